"""Stem sparse prefill inside vLLM: an attention-backend plugin.

    pip install 'stem-indexer[vllm]'
    python -m vllm.entrypoints.openai.api_server --model DIR --attention-backend CUSTOM \\
        --additional-config '{"stem": {"preset": "serving"}}'

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
indexer on the row's queries and the indexer cache's entries of its pages
(``stem_indexer/pipeline/index_cache.py``: written beside the KV cache as vLLM writes it), then
vLLM's kernel on the kept pages only, in every CPU cache layout that has
one (``amx``, ``vec``, ``vec16``). ``stats(llm)`` says what ran; each
request's prefill ends with one log line giving its rows and density.

This release serves the CPU platform of vLLM ``TESTED_VLLM``: elsewhere, and
on another vLLM release, ``register()`` warns once and leaves vLLM as it is.
Every patch it makes to vLLM is listed in ``patches.py``, with the release
it was written against.
"""

from __future__ import annotations

import logging
import os

from .patches import RESET_METHOD, STATS_METHOD, TESTED_VLLM, UNTESTED_ENV
from .settings import StemSettings
from .stats import merge

__all__ = ["register", "stats", "reset_stats", "StemSettings", "BACKEND_PATH", "TESTED_VLLM"]

BACKEND_PATH = "stem_indexer.integrations.vllm.backend.StemAttentionBackend"
_LOG = logging.getLogger("vllm.stem_indexer")
_WARNED: set = set()


def _warn_once(key: str, message: str, *args, exc: BaseException | None = None) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        _LOG.warning(message, *args, exc_info=exc)


def register() -> None:
    """The ``vllm.general_plugins`` entry point: register the backend.

    Idempotent (vLLM calls it in every process, possibly more than once); it
    leaves a ``CUSTOM`` backend registered by another package in place and
    logs a warning instead. It never raises: on a platform other than CPU it
    warns once and changes nothing; on a vLLM release other than
    ``TESTED_VLLM`` it warns once and changes nothing, unless the environment
    sets ``STEM_VLLM_ALLOW_UNTESTED=1``; if registering fails, it warns once
    with the traceback and vLLM runs as without the plugin. The patches it
    makes (``patches.py``) change nothing unless ``CUSTOM`` is asked for, and
    fall back to vLLM's own methods where their part fails.
    """
    try:
        import vllm
        from vllm.platforms import current_platform
        from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

        if not current_platform.is_cpu():
            _warn_once("platform", "Stem's vLLM backend serves the CPU platform; on %s it is "
                       "not registered and vLLM runs without it",
                       type(current_platform).__name__)
            return
        version = getattr(vllm, "__version__", "unknown")
        if version != TESTED_VLLM:
            if os.environ.get(UNTESTED_ENV) != "1":
                _warn_once("version", "Stem's vLLM backend was tested with vLLM %s, not %s; "
                           "it is not registered and vLLM runs without it (set %s=1 to "
                           "register it anyway)", TESTED_VLLM, version, UNTESTED_ENV)
                return
            _warn_once("version", "Stem's vLLM backend was tested with vLLM %s, not %s; it "
                       "registers because %s=1, and runs only where --attention-backend "
                       "CUSTOM is asked for", TESTED_VLLM, version, UNTESTED_ENV)
        custom = AttentionBackendEnum.CUSTOM
        if custom.is_overridden() and custom.get_path() != BACKEND_PATH:
            _LOG.warning("Stem: the CUSTOM attention backend is already registered by another "
                         "package (%s); Stem's backend is not registered", custom.get_path())
            return
        from .patches import add_worker_methods, patch_platform, reserve_index_cache

        patch_platform(_ours, BACKEND_PATH)
        reserve_index_cache(_ours)
        add_worker_methods()
        if not custom.is_overridden():
            register_backend(custom, BACKEND_PATH)
    except Exception as exc:  # a plugin must never stop vLLM
        _warn_once("register", "Stem's vLLM backend could not be registered (%s); vLLM runs "
                   "without it", exc, exc=exc)


def _ours(selected) -> bool:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return (selected == AttentionBackendEnum.CUSTOM
            and AttentionBackendEnum.CUSTOM.get_path() == BACKEND_PATH)


def stats(llm) -> dict:
    """What the Stem backend ran, summed over ``llm``'s workers.

    Returns ``{"rows": {path: count}, "layers": {name: {"kept", "visible",
    "density"}}, "density": float | None, "layouts": {layout: count},
    "kernels": {kernel: count}, "memory": {"index_cache_bytes", "kv_cache_bytes"}}``:
    ``rows`` counts (layer, row) pairs by ``"sparse:fresh"``,
    ``"sparse:continuation"``, ``"sparse:prefix hit"`` or
    ``"dense:<reason>"`` (``"dense:error:<type>"``: Stem failed there and
    vLLM's kernel ran); ``layers`` gives, per attention layer, the
    (query block, key block) pairs the Stem rows kept and could see, all heads;
    ``density`` is kept over visible for all of them (None before any Stem
    row); ``layouts`` counts the sparse rows by the KV-cache layout they ran
    on (``"amx"``, ``"vec"``, ``"vec16"``), ``kernels`` by the kernel that
    attended them (``"stem"``: Stem's block-sparse kernel on keys and values
    read from vLLM's cache; ``"vllm"``: vLLM's kernel on virtual rows; see the
    ``sparse_kernel`` setting); ``memory`` the bytes of the Stem
    layers' indexer caches, allocated when the KV cache is bound and taken
    out of vLLM's KV-cache budget, and of their KV caches.
    """
    return merge(llm.collective_rpc(STATS_METHOD))


def reset_stats(llm) -> None:
    """Zero the counters in every worker of ``llm``."""
    llm.collective_rpc(RESET_METHOD)
