"""Op kinds, and the tags that say what produced an activation."""
from __future__ import annotations

import enum


class OpKind(enum.StrEnum):
    """The op families (docs/design.md, section 3): what a rule may assume about an op, and the view it reads.

    Members are strings (``OpKind.CONV == "conv"``), so a rule's ``kinds`` may name them either way.
    """

    #: convolutions, parametric linear maps ``f(x; weight, bias)``
    CONV = "conv"
    #: dense layers (``F.linear``, Hugging Face's ``Conv1D``)
    DENSE = "dense"
    #: a BatchNorm that could not be merged into the op before it: an affine map
    BATCHNORM = "batchnorm"
    #: sums, means, average pooling, interpolation, routing with constants mixed in
    SUM = "sum"
    #: layer, group and RMS norm with their statistic held constant
    NORM = "norm"
    #: elementwise nonlinearities and scalings by constants
    ELEMENTWISE = "elementwise"
    #: products of activations, divisions, matrix products
    PRODUCT = "product"
    #: max pooling
    MAXPOOL = "maxpool"
    #: softmax inside the model
    SOFTMAX = "softmax"
    #: fused attention (``F.scaled_dot_product_attention``)
    ATTENTION = "attention"
    #: an op without a rule: its plain gradient, reported
    UNKNOWN = "unknown"


#: tags of an activation that gates a product: a sigmoid output, a normalising statistic (``rsqrt`` of a
#: variance, a norm), a divisor, an exponential. Next to a gate the other factor (the signal) takes all the
#: relevance; a gate times a constant tensor gives the relevance to that constant
GATE_TAGS = frozenset({"sigmoid", "statistic", "divisor", "exp"})
