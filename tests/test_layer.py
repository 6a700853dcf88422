"""Relevance inside the model: layers, all modules, concepts, and the audit."""
import pytest
import torch
import torchvision
from torch import nn

import relprop
from conftest import randomize_batch_norms, seed_of, zero_biases


def small_cnn():
    torch.manual_seed(2)
    model = nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(inplace=True), nn.MaxPool2d(2),
        nn.Conv2d(6, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 4 * 4, 5),
    )
    return randomize_batch_norms(model).double().eval()


X = torch.randn(2, 3, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(4))


@pytest.mark.parametrize("preset", ["epsilon", "epsilon-plus-flat"])
def test_output_of_a_layer_equals_input_of_the_next(preset):
    model = small_cnn()
    outputs = relprop.LayerLRP(model, [model[1], model[2], model[3]], preset).attribute(X, target=1)
    inputs = relprop.LayerLRP(model, [model[2], model[3], model[4]], preset).attribute(
        X, target=1, attribute_to_layer_input=True)
    for out, nxt in zip(outputs, inputs):  # batch norm -> in-place ReLU -> max pool -> conv
        assert torch.equal(out, nxt)
    # the conv merged with its BatchNorm: its relevance is the pair's, at the BatchNorm output
    assert torch.equal(relprop.LayerLRP(model, "0", preset).attribute(X, target=1), outputs[0])


def test_layer_relevance_is_the_gradient_times_activation_for_lrp0():
    model = small_cnn()
    hidden = model[:6](X).detach().requires_grad_()
    out = model[6:](hidden)
    (grad,) = torch.autograd.grad(seed_of(out, [1, 1]).sum(), hidden)
    layer = relprop.LayerLRP(model, model[5], relprop.composites.Epsilon(0.0)).attribute(X, target=1)
    torch.testing.assert_close(layer, grad * hidden, rtol=1e-12, atol=1e-14)


def test_convergence_delta_and_channel_ranking():
    model = zero_biases(small_cnn())
    layer = relprop.LayerLRP(model, "4", relprop.composites.Epsilon(0.0))
    relevance, delta = layer.attribute(X, target=[0, 3], return_convergence_delta=True)
    assert delta.abs().max() < 1e-12
    channels = layer.channel_relevance(X, target=[0, 3])
    assert channels.shape == (2, 8)
    torch.testing.assert_close(channels, relevance.sum((2, 3)))


