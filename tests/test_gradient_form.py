"""Relevance per unit of activation (the gradient form of AttnLRP and CP-LRP) against relevance itself.

The presets whose rules are modified gradients carry ``R / x`` between the ops and run LRP-0 layers as plain
autograd (``relprop._core.gradient_form``); the same composite with ``gradient_form = False`` carries the
relevance through one node per op. Both must give the same relevance: to float64 rounding where the model
computes in float64 throughout, to float32 rounding where it casts (Llama's RMSNorm and rotary embeddings).
"""
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import relprop
from relprop.engine import nodes

transformers = pytest.importorskip("transformers")


def both_forms(preset, **kwargs):
    """The preset as it is (gradient form) and the same preset carrying relevance itself."""
    relevance_form = relprop.composites.get(preset, **kwargs)
    relevance_form.gradient_form = False
    return relprop.composites.get(preset, **kwargs), relevance_form


class Decoder(nn.Module):
    """A decoder block written out in float64: RMSNorm, rotary embedding, attention, a gated MLP, a head.

    ``fused``: ``F.scaled_dot_product_attention``; else the softmax of ``q k^T`` written out (eager).
    """

    def __init__(self, fused, vocab=40, width=16, heads=2):
        super().__init__()
        self.fused, self.heads = fused, heads
        self.embed = nn.Embedding(vocab, width)
        self.norm = nn.Parameter(torch.rand(width) + 0.5)
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.out = nn.Linear(width, width)
        self.gate, self.up = nn.Linear(width, 2 * width), nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)
        self.act = nn.SiLU()
        self.head = nn.Linear(width, vocab, bias=False)
        angles = torch.arange(8)[:, None] * torch.linspace(0.1, 1.0, width // heads // 2)
        self.register_buffer("cos", torch.cat([angles.cos()] * 2, -1))
        self.register_buffer("sin", torch.cat([angles.sin()] * 2, -1))

    def rotate(self, x):
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
        T = x.shape[-2]
        return x * self.cos[:T] + rotated * self.sin[:T]

    def forward(self, ids):
        h = self.embed(ids)
        normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm
        B, T, _ = h.shape
        q, k, v = self.qkv(normed).view(B, T, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        q, k = self.rotate(q), self.rotate(k)
        if self.fused:
            z = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
            causal = torch.ones(T, T, dtype=torch.bool).tril()
            z = torch.softmax(scores.masked_fill(~causal, -math.inf), -1) @ v
        h = h + self.out(z.transpose(1, 2).flatten(2))
        h = h + self.down(self.act(self.gate(h)) * self.up(h))
        return self.head(h)


IDS = torch.randint(0, 40, (2, 7), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("fused", [True, False], ids=["sdpa", "eager"])
@pytest.mark.parametrize("preset", ["attnlrp", "cp-lrp"])
def test_the_gradient_form_equals_the_relevance_form_in_float64(preset, fused):
    torch.manual_seed(0)
    model = Decoder(fused).double().eval()
    gradient_form, relevance_form = both_forms(preset)
    found = [relprop.LRP(model, composite).attribute(IDS, target=(-1, 3), return_convergence_delta=True)
             for composite in (gradient_form, relevance_form)]
    (relevance, delta), (expected, expected_delta) = found
    assert expected.abs().sum() > 0
    torch.testing.assert_close(relevance, expected, rtol=1e-12, atol=1e-12 * expected.abs().max().item())
    torch.testing.assert_close(delta, expected_delta, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("preset", ["attnlrp", "cp-lrp"])
@pytest.mark.parametrize("name", ["llama", "bert", "gpt2"])
def test_the_gradient_form_equals_the_relevance_form_on_hugging_face_models(name, preset):
    """Llama computes RMSNorm and the rotary embedding in float32: the two forms round differently there."""
    T = transformers
    configs = {"llama": (T.LlamaConfig, T.LlamaForCausalLM, dict(num_key_value_heads=2), (-1, 5)),
               "bert": (T.BertConfig, T.BertForSequenceClassification, {}, 1),
               "gpt2": (T.GPT2Config, T.GPT2LMHeadModel, {}, (-1, 5))}
    config_class, model_class, extra, target = configs[name]
    if name == "gpt2":
        config = config_class(vocab_size=50, n_embd=16, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0)
    else:
        config = config_class(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
                              intermediate_size=32, **extra)
    torch.manual_seed(0)
    model = model_class(config).double().eval()
    ids = torch.randint(3, 50, (2, 7), generator=torch.Generator().manual_seed(1))
    relevance, expected = (relprop.LRP(model, composite).attribute(ids, target=target)
                           for composite in both_forms(preset))
    rtol = 1e-6 if name == "llama" else 1e-12
    torch.testing.assert_close(relevance, expected, rtol=rtol, atol=rtol * expected.abs().max().item())


def test_many_seeds_from_one_recorded_pass_in_gradient_form():
    torch.manual_seed(0)
    model = Decoder(fused=True).double().eval()
    gradient_form, relevance_form = both_forms("attnlrp")
    explained = relprop.LRP(model, gradient_form).record(IDS)
    assert explained.gradient_form
    for token in (3, 11):
        seed = relprop.output_relevance(explained.logits, (-1, token))
        (relevance,) = explained.relevance(seed)
        expected = relprop.LRP(model, relevance_form).attribute(IDS, target=(-1, token))
        torch.testing.assert_close(relevance, expected, rtol=1e-12, atol=1e-14)


def test_lrp0_layers_run_as_plain_autograd_and_a_vocabulary_head_keeps_its_node():
    """In gradient form a dense layer under LRP-0 is the model's own op: no node. The head (160 outputs on 16
    features) keeps one, whose transposed product skips the zeros of a one-logit seed."""
    torch.manual_seed(0)
    model = Decoder(fused=True, vocab=160).double().eval()
    gradient_form, relevance_form = both_forms("attnlrp")
    explained = relprop.LRP(model, gradient_form).record(IDS, reusable=False)
    assert explained.gradient_form
    assert nodes.is_relevance_node(explained.logits.grad_fn)  # the head's node
    # the dense layers, the sums and the rotary products are no nodes: far fewer than one per op
    assert 0 < len(_nodes(explained.logits)) < len(_nodes(relprop.LRP(model, relevance_form).record(IDS).logits)) / 2
    torch.testing.assert_close(explained.relevance(relprop.output_relevance(explained.logits, (-1, 100)))[0],
                               relprop.LRP(model, relevance_form).attribute(IDS, target=(-1, 100)),
                               rtol=1e-12, atol=1e-14)


def test_a_gate_is_held_constant_and_what_computed_it_is_not_kept():
    """The statistic of the RMSNorm gates its input: the product runs as plain autograd on the statistic detached,
    so the square, the mean and the rsqrt that computed it leave the graph after the forward pass."""
    torch.manual_seed(0)
    model = Decoder(fused=True).double().eval()
    gradient_form, relevance_form = both_forms("attnlrp")
    names = {name: _names(relprop.LRP(model, composite).record(IDS).logits)
             for name, composite in (("gradient", gradient_form), ("relevance", relevance_form))}
    assert {"Tensor.pow", "torch.rsqrt"} <= names["relevance"]
    assert not {"Tensor.pow", "torch.rsqrt"} & names["gradient"]
    assert "torch.nn.functional.silu" in names["gradient"]  # its gradient form, out / x, keeps a node


def _names(logits):
    """The op names of the relevance nodes below ``logits``."""
    return {node.call.name for node in _nodes(logits) if hasattr(node, "call")}


def _nodes(logits):
    """The relevance nodes of the graph below ``logits``."""
    found, stack, seen = [], [logits.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if nodes.is_relevance_node(node):
            found.append(node)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return found


class _Round(torch.autograd.Function):
    """A straight-through rounding, as quantised models apply it."""

    @staticmethod
    def forward(ctx, x):
        return x.round()

    @staticmethod
    def backward(ctx, grad):
        return grad


class _Rounded(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(4, 6), nn.Linear(6, 3)

    def forward(self, x):
        return self.second(_Round.apply(self.first(x) * 4))


def test_a_custom_autograd_function_is_explained_with_relevance_itself():
    """Relevance per unit cannot cross a Function's own backward: the pass is made again in relevance form."""
    torch.manual_seed(0)
    model = _Rounded().double().eval()
    x = torch.randn(3, 4, dtype=torch.float64)
    gradient_form, relevance_form = both_forms("attnlrp", func_map={_Round: relprop.rules.Pass()})
    lrp = relprop.LRP(model, gradient_form)
    assert not lrp.record(x).gradient_form
    expected = relprop.LRP(model, relevance_form).attribute(x, target=1)
    assert torch.equal(lrp.attribute(x, target=1), expected)


def test_a_seed_on_an_output_of_zero_is_reported_in_gradient_form():
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU()).double().eval()
    with torch.no_grad():
        model[0].weight.copy_(torch.eye(4, 3, dtype=torch.float64))
        model[0].bias.zero_()
    x = torch.tensor([[1.0, -1.0, 2.0]], dtype=torch.float64)  # outputs 1, 0, 2, 0
    explained = relprop.LRP(model, "attnlrp").record(x)
    assert explained.gradient_form
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        explained.relevance(torch.tensor([[1.0, 0.0, 1.0, 0.0]], dtype=torch.float64))  # no warning
    with pytest.warns(relprop.ConservationWarning, match="outputs of value 0"):
        explained.relevance(torch.ones(1, 4, dtype=torch.float64))


def test_nan_relevance_is_reported_in_gradient_form():
    """The guard still names the first op that hands on NaN (here a softmax over a row of -inf)."""
    class Masked(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, x):
            scores = self.linear(x).masked_fill(torch.tensor([True, True, True, True]), -math.inf)
            return torch.softmax(scores, -1) * x

    model = Masked().double().eval()
    with pytest.warns(relprop.ConservationWarning, match="NaN"):
        relprop.LRP(model, "attnlrp").attribute(torch.randn(2, 4, dtype=torch.float64), target=0)


class _Hooked(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(4, 6), nn.Linear(6, 3)

    def forward(self, x):
        h = torch.tanh(self.first(x))
        h.register_hook(lambda grad: grad * 2)  # what a hook returns replaces the relevance there
        return self.second(h)


def test_a_hook_on_an_activation_gets_relevance_itself():
    torch.manual_seed(0)
    model = _Hooked().double().eval()
    x = torch.randn(3, 4, dtype=torch.float64)
    gradient_form, relevance_form = both_forms("attnlrp")
    with pytest.warns(UserWarning, match="receives relevance"):
        explained = relprop.LRP(model, gradient_form).record(x)
    assert not explained.gradient_form
    found = []
    for composite in (relevance_form, gradient_form):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            found.append(relprop.LRP(model, composite).attribute(x, target=1))
        assert any("receives relevance" in str(w.message) for w in caught)
        assert any("not accounted for" in str(w.message) for w in caught)  # the doubled relevance, reported
    assert torch.equal(found[0], found[1])


def _spied(module, monkeypatch):
    """A list of what ``module.held_rows`` finds from now on (None: not few rows)."""
    found, original = [], module.held_rows
    monkeypatch.setattr(module, "held_rows", lambda tensor: found.append(original(tensor)) or found[-1])
    return found


SEEDS = {"one-hot": [(0, 6, 3)], "rows": [(0, 6, 3), (0, 2, 7), (1, 6, 3), (1, 6, 39)],
         "negative": [(0, 6, 3), (1, 0, 11)]}


@pytest.mark.parametrize("owned", [True, False])
@pytest.mark.parametrize("entries", SEEDS.values(), ids=SEEDS)
def test_a_seed_in_few_rows_is_divided_there_alone_and_bitwise_as_a_whole(entries, owned, monkeypatch):
    """A seed whose entries lie in a few rows (positions) is divided by the logits in those rows alone."""
    from relprop.methods import forward_pass

    torch.manual_seed(0)
    explained = relprop.LRP(Decoder(fused=True).double().eval(), "attnlrp").record(IDS)
    logits = explained.logits.detach()
    seed = torch.zeros_like(logits)
    for sign, index in zip((1, -1, 2.5, -0.5), entries):
        seed[index] = sign * logits[index]
    found = _spied(forward_pass, monkeypatch)
    given = seed.clone()
    carried = explained._carried(given, owned)
    assert len(found) == 1 and found[0].tolist() == sorted({7 * b + t for b, t, _ in entries})
    assert torch.equal(carried, torch.where(logits == 0, 0.0, seed / logits))  # bitwise, 0 off the seed
    assert torch.equal(given, seed) or owned  # a seed not owned is left as it was
    relevance = explained.propagate(seed.clone(), owned)
    monkeypatch.setattr(forward_pass, "held_rows", lambda tensor: None)  # the whole seed divided
    assert torch.equal(explained._carried(seed.clone(), owned), carried)
    assert torch.equal(explained.propagate(seed.clone(), owned)[0], relevance[0])


def test_a_seed_on_an_output_of_zero_in_few_rows_is_reported_in_gradient_form():
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU()).double().eval()
    with torch.no_grad():
        model[0].weight.copy_(torch.eye(4, 3, dtype=torch.float64))
        model[0].bias.zero_()
    x = torch.tensor([[1.0, -1.0, 2.0], [1.0, 1.0, 1.0], [3.0, 2.0, 1.0]], dtype=torch.float64)
    explained = relprop.LRP(model, "attnlrp").record(x)  # outputs 1, 0, 2, 0 in the first row
    seed = torch.zeros(3, 4, dtype=torch.float64)
    seed[0] = torch.tensor([1.0, 0.0, 1.0, 0.0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        explained.relevance(seed)  # no warning
    seed[0, 1] = 1.0
    with pytest.warns(relprop.ConservationWarning, match="outputs of value 0"):
        explained.relevance(seed)


def test_nan_in_a_seed_of_few_rows_reaches_the_relevance_of_its_example():
    torch.manual_seed(0)
    explained = relprop.LRP(Decoder(fused=True).double().eval(), "attnlrp").record(IDS)
    seed = relprop.output_relevance(explained.logits, (-1, 3))
    seed[1, -1, 3] = math.nan
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the guard reports the NaN
        (relevance,) = explained.relevance(seed)
    assert torch.isfinite(relevance[0]).all() and torch.isnan(relevance[1]).any()


class _Head(nn.Module):
    """Token features through a dense layer and a vocabulary head much wider than them (a node in gradient form)."""

    def __init__(self, bias):
        super().__init__()
        self.embed, self.act, self.head = nn.Embedding(40, 8), nn.SiLU(), nn.Linear(8, 200, bias=bias)
        self.body = nn.Linear(8, 8)

    def forward(self, ids):
        return self.head(self.act(self.body(self.embed(ids))))


@pytest.mark.parametrize("kwargs", [
    dict(epsilon=1e-2),
    dict(name_map={"head": relprop.rules.Epsilon(1e-2, zero_bias=True)}),
], ids=["epsilon", "zero-bias"])
@pytest.mark.parametrize("target", [(-1, 3), [(-1, 3), (2, 150)]], ids=["one-hot", "rows"])
def test_a_stabilised_head_scales_and_transposes_the_rows_that_hold_relevance_alone(kwargs, target, monkeypatch):
    from relprop.engine import parametric

    torch.manual_seed(0)
    model = _Head(bias=True).double().eval()
    gradient_form, relevance_form = both_forms("attnlrp", **kwargs)
    lrp = relprop.LRP(model, gradient_form)
    found = _spied(parametric, monkeypatch)
    relevance = lrp.attribute(IDS, target=target)
    assert [rows.tolist() for rows in found] == [[6, 13] if target == (-1, 3) else [6, 9]]
    monkeypatch.setattr(parametric, "held_rows", lambda tensor: None)  # the head's whole output scaled
    assert torch.equal(relevance, lrp.attribute(IDS, target=target))
    expected = relprop.LRP(model, relevance_form).attribute(IDS, target=target)
    assert expected.abs().sum() > 0
    torch.testing.assert_close(relevance, expected, rtol=1e-12, atol=1e-12 * expected.abs().max().item())


@pytest.mark.parametrize("epsilon", [0.0, 1e-2])
def test_a_llama_of_a_large_vocabulary_in_gradient_form_equals_the_relevance_form(epsilon, monkeypatch):
    """The seed divided in its one row, the head's product of that row alone: as the relevance form gives."""
    from relprop.engine import parametric
    from relprop.methods import forward_pass
    from relprop.ops import linear

    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).double().eval()
    ids = torch.randint(3, 32000, (1, 12), generator=torch.Generator().manual_seed(1))
    gradient_form, relevance_form = both_forms("attnlrp", epsilon=epsilon)
    seeds, heads, products = (_spied(module, monkeypatch) for module in (forward_pass, parametric, linear))
    relevance = relprop.LRP(model, gradient_form).attribute(ids, target=(-1, 42))
    assert [rows.tolist() for rows in seeds] == [[11]]
    # a stabilised head scales its one row and multiplies it alone; LRP-0's transposed product finds the row
    assert [rows.tolist() for rows in heads] == ([[11]] if epsilon else [])
    assert [rows.tolist() for rows in products] == ([] if epsilon else [[11]])
    expected = relprop.LRP(model, relevance_form).attribute(ids, target=(-1, 42))
    assert expected.abs().sum() > 0
    torch.testing.assert_close(relevance, expected, rtol=1e-6, atol=1e-6 * expected.abs().max().item())


def test_lrp0_in_bfloat16_divides_by_nothing_in_gradient_form():
    """The relevance form stabilises LRP-0 with bfloat16's machine epsilon (its 1 / z would overflow); the
    gradient form divides by nothing, so it is LRP-0 itself, close to the float64 relevance."""
    torch.manual_seed(0)
    model = Decoder(fused=True).eval()
    gradient_form, relevance_form = both_forms("attnlrp")
    exact = relprop.LRP(model.double(), relevance_form).attribute(IDS, target=(-1, 3))
    half = relprop.LRP(model.bfloat16(), gradient_form).attribute(IDS, target=(-1, 3)).double()
    cosine = F.cosine_similarity(half.flatten(), exact.flatten(), dim=0).item()
    assert cosine > 0.99


@pytest.mark.parametrize("kwargs", [
    dict(epsilon=1e-2),  # every rule scales G by z / (z + eps sign z)
    dict(name_map={"out": relprop.rules.Epsilon(0.0, zero_bias=True)}),  # z / (z - b)
    dict(layer_map={nn.Linear: relprop.rules.ZPlus()}),  # no gradient form: converted on both sides
], ids=["epsilon", "zero-bias", "converted"])
def test_stabilised_and_converted_rules_equal_the_relevance_form(kwargs):
    torch.manual_seed(0)
    model = Decoder(fused=True).double().eval()
    relevance, expected = (relprop.LRP(model, composite).attribute(IDS, target=(-1, 3))
                           for composite in both_forms("attnlrp", **kwargs))
    assert expected.abs().sum() > 0
    torch.testing.assert_close(relevance, expected, rtol=1e-12, atol=1e-12 * expected.abs().max().item())


def test_a_rule_that_fills_inputs_of_value_0_is_explained_with_relevance_itself():
    """Flat gives relevance to inputs of value 0, which relevance per unit cannot carry: the pass carries
    relevance itself, and the zero pixels keep their share."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 2)).double().eval()
    x = torch.tensor([[1.0, 0.0, -2.0, 0.0]], dtype=torch.float64)
    gradient_form, relevance_form = both_forms("attnlrp", first={"dense": relprop.rules.Flat()})
    assert not relprop.LRP(model, gradient_form).record(x).gradient_form
    relevance = relprop.LRP(model, gradient_form).attribute(x, target=1)
    assert torch.equal(relevance, relprop.LRP(model, relevance_form).attribute(x, target=1))
    assert (relevance[0, [1, 3]] != 0).all()


class FirstTakesAll(relprop.rules.Rule):
    """A user's rule for products: the first factor takes all the relevance as LRP-0 hands it on, the others none;
    in relevance form, and stated once as a :class:`~relprop.rules.Scaled` for the gradient form."""

    kinds = frozenset({"product"})
    needs_vjp = True

    def propagate(self, call, relevance):
        grads = call.vjp(relevance * relprop.rules.inverse_denominator(call.output, 0.0))
        return (call.inputs[0] * grads[0], *(None for _ in call.inputs[1:]))

    def gradient_reads(self, call):
        return relprop.rules.Reads(vjp=True)

    def scaled(self, call):
        return relprop.rules.Scaled(shares=(1.0,) + (0.0,) * (len(call.inputs) - 1))


def test_a_rule_that_states_its_gradient_form_as_scaled_gets_it_under_interception():
    torch.manual_seed(0)
    model = Decoder(fused=False).double().eval()
    gradient_form, relevance_form = both_forms("attnlrp", func_map={torch.mul: FirstTakesAll()})
    relevance, expected = (relprop.LRP(model, composite).attribute(IDS, target=(-1, 3))
                           for composite in (gradient_form, relevance_form))
    assert expected.abs().sum() > 0
    torch.testing.assert_close(relevance, expected, rtol=1e-12, atol=1e-12 * expected.abs().max().item())
    default = relprop.LRP(model, "attnlrp").attribute(IDS, target=(-1, 3))
    assert not torch.allclose(relevance, default)  # the rule took part: not the preset's own products
