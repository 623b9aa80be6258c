"""The OpenAI-compatible server, through the official ``openai`` client (and raw HTTP where a
client library cannot send the mistake): a server on 127.0.0.1 on a free port, uvicorn in a
thread of the test process over the tiny model, one subprocess for the command's graceful
shutdown, and the real model for one chat."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("transformers")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")

from paged_attention.__main__ import main as cli_main  # noqa: E402
from paged_attention.engine import Engine, SamplingParams  # noqa: E402
from paged_attention.modeling.models import load_model  # noqa: E402
from paged_attention.server import create_app  # noqa: E402
from paged_attention.server.app import ENGINE_FAILURE  # noqa: E402

MODEL = "tiny"
NUM_BLOCKS = 256
BLOCK_SIZE = 16
MAX_NUM_SEQS = 40
MAX_N = 4


class LiveServer:
    """uvicorn serving ``app`` on 127.0.0.1, a free port, in a thread."""

    def __init__(self, app, api_key: str = "unused") -> None:
        self.api_key = api_key
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning")
        sock = config.bind_socket()
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]})
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        assert not self.thread.is_alive()

    def client(self, **options) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.url}/v1", api_key=self.api_key, max_retries=0, timeout=60, **options
        )

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=f"{self.url}/v1", api_key=self.api_key, max_retries=0, timeout=60
        )

    def metrics(self) -> dict[str, float]:
        """The unlabelled samples of /metrics, and the finished-requests counter by reason."""
        auth = {"authorization": f"Bearer {self.api_key}"}
        text = httpx.get(f"{self.url}/metrics", headers=auth).text
        samples = {}
        for name, labels, value in re.findall(r"^(\w+)(\{[^}]*\})? (\S+)$", text, re.MULTILINE):
            samples[name + labels] = float(value)
        return samples


@pytest.fixture(scope="module")
def tiny():
    return load_model(MODEL)


def make_engine(model, tokenizer, **options) -> Engine:
    sizes = dict(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_num_seqs=MAX_NUM_SEQS)
    return Engine(model, tokenizer=tokenizer, **{**sizes, **options})


class Recorder:
    """Keeps every final output the engine's output processor routes to the server's streams
    (in the owner thread), so a test can compare the tokens behind an HTTP answer: the tiny
    model's random bytes mostly decode to U+FFFD, which text alone would not tell apart."""

    def __init__(self, engine) -> None:
        self.finals = []
        take_owned = engine.output_processor.take_owned

        def recording_take_owned():
            taken = take_owned()
            self.finals += [o for _, o in taken if o.finished]
            return taken

        engine.output_processor.take_owned = recording_take_owned

    def of(self, prompt: list[int]) -> list:
        return [o for o in self.finals if o.prompt == prompt]


@pytest.fixture(scope="module")
def served(tiny):
    model, tokenizer = tiny
    engine = make_engine(model, tokenizer)
    live = LiveServer(create_app(engine, tokenizer, MODEL, max_n=MAX_N))
    live.engine = engine
    live.tokenizer = tokenizer
    live.recorded = Recorder(engine)
    yield live
    live.stop()


def offline(tiny, prompts, params):
    """The same requests on an engine of the same model and sizes, without a server."""
    model, tokenizer = tiny
    return make_engine(model, tokenizer).generate(prompts, params)


def chat_prompt(tokenizer, content: str) -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def wait_idle(live: LiveServer, timeout: float = 10.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        samples = live.metrics()
        idle = samples["paged_attention_num_requests_running"] == 0
        if idle and samples["paged_attention_num_requests_waiting"] == 0:
            return samples
        assert time.monotonic() < deadline, "the server did not become idle"
        time.sleep(0.02)


# --------------------------------------------------------------------- generation


def test_chat_completion_equals_the_offline_engine(served, tiny):
    client = served.client()
    answer = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hello there"}],
        max_tokens=12,
        temperature=0,
    )
    prompt = chat_prompt(served.tokenizer, "hello there")
    (expected,) = offline(tiny, [prompt], SamplingParams(max_new_tokens=12))
    assert answer.object == "chat.completion" and answer.model == MODEL
    assert answer.id.startswith("chatcmpl-")
    (choice,) = answer.choices
    assert choice.index == 0 and choice.message.role == "assistant"
    assert choice.message.content == expected.text
    (served_output,) = served.recorded.of(prompt)
    assert served_output.outputs == expected.outputs
    reason = {"eos": "stop", "stop": "stop", "length": "length"}[expected.finish_reasons[0]]
    assert choice.finish_reason == reason
    assert answer.usage.prompt_tokens == len(prompt)
    assert answer.usage.completion_tokens == len(expected.outputs[0])
    assert answer.usage.total_tokens == len(prompt) + len(expected.outputs[0])


