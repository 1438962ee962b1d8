"""Running the case table against the golden: single and batch modes.

Used by the tests (``tests/test_cases_*.py``) and by ``stem-indexer verify``.
It mirrors the reference operator's test framework (docs/DEVELOPMENT.md, "Tests"):

* single mode: ``run_case`` builds a case's inputs, takes the golden from
  ``stem_indexer_reference`` (CPU), runs the op on a device in "eager" or
  "graph" mode and compares the two with ``compare.compare`` (docs/CONTRACT.md section 5);
* batch mode: a CSV of cases (``write_cases_csv`` / ``read_cases_csv``) ->
  one ``<case_id>.pt`` per case holding the inputs and golden outputs
  (``prepare_batch``) -> ``run_batch`` runs and compares them all and writes
  ``result.csv``.

Modes: "eager" calls ``torch.ops.custom.npu_stem_indexer_metadata`` then
``torch.ops.custom.npu_stem_indexer``; "graph" makes the same two calls inside
a ``torch.compile(fullgraph=True, dynamic=True)`` function. Graph mode never
falls back to eager: a recompile-limit hit is an error, not a silent eager run.

Environment: ``STEM_INDEXER_CASE_ID`` (comma-separated ids, default all),
``STEM_INDEXER_MODE`` (eager|graph, default eager), ``STEM_INDEXER_DEVICE``
(cpu|cuda, default cpu).

Cases with ``data="integer"`` have exact scores (independent of summation
order), so for them ``run_case`` and ``run_batch`` also require outputs
identical to the golden, not just the docs/CONTRACT.md section 5 tolerance.
Every other case is compared with no allowance: a pick may differ from the
golden's only where its score is within rounding of the row's threshold
(``compare.FOREIGN_ALLOWANCE`` is for other implementations' outputs, never
for this package's backends).
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import io
import json
import os
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch

from . import compare as _compare
from .cases import Case, select_cases
from ..operator._files import write_atomic
from ..operator._threads import thread_count
from ..operator.contract import IndexerParams
from ..operator.ops import library as _library  # noqa: F401  (registers the ops)
from ..operator.reference import stem_indexer_reference

__all__ = [
    "MODES",
    "CaseResult",
    "env_cases",
    "env_mode",
    "env_device",
    "golden_outputs",
    "op_outputs",
    "run_case",
    "write_results_csv",
    "write_cases_csv",
    "read_cases_csv",
    "prepare_batch",
    "run_batch",
]

MODES = ("eager", "graph")
DEVICES = ("cpu", "cuda")
ENV_CASE_ID = "STEM_INDEXER_CASE_ID"
ENV_MODE = "STEM_INDEXER_MODE"
ENV_DEVICE = "STEM_INDEXER_DEVICE"

RESULT_COLUMNS = ("case_id", "label", "mode", "device", "ok", "op_seconds", "golden_seconds",
                  "summary", "covers")
CASES_CSV = "cases.csv"
RESULT_CSV = "result.csv"


@dataclass
class CaseResult:
    """Outcome of one case in one mode on one device."""

    case_id: str
    label: str
    covers: str
    ok: bool
    summary: str
    op_seconds: float
    golden_seconds: float
    mode: str
    device: str
    # Both outputs equal the golden bit for bit (required for data="integer").
    identical: bool = False


# --------------------------------------------------------------------------- #
# Environment selection
# --------------------------------------------------------------------------- #


def env_cases(include_large: bool = False) -> list[Case]:
    """Cases named by STEM_INDEXER_CASE_ID (all when unset; named ones run even if large)."""
    return select_cases(os.environ.get(ENV_CASE_ID), include_large=include_large)


def env_mode() -> str:
    """STEM_INDEXER_MODE: "eager" (default) or "graph"."""
    return _checked_choice(ENV_MODE, os.environ.get(ENV_MODE) or "eager", MODES)


def env_device() -> str:
    """STEM_INDEXER_DEVICE: "cpu" (default) or "cuda"."""
    return _checked_choice(ENV_DEVICE, os.environ.get(ENV_DEVICE) or "cpu", DEVICES)


def _checked_choice(name: str, value: str, allowed: Sequence[str]) -> str:
    value = value.strip().lower()
    if value not in allowed:
        raise ValueError(f"{name} must be one of {'|'.join(allowed)}; got {value!r}")
    return value


# --------------------------------------------------------------------------- #
# Golden
# --------------------------------------------------------------------------- #

# The golden is a pure function of a (frozen, hashable) case, and the slowest
# part of every run; single and batch mode in one process share it. Only
# goldens up to _CACHE_MAX_ELEMENTS are kept, _CACHE_TOTAL_ELEMENTS in all.
_CACHE_MAX_ELEMENTS = 1 << 24
_CACHE_TOTAL_ELEMENTS = 1 << 26
_golden_cache: dict[Case, tuple[tuple[torch.Tensor, torch.Tensor], float]] = {}


def golden_outputs(case: Case, inputs: dict | None = None, *, cache: bool = True
                   ) -> tuple[tuple[torch.Tensor, torch.Tensor], float]:
    """``((sparse_indices, sparse_seq_len), seconds)`` of the reference on CPU.

    ``inputs`` defaults to ``case.make_inputs()``; pass them to save rebuilding.
    With ``cache`` the result for ``case`` is memoised (and copies are returned),
    so only pass ``inputs`` that are the case's own.
    """
    if cache and case in _golden_cache:
        (idx, lens), seconds = _golden_cache[case]
        return (idx.clone(), lens.clone()), seconds
    if inputs is None:
        inputs = case.make_inputs()
    cpu_inputs = {k: (v.cpu() if v is not None else None) for k, v in inputs.items()}
    start = time.perf_counter()
    # The golden's per-head matmuls are tiny: a thread pool only adds
    # overhead (and stalls badly on a loaded machine).
    with thread_count(torch.get_num_threads, torch.set_num_threads, 1):
        out = stem_indexer_reference(**cpu_inputs, **case.op_kwargs())
    seconds = time.perf_counter() - start
    if cache and out[0].numel() <= _CACHE_MAX_ELEMENTS:
        held = sum(v[0][0].numel() for v in _golden_cache.values())
        if held + out[0].numel() <= _CACHE_TOTAL_ELEMENTS:
            _golden_cache[case] = ((out[0].clone(), out[1].clone()), seconds)
    return out, seconds


# --------------------------------------------------------------------------- #
# The op, eager or graph
# --------------------------------------------------------------------------- #


def _call_op(qflat, kflat, vbias, q_seq_lens, kv_seq_lens, num_prompt_tokens, attrs: dict):
    """Metadata op, then the main op: the two calls of the compatibility API."""
    metadata = torch.ops.custom.npu_stem_indexer_metadata(
        q_seq_lens, kv_seq_lens, qflat.shape[1], kflat.shape[1], causal=attrs["causal"],
        stem_block_size=attrs["stem_block_size"], dim_qkflat=qflat.shape[-1],
        window_size=attrs["window_size"])
    return torch.ops.custom.npu_stem_indexer(
        qflat, kflat, vbias, q_seq_lens, kv_seq_lens, num_prompt_tokens=num_prompt_tokens,
        metadata=metadata, **attrs)


# One compiled function per distinct set of attributes (they are constants of
# the traced function; float attributes would be specialised anyway). Shapes
# are dynamic; guards still specialise what the schemas take as plain ints
# (Nq, Nk, Df through the metadata op), so recompiles are expected and the
# limits are raised -- with a hard failure instead of a silent eager fallback.
_graph_fns: dict[tuple, Callable] = {}
# Older torch releases name the first limit ``cache_size_limit``; only the
# options this torch has are set. (Read when graph mode first runs: importing
# torch._dynamo takes about a second.)
@functools.cache
def _graph_dynamo_config() -> dict:
    import torch._dynamo

    return {name: value
            for name, value in (("recompile_limit", 512), ("cache_size_limit", 512),
                                ("accumulated_recompile_limit", 4096),
                                ("accumulated_cache_size_limit", 4096),
                                ("fail_on_recompile_limit_hit", True),
                                ("fail_on_cache_limit_hit", True))
            if hasattr(torch._dynamo.config, name)}


def _graph_fn(params: IndexerParams) -> Callable:
    attrs = dataclasses.asdict(params)
    key = tuple(sorted(attrs.items()))
    fn = _graph_fns.get(key)
    if fn is None:
        def indexer(qflat, kflat, vbias, q_seq_lens, kv_seq_lens, num_prompt_tokens):
            return _call_op(qflat, kflat, vbias, q_seq_lens, kv_seq_lens, num_prompt_tokens,
                            attrs)

        fn = _graph_fns[key] = torch.compile(indexer, fullgraph=True, dynamic=True)
    return fn


def op_outputs(case: Case, inputs: dict, device: str | torch.device = "cpu",
               mode: str = "eager") -> tuple[torch.Tensor, torch.Tensor]:
    """Run the op on ``device`` in ``mode`` on (copies of) ``inputs``; outputs stay there."""
    mode = _checked_choice("mode", mode, MODES)
    args = [inputs[k] for k in ("qflat", "kflat", "vbias", "q_seq_lens", "kv_seq_lens",
                                "num_prompt_tokens")]
    args = [a.to(device) if a is not None else None for a in args]
    if mode == "eager":
        out = _call_op(*args, case.op_kwargs())
    else:
        with torch._dynamo.config.patch(**_graph_dynamo_config()):
            out = _graph_fn(case.params)(*args)
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return out


# --------------------------------------------------------------------------- #
# Single mode
# --------------------------------------------------------------------------- #


def _error_text(exc: BaseException) -> str:
    frame = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    where = f" (at {Path(frame[0].filename).name}:{frame[0].lineno})" if frame else ""
    return f"ERROR: {type(exc).__name__}: {exc}{where}"


def _judge(case: Case, inputs: dict, actual, golden, *, mode: str, device: str,
           op_seconds: float, golden_seconds: float, allowance: float = 0.0) -> CaseResult:
    actual = tuple(t.cpu() for t in actual)
    golden = tuple(t.cpu() for t in golden)
    cmp = _compare.compare(actual, golden, inputs, case.params, allowance=allowance)
    identical = (actual[0].shape == golden[0].shape and actual[1].shape == golden[1].shape
                 and torch.equal(actual[0], golden[0]) and torch.equal(actual[1], golden[1]))
    ok = cmp.ok
    summary = cmp.summary()
    if identical:
        summary += "; identical to the golden"
    elif case.data == "integer":
        ok = False
        summary += ("; FAIL: differs from the golden although every score is exact "
                    "(data=integer requires identical outputs)")
    return CaseResult(case.id, case.label, case.covers, ok, summary, op_seconds,
                      golden_seconds, mode, str(device), identical)


def run_case(case: Case, *, device: str = "cpu", mode: str = "eager",
             golden: tuple[torch.Tensor, torch.Tensor] | None = None,
             allowance: float = 0.0) -> CaseResult:
    """Run one case on ``device`` in ``mode`` and compare it with the golden.

    ``golden`` is ``(sparse_indices, sparse_seq_len)`` when already known;
    otherwise the reference computes it on CPU (``golden_seconds`` is then its
    time, else 0). An exception raised by the op becomes a failed result whose
    summary names it. ``op_seconds`` in graph mode includes any compilation.
    ``allowance`` goes to ``compare.compare``: 0 (no pick beyond score
    tolerance) is the rule for this package's backends.
    """
    inputs = case.make_inputs()
    golden_seconds = 0.0
    if golden is None:
        golden, golden_seconds = golden_outputs(case, inputs)
    start = time.perf_counter()
    try:
        actual = op_outputs(case, inputs, device, mode)
    except Exception as exc:  # reported, not raised: one broken case must not hide the rest
        return CaseResult(case.id, case.label, case.covers, False, _error_text(exc),
                          time.perf_counter() - start, golden_seconds, mode, str(device))
    op_seconds = time.perf_counter() - start
    return _judge(case, inputs, actual, golden, mode=mode, device=device,
                  op_seconds=op_seconds, golden_seconds=golden_seconds, allowance=allowance)


def write_results_csv(results: Iterable[CaseResult], path: str | os.PathLike) -> None:
    """One row per result: case_id,label,mode,device,ok,op_seconds,golden_seconds,summary,covers."""
    buf = io.StringIO(newline="")
    writer = csv.writer(buf)
    writer.writerow(RESULT_COLUMNS)
    for r in results:
        writer.writerow([r.case_id, r.label, r.mode, r.device, r.ok, f"{r.op_seconds:.6f}",
                         f"{r.golden_seconds:.6f}", r.summary, r.covers])
    write_atomic(path, buf.getvalue())


# --------------------------------------------------------------------------- #
# Case CSV
# --------------------------------------------------------------------------- #

_CASE_FIELDS = [f.name for f in dataclasses.fields(Case) if f.name not in ("number", "params")]
_PARAM_FIELDS = [f.name for f in dataclasses.fields(IndexerParams)]
CASE_COLUMNS = ("case_id", *_CASE_FIELDS, *_PARAM_FIELDS)

_TUPLE_FIELDS = {"q_lens", "kv_lens", "prompt_lens"}
_OPTIONAL_FIELDS = {"prompt_lens", "q_blocks", "kv_blocks"}
_REQUIRED_COLUMNS = {"case_id", "q_lens", "kv_lens"}


def _encode(value) -> str:
    if value is None:
        return ""
    if isinstance(value, tuple):
        return json.dumps(list(value))
    if isinstance(value, float):
        return repr(value)  # round-trips exactly
    return str(value)


def _parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("true", "1", "yes"):
        return True
    if low in ("false", "0", "no"):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def _decode(name: str, text: str, kind: type):
    if name in _OPTIONAL_FIELDS and text.strip() == "":
        return None
    if name in _TUPLE_FIELDS:
        values = json.loads(text)
        if not isinstance(values, list) or not all(isinstance(v, int) for v in values):
            raise ValueError(f"{name} must be a JSON list of ints; got {text!r}")
        return tuple(values)
    if kind is bool:
        return _parse_bool(text)
    if kind is int:
        return int(text)
    if kind is float:
        return float(text)
    return text


def _case_number(case_id: str) -> int:
    text = case_id.strip().upper()
    text = text[len("SI_WB_"):] if text.startswith("SI_WB_") else text
    if not text.isdigit():
        raise ValueError(f"case_id must look like SI_WB_nnn; got {case_id!r}")
    return int(text)


def write_cases_csv(cases: Iterable[Case], path: str | os.PathLike) -> None:
    """One row per case: its id and every field (attributes flattened), enough to rebuild it."""
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(CASE_COLUMNS)
        for c in cases:
            row = [c.id] + [_encode(getattr(c, n)) for n in _CASE_FIELDS]
            row += [_encode(getattr(c.params, n)) for n in _PARAM_FIELDS]
            writer.writerow(row)


def read_cases_csv(path: str | os.PathLike) -> list[Case]:
    """Cases from a CSV written by ``write_cases_csv`` (or by hand).

    ``case_id``, ``q_lens`` and ``kv_lens`` are required; any other column may
    be left out (or empty, for the optional ones) and takes its default.
    Unknown columns are an error, so a typo cannot silently fall back.
    """
    case_types = {"q_heads": int, "kv_heads": int, "dim": int, "q_blocks": int,
                  "kv_blocks": int, "vbias_scale": float, "seed": int, "large": bool,
                  "covers": str, "data": str}
    param_types = {f.name: type(f.default) for f in dataclasses.fields(IndexerParams)}
    out = []
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        columns = set(reader.fieldnames or ())
        unknown = columns - set(CASE_COLUMNS)
        missing = _REQUIRED_COLUMNS - columns
        if unknown or missing:
            raise ValueError(f"{path}: unknown columns {sorted(unknown)}, "
                             f"missing columns {sorted(missing)}")
        for line, row in enumerate(reader, start=2):
            try:
                kw = {n: _decode(n, row[n], case_types.get(n, tuple))
                      for n in _CASE_FIELDS if n in columns}
                params = {n: _decode(n, row[n], param_types[n])
                          for n in _PARAM_FIELDS if n in columns}
                out.append(Case(number=_case_number(row["case_id"]), covers=kw.pop("covers", ""),
                                params=IndexerParams(**params), **kw))
            except (ValueError, TypeError, json.JSONDecodeError) as exc:
                raise ValueError(f"{path}:{line}: {exc}") from exc
    return out


# --------------------------------------------------------------------------- #
# Batch mode
# --------------------------------------------------------------------------- #


def prepare_batch(cases: Iterable[Case], outdir: str | os.PathLike) -> list[Path]:
    """Write ``outdir/cases.csv`` and one ``<case_id>.pt`` per case (inputs + golden).

    Each ``.pt`` holds ``{"case_id", "inputs": {name: tensor or None},
    "golden": {"sparse_indices", "sparse_seq_len"}, "golden_seconds"}``.
    Returns the ``.pt`` paths.
    """
    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    cases = list(cases)
    write_cases_csv(cases, outdir / CASES_CSV)
    paths = []
    for case in cases:
        inputs = case.make_inputs()
        (indices, seq_len), seconds = golden_outputs(case, inputs)
        path = outdir / f"{case.id}.pt"
        torch.save({"case_id": case.id, "inputs": inputs,
                    "golden": {"sparse_indices": indices, "sparse_seq_len": seq_len},
                    "golden_seconds": seconds}, path)
        paths.append(path)
    return paths


def run_batch(outdir: str | os.PathLike, *, device: str = "cpu", mode: str = "eager",
              allowance: float = 0.0) -> list[CaseResult]:
    """Run every case of ``outdir/cases.csv`` from its saved ``.pt``; write ``result.csv``.

    ``allowance`` as in ``run_case``: 0 for this package's backends.

    A case whose ``.pt`` is missing or unreadable, or whose op raises, is a
    failed row; the batch goes on.
    """
    outdir = Path(outdir)
    results = []
    for case in read_cases_csv(outdir / CASES_CSV):
        try:
            saved = torch.load(outdir / f"{case.id}.pt", weights_only=True)
            if saved["case_id"] != case.id:
                raise ValueError(f"{case.id}.pt holds case {saved['case_id']}")
            inputs = saved["inputs"]
            golden = (saved["golden"]["sparse_indices"], saved["golden"]["sparse_seq_len"])
            golden_seconds = float(saved["golden_seconds"])
        except Exception as exc:
            results.append(CaseResult(case.id, case.label, case.covers, False,
                                      _error_text(exc), 0.0, 0.0, mode, str(device)))
            continue
        start = time.perf_counter()
        try:
            actual = op_outputs(case, inputs, device, mode)
        except Exception as exc:
            results.append(CaseResult(case.id, case.label, case.covers, False,
                                      _error_text(exc), time.perf_counter() - start,
                                      golden_seconds, mode, str(device)))
            continue
        results.append(_judge(case, inputs, actual, golden, mode=mode, device=device,
                              op_seconds=time.perf_counter() - start,
                              golden_seconds=golden_seconds, allowance=allowance))
    write_results_csv(results, outdir / RESULT_CSV)
    return results
