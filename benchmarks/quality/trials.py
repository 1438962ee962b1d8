"""Trials and their results files, shared by the quality benchmarks (no torch:
the peer benchmark's workers import it in environments of their own).

* ``wilson(k, n)``: the Wilson score interval (95%) of ``k`` successes in
  ``n`` trials; ``wilson_cell(k, n)``: ``k/n [lo%, hi%]``, ``-`` for none;
* ``success_table(entries, by, configs)``: successes / trials with that
  interval, one column per configuration, one row per value of the fields
  ``by`` names;
* ``read(path)`` and ``append(path, row)``: a results file of one JSON line
  per trial, which a killed run leaves resumable (a torn last line is
  skipped when read; the next line appended starts anew).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of ``k`` successes in ``n`` trials."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def wilson_cell(k: int, n: int) -> str:
    if n == 0:
        return "-"
    lo, hi = wilson(k, n)
    return f"{k}/{n} [{lo:.0%}, {hi:.0%}]"


def success_table(entries: list[dict], by: dict[str, str], configs,
                  rows: list[tuple] | None = None) -> list[str]:
    """A markdown table of the entries' ``found`` as ``wilson_cell``s: one
    column per configuration (``config``), one row per value of the fields of
    ``by`` (field -> heading), those of ``rows`` or else every one the
    entries hold, in order."""
    fields, configs = list(by), list(configs)

    def key(entry: dict) -> tuple:
        return tuple(entry[f] for f in fields)

    rows = sorted({key(e) for e in entries}) if rows is None else rows
    lines = ["| " + " | ".join([*by.values(), *configs]) + " |",
             "|" + "---|" * (len(fields) + len(configs))]
    for row in rows:
        cells = []
        for name in configs:
            got = [e["found"] for e in entries if e["config"] == name and key(e) == row]
            cells.append(wilson_cell(sum(got), len(got)))
        lines.append("| " + " | ".join([*map(str, row), *cells]) + " |")
    return lines


def read(path: Path) -> list[dict]:
    """Every complete JSON line of ``path`` (a torn last line is skipped)."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def append(path: Path, row: dict) -> None:
    """One JSON line, flushed to disk; after a torn line it starts a new one."""
    text = json.dumps(row, sort_keys=True) + "\n"
    with path.open("ab+") as f:
        f.seek(0, os.SEEK_END)
        if f.tell():
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                text = "\n" + text
        f.write(text.encode())
        f.flush()
        os.fsync(f.fileno())
