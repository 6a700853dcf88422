"""Transformers as their libraries write them: AttnLRP and CP-LRP on tiny random-weight configs, float64."""
import copy
import math

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
import torchvision  # noqa: E402

import relprop  # noqa: E402

T = transformers
COMMON = dict(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, intermediate_size=32)
CAUSAL = {
    "llama": lambda: (T.LlamaConfig(**COMMON, num_key_value_heads=2), T.LlamaForCausalLM),
    "qwen2": lambda: (T.Qwen2Config(**COMMON, num_key_value_heads=2), T.Qwen2ForCausalLM),
    "mistral": lambda: (T.MistralConfig(**COMMON, num_key_value_heads=2), T.MistralForCausalLM),
    "gemma": lambda: (T.GemmaConfig(**COMMON, num_key_value_heads=2, head_dim=4), T.GemmaForCausalLM),
    "gpt2": lambda: (T.GPT2Config(vocab_size=50, n_embd=16, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0),
                     T.GPT2LMHeadModel),
}
ENCODERS = {
    "bert": lambda: (T.BertConfig(**COMMON), T.BertForSequenceClassification),
    "roberta": lambda: (T.RobertaConfig(**COMMON, pad_token_id=1, bos_token_id=0, eos_token_id=2),
                        T.RobertaForSequenceClassification),
    "distilbert": lambda: (T.DistilBertConfig(vocab_size=50, dim=16, n_layers=2, n_heads=4, hidden_dim=32),
                           T.DistilBertForSequenceClassification),
}
FAMILIES = {**CAUSAL, **ENCODERS}
IDS = torch.randint(3, 50, (2, 7), generator=torch.Generator().manual_seed(1))


def build(name, attention, zero_bias=False):
    config, cls = FAMILIES[name]()
    config._attn_implementation = attention
    torch.manual_seed(0)
    model = cls(config).double().eval()
    if zero_bias:
        for module in model.modules():
            for key, param in module.named_parameters(recurse=False):
                if key == "bias":
                    nn.init.zeros_(param)
    return model


def target_of(name):
    return (-1, 5) if name in CAUSAL else 1


def explained_logit(model, name):
    logits = model(IDS).logits.detach()
    return logits[:, -1, 5] if name in CAUSAL else logits[:, 1]


