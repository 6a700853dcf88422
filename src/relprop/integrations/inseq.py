"""relprop's LRP as attribution methods of inseq: ``relprop_attnlrp``, ``relprop_cp_lrp``, ``relprop_epsilon``.

Importing this module registers them (inseq finds its methods among the subclasses of its registry)::

    import inseq
    import relprop.integrations.inseq

    model = inseq.load_model(hf_model, "relprop_attnlrp", tokenizer=tokenizer)
    out = model.attribute("The capital of France is", attributed_fn="logit")

Each generation step is one LRP of inseq's attributed function (pass ``attributed_fn="logit"`` for the logit of
the generated token, what :func:`relprop.explain_generation` explains) with respect to the input embeddings, and
each token gets one score: the relevance of its embedding summed over the hidden dimension, signed, as
:func:`relprop.explain_generation` gives it. inseq's ``out.show()`` and aggregations work on the result as on
its occlusion's.

Install inseq with ``pip install 'relprop[inseq]'`` (inseq 0.7.1).
"""
from __future__ import annotations

from typing import Any

try:
    from inseq.attr.feat.gradient_attribution import GradientAttributionRegistry
    from inseq.data import CoarseFeatureAttributionStepOutput
    from inseq.utils import Registry
except ModuleNotFoundError as error:  # an optional integration: say how to install it
    raise ModuleNotFoundError(
        "relprop: relprop.integrations.inseq needs inseq: pip install 'relprop[inseq]'", name=error.name) from error

from relprop.composites import Composite
from relprop.methods import LRP

__all__ = ["RelpropAttribution", "AttnLRPAttribution", "CPLRPAttribution", "EpsilonAttribution"]


class RelpropAttribution(GradientAttributionRegistry, Registry):
    """A relprop preset as an inseq attribution method: one relevance score per token and generation step.

    Listing ``Registry`` among the bases keeps this base class out of inseq's list of methods, as inseq's own
    registries do; each subclass names a ``method_name`` and a ``composite``, and a subclass of your own with
    other rules registers one more method when it is defined.

    Parameters
    ----------
    attribution_model : inseq.models.AttributionModel
        The model inseq wraps; relprop explains it through its forward pass from the input embeddings.
    """

    #: the rules: a preset name or a :class:`~relprop.Composite` (:mod:`relprop.composites`)
    composite: Composite | str

    def __init__(self, attribution_model: Any) -> None:
        super().__init__(attribution_model)
        # inseq puts the model it wraps in eval mode but leaves its own wrapper module, which has no dropout or
        # BatchNorm, in training mode: relprop would warn about a model in training mode
        self.attribution_model.eval()
        self.method = LRP(self.attribution_model, self.composite)

    def attribute_step(self, attribute_fn_main_args: dict[str, Any],
                       attribution_args: dict[str, Any] | None = None) -> Any:
        """One step: the relevance of each input embedding, summed over the hidden dimension (one per token)."""
        found = super().attribute_step(attribute_fn_main_args, attribution_args or {})

        def per_token(relevance: Any) -> Any:
            return None if relevance is None else relevance.sum(-1)

        return CoarseFeatureAttributionStepOutput(source_attributions=per_token(found.source_attributions),
                                                  target_attributions=per_token(found.target_attributions),
                                                  step_scores=found.step_scores or {})


class AttnLRPAttribution(RelpropAttribution):
    """AttnLRP (:class:`relprop.composites.AttnLRP`) as inseq's ``relprop_attnlrp``."""

    method_name = "relprop_attnlrp"
    composite = "attnlrp"


class CPLRPAttribution(RelpropAttribution):
    """CP-LRP (:class:`relprop.composites.CPLRP`) as inseq's ``relprop_cp_lrp``."""

    method_name = "relprop_cp_lrp"
    composite = "cp-lrp"


class EpsilonAttribution(RelpropAttribution):
    """Epsilon on every linear op (:class:`relprop.composites.Epsilon`) as inseq's ``relprop_epsilon``."""

    method_name = "relprop_epsilon"
    composite = "epsilon"
