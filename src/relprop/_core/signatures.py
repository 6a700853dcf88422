"""Arguments of torch functions bound to their parameter names, cheaply (this runs for every op), and whether a
call writes into one of them."""
from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any


@functools.cache
def _signature(func: Callable) -> inspect.Signature | None:
    try:
        return inspect.signature(func)
    except (TypeError, ValueError):
        return None


@functools.cache
def _parameters(func: Callable) -> tuple[tuple[str, ...], tuple[str, ...], frozenset[str], dict[str, Any]] | None:
    """``func``'s parameter names in order, the positional ones, the keyword ones and the defaults.

    None if ``func`` takes ``*args`` or ``**kwargs``.
    """
    signature = _signature(func)
    if signature is None:  # a builtin without a signature: bind() says so
        return None
    parameters = signature.parameters.values()
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in parameters):
        return None
    return (tuple(p.name for p in parameters),
            tuple(p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)),
            frozenset(p.name for p in parameters if p.kind != p.POSITIONAL_ONLY),
            {p.name: p.default for p in parameters if p.default is not p.empty})


def bind(func: Callable, args: tuple, kwargs: dict) -> dict[str, Any]:
    """``func``'s arguments by name in the order of its parameters, defaults included."""
    found = _parameters(func)
    if found is not None and len(args) <= len(found[1]):
        # the common case bound by hand: Signature.bind costs more than many a small op it serves
        names, positional, keywords, defaults = found
        given = positional[:len(args)]
        if keywords.issuperset(kwargs) and kwargs.keys().isdisjoint(given):
            values = {**defaults, **dict(zip(given, args)), **kwargs}
            if len(values) == len(names):  # every parameter has a value
                return {name: values[name] for name in names}
    signature = _signature(func)
    if signature is None:
        raise TypeError(f"relprop: {getattr(func, '__name__', func)!r} has no signature to bind its arguments to")
    bound = signature.bind(*args, **kwargs)  # raises TypeError on bad arguments
    bound.apply_defaults()
    return dict(bound.arguments)


def bind_builtin(names: tuple[str, ...], args: tuple, kwargs: dict) -> dict[str, Any]:
    """Arguments of a builtin (which has no signature to bind with) by name."""
    bound = dict(zip(names, args))
    bound.update(kwargs)
    return bound


#: the augmented assignments (``x += y``) and item assignment: the dunder methods that write into a tensor
_WRITES = frozenset({f"__i{op}__" for op in ("add", "sub", "mul", "matmul", "truediv", "floordiv", "mod", "pow",
                                              "and", "or", "xor", "lshift", "rshift")} | {"__setitem__"})


@functools.cache
def inplace_position(func: Callable) -> int | None:
    """The position of ``func``'s ``inplace`` parameter (``F.relu(x, True)``), or None."""
    found = _parameters(func)
    return found[0].index("inplace") if found is not None and "inplace" in found[0] else None


def writes_into(func: Callable, args: tuple, kwargs: dict) -> bool:
    """Whether ``func(*args, **kwargs)`` writes into an argument: its name (``add_``, ``__iadd__``,
    ``__setitem__``), ``out=``, ``inplace=True`` by name or position, or an aten op's mutable schema. The one test
    of writing in place, for recorded plans and compiled programs alike."""
    name = getattr(func, "__name__", "")
    schema = getattr(func, "_schema", None)  # an aten op (``torch.ops.aten.relu_.default``): its schema says
    if ((name.endswith("_") and not name.startswith("__")) or name in _WRITES or "out" in kwargs
            or (schema is not None and schema.is_mutable)):
        return True
    flag = kwargs.get("inplace")
    # only Python functions take the flag (``torch.nn.functional``'s); a builtin's text signature is not parsed
    if flag is None and args and inspect.isfunction(func):
        position = inplace_position(func)
        flag = args[position] if position is not None and position < len(args) else None
    return flag is True
