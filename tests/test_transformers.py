"""``attn_implementation="stem"`` in a tiny Hugging Face Llama.

Two registrations, both with 16-token blocks and stride 4:

* ``DENSE``: the operator's default budget; prompts under 56 blocks keep every
  block, so Stem must reproduce SDPA (to float rounding);
* ``SPARSE``: budget ``Ks = P/8`` (rates 0.125, biases 0); 1024-token prompts
  (64 blocks) keep a fraction of the blocks.

The model and the attention function's inputs are on the ``device`` fixture's
device (the model built on the CPU from one seed, then moved: every device
runs the same weights).
"""

from __future__ import annotations

import pytest
import torch

from stem_indexer import StemIndexerInputError
from stem_indexer.operator import contract
from stem_indexer.surfaces.attention import stem_attention

from _helpers import LazyModule, needs

pytestmark = needs("transformers")
transformers = LazyModule("transformers")
masking = LazyModule("transformers.masking_utils")
stem_hf = LazyModule("stem_indexer.integrations.transformers")

BLOCKING = dict(stem_block_size=16, stem_stride=4)
TIGHT = dict(k_block_num_rate_medium=0.125, k_block_num_bias_medium=0,
             k_block_num_rate_large=0.125, k_block_num_bias_large=0)
# SPARSE steps aside at the CPU's measured share on every device: CUDA's own
# (0.35) would send the left-padded batch of test_left_padding_runs_each_valid_run_sparse
# (runs of 1024 and 824 tokens: 0.66 of the visible pairs together) to dense attention.
CPU_SHARE = dict(dense_above=contract.default_dense_above("cpu", torch.float32))
DENSE, SPARSE = "stem-test-dense", "stem-test-sparse"
KEEPS_ALL = "dense:budget keeps every block"  # stem_attention's reason for running dense
VOCAB = 128


@pytest.fixture(scope="module")
def registered():
    fns = {DENSE: stem_hf.register(DENSE, **BLOCKING),
           SPARSE: stem_hf.register(SPARSE, **BLOCKING, **TIGHT, **CPU_SHARE)}
    yield fns
    for name in fns:
        stem_hf.unregister(name)


@pytest.fixture(scope="module")
def _models(registered):
    """The tiny model of each device, built on first use."""
    return {}


@pytest.fixture
def model(_models, device):
    if device not in _models:
        torch.manual_seed(0)
        config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=2048, pad_token_id=0)
        _models[device] = transformers.LlamaForCausalLM(config).eval().to(device)
    return _models[device]


def _logits(model, impl, ids, mask=None):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model(ids, attention_mask=mask).logits


def _ids(batch, length, seed, device="cpu"):
    return torch.randint(1, VOCAB, (batch, length),
                         generator=torch.Generator().manual_seed(seed)).to(device)


# --------------------------------------------------------------------------- #
# Whole model
# --------------------------------------------------------------------------- #


def test_dense_equivalent_config_matches_sdpa(model, registered, device):
    ids = _ids(2, 320, seed=1, device=device)
    before = registered[DENSE].stats.copy()
    ref = _logits(model, "sdpa", ids)
    out = _logits(model, DENSE, ids)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    # Both layers went through stem_attention (not the integration's fallback),
    # which found that the budget keeps every block, and said so.
    assert registered[DENSE].stats[KEEPS_ALL] - before[KEEPS_ALL] == 2
    assert registered[DENSE].stats["stem"] == before["stem"]


@pytest.mark.parametrize("side", ["left", "right"])
def test_dense_equivalent_config_matches_sdpa_with_padding(model, registered, side, device):
    ids = _ids(3, 288, seed=2, device=device)
    mask = torch.ones_like(ids)
    pads = [0, 37, 130]
    for b, p in enumerate(pads):
        if p:
            if side == "left":
                mask[b, :p] = 0
            else:
                mask[b, -p:] = 0
    ref = _logits(model, "sdpa", ids, mask)
    out = _logits(model, DENSE, ids, mask)
    valid = mask.bool()
    torch.testing.assert_close(out[valid], ref[valid], atol=1e-4, rtol=1e-4)
    stats = registered[DENSE].stats
    assert stats[KEEPS_ALL] > 0
    assert not any(k.startswith("dense:mask") for k in stats)


