"""Block-sparse causal attention over a paged KV cache (``ops/triton/paged_attention.py``).

The kernel runs on CPU tensors under the Triton interpreter (``@interpreted``:
one child pytest with ``TRITON_INTERPRET=1``, ``tests/_interpreter.py``).
Each case is a small batch of rows (context 0, a context inside a block, a
single query token, a partial last block) whose pages lie in a scrambled
order in the cache, unused table slots holding -1 or ids far past the cache,
and the tail of each row's last page, every unused page and every unused
cache slot NaN: a key the kernel should not read would show. Outputs are
compared with a float64 reference computed here from the semantics alone,
itself checked against ``gather_attention`` on contiguous tensors.

Tolerances: float32 outputs within 1e-5 of float64. bfloat16 and float16
outputs within 2e-2: the output is rounded to 8 (11) significant bits, a
relative error up to 2^-9 (2^-12) of values of order 1, and the probabilities
are rounded to the input dtype for the second product, as on the GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import pytest
import torch

pytest.importorskip("triton")

from stem_indexer.operator.contract import StemIndexerInputError  # noqa: E402
from stem_indexer.operator.ops.gather_attention import gather_attention  # noqa: E402
from stem_indexer.operator.ops.triton import launch  # noqa: E402
from stem_indexer.operator.ops.triton.paged_attention import (  # noqa: E402
    PagedConfig, default_paged_config, paged_kernel_supports, paged_launch,
    paged_sparse_attention)

from _interpreter import interpreted  # noqa: E402

NAN = float("nan")


# --------------------------------------------------------------------------- #
# Cases
# --------------------------------------------------------------------------- #


@dataclass
class Case:
    """A batch of rows and everything the kernel takes."""

    query: torch.Tensor        # [T, Hq, D]
    key_cache: torch.Tensor    # [num_pages, page, Hkv, D] (maybe a transposed view)
    value_cache: torch.Tensor
    block_table: torch.Tensor  # [B, W] int32
    indices: torch.Tensor      # [B, Hq, Qmax, Kw] int32
    lengths: torch.Tensor      # [B, Hq, Qmax] int32
    rows: torch.Tensor         # [B, 4] int32
    bs: int
    scale: float
    softcap: float | None

    def to(self, device) -> "Case":
        moved = {f: getattr(self, f).to(device) for f in
                 ("query", "key_cache", "value_cache", "block_table", "indices", "lengths",
                  "rows")}
        return replace(self, **moved)

    def run(self, **kw) -> torch.Tensor:
        return paged_sparse_attention(
            self.query, self.key_cache, self.value_cache, self.block_table, self.indices,
            self.lengths, self.rows, block_size=self.bs, scale=self.scale,
            softcap=self.softcap, **kw)


# (context, seq_len) per row, for block size 16: a partial last block from
# context 0, a context inside a block, one query token, aligned full blocks.
ROWS_16 = ((0, 37), (21, 50), (40, 41), (32, 64))


def _cache(gen, num_pages, page, hkv, d, dtype, layout):
    """A NaN-filled cache in the layout (HND is viewed as NHD)."""
    if layout == "HND":
        return torch.full((num_pages, hkv, page, d), NAN, dtype=dtype).transpose(1, 2)
    return torch.full((num_pages, page, hkv, d), NAN, dtype=dtype)


def _lists(gen, rows, hq, bs, empty_rate):
    """Per (row, head, query block): the diagonal block and a random subset
    of earlier blocks, ascending; some lists empty. Query blocks past a row's
    end get a garbage list (never to be read)."""
    qmax = max(-(-s // bs) - c // bs for c, s in rows)
    lists = {}
    for b, (c, s) in enumerate(rows):
        fb, nqb = c // bs, -(-s // bs) - c // bs
        for h in range(hq):
            for i in range(qmax):
                if i >= nqb:
                    lists[b, h, i] = [0, 1, 2][:1 + i % 3]
                elif float(torch.rand((), generator=gen)) < empty_rate:
                    lists[b, h, i] = []
                else:
                    earlier = (torch.rand(fb + i, generator=gen) < 0.5).nonzero().flatten()
                    lists[b, h, i] = earlier.tolist() + [fb + i]
    kw = max(1, max(len(v) for v in lists.values()))
    indices = torch.full((len(rows), hq, qmax, kw), -1, dtype=torch.int32)
    lengths = torch.zeros((len(rows), hq, qmax), dtype=torch.int32)
    for (b, h, i), blocks in lists.items():
        indices[b, h, i, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        lengths[b, h, i] = len(blocks)
    return indices, lengths


def make_case(seed, rows=ROWS_16, *, bs=16, page=8, hq=4, hkv=2, d=16, dtype=torch.float32,
              layout="NHD", softcap=None, unused=-1, empty_rate=0.15, pad_tokens=0) -> Case:
    """Random case: pages scrambled, unused table slots ``unused``, NaN where
    nothing may be read. ``pad_tokens`` query tokens after the rows' tokens."""
    gen = torch.Generator().manual_seed(seed)
    npages = [-(-s // page) for _, s in rows]
    num_pages = sum(npages) + 3  # three pages no row owns
    perm = torch.randperm(num_pages, generator=gen)
    table = torch.full((len(rows), max(npages) + 2), unused, dtype=torch.int32)
    k_cache = _cache(gen, num_pages, page, hkv, d, dtype, layout)
    v_cache = _cache(gen, num_pages, page, hkv, d, dtype, layout)
    used = 0
    for b, (_, s) in enumerate(rows):
        table[b, :npages[b]] = perm[used:used + npages[b]].to(torch.int32)
        used += npages[b]
        for p in range(s):
            at = (int(table[b, p // page]), p % page)
            k_cache[at] = torch.randn(hkv, d, generator=gen).to(dtype)
            v_cache[at] = torch.randn(hkv, d, generator=gen).to(dtype)
    tokens = sum(s - c for c, s in rows)
    query = torch.randn(tokens + pad_tokens, hq, d, generator=gen).to(dtype)
    starts = [sum(s - c for c, s in rows[:b]) for b in range(len(rows))]
    row_info = torch.tensor([[q0, c, s, c // bs] for q0, (c, s) in zip(starts, rows)],
                            dtype=torch.int32)
    indices, lengths = _lists(gen, rows, hq, bs, empty_rate)
    return Case(query, k_cache, v_cache, table, indices, lengths, row_info, bs,
                scale=1.0 / math.sqrt(d), softcap=softcap)


# --------------------------------------------------------------------------- #
# References
# --------------------------------------------------------------------------- #


def _row_kv(case: Case, b: int):
    """Row b's keys and values [seq_len, Hkv, D] in float64, read through the table."""
    seq_len = int(case.rows[b, 2])
    page = case.key_cache.shape[1]
    pos = torch.arange(seq_len)
    pages = case.block_table[b, pos // page].long()
    return (case.key_cache[pages, pos % page].double(),
            case.value_cache[pages, pos % page].double())


def reference(case: Case) -> list[torch.Tensor]:
    """Per row, [seq_len - context, Hq, D] float64, from the semantics alone."""
    outs = []
    hq, hkv = case.query.shape[1], case.key_cache.shape[2]
    bs = case.bs
    for b in range(case.rows.shape[0]):
        q0, context, seq_len, fb = case.rows[b].tolist()
        k, v = _row_kv(case, b)
        q = case.query[q0:q0 + seq_len - context].double()
        qpos = torch.arange(context, seq_len)
        kpos = torch.arange(seq_len)
        out = torch.zeros_like(q)
        for h in range(hq):
            n = h // (hq // hkv)
            qi = qpos // bs - fb
            listed = torch.zeros(len(qpos), seq_len, dtype=torch.bool)
            for t, i in enumerate(qi.tolist()):
                blocks = case.indices[b, h, i, :int(case.lengths[b, h, i])].long()
                listed[t] = torch.isin(kpos // bs, blocks)
            visible = listed & (kpos[None, :] <= qpos[:, None])
            s = q[:, h] @ k[:, n].T * case.scale
            if case.softcap is not None:
                s = case.softcap * torch.tanh(s / case.softcap)
            s = s.masked_fill(~visible, -math.inf)
            p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # rows that see nothing: 0
            out[:, h] = p @ v[:, n]
        outs.append(out)
    return outs


def gather_reference(case: Case) -> list[torch.Tensor]:
    """Per row, ``gather_attention`` on contiguous float64 tensors: queries
    from the row's first block start (zeros before the context), so that its
    right-down causal alignment is the absolute one."""
    outs = []
    bs = case.bs
    for b in range(case.rows.shape[0]):
        q0, context, seq_len, fb = case.rows[b].tolist()
        k, v = _row_kv(case, b)
        lead = context - fb * bs
        q = torch.zeros(seq_len - fb * bs, *case.query.shape[1:], dtype=torch.float64)
        q[lead:] = case.query[q0:q0 + seq_len - context].double()
        nqb = -(-q.shape[0] // bs)
        out, _ = gather_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            case.indices[b:b + 1, :, :nqb], case.lengths[b:b + 1, :, :nqb],
            torch.tensor([q.shape[0]]), torch.tensor([seq_len]), bs, True, case.scale,
            case.softcap)
        outs.append(out[0].transpose(0, 1)[lead:])
    return outs


def tolerance(dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 2e-2


def assert_matches(case: Case, out: torch.Tensor, what: str) -> None:
    """``out``'s row tokens equal the float64 reference, which equals gather_attention's."""
    expected = reference(case)
    for b, (ref, gat) in enumerate(zip(expected, gather_reference(case))):
        torch.testing.assert_close(gat, ref, atol=1e-12, rtol=1e-12,
                                   msg=lambda m: f"gather_attention, row {b}: {m}")
        q0, context, seq_len, _ = case.rows[b].tolist()
        got = out[q0:q0 + seq_len - context]
        tol = tolerance(case.query.dtype)
        torch.testing.assert_close(got.double(), ref, atol=tol, rtol=tol,
                                   msg=lambda m: f"{what}, row {b}: {m}")


def test_reference_agrees_with_gather_attention_and_sees_keys():
    case = make_case(1, softcap=5.0)
    ref = reference(case)
    for a, b in zip(ref, gather_reference(case)):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)
    assert all(bool(torch.isfinite(r).all()) for r in ref)
    assert any(bool((r != 0).any()) for r in ref)


# --------------------------------------------------------------------------- #
# The kernel against the reference
# --------------------------------------------------------------------------- #

# Adds, for 32-token blocks, a row whose context is a multiple of the block.
ROWS = ROWS_16 + ((70, 101),)
BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
# (label, make_case keywords): block 16 and 32; pages smaller than, equal to
# and larger than a block; head dims 16 and 24 (padded to 32); both layouts;
# soft cap on and off; GQA 2 and MQA.
MATRIX = [
    ("bs16-page8-d16-f32-NHD", dict(bs=16, page=8, d=16, dtype=F32, layout="NHD")),
    ("bs16-page32-d24-f32-HND-softcap",
     dict(bs=16, page=32, d=24, dtype=F32, layout="HND", softcap=5.0)),
    ("bs16-page16-d16-bf16-NHD-mqa", dict(bs=16, page=16, d=16, dtype=BF16, hkv=1)),
    ("bs32-page16-d16-bf16-HND", dict(bs=32, page=16, d=16, dtype=BF16, layout="HND")),
    ("bs32-page8-d24-bf16-NHD-softcap",
     dict(bs=32, page=8, d=24, dtype=BF16, layout="NHD", softcap=3.0)),
    ("bs32-page32-d24-f16-HND-softcap",
     dict(bs=32, page=32, d=24, dtype=F16, layout="HND", softcap=20.0)),
]


def _default_run(cases: list, keep: tuple[str, ...]) -> list:
    """``cases`` as parameters: those named in ``keep`` in the default run,
    the others with ``--run-slow`` (each an interpreted kernel run)."""
    out = []
    for case in cases:
        values = case.values if hasattr(case, "values") else case
        out.append(pytest.param(*values, id=values[0],
                                marks=() if values[0] in keep else pytest.mark.slow))
    return out


@interpreted
@pytest.mark.parametrize("label,kw", _default_run(MATRIX, (
    "bs16-page8-d16-f32-NHD", "bs16-page32-d24-f32-HND-softcap")))  # float32: tight bounds
def test_matches_the_reference(label, kw):
    case = make_case(len(label), ROWS, **kw)
    assert_matches(case, case.run(), label)


# On a GPU: two of the matrix's cases (float32; bfloat16, HND, soft cap) and
# two of realistic sizes; each is a compile of its own, so a few.
CUDA_CASES = [MATRIX[1], MATRIX[4],
              ("bs128-page16-d128-bf16-NHD", dict(bs=128, page=16, d=128, dtype=BF16, hq=8,
                                                  hkv=2)),
              ("bs64-page16-d64-f16-HND-softcap",
               dict(bs=64, page=16, d=64, dtype=F16, layout="HND", softcap=30.0))]


@pytest.mark.skipif(not torch.cuda.is_available() or launch.INTERPRETED,
                    reason="needs a CUDA device (the compiled kernel)")
@pytest.mark.parametrize("label,kw", CUDA_CASES, ids=[c[0] for c in CUDA_CASES])
def test_cuda_kernel_matches_the_reference(label, kw):
    """The compiled kernel, with the GPU's default configuration, on a CUDA
    device, against the same reference."""
    rows = ((0, 300), (130, 400), (399, 400), (256, 512)) if kw["bs"] >= 64 else ROWS
    case = make_case(len(label), rows, **kw)
    assert_matches(case, case.to("cuda").run().cpu(), label)


# (label, block size, config): the GPU configurations themselves; tiles
# larger than the block (masked at its end); a block size that is no power
# of two (its last tile half masked) and one smaller than any GPU tile.
CONFIGS = [
    ("gpu-sm90-bs32", 32, default_paged_config(32, 24, BF16, 90)),
    ("gpu-sm80-bs16-f32", 16, default_paged_config(16, 24, F32, 80)),
    pytest.param("gpu-sm90-bs64", 64, default_paged_config(64, 24, BF16, 90),
                 marks=pytest.mark.slow),
    ("tiles32-bs16", 16, PagedConfig(block_m=32, block_n=32, num_warps=4, num_stages=1)),
    ("tiles16-bs24", 24, PagedConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)),
    ("tiles16-bs8", 8, PagedConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)),
]


@interpreted  # all slow: the default run has test_matches_the_reference's default tiles
@pytest.mark.parametrize("label,bs,config", _default_run(CONFIGS, keep=()))
def test_configurations_and_block_sizes(label, bs, config):
    dtype = F32 if "f32" in label else BF16
    case = make_case(len(label), ROWS, bs=bs, page=16, d=24, dtype=dtype, layout="HND",
                     softcap=4.0 if bs == 24 else None)
    assert paged_kernel_supports(bs, 24) is None
    assert_matches(case, case.run(config=config), label)


@interpreted
def test_poisoned_output_is_overwritten_and_padding_left_alone():
    # Strided query (a [Hq, T, D] tensor viewed as [T, Hq, D]); three padding
    # tokens after the rows' tokens belong to no row; a row with no query.
    rows = ROWS_16 + ((48, 48),)
    case = make_case(7, rows, bs=16, page=8, d=24, dtype=BF16, pad_tokens=3)
    case.query = case.query.transpose(0, 1).contiguous().transpose(0, 1)
    assert case.query.stride(0) != case.query.shape[1] * case.query.shape[2]
    out = torch.full(case.query.shape, NAN, dtype=BF16)
    assert case.run(out=out) is out
    tokens = case.query.shape[0] - 3
    assert bool(torch.isfinite(out[:tokens]).all())
    assert bool(out[tokens:].isnan().all())
    assert_matches(case, out, "poisoned")


@interpreted
@pytest.mark.slow
def test_table_and_list_garbage_is_never_used():
    # Unused table slots: -1, ids far past the cache, the int32 extremes;
    # list entries past each length: garbage blocks; query blocks past a row's
    # end: garbage lists (make_case). All give the same output.
    base = make_case(3, ROWS, bs=16, page=8, d=16, dtype=F32, unused=-1)
    outs = []
    for unused in (-1, 10**6, 2**31 - 1, -(2**31)):
        case = replace(base, block_table=torch.where(base.block_table == -1, unused,
                                                     base.block_table))
        if unused != -1:
            pad = torch.arange(case.indices.shape[-1]) >= case.lengths[..., None]
            case.indices = torch.where(pad, torch.full_like(case.indices, unused // 7),
                                       case.indices)
        outs.append(case.run())
    assert_matches(base, outs[0], "garbage")
    for other in outs[1:]:
        assert torch.equal(outs[0], other)


@interpreted
def test_empty_lists_give_zeros():
    case = make_case(5, ROWS_16, bs=16, page=16, dtype=BF16, softcap=2.0, empty_rate=1.0)
    assert int(case.lengths.sum()) > 0  # only query blocks past a row's end list blocks
    out = case.run(out=torch.full(case.query.shape, NAN, dtype=BF16))
    assert bool((out == 0).all())


@interpreted
def test_blocks_in_the_causal_future_add_nothing():
    # Lists [diag + 1, diag + 2] where both exist (every key tile of them is
    # masked for every query: no NaN, output 0), else [earlier..., diag].
    case = make_case(9, ROWS, bs=16, page=8, d=16, dtype=F32, softcap=6.0, empty_rate=0.0)
    future = torch.zeros_like(case.lengths, dtype=torch.bool)
    for b in range(case.rows.shape[0]):
        _, _, seq_len, fb = case.rows[b].tolist()
        for i in range(-(-seq_len // 16) - fb - 2):
            future[b, ::2, i] = True
            case.indices[b, ::2, i, :2] = torch.tensor([fb + i + 1, fb + i + 2])
            case.indices[b, ::2, i, 2:] = -1
            case.lengths[b, ::2, i] = 2
    assert int(future.sum()) > 0
    out = case.run()
    assert_matches(case, out, "future blocks")
    for b in range(case.rows.shape[0]):
        q0, context, _, fb = case.rows[b].tolist()
        for t in range(int(case.rows[b, 2]) - context):
            i = (context + t) // 16 - fb
            heads = future[b, :, i]
            assert bool((out[q0 + t, heads] == 0).all())
            assert bool((out[q0 + t, ~heads] != 0).any())


# --------------------------------------------------------------------------- #
# The launcher (no kernel run)
# --------------------------------------------------------------------------- #


def _bad(field, value):
    return lambda c: replace(c, **{field: value})


BAD_ARGUMENTS = [
    ("query-dims", _bad("query", torch.zeros(4, 16)), "query"),
    ("query-dtype", _bad("query", torch.zeros(4, 4, 16, dtype=torch.float64)), "query"),
    ("key-dtype", lambda c: replace(c, key_cache=c.key_cache.to(BF16)), "key_cache"),
    ("key-head-dim", lambda c: replace(c, key_cache=c.key_cache[..., :8]), "key_cache"),
    ("kv-heads", lambda c: replace(c, key_cache=torch.zeros(20, 8, 3, 16),
                                   value_cache=torch.zeros(20, 8, 3, 16)), "key_cache"),
    ("value-shape", lambda c: replace(c, value_cache=c.value_cache[:, :4]), "value_cache"),
    ("table-dtype", lambda c: replace(c, block_table=c.block_table.long()), "block_table"),
    ("table-rows", lambda c: replace(c, block_table=c.block_table[:2]), "block_table"),
    ("indices-heads", lambda c: replace(c, indices=c.indices[:, :2]), "indices"),
    ("lengths-shape", lambda c: replace(c, lengths=c.lengths[..., :1]), "lengths"),
    ("rows-width", lambda c: replace(c, rows=c.rows[:, :3]), "rows"),
    ("rows-dtype", lambda c: replace(c, rows=c.rows.long()), "rows"),
    ("block-size", _bad("bs", 0), "block_size"),
    ("scale", _bad("scale", math.inf), "scale"),
    ("softcap", _bad("softcap", -1.0), "softcap"),
    ("device", lambda c: replace(c, lengths=c.lengths.to("meta")), "lengths"),
]


@pytest.mark.parametrize("label,mutate,argument", BAD_ARGUMENTS,
                         ids=[b[0] for b in BAD_ARGUMENTS])
def test_bad_arguments_name_the_argument(label, mutate, argument):
    case = mutate(make_case(0, ROWS_16))
    with pytest.raises(StemIndexerInputError, match=rf"paged_sparse_attention: {argument} "):
        case.run()


@pytest.mark.parametrize("kw,argument", [
    (dict(out=torch.zeros(3, 4, 16)), "out"),
    (dict(config=PagedConfig(block_m=24, block_n=16, num_warps=4, num_stages=1)),
     "config.block_m"),
    (dict(config=PagedConfig(block_m=16, block_n=16, num_warps=0, num_stages=1)),
     "config.num_warps"),
], ids=["out-shape", "block-m", "warps"])
def test_bad_out_and_config_name_the_argument(kw, argument):
    with pytest.raises(StemIndexerInputError, match=rf"paged_sparse_attention: {argument} "):
        make_case(0, ROWS_16).run(**kw)


@pytest.mark.skipif(launch.INTERPRETED, reason="the kernels are interpreted here")
def test_cpu_tensors_need_the_interpreter():
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        make_case(0, ROWS_16).run()


def test_default_configs_and_supports():
    for arch in (80, 90):
        for bs in (1, 8, 16, 24, 64, 128, 256):
            for d in (16, 64, 96, 128, 256):
                for dtype in (BF16, F16, F32):
                    cfg = default_paged_config(bs, d, dtype, arch)
                    assert cfg.block_m >= 16 and cfg.block_n >= 16
                    assert cfg.block_m <= max(16, bs) and cfg.block_n <= max(16, bs)
                    assert bs % cfg.block_n == 0 or cfg.block_n == 16
                    assert paged_kernel_supports(bs, d) is None
    assert default_paged_config(128, 128, BF16, 90) == PagedConfig(64, 64, 8, 3)
    assert default_paged_config(128, 128, F32, 90) == PagedConfig(32, 16, 8, 2)
    assert default_paged_config(16, 16, F32, None) == PagedConfig(16, 16, 4, 1)
    assert "head dim" in paged_kernel_supports(128, 512)
    assert "block_size" in paged_kernel_supports(0, 128)


def test_launch_from_meta_tensors():
    # What an ahead-of-time compile builds: shapes and strides only.
    meta = dict(device="meta", dtype=BF16)
    q = torch.empty(300, 8, 128, **meta)
    kv = torch.empty(50, 4, 16, 128, **meta).transpose(1, 2)  # HND
    i32 = dict(device="meta", dtype=torch.int32)
    idx = torch.empty(3, 8, 5, 7, **i32)
    cfg = default_paged_config(128, 128, BF16, 90)
    run = paged_launch(q, kv, kv, torch.empty(3, 40, **i32), idx, torch.empty(3, 8, 5, **i32),
                       torch.empty(3, 4, **i32), torch.empty_like(q), block_size=128,
                       scale=0.1, softcap=None, config=cfg)
    assert run.grid == (3 * 5 * 2 * 8,)
    assert run.constexprs["PAGE"] == 16 and run.constexprs["BLOCK_D"] == 128
    assert run.options == dict(num_warps=8, num_stages=3)


# --------------------------------------------------------------------------- #
# Compiled for a GPU target, without a GPU
# --------------------------------------------------------------------------- #

# (arch, head dim, dtype, soft cap): the main case on sm_90 by default.
AOT = [pytest.param(90, 128, BF16, None, id="sm_90-d128-bf16"),
       pytest.param(80, 128, BF16, 30.0, id="sm_80-d128-bf16-softcap", marks=pytest.mark.slow),
       pytest.param(90, 256, F16, None, id="sm_90-d256-f16", marks=pytest.mark.slow),
       pytest.param(80, 64, F32, 30.0, id="sm_80-d64-f32-softcap", marks=pytest.mark.slow)]


@pytest.mark.skipif(launch.INTERPRETED, reason="TRITON_INTERPRET=1: the kernel is interpreted")
@pytest.mark.parametrize("arch,d,dtype,softcap", AOT)
def test_default_config_compiles_without_spills(arch, d, dtype, softcap):
    # 128-token blocks, 16-token pages, the launcher's GPU configuration, on
    # meta tensors; registers and spills from the cubin (as ``aot.py`` reads them).
    from stem_indexer.operator.ops.triton import aot

    meta = dict(device="meta", dtype=dtype)
    i32 = dict(device="meta", dtype=torch.int32)
    q = torch.empty(4096, 32, d, **meta)
    kv = torch.empty(5000, 16, 8, d, **meta)
    cfg = default_paged_config(128, d, dtype, arch)
    run = paged_launch(q, kv, kv, torch.empty(16, 512, **i32),
                       torch.empty(16, 32, 64, 40, **i32), torch.empty(16, 32, 64, **i32),
                       torch.empty(16, 4, **i32), torch.empty_like(q), block_size=128,
                       scale=d ** -0.5, softcap=softcap, config=cfg)
    figures = aot.compile_entry(dict(aot._compile_inputs(run, arch), arch=arch))
    assert figures["spill_stores"] == figures["spill_loads"] == figures["stack_bytes"] == 0, \
        figures
    assert figures["mma"] > 0 or dtype == F32, figures
