"""benchmarks/operator/indexer_bench.py: the plain baseline and the GEMM line are right, and one
tiny shape runs end to end (timings are printed by the benchmark, never asserted). The GPU check
(benchmarks/gpu/gpu_check.sh and its scripts): its steps fit one 600-second command, its test
selection names tests that exist, and a call, a length or a timing that raises loses only
its own cells."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import stem_indexer  # noqa: F401  (registers the ops)
import indexer_bench as bench
from stem_indexer.operator.ops import native
from stem_indexer.testing.cases import get_case
from stem_indexer.testing.runner import golden_outputs

TINY = bench.Shape(0, "tiny causal mixed batch", (300, 1, 640), (900, 700, 640), 4, 2,
                   dim=32, repeat=1)


@pytest.mark.parametrize("case_id", ["SI_WB_001", "SI_WB_039", "SI_WB_050", "SI_WB_077",
                                     "SI_WB_082", "SI_WB_177"])
def test_plain_baseline_equals_reference(case_id):
    """The baseline a user would write is exact too (ties by its stable sort)."""
    case = get_case(case_id)
    inputs = case.make_inputs()
    # The baseline budgets with the kv length as the prompt: the cases chosen
    # must have no prompt lengths of their own (a precondition, not a skip).
    assert case.prompt_lens is None and inputs.pop("num_prompt_tokens") is None, case_id
    expected, _ = golden_outputs(case)
    got = bench.plain_indexer(inputs, case.params)
    assert torch.equal(got[1], expected[1]) and torch.equal(got[0], expected[0])


def test_gemm_line_is_the_op_without_its_selection(monkeypatch):
    """The ``gemm`` line runs the op's own score matmuls, and no selection."""
    ranking = bench.Shape(0, "budget binds (71 key blocks)", (300, 1, 640), (9000, 7300, 640),
                          4, 2, dim=32, repeat=1)
    inputs = ranking.make_inputs()
    params = ranking.params
    metadata = bench._metadata(inputs, params)
    seen = []
    real = torch.bmm

    def spy(a, b, *args, **kwargs):
        seen.append((tuple(a.shape), tuple(b.shape)))
        return real(a, b, *args, **kwargs)

    monkeypatch.setattr(torch, "bmm", spy)
    bf16 = native.scores_bf16  # the products on CPUs with bfloat16 dot products
    monkeypatch.setattr(native, "scores_bf16",
                        lambda a, b, *rest, **kw: (seen.append((tuple(a.shape), tuple(b.shape))),
                                                   bf16(a, b, *rest, **kw))[1])
    bench.run_op(inputs, metadata, params)
    by_op, seen[:] = list(seen), []
    selected = []
    monkeypatch.setattr(native, "select_rows", lambda *args: selected.append(1))
    bench.scores_only(inputs, metadata, params)()
    assert seen == by_op and len(seen) > 0
    assert selected == []  # the closure stubs the selection out itself


def test_gemm_floor_multiplies_every_visible_pair(monkeypatch):
    """The bf16 / float32 GEMM lines compute the scores of every causally
    visible (query block, key block) pair: with one query block per matmul
    exactly those, with tiles of them at least those; and the values are
    the products."""
    inputs = TINY.make_inputs()
    params = TINY.params
    want = bench.visible_pairs(inputs, params) * TINY.q_heads
    real = torch.matmul
    for tile, exact in ((1, True), (32, False)):
        done = []

        def spy(a, b, *, out):
            done.append(a.shape[0] * b.shape[1])
            return real(a, b, out=out)

        monkeypatch.setattr(torch, "matmul", spy)
        bench.visible_gemm(inputs, params, torch.float32, tile=tile)()
        assert (sum(done) == want) if exact else (sum(done) >= want)
    monkeypatch.setattr(torch, "matmul", real)
    last = bench.visible_gemm(inputs, params, torch.float32, tile=10**6)()
    q, k = inputs["qflat"][2, 2:4].float().reshape(-1, 32), inputs["kflat"][2, 1, :5].float()
    assert torch.equal(last[1, :q.shape[0] * 5].view(-1, 5), q @ k.T)


