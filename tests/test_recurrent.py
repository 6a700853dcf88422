"""LRP through nn.LSTM, nn.GRU, nn.RNN and their cells, float64."""
import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

import relprop

EXACT = relprop.composites.Epsilon(epsilon=0.0)


def reference(rnn: nn.Module, x: torch.Tensor, relevance_out: torch.Tensor) -> torch.Tensor:
    """Relevance of ``x`` (B, T, F) for output relevance (B, T, D*H) of a batch-first LSTM / GRU, from the formulas.

    Epsilon-0 on the linear parts (biases absorb their share; an LSTM's projection ``h = W_hr m`` is one more),
    gates take nothing, the signal takes all, sums shared by contribution, tanh passes relevance. One time step at
    a time, plain tensor code.
    """
    def div(a, b):
        return torch.where(b == 0, 0.0, a / torch.where(b == 0, 1.0, b))

    kind, hidden, directions = type(rnn).__name__, rnn.hidden_size, 2 if rnn.bidirectional else 1
    width = getattr(rnn, "proj_size", 0) or hidden  # of the hidden state h
    batch, steps, _ = x.shape
    inputs, caches = [x], []
    for layer in range(rnn.num_layers):  # forward pass, keeping every intermediate value
        layer_caches, outs = [], []
        for d in range(directions):
            suffix = f"_l{layer}" + ("_reverse" if d else "")
            w_ih, w_hh = getattr(rnn, "weight_ih" + suffix), getattr(rnn, "weight_hh" + suffix)
            b_ih, b_hh = getattr(rnn, "bias_ih" + suffix), getattr(rnn, "bias_hh" + suffix)
            w_hr = getattr(rnn, "weight_hr" + suffix, None)
            h = torch.zeros(batch, width, dtype=x.dtype)
            c = torch.zeros(batch, hidden, dtype=x.dtype)
            cache, out = {}, [None] * steps
            for t in (range(steps - 1, -1, -1) if d else range(steps)):
                a = inputs[-1][:, t] @ w_ih.T + b_ih
                b = h @ w_hh.T + b_hh
                if kind == "LSTM":
                    i, f, g, o = (a + b).chunk(4, -1)
                    c_new = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
                    m = torch.sigmoid(o) * torch.tanh(c_new)
                    h_new = m if w_hr is None else m @ w_hr.T
                    cache[t] = dict(a=a, b=b, h=h, c=c, c_new=c_new, f=torch.sigmoid(f), i=torch.sigmoid(i), g=g,
                                    m=m, h_new=h_new)
                    h, c = h_new, c_new
                else:
                    (a_r, a_z, a_n), (b_r, b_z, b_n) = a.chunk(3, -1), b.chunk(3, -1)
                    r, z = torch.sigmoid(a_r + b_r), torch.sigmoid(a_z + b_z)
                    pre = a_n + r * b_n
                    n = torch.tanh(pre)
                    h_new = (1 - z) * n + z * h
                    cache[t] = dict(a_n=a_n, b_n=b_n, r=r, pre=pre, n=n, z=z, h=h, h_new=h_new)
                    h = h_new
                out[t] = h
            layer_caches.append((w_ih, w_hh, w_hr, cache))
            outs.append(torch.stack(out, 1))
        caches.append(layer_caches)
        inputs.append(torch.cat(outs, -1))

    relevance = relevance_out
    for layer in reversed(range(rnn.num_layers)):  # backward pass, rule by rule
        layer_in = inputs[layer]
        r_in = torch.zeros_like(layer_in)
        for d, (w_ih, w_hh, w_hr, cache) in enumerate(caches[layer]):
            r_out = relevance[..., d * width:(d + 1) * width]
            r_h, r_c = torch.zeros(batch, width, dtype=x.dtype), torch.zeros(batch, hidden, dtype=x.dtype)
            for t in (range(steps) if d else range(steps - 1, -1, -1)):
                v = cache[t]
                r_h = r_h + r_out[:, t]
                if kind == "LSTM":
                    r_m = r_h if w_hr is None else v["m"] * (div(r_h, v["h_new"]) @ w_hr)  # epsilon-0, no bias
                    r_c = r_c + r_m                                   # m = o * tanh(c): o nothing, tanh passes
                    r_prev_c = div(v["f"] * v["c"], v["c_new"]) * r_c  # c = f*c_prev + i*g, by contribution
                    r_g = div(v["i"] * torch.tanh(v["g"]), v["c_new"]) * r_c
                    z_g = (v["a"] + v["b"]).chunk(4, -1)[2]
                    s = div(r_g, z_g)                                  # epsilon-0 on the g pre-activation
                    w_g_ih, w_g_hh = w_ih.chunk(4, 0)[2], w_hh.chunk(4, 0)[2]
                    r_in[:, t] += layer_in[:, t] * (s @ w_g_ih)
                    r_h = v["h"] * (s @ w_g_hh)
                    r_c = r_prev_c
                else:
                    r_n = div((1 - v["z"]) * v["n"], v["h_new"]) * r_h
                    r_h_direct = div(v["z"] * v["h"], v["h_new"]) * r_h
                    r_a_n = div(v["a_n"], v["pre"]) * r_n                # tanh passes, sum by contribution
                    r_b_n = div(v["r"] * v["b_n"], v["pre"]) * r_n      # reset gate nothing, signal all
                    w_n_ih, w_n_hh = w_ih.chunk(3, 0)[2], w_hh.chunk(3, 0)[2]
                    r_in[:, t] += layer_in[:, t] * (div(r_a_n, v["a_n"]) @ w_n_ih)
                    r_h = r_h_direct + v["h"] * (div(r_b_n, v["b_n"]) @ w_n_hh)
        relevance = r_in
    return relevance


