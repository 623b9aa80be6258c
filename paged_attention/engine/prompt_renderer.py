"""The tokenizer's work on prompts, and nothing else: chat messages through the model's chat
template (tools included), text to token ids, token ids back to text. It needs only a tokenizer,
so it runs wherever the prompts arrive: inside the engine's
:class:`~paged_attention.engine.input_processor.InputProcessor`, and in the server's own
process, whose engine may run in another process and take token ids only (vLLM's split: the
front end renders, the engine core gets ids). One renderer, so a conversation becomes the same
ids whichever way it comes in.

Every refusal is a :class:`~paged_attention.engine.request.RequestError` naming the caller's
argument (``argument``: ``"prompt"`` in the engine, ``"messages"`` or ``"tokens"`` in the
server).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from paged_attention.engine.request import RequestError


@dataclass(frozen=True)
class ChatPrompt:
    """Chat messages to render through the model's chat template: ``messages`` (dicts with
    string ``role`` and ``content``, and whatever else the template reads: ``name``,
    ``tool_calls``, ``tool_call_id``), ``tools`` (OpenAI's tool definitions, or None),
    ``add_generation_prompt`` (open the assistant's answer; the default),
    ``continue_final_message`` (leave the last message open for the model to go on; not with
    ``add_generation_prompt``) and ``add_special_tokens`` (the tokenizer's own, such as a BOS,
    on top of the template's; off by default, the template writes them). A plain list of
    messages given to the engine is ``ChatPrompt(messages)``."""

    messages: Sequence[Mapping]
    tools: Sequence[Mapping] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False


class NoChatTemplateError(RequestError):
    """Chat messages for a tokenizer without a chat template; ``model_name`` names the model."""

    def __init__(self, model_name: str, argument: str) -> None:
        super().__init__(
            f"the model {model_name!r} has no chat template; give the prompt as text or token ids",
            argument,
        )
        self.model_name = model_name


class PromptRenderer:
    """Renders and tokenizes prompts with ``tokenizer`` (a transformers tokenizer) for the
    model ``model_name`` (default: the tokenizer's ``name_or_path``), which refusals name. Not
    safe to share between threads: a tokenizer is not."""

    def __init__(self, tokenizer, model_name: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.model_name = model_name or getattr(tokenizer, "name_or_path", "") or "unnamed"

    @property
    def vocabulary_size(self) -> int:
        """The tokenizer's vocabulary, added tokens included."""
        return len(self.tokenizer)

    def chat_ids(self, chat: ChatPrompt, argument: str = "prompt") -> list[int]:
        """The token ids of ``chat`` rendered by the model's chat template. ``tools`` are
        rendered by the template where it renders them; a template that does not gets them
        described at the end of the system message instead (:func:`with_tools`)."""
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise NoChatTemplateError(self.model_name, argument)
        if chat.add_generation_prompt and chat.continue_final_message:
            raise RequestError(
                "continue_final_message and add_generation_prompt cannot both be true",
                "continue_final_message",
            )
        messages = _checked_messages(chat.messages, argument)
        options = dict(
            add_generation_prompt=chat.add_generation_prompt,
            continue_final_message=chat.continue_final_message,
        )
        text = self._render(messages, argument, **options)
        if chat.tools:
            tools = [dict(tool) for tool in chat.tools]
            with_them = self._render(messages, argument, tools=tools, **options)
            if with_them == text:  # the template ignores tools: describe them in the prompt
                with_them = self._render(with_tools(messages, tools), argument, **options)
            text = with_them
        # names, tool calls and tools reach the text too: check all of it once
        _check_encodable(text, "the rendered chat", argument)
        return self._encode(text, chat.add_special_tokens)

    def text_ids(self, text: str, add_special_tokens: bool = True, argument: str = "prompt"):
        """The token ids of ``text`` (``add_special_tokens``: the tokenizer's own, such as a
        BOS)."""
        if not isinstance(text, str):
            raise RequestError(f"{argument} must be text, got {type(text).__name__}", argument)
        _check_encodable(text, "the prompt", argument)
        return self._encode(text, add_special_tokens)

    def text(self, ids: Sequence[int], argument: str = "tokens") -> str:
        """``ids`` as text (special tokens shown); an id outside the vocabulary is refused."""
        self._check_vocabulary(ids, argument)
        return self.tokenizer.decode(list(ids))

    def token_strings(self, ids: Sequence[int], argument: str = "tokens") -> list[str]:
        """Each of ``ids`` as the tokenizer spells the token (byte-level spellings kept)."""
        self._check_vocabulary(ids, argument)
        return self.tokenizer.convert_ids_to_tokens(list(ids))

    def _render(self, messages: list[dict], argument: str, **options) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, **options)
        except Exception as error:  # the template's own checks (jinja raise_exception)
            raise RequestError(template_refusal(error), argument) from None

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def _check_vocabulary(self, ids: Sequence[int], argument: str) -> None:
        vocabulary = self.vocabulary_size
        outside = [t for t in ids if not 0 <= t < vocabulary]
        if outside:
            raise RequestError(
                f"{argument} holds the token {outside[0]}, outside the model's vocabulary "
                f"[0, {vocabulary})",
                argument,
            )


TOOLS_PROMPT = """You may call functions to answer. Their signatures, one JSON object a line:
<tools>
{tools}
</tools>
To call one, write its name and arguments as a JSON object within <tool_call></tool_call> tags:
<tool_call>
{{"name": <function name>, "arguments": <arguments as a JSON object>}}
</tool_call>"""
"""How tools are described to a model whose chat template does not render them: the Hermes
format, which the server's tool-call parser reads back."""


def with_tools(messages: list[dict], tools: list[dict]) -> list[dict]:
    """``messages`` with ``tools`` described at the end of the system message (a new one
    first if there is none)."""
    listed = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    prompt = TOOLS_PROMPT.format(tools=listed)
    if messages and messages[0]["role"] == "system":
        first = {**messages[0], "content": f"{messages[0]['content']}\n\n{prompt}"}
        return [first, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


def template_refusal(error: Exception) -> str:
    """What a caller is told when the template failed: the message of the template's own
    ``raise_exception``, else only the kind of failure (no internal repr)."""
    try:
        from jinja2 import TemplateError
    except ImportError:  # transformers needs jinja2 for templates; be safe without it
        TemplateError = ()  # noqa: N806
    if isinstance(error, TemplateError):
        return f"the chat template refused the messages: {error}"
    return f"the chat template could not render the messages ({type(error).__name__})"


def _checked_messages(messages: Sequence[Mapping], argument: str) -> list[dict]:
    """``messages`` as the template's list of dicts, each with string ``role`` and
    ``content`` that UTF-8 can encode."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise RequestError(f"{argument} must be a non-empty list of chat messages", argument)
    for message in messages:
        if (
            not isinstance(message, Mapping)
            or not isinstance(message.get("role"), str)
            or not isinstance(message.get("content"), str)
        ):
            raise RequestError(
                f"chat messages must be dicts with string 'role' and 'content', got {message!r}",
                argument,
            )
        _check_encodable(message["content"], "a chat message's content", argument)
    return [dict(message) for message in messages]


def _check_encodable(text: str, what: str, argument: str) -> None:
    """Text a tokenizer can take: UTF-8 encodable (no lone surrogate such as "\\udce9", which
    Python's surrogateescape makes of undecodable input)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise RequestError(
            f"{argument}: {what} is not valid Unicode text ({error.reason} at index "
            f"{error.start}: {text[error.start : error.end]!r}); decode its bytes first",
            argument,
        ) from None
