"""Synthetic graph tasks with known explanations, and small models that learn them (PyTorch Geometric).

- :func:`ba_shapes`: node classification on a Barabasi-Albert graph with "house" motifs attached (Ying et al.
  2019, PyG's ``ExplainerDataset``): a node's class is its place in a house (0: the base graph). Constant
  features: only the structure tells the classes apart.
- :func:`ba_motifs`: graph classification in the manner of BA-2Motifs (Luo et al. 2020): small BA graphs with a
  house (class 0) or a 5-cycle (class 1) attached.

Both carry the ground truth ``edge_mask`` (1 on the motif's edges) and ``node_mask``. Nothing is downloaded.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

try:
    from torch_geometric import seed_everything
    from torch_geometric.data import Batch, Data
    from torch_geometric.datasets import ExplainerDataset
    from torch_geometric.datasets.graph_generator import BAGraph
    from torch_geometric.datasets.motif_generator import CycleMotif, HouseMotif
    from torch_geometric.nn import GATConv, GCNConv, GINConv, global_add_pool
except ModuleNotFoundError as error:  # an optional workflow: say how to install it
    raise ModuleNotFoundError("relprop: relprop.workflows.graphs needs PyTorch Geometric: "
                              "pip install 'relprop[graph]'", name=error.name) from error

__all__ = ["NodeClassifier", "GraphClassifier", "ba_motifs", "ba_shapes", "train_graphs", "train_nodes"]


def ba_shapes(seed: int = 0, nodes: int = 300, motifs: int = 80, degree: bool = False) -> Data:
    """BA-Shapes: ``nodes`` BA nodes (5 edges each), ``motifs`` houses; 10 constant features (with ``degree``, the
    first is each node's degree over 10 instead); a split of the nodes into ``train_mask`` (80%) and
    ``test_mask``."""
    seed_everything(seed)  # PyG's BA generator draws from numpy
    data = ExplainerDataset(BAGraph(num_nodes=nodes, num_edges=5), HouseMotif(), num_motifs=motifs)[0]
    data.x = torch.ones(data.num_nodes, 10)
    if degree:
        data.x[:, 0] = torch.bincount(data.edge_index[1], minlength=data.num_nodes) / 10
    order = torch.randperm(data.num_nodes)
    data.train_mask = torch.zeros(data.num_nodes, dtype=torch.bool)
    data.train_mask[order[: int(0.8 * data.num_nodes)]] = True
    data.test_mask = ~data.train_mask
    return data


def ba_motifs(seed: int = 0, graphs: int = 400, nodes: int = 20) -> list[Data]:
    """Graphs of ``nodes`` BA nodes (one edge each) with a house (label 0) or a 5-cycle (label 1) attached, half
    each; 10 constant features."""
    seed_everything(seed)
    found = []
    for label, motif in enumerate((HouseMotif(), CycleMotif(5))):
        for data in ExplainerDataset(BAGraph(num_nodes=nodes, num_edges=1), motif, num_motifs=1,
                                     num_graphs=graphs // 2):
            data.x = torch.ones(data.num_nodes, 10)
            data.y = torch.tensor([label])
            found.append(data)
    order = torch.randperm(len(found)).tolist()
    return [found[i] for i in order]


class NodeClassifier(nn.Module):
    """Three message-passing layers of ``hidden`` features with ReLUs, and a linear read-out per node.

    ``kind``: ``"gcn"`` (GCNConv) or ``"gat"`` (GATConv, one attention head).
    """

    def __init__(self, features: int, classes: int, hidden: int = 20, kind: str = "gcn") -> None:
        super().__init__()
        sizes = [features, hidden, hidden, hidden]
        if kind == "gcn":
            self.convs = nn.ModuleList(GCNConv(a, b) for a, b in zip(sizes, sizes[1:]))
        elif kind == "gat":
            self.convs = nn.ModuleList(GATConv(a, b, heads=1) for a, b in zip(sizes, sizes[1:]))
        else:
            raise ValueError(f"relprop: unknown node classifier {kind!r}; 'gcn' or 'gat'")
        self.out = nn.Linear(hidden, classes)

    def forward(self, x: Tensor, edge_index: Tensor) -> Tensor:
        for conv in self.convs:
            x = conv(x, edge_index).relu()
        return self.out(x)


class GraphClassifier(nn.Module):
    """Three GIN layers (two-layer MLPs) with ReLUs, sum pooling per graph and a linear read-out."""

    def __init__(self, features: int, classes: int, hidden: int = 32) -> None:
        super().__init__()
        sizes = [features, hidden, hidden, hidden]
        self.convs = nn.ModuleList(
            GINConv(nn.Sequential(nn.Linear(a, b), nn.ReLU(), nn.Linear(b, b))) for a, b in zip(sizes, sizes[1:]))
        self.out = nn.Linear(hidden, classes)

    def forward(self, x: Tensor, edge_index: Tensor, batch: Tensor | None = None) -> Tensor:
        for conv in self.convs:
            x = conv(x, edge_index).relu()
        return self.out(global_add_pool(x, batch))


def train_nodes(model: nn.Module, data: Data, epochs: int = 500, lr: float = 0.01) -> float:
    """Train a node classifier on ``data.train_mask``; its accuracy on ``data.test_mask``."""
    optimizer = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=5e-4)
    model.train()
    for _ in range(epochs):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(data.x, data.edge_index)[data.train_mask], data.y[data.train_mask])
        loss.backward()
        optimizer.step()
    model.eval()
    with torch.no_grad():
        predicted = model(data.x, data.edge_index).argmax(-1)
    return float((predicted[data.test_mask] == data.y[data.test_mask]).float().mean())


def train_graphs(model: nn.Module, graphs: list[Data], epochs: int = 100, lr: float = 0.005,
                 batch_size: int = 32) -> float:
    """Train a graph classifier on the first 80% of ``graphs``; its accuracy on the rest."""
    split = int(0.8 * len(graphs))
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    for _ in range(epochs):
        for start in range(0, split, batch_size):
            batch: Any = Batch.from_data_list(graphs[start:min(start + batch_size, split)])
            optimizer.zero_grad()
            F.cross_entropy(model(batch.x, batch.edge_index, batch.batch), batch.y).backward()
            optimizer.step()
    model.eval()
    test: Any = Batch.from_data_list(graphs[split:])
    with torch.no_grad():
        predicted = model(test.x, test.edge_index, test.batch).argmax(-1)
    return float((predicted == test.y).float().mean())
