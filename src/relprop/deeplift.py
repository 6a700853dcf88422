"""DeepLift (Rescale rule, Shrikumar et al. 2017) on relprop's engine (docs/design.md, section 8).

The inputs and their baselines run as one batch, inputs first: ``cat([x, x0])``.
Every op call then holds both halves, and its rule turns the *multiplier*
arriving at its output (``m = d^Delta f / d^Delta y``, 1 at the target) into
multipliers of its inputs such that ``sum m_in * Delta in = sum m * Delta out``
exactly, with ``Delta t = t[:N] - t[N:]``. Chained through the model this
gives completeness: ``sum m_x * (x - x0) = f(x) - f(x0)``. Multipliers flow
in the input half; the baseline half carries zeros.

==============================  ==============================================================
op                              multiplier
==============================  ==============================================================
linear (conv, dense, sums,      the gradient (the bias cancels in the difference); routing ops
BatchNorm, routing)             (reshape, ``cat``, indexing) are the gradient as they are
elementwise ``y = f(x)``        Rescale: ``m * (y - y0) / (x - x0)``; where ``|x - x0|`` is tiny,
                                ``m * f'`` at the midpoint ``(x + x0) / 2``
product of k activations        the gradient integrated along the straight line from the
(``a * b``, ``a @ b``)          baselines, exactly (Gauss-Legendre, ceil(k/2) points: the
                                gradient at the midpoint for two factors)
quotient ``a / b``              ``a * (1 / b)``: midpoint rule of the product, Rescale of ``1 / b``
softmax                         Rescale through its decomposition ``exp``, sum, ``1 / sum``,
                                product (exact, closed form)
layer/group/RMS norm            Rescale through its decomposition (centring, square, mean,
                                ``rsqrt``, product), closed form
vector p-norm along dimensions  Rescale through ``|x|^p``, sum, ``^(1/p)``, closed form
fused attention                 ``softmax(q k^T s + mask) @ v`` by the rules above
max pooling                     captum's rule: per window, ``max(y, y0) - y0`` to the input's
                                winner, ``y - max(y, y0)`` to the baseline's winner; also
                                ``amax``, ``amin``, ``max``/``min`` along dimensions
casts to a lower precision      Rescale (the rounding is a function too)
==============================  ==============================================================

Other ops that take a winner by value (``maximum(a, b)``, ``topk``,
``sort``, ...) are routing ops of the engine: their gradient is not exact
for differences. Where the attributions then miss ``f(x) -
f(x0)``, a :class:`~relprop.engine.ConservationWarning` names them.
"""
from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import rules
from .attribution import LRP, Attribution, Inputs, Target, _as_tuple, _captum_entry, _forward_arguments, target_mask
from .composites import Composite
from .engine import ConservationWarning, RuleError, Session
from .graph import OpCall, OpKind, is_activation, sum_to, write_into
from .layer import _backward_to_taps, _one_or_list, _resolve, _Tapper
from .ops import _bind, op_name

__all__ = ["DeepLift", "DeepLiftShap", "LayerDeepLift", "DeepLiftComposite", "Rescale", "Multilinear", "Quotient",
           "SoftmaxRescale", "NormRescale", "AttentionRescale", "MaxPoolRescale", "VectorNormRescale"]

Arguments = tuple[tuple, dict]


# ---------------------------------------------------------------- rules


def _halves(call: OpCall, tensor: Tensor, pairs: int) -> tuple[Tensor, Tensor]:
    """The input half and the baseline half of ``tensor`` (batch first), or a one-line error naming the op."""
    if tensor.dim() == 0 or tensor.shape[0] != 2 * pairs:
        raise RuleError(f"relprop: DeepLift needs the batch (inputs, then baselines: {2 * pairs} rows) first in "
                        f"every tensor, but {call.describe()} has a tensor of shape {tuple(tensor.shape)}")
    return tensor[:pairs], tensor[pairs:]


def _input_half(value: Tensor) -> Tensor:
    """A multiplier of the input half, with zeros for the baseline half."""
    return torch.cat([value, torch.zeros_like(value)])


def _arguments(call: OpCall) -> tuple[tuple, dict]:
    """The op's arguments as it was called, its activations replaced by their detached values."""
    return call._call(lambda *args, **kwargs: (args, kwargs), call.inputs)  # type: ignore[return-value]


