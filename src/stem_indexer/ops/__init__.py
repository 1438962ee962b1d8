"""Operator registrations and the backend kernels behind them.

Which implementation runs (``library.py`` registers the ops and dispatches):

| op / function | device, setting | implementation |
|---|---|---|
| ``npu_stem_indexer`` | CPU | ``cpu.py``: batched SGEMMs for the scores, then the native C selection kernel (``native.py``, ``csrc/select_rows.c``) |
| ``npu_stem_indexer`` | CPU, no C compiler or ``STEM_INDEXER_NATIVE=0`` | ``cpu.py`` with its torch selection (same results) |
| ``npu_stem_indexer`` | CUDA with Triton | ``triton/``: score and selection kernels, no host read of tensor data (CUDA-graph capturable) |
| ``npu_stem_indexer`` | CUDA without Triton, any other device | ``cpu.py``'s device-agnostic torch path |
| ``npu_stem_indexer_metadata`` | any | ``metadata.build_metadata`` on host copies of the lengths, copied to their device |
| both ops | Meta / fake tensors | shape-only fakes in ``library.py`` (``torch.compile``, ``torch.export``) |
| ``block_sparse_attention`` | CPU (float32, bf16, fp16) | ``sparse_attention.py``: native C kernel (``csrc/sparse_attention.c``) |
| ``block_sparse_attention`` | CUDA | ``flex_attention.py``: compiled FlexAttention with a ``BlockMask`` from the lists |
| ``block_sparse_attention`` | float64, no native kernel, other devices | ``gather_attention.py``: torch operations |

Every kernel receives inputs already checked by ``contract.py`` (shapes,
dtypes, attributes) and, outside a CUDA-graph capture, by
``library._host_values`` (lengths, metadata); none re-derives the semantics
(visibility, forced blocks, budget, ranking) that ``contract.py`` defines.
"""
