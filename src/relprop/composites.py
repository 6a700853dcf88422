"""Composites: which rule each op of a model gets (docs/design.md, section 4).

A composite answers, for every op of the forward pass, which rule propagates
relevance through it. The answer is found in this order, first match wins:

1. ``module.rule`` set on the module that issued the op (captum's convention);
   it must be able to apply to every rule-bearing op of that module, else
   :class:`~relprop.RuleError` is raised.
2. ``name_map``: the first ``(pattern, rule)`` whose shell-style pattern
   (``fnmatch``) matches the dotted module path.
3. ``func_map``: the rule for the torch function the op calls, matched by
   name with its aliases (:func:`~relprop.composites.function_name`); like ``module.rule`` it
   must apply to every call it matches.
4. ``first``: the rule for a *first layer*, a convolution or dense op fed by
   a model input through routing ops only (reshape, pad, ...).
5. ``layer_map``: the first ``(module type(s), rule)`` matching the module.
6. ``smooth_stride``: :class:`~relprop.rules.SmoothStride` on convolutions
   and max pooling with a stride above 1 (a first layer's own rule is
   smoothed at step 4).
7. The preset's rule for convolutions (``conv``) and dense layers (``dense``).
8. The op family's default: epsilon (with the composite's epsilon) on sums,
   average pooling, normalisation and BatchNorms that follow no linear op;
   Pass on elementwise activations and on scaling by constants; max pooling
   winner-take-all; the softmax rule inside the model; products of two
   activations and fused attention split uniformly, except that a factor of a
   kind in ``gate_kinds`` (a sigmoid gate, ``rsqrt`` of a variance, a
   divisor, an exponential weight; for CP-LRP also activations and attention
   weights) takes none.

A rule from ``name_map``, ``first`` or ``layer_map`` is only used for ops of
the kinds it is about (``rule.kinds``): a name pattern that matches a whole
block gives its rule to the block's convolutions and leaves its activations
to the default. A rule that is about an op's kind but cannot apply to it
(Pass on a convolution that changes the shape) raises
:class:`~relprop.RuleError`.

BatchNorm directly after a convolution or dense op is merged into it first,
unless the BatchNorm module has a ``rule`` of its own.
"""
from __future__ import annotations

import functools
import inspect
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

__all__ = [
    "Composite", "Epsilon", "EpsilonPlus", "EpsilonPlusFlat", "EpsilonAlpha2Beta1", "EpsilonAlpha2Beta1Flat",
    "EpsilonGammaBox", "AttnLRP", "CPLRP", "PRESETS", "get", "function_name", "box_bounds", "NORMALIZATIONS",
    "BOUNDS_NEEDED",
]

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


class Epsilon(Composite):
    """Epsilon on every linear op (preset ``epsilon``); ``Epsilon(0)`` is LRP-0 everywhere."""

    def __init__(self, epsilon: float = 1e-6, **kwargs: Any) -> None:
        super().__init__(epsilon, **kwargs)


class EpsilonPlus(Composite):
    """ZPlus on convolutions, Epsilon on dense layers (zennit's ``epsilon_plus``)."""

    def __init__(self, epsilon: float = 1e-6, **kwargs: Any) -> None:
        super().__init__(epsilon, conv=rules.ZPlus(stabilizer=epsilon), dense=rules.Epsilon(epsilon), **kwargs)


class EpsilonPlusFlat(Composite):
    """Flat on the first layer, ZPlus on convolutions, Epsilon on dense layers (``epsilon_plus_flat``)."""

    def __init__(self, epsilon: float = 1e-6, **kwargs: Any) -> None:
        flat = rules.Flat(stabilizer=epsilon)
        super().__init__(epsilon, conv=rules.ZPlus(stabilizer=epsilon), dense=rules.Epsilon(epsilon),
                         first={"conv": flat, "dense": flat}, **kwargs)


class EpsilonAlpha2Beta1(Composite):
    """AlphaBeta(2, 1) on convolutions, Epsilon on dense layers (``epsilon_alpha2_beta1``)."""

    def __init__(self, epsilon: float = 1e-6, **kwargs: Any) -> None:
        super().__init__(epsilon, conv=rules.AlphaBeta(2.0, 1.0, stabilizer=epsilon), dense=rules.Epsilon(epsilon),
                         **kwargs)


class EpsilonAlpha2Beta1Flat(Composite):
    """Flat on the first layer, AlphaBeta(2, 1) on convolutions, Epsilon on dense layers."""

    def __init__(self, epsilon: float = 1e-6, **kwargs: Any) -> None:
        flat = rules.Flat(stabilizer=epsilon)
        super().__init__(epsilon, conv=rules.AlphaBeta(2.0, 1.0, stabilizer=epsilon), dense=rules.Epsilon(epsilon),
                         first={"conv": flat, "dense": flat}, **kwargs)


