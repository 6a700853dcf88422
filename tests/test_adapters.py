"""Architecture adapters: MambaLRP on Hugging Face Mamba-1 and Mamba-2 (selective parameters held constant)."""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

import relprop

transformers = pytest.importorskip("transformers")
from transformers.models.mamba2 import modeling_mamba2  # noqa: E402


class Logits(torch.nn.Module):
    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, use_cache=False).logits


@contextlib.contextmanager
def replaced(*triples):
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in triples]
    for owner, name, value in triples:
        setattr(owner, name, value)
    try:
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


def mamba2(**changes) -> Logits:
    config = transformers.Mamba2Config(vocab_size=50, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2,
                                       head_dim=16, num_heads=4, n_groups=1, chunk_size=4, conv_kernel=4,
                                       use_cache=False)
    model = transformers.Mamba2ForCausalLM(config).double().eval()
    with torch.no_grad():
        for layer in model.backbone.layers:  # a scan that matters: larger steps, a visible skip term
            layer.mixer.dt_bias.fill_(changes.get("dt_bias", 1.0))
            layer.mixer.D.fill_(0.1)
    return Logits(model).eval()


def mambalrp_reference(wrapper: Logits, ids: torch.Tensor, token: int) -> torch.Tensor:
    """MambaLRP as its authors define it: Gradient x Input of a forward with SiLU as an identity rule, dt, B, C
    detached in the scan, the gate product split half and half, and the RMS normaliser detached."""
    scan = modeling_mamba2.mamba2_chunk_scan

    def held_scan(hidden_states, dt, A, B, C, *args, **kwargs):
        return scan(hidden_states, dt.detach(), A, B.detach(), C.detach(), *args, **kwargs)

    def silu(x, inplace=False):
        return x * torch.sigmoid(x).detach()

    def gated_norm(self, hidden, gate=None):
        dtype = hidden.dtype
        hidden = hidden.to(torch.float32)
        product = hidden * silu(gate.to(torch.float32))
        hidden = product / 2 + (product / 2).detach()
        *lead, last = hidden.shape
        groups = hidden.view(*lead, last // self.group_size, self.group_size)
        groups = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.variance_epsilon).detach()
        return self.weight * groups.view(*lead, last).to(dtype)

    model = wrapper.model
    rsqrt = torch.rsqrt
    # named Mamba2RMSNormGated from transformers 5.25 on
    gated_norm_class = getattr(modeling_mamba2, "Mamba2RMSNormGated", None) or modeling_mamba2.MambaRMSNormGated
    with replaced((modeling_mamba2, "mamba2_chunk_scan", held_scan), (F, "silu", silu),
                  (torch, "rsqrt", lambda t, *a, **k: rsqrt(t, *a, **k).detach()),
                  (gated_norm_class, "forward", gated_norm)):
        embedded = model.backbone.embeddings(ids).detach().requires_grad_()
        out = model(inputs_embeds=embedded, use_cache=False).logits[0, -1, token]
        (grad,) = torch.autograd.grad(out, embedded)
    return (grad * embedded).sum(-1)[0]


def test_mamba2_attnlrp_equals_the_mambalrp_reference():
    scan = modeling_mamba2.mamba2_chunk_scan
    torch.manual_seed(0)
    wrapper = mamba2()
    ids = torch.randint(0, 50, (1, 8))
    token = int(wrapper(ids)[0, -1].argmax())
    relevance = relprop.LRP(wrapper, "attnlrp").attribute(ids, target=(-1, token))[0]
    reference = mambalrp_reference(wrapper, ids, token)
    # HF's scan computes in float32 whatever the model's dtype: equality to its rounding
    assert (relevance - reference).abs().max() / reference.abs().max() < 1e-6
    assert modeling_mamba2.mamba2_chunk_scan is scan  # put back after the pass


