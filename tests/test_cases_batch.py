"""Batch mode: CSV of cases -> saved inputs and goldens (.pt) -> run -> result.csv.

Mirrors the reference suite's batch mode. Selection as in single mode
(``STEM_INDEXER_CASE_ID``, ``STEM_INDEXER_MODE``); large cases join only when
named or with ``--run-large``. By default (no case named) the batch is the
representative ``cases.graph_subset()``, once eager and once in graph mode:
single mode already runs every case of the table, and what batch mode adds
is the CSV -> .pt -> run -> result.csv machinery.
"""

from __future__ import annotations

import csv
import os

import pytest

from stem_indexer.testing import cases, runner

_SPEC = os.environ.get(runner.ENV_CASE_ID, "").strip()
_MODE_GIVEN = bool(os.environ.get(runner.ENV_MODE, "").strip())


def _modes() -> list:
    if _MODE_GIVEN:
        return [runner.env_mode()]
    return ["eager", pytest.param("graph", marks=pytest.mark.slow)]


@pytest.mark.parametrize("mode", _modes())
def test_batch(mode: str, device: str, tmp_path, request):
    if _SPEC:
        selected = cases.select_cases(_SPEC, include_large=request.config.getoption("--run-large"))
    else:
        selected = cases.graph_subset()
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
