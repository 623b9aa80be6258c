"""An OpenAI-compatible HTTP server over the engine (``paged-attention serve``).

* :mod:`~paged_attention.server.protocol` — the request bodies accepted (strictly typed; an
  OpenAI field that is not carried out is refused, a field OpenAI does not define is ignored
  with a warning), OpenAI-style errors, the sampling parameters, the chunk and usage bodies;
* :mod:`~paged_attention.server.security` — what is checked before any work: the API key,
  JSON-only bodies, the body size;
* :mod:`~paged_attention.server.prompts` — the engine's prompt renderer (chat template, text to
  token ids and back), run in a worker thread off the event loop;
* :mod:`~paged_attention.server.tokenization` — ``/tokenize`` and ``/detokenize``;
* :mod:`~paged_attention.server.engine_owner` — the owner that steps the engine, fed by a
  queue, handing outputs back to the event loop: in a thread, or with the engine in a process
  of its own (:mod:`~paged_attention.server.engine_process`, what ``serve`` runs);
* :mod:`~paged_attention.server.answers` — the engine's outputs of a request's prompts as
  OpenAI's choices (whole or streamed; ``echo``; a batch of prompts);
* :mod:`~paged_attention.server.logprobs` — log probabilities in OpenAI's chat and legacy
  completions shapes;
* :mod:`~paged_attention.server.client_watch` — waiting for outputs while watching the
  client's connection;
* :mod:`~paged_attention.server.metrics` — Prometheus metrics read in the owner thread;
* :mod:`~paged_attention.server.app` — the Starlette application, its routes and the bound on
  waiting requests.

Needs the ``serve`` extra, installed from source (``pip install --no-build-isolation
'.[serve]'``): Starlette, uvicorn, pydantic and prometheus_client.
"""

import importlib

# Imported when first used (PEP 562): serve starts the engine's process from
# paged_attention.server.engine_process before it imports Starlette and the server's modules
# (the forked child need not hold them).
_EXPORTS = {
    "create_app": "paged_attention.server.app",
    "EngineOwner": "paged_attention.server.engine_owner",
}

__all__ = ["EngineOwner", "create_app"]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
