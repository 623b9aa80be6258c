"""An engine's settings, validated once: :class:`CacheConfig` (the paged KV cache: its size,
block size, swap space, dtype and prefix caching), :class:`SchedulerConfig` (the sequences and
tokens of a step), :class:`SpeculativeConfig` (drafted tokens per step) and
:class:`EngineConfig`, which holds them and the execution switches.

Each dataclass checks its fields in ``__post_init__`` and raises ValueError (TypeError for a
value of the wrong kind) naming the field; the parts built from a config (the KV cache, the
scheduler, the model runner) take it as given. ``Engine(model, **kwargs)`` is the short door:
:meth:`EngineConfig.from_kwargs` sorts its keyword arguments into these dataclasses.

The KV cache is sized from the model's geometry in one place, :meth:`CacheConfig.build`: a
number of blocks, or a memory budget (bytes, or a fraction of the free memory) the cache fills
with as many blocks as fit. A block count is checked against the memory there is before
anything is allocated (:meth:`CacheConfig.memory_shortfall`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from paged_attention.kv import cache as _cache_module
from paged_attention.kv.cache import (
    PagedKVCache,
    bytes_per_block,
    default_num_host_blocks,
    num_blocks_for_budget,
)
from paged_attention.modeling.mla import check_form as check_mla_form
from paged_attention.ops.supported import FP8_FORMATS


def _check_int(name: str, value, low: int, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")


def _check_bool(name: str, value, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")


class KVBudgetError(ValueError):
    """A KV cache larger than the memory there is for it; ``detail`` says by how much."""

    def __init__(self, message: str, detail: str) -> None:
        super().__init__(message)
        self.detail = detail


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache. Its size: ``num_blocks`` device blocks, or ``max_memory`` (bytes as
    an int, or a fraction in (0, 1] of the free CUDA memory / available host memory as a float)
    filled with as many blocks as fit; exactly one of the two. ``num_host_blocks``: host swap
    space for preempted requests (``None``: four times the blocks on a GPU, none on a CPU, where
    "host" blocks would be more of the same RAM; 0: preemption recomputes). ``kv_cache_dtype``
    ``"auto"`` (the model's dtype) or an fp8 format, with fixed ``k_scale``/``v_scale`` or
    neither (calibrated from the first step). ``enable_prefix_caching``: a prompt whose leading
    full blocks are cached computes only the rest. ``mla``: how multi-head latent attention is
    cached, ``"latent"``, ``"expanded"`` or None (latent unless the cache is fp8 or the decode
    steps are CUDA graphs or compiled: :func:`paged_attention.modeling.mla.resolve`)."""

    block_size: int = 16
    num_blocks: int | None = None
    max_memory: int | float | None = None
    num_host_blocks: int | None = None
    kv_cache_dtype: str = "auto"
    k_scale: float | None = None
    v_scale: float | None = None
    enable_prefix_caching: bool = True
    mla: str | None = None

    def __post_init__(self) -> None:
        check_mla_form(self.mla)
        _check_int("block_size", self.block_size, 1)
        _check_int("num_blocks", self.num_blocks, 1, optional=True)
        _check_int("num_host_blocks", self.num_host_blocks, 0, optional=True)
        if (self.num_blocks is None) == (self.max_memory is None):
            raise ValueError("give num_blocks or max_memory (exactly one of them)")
        memory = self.max_memory
        if isinstance(memory, float):
            if not 0.0 < memory <= 1.0:
                raise ValueError(f"max_memory as a fraction must be in (0, 1], got {memory}")
        elif memory is not None:
            _check_int("max_memory", memory, 1)
        if self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in FP8_FORMATS:
            formats = ", ".join(repr(f) for f in ("auto", *FP8_FORMATS))
            raise ValueError(
                f"kv_cache_dtype must be one of {formats}, got {self.kv_cache_dtype!r}"
            )
        if (self.k_scale is None) != (self.v_scale is None):
            raise ValueError("give both k_scale and v_scale, or neither (calibrated)")
        for name in ("k_scale", "v_scale"):
            scale = getattr(self, name)
            if scale is not None and not (isinstance(scale, (int, float)) and scale > 0):
                raise ValueError(f"{name} must be a positive number, got {scale!r}")
        _check_bool("enable_prefix_caching", self.enable_prefix_caching)

    def block_bytes(self, geometry) -> int:
        """Bytes one block takes over every layer of the model ``geometry`` describes."""
        return bytes_per_block(
            geometry.num_layers,
            geometry.num_kv_heads,
            geometry.head_size,
            self.block_size,
            geometry.dtype,
            self.kv_cache_dtype,
            v_head_size=geometry.v_head_size,
        )

    def sizes(self, geometry, extra_block_bytes: int = 0) -> tuple[int, int]:
        """``(device blocks, host blocks)`` for the model ``geometry`` describes: ``num_blocks``
        or as many as ``max_memory`` holds, and ``num_host_blocks`` or its default for the
        model's device. Raises ValueError naming ``max_memory`` when it holds no block.
        ``extra_block_bytes``: device bytes set aside beside each block (a draft model's pool
        has one block for each of the model's), paid by ``max_memory`` too."""
        num_blocks = self.num_blocks
        if num_blocks is None:
            memory = self.max_memory
            fraction = memory if isinstance(memory, float) else None
            budget = None if fraction is not None else memory
            try:
                num_blocks = num_blocks_for_budget(
                    self.block_bytes(geometry) + extra_block_bytes,
                    geometry.device,
                    budget,
                    fraction,
                )
            except ValueError as error:
                raise ValueError(f"max_memory={memory!r}: {error}") from None
        host = self.num_host_blocks
        if host is None:
            host = default_num_host_blocks(num_blocks, geometry.device)
        return num_blocks, host

    def memory_shortfall(self, geometry, extra_block_bytes: int = 0) -> str | None:
        """Why the cache (device blocks, ``extra_block_bytes`` beside each, and host swap space)
        does not fit the memory available on the model's device and on the host, or None."""
        num_blocks, host_blocks = self.sizes(geometry, extra_block_bytes)
        device = geometry.device
        block = self.block_bytes(geometry)
        host_available = _cache_module._host_available_bytes()
        on_device, on_host = num_blocks * (block + extra_block_bytes), host_blocks * block
        if device.type == "cuda":
            device_free = torch.cuda.mem_get_info(device)[0]
        else:
            device_free, on_host = host_available, on_host + on_device
        for needed, available, where in (
            (on_device, device_free, f"{device.type} memory"),
            (on_host, host_available, "host memory (device blocks on a CPU and swap space)"),
        ):
            if needed > available:
                return (
                    f"{num_blocks} blocks of {block + extra_block_bytes} bytes need "
                    f"{needed / 2**30:.1f} GiB "
                    f"of {where}; {available / 2**30:.1f} GiB are available"
                )
        return None

    def build(self, geometry, extra_block_bytes: int = 0) -> PagedKVCache:
        """The model's KV cache as this config sizes it (:meth:`sizes`, with
        ``extra_block_bytes`` beside each block left to its owner); raises
        :class:`KVBudgetError` before allocating anything when it does not fit the memory
        there is."""
        shortfall = self.memory_shortfall(geometry, extra_block_bytes)
        if shortfall is not None:
            name = "num_blocks" if self.num_blocks is not None else "max_memory"
            raise KVBudgetError(f"{name}: {shortfall}", shortfall)
        num_blocks, host_blocks = self.sizes(geometry, extra_block_bytes)
        return geometry.kv_cache(
            self.block_size,
            num_blocks,
            None,
            num_host_blocks=host_blocks,
            kv_cache_dtype=self.kv_cache_dtype,
            k_scale=self.k_scale,
            v_scale=self.v_scale,
        )


