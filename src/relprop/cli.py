"""The ``relprop`` command line: ``demo``, ``explain``, ``evaluate`` and ``explain-dataset``.

Examples
--------
relprop demo --out out
relprop explain cat.png --model resnet18 --weights resnet18.pth --preset epsilon-plus-flat --out out
relprop explain digit.png --model mymodels:build --size 28 --channels 1
relprop explain --text "The movie was wonderful" --model path/to/hf-model-folder --preset attnlrp
relprop evaluate *.png --model resnet18 --weights resnet18.pth --out out
relprop explain-dataset images/ --model resnet18 --weights resnet18.pth --out shards --downsample 4
torchrun --nproc_per_node=2 -m relprop.cli explain-dataset images/ --model resnet18 --weights resnet18.pth

Every command is a :class:`Command` of the group :data:`app`: an error is one
line on stderr with exit code 2 (a traceback only with ``--debug``), Ctrl-C
ends with one line and exit code 130, keeping what was finished. Another
module adds a command in a few lines, reusing the shared options::

    from relprop.cli import app, image_options, load_images, load_model, model_options, out_option

    @app.command()
    @click.argument("images", nargs=-1, required=True)
    @model_options
    @image_options
    @out_option("atlas")
    def atlas(images, model, weights, random_weights, size, channels, normalize, out):
        \"\"\"One line of help.\"\"\"
        network = load_model(model, weights, random_weights)
        ...
"""
from __future__ import annotations

import importlib
import json
import os
import pickle
import sys
import tempfile
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import click
import torch
from torch import Tensor, nn

from . import LRP, __version__, composites, rules
from .attribution import model_logits, output_relevance

__all__ = ["main", "app", "Command", "CommandError", "load_model", "load_images", "readable_images",
           "model_options", "image_options", "out_option", "preset_option"]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp"}
#: The extra that installs each optional package, for the message when one is missing.
EXTRAS = {"torchvision": "vision", "PIL": "vision", "matplotlib": "vision", "tqdm": "vision", "numpy": "vision",
          "safetensors": "scale", "transformers": "text", "tokenizers": "text", "mlxtend": "demo"}

F = TypeVar("F", bound=Callable[..., Any])


class CommandError(click.ClickException):
    """A problem with the command's input: one line on stderr, exit code 2."""

    exit_code = 2


class Interrupted(click.ClickException):
    """Ctrl-C: one line on stderr, exit code 130."""

    exit_code = 130


def _missing_extra(error: ModuleNotFoundError) -> str:
    package = (error.name or "").split(".")[0]
    if package in EXTRAS:
        return f"this needs the package {package}: pip install 'relprop[{EXTRAS[package]}]'"
    return f"{error} (install the missing package)"