def test_completion_of_text_and_of_token_ids(served, tiny):
    client = served.client()
    text = client.completions.create(model=MODEL, prompt="Once upon a time", temperature=0)
    ids = served.tokenizer("Once upon a time")["input_ids"]
    (expected,) = offline(tiny, [ids], SamplingParams(max_new_tokens=16))  # OpenAI's default
    assert text.object == "text_completion" and text.id.startswith("cmpl-")
    assert text.choices[0].text == expected.text
    assert text.usage.prompt_tokens == len(ids)
    assert text.usage.completion_tokens == len(expected.outputs[0])
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=16, temperature=0)
    assert by_ids.choices[0].text == expected.text


def test_streaming_gives_the_same_text_and_usage(served):
    client = served.client()
    request = dict(
        model=MODEL, messages=[{"role": "user", "content": "stream me"}], max_tokens=20, seed=3
    )
    whole = client.chat.completions.create(**request)
    chunks = list(
        client.chat.completions.create(
            **request, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    *with_choices, last = chunks
    assert last.choices == [] and last.usage == whole.usage
    assert all(c.usage is None for c in with_choices)
    assert "".join(c.choices[0].delta.content or "" for c in with_choices) == (
        whole.choices[0].message.content
    )
    assert with_choices[-1].choices[0].finish_reason == whole.choices[0].finish_reason

    completion = list(
        client.completions.create(model=MODEL, prompt="abc", max_tokens=10, stream=True, seed=1)
    )
    assert all(c.usage is None for c in completion)  # no usage chunk unless asked
    assert completion[-1].choices[0].finish_reason in ("stop", "length")


def test_n_samples_and_seeds(served):
    client = served.client()
    content = "pick two"
    request = dict(
        model=MODEL,
        messages=[{"role": "user", "content": content}],
        max_tokens=10,
        temperature=1.0,
        n=2,
    )
    first = client.chat.completions.create(**request, seed=7)
    again = client.chat.completions.create(**request, seed=7)
    other = client.chat.completions.create(**request, seed=8)
    streamed = list(client.chat.completions.create(**request, seed=7, stream=True))
    tokens = [o.outputs for o in served.recorded.of(chat_prompt(served.tokenizer, content))]
    assert len(tokens) == 4
    assert tokens[0] == tokens[1] == tokens[3]  # a seed reproduces, streamed or not
    assert tokens[2] != tokens[0]
    assert tokens[0][0] != tokens[0][1]  # the two samples differ
    assert [c.index for c in first.choices] == [0, 1]
    texts = [c.message.content for c in first.choices]
    assert texts == [c.message.content for c in again.choices]
    assert first.usage.completion_tokens == sum(len(t) for t in tokens[0])
    by_index = {0: "", 1: ""}
    for chunk in streamed:
        for choice in chunk.choices:
            by_index[choice.index] += choice.delta.content or ""
    assert [by_index[0], by_index[1]] == texts
    assert {c.choices[0].finish_reason for c in [first, other]} <= {"stop", "length"}


def test_models_and_health(served):
    client = served.client()
    (card,) = client.models.list().data
    assert card.id == MODEL and card.object == "model"
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("another-model")
    assert httpx.get(f"{served.url}/health").json() == {"status": "ok"}


def test_unknown_fields_are_ignored_with_one_warning_per_name(served, caplog):
    client = served.client()
    request = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    unknown = {"best_of_vendor": 2, "chat_template_kwargs_x": {"a": 1}}
    with caplog.at_level("WARNING", logger="paged_attention.server"):
        for _ in range(3):
            answer = client.chat.completions.create(**request, extra_body=unknown)
            assert answer.usage.completion_tokens >= 1
        # unknown fields of a message are ignored the same way
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi", "weight": 1}], max_tokens=2
        )
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    for name in [*unknown, "weight"]:
        assert sum(f"'{name}'" in w for w in warnings) == 1, warnings


def test_messages_of_tool_calling_clients_are_accepted(served):
    """``name``, an assistant message with ``content: null`` and ``tool_calls``, a ``tool``
    message and content parts reach the chat template as the template's messages."""
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "add", "arguments": '{"a": 2}'},
    }
    messages = [
        {
            "role": "system",
            "content": [{"type": "text", "text": "be"}, {"type": "text", "text": "brief"}],
        },
        {"role": "user", "content": "add 2 and 2", "name": "alice"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "4", "tool_call_id": "call_1"},
    ]
    answer = served.client().chat.completions.create(
        model=MODEL, messages=messages, max_tokens=2, temperature=0
    )
    rendered = [
        {"role": "system", "content": "be\nbrief"},
        {"role": "user", "content": "add 2 and 2", "name": "alice"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "add", "arguments": {"a": 2}},
                }
            ],
        },
        {"role": "tool", "content": "4", "tool_call_id": "call_1"},
    ]
    text = served.tokenizer.apply_chat_template(
        rendered, tokenize=False, add_generation_prompt=True
    )
    prompt = served.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert answer.usage.prompt_tokens == len(prompt)
    assert served.recorded.of(prompt), "the server rendered other messages"


