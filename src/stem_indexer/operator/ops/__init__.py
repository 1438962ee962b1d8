"""Operator registrations and the backend kernels behind them.

Which implementation runs (``stem_indexer.status()`` prints it for this
machine, with the reason for every slower fallback; each fallback also warns
once per process):

``npu_stem_indexer`` (``library.py`` registers a CPU, a CUDA and a fake
kernel; ``library.indexer_path`` says which runs)
    * CPU: ``cpu.py``, the score GEMMs, then the native C selection kernel
      (``native.py``, ``csrc/select_rows.c``);
    * CPU without a C compiler, or with ``STEM_INDEXER_NATIVE=0``: ``cpu.py``
      with its torch selection (same results, slower; reported);
    * CUDA with Triton: ``triton/``, score and selection kernels that read no
      tensor data on the host (the call can be captured in a CUDA graph);
    * CUDA without Triton: ``cpu.py``'s torch operations on the CUDA tensors
      (same results, slower; reported).

``npu_stem_indexer_metadata``
    CPU and CUDA: ``metadata.build_metadata`` on host copies of the lengths,
    copied to their device.

Both ops on Meta / fake tensors
    The shape-only fakes of ``library.py`` (``torch.compile``, ``torch.export``).

``block_sparse_attention`` (``dispatch.attention_path`` chooses for
``backend="auto"``)
    * CPU, float32 / bfloat16: ``sparse_attention.py``, the native C
      kernel ``csrc/sparse_attention.c`` over torch's BLAS (``torch_blas.py``);
    * CUDA: ``flex_attention.py``, compiled FlexAttention with a ``BlockMask``
      built from the lists;
    * CPU float64 (the references' precision), and any other device:
      ``gather_attention.py``, torch operations;
    * CPU float16, and CPU without the native kernel: ``gather_attention.py``
      (slower; reported).

Every kernel receives inputs already checked by ``contract.py`` (shapes,
dtypes, attributes) and, outside a CUDA-graph capture, by
``library._host_values`` (lengths, metadata); none re-derives the semantics
(visibility, forced blocks, budget, ranking) that ``contract.py`` defines.
"""
