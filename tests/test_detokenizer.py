"""The incremental detokenizer: text equal to decoding the ids, stop strings across tokens."""

import random

import pytest

tokenizers = pytest.importorskip("tokenizers")

from text_tokenizer import byte_level_test_tokenizer  # noqa: E402

from paged_attention.engine.detokenizer import IncrementalDetokenizer, backend_of  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer():
    return byte_level_test_tokenizer()


def pieces(detokenizer, ids, final_at_end=True):
    out = []
    for token in ids:
        stopped = detokenizer.append(token)
        out.append(detokenizer.take_new(final=stopped))
        if stopped:
            return out, True
    if final_at_end:
        out.append(detokenizer.take_new(final=True))
    return out, False


def test_text_is_the_decoding_of_the_ids_across_multibyte_characters(tokenizer):
    backend = backend_of(tokenizer)
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(len(tokenizer)) for _ in range(30)]
        text = IncrementalDetokenizer(backend)
        parts, _ = pieces(text, ids)
        whole = tokenizer.decode(ids, skip_special_tokens=True)
        assert "".join(parts) == text.text == whole


def test_a_character_split_over_tokens_is_handed_out_once_complete(tokenizer):
    backend = backend_of(tokenizer)
    ids = tokenizer("a日", add_special_tokens=False)["input_ids"]
    bytes_of_ri = [tokenizer.convert_tokens_to_ids(c) for c in tokenizer.tokenize("日")]
    assert len(bytes_of_ri) >= 1
    text = IncrementalDetokenizer(backend)
    for token in ids:
        text.append(token)
    assert text.take_new(final=False) == "a日"


@pytest.mark.parametrize("stop", ["lo w", "o", "wö", "ld!"])
def test_stop_strings_end_the_text_before_them(tokenizer, stop):
    backend = backend_of(tokenizer)
    sentence = "hello wörld, hello café"
    ids = tokenizer(sentence, add_special_tokens=False)["input_ids"]
    text = IncrementalDetokenizer(backend, (stop,))
    parts, stopped = pieces(text, ids)
    if stop in sentence:
        assert stopped and text.text == sentence[: sentence.index(stop)]
    else:
        assert not stopped and text.text == sentence
    assert "".join(parts) == text.text


def test_stop_string_prefixes_are_held_back_until_decided(tokenizer):
    backend = backend_of(tokenizer)
    text = IncrementalDetokenizer(backend, ("STOP",))
    handed = ""
    for token in tokenizer("abc STO", add_special_tokens=False)["input_ids"]:
        text.append(token)
        handed += text.take_new(final=False)
    assert handed == "abc "  # "STO" could still become "STOP"
    for token in tokenizer("X", add_special_tokens=False)["input_ids"]:
        text.append(token)
        handed += text.take_new(final=False)
    assert handed + text.take_new(final=True) == "abc STOX"


def test_backend_of_needs_a_fast_tokenizer():
    with pytest.raises(ValueError, match="tokenizer must be a transformers tokenizer"):
        backend_of(object())


def test_a_stop_string_completed_by_the_final_replacement_character_never_survives(tokenizer):
    # Issue 36, defect 5: bytes of an unfinished character are held back while streaming and
    # become U+FFFD only in the final text, where a stop string holding U+FFFD must still end
    # it (and say so).
    backend = backend_of(tokenizer)
    ids = tokenizer("a日", add_special_tokens=False)["input_ids"]
    assert len(ids) >= 3  # "a" and the three bytes of 日
    unfinished = ids[:2]  # "a" and the first byte of 日
    assert tokenizer.decode(unfinished, skip_special_tokens=True) == "a\ufffd"
    for stop in ("a\ufffd", "\ufffd"):
        text = IncrementalDetokenizer(backend, (stop,))
        parts, stopped = pieces(text, unfinished)
        assert not stopped  # streaming never saw the U+FFFD
        assert text.stopped and stop not in "".join(parts) and stop not in text.text
        assert text.text == "a"[: "a\ufffd".index(stop)]
    plain = IncrementalDetokenizer(backend, ("zz",))
    assert "".join(pieces(plain, unfinished)[0]) == "a\ufffd" and not plain.stopped
