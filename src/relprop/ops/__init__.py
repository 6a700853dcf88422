"""Op families: how each torch function is intercepted, as plug-ins of the op registry.

Each module registers its handlers into :data:`relprop._core.registry.HANDLERS`
when it is imported: routing ops (:mod:`.routing`), in-place ops
(:mod:`.inplace`), sums and norms (:mod:`.sums`), products and softmax
(:mod:`.products`), convolutions and dense layers (:mod:`.linear`),
elementwise ops (:mod:`.elementwise`), attention and embeddings
(:mod:`.attention`), max pooling (:mod:`.pools`), recurrent and quantized
layers, and aten ops of exported programs (:mod:`.aten`). A handler either
runs the function as it is (routing ops, whose gradient re-routes relevance
exactly) or builds an op call for the engine to run with a rule.
"""
from relprop._core.registry import ALWAYS_HANDLED, HANDLERS, ROUTING_HANDLERS
from relprop.ops import aten, attention, elementwise, linear, pools, products, quantized, recurrent, routing, sums
from relprop.ops.attention import AttentionCall
from relprop.ops.host import OpHost
from relprop.ops.linear import dense_transpose
from relprop.ops.pools import MaxPoolCall
from relprop.ops.products import ProductCall, SoftmaxCall

__all__ = ["HANDLERS", "ALWAYS_HANDLED", "ROUTING_HANDLERS", "OpHost", "ProductCall", "SoftmaxCall", "MaxPoolCall",
           "AttentionCall", "dense_transpose", "aten", "attention", "elementwise", "linear", "pools", "products",
           "quantized", "recurrent", "routing", "sums"]
