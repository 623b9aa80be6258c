"""DeepSeek sparse attention (DeepSeek-V3.2, transformers' ``DeepseekV32Attention``) over the
latent paged cache.

Each layer is multi-head latent attention (:mod:`paged_attention.modeling.mla`) that reads only
the cached tokens a *lightning indexer* selects per query. The indexer has a key of its own per
token (``index_head_dim`` dims: ``k_norm(wk(x))`` with half-split rotary embeddings on its first
``qk_rope_head_dim`` dims) and, per query, ``index_n_heads`` query heads and one weight per head.
A query's score for a cached token ``t`` is

    score[t] = sum_h weight[h] * relu(scale * q[h] . k[t])        (scale = index_head_dim^-0.5)

and the query attends over the ``index_topk`` visible tokens of highest score (all of them when
fewer are visible), as transformers' eager attention does with its sparse mask.

Layout: the indexer key rides in the same paged blocks as the layer's latent form, so the block
manager owns it with everything else (allocation, forks, copy-on-write, swaps, prefix caching,
frees need nothing new): the layer's key cache holds ``[k_pe | indexer key]`` per token (head
size ``qk_rope_head_dim + index_head_dim``), the value cache the latent ``c`` (``kv_lora_rank``).

The module's forward is replaced (on the instance, :func:`install`) by one that computes what
transformers' does up to the attention (:func:`_paged_forward`) while a ``"paged_attention"``
cache runs the model, and calls the original otherwise. The step's per-token indexer inputs
travel to the packed attention with the query: after the attention heads' ``qk_head_dim`` dims,
each token's indexer query heads and weights (float32) are spread over the heads' extra dims
(:func:`spread`), so the caches' packing (padding removed, steps packed) carries them unchanged.
Scores, top-k and softmax are computed in float32 in PyTorch, one sequence at a time
(:func:`sparse_paged_attention`); speed is not the point of this path, exactness is.
"""

from __future__ import annotations

import functools
import inspect
import math
from dataclasses import replace

import torch
import torch.nn.functional as F

from paged_attention.modeling import mla

# The attention module class whose computation _paged_forward reproduces.
_MODULE_CLASS = "DeepseekV32Attention"
_INDEXER_ATTRIBUTES = ("wq_b", "wk", "k_norm", "weights_proj", "n_heads", "head_dim", "index_topk")
# Query rows x key tokens x heads whose float32 products one piece of a prompt holds at most.
_LOGITS_PER_PRODUCT = 1 << 25


class SparseAttentionError(ValueError):
    """DeepSeek sparse attention asked of a cache or a form that cannot serve it."""


