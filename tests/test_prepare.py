"""prepare.py: qflat / kflat / vbias against per-token scalar references.

The inputs are defined in docs/CONTRACT.md section 7.
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch

import stem_indexer
from stem_indexer.pipeline.prepare import block_representation, output_aware_bias, stem_inputs


def _lens_list(lens, batch, seq):
    return [seq] * batch if lens is None else [int(x) for x in lens]


def ref_block_representation(x, bs, ts, reverse, lens):
    """Token by token: slot s (or Ts-1-s) of block i sums x[i*Bs + r*Ts + s] over r."""
    batch, heads, seq, dim = x.shape
    nblocks = -(-seq // bs)
    lens = _lens_list(lens, batch, seq)
    out = torch.zeros(batch, heads, nblocks, ts, dim, dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            for t in range(lens[b]):
                i, within = divmod(t, bs)
                s = within % ts
                slot = ts - 1 - s if reverse else s
                out[b, h, i, slot] += x[b, h, t].double()
    return out.reshape(batch, heads, nblocks, ts * dim)


def ref_vbias(v, bs, ts, lens, lam, eps=1e-6):
    """Run by run, with Python's statistics for the mean and unbiased std."""
    batch, heads, seq, _ = v.shape
    nblocks, ratio = -(-seq // bs), bs // ts
    lens = _lens_list(lens, batch, seq)
    out = torch.zeros(batch, heads, nblocks, dtype=torch.float64)
    for b in range(batch):
        n = -(-lens[b] // ts)
        for h in range(heads):
            logs = []
            for m in range(n):
                norms = [v[b, h, t].double().norm().item()
                         for t in range(m * ts, min((m + 1) * ts, lens[b]))]
                logs.append(math.log(max(norms) + eps))
            if n < 2:
                continue
            mean, std = statistics.fmean(logs), statistics.stdev(logs)
            z = [max((x - mean) / (std + eps), 0.0) for x in logs]
            for m in range(n):
                out[b, h, m // ratio] += lam * z[m] / ratio
    return out


CASES = [  # (batch, heads, seq, dim, bs, ts, lens)
    (1, 2, 32, 4, 8, 2, None),  # whole blocks
    (2, 3, 29, 5, 8, 4, None),  # tail block
    (3, 2, 37, 3, 8, 2, [37, 20, 9]),  # padded batches, partial runs
    (2, 1, 16, 4, 16, 16, [16, 0]),  # R = 1, an empty sequence
    (2, 2, 24, 3, 4, 1, [23, 5]),  # Ts = 1
]


@pytest.mark.parametrize("reverse", [False, True], ids=["qflat", "kflat"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}-H{c[1]}-S{c[2]}-Bs{c[4]}-Ts{c[5]}")
def test_block_representation_matches_token_loop(case, reverse):
    batch, heads, seq, dim, bs, ts, lens = case
    x = torch.randn(batch, heads, seq, dim, generator=torch.Generator().manual_seed(1))
    ref = ref_block_representation(x, bs, ts, reverse, lens)
    got32 = block_representation(x, bs, ts, reverse=reverse, lens=lens, dtype=torch.float32)
    torch.testing.assert_close(got32.double(), ref, rtol=1e-6, atol=1e-5)
    got = block_representation(x, bs, ts, reverse=reverse, lens=lens)
    assert got.dtype == torch.bfloat16
    # one rounding of the float32 sum: within one bfloat16 step of the exact sum
    torch.testing.assert_close(got.double(), ref, rtol=2 ** -8, atol=1e-6)


def test_scale_is_folded_before_rounding():
    x = torch.randn(1, 2, 24, 4, generator=torch.Generator().manual_seed(2))
    plain = block_representation(x, 8, 2, dtype=torch.float32)
    scaled = block_representation(x, 8, 2, scale=0.125)
    assert torch.equal(scaled, (plain * 0.125).to(torch.bfloat16))


def test_reversed_keys_give_the_antidiagonal_score():
    """dot(qflat_i, kflat_j) / R^2 == mean over r, r' of the stride-Ts antidiagonal sums."""
    bs, ts, dim = 8, 4, 3
    ratio = bs // ts
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 1, 16, dim, generator=g)
    k = torch.randn(1, 1, 24, dim, generator=g)
    qf = block_representation(q, bs, ts, dtype=torch.float32)[0, 0].double()
    kf = block_representation(k, bs, ts, reverse=True, dtype=torch.float32)[0, 0].double()
    for i in range(2):
        for j in range(3):
            expected = 0.0
            for s in range(ts):
                for r in range(ratio):
                    for r2 in range(ratio):
                        qt, kt = i * bs + r * ts + s, j * bs + r2 * ts + (ts - 1 - s)
                        expected += float(q[0, 0, qt].double() @ k[0, 0, kt].double())
            got = float(qf[i] @ kf[j]) / ratio ** 2
            assert got == pytest.approx(expected / ratio ** 2, rel=1e-5, abs=1e-5)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}-H{c[1]}-S{c[2]}-Bs{c[4]}-Ts{c[5]}")
@pytest.mark.parametrize("lam", [0.3, 0.2])
def test_vbias_matches_run_loop(case, lam):
    batch, heads, seq, dim, bs, ts, lens = case
    g = torch.Generator().manual_seed(4)
    # value norms spread over orders of magnitude, as in real layers
    v = torch.randn(batch, heads, seq, dim, generator=g) * torch.rand(
        batch, heads, seq, 1, generator=g).mul(4).exp()
    ref = ref_vbias(v, bs, ts, lens, lam)
    got = output_aware_bias(v, bs, ts, lens, oam_lambda=lam)
    assert got.dtype == torch.float32 and got.shape == ref.shape
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_vbias_of_any_float_dtype(dtype):
    """Models run in float64/bf16/fp16 too: vbias is float32 and matches the
    run loop on the same (rounded) values."""
    g = torch.Generator().manual_seed(8)
    v = (torch.randn(2, 2, 64, 8, generator=g) * 3).to(dtype)
    got = output_aware_bias(v, 16, 4, [64, 37])
    assert got.dtype == torch.float32
    ref = ref_vbias(v.double(), 16, 4, [64, 37], 0.3)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-6)


def test_vbias_fewer_than_two_runs_is_zero():
    v = torch.randn(3, 2, 16, 4, generator=torch.Generator().manual_seed(5)) * 10
    got = output_aware_bias(v, 8, 4, [4, 1, 0])  # one run, one (partial) run, none
    assert torch.equal(got, torch.zeros_like(got))
    got = output_aware_bias(v, 8, 4, [5, 16, 16])  # two runs: not all zero
    assert got[0].abs().sum() > 0


def test_vbias_sees_the_large_values():
    """A block holding the largest value norms gets the largest bias."""
    v = torch.randn(1, 1, 64, 8, generator=torch.Generator().manual_seed(6))
    v[0, 0, 40:48] *= 50
    got = output_aware_bias(v, 16, 4)
    assert int(got[0, 0].argmax()) == 2 and float(got[0, 0, 2]) > 0


def test_padding_content_never_matters():
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 2, 30, 4, generator=g) for _ in range(3))
    lens = [30, 13]
    a = stem_inputs(q, k, v, stem_block_size=8, stem_stride=2, q_lens=lens, kv_lens=lens)
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    for t in (q2, k2, v2):
        t[1, :, 13:] = 1e4 * torch.randn(2, 17, 4, generator=g)
    b = stem_inputs(q2, k2, v2, stem_block_size=8, stem_stride=2, q_lens=lens, kv_lens=lens)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_stem_inputs_feed_the_indexer():
    g = torch.Generator().manual_seed(8)
    q = torch.randn(2, 4, 70, 8, generator=g)
    k = torch.randn(2, 2, 90, 8, generator=g)
    v = torch.randn(2, 2, 90, 8, generator=g)
    inputs = stem_inputs(q, k, v, stem_block_size=16, stem_stride=4, q_lens=[70, 33],
                         kv_lens=torch.tensor([90, 50]))
    assert inputs.qflat.shape == (2, 4, 5, 32) and inputs.qflat.dtype == torch.bfloat16
    assert inputs.kflat.shape == (2, 2, 6, 32) and inputs.kflat.dtype == torch.bfloat16
    assert inputs.vbias.shape == (2, 2, 6) and inputs.vbias.dtype == torch.float32
    assert inputs.q_seq_lens.tolist() == [70, 33] and inputs.q_seq_lens.dtype == torch.int32
    assert inputs.kv_seq_lens.tolist() == [90, 50] and inputs.kv_seq_lens.dtype == torch.int32
    idx, seq_len = stem_indexer.stem_indexer(*inputs, stem_block_size=16, stem_stride=4)
    ref = stem_indexer.stem_indexer_reference(*inputs, stem_block_size=16, stem_stride=4)
    assert torch.equal(idx, ref[0]) and torch.equal(seq_len, ref[1])
    no_oam = stem_inputs(q, k, v, stem_block_size=16, stem_stride=4, oam=False)
    assert torch.equal(no_oam.vbias, torch.zeros(2, 2, 6))


