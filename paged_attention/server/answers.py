"""A request's answer in OpenAI's shapes, from the engine's outputs of its prompts: the choices
of a whole answer, or those of each chunk of a stream.

Choice ``prompt_index * n + sample`` answers sample ``sample`` of prompt ``prompt_index`` (a
completion request may hold several prompts; a chat request has one). ``echo`` puts the prompt
(and its logprobs, the first token's ``None``) before the completion; with ``max_tokens: 0`` the
one token the engine generated is left out and the choice ends as ``"length"``. A chat answer
to a request with tools (``tool_choice`` other than ``"none"``) has its tool calls read out of
its text (:mod:`~paged_attention.server.tool_calls`; in the server's call format, Hermes when
a grammar forces the calls): ``message.tool_calls``, or in a stream OpenAI's
``delta.tool_calls``, each call's name as soon as it is read and its arguments as they are
written; and ``finish_reason: "tool_calls"``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from paged_attention.engine import RequestOutput, SamplingParams
from paged_attention.server import protocol
from paged_attention.server.logprobs import CompletionLogprobs, TokenPieces, chat_content, joined
from paged_attention.server.tool_calls import HERMES, CallFormat, ToolCallReader, stream_deltas


@dataclass(frozen=True)
class PromptJob:
    """One prompt of a request: its token ids, its text (what ``echo`` shows) and the
    engine's parameters for it."""

    ids: list[int]
    text: str
    params: SamplingParams


