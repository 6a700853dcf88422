"""relprop: layer-wise relevance propagation for any PyTorch model.

Quick start
-----------
>>> import relprop
>>> lrp = relprop.LRP(model, "epsilon-plus-flat")
>>> relevance = lrp.attribute(images, target=labels)

Modules: :mod:`relprop.rules` (how relevance crosses one op),
:mod:`relprop.composites` (which op gets which rule, presets),
:mod:`relprop.engine` (interception of torch functions),
:mod:`relprop.attribution` (this public API), :mod:`relprop.layer` (relevance
inside the model, concepts), :mod:`relprop.audit` (a per-op account).
"""
from . import composites, rules
from .attribution import LRP, Contrastive, model_logits, output_relevance
from .audit import Audit, audit
from .bilrp import BiLRP
from .composites import Composite
from .dataset import explain_dataset
from .engine import RuleError, UnhandledOpWarning, UnsupportedOpError
from .layer import LayerLRP, ModuleRelevance, module_relevance

__all__ = [
    "LRP", "LayerLRP", "Contrastive", "explain_dataset", "module_relevance", "ModuleRelevance", "audit", "Audit",
    "Composite", "composites", "rules", "output_relevance", "model_logits",
    "RuleError", "UnsupportedOpError", "UnhandledOpWarning", "BiLRP",
]
__version__ = "0.1.0"
