"""A captured plan: the decisions of an attribution forward pass, op by op, replayed on later passes.

Under interception every op of the forward pass goes to its op family, which builds an op call and asks the
composite for its rule. Where the pass carries relevance per unit of activation, most of that work only
decides: which rule, whether the op runs as plain autograd (and which inputs it holds constant) or as a
relevance node. A :class:`Recording` keeps those decisions with the structure of each op's arguments: where
each activation comes from (which earlier op, which model input), the values of the other arguments, the
dtypes and shapes of constant tensors, the parameters by identity and memory, the module that issued the op,
the grad mode and autocast. Those determine the decision; the tensors' values do not.

A later pass of the same input signature runs the model's forward as before, under the engine's mode, but
each op is checked against the plan before it runs and then runs its recorded decision directly
(:class:`Replay`). Wherever the forward takes another path (another function, an activation from elsewhere,
another constant, a Python value computed from the data), the check fails before that op runs: the pass is
run again under interception, and the plan is dropped. So a replayed pass computes what interception would
have, op for op: the same relevance, bitwise.

A pass is recorded only where every op's decision can be replayed: no op in place, no op without a rule, no op
run by another op's handler, no call that holds more of its pass than its arguments (a convolution keeps its
input for its transposed product, a merged BatchNorm its producer).
"""
from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import torch
from torch import Tensor, nn

from relprop._core.gradient_form import unwrapped
from relprop._core.registry import HANDLERS
from relprop._core.signatures import writes_into
from relprop._core.tensors import is_activation, is_parameter
from relprop.engine.calls import OpCall
from relprop.engine.functions import _Unhandled
from relprop.engine.parametric import ParametricCall
from relprop.engine.rebinding import Rebinding, parameters_of, tensors_of
from relprop.engine.state import RuleState, same

#: input signatures whose plans an explainer keeps, the least recently used dropped first
_KEPT = 16


class PathChanged(RuntimeError):
    """The forward pass took another path than its plan: it runs again under interception."""


class Origins:
    """Where the activations of one forward pass come from: a model input, or an output of an earlier op.

    Tensors are held by weak references, so that the record keeps nothing alive.
    """

    def __init__(self, inputs: tuple[Tensor, ...]) -> None:
        # the model inputs that are activations: their origin is their index, dtype, shape and device
        self._made: dict[int, tuple[weakref.ref, tuple]] = {
            id(x): (weakref.ref(x), ("input", index, x.dtype, x.shape, x.device))
            for index, x in enumerate(inputs) if is_activation(x)}
        #: an activation of unknown origin was met (made outside the ops the mode sees): no plan holds
        self.unknown = False

    def made(self, out: Any, step: int) -> None:
        """The activations in ``out`` (a tensor, or a tuple or list of them) are outputs of op ``step``."""
        if isinstance(out, Tensor):
            if is_activation(out):
                self._made[id(out)] = (weakref.ref(out), (step, 0))
        elif isinstance(out, (tuple, list)):  # named tuples too (``x.max(dim)``)
            for index, value in enumerate(out):
                if is_activation(value):
                    self._made[id(value)] = (weakref.ref(value), (step, index))

    def of(self, x: Tensor) -> tuple | None:
        entry = self._made.get(id(x))
        if entry is None or entry[0]() is not x:
            self.unknown = True
            return None
        return entry[1]

    def arguments(self, args: tuple) -> tuple:
        """:meth:`signature` of an op's positional arguments; the common ones (tensors, numbers) without a call."""
        signature = []
        for value in args:
            kind = type(value)
            if kind is Tensor and value.requires_grad:
                entry = self._made.get(id(value))
                if entry is not None and entry[0]() is value:
                    signature.append(entry[1])
                    continue
            elif kind is int or kind is str or kind is type(None):
                signature.append(value)
                continue
            signature.append(self.signature(value))
        return tuple(signature)

    def signature(self, value: Any) -> Any:
        """What of ``value`` (an op's argument) decides the op's rule: everything but the values of its tensors.

        Activations by origin; parameters (:func:`~relprop._core.tensors.is_parameter`, frozen ones too) by
        identity, memory and layout, so that a parameter given new memory (``p.data = ...``) is another; other
        tensors by dtype, shape and device; containers element by element; other values as they are (compared with ``==``).
        """
        if isinstance(value, Tensor):
            if is_activation(value):
                return self.of(value)
            if is_parameter(value):  # (``p.data = p.data.t()`` keeps a square weight's memory and shape)
                return ("parameter", id(value), value.data_ptr(), value.shape, value.stride(), value.requires_grad)
            return ("constant", value.dtype, value.shape, value.device)
        if type(value) in (tuple, list):
            return tuple([self.signature(v) for v in value])
        if type(value) is dict:
            return tuple([(key, self.signature(v)) for key, v in value.items()])
        if type(value) in (float, bool):  # 1.0 == 1 == True, but each promotes dtypes its own way
            return (type(value), value)
        return value


