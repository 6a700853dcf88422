"""Rule assignment (priority, maps, first layer), presets by name, and user-built rules."""
import pytest
import torch
from torch import nn

import relprop
from relprop import rules
from relprop.composites import Composite
from conftest import ResidualNet, randomize_batch_norms


def net():
    """The same network (same weights) at every call."""
    torch.manual_seed(5)
    return randomize_batch_norms(ResidualNet()).double().eval()


X = torch.randn(2, 3, 16, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(3))


def attribute(model, composite):
    return relprop.LRP(model, composite).attribute(X, target=2)


def test_module_rule_beats_the_composite():
    model = net()
    baseline = attribute(model, "epsilon-plus")
    model.fc.rule = rules.Epsilon(0.5)
    changed = attribute(model, "epsilon-plus")
    assert not torch.allclose(changed, baseline)
    only_fc = Composite(conv=rules.ZPlus(), dense=rules.Epsilon(), name_map={"fc": rules.Epsilon(0.5)})
    assert torch.equal(changed, attribute(net(), only_fc))


def test_name_map_layer_map_and_first_layer():
    model = net()
    by_name = attribute(model, Composite(name_map={"conv_*": rules.ZPlus()}))
    model.conv_a.rule = rules.ZPlus()
    model.conv_b.rule = rules.ZPlus()
    assert torch.equal(by_name, attribute(model, Composite()))

    by_type = attribute(net(), Composite(layer_map={nn.Linear: rules.Epsilon(0.3)}))
    assert torch.equal(by_type, attribute(net(), Composite(dense=rules.Epsilon(0.3))))

    # the first layer (stem, fed by the input) gets Flat; later convolutions do not
    first = attribute(net(), Composite(first={"conv": rules.Flat()}))
    model = net()
    model.stem.rule = rules.Flat()
    assert torch.equal(first, attribute(model, Composite()))


def test_priority_order():
    """module.rule > name_map > first layer > layer_map > the preset's conv rule."""
    levels = {
        "own": rules.Epsilon(0.2), "name_map": rules.ZPlus(), "first": rules.Flat(), "layer_map": rules.AlphaBeta(),
    }
    composite = Composite(name_map=[("stem", levels["name_map"])], first={"conv": levels["first"]},
                          layer_map=[(nn.Conv2d, levels["layer_map"])], conv=rules.WSquare())
    model = net()
    model.stem.rule = levels["own"]
    for level in ("own", "name_map", "first", "layer_map"):
        reference = net()
        reference.stem.rule = levels[level]
        # the other convolutions are not first and match no name: the layer map gives them AlphaBeta
        assert torch.equal(attribute(model, composite), attribute(reference, Composite(conv=rules.AlphaBeta()))), level
        if level == "own":
            del model.stem.rule
        elif level == "name_map":
            composite.name_map = []
        elif level == "first":
            composite.first = {}
    composite.layer_map = []
    assert torch.equal(attribute(model, composite), attribute(net(), Composite(conv=rules.WSquare())))


def test_first_layer_is_found_through_routing_ops():
    class Padded(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1, self.conv2 = nn.Conv2d(3, 4, 3), nn.Conv2d(4, 2, 3)

        def forward(self, x):
            x = torch.nn.functional.pad(x.permute(0, 1, 3, 2), (1, 1, 1, 1))
            return self.conv2(torch.relu(self.conv1(x))).flatten(1)

    model = Padded().double().eval()
    flat_first = relprop.LRP(model, Composite(first={"conv": rules.Flat()})).attribute(X, target=0)
    model.conv1.rule = rules.Flat()
    assert torch.equal(flat_first, relprop.LRP(model).attribute(X, target=0))


def test_presets_by_name():
    for name in relprop.composites.PRESETS:
        kwargs = {"low": -4.0, "high": 4.0} if name == "epsilon-gamma-box" else {}
        by_name = relprop.LRP(net(), name if not kwargs else relprop.composites.get(name, **kwargs))
        assert isinstance(by_name.composite, relprop.composites.PRESETS[name])
    assert isinstance(relprop.composites.get("epsilon_plus_flat"), relprop.composites.EpsilonPlusFlat)
    assert isinstance(relprop.LRP(net()).composite, relprop.composites.Epsilon)


def test_user_rule_from_parts_reproduces_zplus():
    def positive(t):
        return t.clamp(min=0)

    def negative(t):
        return t.clamp(max=0)

    def mapper(relevance, outputs, z):
        return [relevance / rules.denominator(outputs[0] + outputs[1], 1e-6)] * 2

    own = rules.BasicRule([rules.Term(positive, positive), rules.Term(negative, negative, bias=False)], mapper)
    # the same numbers: ZPlus's fast form adds the products in another order (float64)
    torch.testing.assert_close(attribute(net(), Composite(conv=own)), attribute(net(), Composite(conv=rules.ZPlus())),
                               rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kernel, stride, padding", [(2, 2, 0), (3, 2, 1)])
def test_max_pool_propagated_like_average_pooling(kernel, stride, padding):
    x = torch.rand(2, 3, 8, 8, dtype=torch.float64)
    max_pool = nn.MaxPool2d(kernel, stride, padding).eval()
    avg_pool = nn.AvgPool2d(kernel, stride, padding, count_include_pad=True).eval()
    R = torch.rand_like(max_pool(x))
    winner = relprop.LRP(max_pool).attribute(x, target=R)
    max_pool.rule = rules.Proportional(epsilon=0.0)
    proportional = relprop.LRP(max_pool).attribute(x, target=R)
    expected = relprop.LRP(avg_pool, relprop.composites.Epsilon(0.0)).attribute(x, target=R)
    torch.testing.assert_close(proportional, expected, rtol=1e-12, atol=0)
    assert not torch.allclose(proportional, winner)
    torch.testing.assert_close(proportional.sum((1, 2, 3)), R.sum((1, 2, 3)), rtol=1e-12, atol=0)
    torch.testing.assert_close(winner.sum((1, 2, 3)), R.sum((1, 2, 3)), rtol=1e-12, atol=0)
