"""``/tokenize`` and ``/detokenize`` (:mod:`paged_attention.server.tokenization`) in vLLM's
shapes, against the model's tokenizer and chat template, on a live server."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from test_server import MODEL, LiveServer, chat_prompt, make_engine  # noqa: E402

from paged_attention.modeling.models import load_model  # noqa: E402
from paged_attention.server import create_app  # noqa: E402

MESSAGES = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def served():
    model, tokenizer = load_model(MODEL)
    live = LiveServer(create_app(make_engine(model, tokenizer), tokenizer, MODEL))
    live.tokenizer = tokenizer
    yield live
    live.stop()


def post(live, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{live.url}{path}", json=body, timeout=60)


def test_tokenize_a_prompt_as_the_tokenizer_does(served):
    tokenizer = served.tokenizer
    for add_special_tokens in (True, False):
        body = {
            "model": MODEL,
            "prompt": "Once upon a time",
            "add_special_tokens": add_special_tokens,
        }
        answer = post(served, "/tokenize", body).json()
        ids = tokenizer("Once upon a time", add_special_tokens=add_special_tokens)["input_ids"]
        assert answer == {
            "count": len(ids),
            "max_model_len": served.client().models.retrieve(MODEL).max_model_len,
            "tokens": ids,
            "token_strs": None,
        }
    answer = post(served, "/tokenize", {"prompt": "Once", "return_token_strs": True}).json()
    assert answer["token_strs"] == tokenizer.convert_ids_to_tokens(answer["tokens"])


def test_tokenize_messages_as_a_chat_completion_sees_them(served):
    answer = post(served, "/tokenize", {"messages": MESSAGES}).json()
    assert answer["tokens"] == chat_prompt(served.tokenizer, "hello there")
    completion = served.client().chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=1
    )
    assert completion.usage.prompt_tokens == answer["count"]
    bare = post(served, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False})
    text = served.tokenizer.apply_chat_template(MESSAGES, tokenize=False)
    assert bare.json()["tokens"] == served.tokenizer(text, add_special_tokens=False)["input_ids"]
    opened = post(
        served,
        "/tokenize",
        {
            "messages": [*MESSAGES, {"role": "assistant", "content": "Hi"}],
            "add_generation_prompt": False,
            "continue_final_message": True,
        },
    ).json()
    decoded = served.tokenizer.decode(opened["tokens"])
    assert decoded.endswith("Hi")  # the last message is left open


def test_detokenize_reverses_tokenize(served):
    ids = post(served, "/tokenize", {"prompt": "a round trip", "add_special_tokens": False})
    answer = post(served, "/detokenize", {"model": MODEL, "tokens": ids.json()["tokens"]})
    assert answer.json() == {"prompt": "a round trip"}


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"prompt": "x", "model": "other"}, "model"),
        ("/tokenize", {"messages": []}, "messages"),
        (
            "/tokenize",
            {"messages": MESSAGES, "continue_final_message": True},
            "continue_final_message",
        ),
        ("/tokenize", {"messages": MESSAGES, "chat_template": "{{ 7 }}"}, "chat_template"),
        ("/detokenize", {"tokens": ["a"]}, "tokens[0]"),
        ("/detokenize", {"tokens": [10**9]}, "tokens"),
        ("/detokenize", {"tokens": [-1]}, "tokens"),
        ("/detokenize", {}, "tokens"),
    ],
)
def test_bad_tokenization_requests_get_400_naming_the_field(served, path, body, param):
    response = post(served, path, body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
