"""The OpenAI request bodies the server accepts, its errors, and the bodies it answers with.

Requests are validated strictly (a string where a number belongs is refused, not converted) and
every field OpenAI defines that this server does not carry out is refused with a 400 naming it,
unless it holds the value that asks for nothing (``frequency_penalty: 0``, ``logprobs: false``,
``tools: []``...). Fields OpenAI does not define are refused as unrecognized, as OpenAI does.
"""

from __future__ import annotations

import json
import secrets
import time
import uuid
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from paged_attention.engine import RequestError, RequestOutput, SamplingParams

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "abort": "abort"}
"""The engine's finish reasons as OpenAI names them (``abort``: the server ended the request,
when it shut down or the engine failed)."""


class APIError(Exception):
    """An error answered as OpenAI does: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


# Fields OpenAI defines that the server does not carry out, with the values that ask for
# nothing: those are accepted (a client library may send them), any other is refused.
NEUTRAL_VALUES: dict[str, tuple] = {
    "frequency_penalty": (0, 0.0),
    "presence_penalty": (0, 0.0),
    "logprobs": (False, 0),
    "top_logprobs": (0,),
    "logit_bias": ({},),
    "response_format": ({"type": "text"},),
    "tools": ([],),
    "tool_choice": ("none",),
    "parallel_tool_calls": (True, False),  # without tools there are no calls to parallelise
    "functions": ([],),
    "function_call": ("none",),
    "store": (False,),
    "metadata": ({},),
    "modalities": (["text"],),
    "service_tier": ("auto", "default"),
    "echo": (False,),
    "suffix": ("",),
    "best_of": (1,),
}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False
    include_obfuscation: Literal[False] = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    # "developer" is OpenAI's newer name for "system"; chat templates know "system".
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    def template_message(self) -> dict[str, str]:
        content = self.content
        if not isinstance(content, str):
            content = "\n".join(part.text for part in content)
        return {"role": "system" if self.role == "developer" else self.role, "content": content}


class _Generation(_Strict):
    """The fields both routes share."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None  # the caller's end-user id, for its own records
    # refused unless neutral (NEUTRAL_VALUES)
    frequency_penalty: Any = None
    presence_penalty: Any = None
    logit_bias: Any = None
    logprobs: Any = None

    @model_validator(mode="after")
    def _refuse_what_is_not_done(self):
        for name in NEUTRAL_VALUES:
            value = getattr(self, name, None)
            if value is None:
                continue
            neutral = NEUTRAL_VALUES[name]
            # bool is an int: True must not pass as 1 nor 1 as True
            if not any(type(value) is type(v) and value == v for v in neutral):
                shown = " or ".join(json.dumps(v) for v in neutral)
                raise APIError(
                    f"{name} is not supported by this server (accepted only as {shown})",
                    param=name,
                    code="unsupported_parameter",
                )
        if self.stream_options is not None and not self.stream:
            raise APIError(
                "stream_options is only allowed when stream is true", param="stream_options"
            )
        return self


class ChatCompletionRequest(_Generation):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    top_logprobs: Any = None
    response_format: Any = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    functions: Any = None
    function_call: Any = None
    store: Any = None
    metadata: Any = None
    modalities: Any = None
    service_tier: Any = None

    @model_validator(mode="after")
    def _check_messages(self):
        if not self.messages:
            raise APIError("messages must hold at least one message", param="messages")
        both = self.max_tokens is not None and self.max_completion_tokens is not None
        if both and self.max_tokens != self.max_completion_tokens:
            raise APIError(
                "give max_completion_tokens or max_tokens, not both with different values",
                param="max_completion_tokens",
            )
        return self

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_tokens is None else self.max_tokens

    @property
    def max_tokens_param(self) -> str:
        return "max_tokens" if self.max_tokens is not None else "max_completion_tokens"


class CompletionRequest(_Generation):
    # One prompt: a string, or token ids; a list holding one of them is accepted too.
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: Any = None
    suffix: Any = None
    best_of: Any = None

    @model_validator(mode="after")
    def _one_prompt(self):
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise APIError(
                    f"prompt holds {len(prompt)} prompts; this server takes one prompt per "
                    "request (send one request per prompt: they are batched together)",
                    param="prompt",
                    code="unsupported_parameter",
                )
            self.prompt = prompt[0]
        if len(self.prompt) == 0:
            raise APIError("prompt must not be empty", param="prompt")
        return self

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_tokens

    max_tokens_param: ClassVar[str] = "max_tokens"


def parse(model: type[_Generation], body: bytes) -> _Generation:
    """``body`` (JSON) as a ``model`` request, or the APIError a client should get."""
    try:
        return model.model_validate_json(body)
    except ValidationError as error:
        raise validation_error(error) from None


