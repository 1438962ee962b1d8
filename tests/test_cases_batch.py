"""Batch mode: CSV of cases -> saved inputs and goldens (.pt) -> run -> result.csv.

Mirrors the reference suite's batch mode. Selection as in single mode
(``STEM_INDEXER_CASE_ID``, ``STEM_INDEXER_MODE``); large cases join only when
named or with ``--run-large``. With no mode given, the whole selection runs
eager and ``cases.GRAPH_SUBSET`` runs through graph mode as a second batch.
"""

from __future__ import annotations

import csv
import os

import pytest

from stem_indexer.testing import cases, runner

_SPEC = os.environ.get(runner.ENV_CASE_ID, "").strip()
_MODE_GIVEN = bool(os.environ.get(runner.ENV_MODE, "").strip())


def _batches() -> list:
    out = [pytest.param(runner.env_mode(), "selection", id=runner.env_mode())]
    if not _SPEC and not _MODE_GIVEN:
        out.append(pytest.param("graph", "graph_subset", id="graph-subset"))
    return out


@pytest.mark.parametrize("mode, which", _batches())
def test_batch(mode: str, which: str, device: str, tmp_path, request):
    if which == "graph_subset":
        selected = cases.graph_subset()
    else:
        selected = cases.select_cases(_SPEC, include_large=request.config.getoption("--run-large"))
    assert selected, "no cases selected"

    # The case CSV round-trips exactly.
    listing = tmp_path / "selected_cases.csv"
    runner.write_cases_csv(selected, listing)
    rebuilt = runner.read_cases_csv(listing)
    assert rebuilt == selected

    outdir = tmp_path / "batch"
    paths = runner.prepare_batch(rebuilt, outdir)
    assert [p.name for p in paths] == [f"{c.id}.pt" for c in selected]
    assert runner.read_cases_csv(outdir / runner.CASES_CSV) == selected

    results = runner.run_batch(outdir, device=device, mode=mode)
    result_csv = outdir / runner.RESULT_CSV
    assert result_csv.is_file()
    with open(result_csv, newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0].keys()) == list(runner.RESULT_COLUMNS)
    assert [r["case_id"] for r in rows] == [c.id for c in selected]
    assert len(results) == len(selected)
    assert all(r["mode"] == mode and r["device"] == device for r in rows)
    failed = [f"{r['case_id']}: {r['summary']}" for r in rows if r["ok"] != "True"]
    assert not failed, f"{len(failed)} of {len(rows)} cases failed:\n" + "\n".join(failed)
