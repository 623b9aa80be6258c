"""Float linear layers whose weights are packed once, at load, for the CPU's matrix library.

``torch.nn.Linear`` on the CPU hands its plain row-major weight to oneDNN (bfloat16) or MKL
(float32) at every call; oneDNN then reorders it into the blocked layout its kernels read, each
time. :class:`PackedLinear` does that reorder once: its weight is a oneDNN tensor in that layout
(``torch.ops.mkldnn._reorder_linear_weight``) and its forward is oneDNN's inner product on it
(``torch.ops.mkldnn._linear_pointwise``), what inductor's freezing makes of a linear layer on the
CPU. The plain weight is dropped: a packed layer holds one copy of its weight.

Why oneDNN for float32 too, not MKL's packed sgemm (``torch.ops.mkl._mkl_linear``, which
freezing picks for float32): MKL's packed matrix is packed for one number of input rows and
``_mkl_linear`` multiplies it only at that number, falling back to the plain weight (which it
then has to keep) at any other; an engine's steps have every number of rows.

:func:`pack_model` swaps a model's float ``nn.Linear`` layers (the decoder layers' projections
and the LM head) for packed ones. :func:`paged_attention.modeling.models.load_model` calls it
for the bfloat16 layers, and the float32 ones on an AMD CPU (:func:`load_packed_dtypes`), of a
model on the CPU loaded with
``weights`` given (the commands' ``--weights``: ``auto``, ``bf16``, and whatever float layers
``q4``/``q8`` leave), unless
``PAGED_ATTENTION_PACK_LINEAR=0``. Layers are left as they are (and the reason logged once)
where oneDNN is not available, for dtypes other than float32 and bfloat16 (bfloat16 also needs
a CPU oneDNN runs it on), for weights that are not plain CPU tensors (a tensor-parallel shard),
and for multi-head latent attention's ``kv_b_proj``, whose weight the engine reads.

A tied LM head (its weight the input embedding's) is packed as a copy: the embedding keeps its
table, so the model holds the table twice (:attr:`PackReport.added_bytes`).

Packed layers are for inference: there is no gradient through them. Under ``torch.compile``
(``Engine(compile=True)``, ``--compile``) a packed layer is one custom op,
``paged_attention::packed_linear``, that inductor calls as it is, with or without freezing
(freezing would pack an ``nn.Linear`` the same way and also concatenate sibling projections;
a packed layer is not concatenated). The op names its weight by a number, not the oneDNN
tensor, which inductor's and AOTAutograd's caches cannot store: the commands' compile cache
(:mod:`paged_attention.engine.compile_cache`) keeps a packed model's steps.

Sibling projections (q/k/v, gate/up) are not merged here: ``load_model`` merges a Llama
layer's before packing (:mod:`paged_attention.modeling.fused_projections`).
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import logging
import os
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn

from paged_attention.ops.cpu_info import cpu_identity

PACK_ENV = "PAGED_ATTENTION_PACK_LINEAR"
"""``0`` (or ``false``, ``no``, ``off``) turns packing at load off."""
PACKED_DTYPES = (torch.float32, torch.bfloat16)
FLOAT32_PACKED_VENDORS = ("AuthenticAMD",)
"""The CPU vendors (``/proc/cpuinfo``'s ``vendor_id``) on which ``load_model`` packs float32
layers too: on an AMD EPYC, MKL's plain sgemm (what ``nn.Linear`` runs in float32) is the
slower by far: the offline engine's eager float32 made 273.4 tok/s packed against 163.3 unpacked
(docs/results/bench_offline_fusion.json). On an Intel Xeon MKL's sgemm was the faster (190
against 207 tok/s), and elsewhere it is not measured: float32 stays unpacked there
(docs/performance.md)."""
SKIPPED_NAMES = ("kv_b_proj",)
"""Layers whose plain weight other code reads (multi-head latent attention absorbs it)."""

NO_ONEDNN = "this torch has no oneDNN (torch.backends.mkldnn is not available)"
NO_ONEDNN_BF16 = "oneDNN does not run bfloat16 on this CPU"
"""The reasons that are this machine's (logged as warnings; a layer's own kind is not)."""

_log = logging.getLogger(__name__)


def load_packed_dtypes(cpuinfo_path: str = "/proc/cpuinfo") -> tuple[torch.dtype, ...]:
    """The float dtypes ``load_model`` packs on this CPU: bfloat16, measured faster packed on
    the offline workload on every CPU tried, and float32 on the vendors of
    :data:`FLOAT32_PACKED_VENDORS`."""
    if cpu_identity(cpuinfo_path)["cpu_vendor"] in FLOAT32_PACKED_VENDORS:
        return (torch.float32, torch.bfloat16)
    return (torch.bfloat16,)


def packing_enabled() -> bool:
    """Whether :data:`PACK_ENV` leaves packing on (the default)."""
    return switched_on(PACK_ENV)


def switched_on(variable: str) -> bool:
    """Whether the environment ``variable`` of a switch that is on by default leaves it on:
    unset, or anything but ``0``, ``false``, ``no`` and ``off`` (any case)."""
    value = os.environ.get(variable, "1").strip().lower()
    return value not in ("0", "false", "no", "off")


def why_not_packable(linear: nn.Module) -> str | None:
    """Why ``linear`` cannot be packed (None: it can), in words."""
    if type(linear) is not nn.Linear:
        return f"{type(linear).__name__} is not a torch.nn.Linear"
    weight = linear.weight
    if type(weight.data) is not torch.Tensor or weight.layout != torch.strided:
        return f"its weight is a {type(weight.data).__name__}, not a plain tensor"
    if weight.device.type != "cpu":
        return f"its weight is on {weight.device}, not the CPU"
    if weight.dtype not in PACKED_DTYPES:
        return f"its weight is {weight.dtype} (packed: float32 and bfloat16)"
    if not torch.backends.mkldnn.is_available():
        return NO_ONEDNN
    if weight.dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return NO_ONEDNN_BF16
    return None


class PackedLinear(nn.Module):
    """``y = x @ W.T + bias`` with ``W`` packed for oneDNN (the module docstring). Takes inputs
    of the weight's dtype on the CPU, of any shape ``(..., in_features)``."""

    def __init__(self, packed: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = packed.shape
        self.dtype = packed.dtype
        # A plain attribute, not a buffer: Module.to() and friends would try to convert the
        # oneDNN tensor; the layer stays on the CPU in its dtype (load_model packs last).
        self.packed = packed
        self.handle = _PACKED.add(packed)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> PackedLinear:
        """The packed layer of ``linear`` (which is left as it is). Raises ValueError naming
        ``linear`` and the reason when it cannot be packed (:func:`why_not_packable`)."""
        reason = why_not_packable(linear)
        if reason is not None:
            raise ValueError(f"linear: cannot pack it: {reason}")
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach())
        return cls(packed, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.dtype or x.device.type != "cpu":
            raise TypeError(
                f"x: this packed linear layer takes {self.dtype} on the CPU, got {x.dtype} on "
                f"{x.device}"
            )
        if torch.compiler.is_compiling():
            return torch.ops.paged_attention.packed_linear(
                x, self.handle, self.out_features, self.bias
            )
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    @property
    def weight(self) -> torch.Tensor:
        """The plain weight (out features, in features), unpacked at each access (the layer
        never reads it): for code that inspects a linear layer's weight."""
        return self.packed.to_dense()

    @property
    def packed_bytes(self) -> int:
        """The bytes of the packed weight (oneDNN's tensor has no storage to measure)."""
        return self.packed.numel() * self.packed.element_size()

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        # The same keys and values as the nn.Linear it was packed from.
        destination[prefix + "weight"] = self.weight
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing, unexpected, errors
    ) -> None:
        key = prefix + "weight"
        if key in state_dict:
            weight = state_dict[key].detach().to("cpu", self.dtype)
            expected = (self.out_features, self.in_features)
            if tuple(weight.shape) != expected:
                errors.append(f"{key}: expected shape {expected}, got {tuple(weight.shape)}")
                return
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())
            self.handle = _PACKED.add(self.packed)
            state_dict = {k: v for k, v in state_dict.items() if k != key}
        elif strict:
            missing.append(key)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing, unexpected, errors
        )

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"dtype={self.dtype}, bias={self.bias is not None}"
        )