def validation_error(error: ValidationError) -> APIError:
    """The first of pydantic's errors, as a 400 naming the field (``messages[0].role``)."""
    first = error.errors(include_url=False)[0]
    if first["type"] == "json_invalid":
        return APIError(f"the request body is not valid JSON: {first['msg']}", code="invalid_json")
    location = _location(first["loc"])
    if first["type"] == "extra_forbidden":
        return APIError(
            f"unrecognized request argument supplied: {location}",
            param=location,
            code="unsupported_parameter",
        )
    if first["type"] == "missing":
        return APIError(f"{location} is required", param=location or None)
    message = first["msg"]
    if first["type"] == "model_type" and not first["loc"]:
        message = "the request body must be a JSON object"
    shown = f"{location}: " if location else ""
    return APIError(f"{shown}{message}", param=location or None)


def _location(loc: tuple) -> str:
    """``("messages", 0, "content", "str")`` as ``messages[0].content``: pydantic names the
    member of a union it tried (``str``, ``list[int]``, ``TextPart``...), which is no field."""
    parts = []
    for part in loc:
        if isinstance(part, int):
            parts.append(f"[{part}]")
        elif part.isidentifier() and part.islower() and part not in _TYPE_NAMES:
            parts.append(f".{part}" if parts else part)
    return "".join(parts)


_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "none"}


def sampling_params(
    request: ChatCompletionRequest | CompletionRequest,
    prompt_len: int,
    max_model_len: int,
    max_n: int,
    default_max_tokens: int | None,
) -> SamplingParams:
    """The engine's parameters for ``request`` with a prompt of ``prompt_len`` tokens, or the
    APIError naming the parameter that cannot be served."""
    prompt_param = "messages" if isinstance(request, ChatCompletionRequest) else "prompt"
    if prompt_len >= max_model_len:
        raise APIError(
            f"the prompt is {prompt_len} tokens long; this model's context is {max_model_len} "
            "tokens, and the completion needs at least one of them",
            param=prompt_param,
            code="context_length_exceeded",
        )
    room = max_model_len - prompt_len
    max_tokens = request.max_new_tokens
    name = request.max_tokens_param
    if max_tokens is None:
        max_tokens = room if default_max_tokens is None else min(default_max_tokens, room)
    elif max_tokens < 1:
        raise APIError(f"{name} must be at least 1, got {max_tokens}", param=name)
    elif max_tokens > room:
        raise APIError(
            f"{name} is {max_tokens}, but the prompt takes {prompt_len} of this model's "
            f"{max_model_len} context tokens: at most {room} remain",
            param=name,
            code="context_length_exceeded",
        )
    n = 1 if request.n is None else request.n
    if not 1 <= n <= max_n:
        raise APIError(f"n must be between 1 and {max_n}, got {n}", param="n")
    temperature = 1.0 if request.temperature is None else request.temperature
    if not 0 <= temperature <= 2:
        raise APIError(
            f"temperature must be between 0 and 2, got {temperature}", param="temperature"
        )
    top_p = 1.0 if request.top_p is None else request.top_p
    if not 0 < top_p <= 1:
        raise APIError(f"top_p must be in (0, 1], got {top_p}", param="top_p")
    stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    if any(not s for s in stop):
        raise APIError("stop strings must not be empty", param="stop")
    # Without a seed every request draws its own random numbers (the engine's default seed
    # would give every request the same samples).
    seed = secrets.randbits(63) if request.seed is None else request.seed
    try:
        return SamplingParams(
            max_new_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            n=n,
            seed=seed,
            stop=tuple(stop),
        )
    except RequestError as error:  # what the engine refuses beyond the checks above (the seed)
        raise APIError(str(error), param=error.argument) from None


# --------------------------------------------------------------------- responses


def completion_id(chat: bool) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"


def usage(output: RequestOutput) -> dict[str, int]:
    completion = sum(len(tokens) for tokens in output.outputs)
    prompt = len(output.prompt)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def finish_reason(reason: str | None) -> str | None:
    return None if reason is None else FINISH_REASONS[reason]


def response(chat: bool, id: str, model: str, output: RequestOutput) -> dict:
    """The whole answer to a non-streaming request, from its final output."""
    choices = []
    for index, (text, reason) in enumerate(zip(output.texts, output.finish_reasons)):
        choice: dict[str, Any] = {"index": index}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice["finish_reason"] = finish_reason(reason)
        choice["logprobs"] = None
        choices.append(choice)
    return {
        "id": id,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(output),
    }


def chunk(chat: bool, id: str, created: int, model: str, choices: list[dict]) -> dict:
    return {
        "id": id,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
    }


def chunk_choice(chat: bool, index: int, text: str | None, reason: str | None) -> dict:
    """One choice of a streamed chunk: ``text`` is the delta (``None``: the opening chunk of a
    chat choice, which carries the role)."""
    choice: dict[str, Any] = {"index": index}
    if chat:
        opening = text is None
        choice["delta"] = {"role": "assistant", "content": ""} if opening else {"content": text}
    else:
        choice["text"] = text or ""
    choice["finish_reason"] = finish_reason(reason)
    choice["logprobs"] = None
    return choice


def model_card(name: str, created: int, max_model_len: int) -> dict:
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "paged_attention",
        "max_model_len": max_model_len,
    }
