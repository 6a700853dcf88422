"""Relevance differentiable in the parameters and inputs (``create_graph=True``), checked in float64.

Each check compares three things on one model, composite and input:

- the differentiable relevance's value with interception's (``attribute`` without ``create_graph``);
- its derivative in each parameter and in the input, along a random direction, with central differences of
  interception's relevance: the derivative of the relevance function itself, not one with the rules' held
  quantities (ratios, shares, norms' statistics) taken as constants.

Rule families: Epsilon, Gamma, ZPlus, AlphaBeta, ZBox, Flat, WSquare, a BatchNorm merged into its convolution,
LayerNorm and RMSNorm with their statistic held, AttnLRP's softmax and product rules, CP-LRP, the recurrent layers'
(LSTM, GRU, RNN: gates held, the signal takes all). Op families: dense and convolution layers, max and average
pooling, residual sums, attention (fused and written out), recurrent layers.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import relprop
from relprop import rules
from relprop.composites import Composite

D = torch.float64
STEP = 1e-6


def _directional(lrp, x, target, weights, tensor, direction):
    """Central difference of ``sum(weights * attribute(x))`` along ``direction`` of ``tensor`` (an input or a
    parameter, put back bitwise)."""
    original = tensor.detach().clone()
    totals = []
    for step in (STEP, -STEP):
        with torch.no_grad():
            tensor.copy_(original + step * direction)
        totals.append((lrp.attribute(x, target=target) * weights).sum())
    with torch.no_grad():
        tensor.copy_(original)
    return ((totals[0] - totals[1]) / (2 * STEP)).item()


def check(model, composite, x, target, compile=False):
    """The value and both derivatives of the differentiable relevance against interception's."""
    lrp = relprop.LRP(model, composite, compile=compile)
    plain = relprop.LRP(model, composite).attribute(x, target=target)
    leaf = x.clone().requires_grad_(True)
    relevance = lrp.attribute(leaf, target=target, create_graph=True)
    torch.testing.assert_close(relevance.detach(), plain, rtol=1e-10, atol=1e-13)
    generator = torch.Generator().manual_seed(3)
    weights = torch.randn(relevance.shape, dtype=D, generator=generator)
    parameters = list(model.parameters())
    found = torch.autograd.grad((relevance * weights).sum(), [leaf, *parameters], allow_unused=True)
    interception = relprop.LRP(model, composite)
    for grad, tensor in zip(found, [x, *parameters]):
        direction = torch.randn(tensor.shape, dtype=D, generator=generator)
        expected = _directional(interception, x, target, weights, tensor, direction)
        got = 0.0 if grad is None else (grad * direction).sum().item()
        scale = max(abs(expected), 1e-2)
        assert abs(got - expected) <= 1e-5 * scale, (tuple(tensor.shape), got, expected)
    return relevance


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 6), nn.ReLU(), nn.Linear(6, 3)).to(D).eval()


MLP_COMPOSITES = {
    "epsilon": "epsilon",
    "epsilon-plus (ZPlus)": "epsilon-plus",
    "epsilon-alpha2-beta1 (AlphaBeta)": "epsilon-alpha2-beta1",
    "epsilon-alpha2-beta1-flat (Flat)": "epsilon-alpha2-beta1-flat",
    "epsilon-gamma-box (Gamma, ZBox)": relprop.composites.get("epsilon-gamma-box", low=-3.0, high=3.0),
    "Gamma, WSquare": Composite(dense=rules.Gamma(0.25), first={"dense": rules.WSquare()}),
    "LRP-0": Composite(epsilon=0.0),
}


@pytest.mark.parametrize("name", list(MLP_COMPOSITES))
def test_dense_rules_differentiate_as_their_relevance_does(name):
    check(mlp(), MLP_COMPOSITES[name], torch.randn(4, 5, dtype=D, generator=torch.Generator().manual_seed(1)), 1)


