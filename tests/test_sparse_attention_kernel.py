"""The CPU block-sparse attention kernel (``ops/sparse_attention.py``,
``csrc/sparse_attention.c``) against a float64 dense reference restricted to
the listed blocks.

Accuracy: the kernel's largest error on the valid outputs must be within 4x
the error torch's dense SDPA makes on the same inputs and the same mask
(against the same float64 reference). Outputs that must be zero (padded query
positions, queries with no visible key) must be exactly zero, also when the
padding of q, k and v holds NaN and inf.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

from stem_indexer.operator.ops import sparse_attention as sa, torch_blas
from stem_indexer.testing import reference_attention, token_mask

pytestmark = pytest.mark.skipif(not sa.available(), reason=sa.status())

ISAS = ["avx512bf16", "avx512", "avx2", "scalar"]
BF16_MODES = ["brgemm", "widen"] if torch_blas.bf16_brgemm()[0] is not None else ["widen"]


def selection(gen, batch, hq, qmax, kmax, *, p=0.4, diagonal=True, empty=0.1):
    """Random ascending lists (-1 past each length): each key block kept with
    probability p; the diagonal block (i + kmax - qmax) kept or dropped as
    asked; a fraction ``empty`` of rows list nothing."""
    keep = torch.rand(batch, hq, qmax, kmax, generator=gen) < p
    diag = torch.arange(qmax)[:, None] + kmax - qmax == torch.arange(kmax)[None, :]
    keep = keep | diag if diagonal else keep & ~diag
    keep &= torch.rand(batch, hq, qmax, 1, generator=gen) >= empty
    lengths = keep.sum(-1)
    blocks = torch.where(keep, torch.arange(kmax), kmax).sort(-1).values
    return torch.where(blocks < kmax, blocks, -1), lengths


def clean(x, lens):
    """x with its padding (positions >= lens) zeroed."""
    pad = torch.arange(x.shape[2])[None, :] >= lens[:, None]
    return x.masked_fill(pad[:, None, :, None], 0)


def sdpa(q, k, v, vis, scale):
    group = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1),
                                          v.repeat_interleave(group, 1), attn_mask=vis,
                                          scale=scale)


def make_case(seed, *, batch=1, hq=4, hkv=2, sq=200, skv=None, dim=64, bs=32, causal=True,
              dtype=torch.float32, q_lens=None, kv_lens=None, **sel):
    gen = torch.Generator().manual_seed(seed)
    skv = sq if skv is None else skv
    q = torch.randn(batch, hq, sq, dim, generator=gen).to(dtype)
    k = torch.randn(batch, hkv, skv, dim, generator=gen).to(dtype)
    v = torch.randn(batch, hkv, skv, dim, generator=gen).to(dtype)
    q_lens = torch.full((batch,), sq) if q_lens is None else torch.tensor(q_lens)
    kv_lens = torch.full((batch,), skv) if kv_lens is None else torch.tensor(kv_lens)
    idx, lengths = selection(gen, batch, hq, math.ceil(sq / bs), math.ceil(skv / bs), **sel)
    return dict(q=q, k=k, v=v, idx=idx, lengths=lengths, q_lens=q_lens, kv_lens=kv_lens,
                block_size=bs, causal=causal, scale=dim ** -0.5)


def plant(case, value):
    """Put ``value`` in every padded position of q, k and v (copies)."""
    out = dict(case)
    for name, lens in (("q", case["q_lens"]), ("k", case["kv_lens"]), ("v", case["kv_lens"])):
        x = case[name].clone()
        pad = torch.arange(x.shape[2])[None, :] >= lens[:, None]
        out[name] = x.masked_fill(pad[:, None, :, None], value)
    return out


def check(case, **kw):
    """Run the kernel; compare with the reference; return its output."""
    return agrees(case, sa.sparse_attention(**case, **kw))


def agrees(case, out):
    """Assert that ``out`` is the float64 reference's on ``case`` (as close as
    SDPA is, zero where nothing is visible); return it."""
    assert out.dtype == case["q"].dtype and out.shape == case["q"].shape
    q, k, v = (clean(case[n], case[ln]) for n, ln in (("q", "q_lens"), ("k", "kv_lens"),
                                                       ("v", "kv_lens")))
    vis = token_mask(case["idx"], case["lengths"], case["block_size"], q.shape[2], k.shape[2],
                     case["q_lens"], case["kv_lens"], case["causal"])
    ref = reference_attention(q, k, v, vis, scale=case["scale"])
    seen = vis.any(-1)  # [B, Hq, Sq]: queries with a visible key
    assert torch.equal(out[~seen], torch.zeros_like(out[~seen])), "zero rows must be exact 0"
    if not bool(seen.any()):
        return out
    err = (out.double() - ref)[seen].abs().max().item()
    base = (sdpa(q, k, v, vis, case["scale"]).double() - ref)[seen].abs().max().item()
    tiny = 4 * torch.finfo(q.dtype).eps * ref[seen].abs().max().item()
    assert err <= 4 * base + tiny, f"error {err:.3g} vs SDPA's {base:.3g}"
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2)])
@pytest.mark.parametrize("dim", [64, 128, 40])
def test_dtypes_heads_dims(dtype, hq, hkv, dim):
    for mode in BF16_MODES if dtype == torch.bfloat16 else ["auto"]:
        check(make_case(dim + hq, hq=hq, hkv=hkv, dim=dim, dtype=dtype), bf16=mode)


@pytest.mark.parametrize("bs", [16, 32, 128])
@pytest.mark.parametrize("causal", [True, False])
def test_block_sizes_and_causal(bs, causal):
    sq = 3 * bs + bs // 2 + 3  # a tail block on both sides
    for dtype in (torch.float32, torch.bfloat16):
        check(make_case(bs, sq=sq, bs=bs, causal=causal, dtype=dtype, p=0.5))


@pytest.mark.parametrize("skv_extra", [0, 5, 64, 100])
def test_chunked_prefill(skv_extra):
    """q shorter than kv: right-down causal (query t sees keys <= t + Skv - Sq)."""
    sq = 90
    check(make_case(7, sq=sq, skv=sq + skv_extra, bs=32))
    check(make_case(8, sq=sq, skv=sq + skv_extra, bs=32, dtype=torch.bfloat16))


def test_kv_shorter_than_q():
    """kv_len < q_len: the first queries see no key and output 0."""
    check(make_case(9, batch=2, sq=100, skv=100, bs=16, q_lens=[100, 80], kv_lens=[60, 30]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_varlen_batches(dtype):
    case = make_case(3, batch=4, hq=4, hkv=2, sq=150, skv=170, bs=32, dtype=dtype,
                     q_lens=[150, 0, 77, 40], kv_lens=[170, 90, 0, 101])
    check(case)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padding_never_leaks(value, dtype):
    case = make_case(11, batch=3, sq=130, skv=140, bs=32, dtype=dtype,
                     q_lens=[130, 99, 45], kv_lens=[101, 140, 67])
    for mode in BF16_MODES if dtype == torch.bfloat16 else ["auto"]:
        clean_out = sa.sparse_attention(**case, bf16=mode)
        dirty_out = check(plant(case, value), bf16=mode)
        assert torch.equal(clean_out, dirty_out)


def test_lists_without_diagonal():
    """Query tokens whose listed blocks hold no visible key output exactly 0."""
    check(make_case(5, sq=160, bs=32, diagonal=False, p=0.3))
    check(make_case(6, sq=160, bs=32, diagonal=False, p=0.0, empty=0.0))


def test_empty_rows_and_empty_lists():
    check(make_case(12, sq=128, bs=32, empty=0.5))
    case = make_case(13, sq=64, bs=32)
    case["idx"] = case["idx"][..., :0]
    case["lengths"] = torch.zeros_like(case["lengths"])
    assert torch.equal(check(case), torch.zeros_like(case["q"]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_lists_span_steps(dtype):
    """Lists longer than one online-softmax step (512 keys), in many pieces
    (packed, also pieces across the packed 512-key chunks of K)."""
    check(make_case(14, hq=2, hkv=1, sq=1200, bs=16, p=0.6, dim=32, dtype=dtype))
    check(make_case(15, hq=2, hkv=1, sq=1200, bs=128, p=0.9, dim=32, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_larger_than_a_step(dtype):
    check(make_case(20, hq=2, hkv=1, sq=1500, bs=640, dim=16, dtype=dtype, p=0.7))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_token_tails_and_negative_scale(dtype):
    case = make_case(21, batch=2, sq=2 * 32 + 1, bs=32, dtype=dtype, q_lens=[65, 33])
    check(case)
    check({**case, "scale": -0.3})


@pytest.mark.parametrize("isa", ISAS)
def test_instruction_sets(isa):
    try:
        out = check(make_case(16, sq=100, bs=16, dim=40), isa=isa)
    except ValueError:
        pytest.skip(f"{isa} does not run on this CPU")
    assert torch.equal(out, sa.sparse_attention(**make_case(16, sq=100, bs=16, dim=40),
                                                isa=isa))
    for mode in BF16_MODES:
        check(make_case(17, sq=100, bs=16, dim=40, dtype=torch.bfloat16), isa=isa, bf16=mode)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_thread_counts_agree(dtype):
    case = make_case(18, batch=2, hq=4, hkv=2, sq=300, bs=32, dtype=dtype, q_lens=[300, 201])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = sa.sparse_attention(**case)
        torch.set_num_threads(2)
        two = sa.sparse_attention(**case)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_rejects_what_it_cannot_run():
    case = make_case(19, sq=64, bs=32)
    with pytest.raises(TypeError):
        sa.sparse_attention(**{**case, "q": case["q"].double()})
    with pytest.raises(ValueError):
        sa.sparse_attention(**case, bf16="fast")
    with pytest.raises(ValueError):
        sa.sparse_attention(**{**case, "lengths": case["lengths"][..., :1]})
    odd = make_case(22, sq=64, bs=32, dim=33, dtype=torch.bfloat16)
    with pytest.raises(ValueError):
        sa.sparse_attention(**odd, bf16="brgemm")
    check(odd)  # "auto" widens


# --------------------------------------------------------------------------- #
# NaN and inf in what the queries see
# --------------------------------------------------------------------------- #


def plant_specials(case, seed):
    """Copies of q, k, v with NaN, +inf and -inf at random valid positions
    (whole query and key tokens and single elements), and in the last block's
    keys, which the earlier queries of that block do not see."""
    gen = torch.Generator().manual_seed(seed)
    out = dict(case)
    for name, lens in (("q", case["q_lens"]), ("k", case["kv_lens"]), ("v", case["kv_lens"])):
        x = case[name].float().clone()
        batch, heads, seq, dim = x.shape
        for value in (math.nan, math.inf, -math.inf):
            for _ in range(3):
                b = int(torch.randint(0, batch, (1,), generator=gen))
                if int(lens[b]) == 0:
                    continue
                h = int(torch.randint(0, heads, (1,), generator=gen))
                t = int(torch.randint(0, int(lens[b]), (1,), generator=gen))
                d = int(torch.randint(0, dim, (1,), generator=gen))
                x[b, h, t, d] = value
            b = int(torch.randint(0, batch, (1,), generator=gen))
            if int(lens[b]) > 0:  # near the end: inside the causal diagonal
                x[b, :, int(lens[b]) - 1 - int(torch.randint(0, 3, (1,), generator=gen)),
                  int(torch.randint(0, dim, (1,), generator=gen))] = value
        if name == "q":  # one whole NaN query token
            x[0, 0, int(torch.randint(0, max(int(lens[0]), 1), (1,), generator=gen))] = math.nan
        out[name] = x.to(case[name].dtype)
    return out


def same_nonfinite(got, want, tol):
    """NaN where want is NaN, inf of the same sign where it is inf, close elsewhere."""
    got = got.double()
    assert torch.equal(got.isnan(), want.isnan()), "NaN positions differ"
    inf = want.isinf()
    assert torch.equal(got.isinf(), inf) and torch.equal(got[inf], want[inf]), "inf differs"
    fin = want.isfinite()
    if bool(fin.any()):
        err = (got[fin] - want[fin]).abs().max().item()
        assert err <= tol * max(1.0, want[fin].abs().max().item()), err


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [True, False])
def test_nonfinite_values_act_as_in_dense_attention(isa, dtype, causal):
    """NaN and inf in valid q, k, v reach the outputs (and the log-sum-exp)
    exactly where dense softmax attention over each query's visible keys puts
    them, on every instruction set of the softmax; padding still leaks
    nothing (it holds NaN here)."""
    check_nonfinite(isa, dtype, causal, BF16_MODES if dtype == torch.bfloat16 else ["auto"])


def check_nonfinite(isa, dtype, causal, modes, seeds=range(3)):
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    for seed in seeds:
        case = make_case(30 + seed, batch=2, hq=4, hkv=2, sq=70, skv=90, dim=24, bs=16,
                         causal=causal, dtype=dtype, q_lens=[70, 41], kv_lens=[90, 53], p=0.6)
        case = plant(plant_specials(case, seed), math.nan)
        for mode in modes:
            try:
                out, lse = sa.sparse_attention(**case, lse=True, isa=isa, bf16=mode)
            except ValueError:
                pytest.skip(f"{isa} does not run on this CPU")
            q, k, v = (clean(case[n], case[ln]) for n, ln in (
                ("q", "q_lens"), ("k", "kv_lens"), ("v", "kv_lens")))
            vis = token_mask(case["idx"], case["lengths"], case["block_size"], q.shape[2],
                             k.shape[2], case["q_lens"], case["kv_lens"], case["causal"])
            want, want_lse = reference_attention(q, k, v, vis, scale=case["scale"],
                                                 return_lse=True)
            assert bool(want.isnan().any()) and bool(want.isinf().any())
            assert bool((want.isnan().all(-1) != want.isnan().any(-1)).any())  # a partial row
            same_nonfinite(out, want, tol)
            same_nonfinite(lse, want_lse, 1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_keys_a_query_does_not_see_never_reach_it(dtype):
    """NaN in the V (and K) rows of valid keys past a query's causal bound, in
    the block it shares with later queries: its output stays finite."""
    case = make_case(40, hq=2, hkv=1, sq=64, dim=16, bs=32, dtype=dtype, p=1.0, empty=0.0)
    for name in ("k", "v"):
        x = case[name].clone()
        x[:, :, 40] = math.nan  # key 40: seen by queries 40.. only
        case[name] = x
    out = sa.sparse_attention(**case)
    assert bool(out[:, :, :40].isfinite().all())
    assert bool(out[:, :, 40:].isnan().all())


# --------------------------------------------------------------------------- #
# Scores that grow from one online-softmax step to the next
# --------------------------------------------------------------------------- #


def growing_case(seed, rise, dtype=torch.bfloat16):
    """Rows of 1,100 keys (three steps of 512), every block listed; the keys
    of block 9 (in the second step) and block 16 (the third) lean toward the
    queries, so that the last queries' largest scores there exceed their
    largest in the step before by amounts spread from below ``rise`` to
    several times it (base-2 units)."""
    case = make_case(seed, hq=2, hkv=1, sq=1100, bs=64, dim=32, dtype=torch.float32,
                     p=1.0, empty=0.0)
    q, k = case["q"].clone(), case["k"].clone()
    u = F.normalize(torch.ones(32), dim=0)
    q += 2.0 * u
    def top(keys):  # base 2: the median over queries 1024.. of their largest score
        return float((q[0, 0, 1024:] @ keys.T).amax(-1).median()) * case["scale"] / math.log(2)

    for block in (9, 16):
        step = k[0, 0, (block // 8) * 512 - 512:(block // 8) * 512]
        lean = (top(step) + rise) * math.log(2) / (case["scale"] * 2.0)
        k[:, :, block * 64:(block + 1) * 64] += lean * u
    case.update(q=q.to(dtype), k=k.to(dtype), v=case["v"].to(dtype))
    return case


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("rise", [3.0, 7.5, 12.0, 60.0])
def test_scores_rising_across_steps(isa, rise):
    """A later step's scores above the running max, by less and by more than
    the kernel lets the running max lag behind (``LAZY_MAX``, 8 in base 2):
    the output is the reference's on every instruction set and both
    bfloat16 paths."""
    for mode in BF16_MODES:
        try:
            check(growing_case(50, rise), isa=isa, bf16=mode)
        except ValueError:
            pytest.skip(f"{isa} does not run on this CPU")


@pytest.mark.parametrize("isa", ISAS)
def test_nonfinite_values_in_later_steps(isa):
    """NaN and inf that a row meets only in its second or third step act as
    in dense attention (rows of three 512-key steps)."""
    case = growing_case(51, 3.0)
    gen = torch.Generator().manual_seed(52)
    for name in ("q", "k", "v"):
        x = case[name].float().clone()
        for value in (math.nan, math.inf, -math.inf):
            t = int(torch.randint(600, 1100, (1,), generator=gen))
            x[0, 0, t, int(torch.randint(0, 32, (1,), generator=gen))] = value
        case[name] = x.to(torch.bfloat16)
    q, k, v = case["q"], case["k"], case["v"]
    vis = token_mask(case["idx"], case["lengths"], 64, 1100, 1100, case["q_lens"],
                     case["kv_lens"], True)
    want, want_lse = reference_attention(q, k, v, vis, scale=case["scale"], return_lse=True)
    assert bool(want.isnan().any()) and bool(want.isfinite().any())
    for mode in BF16_MODES:
        try:
            out, lse = sa.sparse_attention(**case, lse=True, isa=isa, bf16=mode)
        except ValueError:
            pytest.skip(f"{isa} does not run on this CPU")
        same_nonfinite(out, want, 3e-2)
        same_nonfinite(lse, want_lse, 1e-4)


# --------------------------------------------------------------------------- #
# The bfloat16 micro-kernel's probe
# --------------------------------------------------------------------------- #

needs_cpublas = pytest.mark.skipif(
    "without" in sa.status(), reason="torch exports no cpublas::brgemm here")


@pytest.fixture
def fresh_probe(monkeypatch):
    """No probe result and no fallback warning remembered (restored after)."""
    from stem_indexer.operator.ops import native
    monkeypatch.setattr(sa, "_probed", {})
    monkeypatch.setattr(native, "_warned", set())


def test_probe_calls_cover_the_kernels_calls():
    """Every (valid query rows, blocks) pair of both products, with the
    kernel's leading dimensions (csrc/sparse_attention.c, stem_sparse_attention)."""
    calls, (na, nb, nc) = sa._probe_calls(64, 128)
    step = 512
    ld_s, ld_p = step + 16, step + 32
    assert {c for c in calls if c[6] == 0} == {(m, n * 128, 64, 64, step, ld_s, 0)
                                               for m in range(1, 129) for n in range(1, 5)}
    assert {c for c in calls if c[6] == 1} == {(m, 64, n * 128, ld_p, 64, 64, 1)
                                               for m in range(1, 129) for n in range(1, 5)}
    for m, n, k, lda, ldb, ldc, add in calls:  # the buffers hold what each call reads
        assert m * lda <= na and k * ldb <= nb and m * ldc <= nc
    assert len(sa._probe_calls(16, 1024)[0]) == 2 * 1024  # blocks larger than a step


