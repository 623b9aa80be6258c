"""paged_attention/modeling/tiny.py: the tiny random Llama and its byte tokenizer (``--model
tiny``)."""

import torch

from paged_attention.modeling.tiny import (
    BYTE_TOKENIZER_SPECIAL_TOKENS,
    TINY_LLAMA,
    byte_tokenizer,
    tiny_chat_model,
    tiny_llama,
)


def test_the_byte_tokenizer_spells_bytes_and_round_trips_any_text():
    tokenizer = byte_tokenizer()
    text = "héllo, wörld ✓\n"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids == list(text.encode("utf-8"))
    assert tokenizer.decode(ids) == text
    specials = tokenizer.convert_tokens_to_ids(list(BYTE_TOKENIZER_SPECIAL_TOKENS))
    assert specials == [256, 257, 258] and tokenizer.eos_token_id == 258


def test_the_tiny_llama_is_drawn_from_its_seed_and_leaves_the_random_state():
    state = torch.random.get_rng_state()
    first, again, other = tiny_llama(3), tiny_llama(3), tiny_llama(4)
    assert torch.equal(torch.random.get_rng_state(), state)
    weight = "model.embed_tokens.weight"
    assert torch.equal(first.state_dict()[weight], again.state_dict()[weight])
    assert not torch.equal(first.state_dict()[weight], other.state_dict()[weight])
    assert first.config.num_hidden_layers == TINY_LLAMA["num_hidden_layers"] and not first.training


def test_the_tiny_chat_model_fits_its_tokenizer():
    model, tokenizer = tiny_chat_model()
    assert model.config.vocab_size == len(tokenizer) == 259
    assert model.config.eos_token_id == tokenizer.eos_token_id