def _key(origins: Origins, module_name: str, args: tuple, kwargs: dict) -> tuple:
    # autocast decides the dtypes of the activations, and the dtypes decide some calls (a sum's closed-form VJP,
    # whether attention written out is recognised): whether it is on, and in which dtype
    return (module_name, torch.is_grad_enabled(),
            torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu"),
            torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda"),
            origins.arguments(args), origins.signature(kwargs) if kwargs else ())


# ------------------------------------------------------------------------- the actions a step replays

class Action(Protocol):
    """What a step does with the op's arguments, in place of its op family's handler."""

    def __call__(self, session: Any, func: Callable, args: tuple, kwargs: dict) -> Any: ...


class _Constant(NamedTuple):
    """An op on constants (parameters too): run as interception runs it."""

    with_parameters: bool

    def __call__(self, session: Any, func: Callable, args: tuple, kwargs: dict) -> Any:
        return session.constant(func, args, kwargs, self.with_parameters)


class _Plain(NamedTuple):
    """A routing op, or a native op on the op's own arguments: the op itself, ``held`` inputs detached."""

    held: tuple[int, ...] = ()

    def __call__(self, session: Any, func: Callable, args: tuple, kwargs: dict) -> Any:
        if self.held:
            args = tuple(a.detach() if i in self.held else a for i, a in enumerate(args))
        return func(*args, **kwargs)


class _Native(NamedTuple):
    """An op call run as plain autograd (of its linearised form), ``held`` inputs held constant."""

    rebinding: Rebinding
    held: tuple[bool, ...]

    def __call__(self, session: Any, func: Callable, args: tuple, kwargs: dict) -> Any:
        return session.native(self.rebinding.call(session, args, kwargs), self.held)


class _Node(NamedTuple):
    """An op call run as a relevance node with its rule (in the form the pass carries)."""

    rebinding: Rebinding
    rule: Any

    def __call__(self, session: Any, func: Callable, args: tuple, kwargs: dict) -> Any:
        call = self.rebinding.call(session, args, kwargs)
        out = session.node(call, self.rule)
        call.settle()
        return out


class _Handled(NamedTuple):
    """An op whose handler needs nothing of the pass but the session's own inputs (a token embedding)."""

    handler: Callable

    def __call__(self, session: Any, func: Callable, args: tuple, kwargs: dict) -> Any:
        return self.handler(session, func, args, kwargs)


class Step(NamedTuple):
    """One op of a plan: its function, what decides its rule (:meth:`Origins.signature`), what it does."""

    func: Callable
    key: tuple
    action: Action


# ------------------------------------------------------------------------- recording and replay

