"""The CPU path's native selection kernel (``ops/native.py``, ``csrc/select_rows.c``).

* The kernel alone, on random tiles built to stress it (heavy ties, NaN,
  infinities, signed zeros, bf16 rounding to ties and to infinity, rows that
  take nothing, one less than all, or everything), against a direct
  statement of the contract: the ``take`` largest ``contract.rank_keys_at``
  of each row's candidates, ascending, after its sink and before its window;
  and on rows long enough for its sampled floor, some built so that the
  sample misleads it.
* The large outputs' fill (streaming stores) against ``torch.full``.
* Its build: where a C compiler exists it must build (the suites' native
  variants would otherwise skip quietly); without one, or when disabled, the
  op falls back to torch selection with the same results.

The whole case table, the hand cases of docs/CONTRACT.md section 3 and the integer property tests
run on both selections too (the ``selection`` fixture of conftest.py).
"""

from __future__ import annotations

import hashlib
import math
import platform
import shutil
from pathlib import Path

import pytest
import torch

from stem_indexer import stem_indexer
from stem_indexer.operator import contract
from stem_indexer.operator._threads import thread_count
from stem_indexer.operator.ops import cpu, native, torch_blas
from stem_indexer.operator.reference import stem_indexer_reference

needs_kernel = pytest.mark.skipif(native.kernel() is None, reason=native.status(native.SELECT_ROWS))


def expected_rows(nk, c, group, s2, sink_end, cand_end, take, scores, ranked, lo, precision,
                  kmax):
    """(Nq, c, kmax) int32, row by row from the contract's ranking keys."""
    out = torch.full((nk * group, c, kmax), -1, dtype=torch.int32)
    for n in range(nk):
        for g in range(group):
            for i in range(c):
                s, a, e, t = int(s2[i]), int(sink_end[i]), int(cand_end[i]), int(take[i])
                if t >= e - a:
                    row = list(range(s))
                else:
                    picks = []
                    if t:
                        blocks = torch.arange(a, e)
                        row_scores = scores[n, i - ranked, g, a - lo:e - lo]
                        keys = contract.rank_keys_at(row_scores, blocks, precision)
                        picks = sorted(blocks[keys.topk(t).indices].tolist())
                    row = list(range(a)) + picks + list(range(e, s))
                out[n * group + g, i, :len(row)] = torch.tensor(row, dtype=torch.int32)
    return out


def special_scores(shape, gen, kind: str) -> torch.Tensor:
    """Scores built to stress the selection (see the module docstring)."""
    if kind == "normal":
        return torch.randn(shape, generator=gen)
    if kind == "ties":  # a handful of values: long runs of equal keys
        return torch.randint(-2, 3, shape, generator=gen).float()
    if kind == "specials":
        pool = torch.tensor([math.nan, math.inf, -math.inf, 0.0, -0.0, 1.0, -1.0, 3.5,
                             torch.finfo(torch.float32).max, -torch.finfo(torch.float32).tiny])
        return pool[torch.randint(0, len(pool), shape, generator=gen)]
    if kind == "bf16-near":  # distinct floats that round to few bf16 values
        base = torch.randint(0, 4, shape, generator=gen).float()
        return (1.0 + base / 8) * (1 + torch.randint(-60, 60, shape, generator=gen) * 2.0**-16)
    if kind == "bf16-halfway":  # exactly between two bf16 values: ties to even
        base = 1.0 + torch.randint(0, 128, shape, generator=gen).float() / 128 + 2.0**-8
        return base * (torch.randint(0, 2, shape, generator=gen).float() * 2 - 1)
    if kind == "near-max":  # round to +-inf at bf16
        sign = torch.randint(0, 2, shape, generator=gen).float() * 2 - 1
        return sign * torch.finfo(torch.float32).max * (1 - torch.rand(shape, generator=gen)
                                                        * 2.0**-9)
    raise ValueError(kind)


def random_tile(seed: int, kind: str, *, nk=2, c=9, group=3, kmax=70):
    """A tile's per-block facts, scores and the first ranking block."""
    gen = torch.Generator().manual_seed(seed)
    s2 = torch.sort(torch.randint(0, kmax + 1, (c,), generator=gen)).values
    sink_end = torch.minimum(torch.randint(0, 4, (c,), generator=gen), s2)
    window = torch.minimum(torch.randint(0, 5, (c,), generator=gen), s2 - sink_end)
    cand_end = s2 - window
    n_cand = cand_end - sink_end
    choice = torch.randint(0, 5, (c,), generator=gen)
    rand_take = (torch.rand(c, generator=gen) * n_cand).long()
    take = torch.where(choice == 0, 0, torch.where(choice == 1, n_cand - 1,
                       torch.where(choice == 2, n_cand, rand_take))).clamp(min=0)
    # Rows before the first ranking one take everything (as ops/cpu.py calls it).
    first_ranking = (take < n_cand).nonzero()
    ranked = int(first_ranking[0]) if first_ranking.numel() else c
    take[:ranked] = n_cand[:ranked]
    lo = int(sink_end[ranked:].min()) if ranked < c else 0
    width = (int(cand_end.max()) - lo + 3) if ranked < c else 0  # some padding columns
    scores = special_scores((nk, c - ranked, group, max(width, 1)), gen, kind)
    return nk, c, group, s2, sink_end, cand_end, take, scores, ranked, lo


@pytest.fixture(params=["vector", "scalar"])
def passes(request):
    """The selection's linear passes and the keys' packing for the products
    on AVX-512 (where the CPU has it) or in scalar code."""
    if request.param == "vector" and not native.select_vector():
        pytest.skip("no AVX-512 passes on this CPU")
    try:
        if request.param == "scalar":
            assert not native.select_vector(0)
        yield request.param
    finally:
        native.select_vector(-1)


@needs_kernel
@pytest.mark.parametrize("kind", ["normal", "ties", "specials", "bf16-near", "bf16-halfway",
                                  "near-max"])
