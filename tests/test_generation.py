"""explain_generation: one forward pass over a generation, one seed per generated token, each row a fresh attribution."""
from __future__ import annotations

import pytest
import torch

import relprop

transformers = pytest.importorskip("transformers")


def _llama(attention: str = "eager") -> torch.nn.Module:
    config = transformers.LlamaConfig(vocab_size=60, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=32, pad_token_id=0, eos_token_id=1)
    config._attn_implementation = attention
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).double().eval()


PROMPT = torch.tensor([[5, 17, 23, 9, 41, 12]])


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_each_row_equals_an_attribution_of_the_sequence_cut_there(attention):
    model = _llama(attention)
    found = relprop.explain_generation(model, PROMPT, max_new_tokens=4)
    T, G = PROMPT.shape[1], 4
    assert found.sequences.shape == (1, T + G) and found.relevance.shape == (1, G, T + G)
    assert torch.equal(found.sequences[:, :T], PROMPT)
    for g in range(G):
        expected = relprop.LRP(model, "attnlrp").attribute(found.sequences[:, :T + g],
                                                           target=(-1, found.sequences[:, T + g]))
        # eager attention takes its softmax in float32 (Hugging Face casts back): the two passes round it at other
        # lengths, which moves a float64 relevance by about 1e-9 of its size
        bound = 1e-7 if attention == "eager" else 1e-10
        torch.testing.assert_close(found.relevance[0, g, :T + g], expected[0], rtol=bound, atol=bound * 1e-2)
        assert not found.relevance[0, g, T + g:].any()  # nothing from the predicting position's successor on
        assert found.relevance[0, g, :T + g].abs().sum() > 0


def test_the_generation_is_greedy_decoding():
    model = _llama()
    found = relprop.explain_generation(model, PROMPT, max_new_tokens=5)
    expected = model.generate(PROMPT, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(found.sequences, expected)


def test_a_continuation_equal_to_the_generation_gives_the_same_relevance():
    model = _llama()
    generated = relprop.explain_generation(model, PROMPT, max_new_tokens=3)
    forced = relprop.explain_generation(model, PROMPT, continuation=generated.generated)
    assert torch.equal(forced.sequences, generated.sequences)
    torch.testing.assert_close(forced.relevance, generated.relevance, rtol=0, atol=0)
    with pytest.raises(ValueError, match="continuation is explained as given"):
        relprop.explain_generation(model, PROMPT, continuation=generated.generated, max_new_tokens=2)


def test_left_padded_prompts_of_different_lengths_equal_each_prompt_alone():
    model = _llama("sdpa")  # transformers' eager attention gives NaN logits on left padding in float64
    short = torch.tensor([[8, 30, 14]])
    batch = torch.cat([PROMPT, torch.cat([torch.zeros(1, 3, dtype=torch.long), short], 1)])
    mask = torch.ones_like(batch)
    mask[1, :3] = 0
    found = relprop.explain_generation(model, batch, continuation=torch.tensor([[7, 2, 33], [19, 44, 3]]),
                                       attention_mask=mask)
    for index, prompt, pad in ((0, PROMPT, 0), (1, short, 3)):
        alone = relprop.explain_generation(model, prompt, continuation=found.generated[index:index + 1])
        torch.testing.assert_close(found.relevance[index, :, pad:], alone.relevance[0], rtol=1e-9, atol=1e-11)
        assert not found.relevance[index, :, :pad].any()  # padding takes no relevance


def test_the_page_works_offline_and_names_every_token():
    class Letters:  # a tokenizer of one letter per id
        def convert_ids_to_tokens(self, ids):
            return [chr(97 + i % 26) for i in ids]

        def convert_tokens_to_string(self, tokens):
            return "".join(tokens)

    found = relprop.explain_generation(_llama(), PROMPT, max_new_tokens=2, tokenizer=Letters())
    page = found.html()
    assert "http" not in page and "<script src" not in page  # nothing fetched from elsewhere
    assert page.count('class="t') == PROMPT.shape[1] + 2 and page.count('class="t gen"') == 2
    assert found.tokens == [[chr(97 + i % 26) for i in found.sequences[0].tolist()]]


def test_each_row_is_shown_on_the_scale_of_its_context_between_the_first_and_the_predicting_token():
    sequences = torch.tensor([[0, 5, 6, 7, 8, 9]])
    relevance = torch.tensor([[[9.0, -2.0, 1.0, 7.0, 0.0, 0.0],  # context 0..3: 3 predicts, 1..2 between
                               [9.0, 1.0, -3.0, 0.5, 8.0, 0.0],  # context 0..4
                               [9.0, 0.0, 0.0, 0.0, 0.0, 4.0]]])  # nothing between: the whole context's
    found = relprop.Generation(sequences, relevance, 3, torch.ones(1, 6, dtype=torch.long))
    assert found.scales().tolist() == [2.0, 3.0, 9.0]
    page = found.html()
    assert '"scales": [2.0, 3.0, 9.0]' in page
