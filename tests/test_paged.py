"""The paged entry point (``stem_indexer.pipeline.paged``): an engine's step on Stem.

Each test builds an engine step as a backend would see it: whole prompts'
keys and values written page by page (pages shuffled) into a paged KV cache
and an ``IndexCache`` (``IndexCache.write``, chunk after chunk), the rows'
new queries packed, a block table per row.

* Fresh rows (``context`` 0) give ``stem_attention``'s output on the same
  tokens, bit for bit, on every page size (with integer-valued keys where a
  block spans several pages, so that every order of the pages' sums is exact).
* A chunk that starts on a block boundary attends, without the value bias,
  exactly as the one-shot prefill does for its tokens; any chunk picks what
  the vLLM CPU backend's rows pick (``integrations/vllm/rows.py``).
* Dense rows (decode, short) are dense attention (float64 reference).
* Layouts: an HND cache viewed as NHD, table entries past a row's pages
  holding garbage: the same result.
* The Triton kernels (interpreted, ``tests/_interpreter.py``) pick exactly
  the CPU path's blocks, their kflat pass writes its bits, and their run
  attends as the torch run; on a GPU (``-k cuda``) the compiled ones pick
  the CPU path's blocks on a host copy of the step (exact scores) and attend
  as its run does, and a CUDA graph replays the run.
* The run reads nothing on the host, compiles with ``fullgraph=True,
  dynamic=True`` to eager's result; bad arguments name themselves.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass

import pytest
import torch
from _helpers import host_reads
from _interpreter import interpreted

import stem_indexer
from stem_indexer import IndexCache, StemIndexerInputError, stem_paged_plan, stem_paged_run
from stem_indexer.pipeline.paged import stem_paged_select
from stem_indexer.testing import reference_attention

# Small blocks and a small budget, so that a few thousand tokens are sparse.
SMALL = dict(stem_block_size=32, stem_stride=8, k_block_num_bias_medium=6,
             k_block_num_bias_large=6, dense_above=1.0)


@dataclass
class Step:
    """One engine step: the cache, the rows and their packed queries."""

    q: torch.Tensor  # [B, Hq, S, D] every prompt's queries (for one-shot references)
    k: torch.Tensor  # [B, Hkv, S, D]
    v: torch.Tensor
    query: torch.Tensor  # [T, Hq, D] the step's new queries
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    index_cache: IndexCache
    table: torch.Tensor
    query_lens: list
    seq_lens: list
    prompts: list

    def to(self, device) -> "Step":
        moved = {name: getattr(self, name).to(device) for name in
                 ("q", "k", "v", "query", "key_cache", "value_cache", "table")}
        c = self.index_cache
        cache = IndexCache(c.ksum.to(device), c.vmax.to(device), c.filled.to(device), c.page)
        return Step(**moved, index_cache=cache, query_lens=self.query_lens,
                    seq_lens=self.seq_lens, prompts=self.prompts)


def make_step(prompts, contexts, query_lens, *, page, stride, hq=4, hkv=2, dim=16,
              dtype=torch.float32, integer=False, hnd=False, seed=0, chunk=None,
              edit=None) -> Step:
    """Rows ``b`` of prompt ``prompts[b]`` with ``contexts[b]`` tokens cached
    and ``query_lens[b]`` new ones (in the cache too, as an engine writes
    them before attention). The index cache is written ``chunk`` tokens at a
    time (default: the context, then the new tokens). ``edit(q, k)`` may
    change the prompts' queries and keys in place before anything is written."""
    gen = torch.Generator().manual_seed(seed)
    batch, longest = len(prompts), max(prompts)
    if integer:
        q, k, v = (torch.randint(-3, 4, (batch, h, longest, dim), generator=gen).to(dtype)
                   for h in (hq, hkv, hkv))
    else:
        q = torch.randn(batch, hq, longest, dim, generator=gen).to(dtype) + 0.3
        k = torch.randn(batch, hkv, longest, dim, generator=gen).to(dtype)
        v = torch.randn(batch, hkv, longest, dim, generator=gen).to(dtype)
    if edit is not None:
        edit(q, k)
    need = [math.ceil((c + n) / page) for c, n in zip(contexts, query_lens)]
    num_pages = sum(need) + 5
    perm = torch.randperm(num_pages, generator=gen)
    table = torch.full((batch, max(need) + 2), -1, dtype=torch.int32)
    shape = (num_pages, hkv, page, dim) if hnd else (num_pages, page, hkv, dim)
    key_cache, value_cache = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    if hnd:
        key_cache, value_cache = key_cache.transpose(1, 2), value_cache.transpose(1, 2)
    cache = IndexCache.allocate(num_pages, page, stride, hkv, dim)
    at = 0
    for b, (c, n) in enumerate(zip(contexts, query_lens)):
        table[b, :need[b]] = perm[at:at + need[b]].to(torch.int32)
        at += need[b]
        cuts = [0, c, c + n] if chunk is None else [*range(0, c + n, chunk), c + n]
        for lo, hi in zip(cuts, cuts[1:]):
            if hi <= lo:
                continue
            pos = torch.arange(lo, hi)
            pages, offsets = table[b, pos // page].long(), pos % page
            kk, vv = k[b, :, lo:hi].transpose(0, 1), v[b, :, lo:hi].transpose(0, 1)
            key_cache[pages, offsets] = kk
            value_cache[pages, offsets] = vv
            cache.write(kk, vv, pages * page + offsets)
    query = torch.cat([q[b, :, c:c + n].transpose(0, 1)
                       for b, (c, n) in enumerate(zip(contexts, query_lens))])
    return Step(q, k, v, query, key_cache, value_cache, cache, table, list(query_lens),
                [c + n for c, n in zip(contexts, query_lens)], list(prompts))


def plan_for(step: Step, **kw):
    hq, dim = step.q.shape[1], step.q.shape[3]
    return stem_paged_plan(step.query_lens, step.seq_lens, num_prompt_tokens=step.prompts,
                           num_heads=hq, num_kv_heads=step.k.shape[1], head_dim=dim,
                           page_size=step.index_cache.page, dtype=step.q.dtype,
                           device=step.q.device, **kw)


def run(step: Step, plan):
    return stem_paged_run(step.query, step.key_cache, step.value_cache, step.index_cache,
                          step.table, plan)


def packed(x: torch.Tensor, step: Step) -> torch.Tensor:
    """[B, Hq, S, D] -> the step's new tokens, packed [T, Hq, D]."""
    return torch.cat([x[b, :, s - n:s].transpose(0, 1)
                      for b, (n, s) in enumerate(zip(step.query_lens, step.seq_lens))])


# --------------------------------------------------------------------------- #
# Against the contiguous path
# --------------------------------------------------------------------------- #

@pytest.mark.parametrize("page,integer,dtype", [
    (32, False, torch.float32),   # a page per block: kflat is stem_inputs's to the bit
    pytest.param(16, True, torch.float32, marks=pytest.mark.slow),  # two pages per block
    (8, True, torch.bfloat16),
    pytest.param(32, False, torch.bfloat16, marks=pytest.mark.slow),
])
def test_fresh_rows_are_stem_attention(page, integer, dtype):
    prompts = [2100, 1500, 1800]
    step = make_step(prompts, [0, 0, 0], prompts, page=page, stride=8, dtype=dtype,
                     integer=integer)
    with torch.inference_mode():
        plan = plan_for(step, **SMALL)
        want, info = stem_indexer.stem_attention(step.q, step.k, step.v, q_lens=prompts,
                                                 kv_lens=prompts, return_info=True, **SMALL)
        got = run(step, plan)
    assert info.path == "sparse" and "sparse" in plan.paths, (info, plan.paths)
    assert torch.equal(got, packed(want, step))


def test_chunks_on_block_boundaries_attend_as_the_one_shot_prefill():
    # Without the value bias (its statistics cover the keys so far), a chunk's
    # query blocks see the one-shot blocks' scores, positions and budgets.
    prompts = [2400, 2000]
    contexts, new = [1024, 640], [800, 1360]
    kw = {**SMALL, "oam": False}
    step = make_step(prompts, contexts, new, page=16, stride=8, integer=True)
    with torch.inference_mode():
        got = run(step, plan_for(step, **kw))
        want = stem_indexer.stem_attention(step.q, step.k, step.v, q_lens=prompts,
                                           kv_lens=prompts, num_prompt_tokens=prompts, **kw)
    assert torch.equal(got, packed(want, step))


@pytest.mark.parametrize("invariant", [False, True])
def test_a_plan_with_another_budget_picks_as_a_plan_made_with_it(invariant):
    """``with_budget`` (an engine's per-layer budget over one plan of the
    step) picks and attends as a plan made with that budget from the start,
    the OAM's window under ``chunk_invariant`` included."""
    prompts = [2400, 2000]
    step = make_step(prompts, [1024, 640], [800, 1360], page=16, stride=8, seed=3)
    wide = {**SMALL, "k_block_num_bias_medium": 20, "k_block_num_bias_large": 20,
            "k_block_num_rate_large": 0.2, "alpha": 0.5}
    with torch.inference_mode():
        plan = plan_for(step, **SMALL, chunk_invariant=invariant)
        direct = plan_for(step, **wide, chunk_invariant=invariant)
        shifted = plan.with_budget(direct.params)
        assert plan.with_budget(plan.params) is plan
        assert shifted.params == direct.params and shifted.paths == direct.paths
        if invariant:
            assert torch.equal(shifted.oam_runs, direct.oam_runs)
            assert not torch.equal(plan.oam_runs, direct.oam_runs)
        picks = [stem_paged_select(step.query, step.index_cache, step.table, p)
                 for p in (plan, shifted, direct)]
        assert torch.equal(picks[1][0], picks[2][0]) and torch.equal(picks[1][1], picks[2][1])
        assert int(picks[1][1].sum()) > int(picks[0][1].sum())  # the wider budget keeps more
        assert torch.equal(run(step, shifted), run(step, direct))


def test_a_plan_with_another_budget_refuses_other_parameters():
    plan = _plan(**SMALL)
    other = dataclasses.replace(plan.params, window_size=plan.params.window_size + 1)
    with pytest.raises(StemIndexerInputError, match=r"params\.window_size must be the plan's"):
        plan.with_budget(other)


@pytest.mark.parametrize("probe", [{}, {"probe_queries": 8, "probe_candidates": 3}])
def test_any_chunk_picks_what_the_vllm_cpu_rows_pick(probe):
    # With the probe (tests/test_probe.py), the rows read their keys too.
    from stem_indexer.integrations.vllm.rows import Row, plan_stem_row, select_blocks
    from stem_indexer.integrations.vllm.settings import StemSettings

    prompts, contexts, new = [3000, 2600, 900], [1000, 37, 700], [1100, 2563, 200]
    settings = StemSettings.from_mapping({"preset": "tight", "stem_block_size": 32,
                                          "stem_stride": 8, "exact_tail": 64, **probe})
    step = make_step(prompts, contexts, new, page=16, stride=8, seed=2, chunk=300)
    scale = 1 / math.sqrt(16)
    with torch.inference_mode():
        plan = plan_for(step, preset="tight", stem_block_size=32, stem_stride=8,
                        exact_tail=64, dense_above=1.0, min_q_blocks=1, **probe)
        idx, lengths = stem_paged_select(step.query, step.index_cache, step.table, plan,
                                         key_cache=step.key_cache)
        start = 0
        for b, (c, n) in enumerate(zip(contexts, new)):
            row = Row(b, start, n, c, prompts[b])
            row_plan = plan_stem_row(row, settings, step.table[b].long(), 16, 4, 2, 16)
            kflat, vbias = step.index_cache.inputs(step.table[b].long(), c + n, 32, True,
                                                   settings.oam_lambda)
            want_idx, want_len = select_blocks(step.query[start:start + n], kflat, vbias,
                                               row_plan, scale, settings,
                                               step.k[b].transpose(0, 1))
            qb = want_len.shape[1]
            assert torch.equal(lengths[b, :, :qb], want_len), f"row {b}"
            width = want_idx.shape[2]
            assert torch.equal(idx[b, :, :qb, :width], want_idx), f"row {b}"
            assert bool((idx[b, :, :qb, width:] == -1).all())
            start += n


def test_dense_rows_are_dense_attention():
    # A decode row, a short prompt (the budget keeps every block) and a long one.
    prompts, contexts, new = [3000, 300, 2500], [2999, 0, 0], [1, 300, 2500]
    step = make_step(prompts, contexts, new, page=16, stride=8, seed=3)
    with torch.inference_mode():
        plan = plan_for(step, **SMALL)
        got = run(step, plan)
    assert plan.paths == ("dense: decode", "dense: budget keeps every block", "sparse")
    start = 0
    for b in range(2):
        n, s = new[b], contexts[b] + new[b]
        want = reference_attention(step.q[b:b + 1, :, s - n:s], step.k[b:b + 1, :, :s],
                                   step.v[b:b + 1, :, :s], causal=True)
        assert torch.allclose(got[start:start + n], want[0].transpose(0, 1).float(),
                              atol=1e-5, rtol=1e-5)
        start += n


def test_layouts_and_table_garbage_change_nothing():
    prompts = [1700, 1200]
    kw = dict(page=16, stride=8, seed=4)
    nhd = make_step(prompts, [500, 0], [1200, 1200], **kw)
    hnd = make_step(prompts, [500, 0], [1200, 1200], hnd=True, **kw)
    with torch.inference_mode():
        plan = plan_for(nhd, **SMALL)
        want = run(nhd, plan)
        assert torch.equal(run(hnd, plan), want)
        used = math.ceil(1700 / 16), math.ceil(1200 / 16)
        for b, n in enumerate(used):
            nhd.table[b, n:] = 2**31 - 1 if b else -(2**31)
        assert torch.equal(run(nhd, plan), want)


# --------------------------------------------------------------------------- #
# The Triton kernels, interpreted
# --------------------------------------------------------------------------- #

@interpreted
@pytest.mark.parametrize("page,block", [(8, 32), pytest.param(16, 16, marks=pytest.mark.slow),
                                        pytest.param(32, 64, marks=pytest.mark.slow)])
def test_triton_kflat_pass_writes_the_torch_bits(page, block):
    from stem_indexer.operator.ops.triton.paged_index import paged_kflat

    gen = torch.Generator().manual_seed(page)
    cache = IndexCache.allocate(40, page, 8, 2, 24)
    cache.ksum.normal_(generator=gen)
    cache.ksum[3, 0, 0, :4] = -0.0
    seq = torch.tensor([300, 1, 0, 433], dtype=torch.int32)
    table = torch.randperm(40, generator=gen)[:30].to(torch.int32).repeat(4, 1)
    table[0, math.ceil(300 / page):] = 2**31 - 1  # past the row's pages: never read
    kmax = math.ceil(433 / block)
    got = paged_kflat(cache.ksum, table, seq, kmax, block, page)
    want, _ = cache.block_inputs(table, seq, kmax, block, oam=False, oam_lambda=0.0)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


# 8-token blocks: 56 of them (the least a sparse budget needs) in few tokens.
TINY_SPARSE = dict(stem_block_size=8, stem_stride=4, k_block_num_bias_medium=3,
                   k_block_num_bias_large=3, dense_above=1.0, exact_tail=16)


def _tiny_sparse_step(hnd=False):
    return make_step([480, 460, 300], [0, 203, 299], [480, 257, 1], page=8, stride=4, hq=2,
                     hkv=1, dim=16, seed=5, hnd=hnd, chunk=100)


def triton_picks_the_cpu_blocks(step: Step, host_step: Step, **kw):
    """The Triton path's picks on ``step`` (CUDA tensors, or CPU tensors
    interpreted) are the CPU path's (backend "torch" on the CPU: its own
    indexer kernel) on ``host_step``, the same step on the host. Returns the
    two plans (Triton's, the CPU's)."""
    with torch.inference_mode():
        host_plan = plan_for(host_step, backend="torch", **kw)
        plan = plan_for(step, backend="triton", **kw)
        assert plan.paths == host_plan.paths
        want = stem_paged_select(host_step.query, host_step.index_cache, host_step.table,
                                 host_plan)
        got = stem_paged_select(step.query, step.index_cache, step.table, plan)
    assert torch.equal(got[1].cpu(), want[1]) and torch.equal(got[0].cpu(), want[0])
    return plan, host_plan


@interpreted
def test_triton_picks_the_cpu_blocks():
    step = _tiny_sparse_step()
    plan, _ = triton_picks_the_cpu_blocks(step, step, **TINY_SPARSE)
    assert plan.paths == ("sparse", "sparse", "dense: decode")


def _runs_alike(step, **kw):
    with torch.inference_mode():
        triton_plan = plan_for(step, backend="triton", **kw)
        assert triton_plan.kernel == "triton" and triton_plan.attention == "triton"
        out = run(step, triton_plan)
        ref = run(step, plan_for(step, backend="torch", **kw))
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5), (out - ref).abs().max()


