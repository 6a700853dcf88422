"""MLP neurons and SAE features as components of relprop.patching (relprop.workflows.neurons, .features), on tiny
random Llama and GPT-2 models in float64: the identities of the estimates, activation patching against patching
written out with hooks, and splicing that leaves the logits unchanged."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import relprop
from relprop.workflows.features import latent_relevance, spliced

transformers = pytest.importorskip("transformers")

from test_components import ANSWER, FOIL, metric, prompts


def tiny(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "llama":
        config = transformers.LlamaConfig(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2, intermediate_size=32)
        return transformers.LlamaForCausalLM(config).eval().double()
    config = transformers.GPT2Config(vocab_size=40, n_positions=16, n_embd=16, n_layer=2, n_head=4, n_inner=32)
    return transformers.GPT2LMHeadModel(config).eval().double()


class RandomSAE(nn.Module):
    """A ReLU sparse autoencoder with random weights (what splicing needs: encode and decode)."""

    def __init__(self, width: int, latents: int, bias: bool = True) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(2)
        self.W_enc = nn.Parameter(torch.randn(width, latents, generator=generator, dtype=torch.float64) / 4)
        self.W_dec = nn.Parameter(torch.randn(latents, width, generator=generator, dtype=torch.float64) / 4)
        self.b_enc = nn.Parameter(torch.randn(latents, generator=generator, dtype=torch.float64) / 4)
        self.b_dec = nn.Parameter(torch.randn(width, generator=generator, dtype=torch.float64) / 4 * bias)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu((x - self.b_dec) @ self.W_enc + self.b_enc)

    def decode(self, f: torch.Tensor) -> torch.Tensor:
        return f @ self.W_dec + self.b_dec


def by_hand(model: nn.Module, clean: torch.Tensor, corrupted: torch.Tensor, module: nn.Module,
            entries: tuple, output: bool) -> torch.Tensor:
    """The effect of the clean value of ``entries`` of a module's input (or output), patched by hooks."""
    kept = {}

    def keep(_, args, out=None):
        kept["value"] = (out if output else args[0]).detach().clone()

    def patch(_, args, out=None):
        tensor = (out if output else args[0]).clone()
        tensor[entries] = kept["value"][entries]
        return tensor if output else (tensor, *args[1:])

    register = module.register_forward_hook if output else module.register_forward_pre_hook
    with torch.no_grad():
        handle = register(keep)
        metric(model, clean)
        handle.remove()
        handle = register(patch)
        try:
            patched = metric(model, corrupted)
        finally:
            handle.remove()
        return patched - metric(model, corrupted)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_neurons_sum_to_mlp_out(kind):
    """The down projection is linear: a layer's neuron estimates summed over units are its mlp_out estimates summed
    over positions (attribution), and the per-position neurons sum to the neurons."""
    model = tiny(kind)
    clean, corrupted = prompts()
    found = relprop.patching(model, clean, corrupted, (ANSWER, FOIL), method="attribution",
                             components=["neurons", "neuron_positions", "mlp_out"])
    assert found["neurons"].shape == (2, 2, 32) and found["neuron_positions"].shape == (2, 2, 6, 32)
    torch.testing.assert_close(found["neurons"].sum(-1), found["mlp_out"].sum(-1), rtol=0, atol=1e-12)
    torch.testing.assert_close(found["neuron_positions"].sum(2), found["neurons"], rtol=0, atol=1e-12)



