"""Log probabilities through the server (paged_attention/server/logprobs.py, answers.py): chat's
``logprobs.content`` and the legacy completions' ``logprobs``, ``echo`` with ``max_tokens: 0``
(what lm-eval's ``local-completions`` sends for loglikelihoods) and batches of prompts, through
the official ``openai`` client against a live server on the tiny model in float32, checked
against transformers' float32 log-softmax of the same tokens."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import torch

pytest.importorskip("transformers")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from test_server import LiveServer, Recorder, chat_prompt, make_engine, wait_idle  # noqa: E402

from paged_attention.engine import Logprob  # noqa: E402
from paged_attention.modeling.models import load_model  # noqa: E402
from paged_attention.modeling.tiny import byte_tokenizer  # noqa: E402
from paged_attention.server import create_app  # noqa: E402
from paged_attention.server.logprobs import (  # noqa: E402
    LOGPROB_FLOOR,
    CompletionLogprobs,
    TokenPieces,
    chat_content,
)

MODEL = "tiny"
TOLERANCE = 2e-3
SPECIAL_TOKENS = 256  # the byte tokenizer's ids from here on are special tokens


@pytest.fixture(scope="module")
def served():
    model, tokenizer = load_model(MODEL, dtype="float32")
    engine = make_engine(model, tokenizer)
    live = LiveServer(create_app(engine, tokenizer, MODEL, max_n=4))
    live.tokenizer = tokenizer
    live.recorded = Recorder(engine)
    yield live
    live.stop()


@pytest.fixture(scope="module")
def reference():
    """transformers' float32 log-softmax at every position of a token list, from its own copy
    of the tiny model (seeded weights) with sdpa attention and no cache."""
    model, _ = load_model(MODEL, dtype="float32")
    model.set_attn_implementation("sdpa")

    def logprobs(tokens: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return model(torch.tensor([tokens]), use_cache=False).logits[0].float().log_softmax(-1)

    return logprobs


def assert_top_logprobs(alternatives, row: torch.Tensor, chosen: int, count: int) -> None:
    """``alternatives`` (``(token id, logprob)``) are ``row``'s ``count`` most likely tokens,
    by likelihood, and hold ``chosen`` when it surely ranks among them."""
    values = [value for _, value in alternatives]
    assert values == sorted(values, reverse=True) and len(values) == count
    kth = row.topk(count).values[-1].item()
    for token, value in alternatives:
        assert value == pytest.approx(row[token].item(), abs=TOLERANCE)
        assert row[token].item() >= kth - TOLERANCE
    if row[chosen].item() > kth + TOLERANCE:
        assert chosen in [token for token, _ in alternatives]


def token_id(piece, tokenizer) -> int:
    """A token's id: a byte's from its ``bytes`` (token ``b`` is byte ``b``), a special
    token's from its text."""
    if len(piece.bytes) == 1:
        return piece.bytes[0]
    return tokenizer.convert_tokens_to_ids(piece.token)


# --------------------------------------------------------------------- chat


def test_chat_logprobs_equal_transformers(served, reference):
    content = "logprobs, please"
    answer = served.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": content}],
        max_tokens=12,
        temperature=1.0,
        seed=11,
        logprobs=True,
        top_logprobs=5,
    )
    prompt = chat_prompt(served.tokenizer, content)
    (final,) = served.recorded.of(prompt)
    tokens = final.outputs[0]
    entries = answer.choices[0].logprobs.content
    assert len(entries) == len(tokens) > 0
    rows = reference(prompt + tokens)[len(prompt) - 1 :]
    for entry, token, row in zip(entries, tokens, rows):
        assert entry.logprob == pytest.approx(row[token].item(), abs=TOLERANCE)
        assert entry.token == served.tokenizer.decode([token])
        if token < SPECIAL_TOKENS:
            assert entry.bytes == [token]
        tops = entry.top_logprobs
        alternatives = [(token_id(top, served.tokenizer), top.logprob) for top in tops]
        assert_top_logprobs(alternatives, row, token, 5)


def test_chat_stream_carries_each_tokens_logprobs_once(served):
    fields = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "stream them"}],
        max_tokens=10,
        temperature=1.0,
        seed=3,
        n=2,
        logprobs=True,
        top_logprobs=2,
    )
    client = served.client()
    whole = client.chat.completions.create(**fields)
    streamed = {0: [], 1: []}
    texts = {0: "", 1: ""}
    for chunk in client.chat.completions.create(stream=True, **fields):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.logprobs is not None:
                streamed[choice.index] += choice.logprobs.content
    for choice in whole.choices:
        assert texts[choice.index] == choice.message.content
        expected = choice.logprobs.content
        got = streamed[choice.index]
        assert [e.bytes for e in got] == [e.bytes for e in expected]
        for a, b in zip(got, expected):
            assert a.logprob == pytest.approx(b.logprob, abs=TOLERANCE)
            assert len(a.top_logprobs) == 2