class _PackedWeights:
    """The packed weights by number, for :func:`packed_linear`: inductor's caches cannot store
    a graph that holds a oneDNN tensor (they bypass it), so a compiled step names each weight
    by its number instead. A number is never reused in a process, and the layer holds its
    weight (held weakly here), so a number names one weight while it lives."""

    def __init__(self) -> None:
        self._weights: weakref.WeakValueDictionary[int, torch.Tensor] = (
            weakref.WeakValueDictionary()
        )
        self._next = itertools.count()

    def add(self, packed: torch.Tensor) -> int:
        number = next(self._next)
        self._weights[number] = packed
        return number

    def get(self, number: int) -> torch.Tensor:
        packed = self._weights.get(number)
        if packed is None:
            raise ValueError(f"handle: no packed weight {number} (its layer is gone)")
        return packed


_PACKED = _PackedWeights()


@torch.library.custom_op("paged_attention::packed_linear", mutates_args=())
def packed_linear(
    x: torch.Tensor, handle: int, out_features: int, bias: torch.Tensor | None
) -> torch.Tensor:
    """:class:`PackedLinear`'s product as one op for ``torch.compile`` (inductor's lowering
    of ``mkldnn._linear_pointwise`` takes only frozen weights): the weight numbered
    ``handle`` (:class:`_PackedWeights`), ``out_features`` wide."""
    return torch.ops.mkldnn._linear_pointwise(x, _PACKED.get(handle), bias, "none", [], "")


