"""A thread-count setting changed for the length of a block."""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator


@contextlib.contextmanager
def thread_count(get: Callable[[], int], set_: Callable[[int], object], n: int) -> Iterator[None]:
    """Run the block with ``set_(n)``; give back ``get()``'s earlier value after,
    also when the block raises."""
    before = get()
    set_(n)
    try:
        yield
    finally:
        set_(before)
