"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2, LongCat-Flash) over a latent paged cache.

transformers' latent attention modules compress each token's keys and values into one vector, the
``kv_lora_rank`` dims ``c`` after the ``kv_a`` layernorm, plus a rotary key ``k_pe`` of
``qk_rope_head_dim`` dims shared by every head, and hand both to the cache's ``update``; then
``expand_kv`` multiplies ``c`` through ``kv_b_proj`` into one key of ``qk_nope_head_dim +
qk_rope_head_dim`` dims and one value of ``v_head_dim`` dims per head. The *expanded* form caches
those (DeepSeek-V3: 128 heads of 192 + 128 dims, 80 KiB per token per layer in bf16). The
*latent* form, this module, caches ``c`` and ``k_pe`` only (512 + 64 dims, 1152 bytes) and
attends in the absorbed form: with ``kv_b_proj``'s weight split per head into ``W_UK``
(``qk_nope_head_dim x kv_lora_rank``) and ``W_UV`` (``v_head_dim x kv_lora_rank``),

    q_nope . (W_UK c) = (W_UK^T q_nope) . c        sum_j p_j (W_UV c_j) = W_UV (sum_j p_j c_j)

so each head's query becomes ``[W_UK^T q_nope, q_pe]`` (``kv_lora_rank + qk_rope_head_dim`` dims),
every head attends over the one latent "KV head" ``[c, k_pe]`` (multi-query attention) with the
module's own softmax scale, and each head's latent output goes through ``W_UV``. Prompts use the
same absorbed form. The result equals the expanded form's up to float rounding.

Layout: the key cache holds ``k_pe`` (head size ``qk_rope_head_dim``, one KV head), the value
cache holds ``c`` (head size ``kv_lora_rank``), so every token is stored once, ``kv_lora_rank +
qk_rope_head_dim`` elements per layer, in the blocks the manager plans (copy-on-write, swaps and
prefix caching need nothing new). Within a block this module lays the tokens out one after
another (:func:`token_rows`), so gathering a sequence's blocks gathers its rows. The attention
kernels take head sizes up to 256 and would dot a query with the key cache alone, so this module
stores and attends with PyTorch (one batched matrix product per decode step over the gathered
blocks; prompt rows per sequence).

The model's own forward is kept: the latent form replaces each module's ``expand_kv`` (on the
instance) by one that hands the latents through unchanged while a latent paged cache runs the
module, and calls the original otherwise; the attention function
(:mod:`paged_attention.modeling.transformers_backend`) then calls :func:`attend_absorbed`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import replace

import torch

FORMS = ("latent", "expanded")
# Query rows x heads whose float32 logits one product of a prompt holds at most (32 Mi of them).
_LOGITS_PER_PRODUCT = 1 << 25


def check_form(mla: str | None) -> None:
    if mla is not None and mla not in FORMS:
        raise ValueError(
            f"mla must be None (latent where supported), 'latent' or 'expanded', got {mla!r}"
        )


def resolve(mla: str | None, *, kv_cache_dtype: str = "auto", graphs: bool = False) -> str | None:
    """The form to read a model with: ``mla`` when given; else ``"expanded"`` where the latent
    form is not offered (an fp8 cache, CUDA graphs or compiled decode steps, which its PyTorch
    attention does not serve), else None (latent where the model supports it)."""
    check_form(mla)
    if mla is None and (kv_cache_dtype != "auto" or graphs):
        return "expanded"
    if mla == "latent" and kv_cache_dtype != "auto":
        raise ValueError(
            f"mla='latent' caches the latents in the model's dtype, not kv_cache_dtype="
            f"{kv_cache_dtype!r}: pass mla='expanded' for an fp8 cache"
        )
    if mla == "latent" and graphs:
        raise ValueError(
            "mla='latent' attends with PyTorch operations that CUDA graphs and compiled decode "
            "steps do not capture: pass cuda_graphs=False and compile=False, or mla='expanded'"
        )
    return mla


# ------------------------------------------------------------------------------------------
# Reading a model


