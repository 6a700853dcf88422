"""Relevant walks: GNN-LRP's higher-order relevance of a graph neural network (Schnake et al. 2021).

A walk ``(j_0, j_1, ..., j_L)`` through a model of ``L`` message-passing layers names the node whose features
enter layer 1 (``j_0``), the node each layer's message reaches (``j_1`` ... ``j_L``, ``j_L`` at the last layer's
output). Its relevance is LRP's backward pass with the relevance at each layer's input kept on the walk's node
alone: at the last layer's output on row ``j_L``, at the input of layer ``l`` on row ``j_{l-1}``, read at the
input of layer 1. The rules' relevance is linear in the relevance they receive (their ratios are fixed by the
forward pass), so masking rows commutes with them, and

- the walks starting at a node sum to its relevance at layer 1's input, and all walks to the explained output
  (up to what the rules' stabilisers absorb);
- for LRP-0 on a bias-free ReLU network, a walk's relevance is the gradient times the input of the output with
  every other node's row held constant at each layer, the definition of Schnake et al. 2021.

Masks that keep a set of rows instead of one give the total relevance of every walk through those rows at once.
The relevance of a subgraph ``S``, the sum over every walk with all its nodes in ``S``, is therefore one backward
pass with the rows of ``S`` kept at every layer (the subgraph relevance of Xiong et al. 2022, computed by message
passing instead of by enumerating the walks), and the relevance arriving at each node of layer ``l``'s input,
with a suffix's rows kept after it, is at once the relevance of every walk that reaches the suffix through that
node. :func:`top_walks`
grows walks from the output backwards that way: one pass per suffix kept at each layer scores all the nodes
before it, keeping the ``beam`` most relevant suffixes (by ``|relevance|``) at each layer. Before the last step
a suffix's relevance is read where it arrives (at the input of its first layer: what the rules' stabilisers and
biases absorb below it still counts), the walks themselves at layer 1's input, exactly. A full search
(``beam=None``) costs one pass per suffix of fewer than ``L + 1`` nodes, about ``n d^(L-1)`` passes for ``n``
output nodes of ``d`` neighbours; a beam of width ``b`` at most ``1 + b L`` passes, each one backward pass of
the model, whatever the degrees.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from relprop.methods.attribution import LRP
from relprop.methods.graphs import GraphTarget, LayerCall, graph_pass, graph_seed

__all__ = ["WalkRelevance", "subgraph_relevance", "top_walks", "walk_relevance"]


class WalkRelevance:
    """One recorded forward pass of a graph model, explained walk by walk.

    Parameters
    ----------
    lrp : LRP
        The explainer of a model called as ``model(x, edge_index, *additional_forward_args)``.
    x, edge_index : Tensor
        Node features ``(num_nodes, features)`` and edges ``(2, num_edges)``.
    target : tuple
        The explained output (see :func:`~relprop.methods.graphs.edge_relevance`).
    additional_forward_args : tuple or dict, optional
        Further arguments of the model after ``edge_index``.

    Attributes
    ----------
    layers : int
        The model's message-passing calls ``L``; a walk has ``L + 1`` nodes.
    passes : int
        The backward passes run so far.
    """

    def __init__(self, lrp: LRP, x: Tensor, edge_index: Tensor, target: GraphTarget,
                 additional_forward_args: Any = None) -> None:
        self._pass, self._calls = graph_pass(lrp, x, edge_index, additional_forward_args, reusable=True,
                                                  masked=True)
        self._seed = graph_seed(self._pass.logits, target)
        self.nodes = x.shape[0]
        self.layers = len(self._calls)
        self.passes = 0
        self._masks: list[Tensor | None] = [None] * (self.layers + 1)
        self._read: dict[int, Tensor] = {}  # relevance per node arriving at each position, of the last pass
        tensors = [_node_tensor(call.inputs, call.name, "input") for call in self._calls]
        tensors.append(_node_tensor(self._calls[-1].output, self._calls[-1].name, "output"))
        self._handles = [tensor.register_hook(self._mask(position, tensor)) for position, tensor in enumerate(tensors)]

    def _mask(self, position: int, tensor: Tensor) -> Any:
        """The hook at one position of the walks: keeps the masked rows, after reading the relevance per node that
        arrives there (the relevance of every walk through each node, with the positions after it masked)."""
        scale = self._pass.gradient_form

        def hook(grad: Tensor) -> Tensor:
            mask = self._masks[position]
            if mask is not None:
                grad = grad * mask.to(grad.dtype).reshape(-1, *[1] * (grad.dim() - 1))
            relevance = grad * tensor.detach() if scale else grad
            self._read[position] = relevance.reshape(relevance.shape[0], -1).sum(1)
            return grad
        return hook

    def relevance(self, masks: Sequence[Tensor | None]) -> Tensor:
        """Relevance per node at layer 1's input with the rows of ``masks`` kept (one per position, None for all).

        ``masks[l]`` is a boolean mask over the nodes, for walk position ``l`` (0: layer 1's input, ``L``: the
        last layer's output).
        """
        if len(masks) != self.layers + 1:
            raise ValueError(f"relprop: {len(masks)} masks for walks of {self.layers + 1} nodes")
        self._masks, self._read = list(masks), {}
        self._pass.propagate(self._seed)
        self.passes += 1
        return self._read.get(0, torch.zeros(self.nodes, dtype=self._seed.dtype))

    def walk(self, walk: Sequence[int]) -> Tensor:
        """The relevance of one walk ``(j_0, ..., j_L)``."""
        if len(walk) != self.layers + 1:
            raise ValueError(f"relprop: walk {tuple(walk)} has {len(walk)} nodes; the model's {self.layers} "
                             f"message-passing layers make walks of {self.layers + 1}")
        if any(not 0 <= int(node) < self.nodes for node in walk):
            raise ValueError(f"relprop: walk {tuple(walk)} leaves the graph of {self.nodes} nodes")
        return self.relevance([self._one(int(node)) for node in walk]).sum()

    def subgraph(self, nodes: Tensor | Sequence[int]) -> Tensor:
        """The relevance of every walk with all its nodes in ``nodes``, summed: one backward pass."""
        keep = torch.zeros(self.nodes, dtype=torch.bool)
        keep[torch.as_tensor(nodes, dtype=torch.long)] = True
        return self.relevance([keep] * (self.layers + 1)).sum()

    def _one(self, node: int) -> Tensor:
        mask = torch.zeros(self.nodes, dtype=torch.bool)
        mask[node] = True
        return mask

    def predecessors(self, layer: int, node: int) -> list[int]:
        """The nodes whose messages reach ``node`` in layer ``layer`` (0-based), itself included."""
        call: LayerCall = self._calls[layer]
        found = {node}
        for propagation in range(len(call.edge_index)):
            found.update(call.senders(propagation)[call.receivers(propagation) == node].tolist())
        return sorted(found)

    def top(self, k: int = 10, beam: int | None = None, absolute: bool = False) -> tuple[Tensor, Tensor]:
        """The ``k`` most relevant walks, grown from the output backwards (see the module's notes on the cost).

        Returns the walks ``(k, L + 1)`` and their relevance ``(k,)``, most relevant first (by value, or by
        magnitude with ``absolute``). Each pass keeps one suffix's rows and reads the relevance of every node
        before it at once; with ``beam=None`` every walk along the graph's edges is scored: exact.
        """
        self.relevance([None] * (self.layers + 1))
        reached = self._read[self.layers]
        suffixes: list[tuple[tuple[int, ...], Tensor]] = [
            ((node,), reached[node]) for node in reached.nonzero().flatten().tolist()]
        for position in range(self.layers - 1, -1, -1):
            grown = []
            for suffix, _ in _kept(suffixes, beam):
                self.relevance([None] * (position + 1) + [self._one(node) for node in suffix])
                before = self._read[position]
                grown += [((node, *suffix), before[node]) for node in self.predecessors(position, suffix[0])]
            suffixes = grown
        ranked = sorted(suffixes, key=lambda item: -float(item[1].abs() if absolute else item[1]))[:k]
        walks = torch.tensor([walk for walk, _ in ranked], dtype=torch.long).reshape(-1, self.layers + 1)
        values = torch.stack([value for _, value in ranked]) if ranked else torch.zeros(0)
        return walks, values

    def close(self) -> None:
        """Remove the hooks from the recorded pass."""
        for handle in self._handles:
            handle.remove()


def _kept(suffixes: list[tuple[tuple[int, ...], Tensor]], beam: int | None) -> list[tuple[tuple[int, ...], Tensor]]:
    """The ``beam`` suffixes of largest magnitude (all where ``beam`` is None)."""
    if beam is None or len(suffixes) <= beam:
        return suffixes
    return sorted(suffixes, key=lambda item: -float(item[1].abs()))[:beam]


def _node_tensor(tensor: Tensor | None, name: str, side: str) -> Tensor:
    if tensor is None or not tensor.requires_grad:
        raise ValueError(f"relprop: the {side} of module '{name}' is not a tensor of node features that the "
                         "output depends on; walks need each message-passing layer to take and return one")
    return tensor


def walk_relevance(lrp: LRP, x: Tensor, edge_index: Tensor, target: GraphTarget,
                   walks: Tensor | Sequence[Sequence[int]], additional_forward_args: Any = None) -> Tensor:
    """The relevance of each walk of ``walks`` (shape ``(W, L + 1)``): one backward pass each.
    """
    walker = WalkRelevance(lrp, x, edge_index, target, additional_forward_args)
    try:
        return torch.stack([walker.walk([int(node) for node in walk]) for walk in walks])
    finally:
        walker.close()


def subgraph_relevance(lrp: LRP, x: Tensor, edge_index: Tensor, target: GraphTarget, nodes: Tensor | Sequence[int],
                       additional_forward_args: Any = None) -> Tensor:
    """The relevance of the subgraph on ``nodes``: every walk inside it, summed, in one backward pass."""
    walker = WalkRelevance(lrp, x, edge_index, target, additional_forward_args)
    try:
        return walker.subgraph(nodes)
    finally:
        walker.close()


def top_walks(lrp: LRP, x: Tensor, edge_index: Tensor, target: GraphTarget, k: int = 10, beam: int | None = None,
              absolute: bool = False, additional_forward_args: Any = None) -> tuple[Tensor, Tensor]:
    """The ``k`` most relevant walks and their relevance (see :meth:`WalkRelevance.top`)."""
    walker = WalkRelevance(lrp, x, edge_index, target, additional_forward_args)
    try:
        return walker.top(k, beam, absolute)
    finally:
        walker.close()

