"""Ops the rules do not reach: custom autograd Functions, and ops without a rule, reported when relevance reaches them.

``Function.apply`` is not a torch function: a torch function mode sees only the ops inside the Function's
forward, run with gradients off, and the output comes out with the Function's own backward as its history.
Relevance crosses such a Function through a hook on its autograd node (:meth:`Unruled.custom_functions`).
"""
from __future__ import annotations

import functools
import warnings
from typing import Any

import torch
from torch import Tensor

from relprop._core.contract import Call
from relprop._core.errors import RuleError, UnhandledOpWarning, UnsupportedOpError
from relprop._core.kinds import OpKind
from relprop._core.rule import Gradient, Pass, Rule, broadcasts_to
from relprop._core.tensors import sum_to


class _Unhandled(Gradient):
    """The plain gradient for an op without a rule, reported when relevance reaches it."""

    def __init__(self, session: "Unruled"):
        self._session = session

    def propagate(self, call: Call, relevance: Tensor) -> tuple[Tensor | None, ...]:
        result = super().propagate(call, relevance)
        # an op without an autograd kernel (a custom or quantized kernel) has no gradient either
        self._session.report(call.describe(), relevance, gradient=any(r is not None for r in result))
        return result

    def __repr__(self) -> str:
        return "none"


@functools.cache
def _custom_function(node_type: type) -> type | None:
    """The ``torch.autograd.Function`` whose backward nodes are of ``node_type``; None for autograd's own nodes
    and relprop's.

    ``Function.apply`` is not a torch function: a torch function mode sees only the ops inside the Function's
    forward, run with gradients off, and the output comes out with the Function's own backward as its history.
    """
    function = getattr(node_type, "_forward_cls", None)
    if not isinstance(function, type) or function.__module__.split(".", 1)[0] == "relprop":
        return None
    return function


class GradientFormUnavailable(RuntimeError):
    """The forward pass met what relevance per unit of activation cannot cross (a custom autograd Function, a hook
    on an activation, an op explained as another output, a rule that gives inputs of value 0 relevance): it is
    explained again with relevance itself."""


class FunctionCall:
    """A custom ``torch.autograd.Function`` applied in the forward pass, as the guard and the audit see it.

    Relevance crosses it through a hook on its autograd node (:meth:`Session.custom_functions`): its rule is
    the composite's ``func_map`` entry for the class (``Pass`` or ``rules.Gradient``), else its own
    backward, reported.
    """

    kind = OpKind.UNKNOWN

    def __init__(self, function: type, module_name: str, rule: Rule):
        self.function = function
        self.func = getattr(function, "apply")  # a torch.autograd.Function's classmethod
        self.name = f"{function.__module__}.{function.__qualname__}"
        self.module_name = module_name
        self.rule = rule

    def describe(self) -> str:
        return f"custom autograd Function {self.name} in module '{self.module_name or '<root>'}'"


class Unruled:
    """The part of a :class:`~relprop.engine.Session` that handles what no rule reaches: custom autograd
    Functions, and the reports of ops without a rule."""

    gradient_form: bool
    strict: bool
    guard: bool
    audit: Any
    composite: Any
    unhandled: list[str]
    _observe: Any

    def custom_functions(self, args: tuple | list, module_name: str) -> None:
        """Give every custom autograd Function whose output is among ``args`` its rule, once (a hook on its node).

        The Function's forward is not intercepted as one op (see :func:`_custom_function`); its output is seen
        when the module that applied it returns it, or when an op reads it: every op looks at its arguments' autograd
        nodes, since a Function whose forward runs no torch op on activations (a compiled extension reading their
        memory) leaves no other trace. ``module_name``: the module that applied it (for an op, the module of an op
        run inside the Function's forward, with gradients off, else the module of the op that reads it).
        """
        for value in args:
            if not isinstance(value, Tensor):
                if type(value) in (list, tuple):
                    self.custom_functions(value, module_name)
                continue
            node = value.grad_fn
            if node is None or (function := _custom_function(type(node))) is None or hasattr(node, "_relprop_seen"):
                continue
            if self.gradient_form:  # its backward cannot be told the values a conversion needs
                raise GradientFormUnavailable(f"relprop: custom autograd Function {function.__qualname__}")
            setattr(node, "_relprop_seen", True)  # a Function's node is its ctx: it takes attributes
            rule = self.composite.function_rule(function)
            call = FunctionCall(function, module_name, rule if rule is not None else _Unhandled(self))
            node.register_hook(functools.partial(self._custom_backward, call))

    def _custom_backward(self, call: FunctionCall, grad_inputs: tuple, grad_outputs: tuple) -> tuple | None:
        """The relevance crossing a custom Function: its rule's, or its own backward's (reported)."""
        arriving = [g for g in grad_outputs if g is not None]
        if not arriving:
            return None
        relevance = arriving[0] if len(arriving) == 1 else torch.cat([g.reshape(-1) for g in arriving])
        result = tuple(grad_inputs)
        if isinstance(call.rule, Pass):
            slots = [i for i, g in enumerate(grad_inputs) if g is not None]
            if len(slots) != 1 or len(arriving) != 1 or not broadcasts_to(grad_inputs[slots[0]].shape, relevance.shape):
                raise RuleError(f"relprop: rule {call.rule!r} (func_map entry) cannot apply to {call.describe()}: "
                                "it needs one differentiable input and one output that sums back to its shape")
            result = tuple(sum_to(relevance, g.shape) if g is not None else None for g in grad_inputs)
        elif isinstance(call.rule, _Unhandled):
            self.report(call.describe(), relevance, consequence="its own backward was used as its gradient")
        observe = self._observe if self.guard else self.audit
        if observe is not None:
            observe(call, relevance, result)
        return result if isinstance(call.rule, Pass) else None

    def report(self, description: str, relevance: Tensor, gradient: bool = True, consequence: str | None = None) -> None:
        """Relevance reached an op without a rule: warn once (raise in strict mode).

        ``gradient``: whether the op's plain gradient carries the relevance on; else it stops there.
        ``consequence``: what became of the relevance, if neither.
        """
        consequence = consequence or ("its plain gradient was used" if gradient else
                                      "it has no gradient either, so the relevance stops there")
        if self.strict:
            raise UnsupportedOpError(f"relprop: no rule for {description}; {consequence} (strict mode)")
        if description not in self.unhandled:
            self.unhandled.append(description)
            warnings.warn(f"relprop: no rule for {description}; {consequence}", UnhandledOpWarning, stacklevel=2)
