"""Writes into an activation through a view or ``.data``, and layers the fast paths must not take for others.

A write through a view changes the memory of the tensor it views, whose producer may still read it (a kernel
reads a convolution's output) or vouch for it (a ReLU's output is non-negative): each case is checked against
its rule written out by hand. So are a BatchNorm over another axis than a dense layer's features, which is no
scaling of that layer, and ``addmm`` with a bias per row, which is no dense layer's bias.
"""
import pytest
import torch
from torch import nn

import relprop
from relprop import rules
from relprop.methods.layer import LayerLRP

EPS = 1e-3


def _no_grad_write(y):
    with torch.no_grad():
        y.view(-1).sub_(0.5)


WRITES = {
    "view": lambda y: y.view(-1).sub_(0.5),
    "transposed": lambda y: y.T.sub_(0.5),
    "unsqueezed": lambda y: y.unsqueeze(0).sub_(0.5),
    "narrowed": lambda y: y.narrow(1, 0, 3).mul_(-1.0),
    "sliced": lambda y: y[:, 1:3].fill_(-0.7),
    "item assignment": lambda y: y.__setitem__((slice(None), slice(0, 2)), -0.4),
    "under no_grad": _no_grad_write,
    "through .data": lambda y: y.data.sub_(0.5),
}


class _ReluThenWrite(nn.Module):
    def __init__(self, write):
        super().__init__()
        self.l1, self.l2, self.write = nn.Linear(6, 8), nn.Linear(8, 3), write

    def forward(self, x):
        y = torch.relu(self.l1(x))
        self.write(y)  # y holds negative entries now
        return self.l2(y)