def test_layer_delta_is_what_the_layers_above_absorbed():
    """With biases, the delta at a layer is the output minus the layer's total, as compute_convergence_delta says."""
    model = small_cnn()
    layer = relprop.LayerLRP(model, "4", "epsilon")
    relevance, delta = layer.attribute(X, target=[0, 3], return_convergence_delta=True)
    output = seed_of(model(X), [0, 3]).detach()
    torch.testing.assert_close(delta, output - relevance.sum((1, 2, 3)), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(layer.compute_convergence_delta(relevance, output), delta, rtol=0, atol=0)
    assert delta.abs().min() > 1e-6  # the dense layer's bias took its share


class Twice(nn.Module):
    """A module called twice, and one with a tuple output."""

    def __init__(self):
        super().__init__()
        self.shared = nn.Linear(4, 4)
        self.split = Split()
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        a, b = self.split(torch.relu(self.shared(torch.relu(self.shared(x)))))
        return self.head(torch.cat([a, b], 1))


class Split(nn.Module):
    def forward(self, x):
        return x[:, :2], x[:, 2:]


def test_module_called_twice_and_tuple_output():
    model = Twice().double().eval()
    x = torch.randn(3, 4, dtype=torch.float64)
    first, second = relprop.LayerLRP(model, "shared", relprop.composites.Epsilon(0.0)).attribute(x, target=0)
    assert first.shape == second.shape == (3, 4)
    a, b = relprop.LayerLRP(model, "split", relprop.composites.Epsilon(0.0)).attribute(x, target=0)
    assert a.shape == b.shape == (3, 2)
    head_input = relprop.LayerLRP(model, "head", relprop.composites.Epsilon(0.0)).attribute(
        x, target=0, attribute_to_layer_input=True)
    torch.testing.assert_close(torch.cat([a, b], 1), head_input, rtol=0, atol=0)


def test_bad_layers():
    model = small_cnn()
    with pytest.raises(ValueError, match="no module named 'nope'"):
        relprop.LayerLRP(model, "nope")
    with pytest.raises(ValueError, match="not a module of the model"):
        relprop.LayerLRP(model, nn.Linear(2, 2))


def resnet18():
    torch.manual_seed(0)
    return zero_biases(randomize_batch_norms(torchvision.models.resnet18(num_classes=10))).double().eval()


def densenet121():
    torch.manual_seed(0)
    return zero_biases(randomize_batch_norms(torchvision.models.densenet121(num_classes=10))).double().eval()


@pytest.mark.parametrize("make, layers", [
    (resnet18, ["conv1", "bn1", "relu", "maxpool", "layer1", "layer2", "layer3", "layer4", "avgpool", "fc"]),
    (densenet121, ["features.conv0", "features.pool0", "features.denseblock1", "features.transition1",
                   "features.denseblock2", "features.transition2", "features.denseblock3", "features.transition3",
                   "features.denseblock4", "features.norm5", "classifier"]),
])
@pytest.mark.parametrize("preset", ["epsilon", "epsilon-plus", "epsilon-alpha2-beta1"])
def test_every_layer_holds_the_same_total(make, layers, preset):
    model = make()
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    composite = relprop.composites.get(preset, epsilon=1e-10)
    per_layer = relprop.module_relevance(model, x, target=[2, 5], composite=composite, modules=layers,
                                         reduce=lambda r: r.flatten(1).sum(1))
    assert list(per_layer) == layers
    expected = seed_of(model(x), [2, 5]).detach()
    torch.testing.assert_close(per_layer.input[0].flatten(1).sum(1), expected, rtol=1e-6, atol=0)
    for name in layers:
        torch.testing.assert_close(per_layer[name], expected, rtol=1e-6, atol=0, msg=name)


def test_module_relevance_stores_only_what_was_asked():
    model = small_cnn()
    everything = relprop.module_relevance(model, X, target=1)
    assert set(everything) == {str(i) for i in range(8)}
    only = relprop.module_relevance(model, X, target=1, modules=["4", "7"], reduce=lambda r: r.sum())
    assert set(only) == {"4", "7"} and only["4"].dim() == 0
    torch.testing.assert_close(only["4"], everything["4"].sum())


def test_concepts_on_a_cut_layer_add_up_to_the_heatmap():
    model = resnet18()
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    layer = relprop.LayerLRP(model, "layer3", "epsilon-plus")
    channels = list(range(256))
    concepts = layer.attribute_concepts(x, [channels, channels[:100], channels[100:], [3, 17]], target=[1, 4])
    assert concepts.shape == (4, 2, 3, 32, 32)
    plain = relprop.LRP(model, "epsilon-plus").attribute(x, target=[1, 4])
    torch.testing.assert_close(concepts[0], plain, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(concepts[1] + concepts[2], plain, rtol=1e-9, atol=1e-12)
    # channels 3 and 17 alone carry what sits in them at the layer (exactly, with LRP-0 and zero biases)
    lrp0 = relprop.LayerLRP(model, "layer3", relprop.composites.Epsilon(0.0))
    through = lrp0.attribute_concepts(x, [[3, 17]], target=[1, 4])[0]
    at_layer = lrp0.channel_relevance(x, target=[1, 4])
    torch.testing.assert_close(through.flatten(1).sum(1), at_layer[:, [3, 17]].sum(1), rtol=1e-9, atol=1e-14)
    assert not torch.allclose(concepts[3], torch.zeros_like(concepts[3]))


def test_audit_accounts_for_all_relevance_and_lists_ops_without_rule():
    class Custom(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)
            self.fc = nn.Linear(4, 3)

        def forward(self, x):
            h = torch.relu(self.conv(x)).mean((2, 3))
            return self.fc(torch.cumprod(h, dim=1))  # cumprod has no rule

    model = Custom().double().eval()
    report = relprop.audit(model, X, target=1)
    assert report.absorbed_total == pytest.approx(report.seed_total - report.input_total, rel=1e-9, abs=1e-12)
    assert [(row.module, row.op) for row in report.unhandled] == [("<root>", "torch.cumprod")]
    rules = {row.op: row.rule for row in report.rows}
    assert rules["torch.nn.functional.conv2d"].startswith("Epsilon")
    assert rules["torch.nn.functional.linear"].startswith("Epsilon")
    text = str(report)
    assert "torch.cumprod" in text and "ops without a rule: 1" in text
    # with zero biases and epsilon 0 on a model fully covered, nothing is absorbed
    covered = relprop.audit(zero_biases(small_cnn()), X, target=1, composite=relprop.composites.Epsilon(0.0))
    assert not covered.unhandled and abs(covered.absorbed_total) < 1e-12
    assert all(abs(row.absorbed) < 1e-12 for row in covered.rows)
