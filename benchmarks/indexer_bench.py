"""The CPU benchmark of the indexer (shapes S1..S5), as a script.

The same as ``stem-indexer bench`` and ``python -m stem_indexer.bench``; the
benchmark itself lives in ``src/stem_indexer/bench.py`` (tested in
``tests/test_bench.py``), and ``benchmarks/RESULTS.md`` says what each column
measures.

    .venv/bin/python benchmarks/indexer_bench.py --shapes S3,S4
    .venv/bin/python benchmarks/indexer_bench.py --out benchmarks/RESULTS.md
    STEM_INDEXER_NATIVE=0 .venv/bin/python benchmarks/indexer_bench.py  # torch selection
"""

import sys

from stem_indexer.bench import main

if __name__ == "__main__":
    sys.exit(main())
