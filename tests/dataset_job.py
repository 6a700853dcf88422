"""A small dataset job for the scale-out tests: ``python dataset_job.py OUT [SECONDS_PER_BATCH]``.

Run it directly (one process) or under ``torchrun`` (several).
"""
import sys
import time

import torch
from torch import nn

from relprop.dataset import explain_dataset


class Noise(torch.utils.data.Dataset):
    """45 fixed random 1x12x12 images with labels."""

    def __init__(self, size: int = 45):
        generator = torch.Generator().manual_seed(0)
        self.images = torch.rand(size, 1, 12, 12, generator=generator)
        self.labels = torch.arange(size) % 3

    def __len__(self):
        return len(self.images)

    def __getitem__(self, index):
        return self.images[index], int(self.labels[index])


class Slow(nn.Module):
    """Identity that takes its time, so that a run can be interrupted in the middle."""

    def __init__(self, seconds: float):
        super().__init__()
        self.seconds = seconds

    def forward(self, x):
        time.sleep(self.seconds)
        return x


def model(seconds: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(Slow(seconds), nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(400, 3)).eval()


if __name__ == "__main__":
    seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
    explain_dataset(model(seconds), Noise(), sys.argv[1], composite="epsilon-plus", batch_size=4, shard_size=8,
                    target="label", progress=False)
