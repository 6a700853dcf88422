"""A real pretrained LSTM (Resemblyzer's speaker encoder): relevance over time frames, accounted for."""
import copy
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("librosa")
sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
import speaker_lstm as example  # noqa: E402

import relprop  # noqa: E402


@pytest.fixture(scope="module")
def encoder_and_mels():
    if __import__("importlib").util.find_spec("resemblyzer") is None:
        pytest.skip("resemblyzer is not installed")
    return example.load_encoder(), example.mel_spectrogram(example.tone_utterance())


def test_relevance_sits_on_the_tones_and_is_accounted_for(encoder_and_mels):
    encoder, mels = encoder_and_mels
    dimension, relevance, delta = example.explain(encoder, mels)
    assert relevance.shape == mels.shape and torch.isfinite(relevance).all()
    silent = mels.sum(1) == 0
    assert silent.any() and torch.equal(relevance[silent], torch.zeros_like(relevance[silent]))
    assert relevance[~silent].abs().sum() > 0
    report = relprop.audit(encoder, mels[None], target=dimension)
    assert not report.unhandled
    assert delta == pytest.approx(report.absorbed_total, rel=1e-4, abs=1e-6)  # biases absorb what is missing
    assert torch.equal(relprop.LRP(encoder).record(mels[None]).logits, encoder(mels[None]))


def test_bias_free_encoder_conserves(encoder_and_mels):
    encoder, mels = encoder_and_mels
    bias_free = copy.deepcopy(encoder).double()
    for name, param in bias_free.named_parameters():
        if "bias" in name:
            torch.nn.init.zeros_(param)
    x = mels[None].double()
    with torch.no_grad():
        dimension = int(bias_free(x).argmax())
        value = bias_free(x)[0, dimension].item()
    relevance = relprop.LRP(bias_free, relprop.composites.Epsilon(0.0), strict=True).attribute(x, target=dimension)
    assert relevance.sum().item() == pytest.approx(value, rel=1e-8)


def test_budget_shows_the_output_the_parts_and_what_the_ops_absorbed(encoder_and_mels, tmp_path):
    encoder, mels = encoder_and_mels
    dimension, relevance, delta = example.explain(encoder, mels)
    output = encoder(mels[None])[0, dimension].item()
    parts = example.budget(output, relevance, delta)
    assert parts["positive part"] > 0 > parts["negative part"]
    assert parts["positive part"] + parts["negative part"] == pytest.approx(parts["input total"], rel=1e-5)
    assert parts["input total"] + parts["absorbed by the ops"] == pytest.approx(output, rel=1e-4)
    text = example.report(dimension, parts)
    assert f"output {output:.4f}" in text and f"{parts['input total'] / output:+7.1%}" in text
    example.plot(mels, relevance, dimension, parts, tmp_path / "speaker.png")
    assert (tmp_path / "speaker.png").stat().st_size > 10_000
