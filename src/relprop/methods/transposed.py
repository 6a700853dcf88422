"""Relevance for every entry of a seed at once, from the transposed map of a pass in gradient form.

In gradient form (AttnLRP, CP-LRP) relevance is a linear map of the seed. Recorded with ``create_graph``, the
backward pass can be differentiated with respect to a selector ``s`` of the seed ``s * embedding``: the
derivative of one input position's relevance is that position's relevance for every seed entry, one pass per
position instead of one per seed entry. BiLRP uses it for the relevance of each embedding dimension
(:mod:`relprop.methods.bilrp`).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from relprop._core.tensors import rounding
from relprop.methods.forward_pass import ForwardPass

__all__ = ["Pool", "SCORES", "additive", "pooled", "transposed_relevance"]

Pool = Callable[[Tensor], Tensor]

#: the attention scores per copy (about positions ** 2 per head) beyond which a pass recorded for the transposed
#: map, attention in its math form, takes no more copies
SCORES = 2 ** 20


def transposed_relevance(explained: ForwardPass, embedding: Tensor, pool: Pool | None) -> Tensor | None:
    """``R(phi_m)(x)`` for every dimension ``m``, ``(D, B, *P)``, from a gradient-form pass of copies of ``x``.

    The derivative of the relevance at one position with respect to the selector ``s`` of the seed
    ``s * phi(x)``; copy ``k`` gives the derivative at the ``k``-th position of each group. None where a backward
    pass cannot be differentiated, or the dimensions' relevance weighted by ``s`` does not add up to the
    relevance of ``s`` itself (see :mod:`relprop.methods.bilrp`).
    """
    batch, dims = embedding.shape
    copies = explained.logits.shape[0] // batch
    # any selector serves, the relevance being linear in it; a random one, because the check below is blind in
    # the directions the relevance does not reach (a final LayerNorm's output sums to a constant: all ones is one)
    drawn = torch.rand(embedding.shape, generator=torch.Generator().manual_seed(0), dtype=embedding.dtype)
    weights = drawn.to(embedding.device).add_(0.5)
    selector = weights.repeat(copies, 1).requires_grad_()
    try:
        (relevance,) = explained.propagate(selector * embedding.repeat(copies, 1), create_graph=True)
        summed = pooled(relevance, pool)
        shape, flat = summed.shape[1:], summed.reshape(copies, batch, -1)
        groups = [_derivatives(flat, selector, start) for start in range(0, flat.shape[-1], copies)]
    except RuntimeError:  # an op whose backward has no derivative of its own
        return None
    matrix = torch.cat(groups).permute(2, 1, 0)  # (D, B, positions)
    # rounding aside, the dimensions add up to the selector's relevance; a share missing is an op whose backward
    # pass was not recorded. Each example and position on its own: a share missing from a small one would vanish
    # in a larger one's scale
    weighted = matrix * weights.T.unsqueeze(-1)
    if ((weighted.sum(0) - flat[0].detach()).abs() > rounding(matrix.dtype) * weighted.abs().sum(0)).any():
        return None
    return matrix.reshape(dims, batch, *shape)


def _derivatives(flat: Tensor, selector: Tensor, start: int) -> Tensor:
    """The derivatives of positions ``start, start + 1, ...`` of ``flat`` (copies, B, positions), one per copy, with
    respect to ``selector`` (copies * B, D): ``(used, B, D)``."""
    copies, batch, positions = flat.shape
    used = min(copies, positions - start)
    picks = torch.zeros_like(flat)
    picks[torch.arange(used), :, torch.arange(start, start + used)] = 1
    found = (torch.autograd.grad(flat, selector, picks, retain_graph=start + used < positions, allow_unused=True)[0]
             if flat.requires_grad else None)
    found = torch.zeros_like(selector) if found is None else found  # no relevance reaches x
    return found.view(copies, batch, -1)[:used]


def additive(pool: Pool | None, shape: torch.Size, like: Tensor) -> bool:
    """Whether ``pool`` is additive on two random relevance maps of ``shape``: the transposed map differentiates
    the pooled relevance, which is the pool of each dimension's relevance only for a linear pool (a sum over
    patches is; a maximum or an absolute value is not, nor does the sum check see it, both being homogeneous)."""
    if pool is None:
        return True
    generator = torch.Generator().manual_seed(0)
    a, b = (torch.randn(shape, generator=generator, dtype=like.dtype).to(like.device) for _ in range(2))
    with torch.no_grad():
        together, apart = pooled(a + 2 * b, pool), pooled(a, pool) + 2 * pooled(b, pool)
    scale = pooled(a.abs(), pool).abs() + 2 * pooled(b.abs(), pool).abs()
    return together.shape == apart.shape and bool(((together - apart).abs() <= rounding(like.dtype) * scale).all())


def pooled(relevance: Tensor, pool: Pool | None) -> Tensor:
    """``pool(relevance)``, checked to keep the first dimension; ``relevance`` without ``pool``."""
    if pool is None:
        return relevance
    recorded, result = relevance.shape[0], pool(relevance)
    if not isinstance(result, Tensor) or result.shape[0] != recorded:
        raise ValueError("relprop: pool must map relevance of shape (N, ...) to a tensor (N, ...) with the "
                         f"same first dimension; for N = {recorded} it returned "
                         f"{tuple(result.shape) if isinstance(result, Tensor) else type(result)}")
    return result
