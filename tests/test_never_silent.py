"""Model patterns that were once explained silently wrong (found on the timm and Hugging Face zoos), each minimal.

Every model here is bias-free or compared with Gradient x Input, so a wrong share shows as a number.
"""
import warnings

import pytest
import torch
import torch.nn.functional as F
from conftest import relative_error
from torch import nn

import relprop
from relprop.engine import ConservationWarning

LRP0 = relprop.composites.Epsilon(epsilon=0.0)


def _gradient_times_input(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    x = x.clone().requires_grad_()
    (grad,) = torch.autograd.grad(model(x)[:, 0].sum(), x)
    return grad * x


class _Net(nn.Module):
    """``head(body(lin(x)))`` with ``body`` one pattern; bias-free, float64."""

    def __init__(self, body, width: int = 4):
        super().__init__()
        self.body = body
        self.lin, self.lin2 = nn.Linear(4, width, bias=False), nn.Linear(4, width, bias=False)
        self.scale = nn.Parameter(torch.rand(width) + 0.5)
        self.tail = nn.Linear(8, width, bias=False)  # for patterns that make 8 features
        self.head = nn.Linear(width, 3, bias=False)

    def forward(self, x):
        return self.head(self.body(self, self.lin(x)))


SCALED_BY_A_PARAMETER = {
    "view": lambda m, h: h * m.scale.view(1, -1),
    "reshape-mul": lambda m, h: h.mul(m.scale.reshape(1, -1)),
    "cat-expand": lambda m, h: h * torch.cat([m.scale[:2], m.scale[2:]]).expand(2, -1),
    "chunk": lambda m, h: h * m.scale.chunk(2)[0].repeat(2),
}


@pytest.mark.parametrize("pattern", SCALED_BY_A_PARAMETER)
def test_a_tensor_made_from_parameters_is_a_constant(pattern):
    """``x * scale.view(1, C)`` scales the activation: the parameter takes no half of the relevance."""
    model = _Net(SCALED_BY_A_PARAMETER[pattern]).double().eval()
    x = torch.randn(2, 4, dtype=torch.float64)
    relevance = relprop.LRP(model, LRP0).attribute(x, target=0)
    torch.testing.assert_close(relevance, _gradient_times_input(model, x), rtol=1e-10, atol=1e-12)


class _Gated(nn.Module):
    def __init__(self, split: bool):
        super().__init__()
        self.split = split
        self.conv = nn.Conv2d(3, 4, 3, padding=1, bias=False)
        self.gate = nn.Conv2d(3, 8, 3, stride=2, padding=1, bias=False)
        self.head = nn.Linear(4, 2, bias=False)

    def forward(self, x):
        y = self.conv(x)
        if self.split:  # iFormer: sigmoid(g(x)).chunk(2)
            a, b = torch.sigmoid(self.gate(x)).chunk(2, 1)
            y = y * F.interpolate(a, size=y.shape[-2:]) + y * F.interpolate(b, size=y.shape[-2:])
        else:  # GhostNetV3: out * F.interpolate(sigmoid(r))
            y = y * F.interpolate(torch.sigmoid(self.gate(x)[:, :4]), size=y.shape[-2:], mode="nearest")
        return self.head(y.mean((2, 3)))


@pytest.mark.parametrize("split", [False, True])
def test_a_gate_stays_a_gate_through_interpolation_and_chunk(split):
    """The signal takes all the relevance: it sums to the output on a bias-free net (was off by up to 1e5)."""
    model = _Gated(split).double().eval()
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    relevance = relprop.LRP(model, LRP0).attribute(x, target=0)
    torch.testing.assert_close(relevance.sum((1, 2, 3)), model(x)[:, 0], rtol=1e-10, atol=0)


def _fresh_buffer(m, h):  # DeepSeek-V3's expand_kv
    buf = h.new_empty(2, 8)
    buf[:, :4].copy_(h)
    buf[:, 4:].copy_(h * 2)
    return buf


def _experts(m, h):  # the eager experts loop of Mixtral & co.: each token's rows added into a zero buffer
    out = torch.zeros(2, 8, dtype=h.dtype)
    out.index_add_(0, torch.tensor([0, 1]), torch.cat([h, h], 1))
    out.index_add_(0, torch.tensor([1, 0]), torch.cat([h, -h], 1).flip(0))
    return out


def _scatter_add(m, h):
    return torch.zeros(2, 8, dtype=h.dtype).scatter_add(1, torch.tensor([[0, 1, 2, 2], [3, 3, 4, 5]]), h)


def _index_put_accumulate(m, h):
    out = torch.zeros(2, 8, dtype=h.dtype)
    return out.index_put_((torch.tensor([0, 1, 1]), torch.tensor([0, 0, 0])), h[[0, 1, 1], 0], accumulate=True)


def _self_expression(m, h):  # timm MViTv2: attn[:, 1:, 1:] = attn[:, 1:, 1:] + rel
    a = torch.cat([h, h], 1).reshape(2, 2, 4)
    a[:, 1:, 1:] = a[:, 1:, 1:] + m.scale[:3]
    return a.reshape(2, 8)


def _read_then_overwritten(m, h):  # plain autograd allows it: `add` saves nothing
    a = torch.cat([h, h], 1)
    y = a + 1.0
    a[:, 0] = 0.0
    a.relu_()
    return y * 2 + a


def _scatter_reduce(m, h):
    index = torch.tensor([[0, 1, 2, 2], [3, 3, 4, 5]])
    summed = torch.zeros(2, 8, dtype=h.dtype).scatter_reduce(1, index, h, "sum")
    return summed + torch.zeros(2, 8, dtype=h.dtype).scatter_reduce(1, index, h, "amax", include_self=False)


WRITES = {"scatter_reduce": _scatter_reduce, "fresh buffer": _fresh_buffer, "experts": _experts, "scatter_add": _scatter_add,
          "index_put accumulate": _index_put_accumulate, "self expression": _self_expression,
          "read then overwritten": _read_then_overwritten}


@pytest.mark.parametrize("pattern", WRITES)
def test_writes_into_buffers_and_in_place_after_a_read(pattern):
    """LRP-0 equals Gradient x Input where activations are written into buffers (was: errors, or all zeros)."""
    model = _Net(lambda m, h: m.tail(WRITES[pattern](m, h))).double().eval()
    x = torch.randn(2, 4, dtype=torch.float64)
    relevance = relprop.LRP(model, LRP0).attribute(x, target=0)
    expected = _gradient_times_input(model, x)
    assert relative_error(relevance, expected) < 1e-10


def _fold(m, h):  # VOLO's outlook attention: overlapping patches added back into an image
    patches = F.unfold(torch.cat([h, h], 1).reshape(2, 2, 2, 2), 2, padding=1)  # (2, 8, 9), overlapping
    return F.fold(patches * 0.5, (2, 2), 2, padding=1).reshape(2, 8)


WRITES["fold"] = _fold


MULTILINEAR = {
    "addcmul affine": lambda m, h: torch.addcmul(torch.zeros(4, dtype=h.dtype), m.scale, h),  # ResMLP
    "addcmul": lambda m, h: torch.addcmul(h, h, h.flip(0), value=0.5),
    "addcdiv": lambda m, h: h.addcdiv(h, h.detach().abs() + 1),
    "lerp": lambda m, h: torch.lerp(h, h.flip(1), 0.3),
    "baddbmm": lambda m, h: torch.zeros(2, 4, 4, dtype=h.dtype).baddbmm(h[:, :, None], h[:, None, :], alpha=0.5)
    .sum(-1),
    "addbmm": lambda m, h: torch.zeros(4, 4, dtype=h.dtype).addbmm(h[:, :, None], h[:, None, :]).sum(0)
    .expand(2, 4) / 2,
    "addmv": lambda m, h: torch.stack([torch.addmv(torch.zeros(4, dtype=h.dtype), m.lin2.weight, r) for r in h]),
    "addmm of activations": lambda m, h: torch.addmm(torch.zeros(2, 2, dtype=h.dtype), h, h.T),
    "einsum of three": lambda m, h: torch.einsum("bi,bi,bj->bj", h, h, h),
    "norm (ConvNeXt-V2 GRN)": lambda m, h: h * (h.norm(p=2, dim=1, keepdim=True) / (h.norm(dim=1).mean() + 1e-6)),
    "vector_norm": lambda m, h: torch.linalg.vector_norm(h, dim=1, keepdim=True).expand(2, 4),
    "grouped_mm": lambda m, h: torch._grouped_mm(h, torch.stack([m.lin2.weight.T, m.lin2.weight]),
                                                 offs=torch.tensor([1, 2], dtype=torch.int32)),
    "grid_sample": lambda m, h: F.grid_sample(h.reshape(2, 1, 2, 2), torch.tanh(h[:, None, None, :2]).expand(
        2, 2, 2, 2) * 0.5, align_corners=False).reshape(2, 4),
}


#: patterns that mix the examples of the batch: relevance is conserved over the batch, not per example
MIXING = {"addcmul", "addbmm", "addmm of activations"}


@pytest.mark.parametrize("pattern", MULTILINEAR)
def test_fused_and_multilinear_ops_conserve(pattern):
    """Ops once without a rule: no UnhandledOpWarning (an error here), relevance sums to the output."""
    model = _Net(MULTILINEAR[pattern], width=2 if pattern == "addmm of activations" else 4)
    if pattern == "grouped_mm":  # float32 only
        model = model.eval()
        x = torch.randn(2, 4)
        tolerance = 1e-5
    else:
        model, x, tolerance = model.double().eval(), torch.randn(2, 4, dtype=torch.float64), 1e-10
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConservationWarning)
        relevance = relprop.LRP(model, relprop.composites.CPLRP() if pattern == "lerp" else LRP0).attribute(
            x, target=0)
    totals, expected = relevance.sum(1), model(x)[:, 0].detach()
    if pattern in MIXING:
        totals, expected = totals.sum(), expected.sum()
    torch.testing.assert_close(totals, expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("preset", ["cp-lrp", "attnlrp"])
def test_tanh_soft_capping_is_a_scaling(preset):
    """Gemma-2's ``tanh(z / 30) * 30``: CP-LRP gave all-zero relevance (the product took tanh for a gate)."""
    model = _Net(lambda m, h: torch.tanh(h / 30.0) * 30.0).double().eval()
    x = torch.randn(2, 4, dtype=torch.float64)
    relevance = relprop.LRP(model, preset).attribute(x, target=0)
    torch.testing.assert_close(relevance.sum(1), model(x)[:, 0].detach(), rtol=1e-10, atol=0)


class _SpaceToDepth(nn.Module):
    """tresnet's stem: a space-to-depth before the first convolution (48 channels from 3)."""

    def __init__(self, rearranged: bool = True):
        super().__init__()
        self.rearranged = rearranged
        self.conv, self.conv2 = nn.Conv2d(12, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        x = F.pixel_unshuffle(x, 2) if self.rearranged else x
        return self.head(F.relu(self.conv2(F.relu(self.conv(x)))).mean((2, 3)))


def test_box_bounds_follow_the_input_through_routing_ops():
    """Per-channel bounds of the model input become the bound images of the first layer's rearranged input."""
    model = _SpaceToDepth().double().eval()
    x = torch.rand(2, 3, 8, 8, dtype=torch.float64) * 2 - 1
    low = torch.tensor([-1.0, -1.5, -2.0], dtype=torch.float64).view(1, 3, 1, 1)
    relevance = relprop.LRP(model, relprop.composites.EpsilonGammaBox(low, -low)).attribute(x, target=0)
    plain = _SpaceToDepth(rearranged=False).double().eval()
    plain.load_state_dict(model.state_dict())
    low_image = F.pixel_unshuffle(low.expand(1, 3, 8, 8), 2)
    expected = relprop.LRP(plain, relprop.composites.EpsilonGammaBox(low_image, -low_image)).attribute(
        F.pixel_unshuffle(x, 2), target=0)
    torch.testing.assert_close(F.pixel_unshuffle(relevance, 2), expected, rtol=1e-12, atol=1e-15)


def test_a_preset_that_needs_arguments_says_which():
    with pytest.raises(ValueError, match=r"'epsilon-gamma-box' needs the range of the model's inputs .*"
                                         r"normalization='imagenet' .* low=\.\.\. and high=\.\.\."):
        relprop.LRP(_SpaceToDepth(), "epsilon-gamma-box")


def test_relevance_of_a_learned_token_shows_as_absorbed_in_the_audit():
    """A ViT's class token joins the patches through ``torch.cat``: its share stops there, and the audit says so."""
    import torchvision

    model = torchvision.models.VisionTransformer(image_size=16, patch_size=8, num_layers=1, num_heads=2,
                                                 hidden_dim=16, mlp_dim=32, num_classes=3).double().eval()
    with torch.no_grad():
        model.class_token.normal_()
        model.heads.head.weight.normal_()
    x = torch.randn(1, 3, 16, 16, dtype=torch.float64)
    report = relprop.audit(model, x, target=0, composite="attnlrp")
    (cat,) = [row for row in report.rows if row.op == "torch.cat"]
    assert abs(cat.absorbed) > 1e-3 * abs(cat.relevance_in)
    assert abs(report.unaccounted) < 1e-9 * abs(report.seed_total)


class _Doubling(relprop.rules.Pass):
    """A broken rule that claims to conserve."""

    def propagate(self, call, relevance):
        return tuple(2 * r for r in super().propagate(call, relevance))


class _Undefined(relprop.rules.Pass):
    def propagate(self, call, relevance):
        return tuple(r / 0.0 for r in super().propagate(call, relevance))


class _Dropping(relprop.rules.Pass):
    def propagate(self, call, relevance):
        return tuple(0 * r for r in super().propagate(call, relevance))


@pytest.mark.parametrize("rule, message", [(_Doubling(), "created relevance: it handed on"),
                                           (_Undefined(), "hands on NaN or infinite relevance"),
                                           (_Dropping(), "dropped all the relevance that arrived")])
def test_the_guard_names_the_op_whose_rule_creates_or_breaks_relevance(rule, message):
    model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Tanh(), nn.Linear(4, 3, bias=False)).double().eval()
    with torch.no_grad():  # positive weights and inputs: positive relevance, which doubling makes exceed its mass
        for layer in (model[0], model[2]):
            layer.weight.abs_()
    model[1].rule = rule
    x = torch.rand(2, 4, dtype=torch.float64)
    with pytest.warns(ConservationWarning, match=rf"torch.tanh in module '1' with rule .* {message}"):
        relprop.LRP(model, LRP0).attribute(x, target=0)
    with pytest.raises(relprop.UnsupportedOpError, match=message):
        relprop.LRP(model, LRP0, strict=True).attribute(x, target=0)


class _ExpWeighted(nn.Module):
    """RWKV's WKV: a stabilised exp-weighted average of the values (keys and a learned bonus in the exponent)."""

    def __init__(self):
        super().__init__()
        self.k, self.v, self.o = nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False), nn.Linear(4, 2, bias=False)
        self.bonus = nn.Parameter(torch.randn(4))

    def forward(self, x):
        k, v = self.k(x) + self.bonus, self.v(x)
        weights = torch.exp(k - k.max(1, keepdim=True).values)
        return self.o((weights * v).sum(1) / weights.sum(1))


