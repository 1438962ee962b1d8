"""Triton interpreter tests in one child process.

Triton decides once per process, when it jits the kernels, whether they are
interpreted (``TRITON_INTERPRET=1``) or compiled. A test marked
``@interpreted`` therefore runs in a child pytest with ``TRITON_INTERPRET=1``:
the first such test starts one child for all of those in ``FILES`` (a child
costs about two seconds before its first test: torch, Triton, collection),
and in this process each reports its own child result, failure text
included. Under xdist, ``FILES`` are one unit of work, given to one worker
(``tests/conftest.py``'s scheduler), so that one child serves them all. In a
process that has ``TRITON_INTERPRET=1`` set already, they simply run.

    python tests/_interpreter.py RESULTS.json TEST_ID...   # the child run
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

# The test files with interpreter tests (tests/test_suite_setup.py checks the list).
FILES = ("test_paged.py", "test_paged_attention.py", "test_triton.py",
         "test_index_write_triton.py")
_children: dict = {}  # test file, or FILES -> its child's results and log


def interpreted(test):
    """Mark ``test`` as an interpreter test (see the module docstring);
    skipped, saying so, where Triton is not installed."""
    try:
        from stem_indexer.operator.ops.triton import launch
    except ImportError as exc:
        return pytest.mark.skip(reason=f"Triton is not installed ({exc})")(test)

    if launch.INTERPRETED:
        return test

    @functools.wraps(test)
    def proxy(request, **_):
        _report_child_result(request.node)

    params = [p for p in inspect.signature(test).parameters.values() if p.name != "request"]
    proxy.__signature__ = inspect.Signature(
        [inspect.Parameter("request", inspect.Parameter.POSITIONAL_OR_KEYWORD), *params])
    proxy.interpreted = True
    return proxy


def _report_child_result(node) -> None:
    group = FILES if node.path.name in FILES else (node.path.name,)
    if group not in _children:
        _children[group] = _run_child(node.session, group)
    child = _children[group]
    result = child["results"].get(node.nodeid)
    if result is None:
        pytest.fail(f"the interpreter run gave no result for {node.nodeid}; its output:\n"
                    f"{child['log']}", pytrace=False)
    if result["outcome"] == "failed":
        pytest.fail(result["text"], pytrace=False)
    if result["outcome"] == "skipped":
        pytest.skip(result["text"])


def _run_child(session, files: tuple[str, ...]) -> dict:
    """Run every selected interpreter test of these test files in one child pytest."""
    ids = [item.nodeid for item in session.items if item.path.name in files
           and getattr(getattr(item, "function", None), "interpreted", False)]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "results.json"
        proc = subprocess.run([sys.executable, __file__, str(out), *ids],
                              env=dict(os.environ, TRITON_INTERPRET="1"),
                              cwd=session.config.rootpath, capture_output=True, text=True)
        results = json.loads(out.read_text()) if out.exists() else {}
    return {"results": results, "log": (proc.stdout + proc.stderr)[-6000:]}


class _Recorder:
    """pytest plugin of the child: each test's outcome and failure text."""

    def __init__(self):
        self.results: dict = {}

    def pytest_runtest_logreport(self, report):
        rank = {"passed": 0, "skipped": 1, "failed": 2}
        old = self.results.get(report.nodeid)
        if old is None or rank[report.outcome] > rank[old["outcome"]]:
            text = (report.longrepr[2] if report.skipped and isinstance(report.longrepr, tuple)
                    else report.longreprtext)
            self.results[report.nodeid] = {"outcome": report.outcome, "text": text}


def _patch_language_once_per_launch() -> None:
    """Triton's interpreter patches ``triton.language`` at each launch (and
    restores it after), and again at every call of a ``@triton.jit`` helper
    inside the kernel: about a millisecond per call, a quarter of these runs.
    The helper's patch repeats the launch's, so inside a launch it is
    skipped, wherever the helper sees no language module the kernel does not.
    (A Triton without these internals runs as it is.)"""
    try:
        from triton.runtime import interpreter as ti
        patch_lang, launch = ti._patch_lang, ti.GridExecutor.__call__
        languages = (ti.tl, ti.tl.core)
    except (ImportError, AttributeError):
        return
    patched: list = []  # per running launch: the language modules it patched, once it has
    modules: dict = {}  # id of a function's globals -> the language modules in them

    def seen(fn) -> set:
        key = id(fn.__globals__)
        if key not in modules:
            modules[key] = {id(v) for v in fn.__globals__.values()
                            if any(v is m for m in languages)}
        return modules[key]

    class _Unchanged:
        def restore(self):
            pass

    def patch_once(fn):
        if patched and patched[-1] is not None and seen(fn) <= patched[-1]:
            return _Unchanged()  # a helper inside a launch that patched its modules
        scope = patch_lang(fn)
        if patched:  # the launch's own patch, or a helper's of modules it had not
            patched[-1] = (patched[-1] or set()) | seen(fn)
        return scope

    def launch_once(self, *args, **kwargs):
        patched.append(None)
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched.pop()

    ti._patch_lang, ti.GridExecutor.__call__ = patch_once, launch_once


def _numpy_dtypes_looked_up_once() -> None:
    """The interpreter maps a Triton dtype to numpy's by building a table of
    twenty entries at every call, some 200,000 calls in these runs. The
    mapping depends only on the (element) dtype, so each answer is kept.
    (A Triton without this internal runs as it is.)"""
    try:
        from triton.runtime import interpreter as ti
        lookup, block = ti._get_np_dtype, ti.tl.block_type
    except (ImportError, AttributeError):
        return
    known: dict = {}

    def looked_up(tt_dtype):
        key = tt_dtype.element_ty if isinstance(tt_dtype, block) else tt_dtype
        try:
            return known[key]
        except KeyError:
            known[key] = value = lookup(key)
            return value
        except TypeError:  # an unhashable type: no shortcut
            return lookup(tt_dtype)

    ti._get_np_dtype = looked_up


if __name__ == "__main__":  # the child run: results file, then the test ids
    _patch_language_once_per_launch()
    _numpy_dtypes_looked_up_once()
    recorder = _Recorder()
    pytest.main(["-q", "-p", "no:cacheprovider", "-n", "0", "--run-slow", "--run-large",
                 *sys.argv[2:]],
                plugins=[recorder])
    Path(sys.argv[1]).write_text(json.dumps(recorder.results))
