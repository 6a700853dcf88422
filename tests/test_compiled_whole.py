"""The whole attribution as one compiled program (``LRP.attribute`` with ``compile=``): the forward pass, the seed,
the backward pass and the products with the inputs in one graph; a recorded pass runs as a forward program and a
backward pass, as before. Both against interception, in float64.

Each test compiles with AOT autograd without code generation (``"aot_eager"``): seconds, not minutes.
"""
import warnings

import pytest
import torch
from torch import nn

import relprop
from relprop._core.errors import ConservationWarning
from relprop.methods.compiled import CompileFallbackWarning
from relprop.methods.targets import selection_mask, target_indices, target_mask
from test_compiled import PRESETS, assert_same, composite, images, interception, residual, tiny_llama
from test_compiled_state import inputs as rows
from test_compiled_state import mlp


@pytest.mark.parametrize("target", [1, -1, (2,), [0, 1, 2, 0], torch.tensor([2, 0, 1, 1]), [2], torch.tensor([1])])
def test_targets_select_as_target_mask_does(target):
    output = torch.randn(4, 3)
    assert torch.equal(traced_selection(output, target_indices(target)), target_mask(output, target))


@pytest.mark.parametrize("target", [(1, 2), (-1, 3), [(0, 1), (2, 6), (1, -1)], (torch.tensor([0, 1, 2]), 4),
                                    ([1, 2, 0], -2), (0,)])
def test_targets_of_sequences_select_as_target_mask_does(target):
    output = torch.randn(3, 5, 7)
    expected = torch.zeros_like(output, dtype=torch.bool)
    for example, index in enumerate(per_example(target, len(output))):
        expected[(example, *index)] = True
    assert torch.equal(target_mask(output, target), expected)
    assert torch.equal(traced_selection(output, target_indices(target)), expected)


def per_example(target, batch):
    """A target written out as one tuple of indices per example, by hand."""
    if isinstance(target, list):
        return target
    columns = [value.tolist() if isinstance(value, torch.Tensor) else value for value in target]
    return [tuple(column[example] if isinstance(column, list) else column for column in columns)
            for example in range(batch)]


def traced_selection(output, indices):
    """:func:`selection_mask` as a program traces it (comparisons with positions)."""
    return torch.compile(selection_mask, backend="eager", fullgraph=True)(output, indices)


def test_targets_that_select_otherwise_have_no_indices():
    assert target_indices(relprop.Contrastive(1)) is None
    assert target_indices(torch.randn(4, 3)) is None  # an output relevance
    assert target_indices(None) == ()


@pytest.mark.parametrize("target, error, match", [
    ([1.5, 2], TypeError, "must hold integers, got float"),
    ([(0, 1), 2], ValueError, "index different numbers of dimensions"),
    ([], ValueError, "target list is empty"),
    (torch.tensor([[0, 1]]), ValueError, "must be 1-D"),
    ("1", TypeError, "target must be None"),
])
def test_malformed_targets_are_named_when_read(target, error, match):
    """The one reading of a target refuses what it cannot say as indices, for interception and programs alike."""
    with pytest.raises(error, match=match):
        target_indices(target)
    with pytest.raises(error, match=match):
        relprop.LRP(mlp(), "epsilon", compile="aot_eager").attribute(rows(), target=target)


@pytest.mark.parametrize("target, match", [((0, 5), "index 5 on dimension 2 of size 5"),
                                           ((torch.tensor([0, 1]), 1), "2 targets given for a batch of 3"),
                                           ((0, 1, 2), "has 3 indices")])
def test_indices_are_checked_against_the_output(target, match):
    with pytest.raises(ValueError, match=match):
        target_mask(torch.randn(3, 5, 5), target)


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_as_one_program_and_as_a_recorded_pass(preset):
    """The whole attribution, and a reusable recorded pass (a forward program, then backward passes), give
    interception's relevance."""
    model, x = residual(), images()
    reference = interception(model, composite(preset), x, 3)
    lrp = relprop.LRP(model, composite(preset), compile="aot_eager")
    relevance = lrp.attribute(x, target=3)
    assert lrp.compiled.split is None and lrp.compiled.fallback is None
    assert_same(relevance, reference)
    recorded = lrp.record(x, reusable=True)
    assert lrp.compiled.fallback is None
    for _ in range(2):
        (again,) = recorded.relevance(relprop.output_relevance(recorded.logits, 3))
        assert_same(again, reference)


