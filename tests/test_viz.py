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


def test_overlay_shows_both_signs_in_full_colour_over_a_grey_picture():
    picture = torch.zeros(3, 6, 8)
    picture[:, 0, :] = 1.0                                 # a white top row on black
    blended = viz.overlay(picture, relevance()).astype(int)
    assert tuple(blended[0, 0]) == tuple(blended[0, 1])    # no relevance: the picture, in grey
    assert blended[0, 0, 0] == blended[0, 0, 1] == blended[0, 0, 2] and blended[0, 0, 0] > blended[2, 0, 0]
    red, blue = blended[1, 2], blended[4, 5]               # +max, and -max/2 (opacity 0.9 * 0.5 ** 0.7)
    assert red[0] - red[2] > 200
    assert blue[2] - blue[0] > 0.9 * 0.5 ** 0.7 * 255 - 2


def test_percentile_clipping_saturates_the_extremes():
    values = torch.arange(1.0, 101.0).reshape(10, 10)      # |R| = 1 ... 100
    assert viz.scale_of(values) == 100.0
    assert viz.scale_of(values, clip=50) == pytest.approx(50.5)   # numpy's linear percentile
    clipped = viz.normalize(values, clip=50)
    assert clipped.max() == 1.0 and (clipped == 1.0).sum() == 50
    assert clipped[0, 0] == pytest.approx(1 / 50.5)
    with pytest.raises(ValueError, match="percentile"):
        viz.scale_of(values, clip=0)


def test_unknown_colour_map_is_named():
    with pytest.raises(ValueError, match="unknown colour map 'nosuchmap'"):
        viz.heatmap(relevance(), "nosuchmap")


def test_heatmap_grid_has_a_colour_bar_and_labels(tmp_path):
    inputs = torch.rand(2, 1, 6, 8)
    maps = {"LRP": relevance().expand(2, -1, -1, -1), "-LRP": -relevance().expand(2, -1, -1, -1)}
    path = viz.save_heatmap_grid(inputs, maps, tmp_path / "grid.png", labels=[3, 4], predictions=[3, 5])
    image = np.asarray(Image.open(path).convert("RGB")).astype(int)
    width, height = image.shape[1], image.shape[0]
    assert width > 3 * 1.5 * 120 and height > 2 * 1.5 * 120        # three cells a row, plus the colour bar
    # the colour bar is the only place right of the last heatmap with full red and full blue
    right = image[:, int(width * 0.8):]
    assert ((right[..., 0] > 240) & (right[..., 1:] < 15).all(-1)).any()    # the bar's red end
    assert ((right[..., 2] > 240) & (right[..., :2] < 15).all(-1)).any()    # and its blue end
    def red_label(picture: np.ndarray) -> bool:  # the row titles sit left of the input column
        left = picture[:, :int(picture.shape[1] * 0.06)]
        return bool(((left[..., 0] > 150) & (left[..., 1] < 100) & (left[..., 2] < 100)).any())

    assert red_label(image)                                                  # true 4, pred 5: in red
    right_again = viz.save_heatmap_grid(inputs, maps, tmp_path / "ok.png", labels=[3, 4], predictions=[3, 4])
    assert not red_label(np.asarray(Image.open(right_again).convert("RGB")).astype(int))


def test_pixel_flipping_plot(tmp_path):
    steps = torch.linspace(1, 0, 11).unsqueeze(1).expand(-1, 3)
    curves = {"a": {"LRP": steps ** 2, "Gradient": steps, "random": steps.sqrt()}}
    path = viz.save_pixel_flipping(curves, tmp_path / "pf.png")
    assert Image.open(path).size[0] > 500
    assert [p.name for p in tmp_path.iterdir()] == ["pf.png"]  # no temporary file left


def test_a_failed_write_leaves_no_file(tmp_path):
    with pytest.raises(RuntimeError):
        with viz.atomic_path(tmp_path / "x.json") as temporary:
            temporary.write_text("half")
            raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []


def test_bad_shape_is_explained():
    with pytest.raises(ValueError, match=r"\(H, W\) or \(C, H, W\)"):
        viz.heatmap(torch.zeros(2, 3, 4, 5))


def test_token_rendering():
    html_text = viz.text_html(["<s>", "good", "bad"], [0.0, 1.0, -1.0])
    assert "&lt;s&gt;" in html_text and "rgb(255, 0, 0)" in html_text and "rgb(0, 0, 255)" in html_text
    terminal = viz.text_terminal(["good", "bad"], torch.tensor([1.0, -1.0]))
    assert "\x1b[48;2;255;0;0m" in terminal and "\x1b[48;2;0;0;255m" in terminal
