#include "checks.h"

#include <ATen/ATen.h>
#include <c10/util/accumulate.h>
#include <c10/util/irange.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <utility>

namespace paged_attention {

namespace {

void check_dtype(const at::Tensor& t, at::ScalarType dtype, const char* name) {
  TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
}

void check_dim(const at::Tensor& t, int64_t dim, const char* name) {
  TORCH_CHECK(t.dim() == dim, name, " must be ", dim, "-D, got shape ", t.sizes());
}

void check_same_device(const at::Tensor& t, const at::Tensor& ref, const char* name,
                       const char* ref_name) {
  // An undefined tensor (None passed for a Tensor argument) has no device to compare.
  TORCH_CHECK(t.defined(), name, " must be a tensor, got None");
  TORCH_CHECK(ref.defined(), ref_name, " must be a tensor, got None");
  TORCH_CHECK(t.device() == ref.device(), name, " must be on the same device as ", ref_name,
              " (", ref.device(), "), got ", t.device());
}

bool is_float_type(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

// Cache dtype implied by kv_cache_dtype and the data dtype.
at::ScalarType expected_cache_type(CacheDtype cache_dtype, at::ScalarType data_type) {
  return cache_dtype == CacheDtype::kAuto ? data_type : at::kByte;
}

void check_scale(const at::Tensor& scale, const at::Tensor& cache, const char* name) {
  check_dtype(scale, at::kFloat, name);
  TORCH_CHECK_VALUE(scale.numel() == 1, name, " must hold exactly one element, got shape ",
                    scale.sizes());
  check_same_device(scale, cache, name, "the cache");
}

// Dims 2.. of a cache tensor must be contiguous (one block of one head is a dense tile).
void check_inner_contiguous(const at::Tensor& t, int64_t first_dim, const char* name) {
  int64_t expected = 1;
  for (int64_t d = t.dim() - 1; d >= first_dim; --d) {
    TORCH_CHECK(t.size(d) == 1 || t.stride(d) == expected, name,
                " must be contiguous from dim ", first_dim, " on (strides ", t.strides(), ")");
    expected *= t.size(d);
  }
}

void check_head_size(int64_t head_size, const char* name, const char* source) {
  const auto& head_sizes = supported_head_sizes();
  TORCH_CHECK_VALUE(
      std::find(head_sizes.begin(), head_sizes.end(), head_size) != head_sizes.end(), name, " ",
      head_size, " is not supported (", source,
      "; supported: 32, 64, 80, 96, 112, 120, 128, 192, 256)");
}

// The value cache's head size (v_head_size) is its own: multi-head latent attention stores keys
// of 192 and values of 128 dims, say. Both must be multiples of x.
void check_cache_layout(const at::Tensor& key_cache, const at::Tensor& value_cache,
                        int64_t num_kv_heads, int64_t head_size, int64_t v_head_size,
                        int64_t block_size) {
  check_dim(key_cache, 5, "key_cache");
  check_dim(value_cache, 4, "value_cache");
  TORCH_CHECK(key_cache.scalar_type() == value_cache.scalar_type(),
              "key_cache and value_cache must have the same dtype, got ",
              key_cache.scalar_type(), " and ", value_cache.scalar_type());
  check_same_device(value_cache, key_cache, "value_cache", "key_cache");
  const int64_t x = 16 / static_cast<int64_t>(key_cache.element_size());
  TORCH_CHECK_VALUE(head_size % x == 0, "head_size (", head_size,
                    ") must be a multiple of x = 16 / element size of key_cache = ", x);
  TORCH_CHECK_VALUE(v_head_size % x == 0, "v_head_size (value_cache.size(2) = ", v_head_size,
                    ") must be a multiple of x = 16 / element size = ", x);
  const std::vector<int64_t> key_shape = {key_cache.size(0), num_kv_heads, head_size / x,
                                          block_size, x};
  TORCH_CHECK_VALUE(key_cache.sizes() == at::IntArrayRef(key_shape),
                    "key_cache must have shape [num_blocks, num_kv_heads, head_size / x, "
                    "block_size, x] = ",
                    at::IntArrayRef(key_shape), ", got ", key_cache.sizes());
  const std::vector<int64_t> value_shape = {key_cache.size(0), num_kv_heads, v_head_size,
                                            block_size};
  TORCH_CHECK_VALUE(value_cache.sizes() == at::IntArrayRef(value_shape),
                    "value_cache must have shape [num_blocks, num_kv_heads, v_head_size, "
                    "block_size] = ",
                    at::IntArrayRef(value_shape), ", got ", value_cache.sizes());
  check_inner_contiguous(key_cache, 2, "key_cache");
  check_inner_contiguous(value_cache, 2, "value_cache");
}

void check_block_size(int64_t block_size) {
  const auto& sizes = supported_block_sizes();
  TORCH_CHECK_VALUE(std::find(sizes.begin(), sizes.end(), block_size) != sizes.end(),
                    "block_size ", block_size, " is not supported (supported: 8, 16, 32)");
}

// The kernels compute in float32: a value that is finite or non-zero only in double precision
// would silently become inf (scale) or "no cap" (logits_soft_cap).
void check_logit_args(double scale, int64_t sliding_window, double logits_soft_cap,
                      int64_t attention_chunk_size) {
  TORCH_CHECK_VALUE(std::isfinite(static_cast<float>(scale)),
                    "scale must be finite in float32, got ", scale);
  TORCH_CHECK_VALUE(sliding_window >= 0, "sliding_window must be >= 0 (0 = none), got ",
                    sliding_window);
  TORCH_CHECK_VALUE(attention_chunk_size >= 0,
                    "attention_chunk_size must be >= 0 (0 = none), got ", attention_chunk_size);
  TORCH_CHECK_VALUE(logits_soft_cap >= 0 && std::isfinite(static_cast<float>(logits_soft_cap)),
                    "logits_soft_cap must be >= 0 and finite in float32 (0 = none), got ",
                    logits_soft_cap);
  TORCH_CHECK_VALUE(logits_soft_cap == 0 || static_cast<float>(logits_soft_cap) > 0,
                    "logits_soft_cap (", logits_soft_cap,
                    ") underflows to 0 in float32, which means no cap; pass 0 for none");
}

// First and one-past-last byte a non-empty tensor can address.
std::pair<const char*, const char*> byte_span(const at::Tensor& t) {
  const char* begin = static_cast<const char*>(t.data_ptr());
  int64_t last = 0;
  for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
  return {begin, begin + (last + 1) * static_cast<int64_t>(t.element_size())};
}

// Whether two tensors may share a byte: the same storage and intersecting address spans.
// Conservative for interleaved views of one storage, which real caches and inputs never are.
bool may_overlap(const at::Tensor& a, const at::Tensor& b) {
  if (a.numel() == 0 || b.numel() == 0 || !a.is_alias_of(b)) return false;
  const auto [a_begin, a_end] = byte_span(a);
  const auto [b_begin, b_end] = byte_span(b);
  return a_begin < b_end && b_begin < a_end;
}

void check_no_internal_overlap(const at::Tensor& t, int64_t dense_from, const char* name) {
  // Dims [dense_from, dim) are one dense tile (checked elsewhere); the outer dims, visited by
  // increasing stride, must each step past everything the dims before them reach.
  std::vector<int64_t> outer;
  for (int64_t d = 0; d < dense_from; ++d) {
    if (t.size(d) > 1) outer.push_back(d);
  }
  std::sort(outer.begin(), outer.end(),
            [&](int64_t a, int64_t b) { return t.stride(a) < t.stride(b); });
  int64_t reach = 1;  // elements spanned so far
  for (int64_t d = dense_from; d < t.dim(); ++d) reach *= t.size(d);
  if (reach == 0) return;
  for (const int64_t d : outer) {
    TORCH_CHECK(t.stride(d) >= reach, name,
                " must not overlap itself (as torch's in-place ops require), got shape ",
                t.sizes(), " and strides ", t.strides());
    reach += (t.size(d) - 1) * t.stride(d);
  }
}

// The kernels copy every pair of a mapping at the same time, in no fixed order, so a block
// written twice, or written by one pair and read by another (a chain s -> d -> e, a swap
// s <-> d), would give a result that depends on the order. Blocks of src and dst are compared by
// address when the two share memory (copy_blocks; swap_blocks between views of one storage),
// else by id, where only a repeated destination conflicts. Fan-out (one source, several
// destinations) is fine. `pairs` is the contiguous host copy of block_mapping.
void check_mapping_conflicts(const int64_t* pairs, int64_t num_pairs, const at::Tensor& src,
                             const at::Tensor& dst) {
  const bool same_memory = src.is_alias_of(dst);
  const int64_t bytes = same_memory ? block_bytes(src) : 1;
  if (bytes == 0) return;  // empty blocks: nothing is copied
  const auto address = [&](const at::Tensor& t, int64_t id) -> int64_t {
    if (!same_memory) return id;
    return static_cast<int64_t>(reinterpret_cast<intptr_t>(t.data_ptr())) +
           id * block_stride_bytes(t);
  };
  std::vector<std::pair<int64_t, int64_t>> writes(num_pairs);  // (address, row)
  std::vector<std::pair<int64_t, int64_t>> reads(num_pairs);
  for (const auto i : c10::irange(num_pairs)) {
    reads[i] = {address(src, pairs[2 * i]), i};
    writes[i] = {address(dst, pairs[2 * i + 1]), i};
  }
  std::sort(writes.begin(), writes.end());
  std::sort(reads.begin(), reads.end());
  for (int64_t k = 1; k < num_pairs; ++k) {
    const auto [row, other] = std::minmax(writes[k - 1].second, writes[k].second);
    TORCH_CHECK_VALUE(writes[k].first - writes[k - 1].first >= bytes, "block_mapping[", other,
                      ", 1] = ", pairs[2 * other + 1], " writes the block that block_mapping[",
                      row, ", 1] = ", pairs[2 * row + 1],
                      " writes: each destination may appear once (the pairs are copied in "
                      "parallel)");
  }
  if (!same_memory) return;
  for (const auto& [write, row] : writes) {
    // The first read block that ends after this write starts: it overlaps if it starts before
    // the write ends.
    const auto it = std::lower_bound(reads.begin(), reads.end(),
                                     std::pair<int64_t, int64_t>{write - bytes + 1, -1});
    TORCH_CHECK_VALUE(it == reads.end() || it->first >= write + bytes, "block_mapping[", row,
                      ", 1] = ", pairs[2 * row + 1], " overwrites the block that block_mapping[",
                      it->second, ", 0] = ", pairs[2 * it->second],
                      " reads: a destination may not also be a source (the pairs are copied in "
                      "parallel, so chained or swapped pairs have no order; split them into "
                      "separate calls)");
  }
}

// Range and conflict checks of a mapping whose contents can be read without a device sync (on
// the host), or under the debug switch.
void check_block_mapping_contents(const at::Tensor& block_mapping, const at::Tensor& src,
                                  const at::Tensor& dst) {
  if (!block_mapping.is_cpu() && !debug_checks_enabled()) return;
  const at::Tensor mapping = block_mapping.cpu().contiguous();
  check_block_mapping(mapping, src.size(0), dst.size(0));
  check_mapping_conflicts(mapping.data_ptr<int64_t>(), mapping.size(0), src, dst);
}

}  // namespace

void check_no_overlap(const at::Tensor& written, const char* written_name, const at::Tensor& read,
                      const char* read_name) {
  TORCH_CHECK(!may_overlap(written, read), written_name, " must not share memory with ",
              read_name, " (the op writes ", written_name, " while it reads ", read_name, ")");
}

CacheDtype parse_cache_dtype(const std::string& kv_cache_dtype) {
  if (kv_cache_dtype == "auto") return CacheDtype::kAuto;
  if (kv_cache_dtype == "fp8" || kv_cache_dtype == "fp8_e4m3") return CacheDtype::kFp8E4M3;
  if (kv_cache_dtype == "fp8_e5m2") return CacheDtype::kFp8E5M2;
  TORCH_CHECK_VALUE(false, "kv_cache_dtype must be one of 'auto', 'fp8', 'fp8_e4m3', 'fp8_e5m2', "
                           "got '", kv_cache_dtype, "'");
}

const std::vector<int64_t>& supported_head_sizes() {
  static const std::vector<int64_t> sizes = {32, 64, 80, 96, 112, 120, 128, 192, 256};
  return sizes;
}

const std::vector<int64_t>& supported_block_sizes() {
  static const std::vector<int64_t> sizes = {8, 16, 32};
  return sizes;
}

namespace {

// block_tables int32 [num_seqs, max_blocks] with unit inner stride, seq_lens int32 [num_seqs]
// contiguous, both on query's device.
void check_tables_and_lens(const at::Tensor& block_tables, const at::Tensor& seq_lens,
                           const at::Tensor& query, int64_t num_seqs) {
  check_dim(block_tables, 2, "block_tables");
  check_dtype(block_tables, at::kInt, "block_tables");
  check_same_device(block_tables, query, "block_tables", "query");
  TORCH_CHECK_VALUE(block_tables.size(0) == num_seqs, "block_tables must have num_seqs (",
                    num_seqs, ") rows, got ", block_tables.size(0));
  TORCH_CHECK(block_tables.size(1) == 0 || block_tables.stride(1) == 1,
              "block_tables must have unit stride in its last dim");
  check_dim(seq_lens, 1, "seq_lens");
  check_dtype(seq_lens, at::kInt, "seq_lens");
  check_same_device(seq_lens, query, "seq_lens", "query");
  TORCH_CHECK_VALUE(seq_lens.size(0) == num_seqs, "seq_lens must have num_seqs (", num_seqs,
                    ") entries, got ", seq_lens.size(0));
  TORCH_CHECK(seq_lens.is_contiguous(), "seq_lens must be contiguous");
}

// What v1/v2 and the varlen op share: query and out (`rows` query rows), heads, the caches and
// their scales, block_tables and seq_lens for num_seqs sequences, max_seq_len, ALiBi, the logit
// parameters, and out sharing no memory with an input.
AttentionDims check_common_attention_args(const AttentionArgs& args, int64_t num_seqs,
                                          int64_t block_size) {
  const auto& [out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens,
               max_seq_len, alibi_slopes, kv_cache_dtype, k_scale, v_scale, sliding_window,
               logits_soft_cap, attention_chunk_size] = args;
  AttentionDims dims{};
  dims.cache_dtype = parse_cache_dtype(kv_cache_dtype);
  dims.num_seqs = num_seqs;
  dims.num_heads = query.size(1);
  dims.head_size = query.size(2);
  check_head_size(dims.head_size, "head_size", "query.size(2)");
  TORCH_CHECK(value_cache.defined(), "value_cache must be a tensor, got None");
  check_dim(value_cache, 4, "value_cache");
  dims.v_head_size = value_cache.size(2);
  check_head_size(dims.v_head_size, "v_head_size", "value_cache.size(2)");

  check_same_device(out, query, "out", "query");
  TORCH_CHECK(out.scalar_type() == query.scalar_type(), "out must have the dtype of query (",
              query.scalar_type(), "), got ", out.scalar_type());
  const std::vector<int64_t> out_shape = {query.size(0), dims.num_heads, dims.v_head_size};
  TORCH_CHECK_VALUE(out.sizes() == at::IntArrayRef(out_shape),
                    "out must have shape [query.size(0), num_heads, v_head_size] = ",
                    at::IntArrayRef(out_shape),
                    " (v_head_size: value_cache.size(2), the values' head size), got ",
                    out.sizes());
  TORCH_CHECK(out.is_contiguous(), "out must be contiguous");

  TORCH_CHECK_VALUE(num_kv_heads > 0 && dims.num_heads % num_kv_heads == 0,
                    "num_heads (", dims.num_heads,
                    ") must be a positive multiple of num_kv_heads (", num_kv_heads, ")");
  dims.num_kv_heads = num_kv_heads;
  check_block_size(block_size);
  dims.block_size = block_size;

  check_same_device(key_cache, query, "key_cache", "query");
  TORCH_CHECK(key_cache.scalar_type() == expected_cache_type(dims.cache_dtype, query.scalar_type()),
              "key_cache must be ", expected_cache_type(dims.cache_dtype, query.scalar_type()),
              " for kv_cache_dtype='", kv_cache_dtype, "' and query ", query.scalar_type(),
              ", got ", key_cache.scalar_type());
  check_cache_layout(key_cache, value_cache, num_kv_heads, dims.head_size, dims.v_head_size,
                     block_size);
  dims.num_blocks = key_cache.size(0);
  if (dims.cache_dtype != CacheDtype::kAuto) {
    check_scale(k_scale, key_cache, "k_scale");
    check_scale(v_scale, key_cache, "v_scale");
  }

  check_tables_and_lens(block_tables, seq_lens, query, dims.num_seqs);
  dims.max_blocks_per_seq = block_tables.size(1);

  TORCH_CHECK_VALUE(max_seq_len >= 0, "max_seq_len must be >= 0, got ", max_seq_len);
  TORCH_CHECK_VALUE(max_seq_len <= dims.max_blocks_per_seq * block_size, "max_seq_len (",
                    max_seq_len, ") exceeds what block_tables can address (",
                    dims.max_blocks_per_seq, " blocks x ", block_size, " tokens)");
  dims.max_seq_len = max_seq_len;
  dims.max_partitions = std::max<int64_t>(1, (max_seq_len + kPartitionSize - 1) / kPartitionSize);

  if (alibi_slopes.has_value()) {
    const at::Tensor& slopes = *alibi_slopes;
    check_dtype(slopes, at::kFloat, "alibi_slopes");
    check_same_device(slopes, query, "alibi_slopes", "query");
    TORCH_CHECK_VALUE(slopes.dim() == 1 && slopes.size(0) == dims.num_heads,
                      "alibi_slopes must have shape [num_heads] = [", dims.num_heads, "], got ",
                      slopes.sizes());
    TORCH_CHECK(slopes.is_contiguous(), "alibi_slopes must be contiguous");
  }
  check_logit_args(scale, sliding_window, logits_soft_cap, attention_chunk_size);
  check_no_overlap(out, "out", query, "query");
  check_no_overlap(out, "out", key_cache, "key_cache");
  check_no_overlap(out, "out", value_cache, "value_cache");
  check_no_overlap(out, "out", block_tables, "block_tables");
  check_no_overlap(out, "out", seq_lens, "seq_lens");
  if (alibi_slopes.has_value()) check_no_overlap(out, "out", *alibi_slopes, "alibi_slopes");
  check_no_overlap(out, "out", k_scale, "k_scale");
  check_no_overlap(out, "out", v_scale, "v_scale");
  return dims;
}

void check_query(const at::Tensor& query, const char* layout) {
  TORCH_CHECK(query.dim() == 3, "query must be 3-D ", layout, ", got shape ", query.sizes());
  TORCH_CHECK(is_float_type(query.scalar_type()),
              "query must be float32, float16 or bfloat16, got ", query.scalar_type());
  TORCH_CHECK(query.stride(2) == 1, "query must have unit stride in its last dim, got strides ",
              query.strides());
}

}  // namespace

AttentionDims check_attention_args(const AttentionArgs& args, int64_t block_size) {
  parse_cache_dtype(args.kv_cache_dtype);
  check_query(args.query, "[num_seqs, num_heads, head_size]");
  return check_common_attention_args(args, args.query.size(0), block_size);
}

VarlenDims check_varlen_args(const AttentionArgs& args, const at::Tensor& query_start_loc,
                             int64_t max_query_len, const std::optional<at::Tensor>& sinks) {
  const at::Tensor& out = args.out;
  const at::Tensor& query = args.query;
  const at::Tensor& value_cache = args.value_cache;
  parse_cache_dtype(args.kv_cache_dtype);
  check_query(query, "[num_tokens, num_heads, head_size]");
  check_dim(query_start_loc, 1, "query_start_loc");
  check_dtype(query_start_loc, at::kInt, "query_start_loc");
  check_same_device(query_start_loc, query, "query_start_loc", "query");
  TORCH_CHECK_VALUE(query_start_loc.size(0) >= 1,
                    "query_start_loc must have num_seqs + 1 entries (at least 1), got shape ",
                    query_start_loc.sizes());
  TORCH_CHECK(query_start_loc.is_contiguous(), "query_start_loc must be contiguous");
  check_dim(value_cache, 4, "value_cache");
  VarlenDims dims{};
  static_cast<AttentionDims&>(dims) =
      check_common_attention_args(args, query_start_loc.size(0) - 1, value_cache.size(3));
  dims.num_tokens = query.size(0);
  TORCH_CHECK_VALUE(max_query_len >= 0, "max_query_len must be >= 0, got ", max_query_len);
  dims.max_query_len = max_query_len;
  if (sinks.has_value()) {
    const at::Tensor& s = *sinks;
    check_dtype(s, at::kFloat, "sinks");
    check_same_device(s, query, "sinks", "query");
    TORCH_CHECK_VALUE(s.dim() == 1 && s.size(0) == dims.num_heads,
                      "sinks must have shape [num_heads] = [", dims.num_heads, "], got ",
                      s.sizes());
    TORCH_CHECK(s.is_contiguous(), "sinks must be contiguous");
    check_no_overlap(out, "out", s, "sinks");
  }
  check_no_overlap(out, "out", query_start_loc, "query_start_loc");
  return dims;
}

void check_varlen_indices(const at::Tensor& block_tables, const at::Tensor& seq_lens,
                          const at::Tensor& query_start_loc, const VarlenDims& dims,
                          int64_t sliding_window, int64_t attention_chunk_size) {
  const at::Tensor starts = query_start_loc.cpu();
  const int32_t* start = starts.data_ptr<int32_t>();
  TORCH_CHECK_VALUE(start[0] == 0, "query_start_loc[0] must be 0, got ", start[0]);
  for (const auto s : c10::irange(dims.num_seqs)) {
    TORCH_CHECK_VALUE(start[s + 1] >= start[s], "query_start_loc must be non-decreasing, got ",
                      "query_start_loc[", s, "] = ", start[s], " > query_start_loc[", s + 1,
                      "] = ", start[s + 1]);
  }
  TORCH_CHECK_VALUE(start[dims.num_seqs] <= dims.num_tokens, "query_start_loc[", dims.num_seqs,
                    "] = ", start[dims.num_seqs], " exceeds the ", dims.num_tokens,
                    " rows of query");
  const at::Tensor lens = seq_lens.cpu();
  const int32_t* len_ptr = lens.data_ptr<int32_t>();
  const at::Tensor tables = block_tables.cpu();
  for (const auto s : c10::irange(dims.num_seqs)) {
    const int64_t q_len = start[s + 1] - start[s];
    const int64_t len = len_ptr[s];
    TORCH_CHECK_VALUE(q_len <= dims.max_query_len, "sequence ", s, " has ", q_len,
                      " query rows (query_start_loc[", s + 1, "] - query_start_loc[", s,
                      "]), more than max_query_len = ", dims.max_query_len);
    TORCH_CHECK_VALUE(len >= 0 && len <= dims.max_seq_len, "seq_lens[", s, "] = ", len,
                      " must be in [0, max_seq_len = ", dims.max_seq_len, "]");
    TORCH_CHECK_VALUE(q_len <= len, "seq_lens[", s, "] = ", len, " is less than the ", q_len,
                      " query rows of sequence ", s,
                      " (query_start_loc): seq_len counts the new tokens too");
    if (q_len == 0) continue;  // reads nothing
    // Row 0 sits at position len - q_len; the later rows attend no further back.
    const int64_t first_pos =
        first_attended_position(len - q_len, sliding_window, attention_chunk_size);
    const int32_t* row = tables.data_ptr<int32_t>() + s * tables.stride(0);
    for (int64_t b = first_pos / dims.block_size; b < (len + dims.block_size - 1) / dims.block_size;
         ++b) {
      TORCH_CHECK_VALUE(row[b] >= 0 && row[b] < dims.num_blocks, "block_tables[", s, ", ", b,
                        "] = ", row[b], " is out of range [0, num_blocks = ", dims.num_blocks,
                        ")");
    }
  }
}

void check_v2_scratch(const at::Tensor& exp_sums, const at::Tensor& max_logits,
                      const at::Tensor& tmp_out, const AttentionDims& dims,
                      const AttentionArgs& args) {
  const at::Tensor& query = args.query;
  for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{exp_sums, "exp_sums"},
                                {max_logits, "max_logits"}}) {
    check_dim(t, 3, name);
    check_dtype(t, at::kFloat, name);
    check_same_device(t, query, name, "query");
    TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
    TORCH_CHECK_VALUE(t.size(0) == dims.num_seqs && t.size(1) == dims.num_heads &&
                          t.size(2) >= dims.max_partitions,
                      name, " must have shape [num_seqs, num_heads, >= max_partitions] = [",
                      dims.num_seqs, ", ", dims.num_heads, ", >= ", dims.max_partitions,
                      "], got ", t.sizes());
  }
  TORCH_CHECK_VALUE(exp_sums.sizes() == max_logits.sizes(),
                    "exp_sums and max_logits must have the same shape, got ", exp_sums.sizes(),
                    " and ", max_logits.sizes());
  check_dim(tmp_out, 4, "tmp_out");
  TORCH_CHECK(tmp_out.scalar_type() == query.scalar_type(), "tmp_out must have the dtype of query (",
              query.scalar_type(), "), got ", tmp_out.scalar_type());
  check_same_device(tmp_out, query, "tmp_out", "query");
  TORCH_CHECK(tmp_out.is_contiguous(), "tmp_out must be contiguous");
  TORCH_CHECK_VALUE(tmp_out.size(0) == dims.num_seqs && tmp_out.size(1) == dims.num_heads &&
                        tmp_out.size(2) == exp_sums.size(2) && tmp_out.size(3) == dims.v_head_size,
                    "tmp_out must have shape [num_seqs, num_heads, partitions, v_head_size] = [",
                    dims.num_seqs, ", ", dims.num_heads, ", ", exp_sums.size(2), ", ",
                    dims.v_head_size, "], got ", tmp_out.sizes());
  // The scratch tensors are written while the inputs are read.
  for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{exp_sums, "exp_sums"},
                                {max_logits, "max_logits"},
                                {tmp_out, "tmp_out"}}) {
    check_no_overlap(t, name, query, "query");
    check_no_overlap(t, name, args.out, "out");
    check_no_overlap(t, name, args.key_cache, "key_cache");
    check_no_overlap(t, name, args.value_cache, "value_cache");
    check_no_overlap(t, name, args.block_tables, "block_tables");
    check_no_overlap(t, name, args.seq_lens, "seq_lens");
    if (args.alibi_slopes.has_value()) {
      check_no_overlap(t, name, *args.alibi_slopes, "alibi_slopes");
    }
  }
  check_no_overlap(max_logits, "max_logits", exp_sums, "exp_sums");
  check_no_overlap(tmp_out, "tmp_out", exp_sums, "exp_sums");
  check_no_overlap(tmp_out, "tmp_out", max_logits, "max_logits");
}

