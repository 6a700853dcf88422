"""EasyOCR's recognizer in the concept atlas: one score per word (ReadingScore) and reference words by brute force."""
import copy
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("easyocr")
pytest.importorskip("easyocr_en_models")
pytest.importorskip("safetensors")
sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
import ocr
import ocr_atlas

import relprop
from relprop.workflows.concepts import reference_samples

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning:torch.*", "ignore::DeprecationWarning")


class ToyRecognizer(nn.Module):
    """A recognizer's shape without biases: ReLU convolutions and max pooling, then one linear map per column."""

    def __init__(self, classes: int = 6, height: int = 8):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1, bias=False), nn.ReLU(), nn.MaxPool2d(2),
                                      nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.ReLU())
        self.columns = nn.Linear(4 * height // 2, classes, bias=False)

    def forward(self, x: torch.Tensor, text: None) -> torch.Tensor:
        maps = self.features(x)  # (batch, 4, height / 2, columns)
        return self.columns(maps.permute(0, 3, 1, 2).flatten(2))  # (batch, columns, classes), as easyocr's


@pytest.fixture(scope="module")
def toy():
    torch.manual_seed(0)
    model = ocr.ReadingScore(ToyRecognizer().double(), ["-", *"abcde"]).eval()
    x = torch.randn(3, 1, 8, 24, dtype=torch.float64)
    decoded = [ocr.decode(columns, model.alphabet) for columns in model.recognizer(x, None).detach()]
    assert all(0 < len(characters) < 12 for characters in decoded)  # characters and blanks on every example
    return model, x, decoded


def test_reading_score_is_the_summed_logit_of_the_decoded_characters(toy):
    model, x, decoded = toy
    logits = model.recognizer(x, None).detach()
    expected = torch.tensor([[sum(float(logits[i, c.column, c.label]) for c in characters)]
                             for i, characters in enumerate(decoded)], dtype=torch.float64)
    torch.testing.assert_close(model(x).detach(), expected, rtol=1e-12, atol=0)


def test_reading_score_lrp0_equals_gradient_times_input(toy):
    model, x, _ = toy
    relevance = relprop.LRP(model, relprop.composites.Epsilon(epsilon=0.0)).attribute(x, target=0)
    leaf = x.clone().requires_grad_()
    (gradient,) = torch.autograd.grad(model(leaf).sum(), leaf)
    error = (relevance - gradient * x).abs().max() / (gradient * x).abs().max()
    assert error < 1e-10, error


# (not alpha2-beta1: on this one-channel input some windows of the first convolution hold inputs of one sign only,
# where alpha-beta gives alpha times the relevance, with or without the wrapper)
@pytest.mark.parametrize("preset", ["epsilon", "epsilon-plus"])
def test_reading_score_relevance_is_conserved_without_biases(toy, preset):
    model, x, _ = toy
    lrp = relprop.LRP(model, relprop.composites.get(preset, epsilon=1e-9))
    relevance = lrp.attribute(x, target=0)
    torch.testing.assert_close(relevance.sum((1, 2, 3)), model(x).detach()[:, 0], rtol=1e-6, atol=0)


def test_nothing_read_is_a_zero_score_with_zero_relevance(toy):
    model, x, _ = toy
    blank = copy.deepcopy(model)
    with torch.no_grad():
        blank.recognizer.columns.weight[0] = 1e3 * blank.recognizer.columns.weight[1:].abs().sum(0)  # blank wins
    assert blank.read(x.abs()) == ["", "", ""]
    assert torch.equal(blank(x.abs()).detach(), torch.zeros(3, 1, dtype=torch.float64))
    assert torch.equal(relprop.LRP(blank, "epsilon").attribute(x.abs(), target=0), torch.zeros_like(x))


@pytest.fixture(scope="module")
def model():
    return ocr_atlas.load_model()


@pytest.fixture(scope="module")
def words():
    return ocr_atlas.RenderedWords()


def test_rendered_words_are_read(model, words):
    assert len(words) == len(ocr.WORDS) * len(ocr.FONT_FILES) == 472
    assert words.images.shape == (472, 1, 64, ocr_atlas.WIDTH)
    assert words.images.min() == -1 and words.images.max() == 1
    sample = list(range(0, 472, 9))
    read = model.read(words.images[sample])
    assert sum(text == words.texts[i] for text, i in zip(read, sample)) >= 0.95 * len(sample)  # measured: 467/472


@pytest.mark.slow  # 7 s on two busy shared cores
def test_reading_heatmap_is_the_sum_of_the_characters_heatmaps(model, words):
    index = ocr.WORDS.index("dog") * len(ocr.FONT_FILES) + 1  # a short word, so that float64 stays fast
    double = copy.deepcopy(model).double()
    x = words[index][None].double()
    characters = ocr.decode(ocr.recognizer_logits(double.recognizer, x)[0], double.alphabet)
    assert "".join(c.text for c in characters) == words.texts[index] and words.texts[index].lower() == "dog"
    each = ocr.explain_characters(double.recognizer, x, characters)
    whole = relprop.LRP(double, ocr.ocr_composite()).attribute(x, target=0)[0, 0]
    # measured on a nine-letter word: 4e-9 of the largest pixel (5e-4 in float32, where the epsilon rule's small
    # denominators amplify rounding)
    assert (whole - each.sum(0)).abs().max() < 1e-7 * whole.abs().max()


def brute_force(model: nn.Module, images: torch.Tensor, top_k: int) -> dict:
    """Each word alone, both layers: every channel's relevance (sum of its map) and activation (maximum of its
    map) with their positions, then each channel's words sorted by hand (ties: lower id first)."""
    explainer = relprop.LayerLRP(model, ocr_atlas.LAYERS, "epsilon-plus-flat")
    modules = [model.get_submodule(layer) for layer in ocr_atlas.LAYERS]
    found: dict = {(layer, mode): ([], []) for layer in ocr_atlas.LAYERS for mode in ("relevance", "activation")}
    seen: list[torch.Tensor] = []
    handles = [module.register_forward_hook(lambda _m, _i, output: seen.append(output.detach().clone()))
               for module in modules]
    try:
        for x in images:
            seen.clear()
            with torch.no_grad():
                model(x[None])
            activations = list(seen)
            maps = explainer.attribute(x[None], target=0)  # the reading score: one output
            for layer, relevance, activation in zip(ocr_atlas.LAYERS, maps, activations):
                flat = relevance[0].flatten(1)
                found[layer, "relevance"][0].append(flat.sum(1))
                found[layer, "relevance"][1].append(flat.argmax(1))
                maximum = activation[0].flatten(1).max(1)
                found[layer, "activation"][0].append(maximum.values)
                found[layer, "activation"][1].append(maximum.indices)
    finally:
        for handle in handles:
            handle.remove()
    ranked = {}
    for key, (values, positions) in found.items():
        values, positions = torch.stack(values).T, torch.stack(positions).T  # (channels, words)
        ids = torch.tensor([sorted(range(len(images)), key=lambda i: (-values[c, i].item(), i))[:top_k]
                            for c in range(len(values))])
        ranked[key] = ids, values.gather(1, ids), positions.gather(1, ids), values.sum(1)
    return ranked


@pytest.mark.slow
def test_reference_words_equal_a_brute_force_ranking(model, words):
    """16 of the rendered words (all 8 faces), both layers and modes: top-k ids, values, positions and totals."""
    double = copy.deepcopy(model).double()  # float64, so that batching changes no ranking
    images = words.images[::29].double()
    found = reference_samples(double, images, ocr_atlas.LAYERS, composite="epsilon-plus-flat", top_k=4,
                              batch_size=8, shard_size=12)  # two shards, merged
    for (layer, mode), (ids, values, positions, totals) in brute_force(double, images, 4).items():
        top = found[layer][mode]
        assert torch.equal(top.ids, ids), (layer, mode)
        assert torch.allclose(top.values, values, rtol=1e-9, atol=1e-12), (layer, mode)
        assert torch.equal(top.positions, positions), (layer, mode)
        assert torch.allclose(top.totals, totals, rtol=1e-9, atol=1e-9), (layer, mode)
        assert top.ids.unique().numel() > 4, (layer, mode)  # the channels do not all pick the same words


@pytest.mark.parametrize(("width", "first_column"), [(24, 3.0), (8, 1.0), (80, 4.0)])
def test_glocal_gives_a_wide_input_a_wide_first_column(tmp_path, toy, width, first_column):
    """The figure is 1.3 inches per column at 110 dpi; the first column is the input's aspect, from 1 to count."""
    from PIL import Image

    from relprop.viz.atlas import render_glocal

    model, _, _ = toy
    images = torch.randn(6, 1, 8, width, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    result = reference_samples(model, images, ["recognizer.features.4"], top_k=4, modes=["relevance"])
    path = render_glocal(model, images[0], result, images, "recognizer.features.4", tmp_path / "g.png", n=2, count=4,
                         composite="epsilon", size=16)
    assert Image.open(path).size[0] == round(1.3 * (first_column + 4) * 110)
