"""LRP rules: how the relevance of one operation's output reaches its inputs.

A rule is a small object with parameters. The engine hands it an *op call*
(see :class:`relprop.graph.OpCall`) describing one operation of the forward
pass, and the relevance arriving at that operation's output; the rule returns
the relevance of each of the operation's activation inputs.

The op call offers:

``kind``
    The op family: ``"conv"``, ``"dense"`` (parametric linear maps),
    ``"batchnorm"`` (a BatchNorm that could not be merged), ``"sum"`` (sums,
    means, average pooling, interpolation), ``"norm"`` (layer/group/RMS norm
    with the statistic held constant), ``"elementwise"``, ``"product"``,
    ``"maxpool"``.
``inputs``, ``output``
    The activation inputs and the output value of the forward pass.
``vjp(grad)``
    The vector-Jacobian product of the (linearised) operation with respect to
    its inputs, from the autograd graph kept from the forward pass.
``weight``, ``bias``, ``evaluate(x, weight, bias)``
    For parametric kinds: the parameters (a BatchNorm that follows is already
    merged in) and the operation re-evaluated with other inputs or parameters.

Linear rules follow the general form of docs/design.md, section 2: with modified
parameters ``rho`` the modified output ``z'`` is computed, ``s = R / (z' +
eps * sign(z'))`` and ``R_in = x * VJP(s)``.
"""
from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor

if TYPE_CHECKING:
    from .graph import OpCall, ParametricCall

__all__ = [
    "Rule", "Epsilon", "Norm", "BasicRule", "Term", "ZPlus", "AlphaBeta", "Gamma", "ZBox",
    "Flat", "WSquare", "Pass", "Gradient", "UniformProduct", "SignalTakesAll", "Softmax", "AsFunction", "Proportional",
    "SmoothStride",
    "denominator", "inverse_denominator", "LINEAR_KINDS", "PARAMETRIC_KINDS",
]

#: Op kinds that are linear in their activation inputs.
LINEAR_KINDS = frozenset({"conv", "dense", "batchnorm", "sum", "norm"})
#: Op kinds with a weight and a bias that rules may modify.
PARAMETRIC_KINDS = frozenset({"conv", "dense"})


def _stabilizer(epsilon: float, dtype: torch.dtype) -> float:
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
    epsilon = _stabilizer(epsilon, z.dtype)
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
    epsilon = _stabilizer(epsilon, z.dtype)
    if epsilon == 0:
        # one pass in place instead of `where(z == 0, 0, 1 / z)`: 6x faster on a transformer's small tensors,
        # where LRP-0 (AttnLRP) takes an inverse per linear layer
        inverse = z.reciprocal_() if in_place else z.reciprocal()
        return inverse.nan_to_num_(nan=math.nan, posinf=0.0, neginf=0.0)
    if in_place:
        return z.add_(epsilon).reciprocal_()
    # copysign(eps, 0.0) = +eps; the rare -0.0 gets -eps, the same magnitude. One new tensor, written in place:
    # on large tensors every fresh allocation costs page faults
    return torch.copysign(torch.tensor(epsilon, dtype=z.dtype, device=z.device), z).add_(z).reciprocal_()


def _sum_to(tensor: Tensor, shape: torch.Size) -> Tensor:
    """Sum ``tensor`` over the dimensions along which ``shape`` was broadcast."""
    return tensor if tensor.shape == shape else tensor.sum_to_size(shape)


class Rule:
    """Base class of all rules.

    Subclasses set :attr:`kinds` (the op kinds they apply to) and implement
    :meth:`propagate`.
    """

    #: op kinds this rule applies to
    kinds: frozenset[str] = frozenset()
    #: whether :meth:`propagate` calls ``call.vjp``: the engine then keeps the
    #: op's autograd graph from the forward pass instead of re-running it
    needs_vjp: bool = False
    #: whether :meth:`propagate` reads ``call.output`` (else it may be overwritten in place)
    needs_output: bool = False
    #: whether :meth:`prepare` reads ``call.output``
    prepares: bool = False
    #: whether an input entry that is 0 gets relevance 0, whatever relevance arrives (``R_i = x_i * c_i``). Only
    #: then may the op that computed the input read ``relu(z)`` for ``z`` after an in-place ReLU overwrote it
    #: (the engine computes ``z`` again otherwise). False unless a rule says so.
    zero_for_zero_input: bool = False

    def accepts(self, call: OpCall) -> bool:
        """Whether this rule can propagate through ``call``."""
        return call.kind in self.kinds

    def conserves(self, call: OpCall) -> bool:
        """Whether the relevance this rule hands to ``call``'s inputs adds up to what arrived, up to a stabiliser.

        Such a rule hands on ``sum_k R_k z_k / (z_k + eps)``, never more than
        ``sum_k |R_k|``; the engine reports an op whose rule says so but hands on
        more (:class:`~relprop.engine.ConservationWarning`). False unless a rule
        says so: biases and bounds take or give relevance by design.
        """
        return False

    def prepare(self, call: OpCall) -> None:
        """Precompute from ``call.output`` what :meth:`propagate` needs.

        Called once per call, at the start of the backward pass, or earlier if
        the output is about to be modified in place.
        """

    def propagate(self, call: OpCall, relevance: Tensor) -> tuple[Tensor | None, ...]:
        """Return the relevance of each of ``call.inputs`` given the output relevance."""
        raise NotImplementedError

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({params})"


