"""Stem block-sparse attention for PyTorch: faster long-context prefill.

For every query block, Stem keeps the key blocks that matter (block scores
from compressed Q/K plus a value-magnitude bias, a top-k budget that decays
with position, sink and window blocks always kept) and attends to those
only. Start here:

* ``stem_attention(q, k, v)``: the whole method on ``[B, H, S, D]`` tensors
  (dense where sparsity cannot help); ``preset="default" | "balanced" |
  "tight"`` picks the budget (``PRESETS``);
* ``stem_attn_func`` / ``stem_attn_varlen_func``: the same in FlashAttention's
  calling conventions (``[B, S, H, D]``; packed sequences);
* ``stem_indexer.integrations.transformers.register()``: ``attn_implementation="stem"``
  for Hugging Face models;
* ``stem_paged_plan`` / ``stem_paged_run``: the entry point of a serving
  engine's attention backend (packed queries, a paged KV cache and its
  ``IndexCache``, a block table per row; plan once per step).

The pieces, for those who build their own pipeline: ``stem_inputs`` (Q/K/V ->
block representations and value bias), ``stem_indexer`` and
``stem_indexer_metadata`` (the selection), ``block_sparse_attention`` and
``block_mask`` (attention on a selection, FlexAttention's ``BlockMask``),
``dense_attention`` (the same conventions, dense), ``stem_indexer_reference``
(the scalar golden). ``status()`` says which implementation runs each op on
each device and dtype, and which of them are slower fallbacks.

Importing the package registers ``torch.ops.custom.npu_stem_indexer`` and
``torch.ops.custom.npu_stem_indexer_metadata`` (CPU, CUDA and fake kernels),
the Ascend extension's ops with the same schemas and results, and sets every
op of the ``custom`` namespace as an attribute of the package, as the Ascend
extension does on ``torch_npu``.
"""

from __future__ import annotations

import torch as _torch

from .operator.api import stem_indexer, stem_indexer_metadata
from .surfaces.attention import StemInfo, block_sparse_attention, dense_attention, stem_attention
from .operator.contract import PRESETS, IndexerParams, StemIndexerInputError
from .pipeline.dispatch import status
from .surfaces.flash import stem_attn_func, stem_attn_varlen_func
from .pipeline.index_cache import IndexCache
from .operator.ops.flex_attention import block_mask
from .pipeline.paged import PagedPlan, stem_paged_plan, stem_paged_run
from .pipeline.plan import StemPlan, stem_plan, stem_run
from .pipeline.prepare import StemInputs, stem_inputs
from .operator.reference import stem_indexer_reference

__version__ = "0.1.0"

__all__ = [
    "stem_attention",
    "stem_attn_func",
    "stem_attn_varlen_func",
    "stem_plan",
    "stem_run",
    "StemPlan",
    "stem_paged_plan",
    "stem_paged_run",
    "PagedPlan",
    "IndexCache",
    "StemInfo",
    "PRESETS",
    "stem_inputs",
    "StemInputs",
    "stem_indexer",
    "stem_indexer_metadata",
    "block_sparse_attention",
    "block_mask",
    "dense_attention",
    "stem_indexer_reference",
    "IndexerParams",
    "StemIndexerInputError",
    "status",
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
