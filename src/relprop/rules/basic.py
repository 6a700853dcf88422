"""Linear rules defined by their terms (docs/design.md, section 2): z+, alpha-beta, gamma, z^B, w^2, flat.

With modified parameters ``rho`` the modified output ``z'`` is computed,
``s = R / (z' + eps * sign(z'))`` and ``R_in = x * VJP(s)``.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from relprop._core.contract import ParametricView
from relprop._core.held import held
from relprop._core.rule import Rule, Scaled
from relprop.rules.epsilon import PARAMETRIC_KINDS
from relprop.rules.kernels import Kernel, fused
from relprop.rules.terms import (
    _KEEP_ZERO,
    NEGATIVE_SHARE,
    POSITIVE_SHARE,
    Shares,
    Term,
    _Bound,
    _identity,
    _Lift,
    _negative,
    _ones,
    _positive,
    _square,
)


class BasicRule(Rule[ParametricView]):
    """A rule for parametric linear ops built from its parts: its single definition.

    For each :class:`Term` ``t`` the op is evaluated as ``z_t = f(input_t(x);
    param_t(W), param_t(b))``. ``gradient_mapper(R, outputs, z)`` turns the
    output relevance into one tensor ``s_t`` per term (typically ``R``
    divided by a stabilised sum of outputs, :class:`Shares`);
    ``reducer(inputs, grads)`` combines the modified inputs with the VJPs
    ``c_t = VJP_t(s_t)`` (default: ``sum_t input_t * c_t``).

    That is the rule's reference form. Where :mod:`relprop.rules.kernels` has a fused
    form for these terms and this mapper (z+, alpha-beta, gamma, z^B, flat, w^2), it
    computes the same relevance with fewer passes over memory on the calls it
    serves; everything else takes the reference form.

    The engine's flags follow from the parts: the output is kept unless the
    mapper is a :class:`Shares` that does not read it (and no fused form
    does); an input of 0 gets relevance 0 (``zero_for_zero_input``) where
    every term's input modifier is the identity or a sign part and the
    reducer is the default. A subclass may still set them as class
    attributes.

    Parameters
    ----------
    terms : sequence of Term
    gradient_mapper : callable ``(relevance, outputs, z) -> list[Tensor]``
        ``z`` is the op's output, less its bias with ``zero_bias``; None where the rule does not keep it (a
        :class:`Shares` that reads no output).
    reducer : callable ``(inputs, grads) -> Tensor``, optional
    zero_bias : bool
        Drop the bias from every term, and from the output that the mapper reads.
    """

    kinds = PARAMETRIC_KINDS

    def __init__(
        self,
        terms: Sequence[Term],
        gradient_mapper: Callable[[Tensor, list[Tensor], Tensor | None], list[Tensor]],
        reducer: Callable[[list[Tensor], list[Tensor]], Tensor] | None = None,
        zero_bias: bool = False,
    ):

        self._terms = tuple(terms)
        self._gradient_mapper = gradient_mapper
        self._reducer = reducer
        self.zero_bias = zero_bias
        self._kernel = None if reducer is not None else fused(self._terms, gradient_mapper, zero_bias)
        self._needs_output: bool | None = None  # set: the flag as given, instead of as the parts say
        self._zero_for_zero_input: bool | None = None

    @property
    def kernel(self) -> Kernel | None:
        """The fused form chosen for these terms (:mod:`relprop.rules.kernels`), or None: the reference form serves."""
        return self._kernel

    @property
    def needs_output(self) -> bool:
        """Whether the gradient mapper or the fused form may read the output."""
        if self._needs_output is not None:
            return self._needs_output
        reads = not isinstance(self._gradient_mapper, Shares) or self._gradient_mapper.reads_output
        return reads or (self._kernel is not None and self._kernel.reads_output)

    @needs_output.setter
    def needs_output(self, value: bool) -> None:
        self._needs_output = value

    @property
    def zero_for_zero_input(self) -> bool:
        """Whether an input of 0 gets relevance 0: every input modifier keeps 0, and the reducer is the default."""
        if self._zero_for_zero_input is not None:
            return self._zero_for_zero_input
        return self._reducer is None and all(term.input in _KEEP_ZERO for term in self._terms)

    @zero_for_zero_input.setter
    def zero_for_zero_input(self, value: bool) -> None:
        self._zero_for_zero_input = value

    @property
    def fills_zeros(self) -> bool:  # a flag that follows the terms
        """Whether an input of 0 may get relevance of its own (see :attr:`zero_for_zero_input`)."""
        return not self.zero_for_zero_input

    def propagate(self, call: ParametricView, relevance: Tensor) -> tuple[Tensor]:
        if self._kernel is not None:
            fast = self._kernel(call, relevance)
            if fast is not None:
                return (fast,)
        return (self.reference(call, relevance),)

    def reference(self, call: ParametricView, relevance: Tensor) -> Tensor:
        """The relevance of the input from the terms, one modified forward and one VJP per term."""
        (x,) = call.inputs
        inputs: list[Tensor] = []
        outputs: list[Tensor | None] = []
        live: list[int] = []
        with torch.enable_grad():
            for term in self._terms:
                modified = term.input(x).detach()
                bias = term.param(call.bias) if term.bias and not self.zero_bias and call.bias is not None else None
                inputs.append(modified)
                # x- of a non-negative input (after a ReLU) is all zeros: its term is the bias alone, no product
                if bias is None and not modified.any():
                    outputs.append(None)
                    continue
                modified.requires_grad_()
                outputs.append(call.evaluate(modified, term.param(call.weight), bias))
                live.append(len(outputs) - 1)
        if not live:  # every term vanished: no input, no bias, no relevance
            return torch.zeros_like(x)
        shape = next(out for out in outputs if out is not None)
        full = [torch.zeros_like(shape) if out is None else out for out in outputs]
        mapped = self._gradient_mapper(relevance, full, self._output(call))
        found = torch.autograd.grad([full[i] for i in live], [inputs[i] for i in live], [mapped[i] for i in live])
        grads = [torch.zeros_like(x) for x in inputs]
        for i, grad in zip(live, found):
            grads[i] = grad
        if self._reducer is not None:
            return self._reducer(inputs, grads)
        total = inputs[0] * grads[0]
        for modified, grad in zip(inputs[1:], grads[1:]):
            total = total + modified * grad
        return total

    def scaled(self, call: ParametricView) -> Scaled | None:
        """The terms as one traced product (:meth:`traced`), where the reducer is the default."""
        if self._reducer is not None or (self.zero_bias and self.needs_output):
            return None
        return Scaled(modified=self.traced)

    def traced(self, evaluate: Callable[[Tensor, Tensor, Tensor | None], Tensor], x: Tensor, weight: Tensor,
               bias: Tensor | None, z: Tensor, probe: Tensor | None, nonnegative: bool = False) -> Tensor:
        """``sum_t z_t * (z * m_t)``, ``m_t`` the mapper's share of term ``t`` per unit of relevance (held), so that
        the VJP of ``G`` at ``x`` times ``x`` is the rule's relevance for ``R = z * G``; with ``probe`` (ones) the
        modified inputs are the probe's and the VJP at the probe is the relevance (a rule that fills zeros).
        ``nonnegative``: ``x >= 0`` (a ReLU's output), so that its negative part's terms, without bias, are 0."""
        outputs: list[Tensor | None] = []
        for term in self._terms:
            term_bias = term.param(bias) if term.bias and not self.zero_bias and bias is not None else None
            if nonnegative and term.input is _negative and term_bias is None:
                outputs.append(None)
                continue
            modified = term.input(x) if probe is None else term.input(held(x)) * probe
            outputs.append(evaluate(modified, term.param(weight), term_bias))
        constant = [torch.zeros_like(z) if out is None else held(out) for out in outputs]
        shares = self._gradient_mapper(torch.ones_like(z), constant, z)
        total = torch.zeros_like(z)
        for out, share in zip(outputs, shares):
            if out is not None:
                total = total + out * held(z * share)
        return total

    def _output(self, call: ParametricView) -> Tensor | None:
        """The output the mapper reads: with ``zero_bias`` less the bias, the terms' own output.

        A Gamma group chosen by the sign of the biased output would divide by a
        bias-free sum of the other sign, or near 0, where the bias flips the sign.
        """
        if not self.needs_output:
            return None
        if self.zero_bias and call.bias is not None:
            return call.output - call.bias_term()
        return call.output


class ZPlus(BasicRule):
    """LRP-z+: only positive contributions (``x+ w+`` and ``x- w-``, bias ``b+``).

    Equals :class:`AlphaBeta` with ``alpha=1, beta=0``.
    """

    def __init__(self, stabilizer: float = 1e-6, zero_bias: bool = False):
        self.stabilizer = stabilizer
        super().__init__(POSITIVE_SHARE, Shares(stabilizer, groups=(2,)), zero_bias=zero_bias)


class AlphaBeta(BasicRule):
    """LRP-alpha-beta: ``alpha`` times the positive share minus ``beta`` times the negative share.

    Positive part: ``x+ w+`` and ``x- w-`` with ``b+``; negative part: ``x+ w-``
    and ``x- w+`` with ``b-``. Requires ``alpha - beta = 1``.
    """

    def __init__(self, alpha: float = 2.0, beta: float = 1.0, stabilizer: float = 1e-6, zero_bias: bool = False):
        if alpha < 0 or beta < 0 or not math.isclose(alpha - beta, 1.0):
            raise ValueError(f"AlphaBeta needs alpha, beta >= 0 and alpha - beta = 1, got alpha={alpha}, beta={beta}")
        self.alpha, self.beta, self.stabilizer = alpha, beta, stabilizer
        super().__init__(POSITIVE_SHARE + NEGATIVE_SHARE, Shares(stabilizer, groups=(2, 2), weights=(alpha, -beta)),
                         zero_bias=zero_bias)


class Gamma(BasicRule):
    """LRP-gamma in its generalised form for signed inputs.

    Where ``z > 0`` the relevance is shared by ``x+ (w + gamma w+)`` and
    ``x- (w + gamma w-)`` (bias ``b + gamma b+``); where ``z < 0`` by ``x+ (w +
    gamma w-)`` and ``x- (w + gamma w+)`` (bias ``b + gamma b-``). On
    non-negative inputs this is the original gamma rule. With ``zero_bias``
    ``z`` is the output less the bias (zennit's ``Gamma(zero_params='bias')``
    takes the sign of the biased output).
    """

    def __init__(self, gamma: float = 0.25, stabilizer: float = 1e-6, zero_bias: bool = False):
        self.gamma, self.stabilizer = gamma, stabilizer
        up, down = _Lift(gamma, _positive), _Lift(gamma, _negative)
        super().__init__(
            [Term(_positive, up), Term(_negative, down, bias=False),
             Term(_positive, down), Term(_negative, up, bias=False)],
            Shares(stabilizer, groups=(2, 2), where=(1, -1)),
            zero_bias=zero_bias,
        )


class ZBox(BasicRule):
    """LRP-z^B for a first layer on bounded input (pixels).

    Numerator ``x w - l w+ - h w-``, no bias. ``low`` and ``high`` are the
    smallest and largest possible input values, as scalars or tensors that
    broadcast against the layer's input (e.g. ``(1, 3, 1, 1)`` per channel).
    The bound images are padded exactly like the input. Where routing ops (a
    space-to-depth) sit between the model input and the layer, bounds of the
    model input's shape are taken through them.
    """

    def __init__(self, low: float | Tensor, high: float | Tensor, stabilizer: float = 1e-6):
        self.low, self.high, self.stabilizer = low, high, stabilizer
        super().__init__(
            [Term(_identity, _identity, bias=False), Term(_Bound(low), _positive, bias=False),
             Term(_Bound(high), _negative, bias=False)],
            Shares(stabilizer, groups=(3,), signs=(1, -1, -1)),
        )


class WSquare(BasicRule):
    """LRP-w^2: ``R_i = sum_j w_ij^2 / sum_i' w_i'j^2 R_j``, independent of the input."""

    def __init__(self, stabilizer: float = 1e-6, zero_bias: bool = False):
        self.stabilizer = stabilizer
        super().__init__([Term(_ones, _square)], Shares(stabilizer), zero_bias=zero_bias)


class Flat(BasicRule):
    """LRP-flat: every weight 1, no bias: relevance spread uniformly over the receptive field."""

    def __init__(self, stabilizer: float = 1e-6):
        self.stabilizer = stabilizer
        super().__init__([Term(_ones, _ones)], Shares(stabilizer), zero_bias=True)

    def conserves(self, call: ParametricView) -> bool:
        return True