class Epsilon(Rule):
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
    prepares = True
    zero_for_zero_input = True

    def __init__(self, epsilon: float = 1e-6, zero_bias: bool = False):
        self.epsilon = epsilon
        self.zero_bias = zero_bias

    def accepts(self, call: OpCall) -> bool:
        return super().accepts(call) and (not self.zero_bias or call.kind in PARAMETRIC_KINDS)

    def prepare(self, call: OpCall) -> None:
        if self.zero_bias and call.bias is not None:  # type: ignore[attr-defined]  # parametric kinds only
            call.inverse = inverse_denominator(call.output - call.bias_term(),  # type: ignore[attr-defined]
                                               self.epsilon)
        else:
            z = call.take_output() if call.output_nonnegative else None
            call.inverse = inverse_denominator(call.output if z is None else z, self.epsilon, in_place=z is not None)

    def propagate(self, call: OpCall, relevance: Tensor) -> tuple[Tensor | None, ...]:
        scaled = torch.mul(relevance, call.inverse, out=call.inverse)  # the inverse is read once
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


class Norm(Epsilon):
    """zennit's name for the epsilon rule on parameter-free ops (sum and average pooling).

    Identical to :class:`Epsilon` with ``epsilon=stabilizer``.
    """

    def __init__(self, stabilizer: float = 1e-6):
        super().__init__(epsilon=stabilizer)


def _identity(tensor: Tensor) -> Tensor:
    return tensor


def _positive(tensor: Tensor) -> Tensor:
    return tensor.clamp(min=0)


def _negative(tensor: Tensor) -> Tensor:
    return tensor.clamp(max=0)


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


class BasicRule(Rule):
    """A rule for parametric linear ops built from its parts.

    For each :class:`Term` ``t`` the op is evaluated as ``z_t = f(input_t(x);
    param_t(W), param_t(b))``. ``gradient_mapper(R, outputs, z)`` turns the
    output relevance into one tensor ``s_t`` per term (typically ``R``
    divided by a stabilised sum of outputs); ``reducer(inputs, grads)``
    combines the modified inputs with the VJPs ``c_t = VJP_t(s_t)``
    (default: ``sum_t input_t * c_t``).

    Parameters
    ----------
    terms : sequence of Term
    gradient_mapper : callable ``(relevance, outputs, z) -> list[Tensor]``
    reducer : callable ``(inputs, grads) -> Tensor``, optional
    zero_bias : bool
        Drop the bias from every term.
    """

    kinds = PARAMETRIC_KINDS
    needs_output = True  # the gradient mapper receives z; the built-in rules that ignore it say so

    def __init__(
        self,
        terms: Sequence[Term],
        gradient_mapper: Callable[[Tensor, list[Tensor], Tensor], list[Tensor]],
        reducer: Callable[[list[Tensor], list[Tensor]], Tensor] | None = None,
        zero_bias: bool = False,
    ):
        self._terms = tuple(terms)
        self._gradient_mapper = gradient_mapper
        self._reducer = reducer or _weighted_sum
        self.zero_bias = zero_bias

    #: ``propagate_split(call, relevance, split) -> Tensor``: the rule's fast form on an input split by sign
    #: (see :class:`_Split`), or None if it has none
    propagate_split: Callable[..., Tensor] | None = None
    #: whether that fast form takes inputs of both signs; else only non-negative ones (after a ReLU)
    splits_signed: bool = False

    def propagate(self, call: ParametricCall, relevance: Tensor) -> tuple[Tensor]:  # type: ignore[override]
        split = None
        if self.propagate_split is not None:
            split = _split_input(call, self.zero_bias, self.splits_signed)
        if split is not None:
            return (self.propagate_split(call, relevance, split),)  # type: ignore[misc]
        (x,) = call.inputs
        inputs, outputs, live = [], [], []  # type: ignore[var-annotated]
        with torch.enable_grad():
            for term in self._terms:
                modified = term.input(x).detach()
                keep_bias = term.bias and not self.zero_bias and call.bias is not None
                bias = term.param(call.bias) if keep_bias else None  # type: ignore[arg-type]
                # x- of a non-negative input (after a ReLU) is all zeros: its term is the bias alone, no product
                if bias is None and not modified.any():
                    inputs.append(modified)
                    outputs.append(None)  # type: ignore[arg-type]
                    continue
                modified.requires_grad_()
                inputs.append(modified)
                outputs.append(call.evaluate(modified, term.param(call.weight), bias))
                live.append(len(outputs) - 1)
        if not live:  # every term vanished: no input, no bias, no relevance
            return (torch.zeros_like(x),)
        shape = outputs[live[0]]
        outputs = [torch.zeros_like(shape) if out is None else out for out in outputs]
        mapped = self._gradient_mapper(relevance, outputs, call.output)
        found = torch.autograd.grad([outputs[i] for i in live], [inputs[i] for i in live], [mapped[i] for i in live])
        grads = [torch.zeros_like(x) for x in inputs]
        for i, grad in zip(live, found):
            grads[i] = grad
        return (self._reducer(inputs, grads),)


def _weighted_sum(inputs: list[Tensor], grads: list[Tensor]) -> Tensor:
    return sum(x * c for x, c in zip(inputs, grads))  # type: ignore[return-value]


def _split(relevance: Tensor, outputs: list[Tensor], epsilon: float, groups: Sequence[int]) -> list[Tensor]:
    """Divide the relevance by the stabilised sum of each group of consecutive outputs."""
    grads, start = [], 0
    for size in groups:
        scaled = relevance / denominator(sum(outputs[start:start + size]), epsilon)  # type: ignore[arg-type]
        grads.extend([scaled] * size)
        start += size
    return grads