#: an LSTM with projections (``proj_size``) beside the plain layers: "LSTM-proj"
KINDS = {"LSTM": ("LSTM", {}), "GRU": ("GRU", {}), "RNN": ("RNN", {}), "LSTM-proj": ("LSTM", {"proj_size": 3})}


def layer(kind, **options):
    """A recurrent layer of 4 input features and 5 hidden units (an LSTM-proj's hidden state has 3)."""
    name, extra = KINDS[kind]
    return getattr(nn, name)(4, 5, batch_first=True, **extra, **options)


def width(kind):
    return KINDS[kind][1].get("proj_size", 5)


class Sequence(nn.Module):
    def __init__(self, kind, bias=True, layers=2, bidirectional=True):
        super().__init__()
        self.rnn = layer(kind, num_layers=layers, bidirectional=bidirectional, bias=bias)

    def forward(self, x):
        return self.rnn(x)[0]


@pytest.mark.parametrize("kind", ["LSTM", "GRU", "LSTM-proj"])
def test_two_layer_bidirectional_matches_the_explicit_reference(kind):
    torch.manual_seed(0)
    model = Sequence(kind).double().eval()
    x = torch.randn(3, 6, 4, dtype=torch.float64)
    out = model(x).detach()
    R = torch.randn_like(out)
    relevance = relprop.LRP(model, EXACT, strict=True).attribute(x, target=R)
    torch.testing.assert_close(relevance, reference(model.rnn, x, R), rtol=1e-8, atol=1e-10)


