"""Attacks on heatmaps (Dombrowski et al. 2019) on the MNIST CNN: how far a heatmap moves to a target, at what cost.

The demo's CNN (:mod:`relprop.workflows.mnist`, trained on 4000 digits as ``relprop demo`` splits them, seed 0)
explains test digits; each of ``--pairs`` digits gets as its target map the heatmap of the next test digit of
another class, under the same explainer. :func:`relprop.workflows.manipulate.manipulate` then changes the digit
for ``--steps`` Adam steps.
For each explainer (Gradient x Input, and each LRP preset that applies to a CNN) three settings:

- ``relu``: the network itself explained, the attack differentiating through its softplus(``--beta``) copy;
- ``relu, direct``: the same, the attack differentiating through the ReLU network itself;
- ``smoothed``: the defence, the network explained with softplus(``--defence-beta``) for its ReLUs, attacked
  through that network.

It prints one row per explainer and setting: the heatmap's mean squared difference and cosine similarity to the
target before and after (means over the pairs; maps scaled to mean absolute value 1), the input change (L2 and
L-infinity), the output change (the largest change of a softmax probability; the change of the logits relative to
their norm), and the seconds taken::

    OMP_NUM_THREADS=1 python benchmarks/manipulate.py --pairs 8 --steps 300 --figure docs/guide/manipulation/mnist.png

Each LRP preset's heatmap is differentiated with respect to the input by ``LRP.attribute(..., create_graph=True)``.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from relprop.composites import EpsilonGammaBox
from relprop.workflows.manipulate import GRADIENT_X_INPUT, Manipulation, beta_smoothed, explain, heatmap, manipulate
from relprop.workflows.mnist import load_mnist, train

#: the explainers of the table: Gradient x Input, and the presets for convolutional networks (the transformer
#: presets, AttnLRP, CP-LRP and RelP, are LRP-0 or Gamma on this CNN: the same as ``epsilon`` here)
EXPLAINERS: dict[str, Any] = {
    "gradient-x-input": GRADIENT_X_INPUT,
    "epsilon": "epsilon",
    "epsilon-plus": "epsilon-plus",
    "epsilon-plus-flat": "epsilon-plus-flat",
    "epsilon-alpha2-beta1": "epsilon-alpha2-beta1",
    "epsilon-gamma-box": EpsilonGammaBox(low=0.0, high=1.0),
}


def pairs(model: nn.Module, images: Tensor, count: int) -> tuple[Tensor, Tensor]:
    """``count`` test digits and, for each, the index of the next test digit the model puts in another class."""
    with torch.no_grad():
        predicted = model(images).argmax(1)
    sources, targets = [], []
    for index in range(count):
        other = next(j for j in range(index + 1, len(images)) if predicted[j] != predicted[index])
        sources.append(index)
        targets.append(other)
    return torch.tensor(sources), torch.tensor(targets)


def row(name: str, setting: str, found: Manipulation, seconds: float) -> str:
    change = found.input_change
    values = [found.heatmap_mse(False).mean(), found.heatmap_mse().mean(), found.heatmap_cosine(False).mean(),
              found.heatmap_cosine().mean(), change["l2"].mean(), change["linf"].mean(), found.output_change.mean(),
              found.logit_change.mean()]
    return f"| {name} | {setting} | " + " | ".join(f"{float(v):.3f}" for v in values) + f" | {seconds:.0f} |"


def run(arguments: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    images, labels = load_mnist()
    split = torch.randperm(len(images), generator=torch.Generator().manual_seed(0))  # the file is sorted by class
    model = train(images[split[:4000]], labels[split[:4000]], seed=0)
    test_images, test_labels = images[split[4000:]], labels[split[4000:]]
    smoothed = beta_smoothed(model, arguments.defence_beta).eval()
    with torch.no_grad():
        accuracy = {name: (net(test_images).argmax(1) == test_labels).float().mean().item()
                    for name, net in (("relu", model), ("smoothed", smoothed))}
    print(f"test accuracy: ReLU network {accuracy['relu']:.3f}, softplus(beta={arguments.defence_beta}) "
          f"{accuracy['smoothed']:.3f}")
    sources, others = pairs(model, test_images, arguments.pairs)
    x = test_images[sources]
    options = {"steps": arguments.steps, "lr": arguments.lr, "gamma": arguments.gamma,
               "max_change": arguments.max_change}
    settings = [("relu", model, arguments.beta), ("relu, direct", model, None), ("smoothed", smoothed, None)]
    print("| explainer | setting | MSE before | MSE after | cosine before | cosine after | input L2 | input Linf "
          "| softmax change | logit change | seconds |")
    print("|---|---|" + "---|" * 9)
    shown: dict[str, Manipulation] = {}
    for name, composite in EXPLAINERS.items():
        for setting, net, beta in settings:
            start = time.perf_counter()
            wanted = heatmap(explain(net, composite, test_images[others]))
            found = manipulate(net, composite, x, wanted, beta=beta, **options)
            print(row(name, setting, found, time.perf_counter() - start), flush=True)
            if setting != "relu, direct":
                shown[f"{name}, {setting}"] = found
    if arguments.figure is not None:
        figure(shown, arguments.figure)


def figure(shown: dict[str, Manipulation], path: Path) -> None:
    """One row per explainer and setting, for the first pair: the digit, its heatmap, the target map, the
    manipulated digit, its heatmap (red positive, blue negative)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    titles = ["digit", "its heatmap", "target map", "manipulated digit", "its heatmap"]
    grid, axes = plt.subplots(len(shown), 5, figsize=(7.5, 1.6 * len(shown)), squeeze=False)
    for axes_row, (label, found) in zip(axes, shown.items()):
        pictures = [(found.x[0, 0], "gray", 1.0), (found.heatmap[0], "bwr", None), (found.target_map[0], "bwr", None),
                    (found.x_adv[0, 0], "gray", 1.0), (found.heatmap_adv[0], "bwr", None)]
        for axis, (picture, colours, limit) in zip(axes_row, pictures):
            # pixels on [0, 1]; each heatmap on its own symmetric scale, white at 0
            high = float(picture.abs().max()) if limit is None else limit
            axis.imshow(picture.detach().numpy(), cmap=colours, vmin=0.0 if limit else -high, vmax=high)
            axis.set_xticks([])
            axis.set_yticks([])
        axes_row[0].set_ylabel(label, fontsize=7)
    for axis, title in zip(axes[0], titles):
        axis.set_title(title, fontsize=8)
    grid.suptitle("Heatmap manipulation (Dombrowski et al. 2019) on the MNIST CNN, first test digit\n"
                  "per explainer and setting; heatmaps red for the class, blue against, each on its own scale",
                  fontsize=8)
    grid.tight_layout(rect=(0, 0, 1, 1 - 0.45 / grid.get_figheight()))  # room for the title
    path.parent.mkdir(parents=True, exist_ok=True)
    grid.savefig(path, dpi=80)
    print(f"figure: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=8, help="digits attacked (default 8)")
    parser.add_argument("--steps", type=int, default=300, help="Adam steps per attack (default 300)")
    parser.add_argument("--lr", type=float, default=1e-2, help="Adam's learning rate (default 1e-2)")
    parser.add_argument("--gamma", type=float, default=10.0, help="weight of the output term (default 10)")
    parser.add_argument("--max-change", type=float, default=None, help="largest change of a pixel (default: any)")
    parser.add_argument("--beta", type=float, default=10.0, help="the attack's softplus beta (default 10)")
    parser.add_argument("--defence-beta", type=float, default=3.0, help="the defence's softplus beta (default 3)")
    parser.add_argument("--figure", type=Path, default=None, help="save the figure of the first pair here")
    run(parser.parse_args())


if __name__ == "__main__":
    main()
