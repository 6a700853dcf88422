"""LRP-epsilon, on every op kind that is linear in its activations, and its form for norms."""
from __future__ import annotations

import functools

import torch
from torch import Tensor

from relprop._core.contract import Call, is_parametric
from relprop._core.kinds import OpKind
from relprop._core.rule import Reads, Rule, Scaled
from relprop._core.stabilizers import inverse_denominator, per_unit_ratio, relative_inverse

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
    relative : bool
        Scale the stabiliser of each output by the size of its contributions, ``eps * sum_i |a_i w_ij|`` (the bias
        counted as one, unless ``zero_bias``): ``epsilon`` is then a fraction, and the rule is the same at any
        scale of the activations. Where the contributions of an output nearly cancel (``|z|`` below ``epsilon``
        of their sum) the stabiliser takes most of its relevance: the relevance handed on, in absolute value, is at most
        ``1 / epsilon`` times what arrived. On layers (one more pass of the layer, on ``|x|`` with ``|W|``) and on
        sums of activations of one shape; on other ops (reductions, pooling, an unmerged BatchNorm) the
        contributions are not at hand, and their stabiliser is ``epsilon * |z|``. Its gradient form is converted
        from the relevance form.
    """

    kinds = LINEAR_KINDS
    needs_vjp = True
    needs_output = False  # propagate() reads only the inverse that prepare() makes of it
    prepares = True
    zero_for_zero_input = True

    def __init__(self, epsilon: float = 1e-6, zero_bias: bool = False, relative: bool = False):
        self.epsilon = epsilon
        self.zero_bias = zero_bias
        self.relative = relative

    def accepts(self, call: Call) -> bool:
        return super().accepts(call) and (not self.zero_bias or is_parametric(call))

    def __repr__(self) -> str:  # ``relative`` only where set
        relative = ", relative=True" if self.relative else ""
        return f"{type(self).__name__}(epsilon={self.epsilon!r}, zero_bias={self.zero_bias!r}{relative})"

    def conserves(self, call: Call) -> bool:
        """Up to its stabiliser, where no constant takes a share: a layer without a bias (or with ``zero_bias``),
        a sum of two or more activations (a residual connection). Not LRP-0, which drops the relevance of outputs
        that are 0 (no input has a share of them) and has no stabiliser to account for it."""
        if self.epsilon == 0:
            return False
        if is_parametric(call):
            return self.zero_bias or call.bias is None
        # a sum of one activation may add a constant (x + b), which keeps its share like a bias
        return call.kind == OpKind.SUM and len(call.inputs) > 1

    def prepare(self, call: Call) -> Tensor:
        """``1 / (z + eps sign z)``, with ``z`` the output (less the bias with ``zero_bias``); with ``relative``,
        ``eps`` times the contributions' absolute sum."""
        unbiased = call.output - call.bias_term() if self.zero_bias and is_parametric(call) and call.bias is not None \
            else None
        if self.relative:
            return relative_inverse(call.output if unbiased is None else unbiased, self._contributions(call),
                                    self.epsilon)
        if unbiased is not None:
            return inverse_denominator(unbiased, self.epsilon)
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

    def _contributions(self, call: Call) -> Tensor:
        """``sum_i |a_i w_ij|`` per output ``j`` (the bias's ``|b_j|`` too, unless ``zero_bias``); ``|z|`` where the
        op's contributions are not at hand."""
        z = call.output
        if is_parametric(call):
            (x,) = call.inputs
            bias = None if self.zero_bias or call.bias is None else call.bias.abs()
            return call.evaluate(x.abs(), call.weight.abs(), bias)
        if call.kind == OpKind.SUM and all(x.shape == z.shape for x in call.inputs):
            # a sum of activations of the output's shape: each entry is sum_i c_i x_i, c_i its VJP of ones
            factors = call.vjp(torch.ones_like(z))
            return sum((x.abs() * c.abs() for x, c in zip(call.inputs, factors) if c is not None), z.new_zeros(()))
        return z.abs()

    @property
    def _stabilised(self) -> bool:
        """Whether the gradient form scales ``G`` by ``z / (z + eps sign z)``: LRP-0 (in any dtype) does not."""
        return self.zero_bias or self.epsilon != 0

    def gradient_reads(self, call: Call) -> Reads | None:
        if self.relative:  # its stabiliser reads the inputs: converted from the relevance form (gradient_form)
            return None
        # LRP-0 in gradient form is the op's own VJP: nothing of the call is kept but its autograd graph
        return Reads(vjp=True, output=self._stabilised, native=not self._stabilised)

    def gradient(self, call: Call, grad: Tensor) -> tuple[Tensor | None, ...]:
        """With ``zero_bias`` (outside :meth:`scaled`: its ratio reads the bias term) ``G_x = VJP(G * z / (d + eps
        sign d))``, ``d = z - b``; else as :meth:`scaled` says."""
        if not self.zero_bias:
            return super().gradient(call, grad)
        assert is_parametric(call)  # accepts() took parametric calls alone with zero_bias
        return call.vjp_scaled(grad, self._ratio)

    def scaled(self, call: Call) -> Scaled | None:
        """``G_x = VJP(G * z / (z + eps sign z))``: the op's VJP of ``G``, for LRP-0 ``G`` itself."""
        # its ratio reads the bias term, or the inputs, which a traced pass does not hand over
        if self.zero_bias or self.relative:
            return None
        return Scaled(output=functools.partial(per_unit_ratio, epsilon=self.epsilon) if self._stabilised else None)

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