@dataclass(frozen=True)
class SchedulerConfig:
    """What one step may hold: ``max_num_seqs`` sequences running at once (every sample and
    beam counts), ``max_num_batched_tokens`` tokens computed (``None``: no limit; else at least
    ``max_num_seqs``, since every running sequence decodes a token per step; longer prompts
    are prefilled in chunks over several steps)."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None

    def __post_init__(self) -> None:
        seqs, tokens = self.max_num_seqs, self.max_num_batched_tokens
        if isinstance(seqs, bool) or not isinstance(seqs, int) or seqs < 1:
            raise ValueError(f"max_num_seqs must be an integer >= 1, got {seqs!r}")
        if tokens is not None and (
            isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < seqs
        ):
            raise ValueError(
                "max_num_batched_tokens must be None (no limit) or an integer >= max_num_seqs "
                f"({seqs}: every running sequence decodes a token per step), got {tokens!r}"
            )


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: each step, every decoding sequence of a request that can take them
    (one sample, no beam search, no structured output) is fed up to ``num_speculative_tokens``
    drafted tokens besides its last one, and keeps those the model itself would have chosen,
    plus one token of the model's own (docs/engine.md, "Speculative decoding"). ``method``:
    ``"ngram"`` (prompt lookup, vLLM's ``ngram``): the longest n-gram of ``prompt_lookup_max``
    down to ``prompt_lookup_min`` tokens ending the sequence is looked up earlier in its prompt
    and output, and the tokens that followed its first occurrence are the drafts;
    ``"draft_model"``: ``draft_model``, a smaller causal LM over the same vocabulary (a
    transformers model on the target's device), proposes its greedy continuation
    (:mod:`paged_attention.engine.draft_model`)."""

    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    draft_model: torch.nn.Module | None = field(default=None, repr=False)

    METHODS = ("ngram", "draft_model")

    def __post_init__(self) -> None:
        if self.method not in self.METHODS:
            raise ValueError(f"method must be one of {self.METHODS}, got {self.method!r}")
        if self.method == "draft_model" and not isinstance(self.draft_model, torch.nn.Module):
            raise TypeError(
                "draft_model must be a torch.nn.Module (a causal LM) with method='draft_model', "
                f"got {type(self.draft_model).__name__}"
            )
        if self.method != "draft_model" and self.draft_model is not None:
            raise ValueError(
                f"draft_model is used by method='draft_model' only, got method={self.method!r}"
            )
        _check_int("num_speculative_tokens", self.num_speculative_tokens, 1)
        _check_int("prompt_lookup_min", self.prompt_lookup_min, 1)
        _check_int("prompt_lookup_max", self.prompt_lookup_max, 1)
        if self.prompt_lookup_max < self.prompt_lookup_min:
            raise ValueError(
                f"prompt_lookup_max ({self.prompt_lookup_max}) must be >= prompt_lookup_min "
                f"({self.prompt_lookup_min})"
            )