def indexed_modules(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """The DeepSeek sparse attention module of each layer index of ``model`` (empty for other
    models)."""
    found: dict[int, torch.nn.Module] = {}
    for module in model.modules():
        index = getattr(module, "layer_idx", None)
        if type(module).__name__ == _MODULE_CLASS and isinstance(index, int):
            indexer = getattr(module, "indexer", None)
            if mla.latent_dims(module) is not None and all(
                hasattr(indexer, name) for name in _INDEXER_ATTRIBUTES
            ):
                found.setdefault(index, module)
    return found


def sparse_form(layers: list, model: torch.nn.Module, mla_form: str | None, tp_size: int) -> list:
    """``layers`` (as :func:`~paged_attention.modeling.mla.latent_form` made them) with each
    sparse attention layer's key cache widened by its indexer key and its indexer's sizes set;
    unchanged for models without one. Sparse attention is served in the latent form only:
    ``mla="expanded"`` and whatever keeps the latent form from a layer raise ValueError."""
    modules = indexed_modules(model)
    if not modules:
        return layers
    if mla_form == "expanded":
        raise SparseAttentionError(
            "DeepSeek sparse attention is served in the latent form only (its indexer keys ride "
            "in the latent cache's blocks): pass mla=None or mla='latent', not mla='expanded' "
            "(an fp8 kv_cache_dtype, CUDA graphs and compiled decode steps ask for it too)"
        )
    if any(not layer.latent_rank for layer in layers):
        try:
            layers = mla.latent_form(layers, model, "latent", tp_size)
        except ValueError as error:
            raise SparseAttentionError(
                "DeepSeek sparse attention is served in the latent form only, which cannot serve "
                f"this model ({error})"
            ) from error
    sparse = []
    for index, layer in enumerate(layers):
        module = modules.get(index)
        if module is None:
            raise SparseAttentionError(
                f"layer {index} of a DeepSeek sparse attention model has no {_MODULE_CLASS}"
            )
        indexer = module.indexer
        _, rope, _, _ = mla.latent_dims(module)
        if indexer.head_dim % 8 or indexer.head_dim < rope:
            raise SparseAttentionError(
                f"layer {index}'s index_head_dim ({indexer.head_dim}) must be a multiple of 8 "
                f"and at least qk_rope_head_dim ({rope})"
            )
        sparse.append(
            replace(
                layer,
                head_size=rope + indexer.head_dim,
                index_topk=int(indexer.index_topk),
                index_heads=int(indexer.n_heads),
                index_head_size=int(indexer.head_dim),
            )
        )
    return sparse


def install(model: torch.nn.Module, runs_paged) -> None:
    """Give every sparse attention module of ``model`` a forward that runs
    :func:`_paged_forward` when ``runs_paged(module)`` says a paged cache runs it, and the
    original forward otherwise (once per module)."""
    for module in indexed_modules(model).values():
        if getattr(module, "_paged_attention_sparse", False):
            continue
        source = inspect.getmodule(type(module))
        rotations = tuple(
            getattr(source, name, None)
            for name in ("apply_rotary_pos_emb_interleave", "apply_rotary_pos_emb")
        )
        if not all(callable(rotation) for rotation in rotations):
            raise SparseAttentionError(
                f"{type(module).__name__}'s module does not define the rotary embeddings "
                "(apply_rotary_pos_emb_interleave, apply_rotary_pos_emb) its forward uses"
            )
        original = module.forward

        @functools.wraps(original)
        def forward(*args, _module=module, _original=original, _rotations=rotations, **kwargs):
            if runs_paged(_module):
                return _paged_forward(_module, _rotations, *args, **kwargs)
            return _original(*args, **kwargs)

        module.forward = forward
        module._paged_attention_sparse = True


def _paged_forward(
    module, rotations, hidden_states, position_embeddings, attention_mask, cache=None, **kwargs
):
    """transformers' ``DeepseekV32Attention.forward`` up to its attention, whose keys, values
    and indexer selection come from the paged cache: the cache's ``update`` receives the latents
    as in the latent form, and the attention function receives the query with the indexer's
    inputs spread after it and the rotary keys with the indexer keys after them."""
    from paged_attention.modeling.transformers_backend import paged_attention_forward

    if cache is None:
        cache = kwargs.pop("past_key_values", None)
    if cache is None:
        raise SparseAttentionError(
            'attn_implementation="paged_attention" needs a PagedCache as the model\'s cache '
            "(and use_cache=True): DeepSeek sparse attention reads its indexer keys there"
        )
    interleaved, half_split = rotations
    nope, rope, _, rank = mla.latent_dims(module)
    batch, length = hidden_states.shape[:-1]
    q_resid = module.q_a_layernorm(module.q_a_proj(hidden_states))
    q_states = module.q_b_proj(q_resid).view(batch, length, -1, nope + rope).transpose(1, 2)
    q_pass, q_rot = torch.split(q_states, [nope, rope], dim=-1)
    latent, k_rot = torch.split(module.kv_a_proj_with_mqa(hidden_states), [rank, rope], dim=-1)
    latent = module.kv_a_layernorm(latent).view(batch, 1, length, rank)
    k_rot = k_rot.view(batch, 1, length, rope)
    cos, sin = position_embeddings
    q_rot, k_rot = interleaved(q_rot, k_rot, cos, sin)
    latent, k_rot = cache.update(latent, k_rot, module.layer_idx)
    index_query, index_key, weights = indexer_inputs(
        module.indexer, hidden_states, q_resid, position_embeddings, half_split
    )
    query = torch.cat((q_pass, q_rot), dim=-1)
    query = torch.cat((query.to(torch.float32), spread(index_query, weights, query.shape[1])), -1)
    keys = torch.cat((k_rot, index_key.unsqueeze(1).to(k_rot.dtype)), dim=-1)
    out, _ = paged_attention_forward(
        module, query, latent, keys, attention_mask, scaling=module.scaling
    )
    out = out.reshape(batch, length, -1).to(hidden_states.dtype)
    return module.o_proj(out), None


def indexer_inputs(indexer, hidden_states, q_resid, position_embeddings, half_split):
    """The indexer's query heads ``[batch, q, index_n_heads, index_head_dim]``, keys ``[batch,
    q, index_head_dim]`` (the model's dtype) and float32 head weights ``[batch, q,
    index_n_heads]`` (already times ``index_n_heads^-0.5``), computed as transformers'
    ``DeepseekV32Indexer`` computes them."""
    batch, length, _ = hidden_states.shape
    rope = indexer.qk_rope_head_dim
    q = indexer.wq_b(q_resid).view(batch, length, indexer.n_heads, indexer.head_dim)
    q_rot, q_pass = torch.split(q, [rope, indexer.head_dim - rope], dim=-1)
    k = indexer.k_norm(indexer.wk(hidden_states)).unsqueeze(2)
    k_rot, k_pass = torch.split(k, [rope, indexer.head_dim - rope], dim=-1)
    cos, sin = position_embeddings
    q_rot, k_rot = half_split(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    q = torch.cat([q_rot, q_pass], dim=-1)
    k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)
    projection = indexer.weights_proj
    weights = projection(hidden_states.to(projection.weight.dtype)).float()
    return q, k, weights * (indexer.n_heads**-0.5)


def spread(index_query, weights, heads: int) -> torch.Tensor:
    """Each token's indexer query heads and weights, flattened in float32 and spread over
    ``heads`` equal parts (zero-padded): ``[batch, heads, q, ceil(n / heads)]``."""
    batch, length = weights.shape[:2]
    flat = torch.cat((index_query.float().reshape(batch, length, -1), weights.float()), dim=-1)
    width = -(-flat.shape[-1] // heads)
    flat = F.pad(flat, (0, width * heads - flat.shape[-1]))
    return flat.view(batch, length, heads, width).transpose(1, 2)


def gather(extras: torch.Tensor, layer) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`spread`'s inverse on packed rows ``[tokens, heads, width]``: the indexer query
    heads ``[tokens, index_heads, index_head_size]`` and weights ``[tokens, index_heads]``."""
    heads, size = layer.index_heads, layer.index_head_size
    flat = extras.reshape(extras.shape[0], -1)
    if flat.shape[1] < heads * (size + 1):
        raise SparseAttentionError(
            f"the query carries {flat.shape[1]} indexer dims per token; the cache was built for "
            f"{heads} indexer heads of {size} and their weights: build a PagedCache for the "
            "model it serves"
        )
    query = flat[:, : heads * size].reshape(-1, heads, size)
    return query, flat[:, heads * size : heads * (size + 1)]


def attend_sparse(module, layer_idx: int, layer, query, latent, keys, attend) -> torch.Tensor:
    """The sparse layer's attention call: ``query [batch, heads, q, qk_head_dim + spread]``,
    ``latent [batch, 1, q, kv_lora_rank]``, ``keys [batch, 1, q, rope + index_head_dim]``;
    ``attend(query, key, value)`` attends packed rows (:func:`sparse_paged_attention`). Returns
    ``[batch, q, heads, v_head_dim]`` in float32."""
    nope, rope, _, rank = mla.latent_dims(module)
    built = (layer.num_heads, layer.v_head_size, layer.head_size, layer.index_head_size)
    got = (query.shape[1], latent.shape[-1], keys.shape[-1], module.indexer.head_dim)
    if built != got or rank != built[1] or rope + got[3] != built[2]:
        raise SparseAttentionError(
            f"PagedCache was built for {built[0]} query heads over a latent of {built[1]} and "
            f"keys of {built[2]} (rotary and indexer) in layer {layer_idx}; the model using it "
            f"has {got[0]} heads, a latent of {got[1]} and keys of {got[2]}: build a PagedCache "
            "for the model it serves"
        )
    qk, extras = query.split([nope + rope, query.shape[-1] - nope - rope], dim=-1)

    def with_extras(absorbed, _rotary, _latent):
        return attend(torch.cat((absorbed, extras.to(torch.float32)), dim=-1), keys, latent)

    return mla.attend_absorbed(module, qk, latent, keys[..., :rope], with_extras)


def sparse_paged_attention(
    query, keys, latent, key_cache, value_cache, metadata, scale, layer, padded_length=None
):
    """Store the step's rows (``keys [tokens, 1, rope + index_head_dim]`` in the key cache,
    ``latent [tokens, 1, kv_lora_rank]`` in the value cache) and attend each new token over the
    ``index_topk`` tokens of its sequence its indexer scores highest. ``query [tokens, heads,
    kv_lora_rank + rope + spread]`` (absorbed, float32); returns ``[tokens, heads,
    kv_lora_rank]``. ``padded_length``: the length of a left-padded batch's rows, padding
    included, which the scores are laid out in before the top-k (:func:`select`)."""
    mla.store_latents(keys, latent, key_cache, value_cache, metadata.slot_mapping)
    rank = value_cache.shape[2]
    out = query.new_zeros(query.shape[0], query.shape[1], rank)
    start = 0
    for index, (q_len, seq_len) in enumerate(zip(metadata.query_lens, metadata.seq_lens)):
        if q_len:
            rows = slice(start, start + q_len)
            table = metadata.block_tables[index]
            context = _context(key_cache, value_cache, table, seq_len)
            width = max(seq_len, padded_length or 0)
            out[rows] = _attend_sequence(query[rows], context, seq_len, scale, layer, width)
        start += q_len
    return out


def _context(key_cache, value_cache, table, seq_len: int):
    """A sequence's cached rows: keys ``[seq_len, rope + index_head_dim]`` and latents
    ``[seq_len, kv_lora_rank]``."""
    keys, values = mla.token_rows(key_cache), mla.token_rows(value_cache)
    blocks = table[: -(-seq_len // keys.shape[1])].to(torch.long)
    rows = keys[blocks].reshape(-1, keys.shape[2])[:seq_len]
    return rows, values[blocks].reshape(-1, values.shape[2])[:seq_len]


def select(index_query, weights, index_keys, positions, topk: int, width: int = 0):
    """Which of a sequence's ``T`` cached tokens each query row reads: ``[rows, T]`` bools, the
    ``topk`` visible tokens (at most the row's position) of highest indexer score, as
    transformers' ``DeepseekV32Indexer`` scores them (float32; ``index_query [rows, heads,
    dim]``, ``weights [rows, heads]``, ``index_keys [T, dim]``).

    Scores can tie exactly (every indexer head's ReLU at zero), and which of the tied tokens
    ``topk`` keeps depends on the row it searches. So the row is laid out as transformers lays
    it out: ``width - T`` masked (-inf) padding positions first when the sequence is a row of a
    left-padded batch ``width`` wide, then the sequence, its future masked."""
    scale = index_query.shape[-1] ** -0.5
    scores = torch.matmul(index_query.float(), index_keys.transpose(-1, -2).float()) * scale
    scores = F.relu(scores)
    index_scores = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)  # [rows, T]
    tokens = torch.arange(index_keys.shape[0], device=index_keys.device)
    future = tokens.unsqueeze(0) > positions.unsqueeze(1)
    index_scores = index_scores.masked_fill(future, -math.inf)
    padding = max(0, width - index_keys.shape[0])
    index_scores = F.pad(index_scores, (padding, 0), value=-math.inf)
    chosen = index_scores.topk(min(topk, index_scores.shape[-1]), dim=-1).indices
    selected = torch.zeros_like(index_scores, dtype=torch.bool).scatter(-1, chosen, True)
    return selected[:, padding:] & ~future


def _attend_sequence(query, context, seq_len: int, scale: float, layer, width: int):
    """One sequence's ``query`` rows (its last ``q`` positions) over the tokens each selects
    (scored in rows ``width`` wide: :func:`select`), in pieces of rows that bound the logits'
    size."""
    key_rows, latents = context
    rank = latents.shape[1]
    rope = layer.head_size - layer.index_head_size
    lat = latents.to(torch.float32)
    rot = key_rows[:, :rope].to(torch.float32)
    q_len, heads, _ = query.shape
    step = max(1, _LOGITS_PER_PRODUCT // max(1, heads * seq_len + layer.index_heads * seq_len))
    pieces = []
    for first in range(0, q_len, step):
        q = query[first : first + step].to(torch.float32)
        index_query, weights = gather(q[:, :, rank + rope :], layer)
        positions = seq_len - q_len + first + torch.arange(q.shape[0], device=q.device)
        index_keys = key_rows[:, rope:]
        selected = select(index_query, weights, index_keys, positions, layer.index_topk, width)
        logits = q[..., :rank] @ lat.T + q[..., rank : rank + rope] @ rot.T  # [rows, heads, T]
        logits.mul_(scale).masked_fill_(~selected.unsqueeze(1), -math.inf)
        pieces.append(torch.softmax(logits, dim=-1) @ lat)
    return torch.cat(pieces)