class WithStates(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.lstm = kind.startswith("LSTM")
        self.rnn = layer(kind, num_layers=2, bias=False)
        self.head = nn.Linear(width(kind), 3, bias=False)

    def forward(self, x, h0, c0):
        out, _ = self.rnn(x, (h0, c0) if self.lstm else h0)
        return self.head(out[:, -1])


@pytest.mark.parametrize("kind", ["LSTM", "GRU", "RNN", "LSTM-proj"])
def test_conservation_with_initial_states(kind):
    torch.manual_seed(0)
    model = WithStates(kind).double().eval()
    x, h0, c0 = (torch.randn(3, 6, 4, dtype=torch.float64), torch.randn(2, 3, width(kind), dtype=torch.float64),
                 torch.randn(2, 3, 5, dtype=torch.float64))
    rx, rh, rc = relprop.LRP(model, EXACT, strict=True).attribute((x, h0, c0), target=1)
    total = rx.sum() + rh.sum() + rc.sum()  # the states are layer-first: totals over the batch
    torch.testing.assert_close(total, model(x, h0, c0)[:, 1].sum().detach(), rtol=1e-10, atol=1e-12)
    assert rh.abs().sum() > 0 and (rc.abs().sum() > 0) == model.lstm
    assert torch.equal(relprop.LRP(model).record((x, h0, c0)).logits, model(x, h0, c0))  # bitwise


class Tagger(nn.Module):
    """Embeddings before, a linear head after, packed sequences of different lengths in between."""

    def __init__(self, kind):
        super().__init__()
        self.embed = nn.Embedding(30, 4)
        self.rnn = layer(kind, bidirectional=True, bias=False)
        self.head = nn.Linear(2 * width(kind), 3, bias=False)

    def forward(self, ids, lengths):
        packed = pack_padded_sequence(self.embed(ids), lengths, batch_first=True, enforce_sorted=False)
        _, hidden = self.rnn(packed)
        hidden = hidden[0] if isinstance(hidden, tuple) else hidden
        return self.head(torch.cat([hidden[0], hidden[1]], -1))


@pytest.mark.parametrize("kind", ["LSTM", "GRU", "LSTM-proj"])
def test_packed_sequences_match_each_sequence_alone(kind):
    torch.manual_seed(0)
    model = Tagger(kind).double().eval()
    ids = torch.randint(0, 30, (3, 6))
    lengths = torch.tensor([4, 6, 2])
    lrp = relprop.LRP(model, EXACT, strict=True)
    relevance, delta = lrp.attribute(ids, target=2, additional_forward_args=(lengths,),
                                     return_convergence_delta=True)
    assert delta.abs().max() < 1e-10
    for row, length in enumerate(lengths.tolist()):
        assert torch.equal(relevance[row, length:], torch.zeros(6 - length, dtype=relevance.dtype))
        alone = lrp.attribute(ids[row:row + 1, :length], target=2,
                              additional_forward_args=(torch.tensor([length]),))
        torch.testing.assert_close(relevance[row, :length], alone[0], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("kind", ["LSTM", "GRU", "RNN"])
def test_cells_equal_the_layer(kind):
    torch.manual_seed(0)
    layer = getattr(nn, kind)(4, 5, batch_first=True).double().eval()
    cell = getattr(nn, f"{kind}Cell")(4, 5).double().eval()
    cell.load_state_dict({key[:-3]: value for key, value in layer.state_dict().items()})

    class Looped(nn.Module):
        def __init__(self):
            super().__init__()
            self.cell = cell

        def forward(self, x):
            h = torch.zeros(x.shape[0], 5, dtype=x.dtype)
            state = (h, h) if kind == "LSTM" else h
            for t in range(x.shape[1]):
                state = self.cell(x[:, t], state)
            return state[0] if kind == "LSTM" else state

    class Last(nn.Module):
        def forward(self, x):
            return layer(x)[0][:, -1]

    x = torch.randn(3, 6, 4, dtype=torch.float64)
    R = torch.randn(3, 5, dtype=torch.float64)
    by_cell = relprop.LRP(Looped().eval(), EXACT, strict=True).attribute(x, target=R)
    by_layer = relprop.LRP(Last().eval(), EXACT, strict=True).attribute(x, target=R)
    torch.testing.assert_close(by_cell, by_layer, rtol=1e-9, atol=1e-12)
