"""Evaluating explanations: pixel flipping with AOPC, and the model-randomisation sanity check.

- Pixel flipping (region perturbation, Samek et al. 2017): replace the input
  positions in order of decreasing relevance by a baseline and record the
  target output after each step. AOPC, the area over the perturbation curve,
  is ``mean_k (f(x_0) - f(x_k))``; a faithful explanation has a high AOPC, a
  random order a low one.
- Cascading model randomisation (Adebayo et al. 2018): re-initialise the
  parametric layers from the top down and measure the rank correlation of
  each new heatmap with the original one; it should drop.
- Checkerboard: the share of a heatmap's variation that repeats on a
  lattice, as strided layers leave it (:func:`checkerboard`).
"""
from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

from relprop.methods.targets import model_logits, target_mask

__all__ = ["pixel_flipping", "aopc", "spearman", "randomization_check", "checkerboard"]

T = TypeVar("T")


def _progress(iterable: Iterable[T], enabled: bool | str, desc: str) -> Iterable[T]:
    """``iterable`` with a progress bar (labelled ``enabled`` if that is a string) on a terminal's stderr."""
    if not enabled:
        return iterable
    from tqdm.auto import tqdm  # optional dependency, only for progress bars
    return tqdm(iterable, desc=enabled if isinstance(enabled, str) else desc, leave=False, disable=None)


@torch.no_grad()
def _target_scores(model: nn.Module, batch: Tensor, target: Any) -> Tensor:
    logits = model_logits(model(batch))
    return (logits * target_mask(logits, target)).flatten(1).sum(1)


