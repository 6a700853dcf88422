"""BiLRP on small models in float64: sums, closed forms, chunking, pooling, tokens, callables, bad input."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import relprop
from relprop.composites import Epsilon

LRP0 = Epsilon(0.0)


class Embedder(nn.Module):
    """A bias-free ReLU CNN embedding: conv, ReLU, conv, ReLU, flatten, linear."""

    def __init__(self, dims: int = 6):
        super().__init__()
        self.conv1 = nn.Conv2d(2, 4, 3, padding=1, bias=False)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1, bias=False)
        self.fc = nn.Linear(4 * 4 * 4, dims, bias=False)

    def forward(self, x):
        h = F.relu(self.conv2(F.relu(self.conv1(x))))
        return self.fc(h.flatten(1))


def model_and_pair(batch: int = 3):
    model = Embedder().double().eval()
    return model, torch.randn(batch, 2, 4, 4, dtype=torch.float64), torch.randn(batch, 2, 4, 4, dtype=torch.float64)


def gradient_times_input_per_dimension(model, x):
    """(D, B, *S): x * d phi_m / dx, which is LRP-0's R(phi_m) on a bias-free ReLU net (closed form)."""
    jacobian = torch.autograd.functional.jacobian(lambda v: model(v).sum(0), x)  # (D, B, *S)
    return jacobian * x


def test_pair_relevance_sums_to_the_similarity_and_equals_a_double_loop_over_dimensions():
    model, x, x2 = model_and_pair()
    pairs = relprop.BiLRP(model, LRP0).attribute(x, x2)
    assert pairs.shape == (3, 2, 4, 4, 2, 4, 4) and pairs.dtype == torch.float64
    similarity = (model(x) * model(x2)).sum(1)
    assert torch.allclose(pairs.flatten(1).sum(1), similarity, rtol=0, atol=1e-8)
    left, right = gradient_times_input_per_dimension(model, x), gradient_times_input_per_dimension(model, x2)
    expected = torch.zeros(3, 32, 32, dtype=torch.float64)
    for b in range(3):
        for m in range(left.shape[0]):
            for i in range(32):
                for j in range(32):
                    expected[b, i, j] += left[m, b].flatten()[i] * right[m, b].flatten()[j]
    assert torch.allclose(pairs.reshape(3, 32, 32), expected, rtol=0, atol=1e-10)


def test_chunking_does_not_change_the_result():
    model, x, x2 = model_and_pair()
    whole = relprop.BiLRP(model, "epsilon-plus", max_batch=1000).attribute(x, x2)
    for max_batch in (1, 4, 7):
        chunked = relprop.BiLRP(model, "epsilon-plus", max_batch=max_batch).attribute(x, x2)
        assert torch.allclose(chunked, whole, rtol=0, atol=1e-12), max_batch


def test_pool_sums_patches_before_the_pairs():
    model, x, x2 = model_and_pair(2)
    bilrp = relprop.BiLRP(model, LRP0)

    def patches(r):
        return F.avg_pool2d(r.sum(1), 2) * 4  # (N, 2, 2): sum over channels and 2x2 patches

    pooled = bilrp.attribute(x, x2, pool=patches)
    assert pooled.shape == (2, 2, 2, 2, 2)
    full = bilrp.attribute(x, x2).sum((1, 4))  # (B, 4, 4, 4, 4) after the channels
    expected = full.reshape(2, 2, 2, 2, 2, 2, 2, 2, 2).sum((2, 4, 6, 8))
    assert torch.allclose(pooled, expected, rtol=0, atol=1e-10)


def test_first_order_is_the_marginal_of_the_pair_relevance():
    model, x, x2 = model_and_pair()
    bilrp = relprop.BiLRP(model, LRP0)
    pairs = bilrp.attribute(x, x2).reshape(3, 32, 32)
    left, right = bilrp.first_order(x, x2)
    assert left.shape == x.shape and right.shape == x2.shape
    assert torch.allclose(left.flatten(1), pairs.sum(2), rtol=0, atol=1e-10)
    assert torch.allclose(right.flatten(1), pairs.sum(1), rtol=0, atol=1e-10)
    assert torch.allclose(left.flatten(1).sum(1), bilrp.similarity(x, x2), rtol=0, atol=1e-8)


