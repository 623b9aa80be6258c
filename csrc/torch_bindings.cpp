// The one place that declares every op of the `paged_attention` library.
// Kernels are registered per backend in csrc/cpu/cpu_ops.cpp and csrc/cuda/cuda_ops.cpp.
#include <Python.h>
#include <torch/library.h>

extern "C" {
// Lets `import paged_attention._C` load this shared library (and so register the ops) without
// pybind11: the module itself is empty.
PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
}

TORCH_LIBRARY(paged_attention, m) {
  m.def(
      "paged_attention_v1(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
      "int num_kv_heads, float scale, Tensor block_tables, Tensor seq_lens, int block_size, "
      "int max_seq_len, Tensor? alibi_slopes, str kv_cache_dtype, Tensor k_scale, Tensor v_scale, "
      "int sliding_window=0, float logits_soft_cap=0.0, int attention_chunk_size=0) -> ()");
  m.def(
      "paged_attention_v2(Tensor(a!) out, Tensor(b!) exp_sums, Tensor(c!) max_logits, "
      "Tensor(d!) tmp_out, Tensor query, Tensor key_cache, Tensor value_cache, int num_kv_heads, "
      "float scale, Tensor block_tables, Tensor seq_lens, int block_size, int max_seq_len, "
      "Tensor? alibi_slopes, str kv_cache_dtype, Tensor k_scale, Tensor v_scale, "
      "int sliding_window=0, float logits_soft_cap=0.0, int attention_chunk_size=0) -> ()");
  m.def(
      "paged_attention_varlen(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
      "int num_kv_heads, float scale, Tensor block_tables, Tensor seq_lens, "
      "Tensor query_start_loc, int max_query_len, int max_seq_len, Tensor? alibi_slopes, "
      "str kv_cache_dtype, Tensor k_scale, Tensor v_scale, int sliding_window=0, "
      "float logits_soft_cap=0.0, Tensor? sinks=None, int attention_chunk_size=0) -> ()");
  m.def(
      "reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
      "Tensor slot_mapping, str kv_cache_dtype, Tensor k_scale, Tensor v_scale) -> ()");
  m.def(
      "copy_blocks(Tensor(a!)[] key_caches, Tensor(b!)[] value_caches, Tensor block_mapping) -> "
      "()");
  m.def("swap_blocks(Tensor src, Tensor(a!) dst, Tensor block_mapping) -> ()");
}
