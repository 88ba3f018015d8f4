"""Process-level setup that must run before ``mlx.core`` is first imported.

The Linux ``mlx[cpu]`` wheel links the reference BLAS: a (64x576)@(576x1536)
fp32 matmul takes ~50-140 ms there, ~1.5-4 ms with OpenBLAS.  When Debian's
OpenBLAS is installed (``apt-get install libopenblas0-pthread``) and MLX is
not imported yet, it is loaded with RTLD_GLOBAL so that MLX's BLAS symbols
resolve to it (the same effect as ``LD_PRELOAD``).  Results can differ from
the reference BLAS in the last float bits.  Set ``OIQ_MLX_OPENBLAS=0`` to
keep the reference BLAS.
"""

import ctypes
import os
import sys

OPENBLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
)

openblas_path = None


def preload_openblas() -> str | None:
    """Load OpenBLAS globally if possible; return its path or None."""
    global openblas_path
    if openblas_path or sys.platform != "linux" or os.environ.get("OIQ_MLX_OPENBLAS", "1") == "0":
        return openblas_path
    if "mlx.core" in sys.modules:
        return None
    for path in OPENBLAS_CANDIDATES:
        if os.path.exists(path):
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                continue
            openblas_path = path
            break
    return openblas_path
