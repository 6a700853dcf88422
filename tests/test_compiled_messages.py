"""What the compiled tier says: each compilation with its reason and time, and fallbacks that name the op, its
module path and the user's line. AOT autograd without code generation (``"aot_eager"``)."""
import logging
import warnings

import pytest
import torch
from torch import nn

import relprop
from relprop.methods.compiled import CompileFallbackWarning

transformers = pytest.importorskip("transformers")


class Net(nn.Module):
    def __init__(self, branch=False):
        super().__init__()
        self.first, self.second = nn.Linear(6, 8), nn.Linear(8, 3)
        self.branch = branch

    def forward(self, x):
        h = torch.relu(self.first(x))
        if self.branch and h.sum() > 0:  # a branch on the data: Dynamo cannot trace it whole
            h = h * 2
        return self.second(h)


def net(branch=False):
    torch.manual_seed(0)
    return Net(branch).double().eval()


def rows(batch=4):
    return torch.randn(batch, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(batch))


def messages(caplog):
    return [record.getMessage() for record in caplog.records if record.name == "relprop"]


def test_each_compilation_is_logged_with_its_reason_and_time(caplog):
    model = net()
    lrp = relprop.LRP(model, "epsilon", compile="aot_eager")
    with caplog.at_level(logging.INFO, logger="relprop"):
        lrp.attribute(rows(), target=1)
        first = messages(caplog)
        caplog.clear()
        lrp.attribute(rows(), target=2)  # another class: an index tensor of the same shape compiles nothing
        assert messages(caplog) == []
        lrp.attribute(rows(5), target=1)
        batch = messages(caplog)
        caplog.clear()
        model.second.rule = relprop.rules.ZPlus()
        lrp.attribute(rows(5), target=1)
        rule = messages(caplog)
    assert first[0] == ("relprop: compiling the whole attribution of Net under Epsilon with aot_eager: the first "
                        "call")
    assert first[1].startswith("relprop: compiled the whole attribution of Net") and first[1].endswith(" s")
    assert "a new input signature: an input of shape (5, 6) (compiled for (4, 6))" in batch[0]
    assert "a module, its rule or its hooks changed since it last compiled" in rule[0]


def test_ten_prompt_lengths_compile_at_most_twice():
    config = transformers.LlamaConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=32)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).double().eval()
    lrp = relprop.LRP(model, "attnlrp", compile="aot_eager")
    for length in (8, 12, 20, 16, 33, 5, 9, 27, 14, 40):
        ids = torch.randint(3, 50, (1, length), generator=torch.Generator().manual_seed(length))
        lrp.attribute(ids, target=(-1, 4))
        assert lrp.compiled.fallback is None
    assert lrp.compiled.compilations <= 2


def test_a_graph_break_names_the_users_line():
    lrp = relprop.LRP(net(branch=True), "epsilon", compile="aot_eager")
    with pytest.warns(CompileFallbackWarning) as caught:
        lrp.attribute(rows(), target=1)
    line = Net.forward.__code__.co_firstlineno + 2  # the branch on the data
    assert f"{__file__}:{line}" in str(caught[0].message)


class Custom(nn.Module):
    def __init__(self):
        super().__init__()
        self.dense = nn.Linear(6, 3)

    def forward(self, x):
        return torch.nn.functional.linear(x, self.dense.weight, self.dense.bias)  # the op without a form


def test_an_op_without_a_form_names_op_module_and_line():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), Custom()).double().eval()
    model[1].rule = relprop.rules.Epsilon(1e-3, zero_bias=True)  # no traceable gradient form
    lrp = relprop.LRP(model, "epsilon", compile="aot_eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lrp.attribute(rows(), target=1)
    text = " ".join(str(w.message) for w in caught if w.category is CompileFallbackWarning)
    line = Custom.forward.__code__.co_firstlineno + 1
    assert "linear" in text and "'1'" in text and f"{__file__}:{line}" in text