#: the pixel normalisations that give :class:`EpsilonGammaBox` its bounds by name, as the command line's
#: ``--normalize``: pixels in [0, 1], then minus the mean and divided by the std (per channel)
NORMALIZATIONS: Mapping[str, tuple[tuple[float, ...], tuple[float, ...]]] = MappingProxyType({
    "imagenet": ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
    "inception": ((0.5,), (0.5,)),  # pixels to [-1, 1], as models converted from TensorFlow expect
    "none": ((0.0,), (1.0,)),
})

#: the one message for an EpsilonGammaBox without bounds, from Python and from the command line alike
BOUNDS_NEEDED = ("relprop: preset 'epsilon-gamma-box' needs the range of the model's inputs (ZBox, its first-layer "
                 "rule, is bounded by them): give the preprocessing, normalization='imagenet' (pixels in [0, 1] "
                 "normalised by ImageNet's mean and std) or 'none' (pixels in [0, 1]) or mean=... and std=..., or the "
                 "bounds themselves, low=... and high=...; on the command line: --normalize imagenet or none")


def box_bounds(low: float | Tensor | None = None, high: float | Tensor | None = None,
               normalization: str | None = None, mean: Any = None, std: Any = None) -> tuple[Any, Any]:
    """The smallest and largest input values, from the bounds themselves or from the preprocessing.

    ``normalization`` (``"imagenet"``, ``"none"``: the command line's ``--normalize``) or ``mean`` and
    ``std`` (per channel) describe pixels in [0, 1] normalised as ``(pixel - mean) / std``; their bounds are
    ``(0 - mean) / std`` and ``(1 - mean) / std`` as ``(1, C, 1, 1)`` tensors. Raises ``ValueError``
    (:data:`BOUNDS_NEEDED`) when nothing is given, and when two descriptions are given at once.
    """
    import torch

    given = [name for name, value in (("low/high", low if low is not None else high),
                                      ("normalization", normalization), ("mean/std", mean if mean is not None else std))
             if value is not None]
    if not given:
        raise ValueError(BOUNDS_NEEDED)
    if len(given) > 1:
        raise ValueError(f"relprop: EpsilonGammaBox takes one description of its bounds, got {' and '.join(given)}")
    if given[0] == "low/high":
        if low is None or high is None:
            raise ValueError("relprop: EpsilonGammaBox needs both low and high (or normalization=, or mean= and std=)")
        return low, high
    if normalization is not None:
        if normalization not in NORMALIZATIONS:
            raise ValueError(f"relprop: unknown normalization {normalization!r}; known: {', '.join(NORMALIZATIONS)} "
                             "(or give mean= and std=)")
        mean, std = NORMALIZATIONS[normalization]
    if mean is None or std is None:
        raise ValueError("relprop: EpsilonGammaBox needs both mean and std (the preprocessing's, per channel)")
    mean_t = torch.as_tensor(mean, dtype=torch.float32).reshape(1, -1, 1, 1)
    std_t = torch.as_tensor(std, dtype=torch.float32).reshape(1, -1, 1, 1)
    return (0 - mean_t) / std_t, (1 - mean_t) / std_t


class EpsilonGammaBox(Composite):
    """ZBox on a first convolution, Gamma on other convolutions, Epsilon on dense layers.

    ZBox needs the range of the inputs, given in one of three ways: ``normalization="imagenet"`` or
    ``"none"`` (the command line's ``--normalize``: pixels in [0, 1], normalised by ImageNet's mean and
    std or not at all); ``mean=`` and ``std=`` (the preprocessing's, per channel, for pixels in [0, 1]);
    ``low=`` and ``high=`` (the smallest and largest input values, scalars or ``(1, C, 1, 1)`` tensors, in
    the model's input space). Without any, ``ValueError`` (:data:`BOUNDS_NEEDED`): so
    ``relprop.LRP(model, "epsilon-gamma-box")`` refuses, ``get("epsilon-gamma-box", normalization="imagenet")``
    works. ``epsilon`` and ``gamma`` are the stabiliser and Gamma's parameter.
    """

    def __init__(self, low: float | Tensor | None = None, high: float | Tensor | None = None, epsilon: float = 1e-6,
                 gamma: float = 0.25, *, normalization: str | None = None, mean: Any = None, std: Any = None,
                 **kwargs: Any) -> None:
        self.low, self.high = box_bounds(low, high, normalization, mean, std)
        self.gamma, self.normalization = gamma, normalization
        self._bounds_given = (f"normalization={normalization!r}" if normalization is not None else
                              f"mean={_short_value(_tensor(mean))}, std={_short_value(_tensor(std))}"
                              if mean is not None else
                              f"low={_short_value(self.low)}, high={_short_value(self.high)}")
        super().__init__(epsilon, conv=rules.Gamma(gamma, stabilizer=epsilon), dense=rules.Epsilon(epsilon),
                         first={"conv": rules.ZBox(self.low, self.high, stabilizer=epsilon)}, **kwargs)

    def _parameters(self) -> list[str]:
        return [self._bounds_given, f"gamma={self.gamma!r}"]


