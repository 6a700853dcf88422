"""The op registry: which handler intercepts each torch function.

Op families (:mod:`relprop.ops`) register their handlers here when they are
imported, as ``torch._decomp`` does; the engine looks them up. A handler is
called as ``handler(host, func, args, kwargs)``, where ``host`` is the
engine's session (:class:`relprop.ops.OpHost`). Functions that the table
lacks are resolved by the :data:`RESOLVERS` (aten ops of exported programs),
else reported by the engine when relevance flows through them. The table is
strict: a name this torch lacks raises at import (:func:`lookup`).
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

#: ``handler(host, func, args, kwargs) -> output``, ``host`` the engine (:class:`relprop.ops.OpHost`)
Handler = Callable[[Any, Callable, tuple, dict], Any]


def op_name(func: Callable) -> str:
    """A readable name for a torch function: ``torch.nn.functional.linear``, ``torch.conv2d``, ``Tensor.add``."""
    try:
        return _cached_name(func)
    except TypeError:  # an unhashable callable: named each time
        return _function_name(func)


def _function_name(func: Callable) -> str:
    name = getattr(func, "__name__", None) or repr(func)
    if getattr(F, name, None) is func:
        return f"torch.nn.functional.{name}"
    if getattr(torch, name, None) is func:
        return f"torch.{name}"
    if getattr(func, "__objclass__", None) is not None or "TensorBase" in getattr(func, "__qualname__", ""):
        return f"Tensor.{name}"
    return f"{getattr(func, '__module__', None) or 'torch'}.{name}"


#: every op call is named: the same few functions, many times
_cached_name = functools.lru_cache(maxsize=4096)(_function_name)


_T, _nn = torch.Tensor, torch._C._nn
#: how messages name the namespaces that ops are registered from
_NAMESPACES = {id(torch): "torch", id(_T): "Tensor", id(F): "torch.nn.functional", id(_nn): "torch._C._nn",
               id(torch.linalg): "torch.linalg"}
#: names that exist only in some of the torch versions relprop supports: registered where they exist. Any other
#: name this torch lacks is a mistake in the table and raises at import
OPTIONAL = frozenset({
    "torch._grouped_mm",  # added in torch 2.8 (mixture-of-experts kernels)
})


def lookup(namespace: Any, names: str) -> list[Callable]:
    """The functions ``names`` (space-separated) of ``namespace``.

    Raises
    ------
    AttributeError
        For a name this torch does not have, unless :data:`OPTIONAL` lists it: a typo registers nothing otherwise.
    """
    found = []
    for name in names.split():
        func = getattr(namespace, name, None)
        if func is not None:
            found.append(func)
        elif f"{_NAMESPACES[id(namespace)]}.{name}" not in OPTIONAL:
            raise AttributeError(f"relprop: the op table registers {_NAMESPACES[id(namespace)]}.{name}, which torch "
                                 f"{torch.__version__} does not have (list it in ops.OPTIONAL if only some torch "
                                 "versions have it)")
    return found


def torch_and_tensor(names: str) -> list[Callable]:
    """``torch.name`` and ``Tensor.name`` for each of ``names``: the two namespaces of most tensor ops."""
    return lookup(torch, names) + lookup(_T, names)


#: the handler of each torch function that relprop intercepts (filled by the op families as they are imported)
HANDLERS: dict[Callable, Handler] = {}


def register(handler: Handler, *funcs_lists: list[Callable]) -> None:
    """Make ``handler`` the handler of every function in ``funcs_lists`` (entries of ``HANDLERS``)."""
    for funcs in funcs_lists:
        for func in funcs:
            HANDLERS[func] = handler


#: handlers that run even without an activation among the arguments (a lookup of integer token ids)
ALWAYS_HANDLED: set[Handler] = set()
#: handlers whose ops take no rule from a composite: routing and metadata as they are, in-place writes, and
#: ``cat`` and kin with their fixed rule
ROUTING_HANDLERS: set[Handler] = set()
#: functions ``resolver(func, args, kwargs)`` tried, in order, for a function :data:`HANDLERS` lacks: each
#: returns ``(handler, func, args, kwargs)`` to call instead, or None
RESOLVERS: list[Callable[[Any, tuple, dict], tuple[Handler, Callable, tuple, dict] | None]] = []


def resolve(func: Any, args: tuple, kwargs: dict) -> tuple[Handler, Callable, tuple, dict] | None:
    """The handler of a function that :data:`HANDLERS` lacks, from the first resolver that knows it; else None."""
    for resolver in RESOLVERS:
        found = resolver(func, args, kwargs)
        if found is not None:
            return found
    return None
