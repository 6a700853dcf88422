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
from relprop.composites.composite import Composite, function_name
from relprop.composites.presets import (
                                        BOUNDS_NEEDED,
                                        CPLRP,
                                        NORMALIZATIONS,
                                        PRESETS,
                                        AttnLRP,
                                        Epsilon,
                                        EpsilonAlpha2Beta1,
                                        EpsilonAlpha2Beta1Flat,
                                        EpsilonGammaBox,
                                        EpsilonPlus,
                                        EpsilonPlusFlat,
                                        RelP,
                                        RelPAH,
                                        box_bounds,
                                        get,
)

__all__ = [
    "Composite", "Epsilon", "EpsilonPlus", "EpsilonPlusFlat", "EpsilonAlpha2Beta1", "EpsilonAlpha2Beta1Flat",
    "EpsilonGammaBox", "AttnLRP", "CPLRP", "PRESETS", "get", "function_name", "box_bounds", "NORMALIZATIONS",
    "BOUNDS_NEEDED", "RelP", "RelPAH",
]
