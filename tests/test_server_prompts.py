"""The server's prompt builder: its warm-up runs in the tokenizer's thread and survives a model
without a chat template."""

import threading

from paged_attention.engine.prompt_renderer import NoChatTemplateError
from paged_attention.server.prompts import PromptBuilder


class RecordingRenderer:
    def __init__(self, chat_template: bool) -> None:
        self.chat_template = chat_template
        self.calls: list[tuple[str, str]] = []

    def chat_ids(self, chat, argument="prompt"):
        self.calls.append(("chat", threading.current_thread().name))
        if not self.chat_template:
            raise NoChatTemplateError("m", argument)
        assert chat.messages == [{"role": "user", "content": "Hello"}]
        return [1, 2]

    def text_ids(self, text, add_special_tokens=True, argument="prompt"):
        self.calls.append(("text", threading.current_thread().name))
        return [3]


def test_warm_up_renders_a_chat_in_the_tokenizer_thread():
    builder = PromptBuilder(tokenizer=None, model_name="m")
    builder.renderer = RecordingRenderer(chat_template=True)
    try:
        builder.warm_up().result(timeout=10)
    finally:
        builder.close()
    [(kind, thread)] = builder.renderer.calls
    assert kind == "chat" and thread.startswith("tokenizer")


def test_warm_up_without_a_chat_template_tokenizes_a_text():
    builder = PromptBuilder(tokenizer=None, model_name="m")
    builder.renderer = RecordingRenderer(chat_template=False)
    try:
        builder.warm_up().result(timeout=10)  # no error escapes
    finally:
        builder.close()
    assert [kind for kind, _ in builder.renderer.calls] == ["chat", "text"]
