"""Fused attention, ``nn.MultiheadAttention``, and embedding lookups of the model's token ids."""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from relprop._core.kinds import OpKind
from relprop._core.registry import ALWAYS_HANDLED, op_name, register
from relprop._core.sdpa import SDPA_ARGUMENTS, SDPA_TENSORS
from relprop._core.signatures import bind, bind_builtin
from relprop._core.tensors import agrees, constant, is_activation
from relprop.engine.calls import OpCall
from relprop.engine.nodes import substitute
from relprop.rules import Softmax
from relprop.ops.host import OpHost


class AttentionCall(OpCall):
    """``F.scaled_dot_product_attention``, decomposed for its rule in the backward pass.

    The forward output is the fused kernel's. In the backward pass the rule
    splits the relevance over its two matrix products and its softmax; AttnLRP
    and CP-LRP do it through the fused kernel's own backward, without the
    T x T attention weights (:func:`relprop.rules.products.attention_relevance`).
    """

    def __init__(self, func: Callable, args: tuple, kwargs: dict, module_name: str) -> None:
        bound = bind_builtin(SDPA_ARGUMENTS, args, kwargs)
        # the kernel's autograd graph, kept from the forward pass, serves the rule's VJP: the attention of the
        # model in eval mode, so a call with dropout gets a graph of its own without it
        super().__init__(OpKind.ATTENTION, func, args, kwargs, op_name(func), module_name,
                         linearised=_without_dropout if bound.get("dropout_p") else None)

    def _bind(self, args: tuple, kwargs: dict) -> None:
        super()._bind(args, kwargs)
        bound = bind_builtin(SDPA_ARGUMENTS, args, kwargs)
        self._parts = {key: constant(bound.get(key)) for key in SDPA_ARGUMENTS}
        # a float mask computed from activations (SAM's decomposed relative positions) is a score term too
        self._roles = [key for key in SDPA_TENSORS if is_activation(bound.get(key))]

    @property
    def explains_its_output(self) -> bool:
        return not self.linearised  # with dropout, the attention of its graph without dropout

    def _explained_output(self, value: Tensor) -> Tensor:
        # with dropout, the rule explains the attention of its graph without dropout: that graph's output
        if self._graph is not None and not self.explains_its_output:
            return self._graph[1].detach()
        return value

    @property
    def parts(self) -> dict[str, Any]:
        """Its arguments by name (``query``, ``key``, ``value``, ``attn_mask``, ``is_causal``, ``scale``, ...)."""
        return self._parts

    @property
    def roles(self) -> tuple[str, ...]:
        """The names of the arguments that are activations, in the order of :attr:`~relprop.engine.OpCall.inputs`."""
        return tuple(self._roles)


def _without_dropout(*args: Any, **kwargs: Any) -> Tensor:
    """``F.scaled_dot_product_attention`` of the same arguments with ``dropout_p = 0``."""
    bound = bind_builtin(SDPA_ARGUMENTS, args, kwargs)
    bound["dropout_p"] = 0.0
    return F.scaled_dot_product_attention(**bound)


def _attention(session: OpHost, func: Callable, args: tuple, kwargs: dict) -> Any:
    return session.run(AttentionCall(func, args, kwargs, session.module_name))


def _multi_head_attention(session: OpHost, func: Callable, args: tuple, kwargs: dict) -> Any:
    """``nn.MultiheadAttention``: the native output, relevance through its decomposition into rule-bearing ops."""
    bound = bind(func, args, kwargs)
    if (bound["bias_k"] is not None or bound["add_zero_attn"]
            or bound["static_k"] is not None or bound["static_v"] is not None):
        return session.unknown(func, args, kwargs)
    output, weights = func(*args, **kwargs)
    with session:  # back in the mode: each op of the decomposition gets its rule
        decomposed = _decomposed_attention(**bound)
    return substitute(output, decomposed), weights