class Answer:
    """Turns the outputs of a request's prompts into OpenAI's choices. A stream's deltas are
    taken in order (each output once); the state they keep is the stream's."""

    def __init__(
        self,
        body,
        pieces: TokenPieces,
        prompts: list[PromptJob],
        tool_call_format: CallFormat = HERMES,
    ) -> None:
        self.chat = isinstance(body, protocol.ChatCompletionRequest)
        self.pieces = pieces
        self.prompts = prompts
        self.n = prompts[0].params.n
        self.echo = bool(getattr(body, "echo", False))
        self.prompt_only = body.prompt_only
        self.wants_logprobs = bool(body.logprobs) if self.chat else body.logprobs is not None
        self.top = prompts[0].params.logprobs or 0
        self._offsets: dict[int, CompletionLogprobs] = {}  # per choice of a stream
        self._echoed: set[int] = set()
        self._reported: set[int] = set()
        # Tool calls are read out of the text when the model was given tools to call (forced
        # ones too: their grammar writes them in the same format).
        self.reads_tool_calls = self.chat and body.tool_mode != "none"
        self.tool_call_format = tool_call_format
        self.parallel_tool_calls = getattr(body, "parallel_tool_calls", None) is not False
        self._tool_readers: dict[int, ToolCallReader] = {}  # per choice of a stream

    # ------------------------------------------------------------------ whole answers

    def response(self, request_id: str, model: str, finals: list[RequestOutput]) -> dict:
        """The whole answer, from each prompt's final output."""
        choices = []
        for p, output in enumerate(finals):
            for s, reason in enumerate(output.finish_reasons):
                choices.append(self._whole_choice(p, s, output, reason))
        return {
            "id": request_id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": int(time.time()),
            "model": model,
            "choices": choices,
            "usage": self.usage(finals),
        }

    def usage(self, finals: list[RequestOutput]) -> dict[str, int]:
        return protocol.usage(finals, self.prompt_only)

    def _whole_choice(self, p: int, s: int, output: RequestOutput, reason: str | None) -> dict:
        choice: dict = {"index": p * self.n + s}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": output.texts[s]}
            if self.reads_tool_calls:
                reader = self._tool_reader()
                reader.feed(output.texts[s], final=True)
                choice["message"]["content"] = reader.content
                if reader.calls:
                    choice["message"]["tool_calls"] = reader.calls
                reason = _with_tool_calls(reason, reader)
            logprobs = None
            if self.wants_logprobs:
                content = chat_content(self.pieces, output.outputs[s], output.logprobs[s], self.top)
                logprobs = {"content": content}
        else:
            legacy = CompletionLogprobs(self.pieces)
            text, parts = "", []
            if self.echo:
                text = self.prompts[p].text
                parts.append(legacy.piece(self.prompts[p].ids, output.prompt_logprobs or []))
            if not self.prompt_only:
                text += output.texts[s]
                entries = output.logprobs[s] if output.logprobs is not None else []
                parts.append(legacy.piece(output.outputs[s], entries))
            choice["text"] = text
            logprobs = joined(parts) if self.wants_logprobs else None
            reason = "length" if self.prompt_only else reason
        choice["finish_reason"] = protocol.finish_reason(reason)
        choice["logprobs"] = logprobs
        return choice

    # ------------------------------------------------------------------ streams

    def deltas(self, p: int, output: RequestOutput) -> list[dict]:
        """The chunk choices that ``output`` (of prompt ``p``) adds to a stream: for each
        sample with new text, new tokens whose logprobs are asked for, or a finish not
        reported yet."""
        choices = []
        for s in range(self.n):
            index = p * self.n + s
            if index in self._reported:
                continue
            reason = output.finish_reasons[s] if s < len(output.finish_reasons) else None
            if self.prompt_only and reason is not None:
                reason = "length"
            text, logprobs = self._delta(p, s, index, output, reason)
            if self.reads_tool_calls:
                if index not in self._tool_readers:
                    self._tool_readers[index] = self._tool_reader()
                reader = self._tool_readers[index]
                deltas = stream_deltas(reader.feed(text, final=reason is not None))
                reason = _with_tool_calls(reason, reader)
            else:
                deltas = [{"content": text}] if text else []
            if reason is not None:
                self._reported.add(index)
            choices += _chunk_choices(self.chat, index, deltas, reason, logprobs)
        return choices

    def _tool_reader(self) -> ToolCallReader:
        return ToolCallReader(self.tool_call_format, self.parallel_tool_calls)

    def _delta(self, p: int, s: int, index: int, output: RequestOutput, reason):
        """Sample ``s``'s new text and logprobs in ``output``."""
        text = output.new_texts[s] if s < len(output.new_texts) else ""
        tokens = output.new_tokens[s] if s < len(output.new_tokens) else []
        entries = []
        if output.new_logprobs is not None and s < len(output.new_logprobs):
            entries = output.new_logprobs[s]
        if self.chat:
            if not (self.wants_logprobs and tokens):
                return text, None
            return text, {"content": chat_content(self.pieces, tokens, entries, self.top)}
        legacy = self._offsets.setdefault(index, CompletionLogprobs(self.pieces))
        parts = []
        if self.prompt_only:
            text, tokens = "", []
        # the prompt's logprobs are complete once a sample has tokens (or ended)
        if self.echo and index not in self._echoed and (tokens or reason is not None):
            self._echoed.add(index)
            prompt = self.prompts[p]
            text = prompt.text + text
            parts.append(legacy.piece(prompt.ids, output.prompt_logprobs or []))
        if tokens:
            parts.append(legacy.piece(tokens, entries))
        logprobs = joined(parts) if self.wants_logprobs and parts else None
        return text, logprobs


def _chunk_choices(chat: bool, index: int, deltas: list[dict], reason, logprobs) -> list[dict]:
    """Choice ``index``'s chunks for one output: one per delta (the logprobs with the first,
    the finish reason with the last), or one empty delta for logprobs or a finish alone."""
    if not deltas:
        if not (logprobs or reason is not None):
            return []
        return [protocol.chunk_choice(chat, index, "", reason, logprobs)]
    choices = []
    for k, delta in enumerate(deltas):
        last = k == len(deltas) - 1
        choice = protocol.chunk_choice(chat, index, "", reason if last else None)
        if chat:
            choice["delta"] = delta
        else:
            choice["text"] = delta["content"]
        choice["logprobs"] = logprobs if k == 0 else None
        choices.append(choice)
    return choices


def _with_tool_calls(reason: str | None, reader: ToolCallReader) -> str | None:
    """A choice that ended by itself (not at its length limit) with tool calls ends as
    ``"tool_calls"``."""
    return "tool_calls" if reason in ("eos", "stop") and reader.calls else reason