def test_sparse_config_is_sparse_finite_and_close(model, registered, device):
    ids = _ids(2, 1024, seed=3, device=device)
    ref = _logits(model, "sdpa", ids)
    out = _logits(model, SPARSE, ids)
    assert torch.isfinite(out).all()
    rel = float((out - ref).norm() / ref.norm())
    # Blocks were really dropped (the result is not dense) but little changes:
    # a randomly initialised model attends almost uniformly.
    assert 1e-3 < rel < 0.25, rel


def test_the_miss_check_widens_a_missing_layer_to_sdpas_result(model, registered, device):
    """``miss_check`` under any miss: every layer's sparse call attends every
    block, so the model's logits are SDPA's; each call is counted as
    ``dense:miss check``. Over any miss: the calls stay sparse."""
    ids = _ids(2, 1024, seed=3, device=device)
    ref = _logits(model, "sdpa", ids)
    wide = stem_hf.register("stem-test-miss", miss_check=1e-9, **BLOCKING, **TIGHT, **CPU_SHARE)
    narrow = stem_hf.register("stem-test-no-miss", miss_check=0.999, **BLOCKING, **TIGHT,
                              **CPU_SHARE)
    try:
        torch.testing.assert_close(_logits(model, "stem-test-miss", ids), ref, atol=1e-4,
                                   rtol=1e-4)
        assert wide.stats == {"dense:miss check": 2}, wide.stats
        rel = float((_logits(model, "stem-test-no-miss", ids) - ref).norm() / ref.norm())
        assert rel > 1e-3 and narrow.stats == {"stem": 2}, (rel, narrow.stats)
    finally:
        stem_hf.unregister("stem-test-miss")
        stem_hf.unregister("stem-test-no-miss")


def test_a_bad_miss_check_is_refused_at_registration():
    with pytest.raises(StemIndexerInputError, match="register: miss_check "):
        stem_hf.register("stem-test-bad", miss_check=-1)
    with pytest.raises(StemIndexerInputError, match="register: miss_check_blocks "):
        stem_hf.register("stem-test-bad", miss_check_blocks=0)


def test_density_by_layer_counts_the_sparse_calls_and_resets(model, registered, device):
    fn = registered[SPARSE]
    ids = _ids(1, 1024, seed=5, device=device)
    _logits(model, SPARSE, ids)
    fn.reset_stats()
    assert not fn.stats and fn.density_by_layer() == {} and fn.kept_pairs == 0
    _logits(model, SPARSE, ids)
    per_layer = fn.density_by_layer()
    assert fn.stats["stem"] == 2 and set(per_layer) == {0, 1}
    assert all(0 < d < 1 for d in per_layer.values()), per_layer
    kept, visible = (sum(pairs[i] for pairs in fn.layer_pairs.values()) for i in (0, 1))
    assert (kept, visible) == (fn.kept_pairs, fn.visible_pairs)
    # 64 query blocks of 16 tokens, causal: 64 * 65 / 2 visible pairs per head and layer.
    assert fn.visible_pairs == 2 * 4 * 64 * 65 // 2
    _logits(model, SPARSE, ids)  # counts add up; the same calls keep the same density
    assert fn.density_by_layer() == per_layer and fn.stats["stem"] == 4
    assert fn.visible_pairs == 2 * 2 * 4 * 64 * 65 // 2


@pytest.mark.parametrize("impl", [DENSE, SPARSE])
def test_padded_rows_equal_unpadded_sequences(model, registered, impl, device):
    length = 1024 if impl == SPARSE else 300
    ids = _ids(3, length, seed=4, device=device)
    mask = torch.ones_like(ids)
    mask[1, :100] = 0        # left padding (generate's layout)
    mask[2, -70:] = 0        # right padding
    out = _logits(model, impl, ids, mask)
    pairs = [(out[0], _logits(model, impl, ids[:1])[0]),
             (out[1, 100:], _logits(model, impl, ids[1:2, 100:])[0]),
             (out[2, :-70], _logits(model, impl, ids[2:3, :-70])[0])]
    for padded, alone in pairs:
        if impl == DENSE:
            torch.testing.assert_close(padded, alone, atol=2e-5, rtol=1e-5)
        else:
            # Batched and single-sequence projections differ by float
            # rounding (~1e-7), which can flip a near-tie top-k pick in a
            # layer and move the logits by ~1e-3 (the sparse-vs-dense gap is
            # ~1e-1). Same inputs give the same picks: see
            # test_left_padding_runs_each_valid_run_sparse.
            rel = float((padded - alone).norm() / alone.norm())
            assert rel < 1e-2, rel