@torch.no_grad()
def pixel_flipping(model: nn.Module, inputs: Tensor, attribution: Tensor | None, target: Any, steps: int = 20,
                   region: int = 1, baseline: float | str = 0.0, generator: torch.Generator | None = None,
                   progress: bool | str = False) -> Tensor:
    """Target output while input regions are perturbed, most relevant first (region perturbation).

    Parameters
    ----------
    model : nn.Module
    inputs : Tensor (N, C, H, W)
    attribution : Tensor of the inputs' shape, or None for a random order
        Regions (``region`` x ``region`` squares on a grid, all channels
        together) are ranked by their summed relevance.
    target : captum-style target (see :func:`relprop.methods.target_mask`)
    steps : int
        Number of perturbation steps; step k has perturbed ``k / steps`` of all regions.
    region : int
        Side of the square regions.
    baseline : float or ``"uniform"``
        The value perturbed regions take, or uniform noise in the range of ``inputs``
        (Samek et al. 2017), drawn once per example so that all orders see the same noise.
    generator : torch.Generator, optional
        For the noise and the random order.
    progress : bool or str
        A progress bar on a terminal; a string is its label.

    Returns
    -------
    Tensor (steps + 1, N): the target output after 0, 1, ..., steps steps.
    """
    batch, height, width = inputs.shape[0], inputs.shape[-2], inputs.shape[-1]
    rows, columns = -(-height // region), -(-width // region)
    regions = rows * columns
    if attribution is None:
        order = torch.stack([torch.randperm(regions, generator=generator) for _ in range(batch)])
    else:
        scores = attribution.sum(1, keepdim=True)
        scores = torch.nn.functional.pad(scores, (0, columns * region - width, 0, rows * region - height))
        order = torch.nn.functional.avg_pool2d(scores, region).reshape(batch, -1).argsort(dim=1, descending=True)
    if baseline == "uniform":
        low, high = inputs.min().item(), inputs.max().item()
        noise = torch.rand(inputs.shape, generator=generator, dtype=inputs.dtype) * (high - low) + low
        fill = noise.to(inputs.device)
    else:
        fill = torch.full_like(inputs, float(baseline))
    targets = target.tolist() if isinstance(target, Tensor) else target
    curve = []
    for step in _progress(range(steps + 1), progress, "pixel flipping"):
        count = round(step * regions / steps)
        keep = torch.ones(batch, regions, dtype=torch.bool)
        keep.scatter_(1, order[:, :count].cpu(), False)
        keep = keep.reshape(batch, 1, rows, 1, columns, 1).expand(-1, -1, -1, region, -1, region)
        keep = keep.reshape(batch, 1, rows * region, columns * region)[..., :height, :width].to(inputs.device)
        curve.append(_target_scores(model, torch.where(keep, inputs, fill), targets))
    return torch.stack(curve)


def aopc(curve: Tensor) -> Tensor:
    """Area over the perturbation curve per example: ``mean_k (f(x_0) - f(x_k))``."""
    return (curve[0:1] - curve).mean(0)


def _ranks(row: Tensor) -> Tensor:
    """Ranks of a 1-D tensor, ties sharing their average rank."""
    _, inverse, counts = torch.unique(row, sorted=True, return_inverse=True, return_counts=True)
    ends = counts.cumsum(0).to(torch.float64)
    return ((2 * ends - counts - 1) / 2)[inverse]


def spearman(a: Tensor, b: Tensor) -> Tensor:
    """Spearman rank correlation of each example's flattened ``a`` and ``b`` (ties get average ranks)."""
    ra = torch.stack([_ranks(row) for row in a.reshape(a.shape[0], -1)])
    rb = torch.stack([_ranks(row) for row in b.reshape(b.shape[0], -1)])
    ra, rb = ra - ra.mean(1, keepdim=True), rb - rb.mean(1, keepdim=True)
    return (ra * rb).sum(1) / (ra.norm(dim=1) * rb.norm(dim=1))


def randomization_check(model: nn.Module, explain: Callable[[nn.Module], Tensor], absolute: bool = False,
                        generator: torch.Generator | None = None, progress: bool = False) -> list[tuple[str, float]]:
    """Cascading randomisation: rank correlation with the original heatmap as layers are re-initialised.

    Parameters
    ----------
    model : nn.Module
        Not modified: a copy is randomised.
    explain : callable ``model -> relevance``
        Explains the fixed inputs with the given (partly randomised) model.
    absolute : bool
        Compare absolute relevance instead of signed relevance. For rules that
        multiply by the input, absolute maps keep the input's support (zero
        where the input is zero) whatever the weights, which hides the change.

    Returns
    -------
    list of (name of the last layer randomised, mean Spearman correlation); the
    first entry, ``"original"``, is 1.
    """
    randomized = copy.deepcopy(model)
    original = explain(randomized)
    if absolute:
        original = original.abs()
    layers = [(name, module) for name, module in randomized.named_modules()
              if isinstance(getattr(module, "weight", None), Tensor) and module.weight.dim() > 1]
    results = [("original", 1.0)]
    for name, module in _progress(list(reversed(layers)), progress, "randomising"):
        with torch.no_grad():
            std = module.weight.std().item()
            module.weight.normal_(0.0, std if std > 0 else 1.0, generator=generator)
            if getattr(module, "bias", None) is not None:
                module.bias.zero_()
        heatmap = explain(randomized)
        results.append((name, spearman(heatmap.abs() if absolute else heatmap, original).mean().item()))
    return results


def checkerboard(heatmap: Tensor, period: int = 2) -> Tensor:
    """The share of a heatmap's variation that repeats with period ``period`` in both directions: its checkerboard.

    The heatmap ``h`` is folded into its ``period x period`` phases, ``m[a, b]
    = mean_ij h[a + period i, b + period j]``; the periodic part, ``m`` tiled
    over the map, holds exactly the power of the spectrum at the lattice's
    frequencies (multiples of ``H / period`` and ``W / period``, the Nyquist
    frequency among them), the rest is all other variation. The result is
    ``sum (tile(m) - mean h)^2 / sum (h - mean h)^2``: 1 for a pattern that
    repeats on the lattice alone, about ``(period^2 - 1) / (H W)`` for white
    noise, 0 for a constant map. Periods that divide ``period`` count too: a
    stride-2 layer after a total stride of 4 leaves period 8 in the input's
    pixels, and ResNet50's three downsampling shortcuts periods 8, 16 and
    32, all of them within ``period=32``.

    Parameters
    ----------
    heatmap : Tensor (..., H, W)
        Relevance per pixel (sum colour channels first); rows and columns past
        the last whole period are left out.
    period : int
        The lattice's period in pixels, at least 2 and at most ``H`` and ``W``.

    Returns
    -------
    Tensor (...)
        One share in [0, 1] per heatmap.
    """
    if heatmap.dim() < 2 or not 2 <= period <= min(heatmap.shape[-2:]):
        raise ValueError(f"relprop: checkerboard needs a heatmap (..., H, W) with H and W at least the period "
                         f"{period} (and a period of at least 2), got shape {tuple(heatmap.shape)}")
    rows, cols = (size // period for size in heatmap.shape[-2:])
    h = heatmap[..., :rows * period, :cols * period].double()
    centred = h - h.mean((-2, -1), keepdim=True)
    phases = centred.unflatten(-1, (cols, period)).unflatten(-3, (rows, period)).mean((-4, -2))
    total = centred.square().sum((-2, -1))
    periodic = phases.square().sum((-2, -1)) * rows * cols
    return torch.where(total > 0, periodic / total.clamp(min=torch.finfo(total.dtype).tiny), 0.0)
