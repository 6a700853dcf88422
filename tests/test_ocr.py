"""EasyOCR's pretrained recognizer (int8 as easyocr builds it on a CPU, and float) and CRAFT detector, offline."""
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn.modules import module as module_globals

pytest.importorskip("easyocr")
pytest.importorskip("easyocr_en_models")
sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
import ocr as example  # noqa: E402

import relprop  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning:torch.*", "ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def reader():
    return example.load_reader(quantize=True, detector=True)


@pytest.fixture(scope="module")
def float_reader():
    return example.load_reader(quantize=False)


@pytest.fixture(scope="module")
def word():
    return example.render_word("relprop", example.font_paths()[0], 40)


def state(model: nn.Module) -> list:
    """Every value of the state dict as plain float tensors (packed int8 weights dequantized), with its key."""
    def flat(value):
        if isinstance(value, torch.Tensor):
            return [value.dequantize() if value.is_quantized else value.clone()]
        if isinstance(value, (tuple, list)):
            return [t for v in value for t in flat(v)]
        if isinstance(value, torch.ScriptObject):  # packed int8 weights: their serialised state
            return flat(value.__getstate__())
        return [value]
    return [(key, v) for key, value in model.state_dict().items() for v in flat(value)]


def assert_untouched(model: nn.Module, before: list, training: list) -> None:
    after = state(model)
    assert [k for k, _ in before] == [k for k, _ in after]
    for (key, old), (_, new) in zip(before, after):
        assert torch.equal(old, new) if isinstance(old, torch.Tensor) else old == new, key
    assert [m.training for m in model.modules()] == training
    for module in model.modules():
        assert not module._forward_hooks and not module._forward_pre_hooks and not module._backward_hooks
        assert not any(p.grad is not None for p in module.parameters(recurse=False))
    assert not module_globals._global_forward_hooks and not module_globals._global_forward_pre_hooks
    assert torch._C._len_torch_function_stack() == 0


def test_greedy_ctc_decoding_merges_repeats_drops_blanks_and_picks_the_best_column():
    best = [0, 3, 3, 0, 3, 5, 5, 5, 0]
    logits = torch.zeros(len(best), 6)
    logits[torch.arange(len(best)), best] = torch.tensor([1.0, 2.0, 4.0, 1.0, 3.0, 1.0, 5.0, 2.0, 1.0])
    characters = example.decode(logits, ["[blank]", "a", "b", "c", "d", "e"])
    assert characters == [("c", 2, 3), ("c", 4, 3), ("e", 6, 5)]


def test_reads_the_word_and_each_heatmap_sits_on_its_character(reader, word):
    from PIL import ImageFont

    x, text, characters, relevance = example.read_and_explain(reader, word)
    assert text == "relprop"
    assert relevance.shape == (len(text), *x.shape[2:]) and torch.isfinite(relevance).all()
    # each character's horizontal span in the model input, from the font's advance widths
    font, size = ImageFont.truetype(example.font_paths()[0], 40), 40
    scale, start = x.shape[-1] / word.shape[1], size // 4 - font.getbbox(text)[0]
    spans = [(round((start + font.getlength(text[:i])) * scale), round((start + font.getlength(text[:i + 1])) * scale))
             for i in range(len(text))]
    positive = relevance.clamp(min=0).sum(1)  # per pixel column
    inside = torch.stack([positive[i, a:b].sum() / positive[i].sum() for i, (a, b) in enumerate(spans)])
    width_share = torch.tensor([(b - a) / x.shape[-1] for a, b in spans])
    # a character's heatmap concentrates on it: on average over 3x the share its width would get if spread evenly
    assert inside.mean() > 3 * width_share.mean(), (inside, width_share)


def test_int8_recognizer_output_is_easyocrs_and_relevance_is_accounted_for(reader, word):
    model, x = reader.recognizer, example.word_tensor(word)
    characters = example.decode(example.recognizer_logits(model, x)[0], reader.converter.character)
    target = (characters[0].column, characters[0].label)
    forward = relprop.LRP(model, example.ocr_composite()).record(x, additional_forward_args=(None,))
    assert torch.equal(forward.logits.detach(), example.recognizer_logits(model, x))  # the int8 kernels' output
    report = relprop.audit(model, x, target, example.ocr_composite(), additional_forward_args=(None,))
    assert not report.unhandled
    assert report.seed_total == pytest.approx(float(example.recognizer_logits(model, x)[0][target]))
    assert report.seed_total - report.input_total == pytest.approx(report.absorbed_total, rel=1e-3, abs=1e-3)
    assert report.input_total > 0.02 * report.seed_total  # relevance does reach the pixels through the int8 layers
    # the int8 LSTMs and linear layers were explained with rules (unrolled), not skipped
    assert {"SequenceModeling.0.rnn", "SequenceModeling.1.linear", "Prediction"} <= {row.module for row in report.rows}