def test_callable_embedding_finds_the_modules_it_runs():
    torch.manual_seed(1)
    model, x, x2 = model_and_pair()
    head = nn.Linear(6, 5, bias=False).double().eval()
    # ZPlus by module type: it only reaches the head if the wrapper gives the head's ops their module context
    composite = Epsilon(0.0, layer_map={nn.Linear: relprop.rules.ZPlus()})
    through_callable = relprop.BiLRP(lambda v: head(model(v)), composite).attribute(x, x2)
    as_module = relprop.BiLRP(nn.Sequential(model, head).eval(), composite).attribute(x, x2)
    assert torch.allclose(through_callable, as_module, rtol=0, atol=1e-12)
    plain = relprop.BiLRP(nn.Sequential(model, head).eval(), LRP0).attribute(x, x2)
    assert not torch.allclose(through_callable, plain, atol=1e-3)  # the layer_map rule did apply
    # the modules are named as the callable names them: a name_map pattern 'head' finds the head
    named = Epsilon(0.0, name_map={"head": relprop.rules.ZPlus()})
    wrapped = nn.Module().eval()
    wrapped.model, wrapped.head = model, head
    wrapped.forward = lambda v: wrapped.head(wrapped.model(v))
    expected = relprop.BiLRP(wrapped, named).attribute(x, x2)
    assert torch.allclose(relprop.BiLRP(lambda v: head(model(v)), named).attribute(x, x2), expected, atol=1e-12)
    assert not torch.allclose(expected, plain, atol=1e-3)


def test_a_model_in_training_mode_is_explained_in_eval_mode_and_left_as_it_was():
    model, x, x2 = model_and_pair()
    dropped = nn.Sequential(model, nn.Dropout(0.5)).train()
    with pytest.warns(UserWarning, match="training mode"):
        pairs = relprop.BiLRP(lambda v: dropped(v), LRP0).attribute(x, x2)
    assert all(module.training for module in dropped.modules())
    assert torch.allclose(pairs.flatten(1).sum(1), (model(x) * model(x2)).sum(1), rtol=0, atol=1e-8)


class TokenEmbedder(nn.Module):
    """Token embedding, a bias-free ReLU MLP per token and a masked mean over tokens."""

    def __init__(self, vocabulary: int = 20, hidden: int = 8, dims: int = 5):
        super().__init__()
        self.embedding = nn.Embedding(vocabulary, hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, hidden, bias=False), nn.ReLU(), nn.Linear(hidden, dims, bias=False))

    def forward(self, ids, mask):
        h = self.mlp(self.embedding(ids)) * mask.unsqueeze(-1)
        return h.sum(1) / mask.sum(1, keepdim=True)


def test_token_inputs_give_one_relevance_per_token_pair_and_conserve():
    model = TokenEmbedder().double().eval()
    ids, ids2 = torch.randint(0, 20, (2, 5)), torch.randint(0, 20, (2, 7))
    mask, mask2 = torch.ones(2, 5, dtype=torch.float64), torch.ones(2, 7, dtype=torch.float64)
    mask2[1, 5:] = 0  # the second pair's second sentence is padded
    bilrp = relprop.BiLRP(model, LRP0, max_batch=4)
    pairs = bilrp.attribute(ids, ids2, (mask,), {"mask": mask2})
    assert pairs.shape == (2, 5, 7)
    assert torch.allclose(pairs.sum((1, 2)), bilrp.similarity(ids, ids2, (mask,), (mask2,)), rtol=0, atol=1e-8)
    assert pairs[1, :, 5:].abs().max() == 0  # padding gets nothing
    alone = relprop.BiLRP(model, LRP0).attribute(ids[1:], ids2[1:, :5], (mask[1:],), (mask2[1:, :5],))
    assert torch.allclose(pairs[1, :, :5], alone[0], rtol=0, atol=1e-10)


