"""Files written whole or not at all (results, digests, CSVs), and files to trust."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomic(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same
    directory and an atomic rename: readers never see half a file, and a
    failure leaves the old file (or none) in place."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def untrusted(path: Path) -> str | None:
    """Why ``path`` may not be trusted (None: it is this user's alone: owned
    by the current user and writable by nobody else)."""
    try:
        st = path.stat()
    except OSError as err:
        return str(err)
    if hasattr(os, "geteuid") and st.st_uid != os.geteuid():
        return f"{path} belongs to another user"
    if st.st_mode & 0o022:
        return f"{path} is writable by group or others"
    return None
