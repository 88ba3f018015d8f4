"""Shared fixtures: `metal_emulator` runs Metal kernels on the CPU emulator.

``oiq_mlx`` is imported before anything imports ``mlx.core`` so that it can
preload OpenBLAS on Linux (see ``oiq_mlx/core/platform.py``).

pytest puts tests/ on sys.path (pyproject.toml: ``pythonpath``) so that test files import
``helpers`` and ``metal_emu`` by name.  The folder tests/mlx_lm/ has no ``__init__.py``: a
folder without one never shadows an installed package of the same name, so ``import mlx_lm``
still finds the real mlx-lm (checked below).
"""

from pathlib import Path

import oiq_mlx  # noqa: F401  (must come first)
import mlx_lm  # noqa: E402
from metal_emu import metal_emulator  # noqa: F401,E402

assert Path(__file__).parent not in Path(mlx_lm.__file__).resolve().parents, (
    f"tests/mlx_lm shadows the mlx_lm package: {mlx_lm.__file__}")
