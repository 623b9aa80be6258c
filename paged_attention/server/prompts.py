"""The tokenizer's work for the server, off the event loop: chat messages through the model's
template, text to token ids and back. A huge prompt takes seconds to tokenize; in a worker
thread it delays only the requests tokenized after it, never the streams already running
(the tokenizer releases the GIL while it works).

One worker: a tokenizer object is not meant to be used from several threads at once.
"""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor

from paged_attention.server.protocol import APIError, ChatCompletionRequest


class PromptBuilder:
    """Builds prompts with ``tokenizer`` in a thread of its own; ``close()`` stops it."""

    def __init__(self, tokenizer, model_name: str) -> None:
        self.tokenizer = tokenizer
        self.model_name = model_name
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")

    def close(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)

    async def run(self, function, *args):
        """``function(*args)`` in the tokenizer's thread."""
        return await asyncio.get_running_loop().run_in_executor(self._worker, function, *args)

    # ------------------------------------------------------------------ in the worker

    def chat_ids(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        add_special_tokens: bool = False,
        tools: list[dict] | None = None,
    ) -> list[int]:
        """The token ids of ``messages`` (template messages) rendered by the chat template
        (``continue_final_message``: the last message left open, for the model to go on), with
        ``tools`` (OpenAI's tool definitions) where the template renders them; a template that
        does not gets them described in the system message instead (:func:`with_tools`)."""
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise APIError(
                f"the model {self.model_name!r} has no chat template; use /v1/completions",
                param="messages",
            )
        options = dict(
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
        )
        text = self._render(messages, **options)
        if tools:
            with_them = self._render(messages, tools=tools, **options)
            text = with_them if with_them != text else self._render(with_tools(messages, tools))
        return self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]

    def _render(self, messages: list[dict], **options) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, **options)
        except Exception as error:  # the template's own checks (jinja raise_exception)
            raise APIError(_template_refusal(error), param="messages") from None

    def request_chat_ids(self, body: ChatCompletionRequest) -> list[int]:
        messages = [m.template_message() for m in body.messages]
        return self.chat_ids(messages, tools=body.template_tools)

    def text_ids(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]

    def text(self, ids: list[int], param: str = "tokens") -> str:
        """``ids`` as text; an id outside the vocabulary is refused naming ``param``."""
        vocabulary = len(self.tokenizer)
        outside = [t for t in ids if not 0 <= t < vocabulary]
        if outside:
            raise APIError(
                f"{param} holds the token {outside[0]}, outside the model's vocabulary "
                f"[0, {vocabulary})",
                param=param,
            )
        return self.tokenizer.decode(ids)


TOOLS_PROMPT = """You may call functions to answer. Their signatures, one JSON object a line:
<tools>
{tools}
</tools>
To call one, write its name and arguments as a JSON object within <tool_call></tool_call> tags:
<tool_call>
{{"name": <function name>, "arguments": <arguments as a JSON object>}}
</tool_call>"""
"""How tools are described to a model whose chat template does not render them (the Hermes
format that :mod:`~paged_attention.server.tool_calls` reads)."""


def with_tools(messages: list[dict], tools: list[dict]) -> list[dict]:
    """``messages`` with ``tools`` described at the end of the system message (a new one
    first if there is none)."""
    listed = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    prompt = TOOLS_PROMPT.format(tools=listed)
    if messages and messages[0]["role"] == "system":
        first = {**messages[0], "content": f"{messages[0]['content']}\n\n{prompt}"}
        return [first, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


def _template_refusal(error: Exception) -> str:
    """What a client is told when the template failed: the message of the template's own
    ``raise_exception``, else only the kind of failure (no internal repr)."""
    try:
        from jinja2 import TemplateError
    except ImportError:  # transformers needs jinja2 for templates; be safe without it
        TemplateError = ()  # noqa: N806
    if isinstance(error, TemplateError):
        return f"the chat template refused the messages: {error}"
    return f"the chat template could not render the messages ({type(error).__name__})"
