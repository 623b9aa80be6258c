"""What the server checks before any work (:mod:`paged_attention.server.security`) and how it
bears load: the API key, JSON-only bodies, CORS, the body limit, the waiting-room bound (429),
and tokenization off the event loop, on live servers over the tiny model."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

pytest.importorskip("transformers")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from test_server import MODEL, LiveServer, make_engine  # noqa: E402

from paged_attention.cli import serve  # noqa: E402
from paged_attention.modeling.models import load_model  # noqa: E402
from paged_attention.server import app as server_app  # noqa: E402
from paged_attention.server import create_app, security  # noqa: E402

KEY = "sk-test-0123456789"
GOOD_ORIGIN = "http://good.example"
MAX_BYTES = 4096
CHAT = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def tiny():
    return load_model(MODEL)


@pytest.fixture(scope="module")
def guarded(tiny):
    model, tokenizer = tiny
    engine = make_engine(model, tokenizer)
    app = create_app(
        engine,
        tokenizer,
        MODEL,
        api_key=KEY,
        allowed_origins=[GOOD_ORIGIN],
        max_request_bytes=MAX_BYTES,
    )
    live = LiveServer(app, api_key=KEY)
    yield live
    live.stop()


def assert_openai_error(response: httpx.Response, status: int, code: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code and error["message"]
    return error


def post(live: LiveServer, path: str, **options) -> httpx.Response:
    headers = {"authorization": f"Bearer {KEY}", **options.pop("headers", {})}
    return httpx.post(f"{live.url}{path}", headers=headers, timeout=60, **options)


def test_the_api_key_is_required_except_for_health(guarded):
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": KEY}):
        response = httpx.post(f"{guarded.url}/v1/chat/completions", json=CHAT, headers=headers)
        assert_openai_error(response, 401, "invalid_api_key")
        assert response.headers["www-authenticate"] == "Bearer"
    for path in ("/v1/models", "/metrics"):
        assert_openai_error(httpx.get(f"{guarded.url}{path}"), 401, "invalid_api_key")
    assert httpx.get(f"{guarded.url}/health").json() == {"status": "ok"}
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{guarded.url}/v1", api_key="wrong", max_retries=0).models.list()
    answer = guarded.client().chat.completions.create(model=MODEL, **CHAT)  # the right key
    assert answer.usage.completion_tokens >= 1


@pytest.mark.parametrize(
    "content_type", [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data"]
)
def test_bodies_that_are_not_json_are_refused_before_any_work(guarded, content_type):
    """Defect 12: a web page's "simple" cross-origin POST (no preflight) cannot drive it."""
    before = guarded.metrics()["paged_attention_prompt_tokens_total"]
    headers = {} if content_type is None else {"content-type": content_type}
    for path in ("/v1/chat/completions", "/v1/completions"):
        body = json.dumps({**CHAT, "prompt": "x"}).encode()
        response = post(guarded, path, content=body, headers=headers)
        assert_openai_error(response, 415, "unsupported_media_type")
    assert guarded.metrics()["paged_attention_prompt_tokens_total"] == before
    # a charset parameter is fine
    response = post(
        guarded,
        "/v1/chat/completions",
        content=json.dumps(CHAT).encode(),
        headers={"content-type": "application/json; charset=utf-8"},
    )
    assert response.status_code == 200


def test_cors_answers_only_the_allowed_origins(guarded, tiny):
    preflight = {"access-control-request-method": "POST"}
    allowed = httpx.options(
        f"{guarded.url}/v1/chat/completions", headers={"origin": GOOD_ORIGIN, **preflight}
    )
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == GOOD_ORIGIN
    other = httpx.options(
        f"{guarded.url}/v1/chat/completions", headers={"origin": "http://evil.example", **preflight}
    )
    assert "access-control-allow-origin" not in other.headers
    # without --allowed-origins no origin is allowed
    model, tokenizer = tiny
    live = LiveServer(create_app(make_engine(model, tokenizer, num_blocks=16), tokenizer, MODEL))
    try:
        closed = httpx.options(
            f"{live.url}/v1/chat/completions", headers={"origin": GOOD_ORIGIN, **preflight}
        )
        assert "access-control-allow-origin" not in closed.headers
    finally:
        live.stop()


def test_bodies_over_the_limit_get_413(guarded):
    big = json.dumps({**CHAT, "messages": [{"role": "user", "content": "x" * MAX_BYTES}]})
    response = post(
        guarded,
        "/v1/chat/completions",
        content=big.encode(),
        headers={"content-type": "application/json"},
    )
    assert_openai_error(response, 413, "request_too_large")

    def chunked():  # no content-length: counted as it arrives
        for start in range(0, len(big), 1000):
            yield big[start : start + 1000].encode()

    response = post(
        guarded,
        "/v1/chat/completions",
        content=chunked(),
        headers={"content-type": "application/json"},
    )
    assert_openai_error(response, 413, "request_too_large")
    answer = guarded.client().chat.completions.create(model=MODEL, **CHAT)  # still serving
    assert answer.usage.completion_tokens >= 1