void check_attention_indices(const at::Tensor& block_tables, const at::Tensor& seq_lens,
                             const AttentionDims& dims, int64_t sliding_window,
                             int64_t attention_chunk_size) {
  const at::Tensor tables = block_tables.cpu();
  const at::Tensor lens = seq_lens.cpu();
  const int32_t* len_ptr = lens.data_ptr<int32_t>();
  for (const auto s : c10::irange(dims.num_seqs)) {
    const int64_t len = len_ptr[s];
    TORCH_CHECK_VALUE(len >= 0 && len <= dims.max_seq_len, "seq_lens[", s, "] = ", len,
                      " must be in [0, max_seq_len = ", dims.max_seq_len, "]");
    // The query sits at len - 1 (a sequence of length 0 reads nothing).
    const int64_t first_pos =
        len > 0 ? first_attended_position(len - 1, sliding_window, attention_chunk_size) : 0;
    const int64_t first_block = first_pos / dims.block_size;
    const int64_t end_block = (len + dims.block_size - 1) / dims.block_size;
    const int32_t* row = tables.data_ptr<int32_t>() + s * tables.stride(0);
    for (int64_t b = first_block; b < end_block; ++b) {
      TORCH_CHECK_VALUE(row[b] >= 0 && row[b] < dims.num_blocks, "block_tables[", s, ", ", b,
                        "] = ", row[b], " is out of range [0, num_blocks = ", dims.num_blocks,
                        ")");
    }
  }
}

