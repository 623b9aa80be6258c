"""The engine's prompt renderer (:mod:`paged_attention.engine.prompt_renderer`): chat messages
through the model's template (tools included), text to ids and back, and its refusals naming
the caller's argument; and the one-renderer rule: the in-process Engine and the server (which
renders in its own process) turn the same conversation into the same token ids."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from paged_attention.engine import ChatPrompt, Engine, PromptRenderer, SamplingParams  # noqa: E402
from paged_attention.engine.prompt_renderer import (  # noqa: E402
    NoChatTemplateError,
    with_tools,
)
from paged_attention.engine.request import RequestError  # noqa: E402
from paged_attention.modeling.tiny import byte_tokenizer  # noqa: E402

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "Which days?"},
    {"role": "user", "content": "Two."},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"days": {"type": "integer"}},
                "required": ["days"],
            },
        },
    }
]


def reference_ids(tokenizer, messages, add_special_tokens=False, **options) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, **options)
    return tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]


@pytest.fixture
def tokenizer():
    return byte_tokenizer()


@pytest.fixture
def renderer(tokenizer):
    return PromptRenderer(tokenizer, "tiny")


# ---------------------------------------------------------------------- rendering


def test_chat_ids_are_the_template_s_text_tokenized(tokenizer, renderer):
    assert renderer.chat_ids(ChatPrompt(MESSAGES)) == reference_ids(
        tokenizer, MESSAGES, add_generation_prompt=True
    )
    bare = ChatPrompt(MESSAGES, add_generation_prompt=False)
    assert renderer.chat_ids(bare) == reference_ids(tokenizer, MESSAGES)
    opened = ChatPrompt(MESSAGES[:3], add_generation_prompt=False, continue_final_message=True)
    assert tokenizer.decode(renderer.chat_ids(opened)).endswith("Which days?")
    special = ChatPrompt(MESSAGES, add_special_tokens=True)
    assert renderer.chat_ids(special) == reference_ids(
        tokenizer, MESSAGES, add_special_tokens=True, add_generation_prompt=True
    )


def test_text_ids_and_text_round_trip(tokenizer, renderer):
    ids = renderer.text_ids("café ok")
    assert ids == tokenizer("café ok")["input_ids"]
    assert renderer.text(ids) == "café ok"
    assert renderer.token_strings(ids) == tokenizer.convert_ids_to_tokens(ids)
    assert renderer.vocabulary_size == len(tokenizer)


def test_tools_a_template_ignores_are_described_in_the_system_message(tokenizer, renderer):
    ids = renderer.chat_ids(ChatPrompt(MESSAGES, tools=TOOLS))
    expected = reference_ids(tokenizer, with_tools(MESSAGES, TOOLS), add_generation_prompt=True)
    assert ids == expected
    text = tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system\nBe brief.\n\nYou may call functions")
    assert '"get_weather"' in text and text.count("<|im_start|>system") == 1
    assert text.endswith("<|im_start|>assistant\n")  # the generation prompt stays
    alone = tokenizer.decode(renderer.chat_ids(ChatPrompt(MESSAGES[1:2], tools=TOOLS)))
    assert alone.startswith("<|im_start|>system\nYou may call functions")  # a new system message
    assert renderer.chat_ids(ChatPrompt(MESSAGES, tools=[])) == renderer.chat_ids(
        ChatPrompt(MESSAGES)
    )


def test_a_template_that_renders_tools_renders_them_itself(tokenizer, renderer):
    tokenizer.chat_template = (
        "{% for tool in tools or [] %}TOOL {{ tool.function.name }};{% endfor %}"
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    )
    rendered = tokenizer.decode(renderer.chat_ids(ChatPrompt(MESSAGES[1:2], tools=TOOLS)))
    assert rendered == "TOOL get_weather;user: Weather in Paris?\n"


# ---------------------------------------------------------------------- refusals


@pytest.mark.parametrize("argument", ["prompt", "messages"])
def test_refusals_name_the_caller_s_argument(tokenizer, renderer, argument):
    cases = [
        (ChatPrompt([]), "non-empty list of chat messages"),
        (ChatPrompt([{"role": "user", "content": 5}]), "string 'role' and 'content'"),
        (ChatPrompt([{"role": "user", "content": "caf\udce9"}]), "content is not valid Unicode"),
        (ChatPrompt(MESSAGES, tools=[{"name": "\ud800"}]), "rendered chat is not valid Unicode"),
    ]
    for chat, message in cases:
        with pytest.raises(RequestError, match=message) as raised:
            renderer.chat_ids(chat, argument=argument)
        assert raised.value.argument == argument
    with pytest.raises(RequestError, match=f"^{argument}: the prompt is not valid Unicode"):
        renderer.text_ids("caf\udce9", argument=argument)
    for call in (renderer.text, renderer.token_strings):
        with pytest.raises(RequestError, match=r"holds the token 999, outside .* \[0, 259\)") as r:
            call([5, 999], argument=argument)
        assert r.value.argument == argument


def test_both_template_options_at_once_are_refused_naming_one(renderer):
    both = ChatPrompt(MESSAGES, add_generation_prompt=True, continue_final_message=True)
    with pytest.raises(RequestError, match="cannot both be true") as raised:
        renderer.chat_ids(both, argument="messages")
    assert raised.value.argument == "continue_final_message"


def test_the_template_s_own_refusals_are_passed_on_without_internals(tokenizer, renderer):
    tokenizer.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(RequestError) as raised:
        renderer.chat_ids(ChatPrompt(MESSAGES), argument="messages")
    assert str(raised.value) == "the chat template refused the messages: roles must alternate"
    assert raised.value.argument == "messages"
    tokenizer.chat_template = "{{ messages[0].content + 1 }}"  # a template that breaks
    with pytest.raises(RequestError) as raised:
        renderer.chat_ids(ChatPrompt(MESSAGES))
    assert str(raised.value) == "the chat template could not render the messages (TypeError)"
    tokenizer.chat_template = None
    with pytest.raises(NoChatTemplateError, match="'tiny' has no chat template") as raised:
        renderer.chat_ids(ChatPrompt(MESSAGES), argument="messages")
    assert (raised.value.argument, raised.value.model_name) == ("messages", "tiny")


def test_a_failed_render_changes_nothing(tokenizer, renderer):
    before = renderer.chat_ids(ChatPrompt(MESSAGES, tools=TOOLS))
    with pytest.raises(RequestError):
        renderer.chat_ids(ChatPrompt([*MESSAGES, {"role": "user", "content": "\ud800"}]))
    assert renderer.chat_ids(ChatPrompt(MESSAGES, tools=TOOLS)) == before


# ---------------------------------------------------------------------- one renderer


@pytest.fixture(scope="module")
def tiny():
    from paged_attention.modeling.models import load_model

    return load_model("tiny")


def test_the_engine_renders_chat_prompts_with_its_renderer(tiny):
    model, tokenizer = tiny
    engine = Engine(model, tokenizer=tokenizer, num_blocks=128, block_size=16)
    renderer = PromptRenderer(tokenizer)
    plain, tooled = engine.generate(
        [MESSAGES, ChatPrompt(MESSAGES, tools=TOOLS)], SamplingParams(1)
    )
    assert plain.prompt == renderer.chat_ids(ChatPrompt(MESSAGES))
    assert tooled.prompt == renderer.chat_ids(ChatPrompt(MESSAGES, tools=TOOLS))
    kept, tokenizer.chat_template = tokenizer.chat_template, "{{ raise_exception('no') }}"
    try:
        with pytest.raises(RequestError, match="refused the messages: no") as raised:
            engine.add_request(MESSAGES, SamplingParams(1))
    finally:
        tokenizer.chat_template = kept
    assert raised.value.argument == "prompt" and not engine.has_unfinished()


def test_the_engine_and_the_server_give_the_same_ids(tiny):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    from test_server import LiveServer, Recorder, make_engine

    from paged_attention.server import create_app

    model, tokenizer = tiny
    served_engine = make_engine(model, tokenizer)
    recorded = Recorder(served_engine)
    live = LiveServer(create_app(served_engine, tokenizer, "tiny"))
    engine = Engine(model, tokenizer=tokenizer, num_blocks=128, block_size=16)
    try:
        for tools in (None, TOOLS):
            (direct,) = engine.generate([ChatPrompt(MESSAGES, tools=tools)], SamplingParams(1))
            body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 1, "tools": tools}
            answer = httpx.post(f"{live.url}/v1/chat/completions", json=body, timeout=60)
            assert answer.json()["usage"]["prompt_tokens"] == len(direct.prompt)
            assert recorded.finals[-1].prompt == direct.prompt  # the ids the server submitted
            tokenized = httpx.post(f"{live.url}/tokenize", json=body, timeout=60).json()
            assert tokenized["tokens"] == direct.prompt
        assert len(direct.prompt) > len(engine.generate([MESSAGES], SamplingParams(1))[0].prompt)
    finally:
        live.stop()


def test_the_server_answers_the_renderer_s_refusals_naming_the_field(tiny):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    from test_server import LiveServer, make_engine

    from paged_attention.server import create_app

    model, _ = tiny
    tokenizer = byte_tokenizer()  # its own: the test changes its template
    live = LiveServer(create_app(make_engine(model, tokenizer), tokenizer, "tiny"))

    def refusal(path: str, body: dict | bytes) -> dict:
        options = {"content": body} if isinstance(body, bytes) else {"json": body}
        headers = {"content-type": "application/json"}
        response = httpx.post(f"{live.url}{path}", headers=headers, timeout=60, **options)
        assert response.status_code == 400, response.text
        return response.json()["error"]

    chat = {"model": "tiny", "messages": MESSAGES, "max_tokens": 1}
    refused = "the chat template refused the messages: roles must alternate"
    try:
        error = refusal("/tokenize", b'{"prompt": "caf\\udce9"}')  # JSON that json.loads takes
        assert error["param"] == "prompt" and "not valid Unicode" in error["message"]
        error = refusal("/tokenize", b'{"messages": [{"role": "user", "content": "\\ud800"}]}')
        assert error["param"] == "messages" and "not valid Unicode" in error["message"]
        tokenizer.chat_template = "{{ raise_exception('roles must alternate') }}"
        for path in ("/v1/chat/completions", "/tokenize"):
            error = refusal(path, chat)
            assert error["param"] == "messages"
            assert error["message"] == refused
        tokenizer.chat_template = None
        for path in ("/v1/chat/completions", "/tokenize"):
            error = refusal(path, chat)
            assert error["param"] == "messages"
            assert error["message"] == (
                "the model 'tiny' has no chat template; use /v1/completions"
            )
    finally:
        live.stop()
