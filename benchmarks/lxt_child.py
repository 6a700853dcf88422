"""LXT's AttnLRP timed in a process of its own (run by ``bench.py --with lxt``; LXT patches transformers process-wide).

    python benchmarks/lxt_child.py NAME HIDDEN LAYERS TOKENS ROUNDS DEVICE DTYPE OUT

Builds the same model as ``bench.py`` (``transformer_case``), times a plain forward + backward to the input
embeddings, then patches the model's classes the way LXT 2.1's ``lxt.efficient`` AttnLRP patches do and times
LXT's attribution (the gradient of the patched model, seeded with 1 at the target, times the input
embeddings, summed per token), both as
medians of ``ROUNDS`` after a warm-up. Writes ``{"gradient": s, "lxt": s, "relevance": tokens}`` to ``OUT``.

LXT 2.1's ``lxt.efficient`` package imports its own copy of transformers 4.x's BERT code at import time, which
transformers 5.x cannot load, so only its ``rules`` and ``patches`` modules are loaded here, by file. Its model
maps are rebuilt for transformers 5.x: the attention wrapper goes in through ``AttentionInterface`` (under the
model's attention implementation), and BERT's feed-forward and pooler activations get LXT's identity rule as
its BERT code gives them.
"""
from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402
from relprop.attribution import target_mask  # noqa: E402


def load_lxt() -> tuple[types.ModuleType, types.ModuleType]:
    """LXT's ``rules`` and ``patches`` modules, loaded by file without ``lxt.efficient``'s package imports."""
    spec = importlib.util.find_spec("lxt")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("lxt_child.py: lxt is not installed in this Python (pip install lxt)")
    folder = Path(spec.submodule_search_locations[0]) / "efficient"
    for package, path in (("lxt", folder.parent), ("lxt.efficient", folder)):
        stub = types.ModuleType(package)
        stub.__path__ = [str(path)]
        sys.modules.setdefault(package, stub)
    loaded = []
    for name in ("rules", "patches"):
        module_spec = importlib.util.spec_from_file_location(f"lxt.efficient.{name}", folder / f"{name}.py")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_spec.name] = module
        module_spec.loader.exec_module(module)
        loaded.append(module)
    return loaded[0], loaded[1]


def patch(name: str, model: torch.nn.Module) -> None:
    """LXT's AttnLRP patches on the classes of ``model`` (a Llama or BERT of transformers 5.x)."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    rules, patches = load_lxt()
    implementation = model.config._attn_implementation
    if name == "llama":
        from transformers.models.llama import modeling_llama as modeling
        modeling.LlamaMLP.forward = patches.gated_mlp_forward
        modeling.LlamaRMSNorm.forward = patches.rms_norm_forward
    else:
        from transformers.models.bert import modeling_bert as modeling

        def intermediate(self, hidden_states):
            return rules.identity_rule_implicit(self.intermediate_act_fn, self.dense(hidden_states))

        def pooler(self, hidden_states):
            return rules.identity_rule_implicit(self.activation, self.dense(hidden_states[:, 0]))
        modeling.BertIntermediate.forward = intermediate
        modeling.BertPooler.forward = pooler
        torch.nn.LayerNorm.forward = patches.layer_norm_forward
    original = ALL_ATTENTION_FUNCTIONS.get(implementation, modeling.eager_attention_forward)
    AttentionInterface.register(implementation, patches.wrap_attention_forward(original))
    modeling.eager_attention_forward = patches.wrap_attention_forward(modeling.eager_attention_forward)


def main() -> None:
    name, hidden, layers, length, rounds, device, dtype, out = sys.argv[1:]
    model, ids, target, gradient = bench.transformer_case(name, 1, int(length), device, bench.DTYPES[dtype],
                                                          int(hidden), int(layers))

    def lxt() -> torch.Tensor:
        embeds = model.get_input_embeddings()(ids).detach().requires_grad_()
        return (gradient_of(embeds) * embeds).sum(-1)

    def gradient_of(embeds: torch.Tensor) -> torch.Tensor:
        logits = model(inputs_embeds=embeds).logits
        # seed 1 at the target: gradient x input of the patched model already carries the logit's value
        seed = target_mask(logits.detach(), target).to(logits.dtype)
        return torch.autograd.grad(logits, embeds, seed)[0]

    found = {"gradient": bench.interleaved({"gradient": gradient}, int(rounds), device)["gradient"]}
    patch(name, model)
    found["lxt"] = bench.interleaved({"lxt": lxt}, int(rounds), device)["lxt"]
    torch.save({**found, "relevance": lxt().detach().double().cpu()}, out)


if __name__ == "__main__":
    main()