@pytest.mark.parametrize("first", [rules.ZBox(0.0, 1.0), rules.Flat()], ids=["ZBox", "Flat"])
def test_a_first_layer_behind_flatten_differentiates(first):
    """A rule that gives inputs of value 0 relevance collects it at a probe of the model input, viewed as the
    layer's input is (here flattened); the compiled tier takes the same probe."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 5), nn.ReLU(), nn.Linear(5, 3)).to(D).eval()
    x = torch.rand(2, 1, 3, 4, dtype=D, generator=torch.Generator().manual_seed(1))
    composite = Composite(1e-6, first={"dense": first})
    found = check(model, composite, x, 1)
    compiled = relprop.LRP(model, composite, compile="aot_eager").attribute(x, target=1)
    torch.testing.assert_close(compiled, found.detach(), rtol=1e-10, atol=1e-13)


class ConvNet(nn.Module):
    """Convolutions with BatchNorms (merged into them), a residual sum, max and average pooling, a dense head."""

    def __init__(self):
        super().__init__()
        self.conv1, self.norm1 = nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.conv2, self.norm2 = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.pool, self.average = nn.MaxPool2d(2), nn.AvgPool2d(2)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        hidden = F.relu(self.norm1(self.conv1(x)))
        hidden = F.relu(hidden + self.norm2(self.conv2(hidden)))
        return self.head(self.average(self.pool(hidden)).flatten(1))


def conv_net():
    torch.manual_seed(0)
    model = ConvNet().to(D)
    for norm in (model.norm1, model.norm2):  # statistics and an affine map of their own, so that merging matters
        norm.running_mean.uniform_(-0.5, 0.5)
        norm.running_var.uniform_(0.5, 2.0)
        nn.init.uniform_(norm.weight, 0.5, 1.5)
        nn.init.uniform_(norm.bias, -0.3, 0.3)
    return model.eval()


CONV_COMPOSITES = {
    "epsilon": "epsilon",
    "epsilon-plus-flat": "epsilon-plus-flat",
    "epsilon-alpha2-beta1": "epsilon-alpha2-beta1",
    "epsilon-gamma-box": relprop.composites.get("epsilon-gamma-box", low=-4.0, high=4.0),
}


@pytest.mark.parametrize("name", list(CONV_COMPOSITES))
def test_convolutions_batch_norms_pooling_and_residual_sums_differentiate(name):
    x = torch.randn(2, 2, 8, 8, dtype=D, generator=torch.Generator().manual_seed(1))
    check(conv_net(), CONV_COMPOSITES[name], x, 0)


class Block(nn.Module):
    """A pre-norm transformer block: causal attention (fused or written out), a GELU MLP, residual sums."""

    def __init__(self, fused: bool, norm: type[nn.Module]):
        super().__init__()
        self.embed, self.norm = nn.Linear(6, 8), norm(8)
        self.query, self.key, self.value, self.out = (nn.Linear(8, 8) for _ in range(4))
        self.up, self.down, self.head = nn.Linear(8, 16), nn.Linear(16, 8), nn.Linear(8, 3)
        self.fused = fused

    def forward(self, x):
        hidden = self.embed(x)
        normed = self.norm(hidden)
        q, k, v = (layer(normed).view(2, 5, 2, 4).transpose(1, 2) for layer in (self.query, self.key, self.value))
        if self.fused:
            attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            causal = torch.ones(5, 5, dtype=torch.bool).tril()
            scores = (q @ k.transpose(-1, -2) / 2.0).masked_fill(~causal, float("-inf"))
            attended = torch.softmax(scores, -1) @ v
        hidden = hidden + self.out(attended.transpose(1, 2).reshape(2, 5, 8))
        hidden = hidden + self.down(F.gelu(self.up(hidden)))
        return self.head(hidden[:, -1])


@pytest.mark.parametrize("composite", ["attnlrp", "cp-lrp"])
@pytest.mark.parametrize("norm", [nn.LayerNorm, nn.RMSNorm], ids=["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("fused", [True, False], ids=["sdpa", "written-out"])
def test_attention_norms_and_products_differentiate(composite, norm, fused):
    torch.manual_seed(0)
    model = Block(fused, norm).to(D).eval()
    check(model, composite, torch.randn(2, 5, 6, dtype=D, generator=torch.Generator().manual_seed(1)), 1)


COMPILED_CASES = {
    "conv-epsilon-plus-flat-aot_eager": (conv_net, "epsilon-plus-flat", (2, 2, 8, 8), "aot_eager"),
    "attention-attnlrp-aot_eager": (lambda: Block(True, nn.LayerNorm), "attnlrp", (2, 5, 6), "aot_eager"),
    "lstm-epsilon-aot_eager": (lambda: Recurrent("LSTM"), "epsilon", (2, 4, 3), "aot_eager"),
    "mlp-epsilon-gamma-box-inductor": (mlp, MLP_COMPOSITES["epsilon-gamma-box (Gamma, ZBox)"], (4, 5), "inductor"),
}


@pytest.mark.parametrize("name", list(COMPILED_CASES))
def test_the_compiled_tier_differentiates_as_interception_in_one_program(name):
    """Under compile=, the relevance pass is traced into one program (AOT autograd has no double backward, but
    the program's single backward pass is the derivative): its relevance and derivative are the eager
    program's, and the second call reuses it."""
    make, composite, shape, compiler = COMPILED_CASES[name]
    torch.manual_seed(0)
    model = make().to(D).eval()
    parameters = list(model.parameters())
    generator = torch.Generator().manual_seed(1)
    x, weights = (torch.randn(shape, dtype=D, generator=generator) for _ in range(2))

    def derivative(lrp):
        leaf = x.clone().requires_grad_(True)
        relevance = lrp.attribute(leaf, target=0, create_graph=True)
        found = torch.autograd.grad((relevance * weights).sum(), [leaf, *parameters], allow_unused=True,
                                    materialize_grads=True)
        return [relevance.detach(), *found]
    expected = derivative(relprop.LRP(model, composite))
    compiled = relprop.LRP(model, composite, compile=compiler)
    for _ in range(2):
        found = derivative(compiled)
        assert compiled._program.split is None and compiled._program.compilations == 1
        for got, want in zip(found, expected):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


def test_an_input_that_requires_no_grad_gets_no_derivative_in_its_own_program():
    """A training step's inputs require no grad: the compiled program leaves their derivative out (AOT autograd
    would compute it). An input that requires grad gets a program of its own, guarded apart, and its derivative;
    each program is reused when its kind of input comes again."""
    model = mlp()
    x = torch.randn(4, 5, dtype=D, generator=torch.Generator().manual_seed(1))
    weights = torch.randn(4, 5, dtype=D, generator=torch.Generator().manual_seed(2))

    def derivative(lrp, attached):
        leaf = x.clone().requires_grad_(attached)
        relevance = lrp.attribute(leaf, target=0, create_graph=True)
        found = torch.autograd.grad((relevance * weights).sum(), [*model.parameters(), *([leaf] if attached else [])])
        return [relevance.detach(), *found]
    eager = relprop.LRP(model, "epsilon")
    compiled = relprop.LRP(model, "epsilon", compile="aot_eager")
    for attached, compilations in [(False, 1), (True, 2), (False, 2), (True, 2)]:
        found = derivative(compiled, attached)
        assert compiled._program.split is None and compiled._program.compilations == compilations
        for got, want in zip(found, derivative(eager, attached), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


def test_a_target_that_is_not_indices_takes_the_recorded_pass_under_compile():
    """A Contrastive target cannot run as the whole program: the compiled explainer records a pass (Dynamo's
    graph run as it is) and differentiates it, as without compile=."""
    model = mlp()
    x = torch.randn(4, 5, dtype=D, generator=torch.Generator().manual_seed(1))
    target = relprop.Contrastive(1)

    def derivative(lrp):
        relevance = lrp.attribute(x, target=target, create_graph=True)
        return [relevance.detach(), *torch.autograd.grad(relevance.square().sum(), list(model.parameters()))]
    compiled = relprop.LRP(model, "epsilon", compile="aot_eager")
    found = derivative(compiled)
    assert compiled._program.split is not None and compiled._program.fallback is None
    for got, want in zip(found, derivative(relprop.LRP(model, "epsilon"))):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_recorded_pass_differentiates_any_seed():
    model = mlp()
    x = torch.randn(4, 5, dtype=D, generator=torch.Generator().manual_seed(1))
    seed = torch.randn(4, 3, dtype=D, generator=torch.Generator().manual_seed(2))  # a constant output relevance
    lrp = relprop.LRP(model, "epsilon-plus")
    (relevance,) = lrp.record(x, create_graph=True).propagate(seed, create_graph=True)
    (expected,) = lrp.record(x).relevance(seed)
    torch.testing.assert_close(relevance.detach(), expected, rtol=1e-10, atol=1e-13)
    weight = model[2].weight
    (grad,) = torch.autograd.grad(relevance.sum(), weight)
    direction = torch.randn(weight.shape, dtype=D, generator=torch.Generator().manual_seed(4))

    original = weight.detach().clone()

    def total(h):
        with torch.no_grad():
            weight.copy_(original + h * direction)
        value = lrp.record(x).relevance(seed)[0].sum().item()
        with torch.no_grad():
            weight.copy_(original)
        return value
    expected_change = (total(STEP) - total(-STEP)) / (2 * STEP)
    assert abs((grad * direction).sum().item() - expected_change) <= 1e-6 * max(abs(expected_change), 1e-2)


def test_the_derivative_at_a_relu_kink_is_the_inactive_side():
    """autograd's ReLU has derivative 0 at 0: at a unit exactly at its kink the derivative of the relevance is that
    of the model without the unit (its one-sided derivative from below)."""
    model = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1)).to(D).eval()
    with torch.no_grad():
        model[0].weight.copy_(torch.tensor([[1.0, -1.0], [0.5, 2.0], [-1.0, 0.3]], dtype=D))
        model[0].bias.copy_(torch.tensor([0.0, 0.1, 0.2], dtype=D))
        model[2].weight.copy_(torch.tensor([[1.5, -0.7, 2.0]], dtype=D))
    x = torch.tensor([[0.4, 0.4]], dtype=D)  # unit 0 is at its kink: 0.4 - 0.4 = 0
    leaf = x.clone().requires_grad_(True)
    (found,) = torch.autograd.grad(relprop.LRP(model, "epsilon").attribute(leaf, 0, create_graph=True).sum(), leaf)
    without = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1)).to(D).eval()
    without.load_state_dict(model.state_dict())
    with torch.no_grad():
        without[2].weight[0, 0] = 0.0
    leaf = x.clone().requires_grad_(True)
    (expected,) = torch.autograd.grad(relprop.LRP(without, "epsilon").attribute(leaf, 0, create_graph=True).sum(),
                                      leaf)
    torch.testing.assert_close(found, expected, rtol=1e-12, atol=0)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("name, step, tolerance", [("bert", STEP, 1e-5), ("llama", 1e-3, 2e-3)])