def test_exact_tail_reaches_each_padded_run(model, registered, device):
    """``register(exact_tail=...)`` reaches stem_attention for each valid run
    of a padded batch: a tail as long as the prompt makes every row exact
    (SDPA's logits, through the sparse path), a 40-token tail changes the
    logits of its own blocks only against ``exact_tail=0`` (causal: earlier
    tokens never see it)."""
    ids = _ids(3, 1024, seed=4, device=device)
    mask = torch.ones_like(ids)
    mask[1, :100] = 0        # left padding: the rotated path
    mask[2, -70:] = 0        # right padding
    valid = mask.bool().cpu()
    names = {"none": 0, "tail": 40, "all": 4096}
    fns = {key: stem_hf.register(f"stem-test-tail-{key}", exact_tail=n, **BLOCKING, **TIGHT)
           for key, n in names.items()}
    try:
        sparse, last, exact = (_logits(model, fns[key].name, ids, mask).cpu() for key in names)
    finally:
        for fn in fns.values():
            stem_hf.unregister(fn.name)
    everything, tail = fns["all"], fns["tail"]
    assert dict(everything.stats) == {"stem-rotated": 2}, everything.stats
    assert everything.kept_pairs == everything.visible_pairs  # every row widened
    torch.testing.assert_close(exact[valid], _logits(model, "sdpa", ids, mask).cpu()[valid],
                               atol=1e-4, rtol=1e-4)
    # Blocks of 16 count from each run's first valid token: the tail's first
    # block starts at start + 16 * ((length - 40) // 16).
    start, length = torch.tensor([0, 100, 0]), valid.sum(1)
    first = start + 16 * ((length - 40) // 16)
    assert first.tolist() == [976, 980, 912]
    in_tail = (torch.arange(1024)[None, :] >= first[:, None]) & valid
    assert torch.equal(last[valid & ~in_tail], sparse[valid & ~in_tail])
    for b in range(3):  # each run's tail is its own: changed in every one
        assert not torch.allclose(last[b][in_tail[b]], sparse[b][in_tail[b]])
    assert tail.kept_pairs > fns["none"].kept_pairs


def test_generate_matches_sdpa_greedy(model, registered, device):
    ids = _ids(2, 160, seed=5, device=device)
    mask = torch.ones_like(ids)
    ids[1, :40], mask[1, :40] = 0, 0   # a shorter prompt, left padded
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    before = registered[DENSE].stats.copy()
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        ref = model.generate(ids, **kwargs)
        model.set_attn_implementation(DENSE)
        out = model.generate(ids, **kwargs)
    assert torch.equal(out, ref)
    after = registered[DENSE].stats
    assert after[KEEPS_ALL] > before[KEEPS_ALL]                    # the prompt
    assert after["dense:decode"] - before["dense:decode"] == 2 * 5  # 5 decode steps x 2 layers


def test_generate_decodes_from_the_sparse_prefill(model, registered, device):
    """generate() runs the prompt through Stem (sparse: its logits differ
    from SDPA's) and then decodes densely; its first token is the argmax of
    the sparse prefill's last logits."""
    ids = _ids(1, 1024, seed=6, device=device)
    before = registered[SPARSE].stats.copy()
    with torch.no_grad():
        model.set_attn_implementation(SPARSE)
        out = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
    sparse, dense = _logits(model, SPARSE, ids), _logits(model, "sdpa", ids)
    assert (sparse - dense).abs().max() > 1e-3  # the prefill really was sparse
    assert torch.equal(out[:, :1024], ids) and out.shape == (1, 1027)
    assert int(out[0, 1024]) == int(sparse[0, -1].argmax())
    after = registered[SPARSE].stats
    assert after["stem"] - before["stem"] >= 2                       # the prompt, 2 layers
    assert after["dense:decode"] - before["dense:decode"] == 2 * 2   # 2 decode steps


# --------------------------------------------------------------------------- #
# The attention function alone
# --------------------------------------------------------------------------- #


class _Module(torch.nn.Module):
    is_causal = True
    num_key_value_groups = 2


def _qkv(batch, q_len, kv_len, seed, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, 4, q_len, 16, generator=gen)
    k = torch.randn(batch, 2, kv_len, 16, generator=gen)
    v = torch.randn(batch, 2, kv_len, 16, generator=gen)
    return q.to(device), k.to(device), v.to(device)


def _sdpa_reference(q, k, v, valid):
    mask = masking.sdpa_mask(batch_size=q.shape[0], q_length=q.shape[2], kv_length=k.shape[2],
                     q_offset=k.shape[2] - q.shape[2], attention_mask=valid,
                     allow_is_causal_skip=False, device=q.device)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                           enable_gqa=True)
    return out.transpose(1, 2)