def test_the_default_max_tokens_fits_any_n(tiny):
    """Defect 2: left out, ``max_tokens`` is the longest the KV pool holds for ``n`` samples
    (here 4 x 1000 tokens of context would not fit the 1024-token pool)."""
    model, tokenizer = tiny
    engine = make_engine(model, tokenizer, num_blocks=64)
    recorded = Recorder(engine)
    live = LiveServer(create_app(engine, tokenizer, MODEL, max_n=4))
    try:
        client = live.client()
        for n in (1, 2, 4):
            answer = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "many"}], n=n, temperature=1
            )
            assert len(answer.choices) == n
            prompt_len = answer.usage.prompt_tokens
            # the pool's 64 blocks of 16: the prompt's full blocks shared, the rest split n ways
            own = (64 - prompt_len // 16) // n
            room = 16 * (prompt_len // 16 + own) - prompt_len + 1
            output = recorded.of(chat_prompt(tokenizer, "many"))[-1]
            assert max(len(tokens) for tokens in output.outputs) <= room
        completion = client.completions.create(model=MODEL, prompt="x", n=4)
        assert all(c.finish_reason in ("stop", "length") for c in completion.choices)
    finally:
        live.stop()


# --------------------------------------------------------------------- sampling controls

SAMPLED = dict(temperature=1.0, seed=11, max_tokens=12)


def served_tokens(live: LiveServer, prompt: list[int], **fields) -> list[list[int]]:
    """The tokens behind a completion of ``prompt`` (ids) with ``fields``, through the
    official client: OpenAI's fields as arguments, vLLM's in ``extra_body``."""
    openai_fields = {"presence_penalty", "frequency_penalty", "logit_bias", "temperature", "seed"}
    openai_fields |= {"max_tokens", "n", "top_p", "stop"}
    extra = {k: v for k, v in fields.items() if k not in openai_fields}
    given = {k: v for k, v in fields.items() if k in openai_fields}
    live.client().completions.create(model=MODEL, prompt=prompt, extra_body=extra, **given)
    return live.recorded.of(prompt)[-1].outputs


# The tiny random model samples from a near-uniform distribution, which a penalty hardly
# moves, and greedily it loops on a token, which a penalty breaks: penalties are checked
# greedily, the filters by sampling.
@pytest.mark.parametrize(
    "fields, temperature",
    [
        ({"top_k": 3}, 1.0),
        ({"min_p": 0.9}, 1.0),
        ({"logit_bias": {"7": 5.0, "9": -100}}, 1.0),
        ({"presence_penalty": 2.0}, 0.0),
        ({"frequency_penalty": 1.5}, 0.0),
        ({"frequency_penalty": -2.0}, 1.0),
        ({"repetition_penalty": 2.0}, 0.0),
        ({"top_k": 5, "min_p": 0.05, "presence_penalty": 0.5}, 1.0),
    ],
)
def test_sampling_controls_are_the_engines(served, tiny, fields, temperature):
    """Each request field becomes the engine's SamplingParams field of the same name: the
    served tokens are those of the engine without a server, and differ from those without
    the field."""
    prompt = [7, 7, 7, 7, 9, 9]
    sampling = dict(temperature=temperature, seed=11, ignore_eos=True)
    tokens = served_tokens(served, prompt, **fields, **sampling, max_tokens=24)
    params = dict(fields)
    if "logit_bias" in params:
        params["logit_bias"] = {int(k): v for k, v in params["logit_bias"].items()}
    (expected,) = offline(tiny, [prompt], SamplingParams(max_new_tokens=24, **sampling, **params))
    assert tokens == expected.outputs
    (plain,) = offline(tiny, [prompt], SamplingParams(max_new_tokens=24, **sampling))
    assert tokens != plain.outputs


def test_top_k_1_is_greedy_and_logit_bias_forces_a_token(served):
    prompt = [5, 6, 7, 8, 9]
    greedy = served_tokens(served, prompt, temperature=0, max_tokens=10, ignore_eos=True)
    assert (
        served_tokens(served, prompt, top_k=1, **{**SAMPLED, "max_tokens": 10}, ignore_eos=True)
        == greedy
    )
    forced = served_tokens(served, prompt, logit_bias={"33": 100}, **SAMPLED, ignore_eos=True)
    assert forced == [[33] * 12]


def test_stop_token_ids_ignore_eos_and_min_tokens(served):
    prompt = [11, 12, 13]
    (greedy,) = served_tokens(served, prompt, temperature=0, max_tokens=16, ignore_eos=True)
    assert len(greedy) == 16  # ignore_eos: the whole length, whatever the model says
    stop_at = greedy[5]
    first = greedy.index(stop_at)
    (stopped,) = served_tokens(
        served, prompt, temperature=0, max_tokens=16, ignore_eos=True, stop_token_ids=[stop_at]
    )
    assert stopped == greedy[: first + 1]  # the stop token is kept, as vLLM does
    (late,) = served_tokens(
        served,
        prompt,
        temperature=0,
        max_tokens=16,
        stop_token_ids=[stop_at],
        min_tokens=first + 2,
        ignore_eos=True,
    )
    assert len(late) >= first + 2 and stop_at not in late[: first + 2]
    answer = served.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "x"}],
        max_tokens=9,
        n=2,
        extra_body={"min_tokens": 9, "top_k": 50},
        seed=1,
    )
    assert answer.usage.completion_tokens == 18 and all(
        c.finish_reason == "length" for c in answer.choices
    )