@pytest.mark.parametrize("precision", [1, 2])
@pytest.mark.parametrize("seed", range(6))
def test_kernel_rows_equal_the_contract(kind, precision, seed, passes):
    nk, c, group, s2, sink_end, cand_end, take, scores, ranked, lo = random_tile(seed, kind)
    kmax = 70
    out = torch.full((nk * group, c, kmax), -1, dtype=torch.int32)
    native.select_rows(nk, c, group, s2, sink_end, cand_end, take, scores, ranked, lo,
                       precision, out)
    want = expected_rows(nk, c, group, s2, sink_end, cand_end, take, scores, ranked, lo,
                         precision, kmax)
    assert torch.equal(out, want)


def long_rows(kind: str, n: int, seed: int):
    """One KV head, three query blocks, two queries each, with ``n``
    candidates per row from block 0 (no sink, a window of 2) and budgets of
    1, a third of the candidates and all but one: rows long enough for the
    kernel's sampled floor (``csrc/select_rows.c``, ``pick``)."""
    gen = torch.Generator().manual_seed(seed)
    c, group = 3, 2
    s2 = torch.full((c,), n + 2, dtype=torch.int64)
    sink_end = torch.zeros(c, dtype=torch.int64)
    cand_end = torch.full((c,), n, dtype=torch.int64)
    take = torch.tensor([1, n // 3, n - 1], dtype=torch.int64)
    shape = (1, c, group, n)
    if kind == "comb-high":  # high keys on every 16th candidate only: an evenly
        # spaced sample of a power-of-two size up to n / 16 sees only them,
        # and the budget of n / 3 takes more than there are (the floor misses)
        scores = torch.randn(shape, generator=gen)
        scores[..., ::16] += 50
    elif kind == "comb-low":  # the sample sees only the lowest keys
        scores = torch.randn(shape, generator=gen)
        scores[..., ::16] -= 50
    else:
        scores = special_scores(shape, gen, kind)
    return 1, c, group, s2, sink_end, cand_end, take, scores, 0, 0


@needs_kernel
@pytest.mark.parametrize("kind", ["normal", "ties", "specials", "bf16-near", "comb-high",
                                  "comb-low"])
@pytest.mark.parametrize("n", [2047, 2048, 4096, 6007])
def test_long_rows_equal_the_contract(kind, n, passes):
    nk, c, group, s2, sink_end, cand_end, take, scores, ranked, lo = long_rows(kind, n, n)
    kmax = n + 2
    for precision in (1, 2):
        out = torch.full((nk * group, c, kmax), -1, dtype=torch.int32)
        native.select_rows(nk, c, group, s2, sink_end, cand_end, take, scores, ranked, lo,
                           precision, out)
        want = expected_rows(nk, c, group, s2, sink_end, cand_end, take, scores, ranked, lo,
                             precision, kmax)
        assert torch.equal(out, want), (kind, n, precision)


@needs_kernel
def test_kernel_writes_a_strided_view_only_where_rows_go():
    """A tile is a view into the whole output: neighbours stay untouched."""
    nk, c, group, s2, sink_end, cand_end, take, scores, ranked, lo = random_tile(3, "ties")
    kmax = 70
    whole = torch.full((nk * group, c + 4, kmax), -7, dtype=torch.int32)
    view = whole[:, 2:2 + c]
    view.fill_(-1)
    native.select_rows(nk, c, group, s2, sink_end, cand_end, take, scores, ranked, lo, 1, view)
    want = expected_rows(nk, c, group, s2, sink_end, cand_end, take, scores, ranked, lo, 1,
                         kmax)
    assert torch.equal(view, want)
    assert bool((whole[:, :2] == -7).all()) and bool((whole[:, 2 + c:] == -7).all())


@needs_kernel
@pytest.mark.parametrize("seed", range(6))
def test_rows_of_whole_lines_are_streamed_as_the_contract_writes_them(seed, passes):
    """Rows of whole 64-byte lines (Kmax a multiple of 16, the output
    aligned) are built aside and streamed out line by line (with the
    vector passes): the same rows, -1 after each row's length, and the
    tile's neighbours untouched. Rows of every length class: a few entries,
    a line and a bit, the whole row."""
    kmax = 304
    tile = random_tile(seed, ("normal", "ties", "specials")[seed % 3], kmax=kmax, c=12)
    nk, c, group, s2, sink_end, cand_end, take, scores, ranked, lo = tile
    for precision in (1, 2):
        whole = torch.full((nk * group, c + 4, kmax), -7, dtype=torch.int32)
        assert whole.data_ptr() % 64 == 0
        view = whole[:, 2:2 + c]  # rows of whole lines, 2 rows from the start
        view.fill_(-1)
        native.select_rows(*tile, precision, view)
        want = expected_rows(*tile, precision, kmax)
        assert torch.equal(view, want), (seed, precision)
        assert bool((whole[:, :2] == -7).all()) and bool((whole[:, 2 + c:] == -7).all())


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_kernel_threads_agree(threads):
    tile = random_tile(11, "ties", nk=4, c=40, group=4, kmax=300)
    nk, c, group, s2, sink_end, cand_end, take, scores, ranked, lo = tile
    with thread_count(torch.get_num_threads, torch.set_num_threads, threads):
        out = torch.full((nk * group, c, 300), -1, dtype=torch.int32)
        native.select_rows(*tile, 1, out)
    assert torch.equal(out, expected_rows(*tile, 1, 300))


def test_omp_threads_sets_the_count_and_gives_it_back_on_error():
    lib = native._libgomp()
    if lib is None:
        pytest.skip("torch here does not use libgomp")
    before = lib.omp_get_max_threads()
    with pytest.raises(RuntimeError, match="inside"):
        with native.omp_threads(before + 1):
            assert lib.omp_get_max_threads() == before + 1
            raise RuntimeError("inside")
    assert lib.omp_get_max_threads() == before


def test_kernel_builds_where_a_compiler_exists():
    if shutil.which("cc") is None:
        pytest.skip("no C compiler on this machine")
    assert native.kernel() is not None, native.status(native.SELECT_ROWS)
    assert native.status(native.SELECT_ROWS).startswith("native:")


def test_attention_kernel_builds_and_binds_where_a_compiler_exists():
    """Where a C compiler exists and torch has MKL on x86-64, the attention
    kernel must build and find torch's GEMMs, and CPU attention must use it
    (its own tests would otherwise skip and attention quietly run the gather
    backend)."""
    from stem_indexer.pipeline import dispatch
    from stem_indexer.operator.ops import sparse_attention as sa
    if shutil.which("cc") is None:
        pytest.skip("no C compiler on this machine")
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    if not x86 or not torch.backends.mkl.is_available():
        pytest.skip(f"no MKL in torch on {platform.machine()}: {sa.status()}")
    assert sa.available(), sa.status()
    assert native.status(sa.LIB).startswith("native:"), native.status(sa.LIB)
    assert sa.status().startswith("native:") and "sgemm" not in sa.status(), sa.status()
    for dtype in sa.DTYPES:
        assert dispatch._backend("auto", torch.zeros(1, 1, 4, 8, dtype=dtype)) == "native"


def test_status_reports_every_kernel():
    import stem_indexer
    from stem_indexer.operator.ops import sparse_attention as sa
    selection, scores = native.status().split("; scores: ", 1)
    passes = " (its linear passes on AVX-512)" if native.select_vector() else ""
    assert selection == "selection: " + native.status(native.SELECT_ROWS) + passes
    assert scores == native.bf16_scores_status()
    report = stem_indexer.status().splitlines()
    assert f"native selection: {native.status(native.SELECT_ROWS)}{passes}" in report
    assert f"native attention: {sa.status()}" in report
    assert f"bfloat16 scores: {native.bf16_scores_status()}" in report


@pytest.mark.parametrize("env, why", [
    ({"STEM_INDEXER_NATIVE": "0"}, "disabled by STEM_INDEXER_NATIVE=0"),
    ({"CC": "false"}, "compiling"),  # a compiler that always fails
])
def test_each_fallback_is_reported_and_warns_once(fresh_native, monkeypatch, env, why):
    """Without the kernels, status() says why for each, and the first call
    that falls back from one warns once (once per kernel)."""
    import warnings as w
    from stem_indexer.pipeline import dispatch
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    from stem_indexer.operator.ops import sparse_attention as sa
    for report in (native.status(native.SELECT_ROWS), sa.status()):
        assert report.startswith("torch fallback: ") and why in report, report
    fallbacks = {(p.op, p.dtype): p.fallback for p in dispatch.paths() if p.device == "cpu"}
    for path in (("indexer", "bfloat16"), ("attention", "float32"), ("attention", "bfloat16")):
        assert why in (fallbacks[path] or ""), (path, fallbacks)
    gen = torch.Generator().manual_seed(3)
    inputs = dict(qflat=torch.randint(-3, 4, (1, 2, 64, 8), generator=gen).bfloat16(),
                  kflat=torch.randint(-3, 4, (1, 1, 64, 8), generator=gen).bfloat16(),
                  vbias=torch.zeros(1, 1, 64), q_seq_lens=torch.tensor([1024], dtype=torch.int32),
                  kv_seq_lens=torch.tensor([1024], dtype=torch.int32))
    params = dict(stem_block_size=16, stem_stride=4)  # 64 blocks: budget 42, rows rank
    q = torch.randn(1, 2, 40, 8)
    for call in range(2):
        with w.catch_warnings(record=True) as caught:
            w.simplefilter("always")
            out = stem_indexer(**inputs, **params)
            assert dispatch._backend("auto", q) == "gather"
        messages = [str(c.message) for c in caught if issubclass(c.category, RuntimeWarning)]
        if call == 0:
            assert len(messages) == 2, messages
            assert any("native selection kernel" in m and why in m for m in messages)
            assert any("native attention kernel" in m and why in m for m in messages)
        else:
            assert messages == []
    want = stem_indexer_reference(**inputs, **params)
    assert torch.equal(out[0], want[0]) and torch.equal(out[1], want[1])
    assert bool((want[1] < want[1].amax()).any())  # rows were ranked


def _op_case():
    gen = torch.Generator().manual_seed(5)
    q = torch.randint(-3, 4, (1, 4, 12, 8), generator=gen).to(torch.bfloat16)
    k = torch.randint(-3, 4, (1, 2, 12, 8), generator=gen).to(torch.bfloat16)
    vb = torch.zeros(1, 2, 12)
    lens = torch.tensor([12 * 16], dtype=torch.int32)
    params = dict(stem_block_size=16, stem_stride=16, initial_blocks=1, window_size=1,
                  k_block_num_rate_medium=0.0, k_block_num_bias_medium=3)
    return dict(qflat=q, kflat=k, vbias=vb, q_seq_lens=lens, kv_seq_lens=lens), params


@pytest.mark.parametrize("env, why", [
    ({"STEM_INDEXER_NATIVE": "0"}, "disabled by STEM_INDEXER_NATIVE=0"),
    ({"CC": "no-such-compiler-here"}, "no C compiler"),
    ({"CC": "false"}, "compiling select_rows.c failed"),  # a compiler that always fails
])
def test_without_the_kernel_the_op_falls_back_to_torch(fresh_native, monkeypatch, env, why):
    inputs, params = _op_case()
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert native.kernel() is None
    status = native.status(native.SELECT_ROWS)
    assert status.startswith("torch fallback: ") and why in status
    out = stem_indexer(**inputs, **params)
    want = stem_indexer_reference(**inputs, **params)
    assert torch.equal(out[0], want[0]) and torch.equal(out[1], want[1])
    assert bool((out[1] < out[1].amax()).any())  # the budget binds: rows were ranked


@needs_kernel
def test_build_goes_to_the_cache_dir_and_is_reused(fresh_native):
    assert native.kernel() is not None
    built = list(fresh_native.glob("select_rows-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    native.reset()
    assert native.kernel() is not None
    assert built[0].stat().st_mtime_ns == stamp  # loaded, not rebuilt
    digest = built[0].with_suffix(".sha256")
    assert sorted(fresh_native.glob("*")) == sorted([*built, digest])  # no temporary left
    assert digest.read_text().strip() == hashlib.sha256(built[0].read_bytes()).hexdigest()


def test_concurrent_calls_from_python_threads_agree():
    """Two threads calling the op at once (each its own kernel team and
    workspace) get what one call alone gets."""
    from concurrent.futures import ThreadPoolExecutor
    inputs, params = _op_case()
    want = stem_indexer(**inputs, **params)
    with ThreadPoolExecutor(2) as pool:
        outs = list(pool.map(lambda _: stem_indexer(**inputs, **params), range(8)))
    for out in outs:
        assert torch.equal(out[0], want[0]) and torch.equal(out[1], want[1])


needs_bf16_scores = pytest.mark.skipif(not native.bf16_scores_available(16),
                                       reason=native.bf16_scores_status())

#: how the scores are multiplied: bfloat16 products, or float32 GEMMs on keys
#: widened chunk by chunk (their magnitude bounded in that pass) or copied
#: once per batch (bounded before the products)
PRODUCTS = [pytest.param("bfloat16", marks=needs_bf16_scores), "float32-widened",
            "float32-cached"]


@pytest.fixture
def products(request, monkeypatch):
    """The scores' products as the test's parameter asks (``PRODUCTS``)."""
    from stem_indexer.operator.ops import cpu
    if request.param != "bfloat16":
        monkeypatch.setattr(torch_blas, "bf16_products_pay", lambda: (False, "the test's"))
    if request.param != "float32-cached":
        monkeypatch.setattr(cpu, "KEY_CACHE_BYTES", 0)
    return request.param


# --------------------------------------------------------------------------- #
# Dot products that overflow float32
# --------------------------------------------------------------------------- #

BF16_MAX = torch.finfo(torch.bfloat16).max


def overflow_case(seed: int, nq: int, nk: int, qmax: int):
    """Inputs whose dot products overflow float32: entries of +-bf16 max (one
    product alone is past float32's range; in most dots two of opposite signs,
    so that the result depends on the order of summation and on fused
    multiply-adds: +inf, -inf or NaN), NaN and inf on some rows, small
    integers elsewhere; two batches."""
    gen = torch.Generator().manual_seed(seed)
    df = 16
    q = torch.randint(-3, 4, (2, nq, qmax, df), generator=gen).float()
    k = torch.randint(-3, 4, (2, nk, qmax, df), generator=gen).float()
    q[..., :2] = torch.where(torch.rand(q.shape[:3], generator=gen)[..., None] < 0.9, BF16_MAX,
                             q[..., :2])
    sign = torch.randint(0, 2, k.shape[:3], generator=gen) * 2.0 - 1
    k[..., 0], k[..., 1] = sign * BF16_MAX, -sign * BF16_MAX
    k[0, 0, 5, 3], q[1, -1, 9, 4], k[1, -1, 20] = math.nan, math.inf, -math.inf
    vbias = torch.randn(2, nk, qmax, generator=gen)
    lens = torch.tensor([qmax * 16, (qmax - 9) * 16 - 5], dtype=torch.int32)
    return dict(qflat=q.bfloat16(), kflat=k.bfloat16(), vbias=vbias, q_seq_lens=lens,
                kv_seq_lens=lens)


def check_overflowing_dots_equal_the_reference(seeds=range(2)):
    """The op on overflow_case inputs equals the reference exactly, causal or
    not, at both score precisions (the selection as this process runs it)."""
    for seed in seeds:
        # One head (where the CPU path's products are narrow along a causal
        # diagonal), and GQA.
        inputs = overflow_case(seed, *((1, 1, 100) if seed % 2 == 0 else (4, 2, 64)))
        dots = inputs["qflat"][0, 0].float() @ inputs["kflat"][0, 0].float().T
        assert bool(dots.isnan().any()) and bool(dots.isinf().any())
        for causal in (True, False):
            for precision in (1, 2):
                params = dict(stem_block_size=16, stem_stride=4, causal=causal,
                              topk_score_precision=precision)
                got = stem_indexer(**inputs, **params)
                want = stem_indexer_reference(**inputs, **params)
                assert torch.equal(got[1], want[1]) and bool((want[1] < want[1].amax()).any())
                assert torch.equal(got[0], want[0]), (seed, causal, precision)


@pytest.mark.parametrize("products", PRODUCTS, indirect=True)
@pytest.mark.parametrize("selection,cached", [("native", True), ("native", False),
                                              ("torch", True)], indirect=["selection"],
                         ids=["native-all-heads", "native-head-by-head", "torch-all-heads"])
def test_overflowing_dots_select_as_the_reference(selection, cached, products, monkeypatch):
    """The batch's products kept for all heads, or made again per tile,
    whichever way the scores are multiplied."""
    from stem_indexer.operator.ops import cpu
    if not cached:
        monkeypatch.setattr(cpu, "EXACT_CACHE_BYTES", 0)
    check_overflowing_dots_equal_the_reference()


@pytest.mark.slow  # a process of its own each: two seconds and more
@pytest.mark.parametrize("mkl,aten", [("AVX2", "avx2"), ("SSE4_2", "default")])
def test_overflowing_dots_select_as_the_reference_on_other_instruction_sets(mkl, aten):
    """The same under another instruction set of MKL and of torch's kernels
    (in a process of its own: the choice is made at start-up)."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import test_native; "
            "test_native.check_overflowing_dots_equal_the_reference(range(1))")
    env = dict(os.environ, MKL_ENABLE_INSTRUCTIONS=mkl, ATEN_CPU_CAPABILITY=aten)
    proc = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]


# --------------------------------------------------------------------------- #
# The bfloat16 products of the scores
# --------------------------------------------------------------------------- #

@pytest.fixture(autouse=True)
def bf16_products_where_they_run(monkeypatch):
    """The op takes bfloat16 products wherever the CPU can run them, also
    where its dispatch prefers float32 GEMMs (an Intel CPU without AMX:
    ``torch_blas.bf16_products_pay``), so that they are tested there too; a
    test of that choice sets it itself."""
    monkeypatch.setattr(torch_blas, "bf16_products_pay", lambda: (True, "the tests' choice"))




@pytest.fixture(params=["micro-kernel", "vdpbf16ps"])
def product_kernel(request, monkeypatch):
    """The bfloat16 products on torch's micro-kernel, or on this library's
    vdpbf16ps kernel wherever the CPU has the instruction (also on an AMX
    CPU, which otherwise uses the micro-kernel)."""
    if request.param == "vdpbf16ps":
        lib = native.load(native.SELECT_ROWS)
        if ("avx512_bf16" not in torch_blas.cpu_flags().split() or lib is None
                or lib.stem_scores_dp_built() != 1):
            pytest.skip("no vdpbf16ps on this CPU or compiler")
        monkeypatch.setattr(native, "dp_scores", lambda: True)
    else:
        monkeypatch.setattr(native, "dp_scores", lambda: False)
    return request.param


@needs_bf16_scores
@pytest.mark.parametrize("heads,group,m,n,k", [(1, 1, 1, 1, 16), (2, 3, 33, 70, 16),
                                               (3, 1, 64, 512, 128), (1, 2, 100, 65, 2048),
                                               (2, 2, 5, 0, 16), (2, 4, 40, 700, 16),
                                               (1, 1, 3, 130, 2084)])
@pytest.mark.parametrize("stream", [False, True], ids=["stored", "streamed"])
def test_bf16_scores_equal_the_float32_product(heads, group, m, n, k, passes, stream,
                                               product_kernel):
    """Integer-valued inputs: exactly the float32 product of the upcast
    inputs, then ``* scale`` and ``+ bias`` rounded one after the other (as
    the float32 path rounds them); others within float32 summation error.
    Query rows of a longer buffer, keys strided by row, the output a strided
    view whose other columns stay untouched: rows off the 64-byte grid, and
    rows on it (whole tile rows then go through streaming stores where
    ``stream``). With the keys packed either way (k = 2084: a tail of pairs
    short of 16), on either product kernel."""
    if product_kernel == "vdpbf16ps" and passes == "scalar":
        pytest.skip("the vdpbf16ps kernel packs on AVX-512 whatever the passes")
    gen = torch.Generator().manual_seed(m + n + k + group)
    assert native.bf16_scores_available(k)
    scale = float(torch.tensor(1 / 3.0))  # rounds: a fused multiply-add would differ
    for integers in (True, False):
        def make(*shape):
            if integers:
                return torch.randint(-8, 9, shape, generator=gen).bfloat16()
            return torch.randn(shape, generator=gen).bfloat16()
        a = make(heads, group, m + 3, k)[:, :, 2:m + 2]
        keys = make(heads, n, k + 6)[..., 3:k + 3]
        bias = torch.rand(heads, n + 5, generator=gen)[:, 2:n + 2]
        for with_bias, skip in ((True, 4), (False, 4), (True, 0), (False, 0)):
            # skip 4: rows off the 64-byte grid; 0: every row on it (the
            # buffer is 64-byte aligned and rows are whole lines apart)
            wide = torch.full((heads, m, group, (n + 9 + 15) // 16 * 16), math.nan)
            assert wide.data_ptr() % 64 == 0
            out = wide[..., skip:n + skip]
            native.scores_bf16(a, keys, out, scale, bias if with_bias else None, stream)
            assert wide[..., :skip].isnan().all() and wide[..., n + skip:].isnan().all()
            prod = (a.double() if not integers else a.float()) @ (
                keys.double() if not integers else keys.float()).transpose(1, 2)[:, None]
            prod = prod.transpose(1, 2)  # (heads, m, group, n)
            if integers:
                want = prod.mul_(scale)
                if with_bias:
                    want.add_(bias[:, None, None, :])
                assert torch.equal(out, want)
            elif n:
                want = prod * scale + (bias[:, None, None, :].double() if with_bias else 0)
                err = float((out.double() - want).abs().max())
                assert err <= 1e-6 * k * float(want.abs().max() + 1)


@pytest.mark.parametrize("bf16", ["bf16-products", "bf16-streamed", "float32-gemm"])
def test_scores_on_either_product_select_as_the_reference(bf16, monkeypatch):
    """Integer-valued inputs select exactly as the reference whichever way
    the scores are multiplied (bfloat16 where the CPU has it, their rows
    padded and, for large buffers, streamed; strided keys and elsewhere
    float32), native and torch selection alike."""
    if bf16 == "bf16-streamed":  # as large buffers are
        monkeypatch.setattr(cpu, "STREAM_SCORES_BYTES", 0)
    bf16 = bf16 != "float32-gemm"
    if bf16 and not native.bf16_scores_available(20):
        pytest.skip(native.bf16_scores_status())
    calls = []
    real = native.scores_bf16
    monkeypatch.setattr(native, "scores_bf16",  # records whether each call streams
                        lambda *a, **kw: (calls.append(len(a) > 5 and a[5]), real(*a, **kw))[1])
    # bfloat16 products where they can run, taken even where the float32
    # GEMM is the faster (an Intel CPU without AMX); else the float32 GEMMs
    # the dispatch takes where bfloat16 products do not pay
    monkeypatch.setattr(torch_blas, "bf16_products_pay", lambda: (bf16, "as the test sets"))
    gen = torch.Generator().manual_seed(9)
    kflat = torch.randint(-3, 4, (2, 2, 20, 70), generator=gen).bfloat16()
    inputs = dict(qflat=torch.randint(-3, 4, (2, 4, 70, 20), generator=gen).bfloat16(),
                  kflat=kflat.transpose(2, 3).contiguous(), vbias=torch.zeros(2, 2, 70),
                  q_seq_lens=torch.tensor([1120, 900], dtype=torch.int32),
                  kv_seq_lens=torch.tensor([1120, 1000], dtype=torch.int32))
    params = dict(stem_block_size=16, stem_stride=4)
    want = stem_indexer_reference(**inputs, **params)
    assert bool((want[1] < want[1].amax()).any())  # rows rank
    for kind in ("native", "torch"):
        with monkeypatch.context() as m:
            if kind == "torch":
                m.setattr(native, "kernel", lambda: None)
            for keys in (inputs["kflat"], kflat.transpose(2, 3)):  # contiguous, strided
                out = stem_indexer(**{**inputs, "kflat": keys}, **params)
                assert torch.equal(out[0], want[0]) and torch.equal(out[1], want[1]), kind
    assert bool(calls) == bf16
    assert any(calls) == (cpu.STREAM_SCORES_BYTES == 0 and bf16)


@needs_bf16_scores
def test_bf16_scores_probe_failure_falls_back_with_the_reason(monkeypatch):
    """A micro-kernel that fails its probe for a Df (here: a child that
    aborts, as an uncaught C++ exception would): float32 GEMMs for that Df,
    the reason in status(), one warning; odd Df never take bfloat16."""
    import warnings as w
    from stem_indexer.operator.ops import torch_blas
    monkeypatch.setattr(native, "_bf16_probed", {})
    monkeypatch.setattr(native, "_warned", set())
    monkeypatch.setattr(torch_blas, "PROBE_CODE", "import os; os.abort()")
    with pytest.warns(RuntimeWarning, match="float32 GEMM for Df=24 .*signal"):
        assert not native.bf16_scores_available(24)
    with w.catch_warnings():
        w.simplefilter("error")
        assert not native.bf16_scores_available(24)  # probed once, warned once
    assert "float32 GEMM for Df=24" in native.status()
    assert not native.bf16_scores_available(17)


# --------------------------------------------------------------------------- #
# Large outputs on huge pages
# --------------------------------------------------------------------------- #


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("isa", [0, 1, 2])
def test_fill32_sets_exactly_its_words_at_any_start_and_length(threads, isa):
    """``stem_fill32`` (streaming stores over whole 64-byte lines, ordinary
    ones at either end) sets each word of its range and no other, from
    starts off the line and lengths that end inside one: with ordinary
    stores (isa 0), and with AVX2's and AVX-512's streaming stores where
    the CPU has them."""
    needs = {1: "avx2", 2: "avx512f"}.get(isa)
    if needs and needs not in torch_blas.cpu_flags().split():
        pytest.skip(f"no {needs} on this CPU")
    lib = native.kernel()
    base = torch.zeros(4096 + 64, dtype=torch.int32)
    for start, words in [(0, 4096), (1, 4095), (5, 16), (3, 7), (15, 17), (16, 33), (7, 0)]:
        buf = base.clone()
        lib.stem_fill32(buf[start:].data_ptr(), words, 0xDEADBEEF, threads, isa)
        want = base.clone()
        want[start:start + words] = torch.tensor(0xDEADBEEF, dtype=torch.int64).to(torch.int32)
        assert torch.equal(buf, want), (start, words)


@pytest.mark.parametrize("dtype", [torch.int32, torch.float32, torch.int64])
def test_filled_large_outputs_of_any_dtype_equal_full(dtype):
    """Four-byte values go through stem_fill32 (their bits as a word), the
    others through torch: either way torch.full's tensor."""
    shape = (3, native.HUGE_PAGE_MIN_BYTES // 4 // 3 + 17)
    value = -2.5 if dtype.is_floating_point else -7
    assert torch.equal(native.filled(shape, value, dtype), torch.full(shape, value, dtype=dtype))


@pytest.mark.parametrize("elements", [1000, native.HUGE_PAGE_MIN_BYTES // 4 + 12345])
def test_filled_equals_full_and_asks_huge_pages_for_the_aligned_interior(elements, monkeypatch):
    """``filled`` gives torch.full's tensor; from HUGE_PAGE_MIN_BYTES on it
    first asks madvise for huge pages over exactly the 2 MiB pages that lie
    inside the tensor's memory (none outside it), and a refusal changes
    nothing."""
    asked = []

    def madvise(start, length, advice):
        asked.append((start, length, advice))
        return -1  # refused: the values must not depend on it
    monkeypatch.setattr(native, "_madvise", lambda: madvise)
    out = native.filled((elements,), -1, torch.int32)
    assert torch.equal(out, torch.full((elements,), -1, dtype=torch.int32))
    if out.nbytes < native.HUGE_PAGE_MIN_BYTES:
        assert asked == []
        return
    (start, length, advice), = asked
    lo, hi = out.data_ptr(), out.data_ptr() + out.nbytes
    assert advice == 14 and start % native.HUGE_PAGE == 0 and length % native.HUGE_PAGE == 0
    assert lo <= start and start - lo < native.HUGE_PAGE  # the first whole page inside
    assert start + length <= hi and hi - (start + length) < native.HUGE_PAGE


def test_filled_without_transparent_huge_pages_on_request(tmp_path, monkeypatch):
    """Where the kernel's mode is not ``madvise`` (``always``: pages come
    unasked; ``never``), nothing is asked and the tensor is the same."""
    for mode in ("[always] madvise never", "always madvise [never]"):
        (tmp_path / "enabled").write_text(mode + "\n")
        monkeypatch.setattr(native, "THP_MODE", tmp_path / "enabled")
        native._madvise.cache_clear()
        assert native._madvise() is None
        out = native.filled((native.HUGE_PAGE_MIN_BYTES // 4 + 1,), 7, torch.int32)
        assert bool((out == 7).all())
    native._madvise.cache_clear()
    monkeypatch.undo()  # this machine's own mode and madvise
    assert torch.equal(native.filled(BIG, -1, torch.int32), torch.full(BIG, -1, dtype=torch.int32))


BIG = (3, native.HUGE_PAGE_MIN_BYTES // 12 + 5)  # one large output's shape (int32)


def _holders():
    """Ways a caller keeps a large output's memory alive without its tensor."""
    np = pytest.importorskip("numpy")
    return {
        "nothing": lambda t: None,
        "the tensor": lambda t: t,
        "a view": lambda t: t[1:, 7:],
        "its storage": lambda t: t.untyped_storage(),
        "a tensor on its storage": lambda t: torch.empty(0, dtype=t.dtype).set_(
            t.untyped_storage(), 0, t.shape),
        "a numpy array": lambda t: np.asarray(t.numpy()),
        "a flattened alias": lambda t: t.view(-1),
    }


@pytest.mark.parametrize("holder", list(_holders()))
def test_filled_hands_out_released_memory_again_never_memory_in_use(holder):
    """A large output's memory goes to the next output of its size only once
    nothing refers to it: what a caller still holds (however) keeps its
    values, and every output is all ``value`` whatever was written before."""
    native.release_outputs()
    hold = _holders()[holder]
    first = native.filled(BIG, -1, torch.int32)
    first.fill_(7)
    address = first.data_ptr()
    kept = hold(first)
    del first
    second = native.filled(BIG, -1, torch.int32)
    assert torch.equal(second, torch.full(BIG, -1, dtype=torch.int32))
    if kept is None:
        assert second.data_ptr() == address  # the released memory, filled again
        assert native.kept_output_bytes() == 0  # lent out again
    else:
        assert second.data_ptr() != address
        still = kept if isinstance(kept, torch.Tensor) else (
            torch.empty(0, dtype=torch.int32).set_(kept) if isinstance(kept, torch.UntypedStorage)
            else torch.from_numpy(kept))
        assert bool((still == 7).all())
    del second, kept
    native.release_outputs()
    assert native.kept_output_bytes() == 0


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="no /proc/self/maps")
def test_filled_large_outputs_are_private_memory():
    """A large output's mapping is private (``rw-p``): a shared one would be
    written through by forked children, and is not given huge pages."""
    out = native.filled(BIG, -1, torch.int32)
    address = out.data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        lo, hi = (int(v, 16) for v in line.split()[0].split("-"))
        if lo <= address < hi:
            assert line.split()[1] == "rw-p", line
            break
    else:
        pytest.fail("the output's mapping is not in /proc/self/maps")


def test_filled_keeps_the_last_outputs_only_and_each_size_apart():
    """At most ``OUTPUTS_KEPT`` mappings are kept; an output of another size
    never takes a kept one; ``release_outputs`` unmaps the released ones;
    small outputs are ordinary tensors."""
    native.release_outputs()
    nbytes = math.prod(BIG) * 4
    outs = [native.filled(BIG, -1, torch.int32) for _ in range(native.OUTPUTS_KEPT + 2)]
    assert native.kept_output_bytes() == 0  # all in use
    del outs
    assert native.kept_output_bytes() == native.OUTPUTS_KEPT * nbytes
    other = (BIG[0], BIG[1] + 1)
    wider = native.filled(other, 3, torch.int32)  # a mapping of its own; the oldest goes
    assert bool((wider == 3).all())
    assert native.kept_output_bytes() == (native.OUTPUTS_KEPT - 1) * nbytes
    del wider
    assert native.kept_output_bytes() == (native.OUTPUTS_KEPT - 1) * nbytes + 4 * math.prod(other)
    native.release_outputs()
    assert native.kept_output_bytes() == 0
    small = native.filled((5, 7), -1, torch.int32)
    assert small.untyped_storage().resizable() and native.kept_output_bytes() == 0


@pytest.mark.parametrize("first_mode", ["inference_mode", "no_grad"])
def test_filled_memory_released_in_one_grad_mode_serves_the_other(first_mode):
    """A large output made under ``torch.inference_mode()`` and released
    serves the next one outside it (an ordinary, writable tensor), and the
    other way round."""
    native.release_outputs()
    modes = [torch.inference_mode, torch.no_grad]
    if first_mode == "no_grad":
        modes.reverse()
    with modes[0]():
        first = native.filled(BIG, -1, torch.int32)
        address = first.data_ptr()
    del first
    with modes[1]():
        second = native.filled(BIG, -1, torch.int32)
    assert second.data_ptr() == address
    assert second.is_inference() == (modes[1] is torch.inference_mode)
    if not second.is_inference():
        second.add_(1)  # writable outside inference mode
        assert bool((second == 0).all())
    del second
    native.release_outputs()


@needs_bf16_scores
@pytest.mark.skipif(not native.dp_scores(), reason="no vdpbf16ps kernel on this CPU")
def test_own_bf16_kernel_gives_torch_micro_kernels_floats(monkeypatch):
    """The vdpbf16ps kernel against torch's micro-kernel on random inputs
    with every tail (rows not a multiple of 6, keys of 64, pairs of 16)."""
    gen = torch.Generator().manual_seed(5)
    a = torch.randn(2, 3, 37, 2084, generator=gen).bfloat16()
    keys = torch.randn(2, 201, 2084, generator=gen).bfloat16()
    bias = torch.rand(2, 201, generator=gen)
    assert native.bf16_scores_available(2084)
    ours, theirs = (torch.full((2, 37, 3, 201), math.nan) for _ in range(2))
    native.scores_bf16(a, keys, ours, 0.3, bias)
    monkeypatch.setattr(native, "dp_scores", lambda: False)
    native.scores_bf16(a, keys, theirs, 0.3, bias)
    assert torch.equal(ours, theirs)


@needs_bf16_scores
@pytest.mark.parametrize("kernel", ["vdpbf16ps", "micro-kernel"])
def test_bf16_scores_report_the_largest_inputs_they_read(kernel, passes, monkeypatch):
    """The products return max |keys| over the keys they multiply and max |a|
    over the query rows (inf for an infinite one, NaN for a NaN), none of
    the buffers around them: what decides whether a tile's products may
    overflow (ops/cpu.py)."""
    if kernel == "vdpbf16ps" and not native.dp_scores():
        pytest.skip("no vdpbf16ps kernel on this CPU")
    if kernel == "vdpbf16ps" and passes == "scalar":
        pytest.skip("the vdpbf16ps kernel packs on AVX-512 whatever the passes")
    if kernel == "micro-kernel":
        monkeypatch.setattr(native, "dp_scores", lambda: False)
    gen = torch.Generator().manual_seed(11)
    k, n = 2084, 201  # tails of 16 pairs and of 64 keys
    assert native.bf16_scores_available(k)
    a = torch.randn(2, 3, 7, k, generator=gen).bfloat16()
    wide = torch.randn(2, n + 6, k + 4, generator=gen).bfloat16()
    wide[:, :3], wide[:, n + 3:], wide[..., :2], wide[..., k + 2:] = 1e30, -1e30, 1e30, math.inf
    keys = wide[:, 3:n + 3, 2:k + 2]
    out = torch.empty(2, 7, 3, n)

    def largest(x: torch.Tensor) -> float:
        keys_max, a_max = native.scores_bf16(a, x, out[..., :x.shape[1]])
        assert a_max == (float(a.float().abs().max()) if x.shape[1] else 0.0)
        return keys_max

    assert largest(keys) == float(keys.float().abs().max())
    keys[1, 200, 2083] = -3e38  # the last element of the last key read
    assert largest(keys) == float(torch.tensor(-3e38).bfloat16().abs())
    keys[0, 64, 1000] = -math.inf
    assert largest(keys) == math.inf
    keys[1, 0, 17] = math.nan
    assert math.isnan(largest(keys))
    assert largest(keys[:, :0]) == 0.0  # nothing read

    # The queries: rows 1..7 of 9 per head (6 + 1: a register tile and a tail).
    wide_a = torch.randn(2, 3, 9, k, generator=gen).bfloat16()
    wide_a[:, :, 0], wide_a[:, :, 8] = 1e30, -math.inf
    a = wide_a[:, :, 1:8]
    keys = torch.randn(2, n, k, generator=gen).bfloat16()

    def largest_a() -> float:
        return native.scores_bf16(a, keys, out)[1]

    assert largest_a() == float(a.float().abs().max())
    assert native.scores_bf16(a, keys, out, queries=False)[1] == 0.0  # not scanned
    a[1, 2, 6, k - 1] = 3e38  # the last element of the last row
    assert largest_a() == float(torch.tensor(3e38).bfloat16())
    a[0, 1, 3, 5] = -math.inf
    assert largest_a() == math.inf
    a[1, 0, 0, 0] = math.nan
    assert math.isnan(largest_a())


@pytest.mark.skipif(native.load(native.SELECT_ROWS) is None, reason="no native kernel here")
def test_widened_keys_are_torchs_conversion_and_their_largest_magnitude():
    """``native.widen_bf16``: torch's float32 conversion bit for bit (every
    bfloat16 pattern, subnormals and NaN payloads included), strided heads,
    pieces split between threads; the largest magnitude as torch finds it,
    inf with an inf, NaN with a NaN; None where the heads are not contiguous."""
    every = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    finite = every[every.float().isfinite()]
    gen = torch.Generator().manual_seed(3)
    for keys in (every.view(4, 128, 128), finite[:40000].view(5, 50, 160),
                 torch.randn(3, 700, 64, generator=gen).bfloat16()[:, 100:600]):
        out = torch.empty(keys.shape)
        bound = native.widen_bf16(keys, out)
        assert torch.equal(out.view(torch.int32), keys.float().view(torch.int32))
        want = keys.float().abs().max()
        assert math.isnan(bound) if want.isnan() else bound == float(want)
    keys = torch.randn(2, 9, 8, generator=gen).bfloat16()
    keys[1, 4, 2] = -math.inf
    assert native.widen_bf16(keys, torch.empty(keys.shape)) == math.inf
    assert native.widen_bf16(keys[:, :, :4], torch.empty(2, 9, 4)) is None
    assert native.widen_bf16(keys[:, :0], torch.empty(2, 0, 8)) == 0.0


def exact_product_calls(monkeypatch, q: torch.Tensor, k: torch.Tensor, bs: int = 16):
    """Run the op on bf16 q and k (one batch, every block full, stride 4)
    against the reference; return the ``_ExactDots.products`` calls it made,
    as (r0, r1, lo, hi)."""
    from stem_indexer.operator.ops import cpu
    calls = []
    real = cpu._ExactDots.products
    monkeypatch.setattr(cpu._ExactDots, "products",
                        lambda self, *a: (calls.append(a), real(self, *a))[1])
    lens = torch.tensor([q.shape[2] * bs], dtype=torch.int32)
    inputs = dict(qflat=q.bfloat16(), kflat=k.bfloat16(), vbias=torch.zeros(k.shape[:3]),
                  q_seq_lens=lens, kv_seq_lens=lens)
    params = dict(stem_block_size=bs, stem_stride=4)
    got = stem_indexer(**inputs, **params)
    want = stem_indexer_reference(**inputs, **params)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    return calls


@pytest.mark.parametrize("products", PRODUCTS[:2], indirect=True)
def test_exact_products_only_for_tiles_whose_keys_may_overflow(products, monkeypatch):
    """With bfloat16 products, or keys widened chunk by chunk, the keys are
    checked by the products or the widening themselves: keys of bf16's
    largest magnitude in the sink blocks (kept whatever their score, never
    scored) cost no exact product; the same keys in a candidate block make
    the tiles that score it take the exact products. Both select as the
    reference."""
    gen = torch.Generator().manual_seed(4)
    nq, nk, qmax, df = 4, 2, 100, 16  # from about 56 blocks, rows rank
    for block, exact_calls in ((0, False), (12, True)):
        q = torch.randint(-3, 4, (1, nq, qmax, df), generator=gen).float()
        k = torch.randint(-3, 4, (1, nk, qmax, df), generator=gen).float()
        q[..., 0] = 2.0**100  # times the small keys: no overflow; times BF16_MAX: inf
        k[0, :, block, 0], k[0, :, block, 1] = BF16_MAX, -BF16_MAX  # dots past float32
        calls = exact_product_calls(monkeypatch, q, k)
        assert bool(calls) == exact_calls, (block, calls)
        assert all(lo <= block < hi for _, _, lo, hi in calls)


@pytest.mark.parametrize("products", PRODUCTS[:2], indirect=True)
@pytest.mark.parametrize("value", [BF16_MAX, math.nan])
def test_exact_products_only_for_tiles_whose_queries_may_overflow(value, products,
                                                                  monkeypatch):
    """The queries too are checked by the products: a query block of
    bfloat16's largest magnitude (or NaN) in a row that keeps all its
    candidates (never scored) costs no exact product; the same block in a
    row that ranks makes its tile take the exact products. Both select as
    the reference."""
    gen = torch.Generator().manual_seed(6)
    nq, nk, qmax, df = 4, 2, 100, 16  # from about 56 blocks, rows rank
    # row 60 is in the first product call's rows only (a causal tile's
    # later calls start further down); row 90 in every call's
    for row, exact_calls in ((10, False), (60, True), (90, True)):
        q = torch.randint(-3, 4, (1, nq, qmax, df), generator=gen).float()
        k = torch.randint(1, 4, (1, nk, qmax, df), generator=gen).float()
        q[0, 1, row, :2] = value  # dots past float32 (or NaN) with every key
        calls = exact_product_calls(monkeypatch, q, k)
        assert bool(calls) == exact_calls, (row, calls)
        assert all(r0 <= row < r1 for r0, r1, _, _ in calls)
