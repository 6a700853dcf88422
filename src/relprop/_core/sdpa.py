"""``F.scaled_dot_product_attention``: its argument names, and its attention weights for the rules that need them.

:func:`attention_weights` builds ``softmax(q k^T * scale + mask)`` (T x T per
head) for a rule that needs the scores themselves; the rules of AttnLRP and
CP-LRP take the fused kernel's own backward instead (O(T) memory).
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

#: the arguments of ``F.scaled_dot_product_attention``, in its order
SDPA_ARGUMENTS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
#: the arguments that may be activations, in the order of an attention call's inputs
SDPA_TENSORS = ("query", "key", "value", "attn_mask")


def head_groups(parts: Mapping[str, Any]) -> int:
    """How many query heads share one key and value head (grouped-query attention); 1 without ``enable_gqa``."""
    return parts["query"].shape[-3] // parts["key"].shape[-3] if parts.get("enable_gqa") else 1


def softmax_scale(parts: Mapping[str, Any]) -> float:
    """The factor of ``q k^T``: ``scale``, by default ``1 / sqrt(d)``."""
    scale = parts.get("scale")
    return scale if scale is not None else 1.0 / math.sqrt(parts["query"].shape[-1])


def repeat_heads(t: Tensor, groups: int) -> Tensor:
    """Key or value heads repeated for each query head of their group."""
    return t.repeat_interleave(groups, -3) if groups > 1 else t


def attention_weights(parts: Mapping[str, Any]) -> Tensor:
    """``softmax(q k^T * scale + mask)`` of each query head, causal mask included, without dropout (T x T)."""
    q, k = parts["query"], repeat_heads(parts["key"], head_groups(parts))
    scores = (q @ k.transpose(-2, -1)) * softmax_scale(parts)
    if parts.get("is_causal"):
        causal = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~causal, -math.inf)
    mask = parts.get("attn_mask")
    if mask is not None:
        scores = scores.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else scores + mask
    # a query with every key masked (left padding) attends to nothing: its softmax, NaN, is no weight
    return torch.softmax(scores, -1).nan_to_num_(0.0)
