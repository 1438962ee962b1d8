"""The CUDA path: Triton kernels behind ``custom::npu_stem_indexer``.

``launch.stem_indexer_triton`` is what the op's CUDA kernel calls; the
kernels themselves are in ``kernels.py``; ``aot.py`` compiles them for sm_90
and sm_80 without a GPU and reports registers, spills and tensor-core
instructions. Importing this package does not import Triton: ``launch`` does,
and only the CUDA kernel of the op (or a test) imports it.
"""