def latent_dims(module) -> tuple[int, int, int, int] | None:
    """``(qk_nope_head_dim, qk_rope_head_dim, v_head_dim, kv_lora_rank)`` of a transformers
    latent attention module (None for any other module)."""
    names = ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "kv_lora_rank")
    dims = [getattr(module, name, None) for name in names]
    if not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in dims):
        return None
    if not callable(getattr(module, "expand_kv", None)):
        return None
    return tuple(dims)


def _why_not_latent(index: int, layer, module, tensor_parallel_size: int) -> str | None:
    """Why layer ``index`` cannot be cached in the latent form (None: it can)."""
    if tensor_parallel_size > 1:
        return "tensor parallelism splits kv_b_proj's heads (the latent form is for one rank)"
    dims = latent_dims(module)
    if dims is None:
        return f"layer {index} is not a multi-head latent attention module"
    nope, rope, value, rank = dims
    projection = getattr(module, "kv_b_proj", None)
    weight = getattr(projection, "weight", None)
    if (
        type(projection) is not torch.nn.Linear
        or projection.bias is not None
        or tuple(weight.shape) != (layer.num_heads * (nope + value), rank)
    ):
        return f"layer {index}'s kv_b_proj is not a plain linear map of the latents"
    if not layer.attends_everything or layer.logits_soft_cap or layer.sinks:
        return f"layer {index} has a window, chunks, a soft-cap or sinks"
    if rope % 8:
        return f"layer {index}'s qk_rope_head_dim ({rope}) does not fill 16-byte chunks"
    return None