@needs_cpublas
@pytest.mark.parametrize("code, how", [
    ("import os; os.abort()", "signal"),  # as an uncaught C++ exception does
    ("raise RuntimeError('no ukernel')", "no ukernel"),
    ("print('half done')", "exit status 0"),  # a child that did not reach the end
])
def test_probe_reports_a_child_that_fails(fresh_probe, monkeypatch, code, how):
    monkeypatch.setattr(torch_blas, "PROBE_CODE", code)
    why = sa.brgemm_probe(64, 32)
    assert why is not None and how in why, why
    assert "bfloat16 micro-kernel unusable for D=64, block 32" in sa.status()
    assert sa.brgemm_probe(64, 32) == why  # once per (D, block size)


@needs_cpublas
def test_a_clean_probe_is_remembered_in_the_cache(fresh_probe, monkeypatch, tmp_path):
    """Later processes (here: a later probe) skip the child once it succeeded."""
    from _helpers import native_on_cache
    children = []
    real = torch_blas._probe_child
    monkeypatch.setattr(torch_blas, "_probe_child", lambda *a: (children.append(1), real(*a))[1])
    monkeypatch.setattr(torch_blas, "PROBE_CODE", "print('ok')")
    with native_on_cache(tmp_path):
        calls, sizes = sa._probe_calls(16, 8)
        assert torch_blas.probe(calls, sizes) is None and torch_blas.probe(calls, sizes) is None
        assert len(children) == 1 and len(list(tmp_path.glob("brgemm-probe-*.ok"))) == 1
        monkeypatch.setattr(torch_blas, "PROBE_CODE", "import os; os.abort()")  # another key
        assert torch_blas.probe(calls, sizes) is not None and len(children) == 2


