"""What a recorded forward pass keeps for its rules: no activation that no rule reads, counted by storage."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import relprop
from relprop.engine import OpCall


def _calls(out: Tensor) -> list[OpCall]:
    """The op calls of the relevance nodes behind ``out``."""
    calls, seen, stack = [], set(), [out.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(getattr(node, "call", None), OpCall):
            calls.append(node.call)
        stack.extend(parent for parent, _ in node.next_functions)
    return calls


def _held(calls: list[OpCall]) -> dict[int, int]:
    """Bytes by storage address of the inputs and outputs that ``calls`` keep (a storage shared counts once)."""
    tensors = [x for call in calls for x in (*call.inputs, call.kept_output) if x is not None and not x.is_meta]
    return {x.untyped_storage().data_ptr(): x.untyped_storage().nbytes() for x in tensors}


class _Chain(nn.Module):
    """Two dense layers around two activations: the first activation's output is read by the second alone."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.last = nn.Linear(16, 32), nn.Linear(32, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.last(torch.tanh(torch.tanh(self.first(x))))


def relevance_form(preset):
    """The preset carrying relevance itself, one node per op, whose rules' flags say what each keeps (AttnLRP and
    CP-LRP carry relevance per unit of activation by default: ``tests/test_gradient_form.py``)."""
    composite = relprop.composites.get(preset)
    composite.gradient_form = False
    return composite


def test_an_op_whose_rule_reads_its_input_shape_alone_keeps_no_input_memory():
    torch.manual_seed(0)
    model, x = _Chain().eval(), torch.randn(8, 16)
    explained = relprop.LRP(model, relevance_form("attnlrp")).record(x)
    calls = _calls(explained.logits)
    passes = [call for call in calls if call.name == "torch.tanh"]
    assert len(passes) == 2 and all(not call.keeps_inputs for call in passes)
    assert [tuple(x.shape) for x in passes[0].inputs] == [(8, 32)]  # stand-ins of the shapes the rule reads
    # x, the first layer's output (its rule's denominator, and the first tanh's input), the second tanh's
    # output (the last layer's input) and the logits: the first tanh's output is freed
    assert sorted(_held(calls).values()) == sorted([8 * 16 * 4, 8 * 32 * 4, 8 * 32 * 4, 8 * 4 * 4])
    (relevance,) = explained.relevance(relprop.output_relevance(explained.logits, 1))
    assert torch.equal(relevance, relprop.LRP(model, relevance_form("attnlrp")).attribute(x, target=1))


class _Attention(nn.Module):
    """Fused attention behind a gated normalisation: the gated product's output is read by no rule, the
    attention's by its rule (``1 / z``), in the memory the kernel's own graph saved for its backward."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(16, 48), nn.Linear(16, 4)

    def forward(self, x: Tensor) -> Tensor:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)  # a statistic gates x
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, 8)).permute(2, 0, 3, 1, 4).unbind(0)  # (N, heads, T, 8) each
        return self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(-2, -3).flatten(-2))


def test_rules_that_prepare_for_other_calls_keep_no_output_of_a_gated_product_and_attention_none_of_its_own():
    torch.manual_seed(0)
    model, x = _Attention().eval(), torch.randn(1, 6, 16)
    for preset in ("attnlrp", "cp-lrp"):
        explained = relprop.LRP(model, relevance_form(preset)).record(x)
        calls = _calls(explained.logits)
        (gated,) = [call for call in calls if call.factors == (None, "statistic")]
        assert gated.kept_output is None
        (attention,) = [call for call in calls if call.kind == "attention"]
        graph_output = attention._graph[1]  # what the kernel's autograd node saved for its backward
        assert attention.kept_output.data_ptr() == graph_output.data_ptr()
        (relevance,) = explained.relevance(relprop.output_relevance(explained.logits, (-1, 2)))
        assert torch.equal(relevance, relprop.LRP(model, relevance_form(preset)).attribute(x, target=(-1, 2)))
