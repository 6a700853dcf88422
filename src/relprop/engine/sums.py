"""Sums whose VJP is closed-form: ``x + alpha * y`` (:class:`AddCall`) and the residual ``x += y`` run in place
(:class:`InPlaceSumCall`): no autograd graph of them is kept or run."""
from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from relprop._core.kinds import OpKind
from relprop._core.tensors import sum_to
from relprop.engine.calls import OpCall


class AddCall(OpCall):
    """``x + alpha * y`` or ``x - alpha * y`` (``add``, ``sub``): a sum whose VJP is closed-form.

    The VJP hands ``g`` to ``x`` and ``alpha * g`` (``-alpha * g`` for a
    difference) to ``y``, each summed to its input's shape where it was
    broadcast, as autograd computes it (bitwise), so no autograd graph of the
    sum is kept in the forward pass and none is run in the backward pass.
    Only for two arguments of one floating dtype (or a number): autograd would
    also cast the gradient of an input of another dtype.

    Parameters
    ----------
    alpha : float
        The factor of the second argument, negated for a difference.
    """

    def __init__(self, func: Callable, args: tuple, kwargs: dict, name: str, module_name: str, alpha: float):
        super().__init__(OpKind.SUM, func, args, kwargs, name, module_name)
        #: the factor of each activation input: 1 for the first argument, ``alpha`` for the second
        self._factors = tuple(1 if slot == 0 else alpha for slot in self._slots)

    def _needs_graph(self) -> bool:
        return False

    def vjp(self, grad: Tensor) -> tuple[Tensor, ...]:
        return tuple(sum_to(grad if factor == 1 else grad * factor, x.shape)
                     for factor, x in zip(self._factors, self.inputs))


class InPlaceSumCall(AddCall):
    """``x.add_(y, alpha=a)`` run in place, as in the plain model (a residual connection ``out += identity``).

    The rule reads ``before``, a copy of ``x`` taken before the op, and the
    op's VJP is closed-form (:class:`AddCall`), so no autograd graph of the
    sum is kept and no result is copied back into ``x``. ``producer``, the
    call that computed ``x``, may read the same copy (see :meth:`OpCall.protect`).
    """

    replays = False  # it holds a copy of its input and the call that produced it

    def __init__(self, func: Callable, args: tuple, kwargs: dict, name: str, module_name: str, before: Tensor,
                 alpha: float, producer: OpCall | None):
        super().__init__(func, args, kwargs, name, module_name, alpha)
        self.in_place = True
        self.inputs = (before, *self.inputs[1:])
        self._leaves[self._slots[0]] = before  # no alias of x left here: the output may be writable later
        self._producer = producer

    def prepare(self) -> None:
        """Prepare, and let the producer of ``x`` prepare too.

        The producer may prepare at any time. If it then reads no more of the
        copy of ``x``, the copy is this rule's alone to write into: one
        map-sized tensor fewer on every residual connection.
        """
        super().prepare()
        if self._producer is not None:
            self._producer.prepare()
            if self._producer.kept_output is None and not self.reusable:
                self.scratch = frozenset({0})
            self._producer = None