CacheDims check_reshape_and_cache_args(const at::Tensor& key, const at::Tensor& value,
                                       const at::Tensor& key_cache, const at::Tensor& value_cache,
                                       const at::Tensor& slot_mapping,
                                       const std::string& kv_cache_dtype, const at::Tensor& k_scale,
                                       const at::Tensor& v_scale) {
  CacheDims dims{};
  dims.cache_dtype = parse_cache_dtype(kv_cache_dtype);
  check_dim(key, 3, "key");
  check_dim(value, 3, "value");
  TORCH_CHECK(is_float_type(key.scalar_type()), "key must be float32, float16 or bfloat16, got ",
              key.scalar_type());
  TORCH_CHECK(value.scalar_type() == key.scalar_type(), "value must have the dtype of key (",
              key.scalar_type(), "), got ", value.scalar_type());
  TORCH_CHECK_VALUE(value.size(0) == key.size(0) && value.size(1) == key.size(1),
                    "value must have key's tokens and heads ([", key.size(0), ", ", key.size(1),
                    ", v_head_size]), got ", value.sizes());
  check_same_device(value, key, "value", "key");
  dims.num_tokens = key.size(0);
  dims.num_kv_heads = key.size(1);
  dims.head_size = key.size(2);
  dims.v_head_size = value.size(2);

  check_same_device(key_cache, key, "key_cache", "key");
  const at::ScalarType cache_type = expected_cache_type(dims.cache_dtype, key.scalar_type());
  TORCH_CHECK(key_cache.scalar_type() == cache_type, "key_cache must be ", cache_type,
              " for kv_cache_dtype='", kv_cache_dtype, "' and key ", key.scalar_type(), ", got ",
              key_cache.scalar_type());
  TORCH_CHECK(key_cache.dim() == 5 && key_cache.size(3) == value_cache.size(-1),
              "key_cache must be 5-D [num_blocks, num_kv_heads, head_size / x, block_size, x] "
              "with the block_size of value_cache, got ",
              key_cache.sizes(), " and ", value_cache.sizes());
  dims.block_size = key_cache.size(3);
  check_block_size(dims.block_size);
  check_cache_layout(key_cache, value_cache, dims.num_kv_heads, dims.head_size, dims.v_head_size,
                     dims.block_size);
  dims.num_blocks = key_cache.size(0);
  dims.x = key_cache.size(4);
  if (dims.cache_dtype != CacheDtype::kAuto) {
    check_scale(k_scale, key_cache, "k_scale");
    check_scale(v_scale, key_cache, "v_scale");
  }

  check_dim(slot_mapping, 1, "slot_mapping");
  check_dtype(slot_mapping, at::kLong, "slot_mapping");
  check_same_device(slot_mapping, key, "slot_mapping", "key");
  TORCH_CHECK_VALUE(slot_mapping.size(0) == dims.num_tokens, "slot_mapping must have num_tokens (",
                    dims.num_tokens, ") entries, got ", slot_mapping.size(0));
  TORCH_CHECK(slot_mapping.is_contiguous(), "slot_mapping must be contiguous");

  // The caches are written while every other argument is still being read.
  for (const auto& [cache, cache_name] : {std::pair<const at::Tensor&, const char*>{key_cache,
                                                                                   "key_cache"},
                                          {value_cache, "value_cache"}}) {
    check_no_internal_overlap(cache, 2, cache_name);
    for (const auto& [input, input_name] :
         {std::pair<const at::Tensor&, const char*>{key, "key"},
          {value, "value"},
          {slot_mapping, "slot_mapping"},
          {k_scale, "k_scale"},
          {v_scale, "v_scale"}}) {
      check_no_overlap(cache, cache_name, input, input_name);
    }
  }
  return dims;
}

