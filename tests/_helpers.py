"""Small shared helpers for the tests.

Nothing here computes an expected result: expected values are written by hand
in the tests or come from ``stem_indexer_reference``. These helpers only build
inputs, call the entry points (remembering the reference's results for inputs
seen before) and pad hand-written rows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os

import traceback

import torch

import stem_indexer
from stem_indexer.operator.contract import IndexerParams
from stem_indexer.operator.reference import reference_budget


def bf16_exact(values) -> torch.Tensor:
    """A bf16 tensor of ``values``, asserting that no value was rounded."""
    t = torch.tensor(values, dtype=torch.float32)
    b = t.to(torch.bfloat16)
    exact = (b.float() == t) | (torch.isnan(t) & torch.isnan(b.float()))
    assert bool(exact.all()), f"values not exactly representable in bf16: {values}"
    return b


def i32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


@dataclasses.dataclass
class Inputs:
    """The tensor inputs of one call."""

    qflat: torch.Tensor
    kflat: torch.Tensor
    vbias: torch.Tensor
    q_seq_lens: torch.Tensor
    kv_seq_lens: torch.Tensor
    num_prompt_tokens: torch.Tensor | None = None

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def tensors(self):
        return (self.qflat, self.kflat, self.vbias, self.q_seq_lens, self.kv_seq_lens)

    def to(self, device) -> "Inputs":
        return Inputs(*(t.to(device) for t in self.tensors()),
                      None if self.num_prompt_tokens is None
                      else self.num_prompt_tokens.to(device))


def make_inputs(qflat, kflat, vbias, q_lens, kv_lens, prompt=None) -> Inputs:
    """Inputs from nested lists (bf16-exactness of qflat/kflat is asserted)."""
    return Inputs(
        qflat=bf16_exact(qflat), kflat=bf16_exact(kflat),
        vbias=torch.tensor(vbias, dtype=torch.float32),
        q_seq_lens=i32(q_lens), kv_seq_lens=i32(kv_lens),
        num_prompt_tokens=None if prompt is None else i32(prompt))


def run_api(inp: Inputs, **params):
    """``stem_indexer.stem_indexer`` (builds metadata itself)."""
    return stem_indexer.stem_indexer(*inp.tensors(), num_prompt_tokens=inp.num_prompt_tokens,
                                     **params)


def metadata_for(inp: Inputs, **params) -> torch.Tensor:
    p = IndexerParams(**params)
    return torch.ops.custom.npu_stem_indexer_metadata(
        inp.q_seq_lens, inp.kv_seq_lens, inp.qflat.shape[1], inp.kflat.shape[1],
        causal=p.causal, stem_block_size=p.stem_block_size, dim_qkflat=inp.qflat.shape[-1],
        window_size=p.window_size)


def run_op(inp: Inputs, metadata: torch.Tensor | None = None, **params):
    """``torch.ops.custom.npu_stem_indexer`` with metadata from the metadata op."""
    if metadata is None:
        metadata = metadata_for(inp, **params)
    return torch.ops.custom.npu_stem_indexer(
        *inp.tensors(), num_prompt_tokens=inp.num_prompt_tokens, metadata=metadata, **params)


# The reference is a pure function of its inputs and the slowest part of many
# tests; the variants of a test that run the same inputs on each selection or
# device compute it once. Up to _REF_MEMO_ELEMENTS output elements are kept.
_REF_MEMO: dict = {}
_REF_MEMO_ELEMENTS = 1 << 24


def _digest(inp: Inputs) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for t in (*inp.tensors(), inp.num_prompt_tokens):
        if t is None:
            h.update(b"none")
            continue
        t = t.detach().cpu().contiguous()
        h.update(f"{t.dtype} {tuple(t.shape)};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.digest()


def run_ref(inp: Inputs, **params):
    """``stem_indexer_reference`` on ``inp`` (fresh copies of a remembered result)."""
    key = (_digest(inp), tuple(sorted(params.items())))
    out = _REF_MEMO.get(key)
    if out is None:
        out = stem_indexer.stem_indexer_reference(
            *inp.tensors(), num_prompt_tokens=inp.num_prompt_tokens, **params)
        held = sum(idx.numel() for idx, _ in _REF_MEMO.values())
        if held + out[0].numel() <= _REF_MEMO_ELEMENTS:
            _REF_MEMO[key] = out
    return tuple(t.clone() for t in out)


def expected_tensors(rows, kmax: int):
    """Pad hand-written rows ``rows[b][h][i] = [valid indices]`` with -1.

    ``sparse_seq_len`` is the length of each hand-written row (docs/CONTRACT.md section 3:
    seq_len = L = number of selected blocks).
    """
    batch, nq, qmax = len(rows), len(rows[0]), len(rows[0][0])
    idx = torch.full((batch, nq, qmax, kmax), -1, dtype=torch.int32)
    seq = torch.zeros((batch, nq, qmax), dtype=torch.int32)
    for b in range(batch):
        assert len(rows[b]) == nq
        for h in range(nq):
            assert len(rows[b][h]) == qmax
            for i, row in enumerate(rows[b][h]):
                seq[b, h, i] = len(row)
                if row:
                    idx[b, h, i, : len(row)] = torch.tensor(row, dtype=torch.int32)
    return idx, seq


def assert_out_equal(actual, expected, label=""):
    a_idx, a_len = actual
    e_idx, e_len = expected
    assert a_idx.dtype == torch.int32 and a_len.dtype == torch.int32, label
    assert a_idx.shape == e_idx.shape and a_len.shape == e_len.shape, (
        f"{label}: shapes {tuple(a_idx.shape)}/{tuple(a_len.shape)} != "
        f"{tuple(e_idx.shape)}/{tuple(e_len.shape)}")
    if not torch.equal(a_len, e_len):
        raise AssertionError(f"{label}: sparse_seq_len\n{a_len.tolist()}\n!= expected\n"
                             f"{e_len.tolist()}")
    if not torch.equal(a_idx, e_idx):
        bad = (a_idx != e_idx).any(-1).nonzero().tolist()
        first = tuple(bad[0])
        raise AssertionError(f"{label}: sparse_indices differ in rows {bad[:8]}; row {first}: "
                             f"{a_idx[first].tolist()} != expected {e_idx[first].tolist()}")


def on_cpu(out, device):
    """Check that outputs are on ``device``, then bring them to the CPU."""
    for t in out:
        assert t.device.type == torch.device(device).type, (t.device, device)
    return tuple(t.cpu() for t in out)


def check_all_paths(device, inp: Inputs, expected, **params):
    """The API and the raw op (with metadata from the metadata op), both on
    ``device``, and the reference must all give exactly ``expected``."""
    dev = inp.to(device)
    assert_out_equal(on_cpu(run_api(dev, **params), device), expected,
                     f"stem_indexer.stem_indexer ({device})")
    assert_out_equal(on_cpu(run_op(dev, **params), device), expected,
                     f"torch.ops.custom.npu_stem_indexer ({device})")
    assert_out_equal(run_ref(inp, **params), expected, "stem_indexer_reference")


# --------------------------------------------------------------------------- #
# Random inputs
# --------------------------------------------------------------------------- #


def random_inputs(gen: torch.Generator, *, batch, nq, nk, qmax, kmax, df, q_lens, kv_lens,
                  prompt=None, integer=False) -> Inputs:
    """Random inputs. With ``integer`` the bf16 values are small integers and
    vbias lies on a 1/64 grid, so every score is exact in float32 whatever the
    summation order (as long as R is a power of two)."""
    if integer:
        qflat = torch.randint(-3, 4, (batch, nq, qmax, df), generator=gen).to(torch.bfloat16)
        kflat = torch.randint(-3, 4, (batch, nk, kmax, df), generator=gen).to(torch.bfloat16)
        vbias = torch.randint(-128, 129, (batch, nk, kmax), generator=gen).float() / 64
    else:
        qflat = torch.randn((batch, nq, qmax, df), generator=gen).to(torch.bfloat16)
        kflat = torch.randn((batch, nk, kmax, df), generator=gen).to(torch.bfloat16)
        vbias = torch.randn((batch, nk, kmax), generator=gen) * 0.3
    return Inputs(qflat, kflat, vbias, i32(q_lens), i32(kv_lens),
                  None if prompt is None else i32(prompt))


def spec_row_facts(q_len: int, kv_len: int, prompt_len: int, i: int, params: IndexerParams):
    """(s2, forced set, candidate count, K) of row i, restated from docs/CONTRACT.md section 3
    in plain Python (independent of ``contract``; K from the scalar golden)."""
    bs = params.stem_block_size
    qb, kb, p = -(-q_len // bs), -(-kv_len // bs), -(-prompt_len // bs)
    s2 = min(max(kb - qb + i + 1, 0), kb) if params.causal else kb
    forced = set(range(min(params.initial_blocks, s2)))
    forced |= set(range(max(s2 - params.window_size, 0), s2))
    k = reference_budget(
        p, i + kb - qb, alpha=params.alpha,
        k_block_num_rate_medium=params.k_block_num_rate_medium,
        k_block_num_bias_medium=params.k_block_num_bias_medium,
        k_block_num_rate_large=params.k_block_num_rate_large,
        k_block_num_bias_large=params.k_block_num_bias_large)
    return s2, forced, s2 - len(forced), k


# Attention tests (test_attention.py, test_flash.py): blocks small enough that
# a few hundred tokens are past the budget's keep-everything range (56
# blocks), so Stem really drops blocks.
SMALL = dict(stem_block_size=16, stem_stride=4)


def qkv(batch, hq, hkv, sq, skv, dim, seed, dtype=torch.float32, device="cpu"):
    """Random q [batch, hq, sq, dim], k and v [batch, hkv, skv, dim] on
    ``device`` (drawn on the CPU: every device sees the same numbers)."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, hq, sq, dim, generator=gen).to(device, dtype),
            torch.randn(batch, hkv, skv, dim, generator=gen).to(device, dtype),
            torch.randn(batch, hkv, skv, dim, generator=gen).to(device, dtype))