# --------------------------------------------------------------------- load and faults


def test_32_concurrent_streams_equal_the_offline_engine(served, tiny):
    contents = [f"request {i}: " + "word " * (i % 7) for i in range(32)]
    lengths = [8 + (i * 5) % 17 for i in range(32)]
    steps_before = served.metrics()["paged_attention_engine_steps_total"]

    async def one(client, content: str, max_tokens: int) -> tuple[str, int]:
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": content}],
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        text, usage = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            usage = chunk.usage or usage
        return text, usage.completion_tokens

    async def everyone():
        async with served.async_client() as client:
            return await asyncio.gather(*(one(client, c, n) for c, n in zip(contents, lengths)))

    answers = asyncio.run(everyone())
    steps = served.metrics()["paged_attention_engine_steps_total"] - steps_before
    prompts = [chat_prompt(served.tokenizer, c) for c in contents]
    expected = offline(tiny, prompts, [SamplingParams(max_new_tokens=n) for n in lengths])
    assert [text for text, _ in answers] == [e.text for e in expected]
    assert [count for _, count in answers] == [len(e.outputs[0]) for e in expected]
    assert [served.recorded.of(p)[-1].outputs for p in prompts] == [e.outputs for e in expected]
    # continuous batching across HTTP requests: far fewer steps than one request at a time
    assert steps < sum(len(e.outputs[0]) for e in expected) / 4


def test_a_client_leaving_mid_stream_aborts_its_request(served, tiny):
    before = served.metrics()
    aborted_before = before.get('paged_attention_requests_finished_total{finish_reason="abort"}', 0)
    prompt = chat_prompt(served.tokenizer, "the others go on")
    (expected,) = offline(tiny, [prompt], SamplingParams(max_new_tokens=60))

    async def scenario():
        async with served.async_client() as client:
            return await leave_early(client)

    async def leave_early(client):
        other = asyncio.ensure_future(
            client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "the others go on"}],
                max_tokens=60,
                temperature=0,
            )
        )
        async with httpx.AsyncClient(base_url=served.url) as raw:
            body = chat(max_tokens=800, stream=True, temperature=0)
            async with raw.stream("POST", "/v1/chat/completions", json=body) as response:
                async for line in response.aiter_lines():
                    # the opening chunk comes with the request's first token (the tiny model's
                    # text, mostly invalid UTF-8, may hold back every later one)
                    if line.startswith("data: "):
                        assert json.loads(line[6:])["choices"][0]["delta"]["role"] == "assistant"
                        break  # the client goes away mid-stream
        gone = time.monotonic()
        while True:
            samples = served.metrics()
            key = 'paged_attention_requests_finished_total{finish_reason="abort"}'
            if samples.get(key, 0) == aborted_before + 1:
                break
            assert time.monotonic() - gone < 5, "the request was not aborted"
            await asyncio.sleep(0.01)
        return await other

    other = asyncio.run(scenario())
    assert other.choices[0].message.content == expected.text  # unaffected
    assert served.recorded.of(prompt)[-1].outputs == expected.outputs
    idle = wait_idle(served)
    assert idle["paged_attention_kv_blocks_used"] == 0
    generated = idle["paged_attention_generation_tokens_total"]
    # the abandoned request did not run its 800 tokens
    assert generated - before["paged_attention_generation_tokens_total"] < 800


def chat(**fields) -> dict:
    return {"messages": [{"role": "user", "content": "x"}], **fields}


CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
ERRORS = [  # (route, body, the param the error names)
    (CHAT, b'{"model": "tiny", "messages": [', None),  # invalid JSON
    (CHAT, b"[1, 2]", None),
    (CHAT, {"messages": "hello"}, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    (CHAT, {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    (CHAT, {"messages": []}, "messages"),
    (CHAT, {}, "messages"),
    (CHAT, chat(model="gpt-4"), "model"),
    (CHAT, chat(max_tokens="8"), "max_tokens"),
    (CHAT, chat(max_tokens=0), "max_tokens"),
    (CHAT, chat(max_completion_tokens=-1), "max_completion_tokens"),
    (CHAT, chat(max_tokens=10**6), "max_tokens"),
    (CHAT, chat(n=MAX_N + 1), "n"),
    (CHAT, chat(temperature=3), "temperature"),
    (CHAT, chat(top_p=0), "top_p"),
    (CHAT, chat(stop=[""]), "stop"),
    (CHAT, chat(stream_options={"include_usage": True}), "stream_options"),
    (CHAT, chat(presence_penalty=2.5), "presence_penalty"),
    (CHAT, chat(frequency_penalty="1"), "frequency_penalty"),
    (CHAT, chat(top_k=-2), "top_k"),
    (CHAT, chat(min_p=1.5), "min_p"),
    (CHAT, chat(repetition_penalty=0), "repetition_penalty"),
    (CHAT, chat(logit_bias={"abc": 1}), "logit_bias"),
    (CHAT, chat(logit_bias={"5": 101}), "logit_bias"),
    (CHAT, chat(logit_bias={str(10**7): 1}), "logit_bias"),
    (CHAT, chat(stop_token_ids=[-1]), "stop_token_ids"),
    (CHAT, chat(ignore_eos=1), "ignore_eos"),
    (CHAT, chat(max_tokens=4, min_tokens=5), "min_tokens"),
    (COMPLETIONS, {"prompt": "x", "min_tokens": -1}, "min_tokens"),
    (CHAT, chat(tools=[{"type": "function"}]), "tools[0].function"),
    (CHAT, chat(reasoning_effort="low"), "reasoning_effort"),
    (CHAT, chat(prediction={"type": "content", "content": "x"}), "prediction"),
    (CHAT, {"messages": [{"role": "user"}]}, "messages[0].content"),
    (CHAT, {"messages": [{"role": "user", "content": "x"}, 5]}, "messages[1]"),
    (
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        "messages[0].content[0].type",
    ),
    (CHAT, {"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
    (CHAT, {"messages": [{"role": "tool", "content": "4"}]}, "messages[0].tool_call_id"),
    (
        CHAT,
        {"messages": [{"role": "user", "content": "x", "tool_calls": []}]},
        "messages[0].tool_calls",
    ),
    (CHAT, chat(stop=["s"] * 65), "stop"),
    (COMPLETIONS, {"prompt": "x" * 5000}, "prompt"),
    (COMPLETIONS, {"prompt": [10**7]}, "prompt"),
    (COMPLETIONS, {"prompt": ""}, "prompt"),
    (COMPLETIONS, {"prompt": "x", "seed": 2**70}, "seed"),
]


@pytest.mark.parametrize("route, body, param", ERRORS)
def test_bad_requests_get_openai_errors(served, route, body, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(
        f"{served.url}{route}", content=content, headers={"content-type": "application/json"}
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param
    if param is not None:
        assert param.split("[")[0] in error["message"]


def test_errors_through_the_client_and_unknown_routes(served):
    client = served.client()
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], frequency_penalty=5.0
        )
    assert raised.value.body["param"] == "frequency_penalty"
    # neutral values of what is not carried out are accepted
    client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "x"}],
        max_tokens=2,
        frequency_penalty=0,
        presence_penalty=0.0,
        logprobs=False,
        user="someone",
    )
    for method, path, status in [
        ("GET", "/v1/nothing", 404),
        ("POST", "/v1/embeddings", 404),
        ("GET", "/v1/chat/completions", 405),
    ]:
        response = httpx.request(method, f"{served.url}{path}")
        assert response.status_code == status
        assert path in response.json()["error"]["message"]


def test_after_errors_the_server_serves_and_its_blocks_are_free(served):
    answer = served.client().completions.create(model=MODEL, prompt="still here", max_tokens=4)
    assert answer.usage.completion_tokens >= 1
    idle = wait_idle(served)
    assert idle["paged_attention_kv_blocks_used"] == 0
    assert idle["paged_attention_kv_blocks_free"] == idle["paged_attention_kv_blocks_total"]
    assert idle["paged_attention_kv_blocks_total"] == NUM_BLOCKS
    assert idle["paged_attention_time_to_first_token_seconds_count"] > 0
    assert idle["paged_attention_inter_token_latency_seconds_count"] > 0
    assert "paged_attention_prefix_cache_hit_rate" in idle
    assert "paged_attention_num_preemptions_total" in idle


def test_a_request_beyond_the_kv_pool_is_refused(tiny):
    model, tokenizer = tiny
    engine = make_engine(model, tokenizer, num_blocks=8)  # 128 tokens, in a 1024-token context
    live = LiveServer(create_app(engine, tokenizer, MODEL))
    try:
        client = live.client()
        with pytest.raises(openai.BadRequestError) as raised:
            client.completions.create(model=MODEL, prompt=list(range(3, 203)), max_tokens=4)
        assert raised.value.body["param"] == "prompt"
        with pytest.raises(openai.BadRequestError) as raised:
            client.completions.create(model=MODEL, prompt=[3, 4, 5], max_tokens=400)
        assert raised.value.body["param"] == "max_tokens"
        answer = client.completions.create(model=MODEL, prompt=[3, 4, 5], max_tokens=8)
        assert answer.usage.completion_tokens >= 1
    finally:
        live.stop()


def test_a_failing_engine_step_fails_its_requests_and_the_server_goes_on(tiny):
    model, tokenizer = tiny
    engine = make_engine(model, tokenizer)
    step = engine.step
    failures = [RuntimeError("injected")]

    def failing_step():
        if failures and engine.has_unfinished():
            raise failures.pop()
        return step()

    engine.step = failing_step
    live = LiveServer(create_app(engine, tokenizer, MODEL))
    try:
        client = live.client()
        with pytest.raises(openai.InternalServerError) as raised:
            client.completions.create(model=MODEL, prompt="fail", max_tokens=4)
        # the client is told what happened, not the engine's internals
        assert raised.value.body["message"] == ENGINE_FAILURE
        assert raised.value.body["code"] == "engine_error"
        answer = client.completions.create(model=MODEL, prompt="fine", max_tokens=4)
        assert answer.usage.completion_tokens >= 1
        assert wait_idle(live)["paged_attention_kv_blocks_used"] == 0
    finally:
        live.stop()


# --------------------------------------------------------------------- the command


def test_a_shutdown_lets_requests_finish_within_its_grace_and_aborts_the_rest(tiny):
    """What SIGINT/SIGTERM asks of the engine's owner: refuse new requests, let the running
    ones finish for the grace time, then abort the rest. Every step takes at least 5 ms here,
    so the 900-token stream cannot finish within the 2 s of grace, and the 20-token one does
    (unless a step takes 100 ms)."""
    model, tokenizer = tiny
    engine = make_engine(model, tokenizer)
    step = engine.step

    def slow_step():
        time.sleep(0.005)
        return step()

    engine.step = slow_step
    app = create_app(engine, tokenizer, MODEL)
    live = LiveServer(app)
    try:

        async def scenario():
            async with live.async_client() as client:
                return await shut_down_under(client)

        async def shut_down_under(client):
            # a stream's response starts with its request's first token: both are running
            long = await client.chat.completions.create(
                model=MODEL, stream=True, temperature=0, **chat(max_tokens=900)
            )
            short = await client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "short"}],
                max_tokens=20,
                temperature=0,
                stream=True,
            )
            app.state.owner.drain(2.0)
            with pytest.raises(openai.APIStatusError) as refused:
                await client.completions.create(model=MODEL, prompt="late", max_tokens=4)
            short_reasons = [c.choices[0].finish_reason async for c in short if c.choices]
            long_reasons = [c.choices[0].finish_reason async for c in long if c.choices]
            return short_reasons, refused.value, long_reasons

        short, refused, reasons = asyncio.run(scenario())
        assert short[-1] in ("stop", "length")
        assert refused.status_code == 503 and refused.body["code"] == "shutting_down"
        assert reasons[-1] == "abort"
        assert wait_idle(live)["paged_attention_kv_blocks_used"] == 0
    finally:
        live.stop()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_serve_command_shuts_down_gracefully_on_sigterm():
    """The command in this process's main thread (where signals arrive), a client in another
    thread: a short request is served, a long stream is aborted by the shutdown (no grace
    time) and ends properly, and the command returns exit status 0."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    seen = {}

    def client_side():
        try:
            deadline = time.monotonic() + 120
            while True:
                try:
                    if httpx.get(f"{url}/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, "the server did not start"
                time.sleep(0.05)
            with openai.OpenAI(
                base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60
            ) as client:
                seen["short"] = client.completions.create(model=MODEL, prompt="hi", max_tokens=3)
                with client.chat.completions.create(
                    model=MODEL, stream=True, temperature=0, **chat(max_tokens=900)
                ) as stream:
                    seen["first"] = next(iter(stream))  # the opening chunk, at the first token
                    os.kill(os.getpid(), signal.SIGTERM)
                    seen["reasons"] = [c.choices[0].finish_reason for c in stream if c.choices]
        finally:
            if "reasons" not in seen:
                os.kill(os.getpid(), signal.SIGINT)  # end the command whatever happened

    thread = threading.Thread(target=client_side)
    thread.start()
    status = cli_main(
        ["serve", "--model", MODEL, "--port", str(port), "--num-blocks", "64"]
        + ["--shutdown-timeout", "0", "--log-level", "warning"]
    )
    thread.join(30)
    assert status == 0
    with pytest.raises(httpx.ConnectError):  # no longer listening
        httpx.get(f"{url}/health")
    assert seen["short"].usage.completion_tokens >= 1
    assert seen["first"].choices[0].finish_reason is None
    assert seen["reasons"][-1] == "abort"  # ended by the shutdown, not by its 900 tokens


def test_serve_says_it_serves_only_once_it_listens(monkeypatch, capsys):
    """Defect 8: a client that connects when the "serving ... on URL" line appears is served."""
    port = free_port()
    seen = {}

    class Watch:
        """stdout that, at the serving line, connects to the URL it names."""

        def write(self, text: str) -> int:
            match = re.search(r"serving 'tiny' on http://127\.0\.0\.1:(\d+)", text)
            if match:
                seen["url port"] = int(match.group(1))
                with socket.create_connection(("127.0.0.1", int(match.group(1))), timeout=5):
                    seen["connected"] = True
                os.kill(os.getpid(), signal.SIGINT)
            return len(text)

        def flush(self) -> None:
            pass

        def isatty(self) -> bool:
            return False

    monkeypatch.setattr("sys.stdout", Watch())
    status = cli_main(
        ["serve", "--model", MODEL, "--port", str(port), "--num-blocks", "16"]
        + ["--log-level", "warning"]
    )
    assert status == 0
    assert seen == {"url port": port, "connected": True}


@pytest.mark.parametrize("host", ["127.0.0.1", "no-such-host.invalid"])
def test_an_address_that_cannot_be_had_exits_1_before_the_model_loads(host, monkeypatch, capsys):
    """Defect 10: a port in use or an unknown --host: one line, exit status 1, and the model
    never loads."""

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the address was bound")

    monkeypatch.setattr("paged_attention.modeling.models.load_model", no_loading)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        status = cli_main(["serve", "--model", MODEL, "--host", host, "--port", str(port)])
    assert status == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert err.startswith("paged-attention serve: error: ")
    assert ("--host" in err) if host != "127.0.0.1" else (f"127.0.0.1:{port}" in err)


def test_serve_of_a_model_without_a_tokenizer_is_a_usage_error_and_leaves_no_process(
    tmp_path, capsys
):
    """serve's own process reads the tokenizer while the engine's loads the model: a model
    directory without one is refused with one line (exit status 2), the engine's process
    stopped rather than left loading."""
    import psutil

    from paged_attention.modeling.tiny import tiny_llama

    tiny_llama().save_pretrained(tmp_path / "bare")
    before = {child.pid for child in psutil.Process().children(recursive=True)}
    with pytest.raises(SystemExit) as raised:
        cli_main(["serve", "--model", str(tmp_path / "bare"), "--port", "0"])
    assert raised.value.code == 2
    error = capsys.readouterr().err
    assert "has no tokenizer, which the server needs" in error and "Traceback" not in error
    # the engine's process (spawned here, inside the tests' process), not multiprocessing's
    # resource tracker, which outlives it by design
    engines = [
        child
        for child in psutil.Process().children(recursive=True)
        if child.pid not in before and "resource_tracker" not in " ".join(child.cmdline())
    ]
    assert all(child.status() == psutil.STATUS_ZOMBIE for child in engines), engines


@pytest.mark.parametrize(
    "arguments, option",
    [
        (["--max-n", "100"], "--max-n"),  # beyond --max-num-seqs
        (["--max-model-len", "100000"], "--max-model-len"),
        (["--kv-memory", "0.000001"], "--kv-memory"),
        (["--port", "70000"], "--port"),
        (["--allowed-origins", "evil.example"], "--allowed-origins"),
        (["--max-waiting-requests", "0"], "--max-waiting-requests"),
        (["--max-request-bytes", "-1"], "--max-request-bytes"),
        (["--api-key", " "], "--api-key"),
    ],
)
def test_serve_command_refuses_bad_arguments(arguments, option, capsys):
    with pytest.raises(SystemExit) as raised:
        cli_main(["serve", "--model", MODEL, "--num-blocks", "16", *arguments])
    assert raised.value.code == 2
    error = capsys.readouterr().err
    assert option in error and "Traceback" not in error


def test_serve_speculative_ngram_drafts_and_keeps_the_greedy_answer(tiny, monkeypatch, tmp_path):
    import argparse

    from paged_attention.cli import serve

    monkeypatch.setenv("PAGED_ATTENTION_CACHE", str(tmp_path))  # a cold compile cache: eager
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    base = ["--model", MODEL, "--num-blocks", "32"]
    plain = serve.build_engine(*tiny, parser.parse_args(base))
    speculative = serve.build_engine(*tiny, parser.parse_args([*base, "--speculative-ngram", "3"]))
    assert plain.scheduler.drafts.config is None
    assert speculative.scheduler.drafts.config.num_speculative_tokens == 3
    prompt = list(range(10, 20)) * 4  # a prompt the answer can repeat: drafts to verify
    params = SamplingParams(max_new_tokens=24)
    (expected,), (drafted,) = (
        plain.generate([prompt], params),
        speculative.generate([prompt], params),
    )
    assert drafted.outputs == expected.outputs
    assert speculative.stats.draft_tokens > 0

    # a draft model: the tiny model drafting for itself (another instance), 2 tokens a step
    options = [*base, "--speculative-model", MODEL, "--num-speculative-tokens", "2"]
    drafting = serve.build_engine(*tiny, parser.parse_args(options))
    config = drafting.scheduler.drafts.config
    assert config.method == "draft_model" and config.num_speculative_tokens == 2
    assert config.draft_model is not tiny[0]
    (drafted,) = drafting.generate([prompt], params)
    assert drafted.outputs == expected.outputs
    assert drafting.stats.draft_tokens > 0
    assert drafting.stats.accepted_draft_tokens > 0


def test_serve_compile_compiles_every_batch_size_before_serving(tiny, tmp_path, monkeypatch):
    # --compile compiles (and caches); then the default compiles too, the cache being warm
    import argparse

    from paged_attention.cli import serve

    monkeypatch.setenv("PAGED_ATTENTION_CACHE", str(tmp_path))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(["--model", MODEL, "--num-blocks", "16", "--max-num-seqs", "1"])
    eager = serve.build_engine(*tiny, args)
    assert eager.runner.graphs is None  # the default, with a cold cache
    args.compile = True
    engine = serve.build_engine(*tiny, args)
    assert list(engine.runner.graphs.compile_seconds) == [1]  # before any request
    args.compile = None
    assert list(serve.build_engine(*tiny, args).runner.graphs.compile_seconds) == [1]
    prompt = chat_prompt(tiny[1], "Hello")
    params = SamplingParams(max_new_tokens=6)
    (compiled,), (expected,) = engine.generate([prompt], params), eager.generate([prompt], params)
    assert compiled.outputs == expected.outputs


STARTUP_IMPORTS = """
import asyncio, sys
from paged_attention.engine import Engine
from paged_attention.modeling.models import load_model
from paged_attention.server import create_app

