"""No crash, no silent wrong answer, no foreign code loaded, whatever the input or machine state.

* The native kernel cache, damaged, replaced, foreign, shared with other
  users or built by several processes at once: the op's output must still
  equal the reference. Concurrent builds run in child processes; the other
  cases run here on a fresh ``native`` state. (A truncated library that got
  loaded would end this process with SIGBUS: under xdist, the default, that
  is a failed test and a new worker; under ``-n 0``, the end of the run.)
* Environment switches, lengths past int32, NaN and inf in values and in
  padding, bad arguments through the op, ``torch.compile`` and ``torch.export``.
* Many Python threads at once: the same results, scratch memory bounded.
* The command lines' bad arguments: one usage line, exit code 2, no traceback.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

import stem_indexer
from stem_indexer import StemIndexerInputError
from stem_indexer.surfaces import cli
from stem_indexer.operator.ops import cpu, native

from _helpers import native_on_cache

ROOT = Path(__file__).resolve().parent.parent
needs_cc = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler here")

# A run's job (here or in a child): the op on a case where the budget ranks,
# against the reference; it prints native's status last.
CHILD = textwrap.dedent("""
    import torch, stem_indexer
    from stem_indexer.operator.ops import native
    gen = torch.Generator().manual_seed(3)
    q = torch.randint(-3, 4, (2, 4, 6, 8), generator=gen).bfloat16()
    k = torch.randint(-3, 4, (2, 2, 40, 8), generator=gen).bfloat16()
    vb = torch.zeros(2, 2, 40)
    lens = dict(q_seq_lens=torch.tensor([96, 50], dtype=torch.int32),
                kv_seq_lens=torch.tensor([640, 600], dtype=torch.int32))
    params = dict(stem_block_size=16, stem_stride=16, k_block_num_rate_medium=0.0,
                  k_block_num_bias_medium=3, initial_blocks=1, window_size=1)
    out = stem_indexer.stem_indexer(q, k, vb, **lens, **params)
    ref = stem_indexer.stem_indexer_reference(q, k, vb, **lens, **params)
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1]), "wrong output"
    assert (out[1] < out[1].amax()).any(), "nothing was ranked"
    print(native.status(native.SELECT_ROWS))
""")


def run_here(cache: Path, capsys) -> str:
    """CHILD's job in this process, on ``cache`` with a fresh native state:
    the last line it prints (native's status)."""
    with native_on_cache(cache):
        exec(CHILD, {})
    return capsys.readouterr().out.strip().splitlines()[-1]


def built_library(cache: Path) -> Path:
    (so,) = cache.glob("select_rows-*.so")
    return so


def compile_c(source: str, out: Path) -> None:
    src = out.with_suffix(".c")
    src.write_text(source)
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(out), str(src)], check=True)


# --------------------------------------------------------------------------- #
# The kernel cache
# --------------------------------------------------------------------------- #


@pytest.fixture(scope="module")
def built_cache(tmp_path_factory) -> Path:
    """A cache holding a good build."""
    if shutil.which("cc") is None:
        pytest.skip("no C compiler here")
    cache = tmp_path_factory.mktemp("cache")
    with native_on_cache(cache):
        assert native.kernel() is not None, native.status(native.SELECT_ROWS)
    return cache


@pytest.fixture
def cache(built_cache, tmp_path) -> Path:
    """A private copy of the good cache, for one test to damage."""
    copy = tmp_path / "cache"
    shutil.copytree(built_cache, copy)
    copy.chmod(0o700)
    return copy


def _assert_rebuilt(cache: Path, status: str) -> None:
    assert status.startswith("native: ") and "built into" in status, status
    so = built_library(cache)
    assert so.with_suffix(".sha256").read_text().strip() == \
        hashlib.sha256(so.read_bytes()).hexdigest()


@needs_cc
def test_truncated_library_is_rebuilt_not_loaded(cache, capsys):
    os.truncate(built_library(cache), 10000)  # used to end the process with SIGBUS
    _assert_rebuilt(cache, run_here(cache, capsys))


@needs_cc
@pytest.mark.slow
def test_library_without_the_kernel_is_rebuilt(cache, capsys):
    compile_c("int something_else(void) { return 0; }\n", built_library(cache))
    _assert_rebuilt(cache, run_here(cache, capsys))


@needs_cc
def test_stub_library_that_does_nothing_is_never_run(cache, capsys):
    """A planted library with the right symbol but no work: its digest differs
    from the recorded one, so it is replaced, and the output is right."""
    compile_c("#include <stdint.h>\nint stem_select_rows() { return 0; }\n",
              built_library(cache))
    _assert_rebuilt(cache, run_here(cache, capsys))


