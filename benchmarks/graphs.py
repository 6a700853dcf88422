"""Edge explanations of graph neural networks against the motifs that decide them: relprop and PyG's explainers.

    OMP_NUM_THREADS=1 python benchmarks/graphs.py [--task ba-shapes ba-motifs ba-shapes-gat] [--explained 50]
        [--epochs 100] [--pg-epochs 30] [--seed 0]

Tasks (``relprop.workflows.graphs``, generated, nothing downloaded): ``ba-shapes``, a 3-layer GCN classifying the
nodes of a 300-node BA graph with 80 houses; ``ba-shapes-gat``, the same with GAT layers; ``ba-motifs``, a 3-layer
GIN with sum pooling telling BA graphs with a house from those with a 5-cycle. ``--explained`` motif nodes of the
test split (or test graphs), correctly classified, are explained, each through PyG's ``Explainer`` with
``explanation_type="model"`` (PGExplainer: ``"phenomenon"``, as it requires) and ``edge_mask_type="object"``.

For each method:

- edge AUROC: the edge mask against the motif's edges, per explained node over the edges of its 3-hop computation
  graph (per graph over all its edges), averaged; "signed" rows rank relevance (evidence for the prediction
  above evidence against it), "magnitude" rows each layer's ``|relevance|``, averaged (``edge_magnitudes``);
  "undirected": each mask with both directions of an edge summed (``relprop.methods.graphs.undirected``), as
  the graphs are undirected and their motif marks both directions;
- fidelity+ / fidelity- and the characterization score (PyG's ``fidelity`` and ``characterization_score``) of
  the top 12 edges (a house's 6 undirected edges), averaged before the characterization score;
- time per explanation (median, seconds), PGExplainer's training (``--pg-epochs`` over the explained items) apart;
- for the walks: the share of the top 5 walks (beam 8, ranked by value and by magnitude) whose nodes all lie in
  the motif, and their time.
"""
from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch_geometric.explain import Explainer, Explanation
from torch_geometric.explain.algorithm import CaptumExplainer, GNNExplainer, PGExplainer
from torch_geometric.explain.metric import characterization_score, fidelity, groundtruth_metrics
from torch_geometric.utils import k_hop_subgraph

import relprop
from relprop.integrations.pyg import LRPExplainer
from relprop.methods.graphs import undirected
from relprop.methods.walks import top_walks
from relprop.workflows.graphs import GraphClassifier, NodeClassifier, ba_motifs, ba_shapes, train_graphs, train_nodes

#: relprop's rows: a preset name or a composite, and whether the mask is |relevance|
PRESETS: dict[str, tuple[Any, bool]] = {
    "relprop epsilon, signed": ("epsilon", False),
    "relprop epsilon, magnitude": ("epsilon", True),
    "relprop epsilon-plus-flat, magnitude": ("epsilon-plus-flat", True),
    "relprop cp-lrp, magnitude": ("cp-lrp", True),
    "relprop attnlrp, magnitude": ("attnlrp", True),
    "relprop gamma 0.25 (dense), magnitude": (relprop.composites.Composite(dense=relprop.rules.Gamma(0.25)), True),
    "relprop z+ (dense), epsilon 0.1, magnitude": (relprop.composites.Composite(0.1, dense=relprop.rules.ZPlus()),
                                                   True),
    "relprop z+ (dense), epsilon 0.1, signed": (relprop.composites.Composite(0.1, dense=relprop.rules.ZPlus()),
                                                False),
}
TOP_EDGES = 12


def algorithms(epochs: int, pg_epochs: int) -> dict[str, Callable[[], Any]]:
    """Each method's ExplainerAlgorithm, made fresh."""
    made: dict[str, Callable[[], Any]] = {
        name: (lambda composite=composite, magnitude=magnitude: LRPExplainer(composite, magnitude=magnitude))
        for name, (composite, magnitude) in PRESETS.items()}
    made["gradient magnitude (Saliency)"] = lambda: CaptumExplainer("Saliency")
    made["Integrated Gradients"] = lambda: CaptumExplainer("IntegratedGradients")
    made[f"GNNExplainer ({epochs} epochs)"] = lambda: GNNExplainer(epochs=epochs)
    made[f"PGExplainer ({pg_epochs} epochs)"] = lambda: PGExplainer(epochs=pg_epochs, lr=0.003)
    return made


