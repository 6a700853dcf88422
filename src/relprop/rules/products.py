"""Rules of products, softmax and fused attention (AttnLRP, CP-LRP)."""
from __future__ import annotations

import functools
from collections.abc import Iterable

import torch
from torch import Tensor

from relprop._core.contract import AttentionView, Call, ProductView, SoftmaxView, is_attention, is_product
from relprop._core.kinds import GATE_TAGS
from relprop._core.rule import Reads, Rule, Scaled
from relprop._core.sdpa import attention_weights, head_groups, repeat_heads, softmax_scale
from relprop._core.tensors import sum_to
from relprop._core.stabilizers import inverse_denominator, per_unit_ratio


def attention_relevance(call: AttentionView, relevance: Tensor, values_only: bool) -> tuple[Tensor | None, ...]:
    """Relevance of a fused attention's activation inputs, from the fused kernel's own backward (O(T) memory).

    ``values_only`` (CP-LRP): the values take all of it. Else (AttnLRP) the
    product ``weights @ v`` splits it evenly between the weights and ``v``
    (each with the epsilon rule of a product), the softmax takes its rule
    (:class:`Softmax`), and ``q k^T`` splits its share evenly between ``q``
    and ``k``; an activation mask gets its own share of each score.
    Grouped-query heads sum back onto their key and value heads.

    With ``(dq, dk, dv, dmask)`` the VJP of ``sdpa(q, k, v, mask)`` at
    ``s = R / (z + eps sign z)`` (``call.prepared`` is ``1 / (z + eps sign
    z)``), this is exactly ``v * dv / 2`` (``v * dv`` for CP-LRP, or where q,
    k and the mask are constants), ``q * dq / 4`` and ``k * dk / 4`` (``/ 2``
    for the one of them that is an activation) and ``mask * dmask / 2``: the
    softmax rule of the weights' share ``W * dW / 2`` is ``S * dS / 2``, and
    ``dS`` is the gradient of the scores. So no T x T score matrix is built
    (:func:`recomputed_attention_relevance` builds it), and the VJP is the
    backward of the kernel's autograd graph kept from the forward pass, which
    saved what the kernel's backward needs: the kernel does not run again.
    """
    shares = _attention_shares(call, values_only)
    if not any(role in shares for role in call.roles):
        return (None,) * len(call.roles)
    grads = call.vjp(relevance * call.prepared)
    return tuple(grad.mul_(x).mul_(shares[role]) if role in shares and grad is not None else None
                 for role, x, grad in zip(call.roles, call.inputs, grads))


def _attention_shares(call: AttentionView, values_only: bool) -> dict[str, float]:
    """Each activation argument's share of its ``x * VJP``: q k^T's half of the relevance split over its factors."""
    roles = call.roles
    factors = [role for role in ("query", "key") if role in roles]
    if values_only or not (factors or "attn_mask" in roles):
        return {"value": 1.0}
    return {"value": 0.5, "attn_mask": 0.5, **dict.fromkeys(factors, 0.5 / max(len(factors), 1))}


def attention_gradient(call: AttentionView, grad: Tensor, values_only: bool) -> tuple[Tensor | None, ...]:
    """:func:`attention_relevance` in gradient form: the fused kernel's VJP of ``G``, each argument's by its share."""
    shares = _attention_shares(call, values_only)
    if not any(role in shares for role in call.roles):
        return (None,) * len(call.roles)
    return tuple(g.mul_(shares[role]) if role in shares and g is not None else None
                 for role, g in zip(call.roles, call.vjp(grad)))


def _shares_of(call: AttentionView, values_only: bool) -> tuple[float, ...]:
    """Each activation argument's share of a fused attention's VJP (:func:`attention_gradient`), 0 for none."""
    shares = _attention_shares(call, values_only)
    return tuple(shares.get(role, 0.0) for role in call.roles)


def _ratio(epsilon: float) -> functools.partial | None:
    """``z / (z + eps sign z)`` as a function of ``z`` (a :class:`Scaled` output factor); None for LRP-0."""
    return functools.partial(per_unit_ratio, epsilon=epsilon) if epsilon != 0 else None


def _stabilised(call: Call, grad: Tensor, epsilon: float) -> Tensor:
    """``G`` scaled by ``z / (z + eps sign z)`` for a rule that divides by the output ``z`` (gradient form); LRP-0's
    ``G`` as it is."""
    return grad * per_unit_ratio(call.output, epsilon) if epsilon else grad