@pytest.mark.parametrize("write", WRITES.values(), ids=WRITES.keys())
def test_a_relu_output_written_into_is_no_longer_taken_for_non_negative(write):
    torch.manual_seed(0)
    model = _ReluThenWrite(write).double().eval()
    x, relevance = torch.randn(4, 6, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    found = LayerLRP(model, "l2", relprop.Composite(dense=rules.ZPlus(stabilizer=EPS))).attribute(
        x, target=relevance, attribute_to_layer_input=True)
    with torch.no_grad():  # z+ on l2 by hand: x+ W+^T s + x- W-^T s, s = R / (W+ x+ + W- x- + b+ + eps)
        y = torch.relu(model.l1(x))
        write(y)
        assert (y < 0).any()
        w_pos, w_neg = model.l2.weight.clamp(min=0), model.l2.weight.clamp(max=0)
        y_pos, y_neg = y.clamp(min=0), y.clamp(max=0)
        s = relevance / (y_pos @ w_pos.T + y_neg @ w_neg.T + model.l2.bias.clamp(min=0) + EPS)
        expected = y_pos * (s @ w_pos) + y_neg * (s @ w_neg)
    torch.testing.assert_close(found, expected, rtol=1e-12, atol=1e-12)


class _ConvWrittenThroughView(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.fc = nn.Conv2d(3, 6, 3, padding=1), nn.Linear(6 * 25, 3)

    def forward(self, x):
        y = self.conv(x)
        y.flatten(1).add_(0.5)  # into the convolution's output, through a view
        return self.fc(y.flatten(1))


def test_a_kernel_that_reads_the_output_reads_it_as_the_op_computed_it():
    torch.manual_seed(4)
    model = _ConvWrittenThroughView().double().eval()
    x, relevance = torch.randn(3, 3, 5, 5, dtype=torch.float64), torch.randn(3, 3, dtype=torch.float64)
    composite = relprop.composites.get("epsilon-alpha2-beta1")
    found = relprop.LRP(model, composite).attribute(x, target=relevance)
    arriving = LayerLRP(model, "conv", composite).attribute(x, target=relevance)  # at the convolution's output
    # alpha = 2, beta = 1 on the convolution by hand, on the shares of x+ and x- through W+ and W-
    weight, bias, eps = model.conv.weight, model.conv.bias, 1e-6  # the preset's stabilizer
    x_pos, x_neg = x.clamp(min=0).requires_grad_(), x.clamp(max=0).requires_grad_()

    def f(inp, w, b):
        return nn.functional.conv2d(inp, w, b, padding=1)

    positive = f(x_pos, weight.clamp(min=0), bias.clamp(min=0)) + f(x_neg, weight.clamp(max=0), None)
    negative = f(x_pos, weight.clamp(max=0), bias.clamp(max=0)) + f(x_neg, weight.clamp(min=0), None)
    on_pos = torch.autograd.grad(positive, (x_pos, x_neg), arriving / (positive + eps), retain_graph=True)
    on_neg = torch.autograd.grad(negative, (x_pos, x_neg), arriving / (negative - eps))
    expected = (2 * (x_pos * on_pos[0] + x_neg * on_pos[1]) - (x_pos * on_neg[0] + x_neg * on_neg[1])).detach()
    torch.testing.assert_close(found, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("steps, features", [(5, 5), (5, 4)])
def test_a_batch_norm_over_the_steps_of_a_dense_layer_is_not_merged_into_it(steps, features):
    torch.manual_seed(0)
    dense, norm = nn.Linear(6, features), nn.BatchNorm1d(steps)
    with torch.no_grad():
        norm.weight.uniform_(-1.5, 1.5), norm.bias.uniform_(-0.5, 0.5)
        norm.running_mean.uniform_(-0.5, 0.5), norm.running_var.uniform_(0.5, 2.0)
    model = nn.Sequential(dense, norm).double().eval()
    x = torch.randn(3, steps, 6, dtype=torch.float64)
    relevance = torch.randn(3, steps, features, dtype=torch.float64)
    eps = 1e-6
    found = relprop.LRP(model, relprop.Composite(dense=rules.ZPlus(stabilizer=eps))).attribute(x, target=relevance)
    with torch.no_grad():  # the BatchNorm as an affine map of each step (epsilon), then z+ on the dense layer
        scale = (norm.weight / torch.sqrt(norm.running_var + norm.eps))[:, None]
        z = dense(x)
        out = norm(z)
        at_z = z * scale * relevance / (out + eps * torch.where(out >= 0, 1.0, -1.0))
        w_pos, w_neg = dense.weight.clamp(min=0), dense.weight.clamp(max=0)
        x_pos, x_neg = x.clamp(min=0), x.clamp(max=0)
        s = at_z / (x_pos @ w_pos.T + x_neg @ w_neg.T + dense.bias.clamp(min=0) + eps)
        expected = x_pos * (s @ w_pos) + x_neg * (s @ w_neg)
    torch.testing.assert_close(found, expected, rtol=1e-10, atol=1e-12)


class _Addmm(nn.Module):
    def __init__(self, bias_shape, decomposed=False):
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.randn(6, 5)), nn.Parameter(torch.randn(*bias_shape))
        self.decomposed = decomposed

    def forward(self, x):
        if self.decomposed:
            return self.bias + x @ self.weight
        return torch.addmm(self.bias, x, self.weight)


@pytest.mark.parametrize("bias_shape", [(5, 1), (5, 5)], ids=["per row", "per entry"])
@pytest.mark.parametrize("rule", [rules.ZBox(0.0, 1.0, stabilizer=1e-6), rules.Flat()], ids=["zbox", "flat"])
def test_addmm_with_a_bias_per_row_is_the_sum_it_writes(bias_shape, rule):
    torch.manual_seed(0)
    model = _Addmm(bias_shape).double().eval()
    twin = _Addmm(bias_shape, decomposed=True).double().eval()
    twin.load_state_dict(model.state_dict())
    x, relevance = torch.rand(5, 6, dtype=torch.float64), torch.randn(5, 5, dtype=torch.float64)
    found = relprop.LRP(model, relprop.Composite(dense=rule)).attribute(x, target=relevance)
    expected = relprop.LRP(twin, relprop.Composite(dense=rule)).attribute(x, target=relevance)
    torch.testing.assert_close(found, expected, rtol=0, atol=0)
