"""The package's environment variables, read in one place.

* ``STEM_INDEXER_NATIVE``: build and use the native CPU kernels (default on).
  Accepts 1/0, true/false, yes/no, on/off (any case); anything else warns,
  naming the variable, and keeps the default.
* ``STEM_INDEXER_CACHE_DIR``: where native kernels are built (default
  ``$XDG_CACHE_HOME/stem_indexer`` or ``~/.cache/stem_indexer``).
* ``CC``: the C compiler for them (default ``cc``).

The test harness's selection variables (``STEM_INDEXER_CASE_ID``,
``STEM_INDEXER_MODE``, ``STEM_INDEXER_DEVICE``) are read by
``stem_indexer.testing.runner``.
"""

from __future__ import annotations

import os
import shlex
import warnings
from pathlib import Path

NATIVE = "STEM_INDEXER_NATIVE"
CACHE_DIR = "STEM_INDEXER_CACHE_DIR"

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def flag(name: str, default: bool) -> bool:
    """A boolean switch; an unset or empty variable means ``default``."""
    raw = os.environ.get(name, "")
    value = raw.strip().lower()
    if not value:
        return default
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    warnings.warn(f"{name}={raw!r} is not a switch (use one of "
                  f"{'/'.join(_TRUE)} or {'/'.join(_FALSE)}); using the default "
                  f"({'on' if default else 'off'})", RuntimeWarning, stacklevel=2)
    return default


def cache_dir() -> Path:
    explicit = os.environ.get(CACHE_DIR, "").strip()
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME", "").strip() or Path.home() / ".cache"
    return Path(base) / "stem_indexer"


def compiler() -> list[str]:
    return shlex.split(os.environ.get("CC", "") or "cc")
