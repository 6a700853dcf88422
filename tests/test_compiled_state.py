"""The compiled tier's state: what it keeps and frees, what it leaves on the model, where it warns and raises.

Each test compiles with AOT autograd without code generation (``"aot_eager"``): seconds, not minutes.
"""
import gc
import warnings
import weakref

import pytest
import torch
from torch import nn

import relprop
import relprop.methods.compiled as compiled_tier
from relprop.methods.compiled import CompileFallbackWarning


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3)).double().eval()


def inputs():
    return torch.randn(4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def assert_same(relevance, reference, bound=1e-12):
    assert (relevance - reference).abs().max() <= bound * reference.abs().max()


def test_a_replaced_composite_is_the_one_explained():
    model, x = mlp(), inputs()
    lrp = relprop.LRP(model, "epsilon", compile="aot_eager")
    lrp.attribute(x, target=1)
    lrp.composite = relprop.composites.get("epsilon-plus")
    relevance = lrp.attribute(x, target=1)
    assert lrp.compiled.fallback is None and lrp.compiled.compilations == 2
    assert_same(relevance, relprop.LRP(model, "epsilon-plus").attribute(x, target=1))


def test_a_hook_on_every_module_recompiles():
    model, x = mlp(), inputs()
    lrp = relprop.LRP(model, "epsilon", compile="aot_eager")
    lrp.attribute(x, target=1)
    handle = nn.modules.module.register_module_forward_hook(
        lambda module, args, out: out * 0.5 if isinstance(module, nn.Linear) and out.shape[-1] == 8 else None)
    try:
        relevance = lrp.attribute(x, target=1)
        reference = relprop.LRP(model, "epsilon").attribute(x, target=1)
    finally:
        handle.remove()
    assert lrp.compiled.compilations == 2
    assert_same(relevance, reference)


def test_no_weight_gradients_and_flags_put_back():
    """The program computes no gradient of a parameter (it would cost a second backward product per layer), and
    each parameter's flag is as it was after the call, also one the user had turned off."""
    model, x = mlp(), inputs()
    model[0].weight.requires_grad_(False)
    flags = [p.requires_grad for p in model.parameters()]
    seen = []
    handle = model[2].register_forward_pre_hook(lambda module, args: seen.append(module.weight.requires_grad))
    lrp = relprop.LRP(model, "epsilon", compile="aot_eager")
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompileFallbackWarning)  # a forward hook is traced like the rest
        lrp.attribute(x, target=1)
    handle.remove()
    assert seen == [False]
    assert [p.requires_grad for p in model.parameters()] == flags
    assert all(p.grad is None for p in model.parameters())


