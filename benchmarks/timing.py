"""Timing shared by the benchmark scripts: one call timed, and runs interleaved round by round (medians)."""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import statistics
import time
from collections.abc import Callable

import torch


@functools.cache
def trim_heap() -> Callable[[], None]:
    """A function that hands the free memory of the C heap back to the operating system (glibc's ``malloc_trim``).

    Every timed run then starts from the same allocator state, whatever the
    method before it left behind, and faults in the fresh memory it needs.
    """
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    if not hasattr(libc, "malloc_trim"):
        raise SystemExit("bench.py: --trim needs glibc's malloc_trim, which this C library lacks")
    return lambda: libc.malloc_trim(0)


def timed(device: str, run: Callable, *args, trim: bool = False) -> float:
    """Seconds one call ``run(*args)`` takes, its GPU work included; ``trim``: :func:`trim_heap` first."""
    synchronize = torch.cuda.synchronize if device.startswith("cuda") else lambda: None
    synchronize()
    if trim:
        trim_heap()()
    start = time.perf_counter()
    run(*args)
    synchronize()
    return time.perf_counter() - start


def interleaved(table: dict[str, Callable[[], object]], rounds: int, device: str,
                trim: bool = False) -> dict[str, float]:
    """Median seconds of each run of ``table``, after one warm-up call each, the runs taking turns round by round."""
    for run in table.values():
        run()
    times: dict[str, list[float]] = {key: [] for key in table}
    for _ in range(rounds):
        for key, run in table.items():
            times[key].append(timed(device, run, trim=trim))
    return {key: statistics.median(values) for key, values in times.items()}
