"""Pure-PyTorch reference of every op: the test oracle.

Each function has the signature of the op of the same name in ``torch.ops.paged_attention`` and
mutates the same arguments. They favour obviousness over speed: attention loops over sequences,
gathers each sequence's keys and values through its block table, and computes in float32.

Semantics fixed here (and followed by the kernels):

* logit of query head ``h`` for the token at position ``p`` of a sequence of length ``L``:
  ``s = scale * (q . k_p)``; with ``logits_soft_cap = c > 0``, ``s = c * tanh(s / c)``; with ALiBi,
  ``s += slope[h] * (p - L + 1)``; with ``sliding_window = W > 0`` only ``p >= L - W`` is attended;
  with ``attention_chunk_size = C > 0`` (chunked local attention, Llama 4) only the query's own
  chunk, ``p >= q - q % C`` for the query at ``q = L - 1``; with both, their intersection.
* a sequence of length 0 produces an all-zero output row.
* values have a head size of their own, ``v_head_size = value_cache.shape[2]``, and so has the
  output (``[..., num_heads, v_head_size]``); keys and queries share ``head_size``. They differ
  for multi-head latent attention run through the attention interface (DeepSeek-V3: keys 192,
  values 128).
* fp8 caches (``uint8`` tensors): ``stored = fp8(clamp(x / scale, -max, max))`` rounded to nearest
  even, ``x' = float(stored) * scale``; e4m3 is the ``float8_e4m3fn`` format (max 448), e5m2 is
  ``float8_e5m2`` (max 57344).
* ``copy_blocks``/``swap_blocks`` copy their pairs in parallel: a destination block appears once
  and is never also read by a pair (no chains, no swaps; fan-out of one source is fine); other
  mappings raise (:func:`check_block_mapping`).
* v2 partition outputs: for partition ``j`` (tokens ``[512 j, 512 (j + 1))``), ``max_logits`` is
  the largest attended logit, ``exp_sums`` is ``sum(exp(s - max_logit))`` and ``tmp_out`` is the
  partition's softmax-weighted value sum divided by its ``exp_sum``. A partition with no attended
  token (past the sequence end, or wholly outside the sliding window or the query's chunk) holds
  ``max_logit = -inf``, ``exp_sum = 0`` and a zero ``tmp_out`` row.
"""

from __future__ import annotations

import math

import torch

from paged_attention.ops.supported import FP8_FORMATS, PARTITION_SIZE, is_fp8


def quantize(x: torch.Tensor, kv_cache_dtype: str, scale: torch.Tensor | float) -> torch.Tensor:
    """x (float) -> uint8 fp8 bits, or x unchanged for "auto"."""
    if not is_fp8(kv_cache_dtype):
        return x
    fp8_dtype, fp8_max = FP8_FORMATS[kv_cache_dtype]
    scaled = (x.float() / _scale_value(scale)).clamp(-fp8_max, fp8_max)
    return scaled.to(fp8_dtype).view(torch.uint8)


def dequantize(x: torch.Tensor, kv_cache_dtype: str, scale: torch.Tensor | float) -> torch.Tensor:
    """Cache elements -> float32 values."""
    if not is_fp8(kv_cache_dtype):
        return x.float()
    fp8_dtype, _ = FP8_FORMATS[kv_cache_dtype]
    return x.view(fp8_dtype).float() * _scale_value(scale)


def _scale_value(scale: torch.Tensor | float) -> float:
    return float(scale.item()) if isinstance(scale, torch.Tensor) else float(scale)