def test_chat_without_logprobs_has_none(served):
    client = served.client()
    for fields in ({"logprobs": False}, {"top_logprobs": 0}, {}):
        answer = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2, **fields
        )
        assert answer.choices[0].logprobs is None
    answer = client.chat.completions.create(  # two tokens even where the sample is the end
        model=MODEL,
        messages=[{"role": "user", "content": "x"}],
        max_tokens=2,
        logprobs=True,
        extra_body={"ignore_eos": True},
    )
    assert [entry.top_logprobs for entry in answer.choices[0].logprobs.content] == [[], []]


def test_shapes_floor_and_same_text_tokens():
    """The shapes' rules without a server: -inf is sent as -9999.0, a completion's
    ``top_logprobs`` keeps the likelier of two tokens of the same text, chat's
    ``top_logprobs`` holds only tokens that rank, and byte-level tokens show their raw bytes
    (a lone byte of a multi-byte character shows as U+FFFD)."""
    pieces = TokenPieces(byte_tokenizer())
    entry = {0xC3: Logprob(float("-inf"), 250), 0xA9: Logprob(-0.5, 1), 0xC2: Logprob(-1.0, 2)}
    (content,) = chat_content(pieces, [0xC3], [entry], 2)
    assert content["logprob"] == LOGPROB_FLOOR and content["bytes"] == [0xC3]
    assert content["token"] == "\ufffd"
    assert [t["bytes"] for t in content["top_logprobs"]] == [[0xA9], [0xC2]]
    legacy = CompletionLogprobs(pieces).piece([0xC3, 104], [None, entry | {104: Logprob(-7, 9)}])
    assert legacy["token_logprobs"] == [None, -7]
    assert legacy["top_logprobs"] == [None, {"\ufffd": -0.5, "h": -7}]
    assert legacy["text_offset"] == [0, 1]


# --------------------------------------------------------------------- completions


def test_completion_logprobs_equal_transformers(served, reference):
    text = "The legacy shape"
    answer = served.client().completions.create(
        model=MODEL, prompt=text, max_tokens=8, temperature=0, logprobs=3
    )
    prompt = served.tokenizer(text)["input_ids"]
    (final,) = served.recorded.of(prompt)
    tokens = final.outputs[0]
    logprobs = answer.choices[0].logprobs
    assert logprobs.tokens == [served.tokenizer.decode([t]) for t in tokens]
    rows = reference(prompt + tokens)[len(prompt) - 1 :]
    offset = 0
    for i, (token, row) in enumerate(zip(tokens, rows)):
        assert logprobs.token_logprobs[i] == pytest.approx(row[token].item(), abs=TOLERANCE)
        top = logprobs.top_logprobs[i]
        # greedy: the chosen token is the most likely, and the dict holds the 3 most likely
        assert max(top.values()) == logprobs.token_logprobs[i]
        assert list(top.values()) == sorted(top.values(), reverse=True)
        assert 1 <= len(top) <= 3
        assert logprobs.text_offset[i] == offset
        offset += len(logprobs.tokens[i])


def test_echo_with_max_tokens_0_gives_the_prompts_logprobs(served, reference):
    """lm-eval's ``local-completions`` loglikelihood request: token-id prompts, echo,
    max_tokens 0, logprobs."""
    tokenizer = served.tokenizer
    prompts = [tokenizer("Question: 2+2? Answer: 4")["input_ids"], tokenizer("short")["input_ids"]]
    answer = served.client().completions.create(
        model=MODEL, prompt=prompts, echo=True, max_tokens=0, logprobs=5, temperature=0
    )
    assert [c.index for c in answer.choices] == [0, 1]
    assert answer.usage.completion_tokens == 0
    assert answer.usage.prompt_tokens == sum(len(p) for p in prompts)
    for choice, prompt in zip(answer.choices, prompts):
        assert choice.text == tokenizer.decode(prompt)
        assert choice.finish_reason == "length"
        logprobs = choice.logprobs
        assert logprobs.tokens == [tokenizer.decode([t]) for t in prompt]
        assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
        rows = reference(prompt)
        for i in range(1, len(prompt)):
            value = rows[i - 1][prompt[i]].item()
            assert logprobs.token_logprobs[i] == pytest.approx(value, abs=TOLERANCE)
            top = logprobs.top_logprobs[i]
            assert list(top.values()) == sorted(top.values(), reverse=True)
            assert max(top.values()) == pytest.approx(rows[i - 1].max().item(), abs=TOLERANCE)


