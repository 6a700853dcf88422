"""TransformerLens (relprop.workflows.lens): a HookedTransformer with random weights, built from a
HookedTransformerConfig (nothing downloaded), explained and patched at its hook points, against the same weights
in Hugging Face's GPT-2, in float64."""
from __future__ import annotations

import warnings

import pytest
import torch

import relprop
from relprop.workflows.lens import HOOK_COMPONENTS, to_gpt2

lens = pytest.importorskip("transformer_lens", reason="pip install --no-deps transformer-lens (see pyproject's lens "
                           "extra)")
pytest.importorskip("transformers")

from test_components import ANSWER, FOIL, prompts


@pytest.fixture(scope="module")
def models():
    """A 2-layer HookedTransformer (exact GELU: one op, as GPT-2's module is) and its weights in GPT-2."""
    config = lens.HookedTransformerConfig(n_layers=2, d_model=16, n_ctx=16, d_head=4, n_heads=4, d_mlp=32,
                                          d_vocab=40, act_fn="gelu", normalization_type="LN", dtype=torch.float64)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # 3.x names TransformerBridge as the successor
        hooked = lens.HookedTransformer(config).eval()
    with torch.no_grad():  # every weight random (the default init leaves biases at 0), the unembedding bias 0
        for name, parameter in hooked.named_parameters():
            if name != "unembed.b_U":
                parameter.copy_(torch.randn_like(parameter) * (0.3 if parameter.dim() > 1 else 0.1)
                                + (1.0 if name.endswith(".w") else 0.0))
    return hooked, to_gpt2(hooked)


def test_same_logits(models):
    hooked, gpt2 = models
    clean, _ = prompts()
    with torch.no_grad():
        torch.testing.assert_close(hooked(clean), gpt2(clean).logits, rtol=0, atol=1e-12)


@pytest.mark.parametrize("composite", ["attnlrp", "cp-lrp"])
def test_lrp_agrees(models, composite):
    """The token relevance of relprop.LRP: TransformerLens's W_E[tokens] lookup collects it as F.embedding's."""
    hooked, gpt2 = models
    clean, _ = prompts()
    found = relprop.LRP(hooked, composite).attribute(clean, target=(-1, ANSWER))
    expected = relprop.LRP(gpt2, composite).attribute(clean, target=(-1, ANSWER))
    assert expected.abs().sum() > 0.1
    torch.testing.assert_close(found, expected, rtol=0, atol=1e-10)


@pytest.mark.parametrize("method,composite", [("attribution", "relp"), ("relp", "attnlrp"), ("relp", "cp-lrp"),
                                              ("relp", "relp")])
def test_estimates_agree(models, method, composite):
    """Every kind of component, named by its hook point, gives the estimates of the same kind in GPT-2."""
    hooked, gpt2 = models
    clean, corrupted = prompts()
    found = relprop.patching(hooked, clean, corrupted, (ANSWER, FOIL), method=method, composite=composite,
                             components=list(HOOK_COMPONENTS.values()))
    expected = relprop.patching(gpt2, clean, corrupted, (ANSWER, FOIL), method=method, composite=composite,
                                components=list(HOOK_COMPONENTS))
    for kind, point in HOOK_COMPONENTS.items():
        assert expected[kind].abs().sum() > 1e-3, kind
        torch.testing.assert_close(found[point], expected[kind], rtol=0, atol=1e-10, msg=kind)


@pytest.mark.parametrize("kind", ["heads", "neurons"])
def test_activation_patching_agrees(models, kind):
    hooked, gpt2 = models
    clean, corrupted = prompts()
    found = relprop.patching(hooked, clean, corrupted, (ANSWER, FOIL), method="activation",
                             components=HOOK_COMPONENTS[kind])
    expected = relprop.patching(gpt2, clean, corrupted, (ANSWER, FOIL), method="activation", components=kind)
    torch.testing.assert_close(found, expected, rtol=0, atol=1e-10)
