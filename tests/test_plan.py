"""Captured plans: later passes of an input signature follow the decisions of a recorded one.

A replayed pass must give the relevance interception gives, bitwise, and must notice every change that would
change a decision (another path through the model, another constant, a new parameter, a changed rule) before
the op it concerns runs, falling back to interception.
"""
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import relprop
from relprop.engine import Session, plan

transformers = pytest.importorskip("transformers")


class Counted:
    """Counts the ops handed to op families (interception) and the ops replayed."""

    def __init__(self, monkeypatch):
        self.intercepted = self.replayed = 0
        intercept, run = Session.intercept, plan.Replay.run

        def counted_intercept(session, *args):
            self.intercepted += 1
            return intercept(session, *args)

        def counted_run(replay, *args):
            self.replayed += 1
            return run(replay, *args)
        monkeypatch.setattr(Session, "intercept", counted_intercept)
        monkeypatch.setattr(plan.Replay, "run", counted_run)

    def reset(self):
        self.intercepted = self.replayed = 0


def hugging_face(name):
    T = transformers
    torch.manual_seed(0)
    if name == "llama":
        config = T.LlamaConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, intermediate_size=32)
        return T.LlamaForCausalLM(config).eval(), (-1, 5)
    if name == "bert":
        config = T.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
                              intermediate_size=32)
        return T.BertForSequenceClassification(config).eval(), 1
    config = T.GPT2Config(vocab_size=50, n_embd=16, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0)
    return T.GPT2LMHeadModel(config).eval(), (-1, 5)


