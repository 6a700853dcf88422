"""LRP rules: how the relevance of one operation's output reaches its inputs.

A rule is a small object with parameters. The engine hands it an *op call*
(one operation of the forward pass) and the relevance arriving at that
operation's output; the rule returns the relevance of each of the
operation's activation inputs. What a rule may read and call on an op call is
the contract of the protocols :class:`Call`, :class:`ParametricView`,
:class:`ProductView`, :class:`SoftmaxView`, :class:`PoolView` and
:class:`AttentionView` (defined in ``relprop._core.contract``); the call's
``kind`` is its op family, a member of :class:`OpKind`.

Linear rules follow the general form ``s = R / (z' + eps * sign(z'))``,
``R_in = x * VJP(s)`` with modified parameters (:class:`BasicRule`, defined
by its :class:`Term` s); :mod:`relprop.rules.kernels` holds fused forms of
the built-in ones.
"""
from relprop._core.contract import (
                                     AttentionView,
                                     Call,
                                     ParametricView,
                                     PoolView,
                                     ProductView,
                                     SoftmaxView,
                                     is_attention,
                                     is_parametric,
                                     is_product,
)
from relprop._core.kinds import OpKind
from relprop._core.rule import Gradient, Pass, Reads, Rule, Scaled
from relprop._core.stabilizers import denominator, inverse_denominator
from relprop.rules.basic import AlphaBeta, BasicRule, Flat, Gamma, WSquare, ZBox, ZPlus
from relprop.rules.epsilon import LINEAR_KINDS, PARAMETRIC_KINDS, Epsilon, Norm
from relprop.rules.functions import AsFunction, Proportional
from relprop.rules.passing import Identity, PlainGradient
from relprop.rules.products import SignalTakesAll, Softmax, UniformProduct, attention_relevance
from relprop.rules.smooth_stride import SmoothStride
from relprop.rules.terms import Shares, Term

__all__ = [
    "Rule", "Reads", "Scaled", "Epsilon", "Norm", "BasicRule", "Term", "Shares", "ZPlus", "AlphaBeta", "Gamma",
    "ZBox", "Flat", "WSquare", "Pass", "Gradient", "UniformProduct", "SignalTakesAll", "Softmax", "AsFunction",
    "Proportional", "SmoothStride", "attention_relevance", "Identity", "PlainGradient",
    "denominator", "inverse_denominator", "LINEAR_KINDS", "PARAMETRIC_KINDS",
    # the contract a rule reads (what an op call offers) and the op kinds
    "OpKind", "Call", "ParametricView", "ProductView", "SoftmaxView", "PoolView", "AttentionView", "is_parametric",
    "is_product", "is_attention",
]