def _decomposed_attention(query: Tensor, key: Tensor, value: Tensor, embed_dim_to_check: int, num_heads: int,
                          in_proj_weight: Tensor | None, in_proj_bias: Tensor | None, out_proj_weight: Tensor,
                          out_proj_bias: Tensor | None, key_padding_mask: Tensor | None = None,
                          attn_mask: Tensor | None = None, use_separate_proj_weight: bool = False,
                          q_proj_weight: Tensor | None = None, k_proj_weight: Tensor | None = None,
                          v_proj_weight: Tensor | None = None, is_causal: bool = False, **_: Any) -> Tensor:
    """``F.multi_head_attention_forward`` (sequence first, no dropout) as linear maps around fused attention."""
    if use_separate_proj_weight:
        assert q_proj_weight is not None and k_proj_weight is not None and v_proj_weight is not None
        weights: Sequence[Tensor] = (q_proj_weight, k_proj_weight, v_proj_weight)
    else:
        assert in_proj_weight is not None  # nn.MultiheadAttention has one where the weights are not separate
        weights = in_proj_weight.chunk(3)
    biases = in_proj_bias.chunk(3) if in_proj_bias is not None else (None, None, None)
    length, batch, width = query.shape
    head = width // num_heads

    def heads(t: Tensor) -> Tensor:  # (S, N, E) -> (N, H, S, d)
        return t.reshape(t.shape[0], batch, num_heads, head).permute(1, 2, 0, 3)

    q, k, v = (heads(F.linear(t, w, b)) for t, w, b in zip((query, key, value), weights, biases))
    mask = None
    if attn_mask is not None:  # MultiheadAttention: True = not attended; a float mask is added
        mask = attn_mask.reshape(-1, num_heads, *attn_mask.shape[-2:]) if attn_mask.dim() == 3 else attn_mask
        mask = torch.zeros(mask.shape, dtype=q.dtype).masked_fill(mask, -math.inf) if mask.dtype == torch.bool \
            else mask
    if key_padding_mask is not None:
        padding = key_padding_mask.reshape(batch, 1, 1, -1)
        padding = torch.zeros(padding.shape, dtype=q.dtype).masked_fill(padding, -math.inf) \
            if padding.dtype == torch.bool else padding
        mask = padding if mask is None else mask + padding
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal and mask is None)
    return F.linear(out.permute(2, 0, 1, 3).reshape(length, batch, width), out_proj_weight, out_proj_bias)


# ---------------------------------------------------------------- embeddings

def _embedding(session: OpHost, func: Callable, args: tuple, kwargs: dict) -> Any:
    """A lookup of the model's integer input: its vectors collect the relevance of those tokens."""
    bound = bind(func, args, kwargs)
    if is_activation(bound["weight"]):
        return session.unknown(func, args, kwargs)
    with torch.no_grad():  # a lookup in a parameter table: constant, unless it embeds the model's input
        out = func(*args, **kwargs)
    return session.token_embedding(bound["input"], out)


register(_attention, [F.scaled_dot_product_attention])
register(_multi_head_attention, [F.multi_head_attention_forward])
register(_embedding, [F.embedding])


ALWAYS_HANDLED.add(_embedding)


class EagerScores:
    """Attention written out, on its way: scores ``query @ key_t * scale (+ mask)``, or their softmax.

    The ops that compute them note it as they run (:func:`note_scores`, :func:`note_scaled`,
    :func:`note_masked`, :func:`note_softmax`, :func:`note_routed`); a matrix product of the weights with
    values is then explained as fused attention of the same arguments (:func:`eager_attention`).
    """

    __slots__ = ("query", "key_t", "scale", "mask", "weights")

    def __init__(self, query: Tensor, key_t: Tensor, scale: float = 1.0, mask: Tensor | None = None,
                 weights: bool = False) -> None:
        self.query, self.key_t, self.scale, self.mask, self.weights = query, key_t, scale, mask, weights

    def but(self, **changes: Any) -> EagerScores:
        """A copy with ``changes``."""
        fields = {name: getattr(self, name) for name in self.__slots__}
        return EagerScores(**{**fields, **changes})


#: matrix products that may compute scores or apply attention weights
_MATMUL = frozenset({torch.matmul, Tensor.matmul, Tensor.__matmul__, torch.bmm, Tensor.bmm})
#: routing ops that keep attention weights what they are: casts (``softmax(..., dtype=float32).to(q.dtype)``), copies
_CASTS = frozenset({"to", "type", "type_as", "float", "double", "half", "bfloat16", "contiguous", "clone"})


def _by_default(session: OpHost, call: OpCall) -> bool:
    """Whether ``call`` takes the composite's default rule: a rule mapped to an op of the attention (by function,
    module name, layer type, or on the module) is the user's choice, which the fused attention's rule would drop."""
    return session.rule_for(call)[1] == "default"


def note_scores(session: OpHost, call: OpCall, args: tuple, out: Any) -> None:
    """``out = query @ key_t``, both activations: scores, if ``out`` is one softmax away from attention weights."""
    if (call.func in _MATMUL and len(args) == 2 and all(is_activation(a) and a.dim() >= 2 for a in args)
            and _by_default(session, call)):
        session.aliases.set_scores(out, EagerScores(args[0], args[1]))