def test_hugging_face_transformers_differentiate_in_their_parameters(name, step, tolerance, attention):
    """Token ids: the relevance of their embeddings (summed per token), differentiated in each parameter. Llama
    computes its RMSNorm and rotary embeddings in float32 inside a float64 model, so its differences take a larger
    step."""
    transformers = pytest.importorskip("transformers")
    common = dict(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, intermediate_size=32)
    if name == "bert":
        config, model_class, target = transformers.BertConfig(**common), transformers.BertForSequenceClassification, 1
    else:
        config = transformers.LlamaConfig(**common, num_key_value_heads=2)
        model_class, target = transformers.LlamaForCausalLM, (-1, 5)
    config._attn_implementation = attention
    torch.manual_seed(0)
    model = model_class(config).to(D).eval()
    ids = torch.randint(3, 50, (2, 7), generator=torch.Generator().manual_seed(1))
    lrp = relprop.LRP(model, "attnlrp")
    relevance = lrp.attribute(ids, target=target, create_graph=True)
    torch.testing.assert_close(relevance.detach(), lrp.attribute(ids, target=target), rtol=1e-10, atol=1e-13)
    weights = torch.randn(relevance.shape, dtype=D, generator=torch.Generator().manual_seed(2))
    parameters = [p for p in model.parameters() if p.requires_grad]
    found = torch.autograd.grad((relevance * weights).sum(), parameters, allow_unused=True)
    generator = torch.Generator().manual_seed(3)
    for grad, parameter in zip(found, parameters):
        direction = torch.randn(parameter.shape, dtype=D, generator=generator)
        original, totals = parameter.detach().clone(), []
        for change in (step, -step, 2 * step, -2 * step):
            with torch.no_grad():
                parameter.copy_(original + change * direction)
            totals.append((lrp.attribute(ids, target=target) * weights).sum().item())
        with torch.no_grad():
            parameter.copy_(original)
        # the five-point stencil: its error is of order step^4, where the float32 steps call for a large step
        expected = (8 * (totals[0] - totals[1]) - (totals[2] - totals[3])) / (12 * step)
        got = 0.0 if grad is None else (grad * direction).sum().item()
        assert abs(got - expected) <= tolerance * max(abs(expected), 1e-2), (tuple(parameter.shape), got, expected)