@interpreted
@pytest.mark.slow  # the default run: the same kernel in test_the_triton_backend_attends_as_...
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_triton_run_attends_as_the_torch_run(softcap):
    # Short rows (dense lists): the paged kernel against the gathered pages.
    step = make_step([200, 150, 90], [0, 77, 89], [200, 73, 1], page=8, stride=4, hq=2,
                     hkv=1, dim=16, seed=6, hnd=softcap is not None)
    _runs_alike(step, stem_block_size=16, stem_stride=4, softcap=softcap)


@interpreted
@pytest.mark.slow
@pytest.mark.parametrize("hnd", [False, True])
def test_triton_sparse_run_attends_as_the_torch_run(hnd):
    _runs_alike(_tiny_sparse_step(hnd), **TINY_SPARSE)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_paged_run_matches_the_cpu_path_and_replays_from_a_graph(dtype):
    """The compiled kernels against the CPU path on a host copy of the step.
    Integer keys and queries, a power-of-two indexer scale and no value bias
    make every score exact, so the Triton picks are the CPU indexer's to the
    block (ties to the lower block on both); the outputs agree within the
    dtype's rounding; a CUDA graph of the run replays it on new queries
    (equal to eager, and to the CPU run on them)."""
    prompts, contexts, new = [9000, 5000, 3000], [0, 2100, 2999], [9000, 2900, 1]
    host_step = make_step(prompts, contexts, new, page=16, stride=16, hq=8, hkv=2, dim=128,
                          dtype=dtype, seed=9, chunk=1024, integer=True)
    step = host_step.to("cuda")
    kw = dict(stem_block_size=128, stem_stride=16, dense_above=1.0, oam=False,
              indexer_scale=2.0 ** -6)
    plan, host_plan = triton_picks_the_cpu_blocks(step, host_step, **kw)
    assert plan.kernel == "triton" and plan.attention == "triton"
    assert "sparse" in plan.paths
    with torch.inference_mode():
        out = run(step, plan)
        assert torch.allclose(out.float().cpu(), run(host_step, host_plan).float(), atol=2e-2,
                              rtol=2e-2)
        query = step.query.clone()
        args = (query, step.key_cache, step.value_cache, step.index_cache, step.table, plan)
        side = torch.cuda.Stream()  # warm-up (kernels compiled) off the capture
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            stem_paged_run(*args)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = stem_paged_run(*args)
        query.copy_(query.flip(0))
        graph.replay()
        assert torch.equal(captured, stem_paged_run(*args))
        on_cpu = stem_paged_run(host_step.query.flip(0).contiguous(), host_step.key_cache,
                                host_step.value_cache, host_step.index_cache, host_step.table,
                                host_plan)
        assert torch.allclose(captured.float().cpu(), on_cpu.float(), atol=2e-2, rtol=2e-2)