@pytest.mark.parametrize("mutate, arg", [
    (lambda a: a.update(q=a["q"][0]), "q"),
    (lambda a: a.update(k=a["k"][:, :, :, :3]), "k"),
    (lambda a: a.update(v=a["v"][:, :, :5]), "v"),
    (lambda a: a.update(q=a["q"][:, :3]), "q"),
    (lambda a: a.update(q=a["q"].to(torch.int64)), "q"),
    (lambda a: a.update(stem_block_size=9), "stem_block_size must be a multiple"),
    (lambda a: a.update(stem_stride=0), "stem_stride must be >= 1"),
    (lambda a: a.update(q_lens=[5]), "q_lens"),
    (lambda a: a.update(q_lens=[5, 99]), "q_lens[1]"),
    (lambda a: a.update(kv_lens=torch.tensor([-1, 3])), "kv_lens[0]"),
    (lambda a: a.update(kv_lens=torch.tensor([1.0, 3.0])), "kv_lens"),
    (lambda a: a.update(oam_lambda=float("nan")), "oam_lambda"),
])
def test_invalid_inputs_name_the_argument(mutate, arg):
    g = torch.Generator().manual_seed(9)
    args = dict(q=torch.randn(2, 4, 20, 4, generator=g), k=torch.randn(2, 2, 20, 4, generator=g),
                v=torch.randn(2, 2, 20, 4, generator=g), stem_block_size=8, stem_stride=2)
    mutate(args)
    with pytest.raises(stem_indexer.StemIndexerInputError, match=arg.replace("[", r"\[")):
        stem_inputs(args.pop("q"), args.pop("k"), args.pop("v"), **args)
