"""The compiled tier is never stale: whatever changes between two calls, the second equals a fresh eager explainer.

Each case is a change a user makes between calls (a hook, a rule, a module, the composite's settings, the model
itself, another thread's call); the compiled explainer's next relevance must equal that of a new ``LRP`` without
``compile=`` on the model as it now is, in float64, to 1e-12 of the largest entry. The tier may recompile or
fall back to interception to get there, but never reuse a program decided under other rules. AOT autograd
without code generation (``"aot_eager"``): exact, and seconds per case.
"""
import copy
import threading
import warnings

import pytest
import torch
from torch import nn

import relprop
from relprop.methods.compiled import CompileFallbackWarning

transformers = pytest.importorskip("transformers")


def cnn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1),
                         nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(16, 3)).double().eval()


def images(batch=2, side=6):
    return torch.randn(batch, 3, side, side, dtype=torch.float64, generator=torch.Generator().manual_seed(batch))


def llama():
    config = transformers.LlamaConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=32)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).double().eval()


def assert_same(relevance, reference, bound=1e-12):
    scale = reference.abs().max()
    assert scale > 0
    assert (relevance - reference).abs().max() <= bound * scale


def explained_twice(model, composite, change, x=None, target=1, **kwargs):
    """The compiled relevance after ``change(model, lrp)`` (made after a first compiled call), and a fresh eager
    explainer's on the model (and composite) as they are then."""
    x = images() if x is None else x
    lrp = relprop.LRP(model, composite, compile="aot_eager")
    lrp.attribute(x, target=target, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CompileFallbackWarning)  # a fallback is allowed; a stale program is not
        # a backward hook's Function has no rule: interception says so, and the compiled tier as well
        warnings.simplefilter("ignore", relprop.UnhandledOpWarning)
        change(lrp.model, lrp)
        relevance = lrp.attribute(x, target=target, **kwargs)
        return relevance, relprop.LRP(lrp.model, lrp.composite).attribute(x, target=target, **kwargs)


def _halve_grad_input(module, grad_input, grad_output):
    return tuple(None if g is None else g * 0.5 for g in grad_input)


def _backward_hook(model, lrp):
    model[3].register_full_backward_hook(_halve_grad_input)


def _backward_pre_hook(model, lrp):
    model[3].register_full_backward_pre_hook(lambda module, grad_output: tuple(g * 0.5 for g in grad_output))


class _Settings:
    def __init__(self):
        self.dense = relprop.rules.Epsilon(1e-6)


class _ChoosesBySettings(relprop.composites.Composite):
    """Chooses the dense layers' rule by a settings object its methods read (not an attribute the engine reads)."""

    def __init__(self, settings):
        super().__init__()
        self._settings = settings

    def rule_for(self, call, module, name):
        if isinstance(module, nn.Linear):
            return self._settings.dense, "the settings"
        return super().rule_for(call, module, name)


SETTINGS = _Settings()


def _settings_changed(model, lrp):
    SETTINGS.dense = relprop.rules.ZPlus()


def _composite_nested_changed(model, lrp):
    lrp.composite.conv.epsilon = 0.25  # a rule the composite holds, mutated: read by value


def _module_rule_set(model, lrp):
    model[3].rule = relprop.rules.Gamma(0.5)


def _module_rule_mutated(model, lrp):
    model[3].rule.gamma = 2.0


def _rule_attribute_mutated(model, lrp):
    lrp.composite.dense.epsilon = 0.5


def _parameter_replaced(model, lrp):
    model[3].weight = nn.Parameter(model[3].weight.detach() * -1.5)


def _buffer_replaced(model, lrp):
    model[1].running_var = model[1].running_var * 3


def _state_loaded(model, lrp):
    state = {name: value * 0.5 if value.is_floating_point() else value for name, value in model.state_dict().items()}
    model.load_state_dict(state)


def _module_swapped(model, lrp):
    model[4] = nn.Tanh()


def _forward_patched(model, lrp):
    model[4].forward = lambda x: torch.relu(x) * 2


def _model_replaced(model, lrp):
    other = copy.deepcopy(model)
    with torch.no_grad():
        other[7].weight.mul_(-1)
    lrp.model = other


def _forward_hook(model, lrp):
    model[4].register_forward_hook(lambda module, args, out: out * 3)


def _global_backward_hook(model, lrp):
    handle = nn.modules.module.register_module_full_backward_hook(
        lambda module, grad_input, grad_output: tuple(None if g is None else g * 0.5 for g in grad_input)
        if isinstance(module, nn.Conv2d) else None)
    CLEANUP.append(handle)


CLEANUP = []


@pytest.fixture(autouse=True)
def _remove_global_hooks():
    yield
    while CLEANUP:
        CLEANUP.pop().remove()


