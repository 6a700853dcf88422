"""Attention written out by the model (``softmax(query @ key_t * scale + mask) @ value``) in a compiled program.

Interception explains the product ``weights @ value`` of such attention as ``F.scaled_dot_product_attention`` of
the same arguments (``relprop.ops.attention.eager_attention``): the product's output as it is, its relevance
through the fused attention with the attention rule. When :mod:`relprop.engine.compiled` decides the product's
node, its handler ran that fused call, with tensors the product does not take: :func:`written_attention` finds
the nodes of the traced graph that hold them. :func:`fused_node` then writes the fused call into the graph
beside the product, as its own node: it is decided and rewritten as an attention node of the model is, and the
product's value takes its gradient.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch.nn.functional as F
from torch import fx

#: the arguments of the fused call the product is explained as, in its order: its slots are 0, 1, 2
FUSED_ROLES = ("query", "key", "value")


class WrittenAttention(NamedTuple):
    """The nodes that hold the query, the transposed key and the mask (None: none) of attention written out, and
    its scale."""

    query: fx.Node
    key_t: fx.Node
    mask: fx.Node | None
    scale: float


def written_attention(scores: Any, roles: tuple[str, ...], activations: tuple, value: Any,
                      env: dict[fx.Node, Any]) -> WrittenAttention | None:
    """Where the fused attention that explains ``weights @ value`` reads its arguments: the nodes whose values (in
    ``env``, by node) are the query, ``key_t`` and mask that the weights were noted to be computed from
    (``scores``, the session's ``aliases.scores(weights)``). ``roles``, ``activations``: the fused call's; it must
    be the attention of that query and of ``value``. None where it is not, or the graph holds one of them not."""
    if (scores is None or not scores.weights or roles != FUSED_ROLES or activations[0] is not scores.query
            or activations[2] is not value):
        return None
    held = {id(x): node for node, x in env.items()}  # the last node that holds each value
    query, key_t = held.get(id(scores.query)), held.get(id(scores.key_t))
    mask = held.get(id(scores.mask)) if scores.mask is not None else None
    if query is None or key_t is None or (scores.mask is not None and mask is None):
        return None
    return WrittenAttention(query, key_t, mask, scores.scale)


def fused_node(graph: fx.Graph, product: fx.Node, attention: WrittenAttention) -> fx.Node:
    """``F.scaled_dot_product_attention(query, key_t^T, value, attn_mask=mask, scale=scale)``, written into
    ``graph`` after ``product`` (``weights @ value``), whose arguments it reads."""
    with graph.inserting_after(product):
        key = graph.call_method("transpose", (attention.key_t, -2, -1))
    with graph.inserting_after(key):
        return graph.call_function(F.scaled_dot_product_attention, (attention.query, key, product.args[1]),
                                   {"attn_mask": attention.mask, "scale": attention.scale})