def test_bad_input_is_refused_with_the_problem_named():
    model, x, x2 = model_and_pair()
    bilrp = relprop.BiLRP(model, LRP0)
    with pytest.raises(ValueError, match="same size"):
        bilrp.attribute(x, x2[:2])
    with pytest.raises(ValueError, match="shape \\(batch, dimensions\\)"):
        relprop.BiLRP(nn.Conv2d(2, 3, 1).double()).attribute(x, x2)
    with pytest.raises(ValueError, match="batch first"):
        ids = torch.zeros(3, 4, dtype=torch.long)
        relprop.BiLRP(TokenEmbedder()).attribute(ids, ids, (torch.ones(4),), (torch.ones(3, 4),))
    with pytest.raises(ValueError, match="max_batch"):
        relprop.BiLRP(model, max_batch=0)
    with pytest.raises(TypeError, match="ran no torch.nn.Module"):
        relprop.BiLRP(lambda v: v.flatten(1)).attribute(x, x2)


def test_pair_pictures_show_the_strongest_pairs(tmp_path):
    pytest.importorskip("matplotlib")
    from PIL import Image

    from relprop.viz import pairplot

    pairs = torch.zeros(3, 4, dtype=torch.float64)
    pairs[1, 2], pairs[0, 3], pairs[2, 0] = 2.0, -3.0, 0.5
    assert pairplot.strongest_pairs(pairs, 2) == [(0, 3, -3.0), (1, 2, 2.0)]
    tokens, other = ["a", "<b>", "c"], ["w", "x", "y", "z"]
    svg = pairplot.token_lines_html(tokens, other, pairs, top=2)
    assert svg.count("<line") == 2 and "&lt;b&gt;" in svg and "<b>" not in svg
    assert 'stroke="#1f5fd6" stroke-width="6.0"' in svg  # the strongest, negative pair: blue, widest
    table = pairplot.token_matrix_html(tokens, other, pairs)
    assert table.count("<td") == 12 and "rgb(0, 0, 255)" in table  # -max is full blue
    for draw in (pairplot.token_matrix, pairplot.token_lines):
        path = draw(tokens, other, pairs, tmp_path / f"{draw.__name__}.png")
        width, height = Image.open(path).size
        assert 100 < width < 2000 and 100 < height < 2000
    with pytest.raises(ValueError, match="does not match 2 and 4 tokens"):
        pairplot.token_matrix(tokens[:2], other, pairs, tmp_path / "bad.png")
    grid = torch.zeros(2, 2, 2, 2)
    grid[0, 1, 1, 0] = 1.0
    path = pairplot.image_pair(torch.rand(1, 8, 8), torch.rand(8, 8), grid, tmp_path / "images.png", top=1)
    assert Image.open(path).size[0] > 300


def test_a_callable_that_runs_part_of_a_model_names_it_by_the_model():
    model, x, x2 = model_and_pair()
    named = Epsilon(0.0, name_map={"model.fc": relprop.rules.ZPlus()})

    def features(v):
        return model.fc(F.relu(model.conv2(F.relu(model.conv1(v)))).flatten(1))  # the modules, not the model

    expected = relprop.BiLRP(model, Epsilon(0.0, name_map={"fc": relprop.rules.ZPlus()})).attribute(x, x2)
    assert torch.allclose(relprop.BiLRP(features, named).attribute(x, x2), expected, rtol=0, atol=1e-12)
    assert not torch.allclose(expected, relprop.BiLRP(model, LRP0).attribute(x, x2), atol=1e-3)  # ZPlus applied


def attribution_per_dimension(model, composite, x, extra=None):
    """(D, B, *S): one fresh ``LRP.attribute`` per embedding dimension, seeded with that dimension's value."""
    with torch.no_grad():
        embedding = model(x, *(extra or ()))
    lrp = relprop.LRP(model, composite)
    found = []
    for m in range(embedding.shape[1]):
        seed = torch.zeros_like(embedding)
        seed[:, m] = embedding[:, m]
        found.append(lrp.attribute(x, target=seed, additional_forward_args=extra))
    return torch.stack(found)


