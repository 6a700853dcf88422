"""Attention written out (``softmax(q k^T * scale + mask) v``) is explained as the fused attention of the same
arguments: equal relevance to the model run with ``F.scaled_dot_product_attention``, without the weights kept."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import relprop
import relprop.ops.products

transformers = pytest.importorskip("transformers")
IDS = torch.randint(3, 50, (2, 7), generator=torch.Generator().manual_seed(1))


def hugging_face(name, attention):
    T = transformers
    common = dict(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, intermediate_size=32)
    if name == "llama":
        config, cls, target = T.LlamaConfig(**common, num_key_value_heads=2), T.LlamaForCausalLM, (-1, 5)
    elif name == "bert":
        config, cls, target = T.BertConfig(**common), T.BertForSequenceClassification, 1
    else:
        config = T.GPT2Config(vocab_size=50, n_embd=16, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0)
        cls, target = T.GPT2LMHeadModel, (-1, 5)
    config._attn_implementation = attention
    torch.manual_seed(0)
    return cls(config).double().eval(), target


def recognised(monkeypatch):
    """How many matrix products are explained as fused attention, counted as they are."""
    found = []
    fused = relprop.ops.products.eager_attention

    def counted(*args):
        out = fused(*args)
        found.append(out is not None)
        return out

    monkeypatch.setattr(relprop.ops.products, "eager_attention", counted)
    return found


@pytest.mark.parametrize("gradient_form", [True, False])
@pytest.mark.parametrize("preset", ["attnlrp", "cp-lrp"])
@pytest.mark.parametrize("name", ["llama", "bert", "gpt2"])
def test_written_out_attention_gets_the_relevance_of_the_fused_kernel(name, preset, gradient_form, monkeypatch):
    fused, target = hugging_face(name, "sdpa")
    composite = relprop.composites.get(preset)
    composite.gradient_form = gradient_form
    expected = relprop.LRP(fused, composite).attribute(IDS, target=target)
    written_out, _ = hugging_face(name, "eager")
    found = recognised(monkeypatch)
    relevance = relprop.LRP(written_out, composite).attribute(IDS, target=target)
    assert sum(found) == 2  # one attention per layer
    # Llama's eager attention takes its softmax in float32 (then casts back), the fused kernel in float64: the
    # outputs round apart by float32's rounding, and so does the relevance (the RMSNorm is in float32 anyway)
    rounding = 1e-6 if name == "llama" else 1e-12
    assert torch.allclose(relevance, expected, rtol=0, atol=rounding * expected.abs().max())


class WrittenOut(nn.Module):
    """One head of self-attention written out by hand, its scores scaled by a division, in one of several
    ``variant``s: ``fused`` the same through ``F.scaled_dot_product_attention``; the others are no attention that
    fused attention of ``q``, ``k``, ``v`` computes, or changed after the notes saw it."""

    def __init__(self, variant: str = "plain"):
        super().__init__()
        self.q, self.k, self.v, self.out = (nn.Linear(8, 8) for _ in range(4))
        self.variant = variant

    def forward(self, x):
        q, k, v = self.q(x), self.k(x), self.v(x)
        if self.variant == "fused":
            return self.out(F.scaled_dot_product_attention(q, k, v)).sum(1)
        scores = q @ k.transpose(-2, -1) / math.sqrt(8)
        if self.variant == "activation bias":  # a score term computed from the input
            scores = scores + x.sum(-1, keepdim=True)
        elif self.variant == "activation bias in place":  # (MPNet: attention_scores += position_bias)
            scores += x.sum(-1, keepdim=True)
        elif self.variant == "negated in place":
            scores.neg_()
        elif self.variant == "reflected division":  # 2 / scores is no scaling
            scores = 2.0 / scores
        weights = torch.softmax(scores, dim=-1)
        if self.variant == "weights changed unseen":  # no version counter sees it: the outputs differ
            weights.data.mul_(0.5)
        return self.out(weights @ v).sum(1)


def test_attention_written_by_hand_is_recognised(monkeypatch):
    torch.manual_seed(0)
    model, x = WrittenOut().double().eval(), torch.randn(2, 5, 8, dtype=torch.float64)
    fused = WrittenOut("fused").double().eval()
    fused.load_state_dict(model.state_dict())
    expected = relprop.LRP(fused, "attnlrp").attribute(x, target=1)
    found = recognised(monkeypatch)
    relevance = relprop.LRP(model, "attnlrp").attribute(x, target=1)
    assert found == [False, True]  # the scores' product is no attention yet, the weights' product is
    assert torch.allclose(relevance, expected, rtol=0, atol=1e-12 * expected.abs().max())


def written_out_rules(model, composite, x, monkeypatch):
    """The relevance with attention left written out: every op with its own rule."""
    with monkeypatch.context() as patched:
        patched.setattr(relprop.ops.products, "eager_attention", lambda *args: None)
        return relprop.LRP(model, composite).attribute(x, target=1)


@pytest.mark.parametrize("variant", ["activation bias", "activation bias in place", "negated in place",
                                     "reflected division", "weights changed unseen"])
def test_what_is_not_the_fused_attention_keeps_the_written_out_rules(variant, monkeypatch):
    torch.manual_seed(0)
    model, x = WrittenOut(variant).double().eval(), torch.randn(2, 5, 8, dtype=torch.float64)
    found = recognised(monkeypatch)
    relevance = relprop.LRP(model, "attnlrp").attribute(x, target=1)
    assert not any(found)  # (the last is found, and refused when the fused output is not the product's)
    assert torch.equal(relevance, written_out_rules(model, "attnlrp", x, monkeypatch))


@pytest.mark.parametrize("choice", ["func_map", "name_map", "softmax rule"])
def test_rules_the_user_gave_the_written_out_ops_are_kept(choice, monkeypatch):
    """The fused attention's rule is the default rules' of the whole; a rule mapped to a part is the user's."""
    torch.manual_seed(0)
    model, x = WrittenOut().double().eval(), torch.randn(2, 5, 8, dtype=torch.float64)
    half = relprop.rules.UniformProduct(0.5)
    composite = relprop.composites.AttnLRP(**({"func_map": {torch.matmul: half}} if choice == "func_map" else
                                              {"name_map": {"": half}} if choice == "name_map" else {}))
    if choice == "softmax rule":
        composite._softmax = relprop.rules.Pass()
    found = recognised(monkeypatch)
    relevance = relprop.LRP(model, composite).attribute(x, target=1)
    assert not any(found)
    assert torch.equal(relevance, written_out_rules(model, composite, x, monkeypatch))


