"""In-place ops: run as in the plain model where the rule allows, else as ``x.copy_(op(x, ...))``."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor

from relprop._core.kinds import OpKind
from relprop._core.registry import Handler, op_name
from relprop._core.rule import Pass
from relprop._core.signatures import bind, bind_builtin
from relprop._core.tensors import is_activation
from relprop.engine.nodes import write_into
from relprop.engine.sums import InPlaceSumCall
from relprop.engine.tracking import aliases
from relprop.ops.host import OpHost


def _in_place_pass(session: OpHost, func: Callable, args: tuple, kwargs: dict, handler: Handler) -> Tensor | None:
    """Run an elementwise in-place op as it is, when its rule passes relevance through; else None.

    The rule then reads nothing but the input's shape, so the op may overwrite
    its input as in the plain model: no new tensor, no copy back. This is the
    in-place ReLU of most CNNs. The output gets the tag ``handler`` would give it.
    In gradient form Pass reads the input (``G_x = G * out / x``), unless the op scales its input (a ReLU):
    there its gradient form is the op's own gradient, which autograd takes in place as the plain model does.
    """
    call = session.record(OpKind.ELEMENTWISE, func, args, kwargs)
    rule, source = session.rule_for(call)
    if len(call.inputs) != 1 or type(rule) is not Pass:
        return None
    if session.gradient_form and not rule.gradient_reads(call).native:
        return None
    zeroed = session.aliases.in_place_relu(call)
    out = session.run(call, rule, source)
    if zeroed is not None:
        session.aliases.zeroed_by(out, zeroed)
    session.aliases.set_tag(out, getattr(handler, "tag", None))
    return out


def _in_place(out_of_place: Callable, handler: Handler, keeps_input: bool = True) -> Handler:
    """Handle ``x.op_(...)`` as ``x.copy_(op(x, ...))``, or as it is (see :func:`_in_place_pass`).

    If the op's rule may keep its input for the backward pass
    (``keeps_input``), it works on a copy of the target, so that nothing it
    saved changes; ``copy_`` keeps the in-place meaning for callers that
    ignore the result. Other arguments that share the target's memory
    (``x.add_(x)``) would change with it: the rule reads copies of them.
    """
    def handle(session: OpHost, func: Callable, args: tuple, kwargs: dict) -> Any:
        target = args[0]
        if keeps_input:  # one copy serves this op's rule and the target's producer
            source = target.clone()
            session.aliases.protect(target, copy=source)
            if (tag := session.aliases.tag(target)) is not None:  # `weights /= weights.sum()` keeps a gate a gate
                session.aliases.set_tag(source, tag)
            args = tuple(source if a is target else a.clone() if aliases(a, target) else a for a in args)
            kwargs = {key: a.clone() if aliases(a, target) else a for key, a in kwargs.items()}
        else:
            session.aliases.before_in_place(func, target)
            if (out := _in_place_pass(session, func, args, kwargs, handler)) is not None:
                return out
        result = handler(session, out_of_place, args, kwargs)
        if not keeps_input:  # the op just recorded reads `target`: it keeps a copy
            session.aliases.before_write(target)
        return session.aliases.overwritten(write_into(target, result), result)
    return handle


def _in_place_sum(out_of_place: Callable, sign: int, sum_handler: Handler) -> Handler:
    """``x += y``, ``x.add_(y, alpha=a)``, ``x.sub_(y)``: run in place as in the plain model.

    One copy of ``x`` serves the sum's rule and ``x``'s producer, as in
    :func:`_in_place`, but nothing is computed out of place and copied back:
    one new tensor and two passes over memory fewer on every residual
    connection. Other cases (``y`` sharing memory with ``x``, ``x`` a view, a
    scalar ``y``, mixed dtypes) go the general way.
    """
    general = _in_place(out_of_place, sum_handler)

    def handle(session: OpHost, func: Callable, args: tuple, kwargs: dict) -> Any:
        bound = bind_builtin(("input", "other"), args, kwargs)
        target, other = bound.get("input"), bound.get("other")
        if not (is_activation(target) and target._base is None and isinstance(other, Tensor)
                and other.dtype == target.dtype and set(bound) <= {"input", "other", "alpha"}
                and not aliases(other, target)):
            return general(session, func, args, kwargs)
        before = target.detach().clone()
        session.aliases.protect(target, copy=before)
        call = InPlaceSumCall(func, args, kwargs, op_name(func), session.module_name, before,
                              sign * bound.get("alpha", 1), session.aliases.producer(target))
        out = session.run(call)
        session.aliases.set_tag(out, None)
        return out
    return handle


def _with_inplace_flag(handler: Handler) -> Handler:
    """Functional ops with an ``inplace=`` argument (``F.relu(x, inplace=True)``)."""
    def handle(session: OpHost, func: Callable, args: tuple, kwargs: dict) -> Any:
        bound = bind(func, args, kwargs)
        if not bound.get("inplace", False):
            return handler(session, func, args, kwargs)
        bound["inplace"] = False
        target = next(iter(bound.values()))
        if not is_activation(target):
            return func(*args, **kwargs)
        session.aliases.before_in_place(func, target)  # elementwise rules keep nothing of their input: no copy
        if (out := _in_place_pass(session, func, args, kwargs, handler)) is not None:
            return out
        result = handler(session, func, (), bound)
        session.aliases.before_write(target)  # the op just recorded reads `target`: it keeps a copy
        return session.aliases.overwritten(write_into(target, result), result)
    return handle