@dataclass
class _Split:
    """A parametric op's input split by sign, for the fast forms of z+, alpha-beta and gamma.

    ``positive`` is ``P = W+ x+ + W- x- + b+``, the sum of all positive
    contributions, so that ``z - P`` is the sum of all negative ones: one
    modified forward instead of one per term, and transposed products only.
    On a non-negative input (after a ReLU) ``x_neg`` and ``w_neg`` are None
    and ``P = W+ x + b+``; a rule that needs ``W-`` there writes it over
    ``w_pos`` once done with that (:meth:`ParametricCall.negative_weight`). On
    a signed input ``stacked`` holds ``x+`` and ``x-`` side by side and the
    weights to match (:meth:`ParametricCall.stack_signs`), so that one
    transposed product gives ``W+^T s`` and ``W-^T s`` (``w_pos`` and ``w_neg``
    are None then); where the weight does not allow that (grouped
    convolutions) ``stacked`` is None and each takes its own product.
    ``z`` is the op's output; where an in-place ReLU has since zeroed it, the
    relevance arriving there is 0, so every use stays exact.
    """

    x_pos: Tensor
    x_neg: Tensor | None
    positive: Tensor | None
    w_pos: Tensor | None
    w_neg: Tensor | None
    stacked: tuple[Tensor, Tensor] | None = None

    def take_positive(self) -> Tensor:
        """``positive``, handed over: the rule writes into it, and it is freed as soon as the rule lets go."""
        positive, self.positive = self.positive, None
        return positive  # type: ignore[return-value]  # handed over once


def _split_input(call: ParametricCall, zero_bias: bool, signed: bool) -> _Split | None:
    """The op's input split by sign when a fast form applies (``signed``: also to negative entries), else None."""
    if zero_bias or call.kind not in PARAMETRIC_KINDS or not getattr(call, "transposable", False):
        return None
    (x,) = call.inputs
    nonnegative = call.input_nonnegative or not bool(x.amin() < 0)  # else one reduction pass, no mask tensor
    if not (nonnegative or signed):
        return None
    b_pos = call.bias.clamp(min=0) if call.bias is not None else None
    if nonnegative:
        w_pos, _ = call.weight_parts(negative=False)
        return _Split(x, None, call.evaluate(x, w_pos, b_pos), w_pos, None)
    stacked = call.stack_signs(x)
    if stacked is not None:
        inputs, weights = stacked
        return _Split(*inputs.chunk(2, call.input_channel_axis(x)),  # type: ignore[call-arg, misc, arg-type]
                      call.evaluate(inputs, weights, b_pos), None, None, stacked=stacked)
    w_pos, w_neg = call.weight_parts(negative=True)
    x_pos, x_neg = x.clamp(min=0), x.clamp(max=0)
    positive = call.evaluate(x_pos, w_pos, b_pos).add_(call.evaluate(x_neg, w_neg, None))
    return _Split(x_pos, x_neg, positive, w_pos, w_neg)


def _nonnegative_denominator(z: Tensor, epsilon: float) -> Tensor:
    """:func:`denominator` of a ``z >= 0`` that the caller owns, in place: ``z + epsilon``."""
    epsilon = _stabilizer(epsilon, z.dtype)
    return z.add_(epsilon) if epsilon else z.masked_fill_(z == 0, math.inf)


def _nonpositive_denominator(z: Tensor, epsilon: float) -> Tensor:
    """``z - epsilon`` of a ``z <= 0`` that the caller owns, in place.

    It differs from :func:`denominator` only where ``z == 0``; there every
    product ``x_i w_ij`` summed into ``z`` is 0 as well, so the relevance is
    exactly 0 with either sign.
    """
    epsilon = _stabilizer(epsilon, z.dtype)
    return z.sub_(epsilon) if epsilon else z.masked_fill_(z == 0, -math.inf)


class ZPlus(BasicRule):
    """LRP-z+: only positive contributions (``x+ w+`` and ``x- w-``, bias ``b+``).

    Equals :class:`AlphaBeta` with ``alpha=1, beta=0``.
    """

    zero_for_zero_input = True
    needs_output = False

    splits_signed = True

    def propagate_split(self, call: ParametricCall, relevance: Tensor, split: _Split) -> Tensor:
        shared = _nonnegative_denominator(split.take_positive(), self.stabilizer)  # P >= 0
        shared = torch.div(relevance, shared, out=shared)
        if split.stacked is not None:  # x+ W+^T s and x- W-^T s side by side: the relevance is their sum
            inputs, weights = split.stacked
            both = call.transpose_with(shared, weights, like=inputs).mul_(inputs)
            return torch.add(*both.chunk(2, call.input_channel_axis(both)))
        grad = call.transpose_with(shared, split.w_pos).mul_(split.x_pos)  # type: ignore[arg-type]
        if split.x_neg is None:
            return grad
        return grad.add_(call.transpose_with(shared, split.w_neg).mul_(split.x_neg))  # type: ignore[arg-type]

    def __init__(self, stabilizer: float = 1e-6, zero_bias: bool = False):
        self.stabilizer = stabilizer
        super().__init__(
            [Term(_positive, _positive), Term(_negative, _negative, bias=False)],
            lambda r, outs, z: _split(r, outs, stabilizer, [2]),
            zero_bias=zero_bias,
        )


