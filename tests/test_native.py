"""The CPU path's native selection kernel (``ops/native.py``, ``csrc/select_rows.c``).

* The kernel alone, on random tiles built to stress it (heavy ties, NaN,
  infinities, signed zeros, bf16 rounding to ties and to infinity, rows that
  take nothing, one less than all, or everything), against a direct
  statement of the contract: the ``take`` largest ``contract.rank_keys_at``
  of each row's candidates, ascending, after its sink and before its window.
* Its build: where a C compiler exists it must build (the suites' native
  variants would otherwise skip quietly); without one, or when disabled, the
  op falls back to torch selection with the same results.

The whole case table, the hand cases of docs/CONTRACT.md section 3 and the integer property tests
run on both selections too (the ``selection`` fixture of conftest.py).
"""

from __future__ import annotations

import hashlib
import math
import shutil

import pytest
import torch

from stem_indexer import contract, stem_indexer
from stem_indexer._threads import thread_count
from stem_indexer.ops import native
from stem_indexer.reference import stem_indexer_reference

needs_kernel = pytest.mark.skipif(native.kernel() is None, reason=native.status())


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


@needs_kernel
@pytest.mark.parametrize("kind", ["normal", "ties", "specials", "bf16-near", "near-max"])
@pytest.mark.parametrize("precision", [1, 2])
@pytest.mark.parametrize("seed", range(6))
def test_kernel_rows_equal_the_contract(kind, precision, seed):
    nk, c, group, s2, sink_end, cand_end, take, scores, ranked, lo = random_tile(seed, kind)
    kmax = 70
    out = torch.full((nk * group, c, kmax), -1, dtype=torch.int32)
    native.select_rows(nk, c, group, s2, sink_end, cand_end, take, scores, ranked, lo,
                       precision, out)
    want = expected_rows(nk, c, group, s2, sink_end, cand_end, take, scores, ranked, lo,
                         precision, kmax)
    assert torch.equal(out, want)


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
    assert native.kernel() is not None, native.status()
    assert native.status().startswith("native:")


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
    assert native.status().startswith("torch fallback: ") and why in native.status()
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
