"""docs/CONTRACT.md section 4: every input check, one readable case each.

Each invalid input must raise ``StemIndexerInputError`` (a ValueError) whose
message names the offending argument, through the raw op
``torch.ops.custom.npu_stem_indexer`` and through ``stem_indexer.stem_indexer``.
Then the metadata op's own checks, metadata mismatches field by field, the
generalised parameters (which must work and match the reference), and a check
firing under ``torch.compile`` (in the fake kernel).
"""

from __future__ import annotations

import math

import pytest
import torch

import stem_indexer
from stem_indexer import StemIndexerInputError
from stem_indexer.operator import metadata as md

from _helpers import assert_out_equal, i32, random_inputs

BASE_PARAMS = dict(stem_block_size=4, stem_stride=2, initial_blocks=1, window_size=1)


def base_args(batch=2, nq=4, nk=2, qmax=3, kmax=5, df=8):
    """Valid inputs: B 2, Nq 4, Nk 2, Qmax 3, Kmax 5, Df 8, Bs 4, Ts 2."""
    gen = torch.Generator().manual_seed(0)
    inp = random_inputs(gen, batch=batch, nq=nq, nk=nk, qmax=qmax, kmax=kmax, df=df,
                        q_lens=[12, 5][:batch], kv_lens=[20, 9][:batch],
                        prompt=[20, 30][:batch], integer=True)
    args = inp.as_dict()
    args["params"] = dict(BASE_PARAMS)
    args["metadata"] = build_metadata(args)
    return args


def build_metadata(args, **over):
    p = dict(BASE_PARAMS, **args.get("params", {}))
    kw = dict(causal=p.get("causal", True), stem_block_size=p["stem_block_size"],
              dim_qkflat=args["qflat"].shape[-1], window_size=p["window_size"])
    q_heads, kv_heads = args["qflat"].shape[1], args["kflat"].shape[1]
    q_lens, kv_lens = args["q_seq_lens"], args["kv_seq_lens"]
    q_heads = over.pop("q_heads", q_heads)
    kv_heads = over.pop("kv_heads", kv_heads)
    q_lens = over.pop("q_seq_lens", q_lens)
    kv_lens = over.pop("kv_seq_lens", kv_lens)
    kw.update(over)
    return torch.ops.custom.npu_stem_indexer_metadata(q_lens, kv_lens, q_heads, kv_heads, **kw)


def call_op(args):
    return torch.ops.custom.npu_stem_indexer(
        args["qflat"], args["kflat"], args["vbias"], args["q_seq_lens"], args["kv_seq_lens"],
        num_prompt_tokens=args["num_prompt_tokens"], metadata=args["metadata"],
        **args["params"])


def call_api(args):
    return stem_indexer.stem_indexer(
        args["qflat"], args["kflat"], args["vbias"], args["q_seq_lens"], args["kv_seq_lens"],
        num_prompt_tokens=args["num_prompt_tokens"], metadata=args["metadata"],
        **args["params"])


def test_base_args_are_valid():
    # The invalid cases below each change one thing in these inputs.
    args = base_args()
    idx, seq = call_op(args)
    assert idx.shape == (2, 4, 3, 5) and int(seq.sum()) > 0
    call_api(args)


def _set(name, value):
    def mutate(a):
        a[name] = value(a[name]) if callable(value) else value
    return mutate


def _param(name, value):
    def mutate(a):
        a["params"][name] = value
    return mutate


def _len(name, b, value):
    def mutate(a):
        t = a[name].clone()
        t[b] = value
        a[name] = t
    return mutate


def _cat_batch(name):
    return _set(name, lambda t: torch.cat([t, t[:1]]))


def _zero_dim(d):
    return _set("qflat", lambda t: t.narrow(d, 0, 0))


def _heads_not_divisible(a):
    a["kflat"] = torch.cat([a["kflat"], a["kflat"][:, :1]], 1)  # Nk 3, Nq 4
    a["vbias"] = torch.cat([a["vbias"], a["vbias"][:, :1]], 1)