# --------------------------------------------------------------------------- #
# The run: no host reads, compiled, checked
# --------------------------------------------------------------------------- #

def test_the_run_reads_nothing_on_the_host():
    prompts = [2100, 1500]
    step = make_step(prompts, [600, 0], [1500, 1500], page=16, stride=8, seed=6)
    with torch.inference_mode():
        plan = plan_for(step, **SMALL)
        assert host_reads(lambda: run(step, plan)) == []
        reads = host_reads(lambda: plan_for(step, **SMALL))
    assert any("paged.py" in r for r in reads), reads  # the plan does read: the spy sees


@pytest.mark.slow  # the planned run's compile is test_plan.py's in the default run
def test_the_run_compiles_with_fullgraph_and_dynamic_shapes():
    torch._dynamo.reset()
    compiled = torch.compile(stem_paged_run, fullgraph=True, dynamic=True)
    for prompts, contexts, new in (([2100, 1500], [600, 0], [1500, 1500]),
                                   ([2600, 900], [0, 899], [2600, 1])):
        step = make_step(prompts, contexts, new, page=16, stride=8, seed=7)
        with torch.inference_mode():
            plan = plan_for(step, **SMALL)
            args = (step.query, step.key_cache, step.value_cache, step.index_cache, step.table)
            assert torch.equal(compiled(*args, plan), stem_paged_run(*args, plan))