def test_beyond_the_waiting_requests_the_server_answers_429_not_500(tiny):
    """The engine is held still, so nothing starts: the first two requests wait, every later
    one is refused at once with Retry-After; once the engine moves, the two are served."""
    model, tokenizer = tiny
    engine = make_engine(model, tokenizer)
    go = threading.Event()
    step = engine.step

    def held_step():
        go.wait(60)
        return step()

    engine.step = held_step
    live = LiveServer(create_app(engine, tokenizer, MODEL, max_waiting_requests=2))
    try:

        async def scenario():
            async with httpx.AsyncClient(base_url=live.url, timeout=60) as client:
                waiting = [
                    asyncio.ensure_future(client.post("/v1/chat/completions", json=CHAT))
                    for _ in range(2)
                ]
                while server_app_waiting(live) < 2:
                    await asyncio.sleep(0.01)
                refused = await asyncio.gather(
                    *(client.post("/v1/chat/completions", json=CHAT) for _ in range(5))
                )
                go.set()
                return await asyncio.gather(*waiting), refused

        served, refused = asyncio.run(scenario())
        assert [r.status_code for r in served] == [200, 200]
        for response in refused:
            error = assert_openai_error(response, 429, "rate_limit_exceeded")
            assert "overloaded" in error["message"]
            assert response.headers["retry-after"] == "1"
        with pytest.raises(openai.RateLimitError):  # how the official client sees it
            go.clear()
            flood(live)
        go.set()
    finally:
        go.set()
        live.stop()


def server_app_waiting(live: LiveServer) -> int:
    return live.server.config.app.state.server.waiting.waiting


def flood(live: LiveServer) -> None:
    async def requests():
        async with live.async_client() as client:
            await asyncio.gather(
                *(client.chat.completions.create(model=MODEL, **CHAT) for _ in range(4))
            )

    asyncio.run(requests())


def test_a_huge_prompt_does_not_stall_other_clients_streams(tiny):
    """Defect 1: while a 1.5 MB prompt is tokenized (seconds), a stream already running keeps
    getting its events and /health answers; the prompt is then refused as too long."""
    model, tokenizer = tiny
    engine = make_engine(model, tokenizer)
    live = LiveServer(create_app(engine, tokenizer, MODEL))
    try:
        huge = "hello world " * 125_000

        async def read(lines, events: list[float]) -> None:
            async for line in lines:
                if line.startswith("data: "):
                    events.append(time.monotonic())

        async def ping(client, pings: list[float]) -> None:
            while True:
                sent = time.monotonic()
                assert (await client.get("/health")).status_code == 200
                pings.append(time.monotonic() - sent)
                await asyncio.sleep(0.05)

        async def scenario():
            async with httpx.AsyncClient(base_url=live.url, timeout=120) as client:
                events: list[float] = []
                pings: list[float] = []
                body = {**CHAT, "max_tokens": 900, "stream": True, "temperature": 0}
                async with client.stream("POST", "/v1/chat/completions", json=body) as stream:
                    reader = asyncio.ensure_future(read(stream.aiter_lines(), events))
                    while not events:  # the stream runs
                        await asyncio.sleep(0.01)
                    pinger = asyncio.ensure_future(ping(client, pings))
                    start = time.monotonic()
                    refused = await client.post(
                        "/v1/completions", json={"prompt": huge, "max_tokens": 1}
                    )
                    end = time.monotonic()
                    assert not reader.done(), "the stream ended before the huge prompt did"
                    reader.cancel()
                    pinger.cancel()
                return refused, start, end, events, pings

        refused, start, end, events, pings = asyncio.run(scenario())
        assert_openai_error(refused, 400, "context_length_exceeded")
        during = [start] + [t for t in events if start <= t <= end] + [end]
        longest_gap = max(b - a for a, b in zip(during, during[1:]))
        # tokenized on the event loop, the whole wait would be one gap
        assert longest_gap < (end - start) / 2, (longest_gap, end - start)
        assert max(pings) < (end - start) / 2
    finally:
        live.stop()


def test_the_command_and_the_app_share_their_defaults():
    assert serve.DEFAULT_MAX_REQUEST_BYTES == security.DEFAULT_MAX_REQUEST_BYTES
    assert serve.DEFAULT_MAX_WAITING_REQUESTS == server_app.DEFAULT_MAX_WAITING_REQUESTS


def test_bad_limits_are_refused(tiny):
    model, tokenizer = tiny
    engine = make_engine(model, tokenizer, num_blocks=16)
    with pytest.raises(ValueError, match="max_waiting_requests"):
        create_app(engine, tokenizer, MODEL, max_waiting_requests=0)
    with pytest.raises(ValueError, match="max_request_bytes"):
        create_app(engine, tokenizer, MODEL, max_request_bytes=0)
    with pytest.raises(ValueError, match="api_key"):
        create_app(engine, tokenizer, MODEL, api_key="")
    with pytest.raises(ValueError, match="api_key"):
        security.RequestGuard(None, api_key="", max_request_bytes=10, json_paths=frozenset())


def test_the_key_comes_from_the_environment_unless_given(monkeypatch):
    import argparse

    def parsed(*argv):
        parser = argparse.ArgumentParser()
        serve.add_arguments(parser)
        return parser.parse_args(list(argv))

    monkeypatch.delenv(serve.API_KEY_VARIABLE, raising=False)
    assert parsed().api_key is None
    monkeypatch.setenv(serve.API_KEY_VARIABLE, "from-env")
    assert parsed().api_key == "from-env"
    assert parsed("--api-key", "given").api_key == "given"
    monkeypatch.setenv(serve.API_KEY_VARIABLE, "")  # set but empty: no key
    assert parsed().api_key is None
    assert parsed(
        "--allowed-origins", "http://a.example, https://b.example:8443"
    ).allowed_origins == [
        "http://a.example",
        "https://b.example:8443",
    ]
