"""The ``stem-indexer`` command line: demo, verify, cases."""

from __future__ import annotations

import csv

import pytest

from stem_indexer import cli
from stem_indexer.testing import cases, runner


def test_demo_summarises_the_article_example(capsys):
    assert cli.main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "qflat (4, 64, 16, 2048) bf16" in out
    assert "sparse_indices (4, 64, 16, 64) int32" in out
    assert "metadata 57344 int32" in out  # AlignUp(16 + 4*8*1728, 4096)
    # By hand: P = 64 blocks -> Ks = floor(f32(64 * 0.2)) + 30 = 42, alpha 1 so
    # K = 42 everywhere. Row i sees s2 = 49 + i blocks; 8 are forced, so it
    # keeps min(s2, 8 + 42): 49 for row 0, 50 for rows 1..15.
    assert "blocks kept per row: min 49, mean 49.9, max 50 (visible: 49..64)" in out
    # density = (49 + 15 * 50) / (49 + 50 + ... + 64) = 799 / 904
    assert f"density: {799 / 904:.1%}" in out


def test_verify_writes_result_csv_and_passes(tmp_path, capsys):
    out_csv = tmp_path / "result.csv"
    assert cli.main(["verify", "--cases", "SI_WB_002,SI_WB_103", "--out", str(out_csv)]) == 0
    with open(out_csv, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["case_id"] for r in rows] == ["SI_WB_002", "SI_WB_103"]
    assert all(r["ok"] == "True" for r in rows)
    assert "2 passed, 0 failed" in capsys.readouterr().out


def test_verify_exits_nonzero_when_a_case_fails(tmp_path, monkeypatch, capsys):
    real = runner.golden_outputs

    def wrong_golden(case, inputs=None, *, cache=True):
        (indices, seq_len), seconds = real(case, inputs, cache=False)
        seq_len = seq_len.clone()
        seq_len[0, 0, 0] += 1  # a golden that no correct op can match
        return (indices, seq_len), seconds

    monkeypatch.setattr(runner, "golden_outputs", wrong_golden)
    out_csv = tmp_path / "result.csv"
    assert cli.main(["verify", "--cases", "SI_WB_002", "--out", str(out_csv)]) == 1
    with open(out_csv, newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows[0]["ok"] == "False" and "sparse_seq_len differs" in rows[0]["summary"]
    assert "0 passed, 1 failed" in capsys.readouterr().out


def test_cases_lists_every_case(capsys):
    assert cli.main(["cases"]) == 0
    out = capsys.readouterr().out
    for case in cases.all_cases(include_large=True):
        assert case.label in out


def test_unknown_command_is_a_usage_error():
    with pytest.raises(SystemExit) as err:
        cli.main(["frobnicate"])
    assert err.value.code == 2
