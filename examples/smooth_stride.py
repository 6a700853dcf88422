"""Checkerboards from ResNet50's strided layers, and the heatmaps without them (``smooth_stride=True``).

A strided layer covers some input pixels with more of its windows than others: ResNet's downsampling shortcut (a
1x1 convolution with stride 2) reads one pixel of every 2x2 block, the stem's 7x7 stride-2 convolution covers a
pixel with 4 windows along a dimension at one parity and 3 at the other, its 3x3 stride-2 max pool with 2 or 1. The
plain rules hand relevance on along those windows, and the heatmap shows a lattice. ``rules.SmoothStride``
propagates each strided convolution and max pool as its stride-1 form followed by the average of each stride x
stride block, which covers every pixel alike. This script explains ResNet50 on the pictures in examples/pictures
both ways and prints the checkerboard share (``relprop.workflows.evaluate.checkerboard``) of the relevance at the outputs of
the stages that the shortcuts read (period 2: every other pixel) and of the input heatmap (period 32, which holds
every lattice of the network's strided layers), then the input heatmap's share under each ResNet-friendly preset,
and draws the heatmaps side by side.

No pretrained weights are available offline: the model is torchvision's ResNet50 with its random initialisation
(seed 0). The checkerboard comes from the architecture (which pixels the strided layers read), not from the weights.

    python examples/smooth_stride.py --out docs/smooth_stride.png
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch
import torchvision
from PIL import Image
from torch import Tensor, nn

import relprop
from relprop.workflows.evaluate import checkerboard
from relprop.viz import save_heatmap_grid

PICTURES = Path(__file__).parent / "pictures"
NAMES = ("astronaut", "chelsea", "coffee", "rocket")
MEAN, STD = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1), torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
PERIOD = 32


def load_pictures(folder: Path = PICTURES, names: tuple[str, ...] = NAMES) -> Tensor:
    """The 224 x 224 pictures as pixels in [0, 1], (N, 3, 224, 224)."""
    return torch.stack([torch.from_numpy(np.asarray(Image.open(folder / f"{name}.jpg").convert("RGB"),
                                                    dtype=np.float32).copy()).permute(2, 0, 1) / 255.0
                        for name in names])


def resnet50(seed: int = 0) -> nn.Module:
    """torchvision's ResNet50, randomly initialised with ``seed`` (no pretrained weights offline)."""
    torch.manual_seed(seed)
    return torchvision.models.resnet50().eval()


#: the stage outputs that the downsampling shortcuts read (of layer2, layer3, layer4), 56, 28 and 14 pixels wide
STAGES = ("layer1", "layer2", "layer3")


#: the presets whose input heatmaps the second table compares (the ResNet-friendly ones)
PRESETS = ("epsilon-plus", "epsilon-plus-flat", "epsilon-alpha2-beta1-flat", "epsilon-gamma-box")


def composite(preset: str, smooth: bool) -> relprop.composites.Composite:
    """The preset, with ``smooth_stride``; epsilon-gamma-box with the bounds of pixels in [0, 1], normalised."""
    bounds = {"low": (0 - MEAN) / STD, "high": (1 - MEAN) / STD} if preset == "epsilon-gamma-box" else {}
    return relprop.composites.get(preset, smooth_stride=smooth, **bounds)


def explain(model: nn.Module, pixels: Tensor, smooth: bool, preset: str = "epsilon-plus-flat",
            stages: tuple[str, ...] = ()) -> tuple[Tensor, list[Tensor]]:
    """Channel-summed relevance of each picture's top class at the input and at the outputs of ``stages``."""
    inputs = (pixels - MEAN) / STD
    with torch.no_grad():
        target = model(inputs).argmax(1)
    rules = composite(preset, smooth)
    found = relprop.LayerLRP(model, list(stages), rules).attribute(inputs, target=target) if stages else []
    return relprop.LRP(model, rules).attribute(inputs, target=target).sum(1), [r.sum(1) for r in found]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="docs/smooth_stride.png", help="where the figure goes")
    parser.add_argument("--preset", default="epsilon-plus-flat", help="the LRP preset (a ResNet-friendly one)")
    args = parser.parse_args()
    pixels, model = load_pictures(), resnet50()
    found = {smooth: explain(model, pixels, smooth, args.preset, STAGES) for smooth in (False, True)}
    print(f"checkerboard share of ResNet50 relevance ({args.preset}, random weights, seed 0), plain -> smooth_stride:\n")
    print("| picture | " + " | ".join(f"{stage} output (period 2)" for stage in STAGES)
          + f" | input heatmap (period {PERIOD}) |")
    print("|---|" + "---:|" * (len(STAGES) + 1))
    shares = {smooth: [checkerboard(stage, 2) for stage in stages] + [checkerboard(heatmap, PERIOD)]
              for smooth, (heatmap, stages) in found.items()}
    rows = [(name, index) for index, name in enumerate(NAMES)] + [("mean", None)]
    for name, index in rows:
        cells = [(before.mean() if index is None else before[index], after.mean() if index is None else after[index])
                 for before, after in zip(shares[False], shares[True])]
        print(f"| {name} | " + " | ".join(f"{before:.3f} -> {after:.3f}" for before, after in cells) + " |")
    print(f"\nmean checkerboard share of the input heatmap (period {PERIOD}) by preset, plain -> smooth_stride:\n")
    print("| preset | input heatmap |\n|---|---:|")
    for preset in PRESETS:
        before, after = (checkerboard(explain(model, pixels, smooth, preset)[0], PERIOD).mean() for smooth in
                         (False, True))
        print(f"| {preset} | {before:.3f} -> {after:.3f} |")
    columns = {"input heatmap": found[False][0], "input heatmap, smooth_stride": found[True][0],
               f"{STAGES[0]} output": found[False][1][0], f"{STAGES[0]} output, smooth_stride": found[True][1][0]}
    path = save_heatmap_grid(pixels, columns, args.out, cmap="bwr", clip=99.5, cell_inches=2.0)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