class AlphaBeta(BasicRule):
    """LRP-alpha-beta: ``alpha`` times the positive share minus ``beta`` times the negative share.

    Positive part: ``x+ w+`` and ``x- w-`` with ``b+``; negative part: ``x+ w-``
    and ``x- w+`` with ``b-``. Requires ``alpha - beta = 1``.
    """

    zero_for_zero_input = True
    needs_output = True  # the fast form reads z

    splits_signed = True

    def propagate_split(self, call: ParametricCall, relevance: Tensor, split: _Split) -> Tensor:
        # P >= 0 and N = z - P <= 0: the sums of the positive and of the negative contributions. x+ takes the
        # positive ones through W+ and the negative ones through W-, x- the other way round. Each quotient
        # is freed once its products are done: at most four map-sized tensors at once, the relevance included.
        # (W-^T n as W^T n - W+^T n would spare W-, but cancels badly where N is near 0.)
        z = call.take_output()
        negative = (torch.sub(call.output, split.positive) if z is None  # type: ignore[arg-type]
                    else z.sub_(split.positive))  # type: ignore[arg-type]
        del z  # `negative` alone holds the output's memory now: freed with it
        negative = _nonpositive_denominator(negative, self.stabilizer)
        negative = torch.div(relevance, negative, out=negative)
        if split.x_neg is None:  # x >= 0: W+ first, then W- written over it, one weight-sized tensor fewer
            positive = _nonnegative_denominator(split.take_positive(), self.stabilizer)
            positive = torch.div(relevance, positive, out=positive)
            on_pos = call.transpose_with(positive, split.w_pos)  # type: ignore[arg-type]
            del positive
            w_neg = call.negative_weight(out=split.w_pos)  # type: ignore[arg-type]
            return call.transpose_with(negative, w_neg).mul_(-self.beta).add_(on_pos, alpha=self.alpha) \
                .mul_(split.x_pos)
        if split.stacked is not None:  # one transposed product per quotient gives both of its halves
            inputs, weights = split.stacked
            axis = call.input_channel_axis(inputs)
            on_negative = call.transpose_with(negative, weights, like=inputs)  # W+^T n | W-^T n
            del negative
            positive = _nonnegative_denominator(split.take_positive(), self.stabilizer)
            positive = torch.div(relevance, positive, out=positive)
            both = call.transpose_with(positive, weights, like=inputs)  # W+^T p | W-^T p
            del positive
            (n_pos, n_neg), (p_pos, p_neg) = on_negative.chunk(2, axis), both.chunk(2, axis)
            p_pos.mul_(self.alpha).sub_(n_neg, alpha=self.beta)  # x+: alpha W+^T p - beta W-^T n
            p_neg.mul_(self.alpha).sub_(n_pos, alpha=self.beta)  # x-: alpha W-^T p - beta W+^T n
            del on_negative, n_pos, n_neg
            both.mul_(inputs)
            return torch.add(p_pos, p_neg)
        on_pos = call.transpose_with(negative, split.w_neg).mul_(-self.beta)  # type: ignore[arg-type]
        on_neg = call.transpose_with(negative, split.w_pos).mul_(-self.beta)  # type: ignore[arg-type]
        del negative
        positive = _nonnegative_denominator(split.take_positive(), self.stabilizer)
        positive = torch.div(relevance, positive, out=positive)
        grad = on_pos.add_(call.transpose_with(positive, split.w_pos),  # type: ignore[arg-type]
                           alpha=self.alpha).mul_(split.x_pos)
        on_neg = on_neg.add_(call.transpose_with(positive, split.w_neg), alpha=self.alpha)  # type: ignore[arg-type]
        return grad.add_(on_neg.mul_(split.x_neg))  # type: ignore[arg-type]

    def __init__(self, alpha: float = 2.0, beta: float = 1.0, stabilizer: float = 1e-6, zero_bias: bool = False):
        if alpha < 0 or beta < 0 or not math.isclose(alpha - beta, 1.0):
            raise ValueError(f"AlphaBeta needs alpha, beta >= 0 and alpha - beta = 1, got alpha={alpha}, beta={beta}")
        self.alpha, self.beta, self.stabilizer = alpha, beta, stabilizer

        def reduce(inputs: list[Tensor], grads: list[Tensor]) -> Tensor:
            positive = inputs[0] * grads[0] + inputs[1] * grads[1]
            negative = inputs[2] * grads[2] + inputs[3] * grads[3]
            return alpha * positive - beta * negative

        super().__init__(
            [
                Term(_positive, _positive), Term(_negative, _negative, bias=False),
                Term(_positive, _negative), Term(_negative, _positive, bias=False),
            ],
            lambda r, outs, z: _split(r, outs, stabilizer, [2, 2]),
            reduce,
            zero_bias=zero_bias,
        )


class Gamma(BasicRule):
    """LRP-gamma in its generalised form for signed inputs.

    Where ``z > 0`` the relevance is shared by ``x+ (w + gamma w+)`` and
    ``x- (w + gamma w-)`` (bias ``b + gamma b+``); where ``z < 0`` by ``x+ (w +
    gamma w-)`` and ``x- (w + gamma w+)`` (bias ``b + gamma b-``). On
    non-negative inputs this is the original gamma rule.
    """

    zero_for_zero_input = True
    needs_output = True

    def propagate_split(self, call: ParametricCall, relevance: Tensor, split: _Split) -> Tensor:
        # z > 0: x (W + g W+) shares R over z + t, with t = g P + eps; z < 0: x (W + g W-) over (1 + g) z - t,
        # as W- x + b- = z - P. Divided by 1 + g, that is z - t / (1 + g). So with w = 1 where z > 0 and
        # w = -1 / (1 + g) where z < 0, one quotient a = R / (z + w t) serves both, and as W- = W - W+:
        # (W + g W+)^T up + (W + g W-)^T down = W^T a + g W+^T (w a). No masks, no where: each is a pass, on
        # two map-sized tensors: t and the output's memory (a copy where the output is not writable).
        gamma = self.gamma
        slope = 1 / (1 + gamma)
        z = call.take_output()
        z = call.output.clone() if z is None else z
        epsilon = _stabilizer(self.stabilizer, z.dtype)
        t = split.take_positive().mul_(gamma).add_(epsilon)
        # w t as a leaky ReLU of copysign(t, z); z + w t has the sign of z and |z + w t| >= t
        shared = F.leaky_relu_(t.copysign_(z), slope).add_(z)
        a = z.ne_(0).mul_(relevance).div_(shared)  # where z = 0 nothing is shared
        del z  # `a` alone holds the output's memory now: freed before the second transposed product
        if not epsilon:  # t may be 0 too there
            a = a.nan_to_num_(0.0, 0.0, 0.0)
        (grad,) = call.vjp(a)  # W^T a; a merged BatchNorm's scale goes onto the smaller operand
        w_a = F.leaky_relu_(shared.sign_(), slope).mul_(a)  # w from the sign of z + w t, which is that of z
        del a
        return grad.add_(call.transpose_with(w_a, split.w_pos),  # type: ignore[union-attr, arg-type]
                         alpha=gamma).mul_(split.x_pos)

    def __init__(self, gamma: float = 0.25, stabilizer: float = 1e-6, zero_bias: bool = False):
        self.gamma, self.stabilizer = gamma, stabilizer

        def up(t: Tensor) -> Tensor:
            return t + gamma * t.clamp(min=0)

        def down(t: Tensor) -> Tensor:
            return t + gamma * t.clamp(max=0)

        def mapper(relevance: Tensor, outputs: list[Tensor], z: Tensor) -> list[Tensor]:
            positive = relevance * (z > 0) / denominator(outputs[0] + outputs[1], stabilizer)
            negative = relevance * (z < 0) / denominator(outputs[2] + outputs[3], stabilizer)
            return [positive, positive, negative, negative]

        super().__init__(
            [
                Term(_positive, up), Term(_negative, down, bias=False),
                Term(_positive, down), Term(_negative, up, bias=False),
            ],
            mapper,
            zero_bias=zero_bias,
        )