def _tiny(delta: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """Where a difference is too small for a quotient: ``|a - b| <= sqrt(eps) * (|a| + |b|)``.

    There the quotient would carry rounding errors of relative size eps / |a - b|, and the derivative at the
    midpoint differs from it by O(|a - b|^2) only.
    """
    return delta.abs() <= math.sqrt(torch.finfo(delta.dtype).eps) * (a.abs() + b.abs())


class _Paired(rules.Rule):
    """A DeepLift rule: the op's inputs and outputs hold the inputs' half and the baselines' half."""

    needs_output = True

    def __init__(self, pairs: int):
        self.pairs = pairs

    def halves(self, call: OpCall, tensor: Tensor) -> tuple[Tensor, Tensor]:
        return _halves(call, tensor, self.pairs)


class Rescale(_Paired):
    """The Rescale rule on an op of one activation acting entry by entry: ``m_x = m * (y - y0) / (x - x0)``.

    Where ``|x - x0|`` is tiny the multiplier is ``m * f'((x + x0) / 2)``. Applies
    to elementwise ops, casts, and a constant divided by an activation.
    """

    kinds = frozenset({"elementwise", "product"})

    def accepts(self, call: OpCall) -> bool:
        return call.kind in self.kinds and len(call.inputs) == 1

    def propagate(self, call: OpCall, relevance: Tensor) -> tuple[Tensor | None, ...]:
        (x,) = call.inputs
        dtype = torch.promote_types(x.dtype, call.output.dtype)  # a cast's output is narrower than its input
        x1, x0 = (half.to(dtype) for half in self.halves(call, x))
        y1, y0 = (half.to(dtype) for half in self.halves(call, call.output))
        m = self.halves(call, relevance)[0].to(dtype)
        dx, dy = (x1 - x0).expand_as(y1), y1 - y0
        with torch.enable_grad():
            leaf = torch.cat([(x1 + x0) / 2, x0]).to(x.dtype).requires_grad_()
            at_midpoint = call._call(call.func, [leaf])
        differentiable = isinstance(at_midpoint, Tensor) and at_midpoint.requires_grad
        # an activation module run as one op (its output stored) cannot be evaluated again: secants only
        tiny = _tiny(dx, x1.expand_as(y1), x0.expand_as(y1)) if differentiable else dx == 0
        secant = torch.where(tiny, 0.0, dy / torch.where(tiny, 1.0, dx))
        result = sum_to(m * secant, x1.shape)
        if differentiable and bool(tiny.any()):
            grad_out = _input_half(torch.where(tiny, m, 0.0)).to(at_midpoint.dtype)
            (derivative,) = torch.autograd.grad(at_midpoint, leaf, grad_out)
            result = result + derivative[:self.pairs].to(dtype)
        return (_input_half(result).to(x.dtype),)


class Multilinear(_Paired):
    """Products of k activation factors (``a * b``, ``a @ b``, ``einsum``): exact along the straight line.

    The multiplier of each factor is its gradient integrated from the baselines
    to the inputs, by Gauss-Legendre quadrature with ``ceil(k / 2)`` points,
    exact for a function of degree k: ``Delta(a b) = Delta a * (b + b0) / 2 +
    (a + a0) / 2 * Delta b`` for two factors.
    """

    kinds = frozenset({"product"})
    needs_output = False

    def accepts(self, call: OpCall) -> bool:
        return (call.kind == "product" and len(call.inputs) >= 2
                and "divisor" not in getattr(call, "factors", ()))

    def propagate(self, call: OpCall, relevance: Tensor) -> tuple[Tensor | None, ...]:
        from .methods import _path_points  # methods imports this module

        pairs = [self.halves(call, x) for x in call.inputs]
        grad_out = _input_half(self.halves(call, relevance)[0])
        points, weights = _path_points("gausslegendre", math.ceil(len(pairs) / 2))
        totals = [torch.zeros_like(x1) for x1, _ in pairs]
        for t, weight in zip(points.tolist(), weights.tolist()):
            with torch.enable_grad():
                leaves = [torch.cat([x0 + t * (x1 - x0), x0]).requires_grad_() for x1, x0 in pairs]
                grads = torch.autograd.grad(call._call(call.func, leaves), leaves, grad_out, allow_unused=True)
            for total, grad in zip(totals, grads):
                if grad is not None:
                    total.add_(grad[:self.pairs], alpha=weight)
        return tuple(_input_half(total) for total in totals)


class Quotient(_Paired):
    """``a / b`` of two activations as ``a * (1 / b)``: the product's midpoint rule, then Rescale of ``1 / b``.

    ``m_a = m * (1/b + 1/b0) / 2`` and ``m_b = -m * (a + a0) / 2 / (b b0)``, since
    ``(1/b - 1/b0) / (b - b0) = -1 / (b b0)``.
    """

    kinds = frozenset({"product"})
    needs_output = False

    def accepts(self, call: OpCall) -> bool:
        factors = getattr(call, "factors", ())
        return call.kind == "product" and len(call.inputs) == 2 and tuple(factors) == (None, "divisor")

    def propagate(self, call: OpCall, relevance: Tensor) -> tuple[Tensor | None, ...]:
        (a1, a0), (b1, b0) = (self.halves(call, x) for x in call.inputs)
        m = self.halves(call, relevance)[0]
        m_a = m * (1 / b1 + 1 / b0) / 2
        m_b = -m * ((a1 + a0) / 2) / (b1 * b0)
        return _input_half(sum_to(m_a, a1.shape)), _input_half(sum_to(m_b, b1.shape))


def _softmax_multiplier(x1: Tensor, x0: Tensor, m: Tensor, dim: int) -> Tensor:
    """Multiplier of a softmax's input, given the multiplier ``m`` of its output, exact for differences.

    ``s = e * r`` with ``e = exp(x - c)``, ``r = 1 / sum(e)``: the product's
    midpoint rule, Rescale of ``1 / S`` (``-1 / (S S0)``) and of ``exp``. The
    shift ``c``, the same for input and baseline, cancels. Entries masked in
    both (``-inf``) get 0.
    """
    masked = torch.isneginf(x1) & torch.isneginf(x0)
    top = torch.maximum(x1.amax(dim, keepdim=True), x0.amax(dim, keepdim=True))
    top = torch.where(torch.isfinite(top), top, 0.0)
    e1, e0 = torch.exp(x1 - top), torch.exp(x0 - top)
    s1, s0 = e1.sum(dim, keepdim=True), e0.sum(dim, keepdim=True)
    m_e = m * (1 / s1 + 1 / s0) / 2 - (m * (e1 + e0) / 2).sum(dim, keepdim=True) / (s1 * s0)
    dx = torch.where(masked, 1.0, x1 - x0)
    tiny = _tiny(dx, x1, x0) & ~masked
    rescale = torch.where(tiny, torch.exp((x1 + x0) / 2 - top), (e1 - e0) / torch.where(tiny, 1.0, dx))
    return torch.where(masked, 0.0, m_e * rescale)


class SoftmaxRescale(_Paired):
    """Softmax by Rescale through its decomposition (see :func:`_softmax_multiplier`): exact for differences.

    captum's DeepLift treats ``nn.Softmax`` as an elementwise op and subtracts
    the mean over the whole batch; that is not exact, and ``F.softmax`` gets the gradient there.
    """

    kinds = frozenset({"softmax"})
    needs_output = False

    def propagate(self, call: OpCall, relevance: Tensor) -> tuple[Tensor | None, ...]:
        (x,) = call.inputs
        dtype = torch.promote_types(x.dtype, relevance.dtype)
        x1, x0 = (half.to(dtype) for half in self.halves(call, x))
        m = self.halves(call, relevance)[0].to(dtype)
        return (_input_half(_softmax_multiplier(x1, x0, m, call.dim)).to(x.dtype),)


def _normalised_multiplier(x1: Tensor, x0: Tensor, m: Tensor, dims: tuple[int, ...], centre: bool,
                           eps: float) -> Tensor:
    """Multiplier of ``x`` for ``y = u * rsqrt(mean(u^2) + eps)``, ``u = x - mean(x)`` (or ``x``), over ``dims``.

    Rescale through each step: the product ``u * r`` by its midpoint rule,
    ``r(v) = rsqrt(v + eps)`` by ``(r - r0) / (v - v0) = -1 / (sqrt(a a0) (sqrt a + sqrt a0))``
    (``a = v + eps``), the square by ``u + u0``, the mean and the centring by their gradients.
    """
    size = math.prod(x1.shape[d] for d in dims)
    u1, u0 = (x - x.mean(dims, keepdim=True) if centre else x for x in (x1, x0))
    a1, a0 = (u.pow(2).mean(dims, keepdim=True) + eps for u in (u1, u0))
    r1, r0 = a1.rsqrt(), a0.rsqrt()
    m_r = (m * (u1 + u0) / 2).sum(dims, keepdim=True)
    m_a = -m_r / ((a1 * a0).sqrt() * (a1.sqrt() + a0.sqrt()))
    m_u = m * (r1 + r0) / 2 + m_a * (u1 + u0) / size
    return m_u - m_u.mean(dims, keepdim=True) if centre else m_u


class NormRescale(_Paired):
    """``layer_norm``, ``group_norm``, ``rms_norm`` by Rescale through their decomposition (closed form).

    The statistic is not held constant, as LRP does: DeepLift is exact for the
    difference the normalisation makes.
    """

    kinds = frozenset({"norm"})
    needs_output = False

    def accepts(self, call: OpCall) -> bool:
        return call.kind == "norm" and len(call.inputs) == 1 and call.func in (F.layer_norm, F.group_norm,
                                                                              getattr(F, "rms_norm", None))

    def propagate(self, call: OpCall, relevance: Tensor) -> tuple[Tensor | None, ...]:
        args, kwargs = _arguments(call)
        bound = _bind(call.func, args, kwargs)
        x1, x0 = self.halves(call, call.inputs[0])
        m = self.halves(call, relevance)[0]
        weight = bound.get("weight")
        if call.func is F.group_norm:
            groups = bound["num_groups"]
            if weight is not None:
                m = m * weight.reshape(-1, *[1] * (x1.dim() - 2))
            g1, g0, gm = (t.reshape(t.shape[0], groups, -1) for t in (x1, x0, m))
            result = _normalised_multiplier(g1, g0, gm, (-1,), True, bound["eps"]).reshape(x1.shape)
            return (_input_half(result),)
        if weight is not None:
            m = m * weight
        dims = tuple(range(-len(bound["normalized_shape"]), 0))
        eps = bound["eps"]
        if eps is None:  # rms_norm's default
            eps = torch.finfo(x1.dtype).eps
        return (_input_half(_normalised_multiplier(x1, x0, m, dims, call.func is F.layer_norm, eps)),)


#: ``F.scaled_dot_product_attention``'s parameters in order
_ATTENTION = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


class AttentionRescale(_Paired):
    """Fused attention ``softmax(q k^T * scale + mask) @ v`` by the rules of its parts, in closed form.

    The two matrix products take their midpoint rule, the softmax
    :func:`_softmax_multiplier`; a mask computed from activations takes the
    multiplier of the scores.
    """

    kinds = frozenset({"attention"})
    needs_output = False

    def propagate(self, call: OpCall, relevance: Tensor) -> tuple[Tensor | None, ...]:
        args, kwargs = _arguments(call)
        bound = {**dict(zip(_ATTENTION, args)), **kwargs}
        if bound.get("dropout_p", 0.0):
            raise RuleError(f"relprop: DeepLift cannot explain {call.describe()} with dropout_p > 0")
        q, k, v = (self._pair(call, bound[key]) for key in ("query", "key", "value"))
        mask = bound.get("attn_mask")
        groups = q[0].shape[-3] // k[0].shape[-3] if bound.get("enable_gqa") else 1
        if groups > 1:
            k, v = (tuple(t.repeat_interleave(groups, -3) for t in pair) for pair in (k, v))  # type: ignore[assignment]
        scale = bound.get("scale") or 1.0 / math.sqrt(q[0].shape[-1])
        scores = [(qt @ kt.transpose(-2, -1)) * scale for qt, kt in zip(q, k)]
        if bound.get("is_causal"):
            causal = torch.ones(scores[0].shape[-2:], dtype=torch.bool, device=scores[0].device).tril()
            scores = [s.masked_fill(~causal, -math.inf) for s in scores]
        masks = None
        if mask is not None:  # a mask of a batch (its first dimension) of the rank of the scores, else shared
            masks = self._pair(call, mask) if mask.dim() == scores[0].dim() else (mask, mask)
        if masks is not None:
            scores = [s.masked_fill(~mt, -math.inf) if mt.dtype == torch.bool else s + mt
                      for s, mt in zip(scores, masks)]
        weights = [torch.softmax(s, -1) for s in scores]
        m = self.halves(call, relevance)[0]
        m_weights = m @ ((v[0] + v[1]) / 2).transpose(-2, -1)
        found: dict[str, Tensor] = {"value": ((weights[0] + weights[1]) / 2).transpose(-2, -1) @ m}
        m_scores = _softmax_multiplier(scores[0], scores[1], m_weights, -1)
        found["query"] = scale * m_scores @ ((k[0] + k[1]) / 2)
        found["key"] = scale * m_scores.transpose(-2, -1) @ ((q[0] + q[1]) / 2)
        if groups > 1:
            for key in ("key", "value"):
                found[key] = found[key].unflatten(-3, (-1, groups)).sum(-3)
        if mask is not None:
            found["attn_mask"] = m_scores
        roles = [key for key in ("query", "key", "value", "attn_mask")
                 if any(bound.get(key) is x for x in call.inputs)]
        return tuple(_input_half(sum_to(found[role], x[:self.pairs].shape))
                     for role, x in zip(roles, call.inputs))

    def _pair(self, call: OpCall, value: Tensor) -> tuple[Tensor, Tensor]:
        """Input and baseline halves of a tensor with the batch first; a constant of one example serves both."""
        if any(value is x for x in call.inputs) or value.shape[0] != 1:
            return self.halves(call, value)
        return value, value


class MaxPoolRescale(_Paired):
    """Max pooling, and maxima or minima along dimensions, by captum's max-pool rule, which is exact for differences.

    In each window ``max(y, y0) - y0 >= 0`` goes to the input's winner, which
    then has ``x - x0 >= y - y0 > 0`` where that is not 0, and ``y - max(y, y0) <= 0``
    to the baseline's winner (``x - x0 < 0`` there); each entry's multiplier
    is what it got divided by its ``x - x0``. The gradient through the input's
    winner alone would give that winner ``y - x0``, not ``y - y0``. For
    minima (``amin``), ``min(y, y0)`` takes the place of ``max(y, y0)``.
    """

    kinds = frozenset({"maxpool"})

    def propagate(self, call: OpCall, relevance: Tensor) -> tuple[Tensor | None, ...]:
        (x,) = call.inputs
        x1, x0 = self.halves(call, x)
        y1, y0 = self.halves(call, call.output)
        m = self.halves(call, relevance)[0]
        top = torch.minimum(y1, y0) if call.func in _MINIMA else torch.maximum(y1, y0)
        with torch.enable_grad():
            leaf = x.detach().requires_grad_()
            (routed,) = torch.autograd.grad(call._call(call.func, [leaf]), leaf,
                                            torch.cat([m * (top - y0), m * (y1 - top)]))
        share = routed[:self.pairs] + routed[self.pairs:]
        dx = x1 - x0
        return (_input_half(torch.where(dx == 0, 0.0, share / torch.where(dx == 0, 1.0, dx))),)


#: vector norms and their parameter names in order (``_norm`` in :mod:`relprop.ops` makes them op calls of kind "sum")
_NORMS: dict[Callable, tuple[str, ...]] = {
    torch.norm: ("input", "p", "dim", "keepdim", "out", "dtype"),
    torch.Tensor.norm: ("input", "p", "dim", "keepdim", "dtype"),
    torch.linalg.vector_norm: ("input", "ord", "dim", "keepdim"),
    torch.linalg.norm: ("input", "ord", "dim", "keepdim"),
}


def _norm_order(call: OpCall) -> tuple[float, tuple[int, ...], bool] | None:
    """A vector norm's order, dimensions and keepdim, if it is a finite p-norm along given dimensions; else None."""
    names = _NORMS.get(call.func)
    if names is None:
        return None
    args, kwargs = _arguments(call)
    bound = {**dict(zip(names, args)), **kwargs}
    order = bound.get("p", bound.get("ord"))
    order = 2.0 if order in (None, "fro") else order
    dim = bound.get("dim")
    if not isinstance(order, (int, float)) or not 0 < order < math.inf or dim is None:
        return None
    return float(order), (dim,) if isinstance(dim, int) else tuple(dim), bool(bound.get("keepdim", False))


class VectorNormRescale(_Paired):
    """A p-norm along dimensions by Rescale through ``(sum |x|^p)^(1/p)``, in closed form.

    For ``p = 2`` the multiplier is ``m (x + x0) / (|x| + |x0|)``, with no
    quotient of differences: ``(x^2 - x0^2) / (x - x0) = x + x0`` and
    ``(n - n0) / (n^2 - n0^2) = 1 / (n + n0)``.
    """

    kinds = frozenset({"sum"})
    needs_output = False

    def accepts(self, call: OpCall) -> bool:
        return call.kind == "sum" and len(call.inputs) == 1 and _norm_order(call) is not None

    def propagate(self, call: OpCall, relevance: Tensor) -> tuple[Tensor | None, ...]:
        p, dims, keepdim = _norm_order(call)  # type: ignore[misc]  # accepts() said it is one
        x1, x0 = self.halves(call, call.inputs[0])
        m = self.halves(call, relevance)[0]
        if not keepdim:
            for dim in sorted(d % x1.dim() for d in dims):
                m = m.unsqueeze(dim)
        powers = [x.abs().pow(p) for x in (x1, x0)]
        total1, total0 = (power.sum(dims, keepdim=True) for power in powers)
        norm1, norm0 = total1.pow(1 / p), total0.pow(1 / p)
        if p == 2:
            outer, inner = 1 / torch.where(norm1 + norm0 == 0, 1.0, norm1 + norm0), x1 + x0
        else:
            dt, dx = total1 - total0, x1 - x0
            tiny_total, tiny = _tiny(dt, total1, total0), _tiny(dx, x1, x0)
            middle_total, middle = (total1 + total0) / 2, (x1 + x0) / 2
            derivative = torch.where(middle_total > 0, middle_total, 1.0).pow(1 / p - 1) / p
            outer = torch.where(tiny_total, derivative, (norm1 - norm0) / torch.where(tiny_total, 1.0, dt))
            inner = torch.where(tiny, p * middle.abs().pow(p - 1) * middle.sign(),
                                (powers[0] - powers[1]) / torch.where(tiny, 1.0, dx))
        return (_input_half(m * outer * inner),)


class DeepLiftComposite(Composite):
    """The DeepLift rule of every op, whatever ``module.rule`` or a preset says.

    Parameters
    ----------
    pairs : int
        Examples in the input half of the joint batch (the baselines follow).
    """

    def __init__(self, pairs: int):
        super().__init__(0.0)
        self.pairs = pairs
        self._gradient = rules.Gradient()
        self._vector_norm = VectorNormRescale(pairs)
        self._rules: dict[str, list[rules.Rule]] = {
            "elementwise": [Rescale(pairs)],
            "product": [Multilinear(pairs), Quotient(pairs), Rescale(pairs)],
            "softmax": [SoftmaxRescale(pairs)],
            "norm": [NormRescale(pairs)],
            "attention": [AttentionRescale(pairs)],
            "maxpool": [MaxPoolRescale(pairs)],
        }

    @staticmethod
    def own_rule(module: nn.Module | None) -> rules.Rule | None:
        """None: rules set on modules for LRP do not apply (and a BatchNorm merges into its layer)."""
        return None

    def rule_for(self, call: OpCall, module: nn.Module | None, name: str) -> tuple[rules.Rule | None, str]:
        if call.kind == "sum" and self._vector_norm.accepts(call):
            return self._vector_norm, "DeepLift"
        candidates = self._rules.get(call.kind)
        if candidates is None:  # linear in its activations: conv, dense, sums, BatchNorm
            return self._gradient, "DeepLift (linear)"
        if call.kind == "product" and len(call.inputs) == 1 and getattr(call, "factors", (None,))[0] != "divisor":
            return self._gradient, "DeepLift (a scaling)"
        for rule in candidates:
            if rule.accepts(call):
                return rule, "DeepLift"
        return candidates[0], "DeepLift"  # the engine raises RuleError naming the op

    def __repr__(self) -> str:
        return f"DeepLiftComposite(pairs={self.pairs})"


# ---------------------------------------------------------------- the engine's mode

_T = torch.Tensor
#: casts that may round: an elementwise function, Rescale'd when they lose precision
_CASTS = frozenset({_T.to, _T.float, _T.half, _T.bfloat16, _T.type, _T.type_as})
#: ops whose handling in the engine is not exact for differences: routing ops that pick entries by value (their
#: gradient) and ``F.normalize`` (elementwise there); a norm that is not a finite p-norm along given dimensions is
#: noted by its rule
_INEXACT = frozenset([getattr(namespace, name) for namespace in (torch, _T)
                      for name in "max min maximum minimum fmax fmin sort topk kthvalue median".split()
                      if hasattr(namespace, name)] + [F.normalize])
#: maxima and minima along dimensions, run as op calls of kind "maxpool" (routing ops of the engine otherwise)
_EXTREMA = {torch.amax: torch.amax, _T.amax: torch.amax, torch.amin: torch.amin, _T.amin: torch.amin,
            torch.max: torch.amax, _T.max: torch.amax, torch.min: torch.amin, _T.min: torch.amin}
_MINIMA = frozenset({torch.amin})


#: elementwise ops run in place, and their out-of-place forms
_IN_PLACE = {getattr(namespace, name + "_"): getattr(namespace, name) for namespace in (torch, _T, F)
             for name in "relu sqrt rsqrt abs neg reciprocal pow clamp clip tanh sigmoid exp elu leaky_relu "
                         "hardtanh".split()
             if hasattr(namespace, name + "_") and hasattr(namespace, name)}
#: activations with an ``inplace=`` argument
_INPLACE_FLAG = frozenset(getattr(F, name) for name in "relu relu6 hardtanh leaky_relu elu selu celu silu mish "
                          "hardswish rrelu threshold hardsigmoid".split() if hasattr(F, name))


class _DeepLiftSession(Session):
    """The engine's mode, with four changes for DeepLift.

    Casts that round are elementwise ops (Rescale makes them exact); maxima
    and minima along dimensions are op calls of kind ``"maxpool"``; ops
    without an exact rule are noted with their module paths; elementwise ops
    in place run out of place and are written back after the op that reads
    the old values has kept a copy (the engine's own path lets the new op read
    the overwritten memory when its rule is not ``Pass``).
    """

    accounts = False  # multipliers flow backward, not relevance: their totals are no account

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: ops met whose handling is not exact for differences, with their module paths
        self.inexact: list[str] = []
        #: the machine epsilon of the narrowest floating-point type an op computed in, where narrower than its input:
        #: multipliers through such ops are in that type, which bounds how exact DeepLift can be
        self.precision = 0.0

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.context.opaque or not args or not is_activation(args[0]):
            return super().__torch_function__(func, types, args, kwargs)
        if func in _IN_PLACE or func in _INPLACE_FLAG and _bind(func, args, kwargs).get("inplace"):
            return self._out_of_place(func, types, args, kwargs)
        if func in _EXTREMA and (found := self._extremum(func, args, kwargs)) is not None:
            return found
        out = super().__torch_function__(func, types, args, kwargs)
        if func in _INEXACT or func in _NORMS and not self._vector_norm(out):
            self.inexact.append(f"{op_name(func)} in module '{self.module_name or '<root>'}'")
        narrower = (isinstance(out, Tensor) and out.is_floating_point() and args[0].is_floating_point()
                    and torch.finfo(out.dtype).eps > torch.finfo(args[0].dtype).eps)
        if narrower:  # a cast, or an op computing in a narrower type (softmax(..., dtype=torch.float32))
            self.precision = max(self.precision, torch.finfo(out.dtype).eps)
            if func in _CASTS:
                return self.run(OpCall(OpKind.ELEMENTWISE, func, args, kwargs, op_name(func), self.module_name))
        return out

    def _vector_norm(self, out: Any) -> bool:
        """Whether ``out`` is the output of a norm that :class:`VectorNormRescale` propagates exactly."""
        call = self.aliases.producer(out) if isinstance(out, Tensor) else None
        return call is not None and call.rule is not None and isinstance(call.rule, VectorNormRescale)

    def _extremum(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        """``amax``/``amin``, and ``max``/``min`` along a dimension, as op calls with the max-pool rule.

        None for the forms that are not a reduction along dimensions of one
        activation (``max(a, b)``, ``max()`` of everything): the engine runs them.
        """
        names = ("input", "dim", "keepdim")
        bound = {**dict(zip(names, args)), **kwargs}
        if set(bound) - set(names) or "dim" not in bound or not isinstance(bound["dim"], (int, tuple, list)):
            return None
        reduce = _EXTREMA[func]
        dim, keepdim = bound["dim"], bound.get("keepdim", False)
        values = self.run(OpCall(OpKind.MAXPOOL, reduce, (bound["input"], dim, keepdim), {}, op_name(func),
                                 self.module_name))
        if func in (torch.amax, _T.amax, torch.amin, _T.amin):
            return values
        with torch.no_grad():  # max/min along a dimension also return where the extrema are
            indices = func(bound["input"].detach(), dim, keepdim).indices
        kind = torch.return_types.max if reduce is torch.amax else torch.return_types.min
        return kind((values, indices))

    def _out_of_place(self, func: Callable, types: Any, args: tuple, kwargs: dict) -> Tensor:
        """An elementwise op in place, as its out-of-place form written into the target."""
        target = args[0]
        if func in _INPLACE_FLAG:
            args, kwargs = (), {**_bind(func, args, kwargs), "inplace": False}
        else:
            func = _IN_PLACE[func]
        self.aliases.protect(target)  # the op that made the target keeps what its rule reads
        out = super().__torch_function__(func, types, args, kwargs)
        self.aliases.before_write(target)  # ... and so does the op just made, which read the target
        return self.aliases.overwritten(write_into(target, out), out)


class _DeepLiftLRP(LRP):
    session_class = _DeepLiftSession

    @contextmanager
    def _session(self, taps: Any = None, audit: Any = None, token_inputs: tuple[Tensor, ...] = ()
                 ) -> Iterator[Session]:
        with super()._session(taps, audit, token_inputs) as session:
            self.last_session: _DeepLiftSession = session  # type: ignore[assignment]
            yield session


# ---------------------------------------------------------------- the joint pass


def _tile_arguments(arguments: Arguments, batch: int) -> Arguments:
    """Batch-first tensor arguments for the joint batch: the same rows for the inputs and for the baselines."""
    def tile(value: Any) -> Any:
        if isinstance(value, Tensor) and value.dim() and value.shape[0] == batch:
            return torch.cat([value, value])
        return value
    positional, keywords = arguments
    return tuple(tile(a) for a in positional), {key: tile(a) for key, a in keywords.items()}


class _Joint:
    """One forward pass over ``cat([inputs, baselines])`` under the DeepLift rules, and its seed."""

    def __init__(self, model: nn.Module, items: tuple[Tensor, ...], starts: tuple[Tensor, ...], target: Target,
                 additional_forward_args: Any, taps: Any = None):
        batch = items[0].shape[0]
        if any(x.shape[0] != batch for x in items):
            raise ValueError(f"relprop: every input needs the same batch size, got {[x.shape[0] for x in items]}")
        self.batch, self.items, self.starts = batch, items, starts
        self.lrp = _DeepLiftLRP(model, DeepLiftComposite(batch))
        positional, keywords = _tile_arguments(_forward_arguments(additional_forward_args), batch)
        joined = tuple(torch.cat([x, start]) for x, start in zip(items, starts))
        with torch.inference_mode(False):
            self.explained = self.lrp.record(joined, keywords or positional, taps=taps)
        logits = self.explained.logits
        if logits.dim() == 0 or logits.shape[0] != 2 * batch:
            raise ValueError(f"relprop: DeepLift needs the model output batch first ({2 * batch} rows for inputs "
                             f"and baselines), got shape {tuple(logits.shape)}")
        values = logits.detach()
        mask = target_mask(values[:batch], target)
        #: the multiplier seeded at the output: 1 at the target of each input, nothing for the baselines
        self.seed = torch.cat([mask, torch.zeros_like(mask)]).to(values.dtype)
        explained = (values * torch.cat([mask, mask])).reshape(2 * batch, -1).sum(1)
        #: f(x) - f(x0) at the target, and |f(x)| + |f(x0)|, per example
        self.difference = explained[:batch] - explained[batch:]
        self.size = explained[:batch].abs() + explained[batch:].abs()

    def deltas(self) -> tuple[Tensor, ...]:
        return tuple(x - start for x, start in zip(self.items, self.starts))

    def delta(self, attributions: Sequence[Tensor]) -> Tensor:
        """captum's delta per example: ``attributions total - (f(x) - f(x0))``."""
        total = sum(a.reshape(self.batch, -1).sum(1) for a in attributions)
        return total - self.difference  # type: ignore[return-value]

    def check(self, attributions: Sequence[Tensor]) -> Tensor:
        """:meth:`delta`, with a warning where it is more than rounding."""
        delta = self.delta(attributions)
        session = self.lrp.last_session
        scale = sum(a.reshape(self.batch, -1).abs().sum(1) for a in attributions) + self.size
        # rounding: of the quotients (sqrt(eps), see _tiny), and of multipliers where the model computes in a
        # narrower type than its output (Hugging Face's RMSNorm in float32): autograd keeps them in that type
        tolerance = max(math.sqrt(torch.finfo(delta.dtype).eps), 100 * session.precision) * scale
        if bool((delta.abs() > tolerance).any()):
            inexact = sorted(set(session.inexact))
            cause = (f"ops without an exact rule: {', '.join(inexact)}" if inexact else
                     "an op without an exact rule, or an op that mixes examples of the batch")
            warnings.warn(f"relprop: DeepLift attributions miss f(x) - f(baseline) by up to "
                          f"{delta.abs().max().item():.3g} (of {self.difference.abs().max().item():.3g}): {cause}",
                          ConservationWarning, stacklevel=3)
        return delta


def _format(inputs: Inputs, baselines: Any) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
    from .methods import _format_baselines, _format_inputs  # methods imports this module

    items = _format_inputs(inputs)
    return items, _format_baselines(items, baselines)


class DeepLift(Attribution):
    """DeepLift with the Rescale rule (Shrikumar et al. 2017) on relprop's engine, with captum's interface.

    Inputs and baselines run as one batch (one forward pass); each op's rule
    maps multipliers so that the attributions sum to ``f(x) - f(baseline)``
    at the target exactly, also through functional ops, modules called
    several times, residual sums, ``cat``, in-place ops, max pooling,
    softmax and normalisation (the table in :mod:`relprop.deeplift`).

    Parameters
    ----------
    model : nn.Module
        The model; batch first in every tensor it computes from the inputs.
    multiply_by_inputs : bool
        True (default): ``(x - baseline) * multiplier``; False: the multipliers (captum's flag).

    Examples
    --------
    >>> attributions = relprop.methods.DeepLift(model).attribute(images, target=labels)
    """

    def __init__(self, model: nn.Module, multiply_by_inputs: bool = True):
        if not isinstance(model, nn.Module):
            raise TypeError(f"relprop: model must be a torch.nn.Module, got {type(model).__name__}")
        super().__init__(model)
        self.model = model
        self.multiplies_by_inputs = multiply_by_inputs

    @_captum_entry
    def attribute(self, inputs: Inputs, baselines: Any = None, target: Target = None,
                  additional_forward_args: Any = None, return_convergence_delta: bool = False) -> Any:
        """DeepLift attributions of the target output, shaped like the inputs.

        Parameters
        ----------
        inputs : Tensor or tuple of Tensors
            Floating-point, batch first.
        baselines : None (zeros), number, Tensor or tuple of them
            One per input, broadcast to its shape.
        target, additional_forward_args :
            As for :meth:`relprop.LRP.attribute`; batch-first tensor arguments
            serve the inputs and the baselines alike.
        return_convergence_delta : bool
            Also return captum's delta per example: ``attributions total - (f(x) - f(baseline))``.

        Warns
        -----
        ConservationWarning
            Where the attributions miss ``f(x) - f(baseline)`` by more than
            rounding, naming the ops without an exact rule that the model used.
        """
        items, starts = _format(inputs, baselines)
        joint = _Joint(self.model, items, starts, target, additional_forward_args)
        with torch.inference_mode(False):
            multipliers = joint.explained.relevance(joint.seed)
        contributions = tuple(m[:joint.batch] * d for m, d in zip(multipliers, joint.deltas()))
        delta = joint.check(contributions)
        found = contributions if self.multiplies_by_inputs else tuple(m[:joint.batch] for m in multipliers)
        result = found[0] if isinstance(inputs, Tensor) else found
        return (result, delta) if return_convergence_delta else result

    def compute_convergence_delta(self, attributions: Inputs, start_point: Any, end_point: Inputs,
                                  target: Target = None, additional_forward_args: Any = None) -> Tensor:
        """captum's ``attributions total - (f(end_point) - f(start_point))`` per example."""
        from .methods import _completeness_delta

        return _completeness_delta(self.model, attributions, start_point, end_point, target, additional_forward_args)


class DeepLiftShap(DeepLift):
    """DeepLift averaged over a distribution of baselines (captum's ``DeepLiftShap``).

    Every input is paired with every baseline of the distribution, and all
    pairs run as one batch.
    """

    @_captum_entry
    def attribute(self, inputs: Inputs, baselines: Any = None, target: Target = None,
                  additional_forward_args: Any = None, return_convergence_delta: bool = False) -> Any:
        """Mean DeepLift attributions over the baselines, shaped like the inputs.

        Parameters
        ----------
        baselines : Tensor or tuple of Tensors
            One distribution per input: ``K`` baselines shaped like one
            example, stacked (``(K, *input.shape[1:])``).
        return_convergence_delta : bool
            Also return the delta of every (input, baseline) pair, example-major:
            shape ``(N * K,)``, as captum.

        Other parameters as for :meth:`DeepLift.attribute`.
        """
        from .methods import _format_inputs, _interleave_target, _repeat_arguments

        items = _format_inputs(inputs)
        given = _as_tuple(baselines)
        if len(given) != len(items) or not all(isinstance(b, Tensor) and b.dim() == x.dim() and b.shape[1:] ==
                                               x.shape[1:] for b, x in zip(given, items)):
            raise ValueError("relprop: DeepLiftShap takes one tensor of baselines per input, shaped (K, *input "
                             "shape after the batch)")
        count, batch = given[0].shape[0], items[0].shape[0]
        if any(b.shape[0] != count for b in given):
            raise ValueError("relprop: every input needs the same number of baselines")
        copies = tuple(x.repeat_interleave(count, 0) for x in items)
        starts = tuple(b.to(x).repeat(batch, *[1] * (b.dim() - 1)) for b, x in zip(given, items))
        arguments = _repeat_arguments(_forward_arguments(additional_forward_args), batch, count)
        found, delta = DeepLift.attribute.__wrapped__(  # type: ignore[attr-defined]
            self, copies, starts, _interleave_target(target, count), arguments[1] or arguments[0], True)
        means = tuple(a.reshape(batch, count, *a.shape[1:]).mean(1) for a in found)
        result = means[0] if isinstance(inputs, Tensor) else means
        return (result, delta) if return_convergence_delta else result


class LayerDeepLift(Attribution):
    """DeepLift attributions of a layer's output (or input), with captum's ``LayerDeepLift`` interface.

    The multipliers reach the layer through the engine's graph, so the
    layer's output gets exactly what the ops that read it hand back: through
    a max pooling or activation after it, a module called several times (one
    result per call) or functional ops. With ``multiply_by_inputs`` the
    attributions are ``multiplier * (layer output - its value for the baseline)``
    and sum to ``f(x) - f(baseline)`` where all of the target's dependence
    on the inputs passes through the layer.

    Parameters
    ----------
    model : nn.Module
    layer : module or dotted module name
    multiply_by_inputs : bool
    """

    def __init__(self, model: nn.Module, layer: nn.Module | str, multiply_by_inputs: bool = True):
        super().__init__(model)
        self.model = model
        self.layer = _resolve(model, layer)
        self.multiplies_by_inputs = multiply_by_inputs

    @_captum_entry
    def attribute(self, inputs: Inputs, baselines: Any = None, target: Target = None,
                  additional_forward_args: Any = None, return_convergence_delta: bool = False,
                  attribute_to_layer_input: bool = False) -> Any:
        """DeepLift attributions at the layer for the model's output at ``target``.

        Returns
        -------
        A tensor shaped like the layer's output (or input), a tuple for tuple
        outputs or several inputs, a list when the layer ran several times;
        with ``return_convergence_delta``, also ``attributions total - (f(x) -
        f(baseline))`` per example (for each call).
        """
        items, starts = _format(inputs, baselines)
        tapper = _Tapper(attribute_to_layer_input)
        joint = _Joint(self.model, items, starts, target, additional_forward_args, taps={self.layer: tapper})
        with torch.inference_mode(False):
            _backward_to_taps(joint.explained.logits, joint.seed, [tapper])
        results, deltas = [], []
        for single, records in tapper.calls:
            found: list[Tensor | None] = []
            for record in records:
                if record is None:
                    found.append(None)
                    continue
                assert record.below is not None, "a record of a layer that ran has its tensor"
                m = record.value()[:joint.batch]
                below = record.below.detach()
                difference = below[:joint.batch] - below[joint.batch:]
                found.append(m * difference if self.multiplies_by_inputs else m)
            if return_convergence_delta:
                deltas.append(joint.delta([a for a in found if a is not None]))
            results.append(found[0] if single else tuple(found))
        result = _one_or_list(results)
        return (result, _one_or_list(deltas)) if return_convergence_delta else result
