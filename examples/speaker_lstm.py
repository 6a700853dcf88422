"""Which time frames drive a speaker embedding? LRP through a real pretrained 3-layer LSTM.

Resemblyzer ships a pretrained speaker encoder (``resemblyzer/pretrained.pt``:
a 3-layer ``nn.LSTM`` over 40 mel channels, a linear layer, ReLU, L2
normalisation). Its weights are loaded into the same architecture here (the
package's own import pulls a voice-activity detector that needs
``pkg_resources``); the mel spectrogram uses librosa with Resemblyzer's
settings (16 kHz, 25 ms windows, 10 ms steps, 40 channels).

The utterance is synthetic: tones of rising pitch separated by silence.
The example explains the strongest embedding dimension and plots, per time
frame, the relevance the LSTM assigns to the input.

Run: ``python examples/speaker_lstm.py [--out out]``.
"""
from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

import relprop

SAMPLING_RATE = 16000


class SpeakerEncoder(nn.Module):
    """Resemblyzer's VoiceEncoder architecture: the last layer's final hidden state, linear, ReLU, unit norm."""

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(40, 256, 3, batch_first=True)
        self.linear = nn.Linear(256, 256)
        self.relu = nn.ReLU()

    def forward(self, mels: Tensor) -> Tensor:
        _, (hidden, _) = self.lstm(mels)
        embedding = self.relu(self.linear(hidden[-1]))
        return embedding / torch.norm(embedding, dim=1, keepdim=True)


def load_encoder() -> SpeakerEncoder:
    """The pretrained weights from the installed ``resemblyzer`` package (without importing it)."""
    spec = importlib.util.find_spec("resemblyzer")
    if spec is None:
        raise ModuleNotFoundError("the speaker example needs the package resemblyzer (pip install resemblyzer)")
    path = Path(spec.submodule_search_locations[0]) / "pretrained.pt"
    state = torch.load(path, map_location="cpu", weights_only=False)["model_state"]
    encoder = SpeakerEncoder()
    encoder.load_state_dict({k: v for k, v in state.items() if not k.startswith("similarity_")})
    return encoder.eval()


def tone_utterance(frequencies=(220.0, 330.0, 0.0, 440.0, 660.0, 0.0, 880.0), seconds: float = 0.25) -> np.ndarray:
    """Tones of the given pitches (0: silence), each ``seconds`` long, with soft edges."""
    time = np.arange(int(seconds * SAMPLING_RATE)) / SAMPLING_RATE
    envelope = np.minimum(1.0, np.minimum(time, time[::-1]) / 0.02)
    parts = [0.5 * envelope * np.sin(2 * np.pi * f * time) if f else np.zeros_like(time) for f in frequencies]
    return np.concatenate(parts).astype(np.float32)


def mel_spectrogram(wav: np.ndarray) -> Tensor:
    """Frames x 40 mel channels, Resemblyzer's settings."""
    import librosa

    frames = librosa.feature.melspectrogram(y=wav, sr=SAMPLING_RATE, n_fft=400, hop_length=160, n_mels=40)
    return torch.from_numpy(frames.astype(np.float32).T)


def explain(encoder: nn.Module, mels: Tensor, composite="epsilon"):
    """The strongest embedding dimension and the relevance of every (frame, mel channel) for it."""
    with torch.no_grad():
        dimension = int(encoder(mels[None]).argmax())
    relevance, delta = relprop.LRP(encoder, composite, strict=True).attribute(mels[None], target=dimension,
                                                                             return_convergence_delta=True)
    return dimension, relevance[0], delta.item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="out")
    args = parser.parse_args()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    encoder = load_encoder()
    mels = mel_spectrogram(tone_utterance())
    dimension, relevance, delta = explain(encoder, mels)
    per_frame = relevance.sum(1)
    report = relprop.audit(encoder, mels[None], target=dimension)
    print(f"embedding dimension {dimension}: seed {report.seed_total:.4f}, input relevance {report.input_total:.4f}, "
          f"absorbed by the ops (biases, stabilisers) {report.absorbed_total:.4f}, delta {delta:.4f}")
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(8, 5), sharex=True)
    top.imshow(np.log1p(mels.numpy().T), aspect="auto", origin="lower", cmap="magma")
    top.set_ylabel("mel channel")
    bottom.bar(np.arange(len(per_frame)), per_frame.numpy(), color=np.where(per_frame.numpy() >= 0, "tab:red",
                                                                             "tab:blue"))
    bottom.set_ylabel(f"relevance for dim {dimension}")
    bottom.set_xlabel("time frame (10 ms)")
    figure.tight_layout()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    figure.savefig(out / "speaker_lstm.png", dpi=100)
    print(f"wrote {out / 'speaker_lstm.png'}")


if __name__ == "__main__":
    main()