class ZBox(BasicRule):
    """LRP-z^B for a first layer on bounded input (pixels).

    Numerator ``x w - l w+ - h w-``, no bias. ``low`` and ``high`` are the
    smallest and largest possible input values, as scalars or tensors that
    broadcast against the layer's input (e.g. ``(1, 3, 1, 1)`` per channel).
    The bound images are padded exactly like the input.
    """

    needs_output = True  # the fast form reads x W as z - b

    def propagate(self, call: ParametricCall, relevance: Tensor) -> tuple[Tensor]:  # type: ignore[override]
        (x,) = call.inputs
        low, high = self._fitted(call, x)
        if not getattr(call, "transposable", False):
            if (low, high) != (self.low, self.high):
                raise ValueError(f"relprop: ZBox bounds of shape {tuple(torch.as_tensor(self.low).shape)} do not "
                                 f"broadcast against the input {tuple(x.shape)} of {call.describe()}; pass bounds "
                                 "of the layer's input shape")
            return super().propagate(call, relevance)
        # x W - l W+ - h W-: x W is the output less its bias; bounds shared by the batch are evaluated once
        w_pos, w_neg = call.weight_parts(negative=True)
        z = call.take_output()
        if z is None:
            z = call.output - call.bias_term() if call.bias is not None else call.output.clone()
        elif call.bias is not None:
            z = z.sub_(call.bias_term())
        bounds = self._bound_weight(call, x, low, high, w_pos, w_neg)
        if bounds is not None:
            z = z.sub_(call.evaluate(torch.ones_like(x[:1]), bounds, None))
        else:
            low, high = _bound_image(low, x), _bound_image(high, x)
            z = z.sub_(call.evaluate(low, w_pos, None)).sub_(call.evaluate(high, w_neg, None))
        shared = denominator(z, self.stabilizer)
        del z
        shared = torch.div(relevance, shared, out=shared)
        if bounds is not None:
            on_x, on_bounds = call.transpose_beside(shared, bounds)
            return (torch.sub(on_x.mul_(x), on_bounds),)
        grad = call.vjp(shared)[0].mul_(x)  # type: ignore[union-attr]
        grad.sub_(call.transpose_with(shared, w_pos).mul_(low))
        return (grad.sub_(call.transpose_with(shared, w_neg).mul_(high)),)

    def _fitted(self, call: ParametricCall, x: Tensor) -> tuple[float | Tensor, float | Tensor]:
        """The bounds, where they broadcast against the layer's input ``x``; else as images taken from the model
        input's space through the routing ops that made ``x`` (a space-to-depth before the first layer).
        """
        bounds = (self.low, self.high)
        if all(_broadcasts_to(torch.as_tensor(bound).shape, x.shape) for bound in bounds):
            return bounds
        routed = tuple(call.routed_image(bound) for bound in bounds) if hasattr(call, "routed_image") else (None,)
        if any(image is None for image in routed):
            raise ValueError(f"relprop: ZBox bounds of shape {tuple(torch.as_tensor(self.low).shape)} and "
                             f"{tuple(torch.as_tensor(self.high).shape)} do not broadcast against the input "
                             f"{tuple(x.shape)} of {call.describe()}, which is not the model input rearranged; pass "
                             "bounds of the layer's input shape, or scalars")
        return routed  # type: ignore[return-value]  # none is None here

    def _bound_weight(self, call: ParametricCall, x: Tensor, low: float | Tensor, high: float | Tensor, w_pos: Tensor,
                      w_neg: Tensor) -> Tensor | None:
        """``l W+ + h W-`` in ``w_pos``'s memory, where both bounds are the same at every position of a channel.

        Then ``l W+ + h W-`` on an image of ones is ``l W+ + h W-`` of the
        bound images (padded alike), and one transposed product of it serves
        both bound terms: one forward and one transposed product fewer; that
        product and ``W``'s are one product too
        (:meth:`ParametricCall.transpose_beside`). With ``l <= 0 <= h`` both
        terms are <= 0, so the sum cancels nothing. None where a bound varies
        over positions or examples, or the weight is grouped.
        """
        axis = call.input_channel_axis(x)
        low, high = (_channel_vector(bound, x, axis) for bound in (low, high))  # type: ignore[assignment]
        if low is None or high is None or call.scale_input_channels(w_neg, high) is None:  # type: ignore[arg-type]
            return None
        return call.scale_input_channels(w_pos, low).add_(w_neg)  # type: ignore[union-attr, arg-type]

    def __init__(self, low: float | Tensor, high: float | Tensor, stabilizer: float = 1e-6):
        self.low, self.high, self.stabilizer = low, high, stabilizer

        def mapper(relevance: Tensor, outputs: list[Tensor], z: Tensor) -> list[Tensor]:
            return [relevance / denominator(outputs[0] - outputs[1] - outputs[2], stabilizer)] * 3

        def reduce(inputs: list[Tensor], grads: list[Tensor]) -> Tensor:
            return inputs[0] * grads[0] - inputs[1] * grads[1] - inputs[2] * grads[2]

        super().__init__(
            [
                Term(_identity, _identity),
                Term(lambda x: _bound_image(low, x).expand_as(x), _positive),
                Term(lambda x: _bound_image(high, x).expand_as(x), _negative),
            ],
            mapper,
            reduce,
        )


