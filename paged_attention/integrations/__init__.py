"""Adapters that run other libraries' models on the paged KV cache.

``paged_attention.integrations.transformers`` (needs the ``hf`` extra, installed from source:
``pip install --no-build-isolation '.[hf]'``):
``PagedCache`` and the ``"paged_attention"`` attention implementation for Hugging Face models.
"""