void check_slot_mapping(const at::Tensor& slot_mapping, const CacheDims& dims) {
  const at::Tensor slots = slot_mapping.cpu();
  const int64_t* ptr = slots.data_ptr<int64_t>();
  const int64_t num_slots = dims.num_blocks * dims.block_size;
  std::vector<std::pair<int64_t, int64_t>> stored;  // (slot, token)
  stored.reserve(dims.num_tokens);
  for (const auto i : c10::irange(dims.num_tokens)) {
    TORCH_CHECK_VALUE(ptr[i] < num_slots, "slot_mapping[", i, "] = ", ptr[i],
                      " is out of range (num_blocks * block_size = ", num_slots, ")");
    if (ptr[i] >= 0) stored.emplace_back(ptr[i], i);
  }
  // Tokens are stored in parallel: two of them in one slot would leave either one there.
  std::sort(stored.begin(), stored.end());
  for (size_t k = 1; k < stored.size(); ++k) {
    TORCH_CHECK_VALUE(stored[k].first != stored[k - 1].first, "slot_mapping[",
                      stored[k].second, "] = ", stored[k].first, " repeats slot_mapping[",
                      stored[k - 1].second, "]: each slot may be written once per call");
  }
}

void check_block_mapping_shape(const at::Tensor& block_mapping) {
  check_dtype(block_mapping, at::kLong, "block_mapping");
  TORCH_CHECK_VALUE(block_mapping.dim() == 2 && block_mapping.size(1) == 2,
                    "block_mapping must have shape [n, 2] of (src, dst) pairs, got ",
                    block_mapping.sizes());
}