@needs_cpublas
def test_an_unusable_micro_kernel_widens_with_the_reason(fresh_probe, monkeypatch):
    """A CPU with bfloat16 dot products whose micro-kernel fails its probe:
    bf16 runs widened (bit for bit as bf16='widen'), with one warning and
    the reason in status(); bf16='brgemm' is refused with it."""
    monkeypatch.setattr(torch_blas, "bf16_brgemm", lambda: ((1, 2), "a bfloat16 CPU"))
    monkeypatch.setattr(torch_blas, "bf16_products_pay", lambda: (True, "a bfloat16 CPU"))
    monkeypatch.setattr(torch_blas, "PROBE_CODE", "import os; os.abort()")
    case = make_case(41, sq=100, bs=16, dim=32, dtype=torch.bfloat16)
    with pytest.warns(RuntimeWarning,
                      match="bfloat16 micro-kernel unusable for D=32, block 16"):
        out = check(case)
    assert torch.equal(out, sa.sparse_attention(**case, bf16="widen"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(sa.sparse_attention(**case), out)  # no second warning
    assert "bfloat16 micro-kernel unusable for D=32, block 16" in sa.status()
    with pytest.raises(ValueError, match="signal"):
        sa.sparse_attention(**case, bf16="brgemm")


def test_a_cpu_without_bfloat16_dot_products_widens(monkeypatch):
    """No bfloat16 dot products (an AVX2 CPU): "auto" widens without a probe
    or a warning, and bf16='brgemm' is refused naming why."""
    monkeypatch.setattr(torch_blas, "cpu_flags", lambda: "fpu avx2 fma")
    monkeypatch.setattr(sa, "brgemm_probe", lambda *a: pytest.fail("probed"))
    assert torch_blas.bf16_brgemm() == (None, "the CPU has no bfloat16 dot product instructions")
    case = make_case(43, sq=64, bs=32, dim=32, dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = check(case)
    assert torch.equal(out, sa.sparse_attention(**case, bf16="widen"))
    with pytest.raises(ValueError, match="no bfloat16 dot product"):
        sa.sparse_attention(**case, bf16="brgemm")


@pytest.mark.parametrize("vendor, flags, pays", [
    ("GenuineIntel", "avx2 avx512f avx512_bf16 amx_tile amx_bf16", True),
    ("AuthenticAMD", "avx2 avx512f avx512_bf16", True),
    ("GenuineIntel", "avx2 avx512f avx512_bf16", False),
    ("AuthenticAMD", "avx2 fma", False)])
def test_bfloat16_products_are_taken_where_they_are_the_faster(vendor, flags, pays,
                                                                monkeypatch):
    """``bf16_products_pay``, by the rule its docstring states: AMX, and AMD's
    AVX512-BF16, yes; an Intel CPU with AVX512-BF16 but no AMX, and a CPU
    without bfloat16 dot products, no. Where not, ``bf16="auto"`` widens,
    bit for bit as ``bf16="widen"``, on a paged cache too, and status() and
    ``paged_products`` say why."""
    monkeypatch.setattr(torch_blas, "cpu_flags", lambda: flags)
    monkeypatch.setattr(torch_blas, "cpu_vendor", lambda: vendor)
    # decided once per process (cached): the rule itself, uncached, on this CPU
    monkeypatch.setattr(torch_blas, "bf16_products_pay", torch_blas.bf16_products_pay.__wrapped__)
    assert torch_blas.bf16_products_pay()[0] == pays
    if not pays:
        case = make_case(44, sq=96, bs=32, dim=32, dtype=torch.bfloat16)
        monkeypatch.setattr(sa, "brgemm_probe", lambda *a: pytest.fail("probed"))
        assert torch.equal(sa.sparse_attention(**case), sa.sparse_attention(**case, bf16="widen"))
        assert "bfloat16 widened to float32 by default" in sa.status()
        views = vec_views(16, 32)
        assert torch.equal(run_paged(case, 16, views, seed=5),
                           run_paged(case, 16, views, seed=5, bf16="widen"))
        assert sa.paged_products(16, 32, 32, *views).startswith("float32 products")


@needs_cpublas
@pytest.mark.parametrize("causal", [True, False])
def test_the_micro_kernel_path_on_edges(fresh_probe, causal):
    """The packed path (packed K/V, torch's brgemm, bfloat16 P), the default
    on a CPU with bfloat16 dot products: accuracy, NaN and inf as dense
    attention, padding and unseen keys."""
    if torch_blas.bf16_brgemm()[0] is None:
        pytest.skip(torch_blas.bf16_brgemm()[1])
    if sa.brgemm_probe(24, 16) is not None or sa.brgemm_probe(32, 32) is not None:
        pytest.skip(f"the micro-kernel does not run here: {sa.brgemm_probe(24, 16)}")
    edge = make_case(42, sq=150, skv=170, bs=32, dim=32, causal=causal, dtype=torch.bfloat16,
                     q_lens=[150], kv_lens=[161])
    out = check(edge, bf16="brgemm")
    if torch_blas.bf16_products_pay()[0]:
        assert torch.equal(sa.sparse_attention(**edge), out)  # the default here
    check_nonfinite("auto", torch.bfloat16, causal, ["brgemm"], seeds=range(2))
    case = make_case(40, hq=2, hkv=1, sq=64, dim=32, bs=32, dtype=torch.bfloat16, p=1.0,
                     empty=0.0, causal=causal)
    for name in ("k", "v"):
        x = case[name].clone()
        x[:, :, 40] = math.nan  # key 40: seen by queries 40.. only (all, without causal)
        case[name] = x
    out = sa.sparse_attention(**case, bf16="brgemm")
    assert bool(out[:, :, 40:].isnan().all())
    assert bool(out[:, :, :40].isfinite().all()) == causal


@pytest.mark.parametrize("once", [True, False])
def test_widening_once_per_kv_head_or_step_by_step_gives_the_reference(once, monkeypatch):
    """``bf16="widen"``'s two ways to widen K and V (once per KV head into
    shared buffers, or each step's pieces): each is the reference's, NaN and
    inf included, with padding, GQA, unseen keys and a batch."""
    mode = sa._MODE_PACK32 if once else sa._MODE_WIDEN
    monkeypatch.setattr(sa, "_widen_mode", lambda *args: mode)
    check(make_case(46, batch=2, hq=6, hkv=2, sq=300, skv=333, dim=40, bs=32,
                    dtype=torch.bfloat16, q_lens=[300, 77], kv_lens=[333, 110]), bf16="widen")
    check(make_case(47, hq=2, hkv=1, sq=1100, dim=64, bs=64, dtype=torch.bfloat16, p=1.0,
                    empty=0.0), bf16="widen")  # rows of several steps
    for causal in (True, False):
        check_nonfinite("auto", torch.bfloat16, causal, ["widen"], seeds=range(2))


def test_widening_once_where_rows_read_each_key_twice():
    """The rule ``_widen_mode`` states: a prefill's rows (every block listed)
    read each key many times, so K and V are widened once; one query block
    over a long cache reads each at most once, so piece by piece."""
    full = torch.arange(1, 9)[None, None, :].expand(1, 4, 8)  # causal, every block
    assert sa._widen_mode(full, 32, 2, 256) == sa._MODE_PACK32
    assert sa._widen_mode(torch.full((1, 2, 1), 8), 32, 2, 256) == sa._MODE_WIDEN


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, marks=pytest.mark.slow),
                                   torch.bfloat16])
