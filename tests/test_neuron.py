"""NeuronLRP: the relevance of the inputs for one unit of an inner layer, float64."""
import pytest
import torch
from captum.attr import NeuronGradient
from helpers import Embedded
from torch import nn

import relprop

EXACT = relprop.composites.Epsilon(epsilon=0.0)


def convnet():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(), nn.Conv2d(6, 5, 3),
                          nn.ReLU(), nn.Flatten(), nn.Linear(5 * 6 * 6, 4)).double().eval()
    batch_norm = model[1]
    batch_norm.running_mean.uniform_(-1, 1)
    batch_norm.running_var.uniform_(0.5, 2)
    batch_norm.weight.data.uniform_(0.5, 2)
    return model


def cut(model, stop):
    """The model's first ``stop`` modules, built by hand: the model cut at a layer."""
    return nn.Sequential(*list(model)[:stop]).eval()


X = torch.randn(2, 3, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("composite", ["epsilon-plus-flat", "epsilon-alpha2-beta1", EXACT])
@pytest.mark.parametrize("layer, stop, unit", [
    ("3", 4, (2, 1, 3)),   # a convolution's output
    ("0", 1, (4, 2, 2)),   # a convolution that a BatchNorm follows (merged): still the convolution's own unit
    ("1", 2, (4, 2, 2)),   # the BatchNorm's output
    ("6", 7, (1,)),        # the last layer: plain LRP
    ("3", 4, (2,)),        # a whole channel: its sum
])
def test_equals_lrp_of_the_model_cut_at_the_layer(composite, layer, stop, unit):
    model = convnet()
    relevance, delta = relprop.NeuronLRP(model, layer, composite).attribute(X, unit, return_convergence_delta=True)
    cut_model = cut(model, stop)
    expected, expected_delta = relprop.LRP(cut_model, composite).attribute(X, target=unit,
                                                                           return_convergence_delta=True)
    assert relevance.abs().sum() > 0
    torch.testing.assert_close(relevance, expected, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(delta, expected_delta, rtol=1e-8, atol=1e-10)


def test_the_input_of_a_layer_and_a_callable():
    model = convnet()
    lrp = relprop.NeuronLRP(model, model[3], "epsilon-plus-flat")
    # the input of conv 3 is the ReLU's output: the model cut after the ReLU
    by_input = lrp.attribute(X, (4, 5, 2), attribute_to_neuron_input=True)
    torch.testing.assert_close(by_input, relprop.LRP(cut(model, 3), "epsilon-plus-flat").attribute(X, (4, 5, 2)),
                               rtol=1e-10, atol=1e-12)
    # a linear selector (a channel's sum, two units weighted) seeds dv/dy * y: the same as the index (a sum)
    channel = lrp.attribute(X, lambda y: y[:, 2].sum((1, 2)))
    torch.testing.assert_close(channel, lrp.attribute(X, (2,)), rtol=1e-10, atol=1e-12)
    weighted = lrp.attribute(X, lambda y: 2 * y[:, 2, 1, 3] - y[:, 0, 0, 0])
    seed = torch.zeros(2, 5, 6, 6, dtype=torch.float64)
    output = cut(model, 4)(X).detach()
    seed[:, 2, 1, 3], seed[:, 0, 0, 0] = 2 * output[:, 2, 1, 3], -output[:, 0, 0, 0]
    torch.testing.assert_close(weighted, relprop.LRP(cut(model, 4), "epsilon-plus-flat").attribute(X, seed),
                               rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("attribute_to_neuron_input", [False, True])
def test_lrp0_on_a_relu_net_is_gradient_times_input_and_agrees_with_captum(attribute_to_neuron_input):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 12), nn.ReLU(), nn.Linear(12, 3)).double().eval()
    x = torch.randn(5, 6, dtype=torch.float64)
    unit = 7
    relevance = relprop.NeuronLRP(model, "2", EXACT).attribute(
        x, unit, attribute_to_neuron_input=attribute_to_neuron_input)
    leaf = x.clone().requires_grad_()
    inner = model[:2](leaf) if attribute_to_neuron_input else model[:3](leaf)
    (gradient,) = torch.autograd.grad(inner[:, unit].sum(), leaf)
    torch.testing.assert_close(relevance, gradient * x, rtol=1e-10, atol=1e-12)
    captum = NeuronGradient(model, model[2]).attribute(x.clone().requires_grad_(), unit,
                                                       attribute_to_neuron_input=attribute_to_neuron_input)
    torch.testing.assert_close(relevance, captum * x, rtol=1e-10, atol=1e-12)
    assert relevance.abs().sum() > 0


class Split(nn.Module):
    """A layer with a tuple output."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 3), nn.Linear(4, 2)

    def forward(self, x):
        return self.a(x).relu(), self.b(x)


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.split = Split()
        self.head = nn.Linear(5, 2)

    def forward(self, x):
        return self.head(torch.cat(self.split(x), 1))


def test_a_callable_on_a_tuple_output():
    torch.manual_seed(0)
    model = TwoHeads().double().eval()
    x = torch.randn(3, 4, dtype=torch.float64)
    relevance = relprop.NeuronLRP(model, "split").attribute(x, lambda y: y[0][:, 1] - 3 * y[1][:, 0])

    class Cut(nn.Module):
        def __init__(self):
            super().__init__()
            self.split = model.split

        def forward(self, x):
            return torch.cat(self.split(x), 1)

    out = Cut()(x).detach()
    seed = torch.zeros_like(out)
    seed[:, 1], seed[:, 3] = out[:, 1], -3 * out[:, 3]
    torch.testing.assert_close(relevance, relprop.LRP(Cut().eval()).attribute(x, seed), rtol=1e-10, atol=1e-12)


def tiny_llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=32)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).double().eval()


def by_hand(model, layer, inputs, seed_of):
    """The relevance of ``inputs`` for a seed put by hand on ``layer``'s input, in :meth:`LRP.context`."""
    captured = []
    handle = layer.register_forward_pre_hook(lambda module, args: captured.append(args[0]))
    lrp = relprop.LRP(model, "attnlrp")
    leaf = inputs.clone().requires_grad_()
    try:
        with lrp.context():
            model(leaf)
    finally:
        handle.remove()
    (tensor,) = captured
    (relevance,) = torch.autograd.grad(tensor, leaf, seed_of(tensor.detach()))
    return relevance


POSITION, TOKENS = 2, torch.tensor([[5, 17, 23, 9, 41], [3, 8, 30, 12, 7]])


@pytest.mark.parametrize("unit", ["mlp", "head"])
def test_a_hugging_face_decoder_mlp_neuron_and_attention_head(unit):
    llama = tiny_llama()
    embedded = llama.model.embed_tokens(TOKENS).detach()
    block = llama.model.layers[1]
    if unit == "mlp":  # neuron 5 of the MLP (the input of down_proj) at one position
        layer, selector = block.mlp.down_proj, (POSITION, 5)

        def seed_of(y):
            seed = torch.zeros_like(y)
            seed[:, POSITION, 5] = y[:, POSITION, 5]
            return seed
    else:  # head 1's output at one position (its slice of o_proj's input), summed
        layer, width = block.self_attn.o_proj, block.self_attn.head_dim
        heads = slice(width, 2 * width)

        def selector(y):
            return y[:, POSITION, heads].sum(-1)

        def seed_of(y):
            seed = torch.zeros_like(y)
            seed[:, POSITION, heads] = y[:, POSITION, heads]
            return seed

    model = Embedded(llama).eval()  # on embedded tokens: the reference for the relevance per token
    name = next(name for name, module in model.named_modules() if module is layer)
    relevance, delta = relprop.NeuronLRP(model, name, "attnlrp").attribute(
        embedded, selector, attribute_to_neuron_input=True, return_convergence_delta=True)
    torch.testing.assert_close(relevance, by_hand(model, layer, embedded, seed_of), rtol=1e-9, atol=1e-12)
    # causal attention: the tokens after the position get nothing
    assert relevance[:, POSITION + 1:].abs().max() == 0 and relevance[:, :POSITION + 1].abs().sum() > 0
    assert torch.isfinite(delta).all()
    # on the token ids, one relevance per token: the embeddings' relevance summed over the hidden dimension
    lrp = relprop.NeuronLRP(llama, layer, "attnlrp")
    per_token = lrp.attribute(TOKENS, selector, attribute_to_neuron_input=True)
    torch.testing.assert_close(per_token, relevance.sum(-1), rtol=1e-9, atol=1e-12)
    # CP-LRP conserves on a decoder without biases: the relevance of the tokens sums to the value of the unit
    conserved = relprop.NeuronLRP(llama, layer, "cp-lrp").attribute(TOKENS, selector, attribute_to_neuron_input=True)
    captured = []
    handle = layer.register_forward_pre_hook(lambda module, args: captured.append(args[0]))
    try:
        with torch.no_grad():
            llama(TOKENS)
    finally:
        handle.remove()
    value = seed_of(captured[0]).sum((1, 2))
    torch.testing.assert_close(conserved.sum(1), value, rtol=1e-6, atol=1e-12)  # RMSNorm runs in float32


@pytest.mark.parametrize("selector, message", [
    ((0, 9), r"neuron_selector \(0, 9\) is out of range .* index 9 on dimension 2 of size 6"),
    ((0, 1, 2, 3), r"has 4 indices, but the output of layer '3' of shape \(2, 5, 6, 6\) has 3 dimension"),
    ("2", "must be an int, a tuple of ints and slices, or a callable"),
    ((1.0,), "must be an int, a tuple of ints and slices, or a callable"),
    (lambda y: y[:, 0], r"one value per example, shape \(2,\), from the output of layer '3'; it returned \(2, 6, 6\)"),
    (lambda y: torch.ones(2, dtype=y.dtype), "does not depend on the output of layer '3'"),
])
def test_bad_selectors_name_the_problem(selector, message):
    model = convnet()
    state = {key: value.clone() for key, value in model.state_dict().items()}
    lrp = relprop.NeuronLRP(model, "3")
    with pytest.raises((ValueError, TypeError), match=message):
        lrp.attribute(X, selector)
    # nothing stays on the model, and the next call works
    assert all(torch.equal(value, state[key]) for key, value in model.state_dict().items())
    assert not any(module._forward_hooks or module._forward_pre_hooks for module in model.modules())
    torch.testing.assert_close(lrp.attribute(X, (1,)), relprop.LRP(cut(model, 4)).attribute(X, (1,)))


def test_bad_layers_name_the_problem():
    torch.manual_seed(0)
    model = TwoHeads().double().eval()
    x = torch.randn(3, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="the output of layer 'split' holds 2 entries; pass a callable"):
        relprop.NeuronLRP(model, "split").attribute(x, (0,))
    relu = nn.ReLU()
    twice = nn.Sequential(nn.Linear(4, 4), relu, nn.Linear(4, 4), relu).double().eval()
    with pytest.raises(ValueError, match="runs once per forward pass; the output of layer '1' was tapped 2 times"):
        relprop.NeuronLRP(twice, relu).attribute(x, (0,))
    with pytest.raises(ValueError, match="no module named 'head.missing'"):
        relprop.NeuronLRP(model, "head.missing")
