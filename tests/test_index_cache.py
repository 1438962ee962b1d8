"""The indexer cache (stem_indexer/pipeline/index_cache.py), without vLLM.

Tokens are written as vLLM's cache writer receives them (``key``, ``value``
[T, Hkv, D] and their slots, page id x page size + offset) onto shuffled
pages; what the cache gives the indexer is compared, bit for bit, with
``stem_inputs`` on the same tokens (docs/CONTRACT.md section 8): under
arbitrary chunk boundaries, prefix-cache hits (shared pages), pages freed
and reused by another sequence, and several sequences in one step.
"""

from __future__ import annotations

import random

import pytest
import torch

from stem_indexer import stem_inputs
from stem_indexer.pipeline.index_cache import IndexCache, index_cache_bytes


@pytest.fixture(autouse=True, params=["native", "torch"])
def writer(request, monkeypatch):
    """Every test with each writer: the native kernel (``operator/ops/csrc/index_cache.c``,
    where a C compiler is at hand) and the torch operations it replaces, each
    held to the same independent truth (``stem_inputs``)."""
    from stem_indexer.pipeline import index_cache
    from stem_indexer.operator.ops import native

    if request.param == "torch":
        monkeypatch.setattr(index_cache, "_native_write", lambda *args: False)
        yield request.param
        return
    if native.load(native.INDEX_CACHE) is None:
        pytest.skip(f"the native writer is not built here: {native.status(native.INDEX_CACHE)}")
    ran, real = [], index_cache._native_write

    def counted(*args):
        ran.append(real(*args))
        return ran[-1]

    monkeypatch.setattr(index_cache, "_native_write", counted)
    yield request.param
    assert all(ran), "a CPU write fell back to torch operations"


def _tokens(seq: int, hkv: int, dim: int, dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(seq, hkv, dim, generator=gen).to(dtype),
            torch.randn(seq, hkv, dim, generator=gen).to(dtype))