def test_python_threads_at_once_each_equal_the_reference(dtype):
    """Several Python threads in the kernel at once, each with a thread team
    of its own (torch's thread count is 2 here, so every call opens an
    OpenMP team: the kernel has no size below which it runs serially): each
    output is the reference's, and bit-identical to the same call alone."""
    from concurrent.futures import ThreadPoolExecutor

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        cases = [make_case(40 + n, batch=2, hq=4, hkv=2, sq=260, bs=32, dtype=dtype,
                           q_lens=[260, 199]) for n in range(3)]
        alone = [check(case) for case in cases]
        with ThreadPoolExecutor(4) as pool:
            outs = list(pool.map(lambda n: (n % 3, check(cases[n % 3])), range(12)))
    finally:
        torch.set_num_threads(before)
    for n, out in outs:
        assert torch.equal(out, alone[n])


# --------------------------------------------------------------------------- #
# Keys and values packed straight from the pages of a paged cache
# --------------------------------------------------------------------------- #


def amx_views(page, dim):
    """Where vLLM's ``amx`` layout puts a page's keys and values in its
    (page, head) block of ``2 * page * dim`` elements: keys in tiles of 16
    tokens by pairs of dimensions, values in tiles of 16 dimensions by pairs
    of tokens (``kv_read.PageReader.key_view`` finds these for vLLM's writer)."""
    keys = (0, (page // 16, 16, dim // 2, 2), (16 * dim, 2, 32, 1))
    values = (page * dim, (page // 2, 2, dim // 16, 16), (32, 1, page * 16, 2))
    return keys, values


def vec_views(page, dim):
    """vLLM's ``vec`` layout: keys transposed ([D, page]), values row-major
    (runs of 16-bit elements: packed two runs at a time)."""
    return (0, (page, 1, dim, 1), (1, 0, page, 0)), (page * dim, (page, 1, dim, 1), (dim, 0, 1, 0))


def tiled_halves_views(page, dim):
    """Keys in tiles of 16 tokens per dimension ([page / 16, D, 16]), values
    in tiles of 16 dimensions per token ([D / 16, page, 16]): runs split on
    both axes."""
    keys = (0, (page // 16, 16, dim, 1), (16 * dim, 1, 16, 0))
    values = (page * dim, (page, 1, dim // 16, 16), (16, 0, 16 * page, 1))
    return keys, values


def token_major_views(page, dim):
    """Keys and values row after row: the keys' tokens are not adjacent."""
    return (0, (page, 1, dim, 1), (dim, 0, 1, 0)), (page * dim, (page, 1, dim, 1), (dim, 0, 1, 0))


LAYOUTS = {"amx": amx_views, "vec": vec_views, "tiled halves": tiled_halves_views}
#: every strided view: the widened path reads the pages element by element
ANY_LAYOUTS = {**LAYOUTS, "token-major": token_major_views}


def to_pages(case, page, views, seed, garbage=math.nan):
    """``case``'s keys and values written into a paged cache [pages, Hkv,
    2 * page * D] through ``views``, each sequence on pages in a random order
    among unused ones that hold ``garbage``; the table's entries past a
    sequence's pages are -1 (never to be read). Returns (cache, table)."""
    gen = torch.Generator().manual_seed(seed)
    k, v = case["k"], case["v"]
    batch, hkv, skv, dim = k.shape
    width = -(-skv // page)
    num_pages = batch * width + 3
    cache = torch.full((num_pages, hkv, 2 * page * dim), garbage, dtype=k.dtype)
    order = torch.randperm(num_pages, generator=gen)
    table = torch.full((batch, width), -1, dtype=torch.int32)
    for b in range(batch):
        need = -(-int(case["kv_lens"][b]) // page)
        table[b, :need] = order[b * width:b * width + need].to(torch.int32)
        for n in range(need):
            for x, (offset, sizes, strides) in zip((k, v), views):
                tokens = x[b, :, n * page:(n + 1) * page]  # [Hkv, <= page, D]
                full = torch.full((hkv, page, dim), garbage, dtype=x.dtype)
                full[:, :tokens.shape[1]] = tokens
                blocks = cache[int(table[b, n])]
                place = blocks.as_strided((hkv, *sizes), (blocks.stride(0), *strides),
                                          blocks.storage_offset() + offset)
                place.copy_(full.view(hkv, sizes[0], sizes[1], sizes[2], sizes[3]))
    return cache, table


def run_paged(case, page, views, seed, garbage=math.nan, **kw):
    cache, table = to_pages(case, page, views, seed, garbage)
    return sa.sparse_attention_paged(
        case["q"], cache, table, page, *views, case["idx"], case["lengths"], case["q_lens"],
        case["kv_lens"], case["block_size"], case["causal"], case["scale"], **kw)


_PACKING_REFUSED = sa.paged_refused(128, 64, 128, *amx_views(128, 64), bf16="brgemm")
needs_packing = pytest.mark.skipif(
    _PACKING_REFUSED is not None,
    reason=f"keys cannot be packed for the micro-kernel from pages here: {_PACKING_REFUSED}")
#: the paged products: bfloat16 on the micro-kernel, or widened to float32
PAGED_MODES = [pytest.param("brgemm", marks=needs_packing), "widen"]


@pytest.mark.parametrize("bf16", PAGED_MODES)
@pytest.mark.parametrize("page,bs,dim,layout", [
    *((*shape, layout) for shape in [(128, 128, 64), (16, 32, 64), (32, 16, 128), (64, 64, 32)]
      for layout in ANY_LAYOUTS),
    (24, 16, 40, "token-major")])  # the other layouts tile pages by 16 tokens
def test_paged_keys_and_values_give_the_reference(page, bs, dim, layout, bf16):
    """Batches of several lengths, chunked prefill (fewer queries than keys),
    a last page the sequence only partly fills (NaN past it, as in every
    unused page), in each layout each path takes (the micro-kernel's pack
    only runs of 16 tokens, the widened one any view): the reference's
    output."""
    if layout == "token-major" and bf16 == "brgemm":
        why = sa.paged_refused(page, dim, bs, *token_major_views(page, dim), bf16="brgemm")
        assert "keys lie neither" in why or "whole runs of 16" in why
        return
    sq = 3 * bs + 7
    case = make_case(60 + page, batch=3, hq=4, hkv=2, sq=sq, skv=sq + 2 * page + 5, dim=dim,
                     bs=bs, dtype=torch.bfloat16, q_lens=[sq, sq - 20, 9],
                     kv_lens=[sq + 2 * page + 5, sq + page - 3, 40], p=0.5)
    views = ANY_LAYOUTS[layout](page, dim)
    assert sa.paged_refused(page, dim, bs, *views, bf16=bf16) is None
    out = agrees(case, run_paged(case, page, views, seed=page, bf16=bf16))
    assert bool(out.isfinite().all())


@pytest.mark.parametrize("bf16", PAGED_MODES)
def test_paged_row_spanning_many_steps_and_pages(bf16):
    """A long row (2,600 keys: six steps of 512, 21 pages of 128), every
    block listed, and its log-sum-exp."""
    case = make_case(70, hq=2, hkv=1, sq=256, skv=2600, dim=64, bs=128, dtype=torch.bfloat16,
                     p=1.0, empty=0.0)
    out, lse = run_paged(case, 128, amx_views(128, 64), seed=1, lse=True, bf16=bf16)
    agrees(case, out)
    q, k, v = case["q"], case["k"], case["v"]
    vis = token_mask(case["idx"], case["lengths"], 128, 256, 2600, case["q_lens"],
                     case["kv_lens"], True)
    _, want = reference_attention(q, k, v, vis, scale=case["scale"], return_lse=True)
    assert (lse.double() - want).abs().max().item() < 1e-2


@pytest.mark.parametrize("bf16", PAGED_MODES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal", [True, False])
def test_paged_nonfinite_values_act_as_in_dense_attention(causal, layout, bf16):
    """NaN and inf in valid keys and values (V read from the packed pages
    where a step must go query by query) reach the outputs as in dense
    attention; the garbage past each sequence's keys leaks nothing."""
    for seed in range(2):
        case = make_case(30 + seed, batch=2, hq=4, hkv=2, sq=70, skv=90, dim=32, bs=16,
                         causal=causal, dtype=torch.bfloat16, q_lens=[70, 41],
                         kv_lens=[90, 53], p=0.6)
        case = plant_specials(case, seed)
        out, lse = run_paged(case, 16, LAYOUTS[layout](16, 32), seed, lse=True, bf16=bf16)
        q, k, v = (clean(case[n], case[ln]) for n, ln in (
            ("q", "q_lens"), ("k", "kv_lens"), ("v", "kv_lens")))
        vis = token_mask(case["idx"], case["lengths"], 16, 70, 90, case["q_lens"],
                         case["kv_lens"], causal)
        want, want_lse = reference_attention(q, k, v, vis, scale=case["scale"],
                                             return_lse=True)
        assert bool(want.isnan().any()) and bool(want.isinf().any())
        same_nonfinite(out, want, 3e-2)
        same_nonfinite(lse, want_lse, 1e-4)


@pytest.mark.parametrize("bf16", PAGED_MODES)
def test_paged_unseen_keys_never_reach_a_query(bf16):
    """NaN in key 40's K and V, inside the block it shares with earlier
    queries: those stay finite (the step's P V goes query by query)."""
    case = make_case(40, hq=2, hkv=1, sq=64, dim=32, bs=32, dtype=torch.bfloat16, p=1.0,
                     empty=0.0)
    for name in ("k", "v"):
        x = case[name].clone()
        x[:, :, 40] = math.nan
        case[name] = x
    out = run_paged(case, 16, amx_views(16, 32), seed=2, bf16=bf16)
    assert bool(out[:, :, :40].isfinite().all())
    assert bool(out[:, :, 40:].isnan().all())


@pytest.mark.parametrize("bf16", PAGED_MODES)
def test_paged_refuses_what_it_cannot_read(bf16):
    case = make_case(80, hq=2, hkv=1, sq=64, skv=64, dim=32, bs=32, dtype=torch.bfloat16)
    views = amx_views(16, 32)
    cache, table = to_pages(case, 16, views, seed=3)
    args = dict(idx=case["idx"], lengths=case["lengths"], q_lens=case["q_lens"],
                kv_lens=case["kv_lens"], block_size=32, causal=True, scale=case["scale"])

    def call(q=case["q"], cache=cache, table=table, page=16, views=views, **kw):
        return sa.sparse_attention_paged(q, cache, table, page, *views,
                                         **{"bf16": bf16, **args, **kw})

    keys, _ = amx_views(16, 32)
    if bf16 == "brgemm":
        with pytest.raises(ValueError, match="keys lie neither"):
            call(views=token_major_views(16, 32))
        with pytest.raises(ValueError, match="values lie neither"):  # values column-major
            call(views=(keys, (16 * 32, (16, 1, 32, 1), (1, 0, 16, 0))))
    with pytest.raises(ValueError, match="strides not negative" if bf16 == "widen" else
                       "values lie neither"):
        call(views=(keys, (16 * 32 + 15, (16, 1, 32, 1), (-1, 0, 16, 0))))
    with pytest.raises(ValueError, match="bf16 in"):
        call(bf16="fast")
    with pytest.raises(ValueError, match="page must be at least 1"):
        call(page=0)
    with pytest.raises(TypeError, match="bfloat16"):
        call(q=case["q"].float())
    assert "not bfloat16" in sa.paged_refused(16, 32, 32, *views, torch.float32)
    bad = table.clone()
    bad[0, 1] = cache.shape[0]
    with pytest.raises(ValueError, match="table entries in use"):
        call(table=bad)
    with pytest.raises(ValueError, match="kv_lens"):
        call(kv_lens=torch.tensor([65]))
    with pytest.raises(ValueError, match="must cover"):
        call(page=32, views=amx_views(32, 32))  # views of 32 tokens in blocks of 16
    agrees(case, call())  # and the call itself is sound
