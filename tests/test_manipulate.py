"""Attacks on heatmaps (relprop.workflows.manipulate): the attack, beta-smoothing, the errors; float64."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import relprop
from relprop.workflows.manipulate import GRADIENT_X_INPUT, beta_smoothed, explain, heatmap, manipulate


def tiny(seed: int = 0) -> nn.Module:
    """A small ReLU CNN on 1 x 4 x 4 inputs, float64."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(48, 8), nn.ReLU(),
                         nn.Linear(8, 3)).double().eval()


def inputs(count: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.rand(count, 1, 4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def same(model: nn.Module, before: nn.Module) -> bool:
    """Whether ``model`` has the modules, parameters and modes of ``before`` (a deep copy taken earlier)."""
    kinds = [type(m) for m in model.modules()] == [type(m) for m in before.modules()]
    values = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), before.state_dict().values()))
    flags = [p.requires_grad for p in model.parameters()] == [p.requires_grad for p in before.parameters()]
    return kinds and values and flags and model.training == before.training


def test_beta_smoothed_is_softplus_in_closed_form_on_a_copy():
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).double()
    before = copy.deepcopy(model)
    smoothed = beta_smoothed(model, beta=2.5)
    x = torch.randn(5, 3, dtype=torch.float64)
    first, last = model[0], model[2]
    z = x @ first.weight.T + first.bias
    expected = torch.log1p(torch.exp(2.5 * z)) / 2.5 @ last.weight.T + last.bias
    torch.testing.assert_close(smoothed(x), expected, rtol=1e-12, atol=1e-12)
    assert same(model, before) and isinstance(model[1], nn.ReLU)
    assert smoothed[0] is not model[0]  # its own parameters: training the copy leaves the model alone
    assert all(module.training for module in smoothed.modules())  # the mode of the model
    assert not any(module.training for module in beta_smoothed(model.eval(), beta=2.5).modules())


class Uncopyable(nn.Module):
    def __deepcopy__(self, memo: dict) -> None:
        raise RuntimeError("no copies")


def test_the_users_model_is_untouched_when_an_exception_flies():
    model = nn.Sequential(nn.Linear(16, 3), nn.ReLU()).double().eval()
    before = copy.deepcopy(model)
    with pytest.raises(RuntimeError, match="no copies"):
        beta_smoothed(nn.Sequential(model, Uncopyable()), beta=5.0)
    assert same(model, before)

    def broken(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("broken forward")

    class Breaks(nn.Sequential):
        pass

    failing = Breaks(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3)).double().eval()
    saved = copy.deepcopy(failing)
    smoothed = beta_smoothed(failing, beta=5.0)
    smoothed.forward = broken.__get__(smoothed)  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="broken forward"):
        smoothed(torch.zeros(1, 16, dtype=torch.float64))
    assert same(failing, saved)


