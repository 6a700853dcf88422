"""Autograd nodes that carry relevance instead of gradients.

The node of an op call (:func:`propagate`) computes the original operation
in its forward, so outputs are bitwise those of the plain model; its
backward hands the incoming relevance to the call's rule.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from relprop._core.rule import Rule
from relprop._core.tensors import is_alias_of
from relprop.engine.calls import OpCall


def _unviewed(out: Tensor, call: OpCall) -> Tensor:
    """``out``, a view the op returned, as a tensor of its own.

    A view made inside a custom Function can never be modified in place, and
    models do (timm's NaFlexViT adds its position embedding in place to the
    output of a dense layer, which ``F.linear`` on a 3-D input returns as a view
    of the 2-D matrix product). A view of memory that only the op made (that
    product) becomes a tensor over the same memory (``set_``, no copy; it keeps
    no view relation); a view of an argument is copied, so that modifying it
    in place never modifies the argument behind autograd's back.
    """
    if out.is_conj() or out.is_neg() or any(isinstance(leaf, Tensor)  # lazy conjugates: set_ would drop the flag
                                            and is_alias_of(out, leaf)
                                            for leaf in call._leaves):
        return out.clone()
    # set_(Tensor) is documented, but missing from the type stubs
    return torch.empty(0, dtype=out.dtype, device=out.device).set_(out)  # type: ignore[call-overload]


class _Propagate(torch.autograd.Function):
    """Autograd node of one op call: original op forward, rule backward."""

    @staticmethod
    def forward(ctx: Any, call: OpCall, *activations: Tensor) -> Tensor:
        ctx.call = call
        ctx.set_materialize_grads(False)  # no relevance arriving stays None: nothing to propagate or report
        out = call.run()
        if call.in_place:  # the op overwrote its input, as in the plain model: this node is its history now
            ctx.mark_dirty(activations[0])
        elif out._is_view():
            out = _unviewed(out, call)
        return out

    @staticmethod
    def backward(ctx: Any, relevance: Tensor | None) -> tuple[Tensor | None, ...]:
        call = ctx.call
        if call.finished:
            raise RuntimeError("relprop: relevance crosses this recorded forward pass once: run the forward again, or record it with reusable=True")
        if relevance is None:
            return (None,) * (1 + len(call.inputs))
        call.check_inputs()
        call.prepare()
        result = call.rule.propagate(call, relevance) if not torch.is_grad_enabled() else _recorded(call, relevance)
        if call.audit is not None:
            call.audit(call, relevance, result)
        call.finish()
        return (None, *result)


def _recorded(call: OpCall, relevance: Tensor) -> tuple[Tensor | None, ...]:
    """The rule's relevance in a backward pass taken with ``create_graph=True``, which records it: a rule that
    writes into tensors autograd needs cannot be recorded, and says so with the op's name."""
    try:
        return call.rule.propagate(call, relevance)
    except RuntimeError as error:
        raise RuntimeError(f"relprop: rule {call.rule!r} on {call.describe()} cannot be differentiated (the backward "
                           f"pass runs with create_graph=True): {error}") from error


def propagate(call: OpCall, rule: Rule, audit: Callable | None = None) -> Tensor:
    """Run ``call`` as a relevance node with ``rule``; returns the (bitwise original) output.

    ``audit`` is called as ``audit(call, relevance, input_relevances)`` after the call propagates.
    """
    call.rule = rule
    call.audit = audit
    out = _Propagate.apply(call, *call.activations)
    call.versions = tuple([x._version for x in call.inputs])
    call.output = out.detach()
    call.output_dim = out.dim()
    call.release()
    return out


class _WriteInto(torch.autograd.Function):
    """``target.copy_(result)`` whose backward hands the relevance to ``result`` alone.

    A plain ``copy_`` under autograd would also send a tensor of zeros to the
    overwritten value, and the engine would add it to that value's relevance:
    two passes over memory for nothing on every in-place op.
    """

    @staticmethod
    def forward(ctx: Any, target: Tensor, result: Tensor) -> Tensor:
        ctx.set_materialize_grads(False)
        ctx.mark_dirty(target)
        return target.copy_(result)

    @staticmethod
    def backward(ctx: Any, relevance: Tensor | None) -> tuple[None, Tensor | None]:
        return None, relevance


def write_into(target: Tensor, result: Tensor) -> Tensor:
    """Write ``result`` into ``target`` in place; in the backward pass ``target``'s relevance goes to ``result``."""
    return _WriteInto.apply(target, result)


class _Watch(torch.autograd.Function):
    """Identity on the output of an op without a rule; reports it if relevance flows through."""

    @staticmethod
    def forward(ctx: Any, report: Callable[[Tensor], None], value: Tensor) -> Tensor:
        ctx.report = report
        return value.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, Tensor]:
        ctx.report(grad)
        return None, grad


def watch(value: Any, report: Callable[[Tensor], None]) -> Any:
    """Wrap every floating output tensor of an unknown op; ``report(relevance)`` runs when relevance reaches it."""
    if isinstance(value, Tensor):
        return _Watch.apply(report, value) if value.requires_grad else value
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        watched = tuple(watch(v, report) for v in value)
        # torch's named results (``torch.return_types.cummax``: ``.values``, ``.indices``) are made from one sequence
        return watched if type(value) is tuple else type(value)(watched)
    if isinstance(value, list):
        return [watch(v, report) for v in value]
    return value


class _Tap(torch.autograd.Function):
    """Identity that hands the relevance passing through it to ``record``."""

    @staticmethod
    def forward(ctx: Any, record: Callable[[Tensor], None], value: Tensor) -> Tensor:
        ctx.record = record
        return value.clone()  # a fresh tensor, so that later in-place ops on it are allowed

    @staticmethod
    def backward(ctx: Any, relevance: Tensor) -> tuple[None, Tensor]:
        ctx.record(relevance)
        return None, relevance


class _Substitute(torch.autograd.Function):
    """``value`` in the forward pass, ``source``'s graph in the backward pass."""

    @staticmethod
    def forward(ctx: Any, value: Tensor, source: Tensor) -> Tensor:
        return value.clone()

    @staticmethod
    def backward(ctx: Any, relevance: Tensor) -> tuple[None, Tensor]:
        return None, relevance


def substitute(value: Tensor, source: Tensor) -> Tensor:
    """A tensor equal to ``value`` (bitwise) whose relevance flows into ``source``, an equivalent computation."""
    return _Substitute.apply(value.detach(), source)


def tap(value: Tensor, record: Callable[[Tensor], None]) -> Tensor:
    """``value`` behind a node that passes the relevance reaching it to ``record`` during the backward pass."""
    return _Tap.apply(record, value)


_NODE_TYPES = (_Propagate._backward_cls, _Watch._backward_cls)


def is_relevance_node(grad_fn: Any) -> bool:
    """Whether ``grad_fn`` is a node made by :func:`propagate` or :func:`watch`."""
    return isinstance(grad_fn, _NODE_TYPES)