class Plan:
    """The decisions of one forward pass, op by op, and the state of the rules they were taken under.

    Attributes
    ----------
    steps : list of Step
    output : tuple
        The origin of the explained output (the op, and the output of it).
    """

    def __init__(self, steps: list[Step], output: tuple, state: RuleState, held: list[Tensor]):
        self.steps = steps
        self.output = output
        self._state = state
        self._held = held  # the parameters the steps know by identity: their ids stay theirs

    def holds(self, composite: Any, model: nn.Module) -> bool:
        """Whether ``model``, its modules, ``composite`` and the rules are as they were when it was recorded."""
        return self._state.holds(composite, model)


class Recording:
    """The decisions of a forward pass under interception, kept step by step (:class:`Plan`).

    The session reports what each op did (:meth:`note`); an op whose effect is not one of the replayable ones
    leaves the pass without a plan.
    """

    def __init__(self, inputs: tuple[Tensor, ...]):
        self.origins = Origins(inputs)
        self.steps: list[Step] = []
        self.valid = True
        self._depth = 0
        self._effect: tuple | None = None
        self._calls: list[OpCall] = []
        self._rules: dict[int, Any] = {}
        self._held: dict[int, Tensor] = {}

    def intercept(self, session: Any, func: Callable, args: tuple, kwargs: dict) -> Any:
        """``func(*args, **kwargs)`` under interception, its decision kept as the next step."""
        if self._depth or not self.valid:  # an op inside another's handler: its decision is the handler's
            self.valid = False
            return session.intercept(func, args, kwargs)
        key = _key(self.origins, session.module_name, args, kwargs)
        self._effect = None
        self._depth += 1
        try:
            out = session.intercept(func, args, kwargs)
        finally:
            self._depth -= 1
        action = self._action(func, args, kwargs, out)
        if action is None or self.origins.unknown or writes_into(func, args, kwargs):
            self.valid = False
            return out
        for tensor in tensors_of((args, kwargs), []):
            if is_parameter(tensor):
                self._held[id(tensor)] = tensor
        self.origins.made(out, len(self.steps))
        self.steps.append(Step(func, key, action))
        return out

    def note(self, *effect: Any) -> None:
        """What the op being intercepted did: ``("constant", with_parameters)``, ``("routed",)``,
        ``("native", call, made_with, rule)`` (rule None: winner-take-all), ``("node", call, made_with, rule)`` (``made_with``: the call's
        arguments, :meth:`~relprop.engine.OpCall.arguments_of`), ``("embedded",)`` (a token embedding); then its
        output."""
        if self._depth != 1 or self._effect is not None:  # outside an op (a module hook), or a second effect
            self.valid = False
        self._effect = effect

    def _action(self, func: Callable, args: tuple, kwargs: dict, out: Any) -> Action | None:
        effect = self._effect
        if effect is None or effect[-1] is not out:  # the handler returned something else than what it ran
            return None
        kind = effect[0]
        if kind == "constant":
            return _Constant(effect[1])
        if kind == "routed":
            return _Plain()
        if kind == "embedded":
            handler = HANDLERS.get(func)
            return _Handled(handler) if handler is not None else None
        if kind not in ("native", "node"):
            return None
        call = effect[1]
        if isinstance(unwrapped(effect[3]), _Unhandled):  # reported by the session it holds
            return None
        if not call.replays or (isinstance(call, ParametricCall) and not parameters_of(call, args, kwargs)):
            return None
        try:
            rebinding = Rebinding(call, effect[2], func, args, kwargs)
        except KeyError:
            return None
        self._calls.append(call)
        rule = effect[3]
        if rule is not None:
            self._rules[id(rule)] = rule
        if kind == "node":
            return _Node(rebinding, rule)
        held = rule.held if rule is not None else ()
        return _Plain(rebinding.held_positions(held)) if rebinding.direct else _Native(rebinding, held)

    def plan(self, output: Tensor, composite: Any, model: nn.Module) -> Plan | None:
        """The plan of the finished pass of ``model`` that explains ``output``, taken with ``composite``; None
        where a decision cannot be replayed."""
        origin = self.origins.of(output) if is_activation(output) else None
        # a later op may have changed a call (a BatchNorm merged into its convolution)
        if not self.valid or origin is None or not all(call.replays for call in self._calls):
            return None
        rules = list({id(unwrapped(rule)): unwrapped(rule) for rule in self._rules.values()}.values())
        return Plan(self.steps, origin, RuleState(composite, model, rules), list(self._held.values()))


