"""Rules that propagate through another function's gradient: :class:`AsFunction`, :class:`Proportional`."""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from relprop._core.contract import PoolView
from relprop._core.rule import C_contra, Rule
from relprop._core.stabilizers import denominator


class AsFunction(Rule[C_contra]):
    """The op's relevance propagated as if it computed ``surrogate``, by the epsilon rule on the surrogate.

    The forward pass keeps the op's real output; only the backward pass
    reads the surrogate: ``z = surrogate(x, **arguments)``, ``s = R / (z +
    eps * sign(z))``, ``R_x = x * VJP_surrogate(s)``. The surrogate must give
    an output of the op's output shape. With the op itself as surrogate
    (``AsFunction(torch.conv2d)``) this is the op's plain :class:`Epsilon`.

    Parameters
    ----------
    surrogate : callable ``(x, **arguments) -> Tensor``
        A function of the op's one activation input ``x``. ``arguments`` are
        the op's other arguments by the names its torch function gives them:
        for convolutions and dense layers ``weight`` and ``bias`` (with a
        merged BatchNorm's scale and shift) and the options (``stride``,
        ``padding``, ``dilation``, ``groups``); for ``F.max_pool2d``
        ``kernel_size``, ``stride``, ``padding``, ``dilation``, ``ceil_mode``,
        ``return_indices``; for ``F.adaptive_max_pool2d`` ``output_size``.
        Take ``**_`` for those it does not read.
    epsilon : float
        Stabiliser of the denominator.
    kinds : iterable of str
        Op kinds (see :mod:`relprop.rules`) the rule is about: max pooling,
        convolutions and dense layers unless given.

    Examples
    --------
    Max pooling propagated like the average pooling of its windows (this is
    :class:`Proportional`)::

        AsFunction(lambda x, kernel_size, stride, padding, **_: F.avg_pool2d(x, kernel_size, stride, padding))
    """

    zero_for_zero_input = True
    needs_output = False

    def __init__(self, surrogate: Callable[..., Tensor], epsilon: float = 1e-6,
                 kinds: Iterable[str] = ("maxpool", "conv", "dense")):
        self.surrogate = surrogate
        self.epsilon = epsilon
        self.kinds = frozenset(kinds)

    def accepts(self, call: C_contra) -> bool:
        """An op of the rule's kinds with one activation input and arguments the surrogate can be given."""
        return call.kind in self.kinds and len(call.inputs) == 1 and call.arguments is not None

    def surrogate_output(self, call: C_contra, x: Tensor) -> Tensor:
        """The surrogate at ``x`` with ``call``'s arguments; rules that build it from the call override this."""
        arguments = call.arguments
        assert arguments is not None  # accepts() checked the arguments
        return self.surrogate(x, **arguments)

    def propagate(self, call: C_contra, relevance: Tensor) -> tuple[Tensor | None, ...]:
        (x,) = call.inputs
        with torch.enable_grad():
            leaf = x.detach().requires_grad_()
            z = self.surrogate_output(call, leaf)
        if z.shape != relevance.shape:
            raise ValueError(f"relprop: the surrogate of {self!r} gives shape {tuple(z.shape)} on {call.describe()}, "
                             f"whose output has shape {tuple(relevance.shape)}; it must give the op's output shape")
        (c,) = torch.autograd.grad(z, leaf, relevance / denominator(z.detach(), self.epsilon))
        return (c.mul_(x),)

    def __repr__(self) -> str:
        if type(self) is AsFunction:
            return f"AsFunction({getattr(self.surrogate, '__name__', self.surrogate)}, epsilon={self.epsilon!r})"
        return f"{type(self).__name__}(epsilon={self.epsilon!r})"  # the surrogate is the rule's own


class Proportional(AsFunction[PoolView]):
    """Max pooling propagated like the average pooling over the same windows: :class:`AsFunction` of it.

    Each window's relevance is shared in proportion to its inputs instead of
    going to the winner alone (winner-take-all is the default). Padding
    counts as zeros in the average; ``F.adaptive_max_pool*`` is propagated
    like ``F.adaptive_avg_pool*`` of the same output size.

    Parameters
    ----------
    epsilon : float
        Stabiliser of the denominator.
    """

    def __init__(self, epsilon: float = 1e-6):
        super().__init__(_no_surrogate, epsilon, kinds=("maxpool",))

    def accepts(self, call: PoolView) -> bool:
        return call.kind in self.kinds and len(call.inputs) == 1 and call.average is not None

    def conserves(self, call: PoolView) -> bool:
        return True

    def surrogate_output(self, call: PoolView, x: Tensor) -> Tensor:
        average = call.average  # the op family's average pooling over the op's own windows
        assert average is not None  # accepts() checked there is one
        return average(x)


def _no_surrogate(x: Tensor, **arguments: Any) -> Tensor:
    """The surrogate of rules that build theirs from the op call (:meth:`AsFunction.surrogate_output`)."""
    raise NotImplementedError("relprop: this rule builds its surrogate from the op call")
