"""The probe (``stem_indexer.pipeline.probe``): a second scoring pass.

The truth is a float64 loop written from the docstring's rule, row by row:
for query block ``i`` and query head ``h``, the last ``m`` queries of the
block attend causally to every key up to their position; a key block's
mass is the probability its keys get, summed over those queries; the row
keeps its forced blocks (the contract's sink and window, written out here
as sets) and the ``keep`` listed candidates with the most mass.

* Paged steps (fresh rows and chunks that start inside a block): the
  probe's lists are that loop run over the indexer's lists at the widened
  budget (``probe_params``), and each row keeps as many blocks as the plan
  without the probe.
* A planted needle: one key the block's last queries match strongly, in a
  block whose strided sums the indexer ranks low. The indexer alone drops
  it at this budget; with the probe it is kept.
* ``stem_paged_run`` with the probe is float64 attention masked to the
  probe's lists (which differ from the indexer's alone).
* The exact tail's rows still list every block; bad settings name
  themselves. (The vLLM backend's rows pick what the paged entry point
  picks, with the probe too: ``tests/test_paged.py``.)
"""

from __future__ import annotations

import math

import pytest
import torch
from test_paged import SMALL, make_step, plan_for

from stem_indexer import StemIndexerInputError, stem_paged_run
from stem_indexer.operator import contract
from stem_indexer.pipeline.paged import stem_paged_select
from stem_indexer.pipeline.probe import probe_params
from stem_indexer.testing import reference_attention

BS = SMALL["stem_block_size"]
TOL = 1e-4  # float32 sums against float64: a pick may differ only at such a tie