def _bound_image(value: float | Tensor, x: Tensor) -> Tensor:
    """A bound as an input image: of one example where it is the same for every example, else of the batch."""
    bound = torch.as_tensor(value, dtype=x.dtype, device=x.device)
    per_example = bound.dim() == x.dim() and bound.shape[0] != 1
    return bound.expand_as(x if per_example else x[:1])


def _channel_vector(value: float | Tensor, x: Tensor, axis: int) -> Tensor | None:
    """A bound as one value per channel (``axis`` of ``x``), if it is the same at every position; else None."""
    bound = torch.as_tensor(value, dtype=x.dtype, device=x.device)
    if bound.dim() > x.dim():
        return None
    shape = (1,) * (x.dim() - bound.dim()) + tuple(bound.shape)
    if any(size != 1 for dim, size in enumerate(shape) if dim != axis):
        return None
    return bound.reshape(-1).expand(x.shape[axis])


def _ones(tensor: Tensor) -> Tensor:
    return torch.ones_like(tensor)


def _square(tensor: Tensor) -> Tensor:
    return tensor * tensor


def _gradient_only(inputs: list[Tensor], grads: list[Tensor]) -> Tensor:
    return grads[0]


class WSquare(BasicRule):
    """LRP-w^2: ``R_i = sum_j w_ij^2 / sum_i' w_i'j^2 R_j``, independent of the input."""

    needs_output = False

    def __init__(self, stabilizer: float = 1e-6, zero_bias: bool = False):
        self.stabilizer = stabilizer
        super().__init__(
            [Term(_ones, _square)],
            lambda r, outs, z: _split(r, outs, stabilizer, [1]),
            _gradient_only,
            zero_bias=zero_bias,
        )


class Flat(BasicRule):
    """LRP-flat: every weight 1, no bias: relevance spread uniformly over the receptive field."""

    needs_output = False

    def __init__(self, stabilizer: float = 1e-6):
        self.stabilizer = stabilizer
        super().__init__(
            [Term(_ones, _ones)],
            lambda r, outs, z: _split(r, outs, stabilizer, [1]),
            _gradient_only,
            zero_bias=True,
        )

    def conserves(self, call: OpCall) -> bool:
        return True


class Pass(Rule):
    """Pass the output relevance unchanged to the op's single activation input.

    Applies to any op with one activation input whose shape the output can be
    summed back to (elementwise ops, scaling by constants); it cannot apply
    to a shape-changing op such as a convolution with other channels.
    """

    needs_output = False

    kinds = frozenset({"conv", "dense", "batchnorm", "sum", "norm", "elementwise", "product", "maxpool", "softmax"})

    def accepts(self, call: OpCall) -> bool:
        if call.kind not in self.kinds or len(call.inputs) != 1:
            return False
        return _broadcasts_to(call.inputs[0].shape, call.output.shape)

    def propagate(self, call: OpCall, relevance: Tensor) -> tuple[Tensor | None, ...]:
        return (_sum_to(relevance, call.inputs[0].shape),)

    def conserves(self, call: OpCall) -> bool:
        return True


def _broadcasts_to(shape: torch.Size, target: torch.Size) -> bool:
    if len(shape) > len(target):
        return False
    return all(s in (1, t) for s, t in zip(reversed(shape), reversed(target)))


class Gradient(Rule):
    """The op's plain gradient applied to the relevance.

    Exact for ops that only move values (max pooling is winner-take-all this
    way); for other ops relevance is not what comes out. The engine uses it,
    with a warning, for ops it has no rule for.
    """

    kinds = frozenset({"conv", "dense", "batchnorm", "sum", "norm", "elementwise", "product", "maxpool", "softmax",
                       "unknown"})
    needs_vjp = True

    def propagate(self, call: OpCall, relevance: Tensor) -> tuple[Tensor | None, ...]:
        return call.vjp(relevance)


class UniformProduct(Rule):
    """Products of activations (``a * b``, ``a @ b``): each of the k factors gets 1/k.

    ``R_i = (1/k) * x_i * VJP_i(R / (z + eps sign z))`` (the AttnLRP rule for
    multiplicative interactions). On fused attention (``kind == "attention"``)
    both matrix products are split this way and the softmax takes its
    :class:`Softmax` rule, so that q and k share half and v gets half.
    """

    zero_for_zero_input = True
    kinds = frozenset({"product", "attention"})
    needs_vjp = True
    prepares = True

    def __init__(self, epsilon: float = 1e-6):
        self.epsilon = epsilon

    def prepare(self, call: OpCall) -> None:
        if call.kind == "product":
            call.inverse = inverse_denominator(call.output, self.epsilon).div_(len(call.inputs))

    def conserves(self, call: OpCall) -> bool:
        return call.kind == "product"  # a product of k activations is k-linear: x * grad sums to k z

    def propagate(self, call: OpCall, relevance: Tensor) -> tuple[Tensor | None, ...]:
        if call.kind == "attention":
            return call.attention_relevance(relevance, self.epsilon, values_only=False)  # type: ignore[attr-defined]
        return tuple(None if c is None else x * c for x, c in zip(call.inputs, call.vjp(relevance * call.inverse)))


