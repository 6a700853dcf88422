"""relprop: layer-wise relevance propagation for any PyTorch model.

Quick start
-----------
>>> import relprop
>>> lrp = relprop.LRP(model, "epsilon-plus-flat")
>>> relevance = lrp.attribute(images, target=labels)

Modules: :mod:`relprop.rules` (how relevance crosses one op),
:mod:`relprop.composites` (which op gets which rule, presets),
:mod:`relprop.engine` (interception of torch functions),
:mod:`relprop.attribution` (this public API).
"""
from . import composites, rules
from .attribution import LRP, model_logits, output_relevance
from .composites import Composite
from .engine import RuleError, UnhandledOpWarning, UnsupportedOpError

__all__ = [
    "LRP", "Composite", "composites", "rules", "output_relevance", "model_logits",
    "RuleError", "UnsupportedOpError", "UnhandledOpWarning",
]
__version__ = "0.1.0"
