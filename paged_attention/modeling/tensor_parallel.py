"""Tensor parallelism: how a model's attention heads are split over a ``torch.distributed``
process group, and the checks that every rank's paged cache makes the same decisions.

Each rank keeps a cache of its own heads with its own block manager; the managers agree because
every rank makes the same calls in the same order (docs/design.md, "Tensor parallelism").
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from paged_attention.attention import debug_checks_enabled


@dataclass(frozen=True)
class TensorParallel:
    """How a model's attention is split over a ``torch.distributed`` process group: ``size``
    ranks, rank ``r`` holding query heads ``[r * H / size, (r + 1) * H / size)`` and the KV heads
    they read (transformers' ``"colwise"`` q/k/v projections; Megatron-LM's split). ``size`` 1:
    one process holds every head.

    Each rank keeps a cache of its own heads with its own block manager, and the managers agree
    because every rank makes the same calls in the same order (docs/design.md, "Tensor
    parallelism"): no block table travels between ranks. :meth:`min_max` checks the cache sizes
    at construction; under ``PAGED_ATTENTION_DEBUG_CHECKS=1`` every step's tables and plan are
    compared too (:meth:`check_same_on_every_rank`)."""

    size: int = 1
    rank: int = 0
    group: object = field(default=None, compare=False)  # the torch.distributed ProcessGroup

    @classmethod
    def of(
        cls, model: torch.nn.Module, num_heads: int, num_kv_heads: int, head_size: int
    ) -> TensorParallel:
        """The split of ``model``: transformers' ``model.tp_size`` (set by ``from_pretrained``
        with a ``tp_plan`` or ``DistributedConfig``), else the device mesh of its attention
        weights (DTensors). Raises ValueError for a split PagedCache cannot serve."""
        declared = getattr(model, "tp_size", None)
        if not declared:
            distributed = getattr(model.config, "distributed_config", None)
            declared = getattr(distributed, "tp_size", None)
        attention = next(
            (m for m in model.modules() if hasattr(m, "q_proj") and hasattr(m, "k_proj")), None
        )
        weights = [] if attention is None else [attention.q_proj.weight, attention.k_proj.weight]
        mesh = next((w.device_mesh for w in weights if hasattr(w, "device_mesh")), None)
        size = int(declared or (mesh.size() if mesh is not None else 1))
        if size == 1:
            return cls()
        if num_heads % size:
            raise ValueError(
                f"the model's {num_heads} attention heads do not divide over a tensor-parallel "
                f"size of {size}: shard it over a number of ranks that divides {num_heads}"
            )
        if num_kv_heads % size:
            reason = (
                "each rank would need a replica of a KV head (vLLM replicates KV heads when "
                "the tensor-parallel size exceeds them), which PagedCache does not support"
                if num_kv_heads < size
                else "they do not divide over the ranks"
            )
            heads = f"{num_kv_heads} KV head" + ("s" if num_kv_heads > 1 else "")
            raise ValueError(
                f"the model has {heads} and a tensor-parallel size of {size}: {reason}; shard "
                f"it over a number of ranks that divides {num_kv_heads}"
            )
        group = _process_group(mesh, size)
        rank = torch.distributed.get_rank(group)
        local = [_local_rows(w) // head_size for w in weights]
        expected = [num_heads // size, num_kv_heads // size]
        if weights and local != expected:
            raise ValueError(
                f"tensor-parallel rank {rank} of {size} holds {local[0]} query heads and "
                f"{local[1]} KV heads, not {expected[0]} and {expected[1]}: PagedCache serves "
                "plans that split the q, k and v projections by whole heads (transformers' "
                '"colwise", as tp_plan="auto" does)'
            )
        return cls(size, rank, group)

    @property
    def checks_steps(self) -> bool:
        """Whether every step is compared across the ranks (``PAGED_ATTENTION_DEBUG_CHECKS=1``)."""
        return self.size > 1 and debug_checks_enabled()

    def min_max(self, values: Sequence[int]) -> tuple[list[int], list[int]]:
        """The smallest and the largest of each integer over the ranks: one all-reduce, which
        every rank must call with as many values."""
        values = [int(v) for v in values]
        if self.size == 1:
            return values, values
        backend = str(torch.distributed.get_backend(self.group))
        on_gpu = "nccl" in backend and "gloo" not in backend  # NCCL reduces only GPU tensors
        device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else None
        both = torch.tensor([*values, *(-v for v in values)], dtype=torch.int64, device=device)
        torch.distributed.all_reduce(both, torch.distributed.ReduceOp.MAX, group=self.group)
        both = both.tolist()
        return [-v for v in both[len(values) :]], both[: len(values)]

    def all_ranks(self, flags: Sequence[bool]) -> list[bool]:
        """Each flag and-ed over the ranks."""
        return [bool(v) for v in self.min_max([bool(f) for f in flags])[0]]

    def check_same_on_every_rank(self, what: str, tensors: Sequence[torch.Tensor]) -> None:
        """Raise RuntimeError on every rank unless every rank holds the same integer tensors
        (compared by a digest, one all-reduce of two integers)."""
        digest = _digest(tensors)
        (low,), (high,) = self.min_max([digest])
        if low != high:
            raise RuntimeError(
                f"tensor-parallel ranks disagree on {what} (rank {self.rank} of {self.size}: "
                f"digest {digest:#x}, the ranks' {low:#x}..{high:#x}): every rank must make the "
                "same calls with the same arguments, the same requests in the same order, with "
                'the same sampling seeds (docs/design.md, "Tensor parallelism")'
            )


def _process_group(mesh, size: int):
    """The process group of a tensor-parallel split over ``size`` ranks: the ``"tp"`` dimension
    of the weights' device mesh, else the default group."""
    if mesh is not None:
        if mesh.ndim > 1:
            if "tp" not in (mesh.mesh_dim_names or ()):
                raise ValueError(
                    f"the model's attention weights live on a {mesh.ndim}-dimensional device "
                    "mesh without a 'tp' dimension: PagedCache cannot tell its tensor-parallel "
                    "group"
                )
            mesh = mesh["tp"]
        group = mesh.get_group()
    elif torch.distributed.is_available() and torch.distributed.is_initialized():
        group = torch.distributed.group.WORLD
    else:
        raise ValueError(
            f"the model is split over {size} tensor-parallel ranks but torch.distributed is not "
            "initialized in this process"
        )
    if torch.distributed.get_world_size(group) != size:
        raise ValueError(
            f"the model is split over {size} tensor-parallel ranks, its process group has "
            f"{torch.distributed.get_world_size(group)}"
        )
    return group


def _local_rows(weight: torch.Tensor) -> int:
    """Output features of this rank's shard of a (possibly DTensor) linear weight."""
    local = weight.to_local() if hasattr(weight, "to_local") else weight
    return local.shape[0]


def _digest(tensors: Sequence[torch.Tensor]) -> int:
    """A 56-bit digest of integer tensors' shapes and values (its negation fits in int64)."""
    digest = hashlib.blake2b(digest_size=7)
    for tensor in tensors:
        tensor = tensor.detach().to(device="cpu", dtype=torch.int64).contiguous()
        digest.update(repr(tuple(tensor.shape)).encode())
        digest.update(tensor.numpy().tobytes())
    return int.from_bytes(digest.digest(), "little")
