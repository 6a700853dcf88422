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