@dataclass(frozen=True)
class EngineConfig:
    """Everything an :class:`~paged_attention.engine.Engine` is built from but the model and
    tokenizer: its ``cache`` and ``scheduler`` configs; ``cuda_graphs`` (``None``: on for a
    model on one CUDA device) and ``compile`` (decode steps through ``torch.compile``, a CPU
    model) for the decode steps; ``eos_token_id`` (one id or several; ``None``: the model's
    generation config's); ``speculative`` (a :class:`SpeculativeConfig`, or a dict of its
    fields; ``None``: off)."""

    cache: CacheConfig
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cuda_graphs: bool | None = None
    compile: bool = False
    eos_token_id: int | tuple[int, ...] | None = None
    speculative: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.cache, CacheConfig):
            raise TypeError(f"cache must be a CacheConfig, got {type(self.cache).__name__}")
        if not isinstance(self.scheduler, SchedulerConfig):
            raise TypeError(
                f"scheduler must be a SchedulerConfig, got {type(self.scheduler).__name__}"
            )
        _check_bool("cuda_graphs", self.cuda_graphs, optional=True)
        if not isinstance(self.compile, bool):
            raise ValueError(f"compile must be True or False, got {self.compile!r}")
        eos = self.eos_token_id
        if eos is not None and not isinstance(eos, int):
            try:
                eos = tuple(eos)
            except TypeError:
                raise TypeError(f"eos_token_id must be an int or ints, got {eos!r}") from None
            object.__setattr__(self, "eos_token_id", eos)
        ids = () if eos is None else (eos,) if isinstance(eos, int) else eos
        for token in ids:
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise ValueError(f"eos_token_id must hold token ids >= 0, got {token!r}")
        self._check_speculative()

    def _check_speculative(self) -> None:
        speculative = self.speculative
        if isinstance(speculative, dict):
            try:
                speculative = SpeculativeConfig(**speculative)
            except TypeError as error:
                raise TypeError(f"speculative: {error}") from None
            object.__setattr__(self, "speculative", speculative)
        if speculative is not None and not isinstance(speculative, SpeculativeConfig):
            raise TypeError(
                "speculative must be a SpeculativeConfig, a dict of its fields or None, got "
                f"{type(speculative).__name__}"
            )

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineConfig:
        """The config ``Engine(model, **kwargs)`` builds: every keyword argument named after a
        field of :class:`CacheConfig`, :class:`SchedulerConfig` or this class goes to it;
        another name raises TypeError."""
        parts: dict[type, dict] = {CacheConfig: {}, SchedulerConfig: {}, cls: {}}
        owners = {f.name: part for part in parts for f in dataclasses.fields(part)}
        for name, value in kwargs.items():
            if name in ("cache", "scheduler") or name not in owners:
                raise TypeError(f"Engine got an unexpected keyword argument {name!r}")
            parts[owners[name]][name] = value
        return cls(
            CacheConfig(**parts[CacheConfig]),
            SchedulerConfig(**parts[SchedulerConfig]),
            **parts[cls],
        )
