"""The server's request parsing and parameter mapping (:mod:`paged_attention.server.protocol`),
without a server: what the KV pool holds, which fields are refused, ignored or carried out."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

pytest.importorskip("pydantic")

from paged_attention.engine.scheduler import Scheduler  # noqa: E402
from paged_attention.server import protocol  # noqa: E402
from paged_attention.server.protocol import (  # noqa: E402
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    Limits,
)
from paged_attention.server.tool_calls import (  # noqa: E402
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    tool_call_grammar,
)


def chat(**fields) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": "x"}], **fields}).encode()


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("kv_blocks", [5, 64, 257])
def test_kv_room_is_the_longest_completion_the_engine_admits(block_size, kv_blocks):
    """Against the scheduler's own count of the blocks a request may hold."""
    limits = Limits(max_model_len=10**6, max_n=8, kv_blocks=kv_blocks, block_size=block_size)
    manager = SimpleNamespace(block_size=block_size, reach=SimpleNamespace(releases=False))
    scheduler = SimpleNamespace(block_manager=manager)

    def blocks(prompt_len: int, n: int, max_tokens: int) -> int:
        params = SimpleNamespace(max_new_tokens=max_tokens, num_seqs=n)
        request = SimpleNamespace(prompt=[0] * prompt_len, params=params)
        return Scheduler.blocks_needed(scheduler, request)

    for prompt_len in (1, 7, 8, 9, 40, 100):
        for n in (1, 2, 3, 8):
            room = limits.kv_room(prompt_len, n)
            if room >= 1:
                assert blocks(prompt_len, n, room) <= kv_blocks
            assert blocks(prompt_len, n, room + 1) > kv_blocks


def test_the_default_max_tokens_is_bounded_by_context_pool_and_default():
    limits = Limits(max_model_len=1024, max_n=8, kv_blocks=64, block_size=16)
    request = protocol.parse(ChatCompletionRequest, chat(n=8))
    params = protocol.sampling_params(request, 20, limits, None)
    assert params.max_new_tokens == limits.kv_room(20, 8) < 1024 - 20
    request = protocol.parse(ChatCompletionRequest, chat(n=1))
    assert protocol.sampling_params(request, 20, limits, None).max_new_tokens == 1024 - 20
    completion = protocol.parse(CompletionRequest, b'{"prompt": "x", "n": 8}')
    assert protocol.sampling_params(completion, 20, limits, 16).max_new_tokens == 16
    with pytest.raises(APIError) as raised:  # 8 samples of a 1000-token prompt cannot fit
        protocol.sampling_params(request.model_copy(update={"n": 8}), 1000, limits, None)
    assert raised.value.param == "n" and raised.value.code == "kv_cache_exceeded"


@pytest.mark.parametrize("field", protocol.UNSUPPORTED)
def test_fields_not_carried_out_are_refused_as_unsupported(field):
    with pytest.raises(APIError) as raised:
        protocol.parse(ChatCompletionRequest, chat(**{field: "low"}))
    assert raised.value.param == field and raised.value.code == "unsupported_parameter"
    assert "unrecognized" not in raised.value.message
    protocol.parse(ChatCompletionRequest, chat(**{field: None}))  # null asks for nothing


def test_unknown_fields_are_ignored_and_warned_about_once(caplog):
    with caplog.at_level("WARNING", logger="paged_attention.server"):
        for _ in range(2):
            request = protocol.parse(ChatCompletionRequest, chat(vendor_field_abc=1))
            assert request.max_new_tokens is None
    warned = [r for r in caplog.records if "vendor_field_abc" in r.getMessage()]
    assert len(warned) == 1


def test_tool_call_arguments_reach_the_template_as_objects():
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    body = {"messages": [{"role": "assistant", "content": None, "tool_calls": [call]}]}
    (message,) = protocol.parse(ChatCompletionRequest, json.dumps(body).encode()).messages
    assert message.template_message() == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}
        ],
    }
    call["function"]["arguments"] = "not json"
    (message,) = protocol.parse(ChatCompletionRequest, json.dumps(body).encode()).messages
    assert message.template_message()["tool_calls"][0]["function"]["arguments"] == "not json"


@pytest.mark.parametrize("call_format", [HERMES, LLAMA3_JSON, MISTRAL], ids=lambda f: f.name)
def test_forced_calls_get_the_grammar_of_the_server_s_format(call_format):
    """A forced call's grammar is the one :func:`tool_call_grammar` builds for the server's
    format, for that function only (named) or every tool (required, parallel unless off)."""
    parameters = {"type": "object"}
    tools = [{"type": "function", "function": {"name": n, "parameters": parameters}} for n in "fg"]
    limits = Limits(max_model_len=1024, max_n=8, kv_blocks=64, block_size=16)
    named = {"type": "function", "function": {"name": "g"}}
    cases = [
        (named, None, [("g", parameters)], False),
        ("required", None, [("f", parameters), ("g", parameters)], True),
        ("required", False, [("f", parameters), ("g", parameters)], False),
    ]
    for choice, parallel_calls, functions, parallel in cases:
        fields = dict(tools=tools, tool_choice=choice, parallel_tool_calls=parallel_calls)
        request = protocol.parse(ChatCompletionRequest, chat(**fields))
        params = protocol.sampling_params(request, 5, limits, None, call_format)
        tag = json.loads(params.structured_output.structural_tag)
        assert tag == tool_call_grammar(functions, parallel, call_format)


def test_stop_strings_are_capped():
    limits = Limits(max_model_len=1024, max_n=8, kv_blocks=64, block_size=16)
    fine = protocol.parse(ChatCompletionRequest, chat(stop=["a"] * protocol.MAX_STOP_STRINGS))
    assert len(protocol.sampling_params(fine, 5, limits, None).stop) == protocol.MAX_STOP_STRINGS
    for stop in (["a"] * (protocol.MAX_STOP_STRINGS + 1), ["a" * (protocol.MAX_STOP_LENGTH + 1)]):
        request = protocol.parse(ChatCompletionRequest, chat(stop=stop))
        with pytest.raises(APIError) as raised:
            protocol.sampling_params(request, 5, limits, None)
        assert raised.value.param == "stop"
