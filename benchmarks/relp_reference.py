"""The fixture of tests/test_relp_reference.py: RelP's reference implementation on tiny GPT-2 and Llama models.

The reference is the TransformerLens fork of Jafari et al. 2025 (github.com/FarnoushRJ/RelP, folder
``TransformerLens``). It needs its own environment, apart from relprop's::

    python -m venv relp-ref-venv
    relp-ref-venv/bin/pip install torch==2.13.0 transformers==4.41.2 "numpy<2" "datasets<4" "pyarrow<20" wandb \\
        einops fancy-einsum jaxtyping "beartype<0.15" better-abc pandas rich sentencepiece typeguard accelerate
    git clone https://github.com/FarnoushRJ/RelP
    PYTHONPATH=RelP/TransformerLens relp-ref-venv/bin/python benchmarks/relp_reference.py tests/data/relp_reference.pt

For each model (a GPT-2 and a Llama with grouped-query heads, random float64 weights of a size at which the
nonlinearities matter) it builds the Hugging Face model, converts its weights with TransformerLens's own
converters (no folding or centring, so every activation is the Hugging Face model's), and computes per
(layer, position) estimates of the residual stream entering each layer, each attention output and each MLP
output, ``sum_d (a_clean - a_corrupted) * c`` with ``c`` read at the corrupted run:

- ``attribution``: the plain gradient (``use_lrp = False``);
- ``relp``: RelP's default rules (``LN-rule``, ``Identity-rule``, ``Half-rule``);
- ``relp-ah``: the same with the ``AH-rule`` (attention weights held).

The metric is ``logit[answer] - logit[foil]`` at the last position. Hugging Face's Llama RMSNorm computes in
float32 whatever the model's dtype; both sides compute it in float64 instead (the same formula). Its rotary
angles are float32 values; TransformerLens takes them from the Hugging Face model. The file keeps the Hugging Face config's
arguments, its state dict, the prompts and the estimates: relprop's test rebuilds the model from them.
"""
from __future__ import annotations

import sys

import torch
import transformers
from transformer_lens import HookedTransformer, HookedTransformerConfig
from transformer_lens.pretrained.weight_conversions import convert_gpt2_weights, convert_llama_weights

RULES = {"attribution": None, "relp": ["LN-rule", "Identity-rule", "Half-rule"],
         "relp-ah": ["LN-rule", "Identity-rule", "Half-rule", "AH-rule"]}
HOOKS = ("hook_resid_pre", "hook_attn_out", "hook_mlp_out")
ANSWER, FOIL = 3, 5

