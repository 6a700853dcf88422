"""Aten ops of ``torch.export`` programs, resolved to the torch functions of the same name."""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from relprop._core.registry import HANDLERS, RESOLVERS, Handler
from relprop.ops.routing import _run


def _schema_arguments(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> dict[str, Any]:
    names = [argument.name for argument in op._schema.arguments]
    return {**{argument.name: argument.default_value for argument in op._schema.arguments
               if argument.has_default_value()}, **dict(zip(names, args)), **kwargs}


def _batch_norm_arguments(a: dict) -> tuple:
    return (a["input"], a["running_mean"], a["running_var"], a["weight"], a["bias"], a["training"], a["momentum"],
            a["eps"])


def _embedding_arguments(a: dict) -> tuple:
    return a["indices"], a["weight"], (a["padding_idx"] if a["padding_idx"] >= 0 else None)


#: aten ops whose torch function takes the arguments in another order or fewer of them
_REORDERED: dict[str, tuple[Callable, Callable[[dict], tuple]]] = {
    "batch_norm": (F.batch_norm, _batch_norm_arguments),
    "layer_norm": (F.layer_norm, lambda a: (a["input"], a["normalized_shape"], a["weight"], a["bias"], a["eps"])),
    "group_norm": (F.group_norm, lambda a: (a["input"], a["num_groups"], a["weight"], a["bias"], a["eps"])),
    "embedding": (F.embedding, _embedding_arguments),
}


#: aten ops that copy or gather entries without a torch function of the same name: routing too
_ATEN_ROUTING = frozenset("index _to_copy slice_copy select_copy expand_copy view_copy index_select".split())


def from_aten(op: Any, args: tuple, kwargs: dict) -> tuple[Handler, Callable, tuple, dict] | None:
    """The handler for an aten op overload, with the function and arguments to give it; None if none.

    Programs from ``torch.export`` call aten ops (``torch.ops.aten.conv2d.default``)
    instead of torch functions. An op with a rule resolves to the torch function of
    the same name, which calls that very op, so the forward is unchanged (a few take
    their arguments in another order). Views and copies of entries are routing ops
    and run as they are.
    """
    if not isinstance(op, torch._ops.OpOverload) or op.namespace != "aten":
        return None
    resolved = _resolve_aten(op)
    if resolved is None:
        return None
    handler, func, reorder = resolved
    if reorder is not None:
        return handler, func, reorder(_schema_arguments(op, args, kwargs)), {}
    return handler, func, args, kwargs


@functools.cache  # a program calls the same few ops many times
def _resolve_aten(op: torch._ops.OpOverload) -> tuple[Handler, Callable, Callable | None] | None:
    """``op``'s handler, the function to give it and how to reorder its arguments (see :func:`from_aten`)."""
    name = op._opname
    if name in _REORDERED:
        func, reorder = _REORDERED[name]
        return HANDLERS[func], func, reorder
    returns = op._schema.returns
    if name in _ATEN_ROUTING or (returns and returns[0].alias_info is not None and not op._schema.is_mutable):
        return _run, op, None
    for namespace in (torch, F, torch._C._nn, Tensor):
        found = getattr(namespace, name, None)
        if found is not None and found in HANDLERS:
            handler = HANDLERS[found]
            return handler, (op if handler is _run else found), None
    return None


RESOLVERS.append(from_aten)
