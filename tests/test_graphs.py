"""Graph neural networks (PyTorch Geometric): node, graph and link targets, edge relevance, GNN-LRP walks, layers.

Float64, small random graphs, bias-free models where an identity is checked: LRP-0 is gradient x input on
ReLU networks, so each edge's relevance at its messages is the gradient with respect to a per-layer edge weight
(GraphConv), and each walk's relevance is the gradient x input with every other node held constant at each
layer (a brute-force enumeration through plain autograd, independent of relprop's hooks).
"""
from __future__ import annotations

import itertools
import warnings

import pytest
import torch
from torch import nn

import relprop
from relprop.methods.graphs import GraphModel, edge_relevance, link_target, message_passing_layers
from relprop.methods.walks import WalkRelevance, subgraph_relevance, top_walks, walk_relevance

pyg = pytest.importorskip("torch_geometric")
from torch_geometric import nn as gnn  # noqa: E402

LRP0 = relprop.composites.Epsilon(0.0)
NODES, FEATURES = 6, 3


@pytest.fixture(autouse=True)
def _float64():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


def graph() -> tuple[torch.Tensor, torch.Tensor]:
    """Six nodes, a ring with two chords, both directions."""
    pairs = [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (5, 0), (0, 3), (1, 4)]
    edges = torch.tensor(pairs + [(b, a) for a, b in pairs]).T
    return torch.randn(NODES, FEATURES), edges


def explain(inputs, target, model, *arguments):
    """LRP-0 of a graph model for ``target`` on its output as one example (``(node, class)``)."""
    return relprop.LRP(GraphModel(model), LRP0).attribute(inputs, target=target, additional_forward_args=arguments)


