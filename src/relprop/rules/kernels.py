"""Fused fast forms of the rules that :class:`relprop.rules.BasicRule` defines by their terms.

A rule is defined once, by its terms and its gradient mapper (its *reference
form*: one modified forward and one vector-Jacobian product per term). For
some patterns of terms this module has a *kernel* that computes the same
relevance in fewer passes over memory:

- the positive and negative parts of inputs and weights (z+, alpha-beta):
  the sum of all positive contributions ``P = W+ x+ + W- x- + b+`` is one
  modified forward, the negative ones are ``z - P``, and ``x+`` and ``x-``
  sit side by side along the input channels with ``W+`` and ``W-`` to match
  (:meth:`~relprop.rules.ParametricView.stack_signs`), so one transposed
  product each way serves both;
- gamma on a non-negative input: one quotient for both signs of ``z``, and
  ``W^T`` through the op's own VJP;
- z^B: ``x W`` read off the output, and both bound terms in one transposed
  product beside ``W``'s (:meth:`~relprop.rules.ParametricView.transpose_beside`);
- on a non-negative input (after a ReLU) the ``x-`` terms vanish;
- flat and w^2, whose one term reads no input (``x -> 1``): the denominator
  ``f(1; rho(W))`` is the same for every example, so it is evaluated on a
  batch of one and broadcast, and the relevance is one transposed product
  (on a CPU, slice by slice of the batch).

:func:`fused` chooses a kernel from the terms and the mapper alone: a rule
whose terms match none, or whose mapper is not a :class:`~relprop.rules.Shares`,
takes its reference form. A kernel serves the calls it can (a transposable
op, an input of the signs it handles) and returns None on the others, which
then take the reference form too. ``tests/test_kernels.py`` checks every
kernel against the reference form in float64."""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from relprop._core.contract import ParametricView
from relprop._core.rule import broadcasts_to
from relprop._core.stabilizers import denominator, stabilizer
from relprop.rules.terms import (
    NEGATIVE_SHARE,
    POSITIVE_SHARE,
    Shares,
    Term,
    _Bound,
    _bound_image,
    _identity,
    _Lift,
    _negative,
    _ones,
    _positive,
)

__all__ = ["Kernel", "fused"]


class Kernel:
    """A fused form of one pattern of terms; called as ``kernel(call, relevance)``."""

    #: whether it reads the op's output
    reads_output: bool = False

    def __call__(self, call: ParametricView, relevance: Tensor) -> Tensor | None:
        """The relevance of the call's input, or None where this kernel does not serve the call."""
        raise NotImplementedError


def fused(terms: Sequence[Term], mapper: Callable[..., list[Tensor]], zero_bias: bool = False) -> Kernel | None:
    """The kernel for a rule with these terms and this gradient mapper (and the default reducer); None if none.

    ``zero_bias``: the rule drops the bias from every term.
    """
    if not isinstance(mapper, Shares):
        return None
    terms = tuple(terms)
    everywhere = not any(mapper.where)
    positive_signs = all(sign == 1 for sign in mapper.signs)
    if len(terms) == 1 and terms[0].input is _ones and mapper.groups == (1,) and mapper.weights == (1.0,) \
            and everywhere and positive_signs:
        return _InputFree(terms[0].param, terms[0].bias and not zero_bias, mapper.stabilizer)
    if zero_bias:  # the kernels below carry the bias
        return None
    if terms == POSITIVE_SHARE and mapper.groups == (2,) and mapper.weights == (1.0,) and everywhere \
            and positive_signs:
        return _SignParts(mapper.stabilizer)
    if terms == POSITIVE_SHARE + NEGATIVE_SHARE and mapper.groups == (2, 2) and everywhere and positive_signs:
        alpha, minus_beta = mapper.weights
        return _SignParts(mapper.stabilizer, alpha, -minus_beta)
    if len(terms) == 4 and isinstance(lift := terms[0].param, _Lift):
        up, down = _Lift(lift.gamma, _positive), _Lift(lift.gamma, _negative)
        gamma = (Term(_positive, up), Term(_negative, down, bias=False), Term(_positive, down),
                 Term(_negative, up, bias=False))
        if terms == gamma and mapper.groups == (2, 2) and mapper.weights == (1.0, 1.0) and mapper.where == (1, -1) \
                and positive_signs:
            return _Gamma(lift.gamma, mapper.stabilizer)
    if len(terms) == 3 and isinstance(low := terms[1].input, _Bound) and isinstance(high := terms[2].input, _Bound):
        box = (Term(_identity, _identity, bias=False), Term(low, _positive, bias=False),
               Term(high, _negative, bias=False))
        if terms == box and mapper.groups == (3,) and mapper.signs == (1, -1, -1) and everywhere \
                and mapper.weights == (1.0,):
            return _Box(low.value, high.value, mapper.stabilizer)
    return None


