"""The comparison methods against closed forms."""
import pytest
import torch
from torch import nn

from relprop import methods


def linear_model():
    model = nn.Sequential(nn.Flatten(), nn.Linear(2 * 4 * 4, 3)).double().eval()
    return model


def test_gradient_and_gradient_x_input_on_a_linear_model():
    model, x = linear_model(), torch.randn(2, 2, 4, 4, dtype=torch.float64)
    weight = model[1].weight[1].detach().reshape(2, 4, 4)
    assert torch.equal(methods.InputGradient(model).attribute(x, target=1), weight.expand_as(x))
    torch.testing.assert_close(methods.GradientXInput(model).attribute(x, target=1), weight * x)


def test_integrated_gradients_completeness():
    model = nn.Sequential(nn.Flatten(), nn.Linear(8, 6), nn.Tanh(), nn.Linear(6, 2)).double().eval()
    x = torch.randn(3, 2, 4, dtype=torch.float64)
    attribution, delta = methods.IntegratedGradients(model).attribute(
        x, target=[0, 1, 0], n_steps=400, method="riemann_middle", internal_batch_size=100,
        return_convergence_delta=True)
    out = model(x).detach()[torch.arange(3), [0, 1, 0]]
    zero = model(torch.zeros_like(x)).detach()[torch.arange(3), [0, 1, 0]]
    torch.testing.assert_close(attribution.sum((1, 2)), out - zero, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(delta, attribution.sum((1, 2)) - (out - zero), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("method, tolerance", [("gausslegendre", 1e-12), ("riemann_trapezoid", 1e-5),
                                               ("riemann_left", 0.5), ("riemann_right", 0.5)])
def test_integrated_gradients_rules_integrate_a_quadratic(method, tolerance):
    """f(x) = sum(x**2): the exact attribution from a zero baseline is x**2; each rule's error as its order says."""
    model = Quadratic()
    x = torch.tensor([[1.0, -2.0, 0.5]], dtype=torch.float64)
    attribution = methods.IntegratedGradients(model).attribute(x, n_steps=20, method=method)
    error = (attribution - x ** 2).abs().max().item()
    assert error < tolerance * (x ** 2).max().item()
    if method.startswith("riemann_l") or method.startswith("riemann_r"):
        assert error > 1e-3  # first order rules: visibly off at 20 steps, by -/+ x**2 / 20
        torch.testing.assert_close(attribution, x ** 2 * (1 + (1 if method == "riemann_right" else -1) / 20))


class Quadratic(nn.Module):
    def forward(self, x):
        return (x ** 2).sum(1, keepdim=True)


def test_integrated_gradients_baselines_tuples_and_extra_arguments():
    """Two inputs, a baseline per input, a batch-first extra tensor repeated along the path."""
    class Bilinear(nn.Module):
        def forward(self, a, b, scale):
            return ((a * b).sum(1) * scale).unsqueeze(1)

    a, b = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    scale = torch.tensor([1.0, 2.0, -1.0], dtype=torch.float64)
    base_a = torch.full((1, 4), 0.5, dtype=torch.float64)
    ra, rb = methods.IntegratedGradients(Bilinear()).attribute((a, b), baselines=(base_a, 0.0), target=0,
                                                               additional_forward_args=(scale,), n_steps=8,
                                                               internal_batch_size=5)
    # along the straight path a*b is quadratic in alpha: Gauss-Legendre integrates it exactly
    expected_total = (a * b).sum(1) * scale - (base_a * 0.0).sum(1) * scale
    torch.testing.assert_close(ra.sum(1) + rb.sum(1), expected_total)
    # d/da of a*b along the path, times (a - base_a): mean of b(alpha) = b / 2
    torch.testing.assert_close(ra, (a - base_a) * b / 2 * scale[:, None])


def test_deprecated_names_warn_and_still_work():
    model, x = linear_model(), torch.randn(2, 2, 4, 4, dtype=torch.float64)
    with pytest.warns(DeprecationWarning, match="use methods.InputGradient"):
        old = methods.Gradient(model)
    assert torch.equal(old.attribute(x, target=1), methods.InputGradient(model).attribute(x, target=1))
    with pytest.warns(DeprecationWarning, match="n_steps="):
        legacy = methods.IntegratedGradients(model, steps=16)
    torch.testing.assert_close(legacy.attribute(x, target=1), methods.IntegratedGradients(model).attribute(
        x, target=1, n_steps=16, method="riemann_middle"), rtol=0, atol=0)


def test_smoothgrad_without_noise_is_the_gradient():
    model = nn.Sequential(nn.Flatten(), nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2)).double().eval()
    x = torch.randn(2, 2, 4, dtype=torch.float64)
    smooth = methods.SmoothGrad(model, samples=5, noise=0.0).attribute(x, target=1)
    torch.testing.assert_close(smooth, methods.InputGradient(model).attribute(x, target=1))


def test_occlusion_of_single_features_on_a_linear_model_is_gradient_times_input():
    model, x = linear_model(), torch.randn(2, 2, 4, 4, dtype=torch.float64)
    weight = model[1].weight[2].detach().reshape(2, 4, 4)
    drop = methods.Occlusion(model).attribute(x, sliding_window_shapes=(1, 1, 1), target=2)
    torch.testing.assert_close(drop, weight * x)


def test_occlusion_windows_share_their_drop_and_edges_are_cut():
    """A 3-wide window with stride 2 on 4 features: windows [0:3] and [2:4], the second cut at the edge."""
    model = nn.Sequential(nn.Linear(4, 1, bias=False)).double()
    with torch.no_grad():
        model[0].weight.copy_(torch.tensor([[1.0, 2.0, 3.0, 4.0]]))
    x = torch.ones(1, 4, dtype=torch.float64)
    drop = methods.Occlusion(model).attribute(x, sliding_window_shapes=(3,), strides=2, perturbations_per_eval=1)
    first, second = 1 + 2 + 3, 3 + 4  # the output drop of each window
    expected = torch.tensor([[first, first, (first + second) / 2, second]], dtype=torch.float64)
    torch.testing.assert_close(drop, expected)


def test_bad_method_arguments_raise_one_line_errors():
    model, x = linear_model(), torch.randn(2, 2, 4, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="unknown integration method 'simpson'"):
        methods.IntegratedGradients(model).attribute(x, target=0, method="simpson")
    with pytest.raises(ValueError, match="baseline of shape \\(3,\\) does not fit"):
        methods.IntegratedGradients(model).attribute(x, target=0, baselines=torch.zeros(3, dtype=torch.float64))
    with pytest.raises(TypeError, match="floating-point tensor"):
        methods.InputGradient(model).attribute(torch.zeros(2, 32, dtype=torch.long), target=0)
    with pytest.raises(ValueError, match="larger than the window .* leave features uncovered"):
        methods.Occlusion(model).attribute(x, sliding_window_shapes=(2, 1, 1), strides=(1, 2, 2), target=0)
    with pytest.raises(ValueError, match="must give a positive size for each of the 3 dimensions"):
        methods.Occlusion(model).attribute(x, sliding_window_shapes=(2, 2), target=0)
