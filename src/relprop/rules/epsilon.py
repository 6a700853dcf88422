"""LRP-epsilon, on every op kind that is linear in its activations, and its form for norms."""
from __future__ import annotations

import torch
from torch import Tensor

from relprop._core.contract import Call, is_parametric
from relprop._core.kinds import OpKind
from relprop._core.rule import Reads, Rule
from relprop.rules.stabilizers import inverse_denominator, per_unit_ratio

#: Op kinds that are linear in their activation inputs.
LINEAR_KINDS = frozenset({OpKind.CONV, OpKind.DENSE, OpKind.BATCHNORM, OpKind.SUM, OpKind.NORM})
#: Op kinds with a weight and a bias that rules may modify.
PARAMETRIC_KINDS = frozenset({OpKind.CONV, OpKind.DENSE})


class Epsilon(Rule[Call]):
    """LRP-epsilon: ``R_j = a_j * sum_k w_jk R_k / (z_k + eps * sign(z_k))``.

    ``epsilon=0`` gives LRP-0. Applies to every linear op, parametric or not
    (sums and average pooling are then shared in proportion to the inputs).
    It reuses the gradient graph of the forward pass: no layer is re-run.

    Parameters
    ----------
    epsilon : float
        Stabiliser added to the denominator with the sign of ``z``.
    zero_bias : bool
        Leave the bias out of the denominator, so that it absorbs no relevance.
    """

    kinds = LINEAR_KINDS
    needs_vjp = True
    needs_output = False  # propagate() reads only the inverse that prepare() makes of it
    prepares = True
    zero_for_zero_input = True

    def __init__(self, epsilon: float = 1e-6, zero_bias: bool = False):
        self.epsilon = epsilon
        self.zero_bias = zero_bias

    def accepts(self, call: Call) -> bool:
        return super().accepts(call) and (not self.zero_bias or is_parametric(call))

    def prepare(self, call: Call) -> Tensor:
        """``1 / (z + eps sign z)``, with ``z`` the output (less the bias with ``zero_bias``)."""
        if self.zero_bias and is_parametric(call) and call.bias is not None:
            return inverse_denominator(call.output - call.bias_term(), self.epsilon)
        z = call.take_output() if call.output_nonnegative else None
        return inverse_denominator(call.output if z is None else z, self.epsilon, in_place=z is not None)

    def propagate(self, call: Call, relevance: Tensor) -> tuple[Tensor | None, ...]:
        inverse = call.prepared
        # the inverse is read once, unless the call serves several backward passes
        scaled = relevance * inverse if call.reusable else torch.mul(relevance, inverse, out=inverse)
        grads = call.vjp(scaled)
        if call.kind in PARAMETRIC_KINDS:  # fresh tensors from a transposed product: scaled in place
            return tuple(None if c is None else c.mul_(x) for x, c in zip(call.inputs, grads))
        # a sum hands `scaled` itself to its inputs: ours, so the last input to read it may write into it; an
        # input copy that only this rule reads takes its own relevance
        last = max((i for i, c in enumerate(grads) if c is not None), default=None)
        owned = last is not None and grads[last] is scaled and scaled.shape == call.inputs[last].shape
        return tuple(None if c is None else c.mul_(x) if owned and i == last else
                     x.mul_(c) if i in call.scratch and c.shape == x.shape else x * c
                     for i, (x, c) in enumerate(zip(call.inputs, grads)))

    @property
    def _stabilised(self) -> bool:
        """Whether the gradient form scales ``G`` by ``z / (z + eps sign z)``: LRP-0 (in any dtype) does not."""
        return self.zero_bias or self.epsilon != 0

    def gradient_reads(self, call: Call) -> Reads:
        # LRP-0 in gradient form is the op's own VJP: nothing of the call is kept but its autograd graph
        return Reads(vjp=True, output=self._stabilised, native=not self._stabilised)

    def gradient(self, call: Call, grad: Tensor) -> tuple[Tensor | None, ...]:
        """``G_x = VJP(G * z / (z + eps sign z))``: the op's VJP of ``G``, for LRP-0 ``G`` itself."""
        if not self._stabilised:
            return call.vjp(grad)
        if is_parametric(call):  # on a vocabulary head, the rows of G that hold relevance alone
            return call.vjp_scaled(grad, self._ratio)
        return call.vjp(grad * self._ratio(call.output, None))

    def _ratio(self, z: Tensor, bias: Tensor | None) -> Tensor:
        """``z / (z + eps sign z)``; with ``zero_bias`` and a ``bias`` (broadcast against ``z``), ``z / (d + eps
        sign d)`` with ``d = z - bias``."""
        return per_unit_ratio(z, self.epsilon, z - bias if self.zero_bias and bias is not None else None)


class Norm(Epsilon):
    """zennit's name for the epsilon rule on parameter-free ops (sum and average pooling).

    Identical to :class:`Epsilon` with ``epsilon=stabilizer``.
    """

    def __init__(self, stabilizer: float = 1e-6):
        super().__init__(epsilon=stabilizer)
