"""Registration of the two ops (docs/CONTRACT.md section 1): schemas, opcheck, fake
kernels, torch.compile, torch.export, package attributes, and the article's
example call."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import stem_indexer
from stem_indexer.testing import compare
from stem_indexer.operator.contract import IndexerParams

from _helpers import random_inputs

# docs/CONTRACT.md section 1, verbatim.
SPEC_SCHEMAS = {
    "npu_stem_indexer": """
custom::npu_stem_indexer(Tensor qflat, Tensor kflat, Tensor vbias, Tensor q_seq_lens,
    Tensor kv_seq_lens, *, Tensor? num_prompt_tokens=None, Tensor? metadata=None,
    bool causal=True, int stem_block_size=128, int stem_stride=16, float alpha=1.0,
    int initial_blocks=4, int window_size=4, float k_block_num_rate_medium=0.2,
    int k_block_num_bias_medium=30, float k_block_num_rate_large=0.1,
    int k_block_num_bias_large=30, int topk_score_precision=1) -> (Tensor, Tensor)
""",
    "npu_stem_indexer_metadata": """
custom::npu_stem_indexer_metadata(Tensor q_seq_lens, Tensor kv_seq_lens, int q_heads,
    int kv_heads, *, bool causal=True, int stem_block_size=128, int dim_qkflat=2048,
    int window_size=4) -> Tensor
