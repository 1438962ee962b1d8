"""Metadata (docs/CONTRACT.md section 6) and the fast path's memory/visibility claims.

* size formula M = AlignUp(16 + B*kv_heads*(36+72)*16, 4096), hand-computed;
* the header and lengths record what the metadata was built for;
* the work plan: tiles cover exactly the rows that see at least one key
  block, each once, within the per-tile work rules of ``metadata.py``;
* determinism; CUDA (skipped without CUDA);
* ``ops/cpu.py``'s claim that temporaries stay proportional to a tile,
  whatever the sequence length (``torch.bmm`` instrumented);
* blocks past a row's visible range never influence its output (poisoning).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

import stem_indexer
from stem_indexer.operator import metadata as md
from stem_indexer.operator.ops import cpu, native

from stem_indexer.operator.reference import reference_budget

from _helpers import Inputs, assert_out_equal, i32, metadata_for, random_inputs, run_op, run_ref

METADATA = torch.ops.custom.npu_stem_indexer_metadata


# --------------------------------------------------------------------------- #
# Size
# --------------------------------------------------------------------------- #

# raw = 16 + B * Nk * 1728 (1728 = (36 + 72) * 16), rounded up to 4096.
SIZES = [
    (1, 1, 4096),       # 1744 -> 4096
    (2, 1, 4096),       # 3472 -> 4096
    (1, 2, 4096),       # 3472 -> 4096
    (3, 1, 8192),       # 5200 -> 8192
    (2, 2, 8192),       # 6928 -> 8192
    (4, 8, 57344),      # 55312 -> 14 * 4096
    (19, 4, 135168),    # 131344 -> 33 * 4096
    (64, 8, 888832),    # 884752 -> 217 * 4096
]


@pytest.mark.parametrize("batch, nk, size", SIZES,
                         ids=[f"B{b}-Nk{n}-M{m}" for b, n, m in SIZES])
def test_metadata_size_formula(batch, nk, size):
    assert md.metadata_size(batch, nk) == size
    lens = torch.zeros(batch, dtype=torch.int32)
    real = METADATA(lens, lens, 2 * nk, nk)
    assert real.shape == (size,) and real.dtype == torch.int32
    with FakeTensorMode():
        fake = METADATA(torch.empty(batch, dtype=torch.int32),
                        torch.empty(batch, dtype=torch.int32), 2 * nk, nk)
        assert fake.shape == (size,) and fake.dtype == torch.int32


def test_metadata_size_does_not_depend_on_lengths_or_q_heads():
    a = METADATA(i32([0, 0]), i32([0, 0]), 2, 2)
    b = METADATA(i32([5000, 1]), i32([10**6, 3]), 16, 2, stem_block_size=1)
    assert a.numel() == b.numel() == 8192


# --------------------------------------------------------------------------- #
# Header and plan
# --------------------------------------------------------------------------- #


def _tiles(meta: torch.Tensor, batch: int) -> list[list[int]]:
    header = md.Header.from_tensor(meta)
    start = md.HEADER_SIZE + 2 * batch
    return meta[start:start + md.TILE_FIELDS * header.num_tiles].view(-1, 4).tolist()


def test_header_records_what_it_was_built_for():
    q, kv = i32([300, 0, 129]), i32([1000, 7, 129])
    meta = METADATA(q, kv, 12, 3, causal=False, stem_block_size=64, dim_qkflat=96,
                    window_size=7)
    h = md.Header.from_tensor(meta)
    assert (h.batch, h.q_heads, h.kv_heads, h.causal, h.stem_block_size, h.dim_qkflat,
            h.window_size) == (3, 12, 3, 0, 64, 96, 7)
    assert meta[md.HEADER_SIZE:md.HEADER_SIZE + 3].tolist() == [300, 0, 129]
    assert meta[md.HEADER_SIZE + 3:md.HEADER_SIZE + 6].tolist() == [1000, 7, 129]
    used = md.HEADER_SIZE + 6 + md.TILE_FIELDS * h.num_tiles
    assert h.num_tiles > 0 and (meta[used:] == 0).all()


def _check_plan(q_lens, kv_lens, q_heads, kv_heads, causal, bs, df=8, budget_rules=True):
    """The plan's tiles: each visible row exactly once, 0 <= i0 < i1 <= Qb, and
    (with ``budget_rules``) each tile within the budget rules documented in
    metadata.py (rows <= TILE_ROWS_MAX; scores of all query heads against the
    key blocks the last row sees <= TILE_ELEMENTS; float32 query rows <=
    OPERAND_BYTES; a single-row tile is always allowed)."""
    meta = METADATA(i32(q_lens), i32(kv_lens), q_heads, kv_heads, causal=causal,
                    stem_block_size=bs, dim_qkflat=df, window_size=2)
    chunk = cpu.key_chunk(kv_heads, df)
    assert 1 <= chunk <= cpu.KEY_CHUNK_MAX
    assert chunk == 1 or 4 * kv_heads * df * chunk <= md.OPERAND_BYTES
    seen = set()
    for b, i0, i1, kend in _tiles(meta, len(q_lens)):
        qb, kb = -(-q_lens[b] // bs), -(-kv_lens[b] // bs)
        assert 0 <= i0 < i1 <= qb, (b, i0, i1, qb)
        # key blocks visible to the tile's last row (docs/CONTRACT.md section 3)
        s2_last = min(max(kb - qb + i1, 0), kb) if causal else kb
        assert kend == s2_last
        rows = i1 - i0
        if budget_rules:
            assert rows <= md.TILE_ROWS_MAX
            assert rows == 1 or rows * q_heads * kend <= md.TILE_ELEMENTS
            assert rows == 1 or 4 * rows * q_heads * df <= md.OPERAND_BYTES
        for i in range(i0, i1):
            assert (b, i) not in seen, f"row {(b, i)} in two tiles"
            seen.add((b, i))
    want = set()
    for b, (q, kv) in enumerate(zip(q_lens, kv_lens)):
        qb, kb = -(-q // bs), -(-kv // bs)
        for i in range(qb):
            s2 = min(max(kb - qb + i + 1, 0), kb) if causal else kb
            if s2 > 0:
                want.add((b, i))
    assert seen == want
    return meta


@st.composite
def plan_configs(draw):
    batch = draw(st.integers(1, 6))
    bs = draw(st.sampled_from([1, 4, 16, 128]))
    nk = draw(st.integers(1, 3))
    group = draw(st.sampled_from([1, 2, 3, 8, 64]))
    max_blocks = draw(st.sampled_from([3, 70, 300, 40000]))
    blocks = st.one_of(st.just(0), st.integers(0, max_blocks))
    q = [draw(blocks) * bs - draw(st.integers(0, bs - 1)) for _ in range(batch)]
    kv = [draw(blocks) * bs - draw(st.integers(0, bs - 1)) for _ in range(batch)]
    return ([max(x, 0) for x in q], [max(x, 0) for x in kv], nk * group, nk,
            draw(st.booleans()), bs, draw(st.sampled_from([1, 8, 2048, 65536])))


@settings(max_examples=300, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(cfg=plan_configs())
def test_plan_covers_each_visible_row_once_within_tile_budget(cfg):
    q_lens, kv_lens, q_heads, kv_heads, causal, bs, df = cfg
    # The budget rules are promised while the plan fits the metadata even at
    # one row per tile: total query blocks <= tile slots of M (docs/CONTRACT.md section 6
    # size formula, metadata.py layout). Beyond that see the tests below.
    batch = len(q_lens)
    slots = (md.metadata_size(batch, kv_heads) - md.HEADER_SIZE - 2 * batch) // md.TILE_FIELDS
    fits = sum(-(-q // bs) for q in q_lens) <= slots
    _check_plan(*cfg, budget_rules=fits)


@pytest.mark.parametrize("q_lens, kv_lens, nq, nk, causal, bs, df", [
    pytest.param([2048 * 128], [2048 * 128], 8, 1, True, 128, 8, id="causal-256K-G8"),
    pytest.param([64 * 128], [2048 * 128], 64, 8, True, 128, 2048, id="article-shape-Df2048"),
    pytest.param([500], [70000], 64, 1, False, 1, 65536, id="huge-Df-operand-bound"),
    pytest.param([40 * 16], [1 << 20], 1, 1, True, 16, 1, id="kv-1M-tokens-Bs16"),
    pytest.param([300, 0, 5, 129], [10, 900, 0, 129], 4, 2, True, 4, 8, id="q-longer-than-kv"),
    pytest.param([300, 0, 5, 129], [10, 900, 0, 129], 4, 2, False, 4, 8, id="noncausal"),
    pytest.param([0], [0], 1, 1, True, 1, 8, id="all-empty"),
])
def test_plan_examples(q_lens, kv_lens, nq, nk, causal, bs, df):
    _check_plan(q_lens, kv_lens, nq, nk, causal, bs, df)


def test_causal_q_longer_than_kv_skips_blind_rows():
    # q 10 blocks, kv 4 blocks, causal: s2 = clamp(i - 5, 0, 4) -> rows 0..5 see
    # nothing and get no tile; rows 6..9 are planned.
    meta = METADATA(i32([10]), i32([4]), 1, 1, stem_block_size=1, dim_qkflat=1)
    assert _tiles(meta, 1) == [[0, 6, 10, 4]]


@pytest.mark.parametrize("q_lens, kv_lens, nq, nk, causal, bs, df", [
    pytest.param([1100 * 128], [16384 * 128], 64, 1, False, 128, 128, id="G64-kv2M-q141K"),
    pytest.param([65, 4069], [1, 3277], 64, 1, False, 1, 1, id="G64-one-batch-over-by-one"),
    pytest.param([140000], [140000], 1, 1, False, 1, 1, id="G1-140K-query-blocks"),
])
def test_plan_beyond_metadata_capacity_still_partitions_the_rows(q_lens, kv_lens, nq, nk,
                                                                 causal, bs, df):
    """More budget-sized tiles than the NPU-sized metadata holds ((M - 16 - 2B) / 4):
    the plan coarsens its tiles (the backend then runs them in budget-sized
    steps, next test), and they still cover each visible row exactly once."""
    batch = len(q_lens)
    slots = (md.metadata_size(batch, nk) - md.HEADER_SIZE - 2 * batch) // md.TILE_FIELDS
    assert sum(-(-q // bs) for q in q_lens) > slots  # really beyond capacity
    _check_plan(q_lens, kv_lens, nq, nk, causal, bs, df, budget_rules=False)


def test_coarsened_tiles_run_in_budget_sized_steps(bmm_shapes, monkeypatch):
    """With one query block per budgeted tile, 1100 visible rows (causal,
    q = kv = 1100 blocks) need 1100 tiles but B=1, Nk=1 metadata holds 1019:
    the plan doubles its tiles to 2 rows, and the backend must still score
    one row at a time. Output must equal the reference."""
    monkeypatch.setattr(md, "TILE_ROWS_MAX", 1)
    inp = _integer_case(2, 1, 1100, 1100, 1, seed=3, prompt=[1200])
    params = dict(stem_block_size=1, stem_stride=1, initial_blocks=1, window_size=1)
    meta = METADATA(inp.q_seq_lens, inp.kv_seq_lens, 2, 1, stem_block_size=1, dim_qkflat=1,
                    window_size=1)
    tiles = _tiles(meta, 1)
    assert max(i1 - i0 for _, i0, i1, _ in tiles) > 1  # the plan had to coarsen
    got = run_op(inp, **params)
    assert bmm_shapes and all(shape[1] == 2 for shape in bmm_shapes)  # G * 1 row
    assert_out_equal(got, run_ref(inp, **params), "coarsened plan vs reference")


def test_metadata_is_deterministic():
    q, kv = i32([513, 0, 77, 4096]), i32([9000, 12, 77, 4096])
    a = METADATA(q, kv, 16, 4, stem_block_size=16, dim_qkflat=32)
    b = METADATA(q.clone(), kv.clone(), 16, 4, stem_block_size=16, dim_qkflat=32)
    assert torch.equal(a, b)
    assert torch.equal(a, stem_indexer.stem_indexer_metadata(q, kv, 16, 4, stem_block_size=16,
                                                             dim_qkflat=32))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_metadata_op_on_cuda_matches_cpu():
    q, kv = i32([513, 0, 77]), i32([9000, 12, 77])
    cuda = METADATA(q.cuda(), kv.cuda(), 8, 2, stem_block_size=16)
    assert cuda.device.type == "cuda"
    assert torch.equal(cuda.cpu(), METADATA(q, kv, 8, 2, stem_block_size=16))


# --------------------------------------------------------------------------- #
# Memory: temporaries proportional to a tile, whatever the sequence length
# --------------------------------------------------------------------------- #


@pytest.fixture
def bmm_shapes(monkeypatch):
    """Record the shape of every torch.bmm result (the score tiles of ops/cpu.py,
    on its float32 GEMMs: bfloat16 products read the keys where they lie)."""
    monkeypatch.setattr(cpu.native, "bf16_scores_available", lambda df: False)
    shapes = []
    real = torch.bmm

    def spy(a, b, *args, **kwargs):
        out = real(a, b, *args, **kwargs)
        shapes.append(tuple(out.shape))
        return out

    monkeypatch.setattr(torch, "bmm", spy)
    return shapes


def _integer_case(nq, nk, q_tokens, kv_tokens, bs, seed=0, prompt=None):
    gen = torch.Generator().manual_seed(seed)
    qmax, kmax = -(-q_tokens // bs), -(-kv_tokens // bs)
    return random_inputs(gen, batch=1, nq=nq, nk=nk, qmax=qmax, kmax=kmax, df=1,
                         q_lens=[q_tokens], kv_lens=[kv_tokens], prompt=prompt, integer=True)


@pytest.mark.usefixtures("selection")
def test_long_kv_scores_in_key_chunks_and_matches_reference(bmm_shapes):
    """kv = 1M tokens at Bs = 16: 65536 key blocks (chunks of key_chunk), 4
    query blocks, Nq 4 / Nk 2. The budget is 256 (capped), chosen among 65000+
    candidates across chunks; integer data gives many ties across chunk
    boundaries. Must equal the reference exactly."""
    inp = _integer_case(4, 2, 64, 1 << 20, 16)
    params = dict(stem_block_size=16, stem_stride=16)
    got = run_op(inp, **params)
    assert bmm_shapes, "torch.bmm was not used: update this instrumentation"
    chunk = cpu.key_chunk(2, 1)
    assert chunk < 65536
    assert max(s[-1] for s in bmm_shapes) <= chunk
    assert max(math.prod(s) for s in bmm_shapes) <= max(md.TILE_ELEMENTS, 4 * chunk)
    assert len(bmm_shapes) >= 65536 // chunk  # chunked along the keys
    assert_out_equal(got, run_ref(inp, **params), "1M-token kv vs reference")
    assert int(got[1].min()) == 8 + 256  # sink 4 + window 4 + K 256


@pytest.fixture
def workspace_sizes(monkeypatch):
    """Record (name, elements) of every scratch buffer ops/cpu.py takes."""
    sizes = []
    real = cpu._Workspace.take

    def spy(self, name, shape, dtype):
        sizes.append((name, math.prod(shape)))
        return real(self, name, shape, dtype)

    monkeypatch.setattr(cpu._Workspace, "take", spy)
    return sizes


@pytest.mark.parametrize("q_tokens, kv_tokens, bs, nq", [
    pytest.param(300 * 16, 1 << 20, 16, 1, id="kv-1M-tokens-300-query-blocks"),
    pytest.param(6000 * 16, 6000 * 16, 16, 1, id="causal-96K-tokens-6000-blocks",
                 marks=pytest.mark.slow),
])
def test_score_temporaries_bounded_by_tile_budget(bmm_shapes, workspace_sizes, monkeypatch,
                                                   selection, q_tokens, kv_tokens, bs, nq):
    """The full score matrix (rows x key blocks, > TILE_ELEMENTS here) is never
    materialised: the score buffer holds at most TILE_ELEMENTS elements (all
    query heads), each matmul is at most GEMM_KEYS_MAX key blocks wide, and the
    float32 key copy is at most one key chunk (or the small per-batch cache)."""
    slices = []
    real_picks = cpu._survivor_picks

    def spy(flat, *args):
        slices.append(flat.shape)
        return real_picks(flat, *args)

    monkeypatch.setattr(cpu, "_survivor_picks", spy)
    cpu.release_workspace()
    inp = _integer_case(nq, 1, q_tokens, kv_tokens, bs, seed=1)
    qb, kb = inp.qflat.shape[2], inp.kflat.shape[2]
    assert qb * kb > md.TILE_ELEMENTS  # a monolithic score matrix would not fit
    idx, seq = run_op(inp, stem_block_size=bs, stem_stride=bs)
    assert bmm_shapes and workspace_sizes
    sizes = dict()
    for name, n in workspace_sizes:
        sizes[name] = max(n, sizes.get(name, 0))
    assert sizes["scores"] <= md.TILE_ELEMENTS
    if selection == "torch":  # the native kernel keeps no survivors
        assert slices
    assert all(rows == 1 or rows * width <= cpu.SURVIVOR_ELEMENTS for rows, width in slices)
    assert 4 * max(sizes.get("keys", 0), sizes.get("key_cache", 0)) <= cpu.KEY_CACHE_BYTES
    assert max(s[-1] for s in bmm_shapes) <= cpu.GEMM_KEYS_MAX
    # seq_len (docs/CONTRACT.md section 3): sink 4 + window 4 forced when s2 >= 8, all of
    # the row when s2 < 8; alpha = 1 so K = Ks (P = Kb): L = min(s2, 8 + K).
    k = reference_budget(kb, kb - 1)
    assert k == 256  # capped: floor(0.1 * Kb) + 30 > 256
    s2 = torch.clamp(torch.arange(qb) + kb - qb + 1, 0, kb)
    assert torch.equal(seq[0, 0], torch.minimum(s2, torch.tensor(8 + k)).to(torch.int32))


@pytest.mark.parametrize("selection", ["native", pytest.param("torch", marks=pytest.mark.slow)],
                         indirect=True)
def test_key_chunk_narrower_than_the_budget(selection, bmm_shapes):
    """Df = 40000 makes the float32 key chunk 209 blocks (OPERAND_BYTES), fewer
    than the budget 256 (P = 3000 blocks): the top-k is merged over chunks
    each smaller than K. 600 key blocks, 2 query blocks, integer data."""
    assert cpu.key_chunk(1, 40000) < 256
    gen = torch.Generator().manual_seed(5)
    inp = random_inputs(gen, batch=1, nq=2, nk=1, qmax=2, kmax=600, df=40000, q_lens=[2],
                        kv_lens=[600], prompt=[3000], integer=True)
    params = dict(stem_block_size=1, stem_stride=1)
    got = run_op(inp, **params)
    assert max(s[-1] for s in bmm_shapes) <= cpu.key_chunk(1, 40000)
    assert_out_equal(got, run_ref(inp, **params), "narrow key chunks vs reference")
    assert got[1].tolist() == [[[264, 264], [264, 264]]]  # 8 forced + K 256


# --------------------------------------------------------------------------- #
# Blocks a row cannot see never influence it
# --------------------------------------------------------------------------- #


def _clone(inp: Inputs) -> Inputs:
    return Inputs(*(t.clone() for t in inp.tensors()),
                  None if inp.num_prompt_tokens is None else inp.num_prompt_tokens.clone())


@pytest.mark.usefixtures("selection")
@pytest.mark.parametrize("precision", [1, 2])
def test_padding_and_empty_batches_are_never_read(precision):
    """b0: q 10 tokens (Qb 3 of Qmax 5), kv 37 tokens (Kb 10 of Kmax 12);
    b1: q 0; b2: kv 0. Everything outside the valid blocks is NaN / inf."""
    gen = torch.Generator().manual_seed(7)
    inp = random_inputs(gen, batch=3, nq=4, nk=2, qmax=5, kmax=12, df=8,
                        q_lens=[10, 0, 17], kv_lens=[37, 20, 0], prompt=[400, 20, 0])
    params = dict(stem_block_size=4, stem_stride=2, initial_blocks=1, window_size=2,
                  k_block_num_rate_medium=0.0, k_block_num_bias_medium=3,
                  topk_score_precision=precision)
    clean = run_op(inp, **params)
    bad = _clone(inp)
    bad.qflat[0, :, 3:] = math.nan
    bad.kflat[0, :, 10:] = math.nan
    bad.vbias[0, :, 10:] = math.inf
    for b in (1, 2):
        bad.qflat[b] = math.nan
        bad.kflat[b] = math.nan
        bad.vbias[b] = math.inf
    assert_out_equal(run_op(bad, **params), clean, "poisoned padding")
    assert_out_equal(run_ref(bad, **params), clean, "reference, poisoned padding")
    assert int(clean[1].sum()) > 0


@pytest.mark.usefixtures("selection")
@pytest.mark.parametrize("tiling", ["one-tile", "single-row-tiles"])
def test_future_key_blocks_never_influence_earlier_causal_rows(tiling, monkeypatch):
    """Causal, Qb = Kb = 20 (Bs 4), K = 2, sink 1, window 1. Key blocks
    j >= 12 are poisoned with score +inf (vbias) and huge kflat. A row with
    s2 <= 12 (i <= 11) cannot see them: its output must not change. Rows that
    see a poisoned block as a candidate (s2 >= 14) must pick it: the poison is
    live, so a leak would be caught."""
    gen = torch.Generator().manual_seed(11)
    inp = random_inputs(gen, batch=1, nq=2, nk=1, qmax=20, kmax=20, df=6,
                        q_lens=[80], kv_lens=[80], prompt=[56 * 4])
    params = dict(stem_block_size=4, stem_stride=2, initial_blocks=1, window_size=1,
                  k_block_num_rate_medium=0.0, k_block_num_bias_medium=2)
    clean_idx, clean_seq = run_op(inp, **params)
    if tiling == "single-row-tiles":
        # a plan of one row per tile (the main op rebuilds the plan to check
        # the metadata, so the patch must cover both calls)
        monkeypatch.setattr(md, "TILE_ROWS_MAX", 1)
    assert len(_tiles(metadata_for(inp, **params), 1)) == (1 if tiling == "one-tile" else 20)
    bad = _clone(inp)
    bad.kflat[0, :, 12:] = 1e4
    bad.vbias[0, :, 12:] = math.inf
    idx, seq = run_op(bad, **params)
    assert torch.equal(seq, clean_seq)
    assert torch.equal(idx[:, :, :12], clean_idx[:, :, :12])  # s2 = i + 1 <= 12
    for i in range(13, 20):  # s2 = i + 1 >= 14: candidates include block 12
        for h in range(2):
            row = idx[0, h, i, : seq[0, h, i]].tolist()
            assert {12, 13} & set(row), (i, row)
    ref = run_ref(bad, **params)
    assert_out_equal((idx, seq), ref, "poisoned future blocks vs reference")


@pytest.mark.usefixtures("selection")
def test_kept_workspace_carries_nothing_between_calls():
    """The CPU path keeps its scratch buffers for the next call: calls of
    other shapes in between (and NaN-poisoned buffers) change nothing."""
    gen = torch.Generator().manual_seed(11)
    a = random_inputs(gen, batch=2, nq=4, nk=2, qmax=40, kmax=300, df=8, q_lens=[40 * 16, 7],
                      kv_lens=[300 * 16, 290 * 16], integer=True)
    b = random_inputs(gen, batch=1, nq=8, nk=1, qmax=90, kmax=90, df=16, q_lens=[90 * 16],
                      kv_lens=[90 * 16], integer=True)
    params = dict(stem_block_size=16, stem_stride=16)
    cpu.release_workspace()
    first = run_op(a, **params)
    assert 0 < cpu.kept_bytes() <= cpu.WORKSPACE_KEEP_BYTES
    for ws in cpu._pool:  # poison what the next call reuses
        for buf in ws._buffers.values():
            buf.fill_(float("nan") if buf.is_floating_point()
                      else True if buf.dtype == torch.bool else -7)
    assert_out_equal(run_op(b, **params), run_ref(b, **params), "after another shape")
    assert_out_equal(run_op(a, **params), first, "again")
    assert_out_equal(first, run_ref(a, **params), "reference")
    cpu.release_workspace()
    assert cpu.kept_bytes() == 0


@pytest.mark.usefixtures("selection")
def test_large_output_memory_serves_the_next_call_once_released():
    """An indices output of 8 MiB or more (``native.filled``): released, its
    memory serves the next call of the same shape, whatever was written in
    it; held, the next call gets other memory and the held output keeps its
    values."""
    gen = torch.Generator().manual_seed(13)
    inp = random_inputs(gen, batch=1, nq=4, nk=1, qmax=1024, kmax=512, df=8, q_lens=[512 * 16],
                        kv_lens=[512 * 16], integer=True)
    params = dict(stem_block_size=16, stem_stride=16)
    expected = run_ref(inp, **params)
    assert expected[0].nbytes >= native.HUGE_PAGE_MIN_BYTES
    cpu.release_workspace()
    first = run_op(inp, **params)
    assert_out_equal(first, expected, "first call")
    address = first[0].data_ptr()
    first[0].fill_(99)
    del first
    second = run_op(inp, **params)
    assert second[0].data_ptr() == address
    assert_out_equal(second, expected, "in the released output's memory")
    third = run_op(inp, **params)
    assert third[0].data_ptr() != address
    assert_out_equal(third, expected, "beside the held output")
    assert_out_equal(second, expected, "the held output")
    cpu.release_workspace()
    assert native.kept_output_bytes() == 0


@pytest.mark.usefixtures("selection")
@pytest.mark.parametrize("first_mode", ["inference_mode", "no_grad"])
def test_kept_workspace_serves_calls_in_and_out_of_inference_mode(first_mode):
    """A workspace kept by a call under ``torch.inference_mode()`` serves a
    call outside it, and the other way round (inference tensors cannot be
    written outside inference mode)."""
    gen = torch.Generator().manual_seed(12)
    inp = random_inputs(gen, batch=1, nq=4, nk=2, qmax=24, kmax=96, df=8, q_lens=[24 * 16],
                        kv_lens=[96 * 16], integer=True)
    params = dict(stem_block_size=16, stem_stride=16)
    expected = run_ref(inp, **params)
    modes = [torch.inference_mode, torch.no_grad]
    if first_mode == "no_grad":
        modes.reverse()
    cpu.release_workspace()
    for mode in modes:
        with mode():
            assert_out_equal(run_op(inp, **params), expected, mode.__name__)
        assert cpu.kept_bytes() > 0
    cpu.release_workspace()