model, tokenizer = load_model("tiny")
app = create_app(Engine(model, tokenizer=tokenizer, num_blocks=16), tokenizer, "tiny")
backend = "anyio._backends._asyncio"
before = backend in sys.modules


async def started():
    async with app.router.lifespan_context(app):
        return backend in sys.modules


print(before, asyncio.run(started()))
"""


def test_startup_imports_what_the_first_streamed_answer_needs():
    # a fresh interpreter: this one imported anyio's backend long ago
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    command = [sys.executable, "-c", STARTUP_IMPORTS]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "True"]


def test_serve_warms_the_engine_up_before_serving(tiny, tmp_path, monkeypatch, caplog):
    import argparse
    import logging

    from paged_attention.cli import serve

    monkeypatch.setenv("PAGED_ATTENTION_CACHE", str(tmp_path))  # a cold compile cache: eager
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(["--model", MODEL, "--num-blocks", "16"])
    with caplog.at_level(logging.INFO):
        engine = serve.build_engine(*tiny, args)
    assert any("engine warmed up" in record.message for record in caplog.records)
    assert engine.stats.steps == 0 and engine.stats.generated_tokens == 0  # forgotten
    free = engine.block_manager.num_free_device_blocks()
    assert free == engine.block_manager.num_device_blocks


# --------------------------------------------------------------------- the docs

DOCS = Path(__file__).resolve().parent.parent / "docs" / "server.md"


def docs_blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", DOCS.read_text(), re.S | re.M)


def docs_curl_commands() -> list[str]:
    commands = []
    for block in docs_blocks("bash"):
        for command in block.replace("\\\n", " ").splitlines():
            if command.startswith("curl "):
                commands.append(command)
    return commands


def test_the_docs_examples_run_against_a_server(served, tiny, capsys, monkeypatch):
    """docs/server.md's client examples and curl commands, against live servers (one with a
    key): its URL and model name replaced by theirs."""
    model, tokenizer = tiny
    keyed = LiveServer(
        create_app(make_engine(model, tokenizer, num_blocks=16), tokenizer, MODEL, api_key="k-123"),
        api_key="k-123",
    )
    monkeypatch.setenv("PAGED_ATTENTION_API_KEY", "k-123")
    try:
        python = docs_blocks("python")
        assert len(python) == 3
        for code in python:
            live = served
            code = code.replace("http://127.0.0.1:8000", live.url).replace(
                '"smollm2"', f'"{MODEL}"'
            )
            exec(compile(code, str(DOCS), "exec"), {"__name__": "docs_example"})
        curls = docs_curl_commands()
        assert len(curls) == 5
        for command in curls:
            live = keyed if "PAGED_ATTENTION_API_KEY" in command else served
            command = command.replace("http://127.0.0.1:8000", live.url)
            command = command.replace("curl ", "curl --fail-with-body -sS ", 1)
            result = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=60)
            assert result.returncode == 0, (command, result.stdout, result.stderr)
            assert result.stdout.strip()
    finally:
        keyed.stop()


# --------------------------------------------------------------------- the real model


def test_real_model_answers_a_chat_and_stops_at_a_stop_string():
    model, tokenizer = load_model("smollm2")
    engine = Engine(model, tokenizer=tokenizer, num_blocks=64, block_size=BLOCK_SIZE)
    live = LiveServer(create_app(engine, tokenizer, "smollm2"))
    try:
        client = live.client()
        request = dict(
            model="smollm2",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=24,
            temperature=0,
        )
        answer = client.chat.completions.create(**request)
        text = answer.choices[0].message.content
        assert "Paris" in text
        assert answer.choices[0].finish_reason in ("stop", "length")
        # The text ends before the first stop string met; the rest is not generated.
        stopped = client.chat.completions.create(**request, stop=["Paris", "Lyon"])
        assert stopped.choices[0].message.content == text[: text.index("Paris")]
        assert stopped.choices[0].finish_reason == "stop"
        assert stopped.usage.completion_tokens < answer.usage.completion_tokens
        streamed = list(client.chat.completions.create(**request, stop="Paris", stream=True))
        assert (
            "".join(c.choices[0].delta.content or "" for c in streamed)
            == (text[: text.index("Paris")])
        )
        assert streamed[-1].choices[0].finish_reason == "stop"
        assert len(streamed) > 3  # the role, then text step by step, not in one piece
    finally:
        live.stop()
