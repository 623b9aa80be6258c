"""PagedAttention for PyTorch: a KV cache kept in fixed-size blocks."""