@dataclass
class _Split:
    """A parametric op's input split by sign.

    ``positive`` is ``P = W+ x+ + W- x- + b+``, the sum of all positive
    contributions, so that ``z - P`` is the sum of all negative ones: one
    modified forward instead of one per term, and transposed products only.
    On a non-negative input (after a ReLU) ``x_neg`` and ``w_neg`` are None
    and ``P = W+ x + b+``; a kernel that needs ``W-`` there writes it over
    ``w_pos`` once done with that (:meth:`ParametricView.negative_weight`). On
    a signed input ``stacked`` holds ``x+`` and ``x-`` side by side and the
    weights to match (:meth:`ParametricView.stack_signs`), so that one
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
        """``positive``, handed over: the kernel writes into it, and it is freed as soon as the kernel lets go."""
        positive, self.positive = self.positive, None
        assert positive is not None, "taken once"
        return positive


def _split_input(call: ParametricView, signed: bool) -> _Split | None:
    """The op's input split by sign (``signed``: also where it has negative entries), else None."""
    if not call.transposable:
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
        x_pos, x_neg = inputs.chunk(2, call.input_channel_axis(x))
        return _Split(x_pos, x_neg, call.evaluate(inputs, weights, b_pos), None, None, stacked=stacked)
    w_pos, w_neg = call.weight_parts(negative=True)
    x_pos, x_neg = x.clamp(min=0), x.clamp(max=0)
    positive = call.evaluate(x_pos, w_pos, b_pos).add_(call.evaluate(x_neg, w_neg, None))
    return _Split(x_pos, x_neg, positive, w_pos, w_neg)


def _nonnegative_denominator(z: Tensor, epsilon: float) -> Tensor:
    """:func:`~relprop.rules.denominator` of a ``z >= 0`` that the caller owns, in place: ``z + epsilon``."""
    epsilon = stabilizer(epsilon, z.dtype)
    return z.add_(epsilon) if epsilon else z.masked_fill_(z == 0, math.inf)


def _nonpositive_denominator(z: Tensor, epsilon: float) -> Tensor:
    """``z - epsilon`` of a ``z <= 0`` that the caller owns, in place.

    It differs from :func:`~relprop.rules.denominator` only where ``z == 0``;
    there every product ``x_i w_ij`` summed into ``z`` is 0 as well, so the
    relevance is exactly 0 with either sign.
    """
    epsilon = stabilizer(epsilon, z.dtype)
    return z.sub_(epsilon) if epsilon else z.masked_fill_(z == 0, -math.inf)


def _unwrap(tensor: Tensor | None) -> Tensor:
    """A part of a :class:`_Split` that its branch has."""
    assert tensor is not None, "present on this branch"
    return tensor


