"""The compiled tier (``LRP(..., compile=...)``): each change either recompiles or falls back, and then the
relevance is interception's (float64: 1e-12 of the largest entry). Tiny models, compiled by AOT autograd without
code generation (``"aot_eager"``) but once by Inductor."""
import os
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import relprop
from relprop.methods.compiled import CompileFallbackWarning
from relprop.workflows.generation import _explainer as generation_explainer

FLAG = [False]


class Net(nn.Module):
    """Convolutions, in-place ReLU, max pooling, a dense head; branches on a global flag or on the data."""

    def __init__(self, branch: str = "") -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.conv2 = nn.Conv2d(4, 6, 3, padding=1)
        self.fc = nn.Linear(6 * 3 * 3, 5)
        self.branch = branch

    def forward(self, x):
        h = F.relu(self.conv(x), inplace=True)
        if self.branch == "flag" and FLAG[0]:
            h = h * 2
        if self.branch == "data" and x.sum() > 0:
            h = h + 1
        if self.branch == "break":
            torch._dynamo.graph_break()
        h = F.max_pool2d(torch.relu(self.conv2(h)), 2)
        return self.fc(h.flatten(1))


class Block(nn.Module):
    """A float64 transformer block: fused attention, a gated MLP with SiLU, a residual sum."""

    def __init__(self, width: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)
        self.gate, self.up, self.down = nn.Linear(width, 16), nn.Linear(width, 16), nn.Linear(16, width)
        self.head = nn.Linear(width, 3)
        self.heads = heads

    def forward(self, x):
        b, t, w = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, w)
        h = x + self.out(a)
        h = h + self.down(F.silu(self.gate(h)) * self.up(h))
        return self.head(h[:, -1])


PRESETS = ["epsilon", "epsilon-plus", "epsilon-plus-flat", "epsilon-alpha2-beta1", "epsilon-alpha2-beta1-flat",
           "epsilon-gamma-box", "attnlrp", "cp-lrp"]


def composite(preset):
    if preset == "epsilon-gamma-box":  # the input bounds of standardised images
        return relprop.composites.EpsilonGammaBox(low=-3.0, high=3.0)
    return preset


class Residual(nn.Module):
    """A ResNet's parts: a stem whose BatchNorm merges into it, in-place ReLUs, max pooling, a residual block
    with a strided downsampling branch, an in-place Hardswish (its form runs out of place), average pooling and a
    dense head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
                                  nn.MaxPool2d(2))
        self.branch = nn.Sequential(nn.Conv2d(8, 8, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(8),
                                    nn.ReLU(inplace=True), nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8))
        self.down = nn.Sequential(nn.Conv2d(8, 8, 1, stride=2, bias=False), nn.BatchNorm2d(8))
        self.fc = nn.Linear(8, 5)
        self.act = nn.Hardswish(inplace=True)

    def forward(self, x):
        h = self.stem(x)
        h = self.act(self.branch(h) + self.down(h))
        return self.fc(F.adaptive_avg_pool2d(h, 1).flatten(1))


def residual():
    torch.manual_seed(0)
    model = Residual().double().eval()
    for module in model.modules():  # BatchNorm statistics of a trained network, not the identity
        if isinstance(module, nn.BatchNorm2d):
            nn.init.uniform_(module.weight, 0.5, 1.5)
            nn.init.uniform_(module.bias, -0.1, 0.1)
            module.running_mean.uniform_(-0.1, 0.1)
            module.running_var.uniform_(0.5, 1.5)
    return model


def images(n=2, size=8):
    return torch.randn(n, 3, size, size, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def net(branch=""):
    torch.manual_seed(0)
    return Net(branch).double().eval()


def assert_same(relevance, reference, bound=1e-12):
    scale = reference.abs().max()
    assert scale > 0
    assert (relevance - reference).abs().max() <= bound * scale


def interception(model, composite, x, target):
    return relprop.LRP(model, composite).attribute(x, target=target)


def compiled(model, composite="epsilon"):
    return relprop.LRP(model, composite, compile="aot_eager")


@pytest.mark.parametrize("preset", ["epsilon", "attnlrp", "cp-lrp"])
def test_cnn_equals_interception(preset):
    model, x = net(), images()
    lrp = compiled(model, preset)
    for _ in range(2):
        relevance = lrp.attribute(x, target=3)
        assert lrp.compiled.fallback is None
        assert_same(relevance, interception(model, preset, x, 3))
    assert lrp.compiled.compilations == 1


@pytest.mark.parametrize("preset", ["epsilon", "attnlrp", "cp-lrp", "relp", "relp-ah"])
def test_block_equals_interception(preset):
    """RelP's Identity-rule on the SiLU compiles too: its gradient form is stated as a stabilised ratio."""
    torch.manual_seed(0)
    model = Block().double().eval()
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    lrp = compiled(model, preset)
    relevance = lrp.attribute(x, target=1)
    assert lrp.compiled.fallback is None
    assert_same(relevance, interception(model, preset, x, 1))


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_on_a_residual_network(preset):
    """BatchNorm merged into its layer, z+, alpha-beta and gamma as modified products, Flat and ZBox on the first
    layer through the input's probe: interception's relevance."""
    model, x = residual(), images()
    lrp = compiled(model, composite(preset))
    relevance = lrp.attribute(x, target=3)
    assert lrp.compiled.fallback is None
    assert_same(relevance, interception(model, composite(preset), x, 3))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["resnet18", "vgg11", "mobilenet_v3_small", "densenet121", "vit_b_16",
                                  "llama-sdpa", "bert-sdpa"])
