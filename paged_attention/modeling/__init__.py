"""The modeling layer: how a model is read (:mod:`~paged_attention.modeling.geometry`, GGUF
files, quantized weights), loaded (:mod:`~paged_attention.modeling.models`, the tiny random
model), split across GPUs (:mod:`~paged_attention.modeling.tensor_parallel`) and run on the
paged KV cache by transformers (:mod:`~paged_attention.modeling.transformers_backend`, and
for hybrid models' conv and recurrent states :mod:`~paged_attention.modeling.hybrid`). It
imports the KV cache and the attention below it, never the engine, the server or the command
line above it."""