def test_measure_shape_runs_and_checks():
    row = bench.measure_shape(TINY)
    assert row["check_exact"] and row["shape"] == "S0"
    for key in ("op_ms", "gemm_ms", "plain_ms", "bf16_ms", "f32_ms", "op_over_floor"):
        assert row[key] > 0
    table = bench.markdown_table([row])
    assert table.count("\n") == 2 and "| S0 |" in table


def test_unknown_shape_is_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(["--shapes", "S1,S9"])
    assert exc.value.code == 2 and "unknown ['S9']" in capsys.readouterr().err


def test_shapes_match_the_benchmark_brief():
    s = bench.SHAPES
    assert (len(s["S1"].q_lens), s["S1"].q_heads, s["S1"].kv_heads) == (4, 64, 8)
    assert (s["S1"].q_lens[0] // 128, s["S1"].kv_lens[0] // 128) == (16, 64)
    assert (s["S3"].q_lens, s["S3"].kv_lens) == ((8192,), (1 << 20,))
    assert s["S4"].q_lens == s["S4"].kv_lens == (1 << 17,)
    assert len(s["S5"].q_lens) == 8 and max(s["S5"].kv_lens) <= 65536
    assert dataclasses.asdict(s["S2"].params) == dataclasses.asdict(stem_indexer.IndexerParams())


@pytest.mark.parametrize("stem, name", [
    ({"preset": "default", "exact_tail": 0}, "default"),     # the recorded cells' settings
    ({"preset": "default"}, "default-tail"),                 # the default exact_tail, 128
    ({"preset": "tight", "exact_tail": 64}, "tight-tail64"),
    ({"exact_tail": 0, "alpha": 0.5}, 'serving {"alpha": 0.5}'),   # the backend's preset
])
def test_vllm_passkey_trials_are_named_by_their_settings(stem, name):
    """``vllm_bench.py passkey`` files a Stem engine's trials under a name
    its settings decide, so trials with and without the exact tail never
    share a cell."""
    import vllm_bench  # no vLLM import at module level

    assert vllm_bench.stem_config_name(stem) == name


# --------------------------------------------------------------------------- #
# The GPU check (benchmarks/gpu/gpu_check.sh and the scripts it runs), on the CPU
# --------------------------------------------------------------------------- #

ROOT = Path(__file__).resolve().parents[1]
GPU_CHECK = ROOT / "benchmarks" / "gpu" / "gpu_check.sh"
STUB_TIMEOUT = """#!/usr/bin/env bash
echo "$*" >> "$STUB_CALLS"
echo "step output: $*"
case "$*" in *gpu_check.py*) exit 124 ;; esac
"""


def _run_gpu_check(tmp_path, *args):
    """gpu_check.sh with ``timeout`` stubbed (it records its arguments; the
    indexer check's step stops "at its limit"): what the script runs, and
    how, without running it."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    (stubs / "timeout").write_text(STUB_TIMEOUT)
    (stubs / "timeout").chmod(0o755)
    out, calls = tmp_path / "out", tmp_path / "calls"
    env = dict(os.environ, PATH=f"{stubs}:{os.environ['PATH']}", PYTHON="true", OUT=str(out),
               STUB_CALLS=str(calls), STEM_GIT_SHA="0123abc")
    proc = subprocess.run(["bash", str(GPU_CHECK), *args], env=env, capture_output=True,
                          text=True, timeout=60)
    return proc, [line.split() for line in calls.read_text().splitlines()], out


def test_gpu_check_steps_fit_one_600_second_command(tmp_path):
    """--all: five steps, each under ``timeout -s INT -k 15 LIMIT`` (SIGINT
    first, so pytest prints its summary and the scripts keep their lines),
    the limits adding up to at most 420 s, the curated CUDA tests first; a
    step stopped at its limit is reported and the next ones run; one log
    holds every step's output."""
    proc, calls, out = _run_gpu_check(tmp_path, "--all")
    assert [c[:4] for c in calls] == [["-s", "INT", "-k", "15"]] * 5, calls
    assert sum(int(c[4]) for c in calls) <= 420
    scripts = [" ".join(c[6:8]) for c in calls]
    assert scripts == ["benchmarks/gpu/gpu_tests.py curated", "benchmarks/gpu/gpu_check.py --reps",
                       "benchmarks/gpu/gpu_attention.py --reps",
                       "benchmarks/gpu/gpu_attention.py --break-even",
                       "benchmarks/gpu/gpu_tests.py rest"], scripts
    assert proc.returncode == 1 and "indexer check (stopped at its limit (exit 124))" in proc.stdout
    log = (out / "gpu_check.log").read_text()
    assert log.count("step output:") == 5 and "git 0123abc" in log
    assert log.count("=== ") == 10  # each step's start and end


def test_gpu_check_dry_run_reaches_every_step(tmp_path):
    _, calls, _ = _run_gpu_check(tmp_path, "--all", "--dry-run")
    assert all("--dry-run" in c for c in calls) and len(calls) == 5


def test_gpu_test_selection_names_tests_that_exist():
    """The curated CUDA tests are test functions (or files) of the suite, the
    case ids are the table's; the run shares tests out (``--dist load``),
    caps Inductor's compile threads and writes a JUnit XML under $OUT; the
    rest leaves the curated ones out."""
    import ast

    import gpu_tests

    root = ROOT
    for test in gpu_tests.CURATED:
        path, _, name = test.partition("::")
        assert (root / path).is_file(), test
        if name:
            tree = ast.parse((root / path).read_text())
            assert name in {f.name for f in tree.body if isinstance(f, ast.FunctionDef)}, test
    assert 8 <= len(gpu_tests.CASE_IDS) <= 12
    for case_id in gpu_tests.CASE_IDS:
        get_case(case_id)
    args, env = gpu_tests.command("curated", Path("/o"))
    assert args[args.index("--dist") + 1] == "load"
    assert "--junitxml=/o/cuda_tests_curated.xml" in args
    assert env["STEM_INDEXER_DEVICE"] == "cuda" and env["TORCHINDUCTOR_COMPILE_THREADS"]
    assert env["STEM_INDEXER_CASE_ID"].split(",") == list(gpu_tests.CASE_IDS)
    rest, env = gpu_tests.command("rest", Path("/o"))
    assert {f"--deselect={t}" for t in gpu_tests.CURATED} <= set(rest)
    assert "STEM_INDEXER_CASE_ID" not in env
    dry, env = gpu_tests.command("curated", Path("/o"), dry_run=True)
    assert "--collect-only" in dry and env["STEM_INDEXER_DEVICE"] == "cpu"


def test_a_raising_timed_function_loses_only_its_own_cells(tmp_path, monkeypatch):
    """gpu_attention.py: a timed call that raises (here the FlexAttention
    baseline) leaves its cells ``error`` and fails the row; every other call
    of the length is timed and the row is in the file at once."""
    import gpu_attention
    from gpu_report import Report, guarded_runs

    times, errors = guarded_runs({"ok": lambda: None, "bad": lambda: 1 / 0, "also": lambda: None},
                                 device="cpu", reps=3)
    assert set(times) == {"ok", "also"} and all(len(t) == 3 for t in times.values())
    assert errors == {"bad": "ZeroDivisionError: division by zero"}

    def broken(*args):
        def call():
            raise RuntimeError("planted")
        return call

    monkeypatch.setattr(gpu_attention, "_flex_dense", broken)
    report = Report(tmp_path / "gpu_attention.md")
    with torch.inference_mode():
        assert gpu_attention.run(256, "cpu", 1, report) is False
    (row,) = report.path.read_text().splitlines()
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[0] == "256" and cells[3] == "error" and cells[-1] == "FAIL"
    for cell in cells[2:3] + cells[4:7]:  # sdpa, indexer, sparse, stem: measured
        float(cell)


def test_a_length_that_raises_loses_only_its_row(tmp_path, monkeypatch):
    """Each length runs in its own try; the rows before it are already in
    the file when the next one starts."""
    import gpu_attention
    from gpu_report import Report

    report = Report(tmp_path / "gpu_attention.md")

    def run(seq, device, reps, report):
        if seq == 2:
            raise MemoryError("planted")
        assert "| 1 | row |" in report.path.read_text()  # appended as produced
        report.add(f"| {seq} | row |")
        return True

    monkeypatch.setattr(gpu_attention, "run", run)
    monkeypatch.setattr(gpu_attention, "HEADER", "| tokens | x |")
    report.add("| 1 | row |")
    assert gpu_attention.lengths(report, [2, 3], "cpu", 1) is False
    lines = report.path.read_text().splitlines()
    assert lines[-2] == "| 2 | error: MemoryError: planted |" and lines[-1] == "| 3 | row |"


def test_gpu_check_rows_lose_only_the_timing_that_raised(monkeypatch):
    """gpu_check.py: a kernel timing that raises leaves its cell ``error``
    (and fails the shape); the others are measured. A GPU whose peaks are
    unknown gets no roofline ratio; the peaks follow the device's name."""
    import gpu_check
    from gpu_report import H100_SXM, H200, peaks_for

    monkeypatch.setattr(gpu_check, "run_op", gpu_check.run_cpu_path)  # no Triton here
    monkeypatch.setattr(gpu_check, "kernel_times", lambda *a: 1 / 0)
    row, ok = gpu_check.bench_row(gpu_check.DRY_BENCHES[0], "cpu", 1, None)
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert not ok and cells[3] == "error" and cells[6] == "unknown" and cells[7] == "-"
    for cell in cells[1:3] + cells[4:5]:
        float(cell)
    assert cells[9].startswith("PASS")
    row, _ = gpu_check.bench_row(gpu_check.DRY_BENCHES[0], "cpu", 1, H200)
    cells = [c.strip() for c in row.strip("|").split("|")]
    float(cells[6]), float(cells[7].rstrip("x"))  # a roofline, and the op against it
    assert peaks_for("NVIDIA H200") is H200 and peaks_for("NVIDIA H100 80GB HBM3") is H100_SXM
    for name in ("NVIDIA H100 PCIe", "NVIDIA H200 NVL", "NVIDIA A100-SXM4-80GB", "cpu"):
        assert peaks_for(name) is None, name


def test_the_commit_measured_comes_from_the_host(monkeypatch):
    from gpu_report import run_sha

    monkeypatch.setenv("STEM_GIT_SHA", "feedbeef+dirty")
    assert run_sha() == "feedbeef+dirty"


# --------------------------------------------------------------------------- #
# The benchmarks' folders: one per area, each on the import path
# --------------------------------------------------------------------------- #


def test_every_benchmark_folder_is_an_area_on_the_import_path():
    """The drivers import each other by name: pytest's ``pythonpath``
    (pyproject.toml) and benchmarks/areas.py (a driver run alone) list
    benchmarks/ and every folder of drivers, results/ apart."""
    import areas

    folders = {p.name for p in (ROOT / "benchmarks").iterdir()
               if p.is_dir() and p.name not in ("results", "__pycache__")}
    assert folders == set(areas.AREAS)
    text = (ROOT / "pyproject.toml").read_text()
    listed = re.findall(r'"([^"]+)"', re.search(r"^pythonpath = \[(.*?)\]", text,
                                                re.M | re.S).group(1))
    assert listed == ["benchmarks", *(f"benchmarks/{a}" for a in areas.AREAS)]
    assert all(str(ROOT / path) in sys.path for path in listed)


def test_a_driver_runs_alone_from_the_repository_root():
    """``python benchmarks/<area>/<name>.py``, with nothing of benchmarks/ on
    PYTHONPATH, finds the other areas' drivers (peer_bench imports
    quality/trials.py)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "benchmarks/peers/peer_bench.py", "--help"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "passkey" in proc.stdout, proc.stderr


@pytest.mark.parametrize("before, record, after", [
    ("a", "## b\n", "a\n\n## b\n"),
    ("a", "\n## b\n", "a\n\n## b\n"),
    ("a\n", "## b\n", "a\n\n## b\n"),
    ("a\n", "\n## b\n", "a\n\n## b\n"),
    ("a\n\n", "## b\n", "a\n\n## b\n"),
    ("a\n\n", "\n## b\n", "a\n\n\n## b\n"),  # nothing taken away
    ("", "## b\n", "## b\n"),
])
def test_appended_records_start_after_a_blank_line(before, record, after, tmp_path):
    """A record appended to a markdown file starts after a blank line (its
    heading is one) whatever the file ended with and however the record
    starts; a new file gets the record as it is."""
    from common import write_atomic

    path = tmp_path / "f.md"
    path.write_text(before)
    write_atomic(path, record, append=True)
    assert path.read_text() == after
    write_atomic(tmp_path / "new.md", record, append=True)
    assert (tmp_path / "new.md").read_text() == record
