"""How a captured plan makes an op call anew: the call's arguments as positions among its op's arguments.

An op family builds its call from the op's arguments (a dense layer's call from ``F.linear``'s input, weight and
bias); a replayed step (:mod:`relprop.engine.plan`) makes the same call over the next pass's arguments
(:meth:`~relprop.engine.OpCall.rebound`) without the op family.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from torch import Tensor

from relprop._core.tensors import is_parameter
from relprop.engine.calls import OpCall
from relprop.engine.parametric import ParametricCall


def tensors_of(value: Any, found: list[Tensor]) -> list[Tensor]:
    """The tensors in ``value`` (an op's arguments), depth first."""
    if isinstance(value, Tensor):
        found.append(value)
    elif type(value) in (tuple, list):
        for item in value:
            tensors_of(item, found)
    elif type(value) is dict:
        for item in value.values():
            tensors_of(item, found)
    return found


def parameters_of(call: ParametricCall, args: tuple, kwargs: dict) -> bool:
    """Whether the weight and bias ``call`` holds are the memory of parameters among the op's arguments (which the
    steps know by memory): a weight computed in the forward pass would be stale in a replay."""
    parameters = [t for t in tensors_of((args, kwargs), []) if is_parameter(t)]
    return all(any(p.data_ptr() == t.data_ptr() and p.shape == t.shape and p.stride() == t.stride()
                   for p in parameters)
               for t in (call.weight, call.bias) if t is not None)


class _Argument(NamedTuple):
    """An argument of an op call that is the op's tensor argument at ``position`` (:func:`_tensors`' order)."""

    position: int


def _mapped(value: Any, tensors: list[Tensor]) -> Any:
    """``value`` (an op call's arguments) with each tensor replaced by its :class:`_Argument`; raises KeyError
    for a tensor that is no argument of the op (the call made it: it would be stale on replay), and for a
    constant at several positions (the steps know constants by dtype and shape: a later pass may give two)."""
    if isinstance(value, Tensor):
        found = [index for index, tensor in enumerate(tensors) if tensor is value]
        if not found:
            raise KeyError("a tensor of the call's own")
        if len(found) > 1 and not value.requires_grad:  # activations and parameters: the steps know them as one
            raise KeyError("a constant at several positions")
        return _Argument(found[0])
    if type(value) in (tuple, list):
        return type(value)(_mapped(v, tensors) for v in value)
    if type(value) is dict:
        return {key: _mapped(v, tensors) for key, v in value.items()}
    return value


def _filled(value: Any, tensors: list[Tensor]) -> Any:
    """:func:`_mapped`'s inverse on another op's tensor arguments."""
    if type(value) is _Argument:
        return tensors[value.position]
    if type(value) in (tuple, list):
        return type(value)(_filled(v, tensors) for v in value)
    if type(value) is dict:
        return {key: _filled(v, tensors) for key, v in value.items()}
    return value


class Rebinding:
    """How an op call's arguments come from its op's: the call is made anew over each replayed op's arguments."""

    def __init__(self, call: OpCall, made_with: tuple[tuple, dict], func: Callable, args: tuple, kwargs: dict):
        call_args, call_kwargs = made_with
        tensors = tensors_of((args, kwargs), [])
        self._args = _mapped(call_args, tensors)
        self._kwargs = _mapped(call_kwargs, tensors)
        self._template = call.rebound((), {})
        if isinstance(self._template, ParametricCall):
            self._template.workspace = None  # type: ignore[assignment]  # the replaying session's, each time
        self._slots = call.slots
        #: the call is the op itself on the op's own arguments: a native run needs no call
        self.direct = (call.func is func and not call.linearised and self._slots is not None
                       and len(call_args) == len(args) and all(a is b for a, b in zip(call_args, args))
                       and call_kwargs.keys() == kwargs.keys() and all(call_kwargs[k] is kwargs[k] for k in kwargs))

    def call(self, session: Any, args: tuple, kwargs: dict) -> OpCall:
        tensors = tensors_of((args, kwargs), [])
        call = self._template.rebound(_filled(self._args, tensors), _filled(self._kwargs, tensors))
        if isinstance(call, ParametricCall):
            call.workspace = session.workspace
        return call

    def held_positions(self, held: tuple[bool, ...]) -> tuple[int, ...]:
        """The positions among the op's arguments of the inputs ``held`` flags (for a direct call)."""
        return tuple(slot for slot, hold in zip(self._slots or (), held) if hold)