@needs_cc
@pytest.mark.parametrize("mode", [0o777, pytest.param(0o770, marks=pytest.mark.slow)],
                         ids=["world-writable", "group-writable"])
def test_cache_others_can_write_is_refused(cache, mode, capsys):
    """Code others could plant is not loaded: one warning, the torch selection,
    the right output, and the planted library untouched."""
    so = built_library(cache)
    compile_c("int stem_select_rows() { return 0; }\n", so)
    planted = so.read_bytes()
    so.with_suffix(".sha256").write_text(hashlib.sha256(planted).hexdigest())
    cache.chmod(mode)
    with pytest.warns(RuntimeWarning) as warned:
        status = run_here(cache, capsys)
    assert status.startswith("torch fallback: cache directory refused")
    assert len(warned) == 1 and str(cache) in str(warned[0].message)
    assert "writable by group or others" in str(warned[0].message)
    assert so.read_bytes() == planted


@needs_cc
@pytest.mark.slow  # two builds and a child that imports torch: three seconds
def test_concurrent_builds_agree(tmp_path, capsys):
    """A child process and this one build into one empty cache at once (the
    child imports first, then both start on a signal; the build publishes by
    atomic rename, no lock to hand on): both right, one library and its digest
    left, no temporary file."""
    cache = tmp_path / "cache"
    env = {**os.environ, "STEM_INDEXER_CACHE_DIR": str(cache),
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    racer = "import sys, torch, stem_indexer\nprint('ready', flush=True)\nsys.stdin.readline()\n"
    exit_fast = "import gc\ngc.freeze()\n"  # no last collection over torch's objects
    child = subprocess.Popen([sys.executable, "-c", racer + CHILD + exit_fast], env=env,
                             text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)
    here = None
    try:
        if child.stdout.readline().strip() == "ready":
            child.stdin.write("go\n")
            child.stdin.flush()
            here = run_here(cache, capsys)
    finally:
        out, err = child.communicate(timeout=300)
    assert child.returncode == 0, f"exit {child.returncode}\n{out}\n{err}"
    assert here is not None and here.startswith("native: "), (here, out, err)  # both raced
    assert out.strip().splitlines()[-1].startswith("native: "), out
    so = built_library(cache)
    assert sorted(f.name for f in cache.iterdir()) == sorted([so.name, so.stem + ".sha256"])


@needs_cc
@pytest.mark.slow
def test_cache_directory_is_private_when_created(tmp_path, capsys):
    cache = tmp_path / "new" / "cache"
    assert run_here(cache, capsys).startswith("native: ")
    assert stat.S_IMODE(cache.stat().st_mode) & 0o077 == 0


# --------------------------------------------------------------------------- #
# Environment switches
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("value", ["0", "false", "FALSE", "off", "no", " No "])
def test_native_switch_accepts_the_usual_spellings(fresh_native, monkeypatch, value):
    monkeypatch.setenv("STEM_INDEXER_NATIVE", value)
    assert native.kernel() is None
    assert native.status(native.SELECT_ROWS).startswith(
        "torch fallback: disabled by STEM_INDEXER_NATIVE")


@needs_cc
def test_native_switch_warns_on_anything_else(cache, monkeypatch):
    monkeypatch.setenv("STEM_INDEXER_NATIVE", "maybe")
    with native_on_cache(cache), \
            pytest.warns(RuntimeWarning, match="STEM_INDEXER_NATIVE='maybe' is not a switch"):
        assert native.kernel() is not None  # the default: on (the good build, loaded)


# --------------------------------------------------------------------------- #
# Inputs
# --------------------------------------------------------------------------- #


def _small(seed=0, nan=None, **over):
    gen = torch.Generator().manual_seed(seed)
    args = dict(qflat=torch.randn(2, 4, 3, 8, generator=gen).bfloat16(),
                kflat=torch.randn(2, 2, 9, 8, generator=gen).bfloat16(),
                vbias=torch.randn(2, 2, 9, generator=gen),
                q_seq_lens=torch.tensor([40, 17], dtype=torch.int32),
                kv_seq_lens=torch.tensor([140, 100], dtype=torch.int32))
    args.update(over)
    return args


PARAMS = dict(stem_block_size=16, stem_stride=4, k_block_num_rate_medium=0.0,
              k_block_num_bias_medium=2, initial_blocks=1, window_size=1)


def _equal_reference(args, **params):
    out = stem_indexer.stem_indexer(**args, **params)
    ref = stem_indexer.stem_indexer_reference(**args, **params)
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
    return out


@pytest.mark.parametrize("block, stride", [(2**31, 1), (2**31, 2**31), (2**62, 2**31),
                                           (2**63 - 1, 1)])
def test_block_sizes_past_int32_are_valid(block, stride):
    """Every int32 length fits one such block: one query block sees one key block."""
    out = _equal_reference(_small(), **{**PARAMS, "stem_block_size": block,
                                        "stem_stride": stride})
    assert out[1][:, :, 0].tolist() == [[1] * 4] * 2 and int(out[1][:, :, 1:].sum()) == 0


def test_kmax_times_block_past_int32_is_valid():
    """Kmax * Bs = 2**31: the range check used to wrap and refuse a valid length."""
    args = _small(kflat=torch.zeros(1, 1, 2**24, 1).bfloat16(), vbias=torch.zeros(1, 1, 2**24),
                  qflat=torch.zeros(1, 1, 1, 1).bfloat16(),
                  q_seq_lens=torch.tensor([1], dtype=torch.int32),
                  kv_seq_lens=torch.tensor([300], dtype=torch.int32))
    out = stem_indexer.stem_indexer(**args, stem_block_size=128, stem_stride=1)
    assert out[1].tolist() == [[[3]]]


@pytest.mark.parametrize("value", [None, "no", 1, 0.0])
def test_causal_must_be_a_bool(value):
    with pytest.raises(StemIndexerInputError, match="causal must be True or False"):
        stem_indexer.stem_indexer(**_small(), causal=value)


def test_nan_and_inf_in_values_rank_as_the_contract_says():
    args = _small(1)
    args["qflat"][0, 1, 0, :3] = float("nan")
    args["kflat"][1, 0, 2] = float("inf")
    args["kflat"][1, 1, 3] = -float("inf")
    args["vbias"][0, 0, 4] = float("nan")
    args["vbias"][1, 1, 5] = float("inf")
    _equal_reference(args, **PARAMS)


def test_nan_in_padding_changes_nothing():
    """Blocks past each batch's lengths (rows past Qb, keys past Kb) hold NaN."""
    clean = _small(2)
    dirty = {k: v.clone() for k, v in clean.items()}
    dirty["qflat"][1, :, 2:] = float("nan")   # batch 1 has 2 query blocks of 3
    dirty["kflat"][1, :, 7:] = float("nan")   # and 7 key blocks of 9
    dirty["vbias"][1, :, 7:] = float("nan")
    a = stem_indexer.stem_indexer(**clean, **PARAMS)
    b = stem_indexer.stem_indexer(**dirty, **PARAMS)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def _op(qflat, kflat, vbias, q_seq_lens, kv_seq_lens, metadata):
    return torch.ops.custom.npu_stem_indexer(qflat, kflat, vbias, q_seq_lens, kv_seq_lens,
                                             metadata=metadata, alpha=2.0, **PARAMS)


def _metadata(args):
    return stem_indexer.stem_indexer_metadata(args["q_seq_lens"], args["kv_seq_lens"], 4, 2,
                                              stem_block_size=16, dim_qkflat=8, window_size=1)


def test_bad_attributes_raise_under_compile_and_export():
    args = _small()
    inputs = (*args.values(), _metadata(args))
    # torch.compile reports the fake kernel's error in its own exception type,
    # with the message: it still names the argument and the rule.
    with pytest.raises(Exception, match="stem_indexer: alpha must be a finite number"):
        torch.compile(_op, fullgraph=True, dynamic=True)(*inputs)

    class Model(torch.nn.Module):
        def forward(self, *xs):
            return _op(*xs)

    with pytest.raises(StemIndexerInputError, match="alpha"):
        torch.export.export(Model(), inputs)


def test_many_threads_get_the_same_results_and_bounded_scratch():
    shapes = [_small(seed) for seed in range(4)]
    wanted = [stem_indexer.stem_indexer(**a, **PARAMS) for a in shapes]
    results, errors = {}, []

    def work(n):
        try:
            for rep in range(3):
                results[n, rep] = stem_indexer.stem_indexer(**shapes[n % 4], **PARAMS)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for (n, _), out in results.items():
        assert torch.equal(out[0], wanted[n % 4][0]) and torch.equal(out[1], wanted[n % 4][1])
    assert cpu.kept_bytes() <= cpu.WORKSPACE_KEEP_BYTES



def test_threads_at_once_on_a_case_that_opens_thread_teams(monkeypatch):
    """As above, on a case big enough that each call fills its output with a
    thread team and ranks rows with torch's thread count (the sizes below
    which one thread does the work are passed, and the selection kernel is
    seen called with 2 threads): every thread's result is the reference's."""
    if native.kernel() is None:
        pytest.skip(native.status())
    gen = torch.Generator().manual_seed(7)
    nq, nk, blocks = 8, 2, 384
    args = dict(qflat=torch.randn(1, nq, blocks, 16, generator=gen).bfloat16(),
                kflat=torch.randn(1, nk, blocks, 16, generator=gen).bfloat16(),
                vbias=torch.randn(1, nk, blocks, generator=gen),
                q_seq_lens=torch.tensor([blocks * 16], dtype=torch.int32),
                kv_seq_lens=torch.tensor([blocks * 16], dtype=torch.int32))
    params = dict(PARAMS, stem_stride=16, k_block_num_bias_medium=24)
    assert nq * blocks * blocks > cpu.SMALL_OUTPUT
    want = stem_indexer.stem_indexer_reference(**args, **params)
    lib, teams = native.kernel(), []
    select = lib.stem_select_rows

    def spy(*a):
        teams.append(a[-1])
        return select(*a)

    monkeypatch.setattr(lib, "stem_select_rows", spy)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(3) as pool:
            outs = list(pool.map(lambda _: stem_indexer.stem_indexer(**args, **params),
                                 range(6)))
    finally:
        torch.set_num_threads(before)
    assert 2 in teams
    for out in outs:
        assert torch.equal(out[0], want[0]) and torch.equal(out[1], want[1])

# --------------------------------------------------------------------------- #
# Command lines
# --------------------------------------------------------------------------- #

CLI_ERRORS = [
    (["demo", "--alpha", "0"], "--alpha: must be finite with 0 < alpha <= 1"),
    (["demo", "--alpha", "nan"], "--alpha: must be finite"),
    (["demo", "--alpha", "2"], "--alpha: must be finite"),
    (["verify", "--cases", "BOGUS"], "no case 'BOGUS'"),
    (["verify", "--cases", "SI_WB_001", "--out", "/nonexistent/dir/result.csv"],
     "does not exist"),
    (["verify", "--device", "tpu"], "invalid choice: 'tpu'"),
    (["plot", "--stride", "0"], "--stride: must be >= 1"),
    (["plot", "--block-size", "12", "--stride", "8"], "block_size must be a multiple of stride"),
]
if not torch.cuda.is_available():
    CLI_ERRORS.append((["verify", "--device", "cuda"], "no CUDA device is usable"))


def _usage_error(main, argv: list[str], wanted: str, capsys) -> None:
    """``main(argv)`` stops with exit code 2 and one usage line naming the problem."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "error:" in last and wanted in last, last


@pytest.mark.parametrize("argv, wanted", CLI_ERRORS, ids=[" ".join(a) for a, _ in CLI_ERRORS])
def test_cli_bad_arguments_are_usage_errors(argv, wanted, capsys, monkeypatch):
    ran = []
    monkeypatch.setattr("stem_indexer.testing.runner.run_case", lambda *a, **k: ran.append(1))
    _usage_error(cli.main, argv, wanted, capsys)
    assert not ran  # refused before any work


def test_cli_bad_mode_variable_is_a_usage_error(capsys, monkeypatch):
    monkeypatch.setenv("STEM_INDEXER_MODE", "fast")
    _usage_error(cli.main, ["verify", "--cases", "SI_WB_001"],
                 "STEM_INDEXER_MODE must be one of eager|graph", capsys)


@pytest.mark.parametrize("argv, wanted", [
    (["--block-size", "0"], "--block-size: must be >= 1"),
    (["--stride", "0"], "--stride: must be >= 1"),
    (["--record", "/nonexistent/dir/QUALITY.md"], "does not exist"),
])
def test_quality_benchmark_bad_arguments_are_usage_errors(argv, wanted, capsys):
    import quality
    _usage_error(quality.main, argv, wanted, capsys)


@pytest.mark.parametrize("argv, wanted", [
    (["--configs", "default"], "dense included"),
    (["--lengths", "2048,16384"], "--lengths: each from 1024 to 8192"),
    (["--long-lengths", "65536"], "--long-lengths: each from 1024 to 32768"),
    (["--long-lengths", "16K"], "comma-separated integers"),
    (["--long-trials", "-1"], "--long-trials and --long-reps must be >= 0"),
])
def test_model_quality_bad_arguments_are_usage_errors(argv, wanted, capsys):
    """Refused before the model is looked for or loaded."""
    import model_quality
    _usage_error(model_quality.main, argv, wanted, capsys)
