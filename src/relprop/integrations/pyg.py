"""relprop's LRP as an explainer algorithm of PyTorch Geometric (``torch_geometric.explain``).

:class:`LRPExplainer` is an ``ExplainerAlgorithm``: PyG's ``Explainer`` calls it, and PyG's metrics
(``groundtruth_metrics``, ``fidelity``, ``characterization_score``) and ``Explanation.visualize_graph`` read the
explanation it returns as they read any other::

    from torch_geometric.explain import Explainer

    from relprop.integrations.pyg import LRPExplainer

    explainer = Explainer(model, algorithm=LRPExplainer("epsilon"), explanation_type="model",
                          node_mask_type="object", edge_mask_type="object",
                          model_config=dict(mode="multiclass_classification", task_level="node", return_type="raw"))
    explanation = explainer(data.x, data.edge_index, index=10)
    explanation.edge_mask  # each edge's relevance (relprop.methods.graphs.edge_relevance)

The masks hold relevance, signed: positive for evidence of the explained output, negative against it, and
summing (nodes, or edges with the self-loops) to that output. PyG's masks are importances in [0, 1]; thresholds
of kind ``"topk"`` and ``"topk_hard"`` rank relevance as they rank those, and ``magnitude=True`` gives masks of
``|relevance|``, which rank the edges an output depends on, whichever way (docs/guide/graphs.md). The explained
output is the model's, as it returns it: LRP distributes a logit (``return_type="raw"``) best; probabilities and
log-probabilities are explained as values.
With ``walks=k`` the explanation also holds the ``k`` most relevant walks (``explanation.walks``,
``explanation.walk_relevance``; :func:`relprop.methods.walks.top_walks`).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

try:
    from torch_geometric.explain import Explanation
    from torch_geometric.explain.algorithm import ExplainerAlgorithm
    from torch_geometric.explain.config import MaskType, ModelMode
except ModuleNotFoundError as error:  # an optional integration: say how to install it
    raise ModuleNotFoundError("relprop: relprop.integrations.pyg needs PyTorch Geometric: "
                              "pip install 'relprop[graph]'", name=error.name) from error

from relprop import composites
from relprop.methods import LRP
from relprop.methods.graphs import edge_relevance, undirected
from relprop.methods.walks import WalkRelevance

__all__ = ["LRPExplainer"]


class LRPExplainer(ExplainerAlgorithm):
    """LRP's relevance of nodes, node features and edges, for PyG's ``Explainer``.

    Parameters
    ----------
    composite : Composite, str or None
        The rules (a preset name such as ``"epsilon"``, see :mod:`relprop.composites`).
    magnitude : bool
        Masks of ``|relevance|`` instead of the signed relevance (for edges, each layer's
        ``|relevance|``, averaged: :attr:`~relprop.methods.graphs.GraphRelevance.edge_magnitudes`).
    walks : int
        Also find this many most relevant walks (0: none).
    beam : int or None
        The beam of the walk search (None: exhaustive, exact; see :mod:`relprop.methods.walks`).
    undirected : bool
        Give both directions of an edge their sum (:func:`~relprop.methods.graphs.undirected`): the relevance of
        an undirected edge, for graphs stored with both directions.
    **lrp : Any
        Further arguments of :class:`~relprop.LRP` (``strict``, ``guard``).

    Notes
    -----
    Node masks of type ``"object"`` hold each node's relevance (its features' summed), ``"attributes"`` each
    feature's, ``"common_attributes"`` each feature's summed over the nodes. The edge mask holds each edge's
    relevance over the message-passing layers (:attr:`~relprop.methods.graphs.GraphRelevance.edges`). Several
    indices are explained together: the seed holds each one's target output.
    """

    def __init__(self, composite: composites.Composite | str | None = None, magnitude: bool = False, walks: int = 0,
                 beam: int | None = 8, undirected: bool = False, **lrp: Any) -> None:
        super().__init__()
        self.composite = composites.get(composite)
        self.magnitude = magnitude
        self.walks = walks
        self.beam = beam
        self.undirected = undirected
        self.lrp = lrp

    def supports(self) -> bool:
        """Homogeneous graphs, node masks of any type, edge masks of type ``"object"``."""
        edge = self.explainer_config.edge_mask_type
        if edge not in (None, MaskType.object):
            raise ValueError(f"relprop: LRPExplainer gives edge masks of type 'object' (one value per edge), "
                             f"not {edge.value!r}")
        return True

    def forward(self, model: nn.Module, x: Tensor, edge_index: Tensor, *, target: Tensor,
                index: int | Tensor | None = None, **kwargs: Any) -> Explanation:
        """Explain ``model(x, edge_index, **kwargs)`` at ``target`` (its classes, or its values) and ``index``."""
        if not isinstance(x, Tensor):
            raise TypeError("relprop: LRPExplainer explains homogeneous graphs; heterogeneous ones (dicts of node "
                            "types) are not supported")
        lrp = LRP(model, self.composite, **self.lrp)
        seed = _Seed(target, index, self.model_config.mode == ModelMode.multiclass_classification)
        found = edge_relevance(lrp, x, edge_index, seed, kwargs or None)
        edges = found.edge_magnitudes if self.magnitude else found.edges
        edges = undirected(edge_index, edges) if self.undirected else edges
        explanation = Explanation(node_mask=self._node_mask(found.features), edge_mask=edges.detach())
        if self.walks:
            walker = WalkRelevance(lrp, x, edge_index, seed, kwargs or None)
            try:
                explanation.walks, explanation.walk_relevance = walker.top(self.walks, self.beam)
            finally:
                walker.close()
        return explanation

    def _mask(self, relevance: Tensor) -> Tensor:
        relevance = relevance.detach()
        return relevance.abs() if self.magnitude else relevance

    def _node_mask(self, features: Tensor) -> Tensor | None:
        kind = self.explainer_config.node_mask_type
        if kind is None:
            return None
        relevance = features.reshape(features.shape[0], -1)
        if kind == MaskType.object:
            return self._mask(relevance.sum(1, keepdim=True))
        if kind == MaskType.common_attributes:
            return self._mask(relevance.sum(0, keepdim=True))
        return self._mask(relevance)


class _Seed:
    """PyG's target as relprop's seed: the rows of ``index`` (all where None), at their class or whole."""

    def __init__(self, target: Tensor, index: int | Tensor | None, classes: bool) -> None:
        self.target, self.index, self.classes = target, index, classes

    def __call__(self, logits: Tensor) -> Tensor:
        rows = torch.arange(logits.shape[0]) if self.index is None else torch.as_tensor(self.index).reshape(-1)
        if len(rows) and not bool(((rows >= -logits.shape[0]) & (rows < logits.shape[0])).all()):
            raise ValueError(f"relprop: index {self.index!r} is outside the model output's {logits.shape[0]} rows")
        mask = torch.zeros_like(logits, dtype=torch.bool)
        if self.classes and logits.dim() > 1:
            target = self.target.reshape(-1)
            classes = target[rows] if len(target) == logits.shape[0] else target.expand(len(rows))
            mask[rows.to(logits.device), classes.to(logits.device)] = True
        else:
            mask[rows.to(logits.device)] = True
        return torch.where(mask, logits, torch.zeros((), dtype=logits.dtype, device=logits.device))
