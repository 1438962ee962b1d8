"""The ``stem-indexer`` command line: demo, verify, cases."""

from __future__ import annotations

import csv

import pytest

from stem_indexer.surfaces import cli
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


def _no_case_may_run(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a case ran before --out was checked")
    monkeypatch.setattr(runner, "run_case", refuse)


@pytest.mark.parametrize("where", ["dot", "directory", "trailing_slash", "under_a_file",
                                   "missing_directory", "device", "empty"])
def test_verify_out_that_cannot_be_written_is_a_usage_error(where, tmp_path, monkeypatch,
                                                             capsys):
    # Each of these used to reach the write (after every case had run) and end
    # in a traceback; now it is a usage error before any case runs.
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    monkeypatch.chdir(tmp_path)
    out = {"dot": ".", "directory": str(tmp_path), "trailing_slash": "new_dir/",
           "under_a_file": str(a_file / "result.csv"),
           "missing_directory": str(tmp_path / "missing" / "result.csv"),
           "device": "/dev/null", "empty": ""}[where]
    _no_case_may_run(monkeypatch)
    with pytest.raises(SystemExit) as err:
        cli.main(["verify", "--cases", "SI_WB_002", "--out", out])
    assert err.value.code == 2
    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if "error:" in line]
    assert len(errors) == 1 and "--out" in errors[0], captured.err
    assert "Traceback" not in captured.err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]  # nothing left behind


def test_verify_out_in_a_directory_without_room_for_a_file_is_a_usage_error(
        tmp_path, monkeypatch, capsys):
    # Permission bits do not stop root, so make creating the file fail the way
    # a read-only file system does.
    import tempfile

    def read_only(*args, **kwargs):
        raise OSError(30, "Read-only file system")
    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    _no_case_may_run(monkeypatch)
    with pytest.raises(SystemExit) as err:
        cli.main(["verify", "--cases", "SI_WB_002", "--out", str(tmp_path / "result.csv")])
    assert err.value.code == 2
    assert "not writable (Read-only file system)" in capsys.readouterr().err


def test_verify_reports_a_failed_write_in_one_line(tmp_path, monkeypatch, capsys):
    # A path that was fine when checked but cannot be written at the end.
    def full_disk(results, path):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(runner, "write_results_csv", full_disk)
    assert cli.main(["verify", "--cases", "SI_WB_002",
                     "--out", str(tmp_path / "result.csv")]) == 2
    err = capsys.readouterr().err
    assert "cannot write" in err and "No space left on device" in err


def test_verify_judges_this_packages_op_with_no_allowance(tmp_path, monkeypatch):
    # The 0.5% allowance for picks beyond rounding is for other
    # implementations' outputs; verify runs this package's op.
    from stem_indexer.testing import compare

    seen = []
    real = compare.compare

    def spy(*args, **kwargs):
        result = real(*args, **kwargs)
        seen.append(result.allowance)
        return result
    monkeypatch.setattr(compare, "compare", spy)
    assert cli.main(["verify", "--cases", "SI_WB_002,SI_WB_103",
                     "--out", str(tmp_path / "result.csv")]) == 0
    assert seen == [0.0, 0.0]
