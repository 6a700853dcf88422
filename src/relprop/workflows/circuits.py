"""Circuits scored as the MIB benchmark scores them: a node circuit from any method's scores, its faithfulness curve
over circuit sizes, and the areas CPR and CMD.

A *node circuit* is a set of units (heads, MLPs, and any other kind of
:mod:`relprop.workflows.components`), chosen as the ``k`` of highest score
(in absolute value by default, as MIB ranks) over all kinds together. It is
scored on the corrupted run with the circuit's units at their clean
activations and all else corrupted (MIB's counterfactual patching):

    F(k) = (m(circuit) - m(corrupted)) / (m(clean) - m(corrupted)),

with each ``m`` the metric's mean over the prompt pairs. MIB (Mueller et al.
2025) evaluates ``F`` at circuits of 0.1%, 0.2%, 0.5%, 1%, 2%, 5%, 10%, 20%,
50% and 100% of the units (:data:`BUDGETS`; ``k = int(budget * N)``) and
integrates over the circuit's size as a fraction of ``N`` with the trapezoid
rule: the integrated circuit performance ratio ``CPR`` is the area under
``F`` (higher is better), the circuit-model distance ``CMD`` the area under
``|1 - F|`` (lower is better).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from relprop.workflows.components import Component, resolve
from relprop.workflows.patching import Patching, PatchTarget, _check_gap, _evaluating

__all__ = ["BUDGETS", "Faithfulness", "areas", "circuit", "faithfulness"]

#: MIB's circuit sizes, as fractions of all units
BUDGETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)


@dataclass(frozen=True)
class Faithfulness:
    """A faithfulness curve and its areas.

    Attributes
    ----------
    budgets : tuple of float
        The circuit sizes asked for, as fractions of all units.
    sizes : tuple of int
        The units in each circuit, ``int(budget * units)``.
    units : int
        All units of the kinds scored.
    curve : Tensor
        ``(len(budgets),)``: ``F`` of each circuit.
    cpr, cmd : float
        The trapezoid areas of ``F`` and of ``|1 - F|`` over ``sizes / units``.
    """

    budgets: tuple[float, ...]
    sizes: tuple[int, ...]
    units: int
    curve: Tensor
    cpr: float
    cmd: float


def areas(fractions: Sequence[float], curve: Tensor | Sequence[float]) -> tuple[float, float]:
    """``(CPR, CMD)``: the trapezoid areas of ``F`` and of ``|1 - F|`` over the circuit sizes ``fractions``."""
    x = torch.as_tensor(fractions, dtype=torch.float64)
    f = torch.as_tensor(curve, dtype=torch.float64)
    if x.dim() != 1 or x.shape != f.shape or len(x) < 2:
        raise ValueError(f"relprop: areas need two or more circuit sizes and as many values of F, got "
                         f"{tuple(x.shape)} sizes and {tuple(f.shape)} values")
    if bool((x.diff() < 0).any()):
        raise ValueError(f"relprop: the circuit sizes {x.tolist()} must not decrease")
    return float(torch.trapezoid(f, x)), float(torch.trapezoid((1 - f).abs(), x))


def circuit(scores: Mapping[str, Tensor], size: int, absolute: bool = True) -> dict[str, Tensor]:
    """The ``size`` units of highest score over all kinds together: a boolean mask of each kind's scores' shape.

    ``scores`` maps each kind to its scores, of any shape (``(layers, heads)`` for heads, ``(layers,)`` for MLPs:
    one prompt pair's, or summed over several); ``absolute`` ranks by ``|score|``, as MIB does. Ties go to the
    unit that comes first (kinds in the order given, then in the order of their entries).
    """
    flat = torch.cat([value.detach().reshape(-1).double().cpu() for value in scores.values()])
    if not 0 <= size <= len(flat):
        raise ValueError(f"relprop: a circuit of {size} units out of {len(flat)}")
    order = torch.sort((flat.abs() if absolute else flat), descending=True, stable=True).indices
    chosen = torch.zeros(len(flat), dtype=torch.bool)
    chosen[order[:size]] = True
    masks, start = {}, 0
    for name, value in scores.items():
        masks[name] = chosen[start:start + value.numel()].reshape(value.shape)
        start += value.numel()
    return masks


def faithfulness(model: nn.Module, clean_ids: Tensor, corrupted_ids: Tensor, target: PatchTarget,
                 scores: Mapping[str | Component, Tensor], budgets: Sequence[float] = BUDGETS,
                 absolute: bool = True, attention_mask: Tensor | None = None) -> Faithfulness:
    """The faithfulness curve ``F`` of the circuits that ``scores`` rank, at MIB's ``budgets``, and CPR and CMD.

    Parameters
    ----------
    model, clean_ids, corrupted_ids, target, attention_mask :
        As for :func:`relprop.patching`.
    scores : mapping of kind (``"heads"``, ``"mlps"``, ... or a Component) to Tensor
        Each kind's scores per prompt pair, as :func:`relprop.patching` returns them (``(B, layers, heads)``,
        ``(B, layers)``, ...). One circuit serves all pairs: it ranks the scores summed over the pairs.
    budgets : sequence of float
        Circuit sizes as fractions of all units, increasing (MIB's by default).
    absolute : bool
        Rank by ``|score|`` (MIB's default) rather than by score.

    Returns
    -------
    Faithfulness
        ``F`` per budget, the sizes, CPR and CMD. One batched forward pass for all budgets.
    """
    if not budgets or any(not 0 <= b <= 1 for b in budgets) or list(budgets) != sorted(budgets):
        raise ValueError(f"relprop: budgets {list(budgets)} must be increasing fractions between 0 and 1")
    with _evaluating(model):
        pair = Patching(model, clean_ids, corrupted_ids, target, attention_mask)
        kinds = {resolve(kind): value for kind, value in scores.items()}
        summed = {}
        for kind, value in kinds.items():
            sites, units = len(kind.sites(pair.decoder)), kind.units(pair.decoder, pair.length)
            if value.numel() != pair.batch * sites * units:
                raise ValueError(f"relprop: {kind.name} scores of shape {tuple(value.shape)}; the model has "
                                 f"{pair.batch} x {sites} x {units} of them")
            summed[kind.name] = value.detach().reshape(pair.batch, sites, units).sum(0)
        total = sum(value.numel() for value in summed.values())
        sizes = tuple(int(budget * total) for budget in budgets)
        chosen = [circuit(summed, size, absolute) for size in sizes]
        masks = {kind: {site: torch.stack([c[kind.name][site] for c in chosen])[:, None].expand(-1, pair.batch, -1)
                        for site in range(summed[kind.name].shape[0])} for kind in kinds}
        clean, corrupted = (m.mean() for m in pair.metrics())
        _check_gap(clean.reshape(1), corrupted.reshape(1))
        patched = pair.patched_together(masks).mean(1)
    curve = ((patched - corrupted) / (clean - corrupted)).double()
    cpr, cmd = areas([size / total for size in sizes], curve)
    return Faithfulness(tuple(budgets), sizes, total, curve, cpr, cmd)
