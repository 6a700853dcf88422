"""Circuits scored as MIB scores them (relprop.workflows.circuits): CPR and CMD against a hand computation, the
circuit chosen across kinds, and F(k) against a circuit patched by hand with hooks, float64."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import relprop
from relprop.workflows.circuits import BUDGETS, areas, circuit, faithfulness

transformers = pytest.importorskip("transformers")

ANSWER, FOIL = 3, 5


def test_cpr_and_cmd_are_the_trapezoid_areas_of_a_small_curve():
    # by hand: widths 0.09, 0.4, 0.5; CPR = 0.09 (0.2 - 0.1) / 2 + 0.4 (-0.1 + 0.9) / 2 + 0.5 (0.9 + 1.3) / 2
    # = 0.0045 + 0.16 + 0.55; CMD = 0.09 (0.8 + 1.1) / 2 + 0.4 (1.1 + 0.1) / 2 + 0.5 (0.1 + 0.3) / 2
    cpr, cmd = areas([0.01, 0.1, 0.5, 1.0], [0.2, -0.1, 0.9, 1.3])
    assert cpr == pytest.approx(0.7145, abs=1e-15) and cmd == pytest.approx(0.4255, abs=1e-15)
    assert areas([0.0, 1.0], [1.0, 1.0]) == (1.0, 0.0)  # the whole model at every size
    with pytest.raises(ValueError, match="must not decrease"):
        areas([0.5, 0.1], [0.0, 1.0])


def test_a_circuit_takes_the_top_units_over_all_kinds():
    scores = {"heads": torch.tensor([[0.5, -3.0], [0.1, 2.0]]), "mlps": torch.tensor([-1.0, 4.0])}
    masks = circuit(scores, 3)
    assert masks["heads"].tolist() == [[False, True], [False, True]] and masks["mlps"].tolist() == [False, True]
    signed = circuit(scores, 3, absolute=False)
    assert signed["heads"].tolist() == [[True, False], [False, True]] and signed["mlps"].tolist() == [False, True]
    assert not circuit(scores, 0)["mlps"].any() and circuit(scores, 6)["heads"].all()


def tiny_llama() -> nn.Module:
    config = transformers.LlamaConfig(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=32)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval().double()


def metric(model, ids):
    logits = model(ids).logits[:, -1]
    return logits[:, ANSWER] - logits[:, FOIL]


def patched_by_hand(model, clean, corrupted, heads, mlps):
    """The mean metric of the corrupted run with the heads ``heads[layer, head]`` and MLPs ``mlps[layer]`` clean."""
    kept = {}
    layers = model.model.layers
    handles = [layer.self_attn.o_proj.register_forward_pre_hook(
        lambda _, args, i=i: kept.__setitem__(("heads", i), args[0].detach().clone())) for i, layer in
        enumerate(layers)] + [layer.mlp.register_forward_hook(
            lambda _, args, out, i=i: kept.__setitem__(("mlps", i), out.detach().clone())) for i, layer in
        enumerate(layers)]
    with torch.no_grad():
        metric(model, clean)
    for handle in handles:
        handle.remove()

    def head_patch(i):
        def hook(_, args):
            x = args[0].clone().view(*args[0].shape[:2], 4, 4)
            x[:, :, heads[i]] = kept[("heads", i)].view_as(x)[:, :, heads[i]]
            return (x.view_as(args[0]),)
        return hook

    handles = [layer.self_attn.o_proj.register_forward_pre_hook(head_patch(i)) for i, layer in enumerate(layers)]
    handles += [layer.mlp.register_forward_hook(lambda _, args, out, i=i: kept[("mlps", i)] if mlps[i] else out)
                for i, layer in enumerate(layers)]
    try:
        with torch.no_grad():
            return metric(model, corrupted).mean()
    finally:
        for handle in handles:
            handle.remove()


def test_the_faithfulness_curve_patches_the_circuit_of_each_budget():
    model = tiny_llama()
    generator = torch.Generator().manual_seed(1)
    clean = torch.randint(0, 40, (2, 6), generator=generator)
    corrupted = clean.clone()
    corrupted[:, 1] = (corrupted[:, 1] + 7) % 40
    scores = relprop.patching(model, clean, corrupted, (ANSWER, FOIL), components=("heads", "mlps"),
                              method="attribution")
    budgets = (0.0, 0.1, 0.3, 0.5, 1.0)
    found = faithfulness(model, clean, corrupted, (ANSWER, FOIL), scores, budgets)
    assert found.units == 10 and found.sizes == (0, 1, 3, 5, 10) and found.budgets == budgets
    with torch.no_grad():
        m_clean, m_corrupted = metric(model, clean).mean(), metric(model, corrupted).mean()
    summed = {name: value.sum(0) for name, value in scores.items()}
    for size, value in zip(found.sizes, found.curve):
        masks = circuit(summed, size)
        expected = (patched_by_hand(model, clean, corrupted, masks["heads"], masks["mlps"]) - m_corrupted) / (
            m_clean - m_corrupted)
        assert float(value) == pytest.approx(float(expected), rel=1e-9, abs=1e-12)
    # every head and MLP clean: only the embeddings at the changed position stay corrupted, which the last
    # position reads through attention alone
    assert float(found.curve[0]) == 0.0 and float(found.curve[-1]) == pytest.approx(1.0, abs=1e-9)
    assert (found.cpr, found.cmd) == areas([s / 10 for s in found.sizes], found.curve)
    assert BUDGETS == (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
    with pytest.raises(ValueError, match="scores of shape"):
        faithfulness(model, clean, corrupted, (ANSWER, FOIL), {"heads": scores["mlps"]})


def test_the_curves_are_drawn(tmp_path):
    from relprop.viz.circuits import save_faithfulness_curves
    from relprop.workflows.circuits import Faithfulness

    curve = Faithfulness((0.0, 0.5, 1.0), (0, 5, 10), 10, torch.tensor([0.0, 0.7, 1.0]), 0.6, 0.4)
    path = save_faithfulness_curves({"activation": curve, "random": curve}, tmp_path / "curve.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="no faithfulness curves"):
        save_faithfulness_curves({}, tmp_path / "none.png")
