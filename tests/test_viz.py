"""Heatmaps checked as images: size, colours at the extremes, symmetric scale; text rendering."""
import numpy as np
import pytest
import torch

pytest.importorskip("matplotlib")
import matplotlib.text  # noqa: E402
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


def test_overlay_is_the_colour_map_over_a_dimmed_grey_photo_with_opacity_proportional_to_relevance():
    picture = torch.zeros(3, 6, 8)
    picture[:, 0, :] = 1.0                                 # a white top row on black
    blended = viz.overlay(picture, relevance()).astype(int)
    dark, light = viz.OVERLAY_GREY
    assert tuple(blended[0, 0]) == tuple(blended[0, 1]) == (round(light * 255),) * 3  # no relevance: the grey photo
    assert tuple(blended[2, 0]) == (round(dark * 255),) * 3                           # black, dimmed: not pure black
    red, blue = blended[1, 2], blended[4, 5]               # +max (opacity 1), and -max/2 (opacity 0.5)
    assert tuple(red) == (255, 0, 0)                       # bwr's end colour, in full
    expected = 0.5 * dark + 0.5 * np.array(viz.colormap("bwr")(0.25)[:3])
    assert np.abs(blue - expected * 255).max() <= 1


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


def _texts_outside(figure):
    """The texts of a drawn figure that reach past its edges (a cut label)."""
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()
    width, height = figure.bbox.width, figure.bbox.height
    cut = []
    for text in figure.findobj(matplotlib.text.Text):
        if not text.get_visible() or not text.get_text().strip():
            continue
        box = text.get_window_extent(renderer)
        if box.x0 < -1 or box.y0 < -1 or box.x1 > width + 1 or box.y1 > height + 1:
            cut.append(text.get_text())
    return cut


@pytest.fixture
def drawn(monkeypatch):
    """Per figure the viz functions save, its texts that are cut at its edges."""
    figures = []
    original = viz._save_figure
    monkeypatch.setattr(viz, "_save_figure", lambda figure, path, dpi: figures.append(_texts_outside(figure))
                        or original(figure, path, dpi))
    return figures


@pytest.mark.parametrize("rows", [1, 2, 6])
@pytest.mark.parametrize("clip", [None, 99.5])
def test_no_text_of_a_heatmap_grid_is_cut_not_even_with_one_row(tmp_path, drawn, rows, clip):
    viz.save_heatmap_grid(torch.rand(rows, 3, 16, 16), {"LRP epsilon-plus-flat": torch.randn(rows, 16, 16)},
                          tmp_path / "grid.png", predictions=[1] * rows, clip=clip,
                          title="LRP epsilon-plus-flat, --smooth-stride, --clip 99.5, centre crop")
    assert drawn == [[]]


@pytest.mark.parametrize("size", [28, 224])
@pytest.mark.parametrize("with_image", [False, True])
@pytest.mark.parametrize("magnitude", [1.0, 1e-4])  # long tick labels: -0.000197
def test_an_explanation_picture_has_its_title_and_colour_bar_uncut(tmp_path, drawn, size, with_image, magnitude):
    rel = torch.randn(3, size, size) * magnitude
    path = viz.save_explanation(rel, tmp_path / "x.png", image=torch.rand(3, size, size) if with_image else None,
                                title="a/long/folder/name/of/the/image: class 281 (logit 12.3, relevance sum 11.9)\n"
                                      "LRP epsilon-plus-flat, --smooth-stride, --clip 99.5, centre crop", clip=99.5)
    assert drawn == [[]]
    width, height = Image.open(path).size
    assert width > 256 and height > 256  # small maps enlarged so that the text fits


def test_a_blank_explanation_picture_says_so(tmp_path, drawn):
    viz.save_explanation(torch.zeros(1, 28, 28), tmp_path / "blank.png", title="blank")
    assert drawn == [[]] and (tmp_path / "blank.png").is_file()


@pytest.mark.parametrize("prompt, generated", [(3, 1), (5, 2), (30, 3), (10, 12)])
def test_the_generation_matrix_has_its_colour_bar_label_uncut(tmp_path, drawn, prompt, generated):
    """The label runs along the bar: longer than a short figure is high unless wrapped to the bar."""
    import relprop

    length = prompt + generated
    relevance = torch.randn(1, generated, length).tril(prompt - 1)  # row g: the context before token prompt + g
    tokens = [[" token" if i % 2 else " predicting" for i in range(length)]]  # x tick labels as long as words are
    found = relprop.Generation(torch.arange(length)[None], relevance, prompt, torch.ones(1, length), tokens)
    path = viz.save_generation_matrix(found, tmp_path / "relevance.png")
    assert drawn == [[]] and path.is_file()
