"""Sign-randomized, normalized Walsh-Hadamard rotation of head vectors.

``rotate(x, signs) = H (signs * x) / sqrt(b)`` on the last axis, where ``H`` is
the Hadamard matrix MLX's ``mx.hadamard_transform`` applies (block-diagonal
with blocks of size ``b`` when ``d`` itself is not a Hadamard size).  The
rotation is orthonormal, so ``q . k == rotate(q) . rotate(k)``.

Supported head dimensions
-------------------------
``mx.hadamard_transform`` handles ``n = m * 2**k`` with ``m`` in
``{1, 12, 20, 28}`` (64, 80, 96, 112, 128, 160, 192, 224, 256, ...): those get
one full transform over the head.  Any other ``d`` that is a multiple of 16
(e.g. 144 = 3 x 48, 176 = 11 x 16) gets a block-diagonal transform with the
largest Hadamard size that divides ``d``: it keeps storage at exactly ``d``
values (zero-padding to the next Hadamard size would cost up to 2x bytes) and
still spreads an outlier over at least 16 coordinates, which is what the group
scale needs (see ``tests/core/test_rotation.py`` for the measured effect).  Other
sizes are rejected with ``ValueError``; ``mx.hadamard_transform`` is never
called on a size it mishandles (it silently returns garbage for n = 36 and
crashes for n = 60).

For ``m = 20`` and ``m = 28`` MLX's Hadamard matrix is orthogonal but not
symmetric, so the inverse uses its transpose (an explicit matrix product);
powers of two and ``m = 12`` are symmetric and invert with the same transform.
"""

from __future__ import annotations

import functools
import math

import mlx.core as mx
import numpy as np

from .codec import check_floating

HADAMARD_BASES = (1, 12, 20, 28)
_SYMMETRIC_BASES = (1, 12)
_MIN_BLOCK = 16


def _hadamard_base(n: int) -> int | None:
    """The m of ``n = m * 2**k`` that mx.hadamard_transform accepts, or None."""
    for m in HADAMARD_BASES:
        if n % m == 0:
            q = n // m
            if q & (q - 1) == 0:
                return m
    return None


def hadamard_block_size(dim: int) -> int:
    """Size of the Hadamard blocks used to rotate vectors of length ``dim``.

    ``dim`` itself when it is a Hadamard size, otherwise the largest Hadamard
    size dividing ``dim`` (at least 16).  Raises ``ValueError`` when ``dim`` is
    not rotatable.
    """
    if not isinstance(dim, (int, np.integer)) or isinstance(dim, bool) or dim < 1:
        raise ValueError(f"head dimension must be a positive integer, got {dim!r}")
    dim = int(dim)
    if _hadamard_base(dim) is not None:
        return dim
    if dim % _MIN_BLOCK == 0:
        return max(b for b in range(_MIN_BLOCK, dim, _MIN_BLOCK) if dim % b == 0 and _hadamard_base(b))
    raise ValueError(
        f"head dimension {dim} cannot be rotated: supported sizes are m * 2**k with m in "
        f"{HADAMARD_BASES} (e.g. 64, 80, 96, 112, 128, 192, 256) or any multiple of {_MIN_BLOCK}"
    )


def is_rotatable(dim: int) -> bool:
    try:
        hadamard_block_size(dim)
    except ValueError:
        return False
    return True


def _splitmix64(state: int):
    mask = (1 << 64) - 1
    while True:
        state = (state + 0x9E3779B97F4A7C15) & mask
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        yield z ^ (z >> 31)


@functools.lru_cache(maxsize=256)
def _signs_np(seed: int, dim: int) -> np.ndarray:
    gen = _splitmix64(seed)
    bits = [next(gen) >> 63 for _ in range(dim)]
    return np.where(np.array(bits, dtype=np.uint8) == 1, -1.0, 1.0).astype(np.float32)


def random_signs(seed: int = 0, dim: int = 128) -> mx.array:
    """Deterministic random +-1 vector of shape ``(dim,)``, float32.

    Generated with SplitMix64 from ``seed`` in pure Python, so the same seed
    gives the same signs on every platform and every MLX/NumPy version.
    """
    if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    hadamard_block_size(dim)
    return mx.array(_signs_np(int(seed), int(dim)))