def recomputed_attention_relevance(call: AttentionView, relevance: Tensor,
                                   values_only: bool) -> tuple[Tensor | None, ...]:
    """:func:`attention_relevance` with ``softmax(q k^T * scale + mask) @ v`` recomputed: T x T per head.

    The rules of its parts applied one by one, as in the paper; the reference of the fused path.
    """
    parts, roles = call.parts, call.roles
    q, k, v = (parts[key] for key in ("query", "key", "value"))
    groups = head_groups(parts)
    k_, v_ = repeat_heads(k, groups), repeat_heads(v, groups)
    scale = softmax_scale(parts)
    mask = parts["attn_mask"]
    weights = attention_weights(parts)
    scaled = relevance * call.prepared
    # each product splits its relevance over its activation factors: q or k alone (a decoder's query made
    # from constants, in cross-attention) takes all of q k^T's, and values next to constant weights all
    factors = [role for role in ("query", "key") if role in roles]
    values_only = values_only or not (factors or "attn_mask" in roles)
    found = {"value": (1.0 if values_only else 0.5) * v_ * (weights.transpose(-2, -1) @ scaled)}
    if not values_only:
        r_weights = 0.5 * weights * (scaled @ v_.transpose(-2, -1))
        # softmax rule, then the scale and the mask as constants: relevance per score over q k^T
        per_score = r_weights - weights * r_weights.sum(-1, keepdim=True)  # times a score: its relevance
        taylor = scale * per_score / max(len(factors), 1)
        found["query"] = q * (taylor @ k_)
        found["key"] = k_ * (taylor.transpose(-2, -1) @ q)
        if "attn_mask" in roles:  # the mask's own share of each score, as the sum `scores + mask` gives
            found["attn_mask"] = (mask * per_score).sum_to_size(mask.shape)
    if groups > 1:
        for key in ("key", "value"):
            if key in found:
                found[key] = found[key].unflatten(-3, (k.shape[-3], groups)).sum(-3)
    return tuple(found.get(role) for role in roles)


class UniformProduct(Rule[Call]):
    """Products of activations (``a * b``, ``a @ b``): each of the k factors gets 1/k.

    ``R_i = (1/k) * x_i * VJP_i(R / (z + eps sign z))`` (the AttnLRP rule for
    multiplicative interactions). On fused attention (``kind == "attention"``)
    both matrix products are split this way and the softmax takes its
    :class:`Softmax` rule, so that q and k share half and v gets half.
    """

    zero_for_zero_input = True
    kinds = frozenset({"product", "attention"})
    needs_vjp = True
    needs_output = False

    def __init__(self, epsilon: float = 1e-6):
        self.epsilon = epsilon

    def prepare(self, call: Call) -> Tensor | None:
        """``1 / (k (z + eps sign z))`` of a product of k factors; ``1 / (z + eps sign z)`` of fused attention."""
        if is_attention(call):
            return inverse_denominator(call.output, self.epsilon)
        return inverse_denominator(call.output, self.epsilon).div_(len(call.inputs)) if is_product(call) else None

    def conserves(self, call: Call) -> bool:
        return is_product(call)  # a product of k activations is k-linear: x * grad sums to k z

    def propagate(self, call: Call, relevance: Tensor) -> tuple[Tensor | None, ...]:
        if is_attention(call):
            return attention_relevance(call, relevance, values_only=False)
        return tuple(None if c is None else x * c for x, c in zip(call.inputs, call.vjp(relevance * call.prepared)))

    def gradient_reads(self, call: Call) -> Reads | None:
        if not (is_attention(call) or is_product(call)):
            return None
        return Reads(vjp=True, output=self.epsilon != 0)

    def gradient(self, call: Call, grad: Tensor) -> tuple[Tensor | None, ...]:
        """Fused attention's as :func:`attention_gradient` (outside :meth:`scaled`: its shares are those of the
        weights' two products); a product's as :meth:`scaled` says."""
        if not is_attention(call):
            return super().gradient(call, grad)
        return attention_gradient(call, _stabilised(call, grad, self.epsilon), values_only=False)

    def scaled(self, call: Call) -> Scaled:
        """Each factor's VJP of ``G``, times ``1 / k`` of ``k`` factors (``G`` stabilised by ``z / (z + eps sign
        z)``)."""
        k = len(call.inputs)
        shares = _shares_of(call, values_only=False) if is_attention(call) else (1 / k,) * k
        return Scaled(output=_ratio(self.epsilon), shares=shares)


