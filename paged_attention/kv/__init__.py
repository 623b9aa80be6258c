"""The KV layer: the block manager that plans which block holds every token
(:mod:`~paged_attention.kv.block_manager` over its pools, tables and swap space), the paged
KV cache that carries the plans out (:mod:`~paged_attention.kv.cache`), the state slots of
hybrid models beside the blocks (:mod:`~paged_attention.kv.state_pool`), and what the plans
become on their way to the kernels: :class:`StepInputs` (a step's host arrays) and
:func:`build_metadata`, the one place an :class:`~paged_attention.attention.AttentionMetadata`
is built."""

from paged_attention.kv.step_inputs import StaticStepBuffers, StepInputs, build_metadata

__all__ = ["StaticStepBuffers", "StepInputs", "build_metadata"]
