"""Shared models and helpers for the test suite (float64, random weights, CPU)."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn


os.environ.setdefault("HF_HUB_OFFLINE", "1")  # models come from site-packages and configs, never a hub

if "PYTEST_XDIST_WORKER_COUNT" in os.environ:  # the workers share the cores: one thread each, none oversubscribed
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def randomize_batch_norms(model: nn.Module, eps: float | None = None) -> nn.Module:
    """Give every BatchNorm non-trivial statistics and affine parameters (signed scales)."""
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            with torch.no_grad():
                module.running_mean.uniform_(-0.5, 0.5)
                module.running_var.uniform_(0.5, 2.0)
                module.weight.uniform_(-1.5, 1.5)
                module.bias.uniform_(-0.5, 0.5)
            if eps is not None:
                module.eps = eps
    return model


def zero_biases(model: nn.Module) -> nn.Module:
    """Zero every bias and every BatchNorm shift, so that conservative rules conserve exactly."""
    for module in model.modules():
        with torch.no_grad():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                module.running_mean.zero_()
                module.bias.zero_()
            elif getattr(module, "bias", None) is not None:
                module.bias.zero_()
    return model


def seed_of(output: torch.Tensor, target: list[int]) -> torch.Tensor:
    """The output values at ``target``, one per example: the total relevance to expect."""
    return output[torch.arange(len(target)), target]


def gradient_times_input(model: nn.Module, x: torch.Tensor, target: list[int]) -> torch.Tensor:
    x = x.clone().requires_grad_()
    (grad,) = torch.autograd.grad(seed_of(model(x), target).sum(), x)
    return grad * x


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max()).item()


class ResidualNet(nn.Module):
    """Residual and concatenating branches written with bare torch ops, as people write them."""

    def __init__(self, classes: int = 5):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.conv_a = nn.Conv2d(8, 8, 3, padding=1)
        self.conv_b = nn.Conv2d(8, 8, 3, padding=1)
        self.branch = nn.Conv2d(8, 4, 1)
        self.relu = nn.ReLU(inplace=True)
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(12 * 4 * 4, 16)
        self.head = nn.Linear(16, classes)

    def forward(self, x):
        x = self.relu(self.bn(self.stem(x)))
        identity = x
        out = torch.relu(self.conv_a(x))
        out = out + identity                      # functional residual
        out2 = self.conv_b(out)
        out2 += identity                          # in-place residual
        out2 = F.relu(out2)
        out2 = self.pool(out2)
        merged = torch.cat([out2, self.branch(out2)], dim=1)
        merged = F.avg_pool2d(merged, 2)
        hidden = F.relu(self.fc(torch.flatten(merged, 1)))
        return self.head(hidden.view(hidden.shape[0], -1))


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct and its tokenizer, loaded once per worker (the slow tests of a real decoder)."""
    from relprop.workflows.smollm2 import load_smollm2
    return load_smollm2()