def _batch_65537(a):
    b = 65537
    a["qflat"] = torch.zeros(b, 1, 1, 1, dtype=torch.bfloat16)
    a["kflat"] = torch.zeros(b, 1, 1, 1, dtype=torch.bfloat16)
    a["vbias"] = torch.zeros(b, 1, 1)
    for n in ("q_seq_lens", "kv_seq_lens", "num_prompt_tokens"):
        a[n] = torch.zeros(b, dtype=torch.int32)
    a["metadata"] = torch.zeros(4096, dtype=torch.int32)


def _batch_0(a):
    for n in ("qflat", "kflat", "vbias", "q_seq_lens", "kv_seq_lens", "num_prompt_tokens"):
        a[n] = a[n][:0]


INVALID = [
    # ndim
    ("qflat-1d", _set("qflat", lambda t: t.flatten()), "qflat"),
    ("qflat-3d", _set("qflat", lambda t: t[0]), "qflat"),
    ("qflat-5d", _set("qflat", lambda t: t[None]), "qflat"),
    ("kflat-1d", _set("kflat", lambda t: t.flatten()), "kflat"),
    ("kflat-3d", _set("kflat", lambda t: t[0]), "kflat"),
    ("vbias-2d", _set("vbias", lambda t: t[0]), "vbias"),
    ("vbias-4d", _set("vbias", lambda t: t[..., None]), "vbias"),
    ("q_seq_lens-2d", _set("q_seq_lens", lambda t: t[None]), "q_seq_lens"),
    ("kv_seq_lens-0d", _set("kv_seq_lens", lambda t: t[0]), "kv_seq_lens"),
    ("num_prompt_tokens-2d", _set("num_prompt_tokens", lambda t: t[:, None]),
     "num_prompt_tokens"),
    ("metadata-2d", _set("metadata", lambda t: t.view(2, -1)), "metadata"),
    # dtype
    ("qflat-float16", _set("qflat", lambda t: t.half()), "qflat"),
    ("qflat-float32", _set("qflat", lambda t: t.float()), "qflat"),
    ("kflat-float32", _set("kflat", lambda t: t.float()), "kflat"),
    ("vbias-bfloat16", _set("vbias", lambda t: t.bfloat16()), "vbias"),
    ("vbias-float64", _set("vbias", lambda t: t.double()), "vbias"),
    ("q_seq_lens-int64", _set("q_seq_lens", lambda t: t.long()), "q_seq_lens"),
    ("kv_seq_lens-float32", _set("kv_seq_lens", lambda t: t.float()), "kv_seq_lens"),
    ("num_prompt_tokens-int64", _set("num_prompt_tokens", lambda t: t.long()),
     "num_prompt_tokens"),
    ("metadata-int64", _set("metadata", lambda t: t.long()), "metadata"),
    # zero-sized dims of qflat, batch range
    ("qflat-Nq-0", _zero_dim(1), "qflat"),
    ("qflat-Qmax-0", _zero_dim(2), "qflat"),
    ("qflat-Df-0", lambda a: (_zero_dim(3)(a), _set("kflat", lambda t: t[..., :0])(a)),
     "qflat"),
    ("batch-0", _batch_0, "qflat|batch"),
    ("batch-65537", _batch_65537, "batch size must be in \\[1, 65536\\]"),
    # batch / Df / heads / vbias shape agreement
    ("kflat-batch", _cat_batch("kflat"), "kflat"),
    ("vbias-batch", _cat_batch("vbias"), "vbias"),
    ("q_seq_lens-batch", _cat_batch("q_seq_lens"), "q_seq_lens"),
    ("kv_seq_lens-batch", _cat_batch("kv_seq_lens"), "kv_seq_lens"),
    ("num_prompt_tokens-batch", _cat_batch("num_prompt_tokens"), "num_prompt_tokens"),
    ("kflat-Df-mismatch", _set("kflat", lambda t: torch.cat([t, t[..., :1]], -1)), "kflat"),
    ("Nq4-Nk3-not-divisible", _heads_not_divisible, "qflat.*kflat"),
    ("vbias-Kmax-mismatch", _set("vbias", lambda t: t[..., :-1]), "vbias"),
    ("vbias-Nk-mismatch", _set("vbias", lambda t: t[:, :1]), "vbias"),
    # length values
    ("q_seq_lens-negative", _len("q_seq_lens", 1, -1), "q_seq_lens"),
    ("q_seq_lens-over-Qmax*Bs", _len("q_seq_lens", 0, 3 * 4 + 1), "q_seq_lens"),
    ("kv_seq_lens-negative", _len("kv_seq_lens", 1, -5), "kv_seq_lens"),
    ("kv_seq_lens-over-Kmax*Bs", _len("kv_seq_lens", 0, 5 * 4 + 1), "kv_seq_lens"),
    ("num_prompt_tokens-below-kv", _len("num_prompt_tokens", 0, 19), "num_prompt_tokens"),
    ("num_prompt_tokens-negative", _len("num_prompt_tokens", 1, -1), "num_prompt_tokens"),
    # attributes
    ("alpha-0", _param("alpha", 0.0), "alpha"),
    ("alpha-negative", _param("alpha", -0.5), "alpha"),
    ("alpha-above-1", _param("alpha", 1.5), "alpha"),
    ("alpha-nan", _param("alpha", math.nan), "alpha"),
    ("alpha-inf", _param("alpha", math.inf), "alpha"),
    ("precision-0", _param("topk_score_precision", 0), "topk_score_precision"),
    ("precision-3", _param("topk_score_precision", 3), "topk_score_precision"),
    ("stem_block_size-0", _param("stem_block_size", 0), "stem_block_size"),
    ("stem_block_size-negative", _param("stem_block_size", -4), "stem_block_size"),
    ("stem_stride-0", _param("stem_stride", 0), "stem_stride"),
    ("stem_block_size-not-multiple-of-stride", _param("stem_stride", 3), "stem_block_size"),
    ("initial_blocks-negative", _param("initial_blocks", -1), "initial_blocks"),
    ("window_size-negative", _param("window_size", -1), "window_size"),
    ("rate_medium-negative", _param("k_block_num_rate_medium", -0.2),
     "k_block_num_rate_medium"),
    ("rate_large-nan", _param("k_block_num_rate_large", math.nan), "k_block_num_rate_large"),
    ("rate_medium-inf", _param("k_block_num_rate_medium", math.inf), "k_block_num_rate_medium"),
    ("bias_medium-negative", _param("k_block_num_bias_medium", -1), "k_block_num_bias_medium"),
    ("bias_large-negative", _param("k_block_num_bias_large", -30), "k_block_num_bias_large"),
    # metadata
    ("metadata-too-short", _set("metadata", lambda t: t[:-1]), "metadata"),
    ("metadata-too-long", _set("metadata", lambda t: torch.cat([t, t[:4096]])), "metadata"),
    ("metadata-bad-magic", _len("metadata", 0, 0), "metadata"),
]


