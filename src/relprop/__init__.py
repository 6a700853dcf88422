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
inside the model, concepts), :mod:`relprop.audit` (a per-op account),
:mod:`relprop.methods` (gradient methods for comparison, and DeepLift on the
engine: :mod:`relprop.deeplift`). Every attribution
class follows captum's ``Attribution`` protocol, so captum's ``NoiseTunnel``
and metrics take it.
"""
from . import composites, kernels, methods, rules
from .attribution import LRP, Attribution, Contrastive, convergence_delta, model_logits, output_relevance
from .audit import Audit, audit
from .bilrp import BiLRP
from .composites import Composite
from .dataset import explain_dataset
from .engine import ConservationWarning, RuleError, UnhandledOpWarning, UnsupportedOpError
from .layer import LayerLRP, ModuleRelevance, module_relevance
from .methods import DeepLift, DeepLiftShap, LayerDeepLift

__all__ = [
    "LRP", "LayerLRP", "Contrastive", "explain_dataset", "module_relevance", "ModuleRelevance", "audit", "Audit",
    "Composite", "composites", "rules", "methods", "Attribution", "output_relevance", "convergence_delta",
    "model_logits",
    "RuleError", "UnsupportedOpError", "UnhandledOpWarning", "ConservationWarning", "BiLRP", "DeepLift",
    "DeepLiftShap", "LayerDeepLift",
]
__version__ = "0.1.0"