class Recurrent(nn.Module):
    """A recurrent layer (its last step's output) and a dense head."""

    def __init__(self, kind, **options):
        super().__init__()
        self.layer = getattr(nn, kind)(3, 4, batch_first=True, **options)
        width = options.get("proj_size") or 4 * (2 if options.get("bidirectional") else 1)
        self.head = nn.Linear(width, 2)

    def forward(self, x):
        return self.head(self.layer(x)[0][:, -1])


@pytest.mark.parametrize("kind, options", [("LSTM", {}), ("LSTM", {"num_layers": 2, "bidirectional": True}),
                                           ("LSTM", {"proj_size": 2}), ("GRU", {}), ("RNN", {})],
                         ids=["LSTM", "LSTM-2-layers-bidirectional", "LSTM-projected", "GRU", "RNN"])
def test_recurrent_rules_differentiate(kind, options):
    torch.manual_seed(0)
    model = Recurrent(kind, **options).to(D).eval()
    check(model, "epsilon", torch.randn(2, 4, 3, dtype=D, generator=torch.Generator().manual_seed(1)), 0)
    assert "forward" not in vars(model.layer)  # its own forward again


def test_a_model_the_program_cannot_write_is_refused_with_the_reason():
    class Branching(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(3, 2)

        def forward(self, x):
            return self.layer(x) if x.sum() > 0 else -self.layer(x)  # a branch on the data

    refused = r"^relprop: create_graph=True cannot write this model's relevance as a differentiable program: "
    with pytest.raises(relprop.UnsupportedOpError, match=refused + ".*Data-dependent branching"):
        relprop.LRP(Branching().eval()).attribute(torch.randn(2, 3), target=0, create_graph=True)


def test_a_differentiable_pass_takes_no_taps():
    with pytest.raises(ValueError, match="^relprop: a differentiable pass"):
        relprop.LRP(mlp()).record(torch.randn(2, 5, dtype=D), taps={}, create_graph=True)


def test_the_parameters_flags_and_mode_are_as_they_were():
    model = mlp().train()
    model[0].weight.requires_grad_(False)
    relprop.LRP(model).attribute(torch.randn(2, 5, dtype=D), target=0, create_graph=True)
    assert model.training and all(module.training for module in model)
    assert [p.requires_grad for p in model.parameters()] == [False] + [True] * 5


def test_threads_get_their_own_relevance_and_derivative():
    from concurrent.futures import ThreadPoolExecutor

    torch.manual_seed(0)
    model = Recurrent("LSTM").to(D).eval()
    lrp = relprop.LRP(model, "epsilon")
    inputs = [torch.randn(2, 4, 3, dtype=D, generator=torch.Generator().manual_seed(seed)) for seed in range(4)]

    def derivative(x):
        relevance = lrp.attribute(x, target=0, create_graph=True)
        return relevance.detach(), torch.autograd.grad(relevance.square().sum(), model.layer.weight_hh_l0)[0]
    expected = [derivative(x) for x in inputs]
    with ThreadPoolExecutor(4) as pool:
        found = list(pool.map(derivative, inputs))
    for (relevance, grad), (want_relevance, want_grad) in zip(found, expected):
        assert torch.equal(relevance, want_relevance) and torch.equal(grad, want_grad)
    assert "forward" not in vars(model.layer)
