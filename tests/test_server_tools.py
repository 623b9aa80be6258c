"""Tools on the OpenAI-compatible server, through the official client (and LangChain's
``ChatOpenAI``): the tools reach the model's prompt, ``tool_choice`` ``required`` and a named
function force calls whose arguments follow the function's schema (on the tiny random model,
only the grammar can make them valid), and calls come back as ``tool_calls``, whole or
streamed."""

from __future__ import annotations

import json
from typing import Literal

import pytest

pytest.importorskip("transformers")
pytest.importorskip("xgrammar")
openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")

from openai.lib.streaming.chat import ChatCompletionStreamState  # noqa: E402
from openai.types.chat import ChatCompletionChunk  # noqa: E402
from test_server import LiveServer, make_engine  # noqa: E402

from paged_attention.__main__ import main as cli_main  # noqa: E402
from paged_attention.engine import RequestOutput, SamplingParams  # noqa: E402
from paged_attention.modeling.models import load_model  # noqa: E402
from paged_attention.modeling.tiny import byte_tokenizer  # noqa: E402
from paged_attention.server import create_app, protocol  # noqa: E402
from paged_attention.server.answers import Answer, PromptJob  # noqa: E402
from paged_attention.server.logprobs import TokenPieces  # noqa: E402
from paged_attention.server.tool_calls import (  # noqa: E402
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    ToolCallReader,
)