def auroc(mask: Tensor, truth: Tensor) -> float | None:
    """AUROC of ``mask`` against the binary ``truth``, None where ``truth`` has one class only."""
    if truth.all() or not truth.any():
        return None
    return float(groundtruth_metrics(mask.float(), truth.float(), "auroc"))


def explainer_for(algorithm: Any, model: nn.Module, level: str) -> Explainer:
    phenomenon = isinstance(algorithm, PGExplainer)
    return Explainer(model, algorithm, explanation_type="phenomenon" if phenomenon else "model",
                     node_mask_type=None, edge_mask_type="object",
                     model_config=dict(mode="multiclass_classification", task_level=level, return_type="raw"))


@dataclass
class Item:
    """One explained output: its graph, its index in the output, the ground truth, the edges scored."""

    x: Tensor
    edge_index: Tensor
    index: int
    target: Tensor
    truth: Tensor
    within: Tensor
    motif: set[int]
    keywords: dict[str, Tensor] = field(default_factory=dict)


def scores(explainer: Explainer, explanation: Explanation, item: Item) -> dict[str, Any]:
    """AUROC on the item's edges (directed, and undirected), fidelities of the top edges."""
    hard = explanation.threshold(dict(threshold_type="topk_hard", value=TOP_EDGES))  # type: ignore[arg-type]
    plus, minus = fidelity(explainer, hard)
    both = undirected(item.edge_index, explanation.edge_mask)
    return {"auroc": auroc(explanation.edge_mask[item.within], item.truth[item.within]),
            "undirected": auroc(both[item.within], item.truth[item.within]), "fid+": plus, "fid-": minus}


def run_nodes(kind: str, explained: int, epochs: tuple[int, int], seed: int) -> tuple[dict[str, dict[str, Any]], str]:
    """Node classification on BA-Shapes with a GCN, or a GAT (which needs the degree as a feature: attention
    averages, and constant features would give every node the same embedding)."""
    data = ba_shapes(seed, degree=kind == "gat")
    model = NodeClassifier(data.num_features, 4, kind=kind)
    accuracy = train_nodes(model, data, epochs=1000)
    with torch.no_grad():
        predicted = model(data.x, data.edge_index).argmax(-1)
    chosen = ((data.y > 0) & data.test_mask & (predicted == data.y)).nonzero().flatten()[:explained]
    motif = set(data.node_mask.nonzero().flatten().tolist())
    items = [Item(data.x, data.edge_index, node, data.y, data.edge_mask,
                  k_hop_subgraph(node, 3, data.edge_index, num_nodes=data.num_nodes)[3], motif)
             for node in chosen.tolist()]
    note = f"{kind.upper()} test accuracy {accuracy:.3f}, {len(chosen)} motif nodes explained"
    return evaluate(model, "node", items, epochs), note


def run_graphs(explained: int, epochs: tuple[int, int], seed: int) -> tuple[dict[str, dict[str, Any]], str]:
    """Graph classification on BA graphs with a house or a cycle, with GIN and sum pooling."""
    graphs = ba_motifs(seed)
    model = GraphClassifier(graphs[0].num_features, 2)
    accuracy = train_graphs(model, graphs)
    test = graphs[int(0.8 * len(graphs)):][:explained]
    items = [Item(graph.x, graph.edge_index, 0, graph.y, graph.edge_mask,
                  torch.ones(graph.edge_index.shape[1], dtype=torch.bool),
                  set(graph.node_mask.nonzero().flatten().tolist()),
                  {"batch": torch.zeros(graph.num_nodes, dtype=torch.long)}) for graph in test]
    note = f"GIN test accuracy {accuracy:.3f}, {len(test)} test graphs explained"
    return evaluate(model, "graph", items, epochs), note