def _plan(**kw):
    base = dict(num_heads=4, num_kv_heads=2, head_dim=16, page_size=16, dtype=torch.float32)
    return stem_paged_plan([100], [200], **{**base, **kw})


@pytest.mark.parametrize("kw,arg", [
    (dict(page_size=12), "page_size"),            # not a multiple of stem_stride
    (dict(page_size=256), "page_size"),           # does not divide stem_block_size
    (dict(num_heads=3), "num_heads"),
    (dict(backend="flash"), "backend"),
    (dict(query_lens=[300]), "query_lens[0]"),      # more queries than keys
    (dict(query_lens=[]), "query_lens"),
])
def test_bad_plans_name_the_argument(kw, arg):
    lens = kw.pop("query_lens", None)
    with pytest.raises(StemIndexerInputError, match=rf"\b{re.escape(arg)}"):
        if lens is None:
            _plan(**kw)
        else:
            stem_paged_plan(lens, [200] * max(len(lens), 1), num_heads=4, num_kv_heads=2,
                            head_dim=16, page_size=16)


def test_runs_on_other_tensors_than_planned_are_refused():
    step = make_step([1000], [0], [1000], page=16, stride=8, seed=8)
    plan = plan_for(step, **SMALL)
    args = dict(query=step.query, key_cache=step.key_cache, value_cache=step.value_cache,
                index_cache=step.index_cache, block_table=step.table)
    bad = dict(query=step.query[:-1], key_cache=step.key_cache[:, :8],
               value_cache=step.value_cache.double(), block_table=step.table[:, :10],
               index_cache=IndexCache.allocate(4, 16, 8, 2, 16))
    for name, value in bad.items():
        with pytest.raises(StemIndexerInputError, match=rf"\b{name}\b"):
            stem_paged_run(**{**args, name: value}, plan=plan)


