"""A small continuous-batching engine over a transformers causal LM with a paged KV cache.

Three parts, each readable on its own (the split of nano-vllm and vLLM v1):

* :class:`~paged_attention.engine.scheduler.Scheduler` — pure policy over the block manager:
  admission, resumption of swapped requests, preemption, the per-step token budget (chunked
  prefill) and prefix-cache hits;
* :class:`~paged_attention.engine.model_runner.ModelRunner` — carries out the step's block
  copies and swaps and runs one packed forward pass of the model over the paged cache;
* :class:`~paged_attention.engine.engine.Engine` — the facade: requests in, outputs out
  (``generate``, ``step``, ``stream``, ``abort``), sampling and beam search in between.
"""

from paged_attention.engine.engine import Engine, EngineStats, RequestStream
from paged_attention.engine.request import (
    Logprob,
    RequestError,
    RequestMetrics,
    RequestOutput,
    SamplingParams,
)
from paged_attention.engine.structured_output import StructuredOutputParams

__all__ = [
    "Engine",
    "EngineStats",
    "Logprob",
    "RequestError",
    "RequestMetrics",
    "RequestOutput",
    "RequestStream",
    "SamplingParams",
    "StructuredOutputParams",
]
