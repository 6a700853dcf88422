"""Pictures of a graph's relevance: edges coloured by their relevance, nodes by theirs, top walks drawn as paths.

Drawn with networkx's layouts and matplotlib. Each undirected edge appears once, with the relevance of both its
directions summed; colours are scaled symmetrically (relevance 0 is the centre colour, as in
:mod:`relprop.viz`), and widths grow with ``|relevance|``.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import torch
from torch import Tensor

from relprop.viz import atomic_path, colormap

__all__ = ["draw_graph_relevance", "neighbourhood", "save_graph_relevance"]


def _undirected(edge_index: Tensor, values: Tensor) -> dict[tuple[int, int], float]:
    """Each undirected edge with the relevance of its directions summed (self-loops left out)."""
    found: dict[tuple[int, int], float] = {}
    for (source, destination), value in zip(edge_index.T.tolist(), values.tolist()):
        if source != destination:
            key = (min(source, destination), max(source, destination))
            found[key] = found.get(key, 0.0) + value
    return found


def draw_graph_relevance(ax: Any, edge_index: Tensor, edge_relevance: Tensor, node_relevance: Tensor | None = None,
                         walks: Tensor | Sequence[Sequence[int]] = (), nodes: Sequence[int] | None = None,
                         highlight: Sequence[int] = (), explained: int | None = None, cmap: str = "bwr",
                         seed: int = 0) -> dict[int, Any]:
    """Draw a graph on ``ax`` with its edges coloured by relevance; returns the node positions.

    Parameters
    ----------
    ax : matplotlib Axes
    edge_index : Tensor
        The edges, ``(2, num_edges)``.
    edge_relevance : Tensor
        One value per edge (:attr:`~relprop.methods.graphs.GraphRelevance.edges`, or magnitudes).
    node_relevance : Tensor, optional
        One value per node, as node colours (grey where None).
    walks : Tensor or sequences of int
        Walks drawn as arrows along their nodes, the first one thickest (:func:`~relprop.methods.walks.top_walks`).
    nodes : sequence of int, optional
        The nodes to draw (a neighbourhood); all where None.
    highlight : sequence of int
        Nodes drawn with a black ring (a motif's ground truth).
    explained : int, optional
        The explained node, drawn larger, as a star.
    cmap : str
        The colour map of relevance (:func:`relprop.viz.colormap`).
    seed : int
        The seed of the layout of graphs over 200 nodes.
    """
    import networkx as nx  # a dependency of the graph extra's pictures only

    keep = set(range(int(edge_index.max()) + 1) if nodes is None else [int(node) for node in nodes])
    edges = {key: value for key, value in _undirected(edge_index, edge_relevance.detach().cpu()).items()
             if key[0] in keep and key[1] in keep}
    graph = nx.Graph()
    graph.add_nodes_from(sorted(keep))
    graph.add_edges_from(edges)
    positions = nx.kamada_kawai_layout(graph) if len(keep) <= 200 else nx.spring_layout(graph, seed=seed)
    scale = max((abs(value) for value in edges.values()), default=1.0) or 1.0
    colours = colormap(cmap)
    nx.draw_networkx_edges(graph, positions, ax=ax, edgelist=list(edges),
                           edge_color=[colours(0.5 + 0.5 * value / scale) for value in edges.values()],
                           width=[0.5 + 4.0 * abs(value) / scale for value in edges.values()])
    ordered = sorted(keep)
    if node_relevance is None:
        face: Any = "lightgrey"
    else:
        values = node_relevance.detach().cpu()
        node_scale = float(values[ordered].abs().max()) or 1.0
        face = [colours(0.5 + 0.5 * float(values[node]) / node_scale) for node in ordered]
    rings = set(int(node) for node in highlight)
    nx.draw_networkx_nodes(graph, positions, ax=ax, nodelist=ordered, node_size=60, node_color=face,
                           edgecolors=["black" if node in rings else "grey" for node in ordered],
                           linewidths=[1.8 if node in rings else 0.5 for node in ordered])
    if explained is not None and explained in keep:
        nx.draw_networkx_nodes(graph, positions, ax=ax, nodelist=[explained], node_size=320, node_shape="*",
                               node_color="gold", edgecolors="black", linewidths=1.0)
    for rank, walk in enumerate(walks):
        _draw_walk(ax, positions, [int(node) for node in walk], width=3.0 / (1 + rank), colour=f"C{rank % 10}")
    ax.set_axis_off()
    return positions


def _draw_walk(ax: Any, positions: dict[int, Any], walk: list[int], width: float, colour: str) -> None:
    """A walk as arrows from node to node; a step that stays on its node as a small circle."""
    for source, destination in zip(walk, walk[1:]):
        if source not in positions or destination not in positions:
            continue
        start, end = positions[source], positions[destination]
        if source == destination:
            ax.add_patch(plt.Circle(tuple(start), 0.02, fill=False, color=colour, linewidth=width))
            continue
        ax.annotate("", xy=tuple(end), xytext=tuple(start),
                    arrowprops=dict(arrowstyle="-|>", color=colour, linewidth=width, alpha=0.8,
                                    connectionstyle="arc3,rad=0.15"))


def save_graph_relevance(path: str | Path, panels: Sequence[dict[str, Any]], size: float = 4.5) -> Path:
    """Save panels side by side, each the keyword arguments of :func:`draw_graph_relevance` plus a ``title``."""
    figure, axes = plt.subplots(1, len(panels), figsize=(size * len(panels), size), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        arguments = dict(panel)
        ax.set_title(arguments.pop("title", ""), fontsize=10)
        draw_graph_relevance(ax, **arguments)
    figure.tight_layout()
    path = Path(path)
    with atomic_path(path) as temporary:
        figure.savefig(temporary, dpi=110, format=path.suffix.lstrip(".") or "png")
    plt.close(figure)
    return path


def neighbourhood(edge_index: Tensor, node: int, hops: int) -> list[int]:
    """The nodes within ``hops`` of ``node`` (a node's computation graph)."""
    found = {node}
    for _ in range(hops):
        reached = torch.isin(edge_index[1], torch.tensor(sorted(found)))
        found |= set(edge_index[0, reached].tolist())
    return sorted(found)