def host(t: torch.Tensor, device) -> torch.Tensor:
    """``t``, checked to be on ``device``, on the CPU (where the float64
    references are computed)."""
    assert t.device.type == torch.device(device).type, (t.device, device)
    return t.cpu()


def cpu_dense_above(device, dtype=torch.float32) -> dict:
    """``stem_attention``'s ``dense_above`` for a test whose calls must take
    the path they take on the CPU: nothing there (the default), the CPU's
    measured share elsewhere. CUDA's own default (``contract.DENSE_ABOVE``,
    0.35) sends the default budget's 1,100-token calls, sparse on the CPU, to
    dense attention, and the test would no longer reach the sparse path."""
    if torch.device(device).type == "cpu":
        return {}
    return dict(dense_above=stem_indexer.operator.contract.default_dense_above("cpu", dtype))


@contextlib.contextmanager
def native_on_cache(cache):
    """``ops.native`` with its state forgotten and its cache in ``cache`` for
    the block; the environment and a fresh state again after."""
    from stem_indexer.operator.ops import native
    before = os.environ.get("STEM_INDEXER_CACHE_DIR")
    os.environ["STEM_INDEXER_CACHE_DIR"] = str(cache)
    native.reset()
    try:
        yield native
    finally:
        if before is None:
            os.environ.pop("STEM_INDEXER_CACHE_DIR", None)
        else:
            os.environ["STEM_INDEXER_CACHE_DIR"] = before
        native.reset()


