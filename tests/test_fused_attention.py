"""AttnLRP and CP-LRP on ``F.scaled_dot_product_attention`` through the fused kernel's own backward.

With ``(dq, dk, dv)`` the VJP of ``z = sdpa(q, k, v)`` at ``s = R / (z + eps sign z)``, the rules of the
recomputed ``softmax(q k^T * scale + mask) @ v`` give exactly ``q dq / 4, k dk / 4, v dv / 2``: equal in float64
to the recomputation (``recomputed_attention_relevance``) in every case here, and without a T x T tensor.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import relprop
from relprop._core.sdpa import attention_weights, head_groups, repeat_heads
from relprop.rules import products
from relprop.rules.products import attention_relevance, recomputed_attention_relevance
from relprop._core.stabilizers import inverse_denominator

QKV = ("query", "key", "value")
CASES = {
    "plain": {},
    "causal": {"is_causal": True},
    "causal, fewer queries than keys": {"is_causal": True, "L": 5, "S": 9},
    "boolean mask": {"mask": "bool"},
    "float mask with -inf": {"mask": "float"},
    "grouped-query": {"H": 6, "Hk": 2, "enable_gqa": True},
    "grouped-query, causal, scale": {"H": 6, "Hk": 3, "enable_gqa": True, "is_causal": True, "scale": 0.37},
    "custom scale": {"scale": 1.7},
    "cross-attention": {"L": 4, "S": 9},
    "only the query an activation": {"roles": ("query",)},
    "only the key an activation": {"roles": ("key",)},
    "query and value, constant keys": {"roles": ("query", "value")},
    "key and value, grouped-query": {"roles": ("key", "value"), "H": 6, "Hk": 2, "enable_gqa": True},
    "values next to constant weights": {"roles": ("value",)},
    "constant values": {"roles": ("query", "key")},
    "dropout (explained without it)": {"dropout_p": 0.3},
    "activation mask": {"mask": "activation", "roles": (*QKV, "attn_mask")},
    "activation mask and values": {"mask": "activation", "roles": ("value", "attn_mask")},
    "activation mask alone": {"mask": "activation", "roles": ("attn_mask",)},
}


def attention_call(B=2, H=4, Hk=None, L=7, S=None, d=5, mask=None, roles=QKV, dtype=torch.float64, seed=0,
                   **options) -> SimpleNamespace:
    """A stand-in for an attention call: its ``parts`` (SDPA's arguments by name) and ``roles``."""
    generator = torch.Generator().manual_seed(seed)
    Hk, S = Hk or H, S or L

    def randn(*shape):
        return torch.randn(*shape, generator=generator, dtype=dtype)

    masks = {None: lambda: None,
             "bool": lambda: torch.rand(B, 1, L, S, generator=generator) > 0.3,
             "float": lambda: randn(1, H, L, S).index_fill_(-1, torch.tensor([2]), -math.inf),
             "activation": lambda: randn(B, 1, L, S)}
    attn_mask = masks[mask]()
    if mask == "bool":
        attn_mask[..., 0] = True  # every query attends somewhere
    parts = {"query": randn(B, H, L, d), "key": randn(B, Hk, S, d), "value": randn(B, Hk, S, d),
             "attn_mask": attn_mask, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False,
             **options}
    return as_engine_hands_it(parts, tuple(roles))


def as_engine_hands_it(parts: dict, roles: tuple[str, ...], epsilon: float = 1e-6) -> SimpleNamespace:
    """The call as a rule reads it: ``inputs``, ``prepared`` (``1 / (z + eps sign z)``) and the kernel's VJP.

    The VJP is the backward of the kernel run without dropout on leaves for the activation arguments, as the
    engine keeps it from the forward pass.
    """
    leaves = {role: parts[role].detach().requires_grad_() for role in roles}
    tensors = {key: leaves.get(key, parts[key]) for key in ("query", "key", "value", "attn_mask")}
    with torch.enable_grad():
        out = F.scaled_dot_product_attention(tensors["query"], tensors["key"], tensors["value"],
                                             attn_mask=tensors["attn_mask"], is_causal=parts["is_causal"],
                                             scale=parts["scale"], enable_gqa=parts["enable_gqa"])

    def vjp(grad):
        return torch.autograd.grad(out, [leaves[role] for role in roles], grad, retain_graph=True)

    return SimpleNamespace(parts=parts, roles=roles, inputs=tuple(parts[role] for role in roles), vjp=vjp,
                           prepared=inverse_denominator(out.detach(), epsilon))


def relevance_of(call: SimpleNamespace, seed: int = 1) -> torch.Tensor:
    """Relevance arriving at the output, proportional to it (as a rule's would be): ``s`` of order 1."""
    parts = call.parts
    z = attention_weights(parts) @ repeat_heads(parts["value"], head_groups(parts))
    return z * torch.randn(z.shape, generator=torch.Generator().manual_seed(seed), dtype=z.dtype)


@pytest.mark.parametrize("values_only", [False, True], ids=["AttnLRP", "CP-LRP"])
@pytest.mark.parametrize("case", list(CASES))
def test_the_fused_backward_equals_the_recomputed_rules(case, values_only):
    call = attention_call(**CASES[case])
    relevance = relevance_of(call)
    fused = attention_relevance(call, relevance, values_only)
    recomputed = recomputed_attention_relevance(call, relevance, values_only)
    assert len(fused) == len(recomputed) == len(call.roles)
    for role, a, b in zip(call.roles, fused, recomputed):
        assert (a is None) == (b is None), role
        if a is not None:
            assert a.shape == call.parts[role].shape and a.dtype == torch.float64
            # to 1e-12 of the largest relevance (of order 1 here): float64 rounding of two orders of summation
            tolerance = 1e-12 * max(1.0, b.abs().max().item())
            assert torch.allclose(a, b, rtol=0, atol=tolerance), (role, (a - b).abs().max().item())


def test_attnlrp_shares_of_the_fused_backward():
    """``q dq / 4 + k dk / 4 + v dv / 2`` (``v dv`` for CP-LRP) with the VJP taken here by plain autograd."""
    call = attention_call(is_causal=True)
    relevance = relevance_of(call)
    leaves = [call.parts[key].clone().requires_grad_() for key in QKV]
    z = F.scaled_dot_product_attention(*leaves, is_causal=True)
    grads = torch.autograd.grad(z, leaves, relevance / (z.detach() + 1e-6 * torch.where(z >= 0, 1.0, -1.0)))
    q, k, v = (x.detach() * g for x, g in zip(leaves, grads))
    fused = attention_relevance(call, relevance, False)
    for got, want in zip(fused, (q / 4, k / 4, v / 2)):
        assert torch.allclose(got, want, rtol=0, atol=1e-12)
    (values,) = attention_relevance(as_engine_hands_it(call.parts, ("value",)), relevance, True)
    assert torch.allclose(values, v, rtol=0, atol=1e-12)


class _Outputs(TorchDispatchMode):
    """Every aten op run, with the size of its largest output."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        sizes = [t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        self.ops.append((str(func), max(sizes, default=0)))
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", ["plain", "causal", "boolean mask", "float mask with -inf", "grouped-query"])
def test_no_scores_are_built_on_the_fused_path(case, dtype):
    """No op makes a tensor of a head's T x T scores (a mask of one head, the model's own, may be made float)."""
    options = {"B": 1, "H": 4, "L": 128, "d": 8, "dtype": dtype, **CASES[case]}
    B, H, L = options["B"], options["H"], options["L"]
    call = attention_call(**options)
    relevance = torch.randn(B, H, L, 8, dtype=dtype)
    with _Outputs() as seen:
        attention_relevance(call, relevance, False)
    names = {name for name, _ in seen.ops}
    assert not names & {"aten._softmax.default", "aten.bmm.default", "aten.matmul.default"}, names
    assert max(size for _, size in seen.ops) < B * H * L * L, seen.ops
    with _Outputs() as seen:  # the reference does build them
        recomputed_attention_relevance(call, relevance, False)
    assert max(size for _, size in seen.ops) >= B * H * L * L


class _Attention(nn.Module):
    """A grouped-query causal self-attention block: projections around the fused kernel."""

    def __init__(self, width=12, heads=6, kv_heads=2):
        super().__init__()
        self.heads, self.kv_heads, self.head = heads, kv_heads, width // heads
        self.q = nn.Linear(width, width)
        self.kv = nn.Linear(width, 2 * kv_heads * self.head)
        self.out = nn.Linear(width, 3)

    def forward(self, x):
        B, T, _ = x.shape
        q = self.q(x).view(B, T, self.heads, self.head).transpose(1, 2)
        k, v = self.kv(x).view(B, T, 2, self.kv_heads, self.head).permute(2, 0, 3, 1, 4)
        z = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.out(z.transpose(1, 2).reshape(B, T, -1)).sum(1)


@pytest.mark.parametrize("preset", ["attnlrp", "cp-lrp"])
def test_a_model_explains_the_same_as_with_the_recomputed_rule(preset, monkeypatch):
    torch.manual_seed(0)
    model = _Attention().double().eval()
    x = torch.randn(2, 9, 12, dtype=torch.float64)
    fused = relprop.LRP(model, preset).attribute(x, target=1)
    monkeypatch.setattr(products, "attention_relevance", recomputed_attention_relevance)
    recomputed = relprop.LRP(model, preset).attribute(x, target=1)
    assert torch.allclose(fused, recomputed, rtol=0, atol=1e-12), (fused - recomputed).abs().max().item()
    assert fused.abs().sum() > 0


class _DroppedAttention(nn.Module):
    """Self-attention whose kernel call asks for dropout (as a model in training mode would), output unprojected."""

    def __init__(self, dropout_p: float, width=8, heads=2):
        super().__init__()
        self.dropout_p, self.heads = dropout_p, heads
        self.qkv = nn.Linear(width, 3 * width)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        z = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout_p, is_causal=True)
        return z.transpose(1, 2).flatten(1)


@pytest.mark.parametrize("preset", ["attnlrp", "cp-lrp"])
def test_an_attention_with_dropout_is_explained_without_it(preset):
    torch.manual_seed(0)
    dropped, plain = _DroppedAttention(0.5).double().eval(), _DroppedAttention(0.0).double().eval()
    plain.load_state_dict(dropped.state_dict())
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    seed = torch.randn(2, 5 * 8, dtype=torch.float64)
    explained = [relprop.LRP(model, preset).record(x).relevance(seed)[0] for model in (dropped, plain)]
    torch.manual_seed(1)
    with torch.no_grad():
        assert not torch.equal(dropped(x), plain(x))  # the model's own output keeps its dropout
    assert torch.allclose(explained[0], explained[1], rtol=0, atol=1e-12)
    assert explained[1].abs().sum() > 0
