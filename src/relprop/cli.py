"""The ``relprop`` command line: ``demo``, ``explain``, ``evaluate`` and ``explain-dataset``.

Examples
--------
relprop demo --out out
relprop explain cat.png --model resnet18 --weights resnet18.pth --preset epsilon-plus-flat --out out
relprop explain digit.png --model mypackage.models:build --size 28 --normalize none
relprop explain --text "The movie was wonderful" --model path/to/hf-model-folder --preset attnlrp
relprop evaluate *.png --model resnet18 --weights resnet18.pth --out out
relprop explain-dataset images/ --model resnet18 --weights resnet18.pth --out shards --downsample 4
torchrun --nproc_per_node=2 -m relprop.cli explain-dataset images/ --model resnet18 --weights resnet18.pth
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

import torch
from torch import nn

from . import LRP, composites

__all__ = ["main", "load_model", "load_images"]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class CommandError(Exception):
    """A problem with the command's arguments or files, shown without a traceback."""


def load_model(spec: str, weights: str | None = None, random_weights: bool = False) -> nn.Module:
    """A model from ``module:function``, a ``torch.export`` file (``.pt2``) or a torchvision name."""
    if ":" in spec:
        module_name, _, function = spec.partition(":")
        try:
            factory = getattr(importlib.import_module(module_name), function)
        except (ImportError, AttributeError) as error:
            raise CommandError(f"cannot load {spec!r}: {error}") from error
        model = factory()
    elif spec.endswith(".pt2"):
        if not Path(spec).is_file():
            raise CommandError(f"no such file: {spec}")
        model = torch.export.load(spec).module()
    elif Path(spec).is_file():
        raise CommandError(f"{spec}: model files must come from torch.export (.pt2). TorchScript runs its ops "
                           "outside Python, where relprop cannot give them rules; export the model with "
                           "torch.export.export and torch.export.save instead")
    else:
        import torchvision

        if spec not in torchvision.models.list_models():
            raise CommandError(f"unknown model {spec!r}: give a torchvision model name, a .pt2 file from "
                               "torch.export, or module:function returning an nn.Module")
        if weights is None and not random_weights:
            raise CommandError(f"{spec} needs --weights FILE (a state_dict saved with torch.save); pretrained "
                               "weights are not downloaded. --random-weights explains an untrained model.")
        model = torchvision.models.get_model(spec, weights=None)
    if weights is not None:
        if not Path(weights).is_file():
            raise CommandError(f"no such weights file: {weights}")
        model.load_state_dict(torch.load(weights, map_location="cpu", weights_only=True))
    if not isinstance(model, nn.Module):
        raise CommandError(f"{spec} did not give a torch.nn.Module but {type(model).__name__}")
    # an exported program computes in the mode it was exported in, and its module refuses .eval()
    return model if spec.endswith(".pt2") else model.eval()


