"""A concept atlas of EasyOCR's pretrained recognizer over 472 rendered words, and a glocal figure for one word.

    python examples/ocr_atlas.py [OUT]          # default OUT: out/ocr_atlas

The words: each of the 59 words of ``examples/ocr.py`` in each of its 8 font faces (DejaVu and STIX), in lower
case, capitalised or upper case in turn, rendered at 28, 40 or 56 px and brought to the recognizer's input as
easyocr batches words (:class:`RenderedWords`). The model: the float recognizer (``english_g2``) explained
through :class:`ocr.ReadingScore`, one score per word (the summed logits of the characters it reads), with
EpsilonPlusFlat. easyocr's int8 build for CPUs quantizes each layer's input with one scale per batch, so its
outputs, and an atlas of them, would depend on which words share a batch; its convolutions, whose channels are
ranked here, are float in both builds.

The top 8 reference samples of every channel of two layers of the VGG feature extractor, by relevance and by
activation (``relprop.workflows.concepts.reference_samples``, resumable in ``OUT/run``):

- ``FeatureExtraction.ConvNet.9``: the ReLU after the fourth convolution, 128 channels of 16 x 80 (a receptive
  field of 26 x 26 pixels: strokes and parts of letters);
- ``FeatureExtraction.ConvNet.16``: the ReLU after the sixth convolution and its BatchNorm, 256 channels of
  8 x 80 (receptive field 62 x 42 pixels: letters and their neighbours).

It writes ``OUT/FeatureExtraction.ConvNet.9/index.html`` and ``OUT/FeatureExtraction.ConvNet.16/index.html``, each
with the 12 channels of most total relevance (one PNG each: crops of the reference samples by relevance, with
their conditional heatmaps), and ``OUT/glocal.png`` for the word "Concept" (not among the 472): its heatmap, its
four most relevant channels of ``ConvNet.16`` and their reference crops.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import ocr
import torch
from PIL import Image
from torch import Tensor

from relprop.viz import atlas
from relprop.workflows.concepts import reference_samples

LAYERS = ["recognizer.FeatureExtraction.ConvNet.9", "recognizer.FeatureExtraction.ConvNet.16"]
#: the width every word image is padded to (easyocr pads a batch to its widest word; 7 of the 472 are wider and
#: squeezed to it, as easyocr squeezes a word wider than its batch width)
WIDTH = 320
#: the casings the words take in turn
CASES = (str.lower, str.capitalize, str.upper)


def word_input(grey: np.ndarray) -> Tensor:
    """A grey word image as the recognizer's input (1, 64, WIDTH): easyocr's resize, scaling and padding."""
    from easyocr.recognition import AlignCollate

    collate = AlignCollate(imgH=ocr.MODEL_HEIGHT, imgW=WIDTH, keep_ratio_with_pad=True)
    return collate([Image.fromarray(grey, "L")])[0]


class RenderedWords(torch.utils.data.Dataset):
    """The 472 rendered words (see the module docstring): ``dataset[i]`` is a (1, 64, WIDTH) tensor in [-1, 1].

    ``texts[i]`` is the word as rendered, ``faces[i]`` its font file's name.
    """

    def __init__(self) -> None:
        fonts = ocr.font_paths()
        self.texts: list[str] = []
        self.faces: list[str] = []
        images = []
        for w, word in enumerate(ocr.WORDS):
            for f, font in enumerate(fonts):
                text = CASES[(w + f) % len(CASES)](word)
                images.append(word_input(ocr.render_word(text, font, ocr.FONT_SIZES[f % len(ocr.FONT_SIZES)])))
                self.texts.append(text)
                self.faces.append(Path(font).name)
        self.images = torch.stack(images)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> Tensor:
        return self.images[index]


def load_model() -> ocr.ReadingScore:
    """The float recognizer with one score per word image, in eval mode."""
    reader = ocr.load_reader(quantize=False)
    return ocr.ReadingScore(reader.recognizer, reader.converter.character).eval()


def most_relevant(result: dict, layer: str, count: int) -> list[int]:
    """The ``count`` channels of ``layer`` with the largest total relevance over the dataset."""
    return result[layer]["relevance"].totals.argsort(descending=True, stable=True)[:count].tolist()


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "out/ocr_atlas")
    model, words = load_model(), RenderedWords()
    with torch.no_grad():
        read = [text for start in range(0, len(words), 64) for text in model.read(words.images[start:start + 64])]
    correct = sum(text == truth for text, truth in zip(read, words.texts))
    print(f"{len(words)} rendered words; the recognizer reads {correct} exactly")
    started = time.perf_counter()
    result = reference_samples(model, words, LAYERS, composite=ocr.ocr_composite(), top_k=8, batch_size=32,
                               out=out / "run", progress=True)
    print(f"reference samples of {len(words)} words: {time.perf_counter() - started:.1f} s")
    for layer in LAYERS:
        index = atlas.render_atlas(result, model, words, layer, out / layer.split(".", 1)[1],
                                   composite=ocr.ocr_composite(), channels=most_relevant(result, layer, 12), size=64)
        print(f"wrote {index}")
    word = word_input(ocr.render_word("Concept", ocr.font_paths()[0], 40))
    figure = atlas.render_glocal(model, word, result, words, LAYERS[1], out / "glocal.png", n=4, count=6,
                                 composite=ocr.ocr_composite())
    print(f"wrote {figure}")


if __name__ == "__main__":
    main()
