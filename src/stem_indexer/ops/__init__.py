"""Operator registrations and the backend kernels behind them.

Which implementation runs (``library.py`` registers the ops and dispatches):

``npu_stem_indexer``
    * CPU: ``cpu.py``, batched SGEMMs for the scores, then the native C
      selection kernel (``native.py``, ``csrc/select_rows.c``);
    * CPU without a C compiler, or with ``STEM_INDEXER_NATIVE=0``: ``cpu.py``
      with its torch selection (same results, slower);
    * CUDA with Triton: ``triton/``, score and selection kernels that read no
      tensor data on the host (the call can be captured in a CUDA graph);
    * CUDA without Triton, and any other device: ``cpu.py``'s
      device-agnostic torch path.

``npu_stem_indexer_metadata``
    Any device: ``metadata.build_metadata`` on host copies of the lengths,
    copied to their device.

Both ops on Meta / fake tensors
    The shape-only fakes of ``library.py`` (``torch.compile``, ``torch.export``).

``block_sparse_attention`` (``attention.py`` chooses)
    * CPU, float32 / bfloat16: ``sparse_attention.py``, the native C
      kernel ``csrc/sparse_attention.c``;
    * CUDA: ``flex_attention.py``, compiled FlexAttention with a ``BlockMask``
      built from the lists;
    * float16 and float64 on CPU, no native kernel, other devices:
      ``gather_attention.py``, torch operations.

Every kernel receives inputs already checked by ``contract.py`` (shapes,
dtypes, attributes) and, outside a CUDA-graph capture, by
``library._host_values`` (lengths, metadata); none re-derives the semantics
(visibility, forced blocks, budget, ranking) that ``contract.py`` defines.
"""
