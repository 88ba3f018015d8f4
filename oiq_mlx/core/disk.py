"""The files the package keeps between processes (kernel self-test verdicts, GGUF tokenizers,
assembled model files): where they go, and writing them whole or not at all."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_VARIABLE = "OIQ_MLX_CACHE"


def cache_dir() -> Path:
    """The package's cache folder: ``$OIQ_MLX_CACHE``, else ``$XDG_CACHE_HOME/oiq_mlx``, else
    ``~/.cache/oiq_mlx``.  Assembled model files, GGUF tokenizers (``tokenizers/``) and the kernel
    self-test's verdicts go there."""
    folder = os.environ.get(CACHE_VARIABLE)
    if folder:
        return Path(folder)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "oiq_mlx"


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
