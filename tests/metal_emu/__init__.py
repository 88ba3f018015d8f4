"""CPU emulator for `mx.fast.metal_kernel` kernels (tests only).

`launch(kernel, **kwargs)` is a drop-in for `oiq_mlx.kernels._launch.launch`:
it compiles the exact Metal text MLX generates for the call with g++ against a
shim header and runs every GPU thread as a fiber. `use_emulator(monkeypatch)`
or the `metal_emulator` fixture routes production launches through it.

Semantics worth knowing when reading a failure:
- Outputs without `init_value` start as NaN (float16/bfloat16/float32) or
  0xCD bytes (integer and bool types): unwritten elements show up.
- `threadgroup` arrays are refilled with 0xFF bytes (NaN / all-ones) for every
  threadgroup; a read before any write sees that.
- Buffers sit between 4 KiB guard areas: an out-of-bounds write raises
  `MetalEmuError` after the run, an out-of-bounds read sees 0xA5 bytes.
- Threads of a group run one after the other, each until its next
  `threadgroup_barrier` / `simdgroup_barrier` / `simd_*` call, so a missing
  barrier gives stale (deterministic) values. A barrier reached by only part of
  a group, or lanes of a simdgroup at different simd operations, raise
  `MetalEmuError`. Unsupported MSL features raise `MetalEmuUnsupported`.
- Compiled kernels are cached by hash of (kernel C++ text, shim, flags) in
  $OIQ_EMU_CACHE, default ~/.cache/oiq_mlx/metal_emu; $OIQ_EMU_CXX picks the
  compiler (default g++).
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