class _SignParts(Kernel):
    """z+ (``beta`` None) and alpha-beta: the terms ``x+ W+, x- W-`` (positive share) and ``x+ W-, x- W+``."""

    def __init__(self, stabilizer: float, alpha: float = 1.0, beta: float | None = None):
        self.stabilizer, self.alpha, self.beta = stabilizer, alpha, beta
        self.reads_output = beta is not None  # the negative share is z - P

    def __call__(self, call: ParametricView, relevance: Tensor) -> Tensor | None:
        split = _split_input(call, signed=True)
        if split is None:
            return None
        if self.beta is None:
            return self._positive_share(call, relevance, split)
        return self._both_shares(call, relevance, split, self.beta)

    def _positive_share(self, call: ParametricView, relevance: Tensor, split: _Split) -> Tensor:
        shared = _nonnegative_denominator(split.take_positive(), self.stabilizer)  # P >= 0
        shared = torch.div(relevance, shared, out=shared)
        if split.stacked is not None:  # x+ W+^T s and x- W-^T s side by side: the relevance is their sum
            inputs, weights = split.stacked
            both = call.transpose_with(shared, weights, like=inputs).mul_(inputs)
            return torch.add(*both.chunk(2, call.input_channel_axis(both)))
        grad = call.transpose_with(shared, _unwrap(split.w_pos)).mul_(split.x_pos)
        if split.x_neg is None:
            return grad
        return grad.add_(call.transpose_with(shared, _unwrap(split.w_neg)).mul_(split.x_neg))

    def _both_shares(self, call: ParametricView, relevance: Tensor, split: _Split, beta: float) -> Tensor:
        # P >= 0 and N = z - P <= 0: the sums of the positive and of the negative contributions. x+ takes the
        # positive ones through W+ and the negative ones through W-, x- the other way round. Each quotient
        # is freed once its products are done: at most four map-sized tensors at once, the relevance included.
        # (W-^T n as W^T n - W+^T n would spare W-, but cancels badly where N is near 0.)
        alpha = self.alpha
        positive_sum = _unwrap(split.positive)
        z = call.take_output()
        negative = torch.sub(call.output, positive_sum) if z is None else z.sub_(positive_sum)
        del z  # `negative` alone holds the output's memory now: freed with it
        negative = _nonpositive_denominator(negative, self.stabilizer)
        negative = torch.div(relevance, negative, out=negative)
        if split.x_neg is None:  # x >= 0: W+ first, then W- written over it, one weight-sized tensor fewer
            w_pos = _unwrap(split.w_pos)
            positive = _nonnegative_denominator(split.take_positive(), self.stabilizer)
            positive = torch.div(relevance, positive, out=positive)
            on_pos = call.transpose_with(positive, w_pos)
            del positive
            w_neg = call.negative_weight(out=w_pos)
            return call.transpose_with(negative, w_neg).mul_(-beta).add_(on_pos, alpha=alpha).mul_(split.x_pos)
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
            p_pos.mul_(alpha).sub_(n_neg, alpha=beta)  # x+: alpha W+^T p - beta W-^T n
            p_neg.mul_(alpha).sub_(n_pos, alpha=beta)  # x-: alpha W-^T p - beta W+^T n
            del on_negative, n_pos, n_neg
            both.mul_(inputs)
            return torch.add(p_pos, p_neg)
        w_pos, w_neg = _unwrap(split.w_pos), _unwrap(split.w_neg)
        on_pos = call.transpose_with(negative, w_neg).mul_(-beta)
        on_neg = call.transpose_with(negative, w_pos).mul_(-beta)
        del negative
        positive = _nonnegative_denominator(split.take_positive(), self.stabilizer)
        positive = torch.div(relevance, positive, out=positive)
        grad = on_pos.add_(call.transpose_with(positive, w_pos), alpha=alpha).mul_(split.x_pos)
        on_neg = on_neg.add_(call.transpose_with(positive, w_neg), alpha=alpha)
        return grad.add_(on_neg.mul_(split.x_neg))


class _Gamma(Kernel):
    """Gamma on a non-negative input: ``x (W + g W+)`` shares R where ``z > 0``, ``x (W + g W-)`` where ``z < 0``."""

    reads_output = True

    def __init__(self, gamma: float, stabilizer: float):
        self.gamma, self.stabilizer = gamma, stabilizer

    def __call__(self, call: ParametricView, relevance: Tensor) -> Tensor | None:
        split = _split_input(call, signed=False)
        if split is None:
            return None
        # z > 0: x (W + g W+) shares R over z + t, with t = g P + eps; z < 0: x (W + g W-) over (1 + g) z - t,
        # as W- x + b- = z - P. Divided by 1 + g, that is z - t / (1 + g). So with w = 1 where z > 0 and
        # w = -1 / (1 + g) where z < 0, one quotient a = R / (z + w t) serves both, and as W- = W - W+:
        # (W + g W+)^T up + (W + g W-)^T down = W^T a + g W+^T (w a). No masks, no where: each is a pass, on
        # two map-sized tensors: t and the output's memory (a copy where the output is not writable).
        gamma = self.gamma
        slope = 1 / (1 + gamma)
        z = call.take_output()
        z = call.output.clone() if z is None else z
        epsilon = stabilizer(self.stabilizer, z.dtype)
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
        return _unwrap(grad).add_(call.transpose_with(w_a, _unwrap(split.w_pos)), alpha=gamma).mul_(split.x_pos)


