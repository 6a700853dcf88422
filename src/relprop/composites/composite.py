"""The :class:`Composite`: which rule each op of a model gets, by kind, module, type, name and function."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from fnmatch import fnmatchcase
from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor, nn

from relprop import rules
from relprop._core.kinds import GATE_TAGS, OpKind
from relprop._core.registry import HANDLERS, ROUTING_HANDLERS, op_name
from relprop._core.rule import Rule
from relprop.engine.calls import OpCall

__all__ = ["Composite", "function_name"]

_TypeMap = Mapping[type | tuple[type, ...], Rule] | Iterable[tuple[type | tuple[type, ...], Rule]]
_NameMap = Mapping[str, Rule] | Iterable[tuple[str, Rule]]


_FuncMap = Mapping[Callable, Rule] | Iterable[tuple[Callable, Rule]]

#: other names torch gives the same function, by the name they stand for
_SYNONYMS = {"truediv": "div", "true_divide": "div", "divide": "div", "multiply": "mul", "subtract": "sub",
             "negative": "neg", "clip": "clamp", "absolute": "abs"}
#: operators whose reflected (``__radd__``) and in-place (``__iadd__``) forms are the same function
_OPERATORS = frozenset({"add", "sub", "mul", "div", "truediv", "matmul", "pow"})


@functools.cache
def function_name(func: Callable, check: bool = False) -> str:
    """The name by which ``func_map`` matches a torch function: the same for all its aliases.

    The function's ``__name__``, with these forms counted as the function
    itself: the in-place form's trailing ``_`` (``relu_``, ``add_``); an
    operator's dunder, reflected and in-place forms (``__add__``,
    ``__radd__``, ``__iadd__`` are ``add``); and torch's synonyms
    ``divide``, ``true_divide``, ``__truediv__`` (``div``), ``multiply``
    (``mul``), ``subtract`` (``sub``), ``negative`` (``neg``), ``clip``
    (``clamp``), ``absolute`` (``abs``). The namespace does not count:
    ``F.relu``, ``torch.relu`` and ``Tensor.relu`` are ``relu``.

    Parameters
    ----------
    func : callable
    check : bool
        Raise ``ValueError`` unless relprop gives some op of that name a rule
        (a routing op such as ``reshape`` or ``torch.max``, whose gradient
        moves relevance as it is, gets none).
    """
    name = getattr(func, "__name__", None)
    if not callable(func) or not isinstance(name, str):
        raise ValueError(f"relprop: func_map keys are torch functions (F.max_pool2d, torch.add), got {func!r}")
    if name.startswith("__") and name.endswith("__"):
        name = name[2:-2]
        if name[:1] in ("r", "i") and name[1:] in _OPERATORS:
            name = name[1:]
    elif name.endswith("_") and not name.startswith("_"):
        name = name[:-1]
    name = _SYNONYMS.get(name, name)
    if check and name not in _rule_bearing():
        routed = any(function_name(f) == name for f in HANDLERS)
        raise ValueError(f"relprop: func_map cannot give {op_name(func)} a rule: "
                         + ("relevance follows its gradient as it is (a routing op)" if routed else
                            "relprop has no op of that name (it is not a torch function relprop handles)"))
    return name


@functools.cache
def _rule_bearing() -> frozenset[str]:
    """The names of the torch functions whose op calls get a rule (not routing ops, not metadata)."""
    return frozenset(function_name(func) for func, handler in HANDLERS.items() if handler not in ROUTING_HANDLERS)


def _function_rule(function: type, rule: Rule) -> Rule:
    """``rule`` for a custom autograd Function, if it is one such a Function can take.

    The engine sees a Function through its autograd node alone (``Function.apply`` is not a torch function, and
    its forward runs with gradients off), so it knows the relevance arriving and what the Function's backward
    makes of it, not the inputs: ``rules.Pass()`` (the relevance crosses it unchanged, for a Function with one
    input of the output's shape) and ``rules.Gradient()`` (its own backward, without a warning) are the rules it
    can apply.
    """
    if not isinstance(rule, (rules.Pass, rules.Gradient)):
        raise ValueError(f"relprop: func_map cannot give the custom autograd Function "
                         f"{function.__module__}.{function.__qualname__} the rule {rule!r}: a custom Function "
                         "takes rules.Pass() (its relevance crosses it unchanged) or rules.Gradient() (its own "
                         "backward)")
    return rule


def _pairs(mapping: Mapping | Iterable | None) -> list[tuple]:
    if mapping is None:
        return []
    return list(mapping.items()) if isinstance(mapping, Mapping) else list(mapping)


class Composite:
    """Assigns a rule to every op; the base of all presets.

    Parameters
    ----------
    epsilon : float
        Stabiliser of the default epsilon rule on sums, pooling and
        normalisation (and on conv/dense ops when no rule is given).
        ``epsilon=0`` makes every default exact LRP-0.
    conv, dense : Rule, optional
        Rules for convolutions and for dense (``F.linear``) ops. Default:
        ``rules.Epsilon(epsilon)``.
    first : mapping of op kind (``"conv"``, ``"dense"``) to Rule, optional
        Rules for first layers (fed by a model input).
    layer_map : mapping or pairs of module type(s) to Rule, optional
    name_map : mapping or pairs of module-path pattern to Rule, optional
    func_map : mapping or pairs of torch function to Rule, optional
        Rules by the torch function an op calls (``{F.max_pool2d:
        rules.Proportional()}``). A function matches the op calls of every
        function of the same name in ``torch``, ``torch.nn.functional`` and
        the ``Tensor`` methods (``F.relu``, ``torch.relu``, ``x.relu()``),
        their in-place forms (``relu_``, ``x += y`` for ``torch.add``) and
        operators (``x + y``, ``2 - x``, ``x / y``, ``x @ y``); see
        :func:`~relprop.composites.function_name`. Like ``module.rule`` the rule must apply to
        every call it matches, else :class:`~relprop.RuleError`. A
        function that relevance only passes through (``reshape``,
        ``torch.max``) or that relprop has no op for raises ``ValueError``.
        A key may also be a custom ``torch.autograd.Function`` class
        (``{MySTE: rules.Pass()}``), with ``rules.Pass()`` or
        ``rules.Gradient()`` (see :meth:`function_rule`).
    smooth_stride : bool
        Propagate every convolution and max pooling with a stride above 1
        (ResNet's stem, its strided 3x3 convolutions and downsampling
        shortcuts) as its stride-1 form followed by the average of each
        stride x stride block (:class:`~relprop.rules.SmoothStride`: with the
        rule for convolutions ``conv`` where that is built from terms, ZPlus,
        AlphaBeta, Gamma, ..., else the epsilon rule; max pooling by the
        epsilon rule), which removes the checkerboard such layers leave in
        heatmaps. After ``layer_map``, before ``conv``. A ``first`` rule for
        convolutions built from terms or epsilon (Flat, ZBox) is smoothed
        likewise where the first layer is strided, and applies as it is where
        not.
    """

    #: what makes a factor of a product a gate that takes no relevance: a sigmoid output, a normalising
    #: statistic (``x * rsqrt(var)``), a divisor, an exponential weight (``exp(k - max) * v``), attention weights
    #: (a softmax output: LRP-0 of ``A v`` with ``A`` held constant, which conserves; AttnLRP splits it instead)
    gate_kinds: frozenset[str] = GATE_TAGS | {"softmax"}
    #: whether an attribution carries relevance per unit of activation, ``R / x``, between the ops: for composites
    #: whose rules are modified gradients (LRP-0, uniform products, the softmax rule), which then run as the ops'
    #: own VJPs (see ``relprop.engine.Session``); the relevance is the same up to rounding
    gradient_form: bool = False

    #: the methods by which a composite chooses rules
    CHOOSERS = ("rule_for", "own_rule", "default", "function_rule", "_product", "_smoothed")

    @property
    def replayable(self) -> bool:
        """Whether a captured plan or a compiled program sees every change of this composite's choices: they follow
        from its attributes, the rules' and the modules' ``rule`` alone, as :class:`Composite`'s own methods
        choose, or from what :meth:`state` declares. A subclass that chooses by other means (a method of its own)
        and declares nothing may read anything, so nothing it decided is reused."""
        kind = type(self)
        return (all(getattr(kind, name) is getattr(Composite, name) for name in self.CHOOSERS)
                or kind.state is not Composite.state)

    def state(self) -> Any:
        """What a subclass's own choosers read besides its attributes (a settings object's values, say), as a value
        that compares equal while their choices stay the same: a pass whose rules were decided under another state
        is decided again. None here: :class:`Composite` reads nothing else."""
        return None

    def __init__(self, epsilon: float = 1e-6, conv: Rule | None = None, dense: Rule | None = None,
                 first: Mapping[str, Rule] | None = None, layer_map: _TypeMap | None = None,
                 name_map: _NameMap | None = None, func_map: _FuncMap | None = None, smooth_stride: bool = False):
        self.epsilon = epsilon
        self.conv = conv if conv is not None else rules.Epsilon(epsilon)
        self.dense = dense if dense is not None else rules.Epsilon(epsilon)
        self.first = dict(first or {})
        self.layer_map = _pairs(layer_map)
        self.name_map = _pairs(name_map)
        self.func_map = _pairs(func_map)
        self._by_function: dict[str, tuple[str, Rule]] = {}  # function name -> (the key's name, its rule)
        self._by_class: dict[type, Rule] = {}  # custom autograd Function -> its rule (see function_rule)
        for func, rule in self.func_map:
            if isinstance(func, type) and issubclass(func, torch.autograd.Function):
                self._by_class.setdefault(func, _function_rule(func, rule))
                continue
            self._by_function.setdefault(function_name(func, check=True), (op_name(func), rule))
        self.smooth_stride = self._smoothed(self.conv) if smooth_stride else None
        # a first layer (the stem) takes its own rule before smooth_stride is asked: that rule is smoothed itself
        if smooth_stride and isinstance(self.first.get("conv"), (rules.BasicRule, rules.Epsilon)):
            self.first["conv"] = self._smoothed(self.first["conv"], any_stride=True)
        self._linear = rules.Epsilon(epsilon)
        self._pass = rules.Pass()
        self._uniform = rules.UniformProduct(epsilon)
        self._gated = rules.SignalTakesAll(epsilon, self.gate_kinds)
        self._softmax = rules.Softmax()
        #: fused attention: the values take all, the weights held constant (AttnLRP: split uniformly)
        self.attention: Rule = self._gated

    def _smoothed(self, rule: Rule, any_stride: bool = False) -> rules.SmoothStride:
        """SmoothStride with ``rule`` where that is built from terms (ZPlus, Flat, ZBox, ...), else the epsilon rule
        with ``rule``'s epsilon; the composite's epsilon on max pooling."""
        if isinstance(rule, rules.BasicRule):
            return rules.SmoothStride(self.epsilon, rule=rule, any_stride=any_stride)
        epsilon = rule.epsilon if isinstance(rule, rules.Epsilon) else self.epsilon
        return rules.SmoothStride(epsilon, any_stride=any_stride)

    def function_rule(self, function: type) -> Rule | None:
        """The ``func_map`` rule for a custom ``torch.autograd.Function`` met in the forward pass (or a base class).

        None: none was given; its own backward then carries the relevance, as a gradient, and it is reported.
        """
        for cls in function.__mro__ if self._by_class else ():
            if cls in self._by_class:
                return self._by_class[cls]
        return None

    @staticmethod
    def own_rule(module: nn.Module | None) -> Rule | None:
        """The rule set on ``module`` as ``module.rule``, if any."""
        rule = getattr(module, "rule", None)
        return rule if isinstance(rule, Rule) else None

    def maps_function(self, func: Callable) -> bool:
        """Whether ``func_map`` gives ``func`` (or an alias of it, :func:`function_name`) a rule; for what is no
        function to name, whether it gives any function one."""
        try:
            return function_name(func) in self._by_function
        except ValueError:
            return bool(self._by_function)

    def rule_for(self, call: OpCall, module: nn.Module | None, name: str) -> tuple[Rule | None, str]:
        """The rule for ``call``, issued by ``module`` at path ``name``, and where it came from.

        None means winner-take-all (the plain gradient). The engine checks
        with ``rule.accepts`` that the rule can apply once the op has run.
        """
        own = self.own_rule(module)
        if own is not None:
            return own, f"set as .rule on module '{name or '<root>'}'"
        for pattern, rule in self.name_map:
            if call.kind in rule.kinds and fnmatchcase(name, pattern):
                return rule, f"name_map pattern {pattern!r}"
        if self._by_function and (found := self._by_function.get(function_name(call.func))) is not None:
            return found[1], f"func_map entry for {found[0]}"
        if call.is_first and call.kind in self.first:
            return self.first[call.kind], "first layer"
        for types, rule in self.layer_map:
            if call.kind in rule.kinds and isinstance(module, types):
                return rule, f"layer_map entry for {types}"
        if self.smooth_stride is not None and self.smooth_stride.accepts(call):
            return self.smooth_stride, "smooth_stride (a strided convolution or max pool)"
        return self.default(call), "default"

    #: the default rule of each op kind, as the name of the composite's attribute that holds it (read at each op,
    #: so a preset or a user that sets ``composite.dense = ...`` changes it). Products choose among three rules
    #: (``Composite._product``). A kind not listed (max pooling, unknown ops) gets None: winner-take-all, the gradient
    DEFAULTS: Mapping[OpKind, str] = MappingProxyType({
        OpKind.CONV: "conv",
        OpKind.DENSE: "dense",
        OpKind.SUM: "_linear",
        OpKind.NORM: "_linear",
        OpKind.BATCHNORM: "_linear",
        OpKind.SOFTMAX: "_softmax",
        OpKind.ATTENTION: "attention",
        OpKind.ELEMENTWISE: "_pass",
    })

    def default(self, call: OpCall) -> Rule | None:
        """The rule an op gets when nothing is mapped to it (:attr:`DEFAULTS`)."""
        if call.kind == OpKind.PRODUCT:
            return self._product(call)
        attribute = self.DEFAULTS.get(call.kind)
        return getattr(self, attribute) if attribute is not None else None

    def _product(self, call: OpCall) -> Rule:
        """A product's default: the signal takes all next to gates, two or more activations split uniformly,
        an activation scaled by constants passes its relevance."""
        if self._gated.accepts(call):
            return self._gated
        return self._uniform if len(call.inputs) >= 2 else self._pass

    def _parameters(self) -> list[str]:
        """The preset's own parameters as ``name=value`` texts, for :meth:`__repr__`."""
        if type(self) is not Composite:
            return []
        given = [f"{name}={getattr(self, name)!r}" for name in ("conv", "dense")]
        return given + ([f"first={self.first!r}"] if self.first else [])

    def __repr__(self) -> str:
        """The composite as a user writes it: ``EpsilonPlusFlat(epsilon=1e-06, smooth_stride=True)``."""
        parts = [f"epsilon={self.epsilon!r}", *self._parameters()]
        if self.smooth_stride is not None:
            parts.append("smooth_stride=True")
        if self.func_map:
            parts.append("func_map={" + ", ".join(f"{op_name(func)}: {rule!r}" for func, rule in self.func_map) + "}")
        if self.name_map:
            parts.append("name_map={" + ", ".join(f"{pattern!r}: {rule!r}" for pattern, rule in self.name_map) + "}")
        if self.layer_map:
            names = [getattr(types, "__name__", None) or f"({', '.join(t.__name__ for t in types)})"
                     for types, _ in self.layer_map]
            parts.append("layer_map={" + ", ".join(f"{name}: {rule!r}"
                                                   for name, (_, rule) in zip(names, self.layer_map)) + "}")
        return f"{type(self).__name__}({', '.join(parts)})"


def _tensor(value: Any) -> Tensor:
    import torch

    return torch.as_tensor(value, dtype=torch.float32)


def _short_value(value: float | Tensor) -> str:
    if isinstance(value, Tensor):
        values = [f"{v:.4g}" for v in value.detach().reshape(-1).tolist()]
        return f"[{', '.join(values)}]" if value.numel() > 1 else values[0]
    return repr(value)


