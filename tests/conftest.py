"""Shared fixtures: `metal_emulator` runs Metal kernels on the CPU emulator."""

from metal_emu import metal_emulator  # noqa: F401