# --------------------------------------------------------------------------- #
# The paged kernel as block_sparse_attention's "triton" backend
# --------------------------------------------------------------------------- #

@interpreted
@pytest.mark.parametrize("softcap", [None, pytest.param(4.0, marks=pytest.mark.slow)])
def test_the_triton_backend_attends_as_the_gather_backend(softcap):
    # Two batches, one padded (a partial last block), GQA; kv one block
    # longer than q (keys before the queries: a whole block).
    gen = torch.Generator().manual_seed(11)
    bs, hq, hkv, dim = 16, 4, 2, 16
    q = torch.randn(2, hq, 40, dim, generator=gen)
    k, v = (torch.randn(2, hkv, 56, dim, generator=gen) for _ in range(2))
    q_lens, kv_lens = torch.tensor([40, 23]), torch.tensor([56, 39])
    qb, kb = 3, 4
    idx = torch.full((2, hq, qb, kb), -1, dtype=torch.int32)
    lengths = torch.zeros(2, hq, qb, dtype=torch.int32)
    for b in range(2):
        for h in range(hq):
            for i in range(qb):
                own = i + 1  # the query block's own key block (one block of context)
                picks = sorted({0, own} | {j for j in range(own) if (b + h + i + j) % 2})
                idx[b, h, i, :len(picks)] = torch.tensor(picks, dtype=torch.int32)
                lengths[b, h, i] = len(picks)
    kw = dict(q_lens=q_lens, kv_lens=kv_lens, stem_block_size=bs, softcap=softcap)
    with torch.inference_mode():
        got = stem_indexer.block_sparse_attention(q, k, v, idx, lengths, backend="triton", **kw)
        want = stem_indexer.block_sparse_attention(q, k, v, idx, lengths, backend="gather",
                                                   **kw)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()