@pytest.mark.parametrize("preset", ["attnlrp", "cp-lrp"])
@pytest.mark.parametrize("name", FAMILIES)
def test_token_relevance_eager_equals_sdpa(name, preset):
    results = []
    for attention in ("eager", "sdpa"):
        model = build(name, attention)
        lrp = relprop.LRP(model, preset, strict=True)
        relevance = lrp.attribute(IDS, target=target_of(name), additional_forward_args={"attention_mask":
                                                                                          torch.ones_like(IDS)})
        assert relevance.shape == IDS.shape and relevance.dtype == torch.float64
        assert torch.isfinite(relevance).all() and relevance.abs().sum() > 0
        results.append(relevance)
    # Llama-like models compute RMSNorm, RoPE and eager softmax in float32 (docs/design.md, section 5)
    torch.testing.assert_close(results[0], results[1], rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral", "gemma"])
def test_cp_lrp_conserves_on_bias_free_decoders(name, attention):
    model = build(name, attention, zero_bias=True)
    relevance = relprop.LRP(model, "cp-lrp").attribute(IDS, target=target_of(name))
    torch.testing.assert_close(relevance.sum(1), explained_logit(model, name), rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("name", ["llama", "gemma"])
def test_attnlrp_loses_relevance_only_at_the_softmax(name, attention):
    report = relprop.audit(build(name, attention, zero_bias=True), IDS, target=target_of(name), composite="attnlrp")
    at_softmax = sum(row.absorbed for row in report.rows if "softmax" in row.op or "scaled_dot" in row.op)
    elsewhere = [row for row in report.rows if "softmax" not in row.op and "scaled_dot" not in row.op]
    assert not report.unhandled
    # float32 inside these float64 models (RMSNorm, RoPE) limits the match to ~1e-6 relative
    assert report.seed_total - report.input_total == pytest.approx(at_softmax, rel=1e-5, abs=1e-9)
    assert all(abs(row.absorbed) < 1e-6 * abs(report.seed_total) + 1e-9 for row in elsewhere)
    assert abs(at_softmax) > 1e-6  # the softmax does absorb: AttnLRP is not conservative


def llama_layer_reference(layer, x, relevance_out, cos, sin):
    """AttnLRP through one LlamaDecoderLayer, op by op from the formulas (eager, no mask: one full sequence)."""
    def div(a, b):
        return torch.where(b == 0, 0.0, a / torch.where(b == 0, 1.0, b))

    def linear_lrp(inp, weight, out, rel):  # LRP-0, bias-free
        return inp * (div(rel, out) @ weight)

    def rms(module, h):
        variance = h.pow(2).mean(-1, keepdim=True)
        return module.weight * (h * torch.rsqrt(variance + module.variance_epsilon))

    attn, mlp = layer.self_attn, layer.mlp
    heads, kv_heads, dim = attn.config.num_attention_heads, attn.config.num_key_value_heads, attn.head_dim
    n1 = rms(layer.input_layernorm, x)
    q0, k0, v = (n1 @ proj.weight.T for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
    batch, length, _ = x.shape

    def split(t, count):
        return t.reshape(batch, length, count, dim).transpose(1, 2)

    def rotate(t):
        half = t.shape[-1] // 2
        return torch.cat([-t[..., half:], t[..., :half]], -1)

    def unrotate(rel):  # relevance routed back through rotate: out[:h] = -in[h:], out[h:] = in[:h]
        half = rel.shape[-1] // 2
        return torch.cat([rel[..., half:], rel[..., :half]], -1)

    qh0, kh0, vh = split(q0, heads), split(k0, kv_heads), split(v, kv_heads)
    qh, kh = qh0 * cos + rotate(qh0) * sin, kh0 * cos + rotate(kh0) * sin
    groups = heads // kv_heads
    kr, vr = kh.repeat_interleave(groups, 1), vh.repeat_interleave(groups, 1)
    raw = qh @ kr.transpose(-2, -1)
    scores = raw * attn.scaling + torch.full((length, length), -math.inf).triu(1)
    weights = torch.softmax(scores, -1)
    context = weights @ vr
    merged = context.transpose(1, 2).reshape(batch, length, -1)
    o = merged @ attn.o_proj.weight.T
    h = x + o
    n2 = rms(layer.post_attention_layernorm, h)
    gate, up = n2 @ mlp.gate_proj.weight.T, n2 @ mlp.up_proj.weight.T
    act = torch.nn.functional.silu(gate)
    product = act * up
    out = h + product @ mlp.down_proj.weight.T

    # backward, rule by rule
    m = out - h
    r_h, r_m = h * div(relevance_out, out), m * div(relevance_out, out)      # residual sum, proportional
    r_p = linear_lrp(product, mlp.down_proj.weight, m, r_m)                 # down projection
    r_act, r_up = 0.5 * r_p, 0.5 * r_p                                       # uniform product
    r_gate = r_act                                                           # SiLU: identity
    r_n2 = linear_lrp(n2, mlp.gate_proj.weight, gate, r_gate) + linear_lrp(n2, mlp.up_proj.weight, up, r_up)
    r_h = r_h + r_n2                                                         # RMSNorm: statistic constant
    r_x, r_o = x * div(r_h, h), o * div(r_h, h)
    r_merged = linear_lrp(merged, attn.o_proj.weight, o, r_o)
    r_context = r_merged.reshape(batch, length, heads, dim).transpose(1, 2)
    g = div(r_context, context)
    r_weights, r_v = 0.5 * weights * (g @ vr.transpose(-2, -1)), 0.5 * vr * (weights.transpose(-2, -1) @ g)
    r_scores = torch.where(torch.isfinite(scores), scores * (r_weights - weights * r_weights.sum(-1, keepdim=True)), 0.)
    r_raw = r_scores                                                         # scaling and mask: constants
    g_raw = div(r_raw, raw)
    r_q, r_k = 0.5 * qh * (g_raw @ kr), 0.5 * kr * (g_raw.transpose(-2, -1) @ qh)
    r_k = r_k.unflatten(1, (kv_heads, groups)).sum(2)
    r_v = r_v.unflatten(1, (kv_heads, groups)).sum(2)

    def rope_back(rel, t0, t):  # t = t0*cos + rotate(t0)*sin: proportional sum, constants pass
        first, second = t0 * cos, rotate(t0) * sin
        return div(rel, t) * first + unrotate(div(rel, t) * second)

    r_q0 = rope_back(r_q, qh0, qh).transpose(1, 2).reshape(batch, length, -1)
    r_k0 = rope_back(r_k, kh0, kh).transpose(1, 2).reshape(batch, length, -1)
    r_vf = r_v.transpose(1, 2).reshape(batch, length, -1)
    r_n1 = (linear_lrp(n1, attn.q_proj.weight, q0, r_q0) + linear_lrp(n1, attn.k_proj.weight, k0, r_k0)
            + linear_lrp(n1, attn.v_proj.weight, v, r_vf))
    return r_x + r_n1


def test_attnlrp_matches_an_explicit_reference_for_one_llama_block():
    config = T.LlamaConfig(**{**COMMON, "num_hidden_layers": 1}, num_key_value_heads=2)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = T.LlamaForCausalLM(config).double().eval()
    layer = model.model.layers[0]
    lrp = relprop.LayerLRP(model, layer, "attnlrp")
    at_output = lrp.attribute(IDS, target=(-1, 5))
    at_input = lrp.attribute(IDS, target=(-1, 5), attribute_to_layer_input=True)
    hidden = model.model.embed_tokens(IDS).detach()
    positions = torch.arange(IDS.shape[1]).unsqueeze(0)
    cos, sin = model.model.rotary_emb(hidden, positions)
    expected = llama_layer_reference(layer, hidden, at_output, cos.unsqueeze(1), sin.unsqueeze(1))
    torch.testing.assert_close(at_input, expected, rtol=1e-5, atol=1e-8)


def test_contrastive_target_and_several_models_in_one_process():
    llama, bert = build("llama", "sdpa"), build("bert", "eager")
    first = relprop.LRP(llama, "attnlrp").attribute(IDS, target=(-1, 5))
    relprop.LRP(bert, "cp-lrp").attribute(IDS, target=1)
    again = relprop.LRP(llama, "attnlrp").attribute(IDS, target=(-1, 5))
    assert torch.equal(first, again)  # nothing global stays patched
    logits = llama(IDS).logits[:, -1].detach()
    seed = relprop.output_relevance(llama(IDS).logits.detach(), relprop.Contrastive((-1, 5)))
    expected = logits[:, 5] - (logits.sum(1) - logits[:, 5]) / (logits.shape[1] - 1)
    torch.testing.assert_close(seed.flatten(1).sum(1), expected)
    contrast = relprop.LRP(llama, "attnlrp").attribute(IDS, target=relprop.Contrastive((-1, 5)))
    assert not torch.allclose(contrast, first)


def test_inputs_embeds_get_relevance_per_dimension():
    model = build("bert", "sdpa")
    embeds = model.get_input_embeddings()(IDS).detach()
    lrp = relprop.LRP(model, "attnlrp")
    leaf = embeds.clone().requires_grad_()
    with lrp.context():
        out = model(inputs_embeds=leaf).logits
    (per_dim,) = torch.autograd.grad(out, leaf, relprop.output_relevance(out, 1))
    by_ids = lrp.attribute(IDS, target=1)
    # the same relevance, per token once summed over the hidden dimension
    torch.testing.assert_close(per_dim.sum(-1), by_ids, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("preset", ["attnlrp", "cp-lrp"])
def test_vision_transformers(preset):
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    torch.manual_seed(0)
    tv = torchvision.models.vit_b_16(image_size=32, num_classes=5).double().eval()
    nn.init.normal_(tv.heads.head.weight)  # torchvision starts the head at zero
    config = T.ViTConfig(image_size=32, patch_size=8, num_hidden_layers=2, num_attention_heads=2, hidden_size=16,
                         intermediate_size=32, num_labels=5)
    results = []
    for attention in ("eager", "sdpa"):
        config._attn_implementation = attention
        torch.manual_seed(0)
        results.append(relprop.LRP(T.ViTForImageClassification(config).double().eval(), preset,
                                   strict=True).attribute(x, target=1))
    # HF's eager and fused ViT attention differ by ~1e-10 already in their outputs
    torch.testing.assert_close(results[0], results[1], rtol=1e-6, atol=1e-6 * results[1].abs().max().item())
    relevance = relprop.LRP(tv, preset, strict=True).attribute(x, target=1)
    assert relevance.shape == x.shape and torch.isfinite(relevance).all() and relevance.abs().sum() > 0
    # the MultiheadAttention output under attribution is bitwise the plain one
    plain = tv(x)
    with relprop.LRP(tv, preset).context():
        assert torch.equal(tv(x.clone().requires_grad_()), plain)
    if preset == "cp-lrp":  # bias-free: CP-LRP conserves through nn.MultiheadAttention too
        bias_free = copy.deepcopy(tv)
        for module in bias_free.modules():
            for key, param in module.named_parameters(recurse=False):
                if "bias" in key:
                    nn.init.zeros_(param)
        nn.init.zeros_(bias_free.encoder.pos_embedding)
        relevance = relprop.LRP(bias_free, preset).attribute(x, target=1)
        torch.testing.assert_close(relevance.sum((1, 2, 3)), bias_free(x)[:, 1].detach(), rtol=1e-8, atol=1e-10)


def test_activation_written_as_several_ops_is_one_identity_op():
    report = relprop.audit(build("gpt2", "eager"), IDS, target=(-1, 5), composite="attnlrp")
    activation_rows = [row for row in report.rows if ".mlp.act" in row.module]
    assert [row.op for row in activation_rows] == ["NewGELUActivation"] * 2
    assert all(row.rule == "Pass()" and row.absorbed == 0 for row in activation_rows)


def test_forward_output_is_bitwise_the_plain_one():
    for name in ("llama", "gpt2", "bert"):
        model = build(name, "sdpa")
        plain = model(IDS).logits
        assert torch.equal(relprop.LRP(model, "attnlrp").record(IDS).logits, plain), name
