"""Which time frames drive a speaker embedding? LRP through a real pretrained 3-layer LSTM.

Resemblyzer ships a pretrained speaker encoder (``resemblyzer/pretrained.pt``:
a 3-layer ``nn.LSTM`` over 40 mel channels, a linear layer, ReLU, L2
normalisation). Its weights are loaded into the same architecture here (the
package's own import pulls a voice-activity detector that needs
``pkg_resources``); the mel spectrogram uses librosa with Resemblyzer's
settings (16 kHz, 25 ms windows, 10 ms steps, 40 channels).

The utterance is synthetic: tones of rising pitch separated by silence.
The example explains the strongest embedding dimension and plots, per time
frame, the positive and negative relevance the LSTM assigns to the input,
beside the relevance budget: the explained output, the input relevance's
total and its positive and negative parts, and what the ops absorbed. Here
the input relevance is a small, net-negative share of the output: most of
the output is accounted for by biases (of the LSTM gates and the linear
layer), which the epsilon rule keeps, so the per-frame bars show how the
input moved the output relative to the biases, not a split of the output.

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

    def __init__(self) -> None:
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


def tone_utterance(frequencies: tuple[float, ...] = (220.0, 330.0, 0.0, 440.0, 660.0, 0.0, 880.0),
                   seconds: float = 0.25) -> np.ndarray:
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


def explain(encoder: nn.Module, mels: Tensor, composite: str = "epsilon") -> tuple[int, Tensor, float]:
    """The strongest embedding dimension and the relevance of every (frame, mel channel) for it."""
    with torch.no_grad():
        dimension = int(encoder(mels[None]).argmax())
    relevance, delta = relprop.LRP(encoder, composite, strict=True).attribute(mels[None], target=dimension,
                                                                             return_convergence_delta=True)
    return dimension, relevance[0], delta.item()


def budget(output: float, relevance: Tensor, delta: float) -> dict[str, float]:
    """Where the explained output went: the input relevance (total, positive, negative part) and the ops' share."""
    return {"output": output, "input total": relevance.sum().item(),
            "positive part": relevance.clamp(min=0).sum().item(), "negative part": relevance.clamp(max=0).sum().item(),
            "absorbed by the ops": delta}


def report(dimension: int, parts: dict[str, float]) -> str:
    """The budget as text, each part also as a share of the output."""
    lines = [f"embedding dimension {dimension}: output {parts['output']:.4f}"]
    lines += [f"  {name:20s} {value:+.4f}  ({value / parts['output']:+7.1%} of the output)"
              for name, value in parts.items() if name != "output"]
    return "\n".join(lines)


def plot(mels: Tensor, relevance: Tensor, dimension: int, parts: dict[str, float], path: Path) -> None:
    """The spectrogram, the positive and negative relevance per frame, and the budget beside them."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    frames = np.arange(mels.shape[0])
    positive, negative = relevance.clamp(min=0).sum(1).numpy(), relevance.clamp(max=0).sum(1).numpy()
    figure = plt.figure(figsize=(11, 5.5))
    grid = figure.add_gridspec(2, 2, width_ratios=(3, 1))
    spectrum = figure.add_subplot(grid[0, 0])
    spectrum.imshow(np.log1p(mels.numpy().T), aspect="auto", origin="lower", cmap="magma")
    spectrum.set_ylabel("mel channel")
    spectrum.set_title("input: log(1 + mel power)")
    frame_axis = figure.add_subplot(grid[1, 0], sharex=spectrum)
    frame_axis.bar(frames, positive, width=1.0, color="tab:red", label="positive part")
    frame_axis.bar(frames, negative, width=1.0, color="tab:blue", label="negative part")
    frame_axis.plot(frames, positive + negative, color="black", linewidth=0.8, label="net")
    frame_axis.axhline(0, color="grey", linewidth=0.5)
    frame_axis.set_ylabel("relevance per frame")
    frame_axis.set_xlabel("time frame (10 ms)")
    frame_axis.set_title(f"input relevance: net {parts['input total']:+.3f} of an output of {parts['output']:.3f}")
    frame_axis.legend(loc="lower right", fontsize=8)
    budget_axis = figure.add_subplot(grid[:, 1])
    names = list(parts)
    colors = ["black", "grey", "tab:red", "tab:blue", "tab:olive"]
    budget_axis.barh(names, [parts[name] for name in names], color=colors)
    for row, name in enumerate(names):
        budget_axis.annotate(f"{parts[name]:+.3f}", (parts[name], row), xytext=(3 if parts[name] >= 0 else -3, 0),
                             textcoords="offset points", va="center", ha="left" if parts[name] >= 0 else "right",
                             fontsize=8)
    budget_axis.axvline(0, color="grey", linewidth=0.5)
    budget_axis.invert_yaxis()
    budget_axis.set_title(f"budget of embedding dim {dimension}\n(output = input total + absorbed)", fontsize=9)
    reach = 2.0 * max(abs(value) for value in parts.values())
    budget_axis.set_xlim(-reach, reach)  # room for the labels on both sides
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="out")
    args = parser.parse_args()
    encoder = load_encoder()
    mels = mel_spectrogram(tone_utterance())
    dimension, relevance, delta = explain(encoder, mels)
    with torch.no_grad():
        output = encoder(mels[None])[0, dimension].item()
    parts = budget(output, relevance, delta)
    print(report(dimension, parts))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plot(mels, relevance, dimension, parts, out / "speaker_lstm.png")
    print(f"wrote {out / 'speaker_lstm.png'}")


if __name__ == "__main__":
    main()
