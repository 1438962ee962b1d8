"""Property tests over random small configurations (hypothesis, derandomized).

* Integer-valued bf16 inputs (small ints, vbias on a 1/64 grid, R a power of
  two) make every score exact in float32 whatever the summation order, so the
  op must equal the reference bit for bit, ties included.
* Random float inputs: structural invariants of every row (restated from
  docs/CONTRACT.md section 3 in the test) and ``compare.compare`` against the reference.
* Random invalid inputs always raise ``StemIndexerInputError``.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import stem_indexer
from stem_indexer import StemIndexerInputError
from stem_indexer.testing import compare
from stem_indexer.operator.contract import IndexerParams

from _helpers import (Inputs, assert_out_equal, metadata_for, on_cpu, random_inputs, run_api,
                      run_op, run_ref, spec_row_facts)

SETTINGS = dict(deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])


@dataclasses.dataclass
class Config:
    batch: int
    nq: int
    nk: int
    qmax: int
    kmax: int
    df: int
    q_lens: list
    kv_lens: list
    prompt: list | None
    params: dict
    seed: int

    def inputs(self, integer: bool) -> Inputs:
        gen = torch.Generator().manual_seed(self.seed)
        return random_inputs(gen, batch=self.batch, nq=self.nq, nk=self.nk, qmax=self.qmax,
                             kmax=self.kmax, df=self.df, q_lens=self.q_lens,
                             kv_lens=self.kv_lens, prompt=self.prompt, integer=integer)


def _length(draw, hi: int, lo: int = 0) -> int:
    """A token count in [lo, hi]: mostly partial (tails), sometimes full or lo."""
    kind = draw(st.sampled_from(["low", "full", "full", "any", "any", "any", "any", "any"]))
    return {"low": lo, "full": hi}.get(kind) if kind != "any" else draw(st.integers(lo, hi))


@st.composite
def configs(draw, selective: bool = False):
    """Random valid configurations. ``selective`` restricts them to rows where
    the budget is smaller than the candidate count (long prompt, small rates
    and biases, longer kv), so that the top-k itself decides most rows."""
    batch = draw(st.integers(1, 4))
    nk = draw(st.integers(1, 3))
    nq = nk * draw(st.integers(1, 3))
    bs = draw(st.sampled_from([1, 2, 4, 8, 16]))
    ts = draw(st.sampled_from([d for d in (1, 2, 4, 8, 16) if bs % d == 0]))
    qmax = draw(st.integers(1, 5))
    kmax = draw(st.integers(6, 16) if selective else st.integers(1, 16))
    q_lens = [_length(draw, qmax * bs) for _ in range(batch)]
    kv_lens = [_length(draw, kmax * bs, kmax * bs // 2 if selective else 0)
               for _ in range(batch)]
    # prompt >= kv: None (= kv), equal, a little longer (tail), or long enough
    # for the medium/large budget branches (P >= 56), which is where the
    # budget, not the candidate count, limits the selection in tiny shapes.
    mode = "long" if selective else draw(st.sampled_from(["none", "equal", "tail", "long"]))
    prompt = None
    if mode != "none":
        prompt = []
        for kv in kv_lens:
            if mode == "equal":
                prompt.append(kv)
            elif mode == "tail":
                prompt.append(draw(st.integers(kv, kv + 3 * bs)))
            else:
                prompt.append(draw(st.integers(max(kv, 55 * bs + 1), max(kv, 300 * bs))))
    small_int = st.integers(0, 2) if selective else st.one_of(st.integers(0, 2),
                                                              st.integers(0, 5))
    rate = st.floats(0.0, 0.01)
    bias = st.integers(1, 4)
    if not selective:
        rate = st.one_of(st.just(0.0), rate, st.sampled_from([0.1, 0.2]))
        bias = st.one_of(st.integers(0, 4), st.integers(0, 8), st.just(30))
    params = dict(
        causal=draw(st.booleans()), stem_block_size=bs, stem_stride=ts,
        alpha=draw(st.one_of(st.sampled_from([1.0, 0.5, 0.01]),
                             st.floats(0.0, 1.0, exclude_min=True))),
        initial_blocks=draw(small_int), window_size=draw(small_int),
        # small rates/biases (edges 0 included; the default 30 sometimes)
        k_block_num_rate_medium=draw(rate), k_block_num_bias_medium=draw(bias),
        k_block_num_rate_large=draw(rate), k_block_num_bias_large=draw(bias),
        topk_score_precision=draw(st.sampled_from([1, 2])),
    )
    return Config(batch, nq, nk, qmax, kmax, draw(st.integers(1, 16)), q_lens, kv_lens,
                  prompt, params, draw(st.integers(0, 2**31 - 1)))


def _non_contiguous(t: torch.Tensor) -> torch.Tensor:
    """Same values, last dim strided (a view into a twice-wider buffer)."""
    wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
    wide[..., ::2] = t
    out = wide[..., ::2]
    assert not out.is_contiguous() or t.shape[-1] <= 1
    return out


@pytest.mark.selections
@settings(max_examples=120, **SETTINGS)
@given(cfg=configs(), strided=st.booleans())
def test_integer_inputs_op_equals_reference_exactly(device, cfg, strided):
    _check_exact(device, cfg, strided)


@pytest.mark.selections
@settings(max_examples=80, **SETTINGS)
@given(cfg=configs(selective=True), strided=st.booleans())
def test_integer_inputs_budget_limited_op_equals_reference_exactly(device, cfg, strided):
    _check_exact(device, cfg, strided)


def _check_exact(device, cfg, strided):
    inp = cfg.inputs(integer=True)
    want = run_ref(inp, **cfg.params)
    dev = inp.to(device)
    assert_out_equal(on_cpu(run_api(dev, **cfg.params), device), want, "api")
    if strided:
        dev = dataclasses.replace(dev, qflat=_non_contiguous(dev.qflat),
                                  kflat=_non_contiguous(dev.kflat),
                                  vbias=_non_contiguous(dev.vbias))
    out = run_op(dev, **cfg.params)
    for t in out:
        assert t.dtype == torch.int32 and t.is_contiguous()
    assert_out_equal(on_cpu(out, device), want, "op")


@settings(max_examples=80, **SETTINGS)
@given(cfg=configs())
def test_float_inputs_invariants_and_compare(cfg):
    inp = cfg.inputs(integer=False)
    params = IndexerParams(**cfg.params)
    idx, seq = run_op(inp, **cfg.params)
    assert idx.shape == (cfg.batch, cfg.nq, cfg.qmax, cfg.kmax)
    assert seq.shape == (cfg.batch, cfg.nq, cfg.qmax)
    bs = params.stem_block_size
    prompt = cfg.prompt or cfg.kv_lens
    for b in range(cfg.batch):
        qb, kb = -(-cfg.q_lens[b] // bs), -(-cfg.kv_lens[b] // bs)
        for i in range(cfg.qmax):
            if i >= qb or kb == 0:
                assert (seq[b, :, i] == 0).all() and (idx[b, :, i] == -1).all()
                continue
            s2, forced, n_cand, k = spec_row_facts(cfg.q_lens[b], cfg.kv_lens[b], prompt[b],
                                                   i, params)
            for h in range(cfg.nq):
                n = int(seq[b, h, i])
                row = idx[b, h, i, :n].tolist()
                assert n == len(forced) + min(k, n_cand) <= s2
                assert row == sorted(set(row)), row  # ascending, no duplicates
                assert all(0 <= j < s2 for j in row) and forced <= set(row)
                assert (idx[b, h, i, n:] == -1).all()
    ref = run_ref(inp, **cfg.params)
    # This package's op: no pick beyond rounding of a row's threshold (allowance 0).
    result = compare.compare((idx, seq), ref, inp.as_dict(), params, allowance=0.0)
    assert result.ok, result.summary()


# --------------------------------------------------------------------------- #
# Invalid inputs
# --------------------------------------------------------------------------- #

TENSOR_ARGS = ("qflat", "kflat", "vbias", "q_seq_lens", "kv_seq_lens", "num_prompt_tokens",
               "metadata")
DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int64,
          torch.int32, torch.int16, torch.uint8, torch.bool)
RIGHT_DTYPE = dict(qflat=torch.bfloat16, kflat=torch.bfloat16, vbias=torch.float32)


def _base(cfg: Config) -> dict:
    inp = cfg.inputs(integer=True)
    args = inp.as_dict()
    if args["num_prompt_tokens"] is None:
        args["num_prompt_tokens"] = args["kv_seq_lens"].clone()
    args["metadata"] = metadata_for(inp, **cfg.params)
    args["params"] = dict(cfg.params)
    return args


def _meta(args, **over):
    """Metadata built by the metadata op for ``args`` with some fields changed."""
    p = IndexerParams(**args["params"])
    kw = dict(q_seq_lens=args["q_seq_lens"], kv_seq_lens=args["kv_seq_lens"],
              q_heads=args["qflat"].shape[1], kv_heads=args["kflat"].shape[1],
              causal=p.causal, stem_block_size=p.stem_block_size,
              dim_qkflat=args["qflat"].shape[-1], window_size=p.window_size)
    kw.update(over)
    return torch.ops.custom.npu_stem_indexer_metadata(
        kw.pop("q_seq_lens"), kw.pop("kv_seq_lens"), kw.pop("q_heads"), kw.pop("kv_heads"),
        **kw)


_MUTATIONS: dict = {}  # kind -> a function that breaks one rule of docs/CONTRACT.md section 4


def _mutation(fn):
    _MUTATIONS[fn.__name__.removeprefix("_bad_")] = fn
    return fn


@_mutation
def _bad_dtype(draw, args, p, b) -> str:
    name = draw(st.sampled_from(TENSOR_ARGS))
    right = RIGHT_DTYPE.get(name, torch.int32)
    dtype = draw(st.sampled_from([d for d in DTYPES if d != right]))
    args[name] = args[name].to(dtype)
    return f"{name} dtype {dtype}"


@_mutation
def _bad_ndim(draw, args, p, b) -> str:
    name = draw(st.sampled_from(TENSOR_ARGS))
    args[name] = args[name][None] if draw(st.booleans()) or args[name].dim() == 1 \
        else args[name][0]
    return f"{name} ndim {args[name].dim()}"


@_mutation
def _bad_batch(draw, args, p, b) -> str:
    name = draw(st.sampled_from(["kflat", "vbias", "q_seq_lens", "kv_seq_lens",
                                 "num_prompt_tokens"]))
    t = args[name]
    args[name] = torch.cat([t, t[:1]]) if draw(st.booleans()) or t.shape[0] == 1 \
        else t[1:]
    return f"{name} batch {args[name].shape[0]}"


@_mutation
def _bad_df(draw, args, p, b) -> str:
    args["kflat"] = torch.cat([args["kflat"], args["kflat"][..., :1]], dim=-1)
    return "kflat Df + 1"


@_mutation
def _bad_heads(draw, args, p, b) -> str:
    nq, nk = args["qflat"].shape[1], args["kflat"].shape[1]
    new_nk = draw(st.sampled_from([n for n in range(2, nq + 3) if nq % n]))
    reps = -(-new_nk // nk)
    args["kflat"] = args["kflat"].repeat(1, reps, 1, 1)[:, :new_nk].contiguous()
    args["vbias"] = args["vbias"].repeat(1, reps, 1)[:, :new_nk].contiguous()
    return f"Nq {nq} % Nk {new_nk} != 0"


@_mutation
def _bad_vbias_shape(draw, args, p, b) -> str:
    v = args["vbias"]
    args["vbias"] = torch.cat([v, v[..., :1]], -1) if draw(st.booleans()) \
        else torch.cat([v, v[:, :1]], 1)
    return f"vbias shape {tuple(args['vbias'].shape)}"


@_mutation
def _bad_negative_len(draw, args, p, b) -> str:
    name = draw(st.sampled_from(["q_seq_lens", "kv_seq_lens"]))
    args[name] = args[name].clone()
    args[name][b] = draw(st.sampled_from([-1, -2**31, -p["stem_block_size"]]))
    return f"{name}[{b}] negative"


@_mutation
def _bad_long_len(draw, args, p, b) -> str:
    name, t = draw(st.sampled_from([("q_seq_lens", "qflat"), ("kv_seq_lens", "kflat")]))
    args[name] = args[name].clone()
    args[name][b] = args[t].shape[2] * p["stem_block_size"] + draw(
        st.sampled_from([1, 2**20]))
    args["num_prompt_tokens"] = torch.maximum(args["num_prompt_tokens"],
                                              args["kv_seq_lens"])
    return f"{name}[{b}] too long"


@_mutation
def _bad_prompt_short(draw, args, p, b) -> str:
    args["kv_seq_lens"] = args["kv_seq_lens"].clone()
    args["num_prompt_tokens"] = args["num_prompt_tokens"].clone()
    if args["kv_seq_lens"][b] == 0:
        args["kv_seq_lens"][b] = 1
    args["num_prompt_tokens"][b] = args["kv_seq_lens"][b] - draw(st.integers(1, 5))
    return f"num_prompt_tokens[{b}] < kv"


@_mutation
def _bad_alpha(draw, args, p, b) -> str:
    p["alpha"] = draw(st.sampled_from([0.0, -0.0, -0.5, 1.0000001, 2.0, math.nan, math.inf,
                                       -math.inf]))
    return f"alpha {p['alpha']}"


@_mutation
def _bad_precision(draw, args, p, b) -> str:
    p["topk_score_precision"] = draw(st.sampled_from([0, 3, -1, 4, 100]))
    return f"precision {p['topk_score_precision']}"


@_mutation
def _bad_block(draw, args, p, b) -> str:
    which = draw(st.sampled_from(["bs0", "bsneg", "ts0", "tsneg", "notmultiple"]))
    if which == "bs0":
        p["stem_block_size"] = 0
    elif which == "bsneg":
        p["stem_block_size"] = -p["stem_block_size"]
    elif which == "ts0":
        p["stem_stride"] = 0
    elif which == "tsneg":
        p["stem_stride"] = -1
    else:
        p["stem_stride"] = p["stem_block_size"] + 1
    return f"block {which}"


@_mutation
def _bad_attr(draw, args, p, b) -> str:
    name, value = draw(st.sampled_from([
        ("initial_blocks", -1), ("window_size", -1), ("k_block_num_rate_medium", -0.1),
        ("k_block_num_rate_large", math.nan), ("k_block_num_rate_medium", math.inf),
        ("k_block_num_bias_medium", -1), ("k_block_num_bias_large", -30)]))
    p[name] = value
    return f"{name} {value}"


@_mutation
def _bad_qflat_zero_dim(draw, args, p, b) -> str:
    d = draw(st.integers(1, 3))
    args["qflat"] = args["qflat"].narrow(d, 0, 0)
    return f"qflat dim {d} = 0"


@_mutation
def _bad_meta_size(draw, args, p, b) -> str:
    m = args["metadata"]
    args["metadata"] = m[:-1] if draw(st.booleans()) else torch.cat([m, m[:4096]])
    return "metadata size"


@_mutation
def _bad_meta_lens(draw, args, p, b) -> str:
    name = draw(st.sampled_from(["q_seq_lens", "kv_seq_lens"]))
    other = args[name].clone()
    other[b] = other[b] - 1 if other[b] > 0 else other[b] + 1
    args["metadata"] = _meta(args, **{name: other})
    return f"metadata for other {name}"


@_mutation
def _bad_meta_heads(draw, args, p, b) -> str:
    nq, nk = args["qflat"].shape[1], args["kflat"].shape[1]
    if draw(st.booleans()):
        args["metadata"] = _meta(args, q_heads=nq + nk)
    else:
        args["metadata"] = _meta(args, q_heads=nq * 2, kv_heads=nk * 2)
    return "metadata for other heads"


@_mutation
def _bad_meta_causal(draw, args, p, b) -> str:
    args["metadata"] = _meta(args, causal=not p["causal"])
    return "metadata for other causal"


@_mutation
def _bad_meta_block(draw, args, p, b) -> str:
    args["metadata"] = _meta(args, stem_block_size=p["stem_block_size"] * 2)
    return "metadata for other block size"


@_mutation
def _bad_meta_df(draw, args, p, b) -> str:
    args["metadata"] = _meta(args, dim_qkflat=args["qflat"].shape[-1] + 1)
    return "metadata for other Df"


@_mutation
def _bad_meta_window(draw, args, p, b) -> str:
    args["metadata"] = _meta(args, window_size=p["window_size"] + 1)
    return "metadata for other window"


@_mutation
def _bad_meta_corrupt(draw, args, p, b) -> str:
    m = args["metadata"].clone()
    batch = args["qflat"].shape[0]
    used = 16 + 2 * batch + 4 * int(m[9])  # header slot 9: number of tiles
    pos = draw(st.integers(0, used - 1))
    m[pos] += draw(st.sampled_from([1, -1, 7, 2**20]))
    args["metadata"] = m
    return f"metadata corrupted at {pos}"


@_mutation
def _bad_meta_missing(draw, args, p, b) -> str:
    args["metadata"] = None
    return "metadata None"


def _mutate(draw, args) -> str:
    """Break one rule of docs/CONTRACT.md section 4 in ``args``; return a label."""
    kind = draw(st.sampled_from(sorted(_MUTATIONS)))
    b = draw(st.integers(0, args["qflat"].shape[0] - 1))
    return _MUTATIONS[kind](draw, args, args["params"], b)


@settings(max_examples=200, **SETTINGS)
@given(cfg=configs(), data=st.data())
def test_invalid_inputs_always_raise_input_error(cfg, data):
    args = _base(cfg)
    label = _mutate(data.draw, args)
    params = args.pop("params")
    tensors = [args[n] for n in ("qflat", "kflat", "vbias", "q_seq_lens", "kv_seq_lens")]
    with pytest.raises(StemIndexerInputError):
        torch.ops.custom.npu_stem_indexer(*tensors, num_prompt_tokens=args["num_prompt_tokens"],
                                          metadata=args["metadata"], **params)
    if label != "metadata None":  # the API builds missing metadata itself
        with pytest.raises(StemIndexerInputError):
            stem_indexer.stem_indexer(*tensors, num_prompt_tokens=args["num_prompt_tokens"],
                                      metadata=args["metadata"], **params)
    if not label.startswith("metadata"):
        with pytest.raises(StemIndexerInputError):  # and with metadata built by the API
            stem_indexer.stem_indexer(*tensors, num_prompt_tokens=args["num_prompt_tokens"],
                                      **params)
