"""Model factories for the CLI tests (``--model cli_factory:small_cnn``)."""
import time

import torch
from torch import nn

from relprop.workflows.mnist import SmallCNN


def small_cnn() -> nn.Module:
    torch.manual_seed(0)
    return SmallCNN()


class _Slow(SmallCNN):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.3)  # long enough to press Ctrl-C between two images
        return super().forward(x)


def slow_cnn() -> nn.Module:
    torch.manual_seed(0)
    return _Slow()


def not_a_model() -> str:
    return "a string"


def broken() -> nn.Module:
    raise ValueError("the factory failed")
