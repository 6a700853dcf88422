"""DeepLift's rules and composite: the Rescale rule and its kin on the relevance engine.

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
f(x0)``, a :class:`~relprop.ConservationWarning` names them."""
from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from relprop import rules
from relprop._core.errors import RuleError
from relprop._core.sdpa import SDPA_ARGUMENTS, head_groups, repeat_heads, softmax_scale
from relprop._core.signatures import bind
from relprop._core.tensors import sum_to
from relprop.composites import Composite
from relprop.engine.calls import OpCall
from relprop.methods.gradients import _path_points

__all__ = ["DeepLiftComposite", "Rescale", "Multilinear", "Quotient",
           "SoftmaxRescale", "NormRescale", "AttentionRescale", "MaxPoolRescale", "VectorNormRescale"]

#: the reductions among the extrema run as op calls of kind "maxpool" that take minima
_MINIMA = frozenset({torch.amin})



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
    return call.call_with(lambda *args, **kwargs: (args, kwargs), call.inputs)  # type: ignore[return-value]


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
            at_midpoint = call.call_with(call.func, [leaf])
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

        pairs = [self.halves(call, x) for x in call.inputs]
        grad_out = _input_half(self.halves(call, relevance)[0])
        points, weights = _path_points("gausslegendre", math.ceil(len(pairs) / 2))
        totals = [torch.zeros_like(x1) for x1, _ in pairs]
        for t, weight in zip(points.tolist(), weights.tolist()):
            with torch.enable_grad():
                leaves = [torch.cat([x0 + t * (x1 - x0), x0]).requires_grad_() for x1, x0 in pairs]
                grads = torch.autograd.grad(call.call_with(call.func, leaves), leaves, grad_out, allow_unused=True)
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
    """Softmax by Rescale through its decomposition (see ``_softmax_multiplier``): exact for differences.

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
        bound = bind(call.func, args, kwargs)
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




class AttentionRescale(_Paired):
    """Fused attention ``softmax(q k^T * scale + mask) @ v`` by the rules of its parts, in closed form.

    The two matrix products take their midpoint rule, the softmax
    ``_softmax_multiplier``; a mask computed from activations takes the
    multiplier of the scores.
    """

    kinds = frozenset({"attention"})
    needs_output = False

    def propagate(self, call: OpCall, relevance: Tensor) -> tuple[Tensor | None, ...]:
        args, kwargs = _arguments(call)
        bound = {**dict(zip(SDPA_ARGUMENTS, args)), **kwargs}
        if bound.get("dropout_p", 0.0):
            raise RuleError(f"relprop: DeepLift cannot explain {call.describe()} with dropout_p > 0")
        q, k, v = (self._pair(call, bound[key]) for key in ("query", "key", "value"))
        mask = bound.get("attn_mask")
        groups = head_groups({**bound, "query": q[0], "key": k[0]})
        k = (repeat_heads(k[0], groups), repeat_heads(k[1], groups))
        v = (repeat_heads(v[0], groups), repeat_heads(v[1], groups))
        scale = softmax_scale({**bound, "query": q[0]})
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
            (routed,) = torch.autograd.grad(call.call_with(call.func, [leaf]), leaf,
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
