"""Single mode: every case of the table against the golden, one test each.

Selection follows the reference suite's environment variables:

* ``STEM_INDEXER_CASE_ID`` -- comma-separated ids (default: the whole table;
  large cases are marked ``large`` and need ``--run-large``, unless named);
* ``STEM_INDEXER_MODE`` -- ``eager`` or ``graph`` for the whole selection.

With neither set (the default run) every base case shorter than 64K tokens
and a quarter of the bfloat16 mirrors run eager (all of them with
``--run-slow`` or a mode given, as ``tests/run.sh`` does), and the
representative ``cases.GRAPH_SUBSET`` also runs in graph mode (torch.compile),
so the default suite exercises compilation too.

Each test compares the op with ``stem_indexer_reference`` under the
docs/CONTRACT.md section 5 rules for this package's backends, as the runner
does: no differing pick beyond rounding of its row's threshold (no 0.5%
allowance); cases with ``data="integer"`` have exact scores, so they must also
match the reference bit for bit. ``test_case_torch_selection`` runs a quarter
of the table (and the representative subset) on the CPU path's torch
selection, its fallback where no C compiler exists.
"""

from __future__ import annotations

import os

import pytest

from stem_indexer.testing import cases, runner

_SELECTED_IDS = os.environ.get(runner.ENV_CASE_ID, "").strip()
_MODE_GIVEN = bool(os.environ.get(runner.ENV_MODE, "").strip())


def _params(subset=None) -> list:
    mode = runner.env_mode()
    named = bool(_SELECTED_IDS)
    out = []
    for case in cases.select_cases(_SELECTED_IDS, include_large=True):
        if subset is not None and not subset(case):
            continue
        marks = [pytest.mark.large] if case.large and not named else []
        if (_slow_mirror(case) or _long(case)) and not named and not _MODE_GIVEN:  # run.sh: all
            marks.append(pytest.mark.slow)
        case_id = case.label if mode == "eager" else f"{case.label}-graph"
        out.append(pytest.param(case, mode, id=case_id, marks=marks))
    if not named and not _MODE_GIVEN:  # graph mode: two cases by default, the subset slow
        out += [pytest.param(case, "graph", id=f"{case.label}-graph",
                             marks=[] if n < 2 else [pytest.mark.slow])
                for n, case in enumerate(c for c in cases.graph_subset()
                                         if subset is None or subset(c))]
    return out


def _slow_mirror(case: cases.Case) -> bool:
    """The default run ranks a quarter of the bfloat16 mirrors (and those of the
    representative subset); the slow tier all of them. The bf16 rounding
    itself is pinned by the hand cases and properties of test_semantics and
    test_properties on every shape they build."""
    return (case.params.topk_score_precision == 2 and case.number % 4 != 0
            and case.id not in cases.GRAPH_SUBSET)


def _long(case: cases.Case) -> bool:
    """Cases of 64K tokens and more (a few tenths of a second each) run in the
    slow tier, but for those of the representative subset: a 131K-token
    prefill and a chunk over 1M keys stay in the default run."""
    return (max((*case.q_lens, *case.kv_lens), default=0) >= 65536
            and case.id not in cases.GRAPH_SUBSET)


def _check(case: cases.Case, mode: str, device: str) -> None:
    # The runner's verdict: docs/CONTRACT.md section 5 with no allowance (every
    # differing pick within rounding of its row's threshold), and for
    # data="integer" (exact scores) outputs identical to the golden
    # (tests/test_runner.py pins both rules).
    result = runner.run_case(case, device=device, mode=mode, allowance=0.0)
    assert result.ok, f"{case.id} [{case.covers}] {mode}/{device}: {result.summary}"
    assert result.identical or case.data != "integer", result.summary


@pytest.mark.parametrize("case, mode", _params())
def test_case(case: cases.Case, mode: str, device: str):
    _check(case, mode, device)


def _torch_selection_subset(case: cases.Case) -> bool:
    """The representative subset (and, in the slow tier, a quarter of the
    table): the torch selection is the CPU path's fallback where no C compiler
    exists; the semantics, property and metadata tests run it on every shape
    they build."""
    return case.number % 4 == 0 or case.id in cases.GRAPH_SUBSET


def _torch_params() -> list:
    return [p if p.values[0].id in cases.GRAPH_SUBSET and p.values[1] == "eager"
            else pytest.param(*p.values, id=p.id, marks=[*p.marks, pytest.mark.slow])
            for p in _params(_torch_selection_subset)]


@pytest.mark.parametrize("case, mode", _torch_params())
def test_case_torch_selection(case: cases.Case, mode: str, monkeypatch):
    from stem_indexer.operator.ops import native
    monkeypatch.setattr(native, "kernel", lambda: None)
    _check(case, mode, "cpu")


@pytest.mark.parametrize("case, mode", [p for p in _torch_params()
                                        if p.values[1] == "eager"])
def test_case_scalar_selection_passes(case: cases.Case, mode: str):
    """The native selection with its gather and emit passes in scalar code,
    where the CPU would run them on AVX-512 (``native.select_vector``): the
    same picks."""
    from stem_indexer.operator.ops import native
    if not native.select_vector():
        pytest.skip("the selection's passes are scalar on this CPU already")
    try:
        assert not native.select_vector(0)
        _check(case, mode, "cpu")
    finally:
        assert native.select_vector(-1)
