"""LXT's AttnLRP side by side with relprop's, in a process of its own (run by ``bench.py --with lxt``).

    python benchmarks/lxt_child.py NAME HIDDEN LAYERS TOKENS ROUNDS DEVICE DTYPE OUT
    python benchmarks/lxt_child.py generation TOKENS GENERATED ROUNDS OUT   (SmolLM2, see ``generation``)

LXT patches transformers' classes process-wide, so ``bench.py`` runs it here, never in its own process. This
process builds the same model as ``bench.py`` (``transformer_case``) and times, interleaved round by round after
a warm-up: a plain forward + backward to the input embeddings, relprop's AttnLRP, and LXT's (the gradient of
the model under LXT 2.1's ``lxt.efficient`` AttnLRP patches, seeded with 1 at the target, times the input
embeddings, summed per token). The patches are put on for each LXT run and taken off after it, so the other
two run on the model as transformers defines it; ``bench.py`` checks that by comparing the relevance relprop
gives here with the relevance it gives in its own, unpatched process. Writes the medians and both relevances
(float64, on the CPU) to ``OUT`` (``torch.save``).

LXT 2.1's ``lxt.efficient`` package imports its copy of transformers 4.x's BERT code at import time, which
transformers 5.x cannot load, so only its ``rules`` and ``patches`` modules are loaded here, by file. Its model
maps are rebuilt for transformers 5.x: the attention wrapper goes in through ``AttentionInterface`` (under the
model's attention implementation), and BERT's feed-forward and pooler activations get LXT's identity rule as
its BERT code gives them.
"""
from __future__ import annotations

import importlib.util
import sys
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402
from relprop.methods import target_mask  # noqa: E402


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
        if module_spec is None or module_spec.loader is None:
            raise SystemExit(f"lxt_child.py: no lxt/efficient/{name}.py in {folder}")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_spec.name] = module
        module_spec.loader.exec_module(module)
        loaded.append(module)
    return loaded[0], loaded[1]


def lxt_patches(name: str, model: torch.nn.Module) -> list[tuple[Any, str, Any]]:
    """LXT's AttnLRP patches for ``model`` (a Llama, SmolLM2 or BERT of transformers 5.x): (owner, attribute, value)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    rules, patches = load_lxt()
    if name in ("llama", "smollm2"):
        from transformers.models.llama import modeling_llama as modeling
        found = [(modeling.LlamaMLP, "forward", patches.gated_mlp_forward),
                 (modeling.LlamaRMSNorm, "forward", patches.rms_norm_forward)]
    else:
        from transformers.models.bert import modeling_bert as modeling

        def intermediate(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
            return rules.identity_rule_implicit(self.intermediate_act_fn, self.dense(hidden_states))

        def pooler(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
            return rules.identity_rule_implicit(self.activation, self.dense(hidden_states[:, 0]))
        found = [(modeling.BertIntermediate, "forward", intermediate), (modeling.BertPooler, "forward", pooler),
                 (torch.nn.LayerNorm, "forward", patches.layer_norm_forward)]
    implementation = model.config._attn_implementation
    attention = ALL_ATTENTION_FUNCTIONS.get(implementation, modeling.eager_attention_forward)
    return found + [(ALL_ATTENTION_FUNCTIONS._global_mapping, implementation,
                     patches.wrap_attention_forward(attention)),
                    (modeling, "eager_attention_forward", patches.wrap_attention_forward(modeling.eager_attention_forward))]


@contextmanager
def patched(changes: list[tuple[Any, str, Any]]) -> Iterator[None]:
    """The model's classes under ``changes`` inside the block, as they were after it."""
    def swap(owner: Any, attribute: str, value: Any) -> Any:
        if isinstance(owner, dict):
            old, owner[attribute] = owner.get(attribute), value
        else:
            old = owner.__dict__.get(attribute)  # the class's own attribute (None: inherited)
            setattr(owner, attribute, value)
        return old
    originals = [(owner, attribute, swap(owner, attribute, value)) for owner, attribute, value in changes]
    try:
        yield
    finally:
        for owner, attribute, old in reversed(originals):
            if old is None and not isinstance(owner, dict):
                delattr(owner, attribute)
            else:
                swap(owner, attribute, old)


def generation(tokens: int, generated: int, rounds: int, out: str) -> None:
    """SmolLM2: explaining ``generated`` greedy tokens, relprop's ``explain_generation`` against LXT's.

    LXT's: the patched model's forward pass over the sequence and one backward pass per generated token
    (``llm.token_gradients``), beside the same passes of the plain model. Writes the medians and both
    ``(G, T + G - 1)`` relevances.
    """
    import llm
    model, tokenizer = llm.load_smollm2()
    sequence = llm.generated_sequence(model, tokenizer, tokens, generated)
    changes = lxt_patches("smollm2", model)
    runs: dict[str, Callable[[], torch.Tensor]] = dict(llm.generation_runs(model, sequence, tokens))

    def lxt() -> torch.Tensor:
        with patched(changes):
            return llm.token_gradients(model, sequence, tokens)

    runs["lxt"] = lxt
    found: dict[str, Any] = bench.interleaved(runs, rounds, "cpu")
    found.update({"relprop relevance": runs["attnlrp"]().double(), "lxt relevance": lxt().double()})
    torch.save(found, out)


def main() -> None:
    if sys.argv[1] == "generation":
        tokens, generated, rounds, out = sys.argv[2:]
        generation(int(tokens), int(generated), int(rounds), out)
        return
    name, hidden, layers, length, rounds, device, dtype, out = sys.argv[1:]
    model, ids, target, gradient = bench.transformer_case(name, 1, int(length), device, bench.DTYPES[dtype],
                                                          int(hidden), int(layers))
    changes = lxt_patches(name, model)
    lrp = bench.relprop.LRP(model, "attnlrp")

    def relprop() -> torch.Tensor:
        return lrp.attribute(ids, target=target)

    def lxt() -> torch.Tensor:
        with patched(changes):
            embeds = model.get_input_embeddings()(ids).detach().requires_grad_()
            logits = model(inputs_embeds=embeds).logits
            # seed 1 at the target: gradient x input of the patched model already carries the logit's value
            seed = target_mask(logits.detach(), target).to(logits.dtype)
            return (torch.autograd.grad(logits, embeds, seed)[0] * embeds).sum(-1)

    runs: dict[str, Callable[[], object]] = {"gradient": gradient, "relprop": relprop, "lxt": lxt}
    found: dict[str, Any] = bench.interleaved(runs, int(rounds), device)
    found.update({"relprop relevance": relprop().detach().double().cpu(),
                  "lxt relevance": lxt().detach().double().cpu()})
    torch.save(found, out)


if __name__ == "__main__":
    main()
