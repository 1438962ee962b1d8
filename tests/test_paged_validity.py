"""The paged entry point checks the indexer cache before trusting it.

A row of ``stem_paged_run`` reads its keys' block statistics from the
indexer cache. Where the cache does not hold exactly the row's tokens (a
page some write left unusable, a page another sequence wrote, told by its
tag), the row attends every block it can see: dense attention, decided on
the device, while the other rows of the step keep their selection.
"""

from __future__ import annotations

import torch
from test_paged import SMALL, make_step, packed, plan_for

from stem_indexer import stem_paged_run
from stem_indexer.pipeline.index_cache import token_tags
from stem_indexer.pipeline.paged import stem_paged_select, stem_paged_valid
from stem_indexer.testing import reference_attention

PAGE = 16


def _step():
    prompts = [2100, 1900]
    return make_step(prompts, [0, 0], prompts, page=PAGE, stride=8)


def _dense(step, b: int) -> torch.Tensor:
    """Row ``b``'s new tokens' dense causal attention (float64), [n, Hq, D]."""
    s = step.seq_lens[b]
    out = reference_attention(step.q[b:b + 1, :, :s], step.k[b:b + 1, :, :s],
                              step.v[b:b + 1, :, :s], causal=True)
    return out[0, :, s - step.query_lens[b]:].transpose(0, 1)


def _row(x: torch.Tensor, step, b: int) -> torch.Tensor:
    start = sum(step.query_lens[:b])
    return x[start:start + step.query_lens[b]]


def test_a_row_over_an_unusable_page_attends_every_block_the_others_keep_theirs():
    step = _step()
    with torch.inference_mode():
        plan = plan_for(step, **SMALL)
        idx, lengths = stem_paged_select(step.query, step.index_cache, step.table, plan)
        assert stem_paged_valid(step.index_cache, step.table, plan).tolist() == [True, True]
        # Both rows really drop blocks while the cache is whole.
        visible = [sum(range(1, -(-s // 32) + 1)) for s in step.seq_lens]
        assert all(int(lengths[b, 0].sum()) < visible[b] for b in range(2))
        # A write leaves one of row 1's pages unusable.
        step.index_cache.invalidate(step.table[1, 5:6].long() * PAGE)
        assert stem_paged_valid(step.index_cache, step.table, plan).tolist() == [True, False]
        idx2, lengths2 = stem_paged_select(step.query, step.index_cache, step.table, plan)
        assert torch.equal(idx2[0], idx[0]) and torch.equal(lengths2[0], lengths[0])
        assert int(lengths2[1, 0].sum()) == visible[1]
        out = stem_paged_run(step.query, step.key_cache, step.value_cache, step.index_cache,
                             step.table, plan)
    torch.testing.assert_close(_row(out, step, 1).double(), _dense(step, 1), rtol=1e-5,
                               atol=1e-5)
    # Row 0 is still sparse: its output is not dense attention.
    assert (_row(out, step, 0).double() - _dense(step, 0)).abs().max() > 1e-3


def test_a_page_another_sequence_wrote_is_told_by_its_tag():
    """The counts all match, but the tags the engine expects say row 0's
    fourth page was written by other tokens: row 0 runs dense."""
    step = _step()
    ids = torch.arange(2200) % 97
    tags = token_tags(ids)
    # Tags as the engine's writer would have left them: each page's last token's.
    width = step.table.shape[1]
    last = (torch.arange(width) + 1) * PAGE - 1
    page_tags = tags[last.clamp(max=ids.shape[0] - 1)].repeat(2, 1)
    for b, s in enumerate(step.seq_lens):
        pages = -(-s // PAGE)
        step.index_cache.tag[step.table[b, :pages].long()] = page_tags[b, :pages]
        step.index_cache.tag[step.table[b, pages - 1].long()] = tags[s - 1]
        page_tags[b, pages - 1] = tags[s - 1]
    with torch.inference_mode():
        plan = plan_for(step, **SMALL)
        assert stem_paged_valid(step.index_cache, step.table, plan, page_tags).all()
        wrong = page_tags.clone()
        wrong[0, 3] += 1
        assert stem_paged_valid(step.index_cache, step.table, plan, wrong).tolist() == \
            [False, True]
        out = stem_paged_run(step.query, step.key_cache, step.value_cache, step.index_cache,
                             step.table, plan, page_tags=wrong)
    torch.testing.assert_close(_row(out, step, 0).double(), _dense(step, 0), rtol=1e-5,
                               atol=1e-5)
    assert packed is not None  # the step's helpers are test_paged's
