"""Pictures of pair relevance (:class:`relprop.BiLRP`): token matrices, token lines, image pairs.

Colours follow :mod:`relprop.viz`: red for positive, blue for negative
relevance, white at 0, scaled symmetrically by the largest absolute value.
Lines join the strongest pairs (largest absolute relevance); their width and
opacity grow with it.
"""
from __future__ import annotations

import html
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure
from torch import Tensor

from relprop import viz
from relprop.viz import plt

__all__ = ["strongest_pairs", "token_matrix", "token_matrix_html", "token_lines", "token_lines_html", "image_pair"]

_POSITIVE, _NEGATIVE = "#d62728", "#1f5fd6"


def _matrix(pairs: Tensor | np.ndarray) -> np.ndarray:
    array = pairs.detach().cpu().double().numpy() if isinstance(pairs, Tensor) else np.asarray(pairs, dtype=float)
    if array.ndim != 2:
        raise ValueError(f"relprop: pair relevance of one example must be 2-D (T1, T2), got shape {array.shape}")
    return array


def _check_tokens(tokens: Sequence[str], other: Sequence[str], matrix: np.ndarray) -> None:
    if matrix.shape != (len(tokens), len(other)):
        raise ValueError(f"relprop: pair relevance of shape {matrix.shape} does not match {len(tokens)} and "
                         f"{len(other)} tokens")


def strongest_pairs(pairs: Tensor | np.ndarray, count: int) -> list[tuple[int, int, float]]:
    """The ``count`` pairs ``(i, j, relevance)`` of a 2-D pair relevance with the largest absolute value (not 0)."""
    matrix = _matrix(pairs)
    order = np.argsort(-np.abs(matrix), axis=None, kind="stable")[:count]
    return [(int(i), int(j), float(matrix[i, j])) for i, j in zip(*np.unravel_index(order, matrix.shape))
            if matrix[i, j] != 0]


def _save(figure: Figure, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=130, bbox_inches="tight")
    plt.close(figure)
    return path


def token_matrix(tokens: Sequence[str], other: Sequence[str], pairs: Tensor | np.ndarray, path: str | Path,
                 title: str = "") -> Path:
    """Save the token-token matrix of one pair as PNG: rows are ``tokens``, columns ``other``."""
    matrix = _matrix(pairs)
    _check_tokens(tokens, other, matrix)
    peak = np.abs(matrix).max() or 1.0
    figure, axis = plt.subplots(figsize=(1.2 + 0.5 * len(other), 0.9 + 0.42 * len(tokens)))
    image = axis.imshow(matrix, cmap="bwr", vmin=-peak, vmax=peak)
    axis.set_xticks(range(len(other)), other, rotation=60, ha="right", fontsize=9)
    axis.set_yticks(range(len(tokens)), tokens, fontsize=9)
    axis.tick_params(length=0)
    for i, j in zip(*np.nonzero(np.abs(matrix) >= 0.3 * peak)):  # the values of the strong cells, readable on them
        axis.text(j, i, f"{matrix[i, j]:.2f}", ha="center", va="center", fontsize=7,
                  color="white" if abs(matrix[i, j]) >= 0.7 * peak else "black")
    figure.colorbar(image, ax=axis, shrink=0.8, label="pair relevance")
    if title:
        axis.set_title(title, fontsize=9)
    return _save(figure, path)


def token_matrix_html(tokens: Sequence[str], other: Sequence[str], pairs: Tensor | np.ndarray) -> str:
    """The token-token matrix as an HTML table with coloured cells (hover shows the value)."""
    matrix = _matrix(pairs)
    _check_tokens(tokens, other, matrix)
    colours = viz.heatmap(matrix, "bwr")
    head = "".join(f'<th style="writing-mode: vertical-rl; font-weight: normal">{html.escape(t)}</th>' for t in other)
    rows = []
    for i, token in enumerate(tokens):
        cells = "".join(f'<td style="background: rgb{tuple(int(c) for c in colours[i, j])}; width: 18px; height: '
                        f'18px" title="{html.escape(token)} ~ {html.escape(other[j])}: {matrix[i, j]:.4g}"></td>'
                        for j in range(len(other)))
        rows.append(f'<tr><th style="text-align: right; font-weight: normal">{html.escape(token)}</th>{cells}</tr>')
    return ('<table style="border-collapse: collapse; font-family: monospace; font-size: 12px">'
            f"<tr><th></th>{head}</tr>{''.join(rows)}</table>")


