"""Attribution methods: LRP and its relatives, and the gradient methods to compare with.

:class:`~relprop.LRP` (``relprop.methods.attribution``), relevance inside the model
(:class:`~relprop.LayerLRP`, :func:`~relprop.module_relevance`; ``relprop.methods.layer``), one unit's
relevance (:class:`~relprop.NeuronLRP`), a per-op
account (:func:`~relprop.audit`), second-order relevance of similarity models (:class:`~relprop.BiLRP`),
DeepLift on the same engine (:class:`~relprop.DeepLift`, :class:`~relprop.DeepLiftShap`,
:class:`~relprop.LayerDeepLift`), and gradient methods for comparison
(:class:`InputGradient`, :class:`GradientXInput`, :class:`SmoothGrad`,
:class:`IntegratedGradients`, :class:`Occlusion`). Every class follows
captum's ``Attribution`` protocol.
"""
from relprop.methods.attribution import LRP
from relprop.methods.forward_pass import ForwardPass
from relprop.methods.protocol import Attribution
from relprop.methods.audit import Audit, AuditRow, audit
from relprop.methods.bilrp import BiLRP
from relprop.methods.deeplift import DeepLift, DeepLiftShap, LayerDeepLift
from relprop.methods.gradients import GradientXInput, InputGradient, IntegratedGradients, Occlusion, SmoothGrad
from relprop.methods.layer import LayerLRP, ModuleRelevance, module_relevance
from relprop.methods.neuron import NeuronLRP
from relprop.methods.targets import Contrastive, convergence_delta, model_logits, output_relevance, target_mask

__all__ = ["LRP", "LayerLRP", "NeuronLRP", "ModuleRelevance", "module_relevance", "Audit", "AuditRow", "audit", "BiLRP",
           "Attribution", "Contrastive", "ForwardPass", "convergence_delta", "model_logits", "output_relevance",
           "target_mask", "InputGradient", "GradientXInput", "SmoothGrad", "IntegratedGradients", "Occlusion",
           "DeepLift", "DeepLiftShap", "LayerDeepLift"]
