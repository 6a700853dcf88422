"""Models and images from the command line: by name, factory or file, checked with one-line errors."""
from __future__ import annotations

import importlib
import os
import pickle
import sys
import zipfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click
import torch
from torch import Tensor, nn

from relprop import composites
from relprop.cli.app import CommandError
from relprop.methods.targets import model_logits


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


def _efficientnet_lite0() -> nn.Module:
    from relprop.workflows.imagenet import load_efficientnet_lite0

    try:
        return load_efficientnet_lite0()
    except ImportError as error:  # the message names the extra
        raise CommandError(str(error).removeprefix("relprop: ")) from None


#: pretrained models that ship in packages, by name: loaded offline, weights included
NAMED_MODELS = {"efficientnet-lite0": _efficientnet_lite0}
#: the input normalisation each named model expects (``--normalize``'s default for it)
NAMED_NORMALIZATION = {"efficientnet-lite0": "inception"}


def load_model(spec: str, weights: str | None = None, random_weights: bool = False) -> nn.Module:
    """A model by name (:data:`NAMED_MODELS`), from ``module:function``, a ``torch.export`` file (``.pt2``) or a
    torchvision name, in eval mode.

    Raises :class:`CommandError` with a one-line message for anything that is not such a model.
    """
    path = Path(spec)
    if spec in NAMED_MODELS:
        if weights is not None:
            raise CommandError(f"--model {spec} comes with its pretrained weights; --weights does not apply")
        return NAMED_MODELS[spec]()
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


@contextmanager
def shape_advice(inputs: Tensor) -> Iterator[None]:
    """A model's error about the shape of ``inputs`` turned into advice on ``--size`` and ``--channels``."""
    try:
        yield
    except (RuntimeError, AssertionError) as error:  # AssertionError: timm's and torchvision's ViTs check the size
        text = " ".join(str(error).split())
        if isinstance(error, AssertionError) or "shape" in text or "size" in text or "channels" in text:
            raise CommandError(f"the model cannot take images of shape {tuple(inputs.shape[1:])}"
                               f"{f' (it says: {text})' if text else ''}; {_what_to_do(text)}") from None
        raise


def _what_to_do(text: str) -> str:
    """The advice for a model's shape error: the flag and value it names, where its text says one."""
    import re

    channels = re.search(r"to have (\d+) channels", text)
    if channels:
        return f"rerun with --channels {channels.group(1)}"
    size = (re.search(r"(?i)expected (?:an? )?(?:image )?(?:height|width|size)?\D{0,12}?(\d+)\b(?! channels)", text)
            or re.search(r"(?i)match model \((\d+)", text))  # torchvision's ViT; timm's
    if size and int(size.group(1)) > 3:
        return f"rerun with --size {size.group(1)}"
    return ("set --size and --channels to what it expects, e.g. --size 28 --channels 1 for MNIST, --size 224 for "
            "ImageNet models")


def predict(model: nn.Module, inputs: Tensor) -> Tensor:
    """The model's logits for ``inputs``, with a shape error turned into advice on the flags."""
    with shape_advice(inputs), torch.no_grad():
        return model_logits(model(inputs))


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
    """``--normalize``'s mean and std (:data:`relprop.composites.NORMALIZATIONS`), each shaped ``(1, C, 1, 1)``."""
    name = normalize or ("imagenet" if channels == 3 else "none")
    mean, std = composites.NORMALIZATIONS[name]
    if len(mean) not in (1, channels):
        raise CommandError(f"--normalize {name} needs --channels {len(mean)}; use --normalize none")
    return (torch.tensor(mean).expand(channels).reshape(1, channels, 1, 1),
            torch.tensor(std).expand(channels).reshape(1, channels, 1, 1))


def crops(normalize: str | None, channels: int, whole: bool | None) -> bool:
    """Whether images are centre-cropped (``--crop``) or squashed whole (``--whole``): by default, cropped with
    ImageNet's normalisation (torchvision's ImageNet preprocessing), whole without (MNIST digits are whole)."""
    if whole is not None:
        return not whole
    return normalize in ("imagenet", "inception") or normalize is None and channels == 3


def _resized(image: Any, size: int, crop: bool) -> Any:
    """``image`` as the model sees it: squashed to ``size`` x ``size``, or as torchvision's ImageNet transforms,
    ``Resize(round(size * 256 / 224))`` (the short side, bilinear, antialiased) then ``CenterCrop(size)``."""
    from PIL import Image

    if not crop:
        return image.resize((size, size))
    width, height = image.size
    short = round(size * 256 / 224)
    new = (short, int(short * height / width)) if width <= height else (int(short * width / height), short)
    image = image.resize(new, Image.Resampling.BILINEAR)  # PIL's filters are antialiased when they shrink, as torchvision's
    left, top = round((new[0] - size) / 2.0), round((new[1] - size) / 2.0)  # as CenterCrop
    return image.crop((left, top, left + size, top + size))


def load_images(paths: Sequence[str], size: int, normalize: str | None, channels: int,
                whole: bool | None = None) -> tuple[Tensor, Tensor]:
    """Images as ``size`` x ``size`` inputs: the model input and the pixels in [0, 1], each (N, C, H, W).

    ``whole`` squashes each whole image to ``size`` x ``size``; otherwise its short side is resized and its
    centre cropped (:func:`crops` says which is the default).
    """
    import numpy as np

    mean, std = _normalization(normalize, channels)
    crop = crops(normalize, channels, whole)
    pixels = [torch.from_numpy(np.asarray(_resized(_decode(path, channels), size, crop), dtype=np.float32).copy())
              .reshape(size, size, channels).permute(2, 0, 1) / 255.0 for path in paths]
    raw = torch.stack(pixels)
    return (raw - mean) / std, raw


def _composite(preset: str, normalize: str | None, channels: int) -> composites.Composite:
    """The preset, with the ``--smooth-stride`` and ``--func-rule`` options of the running command."""
    ctx = click.get_current_context(silent=True)
    meta = ctx.meta if ctx is not None else {}
    options = {"smooth_stride": meta.get("relprop.smooth_stride", False), "func_map": meta.get("relprop.func_map")}
    if preset == "epsilon-gamma-box":  # its bounds from the preprocessing, as in Python: normalization=
        _normalization(normalize, channels)  # --normalize imagenet with --channels 1 fails here, as it does for images
        options["normalization"] = normalize if normalize is not None else "imagenet" if channels == 3 else "none"
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
