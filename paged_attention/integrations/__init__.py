"""Adapters that run other libraries' models on the paged KV cache.

``paged_attention.integrations.transformers`` (needs ``pip install 'paged_attention[hf]'``):
``PagedCache`` and the ``"paged_attention"`` attention implementation for Hugging Face models.
"""