def evaluate(model: nn.Module, level: str, items: list[Item], epochs: tuple[int, int]) -> dict[str, dict[str, list]]:
    """Every method on every item: AUROC, fidelities, time; the walks' share in the motif."""
    results: dict[str, dict[str, list]] = {}
    for name, make in algorithms(*epochs).items():
        explainer = explainer_for(make(), model, level)
        row = results.setdefault(name, {"time": []})
        if isinstance(explainer.algorithm, PGExplainer):  # trained on the explained items, as PyG's example does
            start = time.perf_counter()
            for epoch in range(epochs[1]):
                for item in items:
                    explainer.algorithm.train(epoch, model, item.x, item.edge_index, target=item.target,
                                              index=item.index, **item.keywords)
            row["training"] = [time.perf_counter() - start]
        for item in items:
            extra = {"target": item.target} if explainer.explanation_type.value == "phenomenon" else {}
            start = time.perf_counter()
            explanation = explainer(item.x, item.edge_index, index=item.index, **extra, **item.keywords)
            row["time"].append(time.perf_counter() - start)
            for key, value in scores(explainer, explanation, item).items():
                row.setdefault(key, []).append(value)
        _forget_mask_parameters(model)
    for item in items:  # the walks, ranked by value and by magnitude
        with torch.no_grad():
            predicted = int(model(item.x, item.edge_index, **item.keywords)[item.index].argmax())
        for absolute in (False, True):
            start = time.perf_counter()
            walks, _ = top_walks(relprop.LRP(model, "epsilon"), item.x, item.edge_index, (item.index, predicted), k=5,
                                 beam=8, absolute=absolute, additional_forward_args=item.keywords or None)
            row = results.setdefault(f"relprop top 5 walks (epsilon, beam 8{', by magnitude' if absolute else ''})",
                                     {"time": []})
            row["time"].append(time.perf_counter() - start)
            inside = sum(set(walk.tolist()) <= item.motif for walk in walks) / max(len(walks), 1)
            row.setdefault("walks in motif", []).append(inside)
    return results


def _forget_mask_parameters(model: nn.Module) -> None:
    """Undo what GNNExplainer and PGExplainer leave behind: their edge mask registered as a parameter of each
    message-passing layer. PyG's ``clear_masks`` sets it to None but keeps the registration, and ``set_masks``
    then wraps any later mask into a new ``Parameter``, which is not the tensor captum differentiates: captum's
    methods with ``edge_mask_type="object"`` fail on the model from then on ("The differentiated Tensor ...
    appears to not have been used in the graph")."""
    for module in model.modules():
        module._parameters.pop("_edge_mask", None)


def table(results: dict[str, dict[str, list]]) -> str:
    lines = ["| method | edge AUROC | undirected | fidelity+ | fidelity- | characterization | top walks in motif "
             "| s per explanation |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, row in results.items():
        def mean(key: str) -> float | None:
            values = [v for v in row.get(key, []) if v is not None]
            return sum(values) / len(values) if values else None
        plus, minus = mean("fid+"), mean("fid-")
        character = (float(characterization_score(torch.tensor(plus), torch.tensor(minus)))
                     if plus and minus is not None and minus < 1 else None)
        cells = [mean("auroc"), mean("undirected"), plus, minus, character, mean("walks in motif")]
        text = ["" if value is None else f"{value:.3f}" for value in cells]
        seconds = f"{statistics.median(row['time']):.4f}" if row["time"] else ""
        if "training" in row:
            seconds += f" (+ {row['training'][0]:.1f} training)"
        lines.append(f"| {name} | " + " | ".join(text) + f" | {seconds} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--task", nargs="+", default=["ba-shapes", "ba-motifs", "ba-shapes-gat"])
    parser.add_argument("--explained", type=int, default=50)
    parser.add_argument("--epochs", type=int, default=100, help="GNNExplainer's epochs per explanation")
    parser.add_argument("--pg-epochs", type=int, default=30, help="PGExplainer's training epochs")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")  # captum's "did not already require gradients", PyG's deprecations
    for task in args.task:
        torch.manual_seed(args.seed)
        if task == "ba-motifs":
            results, note = run_graphs(args.explained, (args.epochs, args.pg_epochs), args.seed)
        else:
            results, note = run_nodes("gat" if task.endswith("gat") else "gcn", args.explained,
                                      (args.epochs, args.pg_epochs), args.seed)
        print(f"\n### {task}: {note}\n\n{table(results)}", flush=True)


if __name__ == "__main__":
    main()