def _invalid_params():
    entries = ("torch.ops", "stem_indexer.stem_indexer", "stem_indexer.stem_indexer-no-metadata")
    for entry in entries:
        for name, mutate, match in INVALID:
            if entry.endswith("no-metadata") and name.startswith("metadata"):
                continue  # the API builds its own metadata
            yield pytest.param(mutate, match, entry, id=f"{name}-{entry}")


@pytest.mark.parametrize("mutate, match, entry", list(_invalid_params()))
def test_invalid_input_raises_naming_the_argument(mutate, match, entry):
    args = base_args()
    mutate(args)
    if entry.endswith("no-metadata"):
        args["metadata"] = None
    call = call_op if entry == "torch.ops" else call_api
    with pytest.raises(StemIndexerInputError, match=match):
        call(args)


def test_input_error_is_a_value_error():
    assert issubclass(StemIndexerInputError, ValueError)


def test_metadata_none_is_rejected_by_the_op_naming_metadata():
    args = base_args()
    args["metadata"] = None
    with pytest.raises(StemIndexerInputError, match="metadata"):
        call_op(args)
    # the convenience function builds it instead, giving the same result
    want = call_op(base_args())
    assert_out_equal(call_api(args), want, "api without metadata")


# --------------------------------------------------------------------------- #
# Metadata built for other inputs (docs/CONTRACT.md section 6)
# --------------------------------------------------------------------------- #


