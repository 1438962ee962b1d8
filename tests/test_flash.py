"""The FlashAttention-style entry points, the log-sum-exp, soft-capping, presets
and what ``stem_attention`` reports (``flash.py``, ``attention.py``)."""

from __future__ import annotations

import math

import pytest
import torch

import stem_indexer
from stem_indexer import (PRESETS, StemIndexerInputError, stem_attention, stem_attn_func,
                          stem_attn_varlen_func)

from stem_indexer.operator.contract import PARAM_NAMES, IndexerParams
from stem_indexer.testing import reference_attention, token_mask

from _helpers import SMALL, cpu_dense_above, host, qkv


# --------------------------------------------------------------------------- #
# Flash layout
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("seq", [64, 1100], ids=["dense-path", "sparse-path"])
def test_flash_layout_equals_stem_attention(seq, device):
    q, k, v = qkv(2, 4, 2, seq, seq, 8, 1, device=device)
    paths = cpu_dense_above(device)  # 1100 tokens: the sparse path on every device
    want, want_lse = stem_attention(q, k, v, return_lse=True, **paths, **SMALL)
    out, lse = stem_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                              causal=True, return_lse=True, **paths, **SMALL)
    assert out.shape == (2, seq, 4, 8) and out.is_contiguous()
    torch.testing.assert_close(out, want.transpose(1, 2))
    torch.testing.assert_close(lse, want_lse)


def test_lse_is_the_log_sum_exp_of_the_attended_scores(device):
    q, k, v = qkv(1, 2, 1, 64, 96, 8, 2)  # dense: 6 blocks of 16 for 4 query blocks
    scale = 8 ** -0.5
    out, lse = (host(t, device) for t in stem_attention(
        *(x.to(device) for x in (q, k, v)), return_lse=True, **SMALL))
    ref, ref_lse = reference_attention(q, k, v, scale=scale, causal=True, return_lse=True)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)