def note_scaled(session: OpHost, call: OpCall, x: Tensor, factor: Any, out: Any) -> None:
    """``out = x * factor`` (``factor`` a number): scores stay scores, scaled, before a mask is added."""
    scores = session.aliases.scores(x)
    if (scores is not None and not scores.weights and scores.mask is None and type(factor) in (int, float)
            and _by_default(session, call)):
        session.aliases.set_scores(out, scores.but(scale=scores.scale * factor))


def note_masked(session: OpHost, call: OpCall, args: tuple, alpha: Any, out: Any) -> None:
    """``out = scores + mask``, the mask a constant of the scores' dtype (a score term computed from activations
    is one more input of the attention: not written out as fused attention)."""
    if len(args) != 2 or alpha != 1:
        return
    for x, mask in (args, args[::-1]):
        scores = session.aliases.scores(x)
        if (scores is not None and not scores.weights and scores.mask is None and isinstance(mask, Tensor)
                and not is_activation(mask) and mask.dtype == x.dtype and _by_default(session, call)):
            session.aliases.set_scores(out, scores.but(mask=mask))
            return


def note_softmax(session: OpHost, call: OpCall, x: Tensor, dim: int, out: Any) -> None:
    """``out = softmax(scores, dim)`` along the keys (the last dimension), with the softmax rule: attention weights."""
    scores = session.aliases.scores(x)
    if scores is not None and not scores.weights and dim in (-1, x.dim() - 1):
        rule, source = session.rule_for(call)
        if source == "default" and type(rule) is Softmax:
            session.aliases.set_scores(out, scores.but(weights=True))


def note_routed(session: OpHost, func: Callable, args: tuple, out: Any) -> None:
    """A cast (or an op that returned its input: dropout in eval mode) keeps attention weights what they are."""
    if not args or not isinstance(args[0], Tensor) or not isinstance(out, Tensor):
        return
    scores = session.aliases.scores(args[0])
    if scores is not None and (out is args[0] or (getattr(func, "__name__", None) in _CASTS
                                                  and out.shape == args[0].shape)):
        session.aliases.set_scores(out, scores)


def eager_attention(session: OpHost, product: OpCall, args: tuple, kwargs: dict) -> Tensor | None:
    """``weights @ value`` with ``weights = softmax(query @ key_t * scale + mask)`` written out by the model: the
    product's output, its relevance through ``F.scaled_dot_product_attention`` of the same arguments, whose rule is
    the product and softmax rules of the whole (:class:`AttentionCall`). None where it is not that.

    The written-out form would keep the ``T x T`` weights (and, for a stabilised product, the scores) for the
    backward pass; the fused form keeps what the kernel keeps. Recognised only where every op on the way took the
    composite's default rule and the product's rule is the attention's, and checked: the fused output must equal
    the product's to rounding.
    """
    func = product.func
    if func not in _MATMUL or kwargs or len(args) != 2:
        return None
    weights, value = args
    scores = session.aliases.scores(weights)
    if scores is None or not scores.weights or not is_activation(value):
        return None
    query, key_t = scores.query, scores.key_t
    batch = query.shape[:-2]
    if (key_t.shape[:-2] != batch or value.shape[:-2] != batch or weights.shape[:-2] != batch
            or weights.shape[-2:] != (query.shape[-2], key_t.shape[-1]) or value.shape[-2] != key_t.shape[-1]
            or not query.dtype == key_t.dtype == value.dtype):
        return None
    key = key_t.transpose(-2, -1)  # outside the mode: a view, for the rule's question alone
    fused_call = AttentionCall(F.scaled_dot_product_attention, (query, key, value),
                               {"attn_mask": scores.mask, "scale": scores.scale}, session.module_name)
    if session.rule_for(product)[0] is not session.rule_for(fused_call)[0]:
        return None
    with torch.no_grad():  # the model's output, bitwise; its relevance goes through the fused attention
        out = func(*args)
    with session:  # back in the mode: the fused attention gets its rule
        fused = F.scaled_dot_product_attention(query, key_t.transpose(-2, -1), value, attn_mask=scores.mask,
                                               scale=scores.scale)
    # the same attention to rounding, or something the notes did not see changed it: then written out after all
    # (rows whose every key is masked are NaN in both, as a model with -inf in its mask gives them)
    if not bool(agrees(fused.detach(), out)):  # checked on every run of a compiled program too
        return None
    return substitute(out, fused)
