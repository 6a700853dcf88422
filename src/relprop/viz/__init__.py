"""Pictures of relevance: heatmaps, overlays, labelled figure grids, pixel-flipping plots, coloured text.

Colour maps come from matplotlib. Relevance is scaled symmetrically, by its
largest absolute value or, with ``clip``, by a percentile of its absolute
values (larger values saturate), so 0 relevance is always the centre colour
(white for ``"bwr"``, black for ``"coldnhot"``) and the sign is never shifted.
Every file is written under a temporary name and renamed, so an interrupted
run never leaves a half-written picture.
"""
from __future__ import annotations

import html
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; never needs a display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from matplotlib.colors import Colormap, LinearSegmentedColormap  # noqa: E402

__all__ = ["COLD_AND_HOT", "colormap", "scale_of", "normalize", "heatmap", "overlay", "save_image", "save_explanation",
           "save_heatmap_grid", "save_pixel_flipping", "atomic_path", "text_html", "text_terminal",
           "save_generation_matrix"]

#: The field's "cold and hot" map: negative cyan-blue, zero black, positive red-yellow.
COLD_AND_HOT = LinearSegmentedColormap.from_list(
    "coldnhot", [(0.0, (0.0, 1.0, 1.0)), (0.25, (0.0, 0.0, 1.0)), (0.5, (0.0, 0.0, 0.0)),
                 (0.75, (1.0, 0.0, 0.0)), (1.0, (1.0, 1.0, 0.0))])

Array = torch.Tensor | np.ndarray


def colormap(name: str) -> Colormap:
    """A matplotlib colour map by name, or ``"coldnhot"``; a clear ``ValueError`` for unknown names."""
    if name != "coldnhot" and name not in matplotlib.colormaps:
        raise ValueError(f"unknown colour map {name!r}: use coldnhot or a matplotlib name such as bwr or seismic")
    # an odd number of entries puts relevance 0 exactly on the centre colour
    return (COLD_AND_HOT if name == "coldnhot" else matplotlib.colormaps[name]).resampled(255)


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A temporary name next to ``path`` to write to; renamed to ``path`` on success, removed on failure.

    The folder is created if needed. Files get the usual permissions (0644 under umask 022).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        yield temporary
        os.replace(temporary, path)  # atomic on POSIX: the file is complete, or absent
    finally:
        temporary.unlink(missing_ok=True)


def _to_map(relevance: Array) -> np.ndarray:
    """Relevance of one example as a 2-D array: channels (first axis of a 3-D input) are summed."""
    array = relevance.detach().cpu().double().numpy() if isinstance(relevance, torch.Tensor) else np.asarray(relevance)
    if array.ndim == 3:
        array = array.sum(0)
    if array.ndim != 2:
        raise ValueError(f"relprop: a heatmap needs relevance of shape (H, W) or (C, H, W), got {array.shape}")
    return array


def scale_of(relevance: Array, clip: float | None = None) -> float:
    """The value that maps to the ends of the colour map: max ``|relevance|``, or its ``clip`` percentile."""
    magnitude = np.abs(_to_map(relevance))
    if clip is None:
        return float(magnitude.max())
    if not 0 < clip <= 100:
        raise ValueError(f"relprop: clip is a percentile in (0, 100], got {clip}")
    return float(np.percentile(magnitude, clip))


def normalize(relevance: Array, clip: float | None = None) -> np.ndarray:
    """Relevance mapped to [-1, 1] by :func:`scale_of` (larger values saturate; all zeros stay zeros)."""
    array = _to_map(relevance)
    scale = scale_of(array, clip)
    return np.clip(array / scale, -1.0, 1.0) if scale > 0 else np.zeros_like(array)


def heatmap(relevance: Array, cmap: str = "bwr", clip: float | None = None) -> np.ndarray:
    """An RGB image (H, W, 3, uint8) of one example's relevance, symmetric around 0.

    Parameters
    ----------
    relevance : Tensor or array of shape (H, W) or (C, H, W)
    cmap : str
        A matplotlib colour map name, or ``"coldnhot"``. Diverging maps
        (``"bwr"``, ``"seismic"``, ``"coldnhot"``) show the sign.
    clip : float, optional
        Percentile of ``|relevance|`` that maps to the ends of the colour map
        (``99.5`` keeps a few extreme pixels from washing out the rest).
    """
    colours = colormap(cmap)((normalize(relevance, clip) + 1.0) / 2.0)[..., :3]
    return np.round(colours * 255).astype(np.uint8)


