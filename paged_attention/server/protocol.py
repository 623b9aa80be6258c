"""The OpenAI request bodies the server accepts, its errors, and the bodies it answers with.

Requests are validated strictly (a string where a number belongs is refused, not converted) and
every field OpenAI defines that this server does not carry out is refused with a 400 naming it,
unless it holds the value that asks for nothing (``tools: []``, ``best_of: 1``...). Fields
OpenAI does not define are ignored, with one logged warning per field name (vLLM's rule:
client libraries add fields of their own).
"""

from __future__ import annotations

import functools
import json
import logging
import re
import secrets
import threading
import uuid
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from paged_attention.engine import ChatPrompt, RequestError, RequestOutput, SamplingParams
from paged_attention.engine.request import MAX_LOGPROBS
from paged_attention.engine.structured_output import StructuredOutputParams
from paged_attention.server.tool_calls import HERMES, CallFormat, tool_call_grammar

FINISH_REASONS = {
    "eos": "stop",
    "stop": "stop",
    "length": "length",
    "abort": "abort",
    "tool_calls": "tool_calls",
}
"""The engine's finish reasons as OpenAI names them (``abort``: the server ended the request,
when it shut down or the engine failed; ``tool_calls``: the server's, for a chat answer whose
text held tool calls)."""


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
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")
        self.headers = headers or {}  # of the response (Retry-After, WWW-Authenticate)

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
    "functions": ([],),
    "function_call": ("none",),
    "store": (False,),
    "metadata": ({},),
    "modalities": (["text"],),
    "service_tier": ("auto", "default"),
    "suffix": ("",),
    "best_of": (1,),
}


# Fields OpenAI defines that ask for work this server does not do, whatever their value: refused
# unless null.
UNSUPPORTED = ("reasoning_effort", "prediction", "audio", "web_search_options", "verbosity")

logger = logging.getLogger(__name__)


class UnknownFields:
    """The names of the fields OpenAI does not define that requests held, each warned about
    once (a client sending its own field with every request logs it once, not every time)."""

    def __init__(self) -> None:
        self._seen: set[str] = set()
        self._lock = threading.Lock()  # requests are parsed in worker threads

    def warn(self, where: str, names) -> None:
        for name in names:
            key = f"{where}.{name}"
            with self._lock:
                if key in self._seen:
                    continue
                self._seen.add(key)
            logger.warning(
                "ignoring the field %r of a %s: this server does not know it (warned once)",
                name,
                where,
            )


unknown_fields = UnknownFields()


class StrictModel(BaseModel):
    # strict: "8" is no number; extra fields are kept aside, warned about, and not used
    model_config = ConfigDict(strict=True, extra="allow")
    _where: ClassVar[str] = "request"

    @model_validator(mode="after")
    def _warn_unknown_fields(self):
        if self.model_extra:
            unknown_fields.warn(self._where, list(self.model_extra))
        return self


class StreamOptions(StrictModel):
    _where: ClassVar[str] = "stream_options"
    include_usage: bool = False
    include_obfuscation: Literal[False] = False


class TextPart(StrictModel):
    _where: ClassVar[str] = "content part"
    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _text_only(self):
        if self.type != "text":
            raise FieldError(
                "type",
                f"content parts of type {self.type!r} are not supported: this model reads text",
            )
        if self.text is None:
            raise FieldError("text", "a text content part needs its text")
        return self


class FunctionCall(StrictModel):
    _where: ClassVar[str] = "tool call's function"
    name: str
    arguments: str  # JSON, as the model wrote it


class ToolCall(StrictModel):
    _where: ClassVar[str] = "tool call"
    id: str
    type: Literal["function"]
    function: FunctionCall

    def template_call(self) -> dict:
        """The call as chat templates read it: ``arguments`` as an object where it is JSON
        of one (templates iterate over it), else the text as sent."""
        try:
            arguments = json.loads(self.function.arguments)
        except ValueError:
            arguments = self.function.arguments
        if not isinstance(arguments, dict):
            arguments = self.function.arguments
        function = {"name": self.function.name, "arguments": arguments}
        return {"id": self.id, "type": "function", "function": function}