class SignalTakesAll(Rule):
    """Gated products ``gate * signal``: the signal gets all relevance, the gate none.

    Which factor is the gate the composite decides from what produced it: a
    sigmoid (LSTM gates, Arras et al. 2017; squeeze-and-excitation), a
    normalising statistic (``x * rsqrt(var)``), a divisor, and for CP-LRP
    also attention weights and activations of gated MLPs. On fused attention
    all relevance goes to the values (CP-LRP).
    """

    kinds = frozenset({"product", "attention"})
    needs_vjp = True  # for matrix products: the linear map of the signal, with the gate held constant
    prepares = True

    def __init__(self, epsilon: float = 1e-6):
        self.epsilon = epsilon

    def accepts(self, call: OpCall) -> bool:
        """Fused attention, or a product with a gate and at most one other activation factor.

        A gate times a constant (``r * b_hn`` at the first step of a GRU): the
        relevance belongs to the constant, and is absorbed.
        """
        if call.kind == "attention":
            return True
        gates = getattr(call, "gates", ())
        return call.kind in self.kinds and any(gates) and len(gates) - sum(gates) <= 1

    def prepare(self, call: OpCall) -> None:
        if getattr(call, "matrix", False):
            call.inverse = inverse_denominator(call.output, self.epsilon)

    def conserves(self, call: OpCall) -> bool:
        """A gate times a constant gives the constant the relevance; else the signal takes all of it."""
        return call.kind == "attention" or not all(call.gates)

    def propagate(self, call: OpCall, relevance: Tensor) -> tuple[Tensor | None, ...]:
        if call.kind == "attention":
            return call.attention_relevance(relevance, self.epsilon, values_only=True)  # type: ignore[attr-defined]
        if getattr(call, "matrix", False):  # attn @ v: epsilon rule of v's linear map
            grads = call.vjp(relevance * call.inverse)
            return tuple(None if gate else x * c  # type: ignore[operator]
                         for x, c, gate in zip(call.inputs, grads, call.gates))
        # gate * signal elementwise: the signal's share is all of it
        return tuple(None if gate else _sum_to(relevance, x.shape) for x, gate in zip(call.inputs, call.gates))


class Softmax(Rule):
    """Softmax inside the model (AttnLRP): ``R_x = x * (R - s * sum(R))`` along the softmax dimension.

    This equals Gradient x Input through the softmax. It is not conservative:
    the softmax absorbs what its input's shift does not explain. Masked
    entries (``x = -inf``) get 0, never NaN.
    """

    zero_for_zero_input = True
    kinds = frozenset({"softmax"})
    needs_output = True

    def propagate(self, call: OpCall, relevance: Tensor) -> tuple[Tensor | None, ...]:
        (x,) = call.inputs
        s = call.output
        taylor = relevance.to(s.dtype) - s * relevance.to(s.dtype).sum(call.dim, keepdim=True)
        out = torch.where(torch.isfinite(x), x * taylor.to(x.dtype), 0.0)
        return (out,)


def _arguments(call: OpCall) -> dict[str, Any] | None:
    """The op's arguments other than its activation input, by the names its torch function gives them.

    Parametric ops (convolutions, dense layers) give ``weight`` and ``bias``, a
    merged BatchNorm included, and their options (``stride``, ``padding``,
    ``dilation``, ``groups``); other ops their arguments bound to their
    signature, defaults filled in (``kernel_size``, ``stride``, ... of
    ``F.max_pool2d``). None where the function has no signature to bind to.
    """
    # the op call keeps its arguments as they were given (private to relprop.graph): read here, never written
    if call.kind in PARAMETRIC_KINDS:
        return {"weight": call.weight, "bias": call.bias, **call._constants}  # type: ignore[attr-defined]
    if call._spec is not None:  # activations nested in containers: no single input to replace
        return None
    # F.max_pool2d and kin dispatch on return_indices between two functions of one signature
    func = torch._jit_internal.boolean_dispatched.get(call.func, {}).get("if_false", call.func)
    try:
        bound = inspect.signature(func).bind(*call._leaves, **call._constants)
    except (TypeError, ValueError):  # a builtin without a signature, or arguments it does not take
        return None
    bound.apply_defaults()
    return {name: value for name, value in bound.arguments.items()
            if not any(value is x for x in call.inputs)}


class AsFunction(Rule):
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

    def accepts(self, call: OpCall) -> bool:
        """An op of the rule's kinds with one activation input and arguments the surrogate can be given."""
        return call.kind in self.kinds and len(call.inputs) == 1 and _arguments(call) is not None

    def surrogate_output(self, call: OpCall, x: Tensor) -> Tensor:
        """The surrogate at ``x`` with ``call``'s arguments; rules that build the surrogate from the call override it."""
        return self.surrogate(x, **_arguments(call))  # type: ignore[arg-type]  # accepts() checked the arguments

    def propagate(self, call: OpCall, relevance: Tensor) -> tuple[Tensor | None, ...]:
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


class Proportional(AsFunction):
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

    def accepts(self, call: OpCall) -> bool:
        return call.kind in self.kinds and len(call.inputs) == 1

    def conserves(self, call: OpCall) -> bool:
        return True

    def surrogate_output(self, call: OpCall, x: Tensor) -> Tensor:
        return call.average(x)  # the op family's average pooling over the op's own windows (relprop.ops)


