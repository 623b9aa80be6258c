"""The way in: a prompt (token ids, text, or chat messages through the tokenizer's template, both
by the :class:`~paged_attention.engine.prompt_renderer.PromptRenderer` that the server uses
too) and its :class:`SamplingParams` become a validated :class:`Request`, checked once against one
source of limits (:class:`RequestLimits`) and the KV pool the scheduler plans over. A request
that passes can run; one that could never run is refused here, naming the argument."""

from __future__ import annotations

import itertools
import numbers
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Union

import torch

from paged_attention.engine.prompt_renderer import ChatPrompt, PromptRenderer
from paged_attention.engine.request import Request, RequestError, RequestMetrics, SamplingParams

Prompt = Union[Sequence[int], torch.Tensor, str, Sequence[Mapping[str, str]], ChatPrompt]
"""Token ids; or, for an engine with a tokenizer, text or chat messages (a list of them, or a
:class:`ChatPrompt` with tools or template options)."""


@dataclass(frozen=True)
class RequestLimits:
    """What a request may ask of an engine: token ids below ``vocab_size``, at most
    ``max_model_len`` positions (prompt and new tokens; ``None``: no limit) and at most
    ``max_num_seqs`` sequences."""

    vocab_size: int
    max_model_len: int | None
    max_num_seqs: int


class InputProcessor:
    """Turns prompts into validated requests for one engine: its ``tokenizer`` (or None: token
    ids only), ``limits``, the ``scheduler`` whose pool a request must fit, and the ``device``
    of each request's generator. Request ids count up from 0."""

    def __init__(self, tokenizer, limits: RequestLimits, scheduler, device) -> None:
        self.tokenizer = tokenizer
        self.renderer = None if tokenizer is None else PromptRenderer(tokenizer)
        self.limits = limits
        self.scheduler = scheduler
        self.device = device
        self._request_ids = itertools.count()
        self._grammar_compiler = None

    def process(
        self, prompt: Prompt, params: SamplingParams, arrival_time: float | None = None
    ) -> Request:
        """A validated :class:`Request` for ``prompt`` (token ids, or with a tokenizer text or
        chat messages) and ``params``; raises :class:`RequestError` naming what is wrong."""
        if not isinstance(params, SamplingParams):
            raise RequestError(
                f"params must be SamplingParams, got {type(params).__name__}", "params"
            )
        if params.stop and self.tokenizer is None:
            raise RequestError(
                "stop strings need an engine with a tokenizer (Engine(tokenizer=...))", "stop"
            )
        params.check_vocabulary(self.limits.vocab_size)
        grammar = self._grammar(params)
        tokens = self.prompt_ids(prompt)
        if not tokens:
            raise RequestError("prompt must hold at least one token", "prompt")
        outside = [t for t in tokens if not 0 <= t < self.limits.vocab_size]
        if outside:
            raise RequestError(
                f"prompt token {outside[0]} is outside the model's vocabulary [0, "
                f"{self.limits.vocab_size})",
                "prompt",
            )
        if params.num_seqs > self.limits.max_num_seqs:
            raise RequestError(
                f"the request runs {params.num_seqs} sequences, more than "
                f"max_num_seqs={self.limits.max_num_seqs}",
                "beam_width" if params.is_beam_search else "n",
            )
        wanted = len(tokens) + params.max_new_tokens
        if self.limits.max_model_len is not None and wanted > self.limits.max_model_len:
            raise RequestError(
                f"the prompt ({len(tokens)} tokens) and max_new_tokens ({params.max_new_tokens}) "
                f"need {wanted} positions; the model's context holds {self.limits.max_model_len}",
                "prompt" if len(tokens) >= self.limits.max_model_len else "max_new_tokens",
                limit="context",
            )
        request = Request(
            request_id=next(self._request_ids),
            prompt=tokens,
            params=params,
            generator=torch.Generator(device=self.device).manual_seed(params.seed),
            metrics=RequestMetrics(time.perf_counter() if arrival_time is None else arrival_time),
        )
        request.grammar = grammar
        reason = self.scheduler.rejection_reason(request)
        if reason is not None:
            prompt_blocks = -(-(len(tokens) + 1) // self.scheduler.block_manager.block_size)
            raise RequestError(
                f"the request can never run in this engine's KV cache: {reason}",
                "prompt"
                if prompt_blocks > self.scheduler.block_manager.num_device_blocks
                else "max_new_tokens",
                limit="kv_cache",
            )
        return request

    def _grammar(self, params: SamplingParams):
        """The request's compiled grammar (``structured_output``), or None; the compiler is
        built at the first request that needs it."""
        if params.structured_output is None:
            return None
        if self.tokenizer is None:
            raise RequestError(
                "structured_output needs an engine with a tokenizer (Engine(tokenizer=...))",
                "structured_output",
            )
        from paged_attention.engine.structured_output import GrammarCompiler, RequestGrammar

        if self._grammar_compiler is None:
            self._grammar_compiler = GrammarCompiler(self.tokenizer, self.limits.vocab_size)
        return RequestGrammar(self._grammar_compiler.compile(params.structured_output))

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt given as ids, text or chat messages (rendered by
        :attr:`renderer`, the one the server uses too)."""
        if isinstance(prompt, (str, ChatPrompt)) or _is_chat(prompt):
            if self.renderer is None:
                kind = "text" if isinstance(prompt, str) else "chat messages"
                raise RequestError(
                    f"a prompt of {kind} needs an engine with a tokenizer (Engine(tokenizer=...)); "
                    "without one, pass token ids",
                    "prompt",
                )
            if isinstance(prompt, str):
                return self.renderer.text_ids(prompt)
            chat = prompt if isinstance(prompt, ChatPrompt) else ChatPrompt(list(prompt))
            return self.renderer.chat_ids(chat)
        try:
            return _token_list(prompt)
        except (TypeError, ValueError) as error:
            raise RequestError(str(error), "prompt") from None


def _token_list(prompt) -> list[int]:
    tokens = prompt.tolist() if hasattr(prompt, "tolist") else list(prompt)
    for token in tokens:
        if isinstance(token, bool) or not isinstance(token, numbers.Integral):
            raise ValueError(f"prompt tokens must be integers, got {token!r}")
    return [int(t) for t in tokens]


def _is_chat(prompt) -> bool:
    return isinstance(prompt, (list, tuple)) and bool(prompt) and isinstance(prompt[0], Mapping)