class Command(click.Command):
    """A command whose errors are one line (exit code 2) unless ``--debug`` asks for the traceback."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.params.append(click.Option(["--debug"], is_flag=True, expose_value=False, is_eager=True,
                                        callback=_remember_debug, help="Show the full traceback of an error."))

    def invoke(self, ctx: click.Context) -> Any:
        failure: click.ClickException
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.Abort):
            raise
        except click.ClickException as error:
            failure = error
        except KeyboardInterrupt:
            failure = Interrupted("interrupted; the files finished so far are kept")
        except Exception as error:
            if ctx.meta.get("relprop.debug"):
                raise
            failure = CommandError(_missing_extra(error) if isinstance(error, ModuleNotFoundError) else
                                   f"{type(error).__name__}: {error} (rerun with --debug for the traceback)")
        failure.ctx = getattr(failure, "ctx", None) or ctx  # type: ignore[attr-defined]  # names the command
        raise failure


def _remember_debug(ctx: click.Context, _: click.Parameter, value: bool) -> None:
    ctx.meta["relprop.debug"] = value


class _Group(click.Group):
    command_class = Command


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "show_default": True,
                                             "max_content_width": 110})
@click.version_option(__version__, prog_name="relprop", message="%(prog)s %(version)s")
def app() -> None:
    """Layer-wise relevance propagation for PyTorch models: explain images, evaluate explanations."""


# ---------------------------------------------------------------------------------------------------------------
# Shared options

def _check_cmap(_: click.Context, __: click.Parameter, value: str) -> str:
    from . import viz

    try:
        viz.colormap(value)
    except ValueError as error:
        raise click.BadParameter(str(error)) from None
    return value


def _writable_folder(ctx: click.Context, _: click.Parameter, value: str) -> Path:
    """``--out``, checked writable before any work: its nearest existing folder takes a test file."""
    out = Path(value)
    existing = out
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise click.BadParameter(f"{value}: {existing} is a file, not a folder")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as error:
        raise click.BadParameter(f"{value} is not writable ({existing}: {error.strerror}); choose another folder") \
            from None
    return out


def out_option(default: str = "out") -> Callable[[F], F]:
    """``--out FOLDER``, checked writable before the command starts; the command gets a ``Path``."""
    return click.option("--out", default=default, callback=_writable_folder, metavar="FOLDER",
                        help="Folder for the results (created; checked writable before any work starts).")


def model_options(function: F) -> F:
    """``--model``, ``--weights``, ``--random-weights``: the arguments of :func:`load_model`."""
    options = [
        click.option("--model", required=True, metavar="SPEC",
                     help="A torchvision model name, a torch.export .pt2 file, or module:function returning an "
                          "nn.Module (the module is looked up in the current folder first)."),
        click.option("--weights", type=click.Path(dir_okay=False),
                     help="A state_dict file (torch.save(model.state_dict())) to load into the model."),
        click.option("--random-weights", is_flag=True, help="Allow a torchvision model without --weights."),
    ]
    for option in reversed(options):
        function = option(function)
    return function


def image_options(function: F) -> F:
    """``--size``, ``--channels``, ``--normalize``: the arguments of :func:`load_images`."""
    options = [
        click.option("--size", type=click.IntRange(min=1), default=224,
                     help="Images are resized to SIZE x SIZE pixels (28 for MNIST models)."),
        click.option("--channels", type=click.Choice(["1", "3"]), default="3", callback=lambda c, p, v: int(v),
                     help="1 for grey (MNIST), 3 for colour."),
        click.option("--normalize", type=click.Choice(["imagenet", "none"]), default=None,
                     show_default="imagenet with 3 channels, none with 1",
                     help="Pixel normalisation: ImageNet mean and std, or pixels in [0, 1]."),
    ]
    for option in reversed(options):
        function = option(function)
    return function


#: the rules ``--func-rule`` can name, each with its default parameters
RULES: dict[str, Callable[[], rules.Rule]] = {
    "epsilon": rules.Epsilon, "lrp-0": lambda: rules.Epsilon(0.0), "zplus": rules.ZPlus,
    "alpha2-beta1": lambda: rules.AlphaBeta(2.0, 1.0), "gamma": rules.Gamma, "flat": rules.Flat,
    "wsquare": rules.WSquare, "pass": rules.Pass, "gradient": rules.Gradient, "proportional": rules.Proportional,
    "smooth-stride": rules.SmoothStride, "uniform": rules.UniformProduct, "softmax": rules.Softmax,
}


def preset_option(function: F) -> F:
    """``--preset``, ``--smooth-stride`` and ``--func-rule``: the LRP rules (a composite of :mod:`relprop.composites`).

    The last two are kept in the click context for :func:`_composite`, so a command takes ``preset`` alone.
    """
    options = [
        click.option("--preset", type=click.Choice(list(composites.PRESETS)), default="epsilon-plus-flat",
                     metavar="NAME", help=f"The LRP rules, one of {', '.join(composites.PRESETS)}."),
        click.option("--smooth-stride", is_flag=True, expose_value=False, callback=_remember_smooth_stride,
                     help="Propagate strided convolutions and max pools (ResNet's stem and downsampling layers) as "
                          "their stride-1 form averaged over each stride x stride block: no checkerboard in the "
                          "heatmap."),
        click.option("--func-rule", multiple=True, metavar="FUNCTION=RULE", expose_value=False,
                     callback=_remember_func_rules,
                     help="The rule for every call of a torch function, by name (repeatable), e.g. "
                          f"max_pool2d=proportional; rules: {', '.join(RULES)}."),
    ]
    for option in reversed(options):
        function = option(function)
    return function


def _remember_smooth_stride(ctx: click.Context, _: click.Parameter, value: bool) -> None:
    ctx.meta["relprop.smooth_stride"] = value


def _remember_func_rules(ctx: click.Context, __: click.Parameter, values: tuple[str, ...]) -> None:
    """``--func-rule NAME=RULE``: the torch function of that name (``torch.nn.functional``, ``torch``, ``Tensor``)."""
    func_map = {}
    for value in values:
        name, _, rule = value.partition("=")
        func = next((f for f in (getattr(namespace, name.strip(), None) for namespace in (torch.nn.functional, torch,
                                                                                            torch.Tensor))
                     if callable(f)), None)
        if func is None:
            raise click.BadParameter(f"{value!r}: no torch function named {name.strip()!r} (give NAME=RULE, with a "
                                     "name from torch.nn.functional or torch, e.g. max_pool2d=proportional)")
        if rule.strip() not in RULES:
            raise click.BadParameter(f"{value!r}: unknown rule {rule.strip()!r}; rules: {', '.join(RULES)}")
        try:
            composites.function_name(func, check=True)
        except ValueError as error:
            raise click.BadParameter(f"{value!r}: {str(error).removeprefix('relprop: ')}") from None
        func_map[func] = RULES[rule.strip()]()
    ctx.meta["relprop.func_map"] = func_map


# ---------------------------------------------------------------------------------------------------------------
# Models

def _describe(path: Path) -> str:
    """What a file that is not a state_dict seems to be, for the error message."""
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
        if any("/code/" in name or name.endswith("constants.pkl") for name in names):
            return "a TorchScript model (torch.jit.save)"
        if any(name.endswith("data.pkl") for name in names):
            return "a pickled PyTorch object (torch.save)"
        return "a zip archive"
    head = path.read_bytes()[:512]
    if not head:
        return "an empty file"
    if head[:1] == b"\x80":
        return "a pickle file"
    try:
        head.decode("utf-8")
    except UnicodeDecodeError:
        return "not a PyTorch file"
    return "a text file"


def _load_state_dict(path: str, spec: str) -> dict[str, Tensor]:
    file = Path(path)
    if not file.is_file():
        raise CommandError(f"no such weights file: {path}")
    what = _describe(file)
    if what == "a TorchScript model (torch.jit.save)":
        raise CommandError(f"--weights {path} is {what}, not a state_dict; relprop cannot explain TorchScript: "
                           "save model.state_dict() with torch.save instead")
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as error:  # torch.load raises many types for files that are not state_dicts
        if isinstance(error, pickle.UnpicklingError) and what.startswith("a pickled"):
            raise CommandError(f"--weights {path} holds pickled Python objects (a whole model saved with "
                               "torch.save(model)?), which relprop does not unpickle since that can run code: "
                               "save model.state_dict() instead") from None
        raise CommandError(f"--weights {path} is {what}, not a state_dict saved with torch.save") from None
    if isinstance(state, dict) and not all(isinstance(v, Tensor) for v in state.values()):
        keys = ", ".join(map(str, list(state)[:4]))
        raise CommandError(f"--weights {path} holds a dict with keys {keys}, ... (a training checkpoint?), not a "
                           "state_dict of tensors: save the model's state_dict alone")
    if not isinstance(state, dict):
        raise CommandError(f"--weights {path} holds a {type(state).__name__}, not a state_dict (names -> tensors)")
    return state


def _load_weights(model: nn.Module, path: str, spec: str) -> None:
    state = _load_state_dict(path, spec)
    expected = model.state_dict()
    missing, unexpected = expected.keys() - state.keys(), state.keys() - expected.keys()
    if missing or unexpected:
        raise CommandError(f"weights do not match model {spec}: {len(missing)} missing, {len(unexpected)} "
                           f"unexpected keys (are the weights for another architecture?)")
    reshaped = [key for key in expected if expected[key].shape != state[key].shape]
    if reshaped:
        key = reshaped[0]
        raise CommandError(f"weights do not match model {spec}: {len(reshaped)} tensors of another shape, such as "
                           f"{key}: {tuple(state[key].shape)} in the file, {tuple(expected[key].shape)} in the model")
    model.load_state_dict(state)


def _from_factory(spec: str) -> Any:
    """``module:function``, the module looked up in the current folder first (as ``python -c`` would)."""
    module_name, _, function = spec.partition(":")
    sys.path.insert(0, os.getcwd())
    try:
        try:
            module = importlib.import_module(module_name)
        except ImportError as error:
            raise CommandError(f"cannot load {spec!r}: {error} (looked in the current folder and sys.path)") from None
        if not callable(getattr(module, function, None)):
            raise CommandError(f"cannot load {spec!r}: module {module_name} has no function {function!r}")
        return getattr(module, function)()
    finally:
        sys.path.remove(os.getcwd())


def load_model(spec: str, weights: str | None = None, random_weights: bool = False) -> nn.Module:
    """A model from ``module:function``, a ``torch.export`` file (``.pt2``) or a torchvision name, in eval mode.

    Raises :class:`CommandError` with a one-line message for anything that is not such a model.
    """
    path = Path(spec)
    if ":" in spec and not path.exists():
        model = _from_factory(spec)
    elif path.is_file():
        if path.suffix != ".pt2":
            raise CommandError(f"--model {spec} is {_describe(path)}; relprop takes a torch.export program (.pt2), "
                               "or module:function building the model (with its state_dict as --weights)")
        try:
            model = torch.export.load(path).module()
        except Exception as error:
            raise CommandError(f"--model {spec} is not a torch.export program ({type(error).__name__})") from None
    else:
        try:
            import torchvision
        except ModuleNotFoundError:
            raise CommandError(f"no such model file {spec!r}; torchvision model names need "
                               "pip install 'relprop[vision]'") from None
        if spec not in torchvision.models.list_models():
            raise CommandError(f"unknown model {spec!r}: give a torchvision model name, a .pt2 file from "
                               "torch.export, or module:function returning an nn.Module")
        if weights is None and not random_weights:
            raise CommandError(f"{spec} needs --weights FILE (a state_dict saved with torch.save); pretrained "
                               "weights are not downloaded. --random-weights explains an untrained model.")
        model = torchvision.models.get_model(spec, weights=None)
    if not isinstance(model, nn.Module):
        raise CommandError(f"{spec} did not give a torch.nn.Module but a {type(model).__name__}")
    if weights is not None:
        _load_weights(model, weights, spec)
    # an exported program computes in the mode it was exported in, and its module refuses .eval()
    return model if path.suffix == ".pt2" else model.eval()


def _predict(model: nn.Module, inputs: Tensor, explainer: LRP | None = None) -> Any:
    """The model's output (or ``explainer.record``), with a shape error turned into advice on the flags."""
    try:
        if explainer is not None:
            return explainer.record(inputs)
        with torch.no_grad():
            return model_logits(model(inputs))
    except RuntimeError as error:
        if "shape" in str(error) or "size" in str(error) or "channels" in str(error):
            raise CommandError(f"the model cannot take images of shape {tuple(inputs.shape[1:])} "
                               f"({' '.join(str(error).split())}); set --size and --channels to what it expects, "
                               "e.g. --size 28 --channels 1 for MNIST") from None
        raise


