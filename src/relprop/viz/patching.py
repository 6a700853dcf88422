"""Pictures of patching (:func:`relprop.patching`): heads and residual stream per method, and circuit curves.

Each picture reads alone: a title (what was patched, on which model, for which metric), axis labels, a
labelled colour bar, and tick labels that do not overlap.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib.pyplot as plt
import torch

from relprop.viz import _save_figure, _wrap, colormap

__all__ = ["save_circuit_curves", "save_head_maps", "save_residual_maps"]

#: what the colour bars of the maps measure, unless the caller names the metric
EFFECT = "effect on the metric"
#: every row and column gets its own tick label up to this many (more would be illegible)
ALL_TICKS = 40


def _maps(values: Mapping[str, torch.Tensor], path: str | Path, xlabel: str, ylabel: str,
          xticks: Sequence[str] | None, width: float, cmap: str, dpi: int, title: str | None, label: str) -> Path:
    """One ``(layers, columns)`` map per method side by side, each on its own symmetric scale."""
    if not values:
        raise ValueError("relprop: no values to draw")
    layers = next(iter(values.values())).shape[0]
    height = max(3.0, 0.16 * layers + 1.8)
    figure, axes = plt.subplots(1, len(values), figsize=(width * len(values) + 0.6, height),
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
        axis.set_ylabel(ylabel, fontsize=8)
        rows, columns = shown.shape
        if rows <= ALL_TICKS:
            axis.set_yticks(range(rows), [str(row) for row in range(rows)], fontsize=7)
        if xticks is not None:
            axis.set_xticks(range(len(xticks)), [repr(t)[1:-1] for t in xticks], rotation=90, fontsize=8)
        elif columns <= ALL_TICKS:
            axis.set_xticks(range(columns), [str(column) for column in range(columns)], fontsize=7)
        bar = figure.colorbar(image, ax=axis, shrink=0.8)
        # along the bar, which is about 0.8 of the axes' height: wrapped to that, it stays on the canvas
        bar.set_label(_wrap(label, 0.6 * height, 8), fontsize=8)
    if title:
        figure.suptitle(_wrap(title, width * len(values) + 0.4, 10), fontsize=10)
    return _save_figure(figure, path, dpi)


def save_head_maps(values: Mapping[str, torch.Tensor], path: str | Path, cmap: str = "bwr", dpi: int = 110,
                   title: str | None = None, label: str = EFFECT) -> Path:
    """``layers x heads`` maps of each method's effects (``{"activation": (L, H), "relp": ...}``), side by side.

    Each map has its own symmetric colour scale: red where keeping the head clean moves the metric towards the
    clean run, blue against. ``title`` goes above the maps (what was patched: model, metric), ``label`` along
    each colour bar (what its unit is).
    """
    return _maps(values, path, "head", "layer", None, 2.6, cmap, dpi, title, label)


def save_residual_maps(values: Mapping[str, torch.Tensor], tokens: Sequence[str], path: str | Path,
                       cmap: str = "bwr", dpi: int = 110, title: str | None = None, label: str = EFFECT,
                       rows: str = "residual stream entering layer\n(the last row: leaving the last)") -> Path:
    """``layers + 1 x positions`` maps of the residual stream's effects per method, the tokens on the axis.

    Row ``l`` is the hidden state entering layer ``l``; the last row, the one leaving the last layer. Any kind
    with one unit per layer and position draws alike (``"attn_out"``, ``"mlp_out"``), ``rows`` naming its rows.
    """
    return _maps(values, path, "position (token)", rows, tokens, max(2.8, 0.3 * len(tokens) + 1.2), cmap, dpi,
                 title, label)


def _spread_ticks(ks: Sequence[int], apart: float = 0.5) -> list[int]:
    """The ``ks`` to label on a log2 axis: the last always, then, going down, each at least ``apart`` octaves
    below the last one labelled (256 and 270 would print over each other)."""
    kept: list[int] = []
    for k in sorted(set(ks), reverse=True):
        if not kept or math.log2(kept[-1]) - math.log2(max(k, 1)) >= apart:
            kept.append(k)
    return sorted(kept)


def save_circuit_curves(ks: Sequence[int], curves: Mapping[str, torch.Tensor], path: str | Path,
                        dpi: int = 110, title: str | None = None) -> Path:
    """The fraction of the metric recovered with the top ``k`` heads clean, one curve per ranking.

    Every ``k`` is a point; those too close on the log axis to a larger one (:func:`_spread_ticks`) are not
    labelled.
    """
    figure, axis = plt.subplots(figsize=(6.4, 4.4), layout="constrained")
    for name, curve in curves.items():
        axis.plot(list(ks), curve.detach().double().cpu().numpy(), marker="o", markersize=3, label=name)
    axis.set_xscale("log", base=2)
    labelled = _spread_ticks(ks)
    axis.set_xticks(labelled, [str(k) for k in labelled], fontsize=8)
    axis.minorticks_off()
    axis.axhline(1.0, color="grey", linewidth=0.6, linestyle="--")
    axis.set_xlabel("heads kept clean (the top k of each method's ranking)", fontsize=9)
    axis.set_ylabel("share of m(clean) - m(corrupted) recovered", fontsize=9)
    axis.legend(fontsize=8, title="heads ranked by", title_fontsize=8)
    if title:
        figure.suptitle(_wrap(title, 6.0, 9), fontsize=9)
    return _save_figure(figure, path, dpi)