@pytest.mark.parametrize("preset", ["cp-lrp", "attnlrp"])
def test_exponential_weights_take_no_relevance(preset):
    """The values take it all; relevance sent through exp into the exponents summed to -0.87..5.07 of f."""
    model = _ExpWeighted().double().eval()
    x = torch.randn(2, 3, 4, dtype=torch.float64)
    relevance = relprop.LRP(model, preset).attribute(x, target=0)
    torch.testing.assert_close(relevance.sum((1, 2)), model(x)[:, 0].detach(), rtol=1e-10, atol=0)


class _Router(nn.Module):
    """A mixture-of-experts router: softmax weights, the top ones kept or renormalised, gating an expert."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.gate, self.expert = nn.Linear(4, 3, bias=False), nn.Linear(4, 4, bias=False)
        self.out = nn.Linear(4, 1, bias=False)

    def forward(self, x):
        weights = torch.softmax(self.gate(x), -1)
        if self.how == "topk":
            weights, _ = torch.topk(weights, 2, -1)
        elif self.how == "renormalised":
            weights = weights / weights.sum(-1, keepdim=True)
        elif self.how == "renormalised in place":  # Mixtral
            weights, _ = torch.topk(weights, 2, -1)
            weights /= weights.sum(-1, keepdim=True)
        else:  # PhiMoE's sparsemixer: the chosen weight scattered into a zero mask
            weights = torch.zeros_like(weights).scatter(-1, weights.argmax(-1, keepdim=True), weights.amax(-1, True))
        return self.out(self.expert(x) * weights[:, :1].clone())


@pytest.mark.parametrize("how", ["topk", "renormalised", "renormalised in place", "scatter"])
def test_router_weights_stay_gates_under_cp_lrp(how):
    """The expert's output takes all the relevance (was 0.53-0.69 of f: the router took a share)."""
    model = _Router(how).double().eval()
    x = torch.randn(3, 4, dtype=torch.float64)
    relevance = relprop.LRP(model, "cp-lrp").attribute(x, target=0)
    torch.testing.assert_close(relevance.sum(1), model(x)[:, 0].detach(), rtol=1e-10, atol=1e-14)