@pytest.mark.parametrize("composite", ["attnlrp", "cp-lrp", "relp"])
def test_relp_neurons_sum_to_mlp_out_without_a_bias(composite):
    """LRP-0 through Llama's bias-free down projection carries the relevance per unit of activation as its
    transpose does: relp's neuron estimates add up to its mlp_out estimates as attribution's do."""
    model = tiny("llama")
    clean, corrupted = prompts()
    found = relprop.patching(model, clean, corrupted, (ANSWER, FOIL), composite=composite,
                             components=["neurons", "mlp_out"])
    assert found["neurons"].abs().sum() > 1e-3
    torch.testing.assert_close(found["neurons"].sum(-1), found["mlp_out"].sum(-1), rtol=0, atol=1e-12)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_neuron_activation_patching_by_hand(kind):
    """A neuron patched at all positions (batched with the others) has the effect of patching it by hand."""
    model = tiny(kind)
    clean, corrupted = prompts()
    effects = relprop.patching(model, clean, corrupted, (ANSWER, FOIL), components="neurons", method="activation")
    down = [layer.mlp.down_proj if kind == "llama" else layer.mlp.c_proj
            for layer in (model.model.layers if kind == "llama" else model.transformer.h)]
    for layer, unit in [(0, 3), (1, 17), (1, 31)]:
        expected = by_hand(model, clean, corrupted, down[layer], (slice(None), slice(None), unit), output=False)
        torch.testing.assert_close(effects[:, layer, unit], expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_splicing_leaves_logits(kind):
    model = tiny(kind)
    clean, _ = prompts()
    path = "model.layers.0.mlp" if kind == "llama" else "transformer.h.0.mlp"
    with torch.no_grad():
        plain = relprop.model_logits(model(clean))
        with spliced(model, {path: RandomSAE(16, 24)}):
            spliced_logits = relprop.model_logits(model(clean))
    torch.testing.assert_close(spliced_logits, plain, rtol=0, atol=1e-12)


def test_splicing_saelens_sae_leaves_logits():
    sae_lens = pytest.importorskip("sae_lens", reason="pip install --no-deps sae-lens (see pyproject's lens extra)")
    torch.manual_seed(3)
    sae = sae_lens.StandardSAE(sae_lens.StandardSAEConfig(d_in=16, d_sae=24, dtype="float64"))
    with torch.no_grad():
        for parameter in sae.parameters():
            parameter.copy_(torch.randn_like(parameter) / 4)
    model = tiny("llama")
    clean, corrupted = prompts()
    with torch.no_grad():
        plain = model(clean).logits
        with spliced(model, {"model.layers.1.mlp": sae}):
            assert (model(clean).logits - plain).abs().max() <= 1e-12
    effects = relprop.patching(model, clean, corrupted, (ANSWER, FOIL), components="features",
                               features={"model.layers.1.mlp": sae}, method="attribution")
    assert effects["model.layers.1.mlp"].shape == (2, 6, 24) and effects["model.layers.1.mlp:error"].shape == (2, 6)


def test_latent_activation_patching_by_hand():
    """A latent at a position takes its clean value; the corrupted error term stays: patched by hand."""
    model, sae = tiny("llama"), RandomSAE(16, 24)
    clean, corrupted = prompts()
    path = "model.layers.0.mlp"
    found = relprop.patching(model, clean, corrupted, (ANSWER, FOIL), components="features", features={path: sae},
                             method="activation")
    latents, error = found[path], found[path + ":error"]
    assert latents.shape == (2, 6, 24) and error.shape == (2, 6)
    with torch.no_grad():
        clean_latents, corrupted_latents = {}, {}

        def keep(module, args, out):
            kept["f"] = sae.encode(out)
        handle = model.get_submodule(path).register_forward_hook(keep)
        kept = clean_latents
        metric(model, clean)
        kept = corrupted_latents
        base = metric(model, corrupted)
        handle.remove()
        changed = (clean_latents["f"] != corrupted_latents["f"]).nonzero().tolist()[::17][:4]
        assert len(changed) == 4
        for row, position, unit in changed:
            def patch(module, args, out, position=position, unit=unit):
                f = sae.encode(out)
                patched = f.clone()
                patched[:, position, unit] = clean_latents["f"][:, position, unit]
                return sae.decode(patched) + (out - sae.decode(f))
            handle = model.get_submodule(path).register_forward_hook(patch)
            try:
                expected = metric(model, corrupted) - base
            finally:
                handle.remove()
            assert expected[row] != 0
            torch.testing.assert_close(latents[:, position, unit], expected, rtol=0, atol=1e-12)


def test_latent_estimates_sum_to_the_module_output():
    """Attribution: the latents' and the error's estimates at a position sum to the spliced MLP's output's."""
    model, sae = tiny("llama"), RandomSAE(16, 24)
    clean, corrupted = prompts()
    path = "model.layers.0.mlp"
    found = relprop.patching(model, clean, corrupted, (ANSWER, FOIL), components=["features", "mlp_out"],
                             features={path: sae}, method="attribution")
    torch.testing.assert_close(found[path].sum(-1) + found[path + ":error"], found["mlp_out"][:, 0],
                               rtol=0, atol=1e-12)


def test_latent_relevance_conserves_the_module_output_relevance():
    """LRP: the relevance of the latents and the error of a bias-free decoder add up to the relevance at the
    output of the module they are spliced into."""
    model, sae = tiny("llama"), RandomSAE(16, 24, bias=False)
    clean, _ = prompts()
    path = "model.layers.0.mlp"
    found = latent_relevance(model, clean, (-1, ANSWER), {path: sae}, "attnlrp")
    at_output = relprop.LayerLRP(model, path, "attnlrp").attribute(clean, target=(-1, ANSWER))
    torch.testing.assert_close(found[path].sum(-1) + found[path + ":error"], at_output.sum(-1), rtol=0, atol=1e-10)


def test_a_sample_of_neurons_is_patched_as_all_are_and_said_so():
    model = tiny("llama")
    clean, corrupted = prompts()
    every = relprop.patching(model, clean, corrupted, (ANSWER, FOIL), components="neurons", method="activation")
    with pytest.warns(UserWarning, match="measured 10 of the 64 units of 'neurons'"):
        some = relprop.patching(model, clean, corrupted, (ANSWER, FOIL), components="neurons", method="activation",
                                sample=10)
    measured = ~some[0].isnan()
    assert int(measured.sum()) == 10 and bool((some[1].isnan() == ~measured).all())
    torch.testing.assert_close(some[:, measured], every[:, measured], rtol=0, atol=0)