""",
}

INDEXER = torch.ops.custom.npu_stem_indexer
METADATA = torch.ops.custom.npu_stem_indexer_metadata


def _args_tuple(schema):
    return [(a.name, str(a.type), a.default_value, a.kwarg_only) for a in schema.arguments]


@pytest.mark.parametrize("name", sorted(SPEC_SCHEMAS))
def test_schema_is_exactly_the_spec(name):
    spec_text = " ".join(SPEC_SCHEMAS[name].split())
    spec = torch._C.parse_schema(spec_text)
    actual = getattr(torch.ops.custom, name).default._schema
    assert actual.name == f"custom::{name}" and actual.overload_name == ""
    assert _args_tuple(actual) == _args_tuple(spec)
    assert [str(r.type) for r in actual.returns] == [str(r.type) for r in spec.returns]
    assert str(actual) == str(spec)
    # and textually, modulo the printer's float formatting (1.0 -> "1.",
    # 0.2 -> "0.20000000000000001") and the namespace prefix
    printed = str(actual).replace("custom::", "")
    for long, short in (("=1.,", "=1.0,"), ("0.20000000000000001", "0.2"),
                        ("0.10000000000000001", "0.1")):
        printed = printed.replace(long, short)
    assert printed == spec_text.replace("custom::", "")


def test_ops_have_a_single_overload():
    assert INDEXER.overloads() == ["default"] and METADATA.overloads() == ["default"]


def test_package_attributes_are_the_torch_ops_handles():
    assert stem_indexer.npu_stem_indexer is torch.ops.custom.npu_stem_indexer
    assert stem_indexer.npu_stem_indexer_metadata is torch.ops.custom.npu_stem_indexer_metadata


# --------------------------------------------------------------------------- #
# Sample inputs
# --------------------------------------------------------------------------- #

NQ, NK, DF = 4, 2, 8
SAMPLE_PARAMS = dict(stem_block_size=4, stem_stride=2, initial_blocks=1, window_size=1)


def _inputs(batch, qmax, kmax, q_lens, kv_lens, prompt=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return random_inputs(gen, batch=batch, nq=NQ, nk=NK, qmax=qmax, kmax=kmax, df=DF,
                         q_lens=q_lens, kv_lens=kv_lens, prompt=prompt)


def _metadata(inp, params):
    return METADATA(inp.q_seq_lens, inp.kv_seq_lens, NQ, NK,
                    causal=params.get("causal", True),
                    stem_block_size=params["stem_block_size"], dim_qkflat=DF,
                    window_size=params["window_size"])


SAMPLES = [
    ("causal-prompt-given", dict(q_lens=[12, 6], kv_lens=[28, 13], prompt=[400, 900]),
     dict(k_block_num_rate_medium=0.0, k_block_num_bias_medium=2)),
    ("noncausal-prompt-none", dict(q_lens=[12, 3], kv_lens=[28, 28]),
     dict(causal=False)),
    ("bf16-ranking-alpha", dict(q_lens=[9, 12], kv_lens=[25, 17], prompt=[300, 2000]),
     dict(topk_score_precision=2, alpha=0.3, k_block_num_rate_large=0.01,
          k_block_num_bias_large=1)),
    ("varlen-with-empty-batches", dict(q_lens=[0, 12, 5, 7], kv_lens=[20, 0, 0, 28]),
     dict()),
]


def _sample(spec):
    _, lens, extra = spec
    batch = len(lens["q_lens"])
    inp = _inputs(batch, 3, 7, **lens)
    params = dict(SAMPLE_PARAMS, **extra)
    return inp, params


@pytest.mark.parametrize("spec", SAMPLES, ids=[s[0] for s in SAMPLES])
def test_opcheck_indexer(spec):
    inp, params = _sample(spec)
    md = _metadata(inp, params)
    kwargs = dict(num_prompt_tokens=inp.num_prompt_tokens, metadata=md, **params)
    torch.library.opcheck(INDEXER, inp.tensors(), kwargs)


@pytest.mark.parametrize("spec", SAMPLES, ids=[s[0] for s in SAMPLES])
def test_opcheck_metadata(spec):
    inp, params = _sample(spec)
    torch.library.opcheck(METADATA, (inp.q_seq_lens, inp.kv_seq_lens, NQ, NK),
                          dict(causal=params.get("causal", True),
                               stem_block_size=params["stem_block_size"], dim_qkflat=DF,
                               window_size=params["window_size"]))


@pytest.mark.parametrize("spec", SAMPLES, ids=[s[0] for s in SAMPLES])
def test_outputs_are_cpu_int32_contiguous(spec):
    inp, params = _sample(spec)
    md = _metadata(inp, params)
    assert md.device.type == "cpu" and md.dtype == torch.int32 and md.is_contiguous()
    idx, seq = INDEXER(*inp.tensors(), num_prompt_tokens=inp.num_prompt_tokens, metadata=md,
                       **params)
    batch = inp.qflat.shape[0]
    assert idx.shape == (batch, NQ, 3, 7) and seq.shape == (batch, NQ, 3)
    for t in (idx, seq):
        assert t.device.type == "cpu" and t.dtype == torch.int32 and t.is_contiguous()


# --------------------------------------------------------------------------- #
# Fake kernels
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("batch, nk, size", [
    pytest.param(1, 1, 4096, id="B1-Nk1"),
    pytest.param(4, 8, 57344, id="B4-Nk8"),
    pytest.param(65536, 1, 113250304, id="B65536-Nk1"),
    # 16 + 65536*8*1728 = 905969680 -> 221185 * 4096
    pytest.param(65536, 8, 905973760, id="B65536-Nk8")])
def test_fake_kernels_shapes_and_dtypes(batch, nk, size):
    nq = 2 * nk
    with FakeTensorMode():
        q_lens = torch.empty(batch, dtype=torch.int32)
        kv_lens = torch.empty(batch, dtype=torch.int32)
        md = METADATA(q_lens, kv_lens, nq, nk, stem_block_size=4, dim_qkflat=8)
        assert md.shape == (size,) and md.dtype == torch.int32
        qflat = torch.empty(batch, nq, 3, 8, dtype=torch.bfloat16)
        kflat = torch.empty(batch, nk, 11, 8, dtype=torch.bfloat16)
        vbias = torch.empty(batch, nk, 11)
        idx, seq = INDEXER(qflat, kflat, vbias, q_lens, kv_lens, metadata=md,
                           stem_block_size=4, stem_stride=2)
        assert idx.shape == (batch, nq, 3, 11) and idx.dtype == torch.int32
        assert seq.shape == (batch, nq, 3) and seq.dtype == torch.int32


def test_fake_kernel_runs_the_static_checks():
    with FakeTensorMode():
        q_lens = torch.empty(2, dtype=torch.int32)
        md = METADATA(q_lens, q_lens, 4, 2)
        with pytest.raises(stem_indexer.StemIndexerInputError, match="vbias"):
            INDEXER(torch.empty(2, 4, 3, 8, dtype=torch.bfloat16),
                    torch.empty(2, 2, 5, 8, dtype=torch.bfloat16),
                    torch.empty(2, 2, 5, dtype=torch.float64), q_lens, q_lens, metadata=md)
        with pytest.raises(stem_indexer.StemIndexerInputError, match="q_heads"):
            METADATA(q_lens, q_lens, 4, 3)


# --------------------------------------------------------------------------- #
# torch.compile and torch.export
# --------------------------------------------------------------------------- #


def _both_ops(qflat, kflat, vbias, q_seq_lens, kv_seq_lens, num_prompt_tokens):
    md = METADATA(q_seq_lens, kv_seq_lens, NQ, NK, causal=True, stem_block_size=4,
                  dim_qkflat=DF, window_size=1)
    return INDEXER(qflat, kflat, vbias, q_seq_lens, kv_seq_lens,
                   num_prompt_tokens=num_prompt_tokens, metadata=md, stem_block_size=4,
                   stem_stride=2, initial_blocks=1, window_size=1, alpha=0.5,
                   k_block_num_rate_medium=0.0, k_block_num_bias_medium=2)


class BothOps(torch.nn.Module):
    def forward(self, qflat, kflat, vbias, q_seq_lens, kv_seq_lens, num_prompt_tokens):
        return _both_ops(qflat, kflat, vbias, q_seq_lens, kv_seq_lens, num_prompt_tokens)


# Sizes differ from each other and from the constant dims (Nq 4, Nk 2, Df 8),
# so dynamic-shape duck sizing cannot tie them together.
SIZE_A = dict(batch=3, qmax=5, kmax=7, q_lens=[20, 13, 0], kv_lens=[28, 25, 9],
              prompt=[300, 25, 9])
SIZE_B = dict(batch=6, qmax=9, kmax=13, q_lens=[36, 1, 17, 0, 30, 36],
              kv_lens=[52, 40, 0, 5, 49, 52], prompt=[52, 400, 0, 5, 1000, 60])


def _call_args(size, seed):
    return _inputs(seed=seed, **size).as_dict().values()


def _assert_same(a, b):
    assert len(a) == len(b) == 2
    for x, y in zip(a, b):
        assert x.dtype == y.dtype == torch.int32 and torch.equal(x, y)


def test_compile_fullgraph_dynamic_matches_eager_without_recompiling():
    torch._dynamo.reset()
    compiled = torch.compile(_both_ops, fullgraph=True, dynamic=True)
    args_a = list(_call_args(SIZE_A, 1))
    _assert_same(compiled(*args_a), _both_ops(*args_a))
    args_b = list(_call_args(SIZE_B, 2))
    with torch.compiler.set_stance("fail_on_recompile"):
        _assert_same(compiled(*args_b), _both_ops(*args_b))
    assert int(_both_ops(*args_b)[1].sum()) > 0


def test_export_save_load_roundtrip(tmp_path):
    args_a = tuple(_call_args(SIZE_A, 3))
    auto = torch.export.Dim.AUTO
    dims = ({0: auto, 2: auto}, {0: auto, 2: auto}, {0: auto, 2: auto}, {0: auto}, {0: auto},
            {0: auto})
    program = torch.export.export(BothOps(), args_a, dynamic_shapes=dims)
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert {"custom.npu_stem_indexer.default",
            "custom.npu_stem_indexer_metadata.default"} <= targets
    path = tmp_path / "stem_indexer.pt2"
    torch.export.save(program, path)
    loaded = torch.export.load(path).module()
    _assert_same(loaded(*args_a), BothOps()(*args_a))
    args_b = tuple(_call_args(SIZE_B, 4))  # another batch/Qmax/Kmax, same program
    _assert_same(loaded(*args_b), BothOps()(*args_b))


# --------------------------------------------------------------------------- #
# The article's example call
# --------------------------------------------------------------------------- #


def test_article_example_call_matches_reference():
    batch_size, q_heads, kv_heads, d = 4, 64, 8, 128
    stem_block_size, stem_stride = 128, 16
    q_block_num, k_block_num = 16, 64
    q_seq_len = q_block_num * stem_block_size
    kv_seq_len = k_block_num * stem_block_size
    prompt_token_num = kv_seq_len
    torch.manual_seed(0)
    qflat = torch.randn(batch_size, q_heads, q_block_num, stem_stride * d, dtype=torch.bfloat16)
    kflat = torch.randn(batch_size, kv_heads, k_block_num, stem_stride * d,
                        dtype=torch.bfloat16)
    vbias = torch.randn(batch_size, kv_heads, k_block_num, dtype=torch.float32)
    q_seq_lens = torch.full((batch_size,), q_seq_len, dtype=torch.int32)
    kv_seq_lens = torch.full((batch_size,), kv_seq_len, dtype=torch.int32)
    num_prompt_tokens = torch.full((batch_size,), prompt_token_num, dtype=torch.int32)
    metadata = torch.ops.custom.npu_stem_indexer_metadata(
        q_seq_lens, kv_seq_lens, q_heads, kv_heads, causal=True,
        stem_block_size=stem_block_size, dim_qkflat=stem_stride * d, window_size=4,
    )
    sparse_indices, sparse_seq_len = torch.ops.custom.npu_stem_indexer(
        qflat, kflat, vbias, q_seq_lens, kv_seq_lens, num_prompt_tokens=num_prompt_tokens,
        metadata=metadata, causal=True, stem_block_size=stem_block_size,
        stem_stride=stem_stride, alpha=1.0, initial_blocks=4, window_size=4,
        k_block_num_rate_medium=0.2, k_block_num_bias_medium=30, k_block_num_rate_large=0.1,
        k_block_num_bias_large=30, topk_score_precision=1,
    )
    assert metadata.numel() == 57344  # AlignUp(16 + 4*8*108*16, 4096)
    assert sparse_indices.shape == (4, 64, 16, 64) and sparse_seq_len.shape == (4, 64, 16)
    ref = stem_indexer.stem_indexer_reference(
        qflat, kflat, vbias, q_seq_lens, kv_seq_lens, num_prompt_tokens=num_prompt_tokens)
    # Hand check of seq_len: P = 64 -> Ks = floor(64 * 0.2) + 30 = 42; row i
    # sees s2 = 49 + i blocks, 8 forced, so L = 8 + min(42, 41 + i) = 49 + min(i, 1).
    want_len = torch.tensor([49] + [50] * 15, dtype=torch.int32).expand(4, 64, 16)
    assert torch.equal(sparse_seq_len, want_len)
    assert torch.equal(ref[1], want_len)
    inputs = dict(qflat=qflat, kflat=kflat, vbias=vbias, q_seq_lens=q_seq_lens,
                  kv_seq_lens=kv_seq_lens)
    result = compare.compare((sparse_indices, sparse_seq_len), ref, inputs, IndexerParams())
    assert result.ok, result.summary()
    assert result.bad_indices == 0