# ---------------------------------------------------------------------------------------------------------------
# Images

def _decode(path: str, channels: int) -> Any:
    """The decoded PIL image, or a one-line reason why not."""
    from PIL import Image

    if not Path(path).is_file():
        raise CommandError(f"no such image: {path}")
    try:
        with Image.open(path) as image:
            return image.convert("L" if channels == 1 else "RGB")
    except Image.UnidentifiedImageError:
        what = "an empty file" if Path(path).stat().st_size == 0 else "not an image file"
        raise CommandError(f"cannot read image {path}: {what}") from None
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as error:
        raise CommandError(f"cannot read image {path}: a truncated or corrupt file ({' '.join(str(error).split())})") \
            from None


def readable_images(paths: Sequence[str], channels: int) -> list[str]:
    """The paths that decode as images, in order, without repeats; a warning line on stderr for each other one.

    Raises :class:`CommandError` if none does.
    """
    readable, problems = [], []
    for path in dict.fromkeys(paths):
        try:
            _decode(path, channels)
            readable.append(path)
        except CommandError as error:
            problems.append(error.message)
    if problems and not readable:
        raise CommandError(problems[0] + (f" (and {len(problems) - 1} more unreadable)" if len(problems) > 1 else ""))
    for problem in problems:
        click.echo(f"relprop: warning: skipping {problem.removeprefix('cannot read image ')}", err=True)
    return readable


