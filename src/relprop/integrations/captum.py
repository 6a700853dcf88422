"""relprop's LRP in captum's attribution of language models (``LLMGradientAttribution``).

captum's ``LLMGradientAttribution`` takes only its own layer methods (it checks the class), calls the method once
per generated token and sums its result over the hidden dimension. :class:`LLMRelevance` is one of those
classes, ``LayerGradientXActivation`` at the input embeddings, with relprop's relevance in place of
gradient x activation (LRP is gradient x input with a modified backward pass)::

    from captum.attr import LLMGradientAttribution, TextTokenInput

    from relprop.integrations.captum import LLMRelevance

    llm = LLMGradientAttribution(LLMRelevance(model, "attnlrp"), tokenizer)
    result = llm.attribute(TextTokenInput("The capital of France is", tokenizer), gen_args={"max_new_tokens": 3})
    result.plot_token_attr()

Each row of ``result.token_attr`` is the relevance of the prompt's tokens for the *logit* of one generated token,
what :func:`relprop.explain_generation` gives (its row restricted to the prompt). captum's own methods explain
the token's log-probability instead: LRP distributes the value of the output it explains, and it explains the
model's evidence for a token, its logit, as LRP for language models does.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

try:
    from captum.attr import LayerGradientXActivation
except ModuleNotFoundError as error:  # an optional integration: say how to install it
    raise ModuleNotFoundError("relprop: relprop.integrations.captum needs captum: pip install 'captum>=0.9'",
                              name=error.name) from error

from relprop import composites
from relprop.methods import LayerLRP

__all__ = ["LLMRelevance"]


class LLMRelevance(LayerGradientXActivation):
    """relprop's LRP of a causal language model, as the layer method captum's ``LLMGradientAttribution`` takes.

    Parameters
    ----------
    model : nn.Module
        A causal language model with Hugging Face's interface (``get_input_embeddings()``, ``logits``).
    composite : Composite or str
        The rules (AttnLRP by default), as for :class:`relprop.LRP`.

    Notes
    -----
    ``LLMGradientAttribution`` replaces the method's ``forward_func`` by one that returns a token's
    log-probability; this class explains the token's logit with relprop instead, from the model given here.
    Its ``attribute`` takes the arguments ``LLMGradientAttribution`` passes: the interpretable input's tensor and
    ``(input, target tokens, index of the token explained)``.
    """

    def __init__(self, model: nn.Module, composite: composites.Composite | str = "attnlrp") -> None:
        get_embeddings = getattr(model, "get_input_embeddings", None)
        if get_embeddings is None:
            raise TypeError(f"relprop: {type(model).__name__} has no get_input_embeddings(); LLMRelevance explains "
                            "Hugging Face language models")
        embeddings = get_embeddings()
        super().__init__(model, embeddings)
        self.relevance = LayerLRP(model, embeddings, composite)

    def attribute(self, inputs: Tensor, additional_forward_args: tuple[Any, Tensor, int]) -> Tensor:
        """``(B, prompt + index, hidden)``: the relevance of each embedding for the logit of target token ``index``.

        ``inputs`` is the interpretable input's tensor (which tokens are kept), ``additional_forward_args``
        what ``LLMGradientAttribution`` passes: the interpretable input, the target tokens and the index of the
        token explained, which follows the prompt and the target tokens before it.
        """
        source, target_tokens, index = additional_forward_args
        device = next(self.relevance.lrp.model.parameters()).device
        prompt = source.to_model_input(inputs).to(device)
        before = target_tokens[:index].to(device).unsqueeze(0).expand(prompt.shape[0], -1)
        ids = torch.cat([prompt, before], 1)
        return self.relevance.attribute(ids, target=(-1, int(target_tokens[index])))
