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


def zero_logits() -> nn.Module:
    """A CNN whose last layer is all zeros: every logit is 0, every map blank."""
    model = small_cnn()
    last = [module for module in model.modules() if isinstance(module, nn.Linear)][-1]
    with torch.no_grad():
        last.weight.zero_()
        last.bias.zero_()
    return model


def tiny_rgb() -> nn.Module:
    """A small colour CNN that takes images of any size (for photos)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4), nn.Flatten(),
                         nn.Linear(64, 5))
