"""The indexer cache's device writer (``ops/triton/index_write.py``).

Against the CPU writer (``IndexCache.write``'s torch path) on the same
writes, bit for bit: chunks ending anywhere in a page, padding tokens with
no slot, pages reused from offset 0 over an earlier sequence's sums, decode
steps of many sequences, and writes the CPU path refuses (a gap, a repeated
slot, a page appearing twice in one write, a write that does not continue
where its page stopped, offsets out of order, a page's run broken by a
slotless token), which must leave the same pages unusable. The
kernel runs under the Triton interpreter here (``tests/_interpreter.py``) and
compiled on a GPU, where a decode step's write is also captured in a CUDA
graph and replayed on new keys.
"""

from __future__ import annotations

import pytest
import torch
from _interpreter import interpreted

from stem_indexer.pipeline.index_cache import IndexCache, token_tags

PAGE, TS, HKV, DIM, PAGES = 16, 4, 2, 12, 24


def _writes(seed: int = 0):
    """(key, value, slots, tags) of successive writes (one engine step each)."""
    gen = torch.Generator().manual_seed(seed)

    def kv(n):
        return (torch.randn(n, HKV, DIM, generator=gen).to(torch.bfloat16),
                torch.randn(n, HKV, DIM, generator=gen).to(torch.bfloat16))

    def step(parts):
        slots = torch.cat([torch.as_tensor(p, dtype=torch.int64) for p in parts])
        k, v = kv(slots.shape[0])
        tags = token_tags(torch.randint(0, 999, (slots.shape[0],), generator=gen))
        return k, v, slots, tags

    a = [3, 7, 11, 2]  # sequence a's pages
    b = [5, 9]
    seq_a = [p * PAGE + o for p in a for o in range(PAGE)]
    seq_b = [p * PAGE + o for p in b for o in range(PAGE)]
    return [
        step([seq_a[:21]]),  # a chunk ending inside a page
        step([seq_a[21:40], [-1, -1], seq_b[:9]]),  # continued, padding, another sequence
        step([seq_a[40:41], seq_b[9:10]]),  # a decode step of both
        step([[20 * PAGE + o for o in (0, 1, 2, 5)]]),  # a gap
        step([[21 * PAGE + o for o in (0, 1, 1, 2)]]),  # a repeated slot
        step([[22 * PAGE, 22 * PAGE + 1], seq_b[10:12], [22 * PAGE + 2]]),  # a page twice
        step([[a[1] * PAGE + 3, a[1] * PAGE + 4]]),  # not where the page stopped
        step([[a[0] * PAGE + o for o in range(6)]]),  # page a[0] reused from offset 0
        step([seq_a[41:64]]),
        step([[23 * PAGE, 23 * PAGE + 2, 23 * PAGE + 1]]),  # offsets out of order
        step([[19 * PAGE, -1, 19 * PAGE + 1]]),  # a slotless token inside a page's run
    ]


def _cache(device="cpu") -> IndexCache:
    cache = IndexCache.allocate(PAGES, PAGE, TS, HKV, DIM, device=device)
    gen = torch.Generator().manual_seed(9)  # an earlier sequence's sums everywhere
    cache.ksum.copy_(torch.randn(cache.ksum.shape, generator=gen))
    cache.vmax.copy_(torch.rand(cache.vmax.shape, generator=gen))
    return cache


def _assert_same(got: IndexCache, want: IndexCache, label: str) -> None:
    filled = want.filled
    assert torch.equal(got.filled.cpu(), filled), label
    usable = filled > 0  # pages holding tokens: their entries must agree to the bit
    assert torch.equal(got.ksum.cpu()[usable], want.ksum[usable]), label
    assert torch.equal(got.vmax.cpu()[usable], want.vmax[usable]), label
    assert torch.equal(got.tag.cpu()[usable], want.tag[usable]), label


@interpreted
def test_the_device_writer_is_the_cpu_writer_bit_for_bit():
    from stem_indexer.pipeline import index_cache
    from stem_indexer.operator.ops.triton.index_write import index_write

    want, got = _cache(), _cache()
    index_cache._native_write, real = (lambda *a: False), index_cache._native_write
    try:
        for i, (k, v, slots, tags) in enumerate(_writes()):
            want.write(k, v, slots, tags=tags)
            norms = torch.linalg.vector_norm(v.float(), dim=-1)
            index_write(got.ksum, got.vmax, got.filled, got.tag, PAGE, k, norms, slots, tags)
            _assert_same(got, want, f"after write {i}")
    finally:
        index_cache._native_write = real
    # The refused writes left their pages unusable, the others usable.
    assert [int(want.filled[p]) for p in (20, 21, 22, 7, 23, 19)] == [-1] * 6
    assert int(want.filled[3]) == 6 and int(want.filled[2]) == 16


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_write_is_the_cpu_writer_and_a_graph_replays_a_decode_step():
    pytest.importorskip("triton")
    want, got = _cache(), _cache("cuda")
    writes = _writes()
    for k, v, slots, tags in writes[:-1]:
        want.write(k, v, slots, tags=tags)
        assert got.write(k.cuda(), v.cuda(), slots.cuda(), tags=tags.cuda()) is None
    torch.cuda.synchronize()
    _assert_same(got, want, "eager")
    # A decode step of both sequences, captured once and replayed on new keys.
    slots = torch.tensor([3 * PAGE + 10, 9 * PAGE + 12], device="cuda")  # continue a and b
    k_static = torch.zeros(2, HKV, DIM, dtype=torch.bfloat16, device="cuda")
    v_static, tags_static = torch.zeros_like(k_static), torch.zeros(2, dtype=torch.int64,
                                                                     device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    snapshot = [t.clone() for t in (got.ksum, got.vmax, got.filled, got.tag)]
    with torch.cuda.stream(side):
        got.write(k_static, v_static, slots, tags=tags_static)  # warm-up (compiles)
    torch.cuda.current_stream().wait_stream(side)
    for t, s in zip((got.ksum, got.vmax, got.filled, got.tag), snapshot):
        t.copy_(s)
    with torch.cuda.graph(graph):
        got.write(k_static, v_static, slots, tags=tags_static)
    gen = torch.Generator().manual_seed(11)
    k = torch.randn(2, HKV, DIM, generator=gen).to(torch.bfloat16)
    v = torch.randn(2, HKV, DIM, generator=gen).to(torch.bfloat16)
    tags = torch.tensor([17, 23])
    k_static.copy_(k)
    v_static.copy_(v)
    tags_static.copy_(tags)
    graph.replay()
    torch.cuda.synchronize()
    want.write(k, v, slots.cpu(), tags=tags)
    _assert_same(got, want, "graph replay")
