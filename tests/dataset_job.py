"""A small dataset job for the scale-out tests: ``python dataset_job.py OUT [SECONDS_PER_BATCH] [--wrap=ddp|fsdp]
[--concepts]``.

Run it directly (one process) or under ``torchrun`` (several). With ``--concepts`` it runs
``relprop.workflows.concepts.reference_samples`` into OUT instead of ``explain_dataset``. With ``--wrap``
the model is wrapped in DistributedDataParallel, or its layers and itself are
sharded with FSDP2's ``fully_shard``; the job then checks that the model is in
training mode, and sharded, as before after the run.
"""
import sys
import time

import torch
from torch import nn

from relprop.workflows.concepts import reference_samples
from relprop.workflows.dataset import explain_dataset


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


def wrapped(network: nn.Module, how: str) -> nn.Module:
    """The model in DistributedDataParallel, or its layers and itself sharded with FSDP2, in training mode."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    network.train()  # explained in eval mode all the same; the flags must come back
    if how == "ddp":
        return nn.parallel.DistributedDataParallel(network)
    for layer in (network[1], network[4]):
        fully_shard(layer)
    fully_shard(network)
    assert sharded(network)
    return network


def sharded(network: nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return all(isinstance(parameter, DTensor) for parameter in network.parameters())


if __name__ == "__main__":
    how = next((argument.split("=")[1] for argument in sys.argv if argument.startswith("--wrap=")), None)
    arguments = [argument for argument in sys.argv[1:] if not argument.startswith("--")]
    seconds = float(arguments[1]) if len(arguments) > 1 else 0.0
    network = wrapped(model(seconds), how) if how else model(seconds)
    if "--concepts" in sys.argv:
        reference_samples(network, Noise(), ["1", "4"], composite="epsilon-plus", top_k=5, batch_size=4,
                          shard_size=8, out=arguments[0])
    else:
        explain_dataset(network, Noise(), arguments[0], composite="epsilon-plus", batch_size=4, shard_size=8,
                        target="label", progress=False)
    if how:
        assert all(module.training for module in network.modules()), "training flags not restored"
    if how == "fsdp":
        assert sharded(network), "left unsharded"
