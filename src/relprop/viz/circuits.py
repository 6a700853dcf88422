"""Pictures of circuits scored as MIB scores them (:mod:`relprop.workflows.circuits`): faithfulness curves."""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import matplotlib.pyplot as plt

from relprop.viz import _save_figure, _wrap
from relprop.workflows.circuits import Faithfulness

__all__ = ["save_faithfulness_curves"]


def save_faithfulness_curves(curves: Mapping[str, Faithfulness], path: str | Path, dpi: int = 110,
                             title: str | None = None) -> Path:
    """``F`` against the circuit's size (a fraction of all units, log scale), one curve per ranking.

    ``curves`` maps a ranking's name (``"activation"``, ``"relp"``, ``"random"``) to its
    :class:`~relprop.workflows.circuits.Faithfulness`; the legend gives each one's CPR and CMD. Empty circuits
    (size 0) are left out of the log scale. ``title`` goes above the plot (what was patched: model, metric); the
    x axis names the number of units where all curves share it.
    """
    if not curves:
        raise ValueError("relprop: no faithfulness curves to draw")
    figure, axis = plt.subplots(figsize=(6.4, 4.4), layout="constrained")
    for name, found in curves.items():
        points = [(size / found.units, float(value)) for size, value in zip(found.sizes, found.curve) if size > 0]
        axis.plot([x for x, _ in points], [y for _, y in points], marker="o", markersize=3,
                  label=f"{name} (CPR {found.cpr:.3f}, CMD {found.cmd:.3f})")
    axis.set_xscale("log")
    axis.axhline(1.0, color="grey", linewidth=0.6, linestyle="--")
    axis.axhline(0.0, color="grey", linewidth=0.6, linestyle=":")
    units = {found.units for found in curves.values()}
    of = f"the {units.pop()} units" if len(units) == 1 else "units"
    axis.set_xlabel(f"circuit size (fraction of {of}, ranked by each method)")
    axis.set_ylabel("F = (m(circuit) - m(corr.)) / (m(clean) - m(corr.))", fontsize=8)
    axis.legend(fontsize=7)
    if title:
        figure.suptitle(_wrap(title, 6.0, 9), fontsize=9)
    return _save_figure(figure, path, dpi)