class _CrossAttention(nn.Module):
    """Attention whose query is made from constants (a decoder's own tokens, not explained): eager or fused."""

    def __init__(self, fused: bool):
        super().__init__()
        self.fused = fused
        self.k, self.v, self.o = (nn.Linear(8, 8, bias=False) for _ in range(3))
        self.query = nn.Parameter(torch.randn(1, 1, 3, 8))

    def forward(self, x):
        q, k, v = self.query.expand(x.shape[0], 1, 3, 8), self.k(x)[:, None], self.v(x)[:, None]
        if self.fused:
            attended = F.scaled_dot_product_attention(q, k, v)
        else:
            attended = torch.softmax(q @ k.transpose(-1, -2) / 8 ** 0.5, -1) @ v
        return self.o(attended[:, 0].sum(1))


def test_fused_attention_with_a_constant_query_equals_eager():
    """The keys take all of q k^T's relevance when the query is a constant (was half: T5 eager != SDPA by 15%)."""
    eager, fused = _CrossAttention(False).double().eval(), _CrossAttention(True).double().eval()
    fused.load_state_dict(eager.state_dict())
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    expected, actual = (relprop.LRP(m, "attnlrp").attribute(x, target=0) for m in (eager, fused))
    torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-14)


class _MaskFromActivations(nn.Module):
    """SAM's attention: a relative-position term computed from the queries, passed as SDPA's float mask."""

    def __init__(self, fused: bool):
        super().__init__()
        self.fused = fused
        self.qkv, self.rel = nn.Linear(8, 24, bias=False), nn.Linear(8, 5, bias=False)
        self.out = nn.Linear(8, 2, bias=False)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        mask = self.rel(q)
        if self.fused:
            attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            attended = torch.softmax(q @ k.transpose(-1, -2) / 8 ** 0.5 + mask, -1) @ v
        return self.out(attended.sum(1))


