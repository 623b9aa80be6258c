"""A small byte-level BPE tokenizer for the engine's text tests, trained in a few milliseconds:
byte tokens for every UTF-8 byte (so a character can split over tokens), merges that join
multi-byte characters and words, special tokens and a ChatML chat template."""

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

CORPUS = ["hello wörld, hello café naïve 日本語 ok!", "The capital of France is Paris."] * 8
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_level_test_tokenizer():
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        bos_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )
