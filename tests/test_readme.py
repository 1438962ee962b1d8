"""The README: short, the serving command on its first screen, and every
command in it run or checked.

* Every ``python`` block runs as it stands and prints what it claims: with
  the guides' blocks, in one interpreter, in tests/test_docs.py; the ``py``
  block of "Serve with vLLM" runs in tests/test_vllm.py (``--run-model``, in
  the vLLM environment).
* The Quick start's shell commands are what ``.ci/run`` runs, and they do
  not pin a torch and a Triton that conflict; the serving command is checked
  with the guides' commands in tests/test_docs.py.
"""

from __future__ import annotations

import re

from _doc_blocks import ROOT, ci_lines, claim_holds, claims, commands, fenced, section

README = (ROOT / "README.md").read_text()
BLOCKS = fenced(README, "python")
MAX_LINES = 200
FIRST_SCREEN = 50


def test_the_readme_is_short_and_serves_on_its_first_screen():
    lines = README.splitlines()
    assert len(lines) <= MAX_LINES, f"{len(lines)} lines"
    first = "\n".join(lines[:FIRST_SCREEN])
    assert "--attention-backend CUSTOM" in first and "api_server" in first


def test_the_readme_has_an_example_for_each_face():
    """The kernel API and transformers run here; vLLM's is the one ``py``
    block of "Serve with vLLM" (tests/test_vllm.py reads it there)."""
    assert any("stem_attention(" in b for b in BLOCKS)
    assert any("integrations.transformers" in b for b in BLOCKS)
    (serve,) = fenced(section(README, "## Serve with vLLM"), "py")
    assert "integrations.vllm" in serve


def test_every_readme_block_claims_what_it_prints():
    # Every block tells the reader what to expect (tests/test_docs.py checks it).
    assert all(claims(block) for block in BLOCKS)


def test_claim_checker_on_made_up_output():
    printed = "torch.Size([4, 64, 16, 64]) tensor(49.9375)\nsparse density 52%\n"
    assert claim_holds("[4, 64, 16, 64]", printed)
    assert not claim_holds("[4, 64, 16]", printed)
    assert claim_holds("49.9 blocks", printed) and not claim_holds("50.1 blocks", printed)
    assert claim_holds("density 52%", printed) and not claim_holds("density 53%", printed)
    assert claim_holds("sparse", printed) and not claim_holds("dense", printed)
    assert not claim_holds("stem", "{'stem-rotated': 1}")
    assert claims("print(x)   # [2, 3], sparse, density 52%\n") == \
        ["[2, 3]", "sparse", "density 52%"]


# --------------------------------------------------------------------------- #
# The Quick start's shell commands and .ci/run
# --------------------------------------------------------------------------- #

_QUICK_START = section(README, "## Quick start")
_SHELL = [c for block in fenced(_QUICK_START, "bash") for c in commands(block)]


def test_quick_start_commands_are_what_ci_runs():
    assert "python3 -m venv .venv" in _SHELL and ".venv/bin/python -m pytest -q" in _SHELL
    ci = ci_lines()
    missing = [c for c in _SHELL if not any(c in line for line in ci)]
    assert not missing, f".ci/run does not run the README's {missing}"


def test_quick_start_never_pins_torch_and_triton_in_one_install():
    # torch 2.13.0 from PyPI (the CUDA build) requires its own Triton, so a
    # Triton pin beside it cannot resolve there; Triton is a step of its own.
    installs = [c for c in _SHELL if " install " in c]
    torch_pins = [c for c in installs if re.search(r"\btorch==", c)]
    assert torch_pins, "the Quick start pins torch"
    assert not [c for c in torch_pins if "triton" in c], torch_pins
    triton = [c for c in installs if "triton" in c]
    assert all(re.fullmatch(r"\.venv/bin/pip install triton==[\d.]+", c) for c in triton), triton
    # The one install that is allowed to fail in CI is that optional step.
    assert any("|| .venv/bin/pip install triton==" in line for line in ci_lines())


def test_quick_start_names_the_cpu_index_for_the_cpu_build():
    pin = re.search(r"torch==([\d.]+)", _QUICK_START).group(1)
    assert (f"pip install torch=={pin} --index-url https://download.pytorch.org/whl/cpu"
            in " ".join(_QUICK_START.split()))