def _row_positions(tokens: Sequence[str], gap: float = 1.0) -> tuple[np.ndarray, np.ndarray, float]:
    """Centres and widths of tokens laid out in one row, in character units, and the row's length."""
    widths = np.array([max(len(token), 1) + 0.6 for token in tokens], dtype=float)
    starts = np.concatenate([[0.0], np.cumsum(widths + gap)[:-1]])
    return starts + widths / 2, widths, float(starts[-1] + widths[-1]) if len(tokens) else 0.0


def _token_marginals(matrix: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each token's share of the pair relevance (row and column sums), for the token colours."""
    return matrix.sum(1), matrix.sum(0)


def token_lines(tokens: Sequence[str], other: Sequence[str], pairs: Tensor | np.ndarray, path: str | Path,
                top: int = 8, labelled: int = 3, title: str = "") -> Path:
    """Save the two sentences as two rows of tokens, joined by lines for the ``top`` strongest pairs (PNG).

    Tokens are coloured by their row or column sum of the pair relevance; the
    ``labelled`` strongest lines carry their pair's relevance.
    """
    matrix = _matrix(pairs)
    _check_tokens(tokens, other, matrix)
    (x1, w1, length1), (x2, w2, length2) = _row_positions(tokens), _row_positions(other)
    length = max(length1, length2)
    x1, x2 = x1 + (length - length1) / 2, x2 + (length - length2) / 2  # both rows centred
    figure, axis = plt.subplots(figsize=(0.13 * length + 0.6, 3.0))
    axis.set_xlim(-1, length + 1)
    axis.set_ylim(-0.25, 1.35)
    axis.axis("off")
    for row, (centres, widths, words, marginal) in enumerate(
            ((x2, w2, other, _token_marginals(matrix)[1]), (x1, w1, tokens, _token_marginals(matrix)[0]))):
        colours = viz.heatmap(marginal.reshape(1, -1), "bwr")[0] / 255.0
        for centre, word, colour in zip(centres, words, colours):
            axis.text(centre, row * 1.1, word, ha="center", va="center", family="monospace", fontsize=10,
                      bbox={"boxstyle": "round,pad=0.25", "facecolor": colour, "edgecolor": "#888888"})
    strongest = strongest_pairs(matrix, top)
    peak = max((abs(value) for _, _, value in strongest), default=0.0) or 1.0
    for rank, (i, j, value) in reversed(list(enumerate(strongest))):  # the strongest line drawn last, on top
        strength = abs(value) / peak
        colour = _POSITIVE if value > 0 else _NEGATIVE
        axis.plot([x1[i], x2[j]], [1.0, 0.1], color=colour, linewidth=0.8 + 4.2 * strength,
                  alpha=0.35 + 0.6 * strength, solid_capstyle="round")
        if rank < labelled:  # values of the strongest few only, each at its own height, so they stay apart
            along = 0.3 + 0.4 * rank / max(labelled - 1, 1)
            axis.text(x1[i] + along * (x2[j] - x1[i]), 1.0 - along * 0.9, f"{value:+.2f}", fontsize=8, color=colour,
                      ha="center", va="center",
                      bbox={"boxstyle": "round,pad=0.15", "facecolor": "white", "edgecolor": colour})
    if title:
        axis.set_title(title, fontsize=9)
    return _save(figure, path)


def token_lines_html(tokens: Sequence[str], other: Sequence[str], pairs: Tensor | np.ndarray, top: int = 8) -> str:
    """The two-row picture of :func:`token_lines` as inline SVG (hover a line for its value)."""
    matrix = _matrix(pairs)
    _check_tokens(tokens, other, matrix)
    char = 8.0  # pixels per character of a 13px monospace font
    (x1, w1, length1), (x2, w2, length2) = _row_positions(tokens), _row_positions(other)
    length = max(length1, length2)
    x1, x2 = (x1 + (length - length1) / 2) * char, (x2 + (length - length2) / 2) * char
    marginal1, marginal2 = _token_marginals(matrix)
    parts = []
    strongest = strongest_pairs(matrix, top)
    peak = max((abs(value) for _, _, value in strongest), default=0.0) or 1.0
    for i, j, value in reversed(strongest):
        strength = abs(value) / peak
        parts.append(f'<line x1="{x1[i]:.1f}" y1="30" x2="{x2[j]:.1f}" y2="110" stroke="'
                     f'{_POSITIVE if value > 0 else _NEGATIVE}" stroke-width="{1 + 5 * strength:.1f}" '
                     f'stroke-opacity="{0.35 + 0.6 * strength:.2f}" stroke-linecap="round"><title>'
                     f"{html.escape(tokens[i])} ~ {html.escape(other[j])}: {value:.4g}</title></line>")
    for y, centres, widths, words, marginal in ((14, x1, w1, tokens, marginal1), (126, x2, w2, other, marginal2)):
        colours = viz.heatmap(marginal.reshape(1, -1), "bwr")[0]
        for centre, width, word, colour in zip(centres, widths, words, colours):
            parts.append(f'<rect x="{centre - width * char / 2:.1f}" y="{y - 12}" width="{width * char:.1f}" '
                         f'height="22" rx="4" fill="rgb{tuple(int(c) for c in colour)}" stroke="#888"/>'
                         f'<text x="{centre:.1f}" y="{y + 4}" text-anchor="middle">{html.escape(word)}</text>')
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{length * char + 16:.0f}" height="145" '
            f'style="font-family: monospace; font-size: 13px">{"".join(parts)}</svg>')


