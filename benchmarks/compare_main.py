"""Bitwise comparison of relevance between two checkouts of relprop (a refactoring must change no number).

``save`` computes the relevance of every preset on ResNet18, VGG11, MobileNetV3-small, DenseNet121 and
torchvision's ViT-B/16 (random weights, fixed seed, a classifier that starts at zero drawn at random too, a
batch of 2 images of 224 x 224 pixels) and on the tiny Llama and BERT configs of ``tests/test_transformers.py``
(eager and SDPA attention, float64), with whichever ``relprop`` Python imports, and writes them to a file.
The presets that carry relevance per unit of activation (AttnLRP, CP-LRP) are explained three times by one
explainer and the third relevance is kept: on a checkout with captured plans, that pass follows the plan
recorded by the second (where the model's ops allow one), so the comparison covers the replay too.
``compare`` reads two such files and prints, per model and preset, whether the relevance is bitwise equal
(``torch.equal``); it exits with status 1 if any differs. One thread, so that the kernels sum in the same order
in both runs::

    PYTHONPATH=/path/to/old/src python benchmarks/compare_main.py save old.pt
    PYTHONPATH=src python benchmarks/compare_main.py save new.pt
    python benchmarks/compare_main.py compare old.pt new.pt
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves

PRESETS = ["epsilon", "epsilon-plus", "epsilon-plus-flat", "epsilon-alpha2-beta1", "epsilon-alpha2-beta1-flat",
           "epsilon-gamma-box", "attnlrp", "cp-lrp"]
VISION = ["resnet18", "vgg11", "mobilenet_v3_small", "densenet121", "vit_b_16"]
#: the tiny configs of tests/test_transformers.py
TEXT_COMMON = dict(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, intermediate_size=32)
TEXT = ["llama-eager", "llama-sdpa", "bert-eager", "bert-sdpa"]
#: attributions per explainer, the last one kept: a captured plan's replay (see the module's docstring)
REPEATED = {"attnlrp": 3, "cp-lrp": 3}


def _composite(preset: str) -> object:
    import relprop

    if preset == "epsilon-gamma-box":  # the input bounds of standardised images
        return relprop.composites.EpsilonGammaBox(low=-3.0, high=3.0)
    return preset


def _vision(name: str) -> tuple[nn.Module, Tensor, Tensor]:
    import torchvision

    torch.manual_seed(0)
    model = getattr(torchvision.models, name)(weights=None).eval()
    for module in model.modules():  # ViT's head starts at zero: every logit, and every relevance, would be 0
        if isinstance(module, nn.Linear) and not module.weight.any():
            nn.init.normal_(module.weight, std=0.02)
    images = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(1))
    return model, images, torch.tensor([3, 7])


def _text(name: str) -> tuple[nn.Module, Tensor, object]:
    import transformers as T

    family, attention = name.split("-")
    if family == "llama":
        config, cls, target = T.LlamaConfig(**TEXT_COMMON, num_key_value_heads=2), T.LlamaForCausalLM, (-1, 5)
    else:
        config, cls, target = T.BertConfig(**TEXT_COMMON), T.BertForSequenceClassification, 1
    config._attn_implementation = attention
    torch.manual_seed(0)
    model = cls(config).double().eval()
    ids = torch.randint(3, 50, (2, 7), generator=torch.Generator().manual_seed(1))
    return model, ids, target


def save(path: str, only: list[str] | None) -> None:
    """Relevance of every (model, preset) pair, as a flat list of tensors per pair, saved to ``path``."""
    import relprop

    torch.set_num_threads(1)
    results: dict[str, list[Tensor]] = {}
    builders: list[tuple[str, Callable[[str], tuple[nn.Module, Tensor, object]]]] = [
        *((name, _vision) for name in VISION), *((name, _text) for name in TEXT)]
    for name, build in builders:
        if only and name not in only:
            continue
        model, inputs, target = build(name)
        for preset in PRESETS:
            lrp = relprop.LRP(model, _composite(preset))
            for _ in range(REPEATED.get(preset, 1)):
                relevance = lrp.attribute(inputs, target=target)
            results[f"{name} {preset}"] = [t.detach().clone() for t in tree_leaves(relevance)
                                            if isinstance(t, Tensor)]
            print(f"{name:20s} {preset:28s} done", flush=True)
    torch.save(results, path)


def _difference(old: list[Tensor], new: list[Tensor]) -> float:
    """The largest absolute difference of two runs' relevances, relative to the largest absolute relevance."""
    return max(float((x.double() - y.double()).abs().max() / x.double().abs().max().clamp(min=1e-300))
               for x, y in zip(old, new))


def compare(old_path: str, new_path: str) -> int:
    """Print a table of bitwise equality per (model, preset), with the relative difference of a pair that differs
    (:func:`_difference`); 1 if any pair differs or is missing, else 0."""
    old, new = torch.load(old_path), torch.load(new_path)
    failures = 0
    print(f"| model | {' | '.join(PRESETS)} |")
    print(f"|---|{'---|' * len(PRESETS)}")
    models = dict.fromkeys(key.split(" ")[0] for key in (*old, *new))
    for model in models:
        cells = []
        for preset in PRESETS:
            key = f"{model} {preset}"
            a, b = old.get(key), new.get(key)
            comparable = (a is not None and b is not None and len(a) == len(b)
                          and all(x.shape == y.shape and x.dtype == y.dtype for x, y in zip(a, b)))
            equal = comparable and all(torch.equal(x, y) for x, y in zip(a, b))
            failures += not equal
            cells.append("equal" if equal else f"DIFFERS ({_difference(a, b):.1e})" if comparable else
                         "missing" if a is None or b is None else "DIFFERS (shape or dtype)")
        print(f"| {model} | {' | '.join(cells)} |")
    print(f"{failures} of {len(models) * len(PRESETS)} pairs differ or are missing")
    return 1 if failures else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    saving = commands.add_parser("save", help="compute the relevance with the relprop Python imports")
    saving.add_argument("path")
    saving.add_argument("--only", nargs="*", help=f"models to run (default all: {' '.join(VISION + TEXT)})")
    comparing = commands.add_parser("compare", help="compare two saved files bitwise")
    comparing.add_argument("old")
    comparing.add_argument("new")
    args = parser.parse_args()
    if args.command == "save":
        save(args.path, args.only)
        return 0
    return compare(args.old, args.new)


if __name__ == "__main__":
    sys.exit(main())