IDS = torch.randint(3, 50, (2, 7), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("preset", ["attnlrp", "cp-lrp"])
@pytest.mark.parametrize("name", ["llama", "bert", "gpt2"])
def test_a_replayed_pass_gives_the_relevance_of_interception_bitwise(name, preset, monkeypatch):
    model, target = hugging_face(name)
    reference = relprop.LRP(model, preset)
    reference.replay = False
    expected = reference.attribute(IDS, target=target)
    lrp = relprop.LRP(model, preset)
    counted = Counted(monkeypatch)
    for attempt in range(4):  # interception, recorded, replayed, replayed
        counted.reset()
        relevance = lrp.attribute(IDS, target=target)
        assert torch.equal(relevance, expected), attempt
        assert (counted.intercepted == 0) == (attempt >= 2), (attempt, counted.intercepted)
    assert counted.replayed > 50


def test_a_recorded_pass_replays_many_seeds():
    model, _ = hugging_face("llama")
    lrp = relprop.LRP(model, "attnlrp")
    expected = [lrp.attribute(IDS, target=(-1, token)) for token in (3, 7, 11)]  # the last one is replayed
    explained = lrp.record(IDS)
    for token, reference in zip((3, 7, 11), expected):
        (relevance,) = explained.relevance(relprop.output_relevance(explained.logits, (-1, token)))
        assert torch.equal(relevance, reference)


class Branching(nn.Module):
    """A model whose path depends on its input's values, on a Python attribute and on a parameter."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(6, 8), nn.Linear(8, 3)
        self.scale = 2.0

    def forward(self, x):
        h = self.first(x)
        h = F.gelu(h) if h.sum() > 0 else torch.tanh(h) * 3  # Tensor.__bool__: a Python value from the data
        return self.second(h * self.scale)


def attributions(lrp, x, times=3):
    return [lrp.attribute(x, target=1) for _ in range(times)]


def interception(model, x, preset="attnlrp"):
    lrp = relprop.LRP(model, preset)
    lrp.replay = False
    return lrp.attribute(x, target=1)


def test_a_pass_that_takes_another_path_is_explained_under_interception(monkeypatch):
    torch.manual_seed(0)
    model = Branching().eval()
    positive = torch.randn(4, 6)
    with torch.no_grad():
        negative = -positive if model.first(positive).sum() > 0 else positive
        positive = -negative
    lrp = relprop.LRP(model, "attnlrp")
    attributions(lrp, positive)  # the third follows the plan
    counted = Counted(monkeypatch)
    relevance = lrp.attribute(negative, target=1)  # same signature, the other branch
    assert counted.replayed > 0 and counted.intercepted > 0  # it started on the plan, then fell back
    assert torch.equal(relevance, interception(model, negative))
    assert torch.equal(lrp.attribute(positive, target=1), interception(model, positive))


@pytest.mark.parametrize("change", ["constant", "new parameter", "parameter memory", "module rule", "composite"])
def test_a_change_that_concerns_a_decision_is_seen(change):
    torch.manual_seed(0)
    model = Branching().eval()
    x = torch.randn(4, 6)
    lrp = relprop.LRP(model, "attnlrp")
    attributions(lrp, x)
    if change == "constant":
        model.scale = 0.5
    elif change == "new parameter":
        model.second.weight = nn.Parameter(torch.randn(3, 8))
    elif change == "parameter memory":
        model.second.weight.data = torch.randn(3, 8)
    elif change == "module rule":
        model.second.rule = relprop.rules.Epsilon(0.5)
    else:
        lrp.composite.dense = relprop.rules.Epsilon(0.5)
    expected = relprop.LRP(model, lrp.composite)
    expected.replay = False
    for _ in range(3):
        assert torch.equal(lrp.attribute(x, target=1), expected.attribute(x, target=1)), change


def test_a_pass_is_replayed_with_a_rule_changed_in_place_only_after_it_is_recorded_again():
    torch.manual_seed(0)
    model = Branching().eval()
    x = torch.randn(4, 6)
    lrp = relprop.LRP(model, "attnlrp")
    attributions(lrp, x)
    lrp.composite.dense.epsilon = 0.25  # the rule object itself changes
    reference = relprop.LRP(model, lrp.composite)
    reference.replay = False
    assert torch.equal(lrp.attribute(x, target=1), reference.attribute(x, target=1))


def test_passes_that_carry_relevance_itself_record_no_plan(monkeypatch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)).eval()
    lrp = relprop.LRP(model, "epsilon-plus-flat")
    counted = Counted(monkeypatch)
    attributions(lrp, torch.randn(2, 6), times=4)
    assert counted.replayed == 0


class InPlace(nn.Module):
    """``write`` overwrites ``h`` after a relevance node (the product) has read it."""

    def __init__(self, write):
        super().__init__()
        self.first, self.gate, self.second = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 3)
        self.write = write

    def forward(self, x):
        h = self.first(x)
        product = h * self.gate(x)
        self.write(h)
        return self.second(product + h)


@pytest.mark.parametrize("write", [lambda h: h.mul_(2),
                                   lambda h: F.relu(h, inplace=True),  # no "_" in its name: the flag says it
                                   lambda h: F.relu(h, True),  # the flag by position
                                   torch.ops.aten.relu_.default],  # named "relu_.default": its schema says it
                         ids=["mul_", "inplace flag", "flag by position", "aten relu_"])
def test_an_op_in_place_leaves_the_pass_without_a_plan(write, monkeypatch):
    torch.manual_seed(0)
    model, x = InPlace(write).eval(), torch.randn(4, 6)
    expected = interception(model, x)
    lrp = relprop.LRP(model, "attnlrp")
    counted = Counted(monkeypatch)
    for relevance in attributions(lrp, x, times=4):
        assert torch.equal(relevance, expected)
    assert counted.replayed == 0


def test_a_replayed_pass_leaves_the_model_as_it_was():
    model, target = hugging_face("llama")
    lrp = relprop.LRP(model, "attnlrp")
    for _ in range(3):
        lrp.attribute(IDS, target=target)
    model.train()
    with pytest.warns(UserWarning, match="training mode"):
        lrp.attribute(IDS, target=target)
    assert all(module.training for module in model.modules())
    assert not any(module._forward_hooks or module._forward_pre_hooks for module in model.modules())


#: run in a process of its own: cycles that other tests' compilations leave behind (Dynamo's sources and frame
#: summaries) may be collected during any later test of the same worker
_NO_CYCLES = """
import collections, gc
import torch
import relprop
from test_plan import Branching

torch.manual_seed(0)
model, x = Branching().eval(), torch.randn(4, 6)
lrp = relprop.LRP(model, "attnlrp")
lrp.attribute(x, target=1)
gc.collect()
gc.disable()
gc.set_debug(gc.DEBUG_SAVEALL)
for _ in range(3):  # recorded, replayed, replayed
    lrp.attribute(x, target=1)
    gc.collect()
    found = collections.Counter(f"{type(item).__module__}.{type(item).__qualname__}" for item in gc.garbage)
    gc.garbage.clear()
    assert not found, found.most_common(12)
assert list(lrp._plans._entries.values())[0].plan is not None
"""


def test_recording_and_replaying_make_no_reference_cycles():
    result = subprocess.run([sys.executable, "-c", _NO_CYCLES], cwd=Path(__file__).parent, capture_output=True,
                            text=True, timeout=1800)
    assert result.returncode == 0, result.stderr[-3000:]

def test_an_op_without_a_rule_leaves_the_pass_without_a_plan(monkeypatch):
    class Unruled(nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.second = nn.Linear(6, 6), nn.Linear(6, 3)

        def forward(self, x):
            return self.second(torch.logcumsumexp(self.first(x), 1))  # no op family handles it

    torch.manual_seed(0)
    model, x = Unruled().eval(), torch.randn(4, 6)
    lrp = relprop.LRP(model, "attnlrp")
    counted = Counted(monkeypatch)
    for _ in range(4):  # each pass reports the op, as interception does
        with pytest.warns(relprop.UnhandledOpWarning, match="logcumsumexp"):
            lrp.attribute(x, target=1)
    assert counted.replayed == 0


def test_a_constant_given_twice_to_an_op_is_no_position_of_a_later_pass():
    class Clamped(nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.second = nn.Linear(6, 6), nn.Linear(6, 3)
            self.low, self.high = torch.full((6,), -0.5), torch.full((6,), 0.5)
            self.flat = True

        def forward(self, x):
            high = self.low if self.flat else self.high  # one tensor object at both bounds, or two
            return self.second(torch.clamp(self.first(x), self.low, high))

    torch.manual_seed(0)
    model, x = Clamped().eval(), torch.randn(4, 6)
    lrp = relprop.LRP(model, "attnlrp")
    attributions(lrp, x)  # recorded with one bound tensor at both positions, replayed
    model.flat = False
    assert torch.equal(lrp.attribute(x, target=1), interception(model, x))


def test_a_pass_under_autocast_does_not_follow_a_plan_recorded_without_it(monkeypatch):
    torch.manual_seed(0)
    model, x = Branching().eval(), torch.randn(4, 6)
    lrp = relprop.LRP(model, "attnlrp")
    attributions(lrp, x)
    counted = Counted(monkeypatch)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        relevance = lrp.attribute(x, target=1)
        reference = relprop.LRP(model, "attnlrp")
        reference.replay = False
        expected = reference.attribute(x, target=1)
    assert counted.intercepted > 0
    assert torch.equal(relevance, expected)


def _chain():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3)).double().eval()
    return model, torch.randn(4, 6, dtype=torch.float64)


def test_a_square_weight_laid_out_anew_in_its_memory_is_seen():
    model, x = _chain()
    composite = relprop.composites.get("attnlrp")
    composite.dense = relprop.rules.Epsilon(0.01)  # a node that holds the weight for the backward pass
    lrp = relprop.LRP(model, composite)
    attributions(lrp, x)
    weight = model[2].weight
    address = weight.data_ptr()
    weight.data = weight.data.t()  # W <- W^T in the same memory: same address and shape, other strides
    assert weight.data_ptr() == address
    assert torch.equal(lrp.attribute(x, target=1), interception(model, x, composite))


class _WrittenOutAttention(nn.Module):
    """Attention written out with a float16 additive mask: recognised as fused only where the scores are float16."""

    def __init__(self, width=16, steps=6):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(width, width), nn.Linear(width, width), nn.Linear(width, width),
                                          nn.Linear(width, 3))
        self.register_buffer("mask", torch.triu(torch.full((steps, steps), -1e4), 1).half())

    def forward(self, x):
        q, k, v = self.q(x), self.k(x), self.v(x)
        scores = q @ k.transpose(-1, -2) * 0.25 + self.mask
        return self.o(torch.softmax(scores, -1) @ v)[:, -1]


def test_a_pass_under_another_autocast_dtype_does_not_follow_the_plan():
    torch.manual_seed(0)
    model, x = _WrittenOutAttention().eval(), torch.randn(2, 6, 16)
    lrp = relprop.LRP(model, "attnlrp")
    for _ in range(2):  # interception, then recorded
        with torch.autocast("cpu", dtype=torch.bfloat16):
            lrp.attribute(x, target=1)
    with torch.autocast("cpu", dtype=torch.float16):
        relevance = lrp.attribute(x, target=1)
        expected = interception(model, x, "attnlrp")
    assert torch.equal(relevance, expected)


class _Tunable(nn.Linear):
    epsilon = 0.0

    @property
    def rule(self):  # the module's rule follows one of its settings
        return relprop.rules.Epsilon(self.epsilon) if self.epsilon else None


def test_a_module_rule_read_through_a_property_is_seen():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), _Tunable(6, 6), nn.Tanh(), nn.Linear(6, 3)).double().eval()
    x = torch.randn(4, 6, dtype=torch.float64)
    lrp = relprop.LRP(model, "attnlrp")
    attributions(lrp, x)
    model[2].epsilon = 0.5
    assert torch.equal(lrp.attribute(x, target=1), interception(model, x, lrp.composite))


class _PerModule(relprop.composites.presets.AttnLRP):
    """Chooses by a method of its own, from a module attribute no plan can watch."""

    def rule_for(self, call, module, name):
        if getattr(module, "stabilise", False):
            return relprop.rules.Epsilon(0.5), "flagged module"
        return super().rule_for(call, module, name)


def test_a_composite_that_chooses_by_a_method_of_its_own_gets_no_plan(monkeypatch):
    model, x = _chain()
    lrp = relprop.LRP(model, _PerModule())
    attributions(lrp, x)
    model[2].stabilise = True
    counted = Counted(monkeypatch)
    assert torch.equal(lrp.attribute(x, target=1), interception(model, x, lrp.composite))
    assert counted.replayed == 0
    assert relprop.composites.get("attnlrp").replayable and not _PerModule().replayable


def third_pass_replayed(lrp, x, monkeypatch):
    """The relevance of ``lrp``'s third pass of ``x``, checked to follow the plan its second recorded, op for op."""
    attributions(lrp, x, times=2)
    counted = Counted(monkeypatch)
    relevance = lrp.attribute(x, target=1)
    assert counted.replayed > 0 and counted.intercepted == 0
    return relevance


def test_a_model_with_frozen_parameters_follows_its_plan(monkeypatch):
    model, x = _chain()
    model.requires_grad_(False)
    lrp = relprop.LRP(model, "attnlrp")
    assert torch.equal(third_pass_replayed(lrp, x, monkeypatch), interception(model, x))
    model[2].weight.requires_grad_(True)  # unfrozen: seen
    assert torch.equal(lrp.attribute(x, target=1), interception(model, x))


class _MaxPooled(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x):
        return self.second(self.first(x).max(dim=1).values)  # a named tuple of values and indices


def test_a_pass_through_an_op_that_returns_a_named_tuple_follows_its_plan(monkeypatch):
    torch.manual_seed(0)
    model, x = _MaxPooled().double().eval(), torch.randn(4, 5, 6, dtype=torch.float64)
    lrp = relprop.LRP(model, "attnlrp")
    assert torch.equal(third_pass_replayed(lrp, x, monkeypatch), interception(model, x))
