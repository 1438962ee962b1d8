"""Citations of the contract point at docs/CONTRACT.md and at sections it has.

Code, tests and benchmark notes cite the contract by section number. A number
is only useful if it names a heading of docs/CONTRACT.md ("## N. Title"), and
the file it names must be in the repository.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONTRACT = ROOT / "docs" / "CONTRACT.md"
TEXT_SUFFIXES = {".py", ".md", ".c", ".h", ".sh", ".txt", ".toml", ".cfg", ".ini", ".csv"}
SKIP_PARTS = {"__pycache__", ".venv", "build", "dist"}

# "section 3", "sections 3 and 5", "sections 3, 5": every number is captured
# by _NUMBERS from the matched span.
_CITATION = re.compile(r"\bsections?\s+\d+(?:\s*(?:,|and|or)\s*\d+)*", re.IGNORECASE)
_NUMBERS = re.compile(r"\d+")
_PREFIX = "CONTRACT.md "
# A citation of the old contract file: "SPEC.md", "SPEC section 4", "SPEC 5"
# (identifiers such as SPEC_SCHEMAS, or an argument called SPEC, are not).
_OLD_NAME = re.compile(r"\bSPEC(?:\.md\b|\s+(?:sections?\b|\d))")


def contract_sections() -> set[int]:
    return {int(m.group(1)) for m in
            re.finditer(r"^## (\d+)\. ", CONTRACT.read_text(), re.MULTILINE)}


def _tracked(top: str) -> list[Path] | None:
    """The repository's files under ``top`` (work in progress that is not yet
    part of it is judged when it is added); None without git."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--", top], cwd=ROOT, check=True,
                             capture_output=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return [ROOT / name for name in out.decode().split("\0") if name]


def cited_files() -> list[Path]:
    files = [ROOT / "README.md", CONTRACT]
    for top in ("src", "tests", "benchmarks", "docs"):
        listed = _tracked(top)
        for path in sorted((ROOT / top).rglob("*") if listed is None else listed):
            if (path.is_file() and path.suffix in TEXT_SUFFIXES
                    and not SKIP_PARTS & set(path.relative_to(ROOT).parts)
                    and not any(p.endswith(".egg-info") for p in path.parts)):
                files.append(path)
    # This file spells out bad citations on purpose (the checker's own test).
    me = Path(__file__).resolve()
    return [p for p in dict.fromkeys(files) if p.exists() and p.resolve() != me]


def citations(text: str):
    """(line number, matched text, numbers, preceded by the contract's name)."""
    for m in _CITATION.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        before = text[max(0, m.start() - len(_PREFIX)):m.start()]
        yield line, m.group(0), [int(n) for n in _NUMBERS.findall(m.group(0))], \
            before == _PREFIX


def test_contract_has_its_sections():
    # The numbering the citations are checked against: 1 .. N without a gap, with
    # at least the seven sections of the operator's contract.
    sections = sorted(contract_sections())
    assert sections == list(range(1, len(sections) + 1)) and len(sections) >= 7


def test_no_file_cites_the_old_spec_name():
    bad = []
    for path in cited_files():
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if _OLD_NAME.search(line):
                bad.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not bad, "cites a file that is not in the repository:\n" + "\n".join(bad)


def test_every_section_citation_names_the_contract_and_an_existing_section():
    have = contract_sections()
    bad = []
    for path in cited_files():
        text = path.read_text(errors="replace")
        inside_contract = path == CONTRACT
        for line, cited, numbers, named in citations(text):
            where = f"{path.relative_to(ROOT)}:{line}: {cited!r}"
            if not (named or inside_contract):
                bad.append(where + " does not say docs/CONTRACT.md")
            elif not set(numbers) <= have:
                bad.append(where + f" names a section docs/CONTRACT.md lacks (has {sorted(have)})")
    assert not bad, "\n".join(bad)


def test_citation_checker_flags_what_it_should():
    # The checker itself, on made-up text: an unnamed citation, a missing
    # section and a named, existing one.
    text = "see section 4\nper CONTRACT.md section 9\nper docs/CONTRACT.md sections 3 and 5\n"
    found = list(citations(text))
    assert [(line, numbers, named) for line, _, numbers, named in found] == [
        (1, [4], False), (2, [9], True), (3, [3, 5], True)]
    assert 9 not in contract_sections()
    for cited in ("(SPEC 5)", "SPEC section 4", "refer to SPEC.md", "SPEC sections 3"):
        assert _OLD_NAME.search(cited), cited
    for other in ("SPEC_SCHEMAS", "SPEC: ``model`` (a directory)", "SPEC_JSON"):
        assert not _OLD_NAME.search(other), other
