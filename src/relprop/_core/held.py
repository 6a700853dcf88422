"""Quantities a rule holds constant in its gradient form, kept for the derivative of the relevance itself.

A rule's gradient form (:class:`~relprop._core.rule.Scaled`) is written as detach-and-scale: the epsilon rule's
``z / (z + eps sign z)``, a Gamma rule's shares, a norm's statistic are held, so that the op's VJP at the input
is the rule's. But the relevance is a function of those quantities too: they depend on the parameters and the
inputs. Detached, the derivative of the relevance loses every term through them, and is not what finite
differences of the relevance measure.

:func:`held` is ``.detach()`` unless a differentiable pass is running (:func:`holding`). Then it is an identity
whose gradient is 0 while :meth:`Holding.relevance_pass` is computing the relevance (the inner backward pass
with ``create_graph=True``), and the identity's afterwards: in the derivative of that relevance, the held
quantities are functions of the parameters and inputs like any other.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from contextvars import ContextVar
from typing import Any

import torch
from torch import Tensor

__all__ = ["Holding", "held", "holding", "relevance_grad"]


class Holding:
    """One differentiable pass: whether its relevance is being computed now (its held quantities get no gradient).

    A plain flag, not a thread's own: autograd may run a backward pass on a thread of its own (a CUDA device's).
    """

    def __init__(self) -> None:
        self.inner = False

    @contextmanager
    def relevance_pass(self) -> Iterator[None]:
        """The block that computes the relevance: the held quantities' gradient is 0 inside it."""
        self.inner = True
        try:
            yield
        finally:
            self.inner = False


_ACTIVE: ContextVar[Holding | None] = ContextVar("relprop_holding", default=None)


@contextmanager
def holding(pass_: Holding) -> Iterator[None]:
    """Inside the block (this thread's, or this task's), :func:`held` keeps what it holds for ``pass_``."""
    token = _ACTIVE.set(pass_)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


class _Held(torch.autograd.Function):
    """The identity; its gradient 0 while its pass computes the relevance, the identity's after."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, pass_: Holding) -> Tensor:
        ctx.pass_ = pass_
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None]:
        return (None if ctx.pass_.inner else grad), None


def held(x: Tensor) -> Tensor:
    """``x`` held constant in a rule's gradient form: ``x.detach()``, or inside :func:`holding` (where ``x``
    requires grad) an identity that is held while the relevance is computed and differentiable after."""
    pass_ = _ACTIVE.get()
    if pass_ is None or not x.requires_grad:
        return x.detach()
    return _Held.apply(x, pass_)


def relevance_grad(*args: Any, **kwargs: Any) -> tuple[Tensor | None, ...]:
    """``torch.autograd.grad(*args, **kwargs)`` as the relevance pass of the pass that :func:`holding` set (what it
    holds gets no gradient in it). Where a program is traced with that pass inside it (AOT autograd, Inductor),
    the trace keeps the held quantities' zero gradient in the relevance and their identity's in the derivative
    that differentiates the program."""
    pass_ = _ACTIVE.get()
    with pass_.relevance_pass() if pass_ is not None else nullcontext():
        return torch.autograd.grad(*args, **kwargs)
