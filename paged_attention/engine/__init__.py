"""A small continuous-batching engine over a transformers causal LM with a paged KV cache.

Parts each readable on its own (the split of nano-vllm and vLLM v1; docs/engine.md):

* :class:`~paged_attention.engine.engine.Engine` — the door: requests in, outputs out
  (``generate``, ``step``, ``stream``, ``abort``), built from an :class:`EngineConfig`;
* :class:`~paged_attention.engine.input_processor.InputProcessor` — prompts to validated
  requests;
* :class:`~paged_attention.engine.prompt_renderer.PromptRenderer` — the tokenizer's work on
  prompts (chat template with tools, text to ids and back), shared with the server;
* :class:`~paged_attention.engine.core.EngineCore` — a step: schedule, run, sample, update;
* :class:`~paged_attention.engine.scheduler.Scheduler` — pure policy over the block manager:
  admission, resumption of swapped requests, preemption, the per-step token budget (chunked
  prefill) and prefix-cache hits, and every block change of a step;
* :class:`~paged_attention.engine.model_runner.ModelRunner` — carries out the step's block
  copies and swaps and runs one packed forward pass of the model over the paged cache;
* :class:`~paged_attention.engine.output_processor.OutputProcessor` — text, stop strings and
  exactly-once delivery of every output.
"""

from paged_attention.engine.config import (
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from paged_attention.engine.engine import Engine, EngineStats, RequestStream
from paged_attention.engine.prompt_renderer import ChatPrompt, PromptRenderer
from paged_attention.engine.request import (
    Logprob,
    RequestError,
    RequestMetrics,
    RequestOutput,
    SamplingParams,
)
from paged_attention.engine.structured_output import StructuredOutputParams

__all__ = [
    "CacheConfig",
    "ChatPrompt",
    "Engine",
    "EngineConfig",
    "EngineStats",
    "Logprob",
    "PromptRenderer",
    "RequestError",
    "RequestMetrics",
    "RequestOutput",
    "RequestStream",
    "SamplingParams",
    "SchedulerConfig",
    "SpeculativeConfig",
    "StructuredOutputParams",
]