def test_compare_main_models(name):
    """Every preset on benchmarks/compare_main.py's models (small images): interception's relevance, or a fallback
    that says why.

    CI compiles only the tiny transformers: each torchvision model compiles for minutes per preset on two cores.
    ``RELPROP_COMPILE_ALL=1`` runs them too.
    """
    if "-" not in name and not os.environ.get("RELPROP_COMPILE_ALL"):
        pytest.skip("compiles for minutes on two cores: set RELPROP_COMPILE_ALL=1 to run it")
    torchvision = pytest.importorskip("torchvision")
    if "-" in name:
        transformers = pytest.importorskip("transformers")
        common = dict(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, intermediate_size=32)
        family, attention = name.split("-")
        config, cls, target = ((transformers.LlamaConfig(**common, num_key_value_heads=2),
                                transformers.LlamaForCausalLM, (-1, 5)) if family == "llama" else
                               (transformers.BertConfig(**common), transformers.BertForSequenceClassification, 1))
        config._attn_implementation = attention
        torch.manual_seed(0)
        model = cls(config).double().eval()
        inputs = torch.randint(3, 50, (2, 7), generator=torch.Generator().manual_seed(1))
        bound = 1e-6  # Llama's RMSNorm and rotary embedding compute in float32 (docs/design.md, section 5)
    else:
        torch.manual_seed(0)
        model = getattr(torchvision.models, name)(weights=None, num_classes=10).double().eval()
        inputs, target, bound = images(2, 224 if name == "vit_b_16" else 32), 3, 1e-12
        for module in model.modules():  # ViT's head starts at zero
            if isinstance(module, nn.Linear) and not module.weight.any():
                nn.init.normal_(module.weight, std=0.02)
    for preset in PRESETS:
        lrp = compiled(model, composite(preset))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CompileFallbackWarning)
            relevance = lrp.attribute(inputs, target=target)
        assert_same(relevance, interception(model, composite(preset), inputs, target), bound=bound)


