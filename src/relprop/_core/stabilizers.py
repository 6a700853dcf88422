"""The stabilised denominators of the rules: ``z + eps * sign(z)`` and its inverse, and the stabiliser relative to
the size of the contributions (:func:`relative_inverse`)."""
from __future__ import annotations

import math

import torch
from torch import Tensor


def stabilizer(epsilon: float, dtype: torch.dtype) -> float:
    """In float16 and bfloat16 the stabiliser is at least the dtype's machine epsilon, so that 1/eps stays finite."""
    if dtype in (torch.float16, torch.bfloat16):
        return max(epsilon, torch.finfo(dtype).eps)
    return epsilon


def denominator(z: Tensor, epsilon: float) -> Tensor:
    """Stabilise ``z`` for a division: ``z + epsilon * sign(z)`` with ``sign(0) = +1``.

    With ``epsilon == 0`` the zeros of ``z`` become ``inf``, so that dividing by
    the result gives 0 there instead of NaN. In float16 and bfloat16 ``epsilon``
    is at least the dtype's machine epsilon.
    """
    epsilon = stabilizer(epsilon, z.dtype)
    if epsilon == 0:
        return torch.where(z == 0, math.inf, z)
    # eps * (1 - 2 [z < 0]) + z, bitwise z + eps or z - eps, with one new tensor: torch.where costs
    # several passes over memory on CPU, and every fresh tensor page faults
    return torch.lt(z, 0, out=torch.empty_like(z)).mul_(-2 * epsilon).add_(epsilon).add_(z)


def inverse_denominator(z: Tensor, epsilon: float, in_place: bool = False) -> Tensor:
    """``1 / denominator(z, epsilon)``, in as few passes over memory as possible.

    ``in_place``: ``z >= 0`` (an in-place ReLU's output) is the caller's to
    overwrite, and the result is written into it. With ``epsilon == 0`` the
    inverse is 0 where ``1 / z`` is infinite: at ``z = 0``, and at subnormal
    ``z`` (``1 / z`` overflows there; ``denominator`` keeps them).
    """
    epsilon = stabilizer(epsilon, z.dtype)
    if recorded(z):  # the same arithmetic out of place: autograd keeps what it wrote for the relevance's derivative
        inverse = z.reciprocal() if epsilon == 0 else (torch.copysign(z.new_full((), epsilon), z) + z).reciprocal()
        return inverse.nan_to_num(nan=math.nan, posinf=0.0, neginf=0.0) if epsilon == 0 else inverse
    if epsilon == 0:
        # one pass in place instead of `where(z == 0, 0, 1 / z)`: 6x faster on a transformer's small tensors,
        # where LRP-0 (AttnLRP) takes an inverse per linear layer
        inverse = z.reciprocal_() if in_place else z.reciprocal()
        return inverse.nan_to_num_(nan=math.nan, posinf=0.0, neginf=0.0)
    if in_place:
        return z.add_(epsilon).reciprocal_()
    # copysign(eps, 0.0) = +eps; the rare -0.0 gets -eps, the same magnitude. One new tensor, written in place:
    # on large tensors every fresh allocation costs page faults
    return torch.copysign(z.new_full((), epsilon), z).add_(z).reciprocal_()


def relative_inverse(z: Tensor, contributions: Tensor, epsilon: float) -> Tensor:
    """``1 / (z + epsilon * m * sign z)``, ``m`` the ``contributions`` (``sum_i |a_i w_i|`` of each output, ``>= |z|``).

    Written into ``contributions``. 0 where the denominator is 0 (``z`` and its contributions all 0), where no
    relevance can arrive. In float16 and bfloat16 ``epsilon`` is at least the dtype's machine epsilon.
    """
    epsilon = stabilizer(epsilon, z.dtype)
    # copysign: sign(+0) = +1, so an output of 0 with contributions of both signs gets a finite inverse
    denominator = torch.copysign(contributions.mul_(epsilon), z).add_(z)
    return denominator.reciprocal_().nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)


def per_unit_ratio(z: Tensor, epsilon: float, denominator_of: Tensor | None = None) -> Tensor:
    """``z / (d + eps sign d)`` (``d`` is ``denominator_of``, else ``z``): what the epsilon rule scales ``R / z`` by.

    In gradient form (relevance per unit of activation, ``G = R / z``) the epsilon rule's ``R / (z + eps sign z)``
    is ``G`` times this ratio. LRP-0 (``epsilon = 0``, ``d = z``) needs none, in every dtype: it divides by
    nothing there, so the stabiliser that keeps ``1 / z`` finite in float16 and bfloat16 has no role.
    """
    inverse = inverse_denominator(z if denominator_of is None else denominator_of, epsilon)
    return inverse * z if recorded(inverse) else inverse.mul_(z)


def recorded(x: Tensor) -> bool:
    """Whether autograd records what is computed of ``x`` (a differentiable pass, :mod:`relprop._core.held`):
    then no helper writes in place, which would overwrite what autograd saved."""
    return x.requires_grad and torch.is_grad_enabled()
