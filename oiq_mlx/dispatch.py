"""The one place that decides between the fused Metal kernels and the
reference (plain MLX) path.

Kernels are used when Metal is available, the default stream is on the GPU,
the shape is one the kernels serve, and ``OIQ_MLX_FORCE_REFERENCE`` is not
set to ``1``.  Everything else (Linux/CPU, CUDA, unsupported shapes) runs the
reference path, which gives the same results up to float rounding.
"""

from __future__ import annotations

import os

import mlx.core as mx


def kernels_enabled() -> bool:
    if os.environ.get("OIQ_MLX_FORCE_REFERENCE", "0") == "1":
        return False
    return mx.metal.is_available() and mx.default_device() == mx.gpu


def decode_attention_kernel(cache, q_rotated, mask, sinks):
    """Fused decode attention over ``cache`` when a kernel serves this call,
    else None (the caller runs the reference path)."""
    if not kernels_enabled():
        return None
    return None