def tiny_llama(layers):
    """A float64 Llama with grouped-query heads and SDPA attention."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=50, hidden_size=16, num_hidden_layers=layers, num_attention_heads=4,
                                      intermediate_size=32, num_key_value_heads=2)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).double().eval()


@pytest.mark.parametrize("preset", ["relp", "relp-ah"])
def test_relp_compiles_a_llama(preset):
    """RelP (the Identity-rule on RMSNorm's square and on transformers' SiLU module, whose func_map names the
    attention's matmul alone) and its AH-rule, as one program."""
    model = tiny_llama(2)
    ids = torch.randint(3, 50, (2, 7), generator=torch.Generator().manual_seed(1))
    lrp = compiled(model, preset)
    relevance = lrp.attribute(ids, target=(-1, 4))
    assert lrp.compiled.fallback is None
    assert_same(relevance, interception(model, preset, ids, (-1, 4)), bound=1e-6)  # RMSNorm in float32


class SiLUActivation(nn.Module):
    """An activation module of another library (by its name), as transformers writes it: one op."""

    def forward(self, x):
        return F.silu(x)


@pytest.mark.parametrize("entry, compiles", [(F.silu, False), (torch.matmul, True)], ids=["silu", "matmul"])
def test_an_activation_module_compiles_unless_the_func_map_names_its_function(entry, compiles):
    """Interception explains the module as one op on its output, which no func_map entry matches; in a program
    its one op would take an entry that names its function."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), SiLUActivation(), nn.Linear(8, 3)).double().eval()
    x = torch.randn(4, 6, dtype=torch.float64)
    composite = relprop.composites.get("attnlrp", func_map={entry: relprop.rules.PlainGradient()})
    lrp = compiled(model, composite)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CompileFallbackWarning)
        relevance = lrp.attribute(x, target=1)
    assert (lrp.compiled.fallback is None) is compiles
    assert compiles or "the func_map names its function" in str(caught[0].message)
    assert_same(relevance, interception(model, composite, x, 1))


def test_generation_does_not_recompile_for_another_prompt_length():
    model = tiny_llama(1)
    lrp = compiled(model, "attnlrp")
    compilations = []
    for length in (5, 6, 9):  # by the second length its dimension is dynamic: the third reuses that graph
        ids = torch.randint(3, 50, (1, length), generator=torch.Generator().manual_seed(length))
        relevance = lrp.attribute(ids, target=(-1, 5))
        assert lrp.compiled.fallback is None
        assert_same(relevance, interception(model, "attnlrp", ids, (-1, 5)))
        compilations.append(lrp.compiled.compilations)
    assert compilations[1] == compilations[2] <= 2
    # a generation marks its sequence dimension dynamic: a second prompt of another length compiles nothing
    explainers = []
    for length in (5, 7):
        ids = torch.randint(3, 50, (1, length), generator=torch.Generator().manual_seed(length))
        generation = relprop.explain_generation(model, ids, max_new_tokens=2, compile="aot_eager")
        reference = relprop.explain_generation(model, ids, max_new_tokens=2)
        assert torch.equal(generation.sequences, reference.sequences)
        assert_same(generation.relevance, reference.relevance)
        explainers.append(generation_explainer(model, "attnlrp", "aot_eager").compiled)
    assert explainers[0] is explainers[1] and explainers[1].compilations == 1 and explainers[1].fallback is None


@pytest.mark.slow
def test_inductor_equals_interception():
    """Inductor's kernels: 1e-12 of the largest entry in float64; in float32 its fused and reordered sums keep
    to 1e-5 (the bound docs/design.md, section 9, states)."""
    model, x = residual(), images()
    lrp = relprop.LRP(model, "epsilon-plus-flat", compile=True)
    assert_same(lrp.attribute(x, target=2), interception(model, "epsilon-plus-flat", x, 2))
    assert lrp.compiled.fallback is None
    model, x = model.float(), x.float()
    assert_same(lrp.attribute(x, target=2), interception(model, "epsilon-plus-flat", x, 2), bound=1e-5)
    assert lrp.compiled.fallback is None


def test_float32_bound():
    """In float32 Inductor's reordered sums and AOT's decompositions keep to 1e-5 of the largest entry."""
    model, x = net().float(), images().float()
    lrp = compiled(model)
    assert_same(lrp.attribute(x, target=2), interception(model, "epsilon", x, 2), bound=1e-5)


def test_token_relevance_of_a_tiny_llama():
    model = tiny_llama(2)
    ids = torch.randint(3, 50, (2, 7), generator=torch.Generator().manual_seed(1))
    for preset in ("attnlrp", "cp-lrp"):
        lrp = compiled(model, preset)
        relevance = lrp.attribute(ids, target=(-1, 5))
        assert lrp.compiled.fallback is None and relevance.shape == ids.shape
        assert_same(relevance, interception(model, preset, ids, (-1, 5)))


def attribute_twice_then(lrp, change, x, target=3):
    """One call, ``change()``, one more call: the relevance after the change, and the compilations."""
    lrp.attribute(x, target=target)
    change()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CompileFallbackWarning)
        return lrp.attribute(x, target=target), lrp.compiled.compilations


def test_module_rule_set_after_the_first_call_recompiles():
    model, x = net(), images()
    lrp = compiled(model)
    rule = relprop.rules.Epsilon(0.5)
    relevance, compilations = attribute_twice_then(lrp, lambda: setattr(model.fc, "rule", rule), x)
    assert compilations == 2
    assert_same(relevance, interception(model, "epsilon", x, 3))


def test_composite_parameter_changed_recompiles():
    model, x = net(), images()
    lrp = compiled(model)
    relevance, compilations = attribute_twice_then(lrp, lambda: setattr(lrp.composite.dense, "epsilon", 0.3), x)
    assert compilations == 2
    assert_same(relevance, relprop.LRP(model, lrp.composite).attribute(x, target=3))


@pytest.mark.parametrize("change", ["replaced", "data replaced", "in place", "in place through data"])
def test_parameters_changed(change):
    model, x = net(), images()
    lrp = compiled(model)

    def apply():
        if change == "replaced":
            model.fc.weight = nn.Parameter(torch.randn_like(model.fc.weight))
        elif change == "data replaced":
            model.conv.weight.data = torch.randn_like(model.conv.weight)
        elif change == "in place":
            with torch.no_grad():
                model.conv.weight.mul_(-2)
        else:
            model.fc.weight.data.mul_(3)
    relevance, _ = attribute_twice_then(lrp, apply, x)
    assert lrp.compiled.fallback is None
    assert_same(relevance, interception(model, "epsilon", x, 3))


def test_submodule_swapped():
    model, x = net(), images()
    lrp = compiled(model)
    swapped = nn.Conv2d(4, 6, 3, padding=1).double().eval()
    relevance, compilations = attribute_twice_then(lrp, lambda: setattr(model, "conv2", swapped), x)
    assert compilations == 2
    assert_same(relevance, interception(model, "epsilon", x, 3))


def test_forward_hook_added():
    model, x = net(), images()
    lrp = compiled(model)
    relevance, _ = attribute_twice_then(lrp, lambda: model.conv2.register_forward_hook(lambda m, i, o: o * 0.5), x)
    assert_same(relevance, interception(model, "epsilon", x, 3))


def test_new_input_shape_and_dtype():
    model, x = net(), images()
    lrp = compiled(model)
    lrp.attribute(x, target=3)
    wider = images(3)
    assert_same(lrp.attribute(wider, target=3), interception(model, "epsilon", wider, 3))
    model.float()
    assert_same(lrp.attribute(x.float(), target=3), interception(model, "epsilon", x.float(), 3), bound=1e-5)
    assert lrp.compiled.fallback is None


def test_train_mode_is_explained_in_eval_mode():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.5), nn.ReLU(), nn.Linear(8, 3)).double()
    x = torch.randn(4, 6, dtype=torch.float64)
    lrp = compiled(model)
    with pytest.warns(UserWarning, match="training mode"):
        relevance = lrp.attribute(x, target=1)
    assert model.training
    with pytest.warns(UserWarning, match="training mode"):
        assert_same(relevance, interception(model, "epsilon", x, 1))


def test_global_flag_recompiles():
    model, x = net("flag"), images()
    lrp = compiled(model)
    try:
        relevance, compilations = attribute_twice_then(lrp, lambda: FLAG.__setitem__(0, True), x)
        assert compilations == 2
        assert_same(relevance, interception(model, "epsilon", x, 3))
    finally:
        FLAG[0] = False


@pytest.mark.parametrize("branch", ["data", "break"])
def test_graph_break_falls_back_with_one_warning(branch):
    model, x = net(branch), images()
    lrp = compiled(model)
    with pytest.warns(CompileFallbackWarning, match="compile=True fell back"):
        relevance = lrp.attribute(x, target=3)
    assert lrp.compiled.fallback is not None
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompileFallbackWarning)  # said once
        lrp.attribute(x, target=3)
    assert_same(relevance, interception(model, "epsilon", x, 3))


def test_rule_without_a_traceable_form_falls_back():
    """Epsilon with zero_bias and a stabiliser reads the bias term, which its traced form does not take."""
    model, x = net(), images()
    model.fc.rule = relprop.rules.Epsilon(1e-3, zero_bias=True)
    lrp = compiled(model)
    with pytest.warns(CompileFallbackWarning, match="no traceable gradient form"):
        relevance = lrp.attribute(x, target=3)
    assert_same(relevance, interception(model, "epsilon", x, 3))


def test_autocast():
    model, x = net().float(), images().float()
    lrp = compiled(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CompileFallbackWarning)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            relevance = lrp.attribute(x, target=3)
            reference = interception(model, "epsilon", x, 3)
    # bfloat16 has 8 bits of mantissa: the two round the same products in other orders
    assert_same(relevance, reference, bound=5e-2)


def test_explain_dataset_compiled_equals_eager(tmp_path):
    from relprop.workflows.dataset import load_shard

    model = residual()
    data = torch.utils.data.TensorDataset(torch.randn(10, 3, 8, 8, dtype=torch.float64,
                                                      generator=torch.Generator().manual_seed(2)))
    shards = []
    for name, compile in (("eager", False), ("compiled", "aot_eager")):
        relprop.explain_dataset(model, data, tmp_path / name, "epsilon-plus-flat", batch_size=4, shard_size=4,
                                progress=False, compile=compile)
        shards.append(sorted((tmp_path / name).glob("shard-*.safetensors")))
    assert len(shards[0]) == len(shards[1]) == 3
    for eager, compiled_shard in zip(*shards):
        assert_same(load_shard(compiled_shard)["relevance"], load_shard(eager)["relevance"])