# The ways a tensor's values reach Python: each one, on a GPU tensor, waits for
# the device.
_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy")


def host_reads(fn) -> list[str]:
    """Run ``fn`` with every value read recorded, unless it comes from inside
    a kernel (``stem_indexer/operator/ops/`` or a custom op's body, a function whose
    name ends in ``_op``): where in the package each read was made."""
    seen = []
    originals = {name: getattr(torch.Tensor, name) for name in _READS}

    def spy(name):
        original = originals[name]

        def read(self, *args, **kwargs):
            frames = traceback.extract_stack()[:-1]
            ours = [f for f in frames if "/stem_indexer/" in f.filename]
            inside_kernel = any("/stem_indexer/operator/ops/" in f.filename
                                or f.name.endswith("_op") for f in ours)
            if ours and not inside_kernel:
                seen.append(f"{name} at {ours[-1].filename.split('/stem_indexer/')[-1]}:"
                            f"{ours[-1].lineno} ({ours[-1].name})")
            return original(self, *args, **kwargs)
        return read

    try:
        for name in _READS:
            setattr(torch.Tensor, name, spy(name))
        fn()
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
    return seen


class LazyModule:
    """A module imported at its first attribute access. Every xdist worker
    collects every test file, and transformers (with this package's
    integration of it) takes about two seconds to import: only the worker
    that runs its tests pays. (To patch the module, name it:
    ``monkeypatch.setattr("package.module.name", ...)``.)"""

    def __init__(self, name: str):
        self._name = name

    # What pytest's collection asks of each module global (a mock's name, and
    # special names such as __wrapped__): answered without the import.
    _PROBES = ("_mock_name",)

    def __getattr__(self, attr: str):
        special = attr.startswith("__") and attr.endswith("__") and attr != "__version__"
        if special or attr in self._PROBES:
            raise AttributeError(attr)
        import importlib
        return getattr(importlib.import_module(self._name), attr)


def needs(package: str):
    """Skip a test module, saying so, where ``package`` is not installed
    (``pytest.importorskip`` without importing it)."""
    import importlib.util

    import pytest
    return pytest.mark.skipif(importlib.util.find_spec(package) is None,
                              reason=f"{package} is not installed")
