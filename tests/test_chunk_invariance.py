"""Chunk-invariant selection (``stem_paged_plan(chunk_invariant=True)``, the
vLLM backend's ``chunk_invariant`` setting): results that do not depend on
where a serving engine cuts a prompt into chunks.

One prompt is prefilled the way an engine does it, chunk after chunk (the
indexer cache written as each chunk arrives, then that chunk's row
selected), under several chunkings: in one shot, in chunks of 300, of 97,
and at uneven cuts. Every query block of every chunk must keep exactly what
the one-shot prefill keeps, or, where a chunk boundary cuts the block, every
block it can see. Without the option the same chunkings keep other blocks
(the statistic of the Output-Aware Metric moves with the tokens present,
and a cut block is scored on part of its queries): the property is the
option's, not the test's.
"""

from __future__ import annotations

import pytest
import torch

from stem_indexer import IndexCache, stem_paged_plan
from stem_indexer.pipeline.paged import stem_paged_select

BS, PAGE, STRIDE, HQ, HKV, DIM = 32, 16, 8, 4, 2, 16
PROMPT = 3000
PARAMS = dict(stem_block_size=BS, stem_stride=STRIDE, k_block_num_bias_medium=6,
              k_block_num_bias_large=6, dense_above=1.0, min_q_blocks=1)
CHUNKINGS = {
    "300": list(range(0, PROMPT, 300)) + [PROMPT],
    "97": list(range(0, PROMPT, 97)) + [PROMPT],
    "uneven": [0, 1, 500, 511, 1400, 2047, 2048, 2999, PROMPT],
}


def _tokens(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(PROMPT, HQ, DIM, generator=gen) + 0.3
    k = torch.randn(PROMPT, HKV, DIM, generator=gen)
    # Value norms that vary from token to token, as the OAM sees them.
    v = torch.randn(PROMPT, HKV, DIM, generator=gen) * torch.rand(PROMPT, 1, 1,
                                                                  generator=gen).mul(4)
    return q, k, v


def _prefill(cuts: list[int], invariant: bool, seed: int = 0) -> dict:
    """{absolute query block: [(cut, {head: kept blocks}), ...]} over the
    chunks ``cuts`` delimit (a block two chunks share is listed by each)."""
    q, k, v = _tokens(seed)
    pages = -(-PROMPT // PAGE)
    table = torch.randperm(pages + 3, generator=torch.Generator().manual_seed(1))[None, :pages]
    cache = IndexCache.allocate(pages + 3, PAGE, STRIDE, HKV, DIM)
    picks: dict = {}
    for start, end in zip(cuts, cuts[1:]):
        pos = torch.arange(start, end)
        cache.write(k[start:end], v[start:end], table[0, pos // PAGE] * PAGE + pos % PAGE)
        plan = stem_paged_plan([end - start], [end], num_prompt_tokens=[PROMPT],
                               num_heads=HQ, num_kv_heads=HKV, head_dim=DIM, page_size=PAGE,
                               dtype=torch.float32, chunk_invariant=invariant, **PARAMS)
        with torch.inference_mode():
            idx, lengths = stem_paged_select(q[start:end], cache, table, plan)
        first = start // BS
        for j in range(first, -(-end // BS)):
            cut = j * BS < start or (min((j + 1) * BS, PROMPT) > end)
            kept = {h: frozenset(idx[0, h, j - first, :int(lengths[0, h, j - first])].tolist())
                    for h in range(HQ)}
            picks.setdefault(j, []).append((cut, kept))
    return picks


def _differences(picks: dict, one_shot: dict) -> tuple[int, int]:
    """(blocks of chunks that keep neither the one-shot blocks nor, being
    cut, every visible block; (block, chunk) records in all)."""
    bad = records = 0
    for j, seen in picks.items():
        (_, want), = one_shot[j]
        every = frozenset(range(j + 1))
        for cut, kept in seen:
            records += 1
            if kept == want:
                continue
            if cut and all(v == every for v in kept.values()):
                continue
            bad += 1
    return bad, records


@pytest.mark.parametrize("name", sorted(CHUNKINGS))
def test_every_block_keeps_the_one_shot_blocks_or_is_cut_and_dense(name):
    one_shot = _prefill([0, PROMPT], True)
    visible = sum(j + 1 for j in one_shot)
    kept = sum(len(v) for [(_, heads)] in one_shot.values() for v in heads.values()) / HQ
    assert kept < 0.7 * visible  # the prompt really is sparse (63% kept)
    bad, records = _differences(_prefill(CHUNKINGS[name], True), one_shot)
    assert records > len(one_shot) and bad == 0, (bad, records)


def test_without_the_option_chunks_keep_other_blocks():
    one_shot = _prefill([0, PROMPT], False)
    bad, records = _differences(_prefill(CHUNKINGS["97"], False), one_shot)
    assert bad > records // 20, (bad, records)


def test_the_option_is_checked():
    from stem_indexer import StemIndexerInputError

    with pytest.raises(StemIndexerInputError, match="chunk_invariant"):
        stem_paged_plan([1], [1], num_heads=HQ, num_kv_heads=HKV, head_dim=DIM,
                        page_size=PAGE, chunk_invariant="yes", **PARAMS)


def test_the_vllm_setting_plans_its_rows_chunk_invariant():
    """``additional_config["stem"]["chunk_invariant"]`` reaches the rows the
    vLLM backend plans: the same lists as the engine-neutral option, a cut
    block dense."""
    from stem_indexer.integrations.vllm.rows import Row, plan_stem_row, select_blocks
    from stem_indexer.integrations.vllm.settings import StemSettings

    settings = StemSettings.from_mapping({"preset": "default", "stem_block_size": BS,
                                          "stem_stride": STRIDE, "k_block_num_bias_medium": 6,
                                          "k_block_num_bias_large": 6,
                                          "chunk_invariant": True})
    assert "chunk_invariant=True" in settings.describe()
    q, k, v = _tokens()
    start, end = 1000, 2047  # cut at both ends
    pages = -(-end // PAGE)
    table = torch.arange(pages)[None]
    cache = IndexCache.allocate(pages, PAGE, STRIDE, HKV, DIM)
    cache.write(k[:end], v[:end], torch.arange(end))
    plan = plan_stem_row(Row(0, 0, end - start, start, PROMPT), settings, table[0], PAGE, HQ,
                         HKV, DIM)
    kflat, vbias = cache.inputs(plan.pages, end, BS, True, settings.oam_lambda,
                                stat_runs=plan.paged.oam_runs)
    idx, lengths = select_blocks(q[start:end], kflat, vbias, plan, DIM ** -0.5, settings)
    want = stem_paged_plan([end - start], [end], num_prompt_tokens=[PROMPT], num_heads=HQ,
                           num_kv_heads=HKV, head_dim=DIM, page_size=PAGE, chunk_invariant=True,
                           dtype=torch.float32, **PARAMS)
    with torch.inference_mode():
        want_idx, want_len = stem_paged_select(q[start:end], cache, table, want)
    assert torch.equal(lengths, want_len[0]) and torch.equal(idx, want_idx[0, ..., :idx.shape[-1]])
    assert lengths[:, 0].tolist() == [start // BS + 1] * HQ  # the cut first block: dense
    assert lengths[:, -1].tolist() == [-(-end // BS)] * HQ  # the cut last block: dense
