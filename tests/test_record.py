"""Many seeds from one forward pass: a reusable recorded pass gives, per seed, a fresh attribution's relevance."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import relprop

torchvision = pytest.importorskip("torchvision")


def _resnet() -> tuple[nn.Module, torch.Tensor]:
    """ResNet18 in float64: residual `+=`, in-place ReLUs and BatchNorms merged into convolutions."""
    torch.manual_seed(0)
    return torchvision.models.resnet18(weights=None).double().eval(), torch.randn(2, 3, 48, 48, dtype=torch.double)


@pytest.mark.parametrize("preset", ["epsilon", "epsilon-plus-flat", "epsilon-alpha2-beta1", "epsilon-gamma-box"])
def test_every_seed_of_a_reusable_pass_equals_a_fresh_attribution(preset):
    model, x = _resnet()
    composite = relprop.composites.EpsilonGammaBox(low=-3.0, high=3.0) if preset == "epsilon-gamma-box" else preset
    explained = relprop.LRP(model, composite).record(x)
    for target in (3, 7, 3):  # a class again after another: nothing of the first pass was consumed
        (relevance,) = explained.relevance(relprop.output_relevance(explained.logits, target))
        assert torch.equal(relevance, relprop.LRP(model, composite).attribute(x, target=target))


def test_a_batch_of_seeds_equals_one_seed_at_a_time():
    model, x = _resnet()
    explained = relprop.LRP(model, "epsilon-plus").record(x)
    seeds = torch.stack([relprop.output_relevance(explained.logits, t) for t in (0, 5, 9)])
    (relevance,) = explained.relevances(seeds)
    assert relevance.shape == (3, *x.shape)
    for k, seed in enumerate(seeds):
        assert torch.equal(relevance[k], explained.relevance(seed)[0])
    with pytest.raises(ValueError, match="do not stack seeds"):
        explained.relevances(seeds[0])


def test_a_pass_recorded_for_one_seed_refuses_a_second():
    model, x = _resnet()
    explained = relprop.LRP(model, "epsilon").record(x, reusable=False)
    seed = relprop.output_relevance(explained.logits, 1)
    explained.relevance(seed)
    with pytest.raises(RuntimeError, match="reusable=True"):
        explained.relevance(seed)
    with pytest.raises(RuntimeError, match="reusable=True"):
        explained.relevances(seed[None])


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_every_next_token_of_a_llama_from_one_forward_pass(attention):
    """AttnLRP of the logits at several positions (a generation's tokens), from one recorded pass."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=32)
    config._attn_implementation = attention
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).double().eval()
    ids = torch.randint(3, 50, (1, 9), generator=torch.Generator().manual_seed(1))
    explained = relprop.LRP(model, "attnlrp").record(ids)
    for position, token in ((8, 4), (5, 11), (8, 4)):
        (relevance,) = explained.relevance(relprop.output_relevance(explained.logits, (position, token)))
        fresh = relprop.LRP(model, "attnlrp").attribute(ids, target=(position, token))
        torch.testing.assert_close(relevance, fresh, rtol=1e-12, atol=1e-14)


class SquashActivation(nn.Module):
    """An activation module of another library (by its name): run as one op, its output made by the module."""

    def forward(self, x):
        return x * torch.sigmoid(x)


@pytest.mark.parametrize("reusable", [True, False])
def test_a_recorded_pass_is_freed_with_its_last_reference(reusable):
    """Nothing of the pass outlives it, also with an activation module's op (no cycle through the graph)."""
    import gc

    def op_calls() -> int:
        gc.collect()
        # type() rather than isinstance(): the latter reads attributes of every object, deprecated ones too
        return sum(issubclass(type(o), relprop.engine.OpCall) for o in gc.get_objects())

    model = nn.Sequential(nn.Linear(4, 8), SquashActivation(), nn.Linear(8, 3)).eval()
    before = op_calls()
    explained = relprop.LRP(model, "attnlrp").record(torch.randn(5, 4), reusable=reusable)
    assert op_calls() > before
    explained.relevance(relprop.output_relevance(explained.logits, 1))
    del explained
    assert op_calls() == before


def test_a_rule_that_cannot_be_differentiated_says_so_with_its_op():
    """A backward pass taken with create_graph=True records the rules; one that writes into tensors autograd needs
    (the relevance form's ``out=`` arithmetic) is named, with its op and module."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).eval()
    x = torch.rand(2, 4).requires_grad_()
    with relprop.LRP(model, "epsilon").context():
        out = model(x)
    seed = (out.detach() * torch.tensor([1.0, 0.0, 0.0])).requires_grad_()
    with pytest.raises(RuntimeError, match=r"rule Epsilon.* on torch.nn.functional.linear in module '2' cannot be "
                                           r"differentiated \(the backward pass runs with create_graph=True\)"):
        torch.autograd.grad(out, x, seed, create_graph=True)