def test_partial_results_merge_exactly_by_lse(device):
    """Attention over all keys = the lse-weighted merge of attention over a
    prefix (non-causal, chunked prefill) and over the rest (causal)."""
    q, k, v = qkv(1, 2, 2, 64, 160, 8, 3, device=device)
    full, lse = stem_attention(q, k, v, return_lse=True, **SMALL)
    a, lse_a = stem_attention(q, k[:, :, :96], v[:, :, :96], causal=False, return_lse=True,
                              **SMALL)
    b, lse_b = stem_attention(q, k[:, :, 96:], v[:, :, 96:], return_lse=True, **SMALL)
    merged_lse = torch.logaddexp(lse_a, lse_b)
    merged = (a * (lse_a - merged_lse).exp()[..., None]
              + b * (lse_b - merged_lse).exp()[..., None])
    torch.testing.assert_close(merged, full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(merged_lse, lse, rtol=1e-5, atol=1e-5)


def test_sparse_path_lse_matches_its_selection(device):
    """On the sparse path the lse is over the listed blocks only."""
    q, k, v = qkv(1, 2, 1, 1100, 1100, 8, 4, device=device)
    scale = 8 ** -0.5
    out, lse, info = stem_attention(q, k, v, return_lse=True, return_info=True, preset="tight",
                                    exact_tail=0, **SMALL)
    assert info.path == "sparse" and info.density < 0.5
    inputs = stem_indexer.stem_inputs(q, k, v, stem_block_size=16, stem_stride=4, scale=scale / 4)
    idx, seq_len = (host(t, device)
                    for t in stem_indexer.stem_indexer(*inputs, **PRESETS["tight"], **SMALL))
    out, lse = host(out, device), host(lse, device)
    q, k, v = (x.cpu() for x in (q, k, v))
    for h, i in [(0, 40), (1, 60)]:
        allowed = torch.zeros(1100, dtype=torch.bool)
        for j in idx[0, h, i, :int(seq_len[0, h, i])].tolist():
            allowed[j * 16:(j + 1) * 16] = True
        rows = slice(i * 16, (i + 1) * 16)
        seen = allowed[None, :] & (torch.arange(1100)[None, :]
                                   <= torch.arange(rows.start, rows.stop)[:, None])
        ref, ref_lse = reference_attention(q[:, h:h + 1, rows], k, v, seen, scale=scale,
                                           return_lse=True)
        torch.testing.assert_close(lse[0, h, rows].double(), ref_lse[0, 0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out[0, h, rows].double(), ref[0, 0], rtol=1e-5, atol=1e-5)


def test_varlen_equals_each_sequence_alone(device):
    lens_q, lens_k = [40, 1100, 7, 300], [40, 1100, 90, 300]
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(sum(lens_q), 4, 8, generator=gen).to(device)
    k = torch.randn(sum(lens_k), 2, 8, generator=gen).to(device)
    v = torch.randn(sum(lens_k), 2, 8, generator=gen).to(device)
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
    paths = cpu_dense_above(device)  # the 1100-token sequence: the sparse path everywhere
    out, lse = stem_attn_varlen_func(q, k, v, cu_q.to(device), cu_k.to(device), max(lens_q),
                                     max(lens_k), causal=True, return_lse=True, **paths, **SMALL)
    assert out.shape == q.shape and lse.shape == (4, sum(lens_q))
    assert out.device == q.device and lse.device == q.device
    for b in range(4):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        alone, alone_lse = stem_attn_func(q[None, qs], k[None, ks], v[None, ks],
                                          causal=True, return_lse=True, **paths, **SMALL)
        torch.testing.assert_close(out[qs], alone[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse[:, qs], alone_lse[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("call, match", [
    (lambda q, k, v, cu: stem_attn_varlen_func(q, k, v, cu.long(), cu, 8, 8), "cu_seqlens_q"),
    (lambda q, k, v, cu: stem_attn_varlen_func(q, k, v, cu.flip(0), cu, 8, 8), "cu_seqlens_q"),
    (lambda q, k, v, cu: stem_attn_varlen_func(q, k, v, cu, cu[:2], 8, 8), "cu_seqlens_k"),
    (lambda q, k, v, cu: stem_attn_varlen_func(q, k, v, cu, cu, 4, 8), "max_seqlen_q"),
    (lambda q, k, v, cu: stem_attn_varlen_func(q[None], k, v, cu, cu, 8, 8), "q must be a 3-D"),
])
def test_varlen_bad_arguments(call, match):
    q, k, v = (torch.randn(12, 2, 4) for _ in range(3))
    cu = torch.tensor([0, 8, 12], dtype=torch.int32)
    with pytest.raises(StemIndexerInputError, match=match):
        call(q, k, v, cu)


def test_flash_attention_signature_as_flash_attention_means_it(device):
    """Code written for flash_attn_func / flash_attn_varlen_func: the same
    positional arguments (dropout_p third), FlashAttention's defaults
    (causal=False, window_size=(-1, -1), softcap=0.0 = off), and
    return_attn_probs's (out, lse, S_dmask) with no probabilities."""
    q, k, v = qkv(1, 2, 1, 64, 96, 8, 30)  # short: dense, so compared with float64 directly
    fq, fk, fv = (x.transpose(1, 2).to(device) for x in (q, k, v))
    scale = 0.2
    causal_ref, causal_lse = reference_attention(q, k, v, scale=scale, causal=True,
                                                  return_lse=True)
    full_ref = reference_attention(q, k, v, scale=8 ** -0.5)
    # positional, as flash_attn_func(q, k, v, dropout_p, softmax_scale, causal,
    # window_size, softcap, alibi_slopes, deterministic, return_attn_probs)
    out, lse, probs = stem_attn_func(fq, fk, fv, 0.0, scale, True, (-1, -1), 0.0, None, False,
                                     True, **SMALL)
    assert probs is None
    out, lse = host(out, device), host(lse, device)
    torch.testing.assert_close(out.transpose(1, 2).double(), causal_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), causal_lse, rtol=1e-5, atol=1e-5)
    # FlashAttention's defaults: not causal, no window, no cap
    out = host(stem_attn_func(fq, fk, fv, **SMALL), device)
    torch.testing.assert_close(out.transpose(1, 2).double(), full_ref, rtol=1e-5, atol=1e-5)
    # causal with (-1, 0): FlashAttention's own spelling of a causal window
    out = host(stem_attn_func(fq, fk, fv, softmax_scale=scale, causal=True, window_size=(-1, 0),
                              **SMALL), device)
    torch.testing.assert_close(out.transpose(1, 2).double(), causal_ref, rtol=1e-5, atol=1e-5)
    cu_q = torch.tensor([0, 64], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 96], dtype=torch.int32, device=device)
    packed = host(stem_attn_varlen_func(fq[0], fk[0], fv[0], cu_q, cu_k, 64, 96, 0.0, scale, True,
                                        (-1, -1), 0.0, None, False, False, None, **SMALL), device)
    torch.testing.assert_close(packed.transpose(0, 1)[None].double(), causal_ref, rtol=1e-5,
                               atol=1e-5)
    packed = host(stem_attn_varlen_func(fq[0], fk[0], fv[0], cu_q, cu_k, 64, 96, **SMALL), device)
    torch.testing.assert_close(packed.transpose(0, 1)[None].double(), full_ref, rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("call, match", [
    (lambda f, x: f(*x, 0.1), "dropout_p must be 0.0"),
    (lambda f, x: f(*x, dropout_p=True), "dropout_p must be 0.0"),
    (lambda f, x: f(*x, window_size=(128, 0), causal=True), r"window_size must be \(-1, -1\)"),
    (lambda f, x: f(*x, window_size=(-1, 4)), r"window_size must be \(-1, -1\)"),
    (lambda f, x: f(*x, window_size=(-1,)), "window_size must be a pair of ints"),
    (lambda f, x: f(*x, softcap=-1.0), "softcap must be 0.0"),
    (lambda f, x: f(*x, alibi_slopes=torch.ones(2)), "alibi_slopes must be None"),
    (lambda f, x: f(*x, deterministic=1), "deterministic must be True or False"),
    (lambda f, x: f(*x, scale=0.1), "scale is softmax_scale here"),
    (lambda f, x: f(*x, return_info=True), "return_info is not available here"),
    (lambda f, x: f(*x, window_size=2), "window_size must be a pair of ints .* "
                                         "stem_window_blocks"),
])
@pytest.mark.parametrize("varlen", [False, True], ids=["func", "varlen"])
def test_flash_functions_refuse_what_stem_cannot_honour(call, match, varlen):
    q, k, v = (x.transpose(1, 2) for x in qkv(1, 2, 1, 32, 32, 8, 31))
    if varlen:
        cu = torch.tensor([0, 32], dtype=torch.int32)
        x, f, who = (q[0], k[0], v[0], cu, cu, 32, 32), stem_attn_varlen_func, "varlen_func"
    else:
        x, f, who = (q, k, v), stem_attn_func, "func"
    with pytest.raises(StemIndexerInputError, match=f"^stem_attn_{who}: {match}"):
        call(f, x)
    if varlen:
        with pytest.raises(StemIndexerInputError, match="block_table must be None"):
            f(*x, block_table=torch.zeros(1, 1, dtype=torch.int32))
        with pytest.raises(StemIndexerInputError, match="q_lens is given by cu_seqlens_q"):
            f(*x, q_lens=[32])


def test_stem_window_blocks_is_the_indexers_window(device):
    """The indexer's window (stem_attention's window_size) is
    stem_window_blocks here; window_size is FlashAttention's token window."""
    q, k, v = qkv(1, 2, 1, 1100, 1100, 8, 32, device=device)
    fq, fk, fv = (x.transpose(1, 2) for x in (q, k, v))
    want = stem_attention(q, k, v, window_size=1, preset="tight", **SMALL)
    default = stem_attention(q, k, v, preset="tight", **SMALL)
    assert not torch.equal(want, default)  # the window changes the selection
    out = stem_attn_func(fq, fk, fv, causal=True, stem_window_blocks=1, preset="tight", **SMALL)
    torch.testing.assert_close(out.transpose(1, 2), want, rtol=0, atol=0)


def test_a_tensor_in_the_other_layout_is_refused():
    q, k, v = qkv(1, 8, 2, 2048, 2048, 8, 6)
    with pytest.raises(StemIndexerInputError, match=r"is it \[B, S, H, D\]"):
        stem_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    with pytest.raises(StemIndexerInputError, match=r"is it \[B, H, S, D\]"):
        stem_attn_func(q, k, v)
    with pytest.raises(StemIndexerInputError, match="multiple of k's heads"):
        stem_attn_func(q.transpose(1, 2)[:, :, :3], k.transpose(1, 2), v.transpose(1, 2))


# --------------------------------------------------------------------------- #
# Soft-capping, presets, info
# --------------------------------------------------------------------------- #


# FlexAttention's cap (a score_mod) is checked against a capped reference in
# tests/test_attention.py, with the other compiled FlexAttention tests.
@pytest.mark.parametrize("backend", ["native", "gather"])
def test_softcap_on_the_dense_and_sparse_paths(backend, device):
    if backend == "native" and device != "cpu":
        pytest.skip("backend 'native' runs on CPU tensors only")
    if backend == "native" and stem_indexer.pipeline.dispatch._native() is None:
        pytest.skip("the native kernel is not built here")
    q, k, v = qkv(1, 2, 1, 64, 64, 8, 7)
    q = q * 4  # large logits, where capping matters
    scale = 8 ** -0.5
    out = stem_attention(*(x.to(device) for x in (q, k, v)), softcap=5.0, backend=backend,
                         **SMALL)
    out = host(out, device)
    ref = reference_attention(q, k, v, scale=scale, softcap=5.0, causal=True)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    uncapped = reference_attention(q, k, v, scale=scale, causal=True)
    assert (ref - uncapped).abs().max() > 1e-2  # the cap changed the result
    # The sparse path: the capped reference on the indexer's selection (the
    # cap acts after the selection, which it does not change).
    q, k, v = qkv(1, 2, 1, 1100, 1100, 8, 8, device=device)
    q = q * 4
    capped, info = stem_attention(q, k, v, softcap=5.0, backend=backend, return_info=True,
                                  dense_above=1.0, exact_tail=0, **SMALL)
    assert info.path == "sparse" and info.backend == backend
    inputs = stem_indexer.stem_inputs(q, k, v, scale=scale / 4, **SMALL)
    idx, seq_len = (host(t, device) for t in stem_indexer.stem_indexer(*inputs, **SMALL))
    listed = token_mask(idx, seq_len, 16, 1100, 1100)
    capped, q, k, v = host(capped, device), q.cpu(), k.cpu(), v.cpu()
    ref = reference_attention(q, k, v, listed, scale=scale, softcap=5.0)
    torch.testing.assert_close(capped.double(), ref, rtol=1e-5, atol=1e-5)
    uncapped = reference_attention(q, k, v, listed, scale=scale)
    assert (ref - uncapped).abs().max() > 1e-2  # the cap changed the result


@pytest.mark.parametrize("value", [0.0, -1.0, math.inf, True, "5"])
def test_softcap_must_be_positive(value):
    q, k, v = qkv(1, 2, 1, 64, 64, 8, 9)
    with pytest.raises(StemIndexerInputError, match="stem_attention: softcap"):
        stem_attention(q, k, v, softcap=value)


def test_presets_keep_fewer_blocks_in_order(device):
    q, k, v = qkv(1, 2, 1, 2048, 2048, 8, 10, device=device)  # 128 blocks of 16
    paths = cpu_dense_above(device)  # the default preset: sparse on every device
    density = {name: stem_attention(q, k, v, preset=name, return_info=True, **paths,
                                    **SMALL)[1].density
               for name in PRESETS}
    # 128 blocks: Ks 55, 40, 28 and 16 (test_budget.py has them by hand)
    assert density["default"] > density["serving"] > density["balanced"] > density["tight"]
    # a preset's field can still be set by hand, and equals the explicit call
    a = stem_attention(q, k, v, preset="tight", alpha=0.5, **SMALL)
    b = stem_attention(q, k, v, alpha=0.5, **PRESETS["tight"], **SMALL)
    assert torch.equal(a, b)
    with pytest.raises(StemIndexerInputError, match="preset must be one of"):
        stem_attention(q, k, v, preset="fastest")


def test_info_tells_which_path_ran(device):
    q, k, v = qkv(1, 2, 1, 300, 300, 8, 11, device=device)
    _, info = stem_attention(q, k, v, return_info=True, **SMALL)  # 19 blocks: keeps all
    assert (info.path, info.reason, info.backend) == ("dense", "budget keeps every block",
                                                      "sdpa")
    assert info.density == 1.0 and info.kept_pairs == info.visible_pairs == 2 * 19 * 20 // 2
    _, info = stem_attention(q[:, :, :1], k, v, return_info=True, **SMALL)
    assert (info.path, info.reason) == ("dense", "decode")
    q, k, v = qkv(1, 2, 1, 1100, 1100, 8, 12, device=device)
    _, info = stem_attention(q, k, v, return_info=True, preset="tight", exact_tail=0, **SMALL)
    assert info.path == "sparse" and info.reason == "" and 0 < info.density < 0.5
    assert info.visible_pairs == 2 * 69 * 70 // 2


# --------------------------------------------------------------------------- #
# Inside compiled models
# --------------------------------------------------------------------------- #


def _flash_layout(q, k, v):
    """[B, H, S, D] tensors as [B, S, H, D] (contiguous there): stem_attn_func's
    inputs, whose transposes reach the ops with a transposed q."""
    return tuple(x.transpose(1, 2).contiguous() for x in (q, k, v))


def _stem_op_args(q, k, v, lens, **params):
    p = IndexerParams.from_kwargs("test", **params)
    return (q, k, v, lens, lens, None, *(getattr(p, f) for f in PARAM_NAMES), 8 ** -0.5,
            None, True, 0.3, None, 2, "auto", True)


@pytest.mark.parametrize("layout", [pytest.param("contiguous", marks=pytest.mark.slow),
                                    "transposed-q"])
def test_both_ops_pass_opcheck(layout, device):
    """torch.library.opcheck on both custom ops (schema, fake kernel against
    the real one, output layouts included, and tracing with dynamic shapes);
    with a transposed q (stem_attn_func's and the Hugging Face models') the
    fakes must still give the real outputs' contiguous layout."""
    q, k, v = qkv(2, 4, 2, 40, 40, 8, 16, device=device)
    if layout == "transposed-q":
        q = q.transpose(1, 2).contiguous().transpose(1, 2)
    idx = torch.arange(3, dtype=torch.int32, device=device).expand(2, 4, 3, 3).contiguous()
    seq_len = torch.tensor([1, 2, 3], dtype=torch.int32,
                           device=device).expand(2, 4, 3).contiguous()
    lens = torch.tensor([40, 33], device=device)
    torch.library.opcheck(torch.ops.stem_indexer.block_sparse_attention.default,
                          (q, k, v, idx, seq_len, lens, lens, 16, True, 0.3, None, "auto", True))
    for seq in (40, 1100):  # the dense path, then the sparse one
        q, k, v = qkv(1, 2, 1, seq, seq, 8, 17, device=device)
        if layout == "transposed-q":
            q = q.transpose(1, 2).contiguous().transpose(1, 2)
        torch.library.opcheck(torch.ops.stem_indexer.stem_attention.default,
                              _stem_op_args(q, k, v, torch.tensor([seq], device=device),
                                            **SMALL))


@pytest.mark.parametrize("seq, layout", [
    (64, "BHSD"), pytest.param(1100, "BHSD", marks=pytest.mark.slow), (1100, "BSHD")],
    ids=["dense-path", "sparse-path", "sparse-path-BSHD"])
def test_stem_attention_under_fullgraph_compile_equals_eager(seq, layout, device):
    """stem_attention on [B, H, S, D], and stem_attn_func on [B, S, H, D]
    (which hands the op a transposed q), compiled with fullgraph=True."""
    q, k, v = qkv(2, 4, 2, seq, seq, 8, 13, device=device)
    lens = torch.tensor([seq, seq - 37], device=device)
    paths = cpu_dense_above(device)  # 1100 tokens: the sparse path on every device

    if layout == "BHSD":
        def fn(q, k, v, lens):
            return stem_attention(q, k, v, q_lens=lens, kv_lens=lens, return_lse=True, **paths,
                                  **SMALL)
    else:
        q, k, v = _flash_layout(q, k, v)

        def fn(q, k, v, lens):  # full lengths: stem_attn_func takes no per-batch lengths
            return stem_attn_func(q, k, v, causal=True, return_lse=True, **paths, **SMALL)

    eager = fn(q, k, v, lens)
    compiled = torch.compile(fn, fullgraph=True)(q, k, v, lens)
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_dynamic_shape_compile_equals_eager_at_two_lengths(device):
    """torch.compile(fullgraph=True, dynamic=True), as docs/OPERATOR.md says: the
    checks of Python floats (which are traced as symbols there) and the ops
    trace; one compiled function, two sequence lengths (the dense and the
    sparse path), each equal to eager, in both layouts; block_sparse_attention
    likewise."""
    paths = cpu_dense_above(device)  # 1100 tokens: the sparse path on every device
    fns = {"stem_attention": lambda q, k, v: stem_attention(q, k, v, return_lse=True, **paths,
                                                            **SMALL),
           "stem_attn_func": lambda q, k, v: stem_attn_func(q, k, v, causal=True,
                                                            return_lse=True, **paths, **SMALL)}
    for name, fn in fns.items():
        compiled = torch.compile(fn, fullgraph=True, dynamic=True)
        for seq in (300, 1100):
            q, k, v = qkv(1, 4, 2, seq, seq, 8, seq, device=device)
            if name == "stem_attn_func":
                q, k, v = _flash_layout(q, k, v)
            for a, b in zip(compiled(q, k, v), fn(q, k, v)):
                torch.testing.assert_close(a, b, rtol=0, atol=0)

    def sparse(q, k, v, idx, lens):
        return stem_indexer.block_sparse_attention(q, k, v, idx, lens, stem_block_size=16,
                                                   return_lse=True)

    compiled = torch.compile(sparse, fullgraph=True, dynamic=True)
    for seq in (100, 140):
        nb = -(-seq // 16)
        q, k, v = qkv(1, 4, 2, seq, seq, 8, seq, device=device)
        idx = torch.arange(nb, dtype=torch.int32, device=device).expand(1, 4, nb, nb).contiguous()
        lens = torch.arange(1, nb + 1, dtype=torch.int32,
                            device=device).expand(1, 4, nb).contiguous()
        for a, b in zip(compiled(q, k, v, idx, lens), sparse(q, k, v, idx, lens)):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_block_sparse_attention_under_fullgraph_compile_equals_eager(device):
    q, k, v = qkv(1, 4, 2, 100, 100, 8, 14, device=device)
    idx = torch.arange(7, dtype=torch.int32, device=device).expand(1, 4, 7, 7).contiguous()
    lens = torch.arange(1, 8, dtype=torch.int32, device=device).expand(1, 4, 7).contiguous()

    def fn(q, k, v, idx, lens):
        return stem_indexer.block_sparse_attention(q, k, v, idx, lens, stem_block_size=16)

    torch.testing.assert_close(torch.compile(fn, fullgraph=True)(q, k, v, idx, lens),
                               fn(q, k, v, idx, lens), rtol=0, atol=0)


def test_return_info_is_refused_under_compile():
    q, k, v = qkv(1, 2, 1, 64, 64, 8, 15)
    fn = torch.compile(lambda q: stem_attention(q, k, v, return_info=True, **SMALL),
                       fullgraph=True)
    with pytest.raises(Exception, match="return_info is not available under torch.compile"):
        fn(q)


@pytest.mark.slow
def test_hf_model_with_stem_runs_under_compile(device):
    transformers = pytest.importorskip("transformers")
    import stem_indexer.integrations.transformers as stem_hf

    fn = stem_hf.register("stem-test-compile", **SMALL, preset="tight")
    try:
        torch.manual_seed(0)
        config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                          num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2, max_position_embeddings=2048)
        model = transformers.LlamaForCausalLM(config).eval().to(device)
        model.set_attn_implementation(fn.name)
        ids = torch.randint(1, 128, (1, 1024),
                            generator=torch.Generator().manual_seed(1)).to(device)
        with torch.no_grad():
            eager = model(ids).logits
            compiled = torch.compile(model)(ids).logits
        torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)
        assert fn.stats["stem"] >= 4  # both layers, eager and compiled: sparse
    finally:
        stem_hf.unregister(fn.name)