def test_compile_settings_only_inside_calls():
    """The settings the tier compiles under are the user's again after each call; a reusable pass propagates
    seeds after the one that compiled its backward graph (each keeps the graph: no donated buffers)."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    def settings():
        return (functorch_config.donated_buffer, inductor_config.layout_optimization,
                inductor_config.compile_threads)
    model, x = mlp(), inputs()
    before = settings()
    lrp = relprop.LRP(model, "epsilon", compile="aot_eager")
    recorded = lrp.record(x, reusable=True)
    assert settings() == before
    seeds = torch.eye(3, dtype=torch.float64).unsqueeze(1).expand(3, 4, 3) * recorded.logits.detach()
    (relevances,) = recorded.relevances(seeds)
    assert settings() == before and lrp.compiled.fallback is None
    reference = relprop.LRP(model, "epsilon")
    for target in range(3):
        assert_same(relevances[target], reference.attribute(x, target=target))
    with pytest.raises(ZeroDivisionError):  # and when the backward pass raises
        with lrp.compiled.backward()():
            raise ZeroDivisionError
    assert settings() == before


def test_strict_raises_on_nan_relevance():
    class Infinite(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(6, 3)

        def forward(self, x):
            return self.a(x) * torch.tensor(float("inf"), dtype=x.dtype)

    model, x = Infinite().double().eval(), inputs()
    with pytest.raises(relprop.UnsupportedOpError, match="NaN or infinite"):
        relprop.LRP(model, "epsilon", strict=True, compile="aot_eager").attribute(x, target=1)
    with pytest.warns(relprop.ConservationWarning, match="NaN or infinite"):
        relprop.LRP(model, "epsilon", compile="aot_eager").attribute(x, target=1)


def test_a_refused_signature_is_not_traced_again(monkeypatch):
    model, x = mlp(), inputs()
    model[4].rule = relprop.rules.Epsilon(1e-3, zero_bias=True)  # no traceable form
    decided = []
    decide = compiled_tier.decide
    monkeypatch.setattr(compiled_tier, "decide", lambda *args: decided.append(1) or decide(*args))
    lrp = relprop.LRP(model, "epsilon", compile="aot_eager")
    with pytest.warns(CompileFallbackWarning):
        first = lrp.attribute(x, target=1)
    # traced as one program, then as a forward program for a recorded pass: both refused, and remembered
    assert len(decided) == 2 and lrp.compiled.split is not None
    second = lrp.attribute(x, target=1)
    assert len(decided) == 2 and lrp.compiled.fallback is not None
    assert torch.equal(first, second)
    model[4].rule = None  # the key changed: tried again, and compiled as one program
    relevance = lrp.attribute(x, target=1)
    assert len(decided) == 3 and lrp.compiled.fallback is None and lrp.compiled.split is None
    assert_same(relevance, relprop.LRP(model, "epsilon").attribute(x, target=1))


def test_warnings_name_the_callers_line():
    model, x = mlp().train(), inputs()
    model[2].rule = relprop.rules.Epsilon(1e-3, zero_bias=True)
    lrp = relprop.LRP(model, "epsilon", compile="aot_eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lrp.attribute(x, target=1)
    kinds = {w.category for w in caught}
    assert CompileFallbackWarning in kinds and UserWarning in kinds  # the fallback, and training mode
    assert {w.filename for w in caught} == {__file__}


def test_the_model_is_freed_with_its_explainer():
    model, x = mlp(), inputs()
    lrp = relprop.LRP(model, "epsilon", compile="aot_eager")
    lrp.attribute(x, target=1)
    assert lrp.compiled.fallback is None
    alive = weakref.ref(model)
    del model, lrp
    gc.collect()
    assert alive() is None


class Square(nn.Module):
    """A tensor that is both factors of a product: each of its two slots takes its share."""

    def __init__(self):
        super().__init__()
        self.a, self.head = nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x):
        h = self.a(x)
        return self.head(h * h)


@pytest.mark.parametrize("preset", ["epsilon", "attnlrp", "cp-lrp"])
def test_a_tensor_twice_in_one_product(preset):
    torch.manual_seed(0)
    model, x = Square().double().eval(), inputs()
    lrp = relprop.LRP(model, preset, compile="aot_eager")
    relevance = lrp.attribute(x, target=1)
    assert lrp.compiled.fallback is None
    assert_same(relevance, relprop.LRP(model, preset).attribute(x, target=1))


def test_pass_through_an_op_that_moves_zero():
    """ReLU's zeros into a sigmoid: interception hands their relevance on as it is, which relevance per unit of
    activation (G * out / x) cannot carry at x = 0: the tier falls back, but for composites in gradient form, which
    explain so under interception too."""
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Sigmoid(), nn.Linear(8, 3)).double().eval(), inputs()
    for preset, falls_back in (("epsilon", True), ("attnlrp", False)):
        lrp = relprop.LRP(model, preset, compile="aot_eager")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            relevance = lrp.attribute(x, target=1)
        assert (lrp.compiled.fallback is not None) == falls_back
        assert any("inputs of value 0" in str(w.message) for w in caught) == falls_back
        assert_same(relevance, relprop.LRP(model, preset).attribute(x, target=1))


class WritesThroughView(nn.Module):
    def __init__(self, where: str):
        super().__init__()
        self.a, self.head = nn.Linear(6, 8), nn.Linear(4, 3)
        self.where = where

    def forward(self, x):
        h = self.a(x)
        if self.where == "base":  # a view taken before the base is written in place
            v = h[:, :4]
            nn.functional.hardswish(h, inplace=True)
            return self.head(v)
        nn.functional.hardswish(h[:, :4], inplace=True)  # written through a view: the base changes
        return self.head(h[:, :4] + h[:, 4:])


@pytest.mark.parametrize("where", ["base", "view"])
def test_in_place_through_views_falls_back(where):
    torch.manual_seed(0)
    model, x = WritesThroughView(where).double().eval(), inputs()
    lrp = relprop.LRP(model, "epsilon", compile="aot_eager")
    with pytest.warns(CompileFallbackWarning, match="writes into a tensor"):
        explained = lrp.record(x)
    assert torch.equal(explained.logits, model(x))


@pytest.mark.parametrize("conv", [nn.Conv2d, nn.ConvTranspose2d])
@pytest.mark.parametrize("preset", ["epsilon", "epsilon-plus-flat", "epsilon-alpha2-beta1"])
def test_batch_norms_merged_into_convolutions(conv, preset):
    """Scales of both signs; a transposed convolution holds its output channels in its weight's second dimension."""
    torch.manual_seed(0)
    model = nn.Sequential(conv(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 3), nn.BatchNorm2d(4),
                          nn.ReLU(), nn.Flatten(), nn.LazyLinear(3)).double()
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    model(x)
    model.eval()
    for norm in (model[1], model[4]):
        nn.init.uniform_(norm.weight, -1.5, 1.5)
        norm.running_mean.uniform_(-0.1, 0.1)
        norm.running_var.uniform_(0.5, 1.5)
    lrp = relprop.LRP(model, preset, compile="aot_eager")
    relevance = lrp.attribute(x, target=1)
    assert lrp.compiled.fallback is None
    assert_same(relevance, relprop.LRP(model, preset).attribute(x, target=1), bound=1e-13)