def _one_batch():
    # B = 1 so that metadata for Nk 1 or 2 has the same size (4096): the
    # kv_heads mismatch is then caught by the header, not by the size.
    return base_args(batch=1)


MISMATCH = [
    ("q_seq_lens", dict(q_seq_lens=i32([11])), "q_seq_lens"),
    ("kv_seq_lens", dict(kv_seq_lens=i32([19])), "kv_seq_lens"),
    ("kv_seq_lens-same-blocks", dict(kv_seq_lens=i32([17])), "kv_seq_lens"),
    ("q_heads-same-kv_heads", dict(q_heads=2), "q_heads"),
    ("q_heads-8", dict(q_heads=8), "q_heads"),
    ("kv_heads", dict(kv_heads=1), "kv_heads"),
    ("causal", dict(causal=False), "causal"),
    ("stem_block_size", dict(stem_block_size=8), "stem_block_size"),
    ("dim_qkflat", dict(dim_qkflat=16), "dim_qkflat"),
    ("window_size", dict(window_size=2), "window_size"),
]


@pytest.mark.parametrize("entry", ["torch.ops", "stem_indexer.stem_indexer"])
@pytest.mark.parametrize("over, match", [pytest.param(o, m, id=i) for i, o, m in MISMATCH])
def test_metadata_built_for_other_inputs_is_rejected(over, match, entry):
    args = _one_batch()
    args["metadata"] = build_metadata(args, **over)
    assert args["metadata"].numel() == 4096
    call = call_op if entry == "torch.ops" else call_api
    with pytest.raises(StemIndexerInputError, match=f"metadata.*{match}"):
        call(args)


@pytest.mark.parametrize("change", [
    dict(initial_blocks=0), dict(alpha=0.25), dict(topk_score_precision=2),
    dict(stem_stride=1), dict(k_block_num_rate_large=0.5, k_block_num_bias_medium=0),
], ids=["initial_blocks", "alpha", "precision", "stem_stride", "rates-biases"])
def test_metadata_is_reusable_across_attributes_it_does_not_record(change):
    # docs/CONTRACT.md section 6 lists what metadata must match (lengths, Nq, Nk, causal,
    # Bs, Df, window_size); other attributes and num_prompt_tokens may differ.
    args = base_args()
    args["params"].update(change)
    args["num_prompt_tokens"] = i32([900, 400])
    want = stem_indexer.stem_indexer_reference(
        args["qflat"], args["kflat"], args["vbias"], args["q_seq_lens"], args["kv_seq_lens"],
        num_prompt_tokens=args["num_prompt_tokens"], **args["params"])
    assert_out_equal(call_op(args), want, f"metadata reused with {change}")


def test_metadata_for_other_batch_size_is_rejected_by_size():
    args = base_args()  # B = 2, Nk = 2: M = AlignUp(16 + 2*2*1728, 4096) = 8192
    one = base_args(batch=1)
    args["metadata"] = one["metadata"]  # 4096 elements
    for call in (call_op, call_api):
        with pytest.raises(StemIndexerInputError, match="metadata must have 8192 elements"):
            call(args)


def _plan_start(batch):
    return 16 + 2 * batch  # header, then q and kv lengths, then the tiles