GPT2 = {"vocab_size": 40, "n_embd": 16, "n_layer": 2, "n_head": 4, "n_positions": 16}
LLAMA = {"vocab_size": 40, "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 32}


def _rms_norm(self: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """Hugging Face's Llama RMSNorm in the input's dtype: it computes in float32, which would cap the check at
    float32 rounding. relprop's test makes the same change."""
    return self.weight * (hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def _share_rotary(hf: torch.nn.Module, model: HookedTransformer) -> None:
    """TransformerLens's rotary angles computed as Hugging Face computes them (in float32, then widened): it
    computes them in float64, which would cap the check at float32 rounding."""
    rotary = getattr(hf.model, "rotary_emb", None) or hf.model.layers[0].self_attn.rotary_emb
    positions = torch.arange(model.cfg.n_ctx)[None]
    cos, sin = rotary(torch.zeros(1, dtype=torch.float64), positions)
    for block in model.blocks:
        block.attn.rotary_cos.copy_(cos[0])
        block.attn.rotary_sin.copy_(sin[0])


def _randomised(model: torch.nn.Module) -> torch.nn.Module:
    """Weights of size 0.3 (norm scales near 1): attention and activations far from linear."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator, dtype=torch.float64)
            parameter.copy_(1 + 0.1 * noise if "ln" in name or "norm" in name else 0.3 * noise)
    return model.eval()


def _config(kind: str, hf: transformers.PretrainedConfig, rules: list[str] | None) -> HookedTransformerConfig:
    if kind == "gpt2":
        shape = {"d_model": hf.n_embd, "d_head": hf.n_embd // hf.n_head, "n_heads": hf.n_head,
                 "d_mlp": 4 * hf.n_embd, "n_layers": hf.n_layer, "n_ctx": hf.n_positions,
                 "eps": hf.layer_norm_epsilon, "d_vocab": hf.vocab_size, "act_fn": hf.activation_function,
                 "normalization_type": "LN", "original_architecture": "GPT2LMHeadModel"}
    else:
        shape = {"d_model": hf.hidden_size, "d_head": hf.hidden_size // hf.num_attention_heads,
                 "n_heads": hf.num_attention_heads, "d_mlp": hf.intermediate_size, "n_layers": hf.num_hidden_layers,
                 "n_ctx": hf.max_position_embeddings, "eps": hf.rms_norm_eps, "d_vocab": hf.vocab_size,
                 "act_fn": hf.hidden_act, "n_key_value_heads": hf.num_key_value_heads, "normalization_type": "RMS",
                 "positional_embedding_type": "rotary", "rotary_adjacent_pairs": False,
                 "rotary_dim": hf.hidden_size // hf.num_attention_heads, "rotary_base": hf.rope_theta,
                 "final_rms": True, "gated_mlp": True, "original_architecture": "LlamaForCausalLM"}
    config = HookedTransformerConfig(**shape, dtype=torch.float64, device="cpu")
    config.use_lrp = rules is not None
    config.LRP_rules = list(rules or [])
    return config


def _estimates(model: HookedTransformer, clean: torch.Tensor, corrupted: torch.Tensor) -> dict[str, torch.Tensor]:
    """``(B, layers, T)`` per hook: ``sum_d (a_clean - a_corrupted) * dm/da`` at the corrupted run."""
    wanted = lambda name: name.endswith(HOOKS)  # noqa: E731
    _, clean_cache = model.run_with_cache(clean, names_filter=wanted)
    kept, grads = {}, {}

    def keep(tensor: torch.Tensor, hook) -> None:
        kept[hook.name] = tensor.detach()

    def keep_grad(tensor: torch.Tensor, hook) -> None:
        grads[hook.name] = tensor.detach()

    model.reset_hooks()
    model.add_hook(wanted, keep, "fwd")
    model.add_hook(wanted, keep_grad, "bwd")
    logits = model(corrupted)
    (logits[:, -1, ANSWER] - logits[:, -1, FOIL]).sum().backward()
    model.reset_hooks()
    found = {}
    for hook in HOOKS:
        names = [f"blocks.{layer}.{hook}" for layer in range(model.cfg.n_layers)]
        found[hook] = torch.stack([((clean_cache[n] - kept[n]) * grads[n]).sum(-1) for n in names], 1)
    return found


def main(path: str) -> None:
    transformers.models.llama.modeling_llama.LlamaRMSNorm.forward = _rms_norm
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    clean = torch.randint(0, 40, (2, 6), generator=generator)
    corrupted = clean.clone()
    corrupted[:, 1] = (corrupted[:, 1] + 7) % 40
    corrupted[:, 3] = (corrupted[:, 3] + 11) % 40
    fixture = {"clean": clean, "corrupted": corrupted, "answer": ANSWER, "foil": FOIL, "models": {}}
    for kind, arguments in (("gpt2", GPT2), ("llama", LLAMA)):
        if kind == "gpt2":
            hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(**arguments)).double()
            convert = convert_gpt2_weights
        else:
            hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**arguments)).double()
            convert = convert_llama_weights
        hf = _randomised(hf)
        estimates = {}
        for name, rules in RULES.items():
            config = _config(kind, hf.config, rules)
            model = HookedTransformer(config)
            model.load_and_process_state_dict(convert(hf, config), fold_ln=False, center_writing_weights=False,
                                              center_unembed=False, fold_value_biases=False,
                                              refactor_factored_attn_matrices=False)
            if kind == "llama":
                _share_rotary(hf, model)
            with torch.no_grad():  # the converted model is the Hugging Face model (whose Llama returns float32
                # logits: its last hidden state through its head instead)
                hidden = hf(clean, output_hidden_states=True).hidden_states[-1]
                gap = (model(clean) - hf.lm_head(hidden)).abs().max().item()
            if gap > 1e-10:
                raise SystemExit(f"{kind}: TransformerLens and Hugging Face logits differ by {gap:.3g}")
            estimates[name] = _estimates(model, clean, corrupted)
        fixture["models"][kind] = {"config": arguments, "state_dict": {k: v.detach().clone() for k, v in
                                                                       hf.state_dict().items()},
                                   "estimates": estimates}
        print(f"{kind}: " + ", ".join(f"{name} {hook} max {value.abs().max().item():.3g}"
                                      for name, found in estimates.items() for hook, value in found.items()))
    torch.save(fixture, path)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tests/data/relp_reference.pt")