class SmoothStride(AsFunction):
    """A strided 1x1 convolution propagated as if it read the average of each stride x stride block of its input.

    A 1x1 convolution with stride ``s`` (ResNet's downsampling shortcut)
    reads one pixel of every ``s x s`` block, so it hands relevance to those
    pixels alone: a checkerboard in the heatmap. This rule propagates it as
    the convolution with an ``s x s`` kernel of ``weight / s**2`` on each tap
    and stride ``s``, the bias kept, so every pixel of a block shares the
    block's relevance. A block that runs over the input's last row or column
    reads zeros there, as padding. The forward pass is unchanged.

    By default the smoothed convolution takes the epsilon rule (this is
    :class:`AsFunction` of it); ``rule`` gives it another rule for
    convolutions, as the presets do with ``smooth_stride=True`` (their own
    rule for convolutions: :class:`ZPlus` for ``epsilon-plus``). With
    :class:`Epsilon` or :class:`ZPlus` and no bias (a merged BatchNorm's
    shift included), it conserves.

    Applies to ``conv1d``, ``conv2d`` and ``conv3d`` with a kernel of size 1
    and a stride above 1 along some dimension.

    Parameters
    ----------
    epsilon : float
        Stabiliser of the epsilon rule's denominator (without ``rule``).
    rule : BasicRule, optional
        The rule of the smoothed convolution (:class:`ZPlus`,
        :class:`AlphaBeta`, :class:`Gamma`, :class:`Flat`, :class:`WSquare`),
        in its term form; None for the epsilon rule.
    """

    def __init__(self, epsilon: float = 1e-6, rule: BasicRule | None = None):
        if rule is not None and (not isinstance(rule, BasicRule) or isinstance(rule, ZBox)):
            raise TypeError(f"relprop: SmoothStride's rule is None (epsilon) or a rule for convolutions built from "
                            f"terms (ZPlus, AlphaBeta, Gamma, Flat, WSquare), got {rule!r}")
        super().__init__(_no_surrogate, epsilon, kinds=("conv",))
        self.rule = rule

    def accepts(self, call: OpCall) -> bool:
        """Whether ``call`` is a convolution with a 1x1 kernel and a stride above 1 (answered before it runs)."""
        if call.kind not in self.kinds or call.func not in _CONVOLUTIONS or len(call.inputs) != 1:
            return False
        options = _arguments(call)
        dims = call.weight.dim() - 2  # type: ignore[attr-defined]  # convolutions are parametric
        return (options is not None and not isinstance(options.get("padding", 0), str)
                and all(size == 1 for size in call.weight.shape[2:])  # type: ignore[attr-defined]
                and any(step > 1 for step in _per_dim(options.get("stride", 1), dims)))

    def conserves(self, call: OpCall) -> bool:
        if self.rule is not None:
            return self.rule.conserves(call)
        return call.bias is None  # type: ignore[attr-defined]

    def surrogate_output(self, call: OpCall, x: Tensor) -> Tensor:
        smoothed = _SmoothedConv.of(call)
        return smoothed.evaluate(x, smoothed.weight, smoothed.bias)

    def propagate(self, call: OpCall, relevance: Tensor) -> tuple[Tensor | None, ...]:
        if self.rule is None:
            return super().propagate(call, relevance)
        return self.rule.propagate(_SmoothedConv.of(call), relevance)  # type: ignore[arg-type]

    def __repr__(self) -> str:
        return f"SmoothStride(epsilon={self.epsilon!r}, rule={self.rule!r})"


@dataclass
class _SmoothedConv:
    """A strided 1x1 convolution's stride x stride average, as a rule for convolutions sees an op call.

    It offers what the term form of a :class:`BasicRule` reads (``inputs``,
    ``weight``, ``bias``, ``evaluate``, ``output``); it is not transposable,
    so the fused forms do not apply.
    """

    call: OpCall
    weight: Tensor
    bias: Tensor | None
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    groups: int
    kind: str = "conv"

    @classmethod
    def of(cls, call: OpCall) -> _SmoothedConv:
        options = _arguments(call)
        weight = options["weight"]  # type: ignore[index]
        dims = weight.dim() - 2
        stride = _per_dim(options.get("stride", 1), dims)  # type: ignore[union-attr]
        kernel = weight.expand(*weight.shape[:2], *stride) / math.prod(stride)
        return cls(call, kernel, options["bias"], stride, _per_dim(options.get("padding", 0), dims),  # type: ignore
                   options.get("groups", 1))  # type: ignore[union-attr]

    @property
    def inputs(self) -> tuple[Tensor, ...]:
        return self.call.inputs

    @property
    def output(self) -> Tensor:
        with torch.no_grad():
            return self.evaluate(self.call.inputs[0], self.weight, self.bias)

    def evaluate(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        """The convolution with stride x stride blocks: output n reads ``x[s n - p : s n - p + s]``.

        Where the last block runs over the input, the far end is padded with zeros (F.pad lists the last dimension
        first).
        """
        far = []
        for size, step, pad in zip(x.shape[-len(self.stride):], self.stride, self.padding):
            outputs = (size + 2 * pad - 1) // step + 1  # as many as the 1x1 convolution gives
            far.append((outputs - 1) * step + step - (size + 2 * pad))
        if any(far):
            x = F.pad(x, [value for extra in reversed(far) for value in (0, extra)])
        return self.call.func(x, weight, bias, stride=self.stride, padding=self.padding, groups=self.groups)

    def describe(self) -> str:
        return f"the stride x stride average of {self.call.describe()}"


def _no_surrogate(x: Tensor, **arguments: Any) -> Tensor:
    """The surrogate of rules that build theirs from the op call (:meth:`AsFunction.surrogate_output`)."""
    raise NotImplementedError("relprop: this rule builds its surrogate from the op call")


def _per_dim(value: int | Sequence[int], dims: int) -> tuple[int, ...]:
    """A convolution option (an int or one value per dimension) as one value per dimension."""
    return (value,) * dims if isinstance(value, int) else tuple(value)


_CONVOLUTIONS = (torch.conv1d, torch.conv2d, torch.conv3d)
