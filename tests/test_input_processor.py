"""The engine's way in, without a model: prompts become validated requests, checked once against
one RequestLimits and the pool of the scheduler that will run them."""

from __future__ import annotations

import pytest
import torch

from paged_attention.engine.input_processor import InputProcessor, RequestLimits
from paged_attention.engine.request import RequestError, SamplingParams
from paged_attention.engine.scheduler import Scheduler
from paged_attention.kv.block_manager import BlockManager

LIMITS = RequestLimits(vocab_size=100, max_model_len=64, max_num_seqs=4)


def processor(tokenizer=None, num_blocks=8):
    scheduler = Scheduler(BlockManager(num_blocks, 4), max_num_seqs=LIMITS.max_num_seqs)
    return InputProcessor(tokenizer, LIMITS, scheduler, torch.device("cpu"))


def test_token_ids_become_a_request_with_its_own_seeded_generator():
    inputs = processor()
    first = inputs.process(torch.tensor([5, 6, 7]), SamplingParams(4, seed=3), arrival_time=1.5)
    second = inputs.process([8], SamplingParams(2))
    assert (first.request_id, second.request_id) == (0, 1)
    assert first.prompt == [5, 6, 7] and first.metrics.arrival_time == 1.5
    assert first.generator.initial_seed() == 3
    assert not inputs.scheduler.has_unfinished()  # processing queues nothing


@pytest.mark.parametrize(
    "prompt, params, argument, limit, message",
    [
        ([], SamplingParams(), "prompt", None, "at least one token"),
        ([5, 100], SamplingParams(), "prompt", None, "outside the model's vocabulary"),
        ([5, 1.5], SamplingParams(), "prompt", None, "must be integers"),
        ([5], SamplingParams(n=5, temperature=1.0), "n", None, "max_num_seqs=4"),
        ([5] * 60, SamplingParams(5), "max_new_tokens", "context", "context holds 64"),
        ([5] * 20, SamplingParams(20), "max_new_tokens", "kv_cache", "never run"),
        ([5] * 40, SamplingParams(1), "prompt", "kv_cache", "never run"),
        ("hello", SamplingParams(), "prompt", None, "needs an engine with a tokenizer"),
        ([5], SamplingParams(stop=("x",)), "stop", None, "need an engine with a tokenizer"),
    ],
)
def test_bad_requests_are_refused_naming_the_argument(prompt, params, argument, limit, message):
    with pytest.raises(RequestError, match=message) as raised:
        processor().process(prompt, params)
    assert (raised.value.argument, raised.value.limit) == (argument, limit)


def test_text_must_be_valid_unicode():
    pytest.importorskip("tokenizers")
    from text_tokenizer import byte_level_test_tokenizer

    tokenizer = byte_level_test_tokenizer()
    inputs = processor(tokenizer, num_blocks=64)
    limits = RequestLimits(len(tokenizer), 512, 4)
    inputs = InputProcessor(tokenizer, limits, inputs.scheduler, torch.device("cpu"))
    assert inputs.prompt_ids("café") == tokenizer("café")["input_ids"]
    for prompt in ("caf\udce9", [{"role": "user", "content": "\ud800"}]):
        with pytest.raises(ValueError, match="not valid Unicode") as raised:
            inputs.process(prompt, SamplingParams())
        assert raised.value.argument == "prompt"
    with pytest.raises(ValueError, match="string 'role' and 'content'"):
        inputs.process([{"role": "user", "content": "hi"}, 5], SamplingParams())


def test_chat_prompts_are_rendered_by_the_shared_renderer():
    pytest.importorskip("tokenizers")
    from text_tokenizer import byte_level_test_tokenizer

    from paged_attention.engine.prompt_renderer import ChatPrompt, PromptRenderer

    tokenizer = byte_level_test_tokenizer()
    scheduler = Scheduler(BlockManager(64, 4), max_num_seqs=4)
    inputs = InputProcessor(tokenizer, RequestLimits(len(tokenizer), 512, 4), scheduler, "cpu")
    messages = [{"role": "user", "content": "hello"}]
    renderer = PromptRenderer(tokenizer)
    assert inputs.prompt_ids(messages) == renderer.chat_ids(ChatPrompt(messages))
    opened = ChatPrompt(messages, add_generation_prompt=False, continue_final_message=True)
    assert inputs.prompt_ids(opened) == renderer.chat_ids(opened)
    assert inputs.prompt_ids(opened) != inputs.prompt_ids(messages)
    with pytest.raises(RequestError, match="chat messages needs an engine with a tokenizer"):
        processor().process(ChatPrompt(messages), SamplingParams())
    tokenizer.chat_template = None
    with pytest.raises(RequestError, match="has no chat template") as raised:
        inputs.process(messages, SamplingParams())
    assert raised.value.argument == "prompt"
