"""A parameter table indexed by the model's token ids (TransformerLens's ``W_E[tokens, :]``) is an embedding lookup:
its vectors collect the tokens' relevance as ``nn.Embedding``'s do; indexing by other ids stays a constant."""
from __future__ import annotations

import torch
from torch import nn

import relprop


class Lookup(nn.Module):
    def __init__(self, indexed: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.indexed = indexed
        self.table = nn.Parameter(torch.randn(20, 6, dtype=torch.float64))
        self.positions = nn.Parameter(torch.randn(8, 6, dtype=torch.float64))
        self.head = nn.Linear(6, 5).double()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        places = torch.arange(ids.shape[1])
        if self.indexed:
            vectors = self.table[ids, :] + self.positions[places]
        else:
            vectors = nn.functional.embedding(ids, self.table) + nn.functional.embedding(places, self.positions)
        return self.head(torch.relu(vectors)).sum(1)


def test_indexing_a_table_by_the_tokens_is_an_embedding():
    ids = torch.tensor([[3, 7, 1, 19], [0, 2, 2, 5]])
    found = relprop.LRP(Lookup(indexed=True).eval(), "epsilon").attribute(ids, target=2)
    expected = relprop.LRP(Lookup(indexed=False).eval(), "epsilon").attribute(ids, target=2)
    assert found.shape == ids.shape and expected.abs().sum() > 0.1
    torch.testing.assert_close(found, expected, rtol=0, atol=1e-12)
