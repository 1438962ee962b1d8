"""Shared pytest configuration.

* ``--run-large``: tests marked ``large`` (the 1M-token prefill and the like)
  are skipped without it.
* ``device`` fixture: every test that takes it runs on "cpu" and "cuda"; the
  cuda variant is skipped when no GPU is usable. ``STEM_INDEXER_DEVICE=cpu``
  (or ``cuda``) restricts it to one device.
* ``selection`` fixture: how the CPU path selects, "native" (the C kernel of
  ``ops/native.py``) or "torch" (its fallback, plain torch operations);
  modules that use it run each CPU test both ways.

Nothing here touches CUDA at import or collection time, so the suite always
collects on a CPU-only machine.
"""

from __future__ import annotations

import os

import pytest
import torch

_DEVICES = ("cpu", "cuda")


def _devices() -> list[str]:
    wanted = os.environ.get("STEM_INDEXER_DEVICE", "").strip().lower()
    if not wanted:
        return list(_DEVICES)
    if wanted not in _DEVICES:
        raise pytest.UsageError(f"STEM_INDEXER_DEVICE must be cpu or cuda; got {wanted!r}")
    return [wanted]


def pytest_addoption(parser):
    parser.addoption("--run-large", action="store_true", default=False,
                     help="also run tests marked 'large' (1M-token prefill cases, minutes each)")


def pytest_configure(config):
    # Emitted by torch's own compile stack (not by this package) on first compile.
    config.addinivalue_line(
        "filterwarnings", "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--run-large"):
        return
    skip = pytest.mark.skip(reason="large case; run with --run-large")
    for item in items:
        if item.get_closest_marker("large") is not None:
            item.add_marker(skip)


@pytest.fixture(params=_devices())
def device(request) -> str:
    """"cpu" or "cuda"; the cuda variant skips cleanly without a usable GPU."""
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("CUDA is not available")
    return request.param


@pytest.fixture(params=["native", "torch"])
def selection(request, monkeypatch) -> str:
    """"native" or "torch": the CPU path's selection for this test."""
    from stem_indexer.ops import native
    callspec = getattr(request.node, "callspec", None)
    on_cuda = callspec is not None and callspec.params.get("device") == "cuda"
    if request.param == "torch":
        if on_cuda:
            pytest.skip("the torch selection is a variant of the CPU path")
        monkeypatch.setattr(native, "kernel", lambda: None)
    elif not on_cuda and native.kernel() is None:
        pytest.skip(native.status())  # tests/test_native.py fails where a compiler exists
    return request.param