def _normalization(normalize: str | None, channels: int) -> tuple[Tensor, Tensor]:
    if normalize == "imagenet" or normalize is None and channels == 3:
        if channels != 3:
            raise CommandError("--normalize imagenet needs --channels 3; use --normalize none")
        return torch.tensor(IMAGENET_MEAN).reshape(1, 3, 1, 1), torch.tensor(IMAGENET_STD).reshape(1, 3, 1, 1)
    return torch.zeros(1, channels, 1, 1), torch.ones(1, channels, 1, 1)


def load_images(paths: Sequence[str], size: int, normalize: str | None, channels: int) -> tuple[Tensor, Tensor]:
    """Images resized to ``size`` x ``size``: the model input and the pixels in [0, 1], each (N, C, H, W)."""
    import numpy as np

    mean, std = _normalization(normalize, channels)
    pixels = [torch.from_numpy(np.asarray(_decode(path, channels).resize((size, size)), dtype=np.float32).copy())
              .reshape(size, size, channels).permute(2, 0, 1) / 255.0 for path in paths]
    raw = torch.stack(pixels)
    return (raw - mean) / std, raw


def _composite(preset: str, normalize: str | None, channels: int) -> composites.Composite:
    """The preset, with the ``--smooth-stride`` and ``--func-rule`` options of the running command."""
    ctx = click.get_current_context(silent=True)
    meta = ctx.meta if ctx is not None else {}
    options = {"smooth_stride": meta.get("relprop.smooth_stride", False), "func_map": meta.get("relprop.func_map")}
    if preset == "epsilon-gamma-box":
        mean, std = _normalization(normalize, channels)
        return composites.EpsilonGammaBox(low=(0 - mean) / std, high=(1 - mean) / std, **options)
    return composites.get(preset, **options)


def _output_names(paths: Sequence[str]) -> list[str]:
    """A distinct output name per image: its path below the images' common folder, without the suffix.

    ``a/x.png`` and ``b/x.png`` become ``a/x`` and ``b/x``; ``x.png`` and ``x.jpg`` keep their suffixes apart.
    """
    resolved = [Path(path).resolve() for path in paths]
    common = Path(os.path.commonpath([path.parent for path in resolved]))
    names = [str(path.relative_to(common).with_suffix("")) for path in resolved]
    return [name if names.count(name) == 1 else f"{name}-{path.suffix.lstrip('.')}"
            for name, path in zip(names, resolved)]