@functools.lru_cache(maxsize=64)
def _block_matrix_np(block: int) -> np.ndarray:
    """``A`` with ``A[i] = hadamard_transform(e_i)``, i.e. the transpose of the
    matrix mx.hadamard_transform applies, scaled to be orthonormal."""
    eye = mx.eye(block, dtype=mx.float32)
    a = mx.hadamard_transform(eye, scale=1.0 / math.sqrt(block))
    return np.array(a)


def rotation_matrix(signs: mx.array) -> mx.array:
    """The ``(d, d)`` float32 matrix ``M`` with ``rotate(x, signs) == x @ M``.

    Used by kernels' tests and by code that folds the rotation into weights;
    ``unrotate(y, signs) == y @ M.T``.
    """
    s = np.array(_check_signs(signs, None)).astype(np.float32)
    d = s.shape[-1]
    b = hadamard_block_size(d)
    a = _block_matrix_np(b)
    m = np.zeros((d, d), dtype=np.float32)
    for i in range(0, d, b):
        m[i : i + b, i : i + b] = a
    return mx.array(s[:, None] * m)


def _check_signs(signs, dim):
    if not isinstance(signs, mx.array):
        signs = mx.array(signs)
    if signs.ndim < 1:
        raise ValueError("signs must have at least one dimension (the head dimension)")
    if dim is not None and signs.shape[-1] != dim:
        raise ValueError(f"signs have length {signs.shape[-1]} but the vectors have dimension {dim}")
    if not mx.issubdtype(signs.dtype, mx.floating):
        signs = signs.astype(mx.float32)
    return signs


def _blocked_hadamard(x: mx.array, block: int, transpose: bool) -> mx.array:
    """Apply the orthonormal block Hadamard (or its transpose) on the last axis, fp32."""
    shape = x.shape
    xb = x.reshape(*shape[:-1], shape[-1] // block, block)
    if transpose and _hadamard_base(block) not in _SYMMETRIC_BASES:
        # row vector y: H^T y  ==  y @ H  ==  y @ A.T  (A = transform of the identity)
        yb = xb @ mx.array(_block_matrix_np(block)).T
    else:
        yb = mx.hadamard_transform(xb, scale=1.0 / math.sqrt(block))
    return yb.reshape(shape)


def hadamard(x: mx.array, transpose: bool = False) -> mx.array:
    """The orthonormal (block) Hadamard transform of :func:`rotate` on the last
    axis, without the sign flip (``transpose``: its inverse); float32 in and out.

    ``rotate(x, s) == hadamard(x * s)`` and ``unrotate(y, s) == hadamard(y, True) * s``
    with the same operations, so callers that fold the sign flip into another
    elementwise step (a compiled one) get bit-identical results.
    """
    return _blocked_hadamard(x, hadamard_block_size(x.shape[-1]), transpose)


def rotate(x: mx.array, signs: mx.array) -> mx.array:
    """Rotate head vectors: ``H (signs * x) / sqrt(b)`` on the last axis.

    Args:
        x: ``(..., d)`` float16, bfloat16 or float32.
        signs: ``(d,)`` (or broadcastable to ``x``) +-1 values, see
            :func:`random_signs`.

    Returns:
        ``(..., d)`` in ``x.dtype``; computed in float32.
    """
    x = check_floating(x)
    signs = _check_signs(signs, x.shape[-1])
    d = x.shape[-1]
    y = _blocked_hadamard(x.astype(mx.float32) * signs, hadamard_block_size(d), transpose=False)
    return y.astype(x.dtype)


def unrotate(y: mx.array, signs: mx.array) -> mx.array:
    """Exact inverse of :func:`rotate`: ``signs * H^T y / sqrt(b)``. Shapes as in :func:`rotate`."""
    y = check_floating(y)
    signs = _check_signs(signs, y.shape[-1])
    d = y.shape[-1]
    x = _blocked_hadamard(y.astype(mx.float32), hadamard_block_size(d), transpose=True) * signs
    return x.astype(y.dtype)
