"""Writing the files the package keeps between processes (kernel self-test verdicts, GGUF
tokenizers): whole or not at all."""

from __future__ import annotations

import os
from pathlib import Path


def write_atomically(path: Path, data: bytes) -> bool:
    """Write ``data`` to ``path`` through a temporary file beside it, so that a reader sees the old
    file or the new one, never part of one.  False (and nothing left behind) where the folder
    cannot be made or written: what these files hold only saves time."""
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial.write_bytes(data)
        os.replace(partial, path)
        return True
    except OSError:
        try:
            partial.unlink(missing_ok=True)
        except OSError:  # the folder is not there, or not a folder
            pass
        return False