def test_echo_with_one_token_scores_the_prompt_and_the_token(served, reference):
    """lm-eval's newer payload: echo, max_tokens 1, the last entry being the generated token
    (lm-eval drops it, ``[ctxlen:-1]``)."""
    tokenizer = served.tokenizer
    prompt = tokenizer("the cat sat")["input_ids"]
    answer = served.client().completions.create(
        model=MODEL, prompt=[prompt], echo=True, max_tokens=1, logprobs=1, temperature=0
    )
    (choice,) = answer.choices
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(prompt) + 1
    assert choice.text.startswith(tokenizer.decode(prompt))
    rows = reference(prompt)
    expected = sum(rows[i - 1][prompt[i]].item() for i in range(1, len(prompt)))
    assert sum(logprobs.token_logprobs[1:-1]) == pytest.approx(expected, abs=TOLERANCE * 4)
    greedy = rows[-1].max().item()
    assert logprobs.token_logprobs[-1] == pytest.approx(greedy, abs=TOLERANCE)
    assert answer.usage.completion_tokens == 1


def test_concurrent_scoring_requests_of_the_async_client(served, reference):
    """lm-eval sends its loglikelihood requests concurrently: each answer is its own prompt's
    logprobs, whatever ran beside it."""
    tokenizer = served.tokenizer
    texts = ["alpha beta", "gamma", "delta epsilon zeta", "eta theta", "iota", "kappa lambda"]
    prompts = [tokenizer(text)["input_ids"] for text in texts]

    async def score_all():
        client = served.async_client()
        requests = [
            client.completions.create(
                model=MODEL, prompt=[prompt], echo=True, max_tokens=0, logprobs=1
            )
            for prompt in prompts
        ]
        return await asyncio.gather(*requests)

    for answer, prompt in zip(asyncio.run(score_all()), prompts):
        rows = reference(prompt)
        expected = [rows[i - 1][prompt[i]].item() for i in range(1, len(prompt))]
        assert answer.choices[0].logprobs.token_logprobs[1:] == pytest.approx(
            expected, abs=TOLERANCE
        )


def test_a_batch_of_prompts_answers_as_single_prompts(served):
    client = served.client()
    fields = dict(model=MODEL, max_tokens=5, temperature=1.0, seed=5, n=2, logprobs=2)
    prompts = ["first prompt", "a second one", "3"]
    batch = client.completions.create(prompt=prompts, **fields)
    assert [c.index for c in batch.choices] == list(range(6))
    total = 0
    for p, prompt in enumerate(prompts):
        single = client.completions.create(prompt=prompt, **fields)
        total += single.usage.total_tokens
        for s, choice in enumerate(single.choices):
            batched = batch.choices[p * 2 + s]
            assert batched.text == choice.text
            assert batched.logprobs.tokens == choice.logprobs.tokens
            assert batched.logprobs.token_logprobs == pytest.approx(
                choice.logprobs.token_logprobs, abs=TOLERANCE
            )
    assert batch.usage.total_tokens == total


def test_a_streamed_batch_with_echo_adds_up_to_the_whole_answer(served):
    client = served.client()
    fields = dict(
        model=MODEL,
        prompt=[[104, 105, 33], [116, 119, 111]],
        max_tokens=4,
        temperature=0,
        echo=True,
        logprobs=2,
    )
    whole = client.completions.create(**fields)
    texts, pieces = {}, {}
    for chunk in client.completions.create(stream=True, **fields):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.logprobs is not None:
                parts = pieces.setdefault(choice.index, {"tokens": [], "text_offset": []})
                parts["tokens"] += choice.logprobs.tokens
                parts["text_offset"] += choice.logprobs.text_offset
    for choice in whole.choices:
        assert texts[choice.index] == choice.text
        assert pieces[choice.index]["tokens"] == choice.logprobs.tokens
        assert pieces[choice.index]["text_offset"] == choice.logprobs.text_offset


def test_echo_without_logprobs_and_a_streamed_prompt_only_answer(served):
    client = served.client()
    answer = client.completions.create(model=MODEL, prompt="echo me", echo=True, max_tokens=0)
    assert answer.choices[0].text == "echo me" and answer.choices[0].logprobs is None
    chunks = list(
        client.completions.create(
            model=MODEL, prompt="echo me", echo=True, max_tokens=0, logprobs=0, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "echo me"
    (last,) = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert last.choices[0].finish_reason == "length"


# --------------------------------------------------------------------- errors

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "x"}]