@pytest.mark.parametrize("max_batch", [1, 5, 64])
def test_pairs_from_one_recorded_pass_per_side_equal_one_attribution_per_dimension(max_batch):
    model, x, x2 = model_and_pair()
    left, right = (attribution_per_dimension(model, "epsilon-plus", v) for v in (x, x2))
    expected = torch.einsum("mbi,mbj->bij", left.flatten(2), right.flatten(2)).reshape(3, 2, 4, 4, 2, 4, 4)
    pairs = relprop.BiLRP(model, "epsilon-plus", max_batch=max_batch).attribute(x, x2)
    assert torch.allclose(pairs, expected, rtol=0, atol=1e-10)
    tokens = TokenEmbedder().double().eval()
    ids, ids2 = torch.randint(0, 20, (2, 5)), torch.randint(0, 20, (2, 7))
    mask, mask2 = torch.ones(2, 5, dtype=torch.float64), torch.ones(2, 7, dtype=torch.float64)
    mask2[0, 4:] = 0
    left, right = (attribution_per_dimension(tokens, "attnlrp", v, (m,)) for v, m in ((ids, mask), (ids2, mask2)))
    expected = torch.einsum("mbi,mbj->bij", left, right)
    pairs = relprop.BiLRP(tokens, "attnlrp", max_batch=max_batch).attribute(ids, ids2, (mask,), (mask2,))
    assert torch.allclose(pairs, expected, rtol=0, atol=1e-10)


def test_the_model_keeps_its_hooks_flags_and_parameters_as_they_were():
    model, x, x2 = model_and_pair()
    model.fc.train()
    model.conv1.weight.requires_grad_(False)
    calls = []
    model.conv2.register_forward_hook(lambda module, args, output: calls.append(output.shape[0]))

    def state():
        return [(name, module.training, dict(module._forward_hooks), dict(module._forward_pre_hooks),
                 dict(module._backward_hooks), [(p.requires_grad, p.grad) for p in module.parameters(False)])
                for name, module in model.named_modules()]

    before, weights = state(), [p.detach().clone() for p in model.parameters()]
    with pytest.warns(UserWarning, match="training mode"):
        relprop.BiLRP(model, LRP0, max_batch=6).attribute(x, x2)
    assert state() == before
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))
    assert calls == [3, 3, 6, 6]  # the user's hook saw the embeddings' and the recorded passes' forwards, no more


class MeanPooledEncoder(nn.Module):
    """A tiny Hugging Face encoder (BERT) or decoder (Llama), its last hidden states mean-pooled over the mask."""

    def __init__(self, name: str):
        super().__init__()
        transformers = pytest.importorskip("transformers")
        torch.manual_seed(0)
        common = dict(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, intermediate_size=32)
        if name == "llama":
            config = transformers.LlamaConfig(**common, num_key_value_heads=2)
            self.model = transformers.LlamaModel(config)
        else:
            config = transformers.BertConfig(**common)
            self.model = transformers.BertModel(config, add_pooling_layer=False)

    def forward(self, ids, mask):
        states = self.model(input_ids=ids, attention_mask=mask).last_hidden_state * mask.unsqueeze(-1)
        return states.sum(1) / mask.sum(1, keepdim=True)


def token_pair():
    ids, ids2 = torch.randint(3, 50, (2, 5)), torch.randint(3, 50, (2, 6))
    mask, mask2 = torch.ones(2, 5, dtype=torch.long), torch.ones(2, 6, dtype=torch.long)
    mask2[1, 4:] = 0  # padding: masked attention
    return ids, ids2, mask, mask2


def transposed_calls(monkeypatch):
    """The results of BiLRP's transposed map (None where it fell back), as they are made."""
    found = []
    transposed = relprop.methods.bilrp.transposed_relevance

    def spied(*args):
        found.append(transposed(*args))
        return found[-1]

    monkeypatch.setattr(relprop.methods.bilrp, "transposed_relevance", spied)
    return found


