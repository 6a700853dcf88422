"""The engine: one attribution forward pass under a torch function mode, and its relevance nodes.

A :class:`Session` intercepts every torch function the model calls and hands
it to its op family (:mod:`relprop.ops`, looked up in the registry
``relprop.ops.HANDLERS``); an op with a rule becomes an :class:`OpCall`
and one autograd node (:func:`propagate`) whose backward applies the rule.
The engine knows rules only through the :class:`~relprop._core.rule.Rule`
base: it imports neither :mod:`relprop.rules` nor the op families.
"""
from relprop._core.errors import ConservationWarning, RuleError, UnhandledOpWarning, UnsupportedOpError
from relprop.engine.calls import OpCall
from relprop.engine.context import ModuleContext
from relprop.engine.nodes import is_relevance_node, propagate, substitute, tap, watch, write_into
from relprop.engine.parametric import ParametricCall, model_input, routed_image
from relprop.engine.sign_parts import Workspace
from relprop.engine.session import Session
from relprop.engine.sums import AddCall, InPlaceSumCall
from relprop.engine.tracking import AliasTracker, aliases

__all__ = ["Session", "ModuleContext", "OpCall", "ParametricCall", "AddCall", "InPlaceSumCall", "Workspace",
           "AliasTracker", "aliases", "propagate", "watch", "tap", "substitute", "write_into", "is_relevance_node",
           "model_input", "routed_image", "RuleError", "UnsupportedOpError", "UnhandledOpWarning",
           "ConservationWarning"]
