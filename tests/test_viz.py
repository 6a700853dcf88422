"""Heatmaps checked as images: size, colours at the extremes, symmetric scale; text rendering."""
import numpy as np
import pytest
import torch

pytest.importorskip("matplotlib")
from PIL import Image  # noqa: E402

from relprop import viz  # noqa: E402


def relevance():
    values = torch.zeros(3, 6, 8)
    values[0, 1, 2] = 2.0    # most relevant pixel (channels are summed)
    values[1, 4, 5] = -1.0   # most negative pixel, half the magnitude
    return values


def test_bwr_heatmap_colours_and_symmetric_scale(tmp_path):
    image = viz.heatmap(relevance(), "bwr")
    assert image.shape == (6, 8, 3) and image.dtype == np.uint8
    assert tuple(image[1, 2]) == (255, 0, 0)              # +max: full red
    assert tuple(image[0, 0]) == (255, 255, 255)          # zero: white, the centre of the map
    r, g, b = image[4, 5]                                 # -max/2: half-way to blue, not full blue
    assert b == 255 and 120 <= r <= 135 and 120 <= g <= 135
    path = viz.save_image(image, tmp_path / "h.png", scale=3)
    assert Image.open(path).size == (24, 18)


def test_cold_and_hot_is_black_at_zero_and_yellow_at_the_top():
    image = viz.heatmap(relevance(), "coldnhot")
    assert tuple(image[0, 0]) == (0, 0, 0)
    assert tuple(image[1, 2]) == (255, 255, 0)


def test_all_zero_relevance_is_the_centre_colour_not_nan():
    assert (viz.heatmap(torch.zeros(4, 4)) == 255).all()


def test_overlay_and_grid(tmp_path):
    picture = torch.rand(3, 6, 8)
    blended = viz.overlay(picture, relevance())
    assert blended.shape == (6, 8, 3)
    assert blended[1, 2, 0] > blended[1, 2, 2]  # red dominates at the most relevant pixel
    row = [picture[0].numpy(), viz.heatmap(relevance()), viz.heatmap(-relevance())]
    path = viz.save_grid([row] * 2, tmp_path / "grid.png", column_titles=["input", "LRP", "-LRP"], row_titles="ab")
    width, height = Image.open(path).size
    assert (width, height) == (3 * 140, 2 * 140)  # 1.4 inches per cell at 100 dpi


def test_bad_shape_is_explained():
    with pytest.raises(ValueError, match=r"\(H, W\) or \(C, H, W\)"):
        viz.heatmap(torch.zeros(2, 3, 4, 5))


def test_token_rendering():
    html_text = viz.text_html(["<s>", "good", "bad"], [0.0, 1.0, -1.0])
    assert "&lt;s&gt;" in html_text and "rgb(255, 0, 0)" in html_text and "rgb(0, 0, 255)" in html_text
    terminal = viz.text_terminal(["good", "bad"], torch.tensor([1.0, -1.0]))
    assert "\x1b[48;2;255;0;0m" in terminal and "\x1b[48;2;0;0;255m" in terminal