@pytest.mark.parametrize("where", ["first-tile-field", "last-used-entry", "header-reserved",
                                   "recorded-q-length", "tile-count"])
def test_corrupted_metadata_is_rejected(where):
    args = base_args()
    m = args["metadata"].clone()
    num_tiles = int(m[9])
    assert num_tiles > 0
    pos = {"first-tile-field": _plan_start(2), "last-used-entry": _plan_start(2) + 4 * num_tiles
           - 1, "header-reserved": 12, "recorded-q-length": 16, "tile-count": 9}[where]
    m[pos] += 1
    args["metadata"] = m
    for call in (call_op, call_api):
        with pytest.raises(StemIndexerInputError, match="metadata"):
            call(args)


# --------------------------------------------------------------------------- #
# The metadata op's own checks
# --------------------------------------------------------------------------- #


def _meta_call(entry, q, kv, nq=4, nk=2, **kw):
    fn = (torch.ops.custom.npu_stem_indexer_metadata if entry == "torch.ops"
          else stem_indexer.stem_indexer_metadata)
    return fn(q, kv, nq, nk, **kw)


LENS = i32([12, 5]), i32([20, 9])
META_INVALID = [
    ("q_heads-not-multiple", dict(nq=4, nk=3), "q_heads"),
    ("q_heads-0", dict(nq=0), "q_heads"),
    ("kv_heads-0", dict(nk=0), "kv_heads"),
    ("kv_heads-negative", dict(nk=-2), "kv_heads"),
    ("batch-0", dict(q=i32([]), kv=i32([])), "batch size"),
    ("batch-65537", dict(q=torch.zeros(65537, dtype=torch.int32),
                         kv=torch.zeros(65537, dtype=torch.int32)), "batch size"),
    ("q_seq_lens-negative", dict(q=i32([12, -1])), "q_seq_lens"),
    ("kv_seq_lens-negative", dict(kv=i32([-20, 9])), "kv_seq_lens"),
    ("q_seq_lens-int64", dict(q=LENS[0].long()), "q_seq_lens"),
    ("kv_seq_lens-float32", dict(kv=LENS[1].float()), "kv_seq_lens"),
    ("q_seq_lens-2d", dict(q=LENS[0][None]), "q_seq_lens"),
    ("kv_seq_lens-0d", dict(kv=LENS[1][0]), "kv_seq_lens"),
    ("kv_seq_lens-batch-mismatch", dict(kv=i32([20, 9, 3])), "kv_seq_lens"),
    ("stem_block_size-0", dict(stem_block_size=0), "stem_block_size"),
    ("dim_qkflat-0", dict(dim_qkflat=0), "dim_qkflat"),
    ("window_size-negative", dict(window_size=-1), "window_size"),
]


@pytest.mark.parametrize("entry", ["torch.ops", "stem_indexer.stem_indexer_metadata"])
@pytest.mark.parametrize("kw, match", [pytest.param(k, m, id=i) for i, k, m in META_INVALID])
def test_metadata_op_invalid_input(kw, match, entry):
    kw = dict(kw)
    q, kv = kw.pop("q", LENS[0]), kw.pop("kv", LENS[1])
    with pytest.raises(StemIndexerInputError, match=match):
        _meta_call(entry, q, kv, **kw)


def test_metadata_op_accepts_the_batch_limits():
    # B = 1 and B = 65536 are valid (65536 zero-length batches: an empty plan).
    assert _meta_call("torch.ops", i32([0]), i32([0])).numel() == 4096
    big = torch.zeros(65536, dtype=torch.int32)
    # M = AlignUp(16 + 65536 * 1 * 1728, 4096) = AlignUp(113246224, 4096) = 113250304
    assert _meta_call("torch.ops", big, big, 1, 1).numel() == 113250304


# --------------------------------------------------------------------------- #
# Generalised parameters (docs/CONTRACT.md section 4, "here any values")
# --------------------------------------------------------------------------- #

