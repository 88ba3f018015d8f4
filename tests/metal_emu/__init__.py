"""CPU emulator for `mx.fast.metal_kernel` kernels (tests only).

`launch(kernel, **kwargs)` is a drop-in for `oiq_mlx.kernels._launch.launch`:
it compiles the exact Metal text MLX generates for the call with g++ against a
shim header and runs every GPU thread as a fiber. `use_emulator(monkeypatch)`
or the `metal_emulator` fixture routes production launches through it.
"""

import pytest

from .emulator import (
    MetalEmuCompileError,
    MetalEmuError,
    MetalEmuUnsupported,
    cache_dir,
    generated_source,
    launch,
)

__all__ = [
    "MetalEmuCompileError",
    "MetalEmuError",
    "MetalEmuUnsupported",
    "cache_dir",
    "generated_source",
    "launch",
    "metal_emulator",
    "use_emulator",
]


def use_emulator(monkeypatch):
    """Make `oiq_mlx.kernels._launch.launch` run kernels on the emulator."""
    import oiq_mlx.kernels._launch as _launch

    monkeypatch.setattr(_launch, "launch", launch)
    return launch


@pytest.fixture
def metal_emulator(monkeypatch):
    """Route production kernel launches through the CPU Metal emulator."""
    return use_emulator(monkeypatch)
