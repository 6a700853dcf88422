"""What a notebook shows: ``Generation._repr_html_``, and the token and image relevance of ``relprop.viz.displays``.

Jupyter shows the last value of a cell through ``_repr_html_`` or ``_repr_png_``; these tests read those outputs
back: every token is there, in order, and its colour is the one its relevance gives; the PNG decodes to the
picture, at its size.
"""
from __future__ import annotations

import html
import io
import re

import numpy as np
import pytest
import torch

import relprop
from relprop.viz.displays import ImageRelevance, TokenRelevance

plt = pytest.importorskip("matplotlib.pyplot")

_SPAN = re.compile(r'<span style="background: rgb\((\d+),(\d+),(\d+)\)[^"]*" title="relevance ([^"]+)">([^<]*)</span>')
_BOXED = re.compile(r'<b style="outline: 1px solid black">([^<]*)</b>')


def _rows(view: str) -> list[tuple[list[tuple[tuple[int, int, int], str, str]], str]]:
    """Each line of a generation's view: its context spans ((r, g, b), value text, token) and its boxed token."""
    found = []
    for line in re.findall(r"<div>(.*?)</div>", view):
        spans = [((int(r), int(g), int(b)), value, html.unescape(text)) for r, g, b, value, text in _SPAN.findall(line)]
        found.append((spans, html.unescape(_BOXED.search(line).group(1))))
    return found


def test_a_generation_shows_each_row_in_the_colours_of_its_relevance():
    """A generation written by hand: the colours are the closed form of the page's (white at 0, red at +1 and blue
    at -1 of the row's scale, which leaves out the first and the predicting token), and every token is shown."""
    tokens = ["A", " cat", "\n", " sat", "."]
    relevance = torch.tensor([[[5.0, 1.0, -0.5, 0.0, 0.0],    # scale 1 (" cat": the first and "\n" left out)
                               [0.0, 2.0, -4.0, 1.0, 0.0]]])  # scale 4 (" cat" and "\n")
    found = relprop.Generation(torch.tensor([[1, 2, 3, 4, 5]]), relevance, 3, torch.ones(1, 5, dtype=torch.long),
                               [tokens])
    rows = _rows(found._repr_html_())
    assert [boxed for _, boxed in rows] == [" sat", "."]
    assert [[token for _, _, token in spans] for spans, _ in rows] == [["A", " cat", "\u21b5"],
                                                                      ["A", " cat", "\u21b5", " sat"]]
    assert [[colour for colour, _, _ in spans] for spans, _ in rows] == [
        [(255, 0, 0), (255, 0, 0), (128, 128, 255)],                     # 5 saturates; -0.5 is half blue
        [(255, 255, 255), (255, 128, 128), (0, 0, 255), (255, 191, 191)],  # 0, 0.5, -1, 0.25 of the scale 4
    ]


def test_a_generated_views_colours_follow_the_relevance_explain_generation_computes():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=1, intermediate_size=32)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    found = relprop.explain_generation(model, torch.tensor([[3, 7, 9, 4, 11]]), max_new_tokens=3)
    rows = _rows(found._repr_html_())
    ids = [str(t) for t in found.sequences[0].tolist()]
    assert len(rows) == 3
    for g, (spans, boxed) in enumerate(rows):
        assert boxed == ids[5 + g]
        assert [token for _, _, token in spans] == ids[:5 + g]
        values = found.relevance[0, g, :5 + g] / found.scales()[g]
        assert [float(value) for _, value, _ in spans] == pytest.approx(found.relevance[0, g, :5 + g].tolist(),
                                                                        rel=1e-2, abs=1e-12)
        for (red, green, blue), value in zip([colour for colour, _, _ in spans], values.tolist()):
            # red for evidence, blue against; the other two channels fall as |relevance| grows, to 0 from the scale
            level = red if value < 0 else blue
            assert (red, blue) == ((255, level) if value >= 0 else (level, 255)) and green == level
            assert level == pytest.approx(255 * (1 - min(1.0, abs(value))), abs=0.5)


def test_a_text_classifiers_token_relevance_shows_each_token_with_its_value():
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=30, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, num_labels=2)
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config).eval()
    ids = torch.tensor([[2, 11, 17, 5, 23, 3]])
    tokens = ["[CLS]", "a", "<good>", "&", "film", "[SEP]"]
    relevance = relprop.LRP(model, "attnlrp").attribute(ids, target=1)
    view = TokenRelevance(tokens, relevance).html()
    spans = re.findall(r'<span style="background-color: rgb\((\d+), (\d+), (\d+)\);[^"]*" title="([^"]+)">([^<]*)'
                       r"</span>", view)
    assert [html.unescape(text) for *_, text in spans] == tokens  # escaped, in order
    assert [float(value) for *_, value, _ in spans] == pytest.approx(relevance[0].tolist(), rel=1e-3)
    # bwr: the largest |relevance| takes the map's end colour, and a larger relevance is redder (less green)
    values = relevance[0].tolist()
    largest = max(range(len(values)), key=lambda i: abs(values[i]))
    assert tuple(int(c) for c in spans[largest][:3]) == ((255, 0, 0) if values[largest] > 0 else (0, 0, 255))
    greens = [int(green) for _, green, *_ in spans]
    order = sorted(range(len(values)), key=lambda i: abs(values[i]))
    assert [greens[i] for i in order] == sorted(greens, reverse=True)


def test_token_relevance_refuses_a_length_that_differs():
    with pytest.raises(ValueError, match="3 tokens but 2 relevance values"):
        TokenRelevance(["a", "b", "c"], torch.zeros(2))


def _decoded(png: bytes) -> np.ndarray:
    return np.round(plt.imread(io.BytesIO(png), format="png")[..., :3] * 255).astype(np.uint8)


def test_an_image_relevance_shows_as_a_png_of_its_size():
    relevance = torch.zeros(3, 6, 10)
    relevance[0, 2, 3] = 4.0   # the largest: the map's red end
    relevance[1, 4, 7] = -2.0  # half the scale, negative: half blue
    shown = ImageRelevance(relevance, scale=3)
    picture = _decoded(shown._repr_png_())
    assert picture.shape == (18, 30, 3)
    np.testing.assert_array_equal(picture, shown.picture())
    assert tuple(picture[2 * 3, 3 * 3]) == (255, 0, 0)
    assert tuple(picture[0, 0]) == (255, 255, 255)  # no relevance: white
    red, green, blue = picture[4 * 3 + 1, 7 * 3 + 2]
    assert blue == 255 and red == green and abs(int(red) - 128) <= 2  # the map's 255 entries: 2 levels a step


def test_an_image_relevance_over_a_picture_shows_the_photo_where_nothing_is_relevant():
    image = torch.linspace(0, 1, 4 * 5).reshape(1, 4, 5).expand(3, -1, -1)
    relevance = torch.zeros(4, 5)
    relevance[1, 1] = -1.0
    picture = _decoded(ImageRelevance(relevance, image).png())
    assert picture.shape == (4, 5, 3)
    assert tuple(picture[1, 1]) == (0, 0, 255)  # saturated: the colour alone
    dark, light = relprop.viz.OVERLAY_GREY
    assert tuple(picture[0, 0]) == (round(255 * dark),) * 3    # the darkest pixel, dimmed
    assert tuple(picture[3, 4]) == (round(255 * light),) * 3   # the lightest
    with pytest.raises(ValueError, match="differ in height and width"):
        ImageRelevance(relevance, torch.rand(3, 5, 5))
