"""The ops layer, the lowest but errors.py: the Python wrappers of the compiled
``torch.ops.paged_attention`` ops (:mod:`~paged_attention.ops.bindings`), the pure-PyTorch
reference they are tested against (:mod:`~paged_attention.ops.reference`), the dtypes, head
sizes and block sizes the kernels are built for (:mod:`~paged_attention.ops.supported`) and
what CPU they run on (:mod:`~paged_attention.ops.cpu_info`)."""
