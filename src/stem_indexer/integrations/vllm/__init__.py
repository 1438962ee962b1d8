"""Stem sparse prefill inside vLLM: an attention-backend plugin.

    pip install 'stem-indexer[vllm]'
    python -m vllm.entrypoints.openai.api_server --model DIR --attention-backend CUSTOM \\
        --additional-config '{"stem": {"preset": "default"}}'

    from vllm import LLM
    llm = LLM(model=DIR, attention_backend="CUSTOM", additional_config={"stem": {}})
    ...
    stem_indexer.integrations.vllm.stats(llm)

vLLM runs the functions of the ``vllm.general_plugins`` entry point in every
process it starts; this package's is ``register()``. It registers the Stem
backend as ``AttentionBackendEnum.CUSTOM`` and lets the CPU platform honour
``--attention-backend CUSTOM`` (which it otherwise ignores). Without that
option vLLM runs exactly as without the plugin. The settings, under
``additional_config["stem"]``, are ``settings.StemSettings``'s; they are
checked when the engine's configuration is built.

What runs where (``backend.py``): decode rows, short prompts and rows whose
budget keeps nearly every block run vLLM's own CPU kernel; long prefill rows
(a fresh prompt, any chunk of a chunked prompt, a prefix-cache hit) run Stem's
indexer on the row's queries and the keys in the paged cache, then vLLM's
kernel on the kept pages only. ``stats(llm)`` says what ran; each request's
prefill ends with one log line giving its density.

This release serves the CPU platform; on other platforms the backend refuses
to start, naming the platform.
"""

from __future__ import annotations

import logging

from .settings import StemSettings
from .stats import merge

__all__ = ["register", "stats", "reset_stats", "StemSettings", "BACKEND_PATH"]

BACKEND_PATH = "stem_indexer.integrations.vllm.backend.StemAttentionBackend"
_LOG = logging.getLogger("vllm.stem_indexer")


def register() -> None:
    """The ``vllm.general_plugins`` entry point: register the backend.

    Idempotent (vLLM calls it in every process, possibly more than once); it
    leaves a ``CUSTOM`` backend registered by another package in place and
    logs a warning instead.
    """
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    custom = AttentionBackendEnum.CUSTOM
    if custom.is_overridden() and custom.get_path() != BACKEND_PATH:
        _LOG.warning("Stem: the CUSTOM attention backend is already registered by another "
                     "package (%s); Stem's backend is not registered", custom.get_path())
        return
    if not custom.is_overridden():
        register_backend(custom, BACKEND_PATH)
    _patch_platforms()
    _add_worker_methods()


def _ours(selected) -> bool:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return (selected == AttentionBackendEnum.CUSTOM
            and AttentionBackendEnum.CUSTOM.get_path() == BACKEND_PATH)


def _patch_platforms() -> None:
    """CPU: select the backend for CUSTOM, and check Stem's settings when the
    engine's configuration is built. Other platforms: refuse it clearly."""
    from vllm.platforms.cpu import CpuPlatform

    select = CpuPlatform.get_attn_backend_cls.__func__
    if getattr(select, "_stem", False):
        return

    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
        if _ours(selected_backend) and not (attn_selector_config.use_mla
                                            or attn_selector_config.use_sparse):
            _LOG.info("Using Stem sparse-prefill attention (CUSTOM) on CPU")
            return BACKEND_PATH
        return select(cls, selected_backend, attn_selector_config, num_heads)

    check = CpuPlatform.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config) -> None:
        check(cls, vllm_config)
        if _ours(vllm_config.attention_config.backend):
            settings = StemSettings.from_config(vllm_config.additional_config)
            settings.check_kv_block_size(vllm_config.cache_config.block_size)
            _LOG.info("Stem sparse prefill: %s", settings.describe())

    get_attn_backend_cls._stem = True
    CpuPlatform.get_attn_backend_cls = classmethod(get_attn_backend_cls)
    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)


# Worker methods, by name: a name is what every executor (in-process or
# multiprocess) can send to its workers without pickling code.
_STATS_METHOD = "stem_indexer_stats"
_RESET_METHOD = "stem_indexer_reset_stats"


def _worker_snapshot(worker) -> dict:
    from .stats import STATS

    return STATS.snapshot()


def _worker_reset(worker) -> None:
    from .stats import STATS

    STATS.reset()


def _add_worker_methods() -> None:
    from vllm.v1.worker.worker_base import WorkerBase

    for name, fn in ((_STATS_METHOD, _worker_snapshot), (_RESET_METHOD, _worker_reset)):
        if not hasattr(WorkerBase, name):
            setattr(WorkerBase, name, fn)


def stats(llm) -> dict:
    """What the Stem backend ran, summed over ``llm``'s workers.

    Returns ``{"rows": {path: count}, "layers": {name: {"kept", "visible",
    "density"}}, "density": float | None}``: ``rows`` counts (layer, row)
    pairs by ``"sparse:fresh"``, ``"sparse:continuation"``, ``"sparse:prefix
    hit"`` or ``"dense:<reason>"``; ``layers`` gives, per attention layer, the
    (query block, key block) pairs the Stem rows kept and could see, all heads;
    ``density`` is kept over visible for all of them (None before any Stem row).
    """
    return merge(llm.collective_rpc(_STATS_METHOD))


def reset_stats(llm) -> None:
    """Zero the counters in every worker of ``llm``."""
    llm.collective_rpc(_RESET_METHOD)