# --------------------------------------------------------------------------------------------
# Cache ops


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
) -> None:
    """Write key ``[num_tokens, num_kv_heads, head_size]`` and value ``[num_tokens, num_kv_heads,
    v_head_size]`` (the value cache's head size, its own) into the caches at their slots."""
    block_size = value_cache.shape[3]
    x = key_cache.shape[4]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blocks, offsets = slots // block_size, slots % block_size
    num_tokens, num_kv_heads, head_size = key[keep].shape
    k = quantize(key[keep], kv_cache_dtype, k_scale).to(key_cache.dtype)
    v = quantize(value[keep], kv_cache_dtype, v_scale).to(value_cache.dtype)
    key_cache[blocks, :, :, offsets, :] = k.reshape(num_tokens, num_kv_heads, head_size // x, x)
    value_cache[blocks, :, :, offsets] = v


def check_block_mapping(
    block_mapping: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, op: str
) -> None:
    """The pairs of a copy or swap are copied in parallel, in no order, so a result is defined
    only when each destination block is written once and no pair writes a block another reads.
    ``src`` and ``dst`` ids index different pools unless the two tensors share memory (then
    blocks are compared by address). Raises ``ValueError`` naming ``block_mapping``."""
    pairs = block_mapping.cpu().tolist()
    same_memory = src.untyped_storage().data_ptr() == dst.untyped_storage().data_ptr()

    def block(t: torch.Tensor, i: int) -> tuple[int, int]:  # [first byte, end) of block i
        size = t[0].numel() * t.element_size() if t.shape[0] else 0
        start = t.data_ptr() + i * t.stride(0) * t.element_size()
        return (start, start + size) if same_memory else (i, i + 1)

    writes = [block(dst, d) for _, d in pairs]
    reads = [block(src, s) for s, _ in pairs]
    for i, (w0, w1) in enumerate(writes):
        for j in range(i):
            if w0 < writes[j][1] and writes[j][0] < w1:
                raise ValueError(
                    f"{op}: block_mapping[{i}] writes the block block_mapping[{j}] "
                    "writes (each destination may appear once)"
                )
        for j, (r0, r1) in enumerate(reads if same_memory else []):
            if w0 < r1 and r0 < w1:
                raise ValueError(
                    f"{op}: block_mapping[{i}] overwrites the block "
                    f"block_mapping[{j}] reads (no chains or swaps)"
                )


def copy_blocks(
    key_caches: list[torch.Tensor], value_caches: list[torch.Tensor], block_mapping: torch.Tensor
) -> None:
    """For every layer, ``cache[dst] = cache[src]`` for each ``(src, dst)`` row of the mapping.
    One source may go to several destinations; a destination may appear once and may not be a
    source too (:func:`check_block_mapping`)."""
    if key_caches:
        check_block_mapping(block_mapping, key_caches[0], key_caches[0], "copy_blocks")
    src, dst = block_mapping[:, 0], block_mapping[:, 1]
    for cache in (*key_caches, *value_caches):
        cache[dst.to(cache.device)] = cache[src.to(cache.device)]


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """``dst[d] = src[s]`` for each ``(s, d)`` row, across devices. Each destination may appear
    once; when src and dst share memory, no destination may overlap a source."""
    check_block_mapping(block_mapping, src, dst, "swap_blocks")
    mapping = block_mapping.cpu()
    dst[mapping[:, 1].to(dst.device)] = src[mapping[:, 0].to(src.device)].to(dst.device)


# --------------------------------------------------------------------------------------------
# Attention


def gather_kv(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    kv_cache_dtype: str = "auto",
    k_scale: torch.Tensor | float = 1.0,
    v_scale: torch.Tensor | float = 1.0,
    start: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's keys and values as float32 ``[seq_len, num_kv_heads, head_size]`` and
    ``[seq_len, num_kv_heads, v_head_size]``.

    Blocks wholly before position ``start`` are not read (their table entries may be released
    or stale, as before a sliding window); positions before ``start`` hold zeros."""
    _, num_kv_heads, v_head_size, block_size = value_cache.shape
    head_size = key_cache.shape[2] * key_cache.shape[4]
    first = min(start, seq_len) // block_size
    num_blocks = math.ceil(seq_len / block_size)
    blocks = block_table[first:num_blocks].long().to(key_cache.device)
    keys = key_cache[blocks].permute(0, 3, 1, 2, 4).reshape(-1, num_kv_heads, head_size)
    values = value_cache[blocks].permute(0, 3, 1, 2).reshape(-1, num_kv_heads, v_head_size)
    keys = dequantize(keys[: seq_len - first * block_size], kv_cache_dtype, k_scale)
    values = dequantize(values[: seq_len - first * block_size], kv_cache_dtype, v_scale)
    skipped = min(start, seq_len)
    keys = torch.cat(
        [keys.new_zeros(skipped, num_kv_heads, head_size), keys[skipped - first * block_size :]]
    )
    values = torch.cat(
        [
            values.new_zeros(skipped, num_kv_heads, v_head_size),
            values[skipped - first * block_size :],
        ]
    )
    return keys, values


def first_attended_position(
    position: int, sliding_window: int = 0, attention_chunk_size: int = 0
) -> int:
    """The first key position a query at ``position`` attends: the start of its sliding window
    (the last ``sliding_window`` positions) and of its chunk (``position - position %
    attention_chunk_size``), whichever is later; 0 without either (0 = none for each)."""
    first = 0
    if sliding_window > 0:
        first = max(first, position - sliding_window + 1)
    if attention_chunk_size > 0 and position > 0:
        first = max(first, position - position % attention_chunk_size)
    return first


def attention_logits(
    query: torch.Tensor,
    keys: torch.Tensor,
    scale: float,
    alibi_slopes: torch.Tensor | None = None,
    sliding_window: int = 0,
    logits_soft_cap: float = 0.0,
    attention_chunk_size: int = 0,
) -> torch.Tensor:
    """Logits ``[num_heads, seq_len]`` of one sequence's query ``[num_heads, head_size]``, at
    position ``seq_len - 1``, against its keys ``[seq_len, num_kv_heads, head_size]``;
    unattended positions are ``-inf``."""
    num_heads = query.shape[0]
    seq_len, num_kv_heads, _ = keys.shape
    keys = keys.repeat_interleave(num_heads // num_kv_heads, dim=1)  # [L, H, D]
    logits = scale * torch.einsum("hd,lhd->hl", query.float(), keys.float())
    if logits_soft_cap > 0:
        logits = logits_soft_cap * torch.tanh(logits / logits_soft_cap)
    positions = torch.arange(seq_len, device=query.device)
    if alibi_slopes is not None:
        logits = logits + alibi_slopes.float()[:, None] * (positions - seq_len + 1)[None, :]
    first = first_attended_position(seq_len - 1, sliding_window, attention_chunk_size)
    return logits.masked_fill((positions < first)[None, :], -math.inf)


def _attend(logits: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """softmax(logits) @ values, per head, float32; values ``[L, num_kv_heads, D]``."""
    num_heads = logits.shape[0]
    values = values.float().repeat_interleave(num_heads // values.shape[1], dim=1)
    return torch.einsum("hl,lhd->hd", torch.softmax(logits, dim=-1), values)


def _sequences(
    block_tables, seq_lens, key_cache, value_cache, kv_cache_dtype, k_scale, v_scale, window, chunk
):
    for s, seq_len in enumerate(seq_lens.tolist()):
        start = first_attended_position(seq_len - 1, window, chunk)
        keys, values = gather_kv(
            key_cache,
            value_cache,
            block_tables[s],
            seq_len,
            kv_cache_dtype,
            k_scale,
            v_scale,
            start,
        )
        yield s, seq_len, keys, values


def paged_attention_v1(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    num_kv_heads: int,
    scale: float,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    max_seq_len: int,
    alibi_slopes: torch.Tensor | None,
    kv_cache_dtype: str,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    sliding_window: int = 0,
    logits_soft_cap: float = 0.0,
    attention_chunk_size: int = 0,
) -> None:
    """Decode attention: one query token per sequence against its paged context."""
    for s, seq_len, keys, values in _sequences(
        block_tables,
        seq_lens,
        key_cache,
        value_cache,
        kv_cache_dtype,
        k_scale,
        v_scale,
        sliding_window,
        attention_chunk_size,
    ):
        if seq_len == 0:
            out[s] = 0
            continue
        logits = attention_logits(
            query[s],
            keys,
            scale,
            alibi_slopes,
            sliding_window,
            logits_soft_cap,
            attention_chunk_size,
        )
        out[s] = _attend(logits, values).to(out.dtype)


def paged_attention_v2(
    out: torch.Tensor,
    exp_sums: torch.Tensor,
    max_logits: torch.Tensor,
    tmp_out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    num_kv_heads: int,
    scale: float,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    max_seq_len: int,
    alibi_slopes: torch.Tensor | None,
    kv_cache_dtype: str,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    sliding_window: int = 0,
    logits_soft_cap: float = 0.0,
    attention_chunk_size: int = 0,
) -> None:
    """Split-K decode attention: per-partition results, then their exact combination."""
    num_partitions = exp_sums.shape[2]
    for s, _, keys, values in _sequences(
        block_tables,
        seq_lens,
        key_cache,
        value_cache,
        kv_cache_dtype,
        k_scale,
        v_scale,
        sliding_window,
        attention_chunk_size,
    ):
        logits = attention_logits(
            query[s],
            keys,
            scale,
            alibi_slopes,
            sliding_window,
            logits_soft_cap,
            attention_chunk_size,
        )
        for j in range(num_partitions):
            part = logits[:, j * PARTITION_SIZE : (j + 1) * PARTITION_SIZE]
            part_max = (
                part.max(dim=-1).values
                if part.shape[1]
                else torch.full((part.shape[0],), -math.inf, device=part.device)
            )
            attended = torch.isfinite(part_max)
            safe_max = torch.where(attended, part_max, torch.zeros_like(part_max))
            weights = torch.exp(part - safe_max[:, None])  # 0 where -inf
            part_sum = weights.sum(dim=-1)
            part_values = values[j * PARTITION_SIZE : (j + 1) * PARTITION_SIZE]
            part_out = _weighted_values(weights, part_values)
            part_out = torch.where(
                attended[:, None], part_out / part_sum.clamp_min(1e-30)[:, None], 0.0
            )
            max_logits[s, :, j] = part_max
            exp_sums[s, :, j] = part_sum
            tmp_out[s, :, j] = part_out.to(tmp_out.dtype)
        out[s] = combine_partitions(
            max_logits[s, :, :num_partitions],
            exp_sums[s, :, :num_partitions],
            tmp_out[s, :, :num_partitions].float(),
        ).to(out.dtype)


def paged_attention_varlen(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    num_kv_heads: int,
    scale: float,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    alibi_slopes: torch.Tensor | None,
    kv_cache_dtype: str,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    sliding_window: int = 0,
    logits_soft_cap: float = 0.0,
    sinks: torch.Tensor | None = None,
    attention_chunk_size: int = 0,
) -> None:
    """Causal attention of every sequence's query rows over its paged context.

    Sequence ``s`` owns query rows ``query_start_loc[s] .. query_start_loc[s + 1] - 1``; row ``i``
    of ``q_len`` sits at position ``p = seq_len - q_len + i`` and attends positions ``j <= p``
    (and ``j > p - W`` with a window ``W``, ``j >= p - p % C`` with a chunk size ``C``), logit as
    in v1 with ALiBi ``slope * (j - p)``. A sink is one more logit per head in the softmax's
    denominator, with no value. Rows of no sequence are left as they are."""
    starts = query_start_loc.tolist()
    for s, seq_len in enumerate(seq_lens.tolist()):
        rows = slice(starts[s], starts[s + 1])
        q_len = starts[s + 1] - starts[s]
        if q_len == 0:
            continue
        first = first_attended_position(seq_len - q_len, sliding_window, attention_chunk_size)
        keys, values = gather_kv(
            key_cache,
            value_cache,
            block_tables[s],
            seq_len,
            kv_cache_dtype,
            k_scale,
            v_scale,
            first,
        )
        num_heads = query.shape[1]
        group = num_heads // num_kv_heads
        keys = keys.repeat_interleave(group, dim=1)  # [L, H, D]
        values = values.repeat_interleave(group, dim=1)
        logits = scale * torch.einsum("nhd,lhd->hnl", query[rows].float(), keys)
        if logits_soft_cap > 0:
            logits = logits_soft_cap * torch.tanh(logits / logits_soft_cap)
        key_pos = torch.arange(seq_len, device=query.device)
        query_pos = seq_len - q_len + torch.arange(q_len, device=query.device)
        distance = key_pos[None, :] - query_pos[:, None]  # [n, L], j - p
        if alibi_slopes is not None:
            logits = logits + alibi_slopes.float()[:, None, None] * distance[None]
        hidden = distance > 0
        if sliding_window > 0:
            hidden |= distance <= -sliding_window
        if attention_chunk_size > 0:
            chunk_start = query_pos - query_pos % attention_chunk_size
            hidden |= key_pos[None, :] < chunk_start[:, None]
        logits = logits.masked_fill(hidden[None], -math.inf)
        if sinks is not None:
            sink = sinks.float()[:, None, None].expand(-1, q_len, 1)
            probs = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(logits, dim=-1)
        out[rows] = torch.einsum("hnl,lhd->nhd", probs, values).to(out.dtype)


def _weighted_values(weights: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    num_heads = weights.shape[0]
    if values.shape[0] == 0:
        return torch.zeros(num_heads, values.shape[2], device=weights.device)
    values = values.float().repeat_interleave(num_heads // values.shape[1], dim=1)
    return torch.einsum("hl,lhd->hd", weights, values)


def combine_partitions(
    max_logits: torch.Tensor, exp_sums: torch.Tensor, partition_out: torch.Tensor
) -> torch.Tensor:
    """Merge partition results ``[H, P]``, ``[H, P]``, ``[H, P, D]`` into ``[H, D]`` (float32).

    Each partition's normalised output is weighted by ``exp_sum * exp(max_logit - global_max)``;
    a head with no attended token anywhere gets zeros.
    """
    global_max = max_logits.max(dim=-1, keepdim=True).values
    safe_global = torch.where(torch.isfinite(global_max), global_max, torch.zeros_like(global_max))
    weights = exp_sums * torch.exp(max_logits - safe_global)  # exp(-inf) = 0 for empty partitions
    total = weights.sum(dim=-1, keepdim=True)
    combined = (weights[..., None] * partition_out).sum(dim=1) / total.clamp_min(1e-30)
    return torch.where(total > 0, combined, 0.0)