GENERAL = [
    # id, (B, Nq, Nk, Qmax, Kmax, Df), q_lens, kv_lens, prompt, params
    ("Bs3-Ts1-R3", (2, 2, 1, 4, 30, 5), [12, 7], [90, 40], [6000, 400],
     dict(stem_block_size=3, stem_stride=1, initial_blocks=2, window_size=2,
          k_block_num_rate_medium=0.05, k_block_num_bias_medium=3)),
    ("Bs6-Ts3-R2-Df1", (1, 3, 3, 5, 40, 1), [30], [240], [2000],
     dict(stem_block_size=6, stem_stride=3, initial_blocks=1, window_size=3,
          k_block_num_rate_large=0.02, k_block_num_bias_large=4)),
    ("Bs7-Ts1-R7-Nq7-Nk1-alpha0.5", (1, 7, 1, 3, 25, 3), [21], [170], [700],
     dict(stem_block_size=7, stem_stride=1, alpha=0.5, k_block_num_rate_medium=0.0,
          k_block_num_bias_medium=5)),
    ("Bs5-Ts5-R1-noncausal", (3, 2, 2, 3, 20, 7), [15, 1, 11], [100, 3, 64], [5000, 3, 64],
     dict(stem_block_size=5, stem_stride=5, causal=False, initial_blocks=0, window_size=0,
          k_block_num_rate_large=0.001, k_block_num_bias_large=2)),
    ("Bs256-Ts2-R128", (1, 4, 2, 2, 12, 33), [300], [3000], [60 * 256],
     dict(stem_block_size=256, stem_stride=2, initial_blocks=1, window_size=1,
          k_block_num_rate_medium=0.0, k_block_num_bias_medium=4, alpha=0.01)),
    ("Bs1-Nq12-Nk4-Df130", (2, 12, 4, 6, 70, 130), [6, 3], [70, 58], [70, 400],
     dict(stem_block_size=1, stem_stride=1, initial_blocks=7, window_size=0,
          k_block_num_rate_medium=0.3, k_block_num_bias_medium=0, topk_score_precision=2)),
    ("sink-window-100", (1, 2, 2, 2, 16, 4), [8], [64], None,
     dict(stem_block_size=4, stem_stride=2, initial_blocks=100, window_size=100)),
    ("huge-rates-and-biases", (1, 2, 1, 3, 40, 4), [9], [120], [3000],
     dict(stem_block_size=3, stem_stride=3, k_block_num_rate_medium=1e6,
          k_block_num_rate_large=2.5, k_block_num_bias_medium=1000,
          k_block_num_bias_large=10**6)),
    ("Nq5-Nk5-Ts4-Bs8", (2, 5, 5, 3, 9, 12), [24, 17], [72, 50], [1000, 9000],
     dict(stem_block_size=8, stem_stride=4, initial_blocks=3, window_size=0,
          k_block_num_rate_large=0.01, k_block_num_bias_large=1, alpha=0.3,
          topk_score_precision=2)),
]


@pytest.mark.parametrize("shape, q_lens, kv_lens, prompt, params",
                         [pytest.param(*g[1:], id=g[0]) for g in GENERAL])
def test_generalised_parameters_match_reference_exactly(shape, q_lens, kv_lens, prompt, params):
    batch, nq, nk, qmax, kmax, df = shape
    gen = torch.Generator().manual_seed(batch * 1000 + kmax)
    # Integer data: dots are exact; scale * dot and + vbias are single float32
    # roundings done the same way by both, so equality is exact.
    inp = random_inputs(gen, batch=batch, nq=nq, nk=nk, qmax=qmax, kmax=kmax, df=df,
                        q_lens=q_lens, kv_lens=kv_lens, prompt=prompt, integer=True)
    want = stem_indexer.stem_indexer_reference(*inp.tensors(),
                                               num_prompt_tokens=inp.num_prompt_tokens,
                                               **params)
    got = stem_indexer.stem_indexer(*inp.tensors(), num_prompt_tokens=inp.num_prompt_tokens,
                                    **params)
    assert_out_equal(got, want, "op vs reference")
    assert int(want[1].sum()) > 0