CHANGES = {
    "full backward hook": _backward_hook,
    "backward pre-hook": _backward_pre_hook,
    "global backward hook": _global_backward_hook,
    "forward hook": _forward_hook,
    "module rule set": _module_rule_set,
    "rule attribute mutated": _rule_attribute_mutated,
    "parameter replaced": _parameter_replaced,
    "buffer replaced": _buffer_replaced,
    "load_state_dict": _state_loaded,
    "module swapped": _module_swapped,
    "forward patched": _forward_patched,
    "model replaced": _model_replaced,
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_change_between_calls(change):
    relevance, reference = explained_twice(cnn(), relprop.composites.EpsilonPlusFlat(), CHANGES[change])
    assert_same(relevance, reference)


def test_a_module_rule_mutated():
    model = cnn()
    model[3].rule = relprop.rules.Gamma(0.5)
    relevance, reference = explained_twice(model, "epsilon", _module_rule_mutated)
    assert_same(relevance, reference)


def test_a_rule_nested_in_the_composite_mutated():
    relevance, reference = explained_twice(cnn(), relprop.composites.Composite(), _composite_nested_changed)
    assert_same(relevance, reference)


def test_a_composite_that_reads_its_own_settings():
    """A composite whose own ``rule_for`` reads an object the engine cannot see is never cached."""
    SETTINGS.dense = relprop.rules.Epsilon(1e-6)
    relevance, reference = explained_twice(cnn(), _ChoosesBySettings(SETTINGS), _settings_changed)
    assert_same(relevance, reference)


class _DeclaresSettings(_ChoosesBySettings):
    def state(self):
        return self._settings.dense


def test_a_composite_that_declares_its_state_compiles():
    settings = _Settings()
    model, x = cnn(), images()
    lrp = relprop.LRP(model, _DeclaresSettings(settings), compile="aot_eager")
    lrp.attribute(x, target=1)
    assert lrp.compiled.fallback is None
    settings.dense = relprop.rules.ZPlus()
    relevance = lrp.attribute(x, target=1)
    assert lrp.compiled.fallback is None and lrp.compiled.compilations == 2
    assert_same(relevance, relprop.LRP(model, _DeclaresSettings(settings)).attribute(x, target=1))


@pytest.mark.parametrize("preset", ["epsilon-plus-flat", "epsilon-gamma-box"])
def test_smooth_stride_on_the_first_layer_alone(preset):
    """Only the stem is strided: SmoothStride's own rule, not the rule it wraps, is the stem's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, stride=2, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1),
                          nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 3)).double().eval()
    kind = {"epsilon-plus-flat": relprop.composites.EpsilonPlusFlat,
            "epsilon-gamma-box": lambda **kw: relprop.composites.EpsilonGammaBox(low=-3.0, high=3.0, **kw)}[preset]
    x = images(side=8)
    lrp = relprop.LRP(model, kind(smooth_stride=True), compile="aot_eager")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CompileFallbackWarning)
        relevance = lrp.attribute(x, target=1)
    assert_same(relevance, relprop.LRP(model, kind(smooth_stride=True)).attribute(x, target=1))


@pytest.mark.parametrize("what", ["targets", "batch sizes"])
def test_targets_and_batch_sizes(what):
    model = cnn()
    lrp = relprop.LRP(model, "epsilon-plus-flat", compile="aot_eager")
    for step in range(3):
        x = images(batch=2 + step if what == "batch sizes" else 2)
        target = step if what == "targets" else torch.arange(x.shape[0]) % 3
        assert_same(lrp.attribute(x, target=target),
                    relprop.LRP(model, "epsilon-plus-flat").attribute(x, target=target))


def test_two_explainers_of_one_model():
    model, x = cnn(), images()
    first = relprop.LRP(model, "epsilon-plus-flat", compile="aot_eager")
    second = relprop.LRP(model, "epsilon", compile="aot_eager")
    for lrp, name in ((first, "epsilon-plus-flat"), (second, "epsilon"), (first, "epsilon-plus-flat")):
        assert_same(lrp.attribute(x, target=2), relprop.LRP(model, name).attribute(x, target=2))


def test_lengths_and_tied_weights():
    """A language model whose embedding and output layer share their weight, at several lengths."""
    model = llama()
    model.lm_head.weight = model.model.embed_tokens.weight
    lrp = relprop.LRP(model, "attnlrp", compile="aot_eager")
    for length in (5, 7, 5):
        ids = torch.randint(3, 50, (2, length), generator=torch.Generator().manual_seed(length))
        assert_same(lrp.attribute(ids, target=(-1, 4)),
                    relprop.LRP(model, "attnlrp").attribute(ids, target=(-1, 4)))


def test_first_calls_from_several_threads():
    """Threads that make the first call of a fresh explainer at once each get their own relevance: what a call
    traces, and the inputs the rules are decided on, belong to that call."""
    model = llama()
    lrp = relprop.LRP(model, "attnlrp", compile="aot_eager")
    ids = [torch.randint(3, 50, (2, 6), generator=torch.Generator().manual_seed(seed)) for seed in range(4)]
    found, errors = {}, []

    def explain(index):
        try:
            found[index] = lrp.attribute(ids[index], target=(-1, 4))
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=explain, args=(i,)) for i in range(len(ids))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    for index, x in enumerate(ids):
        assert_same(found[index], relprop.LRP(model, "attnlrp").attribute(x, target=(-1, 4)))
    # and later calls of the same signature reuse what those calls compiled, unchanged
    assert_same(lrp.attribute(ids[0], target=(-1, 4)), found[0], bound=0)


def test_calls_while_another_thread_compiles():
    """A thread explains a signature that has compiled while another compiles a new one."""
    model = llama()
    lrp = relprop.LRP(model, "attnlrp", compile="aot_eager")
    short = torch.randint(3, 50, (1, 5), generator=torch.Generator().manual_seed(0))
    lrp.attribute(short, target=(-1, 4))
    batch = torch.randint(3, 50, (3, 9), generator=torch.Generator().manual_seed(1))
    found, errors = [], []

    def compile_new():
        try:
            found.append(lrp.attribute(batch, target=(-1, 4)))
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    thread = threading.Thread(target=compile_new)
    thread.start()
    repeated = [lrp.attribute(short, target=(-1, 4)) for _ in range(3)]
    thread.join()
    assert not errors
    reference = relprop.LRP(model, "attnlrp").attribute(short, target=(-1, 4))
    for relevance in repeated:
        assert_same(relevance, reference)
    assert_same(found[0], relprop.LRP(model, "attnlrp").attribute(batch, target=(-1, 4)))


def test_record_under_no_grad():
    model, x = cnn(), images()
    lrp = relprop.LRP(model, "epsilon-plus-flat", compile="aot_eager")
    with torch.no_grad():
        explained = lrp.record(x)
    (relevance,) = explained.relevance(relprop.output_relevance(explained.logits, target=1))
    assert_same(relevance, relprop.LRP(model, "epsilon-plus-flat").attribute(x, target=1))


def bert():
    config = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=32)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(config).double().eval()


def test_an_attention_mask_whose_data_changes():
    """Attention written out is explained through its fused form where the two agree, which interception checks
    on every call: the compiled program checks it on every run too, whatever mask the call brings."""
    model, ids = bert(), torch.randint(3, 50, (2, 7), generator=torch.Generator().manual_seed(1))
    lrp = relprop.LRP(model, "attnlrp", compile="aot_eager")
    for padded in (0, 3, 6):
        mask = torch.ones(2, 7, dtype=torch.long)
        mask[1, 7 - padded:] = 0
        arguments = {"attention_mask": mask}
        relevance = lrp.attribute(ids, target=1, additional_forward_args=arguments)
        assert_same(relevance, relprop.LRP(model, "attnlrp").attribute(ids, target=1,
                                                                       additional_forward_args=arguments))


@pytest.mark.parametrize("agree", [True, False])
def test_written_attention_checks_its_fused_form_on_every_run(agree):
    """The value is the written-out product's, bitwise; the gradient is the fused form's where the two agree, and
    infinite where they do not (which makes the call fall back)."""
    from relprop.engine.compiled import _agreeing

    value = torch.randn(3, 4, dtype=torch.float64)
    fused = (value + (0 if agree else 1e-3)).requires_grad_()
    out = _agreeing(value, fused)
    assert torch.equal(out, value)
    (grad,) = torch.autograd.grad(out, fused, torch.full_like(value, 0.75))
    assert torch.equal(grad, torch.full_like(value, 0.75)) if agree else grad.isinf().all()


@pytest.mark.slow
@pytest.mark.parametrize("change", ["module rule set", "backward pre-hook"])
def test_inductor_is_never_stale_either(change):
    """The same with Inductor's generated code, on a tiny model: within rounding of Inductor's own sums."""
    model, x = cnn(), images()
    lrp = relprop.LRP(model, relprop.composites.EpsilonPlusFlat(), compile=True)
    lrp.attribute(x, target=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CompileFallbackWarning)
        warnings.simplefilter("ignore", relprop.UnhandledOpWarning)
        CHANGES[change](model, lrp)
        relevance = lrp.attribute(x, target=1)
        reference = relprop.LRP(model, relprop.composites.EpsilonPlusFlat()).attribute(x, target=1)
    assert_same(relevance, reference, bound=1e-10)
