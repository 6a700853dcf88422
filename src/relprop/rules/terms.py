"""The vocabulary of the linear rules: terms (a weight map and an input map) and how they share relevance.

:class:`~relprop.rules.BasicRule` is defined by these; :mod:`relprop.rules.kernels`
recognises them to pick a fused form.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from relprop._core.stabilizers import denominator


def _identity(tensor: Tensor) -> Tensor:
    return tensor


def _positive(tensor: Tensor) -> Tensor:
    return tensor.clamp(min=0)


def _negative(tensor: Tensor) -> Tensor:
    return tensor.clamp(max=0)


def _ones(tensor: Tensor) -> Tensor:
    return torch.ones_like(tensor)


def _square(tensor: Tensor) -> Tensor:
    return tensor * tensor


#: input modifiers that map 0 to 0: a rule made of them alone gives an input entry of 0 relevance 0
_KEEP_ZERO = (_identity, _positive, _negative)


@dataclass(frozen=True)
class _Lift:
    """Parameter modifier ``w -> w + gamma * part(w)`` (``part``: the positive or the negative part)."""

    gamma: float
    part: Callable[[Tensor], Tensor]

    def __call__(self, tensor: Tensor) -> Tensor:
        return tensor + self.gamma * self.part(tensor)


@dataclass(frozen=True, eq=False)
class _Bound:
    """Input modifier ``x -> `` the bound ``value`` as an image of ``x``'s shape (padded alike by the op)."""

    value: float | Tensor

    def __call__(self, tensor: Tensor) -> Tensor:
        return _bound_image(self.value, tensor).expand_as(tensor)


def _bound_image(value: float | Tensor, x: Tensor) -> Tensor:
    """A bound as an input image: of one example where it is the same for every example, else of the batch."""
    bound = torch.as_tensor(value, dtype=x.dtype, device=x.device)
    per_example = bound.dim() == x.dim() and bound.shape[0] != 1
    return bound.expand_as(x if per_example else x[:1])


@dataclass(frozen=True)
class Term:
    """One product ``input(x) * param(W)`` of a :class:`BasicRule`.

    Parameters
    ----------
    input : callable
        Input modifier, ``x -> x'``.
    param : callable
        Parameter modifier, applied to the weight and to the bias.
    bias : bool
        Whether this term carries the (modified) bias.
    """

    input: Callable[[Tensor], Tensor] = _identity
    param: Callable[[Tensor], Tensor] = _identity
    bias: bool = True


@dataclass(frozen=True)
class Shares:
    """The gradient mapper of the rules of docs/design.md, section 2: relevance shared in proportion to outputs.

    The terms form groups of consecutive terms (``groups``: their sizes). Term
    ``t`` of group ``g`` gets ``s_t = sign_t * weight_g * R / denominator(z_g,
    stabilizer)`` with ``z_g = sum_{t in g} sign_t z_t``, on the entries where
    the op's output has the sign ``where_g`` (+1, -1; 0: everywhere) and 0
    elsewhere.

    Parameters
    ----------
    stabilizer : float
    groups : tuple of int
        Sizes of the groups, in the order of the terms; they add up to the number of terms.
    weights : tuple of float, optional
        One per group (default: 1 each).
    signs : tuple of int, optional
        One per term, +1 or -1 (default: +1 each).
    where : tuple of int, optional
        One per group (default: 0 each, everywhere).
    """

    stabilizer: float
    groups: tuple[int, ...] = (1,)
    weights: tuple[float, ...] = ()
    signs: tuple[int, ...] = ()
    where: tuple[int, ...] = ()

    def __post_init__(self) -> None:  # the defaults spelled out: kernels recognise a mapper by its fields
        for name, default, count in (("weights", 1.0, len(self.groups)), ("signs", 1, sum(self.groups)),
                                     ("where", 0, len(self.groups))):
            if not getattr(self, name):
                object.__setattr__(self, name, (default,) * count)
        if len(self.weights) != len(self.groups) or len(self.where) != len(self.groups) or \
                len(self.signs) != sum(self.groups):
            raise ValueError(f"relprop: Shares needs one weight and one `where` per group and one sign per term, got "
                             f"groups={self.groups}, weights={self.weights}, signs={self.signs}, where={self.where}")

    @property
    def reads_output(self) -> bool:
        """Whether it reads the op's output (for ``where``)."""
        return any(self.where)

    def __call__(self, relevance: Tensor, outputs: list[Tensor], z: Tensor | None) -> list[Tensor]:
        grads: list[Tensor] = []
        start = 0
        for size, weight, where in zip(self.groups, self.weights, self.where):
            signs = self.signs[start:start + size]
            total = outputs[start]
            for sign, out in zip(signs[1:], outputs[start + 1:start + size]):
                total = total + out if sign > 0 else total - out
            if where == 0:
                shared = relevance
            else:
                assert z is not None  # reads_output: the rule keeps the output for it
                shared = relevance * (z > 0 if where > 0 else z < 0)
            shared = shared / denominator(total, self.stabilizer)
            if weight != 1:
                shared = weight * shared
            grads.extend(shared if sign > 0 else -shared for sign in signs)
            start += size
        return grads


#: the positive contributions ``x+ W+ + x- W-`` (bias ``b+``), and the negative ones ``x+ W- + x- W+`` (``b-``)
POSITIVE_SHARE = (Term(_positive, _positive), Term(_negative, _negative, bias=False))
NEGATIVE_SHARE = (Term(_positive, _negative), Term(_negative, _positive, bias=False))
