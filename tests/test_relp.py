"""RelP's rules (presets relp and relp-ah, rules.Identity, rules.PlainGradient) in closed form, float64."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import relprop
from relprop import composites, rules

EPS = 1e-6


def stabilised(z: torch.Tensor, eps: float) -> torch.Tensor:
    """``z + eps sign z`` with ``sign(0) = +1``: the reference's ``stabilize``."""
    return z + eps * torch.where(z < 0, -1.0, 1.0).to(z)


class Gated(nn.Module):
    """``down(silu(gate x) * up x)``: a gated MLP."""

    def __init__(self, width: int = 5, hidden: int = 7):
        super().__init__()
        self.gate, self.up = nn.Linear(width, hidden), nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Plain(nn.Module):
    """``out(silu(inner x))``: one activation between two linear maps."""

    def __init__(self):
        super().__init__()
        self.inner, self.out = nn.Linear(4, 6), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.silu(self.inner(x)))


class Attention(nn.Module):
    """One causal attention head at the last position: ``out(sdpa(q x, k x, v x))``, or written out with its
    weights held."""

    def __init__(self, held: bool = False, eager: bool = False):
        super().__init__()
        self.q, self.k, self.v, self.out = (nn.Linear(4, 4) for _ in range(4))
        self.held, self.eager = held, eager

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(x), self.k(x), self.v(x)
        if not (self.held or self.eager):
            return self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True))[:, -1]
        scores = torch.matmul(q, k.transpose(-2, -1)) / 2.0 + torch.full((3, 3), -torch.inf).triu(1).to(x)
        weights = scores.softmax(-1)
        return self.out(torch.matmul(weights.detach() if self.held else weights, v))[:, -1]


def made(module: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    return module.double().eval()


def test_the_identity_rule_passes_act_over_the_stabilised_input():
    model = made(Plain())
    x = torch.randn(2, 4, dtype=torch.float64)
    with torch.no_grad():  # one pre-activation close to 0, where the stabiliser matters
        model.inner.bias[0] -= (model.inner(x)[0, 0] - 3e-6).item()
    z = model.inner(x).detach()
    seed = torch.zeros(2, 3, dtype=torch.float64)
    seed[:, 1] = 1.0
    expected = {}
    for eps in (EPS, 0.0):
        # LRP-0 in gradient form is the plain VJP; the activation's factor is silu(z) / (z + eps sign z)
        g_z = (seed @ model.out.weight) * F.silu(z) / stabilised(z, eps)
        expected[eps] = x * (g_z @ model.inner.weight)
    for eps in (EPS, 0.0):
        gradient_form = relprop.LRP(model, composites.RelP(epsilon=eps)).attribute(x, target=1)
        # the same rule carrying relevance itself (a composite that is no gradient form)
        carried = relprop.LRP(model, relprop.Composite(0.0, func_map={F.silu: rules.Identity(eps)})).attribute(
            x, target=1)
        for found in (gradient_form, carried):
            torch.testing.assert_close(found, expected[eps], rtol=1e-10, atol=1e-13)
    assert (expected[EPS] - expected[0.0]).abs().max() > 1e-3  # the stabiliser is seen
    assert rules.Identity(EPS).accepts is not None and repr(rules.Identity(EPS)) == "Identity(epsilon=1e-06)"


def test_the_half_rule_gives_each_factor_of_a_gated_product_half():
    model = made(Gated())
    x = torch.randn(3, 5, dtype=torch.float64)
    gate, up = model.gate(x).detach(), model.up(x).detach()
    seed = torch.zeros(3, 3, dtype=torch.float64)
    seed[:, 2] = 1.0
    g_h = seed @ model.down.weight
    g_up = g_h * F.silu(gate) / 2
    g_gate = g_h * up / 2 * F.silu(gate) / stabilised(gate, EPS)
    expected = x * (g_up @ model.up.weight + g_gate @ model.gate.weight)
    found = relprop.LRP(model, "relp").attribute(x, target=2)
    torch.testing.assert_close(found, expected, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("eager", [False, True], ids=["fused", "eager"])
def test_relp_passes_the_plain_gradient_through_attention(eager):
    """Linear maps and attention alone (fused, or written out with matmul and softmax): every rule is the plain
    gradient, so relp is gradient x input."""
    model = made(Attention(eager=eager))
    x = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    (grad,) = torch.autograd.grad(model(x)[:, 1].sum(), x)
    found = relprop.LRP(model, "relp").attribute(x.detach(), target=1)
    torch.testing.assert_close(found, x.detach() * grad, rtol=1e-10, atol=1e-13)


def test_relp_ah_holds_the_attention_weights():
    model = made(Attention())
    held = made(Attention(held=True))  # the same weights: made from the same seed
    x = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    (grad,) = torch.autograd.grad(held(x)[:, 1].sum(), x)
    torch.testing.assert_close(model(x), held(x), rtol=1e-12, atol=1e-12)  # the same model, written out
    found = relprop.LRP(model, "relp-ah").attribute(x.detach(), target=1)
    torch.testing.assert_close(found, x.detach() * grad, rtol=1e-10, atol=1e-13)


def test_the_plain_gradient_is_the_same_rule_in_both_forms():
    """rules.PlainGradient on a product of two activations: R_x = x VJP(R / z), and G_x = VJP(G)."""
    model = made(Gated())
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    (grad,) = torch.autograd.grad(model(x)[:, 0].sum(), x)
    plain = rules.PlainGradient()
    for composite in (relprop.Composite(0.0, func_map={torch.mul: plain, F.silu: plain}),
                      composites.RelP(func_map={torch.mul: plain, F.silu: plain})):
        found = relprop.LRP(model, composite).attribute(x.detach(), target=0)
        torch.testing.assert_close(found, x.detach() * grad, rtol=1e-10, atol=1e-12)


def test_the_presets_by_name():
    assert isinstance(composites.get("relp"), composites.RelP) and not composites.get("relp").hold_attention
    assert isinstance(composites.get("relp-ah"), composites.RelPAH) and composites.get("relp-ah").hold_attention
    assert repr(composites.get("relp-ah", epsilon=0.0)) == "RelPAH(epsilon=0.0)"
    assert composites.get("relp").gradient_form


@pytest.fixture(scope="module")
def llama_pair():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=32)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval().double()
    generator = torch.Generator().manual_seed(1)
    clean = torch.randint(0, 40, (2, 6), generator=generator)
    corrupted = clean.clone()
    corrupted[:, 1] = (corrupted[:, 1] + 7) % 40
    return model, clean, corrupted


def test_epsilon_zero_everywhere_equals_relp_with_attention_held(llama_pair):
    model, clean, corrupted = llama_pair
    kinds = ("heads", "mlp_out", "residual")
    held = relprop.patching(model, clean, corrupted, (3, 5), components=kinds, composite=composites.RelPAH(0.0))
    in_gradient_form = composites.Epsilon(0.0)
    in_gradient_form.gradient_form = True  # the same rules, carried as R / x: the same numbers in float64
    for composite, tolerance in ((in_gradient_form, 1e-13), (composites.Epsilon(0.0), 1e-6)):
        # carried as relevance, Epsilon(0) divides by small z and back: the same up to that rounding
        found = relprop.patching(model, clean, corrupted, (3, 5), components=kinds, composite=composite)
        for kind in kinds:
            scale = held[kind].abs().max()
            torch.testing.assert_close(found[kind], held[kind], rtol=0, atol=tolerance * scale)