def load_images(paths: list[str], size: int, normalize: str, channels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Images resized to ``size`` x ``size``: the model input and the [0, 1] pixels."""
    from PIL import Image

    pixels = []
    for path in paths:
        if not Path(path).is_file():
            raise CommandError(f"no such image: {path}")
        image = Image.open(path).convert("L" if channels == 1 else "RGB").resize((size, size))
        array = torch.tensor(list(image.getdata()), dtype=torch.float32).reshape(size, size, channels)
        pixels.append(array.permute(2, 0, 1) / 255.0)
    raw = torch.stack(pixels)
    mean, std = _normalization(normalize, channels)
    return (raw - mean) / std, raw


def _normalization(normalize: str, channels: int) -> tuple[torch.Tensor, torch.Tensor]:
    if normalize == "imagenet":
        if channels != 3:
            raise CommandError("--normalize imagenet needs 3 channels")
        return torch.tensor(IMAGENET_MEAN).reshape(1, 3, 1, 1), torch.tensor(IMAGENET_STD).reshape(1, 3, 1, 1)
    return torch.zeros(1, channels, 1, 1), torch.ones(1, channels, 1, 1)


def _composite(args) -> composites.Composite:
    if args.preset == "epsilon-gamma-box":
        mean, std = _normalization(args.normalize, args.channels)
        return composites.EpsilonGammaBox(low=(0 - mean) / std, high=(1 - mean) / std)
    return composites.get(args.preset)


def _explain(args) -> None:
    from . import viz

    if args.text is not None:
        return _explain_text(args)
    if not args.images:
        raise CommandError("give image files, or --text with a Hugging Face model folder as --model")
    model = load_model(args.model, args.weights, args.random_weights)
    inputs, raw = load_images(args.images, args.size, args.normalize, args.channels)
    with torch.no_grad():
        logits = model(inputs)
    target = [args.target] * len(inputs) if args.target is not None else logits.argmax(1).tolist()
    relevance = LRP(model, _composite(args), strict=args.strict).attribute(inputs, target=target)
    out = Path(args.out)
    summary = []
    for path, image, rel, t in zip(args.images, raw, relevance, target):
        stem = Path(path).stem
        viz.save_image(viz.heatmap(rel, args.cmap), out / f"{stem}_relevance.png", scale=args.scale)
        viz.save_image(viz.overlay(image, rel, args.cmap), out / f"{stem}_overlay.png", scale=args.scale)
        summary.append({"image": path, "target": t, "logit": logits[len(summary), t].item(),
                        "relevance_sum": rel.sum().item()})
        print(f"{path}: class {t} (logit {summary[-1]['logit']:.3f}, relevance sum {rel.sum().item():.3f}) "
              f"-> {out / (stem + '_relevance.png')}")
    (out / "explain.json").write_text(json.dumps(summary, indent=2))


def _explain_text(args) -> None:
    """A local Hugging Face model folder: relevance per token of ``--text``, printed and written as HTML."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    from . import viz

    if not Path(args.model).is_dir():
        raise CommandError(f"no such model folder: {args.model}")
    config = AutoConfig.from_pretrained(args.model)
    causal = any(name.endswith("ForCausalLM") for name in (config.architectures or []))
    factory = AutoModelForCausalLM if causal else AutoModelForSequenceClassification
    model = factory.from_pretrained(args.model).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    encoded = tokenizer([args.text], return_tensors="pt")
    with torch.no_grad():
        logits = model(**encoded).logits
    scores = logits[0, -1] if causal else logits[0]
    chosen = args.target if args.target is not None else int(scores.argmax())
    target = (-1, chosen) if causal else chosen
    preset = args.preset if args.preset in ("attnlrp", "cp-lrp") else "attnlrp"
    relevance = LRP(model, preset).attribute(encoded["input_ids"], target=target,
                                             additional_forward_args={"attention_mask": encoded["attention_mask"]})
    tokens = tokenizer.convert_ids_to_tokens(encoded["input_ids"][0])
    label = tokenizer.decode([chosen]) if causal else (config.id2label or {}).get(chosen, str(chosen))
    print(f"explaining {'next token' if causal else 'class'} {label!r} ({preset}):")
    print(viz.text_terminal(tokens, relevance[0]))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "text.html").write_text(viz.text_html(tokens, relevance[0]))
    (out / "text.json").write_text(json.dumps({"tokens": tokens, "relevance": relevance[0].tolist(),
                                               "target": chosen, "label": label}, indent=1))
    print(f"-> {out / 'text.html'}")


def _evaluate(args) -> None:
    from . import evaluate, methods

    model = load_model(args.model, args.weights, args.random_weights)
    inputs, _ = load_images(args.images, args.size, args.normalize, args.channels)
    with torch.no_grad():
        target = model(inputs).argmax(1)
    explainers = {args.preset: LRP(model, _composite(args)), "gradient": methods.Gradient(model),
                  "integrated-gradients": methods.IntegratedGradients(model)}
    scores = {}
    for name, explainer in explainers.items():
        curve = evaluate.pixel_flipping(model, inputs, explainer.attribute(inputs, target=target), target,
                                        steps=args.steps, region=args.region, baseline=args.baseline,
                                        progress=True)
        scores[name] = evaluate.aopc(curve).mean().item()
    curve = evaluate.pixel_flipping(model, inputs, None, target, steps=args.steps, region=args.region,
                                    baseline=args.baseline, generator=torch.Generator().manual_seed(0))
    scores["random"] = evaluate.aopc(curve).mean().item()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "aopc.json").write_text(json.dumps(scores, indent=2))
    for name, score in sorted(scores.items(), key=lambda item: -item[1]):
        print(f"{name:24s} AOPC {score:.4f}")