def test_an_attention_mask_made_from_activations_takes_its_share():
    """Fused attention with a mask computed from q equals its eager form (it raised: 5 gradients expected)."""
    eager, fused = _MaskFromActivations(False).double().eval(), _MaskFromActivations(True).double().eval()
    fused.load_state_dict(eager.state_dict())
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    for preset in ("attnlrp", "cp-lrp"):
        expected, actual = (relprop.LRP(m, preset).attribute(x, target=0) for m in (eager, fused))
        torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-14)


def test_a_shifted_gate_is_a_gate():
    """ConViT's gated positional attention ``(1 - sigmoid(g)) * a + sigmoid(g) * b``: the gate takes nothing."""
    model = _Net(lambda m, h: (1 - torch.sigmoid(h.flip(1))) * h + torch.sigmoid(h.flip(1)) * h.roll(1, 1))
    model = model.double().eval()
    x = torch.randn(2, 4, dtype=torch.float64)
    relevance = relprop.LRP(model, LRP0).attribute(x, target=0)
    torch.testing.assert_close(relevance.sum(1), model(x)[:, 0].detach(), rtol=1e-10, atol=0)


def test_a_dense_layers_output_on_tokens_can_be_modified_in_place():
    """F.linear on (batch, tokens, features) returns a view; NaFlexViT adds its position embedding into it in place."""
    model = _Net(lambda m, h: m.lin2(h[:, None, :].expand(2, 3, 4)).add_(m.scale).sum(1)).double().eval()
    x = torch.randn(2, 4, dtype=torch.float64)
    relevance = relprop.LRP(model, LRP0).attribute(x, target=0)
    assert relative_error(relevance, _gradient_times_input(model, x)) < 1e-10


