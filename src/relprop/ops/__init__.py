"""Op families: how each torch function is intercepted, as plug-ins of the op registry.

Each module registers its handlers into ``HANDLERS`` (the registry's table,
function to handler) when it is imported: routing ops (``.routing``), in-place
ops (``.inplace``), sums and norms (``.sums``), products and softmax
(``.products``), convolutions and dense layers (``.linear``), elementwise ops
(``.elementwise``), attention and embeddings (``.attention``), max pooling
(``.pools``), recurrent and quantized layers (``.recurrent``, ``.quantized``),
and aten ops of exported programs (``.aten``). A handler either
runs the function as it is (routing ops, whose gradient re-routes relevance
exactly) or builds an op call for the engine to run with a rule. An op of an
existing family is added with :func:`register` and one of the handler
factories exported here (docs/extending.md, section 3).
"""
from relprop._core.registry import ALWAYS_HANDLED, HANDLERS, OPTIONAL, ROUTING_HANDLERS, register
from relprop.ops import aten, attention, elementwise, linear, pools, products, quantized, recurrent, routing, sums
from relprop.ops.attention import AttentionCall
from relprop.ops.elementwise import _elementwise as elementwise_handler
from relprop.ops.host import OpHost
from relprop.ops.linear import dense_transpose
from relprop.ops.pools import MaxPoolCall
from relprop.ops.products import ProductCall, SoftmaxCall
from relprop.ops.products import _decomposed as decomposed_handler
from relprop.ops.products import _product as product_handler
from relprop.ops.routing import _run as routing_handler
from relprop.ops.sums import _linear as linear_handler

__all__ = ["HANDLERS", "ALWAYS_HANDLED", "ROUTING_HANDLERS", "OPTIONAL", "register", "OpHost", "ProductCall",
           "SoftmaxCall", "MaxPoolCall", "AttentionCall", "dense_transpose",
           # the handler factories an op of an existing family needs (docs/extending.md, section 3)
           "routing_handler", "linear_handler", "elementwise_handler", "product_handler", "decomposed_handler",
           # the families, each registering its handlers when imported
           "aten", "attention", "elementwise", "linear", "pools", "products", "quantized", "recurrent", "routing",
           "sums"]
