"""Shared fixtures: `metal_emulator` runs Metal kernels on the CPU emulator.

``oiq_mlx`` is imported before anything imports ``mlx.core`` so that it can
preload OpenBLAS on Linux (see ``oiq_mlx/_platform.py``).
"""

import oiq_mlx  # noqa: F401  (must come first)
from metal_emu import metal_emulator  # noqa: F401,E402
