"""Checkerboards from ResNet50's strided 1x1 shortcuts, and the heatmaps without them (``smooth_stride=True``).

ResNet's downsampling shortcut is a 1x1 convolution with stride 2: it reads one pixel of every 2x2 block, so the
plain rules hand the shortcut's relevance to a quarter of the pixels, and the heatmap shows a lattice.
``rules.SmoothStride`` propagates it as if it read each block's average. This script explains ResNet50 on the
pictures in examples/pictures both ways and prints the checkerboard share (``relprop.evaluate.checkerboard``) of
the relevance at the outputs of the stages that the shortcuts read (period 2: every other pixel) and of the input
heatmap (period 32, which holds every lattice of the network's strided layers), and draws them side by side.

No pretrained weights are available offline: the model is torchvision's ResNet50 with its random initialisation
(seed 0). The checkerboard comes from the architecture (which pixels a shortcut reads), not from the weights.

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
from relprop.evaluate import checkerboard
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


def explain(model: nn.Module, pixels: Tensor, smooth: bool, preset: str = "epsilon-plus-flat"
            ) -> tuple[Tensor, list[Tensor]]:
    """Channel-summed relevance of each picture's top class at the input and at the outputs of :data:`STAGES`."""
    inputs = (pixels - MEAN) / STD
    with torch.no_grad():
        target = model(inputs).argmax(1)
    composite = relprop.composites.get(preset, smooth_stride=smooth)
    stages = relprop.LayerLRP(model, list(STAGES), composite).attribute(inputs, target=target)
    return relprop.LRP(model, composite).attribute(inputs, target=target).sum(1), [r.sum(1) for r in stages]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="docs/smooth_stride.png", help="where the figure goes")
    parser.add_argument("--preset", default="epsilon-plus-flat", help="the LRP preset (a ResNet-friendly one)")
    args = parser.parse_args()
    pixels, model = load_pictures(), resnet50()
    found = {smooth: explain(model, pixels, smooth, args.preset) for smooth in (False, True)}
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
    columns = {"input heatmap": found[False][0], "input heatmap, smooth_stride": found[True][0],
               f"{STAGES[0]} output": found[False][1][0], f"{STAGES[0]} output, smooth_stride": found[True][1][0]}
    path = save_heatmap_grid(pixels, columns, args.out, cmap="bwr", clip=99.5, cell_inches=2.0)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