def test_the_attack_moves_the_heatmap_and_keeps_the_output():
    model, x = tiny(), inputs()
    before = copy.deepcopy(model)
    target_map = torch.rand(2, 4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    found = manipulate(model, GRADIENT_X_INPUT, x, target_map, steps=150, lr=2e-2, output_bound=0.02)
    assert (found.heatmap_mse() < 0.5 * found.heatmap_mse(adversarial=False)).all()
    assert (found.heatmap_cosine() > found.heatmap_cosine(adversarial=False)).all()
    assert (found.output_change <= 0.02).all()
    assert found.x_adv.min() >= 0 and found.x_adv.max() <= 1
    assert same(model, before)
    # what the result says is what the model says
    torch.testing.assert_close(found.heatmap_adv, heatmap(explain(model, GRADIENT_X_INPUT, found.x_adv,
                                                                   found.target)))
    torch.testing.assert_close(found.logits_adv, model(found.x_adv))
    history = found.history["heatmap_mse"]
    assert history.shape == (151, 2)
    torch.testing.assert_close(history[0], found.heatmap_mse(adversarial=False))
    assert ((history - found.heatmap_mse()).abs().min(0).values < 1e-12).all()  # x_adv is one of the iterates


def test_the_attack_through_a_smoothed_copy():
    """The paper's attack on a ReLU network: differentiated through softplus(beta), measured on the network."""
    model, x = tiny(), inputs()
    before = copy.deepcopy(model)
    target_map = torch.rand(2, 4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    found = manipulate(model, GRADIENT_X_INPUT, x, target_map, steps=100, lr=2e-2, beta=20.0, output_bound=0.02)
    assert (found.heatmap_mse() < 0.75 * found.heatmap_mse(adversarial=False)).all()
    assert (found.output_change <= 0.02).all()
    assert same(model, before) and all(isinstance(model[i], nn.ReLU) for i in (1, 4))


def test_max_change_bounds_the_input_change():
    model, x = tiny(), inputs()
    found = manipulate(model, GRADIENT_X_INPUT, x, torch.ones(4, 4, dtype=torch.float64), steps=30, lr=0.1,
                       max_change=0.05, output_bound=1.0)
    assert found.input_change["linf"].max() <= 0.05 + 1e-12
    assert (found.input_change["linf"] > 0).all()


def test_gradient_x_input_and_heatmap_in_closed_form():
    linear = nn.Linear(16, 3).double()
    model = nn.Sequential(nn.Flatten(), linear)
    x = inputs(2)
    relevance = explain(model, "gradient_x_input", x, torch.tensor([2, 0]))
    expected = torch.stack([linear.weight[2], linear.weight[0]]).reshape(2, 1, 4, 4) * x
    torch.testing.assert_close(relevance, expected)
    scaled = heatmap(relevance)
    torch.testing.assert_close(scaled.abs().flatten(1).mean(1), torch.ones(2, dtype=torch.float64))
    torch.testing.assert_close(scaled, expected.sum(1) / expected.abs().flatten(1).mean(1)[:, None, None])


def test_lrp_heatmaps_are_the_lrp_relevance():
    model, x = tiny(), inputs()
    found = manipulate(model, "epsilon", x, torch.ones(4, 4, dtype=torch.float64), steps=0)
    expected = relprop.LRP(model, "epsilon").attribute(x, target=model(x).argmax(1))
    torch.testing.assert_close(found.heatmap, heatmap(expected))
    assert torch.equal(found.x_adv, x)


def test_the_attack_under_an_lrp_preset():
    model, x = tiny(), inputs()
    target_map = torch.rand(2, 4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    found = manipulate(model, "epsilon", x, target_map, steps=40, lr=2e-2, beta=20.0, output_bound=0.05)
    assert (found.heatmap_mse() < found.heatmap_mse(adversarial=False)).all()
    assert (found.output_change <= 0.05).all()


@pytest.mark.parametrize("target_map, message", [
    (torch.ones(5, 5), "does not fit"),
    (torch.ones(3, 4, 4), "does not fit"),
    (torch.zeros(4, 4), "zero everywhere"),
])
def test_target_map_errors(target_map, message):
    with pytest.raises(ValueError, match=f"^relprop: .*{message}"):
        manipulate(tiny(), GRADIENT_X_INPUT, inputs(), target_map.double(), steps=1)


def test_argument_errors():
    model, x, target_map = tiny(), inputs(), torch.ones(4, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="^relprop: steps"):
        manipulate(model, GRADIENT_X_INPUT, x, target_map, steps=-1)
    with pytest.raises(ValueError, match="^relprop: max_change"):
        manipulate(model, GRADIENT_X_INPUT, x, target_map, max_change=0.0)
    with pytest.raises(TypeError, match="^relprop: composite"):
        manipulate(model, 3, x, target_map)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="^relprop: beta-smoothing needs a positive beta"):
        manipulate(model, GRADIENT_X_INPUT, x, target_map, beta=0.0)
    with pytest.raises(ValueError, match="^relprop: Sequential has no nn.ReLU"):
        beta_smoothed(nn.Sequential(nn.Linear(2, 2), nn.Tanh()), beta=1.0)
    with pytest.raises(ValueError, match="^relprop: manipulate needs inputs"):
        manipulate(model, GRADIENT_X_INPUT, torch.ones(4, dtype=torch.float64), target_map)