void check_block_mapping(const at::Tensor& block_mapping, int64_t num_src_blocks,
                         int64_t num_dst_blocks) {
  const at::Tensor mapping = block_mapping.cpu().contiguous();
  const int64_t* ptr = mapping.data_ptr<int64_t>();
  for (const auto i : c10::irange(mapping.size(0))) {
    TORCH_CHECK_VALUE(ptr[2 * i] >= 0 && ptr[2 * i] < num_src_blocks, "block_mapping[", i,
                      ", 0] = ", ptr[2 * i], " is out of range [0, ", num_src_blocks, ")");
    TORCH_CHECK_VALUE(ptr[2 * i + 1] >= 0 && ptr[2 * i + 1] < num_dst_blocks, "block_mapping[", i,
                      ", 1] = ", ptr[2 * i + 1], " is out of range [0, ", num_dst_blocks, ")");
  }
}

void check_copy_blocks_args(const std::vector<at::Tensor>& key_caches,
                            const std::vector<at::Tensor>& value_caches,
                            const at::Tensor& block_mapping) {
  TORCH_CHECK_VALUE(key_caches.size() == value_caches.size(),
                    "key_caches and value_caches must have one entry per layer, got ",
                    key_caches.size(), " and ", value_caches.size());
  check_block_mapping_shape(block_mapping);
  if (key_caches.empty()) return;
  const at::Tensor& first = key_caches[0];
  TORCH_CHECK(first.dim() >= 2, "key_caches[0] must have a block dim and data, got shape ",
              first.sizes());
  for (const auto i : c10::irange(key_caches.size())) {
    for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{key_caches[i],
                                                                           "key_caches"},
                                  {value_caches[i], "value_caches"}}) {
      check_same_device(t, first, name, "key_caches[0]");
      TORCH_CHECK(t.scalar_type() == first.scalar_type(), name, "[", i,
                  "] must have the dtype of key_caches[0] (", first.scalar_type(), "), got ",
                  t.scalar_type());
      TORCH_CHECK(t.dim() >= 2 && t.size(0) == first.size(0), name, "[", i,
                  "] must have as many blocks as key_caches[0] (", first.size(0), "), got shape ",
                  t.sizes());
      check_inner_contiguous(t, 1, name);
      check_no_internal_overlap(t, 1, name);
      check_no_overlap(t, name, block_mapping, "block_mapping");
    }
    TORCH_CHECK_VALUE(key_caches[i].sizes() == first.sizes(), "key_caches[", i,
                      "] must have the shape of key_caches[0] (", first.sizes(), "), got ",
                      key_caches[i].sizes());
    TORCH_CHECK_VALUE(value_caches[i].sizes() == value_caches[0].sizes(), "value_caches[", i,
                      "] must have the shape of value_caches[0] (", value_caches[0].sizes(),
                      "), got ", value_caches[i].sizes());
  }
  // Every layer uses the same ids, and each cache tensor is its own pool.
  check_block_mapping_contents(block_mapping, first, first);
}

