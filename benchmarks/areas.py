"""The benchmarks' areas, one folder of drivers each, and their import path.

Importing this module puts ``benchmarks/`` (``common.py``) and every area's
folder on ``sys.path``, ahead of the installed packages, so that a driver run
as ``python benchmarks/<area>/<name>.py`` imports the others by name, as the
tests do (pytest's ``pythonpath`` in pyproject.toml lists the same folders).
Each driver that imports another starts with::

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import areas  # noqa: F401  (every area's folder on sys.path)

Raw results go to ``benchmarks/results/`` (``RESULTS``); the tables (``*.md``)
stay in ``benchmarks/``.
"""

from __future__ import annotations

import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent
AREAS = ("operator", "attention", "engines", "gpu", "peers", "quality")
RESULTS = BENCHMARKS / "results"

sys.path[:0] = [p for p in [str(BENCHMARKS), *(str(BENCHMARKS / a) for a in AREAS)]
                if p not in sys.path]