class ChatMessage(StrictModel):
    """One message of a conversation: an earlier tool call of the assistant (``tool_calls``,
    with ``content`` null) and a tool's answer (role ``tool``) are rendered by the template."""

    _where: ClassVar[str] = "message"
    # "developer" is OpenAI's newer name for "system"; chat templates know "system".
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # the list first: a list's errors name its part, not the string it is not
    content: list[TextPart] | str | None = Field(default=None)
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _check_role_fields(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise FieldError(
                "content", "content is required, unless an assistant message has tool_calls"
            )
        if self.tool_calls is not None and self.role != "assistant":
            raise FieldError("tool_calls", "only assistant messages may have tool_calls")
        if self.role == "tool" and self.tool_call_id is None:
            raise FieldError("tool_call_id", "a tool message needs the tool_call_id it answers")
        return self

    def template_message(self) -> dict:
        content = self.content
        if content is None:
            content = ""  # templates concatenate it
        elif not isinstance(content, str):
            content = "\n".join(part.text for part in content)
        message: dict[str, Any] = {
            "role": "system" if self.role == "developer" else self.role,
            "content": content,
        }
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [call.template_call() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class JSONSchemaFormat(StrictModel):
    _where: ClassVar[str] = "response_format.json_schema"
    name: str
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the schema is always enforced


class ResponseFormat(StrictModel):
    """``{"type": "text"}``, ``{"type": "json_object"}`` or ``{"type": "json_schema",
    "json_schema": {"name", "schema", "strict"}}``."""

    _where: ClassVar[str] = "response_format"
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _check_schema(self):
        missing = self.json_schema is None or self.json_schema.schema_ is None
        if self.type == "json_schema" and missing:
            raise FieldError("json_schema", 'type "json_schema" needs json_schema.schema')
        if self.type != "json_schema" and self.json_schema is not None:
            raise FieldError("json_schema", 'json_schema is only allowed with type "json_schema"')
        return self

    def structured_output(self) -> StructuredOutputParams | None:
        if self.type == "json_object":
            return StructuredOutputParams(json_object=True)
        if self.type == "json_schema":
            return StructuredOutputParams(json=self.json_schema.schema_)
        return None


class StructuredOutputs(StrictModel):
    """vLLM's ``structured_outputs``: exactly one of ``json`` (a schema), ``json_object``,
    ``regex``, ``grammar`` (EBNF), ``choice`` or ``structural_tag``."""

    _where: ClassVar[str] = "structured_outputs"
    json_: dict | bool | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    grammar: str | None = None
    choice: list[str] | None = None
    structural_tag: dict | str | None = None

    def structured_output(self) -> StructuredOutputParams:
        return StructuredOutputParams(
            json=self.json_,
            json_object=bool(self.json_object),
            regex=self.regex,
            grammar=self.grammar,
            choice=self.choice,
            structural_tag=self.structural_tag,
        )


GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
"""vLLM's older fields for structured output, and the kind each one gives."""


_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


class FunctionDefinition(StrictModel):
    _where: ClassVar[str] = "tool's function"
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None  # the parameters are always enforced when a call is forced

    @model_validator(mode="after")
    def _check_name(self):
        if not _FUNCTION_NAME.fullmatch(self.name):
            raise FieldError("name", "a function's name is 1 to 64 of a-z, A-Z, 0-9, _ and -")
        return self


class Tool(StrictModel):
    _where: ClassVar[str] = "tool"
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(StrictModel):
    _where: ClassVar[str] = "tool_choice.function"
    name: str


class NamedToolChoice(StrictModel):
    _where: ClassVar[str] = "tool_choice"
    type: Literal["function"]
    function: NamedFunction


class FieldError(ValueError):
    """A field refused by its object's validator; pydantic reports it at the object, and
    :func:`validation_error` names the field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class _Generation(StrictModel):
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
    # the caller's ids for its own records (they change nothing here)
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    # sampling controls: OpenAI's, then vLLM's (sent by the openai client in extra_body)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # JSON keys: token ids as strings
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    response_format: ResponseFormat | None = None
    # vLLM's structured output fields (sent by the openai client in extra_body)
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

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
        for name in UNSUPPORTED:
            if getattr(self, name, None) is not None:
                raise APIError(
                    f"{name} is not supported by this server",
                    param=name,
                    code="unsupported_parameter",
                )
        if self.stream_options is not None and not self.stream:
            raise APIError(
                "stream_options is only allowed when stream is true", param="stream_options"
            )
        formats = [name for name, _ in self._formats()]
        if len(formats) > 1:
            raise APIError(
                f"give one structured output field, not {' and '.join(formats)}",
                param=formats[1],
            )
        return self

    def _formats(self) -> list[tuple[str, Any]]:
        """The fields that ask for structured output: ``(name, a function giving its
        StructuredOutputParams)``."""
        formats = []
        if self.response_format is not None and self.response_format.type != "text":
            formats.append(("response_format", self.response_format.structured_output))
        if self.structured_outputs is not None:
            formats.append(("structured_outputs", self.structured_outputs.structured_output))
        for name, kind in GUIDED.items():
            value = getattr(self, name)
            if value is not None:
                formats.append((name, functools.partial(StructuredOutputParams, **{kind: value})))
        return formats

    def structured_output(self, call_format: CallFormat = HERMES) -> StructuredOutputParams | None:
        """The grammar the answer must follow, or None (``call_format``, the format forced
        tool calls are written in, is for chat requests)."""
        formats = self._formats()
        return formats[0][1]() if formats else None

    @property
    def structured_param(self) -> str:
        """The field a grammar that fails to compile came from."""
        formats = self._formats()
        return formats[0][0] if formats else "response_format"


class ChatCompletionRequest(_Generation):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: Any = None
    function_call: Any = None
    store: Any = None
    metadata: Any = None
    modalities: Any = None
    service_tier: Any = None
    # refused unless null (UNSUPPORTED)
    reasoning_effort: Any = None
    prediction: Any = None
    audio: Any = None
    web_search_options: Any = None
    verbosity: Any = None

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
        if self.top_logprobs is not None:
            _check_logprob_count("top_logprobs", self.top_logprobs)
            if self.top_logprobs and not self.logprobs:  # 0 asks for nothing
                raise APIError("top_logprobs needs logprobs: true", param="top_logprobs")
        self._check_tools()
        return self

    def _check_tools(self) -> None:
        names = [tool.function.name for tool in self.tools or ()]
        if len(set(names)) != len(names):
            raise APIError("tools holds two functions of the same name", param="tools")
        if self.tool_choice not in (None, "none") and not names:
            raise APIError("tool_choice needs tools to choose from", param="tool_choice")
        if isinstance(self.tool_choice, NamedToolChoice):
            if self.tool_choice.function.name not in names:
                raise APIError(
                    f"tool_choice names the function {self.tool_choice.function.name!r}, "
                    "which is not in tools",
                    param="tool_choice",
                )
        formats = [name for name, _ in self._formats()]
        if formats and self.tool_mode != "none":
            raise APIError(
                f"{formats[0]} cannot be combined with tools unless tool_choice is "
                '"none" (the answer is either tool calls or the formatted text)',
                param=formats[0],
            )

    @property
    def tool_mode(self) -> str:
        """``"none"`` (no tools, or tool_choice none), ``"auto"``, ``"required"`` or
        ``"named"``."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"

    @property
    def template_tools(self) -> list[dict] | None:
        """The tools as chat templates read them, or None when the model is not to see any."""
        if self.tool_mode == "none":
            return None
        return [tool.model_dump(by_alias=True, exclude_none=True) for tool in self.tools]

    def chat_prompt(self) -> ChatPrompt:
        """The conversation as the engine's renderer takes it: the template's messages, and the
        tools the model is to see."""
        messages = [m.template_message() for m in self.messages]
        return ChatPrompt(messages, tools=self.template_tools)

    def structured_output(self, call_format: CallFormat = HERMES) -> StructuredOutputParams | None:
        """The grammar the answer must follow: calls (in ``call_format``) of the named tool, or
        of any tool with ``required``; the response format's; or None."""
        mode = self.tool_mode
        if mode in ("required", "named"):
            tools = [tool.function for tool in self.tools]
            if mode == "named":
                tools = [f for f in tools if f.name == self.tool_choice.function.name]
            functions = [(f.name, f.parameters) for f in tools]
            # a named function is called once (OpenAI's rule); required honours
            # parallel_tool_calls
            parallel = mode == "required" and self.parallel_tool_calls is not False
            grammar = tool_call_grammar(functions, parallel, call_format)
            return StructuredOutputParams(structural_tag=grammar)
        return super().structured_output()

    @property
    def structured_param(self) -> str:
        """The field a grammar that fails to compile came from."""
        return "tools" if self.tool_mode in ("required", "named") else super().structured_param

    @property
    def logprob_counts(self) -> tuple[int | None, int | None]:
        """The engine's ``logprobs`` and ``prompt_logprobs`` for this request."""
        return (self.top_logprobs or 0) if self.logprobs else None, None

    prompt_only: ClassVar[bool] = False

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_tokens is None else self.max_tokens

    @property
    def max_tokens_param(self) -> str:
        return "max_tokens" if self.max_tokens is not None else "max_completion_tokens"


class CompletionRequest(_Generation):
    """A completion of one prompt or of a batch: ``prompt`` is a string, token ids, or a list
    of either (one choice per prompt and sample, index ``prompt_index * n + sample``)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = None
    suffix: Any = None
    best_of: Any = None

    @model_validator(mode="after")
    def _check_prompts(self):
        prompts = self.prompts
        if not prompts:
            raise APIError("prompt must not be empty", param="prompt")
        if len(prompts) > MAX_PROMPTS:
            raise APIError(
                f"prompt holds {len(prompts)} prompts; at most {MAX_PROMPTS} are allowed in one "
                "request",
                param="prompt",
            )
        for index, prompt in enumerate(prompts):
            if len(prompt) == 0:
                where = "prompt" if len(prompts) == 1 else f"prompt[{index}]"
                raise APIError(f"{where} must not be empty", param="prompt")
        if self.logprobs is not None:
            _check_logprob_count("logprobs", self.logprobs)
        if self.max_tokens == 0 and not self.echo:
            raise APIError(
                "max_tokens must be at least 1 (0 only with echo: true, which returns the "
                "prompt alone)",
                param="max_tokens",
            )
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        prompt = self.prompt
        if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
            return [prompt]
        return list(prompt)

    @property
    def prompt_only(self) -> bool:
        """``echo`` with ``max_tokens: 0``: the prompt (and its logprobs) alone. The engine
        generates one token, which the answer leaves out."""
        return bool(self.echo) and self.max_tokens == 0

    @property
    def logprob_counts(self) -> tuple[int | None, int | None]:
        """The engine's ``logprobs`` and ``prompt_logprobs`` for this request."""
        prompt_logprobs = self.logprobs if self.echo else None
        return (None if self.prompt_only else self.logprobs), prompt_logprobs

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_tokens

    max_tokens_param: ClassVar[str] = "max_tokens"


MAX_PROMPTS = 64
"""The most prompts one completion request may hold (they are served together)."""


def _check_logprob_count(name: str, value: int) -> None:
    if not 0 <= value <= MAX_LOGPROBS:
        raise APIError(f"{name} must be between 0 and {MAX_LOGPROBS}, got {value}", param=name)


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
    cause = first.get("ctx", {}).get("error")
    if first["type"] == "value_error" and isinstance(cause, FieldError):
        location = f"{location}.{cause.field}"
        return APIError(f"{location}: {cause}", param=location)
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


MAX_STOP_STRINGS = 64
MAX_STOP_LENGTH = 1024
"""The most stop strings one request may give, and the most characters of one: every step
searches each new text for each of them (OpenAI itself takes 4)."""


@dataclass(frozen=True)
class Limits:
    """What one request may ask of this server: the context it may fill, the samples, and the
    KV pool (``kv_blocks`` of ``block_size`` tokens) its sequences must fit in together."""

    max_model_len: int
    max_n: int
    kv_blocks: int
    block_size: int

    def kv_room(self, prompt_len: int, n: int) -> int:
        """The most tokens each of ``n`` samples of a ``prompt_len``-token prompt may generate
        with the whole pool: the prompt's full blocks are shared, every sample holds its own
        blocks up to ``prompt + max_tokens - 1`` tokens (the engine's count)."""
        size = self.block_size
        shared = prompt_len // size
        own_blocks = (self.kv_blocks - shared) // n
        return size * (shared + own_blocks) - prompt_len + 1


def sampling_params(
    request: ChatCompletionRequest | CompletionRequest,
    prompt_len: int,
    limits: Limits,
    default_max_tokens: int | None,
    tool_call_format: CallFormat = HERMES,
) -> SamplingParams:
    """The engine's parameters for ``request`` with a prompt of ``prompt_len`` tokens (forced
    tool calls written in ``tool_call_format``), or the APIError naming the parameter that
    cannot be served."""
    n = 1 if request.n is None else request.n
    if not 1 <= n <= limits.max_n:
        raise APIError(f"n must be between 1 and {limits.max_n}, got {n}", param="n")
    max_tokens = _max_tokens(request, prompt_len, n, limits, default_max_tokens)
    temperature = 1.0 if request.temperature is None else request.temperature
    if not 0 <= temperature <= 2:
        raise APIError(
            f"temperature must be between 0 and 2, got {temperature}", param="temperature"
        )
    top_p = 1.0 if request.top_p is None else request.top_p
    if not 0 < top_p <= 1:
        raise APIError(f"top_p must be in (0, 1], got {top_p}", param="top_p")
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
            stop=_stop_strings(request.stop),
            logprobs=request.logprob_counts[0],
            prompt_logprobs=request.logprob_counts[1],
            structured_output=request.structured_output(tool_call_format),
            **_sampling_controls(request),
        )
    except RequestError as error:  # what the engine refuses beyond the checks above (the seed)
        param = error.argument
        if param == "structured_output":
            param = request.structured_param
        raise APIError(str(error), param=param) from None


def _max_tokens(request, prompt_len: int, n: int, limits: Limits, default: int | None) -> int:
    """The request's completion length, checked against the context; left out, the longest
    that the context and the KV pool allow for its ``n`` samples (at most ``default``)."""
    prompt_param = "messages" if isinstance(request, ChatCompletionRequest) else "prompt"
    context = limits.max_model_len
    if prompt_len >= context:
        raise APIError(
            f"the prompt is {prompt_len} tokens long; this model's context is {context} "
            "tokens, and the completion needs at least one of them",
            param=prompt_param,
            code="context_length_exceeded",
        )
    room = context - prompt_len
    max_tokens = request.max_new_tokens
    name = request.max_tokens_param
    if request.prompt_only:
        return 1  # the engine generates at least one token; the answer leaves it out
    if max_tokens is not None:
        if max_tokens < 1:
            raise APIError(f"{name} must be at least 1, got {max_tokens}", param=name)
        if max_tokens > room:
            raise APIError(
                f"{name} is {max_tokens}, but the prompt takes {prompt_len} of this model's "
                f"{context} context tokens: at most {room} remain",
                param=name,
                code="context_length_exceeded",
            )
        return max_tokens
    kv_room = limits.kv_room(prompt_len, n)
    if kv_room < 1:
        alone = limits.kv_room(prompt_len, 1) >= 1
        raise APIError(
            f"the KV cache cannot hold {n} samples of this {prompt_len}-token prompt"
            if alone
            else f"the KV cache cannot hold this {prompt_len}-token prompt",
            param="n" if alone else prompt_param,
            code="kv_cache_exceeded",
        )
    return min(room, kv_room, default or room)


SAMPLING_CONTROLS = (
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "stop_token_ids",
    "ignore_eos",
    "min_tokens",
)
"""Request fields that are the engine's SamplingParams of the same name (vLLM's names and
meaning), besides ``logit_bias`` whose keys are converted. Left out (null), the engine's
default applies."""


def _sampling_controls(request) -> dict[str, Any]:
    """The request's sampling controls as SamplingParams arguments; the engine checks their
    values (its RequestError names the field)."""
    controls = {name: getattr(request, name) for name in SAMPLING_CONTROLS}
    controls = {name: value for name, value in controls.items() if value is not None}
    if request.logit_bias:
        bias = {}
        for token, value in request.logit_bias.items():
            if not token.isascii() or not token.isdigit():
                raise APIError(
                    f'logit_bias keys must be token ids ("123"), got {token!r}',
                    param="logit_bias",
                )
            bias[int(token)] = value
        controls["logit_bias"] = bias
    if "stop_token_ids" in controls:
        controls["stop_token_ids"] = tuple(controls["stop_token_ids"])
    return controls


def _stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP_STRINGS:
        raise APIError(
            f"stop holds {len(stops)} strings; at most {MAX_STOP_STRINGS} are allowed",
            param="stop",
        )
    if any(not s for s in stops):
        raise APIError("stop strings must not be empty", param="stop")
    if any(len(s) > MAX_STOP_LENGTH for s in stops):
        raise APIError(f"a stop string may hold at most {MAX_STOP_LENGTH} characters", param="stop")
    return tuple(stops)


# --------------------------------------------------------------------- responses


def completion_id(chat: bool) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"


def usage(outputs: list[RequestOutput], prompt_only: bool = False) -> dict[str, int]:
    """The tokens of a request's prompts and completions (``prompt_only``: the one token
    the engine generated for each is not part of the answer)."""
    prompt = sum(len(output.prompt) for output in outputs)
    completion = 0
    if not prompt_only:
        completion = sum(len(tokens) for output in outputs for tokens in output.outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def finish_reason(reason: str | None) -> str | None:
    return None if reason is None else FINISH_REASONS[reason]


def chunk(chat: bool, id: str, created: int, model: str, choices: list[dict]) -> dict:
    return {
        "id": id,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
    }


def chunk_choice(
    chat: bool, index: int, text: str | None, reason: str | None, logprobs: dict | None = None
) -> dict:
    """One choice of a streamed chunk: ``text`` is the delta (``None``: the opening chunk of a
    chat choice, which carries the role), ``logprobs`` those of its tokens."""
    choice: dict[str, Any] = {"index": index}
    if chat:
        opening = text is None
        choice["delta"] = {"role": "assistant", "content": ""} if opening else {"content": text}
    else:
        choice["text"] = text or ""
    choice["finish_reason"] = finish_reason(reason)
    choice["logprobs"] = logprobs
    return choice


def model_card(name: str, created: int, max_model_len: int) -> dict:
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "paged_attention",
        "max_model_len": max_model_len,
    }
