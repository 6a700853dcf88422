"""Heatmaps of relevance: images, overlays, grids and coloured text.

Colour maps come from matplotlib. Relevance is normalised symmetrically by
its largest absolute value, so 0 relevance is always the centre colour
(white for ``"bwr"``, black for ``"coldnhot"``) and the sign is never shifted.
"""
from __future__ import annotations

import html
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never needs a display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from matplotlib.colors import LinearSegmentedColormap  # noqa: E402

__all__ = ["COLD_AND_HOT", "normalize", "heatmap", "overlay", "save_image", "save_grid", "text_html", "text_terminal"]

#: The field's "cold and hot" map: negative cyan-blue, zero black, positive red-yellow.
COLD_AND_HOT = LinearSegmentedColormap.from_list(
    "coldnhot", [(0.0, (0.0, 1.0, 1.0)), (0.25, (0.0, 0.0, 1.0)), (0.5, (0.0, 0.0, 0.0)),
                 (0.75, (1.0, 0.0, 0.0)), (1.0, (1.0, 1.0, 0.0))])


def _colormap(name: str):
    # an odd number of entries puts relevance 0 exactly on the centre colour
    return (COLD_AND_HOT if name == "coldnhot" else plt.get_cmap(name)).resampled(255)


def _to_map(relevance: torch.Tensor | np.ndarray) -> np.ndarray:
    """Relevance of one example as a 2-D array: channels (first axis of a 3-D input) are summed."""
    array = relevance.detach().cpu().double().numpy() if isinstance(relevance, torch.Tensor) else np.asarray(relevance)
    if array.ndim == 3:
        array = array.sum(0)
    if array.ndim != 2:
        raise ValueError(f"relprop: a heatmap needs relevance of shape (H, W) or (C, H, W), got {array.shape}")
    return array


def normalize(relevance: torch.Tensor | np.ndarray) -> np.ndarray:
    """Map relevance to [-1, 1] by its largest absolute value (all zeros stay zeros)."""
    array = _to_map(relevance)
    peak = np.abs(array).max()
    return array / peak if peak > 0 else np.zeros_like(array)


def heatmap(relevance: torch.Tensor | np.ndarray, cmap: str = "bwr") -> np.ndarray:
    """An RGB image (H, W, 3, uint8) of one example's relevance, symmetric around 0.

    Parameters
    ----------
    relevance : Tensor or array of shape (H, W) or (C, H, W)
    cmap : str
        A matplotlib colour map name, or ``"coldnhot"``. Diverging maps
        (``"bwr"``, ``"seismic"``, ``"coldnhot"``) show the sign.
    """
    colours = _colormap(cmap)((normalize(relevance) + 1.0) / 2.0)[..., :3]
    return np.round(colours * 255).astype(np.uint8)


def overlay(image: torch.Tensor | np.ndarray, relevance: torch.Tensor | np.ndarray, cmap: str = "bwr",
            alpha: float = 0.6) -> np.ndarray:
    """The heatmap blended over a grey version of ``image`` (C, H, W or H, W), weighted by |relevance|."""
    grey = normalize(np.abs(_to_map(image)))[..., None] * 0.5 + 0.25
    weight = alpha * np.abs(normalize(relevance))[..., None]
    blended = (1 - weight) * grey + weight * heatmap(relevance, cmap) / 255.0
    return np.round(blended * 255).astype(np.uint8)


def save_image(array: np.ndarray, path: str | Path, scale: int = 1) -> Path:
    """Save an (H, W, 3) uint8 image as PNG, each pixel ``scale`` x ``scale`` large."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if scale > 1:
        array = np.repeat(np.repeat(array, scale, axis=0), scale, axis=1)
    plt.imsave(path, array)
    return path


def save_grid(images: Sequence[Sequence[np.ndarray]], path: str | Path, column_titles: Sequence[str] = (),
              row_titles: Sequence[str] = (), cell_inches: float = 1.4) -> Path:
    """Save a grid of RGB or grey images (one row per example, one column per method) as PNG."""
    rows, columns = len(images), max(len(row) for row in images)
    figure, axes = plt.subplots(rows, columns, figsize=(cell_inches * columns, cell_inches * rows), squeeze=False)
    for r, row in enumerate(images):
        for c in range(columns):
            axis = axes[r][c]
            axis.set_xticks([])
            axis.set_yticks([])
            if c < len(row):
                axis.imshow(row[c], cmap="gray" if row[c].ndim == 2 else None, interpolation="nearest")
            if r == 0 and c < len(column_titles):
                axis.set_title(column_titles[c], fontsize=8)
            if c == 0 and r < len(row_titles):
                axis.set_ylabel(row_titles[r], fontsize=8)
    figure.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def _token_colours(relevance: Sequence[float] | torch.Tensor, cmap: str) -> list[tuple[int, int, int]]:
    values = torch.as_tensor(relevance, dtype=torch.float64).reshape(1, -1).numpy()
    return [tuple(int(v) for v in rgb) for rgb in heatmap(values, cmap)[0]]


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
