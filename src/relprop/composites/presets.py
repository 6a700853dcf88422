"""The presets: the composites of the literature, by name (:data:`PRESETS`, :func:`get`)."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor

from relprop import rules
from relprop._core.kinds import GATE_TAGS, OpKind
from relprop.composites.composite import Composite, _pairs, _short_value, _tensor


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
        self.gradient_form = gamma is None  # Gamma has no gradient form
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


class RelP(Composite):
    """RelP's default rules (Jafari et al. 2025, Relevance Patching), on any decoder relprop explains.

    - LN-rule (Ali et al. 2022): a layer or RMS norm's standard deviation is held constant, the rest is linear;
    - Identity-rule (Jafari et al. 2024): an activation function passes ``act(x) / x``, with ``x`` stabilised by
      ``epsilon`` as in the reference implementation (:class:`~relprop.rules.Identity`);
    - Half-rule: both factors of a gated product (``act(gate) * up``) take half;
    - 0-rule (LRP-0) on linear layers and sums;
    - attention: the plain gradient (:class:`~relprop.rules.PlainGradient`), or with ``hold_attention`` its
      AH-rule (Ali et al. 2022): the attention weights held constant, the values take all (preset ``relp-ah``).

    Carried in gradient form: every rule is a modified gradient, so relevance patching reads ``R / a`` as a
    gradient. ``RelP(hold_attention=True, epsilon=0)`` equals ``Epsilon(0)``.

    Parameters
    ----------
    epsilon : float
        The Identity-rule's stabiliser (the reference's 1e-6; 0: the exact ratio ``act(x) / x``).
    hold_attention : bool
        The AH-rule on attention instead of the plain gradient.
    """

    gradient_form = True

    def __init__(self, epsilon: float = 1e-6, hold_attention: bool = False, **kwargs: Any) -> None:
        plain = rules.PlainGradient()
        if hold_attention:  # attention weights are gates, as in CP-LRP: the values take all
            self.gate_kinds = GATE_TAGS | {"softmax"}
        else:
            # the plain gradient through the attention's own products where they are not fused (eager
            # attention): a decoder multiplies two activations with matmul only there
            kwargs["func_map"] = [(torch.matmul, plain), (torch.bmm, plain), *_pairs(kwargs.get("func_map"))]
        super().__init__(0.0, **kwargs)  # LRP-0 on linear maps, sums and norms (their std held: the LN-rule)
        self.epsilon, self.hold_attention = epsilon, hold_attention  # the 0-rule has none: the Identity-rule's
        self.activation = rules.Identity(epsilon)
        self.softmax: rules.Rule = self._softmax if hold_attention else plain
        if not hold_attention:
            self.attention = plain

    #: activation functions take the Identity-rule; a softmax (eager attention) the plain gradient or its own rule
    DEFAULTS = MappingProxyType({**Composite.DEFAULTS, OpKind.ELEMENTWISE: "activation", OpKind.SOFTMAX: "softmax"})

    def _parameters(self) -> list[str]:
        return [f"hold_attention={self.hold_attention!r}"] if self.hold_attention else []


class RelPAH(RelP):
    """RelP with its AH-rule: the attention weights held constant (preset ``relp-ah``); see :class:`RelP`."""

    def __init__(self, epsilon: float = 1e-6, **kwargs: Any) -> None:
        super().__init__(epsilon, hold_attention=True, **kwargs)

    def _parameters(self) -> list[str]:
        return []


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
    "relp": RelP,
    "relp-ah": RelPAH,
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