def _write_json(data: Any, path: Path) -> None:
    from .viz import atomic_path

    with atomic_path(path) as temporary:
        temporary.write_text(json.dumps(data, indent=1))


def _bar(total: int, desc: str, unit: str) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit=unit, disable=None)  # only on a terminal


# ---------------------------------------------------------------------------------------------------------------
# Commands

@app.command()
@out_option()
@click.option("--examples", type=click.IntRange(1, 1000), default=8, help="Test digits shown in the heatmap grid.")
@click.option("--evaluated", type=click.IntRange(1, 1000), default=200, help="Test digits used for pixel flipping.")
def demo(out: Path, examples: int, evaluated: int) -> None:
    """Train a small CNN on real MNIST digits, explain it with several methods and evaluate them."""
    from . import demo as demo_module

    demo_module.run(out, examples=examples, evaluated=evaluated)


@app.command()
@click.argument("images", nargs=-1, type=click.Path())
@model_options
@preset_option
@image_options
@out_option()
@click.option("--target", type=click.IntRange(min=0), default=None, show_default="each image's top class",
              help="Class (or, with --text, token id) to explain.")
@click.option("--batch-size", type=click.IntRange(min=1), default=16, help="Images explained together.")
@click.option("--cmap", default="bwr", callback=_check_cmap, help="Colour map: a matplotlib name, or coldnhot.")
@click.option("--clip", type=click.FloatRange(0, 100, min_open=True), default=None, show_default="off",
              help="Scale each heatmap by this percentile of |relevance| (e.g. 99.5) instead of its maximum.")
@click.option("--scale", type=click.IntRange(min=1), default=1, help="Enlarge each heatmap pixel to SCALE x SCALE.")
@click.option("--figure", is_flag=True, help="Also write explain.png: every image and its heatmap, with the "
                                             "predicted class and a colour bar (one row per image).")
@click.option("--strict", is_flag=True, help="Fail on ops without an LRP rule instead of warning.")
@click.option("--text", default=None, help="Explain this text instead of images; --model is then a local Hugging "
                                           "Face model folder (needs pip install 'relprop[text]').")
def explain(images: tuple[str, ...], model: str, weights: str | None, random_weights: bool, preset: str, size: int,
            channels: int, normalize: str | None, out: Path, target: int | None, batch_size: int, cmap: str,
            clip: float | None, scale: int, figure: bool, strict: bool, text: str | None) -> None:
    """Write a relevance heatmap and an overlay per image, and explain.json.

    Output names follow the images' paths below their common folder. An image that
    cannot be read is skipped with a warning (the others are explained); if none
    can be read, nothing is done. Ctrl-C keeps the images finished so far.
    """
    if text is not None:
        return _explain_text(text, model, preset, target, out)
    if not images:
        raise CommandError("give image files, or --text with a Hugging Face model folder as --model")
    from . import viz

    paths = readable_images(images, channels)
    network = load_model(model, weights, random_weights)
    lrp = LRP(network, _composite(preset, normalize, channels), strict=strict)
    names = _output_names(paths)
    summary: list[dict[str, Any]] = []
    shown: list[tuple[Tensor, Tensor]] = []  # pixels and channel-summed relevance, for --figure
    with _bar(len(paths), "explaining", "image") as bar:
        for start in range(0, len(paths), batch_size):
            batch = slice(start, start + batch_size)
            inputs, raw = load_images(paths[batch], size, normalize, channels)
            entries, relevance = _explain_batch(network, lrp, inputs, target)
            for entry, path, name, image, rel in zip(entries, paths[batch], names[batch], raw, relevance):
                files = {kind: out / f"{name}_{kind}.png" for kind in ("relevance", "overlay")}
                entry = {"image": path, **entry, **{kind: str(file) for kind, file in files.items()}}
                bar.write(f"{path}: class {entry['target']} (logit {entry['logit']:.3f}, relevance sum "
                          f"{entry['relevance_sum']:.3f}) -> {files['relevance']}", file=sys.stdout)
                viz.save_image(viz.heatmap(rel, cmap, clip), files["relevance"], scale=scale)
                viz.save_image(viz.overlay(image, rel, cmap, clip), files["overlay"], scale=scale)
                summary.append(entry)
                if figure:
                    shown.append((image, rel.sum(0)))
            _write_json(summary, out / "explain.json")  # after every batch: it lists exactly the finished images
            bar.update(len(relevance))
    if figure:
        title = f"LRP {preset}" + (f", class {target}" if target is not None else "")
        viz.save_heatmap_grid(torch.stack([p for p, _ in shown]), {title: torch.stack([r for _, r in shown])},
                              out / "explain.png", predictions=[e["prediction"] for e in summary], cmap=cmap,
                              clip=clip)


