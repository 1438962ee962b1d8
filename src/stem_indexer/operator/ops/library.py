"""torch.library registrations of the two ops in the ``custom`` namespace.

The schemas are the Ascend extension's, verbatim, so code written against
``torch.ops.custom.npu_stem_indexer`` runs unchanged. Each op has a CPU and a
CUDA kernel and a fake kernel
that derives shapes and dtypes only, for ``torch.compile`` and ``torch.export``.

CUDA tensors go to the Triton kernels (``ops/triton``) when Triton is
installed, else to the torch operations of ``ops/cpu.py`` (reported once,
``indexer_path``). The Triton path reads no
tensor data on the host, so the indexer op can be captured in a CUDA graph;
its value checks (lengths in range, prompt >= kv, metadata built for these
inputs) run on host copies outside a capture and are skipped during one. The
metadata op builds its plan on the host on every device (it is called once
per batch of requests, before the captured region) and copies it to the
lengths' device.
"""

from __future__ import annotations

import functools

import torch

from .. import contract, metadata as md
from ..contract import IndexerParams
from . import cpu, native

NAMESPACE = "custom"

INDEXER_SCHEMA = (
    "npu_stem_indexer(Tensor qflat, Tensor kflat, Tensor vbias, Tensor q_seq_lens, "
    "Tensor kv_seq_lens, *, Tensor? num_prompt_tokens=None, Tensor? metadata=None, "
    "bool causal=True, int stem_block_size=128, int stem_stride=16, float alpha=1.0, "
    "int initial_blocks=4, int window_size=4, float k_block_num_rate_medium=0.2, "
    "int k_block_num_bias_medium=30, float k_block_num_rate_large=0.1, "
    "int k_block_num_bias_large=30, int topk_score_precision=1) -> (Tensor, Tensor)"
)
METADATA_SCHEMA = (
    "npu_stem_indexer_metadata(Tensor q_seq_lens, Tensor kv_seq_lens, int q_heads, "
    "int kv_heads, *, bool causal=True, int stem_block_size=128, int dim_qkflat=2048, "
    "int window_size=4) -> Tensor"
)

_lib = torch.library.Library(NAMESPACE, "FRAGMENT")
_lib.define(INDEXER_SCHEMA)
_lib.define(METADATA_SCHEMA)


def _checked(qflat, kflat, vbias, q_seq_lens, kv_seq_lens, num_prompt_tokens, metadata,
             attrs) -> IndexerParams:
    """docs/CONTRACT.md section 4 checks on shapes, dtypes and attributes (static: fakes too)."""
    params = IndexerParams(**attrs)
    contract.check_indexer_inputs(qflat, kflat, vbias, q_seq_lens, kv_seq_lens,
                                  num_prompt_tokens, metadata, params)
    md.check_size(metadata, qflat.shape[0], kflat.shape[1])
    return params


def _host_values(qflat, kflat, q_seq_lens, kv_seq_lens, num_prompt_tokens, metadata,
                 params: IndexerParams):
    """docs/CONTRACT.md section 4 checks on the values (lengths in range, prompt >= kv,
    metadata built for these inputs), on host copies of the lengths.

    Returns ``(q_lens, kv_lens, prompt_lens, tiles)`` on the host.
    """
    q_lens, kv_lens = q_seq_lens.cpu(), kv_seq_lens.cpu()
    prompt = None if num_prompt_tokens is None else num_prompt_tokens.cpu()
    _, nq, qmax, df = qflat.shape
    nk, kmax = kflat.shape[1], kflat.shape[2]
    with native.omp_threads(1):  # a few values per batch: not worth a thread team
        contract.check_lengths(q_lens, kv_lens, prompt, qmax, kmax, params.stem_block_size)
        tiles = md.read_plan(metadata.cpu(), q_lens, kv_lens, nq, nk, params.causal,
                             params.stem_block_size, df, params.window_size)
    return q_lens, kv_lens, kv_lens if prompt is None else prompt, tiles


# The scalar attributes arrive as keyword arguments named as in the schema,
# which are exactly the fields of ``IndexerParams``.
def _indexer_kernel(qflat, kflat, vbias, q_seq_lens, kv_seq_lens, *, num_prompt_tokens=None,
                    metadata=None, **attrs):
    """CPU tensors, and CUDA tensors where Triton is missing: ``ops/cpu.py``."""
    inputs = (qflat, kflat, vbias, q_seq_lens, kv_seq_lens, num_prompt_tokens, metadata)
    params = _checked(*inputs, attrs)
    q_lens, kv_lens, prompt, tiles = _host_values(qflat, kflat, *inputs[3:], params)
    return cpu.stem_indexer_forward(qflat, kflat, vbias, q_lens, kv_lens, prompt, tiles, params)


@functools.cache
def _triton_available() -> bool:
    try:
        import triton  # noqa: F401  (imported lazily: CPU-only installs never need it)
    except ImportError:
        return False
    return True


def indexer_path(device_type: str) -> tuple[str, str | None]:
    """What runs the indexer op for tensors of ``device_type`` (``"cpu"`` or
    ``"cuda"``), and why that is a slower fallback (None: it is not)."""
    if device_type == "cuda":
        if _triton_available():
            return "Triton kernels (ops/triton/)", None
        return ("torch operations (ops/cpu.py)",
                "Triton is not installed: pip install 'stem-indexer[cuda]'")
    if native.kernel() is not None:
        return "ops/cpu.py: score GEMMs, native selection (csrc/select_rows.c)", None
    return "ops/cpu.py: score GEMMs, torch selection", native.status(native.SELECT_ROWS)