def test_rms_norm_as_dynamo_traces_it():
    """Dynamo traces ``F.rms_norm`` into ``torch.rms_norm``: decided as interception decides the wrapper."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.RMSNorm(8), nn.Linear(8, 3)).double().eval()
    x = inputs()
    for preset in ("epsilon", "attnlrp"):
        lrp = relprop.LRP(model, preset, compile="aot_eager")
        relevance = lrp.attribute(x, target=1)
        assert lrp.compiled.fallback is None
        assert_same(relevance, relprop.LRP(model, preset).attribute(x, target=1))


@pytest.mark.slow
def test_mamba_falls_back():
    """Interception holds Mamba's selective parameters by replacing the model's functions for the pass
    (``methods.adapters``): the compiled tier does not, so it explains such a model under interception."""
    pytest.importorskip("transformers")
    from test_zoo import hf_call, hf_model

    model = hf_model("mamba2", "eager")
    x, target, kwargs = hf_call("mamba2")
    lrp = relprop.LRP(model, "attnlrp", compile="aot_eager")
    with pytest.warns(CompileFallbackWarning, match="selective parameters"):
        relevance = lrp.attribute(x, target=target, additional_forward_args=kwargs or None)
    reference = relprop.LRP(model, "attnlrp").attribute(x, target=target, additional_forward_args=kwargs or None)
    assert torch.equal(relevance, reference)


class _Doubling(nn.Module):
    def forward(self, x):
        return x * 2.0


#: a module the model calls without holding it (as transformers calls functions it wraps as hub-kernel modules)
_OUTSIDE = _Doubling()


def test_a_module_outside_the_model_is_its_callers():
    """Dynamo names a module the model calls but does not hold in the graph's module stack; interception hooks
    the model's modules alone and explains its ops as the caller's: so does the compiled tier."""
    class Calling(nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.second = nn.Linear(6, 8), nn.Linear(8, 3)

        def forward(self, x):
            return self.second(_OUTSIDE(self.first(x)).relu())

    torch.manual_seed(0)
    model, x = Calling().double().eval(), inputs()
    for preset in ("epsilon", "epsilon-plus"):
        lrp = relprop.LRP(model, preset, compile="aot_eager")
        relevance = lrp.attribute(x, target=1)
        assert lrp.compiled.fallback is None and lrp.compiled.split is None
        assert_same(relevance, relprop.LRP(model, preset).attribute(x, target=1))
