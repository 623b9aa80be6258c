"""``POST /tokenize`` and ``POST /detokenize`` in vLLM's shapes: a prompt (or chat messages,
through the model's template) to token ids, and token ids back to text, by the engine's
:class:`~paged_attention.engine.prompt_renderer.PromptRenderer` (the one a chat completion's
messages go through).

Requests: ``{"prompt", "add_special_tokens" (true), "return_token_strs" (false)}`` or
``{"messages", "add_generation_prompt" (true), "continue_final_message" (false),
"add_special_tokens" (false), "return_token_strs" (false), "tools" (rendered as in a chat
completion)}``, both with an optional ``model``;
``{"tokens": [ids], "model"}``. Answers: ``{"count", "max_model_len", "tokens",
"token_strs"}`` and ``{"prompt"}``.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError, model_validator

from paged_attention.engine import ChatPrompt, PromptRenderer
from paged_attention.server.protocol import (
    APIError,
    ChatMessage,
    StrictModel,
    Tool,
    validation_error,
)


class TokenizeCompletionRequest(StrictModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(StrictModel):
    model: str | None = None
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool | None = False
    tools: list[Tool] | None = None  # rendered as a chat completion's tools are
    # vLLM's template overrides: refused unless null (a client-written template is code)
    chat_template: Any = None
    chat_template_kwargs: Any = None

    @model_validator(mode="after")
    def _check(self):
        for name in ("chat_template", "chat_template_kwargs"):
            if getattr(self, name) is not None:
                raise APIError(
                    f"{name} is not supported by this server",
                    param=name,
                    code="unsupported_parameter",
                )
        if not self.messages:
            raise APIError("messages must hold at least one message", param="messages")
        if self.continue_final_message and self.add_generation_prompt:
            raise APIError(
                "continue_final_message and add_generation_prompt cannot both be true",
                param="continue_final_message",
            )
        return self

    def chat_prompt(self) -> ChatPrompt:
        """The conversation and the template's options as the engine's renderer takes them."""
        return ChatPrompt(
            [m.template_message() for m in self.messages],
            tools=[tool.model_dump(exclude_none=True) for tool in self.tools or ()],
            add_generation_prompt=self.add_generation_prompt,
            continue_final_message=self.continue_final_message,
            add_special_tokens=self.add_special_tokens,
        )


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[int]


def _parse(model: type[StrictModel], data: Any) -> StrictModel:
    try:
        return model.model_validate(data, strict=True)
    except ValidationError as error:
        raise validation_error(error) from None


def _json_object(raw: bytes) -> dict:
    try:
        data = json.loads(raw)
    except ValueError as error:
        raise APIError(
            f"the request body is not valid JSON: {error}", code="invalid_json"
        ) from None
    if not isinstance(data, dict):
        raise APIError("the request body must be a JSON object")
    return data


def tokenize(renderer: PromptRenderer, raw: bytes, check_model, max_model_len: int) -> dict:
    """Tokenizer thread: the answer to a ``/tokenize`` body."""
    data = _json_object(raw)
    if "messages" in data:
        request = _parse(TokenizeChatRequest, data)
        check_model(request.model)
        ids = renderer.chat_ids(request.chat_prompt(), argument="messages")
    else:
        request = _parse(TokenizeCompletionRequest, data)
        check_model(request.model)
        ids = renderer.text_ids(request.prompt, request.add_special_tokens, argument="prompt")
    strings = renderer.token_strings(ids) if request.return_token_strs else None
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strings}


def detokenize(renderer: PromptRenderer, raw: bytes, check_model) -> dict:
    """Tokenizer thread: the answer to a ``/detokenize`` body."""
    request = _parse(DetokenizeRequest, _json_object(raw))
    check_model(request.model)
    return {"prompt": renderer.text(request.tokens, argument="tokens")}