BAD_VALUES = [
    (CHAT, {"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
    (CHAT, {"messages": MESSAGES, "logprobs": False, "top_logprobs": 1}, "top_logprobs"),
    (CHAT, {"messages": MESSAGES, "top_logprobs": -1}, "top_logprobs"),
    (CHAT, {"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (CHAT, {"messages": MESSAGES, "logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    (CHAT, {"messages": MESSAGES, "logprobs": 1}, "logprobs"),
    (COMPLETIONS, {"prompt": "x", "logprobs": 21}, "logprobs"),
    (COMPLETIONS, {"prompt": "x", "logprobs": True}, "logprobs"),
    (COMPLETIONS, {"prompt": "x", "echo": "yes"}, "echo"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": -1, "echo": True}, "max_tokens"),
    (COMPLETIONS, {"prompt": ["x", ""]}, "prompt"),
    (COMPLETIONS, {"prompt": [[1, 2], []]}, "prompt"),
    (COMPLETIONS, {"prompt": []}, "prompt"),
    (COMPLETIONS, {"prompt": ["x"] * 65}, "prompt"),
    (COMPLETIONS, {"prompt": [[1], [10**7]], "echo": True}, "prompt"),
    (COMPLETIONS, {"prompt": [[1], [10**7]]}, "prompt"),
]


@pytest.mark.parametrize("route, body, param", BAD_VALUES)
def test_bad_logprob_values_get_400_naming_the_field(served, route, body, param):
    response = httpx.post(
        f"{served.url}{route}",
        content=json.dumps({"max_tokens": 2, **body}).encode(),
        headers={"content-type": "application/json"},
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert param in error["message"]


def test_a_batch_the_engine_refuses_in_part_leaves_nothing_running(served):
    """The second prompt is refused after the first started: the first is aborted."""
    response = httpx.post(
        f"{served.url}{COMPLETIONS}",
        json={"prompt": [[104] * 40, [10**7]], "max_tokens": 200, "ignore_eos": True},
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"
    samples = wait_idle(served)
    assert samples["paged_attention_kv_blocks_used"] == 0


def test_a_client_leaving_a_streamed_batch_aborts_every_prompt(served):
    key = 'paged_attention_requests_finished_total{finish_reason="abort"}'
    aborted_before = served.metrics().get(key, 0)
    body = {
        "prompt": [[104] * 8, [105] * 8, [106] * 8],
        "max_tokens": 800,
        "ignore_eos": True,
        "logprobs": 2,
        "stream": True,
    }
    with httpx.Client(base_url=served.url) as raw:
        with raw.stream("POST", COMPLETIONS, json=body) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    assert "logprobs" in json.loads(line[6:])["choices"][0]
                    break  # the client goes away mid-stream
    deadline = time.monotonic() + 10
    while served.metrics().get(key, 0) < aborted_before + 3:
        assert time.monotonic() < deadline, "the batch's requests were not all aborted"
        time.sleep(0.01)
    samples = wait_idle(served)
    assert samples["paged_attention_kv_blocks_used"] == 0


def test_real_model_scores_and_spells_tokens_as_transformers_does():
    """SmolLM2 in float32 with its real byte-level BPE tokenizer: an echoed text's logprobs
    equal transformers', its tokens' bytes spell it (accents and an emoji split across
    tokens included), and a chat answer's token ``bytes`` spell the answer."""
    model, tokenizer = load_model("smollm2", dtype="float32")
    live = LiveServer(create_app(make_engine(model, tokenizer, num_blocks=64), tokenizer, "s"))
    try:
        client = live.client()
        text = "Le café ☕ est chaud, dit-elle."
        scored = client.completions.create(
            model="s", prompt=text, echo=True, max_tokens=0, logprobs=3
        )
        chat = client.chat.completions.create(
            model="s",
            messages=[{"role": "user", "content": "Écris « café ☕ » trois fois."}],
            max_tokens=12,
            temperature=0,
            logprobs=True,
            top_logprobs=1,
        )
    finally:
        live.stop()
    ids = tokenizer(text)["input_ids"]
    choice = scored.choices[0]
    assert choice.text == text and choice.logprobs.tokens[0] == tokenizer.decode(ids[:1])
    model.set_attn_implementation("sdpa")
    with torch.inference_mode():
        rows = model(torch.tensor([ids]), use_cache=False).logits[0].float().log_softmax(-1)
    expected = [rows[i - 1][ids[i]].item() for i in range(1, len(ids))]
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(expected, abs=TOLERANCE)
    pieces = TokenPieces(tokenizer)
    assert b"".join(bytes(pieces.bytes(t)) for t in ids) == text.encode()
    answer = chat.choices[0]
    assert answer.finish_reason == "length"
    spelled = bytes(b for entry in answer.logprobs.content for b in entry.bytes)
    assert spelled.decode("utf-8", "replace") == answer.message.content
