"""The engine's :class:`~paged_attention.engine.prompt_renderer.PromptRenderer` for the server,
off the event loop: the server process renders chat templates and tokenizes with its own
tokenizer (its engine may run in another process and takes token ids), in a worker thread. A
huge prompt takes seconds to tokenize; in a worker thread it delays only the requests tokenized
after it, never the streams already running (the tokenizer releases the GIL while it works).

One worker: a tokenizer object is not meant to be used from several threads at once.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Future, ThreadPoolExecutor

from paged_attention.engine import PromptRenderer, RequestError
from paged_attention.engine.prompt_renderer import ChatPrompt, NoChatTemplateError
from paged_attention.server.protocol import APIError


class PromptBuilder:
    """Runs work on :attr:`renderer` (over ``tokenizer``, for the model served as
    ``model_name``) in a thread of its own; ``close()`` stops it."""

    def __init__(self, tokenizer, model_name: str) -> None:
        self.renderer = PromptRenderer(tokenizer, model_name)
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")

    def warm_up(self) -> Future:
        """Render and tokenize a one-message chat in the worker thread (not waited for), so
        that the first request does not wait for the chat template's compile and the
        tokenizer's first call (tens of milliseconds on a busy 2-core machine); a model without a
        chat template (or whose template refuses that chat) tokenizes a text instead."""
        return self._worker.submit(self._warm_up)

    def _warm_up(self) -> None:
        try:
            self.renderer.chat_ids(ChatPrompt([{"role": "user", "content": "Hello"}]))
        except RequestError:  # the first request of this kind gets the refusal itself
            self.renderer.text_ids("Hello")

    def close(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)

    async def run(self, function, *args):
        """``function(*args)`` in the tokenizer's thread; a refusal of the renderer comes back
        as the APIError naming the request's field (the renderer names it as the caller
        passed it)."""
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._worker, function, *args)
        except RequestError as error:
            raise rendering_refusal(error) from None


def rendering_refusal(error: RequestError) -> APIError:
    """A renderer's refusal as a 400; a model without a chat template is pointed to the
    completions route, the HTTP form of giving the prompt as text."""
    if isinstance(error, NoChatTemplateError):
        message = f"the model {error.model_name!r} has no chat template; use /v1/completions"
        return APIError(message, param=error.argument)
    return APIError(str(error), param=error.argument)
