"""Training with explanations: a penalty on the explanation inside a mask, to add to any loss.

"Right for the right reasons" (Ross et al. 2017) penalises a model's input
gradient on regions it must not use. :class:`Penalty` does the same with
relevance under any composite, or with Ross et al.'s input gradient (the RRR
baseline, :data:`GRADIENT`). It returns one value per example, with its graph,
so that ``loss = cross_entropy + weight * penalty.mean()`` trains the model to
explain its outputs by what lies outside the mask; the training loop stays yours.
:mod:`relprop.workflows.decoy` builds decoy MNIST, the benchmark of that paper.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from relprop import composites
from relprop._core.modules import evaluation
from relprop.methods import LRP

__all__ = ["GRADIENT", "Penalty", "check_mask", "penalty"]

#: the explainer that takes the input gradient of the summed log-probabilities (Ross et al.'s RRR), not relevance
GRADIENT = "gradient"


def check_mask(mask: Tensor, inputs: Tensor) -> Tensor:
    """``mask`` as the inputs' floating-point type, once checked to fit them (a boolean mask is converted once
    here: a product with a boolean tensor converts it again on each call, forward and backward).

    It fits when it has the inputs' number of dimensions and batch size, and each other dimension equals the
    inputs' or is 1 (one mask for all channels: ``(N, 1, H, W)`` for inputs ``(N, C, H, W)``); otherwise
    ``ValueError``.
    """
    fits = (mask.dim() == inputs.dim() and mask.shape[0] == inputs.shape[0]
            and all(m in (1, i) for m, i in zip(mask.shape[1:], inputs.shape[1:])))
    if not fits:
        raise ValueError(f"relprop: a mask of shape {tuple(mask.shape)} does not fit the inputs of shape "
                         f"{tuple(inputs.shape)}: it needs their batch size and shape, with 1 where it holds for "
                         "the whole dimension (e.g. (N, 1, H, W) for all channels)")
    return mask.to(inputs.dtype)


class Penalty:
    """How much of each example's explanation lies inside a mask; differentiable in the model's parameters.

    The explanation is the relevance of ``target`` under ``composite``, or with
    ``composite="gradient"`` (:data:`GRADIENT`) the input gradient of the summed
    log-probabilities, ``d/dx sum_k log softmax(f(x))_k`` (Ross et al. 2017's
    RRR: all classes at once, no target). The penalty of example ``n`` is

    - ``sum_i (m_i e_i)^2``, by default (``normalize=False``): Ross et al.'s form;
    - ``sum_i (m_i e_i)^2 / sum_i e_i^2``, with ``normalize=True``: the share of
      the explanation's squared mass inside the mask, in [0, 1] (0 for an
      explanation that is zero everywhere).

    The sum of squares takes the explanation's scale: relevance sums to about
    the explained logit ``f_t(x)``, so the penalty grows as training sharpens
    the logits, and a weight suits logits of one scale. The share is scale-free
    (one weight holds for the whole training) and falls only as relevance moves
    out of the mask. On decoy MNIST (``docs/guide/training.md``) the sum of
    squares trains to the higher accuracy, at every weight from 10 to 1000, and
    is the default for relevance as for the gradient.

    Parameters
    ----------
    model : nn.Module
        A classifier (outputs ``(N, classes)`` for :data:`GRADIENT`).
    composite : Composite, str or None
        The rules (a :class:`~relprop.composites.Composite` or a preset name, None
        the ``epsilon`` preset), or ``"gradient"``. A preset's rules must
        tell the mask's features apart: ``epsilon-plus-flat`` spreads the first
        layer's relevance evenly on its inputs, so on an MLP its share inside a
        mask is the mask's share of the inputs whatever the model.
    normalize : bool
        The share (True) or the sum of squares (False).
    **kwargs
        Further arguments of :class:`~relprop.LRP` (``compile=True``).

    Examples
    --------
    One step of a training loop (``model``, ``images``, ``labels``, ``masks``
    and ``optimizer`` are yours)::

        explained = Penalty(model, "epsilon")
        loss = F.cross_entropy(model(images), labels) + 30 * explained(images, masks, labels).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    """

    def __init__(self, model: nn.Module, composite: composites.Composite | str | None = "epsilon",
                 normalize: bool = False, **kwargs: Any) -> None:
        self.model = model
        self.lrp = None if composite == GRADIENT else LRP(model, composite, **kwargs)
        self.normalize = normalize

    def explain(self, inputs: Tensor, target: Any = None, create_graph: bool = True) -> Tensor:
        """The explanation of ``inputs`` (relevance, or the gradient), with its graph if ``create_graph``.

        ``target`` is the class to explain, per example (the labels, when training); relprop's
        targets (:func:`~relprop.methods.target_mask`). The gradient takes none. Either is taken in eval mode
        (dropout off, BatchNorm's running statistics), as :class:`~relprop.LRP` explains, and the model's mode
        restored.
        """
        with evaluation(self.model):  # as relprop.LRP explains, without its warning for a model in training
            if self.lrp is not None:
                return self.lrp.attribute(inputs, target, create_graph=create_graph)
            leaf = inputs.detach().requires_grad_(True)
            with torch.enable_grad():
                log_probabilities = F.log_softmax(self.model(leaf), dim=1)
                (gradient,) = torch.autograd.grad(log_probabilities.sum(), leaf, create_graph=create_graph)
            return gradient

    def __call__(self, inputs: Tensor, mask: Tensor, target: Any = None, create_graph: bool = True) -> Tensor:
        """The penalty of each example, shape ``(N,)``.

        Parameters
        ----------
        inputs : Tensor
            A batch of inputs.
        mask : Tensor
            Where the explanation must not be: 1 (or True) there, 0 elsewhere; the inputs' shape, or 1 along a
            dimension where it is the same (see :func:`check_mask`). Values between 0 and 1 weigh features.
        target : optional
            The class whose relevance is penalised, per example (the labels); ignored by the gradient.
        create_graph : bool
            Keep the graph, so that the penalty can be differentiated (training); False: its value alone.
        """
        weights = check_mask(mask, inputs)
        if mask.dtype != torch.bool:  # (m e)^2 = m^2 e^2: squared on the mask, which takes no derivative
            weights = weights.square()
        squares = self.explain(inputs, target, create_graph).square()  # for both sums, squared once
        inside = (squares * weights).flatten(1).sum(1)
        if not self.normalize:
            return inside
        total = squares.flatten(1).sum(1)
        return inside / total.clamp_min(torch.finfo(total.dtype).tiny)


def penalty(model: nn.Module, inputs: Tensor, mask: Tensor, target: Any = None,
            composite: composites.Composite | str | None = "epsilon", normalize: bool = False,
            create_graph: bool = True) -> Tensor:
    """The penalty of each example, shape ``(N,)``: :class:`Penalty` built and called once (see there).

    A training loop calls a :class:`Penalty` built once instead, which keeps its :class:`~relprop.LRP`.
    """
    return Penalty(model, composite, normalize)(inputs, mask, target, create_graph)
