"""What the block manager's plans become on their way to the kernels: :class:`StepInputs` (a
step's host arrays) and :func:`build_metadata`, the one place an
:class:`~paged_attention.attention.AttentionMetadata` is built."""

from paged_attention.kv.step_inputs import StaticStepBuffers, StepInputs, build_metadata

__all__ = ["StaticStepBuffers", "StepInputs", "build_metadata"]