class SignalTakesAll(Rule[Call]):
    """Gated products ``gate * signal``: the signal gets all relevance, the gate none.

    A factor is a gate when its tag (what produced it, :attr:`ProductView.factors
    <relprop.rules.ProductView.factors>`) is one of ``gate_kinds``: by default
    a sigmoid (LSTM gates, Arras et al. 2017; squeeze-and-excitation), a
    normalising statistic (``x * rsqrt(var)``), a divisor and an exponential
    weight; CP-LRP adds attention weights (``"softmax"``) and activations of
    gated MLPs (``"activation"``). On fused attention all relevance goes to the
    values (CP-LRP).

    Parameters
    ----------
    epsilon : float
        Stabiliser of the epsilon rule of a matrix product's signal.
    gate_kinds : iterable of str
        The factor tags that make a factor a gate.
    """

    #: the factor tags that make a factor a gate unless a composite says otherwise (AttnLRP's)
    GATE_KINDS = GATE_TAGS

    kinds = frozenset({"product", "attention"})
    needs_vjp = True  # for matrix products: the linear map of the signal, with the gate held constant
    needs_output = False

    def __init__(self, epsilon: float = 1e-6, gate_kinds: Iterable[str] = GATE_KINDS):
        self.epsilon = epsilon
        self.gate_kinds = frozenset(gate_kinds)

    def gates(self, call: ProductView) -> tuple[bool, ...]:
        """Which factors of the product ``call`` are gates that take no relevance.

        Where every factor would be one, an activation output gated by a
        sigmoid or a softmax is the signal (CP-LRP on squeeze-and-excitation:
        ``relu(h) * sigmoid(s)``); gates alone share the relevance uniformly
        (none is a gate). Never may all of it vanish.
        """
        factors = call.factors
        if call.matrix and "softmax" in factors and any(factor != "softmax" for factor in factors):
            # attention weights times values: the values are no gate, even where a sigmoid made them (timm's
            # iformer), as in a fused attention
            return tuple(factor == "softmax" and factor in self.gate_kinds for factor in factors)
        gates = tuple(factor in self.gate_kinds for factor in factors)
        if len(gates) > 1 and all(gates):
            gates = tuple(factor != "activation" for factor in factors)
            if all(gates):
                gates = (False,) * len(gates)
        return gates

    def accepts(self, call: Call) -> bool:
        """Fused attention, or a product with a gate and at most one other activation factor.

        A gate times a constant (``r * b_hn`` at the first step of a GRU): the
        relevance belongs to the constant, and is absorbed.
        """
        if is_attention(call):
            return True
        if not is_product(call):
            return False
        gates = self.gates(call)
        return any(gates) and len(gates) - sum(gates) <= 1

    def prepare(self, call: Call) -> Tensor | None:
        """A matrix product's or a fused attention's ``1 / (z + eps sign z)``."""
        return inverse_denominator(call.output, self.epsilon) if self.prepares_on(call) else None

    def prepares_on(self, call: Call) -> bool:
        # a gated product's signal takes the relevance as it arrives
        return is_attention(call) or (is_product(call) and call.matrix)

    def conserves(self, call: Call) -> bool:
        """A gate times a constant gives the constant the relevance; else the signal takes all of it."""
        return is_attention(call) or (is_product(call) and not all(self.gates(call)))

    def propagate(self, call: Call, relevance: Tensor) -> tuple[Tensor | None, ...]:
        if is_attention(call):
            return attention_relevance(call, relevance, values_only=True)
        assert is_product(call)  # accepts() took only products and attention
        gates = self.gates(call)
        if call.matrix:  # attn @ v: epsilon rule of v's linear map
            grads = call.vjp(relevance * call.prepared)
            return tuple(None if gate or c is None else x * c for x, c, gate in zip(call.inputs, grads, gates))
        # gate * signal elementwise: the signal's share is all of it
        return tuple(None if gate else sum_to(relevance, x.shape) for x, gate in zip(call.inputs, gates))

    def gradient_reads(self, call: Call) -> Reads:
        if self.prepares_on(call) and self.epsilon != 0:
            return Reads(vjp=True, output=True)
        # the op's own VJP with the gates held: plain autograd of the op on the gates detached
        if is_attention(call):
            return Reads(vjp=True, native=True, held=tuple(role != "value" for role in call.roles))
        assert is_product(call)  # accepts() took only products and attention
        return Reads(vjp=True, native=True, held=self.gates(call))

    def gradient(self, call: Call, grad: Tensor) -> tuple[Tensor | None, ...]:
        """Fused attention's as :func:`attention_gradient` (outside :meth:`scaled`, as
        :meth:`UniformProduct.gradient`); a product's as :meth:`scaled` says."""
        if not is_attention(call):
            return super().gradient(call, grad)
        return attention_gradient(call, _stabilised(call, grad, self.epsilon), values_only=True)

    def scaled(self, call: Call) -> Scaled:
        """The signal's VJP of ``G`` with the gates held constant (its relevance all of the output's); gates none."""
        if is_attention(call):
            shares = _shares_of(call, values_only=True)
        else:
            assert is_product(call)  # accepts() took only products and attention
            shares = tuple(0.0 if gate else 1.0 for gate in self.gates(call))
        return Scaled(output=_ratio(self.epsilon) if self.prepares_on(call) else None, shares=shares)


class Softmax(Rule[SoftmaxView]):
    """Softmax inside the model (AttnLRP): ``R_x = x * (R - s * sum(R))`` along the softmax dimension.

    This equals Gradient x Input through the softmax. It is not conservative:
    the softmax absorbs what its input's shift does not explain. Masked
    entries (``x = -inf``) get 0, never NaN.
    """

    zero_for_zero_input = True
    kinds = frozenset({"softmax"})
    needs_output = True

    def propagate(self, call: SoftmaxView, relevance: Tensor) -> tuple[Tensor | None, ...]:
        (x,) = call.inputs
        s = call.output
        taylor = relevance.to(s.dtype) - s * relevance.to(s.dtype).sum(call.dim, keepdim=True)
        out = torch.where(torch.isfinite(x), x * taylor.to(x.dtype), 0.0)
        return (out,)

    def gradient_reads(self, call: SoftmaxView) -> Reads:
        return Reads(vjp=True, native=True)

    def scaled(self, call: SoftmaxView) -> Scaled:
        """Gradient x Input in gradient form: the softmax's own VJP of ``G`` (0 at masked entries, where ``s = 0``)."""
        return Scaled()