def _indexer_cuda_kernel(qflat, kflat, vbias, q_seq_lens, kv_seq_lens, *,
                         num_prompt_tokens=None, metadata=None, **attrs):
    """CUDA tensors: the Triton kernels, which read no tensor data on the host.

    The value checks need the lengths on the host, so they are skipped while
    a CUDA graph is being captured: a captured call trusts its inputs (and
    its kernels stay in bounds whatever they hold). Without Triton, the torch
    operations of ``ops/cpu.py`` (reported once).
    """
    if not _triton_available():
        native.report_once("indexer cuda", "on CUDA the indexer runs torch operations, not "
                           f"its Triton kernels ({indexer_path('cuda')[1]}): same results, "
                           "slower")
        return _indexer_kernel(qflat, kflat, vbias, q_seq_lens, kv_seq_lens,
                               num_prompt_tokens=num_prompt_tokens, metadata=metadata, **attrs)
    inputs = (qflat, kflat, vbias, q_seq_lens, kv_seq_lens, num_prompt_tokens, metadata)
    params = _checked(*inputs, attrs)
    if not torch.cuda.is_current_stream_capturing():
        _host_values(qflat, kflat, *inputs[3:], params)
    from .triton.launch import stem_indexer_triton

    return stem_indexer_triton(*inputs, params)


def _indexer_fake(qflat, kflat, vbias, q_seq_lens, kv_seq_lens, *, num_prompt_tokens=None,
                  metadata=None, **attrs):
    _checked(qflat, kflat, vbias, q_seq_lens, kv_seq_lens, num_prompt_tokens, metadata, attrs)
    batch, nq, qmax, _ = qflat.shape
    kmax = kflat.shape[2]
    indices = qflat.new_empty((batch, nq, qmax, kmax), dtype=torch.int32)
    seq_len = qflat.new_empty((batch, nq, qmax), dtype=torch.int32)
    return indices, seq_len


def _metadata_kernel(q_seq_lens, kv_seq_lens, q_heads, kv_heads, *, causal=True,
                     stem_block_size=128, dim_qkflat=2048, window_size=4):
    contract.check_metadata_inputs(q_seq_lens, kv_seq_lens, q_heads, kv_heads,
                                   stem_block_size, dim_qkflat, window_size)
    q_lens, kv_lens = q_seq_lens.cpu(), kv_seq_lens.cpu()
    with native.omp_threads(1):  # a few values per batch: not worth a thread team
        contract.check_nonnegative("q_seq_lens", q_lens)
        contract.check_nonnegative("kv_seq_lens", kv_lens)
        out = md.build_metadata(q_lens, kv_lens, q_heads, kv_heads, causal, stem_block_size,
                                dim_qkflat, window_size)
    return out.to(q_seq_lens.device)


def _metadata_fake(q_seq_lens, kv_seq_lens, q_heads, kv_heads, *, causal=True,
                   stem_block_size=128, dim_qkflat=2048, window_size=4):
    contract.check_metadata_inputs(q_seq_lens, kv_seq_lens, q_heads, kv_heads,
                                   stem_block_size, dim_qkflat, window_size)
    size = md.metadata_size(q_seq_lens.shape[0], kv_heads)
    return q_seq_lens.new_empty((size,), dtype=torch.int32)


_lib.impl("npu_stem_indexer", _indexer_kernel, "CPU")
_lib.impl("npu_stem_indexer", _indexer_cuda_kernel, "CUDA")
for _key in ("CPU", "CUDA"):
    _lib.impl("npu_stem_indexer_metadata", _metadata_kernel, _key)
torch.library.register_fake(f"{NAMESPACE}::npu_stem_indexer", _indexer_fake, lib=_lib)


# The same indexer for ``plan.stem_run``, in this package's namespace: its
# plan checked the lengths and built the metadata, so on CUDA it reads
# nothing on the host (no check repeated), captured or not. On CPU the
# kernel needs the lengths on the host anyway and checks them as the op does.
PLANNED_NAMESPACE = "stem_indexer"
_planned = torch.library.Library(PLANNED_NAMESPACE, "FRAGMENT")
_planned.define(INDEXER_SCHEMA.replace("npu_stem_indexer(", "planned_indexer("))


def _planned_cuda_kernel(qflat, kflat, vbias, q_seq_lens, kv_seq_lens, *,
                         num_prompt_tokens=None, metadata=None, **attrs):
    if not _triton_available():
        return _indexer_cuda_kernel(qflat, kflat, vbias, q_seq_lens, kv_seq_lens,
                                    num_prompt_tokens=num_prompt_tokens, metadata=metadata,
                                    **attrs)
    inputs = (qflat, kflat, vbias, q_seq_lens, kv_seq_lens, num_prompt_tokens, metadata)
    from .triton.launch import stem_indexer_triton

    return stem_indexer_triton(*inputs, _checked(*inputs, attrs))


_planned.impl("planned_indexer", _indexer_kernel, "CPU")
_planned.impl("planned_indexer", _planned_cuda_kernel, "CUDA")
torch.library.register_fake(f"{PLANNED_NAMESPACE}::planned_indexer", _indexer_fake,
                            lib=_planned)
torch.library.register_fake(f"{NAMESPACE}::npu_stem_indexer_metadata", _metadata_fake, lib=_lib)