def test_int8_relevance_is_close_to_the_float_recognizers(reader, float_reader, word):
    x = example.word_tensor(word)
    characters = example.decode(example.recognizer_logits(float_reader.recognizer, x)[0],
                                float_reader.converter.character)
    int8 = example.explain_characters(reader.recognizer, x, characters)
    full = example.explain_characters(float_reader.recognizer, x, characters)
    # the int8 kernels also round each layer's input to 8 bits, which moves the later layers' ratios: the maps agree
    # closely for most characters (measured: cosine 0.91-0.99), less for the first "r" (0.57), never by chance (~0)
    cosine = torch.nn.functional.cosine_similarity(int8.flatten(1), full.flatten(1))
    assert cosine.median() > 0.95 and cosine.min() > 0.3, cosine


@pytest.mark.parametrize("quantize", [True, False])
def test_recognizer_untouched_also_after_an_error(reader, float_reader, word, quantize):
    model = (reader if quantize else float_reader).recognizer
    x = example.word_tensor(word)
    model.train()  # as easyocr leaves it
    before, training = state(model), [m.training for m in model.modules()]
    try:
        with pytest.warns(UserWarning, match="training mode"):
            example.explain_characters(model, x, [example.Character("r", 1, 2)])
        assert_untouched(model, before, training)
        with pytest.raises(ValueError, match="out of range"), pytest.warns(UserWarning, match="training mode"):
            example.explain_characters(model, x, [example.Character("r", 10_000, 2)])
        assert_untouched(model, before, training)
    finally:
        model.eval()


def test_detector_region_relevance_is_accounted_for_and_leaves_craft_untouched(reader):
    from skimage import data

    page = np.repeat(data.text()[40:104, 0:128, None], 3, axis=2)  # "f(s) =" at the left: 64 x 128 pixels
    x, detector = example.detector_input(page), reader.detector
    before, training = state(detector), [m.training for m in detector.modules()]
    box = (8, 72, 8, 48)
    relevance, seed = example.explain_region(detector, x, box)
    assert_untouched(detector, before, training)
    assert relevance.shape == x.shape[2:] and torch.isfinite(relevance).all()
    assert seed.sum() > 0 and (seed[..., 1] == 0).all()  # the region score in the box only
    inside = relevance[box[2]:box[3], box[0]:box[1]].clamp(min=0).sum()
    assert inside > 0.5 * relevance.clamp(min=0).sum()
    report = relprop.audit(detector, x, seed, example.ocr_composite())
    assert not report.unhandled
    assert report.seed_total - report.input_total == pytest.approx(report.absorbed_total, rel=1e-3, abs=1e-3)
    assert report.input_total == pytest.approx(float(relevance.sum()), rel=1e-4)


def test_character_figure_is_written(reader, word, tmp_path):
    x, text, characters, relevance = example.read_and_explain(reader, word)
    example.plot_characters(x, text, characters, relevance, tmp_path / "ocr.png")
    assert (tmp_path / "ocr.png").stat().st_size > 10_000


@pytest.mark.slow
def test_masking_the_most_relevant_pixels_hurts_each_character_most(float_reader):
    """Over 59 rendered words (8 faces, 3 sizes) and the words of skimage.data.text(): LRP beats gradient, random."""
    words = example.rendered_words() + example.page_words(example.load_reader(quantize=False, detector=True))
    assert len(words) >= 50
    results = example.faithfulness(float_reader, words)
    lrp_drop, lrp_flip = results["LRP"]
    assert len(lrp_drop) >= 250
    for method in ("Gradient", "random"):
        drop, flip = results[method]
        assert lrp_drop.mean() > drop.mean() + 2.0 and lrp_flip.float().mean() > flip.float().mean() + 0.08, method
        assert (lrp_drop > drop).float().mean() > 0.65, method  # character by character (measured: 75%, 84%)