def _explain_batch(network: nn.Module, lrp: LRP, inputs: Tensor, target: int | None) -> tuple[list[dict], Tensor]:
    """One batch explained: per image its target, prediction, logit and relevance sum; and the relevance."""
    explained = _predict(network, inputs, lrp)
    logits = explained.logits.detach()
    chosen = _targets(target, logits)
    (relevance,) = explained.relevance(output_relevance(explained.logits, chosen))
    entries = [{"target": t, "prediction": int(row.argmax()), "logit": row[t].item(), "relevance_sum": r.sum().item()}
               for t, row, r in zip(chosen, logits, relevance)]
    return entries, relevance


def _targets(target: int | None, logits: Tensor) -> list[int]:
    classes = logits.shape[1] if logits.dim() == 2 else 0
    if logits.dim() != 2:
        raise CommandError(f"the model gives outputs of shape {tuple(logits.shape)}; explain needs one score per "
                           "class, (batch, classes)")
    if target is not None and target >= classes:
        raise CommandError(f"--target {target} is out of range: the model has {classes} classes (0 to {classes - 1})")
    return [target] * len(logits) if target is not None else logits.argmax(1).tolist()


def _explain_text(text: str, folder: str, preset: str, target: int | None, out: Path) -> None:
    """A local Hugging Face model folder: relevance per token of ``text``, printed and written as HTML."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    from . import viz

    if not Path(folder).is_dir():
        raise CommandError(f"no such model folder: {folder} (with --text, --model is a Hugging Face model folder)")
    config = AutoConfig.from_pretrained(folder)
    causal = any(name.endswith("ForCausalLM") for name in (config.architectures or []))
    factory = AutoModelForCausalLM if causal else AutoModelForSequenceClassification
    model = factory.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    encoded = tokenizer([text], return_tensors="pt")
    with torch.no_grad():
        logits = model(**encoded).logits
    scores = logits[0, -1] if causal else logits[0]
    if target is not None and target >= len(scores):
        raise CommandError(f"--target {target} is out of range: the model has {len(scores)} "
                           f"{'tokens' if causal else 'classes'} (0 to {len(scores) - 1})")
    chosen = target if target is not None else int(scores.argmax())
    preset = preset if preset in ("attnlrp", "cp-lrp") else "attnlrp"
    relevance = LRP(model, _composite(preset, None, 3)).attribute(
        encoded["input_ids"], target=(-1, chosen) if causal else chosen,
        additional_forward_args={"attention_mask": encoded["attention_mask"]})
    tokens = tokenizer.convert_ids_to_tokens(encoded["input_ids"][0])
    label = tokenizer.decode([chosen]) if causal else (config.id2label or {}).get(chosen, str(chosen))
    click.echo(f"explaining {'next token' if causal else 'class'} {label!r} ({preset}):")
    click.echo(viz.text_terminal(tokens, relevance[0]) if sys.stdout.isatty() else
               " ".join(f"{token}({value:+.3g})" for token, value in zip(tokens, relevance[0].tolist())))
    with viz.atomic_path(out / "text.html") as temporary:
        temporary.write_text(viz.text_html(tokens, relevance[0]))
    _write_json({"tokens": tokens, "relevance": relevance[0].tolist(), "target": chosen, "label": label},
                out / "text.json")
    click.echo(f"-> {out / 'text.html'}")


@app.command()
@click.argument("images", nargs=-1, required=True, type=click.Path())
@model_options
@preset_option
@image_options
@out_option()
@click.option("--steps", type=click.IntRange(min=1), default=50,
              help="Perturbation steps; step k has replaced k/STEPS of the regions.")
@click.option("--region", type=click.IntRange(min=1), default=8, help="Side in pixels of the square regions replaced.")
@click.option("--baseline", default="0.0", callback=lambda c, p, v: _baseline(v),
              help="The value replaced regions take (in the model's normalised input), or uniform (noise).")
def evaluate(images: tuple[str, ...], model: str, weights: str | None, random_weights: bool, preset: str, size: int,
             channels: int, normalize: str | None, out: Path, steps: int, region: int, baseline: float | str) -> None:
    """Pixel-flipping AOPC of LRP against Gradient, Integrated Gradients and a random order.

    Prints the scores, then writes aopc.json and pixel_flipping.png. An image that
    cannot be read is skipped with a warning; if none can be read, nothing is done.
    """
    from . import evaluate as evaluation, methods, viz

    paths = readable_images(images, channels)
    network = load_model(model, weights, random_weights)
    inputs, _ = load_images(paths, size, normalize, channels)
    target = torch.tensor(_targets(None, _predict(network, inputs)))
    explainers: dict[str, Any] = {f"LRP {preset}": LRP(network, _composite(preset, normalize, channels)),
                                  "Gradient": methods.InputGradient(network),
                                  "Integrated Gradients": methods.IntegratedGradients(network)}
    curves = {}
    for name, explainer in [*explainers.items(), ("random", None)]:
        attribution = explainer.attribute(inputs, target=target) if explainer is not None else None
        curves[name] = evaluation.pixel_flipping(network, inputs, attribution, target, steps=steps, region=region,
                                                 baseline=baseline, generator=torch.Generator().manual_seed(0),
                                                 progress=f"pixel flipping: {name}")
    scores = {name: evaluation.aopc(curve).mean().item() for name, curve in curves.items()}
    click.echo(f"AOPC on {len(paths)} image(s), {region}x{region} regions set to {baseline}, most relevant first "
               "(higher is better):")
    for name, score in sorted(scores.items(), key=lambda item: -item[1]):
        click.echo(f"  {name:28s} {score:.4f}")
    _write_json(scores, out / "aopc.json")
    viz.save_pixel_flipping({f"{region}x{region} regions set to {baseline}": curves}, out / "pixel_flipping.png")
    click.echo(f"wrote {out / 'aopc.json'}, {out / 'pixel_flipping.png'}")


def _baseline(value: str) -> float | str:
    if value == "uniform":
        return value
    try:
        return float(value)
    except ValueError:
        raise click.BadParameter(f"{value!r} is neither a number nor uniform") from None


class _ImageFolder(torch.utils.data.Dataset):
    """The images below a folder, sorted by path, prepared like ``explain``'s inputs.

    Items are ``(input, label)`` when the images sit in class subfolders (``FOLDER/CLASS/IMAGE``): a subfolder
    named by an integer is that class; otherwise classes are numbered in the sorted order of the subfolder names,
    as torchvision's ``ImageFolder`` does. Images directly in ``FOLDER`` give items without a label.
    """

    def __init__(self, folder: str, size: int, normalize: str | None, channels: int):
        root = Path(folder)
        if not root.is_dir():
            raise CommandError(f"no such folder: {folder}")
        files = sorted(p for p in root.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
        self.paths = _openable([str(p) for p in files])
        if not self.paths:
            raise CommandError(f"no readable images in {folder}")
        self.labels = _class_labels([Path(p).relative_to(root).parts for p in self.paths])
        self.size, self.normalize, self.channels = size, normalize, channels
        # the preprocessing, for the fingerprint that keeps a resumed run from mixing with another one
        self.transform = {"size": size, "channels": channels, "normalize": normalize}

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> Tensor | tuple[Tensor, int]:
        image = load_images([self.paths[index]], self.size, self.normalize, self.channels)[0][0]
        return image if self.labels is None else (image, self.labels[index])


def _class_labels(parts: list[tuple[str, ...]]) -> list[int] | None:
    """Each image's class from its first subfolder (see :class:`_ImageFolder`); None unless all have one."""
    if any(len(part) == 1 for part in parts):
        return None
    classes = sorted({part[0] for part in parts})
    numbers = {name: int(name) if all(c.isdigit() for c in classes) else index for index, name in enumerate(classes)}
    return [numbers[part[0]] for part in parts]