def _grey(image: Array) -> np.ndarray:
    """The picture's luminance in [0, 1], stretched to its range (one channel as it is, three by Rec. 601)."""
    array = image.detach().cpu().double().numpy() if isinstance(image, torch.Tensor) else np.asarray(image, float)
    if array.ndim == 3:
        array = np.tensordot([0.299, 0.587, 0.114], array, axes=1) if array.shape[0] == 3 else array.mean(0)
    low, high = array.min(), array.max()
    return (array - low) / (high - low) if high > low else np.zeros_like(array)


#: the darkest and lightest grey of the photo under an overlay: dimmed, so that the colours stand out
OVERLAY_GREY = (0.12, 0.62)


def _overlay_colours(signed: np.ndarray, grey: np.ndarray | float, cmap: str) -> np.ndarray:
    colours = colormap(cmap)((signed + 1.0) / 2.0)[..., :3]
    weight = np.abs(signed)[..., None]  # opacity proportional to |relevance|: 0 shows the photo alone
    return (1 - weight) * np.asarray(grey)[..., None] + weight * colours


def overlay(image: Array, relevance: Array, cmap: str = "bwr", clip: float | None = None) -> np.ndarray:
    """Relevance painted over ``image`` (C, H, W or H, W): the colour map over a dimmed grey photo.

    The photo becomes grey (its luminance, stretched to its range, between
    :data:`OVERLAY_GREY`'s greys); each pixel takes the colour map's colour of
    its relevance with an opacity of ``|relevance / scale|`` (:func:`scale_of`),
    so irrelevant pixels show the photo and the most relevant ones the colour
    map's end colours in full. Returns an RGB image (H, W, 3, uint8).
    """
    dark, light = OVERLAY_GREY
    grey = dark + (light - dark) * _grey(image)
    blended = _overlay_colours(normalize(relevance, clip), grey, cmap)
    return np.round(blended * 255).astype(np.uint8)


def _wrap(text: str, inches: float, points: float) -> str:
    """``text`` broken into lines that fit ``inches`` at a font of ``points`` (about 0.5 em a character); words
    and options (``--clip``) are never split."""
    import textwrap

    width = max(12, int(inches * 72 / (0.5 * points)))
    return "\n".join(textwrap.fill(line, width, break_long_words=False, break_on_hyphens=False)
                     for line in text.split("\n"))


