"""A model factory for the CLI tests (``--model cli_factory:small_cnn``)."""
import torch

from relprop.demo import SmallCNN


def small_cnn():
    torch.manual_seed(0)
    return SmallCNN()
