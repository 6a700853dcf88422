"""Explanations that show themselves: a text's token relevance and an image's relevance, in Jupyter and as files.

An attribution returns a plain tensor; these small holders pair it with what it explains (the tokens, the
picture) so that a notebook shows it: Jupyter calls ``_repr_html_`` and ``_repr_png_`` on the last value of a
cell. The pictures are :mod:`relprop.viz`'s own (:func:`relprop.viz.text_html`, :func:`relprop.viz.heatmap`,
:func:`relprop.viz.overlay`), with their colours and scaling.

>>> import torch
>>> from relprop.viz.displays import ImageRelevance, TokenRelevance
>>> TokenRelevance(["a", "good", "film"], torch.tensor([0.0, 2.0, -1.0])).html().count("<span")
3
>>> ImageRelevance(torch.randn(3, 8, 12)).picture().shape
(8, 12, 3)
"""
from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from relprop import viz

__all__ = ["TokenRelevance", "ImageRelevance"]


@dataclass(repr=False)
class TokenRelevance:
    """The relevance of each token of a text for one output: a class of a text classifier, a next token.

    Parameters
    ----------
    tokens : sequence of str
        The tokens as text, in order.
    relevance : Tensor or array
        One value per token (any shape with ``len(tokens)`` entries, e.g. the ``(1, T)`` of
        :meth:`relprop.LRP.attribute` on token ids).
    cmap : str
        The colour map (:func:`relprop.viz.colormap`); each token's background is its relevance over the largest
        absolute relevance of the text.
    """

    tokens: Sequence[str]
    relevance: torch.Tensor | np.ndarray
    cmap: str = "bwr"

    def __post_init__(self) -> None:
        values = torch.as_tensor(self.relevance).detach().cpu().reshape(-1)
        if values.numel() != len(self.tokens):
            raise ValueError(f"relprop: {len(self.tokens)} tokens but {values.numel()} relevance values")
        self.relevance = values

    def __repr__(self) -> str:
        return f"TokenRelevance({len(self.tokens)} tokens)"

    def html(self) -> str:
        """The tokens as coloured spans (:func:`relprop.viz.text_html`); hovering shows each value."""
        return viz.text_html(self.tokens, torch.as_tensor(self.relevance), self.cmap)

    def _repr_html_(self) -> str:
        return self.html()


@dataclass(repr=False)
class ImageRelevance:
    """The relevance of an image's pixels: a heatmap, or with ``image`` the heatmap painted over it.

    Parameters
    ----------
    relevance : Tensor or array
        ``(C, H, W)`` (channels are summed) or ``(H, W)``, one example.
    image : Tensor or array, optional
        The picture explained, ``(C, H, W)`` or ``(H, W)``: the overlay (:func:`relprop.viz.overlay`) instead of the
        bare heatmap (:func:`relprop.viz.heatmap`).
    cmap, clip :
        As for :func:`relprop.viz.heatmap`.
    scale : int
        Each relevance pixel is drawn ``scale`` x ``scale`` pixels large.
    """

    relevance: torch.Tensor | np.ndarray
    image: torch.Tensor | np.ndarray | None = None
    cmap: str = "bwr"
    clip: float | None = None
    scale: int = 1

    def __post_init__(self) -> None:
        if self.scale < 1:
            raise ValueError(f"relprop: scale is a whole number of pixels, at least 1, got {self.scale}")
        if self.image is not None and tuple(np.shape(self.image))[-2:] != tuple(np.shape(self.relevance))[-2:]:
            raise ValueError(f"relprop: the image of shape {tuple(np.shape(self.image))} and the relevance of shape "
                             f"{tuple(np.shape(self.relevance))} differ in height and width")

    def __repr__(self) -> str:
        height, width = tuple(np.shape(self.relevance))[-2:]
        return f"ImageRelevance({height} x {width}{', over an image' if self.image is not None else ''})"

    def picture(self) -> np.ndarray:
        """The picture, ``(H * scale, W * scale, 3)`` uint8."""
        if self.image is None:
            shown = viz.heatmap(self.relevance, self.cmap, self.clip)
        else:
            shown = viz.overlay(self.image, self.relevance, self.cmap, self.clip)
        return np.repeat(np.repeat(shown, self.scale, axis=0), self.scale, axis=1) if self.scale > 1 else shown

    def png(self) -> bytes:
        """The picture as PNG bytes."""
        buffer = io.BytesIO()
        viz.plt.imsave(buffer, self.picture(), format="png")
        return buffer.getvalue()

    def _repr_png_(self) -> bytes:
        return self.png()