def held(tensor: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """``tensor`` with the rows outside ``keep`` held constant (no gradient through them)."""
    return tensor if keep is None else torch.where(keep[:, None], tensor, tensor.detach())


class TwoLayers(nn.Module):
    """Two message-passing layers with a ReLU between; ``keep`` holds rows constant for the brute force."""

    def __init__(self, make, hidden: int = 4, classes: int = 3):
        super().__init__()
        self.conv1, self.conv2 = make(FEATURES, hidden), make(hidden, classes)

    def forward(self, x, edge_index, weights=(None, None), keep=(None, None, None)):
        extra1 = () if weights[0] is None else (weights[0],)
        extra2 = () if weights[1] is None else (weights[1],)
        hidden = self.conv1(held(x, keep[0]), edge_index, *extra1).relu()
        return held(self.conv2(held(hidden, keep[1]), edge_index, *extra2), keep[2])


def gin(a: int, b: int) -> nn.Module:
    return gnn.GINConv(nn.Sequential(nn.Linear(a, b, bias=False), nn.ReLU(), nn.Linear(b, b, bias=False)))


BIAS_FREE = {
    "GCNConv": lambda a, b: gnn.GCNConv(a, b, bias=False),
    "GraphConv": lambda a, b: gnn.GraphConv(a, b, bias=False),
    "GINConv": gin,
    "SAGEConv mean": lambda a, b: gnn.SAGEConv(a, b, bias=False),
    "SAGEConv sum": lambda a, b: gnn.SAGEConv(a, b, aggr="sum", bias=False),
    "SAGEConv max": lambda a, b: gnn.SAGEConv(a, b, aggr="max", bias=False),
    "ChebConv K=2": lambda a, b: gnn.ChebConv(a, b, K=2, bias=False),
}
ATTENTION = {
    "GATConv": lambda a, b: gnn.GATConv(a, b, heads=2, concat=False, bias=False),
    "GATv2Conv": lambda a, b: gnn.GATv2Conv(a, b, heads=2, concat=False, bias=False),
    "TransformerConv": lambda a, b: gnn.TransformerConv(a, b, heads=2, concat=False, bias=False, root_weight=False),
}


# ---- targets on outputs without a batch dimension (GraphModel: the graph as one example) ----

def test_node_target_is_gradient_times_input():
    x, edges = graph()
    model = TwoLayers(BIAS_FREE["GCNConv"]).eval()
    relevance = explain(x, (2, 1), model, edges)
    leaf = x.clone().requires_grad_()
    (gradient,) = torch.autograd.grad(model(leaf, edges)[2, 1], leaf)
    torch.testing.assert_close(relevance, gradient * x, rtol=0, atol=1e-12)
    torch.testing.assert_close(relevance.sum(), model(x, edges)[2, 1].detach(), rtol=0, atol=1e-12)


def test_graph_target_on_a_batch_of_graphs():
    """Two graphs batched as PyG batches them: explaining graph 1 gives graph 0's nodes nothing."""
    x, edges = graph()
    batch = torch.tensor([0, 0, 0, 1, 1, 1])
    inside = edges[:, (batch[edges[0]] == batch[edges[1]])]

    class Pooled(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = gin(FEATURES, 4)
            self.out = nn.Linear(4, 2, bias=False)

        def forward(self, x, edge_index, batch):
            return self.out(gnn.global_add_pool(self.conv(x, edge_index).relu(), batch))

    model = Pooled().eval()
    relevance = explain(x, (1, 0), model, inside, batch)
    assert relevance[:3].abs().max() == 0
    torch.testing.assert_close(relevance.sum(), model(x, inside, batch)[1, 0].detach(), rtol=0, atol=1e-12)


def test_a_target_outside_the_graph_is_named():
    x, edges = graph()
    model = TwoLayers(BIAS_FREE["GCNConv"]).eval()
    with pytest.raises(ValueError, match=r"output of shape \(1, 6, 3\): index 6 on dimension 1 of size 6"):
        edge_relevance(relprop.LRP(model), x, edges, (6, 0))
    with pytest.raises(ValueError, match="out of range"):
        relprop.LRP(GraphModel(model)).attribute(x, target=(0, 3), additional_forward_args=(edges,))


def test_link_target():
    """A link predictor scoring pairs: the target is the pair's position; edges conserve its score."""
    x, edges = graph()

    class Links(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = gnn.GraphConv(FEATURES, 4, bias=False)

        def forward(self, x, edge_index, pairs):
            h = self.conv(x, edge_index).relu()
            return (h[pairs[0]] * h[pairs[1]]).sum(-1)

    pairs = torch.tensor([[0, 2], [3, 5]])
    assert link_target(pairs, 2, 5) == (1,)
    with pytest.raises(ValueError, match="not among"):
        link_target(pairs, 5, 2)
    model = Links().eval()
    found = edge_relevance(relprop.LRP(model, LRP0), x, edges, link_target(pairs, 2, 5), (pairs,))
    score = model(x, edges, pairs)[1].detach()
    torch.testing.assert_close(found.output, score)
    torch.testing.assert_close(found.edge_layers.sum() + found.self_layers.sum(), score, rtol=1e-9, atol=1e-12)


# ---- edges ----

@pytest.mark.parametrize("layer", sorted(BIAS_FREE))
def test_edges_and_self_loops_conserve_in_every_layer(layer):
    x, edges = graph()
    model = TwoLayers(BIAS_FREE[layer]).eval()
    found = edge_relevance(relprop.LRP(model, LRP0), x, edges, (3, 2))
    output = model(x, edges)[3, 2].detach()
    assert found.layers == ["conv1", "conv2"]
    torch.testing.assert_close(found.edge_layers.sum(1) + found.self_layers.sum(1), output.expand(2), rtol=1e-9,
                               atol=1e-12)
    torch.testing.assert_close(found.edges.sum() + found.self_loops.sum(), output, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(found.nodes.sum(), output, rtol=1e-9, atol=1e-12)


def test_edge_relevance_is_the_gradient_of_per_layer_edge_weights():
    """GraphConv scales each message by its edge weight: LRP-0's relevance at the message is w dF/dw at w = 1."""
    x, edges = graph()
    model = TwoLayers(BIAS_FREE["GraphConv"]).eval()
    found = edge_relevance(relprop.LRP(model, LRP0), x, edges, (4, 0))
    weights = tuple(torch.ones(edges.shape[1], requires_grad=True) for _ in range(2))
    gradients = torch.autograd.grad(model(x, edges, weights)[4, 0], weights)
    torch.testing.assert_close(found.edge_layers, torch.stack(gradients), rtol=0, atol=1e-12)
    assert found.edge_magnitudes.min() >= 0
    wrapped = edge_relevance(relprop.LRP(GraphModel(model), LRP0), x, edges, (4, 0))  # the plain model's edges
    assert wrapped.layers == ["conv1", "conv2"] and torch.equal(wrapped.edge_layers, found.edge_layers)


def test_sparse_adjacency_is_refused_for_edges():
    x, edges = graph()
    model = TwoLayers(BIAS_FREE["GCNConv"]).eval()
    adjacency = torch.sparse_coo_tensor(edges.flip(0), torch.ones(edges.shape[1]), (NODES, NODES))
    with pytest.raises(TypeError, match="module 'conv1' propagates over a sparse adjacency"):
        edge_relevance(relprop.LRP(model), x, adjacency, (0, 0))
    # node relevance: the sparse product has no rule, which is said with its module
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        explain(x, (0, 0), model, adjacency)
    said = {str(warning.message) for warning in caught if warning.category is relprop.UnhandledOpWarning}
    assert {f"relprop: no rule for torch._C._sparse._sparse_mm in module 'model.conv{i}'; its plain gradient was used"
            for i in (1, 2)} <= said


# ---- walks ----

def brute_force(model: nn.Module, x: torch.Tensor, edges: torch.Tensor, target: tuple) -> dict[tuple, torch.Tensor]:
    """Every walk's relevance by its definition for LRP-0: gradient x input with the other rows held."""
    found = {}
    for walk in itertools.product(range(NODES), repeat=3):
        keep = tuple(torch.arange(NODES) == node for node in walk)
        leaf = x.clone().requires_grad_()
        (gradient,) = torch.autograd.grad(model(leaf, edges, keep=keep)[target], leaf)
        found[walk] = (gradient * x)[walk[0]].sum()
    return found


@pytest.mark.parametrize("layer", ["GCNConv", "GINConv"])
def test_walks_equal_the_brute_force_and_sum_to_the_nodes(layer):
    x, edges = graph()
    model = TwoLayers(BIAS_FREE[layer]).eval()
    target = (1, 2)
    expected = brute_force(model, x, edges, target)
    walks = torch.tensor(list(expected))
    found = walk_relevance(relprop.LRP(model, LRP0), x, edges, target, walks)
    torch.testing.assert_close(found, torch.stack(list(expected.values())), rtol=0, atol=1e-12)
    nodes = explain(x, target, model, edges).sum(1)
    per_start = torch.zeros(NODES).index_add_(0, walks[:, 0], found)
    torch.testing.assert_close(per_start, nodes, rtol=0, atol=1e-12)

    inside = [0, 1, 2, 4]
    chosen = torch.tensor([set(walk) <= set(inside) for walk in expected])
    torch.testing.assert_close(subgraph_relevance(relprop.LRP(model, LRP0), x, edges, target, inside),
                               found[chosen].sum(), rtol=0, atol=1e-12)

    walker_walks, values = top_walks(relprop.LRP(model, LRP0), x, edges, target, k=5)
    ranked = sorted(expected.items(), key=lambda item: -float(item[1]))[:5]
    torch.testing.assert_close(values, torch.stack([value for _, value in ranked]), rtol=0, atol=1e-12)
    for walk, value in zip(walker_walks.tolist(), values):
        torch.testing.assert_close(expected[tuple(walk)], value, rtol=0, atol=1e-12)


def test_a_beam_costs_fewer_passes():
    x, edges = graph()
    model = TwoLayers(BIAS_FREE["GCNConv"]).eval()
    full = WalkRelevance(relprop.LRP(model, LRP0), x, edges, (1, 2))
    full.top(3)
    narrow = WalkRelevance(relprop.LRP(model, LRP0), x, edges, (1, 2))
    narrow.top(3, beam=2)
    assert narrow.passes < full.passes
    with pytest.raises(ValueError, match="walks of 3"):
        narrow.walk([0, 1])


# ---- every common layer ----

@pytest.mark.parametrize("layer", sorted(BIAS_FREE) + sorted(ATTENTION))
def test_layer_conserves_without_unhandled_ops(layer):
    """No op without a rule (an error in the tests), relevance conserved; LRP-0 = gradient x input where the
    layer is piecewise linear (attention weights are held, as in transformers, so not there)."""
    x, edges = graph()
    make = {**BIAS_FREE, **ATTENTION}[layer]
    model = TwoLayers(make).eval()
    relevance = explain(x, (0, 1), model, edges)
    output = model(x, edges)[0, 1].detach()
    torch.testing.assert_close(relevance.sum(), output, rtol=1e-9, atol=1e-12)
    found = edge_relevance(relprop.LRP(model, LRP0), x, edges, (0, 1))
    torch.testing.assert_close(found.edge_layers.sum(1) + found.self_layers.sum(1), output.expand(2), rtol=1e-9,
                               atol=1e-12)
    if layer in BIAS_FREE:
        leaf = x.clone().requires_grad_()
        (gradient,) = torch.autograd.grad(model(leaf, edges)[0, 1], leaf)
        torch.testing.assert_close(relevance, gradient * x, rtol=0, atol=1e-12)


def test_gine_with_edge_features():
    """GINE adds projected edge features to each message: they get relevance as an input of their own."""
    x, edges = graph()
    attributes = torch.randn(edges.shape[1], 2)

    class Gine(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = gnn.GINEConv(nn.Sequential(nn.Linear(FEATURES, 3, bias=False)), edge_dim=2)

        def forward(self, x, edge_attr, edge_index):
            return self.conv(x, edge_index, edge_attr)

    model = Gine().eval()
    with torch.no_grad():
        model.conv.lin.bias.zero_()  # the edge features' projection: a bias would absorb relevance
    relevance = explain((x, attributes), (2, 0), model, edges)
    found = edge_relevance(relprop.LRP(model, LRP0), x, edges, (2, 0), {"edge_attr": attributes})
    output = model(x, attributes, edges)[2, 0].detach()
    assert len(message_passing_layers(model)) == 1
    torch.testing.assert_close(sum(r.sum() for r in relevance), output, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(found.edge_layers.sum() + found.self_layers.sum(), output, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("pool", ["mean", "max", "sum", "attention"])
def test_global_pooling_conserves(pool):
    x, edges = graph()
    batch = torch.tensor([0, 0, 0, 1, 1, 1])

    class Pooled(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = gnn.GraphConv(FEATURES, 4, bias=False)
            self.gate = gnn.AttentionalAggregation(nn.Linear(4, 1, bias=False))
            self.out = nn.Linear(4, 2, bias=False)

        def forward(self, x, edge_index, batch):
            h = self.conv(x, edge_index).relu()
            pooled = {"mean": gnn.global_mean_pool, "max": gnn.global_max_pool, "sum": gnn.global_add_pool,
                      "attention": self.gate}[pool](h, batch)
            return self.out(pooled)

    model = Pooled().eval()
    relevance = explain(x, (0, 1), model, edges, batch)
    torch.testing.assert_close(relevance.sum(), model(x, edges, batch)[0, 1].detach(), rtol=1e-9, atol=1e-12)