def save_explanation(relevance: Array, path: str | Path, image: Array | None = None, title: str = "",
                     cmap: str = "bwr", clip: float | None = None, scale: int = 1, dpi: int = 100) -> Path:
    """One explanation as a labelled picture: the heatmap (or, with ``image``, the :func:`overlay`), a title, and
    a colour bar in units of relevance.

    Parameters
    ----------
    relevance : (C, H, W) or (H, W)
    path : where the PNG goes
    image : (C, H, W) pixels in [0, 1], optional
        Draw the overlay on this picture instead of the bare heatmap.
    title : str
        Printed above (wrapped to the picture's width): what was explained, and how.
    cmap, clip :
        As for :func:`heatmap`. The colour bar runs from ``-scale`` to ``+scale``
        (:func:`scale_of`: max ``|R|``, or the ``clip`` percentile); for the
        overlay it shows the colours blended over grey as the picture does.
    scale : int
        Each relevance pixel is drawn at least ``scale`` x ``scale`` screen pixels
        (small maps are enlarged to about 256 pixels, so that the text fits).
    """
    from matplotlib.colors import ListedColormap, Normalize

    if image is not None:
        picture = overlay(image, relevance, cmap, clip)
    else:
        picture = heatmap(relevance, cmap, clip)
    height, width = picture.shape[:2]
    magnify = max(scale, -(-256 // max(height, width)))
    image_w, image_h = width * magnify / dpi, height * magnify / dpi
    title = _wrap(title, image_w + 1.0, 8.5) if title else ""
    lines = title.count("\n") + 1 if title else 0
    value = scale_of(relevance, clip)
    if value == 0:
        label = "relevance (all zero: a blank map)"
    else:
        label = "relevance, " + (f"clipped at its {clip:g}th percentile of |R|" if clip is not None else "± max |R|")
        if image is not None:
            label += "; opacity ∝ |R|"
    label = _wrap(label, image_h, 7.5)
    ticks = np.linspace(-value, value, 5) if value > 0 else np.zeros(1)  # a blank map has no range but 0
    tick_labels = [f"{tick:.3g}" for tick in ticks]
    # the space right of the bar: its tick labels (about 0.55 em a character at 7 points) and the label's lines
    right = 0.12 + max(len(text) for text in tick_labels) * 0.055 + 0.15 * (label.count("\n") + 1)
    left, gap, bar_w, bottom = 0.12, 0.12, 0.16, 0.12
    top = 0.12 + 0.17 * lines
    figure = plt.figure(figsize=(left + image_w + gap + bar_w + right, bottom + image_h + top), dpi=dpi)
    fw, fh = figure.get_size_inches()
    axis = figure.add_axes((left / fw, bottom / fh, image_w / fw, image_h / fh))
    axis.imshow(picture, interpolation="nearest")
    axis.set_xticks([])
    axis.set_yticks([])
    if title:
        figure.text(0.5, 1 - 0.06 / fh, title, ha="center", va="top", fontsize=8.5)
    colours = colormap(cmap)
    if image is not None:  # the overlay's own colours: the colour map blended over mid-grey by |relevance|
        ramp = np.linspace(-1, 1, 255)
        colours = ListedColormap(_overlay_colours(ramp, float(np.mean(OVERLAY_GREY)), cmap))
    bar_axis = figure.add_axes(((left + image_w + gap) / fw, bottom / fh, bar_w / fw, image_h / fh))
    shown = value if value > 0 else 1.0
    bar = figure.colorbar(matplotlib.cm.ScalarMappable(norm=Normalize(-shown, shown), cmap=colours), cax=bar_axis,
                          ticks=ticks)
    bar.ax.set_yticklabels(tick_labels)
    bar.ax.tick_params(labelsize=7)
    bar.set_label(label, fontsize=7.5)
    return _save_figure(figure, path, dpi)


def save_image(array: np.ndarray, path: str | Path, scale: int = 1) -> Path:
    """Save an (H, W, 3) uint8 image as PNG, each pixel ``scale`` x ``scale`` large."""
    if scale > 1:
        array = np.repeat(np.repeat(array, scale, axis=0), scale, axis=1)
    with atomic_path(path) as temporary:
        plt.imsave(temporary, array, format="png")
    return Path(path)


def _save_figure(figure: plt.Figure, path: str | Path, dpi: int) -> Path:
    try:
        with atomic_path(path) as temporary:
            figure.savefig(temporary, dpi=dpi, format="png")
    finally:
        plt.close(figure)
    return Path(path)


def _row_label(index: int, labels: Sequence[int] | None, predictions: Sequence[int] | None,
               class_names: Sequence[str] | None) -> tuple[str, str]:
    """The row title and its colour: red when the prediction is wrong."""
    def name(value: int) -> str:
        return class_names[value] if class_names is not None else str(value)

    parts = []
    if labels is not None:
        parts.append(f"true {name(int(labels[index]))}")
    if predictions is not None:
        parts.append(f"pred {name(int(predictions[index]))}")
    wrong = labels is not None and predictions is not None and int(labels[index]) != int(predictions[index])
    return "\n".join(parts), ("tab:red" if wrong else "black")


def save_heatmap_grid(inputs: Array, heatmaps: Mapping[str, Array], path: str | Path,
                      labels: Sequence[int] | None = None, predictions: Sequence[int] | None = None,
                      class_names: Sequence[str] | None = None, cmap: str = "bwr", clip: float | None = None,
                      cell_inches: float = 1.5, dpi: int = 120, title: str | None = None) -> Path:
    """A figure for a paper: one row per example (input, then one heatmap per method), with a colour bar.

    Parameters
    ----------
    inputs : (N, C, H, W) pixels, shown in grey (one channel) or colour (three, in [0, 1])
    heatmaps : method name -> relevance of shape (N, C, H, W) or (N, H, W)
    path : where the PNG goes
    labels, predictions : class per example, optional
        Shown as each row's title ("true 7 / pred 1"), in red where they differ.
    class_names : names of the classes, optional
    cmap, clip :
        As for :func:`heatmap`. Each heatmap is scaled on its own; the number
        under it is that scale (the relevance shown in full colour), and the
        shared colour bar gives the fraction of it.
    title : str, optional
        Printed above the grid (wrapped to its width), e.g. the options that made the maps.
    """
    inputs = inputs.detach().cpu().numpy() if isinstance(inputs, torch.Tensor) else np.asarray(inputs)
    rows, columns = len(inputs), 1 + len(heatmaps)
    figure, axes = plt.subplots(rows, columns, figsize=(cell_inches * columns + 0.9, cell_inches * rows + 0.5),
                                squeeze=False, layout="constrained")
    colours = colormap(cmap)
    for r in range(rows):
        picture = inputs[r]
        shown = picture[0] if picture.shape[0] == 1 else np.clip(picture.transpose(1, 2, 0), 0, 1)
        axes[r][0].imshow(shown, cmap="gray", interpolation="nearest")
        row_title, colour = _row_label(r, labels, predictions, class_names)
        axes[r][0].set_ylabel(row_title, fontsize=9, color=colour)
        for c, (name, relevance) in enumerate(heatmaps.items(), start=1):
            scale = scale_of(relevance[r], clip)
            axes[r][c].imshow(normalize(relevance[r], clip), cmap=colours, vmin=-1, vmax=1, interpolation="nearest")
            axes[r][c].set_xlabel(f"±{scale:.3g}", fontsize=7, labelpad=1)
    for c, name in enumerate(["input", *heatmaps]):
        axes[0][c].set_title(name, fontsize=9)
    for axis in axes.flat:
        axis.set_xticks([])
        axis.set_yticks([])
    bar = figure.colorbar(matplotlib.cm.ScalarMappable(norm=matplotlib.colors.Normalize(-1, 1), cmap=colours),
                          ax=axes[:, 1:], shrink=min(1.0, 3.0 / rows + 0.3), aspect=25, ticks=[-1, -0.5, 0, 0.5, 1])
    scaled_by = f"{clip:g}th percentile of |R|" if clip is not None else "max |R|"
    # the bar is as long as the rows it spans: its label is wrapped to that length (one row is short)
    length = cell_inches * rows * min(1.0, 3.0 / rows + 0.3)
    scaled_by = scaled_by.replace(" ", "\u00a0")  # kept on one line
    bar.set_label(_wrap(f"relevance / scale under each map ({scaled_by})", 0.9 * length, 8), fontsize=8)
    bar.ax.tick_params(labelsize=7)
    if title:
        figure.suptitle(_wrap(title, cell_inches * columns + 0.9, 8.5), fontsize=8.5)
    return _save_figure(figure, path, dpi)


def save_pixel_flipping(curves: Mapping[str, Mapping[str, torch.Tensor]], path: str | Path,
                        ylabel: str = "target logit, mean over examples", dpi: int = 110) -> Path:
    """Pixel-flipping curves, and below them each curve's distance to the best one, so close curves part.

    Parameters
    ----------
    curves : panel title -> method name -> Tensor (steps + 1, N)
        As :func:`relprop.workflows.evaluate.pixel_flipping` returns them. A method named
        ``"random"`` is drawn dashed, and left out of the lower panel. The best
        explanation (highest AOPC) is the reference of the lower panel; each legend
        entry gives the AOPC. A method has the same colour in every panel.
    path : where the PNG goes
    """
    from relprop.workflows.evaluate import aopc

    figure, axes = plt.subplots(2, len(curves), figsize=(6.2 * len(curves), 6.4), squeeze=False, sharex="col",
                                gridspec_kw={"height_ratios": [3, 2]}, layout="constrained")
    markers = "osD^vP*Xh<>"
    methods = list(dict.fromkeys(name for by_method in curves.values() for name in by_method))
    styles = {name: {"linestyle": "--" if name == "random" else "-", "marker": markers[i % len(markers)],
                     "markersize": 4, "linewidth": 1.4, "color": "grey" if name == "random" else f"C{i}"}
              for i, name in enumerate(methods)}  # the same look for a method in every panel
    for column, (title, by_method) in enumerate(curves.items()):
        scores = {name: aopc(curve).mean().item() for name, curve in by_method.items()}
        best = max([n for n in scores if n != "random"] or scores, key=scores.__getitem__)
        reference = by_method[best].mean(1)
        for name in sorted(by_method, key=lambda n: -scores[n]):
            mean = by_method[name].mean(1)
            removed = np.linspace(0, 100, len(mean))
            style = {**styles[name], "markevery": max(1, len(mean) // 8)}
            axes[0][column].plot(removed, mean.numpy(), label=f"{name} (AOPC {scores[name]:.3f})", **style)
            if name != "random":  # far above the others, it would flatten their differences
                axes[1][column].plot(removed, (mean - reference).numpy(), **style)
        axes[0][column].set_title(title, fontsize=10)
        axes[0][column].set_ylabel(ylabel)
        axes[0][column].legend(fontsize=7, title="most relevant removed first", title_fontsize=7)
        axes[1][column].axhline(0.0, color="black", linewidth=0.6)
        axes[1][column].set_ylabel(f"minus the best ({best})\n(random order not shown)", fontsize=9)
        axes[1][column].set_xlabel("input removed (%)")
        for axis in axes[:, column]:
            axis.grid(alpha=0.3)
    return _save_figure(figure, path, dpi)


def _token_colours(relevance: Sequence[float] | torch.Tensor, cmap: str) -> list[tuple[int, int, int]]:
    values = torch.as_tensor(relevance, dtype=torch.float64).reshape(1, -1).numpy()
    return [(int(r), int(g), int(b)) for r, g, b in heatmap(values, cmap)[0]]


def text_html(tokens: Sequence[str], relevance: Sequence[float] | torch.Tensor, cmap: str = "bwr") -> str:
    """Tokens as HTML spans with a background colour for their relevance (hover shows the value)."""
    values = torch.as_tensor(relevance, dtype=torch.float64).reshape(-1).tolist()
    spans = [f'<span style="background-color: rgb{colour}; padding: 1px 2px" title="{value:.4g}">'
             f"{html.escape(token)}</span>"
             for token, value, colour in zip(tokens, values, _token_colours(values, cmap))]
    return '<p style="font-family: monospace; line-height: 1.8">' + " ".join(spans) + "</p>"


def text_terminal(tokens: Sequence[str], relevance: Sequence[float] | torch.Tensor, cmap: str = "bwr") -> str:
    """Tokens with 24-bit ANSI background colours for their relevance, for a terminal."""
    parts = [f"\x1b[48;2;{r};{g};{b}m\x1b[38;2;0;0;0m{token}\x1b[0m"
             for token, (r, g, b) in zip(tokens, _token_colours(relevance, cmap))]
    return " ".join(parts)


def save_generation_matrix(generation: Any, path: str | Path, index: int = 0, cmap: str = "bwr",
                           dpi: int = 110, title: str | None = None) -> Path:
    """The relevance matrix of a generation (:class:`relprop.Generation`): one row per generated token.

    Each row is shown on its scale of :meth:`relprop.Generation.scales` (the first and the predicting token,
    which often hold much of the relevance, left out of it); the colour bar is in units of that scale.
    ``title`` goes above the matrix (what was explained: model, rules, prompt), wrapped to the figure's width.
    """
    keep = generation.attention_mask[index].bool()
    start = int((~keep).sum())
    words = (generation.tokens[index] if generation.tokens is not None
             else [str(t) for t in generation.sequences[index].tolist()])[start:]
    prompt = generation.prompt_length - start
    rows = generation.relevance[index][:, start:].double()
    scales = generation.scales(index).unsqueeze(1)
    shown = (rows / scales).clamp(-1, 1).numpy()
    columns = len(words) - 1  # the last generated token is predicted, never read
    width = max(4.0, 0.28 * columns + 2)
    title = _wrap(title, width - 0.2, 9) if title else None
    # each line of the title adds its own height, so that the matrix keeps the same room
    height = max(2.5, 0.3 * len(rows) + 1.6) + (0.2 * (title.count("\n") + 1) if title else 0.0)
    figure, axis = plt.subplots(figsize=(width, height), layout="constrained")
    image = axis.imshow(shown[:, :columns], cmap=colormap(cmap), vmin=-1, vmax=1, aspect="auto",
                        interpolation="nearest")
    axis.set_xticks(range(columns), [repr(w)[1:-1] for w in words[:columns]], rotation=90, fontsize=7)
    axis.set_yticks(range(len(rows)), [repr(w)[1:-1] for w in words[prompt:]], fontsize=7)
    axis.axvline(prompt - 0.5, color="black", linewidth=0.8)
    axis.set_xlabel("context token (prompt | generated)")
    axis.set_ylabel("generated token")
    bar = figure.colorbar(image, ax=axis, shrink=0.8)
    # the label runs along the bar, which is about half as long as the figure is high: wrapped to that, it
    # stays on the canvas however few rows there are
    bar.set_label(_wrap("relevance / row scale (first and predicting token aside)", 0.55 * height, 7), fontsize=7)
    if title:
        figure.suptitle(title, fontsize=9)
    return _save_figure(figure, path, dpi)
