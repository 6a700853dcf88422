"""relprop: layer-wise relevance propagation for any PyTorch model.

Quick start
-----------
>>> import torch
>>> from torch import nn
>>> import relprop
>>> model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 8 * 8, 10)).eval()
>>> images, labels = torch.randn(2, 3, 8, 8), torch.tensor([3, 7])
>>> lrp = relprop.LRP(model, "epsilon-plus-flat")
>>> relevance = lrp.attribute(images, target=labels)  # one heatmap per image, for its label
>>> relevance.shape
torch.Size([2, 3, 8, 8])

Modules: :mod:`relprop.rules` (how relevance crosses one op),
:mod:`relprop.composites` (which op gets which rule, presets),
:mod:`relprop.ops` (op families), :mod:`relprop.engine` (interception of
torch functions), :mod:`relprop.methods` (LRP and this public API, relevance
inside the model, the audit, BiLRP, DeepLift and gradient methods for
comparison), :mod:`relprop.workflows` (datasets, concepts, evaluation),
:mod:`relprop.viz` (pictures) and ``relprop.cli`` (the command line). Every attribution
class follows captum's ``Attribution`` protocol, so captum's ``NoiseTunnel``
and metrics take it.
"""
from relprop import composites, methods, ops, rules
from relprop._core.errors import ConservationWarning, RuleError, UnhandledOpWarning, UnsupportedOpError
from relprop.composites import Composite
from relprop.methods import (
                             LRP,
                             Attribution,
                             Audit,
                             BiLRP,
                             Contrastive,
                             DeepLift,
                             DeepLiftShap,
                             LayerDeepLift,
                             LayerLRP,
                             NeuronLRP,
                             ModuleRelevance,
                             audit,
                             convergence_delta,
                             model_logits,
                             module_relevance,
                             output_relevance,
)
from relprop.methods.compiled import CompileFallbackWarning
from relprop.workflows.dataset import explain_dataset
from relprop.workflows.generation import Generation, explain_generation
from relprop.workflows.patching import patching

__all__ = [
    "LRP", "LayerLRP", "NeuronLRP", "Contrastive", "explain_dataset", "module_relevance", "ModuleRelevance", "audit",
    "Audit",
    "Composite", "composites", "rules", "methods", "Attribution", "output_relevance", "convergence_delta",
    "model_logits",
    "RuleError", "UnsupportedOpError", "UnhandledOpWarning", "ConservationWarning", "BiLRP", "DeepLift",
    "DeepLiftShap", "LayerDeepLift", "ops", "explain_generation", "Generation", "patching",
    "CompileFallbackWarning",
]
__version__ = "0.1.0"