@pytest.mark.parametrize("max_batch", [1, 3, 64])
@pytest.mark.parametrize("name", ["bert", "llama"])
@pytest.mark.parametrize("preset", ["attnlrp", "cp-lrp"])
def test_the_transposed_map_gives_the_pairs_of_one_attribution_per_dimension(preset, name, max_batch, monkeypatch):
    model = MeanPooledEncoder(name).double().eval()
    ids, ids2, mask, mask2 = token_pair()
    left, right = (attribution_per_dimension(model, preset, v, (m,)) for v, m in ((ids, mask), (ids2, mask2)))
    expected = torch.einsum("mbi,mbj->bij", left, right)
    found = transposed_calls(monkeypatch)
    pairs = relprop.BiLRP(model, preset, max_batch=max_batch).attribute(ids, ids2, (mask,), (mask2,))
    assert len(found) == 2 and all(side is not None for side in found)  # 5 and 6 tokens, 16 dimensions
    # the Llama runs its RMSNorm and rotary embedding in float32: the two ways round apart there
    rounding = 1e-6 if name == "llama" else 1e-12
    assert torch.allclose(pairs, expected, rtol=0, atol=rounding * expected.abs().max())
    assert pairs[1, :, 4:].abs().max() == 0


def test_the_transposed_map_pools_before_it_differentiates(monkeypatch):
    model = MeanPooledEncoder("bert").double().eval()
    ids, ids2, mask, mask2 = token_pair()

    def pool(relevance):  # the first two tokens together, then the rest one by one
        return torch.cat([relevance[:, :2].sum(1, keepdim=True), relevance[:, 2:]], 1)

    left, right = (pool(attribution_per_dimension(model, "attnlrp", v, (m,)).flatten(0, 1)).unflatten(0, (16, 2))
                   for v, m in ((ids, mask), (ids2, mask2)))
    found = transposed_calls(monkeypatch)
    with torch.inference_mode():  # the recorded passes need autograd all the same
        pairs = relprop.BiLRP(model, "attnlrp").attribute(ids, ids2, (mask,), (mask2,), pool=pool)
    assert pairs.shape == (2, 4, 5) and len(found) == 2 and all(side is not None for side in found)
    expected = torch.einsum("mbi,mbj->bij", left, right)
    assert torch.allclose(pairs, expected, rtol=0, atol=1e-12 * expected.abs().max())


def test_a_pool_that_is_not_linear_is_applied_to_each_dimension(monkeypatch):
    """The pooled relevance's derivative is the pool of each dimension's relevance only for a linear pool."""
    model = MeanPooledEncoder("bert").double().eval()
    ids, ids2, mask, mask2 = token_pair()

    def pool(relevance):  # the largest relevance of the first two tokens, then the rest
        return torch.cat([relevance[:, :2].amax(1, keepdim=True), relevance[:, 2:]], 1)

    left, right = (pool(attribution_per_dimension(model, "attnlrp", v, (m,)).flatten(0, 1)).unflatten(0, (16, 2))
                   for v, m in ((ids, mask), (ids2, mask2)))
    found = transposed_calls(monkeypatch)
    pairs = relprop.BiLRP(model, "attnlrp").attribute(ids, ids2, (mask,), (mask2,), pool=pool)
    assert found == []
    expected = torch.einsum("mbi,mbj->bij", left, right)
    assert torch.allclose(pairs, expected, rtol=0, atol=1e-12 * expected.abs().max())


def test_a_rule_whose_backward_pass_is_not_recorded_makes_the_side_fall_back(monkeypatch):
    """An attention whose VJP drops the graph would lose its share of the transposed map: the sum check sees it."""
    from relprop.engine.calls import OpCall
    from relprop.ops.attention import AttentionCall

    model = MeanPooledEncoder("bert").double().eval()
    ids, ids2, mask, mask2 = token_pair()
    left, right = (attribution_per_dimension(model, "attnlrp", v, (m,)) for v, m in ((ids, mask), (ids2, mask2)))
    monkeypatch.setattr(AttentionCall, "vjp", lambda self, grad: OpCall.vjp(self, grad.detach()))
    found = transposed_calls(monkeypatch)
    pairs = relprop.BiLRP(model, "attnlrp").attribute(ids, ids2, (mask,), (mask2,))
    assert found == [None, None]
    expected = torch.einsum("mbi,mbj->bij", left, right)
    assert torch.allclose(pairs, expected, rtol=0, atol=1e-12 * expected.abs().max())