def test_left_padding_runs_each_valid_run_sparse(registered, device):
    fn = registered[SPARSE]
    q, k, v = _qkv(2, 1024, 1024, seed=7, device=device)
    valid = torch.ones(2, 1024, dtype=torch.bool, device=device)
    valid[1, :200] = False
    out, weights = fn(_Module(), q, k, v, valid, scaling=0.25)
    assert weights is None and out.shape == (2, 1024, 4, 16)
    alone = stem_attention(q[1:, :, 200:], k[1:, :, 200:], v[1:, :, 200:], scale=0.25,
                           **BLOCKING, **TIGHT, **CPU_SHARE)
    torch.testing.assert_close(out[1, 200:], alone[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    assert out[1, :200].abs().max() == 0                  # padding rows are zero
    whole = stem_attention(q[:1], k[:1], v[:1], scale=0.25, **BLOCKING, **TIGHT, **CPU_SHARE)
    torch.testing.assert_close(out[0], whole[0].transpose(0, 1), atol=1e-5, rtol=1e-5)


def test_chunked_prefill_with_padding_matches_sdpa(registered, device):
    # 64 new queries after 96 cached keys, left padding of 30 in batch 1.
    fn = registered[DENSE]
    q, k, v = _qkv(2, 64, 160, seed=8, device=device)
    valid = torch.ones(2, 160, dtype=torch.bool, device=device)
    valid[1, :30] = False
    out, _ = fn(_Module(), q, k, v, valid)
    torch.testing.assert_close(out, _sdpa_reference(q, k, v, valid), atol=1e-5, rtol=1e-5)


def test_mask_with_holes_falls_back_to_dense(registered, device):
    fn = registered[DENSE]
    q, k, v = _qkv(2, 64, 64, seed=9, device=device)
    valid = torch.ones(2, 64, dtype=torch.bool, device=device)
    valid[0, 10:20] = False                                # not one contiguous run
    before = fn.stats["dense:mask-holes"]
    out, _ = fn(_Module(), q, k, v, valid)
    assert fn.stats["dense:mask-holes"] == before + 1
    ref = _sdpa_reference(q, k, v, valid)
    rows = torch.ones(2, 64, dtype=torch.bool, device=device)
    rows[0, 10:20] = False                                 # padded queries: any output
    torch.testing.assert_close(out[rows], ref[rows], atol=1e-5, rtol=1e-5)


def test_four_d_mask_and_decode_use_sdpa(registered, device):
    fn = registered[DENSE]
    module = _Module()
    q, k, v = _qkv(1, 1, 50, seed=10, device=device)
    before = fn.stats.copy()
    out, _ = fn(module, q, k, v, None)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    torch.testing.assert_close(out, ref.transpose(1, 2), atol=1e-6, rtol=1e-6)
    q, k, v = _qkv(1, 40, 40, seed=11, device=device)
    mask = (torch.rand(1, 1, 40, 40, generator=torch.Generator().manual_seed(0)) > 0.3).to(device)
    mask[..., 0] = True
    out, _ = fn(module, q, k, v, mask)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                           enable_gqa=True)
    torch.testing.assert_close(out, ref.transpose(1, 2), atol=1e-5, rtol=1e-5)
    assert fn.stats["dense:decode"] == before["dense:decode"] + 1
    assert fn.stats["dense:mask"] == before["dense:mask"] + 1


# --------------------------------------------------------------------------- #
# The mask function and registration
# --------------------------------------------------------------------------- #


def test_mask_function_is_compact_only_for_plain_causal_masks():
    pad = torch.ones(2, 12, dtype=torch.bool)
    pad[1, :3] = False
    common = dict(batch_size=2, q_length=12, kv_length=12)
    assert stem_hf.stem_mask(**common) is None
    assert stem_hf.stem_mask(**common, attention_mask=torch.ones(2, 12, dtype=torch.bool)) is None
    assert torch.equal(stem_hf.stem_mask(**common, attention_mask=pad), pad)
    ones = stem_hf.stem_mask(batch_size=2, q_length=4, kv_length=12, q_offset=8)
    assert ones.shape == (2, 12) and bool(ones.all())
    sliding = masking.sliding_window_causal_mask_function(4)
    got = stem_hf.stem_mask(**common, mask_function=sliding, attention_mask=pad)
    want = masking.sdpa_mask(**common, mask_function=sliding, attention_mask=pad)
    assert got.dim() == 4 and torch.equal(got, want)
    # A static cache's offsets (more keys than seen tokens) also go to sdpa_mask.
    got = stem_hf.stem_mask(batch_size=2, q_length=4, kv_length=16, q_offset=8,
                            mask_function=masking.causal_mask_function, attention_mask=pad,
                            allow_is_causal_skip=False)
    assert got.dim() == 4


@pytest.mark.parametrize("kwargs, arg", [
    (dict(blocksize=16), "blocksize is not an argument of stem_attention"),
    (dict(scale=0.1), "scale is supplied by the model"),
    (dict(softcap=5.0), "softcap is supplied by the model"),
    (dict(num_prompt_tokens=[4096]), "num_prompt_tokens is per batch"),
    (dict(return_info=True), "return_info is set by the integration"),
    (dict(return_lse=True), "return_lse is set by the integration"),
    (dict(preset="fast"), "preset must be one of"),
    (dict(stem_block_size=12, stem_stride=8), "stem_block_size must be a multiple of stem_stride"),
    (dict(stem_block_size=0), "stem_block_size must be >= 1"),
    (dict(alpha=2.0), "alpha must be"),
    (dict(window_size=-1), "window_size must be >= 0"),
    (dict(topk_score_precision=3), "topk_score_precision must be"),
    (dict(oam="yes"), "oam must be True or False"),
    (dict(oam_lambda=float("nan")), "oam_lambda must be a finite number"),
    (dict(indexer_scale="0.1"), "indexer_scale must be a finite number"),
    (dict(min_q_blocks=-1), "min_q_blocks must be >= 0"),
    (dict(exact_tail=-1), "exact_tail must be >= 0"),
    (dict(backend="fast"), "backend must be one of"),
    (dict(min_prefill_tokens=0), "min_prefill_tokens must be >= 1"),
    (dict(min_prefill_tokens=True), "min_prefill_tokens must be an int"),
])
def test_register_checks_every_argument_when_called(kwargs, arg):
    """Each argument stem_attention would refuse at the model's first call
    (deep inside generate()) is refused by register() itself, with the
    package's one-line error, and nothing is registered."""
    with pytest.raises(StemIndexerInputError, match="^register: " + arg):
        stem_hf.register("stem-test-bad", **kwargs)
    assert "stem-test-bad" not in transformers.AttentionInterface._global_mapping
    with pytest.raises(StemIndexerInputError, match="^register: name must be a non-empty str"):
        stem_hf.register("")


def test_register_and_unregister_names():
    fn = stem_hf.register("stem-test-tmp", stem_block_size=32, stem_stride=8)
    assert fn.min_prefill_tokens == 32
    assert transformers.AttentionInterface._global_mapping["stem-test-tmp"] is fn
    assert "stem-test-tmp" in transformers.masking_utils.AttentionMaskInterface._global_mapping
    stem_hf.unregister("stem-test-tmp")
    assert "stem-test-tmp" not in transformers.AttentionInterface._global_mapping
    assert "stem-test-tmp" not in transformers.masking_utils.AttentionMaskInterface._global_mapping


def test_declared_transformers_floor_is_the_one_the_code_checks():
    """Every extra of pyproject.toml declares the floor the module enforces,
    the installed transformers meets it, and a transformers whose mask
    functions still take cache_position (before 5.4) is refused at import
    with that floor named (not deep inside a model's mask creation)."""
    import pathlib
    import re

    from packaging.version import Version

    text = (pathlib.Path(__file__).parents[1] / "pyproject.toml").read_text()
    floors = set(re.findall(r'"transformers>=([0-9.]+)"', text))
    assert floors == {stem_hf.MIN_TRANSFORMERS}
    assert Version(transformers.__version__) >= Version(stem_hf.MIN_TRANSFORMERS)

    def old_sdpa_mask(batch_size, cache_position, kv_length, kv_offset=0, **kwargs):
        """transformers 5.3's signature."""

    with pytest.raises(ImportError, match=r"needs transformers>=5\.4 .*found"):
        stem_hf._check_mask_signature(old_sdpa_mask)
    stem_hf._check_mask_signature(masking.sdpa_mask)  # the installed one is accepted
