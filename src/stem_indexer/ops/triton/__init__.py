"""The CUDA path: Triton kernels behind ``custom::npu_stem_indexer``.

``launch.stem_indexer_triton`` is what the op's CUDA kernel calls; the
kernels themselves are in ``kernels.py``. Importing this package does not
import Triton: ``launch`` does, and only the CUDA kernel of the op (or a
test) imports it.
"""
