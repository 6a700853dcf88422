"""The pictures of docs/guide/graphs.md: edge relevance and the top walks of a node and of a graph classifier.

    OMP_NUM_THREADS=1 python examples/graphs.py [--out docs/guide/graphs] [--seed 0]

Trains the 3-layer GCN of BA-Shapes and the 3-layer GIN of the house-or-cycle graphs
(:mod:`relprop.workflows.graphs`, a minute on one core), explains one house node and one test graph of each
class with the epsilon rule, and draws each explained output's neighbourhood: edges coloured by their signed
relevance (red for, blue against; width by ``|relevance|``), nodes ringed where they belong to the motif, and
the 3 walks of largest ``|relevance|`` as arrows (beam 8), the first thickest.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

import relprop
from relprop.methods.graphs import edge_relevance
from relprop.methods.walks import top_walks
from relprop.viz.graphs import neighbourhood, save_graph_relevance
from relprop.workflows.graphs import GraphClassifier, NodeClassifier, ba_motifs, ba_shapes, train_graphs, train_nodes


def node_panels(seed: int) -> list[dict]:
    """One house node of BA-Shapes: its 3-hop neighbourhood, with the top walks."""
    data = ba_shapes(seed)
    model = NodeClassifier(data.num_features, 4)
    accuracy = train_nodes(model, data, epochs=1000)
    with torch.no_grad():
        predicted = model(data.x, data.edge_index).argmax(-1)
    node = int(((data.y > 0) & data.test_mask & (predicted == data.y)).nonzero()[0])
    lrp = relprop.LRP(model, "epsilon")
    found = edge_relevance(lrp, data.x, data.edge_index, (node, int(predicted[node])))
    walks, _ = top_walks(lrp, data.x, data.edge_index, (node, int(predicted[node])), k=3, beam=8, absolute=True)
    motif = data.node_mask.nonzero().flatten().tolist()
    around = neighbourhood(data.edge_index, node, 2)
    return [dict(title=f"BA-Shapes node {node} (GCN, test accuracy {accuracy:.2f}): edges, top 3 walks by |R|",
                 edge_index=data.edge_index, edge_relevance=found.edges, walks=walks, nodes=around,
                 highlight=[n for n in around if n in motif], explained=node)]


def graph_panels(seed: int) -> list[dict]:
    """A test graph with a house and one with a cycle, whole."""
    graphs = ba_motifs(seed)
    model = GraphClassifier(graphs[0].num_features, 2)
    accuracy = train_graphs(model, graphs)
    panels = []
    for label, name in enumerate(("house", "cycle")):
        graph = next(g for g in graphs[int(0.8 * len(graphs)):] if int(g.y) == label)
        batch = torch.zeros(graph.num_nodes, dtype=torch.long)
        lrp = relprop.LRP(model, "epsilon")
        found = edge_relevance(lrp, graph.x, graph.edge_index, (0, label), (batch,))
        walks, _ = top_walks(lrp, graph.x, graph.edge_index, (0, label), k=3, beam=8, absolute=True,
                             additional_forward_args=(batch,))
        panels.append(dict(title=f"a graph with a {name} (GIN, test accuracy {accuracy:.2f})",
                           edge_index=graph.edge_index, edge_relevance=found.edges, walks=walks,
                           highlight=graph.node_mask.nonzero().flatten().tolist()))
    return panels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/guide/graphs"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    print(save_graph_relevance(args.out / "node.png", node_panels(args.seed), size=6.5))
    print(save_graph_relevance(args.out / "graph.png", graph_panels(args.seed)))


if __name__ == "__main__":
    main()
