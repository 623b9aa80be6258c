"""The tiny random Llama with its byte-level tokenizer: ``--model tiny`` of the command line and
the model the tests and the benchmarks run (text and chat through random weights)."""

from __future__ import annotations

import torch

TINY_LLAMA = dict(
    vocab_size=1000,
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
"""The config of the tiny Llama (2 layers, hidden 256, 8 query heads and 2 KV heads of size 32);
tests and benchmarks derive theirs from it."""

BYTE_TOKENIZER_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
"""Token ids 256, 257 and 258 of :func:`byte_tokenizer`, after the 256 bytes."""

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""The ChatML chat template (the format of SmolLM2's and Qwen2's templates)."""


def tiny_llama_config(**overrides) -> dict:
    """``LlamaConfig`` keyword arguments: :data:`TINY_LLAMA` with ``overrides``."""
    return {**TINY_LLAMA, **overrides}


def tiny_llama(seed: int = 0, **overrides) -> torch.nn.Module:
    """The tiny Llama (``tiny_llama_config(**overrides)``) with random weights drawn from
    ``seed``, in eval mode; the global random state is left as it was."""
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForCausalLM(LlamaConfig(**tiny_llama_config(**overrides))).eval()


def byte_tokenizer():
    """A byte-level tokenizer built in code: token ``b`` is byte ``b`` (0-255) of the text's
    UTF-8, then the special tokens ``<|endoftext|>`` (padding), ``<|im_start|>`` and
    ``<|im_end|>`` (end of sequence), with a ChatML chat template. Any text round-trips; bytes
    that are not UTF-8 decode as ``bytes.decode("utf-8", "replace")`` does. A
    ``transformers.PreTrainedTokenizerFast`` over a ``tokenizers`` BPE model without merges on
    GPT-2's byte-level alphabet (each byte spelled as a printable character)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {char: byte for byte, char in _byte_level_alphabet().items()}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(BYTE_TOKENIZER_SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHATML_TEMPLATE,
    )


def _byte_level_alphabet() -> dict[int, str]:
    """GPT-2's printable spelling of each byte (the one ``tokenizers``' ByteLevel pre-tokenizer
    and decoder use): printable Latin-1 bytes are themselves, the others are code points from
    256 up, in byte order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)}
    printable |= set(range(ord("®"), ord("ÿ") + 1))
    alphabet, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            alphabet[byte] = chr(byte)
        else:
            alphabet[byte] = chr(256 + extra)
            extra += 1
    return alphabet


def tiny_chat_model(seed: int = 0) -> tuple[torch.nn.Module, object]:
    """The tiny Llama sized for :func:`byte_tokenizer` (a vocabulary of 259 tokens; end of
    sequence ``<|im_end|>``) and the tokenizer: text and chat through random weights."""
    tokenizer = byte_tokenizer()
    model = tiny_llama(
        seed,
        vocab_size=len(tokenizer),
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return model, tokenizer
