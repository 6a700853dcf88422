"""Attention written out (``softmax(q k^T * scale + mask) v``, Hugging Face's eager attention) in the compiled tier:
the product of the weights with the values as it is, its relevance through the fused attention's form, as
interception explains it (docs/design.md, section 9). Float64: 1e-12 of the largest entry."""
import warnings

import pytest
import torch

import relprop
import relprop.methods.compiled
from relprop.methods.compiled import CompileFallbackWarning
from test_eager_attention import WrittenOut

transformers = pytest.importorskip("transformers")
IDS = torch.randint(3, 50, (2, 7), generator=torch.Generator().manual_seed(1))


def eager(name):
    T = transformers
    common = dict(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, intermediate_size=32)
    if name == "llama":
        config, cls, target = T.LlamaConfig(**common, num_key_value_heads=2), T.LlamaForCausalLM, (-1, 5)
    else:
        config, cls, target = T.BertConfig(**common), T.BertForSequenceClassification, 1
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return cls(config).double().eval(), target


def fused_attentions(monkeypatch):
    """How many products each compilation explains as fused attention, counted as they are decided."""
    found = []
    decide = relprop.methods.compiled.decide

    def counted(*args):
        decisions = decide(*args)
        found.append(sum(decision.attention is not None for decision in decisions.values()))
        return decisions

    monkeypatch.setattr(relprop.methods.compiled, "decide", counted)
    return found


def both(model, composite, x, target, **kwargs):
    """The relevance compiled (checked to have run compiled) and under interception."""
    lrp = relprop.LRP(model, composite, compile="aot_eager")
    relevance = lrp.attribute(x, target=target, **kwargs)
    assert lrp.compiled.fallback is None
    return relevance, relprop.LRP(model, composite).attribute(x, target=target, **kwargs)


def assert_same(relevance, reference, bound=1e-12):
    scale = reference.abs().max()
    assert scale > 0
    assert (relevance - reference).abs().max() <= bound * scale


@pytest.mark.parametrize("preset", ["attnlrp", "cp-lrp", "epsilon"])
def test_llama(preset, monkeypatch):
    """Grouped-query heads (``repeat_kv``), a causal mask, the softmax in float32 cast back."""
    model, target = eager("llama")
    found = fused_attentions(monkeypatch)
    relevance, reference = both(model, preset, IDS, target)
    assert found == [2]  # one attention per layer
    # Epsilon's rules on Llama's RMSNorm run in float32 (docs/design.md, section 5), under SDPA attention too
    assert_same(relevance, reference, bound=1e-6 if preset == "epsilon" else 1e-12)


@pytest.mark.parametrize("preset", ["attnlrp", "cp-lrp", "epsilon"])
def test_bert_with_padding(preset, monkeypatch):
    """A padding mask, from an input of the model: the mask's node is the one the traced graph computes."""
    model, target = eager("bert")
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 5:] = 0
    found = fused_attentions(monkeypatch)
    relevance, reference = both(model, preset, IDS, target, additional_forward_args={"attention_mask": mask})
    assert found == [2]
    assert_same(relevance, reference)


@pytest.mark.parametrize("preset", ["attnlrp", "cp-lrp", "epsilon"])
def test_attention_written_by_hand(preset, monkeypatch):
    """One head, its scores divided by a number, no mask."""
    torch.manual_seed(0)
    model, x = WrittenOut().double().eval(), torch.randn(2, 5, 8, dtype=torch.float64)
    found = fused_attentions(monkeypatch)
    relevance, reference = both(model, preset, x, 1)
    assert found == [1]
    assert_same(relevance, reference)


@pytest.mark.parametrize("variant", ["activation bias", "softmax rule"])
def test_what_interception_keeps_written_out_compiles_written_out(variant, monkeypatch):
    """A score term computed from the input, or a softmax rule the user chose: interception explains each op with
    its own rule, and so does the compiled program."""
    torch.manual_seed(0)
    model = WrittenOut("plain" if variant == "softmax rule" else variant).double().eval()
    x = torch.randn(2, 5, 8, dtype=torch.float64)

    def composite():
        chosen = relprop.composites.AttnLRP()
        if variant == "softmax rule":
            chosen._softmax = relprop.rules.Pass()
        return chosen

    found = fused_attentions(monkeypatch)
    lrp = relprop.LRP(model, composite(), compile="aot_eager")
    relevance = lrp.attribute(x, target=1)
    assert lrp.compiled.fallback is None and found == [0]
    assert_same(relevance, relprop.LRP(model, composite()).attribute(x, target=1))


def test_fused_attention_refused_by_interception_falls_back():
    """Weights changed where no version counter sees it: interception runs the fused attention, finds that it is
    not the product, and explains the product written out: a decision across two ops, which falls back."""
    torch.manual_seed(0)
    model, x = WrittenOut("weights changed unseen").double().eval(), torch.randn(2, 5, 8, dtype=torch.float64)
    lrp = relprop.LRP(model, "attnlrp", compile="aot_eager")
    with pytest.warns(CompileFallbackWarning, match="matmul.*decides across ops"):
        relevance = lrp.attribute(x, target=1)
    assert "decides across ops" in lrp.compiled.fallback
    assert torch.equal(relevance, relprop.LRP(model, "attnlrp").attribute(x, target=1))


def test_generation_lengths_do_not_recompile():
    """Dynamic sequence lengths: the fused attention's node reads the mask and the key at any length."""
    model, target = eager("llama")
    lrp = relprop.LRP(model, "attnlrp", compile="aot_eager")
    compilations = []
    for length in (5, 6, 9):
        ids = torch.randint(3, 50, (1, length), generator=torch.Generator().manual_seed(length))
        relevance = lrp.attribute(ids, target=target)
        assert lrp.compiled.fallback is None
        assert_same(relevance, relprop.LRP(model, "attnlrp").attribute(ids, target=target))
        compilations.append(lrp.compiled.compilations)
    assert compilations[1] == compilations[2] <= 2
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompileFallbackWarning)
        generation = relprop.explain_generation(model, ids, max_new_tokens=2, compile="aot_eager")
    reference = relprop.explain_generation(model, ids, max_new_tokens=2)
    assert torch.equal(generation.sequences, reference.sequences)
    assert_same(generation.relevance, reference.relevance)
