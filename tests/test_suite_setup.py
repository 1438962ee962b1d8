"""The suite's own machinery (``tests/conftest.py``, ``tests/_interpreter.py``).

* Every test file with Triton interpreter tests is in ``_interpreter.FILES``:
  one that is not still runs, in a child of its own (two seconds more).
* Every test file that imports transformers is in
  ``conftest.TRANSFORMERS_USERS`` (one that is not imports it again).
* The costliest-first order names test files that exist.
"""

from __future__ import annotations

import re
from pathlib import Path

import conftest
from _interpreter import FILES

TESTS = Path(__file__).resolve().parent


def test_every_file_with_interpreter_tests_is_in_the_shared_child():
    using = {p.name for p in TESTS.glob("test_*.py") if "\n@interpreted\n" in p.read_text()}
    assert using and using == set(FILES), (sorted(using), FILES)


def test_every_file_that_imports_transformers_shares_a_worker():
    imports = re.compile(r'(importorskip|needs)\("transformers"\)|^\s*(import|from) transformers\b'
                         r'|stem_indexer\.integrations\.transformers\b', re.M)
    using = {p.name for p in TESTS.glob("test_*.py") if imports.search(p.read_text())}
    assert using and using == set(conftest.TRANSFORMERS_USERS), sorted(using)


def test_the_costliest_first_order_names_existing_files():
    missing = [name for name in conftest.COSTLIEST_FIRST if not (TESTS / name).exists()]
    assert not missing, missing