@pytest.mark.parametrize("entry", ["torch.ops", "stem_indexer.stem_indexer"])
def test_window_size_beyond_int32_works_like_any_window(entry):
    # window 2**31 covers every visible block: the result is "all visible
    # blocks", exactly what the reference (and window_size = 2**31 - 1) give.
    args = base_args()
    args["params"]["window_size"] = 2**31
    want = stem_indexer.stem_indexer_reference(
        args["qflat"], args["kflat"], args["vbias"], args["q_seq_lens"], args["kv_seq_lens"],
        num_prompt_tokens=args["num_prompt_tokens"], **args["params"])
    if entry == "torch.ops":
        args["metadata"] = build_metadata(args)
        got = call_op(args)
    else:
        args["metadata"] = None
        got = call_api(args)
    assert_out_equal(got, want, "window_size 2**31")


def test_window_size_int32_max_works():
    args = base_args()
    args["params"]["window_size"] = 2**31 - 1
    args["metadata"] = build_metadata(args)
    want = stem_indexer.stem_indexer_reference(
        args["qflat"], args["kflat"], args["vbias"], args["q_seq_lens"], args["kv_seq_lens"],
        num_prompt_tokens=args["num_prompt_tokens"], **args["params"])
    assert_out_equal(call_op(args), want, "window_size 2**31 - 1")


@pytest.mark.parametrize("kw", [dict(window_size=2**31), dict(stem_block_size=2**31),
                                dict(dim_qkflat=2**31)],
                         ids=["window_size", "stem_block_size", "dim_qkflat"])
def test_metadata_op_large_int_attributes_are_recorded_saturated(kw):
    # Values past int32 are valid (docs/CONTRACT.md section 4) and plan alike: the header
    # records them saturated at INT32_MAX (the window test above runs the main op).
    meta = torch.ops.custom.npu_stem_indexer_metadata(*LENS, 4, 2, **kw)
    header = md.Header.from_tensor(meta)
    (field, _), = kw.items()
    assert getattr(header, field) == 2**31 - 1


# --------------------------------------------------------------------------- #
# Under torch.compile the fake kernel runs the same checks
# --------------------------------------------------------------------------- #


def _chain(exc):
    while exc is not None:
        yield exc
        exc = exc.__cause__ or exc.__context__


@pytest.mark.parametrize("mutate, match", [
    pytest.param(_set("vbias", lambda t: t.double()), "vbias", id="vbias-float64"),
    pytest.param(_set("kflat", lambda t: torch.cat([t, t[..., :1]], -1)), "kflat",
                 id="kflat-Df-mismatch"),
])
def test_input_check_fires_under_torch_compile(mutate, match):
    torch._dynamo.reset()
    args = base_args()
    mutate(args)
    params = args.pop("params")

    def fn(qflat, kflat, vbias, q_seq_lens, kv_seq_lens, num_prompt_tokens, metadata):
        return torch.ops.custom.npu_stem_indexer(
            qflat, kflat, vbias, q_seq_lens, kv_seq_lens, num_prompt_tokens=num_prompt_tokens,
            metadata=metadata, **params)

    compiled = torch.compile(fn, fullgraph=True, dynamic=True)
    with pytest.raises(Exception) as info:
        compiled(args["qflat"], args["kflat"], args["vbias"], args["q_seq_lens"],
                 args["kv_seq_lens"], args["num_prompt_tokens"], args["metadata"])
    errors = [e for e in _chain(info.value) if isinstance(e, StemIndexerInputError)]
    assert errors, f"no StemIndexerInputError in the chain of {info.value!r}"
    assert match in str(errors[0])