class _Box(Kernel):
    """z^B: ``x W - l W+ - h W-`` with ``x W`` read off the output."""

    reads_output = True

    def __init__(self, low: float | Tensor, high: float | Tensor, stabilizer: float):
        self.low, self.high, self.stabilizer = low, high, stabilizer

    def __call__(self, call: ParametricView, relevance: Tensor) -> Tensor | None:
        (x,) = call.inputs
        low, high = self._fitted(call, x)
        if not call.transposable:
            if (low, high) != (self.low, self.high):
                raise ValueError(f"relprop: ZBox bounds of shape {tuple(torch.as_tensor(self.low).shape)} do not "
                                 f"broadcast against the input {tuple(x.shape)} of {call.describe()}; pass bounds "
                                 "of the layer's input shape")
            return None
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
            return torch.sub(on_x.mul_(x), on_bounds)
        grad = _unwrap(call.vjp(shared)[0]).mul_(x)
        grad.sub_(call.transpose_with(shared, w_pos).mul_(low))
        return grad.sub_(call.transpose_with(shared, w_neg).mul_(high))

    def _fitted(self, call: ParametricView, x: Tensor) -> tuple[float | Tensor, float | Tensor]:
        """The bounds, where they broadcast against the layer's input ``x``; else as images taken from the model
        input's space through the routing ops that made ``x`` (a space-to-depth before the first layer).
        """
        bounds = (self.low, self.high)
        if all(broadcasts_to(torch.as_tensor(bound).shape, x.shape) for bound in bounds):
            return bounds
        low, high = (call.routed_image(bound) for bound in bounds)
        if low is None or high is None:
            raise ValueError(f"relprop: ZBox bounds of shape {tuple(torch.as_tensor(self.low).shape)} and "
                             f"{tuple(torch.as_tensor(self.high).shape)} do not broadcast against the input "
                             f"{tuple(x.shape)} of {call.describe()}, which is not the model input rearranged; pass "
                             "bounds of the layer's input shape, or scalars")
        return low, high

    def _bound_weight(self, call: ParametricView, x: Tensor, low: float | Tensor, high: float | Tensor,
                      w_pos: Tensor, w_neg: Tensor) -> Tensor | None:
        """``l W+ + h W-`` in ``w_pos``'s memory, where both bounds are the same at every position of a channel.

        Then ``l W+ + h W-`` on an image of ones is ``l W+ + h W-`` of the
        bound images (padded alike), and one transposed product of it serves
        both bound terms: one forward and one transposed product fewer; that
        product and ``W``'s are one product too
        (:meth:`ParametricView.transpose_beside`). With ``l <= 0 <= h`` both
        terms are <= 0, so the sum cancels nothing. None where a bound varies
        over positions or examples, or the weight is grouped.
        """
        axis = call.input_channel_axis(x)
        low_vector, high_vector = (_channel_vector(bound, x, axis) for bound in (low, high))
        if low_vector is None or high_vector is None or call.scale_input_channels(w_neg, high_vector) is None:
            return None
        return _unwrap(call.scale_input_channels(w_pos, low_vector)).add_(w_neg)


#: bytes of quotient per transposed product of :class:`_InputFree` on a CPU: a slice of the batch at a time keeps
#: the quotient small between the division and the product; one quotient of the whole batch, fresh memory written
#: and read back, made the demo CNN's first layer at batch 256 twice as slow (20 ms against 10 ms)
SLICE_BYTES = 1 << 21


class _InputFree(Kernel):
    """One term ``1 * rho(W)`` (flat: ``rho(W) = 1``; w^2: ``rho(W) = W^2``), shared by ``f(1; rho(W), rho(b))``."""

    def __init__(self, param: Callable[[Tensor], Tensor], bias: bool, stabilizer: float):
        self.param, self.bias, self.stabilizer = param, bias, stabilizer

    def __call__(self, call: ParametricView, relevance: Tensor) -> Tensor | None:
        if not call.transposable:
            return None
        (x,) = call.inputs
        weight = self.param(call.weight)
        # no batch dimension to share over, or no example to share
        if x.dim() < 2 or (call.kind == "conv" and x.dim() != weight.dim()) or not x.numel():
            return None
        bias = self.param(call.bias) if self.bias and call.bias is not None else None
        # the denominator reads no input: one example's is every example's, and broadcasts against the relevance
        shared = denominator(call.evaluate(torch.ones_like(x[:1]), weight, bias), self.stabilizer)
        step = len(x)
        if relevance.device.type == "cpu":
            step = max(1, SLICE_BYTES // max(1, relevance[:1].numel() * relevance.element_size()))
        if step >= len(x):
            return call.transpose_with(torch.div(relevance, shared), weight)  # times the modified input, 1
        grad = torch.empty_like(x)
        for start in range(0, len(x), step):
            part = slice(start, start + step)
            grad[part] = call.transpose_with(torch.div(relevance[part], shared), weight, like=x[part])
        return grad


def _channel_vector(value: float | Tensor, x: Tensor, axis: int) -> Tensor | None:
    """A bound as one value per channel (``axis`` of ``x``), if it is the same at every position; else None."""
    bound = torch.as_tensor(value, dtype=x.dtype, device=x.device)
    if bound.dim() > x.dim():
        return None
    shape = (1,) * (x.dim() - bound.dim()) + tuple(bound.shape)
    if any(size != 1 for dim, size in enumerate(shape) if dim != axis):
        return None
    return bound.reshape(-1).expand(x.shape[axis])
