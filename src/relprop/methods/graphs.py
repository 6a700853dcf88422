"""Graphs: relevance of a graph neural network's nodes and edges (PyTorch Geometric's message passing).

A graph model is called as ``model(x, edge_index, ...)`` on node features ``x`` of shape ``(num_nodes,
features)``; its output has no batch dimension: ``(num_nodes, classes)`` for node tasks, ``(num_graphs,
classes)`` for graph tasks (PyG batches graphs by concatenating their nodes), one score per queried pair for
links. The functions here see the whole output as one example, so that a captum-style target indexes it:
``(node, class)``, ``(graph, class)``, ``(pair,)``; :class:`GraphModel` gives any relprop method that view
(``relprop.LRP(GraphModel(model)).attribute(x, target=(node, class), additional_forward_args=(edge_index,))``).

The relevance of an edge in a layer is the relevance that flows through its message: PyG computes one message
per edge (``MessagePassing.message``, shape ``(edges, ...)``) and aggregates them per receiving node, and the
relevance reaching that message tensor in relprop's backward pass is read per edge. The message is where the
edge acts, so no mask or weight is added to the model: the explained pass is the plain one. What reaches a
node's layer output without an edge of the graph (an added self-loop, a root weight, a bias's share) is that
node's *self* relevance: the edges and the self relevance of a layer sum to the relevance at the layer's output.
Layers are the message-passing modules' calls, in the order the forward pass makes them.

Edges need the messages apart: a fused sparse adjacency (``SparseTensor``, ``torch.sparse``, a sorted
``EdgeIndex``) aggregates without them, and is refused with a clear error.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from relprop.methods._inputs import Target, forward_arguments
from relprop.methods.attribution import LRP, ForwardPass
from relprop.methods.targets import output_relevance

__all__ = ["GraphModel", "GraphRelevance", "GraphTarget", "LayerCall", "edge_relevance", "graph_pass", "graph_seed",
           "link_target", "message_passing_layers", "undirected"]


#: what a graph explanation explains: a target of :func:`~relprop.methods.target_mask` on the output seen as one
#: example, or a function of the logits returning the seed (the output relevance), for selections a target
#: cannot name
GraphTarget = Target | Callable[[Tensor], Tensor]


def message_passing_layers(model: nn.Module) -> list[nn.Module]:
    """The message-passing modules of ``model`` (PyG's ``MessagePassing``), outermost ones only.

    Recognised by PyG's message hooks, so that relprop needs no import of torch_geometric here.
    """
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if hasattr(module, "register_message_forward_hook") and hasattr(module, "propagate"):
            if not any(name.startswith(f"{outer}.") for outer, _ in found):
                found.append((name, module))
    return [module for _, module in found]


@dataclass
class LayerCall:
    """One call of a message-passing module in the explained forward pass: what its edges need.

    Attributes
    ----------
    layer : nn.Module
        The message-passing module.
    name : str
        The module's path in the model.
    inputs : Tensor or None
        The node features the call received (its first argument), where it is a tensor.
    output : Tensor or None
        The node features it returned.
    edge_index : list of Tensor
        The edges of each of its ``propagate`` calls, as PyG used them (self-loops added by the layer included).
    messages : list of Tensor
        The messages of each ``propagate`` call, edges along ``node_dim``.
    """

    layer: nn.Module
    name: str
    inputs: Tensor | None = None
    output: Tensor | None = None
    edge_index: list[Tensor] = field(default_factory=list)
    messages: list[Tensor] = field(default_factory=list)

    def receivers(self, propagation: int) -> Tensor:
        """The receiving node of each edge of one ``propagate`` call (by the module's ``flow``)."""
        edges = self.edge_index[propagation]
        return edges[1] if getattr(self.layer, "flow", "source_to_target") == "source_to_target" else edges[0]

    def senders(self, propagation: int) -> Tensor:
        """The sending node of each edge of one ``propagate`` call."""
        edges = self.edge_index[propagation]
        return edges[0] if getattr(self.layer, "flow", "source_to_target") == "source_to_target" else edges[1]


def _dense_edges(module: nn.Module, name: str, edge_index: Any) -> Tensor:
    """The ``(2, edges)`` index tensor of a propagation, or a clear error for a fused sparse adjacency."""
    fused = getattr(module, "fuse", False) and not getattr(module, "explain", False)
    if not isinstance(edge_index, Tensor) or edge_index.is_sparse or edge_index.layout != torch.strided or (
            fused and type(edge_index).__name__ == "EdgeIndex" and getattr(edge_index, "is_sorted_by_col", False)):
        raise TypeError(f"relprop: module '{name}' propagates over a sparse adjacency "
                        f"({type(edge_index).__name__}), which aggregates without per-edge messages; edge and walk "
                        "relevance need edge_index as a (2, num_edges) integer tensor")
    return edge_index


@contextmanager
def _recording(model: nn.Module, calls: list[LayerCall]) -> Iterator[None]:
    """Record each message-passing call's inputs, edges, messages and output while the block runs."""
    names = {module: name for name, module in model.named_modules()}
    active: list[LayerCall] = []
    handles = []

    def pre(module: nn.Module, args: tuple) -> None:
        call = LayerCall(module, names[module] or "<root>")
        call.inputs = args[0] if args and isinstance(args[0], Tensor) else None
        calls.append(call)
        active.append(call)

    def post(module: nn.Module, args: tuple, output: Any) -> None:
        call = active.pop()
        call.output = output if isinstance(output, Tensor) else None

    def propagate(module: nn.Module, inputs: tuple) -> None:
        if active and active[-1].layer is module:
            active[-1].edge_index.append(_dense_edges(module, active[-1].name, inputs[0]))

    def message(module: nn.Module, inputs: tuple, output: Tensor) -> None:
        if active and active[-1].layer is module:
            call = active[-1]
            if len(call.messages) < len(call.edge_index):
                call.messages.append(output)
            else:  # decomposed_layers > 1: the features in chunks, each its own messages
                call.messages[-1] = torch.cat([call.messages[-1], output], dim=-1)

    for module in message_passing_layers(model):
        layer: Any = module  # a MessagePassing: its own hooks are no nn.Module's
        handles += [layer.register_forward_pre_hook(pre), layer.register_forward_hook(post),
                    layer.register_propagate_forward_pre_hook(propagate), layer.register_message_forward_hook(message)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def link_target(edge_label_index: Tensor, source: int, destination: int) -> tuple[int]:
    """The target of a link predictor's score for the pair ``(source, destination)``.

    A link predictor scores the pairs of ``edge_label_index`` (shape ``(2, pairs)``), one score each: its
    target is the pair's position, ``(pair,)``.
    """
    hits = ((edge_label_index[0] == source) & (edge_label_index[1] == destination)).nonzero()
    if not len(hits):
        raise ValueError(f"relprop: the pair ({source}, {destination}) is not among the {edge_label_index.shape[1]} "
                         "scored pairs of edge_label_index")
    return (int(hits[0, 0]),)


class GraphModel(nn.Module):
    """A graph model seen as a model of one example: its output gains a batch dimension of 1.

    PyG's models return ``(num_nodes, classes)`` or ``(num_graphs, classes)``, without a batch dimension (a batch
    of graphs is one graph of their nodes), where relprop's methods read the first dimension as the batch, as
    captum's do. Wrapped, the output is ``(1, num_nodes, classes)``, and a captum-style target indexes it:
    ``target=(node, class)``. The relevance of the node features keeps their shape.

    Examples
    --------
    >>> import torch
    >>> from torch import nn
    >>> import relprop
    >>> from relprop.methods.graphs import GraphModel
    >>> class Mean(nn.Module):  # each node's features and its neighbours' mean, then a linear map
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.linear = nn.Linear(2, 3)
    ...     def forward(self, x, edge_index):
    ...         summed = torch.zeros_like(x).index_add(0, edge_index[1], x[edge_index[0]])
    ...         return self.linear(x + summed / 2)
    >>> x, edge_index = torch.randn(4, 2), torch.tensor([[0, 1, 2, 3], [1, 0, 3, 2]])
    >>> lrp = relprop.LRP(GraphModel(Mean().eval()))
    >>> lrp.attribute(x, target=(1, 2), additional_forward_args=(edge_index,)).shape  # node 1, class 2
    torch.Size([4, 2])
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.train(model.training)  # in the model's mode, so that relprop says nothing a plain call would not

    def forward(self, *args: Any, **kwargs: Any) -> Tensor:
        output = self.model(*args, **kwargs)
        if not isinstance(output, Tensor):
            raise TypeError(f"relprop: GraphModel explains a model returning a tensor, got {type(output).__name__}")
        return output.unsqueeze(0)


def graph_pass(lrp: LRP, x: Tensor, edge_index: Tensor, additional_forward_args: Any = None,
               reusable: bool = False, masked: bool = False) -> tuple[ForwardPass, list[LayerCall]]:
    """Run ``lrp.model(x, edge_index, ...)`` once under the engine, recording its message-passing calls.

    ``masked``: its backward passes keep part of the relevance on purpose (walks), where the guard would report
    the relevance left behind as lost: the pass runs without the guard.
    """
    extra, keywords = forward_arguments(additional_forward_args)
    calls: list[LayerCall] = []
    if isinstance(lrp.model, GraphModel) or (masked and lrp.guard):  # the plain model's output, unbatched
        model = lrp.model.model if isinstance(lrp.model, GraphModel) else lrp.model
        lrp = LRP(model, lrp.composite, lrp.strict, guard=lrp.guard and not masked)
    with _recording(lrp.model, calls):
        explained = lrp.record(x, _arguments(edge_index, extra, keywords), reusable=reusable)
    if not calls:
        raise ValueError("relprop: the model called no message-passing module (torch_geometric MessagePassing); "
                         "edges and walks are read at their messages")
    return explained, calls


def _arguments(edge_index: Tensor, extra: tuple, keywords: dict[str, Any]) -> Any:
    """The model's further arguments: ``(edge_index, *extra)``, or keywords with ``edge_index`` among them."""
    return {"edge_index": edge_index, **keywords} if keywords else (edge_index, *extra)


def _grab(tensors: Sequence[Tensor], found: dict[int, Tensor], scale: bool) -> list[Any]:
    """Hooks that keep the relevance reaching each tensor (times the tensor where it is per unit)."""
    def keep(position: int, tensor: Tensor) -> Any:
        def hook(grad: Tensor) -> None:
            relevance = grad * tensor.detach() if scale else grad
            found[position] = found[position] + relevance if position in found else relevance.detach().clone()
        return hook
    return [tensor.register_hook(keep(position, tensor)) for position, tensor in enumerate(tensors)
            if tensor.requires_grad]


def _per_row(relevance: Tensor | None, rows: int, dim: int = 0) -> Tensor:
    """Relevance summed over every dimension but ``dim`` (the nodes or edges)."""
    if relevance is None:
        return torch.zeros(rows)
    return relevance.movedim(dim, 0).reshape(rows, -1).sum(1)


@dataclass
class GraphRelevance:
    """The relevance of a graph's nodes and edges for one explained output.

    Attributes
    ----------
    features : Tensor
        Relevance of each node feature, shape of ``x``.
    nodes : Tensor
        ``features`` summed per node, shape ``(num_nodes,)``.
    edge_layers : Tensor
        Relevance of each edge of ``edge_index`` in each message-passing call, shape ``(layers, num_edges)``.
    self_layers : Tensor
        Relevance of each node that reached its layer output without an edge of the graph (added self-loops,
        root weights, biases' shares), shape ``(layers, num_nodes)``.
    output : Tensor
        The explained output: the seed's total.
    layers : list of str
        The module path of each layer.
    """

    features: Tensor
    nodes: Tensor
    edge_layers: Tensor
    self_layers: Tensor
    output: Tensor
    layers: list[str]

    @property
    def edges(self) -> Tensor:
        """Each edge's relevance over all layers, as the mean of its layers' (so that edges and self-loops sum to
        the output as each layer's do)."""
        return self.edge_layers.mean(0)

    @property
    def edge_magnitudes(self) -> Tensor:
        """How much relevance each edge carries, of either sign: the mean over layers of its ``|relevance|``.

        Relevance of both signs flowing through an edge (evidence for and against the output, which cancel in
        :attr:`edges`) counts here: it ranks the edges an output depends on.
        """
        return self.edge_layers.abs().mean(0)

    @property
    def self_loops(self) -> Tensor:
        """Each node's self relevance, as the mean of its layers'."""
        return self.self_layers.mean(0)


def _edge_positions(graph: Tensor, used: Tensor, nodes: int) -> Tensor:
    """For each edge PyG used, its column in the graph's ``edge_index``, or -1 (a self-loop the layer added)."""
    keys = graph[0] * nodes + graph[1]
    order = torch.argsort(keys, stable=True)
    sorted_keys = keys[order]
    wanted = used[0] * nodes + used[1]
    at = torch.searchsorted(sorted_keys, wanted).clamp(max=max(len(sorted_keys) - 1, 0))
    found = (sorted_keys[at] == wanted) if len(sorted_keys) else torch.zeros_like(wanted, dtype=torch.bool)
    return torch.where(found, order[at] if len(order) else wanted, torch.full_like(wanted, -1))


def undirected(edge_index: Tensor, values: Tensor) -> Tensor:
    """Each edge's value plus its reverse edge's: an undirected edge's, where the graph stores it as two directed
    edges (as PyG stores undirected graphs). An edge without a reverse, or a self-loop, keeps its own value.

    Examples
    --------
    >>> import torch
    >>> from relprop.methods.graphs import undirected
    >>> undirected(torch.tensor([[0, 1, 1], [1, 0, 2]]), torch.tensor([1.0, 2.0, 5.0]))
    tensor([3., 3., 5.])
    """
    nodes = int(edge_index.max()) + 1 if edge_index.numel() else 0
    reverse = _edge_positions(edge_index, edge_index.flip(0), nodes)
    paired = (reverse >= 0) & (edge_index[0] != edge_index[1])
    result = values.clone()
    result[paired] += values[reverse[paired]]
    return result


def edge_relevance(lrp: LRP, x: Tensor, edge_index: Tensor, target: GraphTarget,
                   additional_forward_args: Any = None) -> GraphRelevance:
    """Relevance of the nodes and edges of a graph for the output at ``target``.

    Parameters
    ----------
    lrp : LRP
        The explainer of a model called as ``model(x, edge_index, *additional_forward_args)``.
    x : Tensor
        Node features, ``(num_nodes, features)``.
    edge_index : Tensor
        The graph's edges, ``(2, num_edges)``.
    target : tuple or callable
        ``(node, class)`` for node outputs, ``(graph, class)`` for graph outputs, ``(pair,)`` for a link
        predictor's scores (:func:`link_target`): any target of :func:`~relprop.methods.target_mask` on the
        output seen as one example; or a function of the logits returning the output relevance
        (:data:`GraphTarget`).
    additional_forward_args : tuple or dict, optional
        Further arguments of the model after ``edge_index`` (``batch``, edge features).

    Returns
    -------
    GraphRelevance

    """
    explained, calls = graph_pass(lrp, x, edge_index, additional_forward_args)
    seed = graph_seed(explained.logits, target)
    nodes, edges = x.shape[0], edge_index.shape[1]
    messages = [message for call in calls for message in call.messages]
    outputs = [call.output if call.output is not None else torch.zeros(0) for call in calls]
    found: dict[int, Tensor] = {}
    handles = _grab([*messages, *outputs], found, explained.gradient_form)
    try:
        (features,) = explained.propagate(seed, owned=True)[:1]
    finally:
        for handle in handles:
            handle.remove()
    edge_layers = torch.zeros(len(calls), edges, dtype=features.dtype)
    self_layers = torch.zeros(len(calls), nodes, dtype=features.dtype)
    position = 0
    for layer, call in enumerate(calls):
        for propagation, used in enumerate(call.edge_index):
            node_dim = getattr(call.layer, "node_dim", -2) % call.messages[propagation].dim()
            relevance = _per_row(found.get(position), used.shape[1], node_dim).to(features.dtype)
            columns = _edge_positions(edge_index, used, nodes)
            graph_edge = (columns >= 0) & (used[0] != used[1])
            edge_layers[layer].index_add_(0, columns[graph_edge], relevance[graph_edge])
            self_layers[layer].index_add_(0, call.receivers(propagation)[graph_edge], -relevance[graph_edge])
            position += 1
        out = found.get(len(messages) + layer)
        if out is not None:
            self_layers[layer] += _per_row(out, out.shape[0]).to(features.dtype)[:nodes]
    return GraphRelevance(features, features.reshape(nodes, -1).sum(1), edge_layers, self_layers,
                          seed.sum(), [call.name for call in calls])


def graph_seed(logits: Tensor, target: GraphTarget) -> Tensor:
    """The output relevance for ``target``: ``target(logits)``, or :func:`~relprop.methods.output_relevance` with
    the output as one example (``(node, class)`` indexes it)."""
    if callable(target) and not isinstance(target, Tensor):
        seed = target(logits.detach())
        if seed.shape != logits.shape:
            raise ValueError(f"relprop: the seed of shape {tuple(seed.shape)} does not match the model output of "
                             f"shape {tuple(logits.shape)}")
        return seed.detach()
    return output_relevance(logits.unsqueeze(0), target).squeeze(0)
