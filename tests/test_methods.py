"""The comparison methods against closed forms."""
import torch
from torch import nn

from relprop import methods


def linear_model():
    model = nn.Sequential(nn.Flatten(), nn.Linear(2 * 4 * 4, 3)).double().eval()
    return model


def test_gradient_and_gradient_x_input_on_a_linear_model():
    model, x = linear_model(), torch.randn(2, 2, 4, 4, dtype=torch.float64)
    weight = model[1].weight[1].detach().reshape(2, 4, 4)
    assert torch.equal(methods.Gradient(model).attribute(x, target=1), weight.expand_as(x))
    torch.testing.assert_close(methods.GradientXInput(model).attribute(x, target=1), weight * x)


def test_integrated_gradients_completeness():
    model = nn.Sequential(nn.Flatten(), nn.Linear(8, 6), nn.Tanh(), nn.Linear(6, 2)).double().eval()
    x = torch.randn(3, 2, 4, dtype=torch.float64)
    attribution = methods.IntegratedGradients(model, steps=400, chunk_size=100).attribute(x, target=[0, 1, 0])
    out = model(x).detach()[torch.arange(3), [0, 1, 0]]
    zero = model(torch.zeros_like(x)).detach()[torch.arange(3), [0, 1, 0]]
    torch.testing.assert_close(attribution.sum((1, 2)), out - zero, rtol=1e-4, atol=1e-6)


def test_smoothgrad_without_noise_is_the_gradient():
    model = nn.Sequential(nn.Flatten(), nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2)).double().eval()
    x = torch.randn(2, 2, 4, dtype=torch.float64)
    smooth = methods.SmoothGrad(model, samples=5, noise=0.0).attribute(x, target=1)
    torch.testing.assert_close(smooth, methods.Gradient(model).attribute(x, target=1))


def test_occlusion_of_single_pixels_on_a_linear_model():
    model, x = linear_model(), torch.randn(2, 2, 4, 4, dtype=torch.float64)
    weight = model[1].weight[2].detach().reshape(2, 4, 4)
    drop = methods.Occlusion(model, window=1, stride=1).attribute(x, target=2)
    expected = (weight * x).sum(1, keepdim=True).expand_as(x) / 2  # the drop of a pixel, shared by its channels
    torch.testing.assert_close(drop, expected)