@interpreted
@pytest.mark.slow
def test_stem_attention_on_the_triton_backend_is_the_native_run():
    q = torch.randn(1, 2, 480, 16, generator=torch.Generator().manual_seed(12))
    k, v = q[:, :1] * 0.5, q[:, 1:] + 0.1
    # A few blocks a row (sink, window, three picks): few tiles to interpret.
    kw = dict(TINY_SPARSE, k_block_num_rate_medium=0.0, initial_blocks=1, window_size=1)
    with torch.inference_mode():
        got, info = stem_indexer.stem_attention(q, k, v, backend="triton", return_info=True,
                                                **kw)
        want = stem_indexer.stem_attention(q, k, v, backend="native", **kw)
    assert info.path == "sparse" and info.backend == "triton"
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()


def _triton_call(**kw):
    """block_sparse_attention and stem_plan with backend="triton" on 40
    queries over ``kv_lens`` keys in 16-token blocks (both refuse first)."""
    lens = dict(q_lens=kw.pop("q_lens", [40]), kv_lens=kw.pop("kv_lens", [40]))
    q, k = torch.zeros(1, 2, 40, 16), torch.zeros(1, 1, max(lens["kv_lens"]), 16)
    idx = torch.zeros(1, 2, 3, 4, dtype=torch.int32)
    lengths = torch.ones(1, 2, 3, dtype=torch.int32)
    yield lambda: stem_indexer.block_sparse_attention(q, k, k, idx, lengths, stem_block_size=16,
                                                      backend="triton", **lens, **kw)
    yield lambda: stem_indexer.stem_plan(lens["q_lens"], lens["kv_lens"], num_heads=2,
                                         num_kv_heads=1, head_dim=16, stem_block_size=16,
                                         stem_stride=4, backend="triton", **kw)


@interpreted
@pytest.mark.parametrize("kw,rule", [
    (dict(q_lens=[40], kv_lens=[50]), "whole number of blocks"),
    (dict(causal=False), "causal only"),
    (dict(return_lse=True), "log-sum-exp"),
])
def test_the_triton_backend_refuses_what_its_kernel_cannot_run(kw, rule):
    for call in _triton_call(**kw):
        with pytest.raises(StemIndexerInputError, match=rf"backend.*{rule}"):
            call()


def test_the_triton_backend_needs_cuda_or_the_interpreter():
    launch = pytest.importorskip("stem_indexer.operator.ops.triton.launch")
    if launch.INTERPRETED:
        pytest.skip("the Triton interpreter takes CPU tensors")
    for call in _triton_call():
        with pytest.raises(StemIndexerInputError, match=r"backend.*TRITON_INTERPRET=1"):
            call()