def image_pair(image: Tensor | np.ndarray, other: Tensor | np.ndarray, pairs: Tensor | np.ndarray, path: str | Path,
               top: int = 12, title: str = "") -> Path:
    """Save two images side by side with lines between the ``top`` strongest pairs of patches (PNG).

    Parameters
    ----------
    image, other : Tensor or array, (C, H, W) or (H, W)
        The two inputs (channels are averaged to grey).
    pairs : Tensor or array, (h1, w1, h2, w2)
        Pair relevance of patches, e.g. ``BiLRP.attribute(..., pool=...)[b]``:
        an ``H / h1`` by ``W / w1`` patch grid on the first image, likewise on the second.
    """
    grids = np.asarray(pairs.detach().cpu().double() if isinstance(pairs, Tensor) else pairs, dtype=float)
    if grids.ndim != 4:
        raise ValueError(f"relprop: patch pair relevance must have shape (h1, w1, h2, w2), got {grids.shape}")
    left, right = _grey(image), _grey(other)
    gap = left.shape[1] // 4
    canvas = np.ones((max(left.shape[0], right.shape[0]), left.shape[1] + gap + right.shape[1]))
    canvas[:left.shape[0], :left.shape[1]] = left
    canvas[:right.shape[0], left.shape[1] + gap:] = right
    scale = 7.0 / canvas.shape[1]
    figure, axis = plt.subplots(figsize=(7.0, canvas.shape[0] * scale + (0.4 if title else 0.1)))
    axis.imshow(canvas, cmap="gray", vmin=0, vmax=1, interpolation="nearest")
    axis.axis("off")
    (h1, w1, h2, w2), step1, step2 = grids.shape, left.shape[0] / grids.shape[0], right.shape[0] / grids.shape[2]
    strongest = strongest_pairs(grids.reshape(h1 * w1, h2 * w2), top)
    peak = max((abs(value) for _, _, value in strongest), default=0.0) or 1.0
    for a, b, value in reversed(strongest):
        strength = abs(value) / peak
        start = ((a % w1 + 0.5) * left.shape[1] / w1 - 0.5, (a // w1 + 0.5) * step1 - 0.5)
        end = (left.shape[1] + gap + (b % w2 + 0.5) * right.shape[1] / w2 - 0.5, (b // w2 + 0.5) * step2 - 0.5)
        colour = _POSITIVE if value > 0 else _NEGATIVE
        axis.plot([start[0], end[0]], [start[1], end[1]], color=colour, linewidth=0.8 + 3.2 * strength,
                  alpha=0.4 + 0.55 * strength, marker="o", markersize=3 + 3 * strength)
    if title:
        axis.set_title(title, fontsize=9)
    return _save(figure, path)


def _grey(image: Tensor | np.ndarray) -> np.ndarray:
    """An image as a 2-D array in [0, 1] (channels averaged, min-max scaled)."""
    array = image.detach().cpu().double().numpy() if isinstance(image, Tensor) else np.asarray(image, dtype=float)
    if array.ndim == 3:
        array = array.mean(0)
    if array.ndim != 2:
        raise ValueError(f"relprop: an image must have shape (C, H, W) or (H, W), got {array.shape}")
    low, high = array.min(), array.max()
    return (array - low) / (high - low) if high > low else np.zeros_like(array)
