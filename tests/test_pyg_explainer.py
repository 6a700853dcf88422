"""relprop inside PyG's explainer framework: LRPExplainer through Explainer, PyG's metrics on its explanation."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("torch_geometric")
pytest.importorskip("torchmetrics")
from torch_geometric.explain import Explainer  # noqa: E402
from torch_geometric.explain.metric import characterization_score, fidelity, groundtruth_metrics  # noqa: E402
from torch_geometric.utils import k_hop_subgraph  # noqa: E402

import relprop  # noqa: E402
from relprop.integrations.pyg import LRPExplainer  # noqa: E402
from relprop.methods.graphs import edge_relevance  # noqa: E402
from relprop.viz.graphs import neighbourhood, save_graph_relevance  # noqa: E402
from relprop.workflows.graphs import GraphClassifier, NodeClassifier, ba_motifs, ba_shapes, train_nodes  # noqa: E402

CONFIG = dict(mode="multiclass_classification", task_level="node", return_type="raw")


@pytest.fixture(scope="module")
def small_ba_shapes():
    """A small BA-Shapes (60 BA nodes, 10 houses) and a GCN trained on it for a few seconds."""
    torch.manual_seed(0)
    data = ba_shapes(seed=0, nodes=60, motifs=10)
    model = NodeClassifier(data.num_features, 4, hidden=12)
    train_nodes(model, data, epochs=150)
    return data, model


def test_explainer_gives_relevance_and_pyg_metrics_read_it(small_ba_shapes):
    data, model = small_ba_shapes
    node = int(data.node_mask.nonzero()[0])
    explainer = Explainer(model, LRPExplainer("epsilon", walks=3), explanation_type="model",
                          node_mask_type="attributes", edge_mask_type="object", model_config=CONFIG)
    explanation = explainer(data.x, data.edge_index, index=node)
    predicted = int(model(data.x, data.edge_index)[node].argmax())
    found = edge_relevance(relprop.LRP(model, "epsilon"), data.x, data.edge_index, (node, predicted))
    torch.testing.assert_close(explanation.edge_mask, found.edges)
    torch.testing.assert_close(explanation.node_mask, found.features)
    assert explanation.walks.shape == (3, 4) and explanation.walk_relevance.shape == (3,)
    assert bool((explanation.walk_relevance[:-1] >= explanation.walk_relevance[1:]).all())

    _, _, _, within = k_hop_subgraph(node, 3, data.edge_index, num_nodes=data.num_nodes)
    auroc = groundtruth_metrics(explanation.edge_mask[within], data.edge_mask[within], "auroc")
    assert 0 <= auroc <= 1
    hard = explanation.threshold(dict(threshold_type="topk_hard", value=12))
    plus, minus = fidelity(explainer, hard)
    assert 0 <= plus <= 1 and 0 <= minus <= 1
    if plus > 0 and minus < 1:
        assert 0 < float(characterization_score(torch.tensor(plus), torch.tensor(minus))) <= 1


def test_magnitudes_and_node_mask_types(small_ba_shapes, tmp_path):
    data, model = small_ba_shapes
    node = int(data.node_mask.nonzero()[0])
    masks = {}
    for kind in ("object", "common_attributes"):
        explainer = Explainer(model, LRPExplainer("epsilon", magnitude=True), explanation_type="model",
                              node_mask_type=kind, edge_mask_type="object", model_config=CONFIG)
        masks[kind] = explainer(data.x, data.edge_index, index=node)
    assert masks["object"].node_mask.shape == (data.num_nodes, 1)
    assert masks["common_attributes"].node_mask.shape == (1, data.num_features)
    assert masks["object"].edge_mask.min() >= 0
    masks["object"].visualize_graph(str(tmp_path / "pyg.png"), backend="networkx")  # PyG's picture reads it
    assert (tmp_path / "pyg.png").stat().st_size > 1000
    with pytest.raises(ValueError, match="outside the model output"):
        masks["object"] = Explainer(model, LRPExplainer(), explanation_type="model", node_mask_type="object",
                                    edge_mask_type="object", model_config=CONFIG)(data.x, data.edge_index,
                                                                                   index=data.num_nodes)


def test_graph_level_explanation_and_picture(tmp_path):
    torch.manual_seed(0)
    graph = ba_motifs(seed=0, graphs=2, nodes=8)[0]
    model = GraphClassifier(graph.num_features, 2, hidden=8).eval()
    batch = torch.zeros(graph.num_nodes, dtype=torch.long)
    explainer = Explainer(model, LRPExplainer("epsilon"), explanation_type="model", node_mask_type="object",
                          edge_mask_type="object", model_config={**CONFIG, "task_level": "graph"})
    explanation = explainer(graph.x, graph.edge_index, batch=batch)
    output = model(graph.x, graph.edge_index, batch).detach()
    explained = output[0, output[0].argmax()]
    # the epsilon rule absorbs what the biases take: the relevance is at most of the output's order
    assert explanation.edge_mask.shape == (graph.edge_index.shape[1],)
    assert torch.isfinite(explanation.node_mask).all() and float(explained) != 0
    path = save_graph_relevance(tmp_path / "graph.png", [dict(
        edge_index=graph.edge_index, edge_relevance=explanation.edge_mask, walks=[[0, 1, 1, 2]],
        node_relevance=explanation.node_mask.flatten(), highlight=[0], title="graph")])
    assert path.stat().st_size > 1000
    assert neighbourhood(graph.edge_index, 0, 0) == [0]