class _ImageFiles(torch.utils.data.Dataset):
    """The images of a folder, sorted by name, prepared like ``explain``'s inputs."""

    SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp"}

    def __init__(self, folder: str, size: int, normalize: str, channels: int):
        if not Path(folder).is_dir():
            raise CommandError(f"no such folder: {folder}")
        self.paths = sorted(str(p) for p in Path(folder).iterdir() if p.suffix.lower() in self.SUFFIXES)
        if not self.paths:
            raise CommandError(f"no images in {folder}")
        self.size, self.normalize, self.channels = size, normalize, channels

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> torch.Tensor:
        return load_images([self.paths[index]], self.size, self.normalize, self.channels)[0][0]


def _explain_dataset(args) -> None:
    from .dataset import explain_dataset

    model = load_model(args.model, args.weights, args.random_weights)
    dataset = _ImageFiles(args.folder, args.size, args.normalize, args.channels)
    reduce = None
    if args.downsample > 1:
        def reduce(relevance):
            return torch.nn.functional.avg_pool2d(relevance.sum(1, keepdim=True), args.downsample)
    index = explain_dataset(model, dataset, args.out, composite=_composite(args), batch_size=args.batch_size,
                            shard_size=args.shard_size, target=args.target, reduce=reduce)
    (Path(args.out) / "files.json").write_text(json.dumps(dataset.paths, indent=1))
    print(f"explained {len(dataset)} images -> {index}")


def _demo(args) -> None:
    from . import demo

    demo.run(args.out, examples=args.examples, evaluated=args.evaluated)


def _dataset_target(value: str) -> int | str:
    return value if value == "prediction" else int(value)


def _baseline(value: str) -> float | str:
    return value if value == "uniform" else float(value)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="relprop", description="Layer-wise relevance propagation for PyTorch.")
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser("demo", help="train a CNN on real MNIST digits, explain and evaluate it")
    demo.add_argument("--out", default="out")
    demo.add_argument("--examples", type=int, default=8, help="digits shown in the heatmap grid")
    demo.add_argument("--evaluated", type=int, default=200, help="digits used for pixel flipping")
    demo.set_defaults(run=_demo)

    for name, run, help_text in (("explain", _explain, "write relevance heatmaps for images"),
                                 ("evaluate", _evaluate, "pixel-flipping AOPC of LRP against baselines"),
                                 ("explain-dataset", _explain_dataset,
                                  "explain a folder of images into resumable shards (works under torchrun)")):
        command = commands.add_parser(name, help=help_text)
        if name == "explain-dataset":
            command.add_argument("folder")
        else:
            command.add_argument("images", nargs="*" if name == "explain" else "+")
        command.add_argument("--model", required=True,
                             help="torchvision model name, a torch.export .pt2 file, module:function, "
                                  "or (with --text) a Hugging Face model folder")
        command.add_argument("--weights", help="state_dict file for a torchvision model")
        command.add_argument("--random-weights", action="store_true", help="allow a torchvision model untrained")
        command.add_argument("--preset", default="epsilon-plus-flat", choices=list(composites.PRESETS))
        command.add_argument("--size", type=int, default=224)
        command.add_argument("--channels", type=int, default=3, choices=(1, 3))
        command.add_argument("--normalize", default="imagenet", choices=("imagenet", "none"))
        command.add_argument("--out", default="out")
        if name == "explain-dataset":
            command.add_argument("--batch-size", type=int, default=32)
            command.add_argument("--shard-size", type=int, default=256)
            command.add_argument("--target", type=_dataset_target, default="prediction",
                                 help="a class index, or prediction (each image's top class, the default)")
            command.add_argument("--downsample", type=int, default=1,
                                 help="store relevance summed over channels and average-pooled by this factor")
        elif name == "explain":
            command.add_argument("--target", type=int, help="class or token to explain (default: the top one)")
            command.add_argument("--text", help="explain this text with --model, a local Hugging Face model folder")
            command.add_argument("--cmap", default="bwr", help="matplotlib colour map or coldnhot")
            command.add_argument("--scale", type=int, default=1, help="enlarge each heatmap pixel")
            command.add_argument("--strict", action="store_true", help="fail on ops without a rule")
        else:
            command.add_argument("--steps", type=int, default=50)
            command.add_argument("--region", type=int, default=8)
            command.add_argument("--baseline", type=_baseline, default=0.0, help="a value, or uniform")
        command.set_defaults(run=run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``relprop`` command."""
    args = _parser().parse_args(argv)
    try:
        args.run(args)
    except (CommandError, ModuleNotFoundError) as error:
        print(f"relprop {args.command}: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
