"""LangChain's OpenAI models against the server (paged_attention/server/): ``ChatOpenAI``'s
invoke, stream, batch, stop strings, ``max_tokens``, logprobs and vLLM's sampling controls in
``extra_body``, and the completions model ``OpenAI``, on SmolLM2-135M-Instruct in float32. The
oracle is the official ``openai`` client sending the same request to the same server, and greedy
decoding for ``top_k: 1``. Structured output and bound tools are in tests/test_server_tools.py;
docs/clients.md's LangChain example runs here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("uvicorn")
langchain_openai = pytest.importorskip("langchain_openai")

from offline import refuse_remote_connections  # noqa: E402
from test_server import LiveServer, make_engine  # noqa: E402

from paged_attention.modeling.models import load_model  # noqa: E402
from paged_attention.server import create_app  # noqa: E402

MODEL = "smollm2"
DOCS = Path(__file__).resolve().parent.parent / "docs" / "clients.md"
QUESTION = "What is the capital of France?"
QUESTIONS = [QUESTION, "Name a color.", "What do bees make?"]
GREEDY = dict(temperature=0, seed=0, max_tokens=16)


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    refuse_remote_connections(monkeypatch)


@pytest.fixture(scope="module")
def served():
    model, tokenizer = load_model(MODEL, dtype="float32")
    live = LiveServer(create_app(make_engine(model, tokenizer), tokenizer, MODEL, max_n=4))
    yield live
    live.stop()


@pytest.fixture(scope="module")
def greedy(served):
    """The official client's greedy answer to each question."""
    return {q: official(served, q, **GREEDY).choices[0].message.content for q in QUESTIONS}


def chat_model(live: LiveServer, **options):
    return langchain_openai.ChatOpenAI(
        model=MODEL, base_url=f"{live.url}/v1", api_key=live.api_key, max_retries=0, **options
    )


def official(live: LiveServer, question: str, **options):
    """The official client's chat answer to ``question``."""
    messages = [{"role": "user", "content": question}]
    return live.client().chat.completions.create(model=MODEL, messages=messages, **options)


def test_invoke_answers_as_the_official_client_does(served, greedy):
    message = chat_model(served, **GREEDY).invoke(QUESTION)
    assert "Paris" in message.content
    assert message.content == greedy[QUESTION]
    usage = message.response_metadata["token_usage"]
    assert usage["completion_tokens"] <= GREEDY["max_tokens"] and usage["prompt_tokens"] > 0


def test_streamed_chunks_add_up_to_the_invoked_answer(served, greedy):
    """(The invoked answer is the official client's: the test above.)"""
    chunks = list(chat_model(served, **GREEDY).stream(QUESTION))
    assert len(chunks) > 2  # a token or so a chunk, not one whole answer
    assert "".join(chunk.content for chunk in chunks) == greedy[QUESTION]


def test_a_batch_answers_each_prompt_as_alone(served, greedy):
    answers = chat_model(served, **GREEDY).batch(QUESTIONS)
    assert [answer.content for answer in answers] == [greedy[q] for q in QUESTIONS]
    assert len(set(greedy.values())) == len(QUESTIONS)


def test_a_stop_string_cuts_the_answer_before_it(served, greedy):
    whole = greedy[QUESTION]
    assert "." in whole
    stopped = chat_model(served, **GREEDY).invoke(QUESTION, stop=["."])
    assert stopped.content == whole.split(".")[0]
    assert stopped.response_metadata["finish_reason"] == "stop"


def test_max_tokens_ends_the_answer_at_that_count(served):
    message = chat_model(served, **{**GREEDY, "max_tokens": 3}).invoke(QUESTION)
    assert message.response_metadata["token_usage"]["completion_tokens"] == 3
    assert message.response_metadata["finish_reason"] == "length"


def test_logprobs_are_the_servers(served):
    options = dict(GREEDY, logprobs=True, top_logprobs=2)
    message = chat_model(served, **options).invoke(QUESTION)
    theirs = message.response_metadata["logprobs"]["content"]
    ours = official(served, QUESTION, **options).choices[0].logprobs.model_dump()["content"]
    assert [t["token"] for t in theirs] == [t["token"] for t in ours]
    # The end-of-sequence token that ended the answer has its entry too, as vLLM gives it.
    assert "".join(t["token"] for t in theirs) in (message.content, message.content + "<|im_end|>")
    for got, want in zip(theirs, ours):
        assert got["logprob"] == pytest.approx(want["logprob"], abs=1e-4)
        alternatives = [a["token"] for a in got["top_logprobs"]]
        assert alternatives == [a["token"] for a in want["top_logprobs"]]
        assert len(got["top_logprobs"]) == 2 and got["logprob"] <= 0


def test_top_k_in_extra_body_samples_greedily_at_one(served, greedy):
    """``top_k: 1`` at temperature 1 leaves one token to draw: the greedy answer, whatever
    the seed, so the server read ``top_k`` from LangChain's ``extra_body``; without it the
    same seeds sample something else."""
    question = QUESTIONS[1]  # open enough for sampling at temperature 1 to wander

    def sampled(seed: int, **options) -> str:
        sampling = dict(GREEDY, temperature=1.0, seed=seed, **options)
        return chat_model(served, **sampling).invoke(question).content

    assert [sampled(seed, extra_body={"top_k": 1}) for seed in (1, 2)] == [greedy[question]] * 2
    assert {sampled(seed) for seed in (1, 2)} != {greedy[question]}


def test_the_completions_model_answers_as_the_official_client_does(served):
    prompt = "The capital of France is"
    llm = langchain_openai.OpenAI(
        model=MODEL,
        base_url=f"{served.url}/v1",
        api_key=served.api_key,
        max_retries=0,
        temperature=0,
        max_tokens=12,
    )
    text = llm.invoke(prompt)
    answer = served.client().completions.create(
        model=MODEL, prompt=prompt, temperature=0, max_tokens=12
    )
    assert text == answer.choices[0].text
    assert "Paris" in text


def test_the_docs_example_runs_against_the_server(served):
    """docs/clients.md's LangChain example, its URL replaced by the live server's."""
    (code,) = re.findall(r"^```python\n(.*?)^```", DOCS.read_text(), re.S | re.M)
    code = code.replace("http://127.0.0.1:8000", served.url)
    exec(compile(code, str(DOCS), "exec"), {"__name__": "docs_example"})