def _openable(paths: list[str]) -> list[str]:
    """The paths whose header PIL recognises (no decoding: a large folder is checked in seconds)."""
    from PIL import Image

    good = []
    for path in paths:
        try:
            with Image.open(path):
                good.append(path)
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombError):
            click.echo(f"relprop: warning: skipping {path}: not a readable image", err=True)
    return good


def _dataset_target(_: click.Context, __: click.Parameter, value: str) -> int | str:
    if value in ("prediction", "label"):
        return value
    if not value.isdigit():
        raise click.BadParameter(f"{value!r}: give prediction, label or a class index (0 or more)")
    return int(value)


@app.command("explain-dataset")
@click.argument("folder", type=click.Path())
@model_options
@preset_option
@image_options
@out_option("shards")
@click.option("--target", default="prediction", callback=_dataset_target,
              help="prediction (each image's top class), label (its class subfolder: FOLDER/CLASS/IMAGE) or a "
                   "class index.")
@click.option("--batch-size", type=click.IntRange(min=1), default=32, help="Images explained together.")
@click.option("--shard-size", type=click.IntRange(min=1), default=256, help="Images per shard file.")
@click.option("--downsample", type=click.IntRange(min=1), default=1,
              help="Store relevance summed over channels and average-pooled by this factor.")