def truth(q, k, lists, lengths, *, context, seq_len, prompt, params, scale, m):
    """The float64 loop: ``q [Hq, S, D]`` and ``k [Hkv, S, D]`` the whole
    prompt's, ``lists``/``lengths`` one row's indexer lists. Returns, per
    (h, r), the kept set and the masses of its blocks."""
    hq, qb, _ = lists.shape
    group = hq // k.shape[0]
    first = context // BS
    p = torch.tensor(math.ceil(prompt / BS))
    out = {}
    for r in range(qb):
        i = first + r
        s2 = i + 1
        forced = set(range(min(params.initial_blocks, s2))) | set(
            range(max(s2 - params.window_size, 0), s2))
        cands = s2 - len(forced)
        k_row = int(contract.row_budget(torch.tensor(i), p, contract.prompt_budget(p, params),
                                        params.alpha))
        keep = min(k_row, max(cands, 0))
        end = min((i + 1) * BS, seq_len)
        first_q = max(i * BS, context, end - m)
        for h in range(hq):
            listed = set(lists[h, r, :int(lengths[h, r])].tolist())
            if len(listed) <= len(forced) + keep:
                out[h, r] = (listed, None)
                continue
            mass = torch.zeros(s2, dtype=torch.float64)
            for t in range(first_q, end):
                logits = (k[h // group, :t + 1].double() @ q[h, t].double()) * scale
                prob = torch.softmax(logits, 0)
                prob = torch.nn.functional.pad(prob, (0, s2 * BS - prob.shape[0]))
                mass += prob.view(s2, BS).sum(1)
            free = sorted(listed - forced, key=lambda j: (-float(mass[j]), j))
            out[h, r] = (forced | set(free[:keep]), mass)
    return out


def assert_matches_truth(idx, lengths, want, where):
    for (h, r), (kept, mass) in want.items():
        got = set(idx[h, r, :int(lengths[h, r])].tolist())
        assert int(lengths[h, r]) == len(kept), (where, h, r)
        if got == kept:
            continue
        # Only a tie at the row's threshold may differ.
        assert mass is not None, (where, h, r, sorted(got ^ kept))
        edge = min(float(mass[j]) for j in kept - got)
        for j in got ^ kept:
            assert abs(float(mass[j]) - edge) <= TOL * max(edge, 1e-6), (where, h, r, j)


@pytest.mark.parametrize("contexts,new,m", [
    ([0, 0], [2200, 1900], 8),         # fresh prompts
    ([0, 0], [2200, 1900], 1),         # one query per block: its last
    ([1400, 450], [800, 1500], 4),     # chunks starting inside a block (450 = 14 * 32 + 2)
])
def test_the_probe_keeps_the_heaviest_candidates(contexts, new, m):
    prompts = [c + n for c, n in zip(contexts, new)]
    step = make_step(prompts, contexts, new, page=16, stride=8, seed=3)
    kw = {**SMALL, "exact_tail": 0, "min_q_blocks": 1}
    scale = 1 / math.sqrt(step.q.shape[3])
    with torch.inference_mode():
        plan = plan_for(step, probe_queries=m, probe_candidates=2.0, **kw)
        idx, lengths = stem_paged_select(step.query, step.index_cache, step.table, plan,
                                         key_cache=step.key_cache)
        wide = plan_for(step, **{**kw, **{n: getattr(plan.indexer_params, n) for n in (
            "k_block_num_rate_medium", "k_block_num_bias_medium", "k_block_num_rate_large",
            "k_block_num_bias_large")}})
        cand_idx, cand_len = stem_paged_select(step.query, step.index_cache, step.table, wide)
        plain = plan_for(step, **kw)
        _, plain_len = stem_paged_select(step.query, step.index_cache, step.table, plain)
    assert plan.paths == ("sparse", "sparse")
    refined = 0
    for b, (c, n) in enumerate(zip(contexts, new)):
        qb = math.ceil((c + n) / BS) - c // BS
        want = truth(step.q[b], step.k[b], cand_idx[b, :, :qb], cand_len[b, :, :qb],
                     context=c, seq_len=c + n, prompt=prompts[b], params=plan.params,
                     scale=scale, m=m)
        refined += sum(mass is not None for _, mass in want.values())
        assert_matches_truth(idx[b], lengths[b], want, f"row {b}")
        # As many blocks as the budget keeps without the probe.
        assert torch.equal(lengths[b, :, :qb], plain_len[b, :, :qb]), f"row {b}"
    assert refined > 20, "the step should have rows with more candidates than they keep"


def test_the_probe_finds_a_needle_the_indexer_misses():
    # One key (token 300, block 9) matches the last queries of the last block
    # strongly; the other keys of its block point the other way, so that the
    # block's strided sums, which the indexer scores, rank it low.
    n, dim = 2048, 16
    direction = torch.zeros(dim)
    direction[0] = 1.0

    def plant(q, k):
        k[0, :, 288:320] = -3.0 * direction
        k[0, :, 300] = 8.0 * direction
        q[0, :, n - 8:n] = 4.0 * direction

    step = make_step([n], [0], [n], page=16, stride=8, seed=5, dim=dim, edit=plant)
    q = step.q
    kw = {**SMALL, "exact_tail": 0, "min_q_blocks": 1, "k_block_num_bias_medium": 3,
          "k_block_num_bias_large": 3}
    last = n // BS - 1
    with torch.inference_mode():
        alone_idx, alone_len = stem_paged_select(step.query, step.index_cache, step.table,
                                                 plan_for(step, **kw))
        plan = plan_for(step, probe_queries=8, probe_candidates=8.0, **kw)
        idx, lengths = stem_paged_select(step.query, step.index_cache, step.table, plan,
                                         key_cache=step.key_cache)
    for h in range(q.shape[1]):
        assert 9 not in alone_idx[0, h, last, :int(alone_len[0, h, last])].tolist()
        assert 9 in idx[0, h, last, :int(lengths[0, h, last])].tolist(), h
        assert int(lengths[0, h, last]) == int(alone_len[0, h, last])


def test_the_exact_tail_still_lists_every_block():
    prompts = [2000]
    step = make_step(prompts, [0], prompts, page=16, stride=8, seed=4)
    with torch.inference_mode():
        plan = plan_for(step, probe_queries=8, **{**SMALL, "exact_tail": 64})
        idx, lengths = stem_paged_select(step.query, step.index_cache, step.table, plan,
                                         key_cache=step.key_cache)
    last = math.ceil(2000 / BS) - 1
    for r in (last - 2, last - 1, last):  # positions 1936 .. 1999 lie in blocks 60 .. 62
        assert torch.equal(lengths[0, :, r], torch.full_like(lengths[0, :, r], r + 1)), r
        assert idx[0, 0, r, :r + 1].tolist() == list(range(r + 1))


def test_the_run_attends_the_probes_blocks():
    # stem_paged_run passes its key cache to the probe: its output is float64
    # attention masked to the probe's lists (each query block's listed key
    # blocks, causal inside them).
    prompts, contexts, new = [2200], [450], [1750]
    step = make_step(prompts, contexts, new, page=16, stride=8, seed=6)
    with torch.inference_mode():
        plan = plan_for(step, probe_queries=4, **{**SMALL, "exact_tail": 0})
        got = stem_paged_run(step.query, step.key_cache, step.value_cache, step.index_cache,
                             step.table, plan)
        idx, lengths = stem_paged_select(step.query, step.index_cache, step.table, plan,
                                         key_cache=step.key_cache)
        plain_idx, _ = stem_paged_select(step.query, step.index_cache, step.table,
                                         plan_for(step, **{**SMALL, "exact_tail": 0}))
    assert not torch.equal(plain_idx, idx)  # the probe changed some lists
    seq, first = prompts[0], contexts[0] // BS
    listed = torch.zeros(step.q.shape[1], seq, math.ceil(seq / BS), dtype=torch.bool)
    for r in range(lengths.shape[2]):
        for h in range(step.q.shape[1]):
            blocks = idx[0, h, r, :int(lengths[0, h, r])].long()
            listed[h, (first + r) * BS:(first + r + 1) * BS, blocks] = True
    mask = listed.repeat_interleave(BS, 2)[None, :, contexts[0]:, :seq]
    want = reference_attention(step.q[:, :, contexts[0]:seq], step.k[:, :, :seq],
                               step.v[:, :, :seq], mask, causal=True)
    assert torch.allclose(got, want[0].transpose(0, 1).float(), atol=1e-5, rtol=1e-5)


def test_probe_params_widen_the_budget_only():
    params = contract.IndexerParams.from_kwargs("t", preset="balanced")
    wide = probe_params(params, 2.5)
    assert (wide.k_block_num_rate_large, wide.k_block_num_bias_large) == (0.25, 40)
    assert (wide.k_block_num_rate_medium, wide.k_block_num_bias_medium) == (0.25, 40)
    assert (wide.initial_blocks, wide.window_size, wide.alpha) == (
        params.initial_blocks, params.window_size, params.alpha)


@pytest.mark.parametrize("kw,arg", [
    (dict(probe_queries=-1), "probe_queries"),
    (dict(probe_queries=1.5), "probe_queries"),
    (dict(probe_queries=4, probe_candidates=0.5), "probe_candidates"),
    (dict(probe_queries=4, probe_candidates=float("nan")), "probe_candidates"),
])
def test_bad_probe_settings_name_themselves(kw, arg):
    from stem_indexer.integrations.vllm.settings import StemSettings

    step = make_step([600], [0], [600], page=16, stride=8)
    with pytest.raises(StemIndexerInputError, match=f"stem_paged_plan: {arg} "):
        plan_for(step, **SMALL, **kw)
    with pytest.raises(StemIndexerInputError, match=arg):
        StemSettings.from_mapping(kw)


def test_the_probe_needs_the_keys():
    step = make_step([2000], [0], [2000], page=16, stride=8)
    with torch.inference_mode():
        plan = plan_for(step, probe_queries=4, **SMALL)
        with pytest.raises(StemIndexerInputError, match="key_cache must be given"):
            stem_paged_select(step.query, step.index_cache, step.table, plan)


# --------------------------------------------------------------------------- #
# The miss check: how much attention a selection leaves out, sampled
# --------------------------------------------------------------------------- #


def miss_truth(q, k, lists, lengths, rows, *, context, seq_len, scale, m, bs=BS):
    """The float64 loop of ``selection_miss``'s docstring over the sampled
    ``rows`` (indices into the lists): per query head, the mean over the
    row's last ``m`` queries of the probability each key block gets; the
    heaviest ``n`` blocks' mass less the listed ones'."""
    hq = q.shape[0]
    group = hq // k.shape[0]
    first = context // bs
    total = 0.0
    for r in rows:
        i = first + r
        end = min((i + 1) * bs, seq_len)
        begin = max(i * bs, context, end - m)
        for h in range(hq):
            mass = torch.zeros(i + 1, dtype=torch.float64)
            for t in range(begin, end):
                prob = torch.softmax(k[h // group, :t + 1].double() @ q[h, t].double() * scale, 0)
                mass += torch.nn.functional.pad(prob, (0, (i + 1) * bs - t - 1)).view(
                    i + 1, bs).sum(1)
            mass /= end - begin
            listed = lists[h, r, :int(lengths[h, r])].tolist()
            best = sorted(mass.tolist(), reverse=True)[:len(listed)]
            total += sum(best) - float(mass[listed].sum())
    return total / (len(rows) * hq)


@pytest.mark.parametrize("blocks, sampled", [(1, [5]), (2, [1, 5]), (9, [1, 3, 4, 5])])
def test_the_miss_check_measures_the_mass_a_selection_leaves_out(blocks, sampled):
    """A chunk starting inside block 1 (query blocks 1..6); rows 0 and 2
    list every block they see. Sampled: the last partial row, then evenly
    spaced ones back to the first."""
    from stem_indexer.pipeline.probe import selection_miss

    torch.manual_seed(7)
    hq, hkv, dim, seq_len, context, m = 4, 2, 16, 7 * BS - 5, BS + 9, 6
    q, k = torch.randn(hq, seq_len, dim), torch.randn(hkv, seq_len, dim)
    k[:, 2 * BS + 3] = q[:, 6 * BS - 1].view(hkv, 2, dim).mean(1) * 4  # a heavy key
    qb = 6
    lists = torch.full((hq, qb, 7), -1, dtype=torch.int32)
    lengths = torch.zeros(hq, qb, dtype=torch.int32)
    for r in range(qb):
        seen = context // BS + r + 1
        for h in range(hq):
            if r in (0, 2):
                keep = list(range(seen))
            else:  # the sink, the diagonal and a few others, never block 2 in head 0
                others = [j for j in torch.randperm(seen).tolist() if j not in (0, seen - 1)
                          and not (h == 0 and j == 2)]
                keep = sorted({0, seen - 1, *others[:max(0, seen // 2 - 1)]})
            lists[h, r, :len(keep)] = torch.tensor(keep, dtype=torch.int32)
            lengths[h, r] = len(keep)
    scale = dim ** -0.5
    got, n, dropped = selection_miss(q[:, context:].transpose(0, 1), k.transpose(0, 1), lists,
                                     lengths, context=context, seq_len=seq_len, block_size=BS,
                                     queries=m, blocks=blocks, scale=scale)
    want = miss_truth(q, k, lists, lengths, sampled, context=context, seq_len=seq_len,
                      scale=scale, m=m)
    assert n == len(sampled)
    # the share of the sampled rows' visible blocks their lists leave out
    seen = [context // BS + r + 1 for r in sampled]
    assert dropped == pytest.approx(sum(1 - int(lengths[h, r]) / s for r, s in zip(sampled, seen)
                                        for h in range(hq)) / (len(sampled) * hq))
    assert want > 0.01
    assert got == pytest.approx(want, abs=1e-5)


def test_the_miss_check_of_lists_holding_every_block_samples_nothing():
    from stem_indexer.pipeline.probe import selection_miss

    hq, qb, seq_len = 2, 3, 3 * BS
    lists = torch.arange(qb, dtype=torch.int32).expand(hq, qb, qb).clone()
    lengths = torch.arange(1, qb + 1, dtype=torch.int32).expand(hq, qb).clone()
    lists[lists >= lengths[..., None]] = -1
    got = selection_miss(torch.randn(seq_len, hq, 8), torch.randn(seq_len, 1, 8), lists,
                         lengths, context=0, seq_len=seq_len, block_size=BS, queries=4,
                         blocks=4, scale=0.3)
    assert got == (0.0, 0, 0.0)


@pytest.mark.parametrize("kw, arg", [
    (dict(miss=-0.1), "miss_check"), (dict(miss=1.0), "miss_check"),
    (dict(miss=float("nan")), "miss_check"), (dict(miss=True), "miss_check"),
    (dict(queries=0), "miss_check_queries"), (dict(queries=2.0), "miss_check_queries"),
    (dict(blocks=0), "miss_check_blocks"), (dict(blocks=False), "miss_check_blocks"),
    (dict(first=-1), "miss_check_from"), (dict(first=True), "miss_check_from")])
def test_bad_miss_check_settings_name_themselves(kw, arg):
    from stem_indexer.pipeline.probe import check_miss

    args = dict(miss=0.05, queries=16, blocks=4, first=0) | kw
    with pytest.raises(StemIndexerInputError, match=arg):
        check_miss("who", args["miss"], args["queries"], args["blocks"], args["first"])