def _slots(pages: torch.Tensor, page: int, start: int, stop: int) -> torch.Tensor:
    t = torch.arange(start, stop)
    return pages[t // page].long() * page + t % page


def _want(k, v, length: int, bs: int, ts: int, oam_lambda: float = 0.3):
    """``stem_inputs``'s kflat [Hkv, Kb, Ts*D] and vbias [Hkv, Kb] of the first tokens."""
    keys = k[:length].transpose(0, 1)[None]
    vals = v[:length].transpose(0, 1)[None]
    q = torch.zeros(1, k.shape[1], 1, k.shape[2], dtype=k.dtype)
    inp = stem_inputs(q, keys, vals, stem_block_size=bs, stem_stride=ts, oam_lambda=oam_lambda)
    return inp.kflat[0], inp.vbias[0]


def _assert_inputs(cache: IndexCache, pages, k, v, length: int, bs: int, label: str = ""):
    kflat, vbias = cache.inputs(pages, length, bs, True, 0.3)
    want_k, want_v = _want(k, v, length, bs, cache.stride)
    assert torch.equal(kflat, want_k), f"{label}: kflat differs at {length} tokens"
    assert torch.equal(vbias, want_v), f"{label}: vbias differs at {length} tokens"
    assert cache.complete(pages[:-(-length // cache.page)], cache.expected_fill(length)), label


def _garbage(cache: IndexCache, seed: int) -> None:
    """Pages as an earlier sequence left them."""
    gen = torch.Generator().manual_seed(seed)
    cache.ksum.copy_(torch.randn(cache.ksum.shape, generator=gen))
    cache.vmax.copy_(torch.rand(cache.vmax.shape, generator=gen) * 9)
    cache.filled.fill_(17)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("page, bs, ts", [(32, 32, 8), (32, 64, 8), (128, 128, 16), (16, 64, 16)],
                         ids=["block=page", "block=2pages", "vllm-default", "block=4pages"])
def test_any_chunk_boundaries_give_stem_inputs_bit_for_bit(dtype, page, bs, ts):
    hkv, dim, seq = 2, 16, 700
    k, v = _tokens(seq, hkv, dim, dtype, page + bs)
    pages = torch.randperm(64, generator=torch.Generator().manual_seed(3))[:-(-seq // page)]
    cache = IndexCache.allocate(64, page, ts, hkv, dim)
    _garbage(cache, 1)
    rng = random.Random(page * bs)
    at = 0
    while at < seq:  # chunks of 1 to 150 tokens, boundaries anywhere in a page
        n = min(seq - at, rng.choice([1, rng.randrange(2, 150)]))
        cache.write(k[at:at + n], v[at:at + n], _slots(pages, page, at, at + n))
        at += n
        _assert_inputs(cache, pages, k, v, at, bs, f"after a chunk ending at {at}")


def test_a_prefix_hit_reads_the_shared_pages_as_written():
    """Sequence B shares A's first three full pages (vLLM's prefix cache shares
    whole pages only) and writes its own from there."""
    page, bs, ts, hkv, dim = 32, 32, 8, 2, 16
    k, v = _tokens(200, hkv, dim, torch.bfloat16, 5)
    kb, vb = _tokens(150, hkv, dim, torch.bfloat16, 6)
    kb[:96], vb[:96] = k[:96], v[:96]  # the shared prefix: 3 pages
    cache = IndexCache.allocate(40, page, ts, hkv, dim)
    pages_a = torch.tensor([7, 3, 30, 12, 5, 21, 9])
    pages_b = torch.cat([pages_a[:3], torch.tensor([25, 1])])
    cache.write(k, v, _slots(pages_a, page, 0, 200))
    cache.write(kb[96:], vb[96:], _slots(pages_b, page, 96, 150))  # the hit's own chunk
    _assert_inputs(cache, pages_b, kb, vb, 150, bs, "prefix hit")
    _assert_inputs(cache, pages_a, k, v, 96, bs, "the owner's shared pages")


def test_a_reused_page_starts_afresh_and_a_rewrite_or_gap_is_refused():
    page, bs, ts, hkv, dim = 32, 64, 8, 1, 8
    k, v = _tokens(100, hkv, dim, torch.float32, 7)
    k2, v2 = _tokens(70, hkv, dim, torch.float32, 8)
    cache = IndexCache.allocate(10, page, ts, hkv, dim)
    pages = torch.tensor([4, 2, 9, 0])
    cache.write(k, v, _slots(pages, page, 0, 100))
    # Pages 2 and 4 freed; another sequence takes them, in another order.
    reused = torch.tensor([2, 4, 6])
    cache.write(k2[:40], v2[:40], _slots(reused, page, 0, 40))
    cache.write(k2[40:], v2[40:], _slots(reused, page, 40, 70))
    _assert_inputs(cache, reused, k2, v2, 70, bs, "reused pages")
    # A slot written twice (a rewritten token) and a gap both leave the page unusable.
    cache.write(k2[60:62], v2[60:62], _slots(reused, page, 60, 62))  # page 4, offsets 28, 29
    assert not cache.complete(reused, cache.expected_fill(70))
    assert int(cache.filled[4]) == -1
    cache.write(k2[:5], v2[:5], _slots(torch.tensor([8]), page, 3, 8))  # starts at offset 3
    assert int(cache.filled[8]) == -1
    # Starting again at offset 0 makes a page usable again.
    cache.write(k2[:5], v2[:5], _slots(torch.tensor([8]), page, 0, 5))
    assert int(cache.filled[8]) == 5
    _assert_inputs(cache, torch.tensor([8]), k2, v2, 5, bs, "restarted page")


def test_one_step_of_several_sequences_and_padding_slots():
    """A step holds tokens of several sequences (each in position order) and
    may carry padding tokens with slot -1: those are skipped."""
    page, bs, ts, hkv, dim = 32, 32, 8, 3, 16
    ka, va = _tokens(90, hkv, dim, torch.bfloat16, 9)
    kb, vb = _tokens(45, hkv, dim, torch.bfloat16, 10)
    pa, pb = torch.tensor([11, 2, 7]), torch.tensor([5, 13])
    cache = IndexCache.allocate(16, page, ts, hkv, dim)
    _garbage(cache, 2)
    cache.write(ka[:50], va[:50], _slots(pa, page, 0, 50))
    keys = torch.cat([kb[:45], ka[50:], ka[:4]])
    vals = torch.cat([vb[:45], va[50:], va[:4]])
    slots = torch.cat([_slots(pb, page, 0, 45), _slots(pa, page, 50, 90),
                       torch.full((4,), -1)])
    cache.write(keys, vals, slots)
    _assert_inputs(cache, pa, ka, va, 90, bs, "sequence a")
    _assert_inputs(cache, pb, kb, vb, 45, bs, "sequence b")


def test_memory_is_an_eighth_of_a_bf16_kv_cache_at_vllms_defaults():
    pages, page, ts, hkv, dim = 100, 128, 16, 8, 128
    cache = IndexCache.allocate(pages, page, ts, hkv, dim)
    assert cache.nbytes == index_cache_bytes(pages, page, ts, hkv, dim)
    kv_bytes = pages * hkv * page * 2 * dim * 2  # K and V in bfloat16
    assert abs(cache.nbytes / kv_bytes - 1 / 8) < 0.002


def test_the_page_must_hold_whole_stride_groups():
    with pytest.raises(ValueError, match="page size \\(24\\) must be a multiple of stem_stride"):
        IndexCache.allocate(4, 24, 16, 1, 8)


def test_one_write_plan_serves_every_layer_of_a_step_and_no_other():
    """Layers write the same slots into caches in the same state: the plan of
    the first is reused by the others (and gives what its own plan gives);
    a cache in another state, or other slots, get a plan of their own."""
    page, bs, ts, hkv, dim = 32, 32, 8, 2, 16
    k, v = _tokens(100, hkv, dim, torch.bfloat16, 11)
    pages = torch.tensor([3, 8, 1, 6])
    layers = [IndexCache.allocate(10, page, ts, hkv, dim) for _ in range(3)]
    plan = None
    for at, stop in ((0, 45), (45, 100)):
        slots = _slots(pages, page, at, stop)
        first = plan = layers[0].write(k[at:stop], v[at:stop], slots, plan)
        for cache in layers[1:]:
            assert cache.write(k[at:stop], v[at:stop], slots, first) is first
    for cache in layers:
        _assert_inputs(cache, pages, k, v, 100, bs, "a layer on the shared plan")
    other = IndexCache.allocate(10, page, ts, hkv, dim)
    other.filled[6] = -1  # a page another layer's write left unusable
    assert other.write(k[:20], v[:20], _slots(torch.tensor([6]), page, 3, 23), plan) is not plan
    assert int(other.filled[6]) == -1
    slots = _slots(pages, page, 0, 10)
    assert not plan.fits(layers[0], slots)


@pytest.mark.parametrize("offsets", [[0, 1, 2, 5], [0, 1, 1, 2], [0, 1, 1, 3], [4, 5, 5, 7]],
                         ids=["gap", "duplicate", "duplicate-and-gap", "continued-with-a-gap"])
def test_a_write_with_a_gap_or_a_repeated_slot_leaves_its_page_unusable(offsets):
    """Offsets within one write are counted: a gap (0, 1, 2, 5) or a slot
    written twice (0, 1, 1, 2; or both, 0, 1, 1, 3, which spans as many offsets
    as it has tokens) never passes for the tokens the page should hold; the
    other pages of the write are unaffected."""
    page, ts, hkv, dim = 8, 4, 1, 4
    k, v = _tokens(12, hkv, dim, torch.float32, 12)
    cache = IndexCache.allocate(6, page, ts, hkv, dim)
    if offsets[0]:  # the page already holds offsets 0 .. 3
        cache.write(k[:4], v[:4], torch.arange(4) + 3 * page)
    slots = torch.cat([torch.tensor(offsets) + 3 * page, torch.arange(5) + 1 * page])
    cache.write(k[:slots.shape[0]], v[:slots.shape[0]], slots)
    assert int(cache.filled[3]) == -1
    assert int(cache.filled[1]) == 5  # the well-formed page of the same write
    assert not cache.complete(torch.tensor([3]), torch.tensor([max(offsets) + 1],
                                                              dtype=torch.int32))


def test_a_page_is_complete_only_for_the_tokens_that_wrote_it():
    """Tags say which prefix wrote a page: a page holding the right count of
    another sequence's tokens (a page some other writer filled, as a KV
    connector would) is not complete for this one; the same tokens are, on a
    page another request wrote (a prefix hit)."""
    from stem_indexer.pipeline.index_cache import token_tags

    page, ts, hkv, dim = 8, 4, 1, 4
    ids_a = torch.tensor([5, 9, 2, 7, 1, 1, 4, 3, 8, 6, 2, 0])
    ids_b = ids_a.clone()
    ids_b[2] = 11  # differs at position 2 only
    k, v = _tokens(12, hkv, dim, torch.float32, 13)
    cache = IndexCache.allocate(4, page, ts, hkv, dim)
    pages = torch.tensor([2, 0])
    tags_a, tags_b = token_tags(ids_a), token_tags(ids_b)
    assert not torch.equal(tags_a[2:], tags_b[2:]) and torch.equal(tags_a[:2], tags_b[:2])
    cache.write(k, v, _slots(pages, page, 0, 12), tags=tags_a)
    fill = cache.expected_fill(12)
    last = torch.tensor([7, 11])  # each page's last token
    assert cache.complete(pages, fill, tags_a[last])
    assert not cache.complete(pages, fill, tags_b[last])
    assert cache.usable(pages, fill, tags_b[last]).tolist() == [False, False]
    # Tags continue across chunks: a chunk's tags from its own start position.
    assert torch.equal(token_tags(ids_a[5:], 5, int(tags_a[4])), tags_a[5:])
    # Without tags only the counts are checked.
    assert cache.complete(pages, fill)


def test_a_failed_write_invalidates_only_its_own_pages():
    page, ts, hkv, dim = 8, 4, 1, 4
    k, v = _tokens(24, hkv, dim, torch.float32, 14)
    cache = IndexCache.allocate(5, page, ts, hkv, dim)
    cache.write(k, v, torch.arange(24))  # pages 0, 1, 2
    cache.invalidate(torch.tensor([-1, 9, 10]))
    assert cache.filled.tolist() == [8, -1, 8, 0, 0]


def test_row_tags_are_each_rows_token_tags():
    """Several rows at once (a step's decodes and chunks) give what each row's
    own ``token_tags`` gives: rows of 0, 1 and several tokens, from position
    0 or continuing a sequence."""
    from stem_indexer.pipeline.index_cache import row_tags, token_tags

    gen = torch.Generator().manual_seed(15)
    seqs = [torch.randint(0, 50000, (n,), generator=gen) for n in (9, 30, 4, 17)]
    spans = [(0, 9), (12, 13), (0, 0), (5, 17)]  # (first position, end) of each row
    ids = torch.cat([s[a:b] for s, (a, b) in zip(seqs, spans)])
    positions = torch.cat([torch.arange(a, b) for a, b in spans])
    lengths = torch.tensor([b - a for a, b in spans])
    carries = torch.tensor([int(token_tags(s[:a])[-1]) if a else 0 for s, (a, _) in
                            zip(seqs, spans)])
    want = torch.cat([token_tags(s)[a:b] for s, (a, b) in zip(seqs, spans)])
    assert torch.equal(row_tags(ids, positions, lengths, carries), want)


# --------------------------------------------------------------------------- #
# Several layers' writes of a step at once (WriteStage)
# --------------------------------------------------------------------------- #


def _stage(layers: int, capacity: int, hkv: int, dim: int, dtype):
    from stem_indexer.pipeline.index_cache import WriteStage, _native_lib

    if _native_lib() is None:
        pytest.skip("the staged write is native only, and the native writer is not built here")
    return WriteStage(layers, capacity, hkv, dim, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["fp32", "bf16", "fp16"])
def test_staged_decode_steps_give_stem_inputs_bit_for_bit(dtype):
    """Three layers, three sequences: each prompt written at once, then decode
    steps (one token per sequence, a padding token with slot -1, keys and
    values as strided views of a fused projection) staged and flushed: every
    layer's entries are ``stem_inputs``'s on its own tokens, bit for bit,
    across pages that fill and new pages that start."""
    page, bs, ts, hkv, dim, layers = 16, 32, 4, 2, 8, 3
    lens, steps = [20, 7, 31], 30
    total = [n + steps for n in lens]
    tables = [torch.tensor(t) for t in ([9, 2, 14, 5], [0, 11, 7], [3, 12, 6, 1, 13])]
    toks = [[_tokens(n, hkv, dim, dtype, 100 * layer + s) for s, n in enumerate(total)]
            for layer in range(layers)]
    caches = [IndexCache.allocate(16, page, ts, hkv, dim) for _ in range(layers)]
    for layer, cache in enumerate(caches):
        _garbage(cache, layer)
        for s, n in enumerate(lens):
            k, v = toks[layer][s]
            cache.write(k[:n], v[:n], _slots(tables[s], page, 0, n))
    stage = _stage(layers, 8, hkv, dim, dtype)
    for step in range(steps):
        owner = object()
        slots = torch.cat([_slots(tables[s], page, n + step, n + step + 1)
                           for s, n in enumerate(lens)] + [torch.tensor([-1])])
        for layer, cache in enumerate(caches):
            fused = torch.zeros(4, 3, hkv, dim, dtype=dtype)  # [tokens, q|k|v, Hkv, D]
            for s, n in enumerate(lens):
                k, v = toks[layer][s]
                fused[s, 1], fused[s, 2] = k[n + step], v[n + step]
            key, value = fused[:, 1], fused[:, 2]
            assert stage.takes(cache, key, value)
            stage.put(owner, cache, key, value, slots)
        assert int(caches[0].filled[tables[0][1]]) != -2  # nothing written before the flush
        assert stage.flush() == [] and not stage.pending
    for layer, cache in enumerate(caches):
        for s, n in enumerate(total):
            k, v = toks[layer][s]
            _assert_inputs(cache, tables[s], k, v, n, bs, f"layer {layer}, sequence {s}")


def test_a_staged_layer_in_another_state_is_written_on_its_own():
    """The stage plans the step once, from its first layer's cache; a layer
    whose pages are in another state (a page a failed write left unusable)
    is written on its own: its unusable page stays unusable, its other
    pages are written, and the other layers are as the plan says."""
    page, ts, hkv, dim = 8, 4, 1, 4
    k, v = _tokens(12, hkv, dim, torch.float32, 16)
    caches = [IndexCache.allocate(4, page, ts, hkv, dim) for _ in range(3)]
    for cache in caches:
        cache.write(k[:6], v[:6], torch.arange(6) + page)  # page 1, offsets 0 .. 5
    caches[1].filled[1] = -1
    stage = _stage(3, 4, hkv, dim, torch.float32)
    slots = torch.tensor([page + 6, 2 * page])  # page 1 goes on, page 2 starts
    for cache in caches:
        stage.put("step", cache, k[6:8], v[6:8], slots)
    assert stage.flush() == []
    assert [c.filled[1:3].tolist() for c in caches] == [[7, 1], [-1, 1], [7, 1]]
    assert torch.equal(caches[0].ksum, caches[2].ksum)
    assert torch.equal(caches[1].ksum[2], caches[0].ksum[2])


def test_the_stage_takes_only_what_it_can_hold_and_one_step_at_a_time():
    page, ts, hkv, dim = 8, 4, 2, 4
    cache = IndexCache.allocate(4, page, ts, hkv, dim)
    stage = _stage(2, 4, hkv, dim, torch.bfloat16)
    k = torch.zeros(3, hkv, dim, dtype=torch.bfloat16)
    assert stage.takes(cache, k, k)
    assert not stage.takes(cache, k.float(), k.float())  # another dtype
    assert not stage.takes(cache, torch.zeros(5, hkv, dim, dtype=torch.bfloat16),
                           torch.zeros(5, hkv, dim, dtype=torch.bfloat16))  # over capacity
    assert not stage.takes(IndexCache.allocate(4, page, ts, hkv, 8), k, k)  # another head size
    assert not stage.takes(cache, k.transpose(1, 2), k.transpose(1, 2))  # strided head dim
    slots = torch.tensor([0, 1, 2])
    stage.put("a", cache, k, k, slots)
    with pytest.raises(RuntimeError, match="another step's writes are staged"):
        stage.put("b", cache, k, k, slots)
    with pytest.raises(ValueError, match="slots \\(2\\) must be the step's \\(3\\)"):
        stage.put("a", cache, k, k, slots[:2])
    other = IndexCache.allocate(6, page, ts, hkv, dim)
    assert not stage.takes(other, k, k)  # a cache of another shape than the step's first
    stage.put("a", cache, k, k, slots)
    assert not stage.takes(cache, k, k)  # every layer's place is taken
    # The same cache twice: its second write finds the page as the first left
    # it, not as planned, and is planned on its own (offset 0: afresh).
    assert stage.flush() == [] and int(cache.filled[0]) == 3 and not stage.pending