@click.option("--overwrite", is_flag=True, help="Start afresh instead of resuming a run in --out.")
def explain_dataset_command(folder: str, model: str, weights: str | None, random_weights: bool, preset: str,
                            size: int, channels: int, normalize: str | None, out: Path, target: int | str,
                            batch_size: int, shard_size: int, downsample: int, overwrite: bool) -> None:
    """Explain the images below FOLDER into resumable shards (also under torchrun).

    Images are taken in sorted path order; files.json lists them (sample id = position).
    A file whose header cannot be read is skipped with a warning before the run; an
    image that fails to decode later stops the run with its name (finished shards are
    kept). A rerun into the same --out resumes, skipping finished shards.
    """
    importlib.import_module("safetensors")  # shards need it: fail before any work, naming the extra
    dataset = _ImageFolder(folder, size, normalize, channels)
    if target == "label" and dataset.labels is None:
        raise CommandError(f"--target label needs every image in a class subfolder (FOLDER/CLASS/IMAGE); {folder} "
                           "has images directly in it")
    network = load_model(model, weights, random_weights)
    from .dataset import RunMismatch, explain_dataset
    reduce = None
    if downsample > 1:
        def reduce(relevance: Tensor) -> Tensor:
            return torch.nn.functional.avg_pool2d(relevance.sum(1, keepdim=True), downsample)
    if overwrite:
        (out / "files.json").unlink(missing_ok=True)  # the old run's list must not outlive its shards
    try:
        index = explain_dataset(network, dataset, out, composite=_composite(preset, normalize, channels),
                                batch_size=batch_size, shard_size=shard_size, target=target, reduce=reduce,
                                overwrite=overwrite)
    except RunMismatch as error:
        raise CommandError(f"{str(error).removeprefix('relprop: ')} (on the command line: --overwrite)") from None
    _write_json(dataset.paths, out / "files.json")
    click.echo(f"{len(dataset)} images -> {index}")


@app.command("atlas")
@click.argument("folder", type=click.Path())
@model_options
@preset_option
@image_options
@out_option("atlas")
@click.option("--layer", required=True, help="Module path of the layer whose channels are the concepts.")
@click.option("--mode", type=click.Choice(["relevance", "activation"]), default="relevance", show_default=True,
              help="Reference samples by a channel's relevance (RelMax) or its activation (ActMax).")
@click.option("--top-k", type=click.IntRange(min=1), default=8, show_default=True,
              help="Reference samples kept per channel.")
@click.option("--target", default="prediction", callback=_dataset_target,
              help="prediction (each image's top class), label (its class subfolder) or a class index.")
@click.option("--batch-size", type=click.IntRange(min=1), default=32, show_default=True,
              help="Images explained together.")
@click.option("--overwrite", is_flag=True, help="Start afresh instead of resuming a run in --out.")
def atlas_command(folder: str, model: str, weights: str | None, random_weights: bool, preset: str, size: int,
                  channels: int, normalize: str | None, out: Path, layer: str, mode: str, top_k: int,
                  target: int | str, batch_size: int, overwrite: bool) -> None:
    """A concept atlas of one layer over the images below FOLDER: the top-k images of every channel.

    The reference samples are found resumably in --out/run (the fingerprinted runner of
    explain-dataset); --out/index.html lists the channels by total relevance, each with
    its top images, cropped where the channel acts, and their values.
    """
    importlib.import_module("safetensors")  # the run's shards need it: fail before any work, naming the extra
    dataset = _ImageFolder(folder, size, normalize, channels)
    if target == "label" and dataset.labels is None:
        raise CommandError(f"--target label needs every image in a class subfolder (FOLDER/CLASS/IMAGE); {folder} "
                           "has images directly in it")
    network = load_model(model, weights, random_weights)
    if layer not in dict(network.named_modules()):
        raise CommandError(f"no module {layer!r} in the model; its top-level modules: "
                           f"{', '.join(name for name, _ in network.named_children())}")
    from .atlas import render_atlas
    from .concepts import reference_samples
    from .dataset import RunMismatch
    composite = _composite(preset, normalize, channels)
    try:
        reference_samples(network, dataset, layers=[layer], composite=composite, top_k=top_k, modes=(mode,),
                          target=None if target == "prediction" else target, batch_size=batch_size,
                          out=out / "run", overwrite=overwrite)
    except RunMismatch as error:
        raise CommandError(f"{str(error).removeprefix('relprop: ')} (on the command line: --overwrite)") from None
    index = render_atlas(out / "run", network, dataset, layer, out, mode=mode, composite=composite)
    click.echo(f"{len(dataset)} images -> {index}")


# ---------------------------------------------------------------------------------------------------------------

def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``relprop`` command: returns the exit code."""
    try:
        result = app.main(args=list(argv) if argv is not None else None, prog_name="relprop", standalone_mode=False)
    except click.ClickException as error:
        context = getattr(error, "ctx", None)
        where = context.command_path if context is not None else "relprop"
        hint = f" (see {where} --help)" if isinstance(error, click.UsageError) else ""
        click.echo(f"{where}: error: {' '.join(error.format_message().split())}{hint}", err=True)
        return error.exit_code
    except click.Abort:  # Ctrl-C while click itself was parsing
        click.echo("relprop: interrupted", err=True)
        return 130
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