void check_swap_blocks_args(const at::Tensor& src, const at::Tensor& dst,
                            const at::Tensor& block_mapping) {
  check_block_mapping_shape(block_mapping);
  TORCH_CHECK(src.dim() >= 1 && dst.dim() == src.dim(), "src and dst must have the same rank, got ",
              src.sizes(), " and ", dst.sizes());
  TORCH_CHECK(src.scalar_type() == dst.scalar_type(), "src and dst must have the same dtype, got ",
              src.scalar_type(), " and ", dst.scalar_type());
  TORCH_CHECK_VALUE(src.sizes().slice(1) == dst.sizes().slice(1),
                    "src and dst must have the same shape after the block dim, got ", src.sizes(),
                    " and ", dst.sizes());
  check_inner_contiguous(src, 1, "src");
  check_inner_contiguous(dst, 1, "dst");
  check_no_internal_overlap(dst, 1, "dst");
  check_no_overlap(dst, "dst", block_mapping, "block_mapping");
  check_block_mapping_contents(block_mapping, src, dst);
}

int64_t block_stride_bytes(const at::Tensor& cache) {
  return cache.stride(0) * static_cast<int64_t>(cache.element_size());
}

int64_t block_bytes(const at::Tensor& cache) {
  return c10::multiply_integers(cache.sizes().slice(1)) *
         static_cast<int64_t>(cache.element_size());
}

bool debug_checks_enabled() {
  static const bool enabled = [] {
    const char* value = std::getenv("PAGED_ATTENTION_DEBUG_CHECKS");
    return value != nullptr && std::string(value) == "1";
  }();
  return enabled;
}

}  // namespace paged_attention
