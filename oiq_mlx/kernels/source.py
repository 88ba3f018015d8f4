"""Metal sources of the kernels and the lazily built `mx.fast.metal_kernel` objects."""

from __future__ import annotations

import functools
from pathlib import Path

import mlx.core as mx

_PACKAGE = Path(__file__).resolve().parent.parent

# Head dimensions the kernels serve: one simdgroup per vector, D/32 values per lane.
SUPPORTED_DIMS = (32, 64, 128, 256)

_SEARCH = (
    _PACKAGE / "metal",  # installed wheel
    _PACKAGE.parent / "metal",  # source checkout
)


def metal_source(name: str) -> str:
    """Text of ``metal/<name>`` from the installed package, else the checkout."""
    for d in _SEARCH:
        path = d / name
        if path.is_file():
            return path.read_text()
    raise FileNotFoundError(f"Metal source {name!r} not found in {[str(d) for d in _SEARCH]}")


@functools.lru_cache(maxsize=None)
def build_kernel(name: str, source_file: str, input_names: tuple, output_names: tuple,
                 row_contiguous: bool = True):
    """The `mx.fast.metal_kernel` for ``metal/<source_file>`` (built once per process)."""
    return mx.fast.metal_kernel(
        name=name,
        input_names=list(input_names),
        output_names=list(output_names),
        source=metal_source(source_file),
        header=metal_source("oiq_common.h"),
        ensure_row_contiguous=row_contiguous,
    )