def latent_modules(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """The latent attention module of each layer index of ``model`` (the first one per index;
    LongCat-Flash's are not named attention)."""
    found: dict[int, torch.nn.Module] = {}
    for module in model.modules():
        index = getattr(module, "layer_idx", None)
        if isinstance(index, int) and latent_dims(module) is not None:
            found.setdefault(index, module)
    return found


def latent_form(layers, model, mla: str | None, tensor_parallel_size: int) -> list:
    """``model``'s layers as the latent form caches them (one KV head: keys of
    ``qk_rope_head_dim``, values of ``kv_lora_rank``, ``latent_rank`` set), when ``mla`` asks
    for it or (None) the model supports it; else ``layers`` unchanged. ``mla="latent"`` on a
    model that does not support it raises ValueError with the reason."""
    check_form(mla)
    if mla == "expanded":
        return list(layers)
    modules = latent_modules(model)
    if not modules:
        if mla == "latent":
            raise ValueError(
                "mla='latent' is for models with multi-head latent attention (DeepSeek-V2/V3, "
                "Kimi K2, LongCat-Flash); this model has none"
            )
        return list(layers)
    for index, layer in enumerate(layers):
        reason = _why_not_latent(index, layer, modules.get(index), tensor_parallel_size)
        if reason is not None:
            if mla == "latent":
                raise ValueError(
                    f"mla='latent' cannot serve this model: {reason}; pass mla='expanded'"
                )
            return list(layers)
    latent = []
    for index, layer in enumerate(layers):
        _, rope, _, rank = latent_dims(modules[index])
        latent.append(
            replace(layer, num_kv_heads=1, head_size=rope, v_head_size=rank, latent_rank=rank)
        )
    return latent


def pass_latents_through(model: torch.nn.Module, hands_latents: Callable) -> None:
    """Give every latent attention module of ``model`` an ``expand_kv`` that returns the latents
    unchanged when ``hands_latents(module, latent)`` says a latent paged cache is running it, and
    expands them as before otherwise (once per module)."""
    for module in model.modules():
        if latent_dims(module) is None or getattr(module, "_paged_attention_latent", False):
            continue
        expand = module.expand_kv

        @functools.wraps(expand)
        def expand_kv(latent, rotary, _module=module, _expand=expand):
            if hands_latents(_module, latent):
                return latent, rotary
            return _expand(latent, rotary)

        module.expand_kv = expand_kv
        module._paged_attention_latent = True


# ------------------------------------------------------------------------------------------
# Attention


def check_call(layer_idx: int, layer, module, query, latent, rotary) -> None:
    """Raise ValueError when a latent layer's call does not match the cache it was built for."""
    dims = latent_dims(module)
    nope, rope, _, rank = dims if dims else (0, 0, 0, 0)
    built = (layer.num_heads, layer.v_head_size, layer.head_size)
    got = (query.shape[1], latent.shape[-1], rotary.shape[-1])
    if (
        dims is None
        or built != got
        or (rank, rope) != built[1:]
        or query.shape[-1] != nope + rope
        or latent.shape[1] != 1
        or rotary.shape[1] != 1
    ):
        raise ValueError(
            f"PagedCache was built for {layer.num_heads} query heads over a latent of "
            f"{layer.v_head_size} + {layer.head_size} rotary dims (one KV head) in layer "
            f"{layer_idx}; the model using it has {got[0]} heads over {latent.shape[1]} KV heads "
            f"of {got[1]} + {got[2]}: build a PagedCache for the model it serves"
        )


def absorbed_weights(module) -> tuple[torch.Tensor, torch.Tensor]:
    """``(W_UK [heads, qk_nope_head_dim, kv_lora_rank], W_UV [heads, v_head_dim,
    kv_lora_rank])``: views of ``kv_b_proj``'s weight, whose output is per head ``[k_nope,
    value]``."""
    nope, _, value, rank = latent_dims(module)
    weight = module.kv_b_proj.weight.view(-1, nope + value, rank)
    return weight[:, :nope], weight[:, nope:]


def attend_absorbed(module, query, latent, rotary, attend: Callable) -> torch.Tensor:
    """The latent layer's attention: ``query [batch, heads, q, qk_head_dim]`` as the module made
    it, this step's ``latent [batch, 1, q, kv_lora_rank]`` and ``rotary [batch, 1, q,
    qk_rope_head_dim]``; ``attend(query, key, value)`` attends the absorbed queries over the
    cache (keys: the rotary parts, values: the latents) and returns ``[batch, q, heads,
    kv_lora_rank]``. Returns ``[batch, q, heads, v_head_dim]``, as the module's ``o_proj``
    takes it."""
    nope, rope, _, _ = latent_dims(module)
    up_key, up_value = (w.to(torch.float32) for w in absorbed_weights(module))
    # In float32 from the absorbed query to W_UV's output: the attention computes in float32,
    # and rounding the absorbed query or the latent output to bf16 would add error the expanded
    # form does not have.
    query_nope, query_rope = query.to(torch.float32).split([nope, rope], dim=-1)
    absorbed = torch.einsum("bhqn,hnr->bhqr", query_nope, up_key)
    out = attend(torch.cat([absorbed, query_rope], dim=-1), rotary, latent)
    return torch.einsum("bqhr,hvr->bqhv", out.to(torch.float32), up_value).to(query.dtype)


def token_rows(cache: torch.Tensor) -> torch.Tensor:
    """A layer's key or value cache ``[blocks, 1, ...]`` viewed as ``[blocks, block_size,
    dims]``: the latent form lays each block out token by token (its own reading of the
    blocks' bytes; copies and swaps move whole blocks), so a gather of blocks is a gather of
    token rows."""
    block_size = cache.shape[3]
    return cache.view(cache.shape[0], block_size, -1)


def store_latents(rotary, latent, key_cache, value_cache, slot_mapping) -> None:
    """Store ``rotary [tokens, 1, rope]`` in the key cache and ``latent [tokens, 1, rank]`` in
    the value cache at their slots (a negative slot stores nothing). A block is zeroed when a
    token is stored in its first slot (a sequence fills its blocks from there), so every slot of
    a block in use holds a finite number, and a product that gives a slot past a sequence's
    length zero weight adds zero."""
    slots = slot_mapping.to(torch.long)
    keep = slots >= 0
    if not bool(keep.all()):
        slots, rotary, latent = slots[keep], rotary[keep], latent[keep]
    keys, values = token_rows(key_cache), token_rows(value_cache)
    block_size = keys.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    fresh = blocks[offsets == 0]
    keys[fresh], values[fresh] = 0, 0
    keys[blocks, offsets] = rotary.reshape(rotary.shape[0], -1).to(keys.dtype)
    values[blocks, offsets] = latent.reshape(latent.shape[0], -1).to(values.dtype)


def latent_paged_attention(query, rotary, latent, key_cache, value_cache, metadata, scale):
    """Store the step's latents and attend every new token over its sequence's latent context:
    ``query [tokens, heads, kv_lora_rank + rope]`` (absorbed), ``rotary [tokens, 1, rope]``,
    ``latent [tokens, 1, kv_lora_rank]``; returns ``[tokens, heads, kv_lora_rank]``. Softmax
    and products in float32, causal (a row sees its own position and those before)."""
    store_latents(rotary, latent, key_cache, value_cache, metadata.slot_mapping)
    out = query.new_zeros(query.shape[0], query.shape[1], value_cache.shape[2])
    if query.shape[0] == 0:
        return out
    if metadata.max_query_len == 1 and len(metadata.query_lens) == query.shape[0]:
        return _decode(query, key_cache, value_cache, metadata, scale)
    start = 0
    for index, (q_len, seq_len) in enumerate(zip(metadata.query_lens, metadata.seq_lens)):
        if q_len:
            rows = slice(start, start + q_len)
            out[rows] = _attend_sequence(
                query[rows], key_cache, value_cache, metadata.block_tables[index], seq_len, scale
            )
        start += q_len
    return out


def _decode(query, key_cache, value_cache, metadata, scale):
    """One query row per sequence: one batched product over the block tables' width, entries
    past a sequence's blocks pointed at its first block (weighted zero, as are its slots past
    its length)."""
    keys, values = token_rows(key_cache), token_rows(value_cache)
    block_size, rank = values.shape[1], values.shape[2]
    tables = metadata.block_tables.to(torch.long)
    seqs, width = tables.shape
    lengths = metadata.seq_lens_tensor.to(torch.long)
    owned = torch.arange(width, device=tables.device) < (lengths + block_size - 1).floor_divide(
        block_size
    ).unsqueeze(1)
    tables = torch.where(owned, tables, tables[:, :1])
    latents = values[tables].view(seqs, width * block_size, rank).to(torch.float32)
    rotaries = keys[tables].view(seqs, width * block_size, -1).to(torch.float32)
    q = query.to(torch.float32)
    logits = torch.bmm(q[..., :rank], latents.transpose(1, 2))
    logits.baddbmm_(q[..., rank:], rotaries.transpose(1, 2))
    positions = torch.arange(width * block_size, device=tables.device)
    future = positions.unsqueeze(0) >= lengths.unsqueeze(1)
    logits.mul_(scale).masked_fill_(future.unsqueeze(1), -math.inf)
    return torch.bmm(torch.softmax(logits, dim=-1), latents).to(query.dtype)


def _attend_sequence(query, key_cache, value_cache, table, seq_len: int, scale: float):
    """One sequence's ``query [q, heads, rank + rope]`` rows, the last ``q`` of its ``seq_len``
    positions, over its context; in pieces of rows that bound the logits' size."""
    keys, values = token_rows(key_cache), token_rows(value_cache)
    block_size, rank = values.shape[1], values.shape[2]
    blocks = table[: -(-seq_len // block_size)].to(torch.long)
    lat = values[blocks].view(-1, rank)[:seq_len].to(torch.float32)
    rot = keys[blocks].view(-1, keys.shape[2])[:seq_len].to(torch.float32)
    q_len, heads, _ = query.shape
    step = max(1, _LOGITS_PER_PRODUCT // max(1, heads * seq_len))
    key_positions = torch.arange(seq_len, device=query.device)
    pieces = []
    for first in range(0, q_len, step):
        q = query[first : first + step].to(torch.float32)
        logits = q[..., :rank] @ lat.T + q[..., rank:] @ rot.T  # [rows, heads, seq_len]
        positions = seq_len - q_len + first + torch.arange(q.shape[0], device=query.device)
        future = key_positions.unsqueeze(0) > positions.unsqueeze(1)
        logits.mul_(scale).masked_fill_(future.unsqueeze(1), -math.inf)
        pieces.append(torch.softmax(logits, dim=-1) @ lat)
    return torch.cat(pieces).to(query.dtype)