@packed_linear.register_fake
def _packed_linear_fake(x, handle, out_features, bias):
    return x.new_empty((*x.shape[:-1], out_features))


@dataclass
class PackReport:
    """What :func:`pack_model` did."""

    packed: list[str] = field(default_factory=list)
    """The names of the layers it packed."""
    skipped: dict[str, str] = field(default_factory=dict)
    """Each float ``nn.Linear`` left as it is, and why."""
    copied: list[str] = field(default_factory=list)
    """The parameters and buffers it copied out of a memory-mapped checkpoint."""
    added_bytes: int = 0
    """Bytes the model holds more than before: packed copies of weights that stay referenced
    elsewhere (a tied LM head's embedding table)."""


def pack_model(model: nn.Module, dtypes=PACKED_DTYPES) -> PackReport:
    """Swaps every ``torch.nn.Linear`` of ``model`` that can be packed (:func:`why_not_packable`,
    of one of ``dtypes`` and not named in :data:`SKIPPED_NAMES`) for a :class:`PackedLinear`,
    in place; logs once
    per reason why a layer is left as it is; when it packed any, copies the parameters left on a
    memory-mapped checkpoint into memory of their own (:attr:`PackReport.copied`). Call it
    last, with the model on the CPU in its dtype."""
    report = PackReport()
    shared = _weights_used_elsewhere(model)
    for name, module in list(model.named_modules()):
        if type(module) is not nn.Linear:
            continue
        reason = why_not_packable(module)
        if reason is None and name.rsplit(".", 1)[-1] in SKIPPED_NAMES:
            reason = "other code reads its plain weight"
        if reason is None and module.weight.dtype not in dtypes:
            reason = f"{module.weight.dtype} is not packed here (packed: {_names(dtypes)})"
        if reason is not None:
            report.skipped[name] = reason
            _log_once(reason)
            continue
        packed = PackedLinear.from_linear(module)
        if id(module.weight) in shared:
            report.added_bytes += packed.packed_bytes
        parent, _, attribute = name.rpartition(".")
        setattr(model.get_submodule(parent), attribute, packed)
        report.packed.append(name)
    if report.packed:
        report.copied = _own_checkpoint_memory(model)
        _return_freed_memory()
    return report


def _return_freed_memory() -> None:
    """Hands the heap pages freed with the plain weights back to the system. glibc keeps freed
    heap memory for later allocations (the weights are allocated and freed between packed
    copies, so the freed ones sit below live ones); ``malloc_trim`` returns it. Elsewhere (no
    glibc) nothing happens."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)


def _own_checkpoint_memory(model: nn.Module) -> list[str]:
    """Copies the parameters and buffers whose memory torch did not allocate (a non-resizable
    storage: a view of a memory-mapped safetensors file, as float32 weights loaded in float32
    are) into memory of their own; returns their names. A packed layer no longer reads its
    file's bytes, but one parameter left on the mapping (the embedding) would keep the whole
    file mapped, and its pages read while packing resident: a second copy of every weight."""
    copied = []
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if tensor.layout == torch.strided and not tensor.untyped_storage().resizable():
                tensor.data = tensor.data.clone()
                copied.append(name)
    return copied


def _weights_used_elsewhere(model: nn.Module) -> set[int]:
    """The ids of linear weights that another module also holds (a tied embedding)."""
    holders: dict[int, int] = {}
    for module in model.modules():
        for parameter in module.parameters(recurse=False):
            holders[id(parameter)] = holders.get(id(parameter), 0) + 1
    return {key for key, count in holders.items() if count > 1}


def _names(dtypes) -> str:
    return ", ".join(str(dtype).removeprefix("torch.") for dtype in dtypes)


@functools.cache
def _log_once(reason: str) -> None:
    level = logging.WARNING if reason in (NO_ONEDNN, NO_ONEDNN_BF16) else logging.INFO
    _log.log(level, "linear layers left unpacked: %s", reason)
