"""Dynamic-quantized Linear, LSTM, GRU and cells (int8 and float16), against float layers with dequantized weights."""
import warnings

import pytest
import torch
from torch import nn

import relprop
from relprop.ops.quantized import dequantized_weights

EXACT = relprop.composites.Epsilon(epsilon=0.0)

pytestmark = pytest.mark.filterwarnings("ignore:.*quantize_per_tensor.*:UserWarning")


def quantize(model: nn.Module, dtype: torch.dtype = torch.qint8) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's deprecation notice for quantized tensors
        return torch.ao.quantization.quantize_dynamic(model.eval(), {nn.Linear, nn.LSTM, nn.GRU, nn.LSTMCell,
                                                                     nn.GRUCell}, dtype=dtype).eval()


def relevance(model: nn.Module, x: torch.Tensor, seed: torch.Tensor) -> torch.Tensor:
    return relprop.LRP(model.eval(), EXACT, strict=True).attribute(x, target=seed)


def float_twin(quantized_rnn: nn.Module, kind: type) -> nn.Module:
    """The float layer with the quantized layer's dequantized weights."""
    twin = kind(quantized_rnn.input_size, quantized_rnn.hidden_size, num_layers=quantized_rnn.num_layers,
                bidirectional=quantized_rnn.bidirectional, batch_first=quantized_rnn.batch_first).eval()
    params = [w for cell in quantized_rnn._all_weight_values for w in dequantized_weights(cell.param)]
    with torch.no_grad():
        for name, value in zip([n for n, _ in twin.named_parameters()], params):
            getattr(twin, name).copy_(value)
    return twin


@pytest.mark.parametrize("dtype", [torch.qint8, torch.float16])
def test_linear_is_the_epsilon_rule_on_the_dequantized_weights(dtype):
    torch.manual_seed(0)
    model = quantize(nn.Sequential(nn.Linear(6, 4)), dtype)
    x, seed = torch.randn(3, 6), torch.randn(3, 4)
    weight, bias = model[0].weight(), model[0].bias()
    weight = weight.dequantize() if weight.is_quantized else weight
    z = x @ weight.T + bias
    expected = x * ((seed / z) @ weight)
    assert torch.allclose(relevance(model, x, seed), expected, rtol=1e-4, atol=1e-5)


def test_output_is_the_quantized_kernels_and_relevance_is_conserved_without_biases():
    torch.manual_seed(1)
    float_model = nn.Sequential(nn.Linear(8, 16, bias=False), nn.ReLU(), nn.Linear(16, 3, bias=False))
    model = quantize(float_model)
    x = torch.randn(5, 8)
    with relprop.LRP(model, EXACT, strict=True).context():
        leaf = x.clone().requires_grad_()
        out = model(leaf)
    assert torch.equal(out.detach(), model(x))  # bitwise the int8 model's output, not the float one's
    assert not torch.equal(out.detach(), float_model(x))
    seed = torch.where(torch.arange(3) == 1, out.detach(), 0.0)
    (r,) = torch.autograd.grad(out, leaf, seed)
    assert torch.allclose(r.sum(1), seed.sum(1), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", [nn.LSTM, nn.GRU])
@pytest.mark.parametrize("dtype", [torch.qint8, torch.float16])
def test_recurrent_layer_equals_the_float_layer_with_dequantized_weights(kind, dtype):
    torch.manual_seed(2)
    model = quantize(nn.Sequential(kind(5, 7, num_layers=2, bidirectional=True, batch_first=True)), dtype)[0]
    x = torch.randn(2, 4, 5)
    seed = torch.randn(2, 4, 14)

    class First(nn.Module):  # the output sequence only
        def __init__(self, rnn):
            super().__init__()
            self.rnn = rnn

        def forward(self, x):
            return self.rnn(x)[0]

    got = relevance(First(model), x, seed)
    expected = relevance(First(float_twin(model, kind)), x, seed)
    assert got.abs().sum() > 0
    assert torch.allclose(got, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", [nn.LSTMCell, nn.GRUCell])
def test_cells_equal_the_float_cell_with_dequantized_weights(kind):
    torch.manual_seed(3)
    float_cell = kind(5, 6)
    cell = quantize(nn.Sequential(float_cell))[0]
    twin = kind(5, 6).eval()
    with torch.no_grad():
        twin.weight_ih.copy_(torch.ops.quantized.linear_unpack(cell._packed_weight_ih)[0].dequantize())
        twin.weight_hh.copy_(torch.ops.quantized.linear_unpack(cell._packed_weight_hh)[0].dequantize())
        twin.bias_ih.copy_(cell.bias_ih)
        twin.bias_hh.copy_(cell.bias_hh)

    class Hidden(nn.Module):
        def __init__(self, cell):
            super().__init__()
            self.cell = cell

        def forward(self, x):
            out = self.cell(x)
            return out[0] if isinstance(out, tuple) else out

    x, seed = torch.randn(3, 5), torch.randn(3, 6)
    got = relevance(Hidden(cell), x, seed)
    assert got.abs().sum() > 0
    assert torch.allclose(got, relevance(Hidden(twin), x, seed), rtol=1e-4, atol=1e-5)


def test_static_quantization_is_refused_with_the_module_path():
    class Static(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 2)

        def forward(self, x):
            q = torch.quantize_per_tensor(x, 0.1, 0, torch.quint8)
            return self.fc(q.dequantize())

    with pytest.raises(NotImplementedError, match="statically quantized models are not supported"):
        relprop.LRP(Static().eval()).attribute(torch.randn(2, 4), target=0)


@pytest.mark.parametrize("dtype", [torch.qint8, torch.float16])
def test_fused_linear_relu_is_the_epsilon_rule_on_the_dequantized_weights(dtype):
    torch.manual_seed(4)
    fused = torch.ao.quantization.fuse_modules(nn.Sequential(nn.Linear(4, 3), nn.ReLU()).eval(), [["0", "1"]])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = torch.ao.quantization.quantize_dynamic(fused, {torch.ao.nn.intrinsic.LinearReLU}, dtype=dtype).eval()
    assert isinstance(model[0], torch.ao.nn.intrinsic.quantized.dynamic.LinearReLU)
    x, seed = torch.randn(2, 4), torch.randn(2, 3)
    weight, bias = model[0].weight(), model[0].bias()
    weight = weight.dequantize() if weight.is_quantized else weight
    z = x @ weight.T + bias
    expected = x * ((seed / z) @ weight)  # the ReLU passes relevance on (Pass), also where it output 0
    assert torch.allclose(relevance(model, x, seed), expected, rtol=1e-4, atol=1e-5)
    with relprop.LRP(model, EXACT).context():
        out = model(x.clone().requires_grad_())
    assert torch.equal(out.detach(), model(x))
