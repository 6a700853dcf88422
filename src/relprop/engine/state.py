"""What decides the rules of a pass besides its ops: one snapshot, compared by every path that reuses decisions.

A captured plan (``relprop.engine.plan``) and a compiled program (``relprop.methods.compiled``) both reuse the
rules decided on an earlier call. Both are right only while everything that decided those rules is as it was,
so both compare the same :class:`RuleState`:

- the explained model itself, and every module with its path, its class, a ``forward`` patched onto it and the
  rule set on it as ``module.rule``;
- every hook a forward or a backward pass runs: forward and forward pre-hooks, full backward and backward
  pre-hooks, of each module and those registered for every module;
- the composite: its class, its attributes read deeply (a rule it holds, and that rule's settings, by value),
  and what it declares with ``state()`` where it chooses rules by means of its own;
- the rules the pass used, read deeply likewise.

Tensors are compared by identity and memory (a parameter given new memory is another), never by value: the
values of the weights decide no rule. A composite that chooses rules by methods of its own and declares nothing
(:func:`opaque`) may read anything: no path caches its decisions.
"""
from __future__ import annotations

import functools
import types
from typing import Any

from torch import Tensor, nn

__all__ = ["RuleState", "module_rule", "opaque", "same", "snapshot"]

_ABSENT = object()
#: what a snapshot holds as it is: modules (their structure is read apart), classes and functions
_BY_IDENTITY = (nn.Module, type, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
                functools.partial, types.ModuleType)
#: values a snapshot holds as they are, tested first: most of what a rule or a composite holds
_PLAIN = frozenset({bool, int, float, complex, str, bytes, type(None)})


def same(a: Any, b: Any) -> bool:
    """``a == b``, False where the comparison is elementwise or fails."""
    try:
        return bool(a == b)
    except Exception:  # a value whose == is elementwise or fails: not the same
        return False


def snapshot(value: Any, seen: frozenset[int] = frozenset()) -> Any:
    """``value`` as a comparable snapshot, read deeply: containers and plain objects (a rule, a settings object) by
    their contents, tensors by identity and memory, modules, functions and classes by identity."""
    if type(value) in _PLAIN:
        return value
    if isinstance(value, Tensor):
        return ("tensor", id(value), value.data_ptr(), value.shape, value.stride())
    if isinstance(value, (list, tuple)):
        return tuple([snapshot(v, seen) for v in value])
    if isinstance(value, dict):
        return tuple([(key, snapshot(v, seen)) for key, v in value.items()])
    if isinstance(value, (set, frozenset)):
        return ("set", frozenset(value))
    if isinstance(value, _BY_IDENTITY) or not hasattr(value, "__dict__"):
        return value
    if id(value) in seen:  # a cycle back to an object read above
        return ("cycle", id(value))
    inner = seen | {id(value)}
    return (type(value), tuple([(key, snapshot(v, inner)) for key, v in vars(value).items()]))


def module_rule(module: nn.Module) -> Any:
    """``getattr(module, "rule", None)``, as the composite reads it, without the exception that
    ``Module.__getattr__`` raises for each module that has none: a plain attribute is read where it is."""
    kind = type(module)
    on_class = getattr(kind, "rule", _ABSENT)
    if on_class is not _ABSENT and hasattr(on_class, "__get__"):  # a property, or another descriptor
        return getattr(module, "rule", None)
    on_module = module.__dict__.get("rule", _ABSENT)
    if on_module is not _ABSENT:
        return on_module
    if on_class is not _ABSENT:
        return on_class
    # a class's own __getattr__ may make one
    return None if kind.__getattr__ is nn.Module.__getattr__ else getattr(module, "rule", None)


def opaque(composite: Any) -> bool:
    """Whether ``composite`` chooses rules by means no snapshot sees (``replayable`` False: a method of its own,
    and no ``state()`` declaring what it reads), so that nothing it decided may be reused."""
    return not getattr(composite, "replayable", True)


def _hooks(module: nn.Module) -> tuple:
    return (tuple(module._forward_hooks), tuple(module._forward_pre_hooks), tuple(module._backward_hooks),
            tuple(module._backward_pre_hooks))


def global_hooks() -> tuple:
    """The hooks registered for every module (``register_module_forward_hook`` and the like)."""
    registry = nn.modules.module
    return (tuple(registry._global_forward_hooks), tuple(registry._global_forward_pre_hooks),
            tuple(registry._global_backward_hooks), tuple(registry._global_backward_pre_hooks))


def backward_hooks(model: nn.Module) -> str | None:
    """The path of a module of ``model`` with a backward hook (``"*"``: one registered for every module), else
    None: such a hook runs in the backward pass, outside what a rule decides."""
    registry = nn.modules.module
    if registry._global_backward_hooks or registry._global_backward_pre_hooks:
        return "*"
    for name, module in model.named_modules():
        if module._backward_hooks or module._backward_pre_hooks:
            return name or "<root>"
    return None


#: the parts of a snapshot, in words, in its order
_PARTS = ("the model explained", "a module, its rule or its hooks", "the hooks registered for every module",
          "the composite's class", "the composite's settings", "the composite's declared state", "a rule's settings")


class RuleState:
    """A snapshot of what decides the rules of ``model`` under ``composite``, besides the ops (see the module).

    Parameters
    ----------
    composite : Composite
    model : nn.Module
    rules : list
        The rules the pass used (those a composite makes as it chooses, such as a rule in gradient form, are read
        through the rule they wrap).
    """

    def __init__(self, composite: Any, model: nn.Module, rules: list[Any]):
        self.rules = rules
        self._state = self._of(composite, model)

    def _of(self, composite: Any, model: nn.Module) -> Any:
        modules = tuple([(name, module, type(module), module.__dict__.get("forward"), snapshot(module_rule(module)),
                          _hooks(module)) for name, module in model.named_modules()])
        declared = composite.state() if hasattr(composite, "state") else None
        return (model, modules, global_hooks(), type(composite), snapshot(vars(composite)), snapshot(declared),
                tuple([(id(rule), snapshot(vars(rule))) for rule in self.rules]))

    def holds(self, composite: Any, model: nn.Module) -> bool:
        """Whether ``model``, its modules, ``composite`` and the rules are as they were at the snapshot."""
        return same(self._of(composite, model), self._state)

    def changed(self, composite: Any, model: nn.Module) -> str | None:
        """What of the snapshot differs now, in words (the first part that does), or None where it holds."""
        now = self._of(composite, model)
        if same(now, self._state):
            return None
        return next((name for name, a, b in zip(_PARTS, now, self._state) if not same(a, b)), "the rules")