def test_an_op_without_a_gradient_is_reported_where_relevance_stops(monkeypatch):
    """An op without a rule and without an autograd kernel: the warning says the relevance stops (it was all 0)."""
    from torch.ao.nn.quantized.dynamic import Linear as QuantizedLinear

    op = torch.ops.quantized.linear_dynamic.default
    monkeypatch.delitem(relprop.ops.HANDLERS, op)  # as for a custom kernel relprop has no rule for

    class Bare(nn.Module):
        def __init__(self):
            super().__init__()
            self.q = QuantizedLinear(4, 3)

        def forward(self, x):
            return op(x, self.q._packed_params._packed_params)

    x = torch.randn(2, 4)
    with pytest.warns(relprop.UnhandledOpWarning, match="has no gradient either, so the relevance stops there"):
        relevance = relprop.LRP(Bare().eval()).attribute(x, target=0)
    assert not relevance.any()


class _Excited(nn.Module):
    """Squeeze-and-excitation: ``relu(h) * sigmoid(s)``, s pooled from h."""

    def __init__(self):
        super().__init__()
        self.conv, self.head = nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.Linear(4, 2, bias=False)

    def forward(self, x):
        h = self.conv(x)
        return self.head((torch.relu(h) * torch.sigmoid(h.mean((2, 3), keepdim=True))).mean((2, 3)))