def test_sides_with_as_many_positions_as_dimensions_take_one_backward_pass_per_chunk(monkeypatch):
    model = TokenEmbedder(dims=5).double().eval()
    ids, ids2 = torch.randint(0, 20, (2, 4)), torch.randint(0, 20, (2, 5))
    mask, mask2 = torch.ones(2, 4, dtype=torch.float64), torch.ones(2, 5, dtype=torch.float64)
    found = transposed_calls(monkeypatch)
    pairs = relprop.BiLRP(model, "attnlrp").attribute(ids, ids2, (mask,), (mask2,))
    assert len(found) == 1 and found[0] is not None  # 4 tokens: the transposed map; 5: a pass per chunk of 5 dimensions
    left, right = (attribution_per_dimension(model, "attnlrp", v, (m,)) for v, m in ((ids, mask), (ids2, mask2)))
    assert torch.allclose(pairs, torch.einsum("mbi,mbj->bij", left, right), rtol=0, atol=1e-12)


def test_a_backward_pass_that_cannot_be_differentiated_makes_the_side_fall_back(monkeypatch):
    """Recorded with the fused attention kernels, whose backward has no derivative: each side falls back."""
    import contextlib

    model = MeanPooledEncoder("bert").double().eval()
    ids, ids2, mask, mask2 = token_pair()
    left, right = (attribution_per_dimension(model, "cp-lrp", v, (m,)) for v, m in ((ids, mask), (ids2, mask2)))
    monkeypatch.setattr(relprop.methods.bilrp, "sdpa_kernel", lambda backend: contextlib.nullcontext())
    found = transposed_calls(monkeypatch)
    pairs = relprop.BiLRP(model, "cp-lrp").attribute(ids, ids2, (mask,), (mask2,))
    assert found == [None, None]
    expected = torch.einsum("mbi,mbj->bij", left, right)
    assert torch.allclose(pairs, expected, rtol=0, atol=1e-12 * expected.abs().max())


class _DetachedEpsilon(relprop.rules.Rule):
    """LRP-epsilon of a dense layer computed without autograd: a valid rule whose backward pass leaves the graph."""

    kinds = frozenset({"dense"})

    def propagate(self, call, relevance):
        with torch.no_grad():
            (x,) = call.inputs
            return (x * ((relevance / relprop.rules.denominator(call.output, 1e-9)) @ call.weight),)


class _TwoBranches(nn.Module):
    def __init__(self):
        super().__init__()
        self.positive, self.negative = nn.Linear(3, 6, bias=False), nn.Linear(3, 6, bias=False)

    def forward(self, x):
        return self.positive(torch.relu(x)) + self.negative(torch.relu(-x))


@pytest.mark.parametrize("case", ["a small example beside a large one", "a small position beside large ones"])
def test_a_share_missing_from_a_small_example_or_position_is_seen(case, monkeypatch):
    """The sum check compares each example and position on its own, not at the scale of the largest."""
    model = _TwoBranches().double().eval()
    composite = relprop.composites.AttnLRP(name_map={"negative": _DetachedEpsilon()})
    if case.startswith("a small example"):  # example 0 takes the positive branch alone, example 1 the other
        x = torch.tensor([[4e4, 2e4, 3e4], [-0.5, -1.0, -0.7]], dtype=torch.float64)
    else:  # one feature, small, through the other branch
        x = torch.tensor([[5.0, 3.0, -0.002]], dtype=torch.float64)
    x2 = torch.rand(x.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) + 0.5
    found = transposed_calls(monkeypatch)
    pairs = relprop.BiLRP(model, composite).attribute(x, x2)
    assert found[0] is None
    left, right = (attribution_per_dimension(model, composite, v) for v in (x, x2))
    expected = torch.einsum("mbi,mbj->bij", left, right)
    assert torch.allclose(pairs, expected, rtol=0, atol=1e-12 * expected.abs().max())
    assert torch.allclose(pairs[-1].sum(), expected[-1].sum(), rtol=1e-12, atol=0)