class Replay:
    """A forward pass that follows a :class:`Plan`: each op checked against its step, then its decision run."""

    def __init__(self, plan: Plan, inputs: tuple[Tensor, ...]):
        self.plan = plan
        self.origins = Origins(inputs)
        self._next = 0

    def run(self, session: Any, func: Callable, args: tuple, kwargs: dict) -> Any:
        steps = self.plan.steps
        index = self._next
        if index >= len(steps):
            raise PathChanged("relprop: the forward pass runs more ops than its plan")
        step = steps[index]
        self._next = index + 1  # a failed check leaves the replay at an end: every later op fails too
        # (a property's getter is a new method-wrapper on each access: equal, not identical)
        if ((step.func is not func and step.func != func)
                or not same(step.key, _key(self.origins, session.module_name, args, kwargs))):
            self._next = len(steps) + 1
            raise PathChanged(f"relprop: op {index} of the forward pass differs from its plan")
        out = step.action(session, func, args, kwargs)
        self.origins.made(out, index)
        return out

    def finished(self, output: Any) -> bool:
        """Whether the pass ran every op of the plan and explains the output the plan did."""
        return (self._next == len(self.plan.steps) and isinstance(output, Tensor)
                and is_activation(output) and self.origins.of(output) == self.plan.output)


class Entry:
    """What an explainer knows of one input signature: its passes so far, its plan's failures, its plan."""

    def __init__(self) -> None:
        self.passes = 0
        self.failures = 0
        self.plan: Plan | None = None

    def next_pass(self, composite: Any, model: nn.Module, leaves: tuple[Tensor, ...]
                  ) -> tuple[Replay | None, Recording | None]:
        """The replay a pass of this signature follows, or the recording it makes, if any."""
        if self.plan is not None and not self.plan.holds(composite, model):
            self.plan = None  # the modules, the composite or a rule changed: recorded again
        if self.plan is not None:
            return Replay(self.plan, leaves), None
        if self.passes > 1 and self.failures < Plans.FAILURES:
            return None, Recording(leaves)
        return None, None


class Plans:
    """The captured plans of one explainer, by input signature.

    A signature's first pass runs under interception alone (most attributions are one-offs: a plan would cost
    its record and serve nothing), its second is recorded, later ones are replayed. A plan that fails is
    dropped; after :attr:`FAILURES` failures the signature is no longer recorded.
    """

    #: a signature whose plan failed this often is explained under interception from then on
    FAILURES = 2

    def __init__(self) -> None:
        self._entries: OrderedDict[Any, Entry] = OrderedDict()

    def entry(self, signature: Any) -> Entry:
        """The entry of ``signature``, for one pass more."""
        entry = self._entries.pop(signature, None) or Entry()
        entry.passes += 1
        self._entries[signature] = entry
        while len(self._entries) > _KEPT:
            self._entries.popitem(last=False)
        return entry

    def clear(self) -> None:
        """Forget every plan (they are recorded again)."""
        self._entries.clear()


def pass_signature(inputs: tuple[Tensor, ...], extra: tuple, keywords: dict, *flags: Any) -> Any:
    """What a forward pass's plan is kept by: its inputs' dtypes, shapes and devices, the other arguments'
    structure and values, and ``flags``."""
    origins = Origins(inputs)
    signature = (origins.signature(inputs), origins.signature(extra), origins.signature(keywords), flags)
    try:
        hash(signature)
    except TypeError:  # an argument that cannot key a plan (a list, an unhashable object): none is kept
        return None
    return signature
