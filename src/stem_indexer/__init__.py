"""Stem block-sparse attention indexing for PyTorch.

Importing this package registers ``torch.ops.custom.npu_stem_indexer`` and
``torch.ops.custom.npu_stem_indexer_metadata`` (CPU, CUDA and fake kernels)
and sets every op of the ``custom`` namespace as an attribute of the package,
as the Ascend extension does on ``torch_npu``.
"""

from __future__ import annotations

import torch as _torch

from .api import stem_indexer, stem_indexer_metadata
from .attention import block_sparse_attention, dense_attention, stem_attention
from .contract import IndexerParams, StemIndexerInputError
from .ops.flex_attention import block_mask
from .prepare import StemInputs, stem_inputs
from .reference import stem_indexer_reference

__version__ = "0.1.0"

__all__ = [
    "stem_indexer",
    "stem_indexer_metadata",
    "stem_indexer_reference",
    "stem_inputs",
    "StemInputs",
    "block_sparse_attention",
    "block_mask",
    "dense_attention",
    "stem_attention",
    "IndexerParams",
    "StemIndexerInputError",
    "npu_stem_indexer",
    "npu_stem_indexer_metadata",
]


def _export_custom_ops() -> None:
    prefix = "custom::"
    for qualified in _torch._C._dispatch_get_all_op_names():
        if qualified.startswith(prefix):
            name = qualified[len(prefix):].split(".")[0]
            globals()[name] = getattr(_torch.ops.custom, name)


_export_custom_ops()