class Weather(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", strict=True)
    city: Literal["Paris", "Oslo", "Lima"]
    days: int = pydantic.Field(ge=1, le=7)


class Sum(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", strict=True)
    a: int = pydantic.Field(ge=0, le=9)
    b: int = pydantic.Field(ge=0, le=9)


def tool(name: str, properties: dict) -> dict:
    """A function of integer and enum parameters, all required (a compact schema: the tiny
    model's byte tokenizer spends a token per character of the prompt)."""
    parameters = {"type": "object", "properties": properties, "required": list(properties)}
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def digit() -> dict:
    return {"type": "integer", "minimum": 0, "maximum": 9}


TOOLS = [
    tool(
        "get_weather",
        {
            "city": {"enum": ["Paris", "Oslo", "Lima"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
    ),
    tool("add", {"a": digit(), "b": digit()}),
]
VALIDATORS = {"get_weather": Weather, "add": Sum}
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def served():
    model, tokenizer = load_model("tiny")
    live = LiveServer(create_app(make_engine(model, tokenizer), tokenizer, "tiny", max_n=4))
    yield live
    live.stop()


def ask(served, **fields):
    options = dict(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=200, seed=0)
    return served.client().chat.completions.create(**{**options, **fields})


def check_calls(calls) -> list[tuple[str, dict]]:
    """Each call's name and arguments, validated against its function's schema."""
    found = []
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        arguments = json.loads(call.function.arguments)
        VALIDATORS[call.function.name].model_validate(arguments)
        found.append((call.function.name, arguments))
    return found


@pytest.mark.parametrize("seed", range(4))
def test_a_named_tool_is_called_with_valid_arguments(served, seed):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    answer = ask(served, tool_choice=choice, seed=seed, temperature=1.0, n=2)
    for result in answer.choices:
        assert result.finish_reason == "tool_calls"
        assert result.message.content is None
        names = [name for name, _ in check_calls(result.message.tool_calls)]
        assert names == ["get_weather"]  # a named function is called once


@pytest.mark.parametrize("seed", range(3))
def test_required_calls_at_least_one_tool(served, seed):
    answer = ask(served, tool_choice="required", seed=seed, temperature=1.0)
    assert len(check_calls(answer.choices[0].message.tool_calls)) >= 1


def test_parallel_tool_calls_false_makes_one_call(served):
    for seed in range(3):
        answer = ask(served, tool_choice="required", parallel_tool_calls=False, seed=seed)
        assert answer.choices[0].finish_reason == "tool_calls"
        assert len(check_calls(answer.choices[0].message.tool_calls)) == 1


def test_streamed_tool_calls_come_in_openai_s_delta_shape(served):
    """A call's first delta carries its index, id, type, name and empty arguments; the next
    ones the index and the arguments piece by piece, which add up to the whole answer's."""
    fields = dict(tool_choice="required", seed=5, temperature=1.0)
    whole = ask(served, **fields).choices[0]
    calls: dict[int, dict] = {}
    reasons = []
    for chunk in ask(served, stream=True, **fields):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        reasons.append(chunk.choices[0].finish_reason)
        for call in delta.tool_calls or ():
            if call.index not in calls:
                assert call.id.startswith("call_") and call.type == "function"
                assert call.function.name and call.function.arguments == ""
                calls[call.index] = {"name": call.function.name, "pieces": []}
            else:
                assert call.id is None and call.type is None and call.function.name is None
                calls[call.index]["pieces"].append(call.function.arguments)
    streamed = [(calls[i]["name"], "".join(calls[i]["pieces"])) for i in sorted(calls)]
    expected = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert streamed == expected and sorted(calls) == list(range(len(expected)))
    assert len(calls[0]["pieces"]) > 1  # the arguments come as they are written
    assert reasons[-1] == whole.finish_reason


@pytest.mark.parametrize("seed", range(2))
def test_the_client_s_stream_helper_gathers_the_whole_answer_s_calls(served, seed):
    # one call, so that the answer ends before max_tokens (the helper refuses a cut answer)
    fields = dict(tool_choice="required", parallel_tool_calls=False, seed=seed, temperature=1.0)
    answer = ask(served, **fields).choices[0]
    whole, whole_reason = answer.message, answer.finish_reason
    options = dict(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=200, **fields)
    pieces: dict[int, list[str]] = {}
    with served.client().chat.completions.stream(**options) as stream:
        for event in stream:
            if event.type == "tool_calls.function.arguments.delta":
                pieces.setdefault(event.index, []).append(event.arguments_delta)
        final = stream.get_final_completion().choices[0]
    expected = [(c.function.name, c.function.arguments) for c in whole.tool_calls]
    calls = final.message.tool_calls
    assert [(c.function.name, c.function.arguments) for c in calls] == expected
    assert ["".join(pieces[i]) for i in sorted(pieces)] == [a for _, a in expected]
    assert final.finish_reason == whole_reason == "tool_calls" and not final.message.content


def test_auto_answers_in_words_when_the_model_calls_nothing(served):
    answer = ask(served, tool_choice="auto", max_tokens=12)
    assert answer.choices[0].message.tool_calls is None
    assert answer.choices[0].finish_reason == "length"
    assert answer.choices[0].message.content


def test_tools_reach_the_prompt_unless_tool_choice_is_none(served):
    plain = served.client().chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1)
    none = ask(served, tool_choice="none", max_tokens=1)
    auto = ask(served, max_tokens=1)
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens
    assert auto.usage.prompt_tokens > plain.usage.prompt_tokens


def test_tokenize_renders_tools_as_a_chat_completion_does(served):
    httpx = pytest.importorskip("httpx")
    body = {"model": "tiny", "messages": MESSAGES, "tools": TOOLS}
    tokenized = httpx.post(f"{served.url}/tokenize", json=body).json()
    assert tokenized["count"] == ask(served, max_tokens=1).usage.prompt_tokens
    plain = httpx.post(f"{served.url}/tokenize", json={**body, "tools": None}).json()
    assert plain["count"] < tokenized["count"]


def test_a_conversation_with_earlier_calls_goes_on(served):
    choice = {"type": "function", "function": {"name": "add"}}
    first = ask(served, tool_choice=choice).choices[0].message
    call = first.tool_calls[0]
    messages = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "5"},
    ]
    again = ask(served, messages=messages, tool_choice=choice).choices[0].message
    check_calls(again.tool_calls)


@pytest.mark.parametrize(
    "fields, param, message",
    [
        ({"tools": None, "tool_choice": "required"}, "tool_choice", "needs tools"),
        (
            {"tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "not in tools",
        ),
        ({"tool_choice": "sometimes"}, "tool_choice", None),
        (
            {"tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
            "cannot be combined with tools",
        ),
        ({"tools": [*TOOLS, TOOLS[0]]}, "tools", "same name"),
        (
            {"tools": [{"type": "function", "function": {"name": "bad name"}}]},
            "tools[0].function.name",
            "1 to 64",
        ),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": 7}}}
                ],
                "tool_choice": "required",
            },
            "tools",
            "could not be compiled",
        ),
    ],
)
def test_what_cannot_be_served_is_a_400_naming_the_field(served, fields, param, message):
    with pytest.raises(openai.BadRequestError) as caught:
        ask(served, max_tokens=4, extra_body=fields)
    error = caught.value.body
    assert error["param"] == param
    if message:
        assert message in error["message"]


def test_langchain_structured_output_and_bound_tools(served):
    chat_openai = pytest.importorskip("langchain_openai")
    llm = chat_openai.ChatOpenAI(
        model="tiny",
        base_url=f"{served.url}/v1",
        api_key=served.api_key,
        max_tokens=200,
        temperature=1.0,
        max_retries=0,
        seed=1,
    )
    reading = llm.with_structured_output(Weather).invoke("Weather?")
    assert isinstance(reading, Weather)
    bound = llm.bind_tools([Sum], tool_choice="Sum")
    message = bound.invoke("Add two digits.")
    assert [call["name"] for call in message.tool_calls][:1] == ["Sum"]
    Sum.model_validate(message.tool_calls[0]["args"])
    # streamed: LangChain adds the chunks' tool-call pieces up into the same call
    chunks = list(bound.stream("Add two digits."))
    gathered = chunks[0]
    for chunk in chunks[1:]:
        gathered += chunk
    assert len(chunks) > 3 and [call["name"] for call in gathered.tool_calls] == ["Sum"]
    Sum.model_validate(gathered.tool_calls[0]["args"])


# ---------------------------------------------------------------------- the call formats

WRITTEN = {
    HERMES: 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", '
    '"days": 2}}\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}'
    "\n</tool_call>",
    LLAMA3_JSON: 'Checking.<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo", '
    '"days": 2}}; {"name": "add", "parameters": {"a": 1, "b": 2}}',
    MISTRAL: 'Checking. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo", '
    '"days": 2}}, {"name": "add", "arguments": {"a": 1, "b": 2}}]',
}
EXPECTED_CALLS = [("get_weather", '{"city": "Oslo", "days": 2}'), ("add", '{"a": 1, "b": 2}')]


def answer_of(call_format, tool_choice="auto") -> Answer:
    body = protocol.parse(
        protocol.ChatCompletionRequest,
        json.dumps(
            {"model": "tiny", "messages": MESSAGES, "tools": TOOLS, "tool_choice": tool_choice}
        ).encode(),
    )
    job = PromptJob([1], "", SamplingParams(max_new_tokens=200))
    return Answer(body, TokenPieces(byte_tokenizer()), [job], call_format)


def output(text: str, new: str, reason: str | None) -> RequestOutput:
    return RequestOutput(
        request_id=0,
        prompt=[1],
        outputs=[[0] * len(text)],
        finish_reasons=[reason],
        new_tokens=[[0] * len(new)],
        finished=reason is not None,
        texts=[text],
        new_texts=[new],
    )


@pytest.mark.parametrize("call_format", list(WRITTEN), ids=lambda f: f.name)
@pytest.mark.parametrize("size", [1, 7, 1000])
def test_each_format_streams_what_the_whole_answer_holds(call_format, size):
    """The server's chunks of an answer written in ``call_format`` (streamed ``size``
    characters an output), gathered by the openai client's own stream state, give the
    whole answer's message."""
    text = WRITTEN[call_format]
    whole = answer_of(call_format).response("id", "tiny", [output(text, text, "eos")])
    message = whole["choices"][0]["message"]
    assert message["content"] == "Checking."
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
    assert whole["choices"][0]["finish_reason"] == "tool_calls"
    state = ChatCompletionStreamState(input_tools=TOOLS)
    answer = answer_of(call_format)
    opening = protocol.chunk_choice(True, 0, None, None)
    choices = [opening]
    for start in range(0, len(text), size):
        piece = text[start : start + size]
        reason = "eos" if start + size >= len(text) else None
        choices += answer.deltas(0, output(text[: start + size], piece, reason))
    for choice in choices:
        chunk = protocol.chunk(True, "id", 0, "tiny", [choice])
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    final = state.get_final_completion().choices[0]
    assert final.message.content == "Checking."
    calls = [(c.function.name, c.function.arguments) for c in final.message.tool_calls]
    assert calls == EXPECTED_CALLS
    assert [c["function"]["arguments"] for c in message["tool_calls"]] == [a for _, a in calls]
    assert final.finish_reason == "tool_calls"


def test_an_answer_cut_at_max_tokens_keeps_its_calls_and_ends_as_length():
    text = WRITTEN[HERMES][:-20]
    whole = answer_of(HERMES).response("id", "tiny", [output(text, text, "length")])
    choice = whole["choices"][0]
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == [
        "get_weather",
        "add",
    ]
    assert choice["finish_reason"] == "length"


@pytest.mark.parametrize("call_format", list(WRITTEN), ids=lambda f: f.name)
def test_malformed_calls_stay_content(call_format):
    text = WRITTEN[call_format].replace('"name"', '"nom"')  # no call has a name
    message = answer_of(call_format).response("id", "tiny", [output(text, text, "eos")])
    choice = message["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": text}
    assert choice["finish_reason"] == "stop"


def test_forced_calls_are_read_in_the_server_s_format():
    assert answer_of(MISTRAL, "required").tool_call_format is MISTRAL
    named = {"type": "function", "function": {"name": "add"}}
    assert answer_of(LLAMA3_JSON, named).tool_call_format is LLAMA3_JSON
    assert answer_of(LLAMA3_JSON, "auto").tool_call_format is LLAMA3_JSON


@pytest.fixture(scope="module", params=[HERMES, LLAMA3_JSON, MISTRAL], ids=lambda f: f.name)
def served_in(request):
    """A live server on the tiny model reading calls in one format, and that format."""
    model, tokenizer = load_model("tiny")
    app = create_app(
        make_engine(model, tokenizer),
        tokenizer,
        "tiny",
        max_n=4,
        tool_call_parser=request.param.name,
    )
    live = LiveServer(app)
    yield live, request.param
    live.stop()


# How the text of a forced answer opens in each format (the grammar allows nothing else).
OPENINGS = {HERMES: "<tool_call>\n", LLAMA3_JSON: "{", MISTRAL: "[TOOL_CALLS][{"}


def written_text(result) -> str:
    """The text the model wrote (the tiny model's tokens are bytes: their logprobs' tokens
    add up to it), without the end-of-text token that ended it."""
    tokens = [entry.token for entry in result.logprobs.content]
    return "".join(tokens if result.finish_reason == "length" else tokens[:-1])


def forced_calls(served_in, choice) -> list[list[tuple[str, dict]]]:
    """Each sampled answer's whole calls (validated against their function's schema), after
    checking that its text is written in the server's format and read as nothing but calls.
    Parallel calls may go on until max_tokens cuts the last one: cut before its name is
    complete, it stays content (and the calls before it are whole); after, its name is still
    a tool's."""
    call_format = served_in[1]
    found = []
    for result in choice.choices:
        text = written_text(result)
        assert text.startswith(OPENINGS[call_format]), text
        reader = ToolCallReader(call_format, parallel=True)
        reader.feed(text, final=True)
        calls = result.message.tool_calls
        assert [c["function"]["name"] for c in reader.calls] == [c.function.name for c in calls]
        if result.finish_reason == "length" and result.message.content is None:
            assert calls[-1].function.name in VALIDATORS
            calls = calls[:-1]
        elif result.finish_reason != "length":
            assert result.finish_reason == "tool_calls"
            assert result.message.content is None  # the whole text was read as calls
        found.append(check_calls(calls))
    return found


@pytest.mark.parametrize("seed", range(3))
def test_a_forced_named_call_follows_the_server_s_format(served_in, seed):
    choice = {"type": "function", "function": {"name": "add"}}
    answer = ask(served_in[0], tool_choice=choice, seed=seed, temperature=1.0, n=2, logprobs=True)
    for calls in forced_calls(served_in, answer):
        assert [name for name, _ in calls] == ["add"]


@pytest.mark.parametrize("seed", range(3))
def test_forced_required_calls_follow_the_server_s_format(served_in, seed):
    answer = ask(
        served_in[0],
        tool_choice="required",
        seed=seed,
        temperature=1.0,
        n=2,
        max_tokens=224,
        logprobs=True,
    )
    for calls in forced_calls(served_in, answer):
        assert len(calls) >= 1
        assert {name for name, _ in calls} <= set(VALIDATORS)


def test_forced_required_calls_are_one_without_parallel_calls(served_in):
    for seed in range(3):
        fields = dict(tool_choice="required", parallel_tool_calls=False, seed=seed)
        answer = ask(served_in[0], temperature=1.0, logprobs=True, **fields)
        assert [len(calls) for calls in forced_calls(served_in, answer)] == [1]


@pytest.mark.parametrize("seed", range(2))
def test_forced_calls_stream_in_the_server_s_format(served_in, seed):
    """The client's stream helper gathers a streamed forced answer into the calls of the
    same answer whole."""
    live, _ = served_in
    fields = dict(tool_choice="required", parallel_tool_calls=False, seed=seed, temperature=1.0)
    whole = ask(live, **fields).choices[0]
    options = dict(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=200, **fields)
    with live.client().chat.completions.stream(**options) as stream:
        final = stream.get_final_completion().choices[0]
    calls = [(c.function.name, c.function.arguments) for c in final.message.tool_calls]
    assert calls == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert len(check_calls(final.message.tool_calls)) == 1
    assert final.finish_reason == whole.finish_reason == "tool_calls"
    assert not final.message.content


def test_an_unknown_parser_is_refused():
    model, tokenizer = load_model("tiny")
    engine = make_engine(model, tokenizer)
    with pytest.raises(ValueError, match="tool_call_parser must be one of .*'qwen'"):
        create_app(engine, tokenizer, "tiny", tool_call_parser="qwen")


def test_serve_refuses_an_unknown_tool_call_parser(capsys):
    with pytest.raises(SystemExit) as raised:
        cli_main(["serve", "--model", "tiny", "--tool-call-parser", "qwen"])
    assert raised.value.code == 2
    error = capsys.readouterr().err
    assert "--tool-call-parser" in error and "hermes" in error and "Traceback" not in error
