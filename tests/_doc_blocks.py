"""Running the README's and the guides' examples, and checking what they claim.

``python`` blocks run as they stand, in order, in one fresh interpreter, as
a reader pasting them into one Python session would: each in a namespace of
its own (a block must import what it uses), with whatever state the earlier
blocks left in the libraries. A ``print(...)  # claim``
line's claim (shapes, words, rounded numbers) is checked against what that
block printed. ``py`` blocks (a model, vLLM) are not run here: the tests
that need a model run them (``--run-model``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 180

# Runs in the child: {"blocks": [...], ...} as JSON on stdin, one JSON line
# per block out; code appended to it (``then``) reads the rest of ``payload``.
DRIVER = """
import json, sys, traceback
import contextlib, io
payload = json.load(sys.stdin)
for n, code in enumerate(payload["blocks"]):
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            exec(compile(code, f"<block {n + 1}>", "exec"), {"__name__": "__main__"})
        result = None
    except BaseException:
        result = traceback.format_exc()
    sys.stdout.write(printed.getvalue())
    print("\\nDOC-BLOCK " + json.dumps([n, result, printed.getvalue()]), flush=True)
"""
_EXIT = """
import gc
gc.freeze()  # exit without a last collection over the blocks' objects
"""


def fenced(text: str, language: str) -> list[str]:
    """The ``language`` code blocks of a markdown text."""
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.S)


def section(text: str, heading: str) -> str:
    """The text under ``heading`` (a whole heading line), up to the next
    heading of the same or a higher level."""
    level = heading.split(" ", 1)[0]
    body = text.split(f"\n{heading}\n", 1)[1]
    return re.split(rf"\n#{{1,{len(level)}}} ", body, maxsplit=1)[0]


def run_blocks(blocks: list[str], cwd: Path, then: str = "", **payload) -> dict:
    """Block number -> None (ran) or its traceback; "printed" -> block number
    -> what it printed; "log" -> the end of the child's output; "output" ->
    all of it. ``then``: code the child runs after the blocks, with the
    keyword arguments in ``payload``."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT / "src"), str(ROOT / "benchmarks"), os.environ.get("PYTHONPATH", "")]))
    try:
        proc = subprocess.run([sys.executable, "-c", DRIVER + then + _EXIT],
                              input=json.dumps({"blocks": blocks, **payload}),
                              env=env, cwd=cwd, text=True, capture_output=True,
                              timeout=TIMEOUT_S)
        log = proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as err:
        log = f"{err.stdout or ''}{err.stderr or ''}\n(killed after {TIMEOUT_S} s)"
    found, printed = {}, {}
    for line in log.splitlines():
        if line.startswith("DOC-BLOCK "):
            n, result, out = json.loads(line.split(" ", 1)[1])
            found[n], printed[n] = result, out
    return {**found, "printed": printed, "log": log[-3000:], "output": log}


_CLAIM = re.compile(r"^print\(.*\)\s+#\s*(.+)$", re.M)


def claims(code: str) -> list[str]:
    """The comma-separated items of the block's ``print(...)  # ...`` claims
    (commas inside brackets belong to their item)."""
    items = []
    for claim in _CLAIM.findall(code):
        depth, item = 0, ""
        for ch in claim:
            depth += (ch == "[") - (ch == "]")
            if ch == "," and depth == 0:
                items.append(item.strip())
                item = ""
            else:
                item += ch
        items.append(item.strip())
    return [i for i in items if i]


def claim_holds(item: str, printed: str) -> bool:
    """``[a, b]``: a torch.Size printed; a number (``52%``, ``49.9``): a printed
    number that rounds to it at the claim's precision; words: printed words."""
    if item.startswith("["):
        return f"torch.Size({item})" in printed
    number = re.search(r"-?\d+(?:\.(\d+))?", item)
    if number:
        decimals = len(number.group(1) or "")
        want = float(number.group(0))
        scale = 100 if item[number.end():number.end() + 1] == "%" else 1
        values = [float(x) for x in re.findall(r"-?\d+(?:\.\d+)?", printed)]
        percents = [float(x) for x in re.findall(r"(-?\d+(?:\.\d+)?)%", printed)]
        candidates = percents if scale == 100 else values
        return any(round(v, decimals) == want for v in candidates)
    return all(re.search(rf"(?<![\w-]){re.escape(word)}(?![\w-])", printed)
               for word in item.split())


def commands(block: str) -> list[str]:
    """A shell block's commands: lines without comments, continuation lines
    joined, split at ``&&``, a trailing ``&`` dropped."""
    out = []
    for line in block.replace("\\\n", " ").splitlines():
        line = line.split(" #", 1)[0].strip()
        if line.startswith("#"):
            continue
        for part in line.split("&&"):
            part = part.strip().removesuffix("&").strip()
            if part:
                out.append(" ".join(part.split()))
    return out


def ci_lines() -> list[str]:
    """The commands of ``.ci/run``, continuation lines joined, spaces folded."""
    text = (ROOT / ".ci" / "run").read_text().replace("\\\n", " ")
    return [" ".join(line.split()) for line in text.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]