def kept_for_backward(root):
    """The tensors the backward pass from ``root`` holds: saved by autograd's nodes, and kept by relprop's (the
    op call's inputs, output and private graph)."""
    found, seen, todo = [], set(), [root.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        for name in dir(node):
            value = getattr(node, name, None) if name.startswith("_saved_") else None
            found.extend(v for v in (value if isinstance(value, (tuple, list)) else [value]) if torch.is_tensor(v))
        call = getattr(node, "call", None)
        if call is not None:
            graph = getattr(call, "_graph", None) or ((), None)
            output = getattr(call, "_output", None)
            found.extend([*call.inputs, *([output] if torch.is_tensor(output) else []), *graph[0]])
            todo.append(graph[1].grad_fn if graph[1] is not None else None)
        todo.extend(next_node for next_node, _ in node.next_functions)
    return found


def test_the_attention_weights_are_not_kept_for_the_backward_pass(monkeypatch):
    """Written out, each layer's T x T weights per head would stay alive until the relevance passes them."""
    model, target = hugging_face("llama", "eager")
    ids = torch.randint(3, 50, (1, 12), generator=torch.Generator().manual_seed(2))

    def weights_kept():
        explained = relprop.LRP(model, "attnlrp").record(ids)
        return explained, sum(t.shape[-3:] == (4, 12, 12) for t in kept_for_backward(explained.logits))

    explained, kept = weights_kept()
    assert kept == 0
    explained.relevance(relprop.output_relevance(explained.logits, target))  # and the pass explains
    monkeypatch.setattr(relprop.ops.products, "eager_attention", lambda *args: None)
    assert weights_kept()[1] >= 2  # written out, the products keep them: one layer's at least per layer


def test_an_explainer_called_again_on_written_out_attention_gives_the_same_relevance(monkeypatch):
    """Such a pass gets no captured plan (the fused call runs inside the product's handler): every call is
    intercepted, and recognised, alike."""
    model, target = hugging_face("gpt2", "eager")
    lrp = relprop.LRP(model, "attnlrp")
    found = recognised(monkeypatch)
    first = lrp.attribute(IDS, target=target)
    for _ in range(3):
        assert torch.equal(lrp.attribute(IDS, target=target), first)
    assert sum(found) == 8


def test_queries_that_see_no_key_are_explained_as_the_model_computes_them(monkeypatch):
    # left padding: in float64 Hugging Face's eager Llama gives the padded queries rows of NaN (every key masked)
    model, target = hugging_face("llama", "eager")
    twin, _ = hugging_face("llama", "sdpa")
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, :3] = 0
    found = recognised(monkeypatch)
    with pytest.warns(relprop.ConservationWarning, match="NaN"):  # the model's own NaN, said where it starts
        relevance = relprop.LRP(model, "attnlrp").attribute(IDS, target=target,
                                                             additional_forward_args={"attention_mask": mask})
    expected = relprop.LRP(twin, "attnlrp").attribute(IDS, target=target,
                                                      additional_forward_args={"attention_mask": mask})
    # recognition was asked, and kept the ops written out where the fused kernel's rows differ from the NaN rows
    assert found
    # the example without padding, to the float32 rounding of the eager softmax
    torch.testing.assert_close(relevance[0], expected[0], rtol=1e-5, atol=1e-9)
