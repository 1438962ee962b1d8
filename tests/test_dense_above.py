"""Stem steps aside where it cannot win: ``dense_above``.

When the budget keeps more than ``dense_above`` of the causally visible
(query block, key block) pairs (``contract.budget_pairs``, from the budget
alone), ``stem_attention`` runs dense attention, exact, with the reason
``"budget keeps most blocks"``; below it, the sparse path as before.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import stem_indexer
from stem_indexer import IndexerParams, StemIndexerInputError, stem_attention
from stem_indexer.operator import contract
from stem_indexer.testing import reference_attention, token_mask

from _helpers import SMALL, host, qkv, spec_row_facts

MOST = "budget keeps most blocks"
# 60 blocks of 16 tokens (past the 56 below which every block is kept): the
# default budget keeps 0.2 * 60 + 30 = 42 blocks a row, 97% of the visible pairs.
SEQ = 960


def _hand_pairs(q_len, kv_len, prompt_len, params):
    """Kept and visible pairs per head, row by row from the contract restated
    in plain Python (``_helpers.spec_row_facts``)."""
    kept = visible = 0
    for i in range(-(-q_len // params.stem_block_size)):
        s2, forced, candidates, k = spec_row_facts(q_len, kv_len, prompt_len, i, params)
        kept += len(forced) + min(k, candidates)
        visible += s2
    return kept, visible


@pytest.mark.parametrize("q_len, kv_len, prompt_len, change", [
    (SEQ, SEQ, SEQ, {}),                                   # the default budget
    (SEQ, SEQ, SEQ, dict(alpha=0.4)),                      # decaying budgets
    (300, SEQ, SEQ, {}),                                   # a chunk after a prefix
    (SEQ, SEQ, 3000, dict(k_block_num_rate_large=0.05)),   # a longer prompt's budget
    (200, 200, 200, {}),                                   # short: every block kept
    (SEQ, SEQ, SEQ, dict(initial_blocks=0, window_size=1, k_block_num_rate_medium=0.0,
                         k_block_num_bias_medium=3)),
])
def test_budget_pairs_equal_a_hand_count(q_len, kv_len, prompt_len, change):
    params = IndexerParams(**SMALL, **change)
    got = contract.budget_pairs(torch.tensor([q_len]), torch.tensor([kv_len]),
                                torch.tensor([prompt_len]), params)
    assert got == _hand_pairs(q_len, kv_len, prompt_len, params)


def test_budget_pairs_are_what_the_indexer_keeps(device):
    """Summed over a batch of two lengths: the pairs the indexer's own lists
    hold (every head alike) and the visible pairs stem_attention reports
    (``exact_tail=0``: the count is the budget's, before any row is widened)."""
    q, k, v = qkv(2, 4, 2, SEQ, SEQ, 8, seed=3, device=device)
    lens = torch.tensor([SEQ, 900])
    params = IndexerParams(**SMALL)
    kept, visible = contract.budget_pairs(lens, lens, lens, params)
    _, info = stem_attention(q, k, v, q_lens=lens, kv_lens=lens, dense_above=1.0,
                             exact_tail=0, return_info=True, **SMALL)
    assert info.path == "sparse"
    assert (info.kept_pairs, info.visible_pairs) == (4 * kept, 4 * visible)


def test_a_budget_above_the_share_runs_dense_and_equals_sdpa(device):
    q, k, v = qkv(1, 4, 2, SEQ, SEQ, 8, seed=1, device=device)
    kept, visible = contract.budget_pairs(*(torch.tensor([SEQ]),) * 3, IndexerParams(**SMALL))
    assert 0.95 < kept / visible < 0.99
    out, info = stem_attention(q, k, v, dense_above=0.95, return_info=True, **SMALL)
    assert (info.path, info.reason) == ("dense", MOST)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert torch.equal(out, want)


def _selection(q, k, v):
    """The indexer's own lists for q, k, v (``stem_attention``'s inputs to it)."""
    inputs = stem_indexer.stem_inputs(q, k, v, scale=8 ** -0.5 / 4, **SMALL)
    return stem_indexer.stem_indexer(*inputs, **SMALL)


def test_a_budget_below_the_share_routes_to_the_sparse_path(device):
    """Routing: below the share, stem_attention is exactly the chain of its
    own parts (stem_inputs -> indexer -> block_sparse_attention), bit for bit."""
    q, k, v = qkv(1, 4, 2, SEQ, SEQ, 8, seed=1, device=device)
    out, info = stem_attention(q, k, v, dense_above=0.99, exact_tail=0, return_info=True,
                               **SMALL)
    assert info.path == "sparse" and 0.95 < info.density < 0.99
    idx, seq_len = _selection(q, k, v)
    want = stem_indexer.block_sparse_attention(q, k, v, idx, seq_len, stem_block_size=16)
    torch.testing.assert_close(out, want, rtol=0, atol=0)


def test_a_budget_below_the_share_is_attention_on_the_indexers_selection(device):
    """The result: the float64 reference restricted to the blocks the indexer
    keeps, and not dense attention (blocks were dropped)."""
    q, k, v = qkv(1, 4, 2, SEQ, SEQ, 8, seed=1, device=device)
    out = host(stem_attention(q, k, v, dense_above=0.99, exact_tail=0, **SMALL), device)
    idx, seq_len = _selection(q, k, v)
    mask = token_mask(idx, seq_len, 16, SEQ, SEQ)
    torch.testing.assert_close(out.double(), reference_attention(q, k, v, mask),
                               rtol=1e-5, atol=1e-5)
    dense = reference_attention(q, k, v, causal=True)
    assert (out.double() - dense).abs().max() > 1e-3  # blocks were dropped


@pytest.mark.parametrize("want_lse", [False, True], ids=["out", "out-and-lse"])
def test_stepping_aside_with_softcap_or_lse_is_dense_too(want_lse, device):
    """With a soft-cap (and the log-sum-exp) the step-aside runs dense
    attention through the block kernels: the capped dense reference."""
    q, k, v = qkv(1, 2, 1, SEQ, SEQ, 8, seed=2)
    q = 4 * q
    result = stem_attention(*(x.to(device) for x in (q, k, v)), softcap=5.0, dense_above=0.9,
                            return_info=True, return_lse=want_lse, **SMALL)
    out, info = host(result[0], device), result[-1]
    assert (info.path, info.reason) == ("dense", MOST)
    ref, ref_lse = reference_attention(q, k, v, softcap=5.0, causal=True, return_lse=True)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    if want_lse:
        torch.testing.assert_close(host(result[1], device).double(), ref_lse,
                                   rtol=1e-5, atol=1e-5)


def test_the_default_is_the_measured_share_for_the_device_and_dtype(monkeypatch, device):
    q, k, v = qkv(1, 4, 2, SEQ, SEQ, 8, seed=1, device=device)
    assert contract.default_dense_above(device, torch.float32) == \
        contract.DENSE_ABOVE[(device, torch.float32)]
    monkeypatch.setitem(contract.DENSE_ABOVE, (device, torch.float32), 0.9)
    _, info = stem_attention(q, k, v, return_info=True, **SMALL)
    assert (info.path, info.reason) == ("dense", MOST)
    monkeypatch.setitem(contract.DENSE_ABOVE, (device, torch.float32), 1.0)
    _, info = stem_attention(q, k, v, return_info=True, **SMALL)
    assert info.path == "sparse"
    # bfloat16 reads its own entry.
    monkeypatch.setitem(contract.DENSE_ABOVE, (device, torch.bfloat16), 0.5)
    _, info = stem_attention(*(x.bfloat16() for x in (q, k, v)), return_info=True, **SMALL)
    assert (info.path, info.reason) == ("dense", MOST)


BAD = [0, 0.0, -0.5, 1.5, math.nan, math.inf, True, "0.9"]


@pytest.mark.parametrize("value", BAD, ids=repr)
def test_stem_attention_refuses_a_bad_dense_above(value):
    q, k, v = qkv(1, 2, 1, 64, 64, 8, seed=0)
    with pytest.raises(StemIndexerInputError, match="^stem_attention: dense_above must be None "
                                                    "or a number with 0 < dense_above <= 1"):
        stem_attention(q, k, v, dense_above=value, **SMALL)


@pytest.fixture
def hf():
    """transformers and the integration (the tests that need them skip without)."""
    transformers = pytest.importorskip("transformers")
    import stem_indexer.integrations.transformers as stem_hf
    return transformers, stem_hf


@pytest.mark.parametrize("value", BAD, ids=repr)
def test_register_refuses_a_bad_dense_above(value, hf):
    transformers, stem_hf = hf
    with pytest.raises(StemIndexerInputError, match="^register: dense_above must be None"):
        stem_hf.register("stem-dense-above-bad", dense_above=value)
    assert "stem-dense-above-bad" not in transformers.AttentionInterface._global_mapping


def test_register_dense_above_steps_aside_in_a_model(device, hf):
    """A tiny Llama at 960 tokens in 16-token blocks (the default budget keeps
    97% of the pairs): with ``dense_above=0.9`` every layer steps aside
    (counted) and the logits are SDPA's; with ``1.0`` every layer runs Stem."""
    transformers, stem_hf = hf
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=2048)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval().to(device)
    ids = torch.randint(0, 128, (1, SEQ), generator=torch.Generator().manual_seed(0)).to(device)
    aside = stem_hf.register("stem-dense-above-0.9", dense_above=0.9, **SMALL)
    sparse = stem_hf.register("stem-dense-above-1", dense_above=1.0, **SMALL)
    try:
        logits = {}
        for name in ("sdpa", aside.name, sparse.name):
            model.set_attn_implementation(name)
            with torch.no_grad():
                logits[name] = model(ids).logits
        assert dict(aside.stats) == {f"dense:{MOST}": 2}
        assert dict(sparse.stats) == {"stem": 2}
        torch.testing.assert_close(logits[aside.name], logits["sdpa"], rtol=1e-5, atol=1e-5)
        assert (logits[sparse.name] - logits["sdpa"]).abs().max() > 1e-5
    finally:
        stem_hf.unregister(aside.name)
        stem_hf.unregister(sparse.name)