class AttnLRP(Composite):
    """AttnLRP (Achtibat et al. 2024) for transformers, text or vision.

    LRP-0 on linear maps and sums (no stabiliser; biases absorb their share),
    identity on elementwise nonlinearities and on normalisation statistics,
    uniform split on products of two activations (``q @ k``, ``attn @ v``,
    ``act(gate) * up``), the softmax rule ``R_x = x * (R - s * sum R)``.

    Parameters
    ----------
    gamma : float, optional
        Use Gamma(gamma) on linear and convolution layers instead (for vision
        transformers).
    epsilon : float
        Stabiliser of products and sums; 0 gives exact LRP-0 (divisions by 0 give 0).
    """

    #: attention weights are no gates: ``A v`` splits uniformly, the softmax takes its rule
    gate_kinds = GATE_TAGS

    def __init__(self, gamma: float | None = None, epsilon: float = 0.0, **kwargs: Any) -> None:
        linear = rules.Gamma(gamma, stabilizer=epsilon) if gamma is not None else rules.Epsilon(epsilon)
        self.gamma = gamma
        super().__init__(epsilon, conv=linear, dense=linear, **kwargs)
        self.attention = self._uniform

    def _parameters(self) -> list[str]:
        return [f"gamma={self.gamma!r}"] if self.gamma is not None else []


class CPLRP(AttnLRP):
    """CP-LRP (Ali et al. 2022): like :class:`AttnLRP`, but no relevance through attention weights or gates.

    Attention weights, softmax outputs and activations that gate a product
    (``act(gate) * up``) are held constant: relevance flows only through the
    values and the gated signal. On a bias-free model it conserves exactly.
    """

    gate_kinds = GATE_TAGS | {"activation", "softmax"}

    def __init__(self, gamma: float | None = None, epsilon: float = 0.0, **kwargs: Any) -> None:
        super().__init__(gamma, epsilon, **kwargs)
        self.attention = self._gated


#: Preset names (zennit's, with dashes) and their classes.
PRESETS: dict[str, type[Composite]] = {
    "epsilon": Epsilon,
    "epsilon-plus": EpsilonPlus,
    "epsilon-plus-flat": EpsilonPlusFlat,
    "epsilon-alpha2-beta1": EpsilonAlpha2Beta1,
    "epsilon-alpha2-beta1-flat": EpsilonAlpha2Beta1Flat,
    "epsilon-gamma-box": EpsilonGammaBox,
    "attnlrp": AttnLRP,
    "cp-lrp": CPLRP,
}


def get(composite: Composite | str | None, **kwargs: Any) -> Composite:
    """A composite from an instance, a preset name (``"epsilon-plus"``; ``_`` works too) or None (epsilon).

    ``kwargs`` go to the preset's class: ``get("epsilon-gamma-box", normalization="imagenet")`` (see
    :class:`EpsilonGammaBox` for its bounds), ``get("epsilon-plus-flat", smooth_stride=True)``.
    """
    if composite is None:
        return Epsilon(**kwargs)
    if isinstance(composite, Composite):
        return composite
    if isinstance(composite, str):
        key = composite.lower().replace("_", "-")
        if key not in PRESETS:
            raise ValueError(f"relprop: unknown preset {composite!r}; known presets: {', '.join(PRESETS)}")
        preset = PRESETS[key]
        missing = [name for name, parameter in inspect.signature(preset).parameters.items()
                   if parameter.default is parameter.empty and parameter.kind is parameter.POSITIONAL_OR_KEYWORD
                   and name not in kwargs]
        if missing:
            raise ValueError(f"relprop: preset {key!r} needs {' and '.join(missing)}: use "
                             f"relprop.composites.{preset.__name__}({', '.join(f'{n}=...' for n in missing)})"
                             )
        return preset(**kwargs)
    raise TypeError(f"relprop: composite must be a Composite, a preset name or None, got {type(composite).__name__}")

