"""CPU emulator for `mx.fast.metal_kernel` kernels (tests only).

`launch(kernel, **kwargs)` is a drop-in for `oiq_mlx.kernels.launcher.launch`:
it compiles the exact Metal text MLX generates for the call with clang against
a shim header and runs every GPU thread as a fiber. `use_emulator(monkeypatch)`
or the `metal_emulator` fixture routes production launches through it.

What it rejects, as Metal would:
- Address-space misuse: each kernel is also compiled with `device`, `constant`
  and `threadgroup` as distinct clang address spaces; passing a pointer of one
  where another is declared fails with clang's message. Inputs are declared as
  MLX declares them (`constant` for fewer than 8 elements, 0-d and scalars).
- More than 32 KiB of threadgroup memory or 1024 threads per threadgroup, and
  threadgroups that are not whole simdgroups of 32 in kernels using `simd_*`.
- Out-of-bounds reads and writes: inputs reach the kernel with MLX's real
  strides and offsets (slices of larger buffers, stride-0 broadcasts; copied
  contiguous only where the kernel asks `ensure_row_contiguous`), and every
  load and store is checked against the bytes of the array's elements (clang's
  load/store hooks), gaps of strided views included.
- Races: each launch runs in several execution orders ($OIQ_EMU_ORDERS, default
  forward, reverse and a seeded shuffle of threads between synchronisation
  points and of threadgroups); outputs that differ between orders raise.

Semantics worth knowing when reading a failure:
- Outputs without `init_value` start as NaN (float16/bfloat16/float32) or
  0xCD bytes (integer and bool types): unwritten elements show up.
- `fast::exp(x)` (float) is off exp(x) by Metal's documented fast-math bound,
  3 + floor(|2x|) ulp (MSL specification 8.4, Table 8.2), up to one ulp more, on a
  side hashed from x (a fixed function of x, as on hardware); `emulator.FAST_EXP`
  or $OIQ_EMU_FAST_EXP (`hash`, `up`, `down`, `exact`, optionally `:SCALE` to
  multiply the bound) changes that.  The precise `exp` is libm's.
- `threadgroup` arrays are refilled with 0xFF bytes (NaN / all-ones) for every
  threadgroup; a read before any write sees that.
- A barrier reached by only part of a group, or lanes of a simdgroup at
  different simd operations, raise `MetalEmuError`. Unsupported MSL features
  raise `MetalEmuUnsupported`.
- `emulator.RESOURCES` holds each launched instantiation's threadgroup memory
  and per-thread state (the kernel's stack frame at -O0: every local, an upper
  bound of live 32-bit registers); `emulator.resource_table()` prints them.
- Compiled kernels are cached by hash of (kernel C++ text, shim, flags) in
  $OIQ_EMU_CACHE, default ~/.cache/oiq_mlx/metal_emu; $OIQ_EMU_CXX picks the
  clang++ binary (default clang++; g++ lacks the address spaces and hooks).
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
    """Make `oiq_mlx.kernels.launcher.launch` run kernels on the emulator."""
    import oiq_mlx.kernels.launcher as _launch

    monkeypatch.setattr(_launch, "launch", launch)
    return launch


@pytest.fixture
def metal_emulator(monkeypatch):
    """Route production kernel launches through the CPU Metal emulator."""
    return use_emulator(monkeypatch)
