"""relprop's relp against RelP's reference implementation (Jafari et al. 2025, a TransformerLens fork).

tests/data/relp_reference.pt holds the reference's per (layer, position) estimates on a tiny GPT-2 and a tiny
Llama with grouped-query heads, float64, with the Hugging Face weights they were computed from; the script that
made it is benchmarks/relp_reference.py. Preset ``relp`` is RelP's default rules, ``relp-ah`` the same with the
attention weights held; ``attribution`` is the plain gradient on both sides.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import relprop

transformers = pytest.importorskip("transformers")

FIXTURE = Path(__file__).parent / "data" / "relp_reference.pt"
KINDS = {"hook_resid_pre": "residual", "hook_attn_out": "attn_out", "hook_mlp_out": "mlp_out"}


def _rms_norm(self, hidden):
    """Llama's RMSNorm in the input's dtype, as the fixture computed it (Hugging Face's computes in float32)."""
    return self.weight * (hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_relp_equals_the_reference_implementation(kind, monkeypatch):
    fixture = torch.load(FIXTURE, weights_only=True)
    entry = fixture["models"][kind]
    if kind == "gpt2":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**entry["config"]))
    else:
        monkeypatch.setattr(transformers.models.llama.modeling_llama.LlamaRMSNorm, "forward", _rms_norm)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**entry["config"]))
    model = model.double().eval()
    model.load_state_dict(entry["state_dict"])
    target = (fixture["answer"], fixture["foil"])
    for method, reference in entry["estimates"].items():
        found = relprop.patching(model, fixture["clean"], fixture["corrupted"], target, components=tuple(KINDS.values()),
                                 method="attribution" if method == "attribution" else "relp",
                                 composite=method if method != "attribution" else "relp")
        for hook, name in KINDS.items():
            expected = reference[hook]
            estimate = found[name][:, :expected.shape[1]]  # the residual stream also leaves the last layer
            scale = expected.abs().max()
            torch.testing.assert_close(estimate, expected, rtol=0, atol=1e-12 * scale,
                                       msg=lambda text: f"{kind} {method} {name}: {text}")
