"""``stem_indexer.status()``: the path each op takes on each device and dtype,
and every slower fallback reported once, with its reason.

The native kernels' own fallbacks (no compiler, disabled, a refused cache
directory) are tested in tests/test_native.py and tests/test_reliability.py.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import stem_indexer
from stem_indexer import stem_indexer_reference
from stem_indexer.pipeline import dispatch
from stem_indexer.operator.ops import library, native

from _helpers import qkv


@pytest.fixture
def fresh_reports(monkeypatch):
    """No fallback reported yet in this process (restored after)."""
    monkeypatch.setattr(native, "_warned", set())


def _fallback_warnings(call) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    return [str(c.message) for c in caught if issubclass(c.category, RuntimeWarning)]


def test_status_lists_every_op_device_and_dtype():
    rows = dispatch.paths()
    assert {(p.op, p.device) for p in rows} == {(op, d) for op in ("indexer", "attention",
                                                                 "paged")
                                                for d in ("cpu", "cuda")}
    attention = {(p.device, p.dtype) for p in rows if p.op == "attention"}
    assert attention == {(d, t) for d in ("cpu", "cuda")
                         for t in ("float32", "bfloat16", "float16", "float64")}
    report = stem_indexer.status()
    for p in rows:
        assert f"{p.op:9} {p.device:4} {p.dtype:8} {p.runs}" in report
    assert report.count("[fallback: ") == sum(p.fallback is not None for p in rows)


@pytest.mark.skipif(dispatch._native() is None, reason="no native attention kernel here")
def test_cpu_float16_attention_is_a_reported_fallback(fresh_reports):
    """float16 on CPU runs the gather backend: status() says so, and the
    first such call warns once; float32 and float64 say nothing."""
    (row,) = [p for p in dispatch.paths() if (p.op, p.device, p.dtype) ==
              ("attention", "cpu", "float16")]
    assert "gather" in row.runs and "float32 and bfloat16, not float16" in row.fallback
    q, k, v = qkv(1, 2, 1, 64, 64, 8, 3)
    idx = torch.arange(4, dtype=torch.int32).expand(1, 2, 4, 4).contiguous()
    lengths = torch.arange(1, 5, dtype=torch.int32).expand(1, 2, 4).contiguous()

    def call(dtype):
        return lambda: stem_indexer.block_sparse_attention(
            q.to(dtype), k.to(dtype), v.to(dtype), idx, lengths, stem_block_size=16)

    assert _fallback_warnings(call(torch.float32)) == []
    assert _fallback_warnings(call(torch.float64)) == []
    (message,) = _fallback_warnings(call(torch.float16))
    assert "cpu float16 runs torch operations on gathered blocks" in message
    assert "stem_indexer.status()" in message
    assert _fallback_warnings(call(torch.float16)) == []  # once per process


def test_indexer_without_triton_is_a_reported_fallback(fresh_reports, monkeypatch):
    """The CUDA kernel of the indexer op without Triton runs ops/cpu.py's
    torch operations: status() says so, the first call warns once, and the
    results are the reference's. (CPU tensors stand in for CUDA ones: the
    kernel is called directly.)"""
    monkeypatch.setattr(library, "_triton_available", lambda: False)
    runs, why = library.indexer_path("cuda")
    assert "torch operations" in runs and "Triton is not installed" in why
    (row,) = [p for p in dispatch.paths() if (p.op, p.device) == ("indexer", "cuda")]
    assert row.fallback == why
    gen = torch.Generator().manual_seed(4)
    inputs = dict(qflat=torch.randint(-3, 4, (1, 2, 8, 8), generator=gen).bfloat16(),
                  kflat=torch.randint(-3, 4, (1, 1, 8, 8), generator=gen).bfloat16(),
                  vbias=torch.zeros(1, 1, 8), q_seq_lens=torch.tensor([128], dtype=torch.int32),
                  kv_seq_lens=torch.tensor([128], dtype=torch.int32))
    params = dict(stem_block_size=16, stem_stride=4)
    metadata = stem_indexer.stem_indexer_metadata(
        inputs["q_seq_lens"], inputs["kv_seq_lens"], 2, 1, stem_block_size=16, dim_qkflat=8)
    for call in range(2):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = library._indexer_cuda_kernel(**inputs, metadata=metadata, **params)
        messages = [str(c.message) for c in caught if issubclass(c.category, RuntimeWarning)]
        assert len(messages) == (1 if call == 0 else 0), messages
        if call == 0:
            assert "on CUDA the indexer runs torch operations" in messages[0]
    want = stem_indexer_reference(**inputs, **params)
    assert torch.equal(out[0], want[0]) and torch.equal(out[1], want[1])
