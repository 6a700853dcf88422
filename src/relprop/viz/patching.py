"""Pictures of patching (:func:`relprop.patching`): heads and residual stream per method, and circuit curves."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib.pyplot as plt
import torch

from relprop.viz import _save_figure, colormap

__all__ = ["save_circuit_curves", "save_head_maps", "save_residual_maps"]


def _maps(values: Mapping[str, torch.Tensor], path: str | Path, xlabel: str, xticks: Sequence[str] | None,
          width: float, cmap: str, dpi: int) -> Path:
    """One ``(layers, columns)`` map per method side by side, each on its own symmetric scale."""
    if not values:
        raise ValueError("relprop: no values to draw")
    layers = next(iter(values.values())).shape[0]
    figure, axes = plt.subplots(1, len(values), figsize=(width * len(values) + 0.6, max(3.0, 0.14 * layers + 1.4)),
                                layout="constrained", squeeze=False)
    for axis, (name, value) in zip(axes[0], values.items()):
        shown = value.detach().double().cpu()
        if shown.dim() != 2:
            raise ValueError(f"relprop: the values of {name!r} must be (layers, columns), got {tuple(shown.shape)}")
        scale = float(shown.abs().max()) or 1.0
        image = axis.imshow(shown.numpy(), cmap=colormap(cmap), vmin=-scale, vmax=scale, aspect="auto",
                            interpolation="nearest", origin="lower")
        axis.set_title(name, fontsize=9)
        axis.set_xlabel(xlabel, fontsize=8)
        axis.set_ylabel("layer", fontsize=8)
        if xticks is not None:
            axis.set_xticks(range(len(xticks)), [repr(t)[1:-1] for t in xticks], rotation=90, fontsize=6)
        figure.colorbar(image, ax=axis, shrink=0.8)
    return _save_figure(figure, path, dpi)


def save_head_maps(values: Mapping[str, torch.Tensor], path: str | Path, cmap: str = "bwr", dpi: int = 110) -> Path:
    """``layers x heads`` maps of each method's effects (``{"activation": (L, H), "relp": ...}``), side by side.

    Each map has its own symmetric colour scale: red where keeping the head clean moves the metric towards the
    clean run, blue against.
    """
    return _maps(values, path, "head", None, 2.2, cmap, dpi)


def save_residual_maps(values: Mapping[str, torch.Tensor], tokens: Sequence[str], path: str | Path,
                       cmap: str = "bwr", dpi: int = 110) -> Path:
    """``layers + 1 x positions`` maps of the residual stream's effects per method, the tokens on the axis."""
    return _maps(values, path, "position", tokens, max(2.5, 0.22 * len(tokens) + 0.8), cmap, dpi)


def save_circuit_curves(ks: Sequence[int], curves: Mapping[str, torch.Tensor], path: str | Path,
                        dpi: int = 110) -> Path:
    """The fraction of the metric recovered with the top ``k`` heads clean, one curve per ranking."""
    figure, axis = plt.subplots(figsize=(5.0, 3.4), layout="constrained")
    for name, curve in curves.items():
        axis.plot(list(ks), curve.detach().double().cpu().numpy(), marker="o", markersize=3, label=name)
    axis.set_xscale("log", base=2)
    axis.set_xticks(list(ks), [str(k) for k in ks], fontsize=7)
    axis.minorticks_off()
    axis.axhline(1.0, color="grey", linewidth=0.6, linestyle="--")
    axis.set_xlabel("heads kept clean (k, ranked by each method)")
    axis.set_ylabel("fraction of m(clean) - m(corrupted)")
    axis.legend(fontsize=8)
    return _save_figure(figure, path, dpi)