def test_token_ids_as_one_program():
    model = tiny_llama(2)
    ids = torch.randint(3, 50, (2, 7), generator=torch.Generator().manual_seed(1))
    lrp = relprop.LRP(model, "attnlrp", compile="aot_eager")
    for target in [(-1, 5), (-1, [5, 9]), [(-1, 4), (3, 2)]]:
        relevance = lrp.attribute(ids, target=target)
        assert lrp.compiled.split is None and relevance.shape == ids.shape
        assert_same(relevance, interception(model, "attnlrp", ids, target))


def test_other_target_values_compile_nothing():
    model, x = mlp(), rows()
    lrp = relprop.LRP(model, "epsilon", compile="aot_eager")
    reference = relprop.LRP(model, "epsilon")
    for target in (0, 2, -1, [2, 0, 1, 1]):
        assert_same(lrp.attribute(x, target=target), reference.attribute(x, target=target))
    assert lrp.compiled.compilations == 2  # one index for every example, and one per example


def test_a_contrastive_target_runs_as_a_recorded_pass():
    model, x = mlp(), rows()
    lrp = relprop.LRP(model, "epsilon", compile="aot_eager")
    relevance = lrp.attribute(x, target=relprop.Contrastive(1))
    assert lrp.compiled.split.startswith("the target is not indices") and lrp.compiled.fallback is None
    assert_same(relevance, relprop.LRP(model, "epsilon").attribute(x, target=relprop.Contrastive(1)))


def test_a_target_out_of_range_raises_as_under_interception():
    model, x = mlp(), rows()
    lrp = relprop.LRP(model, "epsilon", compile="aot_eager")
    lrp.attribute(x, target=1)
    with pytest.raises(ValueError, match="out of range for the model output of shape"):
        lrp.attribute(x, target=3)
    with pytest.raises(ValueError, match="4 targets given for a batch of 3"):
        lrp.attribute(x[:3], target=[0, 1, 2, 0])


def test_convergence_delta_as_under_interception():
    model, x = mlp(), rows()
    for layer in (model[0], model[2], model[4]):
        nn.init.zeros_(layer.bias)
    lrp = relprop.LRP(model, "epsilon", compile="aot_eager")
    relevance, delta = lrp.attribute(x, target=2, return_convergence_delta=True)
    reference, expected = relprop.LRP(model, "epsilon").attribute(x, target=2, return_convergence_delta=True)
    assert lrp.compiled.split is None
    assert_same(relevance, reference)
    assert torch.allclose(delta, expected, atol=1e-12)
    assert delta.abs().max() < 1e-4 * relevance.abs().sum()  # no bias: relevance is conserved up to epsilon


def test_a_logit_of_zero_warns_that_its_relevance_is_lost():
    model, x = mlp(), rows()
    nn.init.zeros_(model[4].weight)
    nn.init.zeros_(model[4].bias)
    lrp = relprop.LRP(model, "epsilon", compile="aot_eager")
    with pytest.warns(ConservationWarning, match="outputs of value 0"):
        relevance = lrp.attribute(x, target=1)
    assert lrp.compiled.split is None and not relevance.any()


def test_nan_relevance_is_reported_as_the_guard_does():
    model, x = mlp(), rows()
    x[0, 0] = float("nan")
    lrp = relprop.LRP(model, "epsilon", compile="aot_eager", strict=True)
    # the program's relevance is not finite: the call runs again under interception, whose guard names the op
    with pytest.warns(CompileFallbackWarning, match="not finite"), pytest.raises(relprop.UnsupportedOpError,
                                                                                 match="NaN"):
        lrp.attribute(x, target=1)
    assert "not finite" in lrp.compiled.split
    quiet = relprop.LRP(model, "epsilon", compile="aot_eager", guard=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConservationWarning)
        quiet.attribute(x, target=1)


def test_dynamo_settings_are_the_users_after_each_call():
    model, x = mlp(), rows()
    before = torch._dynamo.config.trace_autograd_ops
    relprop.LRP(model, "epsilon", compile="aot_eager").attribute(x, target=1)
    assert torch._dynamo.config.trace_autograd_ops == before


def test_a_model_that_writes_into_its_logits():
    """An op of the model after the op that made its logits (writing into them) is the model's: decided as in a
    recorded pass (which refuses this one: the program falls back), not left out as an op of the seed's."""
    class Doubled(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = mlp()

        def forward(self, x):
            out = self.layers(x)
            out.mul_(2)
            return out

    model, x = Doubled().eval(), rows()
    lrp = relprop.LRP(model, "epsilon", compile="aot_eager")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        relevance = lrp.attribute(x, target=1)
        reference = relprop.LRP(model, "epsilon").attribute(x, target=1)
    assert lrp.compiled.split is not None and "Tensor.mul" in lrp.compiled.fallback
    assert_same(relevance, reference)