def test_mamba2_scan_functions_are_put_back_after_a_failing_pass():
    wrapper = mamba2()
    scan, update = modeling_mamba2.mamba2_chunk_scan, modeling_mamba2.mamba2_selective_state_update
    with pytest.raises(IndexError):  # a token id outside the vocabulary: raised inside the pass
        relprop.LRP(wrapper, "attnlrp").attribute(torch.full((1, 8), 10_000), target=(-1, 0))
    assert modeling_mamba2.mamba2_chunk_scan is scan
    assert modeling_mamba2.mamba2_selective_state_update is update


class FixedOutput(torch.nn.Module):
    """A stand-in that returns a precomputed tensor as a constant."""

    def __init__(self, value: torch.Tensor):
        super().__init__()
        self.value = value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.value


def test_mamba1_selective_parameters_are_constants():
    torch.manual_seed(0)
    config = transformers.MambaConfig(vocab_size=50, hidden_size=16, state_size=4, num_hidden_layers=2, expand=2,
                                      conv_kernel=4, use_cache=False)
    wrapper = Logits(transformers.MambaForCausalLM(config).double()).eval()
    ids = torch.randint(0, 50, (1, 6))
    token = int(wrapper(ids)[0, -1].argmax())
    relevance = relprop.LRP(wrapper, "attnlrp").attribute(ids, target=(-1, token))[0]
    # the same model with each x_proj replaced by its own output on this input, as a constant
    outputs = {}
    mixers = [layer.mixer for layer in wrapper.model.backbone.layers]
    handles = [mixer.x_proj.register_forward_hook(lambda m, a, out: outputs.__setitem__(m, out.detach()))
               for mixer in mixers]
    wrapper(ids)
    for handle in handles:
        handle.remove()
    originals = [mixer.x_proj for mixer in mixers]
    for mixer, projection in zip(mixers, originals):
        mixer.x_proj = FixedOutput(outputs[projection]).eval()
    try:
        expected = relprop.LRP(wrapper, "attnlrp").attribute(ids, target=(-1, token))[0]
    finally:
        for mixer, projection in zip(mixers, originals):
            mixer.x_proj = projection
    torch.testing.assert_close(relevance, expected, rtol=1e-10, atol=1e-12)
    assert not any(module._forward_hooks for mixer in mixers for module in mixer.modules())


def _as_function_module(func):
    """``func`` as transformers wraps scan functions when ``kernels`` is installed: a module whose ``forward``
    takes ``*args, **kwargs`` and calls the function it closes over."""
    class Func(torch.nn.Module):
        def forward(self, *args, **kwargs):
            return func(*args, **kwargs)
    return Func()


@pytest.mark.parametrize("wrapped", [False, True])
def test_scan_functions_wrapped_as_modules_are_held(wrapped):
    """Whether transformers hands the scan over as a function or as a function module, dt, B and C are held:
    the relevance is MambaLRP's reference's."""
    torch.manual_seed(0)
    wrapper = mamba2()
    ids = torch.randint(0, 50, (1, 8))
    token = int(wrapper(ids)[0, -1].argmax())
    reference = mambalrp_reference(wrapper, ids, token)
    scan = modeling_mamba2.mamba2_chunk_scan
    with replaced((modeling_mamba2, "mamba2_chunk_scan", _as_function_module(scan) if wrapped else scan)):
        relevance = relprop.LRP(wrapper, "attnlrp").attribute(ids, target=(-1, token))[0]
    assert (relevance - reference).abs().max() / reference.abs().max() < 1e-6


def test_a_scan_that_does_not_name_its_arguments_is_reported():
    torch.manual_seed(0)
    wrapper = mamba2()
    ids = torch.randint(0, 50, (1, 8))
    scan = modeling_mamba2.mamba2_chunk_scan
    with replaced((modeling_mamba2, "mamba2_chunk_scan", lambda *args, **kwargs: scan(*args, **kwargs))):
        with pytest.warns(relprop.UnhandledOpWarning, match="not held constant"):
            relprop.LRP(wrapper, "attnlrp").attribute(ids, target=(-1, 3))