def test_an_activation_gated_by_a_sigmoid_is_the_signal_under_cp_lrp():
    """CP-LRP took both factors of ``relu(h) * sigmoid(s)`` for gates and gave all zeros."""
    model = _Excited().double().eval()
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    relevance = relprop.LRP(model, "cp-lrp").attribute(x, target=0)
    torch.testing.assert_close(relevance.sum((1, 2, 3)), model(x)[:, 0].detach(), rtol=1e-10, atol=0)


def test_a_data_parallel_model_is_explained_through_the_module_it_wraps():
    """nn.DataParallel runs replicas in threads, where the engine's mode is not active."""
    model = _Net(SCALED_BY_A_PARAMETER["view"]).double().eval()
    x = torch.randn(2, 4, dtype=torch.float64)
    torch.testing.assert_close(relprop.LRP(nn.DataParallel(model), LRP0).attribute(x, target=0),
                               relprop.LRP(model, LRP0).attribute(x, target=0), rtol=0, atol=0)


class _HookedInside(nn.Module):
    """A model that registers a gradient hook on an activation in its own forward (as Grad-CAM code does)."""

    def __init__(self, seen: list):
        super().__init__()
        self.seen = seen
        self.a, self.b = nn.Linear(4, 6, bias=False), nn.Linear(6, 2, bias=False)

    def forward(self, x):
        h = torch.relu(self.a(x))
        h.register_hook(self.seen.append)
        return self.b(h)


def test_a_hook_registered_inside_the_forward_pass_gets_the_relevance_and_is_reported():
    seen: list = []
    model = _HookedInside(seen).double().eval()
    x = torch.randn(3, 4, dtype=torch.float64)
    with pytest.warns(UserWarning, match="hook registered on an activation in module '<root>'.*relevance, not "
                                         "gradients"):
        relevance = relprop.LRP(model, relprop.composites.Epsilon(0.0)).attribute(x, target=1)
    (arriving,) = seen
    logit = model(x)[:, 1].detach()  # with autograd on: the model registers its hook
    # bias-free LRP-0 conserves: the relevance at the hidden layer sums to the logit, as at the input
    assert torch.allclose(arriving.sum(1), logit, rtol=1e-10, atol=1e-12)
    assert torch.allclose(relevance.sum(1), logit, rtol=1e-10, atol=1e-12)


def test_an_op_without_a_rule_keeps_its_named_results():
    """``torch.cummax(h, 1).values``: the result of an op without a rule keeps its fields, and is reported."""
    class CumulativeMax(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.second = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)

        def forward(self, x):
            return self.second(torch.cummax(self.first(x), 1).values)

    torch.manual_seed(0)
    model, x = CumulativeMax().eval(), torch.randn(2, 4)
    with pytest.warns(relprop.UnhandledOpWarning, match="cummax"):
        relevance = relprop.LRP(model, "epsilon").attribute(x, target=1)
    # cummax's gradient routes each maximum's relevance to the entry it came from: LRP-0 with zero biases conserves
    for layer in (model.first, model.second):
        torch.nn.init.zeros_(layer.bias)
    with pytest.warns(relprop.UnhandledOpWarning):
        relevance = relprop.LRP(model, relprop.composites.Composite(epsilon=0.0)).attribute(x, target=1)
    torch.testing.assert_close(relevance.sum(1), model(x)[:, 1].detach(), rtol=1e-5, atol=1e-6)
