"""TransformerLens's ``HookedTransformer`` for patching, and its weights in Hugging Face's GPT-2.

A ``HookedTransformer`` names its tensors by hook points (identity modules):
patching reads and writes them there, so its components are those hook points:

- ``"attn.hook_z"`` (``blocks.i.attn.hook_z``): ``(B, layers, heads)``, as ``"heads"``;
- ``"hook_attn_out"`` (``blocks.i.hook_attn_out``): ``(B, layers, T)``, as ``"attn_out"``;
- ``"hook_mlp_out"`` (``blocks.i.hook_mlp_out``): ``(B, layers, T)``, as ``"mlp_out"``;
- ``"hook_resid_pre"`` (``blocks.i.hook_resid_pre``, and the last block's ``hook_resid_post``):
  ``(B, layers + 1, T)``, as ``"residual"``;
- ``"mlp.hook_post"`` (``blocks.i.mlp.hook_post``): ``(B, layers, d_mlp)``, as ``"neurons"``.

The library itself is not imported here: a model is recognised by its
``blocks`` of hook points and its ``cfg``. :func:`to_gpt2` copies the weights
of a GPT-2-style ``HookedTransformer`` into ``transformers.GPT2LMHeadModel``, so
that both can be explained and compared.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from relprop.workflows.components import Component, Heads, Positions
from relprop.workflows.decoders import Decoder, Site
from relprop.workflows.neurons import Neurons

__all__ = ["HOOK_COMPONENTS", "HOOK_KINDS", "hooked_decoder", "is_hooked", "to_gpt2"]

#: the hook point of each kind of component, as TransformerLens names it within a block
HOOK_COMPONENTS = {"heads": "attn.hook_z", "attn_out": "hook_attn_out", "mlp_out": "hook_mlp_out",
                   "residual": "hook_resid_pre", "neurons": "mlp.hook_post"}


def is_hooked(model: nn.Module) -> bool:
    """Whether ``model`` looks like a TransformerLens ``HookedTransformer``: ``cfg``, ``blocks`` and ``hook_dict``."""
    return (isinstance(getattr(model, "blocks", None), nn.ModuleList) and hasattr(model, "cfg")
            and isinstance(getattr(model, "hook_dict", None), dict))


def hooked_decoder(model: nn.Module) -> Decoder:
    """The sites of a ``HookedTransformer``: its hook points per block (see the module's list)."""
    hooked: Any = model  # its attributes are TransformerLens's
    hooks: dict[str, nn.Module] = hooked.hook_dict
    cfg: Any = hooked.cfg
    blocks = len(hooked.blocks)

    def sites(point: str) -> tuple[Site, ...]:
        names = [f"blocks.{i}.{point}" for i in range(blocks)]
        missing = [name for name in names if name not in hooks]
        if missing:
            raise ValueError(f"relprop: the HookedTransformer has no hook point {missing[0]}")
        return tuple(Site(hooks[name], True, name) for name in names)

    last = f"blocks.{blocks - 1}.hook_resid_post"
    has_mlp = not getattr(cfg, "attn_only", False)
    return Decoder(tuple(hooked.blocks), sites("attn.hook_z"), sites("hook_attn_out"),
                   sites("hook_mlp_out") if has_mlp else (),
                   (*sites("hook_resid_pre"), Site(hooks[last], True, last)), int(cfg.n_heads),
                   sites("mlp.hook_post") if has_mlp else (), int(cfg.d_mlp) if has_mlp else 0)


#: the kinds of component named by TransformerLens's hook points (not in the registry: ``relprop.patching`` looks
#: a name up here first, and keys its results by the hook point's name)
HOOK_KINDS: dict[str, Component] = {
    "attn.hook_z": Heads("attn.hook_z", lambda decoder: decoder.heads, "(B, layers, heads): as \"heads\""),
    "hook_attn_out": Positions("hook_attn_out", lambda decoder: decoder.attentions,
                               "(B, layers, T): as \"attn_out\""),
    "hook_mlp_out": Positions("hook_mlp_out", lambda decoder: decoder.mlps, "(B, layers, T): as \"mlp_out\""),
    "hook_resid_pre": Positions("hook_resid_pre", lambda decoder: decoder.residual,
                                "(B, layers + 1, T): as \"residual\""),
    "mlp.hook_post": Neurons("mlp.hook_post"),
}


def to_gpt2(model: nn.Module) -> nn.Module:
    """The weights of a GPT-2-style ``HookedTransformer`` in ``transformers.GPT2LMHeadModel``, in eval mode.

    The model must have learned positions, LayerNorm, an MLP of ``act_fn`` and no unembedding bias (GPT-2's
    head has none); its weights must not be folded or centred in ways GPT-2 cannot express (build it from a
    ``HookedTransformerConfig`` as it is).
    """
    import transformers

    hooked: Any = model  # its attributes are TransformerLens's
    c: Any = hooked.cfg
    if c.normalization_type != "LN" or c.positional_embedding_type != "standard" or c.gated_mlp or c.attn_only:
        raise ValueError("relprop: to_gpt2 copies a GPT-2-style HookedTransformer: LN, standard positions, a plain "
                         "MLP")
    if bool(hooked.unembed.b_U.ne(0).any()):
        raise ValueError("relprop: the HookedTransformer has an unembedding bias; GPT-2's head has none")
    config = transformers.GPT2Config(
        vocab_size=c.d_vocab, n_positions=c.n_ctx, n_embd=c.d_model, n_layer=c.n_layers, n_head=c.n_heads,
        n_inner=c.d_mlp, activation_function=c.act_fn, layer_norm_epsilon=c.eps, tie_word_embeddings=False,
        attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0)
    gpt2 = transformers.GPT2LMHeadModel(config).to(c.dtype).eval()
    weights = {"transformer.wte.weight": hooked.embed.W_E, "transformer.wpe.weight": hooked.pos_embed.W_pos,
               "transformer.ln_f.weight": hooked.ln_final.w, "transformer.ln_f.bias": hooked.ln_final.b,
               "lm_head.weight": hooked.unembed.W_U.T}
    for i, block in enumerate(hooked.blocks):
        to, attention, mlp = f"transformer.h.{i}.", block.attn, block.mlp
        weights.update({
            to + "ln_1.weight": block.ln1.w, to + "ln_1.bias": block.ln1.b,
            to + "ln_2.weight": block.ln2.w, to + "ln_2.bias": block.ln2.b,
            # (heads, d_model, d_head) -> Conv1D's (d_model, heads * d_head), query, key and value side by side
            to + "attn.c_attn.weight": torch.cat([w.permute(1, 0, 2).reshape(c.d_model, -1)
                                             for w in (attention.W_Q, attention.W_K, attention.W_V)], 1),
            to + "attn.c_attn.bias": torch.cat([b.reshape(-1) for b in (attention.b_Q, attention.b_K, attention.b_V)]),
            to + "attn.c_proj.weight": attention.W_O.reshape(-1, c.d_model), to + "attn.c_proj.bias": attention.b_O,
            to + "mlp.c_fc.weight": mlp.W_in, to + "mlp.c_fc.bias": mlp.b_in,
            to + "mlp.c_proj.weight": mlp.W_out, to + "mlp.c_proj.bias": mlp.b_out})
    gpt2.load_state_dict({name: tensor.detach().clone() for name, tensor in weights.items()}, strict=True)
    return gpt2
