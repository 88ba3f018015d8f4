"""Rotation: exact inverse, dot products, determinism, supported sizes."""

import math

import mlx.core as mx
import numpy as np
import pytest

from oiq_mlx.core import codec
from oiq_mlx.core.rotation import hadamard_block_size, is_rotatable, random_signs, rotate, rotation_matrix, unrotate

# head dims used by mlx-lm models, plus block-diagonal sizes (144 -> 3x48, 176 -> 11x16)
DIMS = [16, 32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 144, 176]


@pytest.mark.parametrize("d", DIMS)
def test_round_trip_and_dot_products(d):
    signs = random_signs(seed=1, dim=d)
    x = mx.random.normal((4, 3, d), key=mx.random.key(d))
    q = mx.random.normal((4, 3, d), key=mx.random.key(d + 1))
    y = rotate(x, signs)
    # fp32: each output sums d terms of magnitude ~1/sqrt(d); 1e-5 is ~100 ulp
    assert float(mx.abs(unrotate(y, signs) - x).max()) <= 1e-5
    dots = mx.sum(x * q, axis=-1)
    rdots = mx.sum(y * rotate(q, signs), axis=-1)
    assert float(mx.abs(dots - rdots).max()) <= 1e-4 * math.sqrt(d)
    # norm preserved, and the matrix form agrees
    assert np.allclose(np.linalg.norm(np.array(y), axis=-1), np.linalg.norm(np.array(x), axis=-1), rtol=1e-5)
    m = rotation_matrix(signs)
    assert float(mx.abs(x @ m - y).max()) <= 1e-5
    assert np.allclose(np.array(m @ m.T), np.eye(d), atol=1e-5)


def test_non_symmetric_hadamard_needs_transpose():
    # d = 80 (m = 20): applying the forward transform twice is not the identity,
    # which is why unrotate uses the transpose (DESIGN.md section 7).
    d = 80
    ones = mx.ones((d,))
    x = mx.random.normal((2, d), key=mx.random.key(0))
    twice = rotate(rotate(x, ones), ones)
    assert float(mx.abs(twice - x).max()) > 0.5
    assert float(mx.abs(unrotate(rotate(x, ones), ones) - x).max()) <= 1e-5


def test_signs_deterministic_and_balanced():
    a = np.array(random_signs(seed=7, dim=128))
    b = np.array(random_signs(seed=7, dim=128))
    c = np.array(random_signs(seed=8, dim=128))
    assert set(np.unique(a)) == {-1.0, 1.0}
    assert (a == b).all() and not (a == c).all()
    assert 40 < (a > 0).sum() < 88
    # a longer vector extends a shorter one (same stream)
    assert a[:8].tolist() == np.array(random_signs(seed=7, dim=8)).tolist()


def test_signs_pinned_values():
    # the exact stream must never change: caches saved with one version must load in the next
    expected = [-1, 1, 1, -1, 1, 1, 1, -1, 1, -1, 1, -1, -1, -1, -1, -1]
    assert np.array(random_signs(seed=0, dim=16)).astype(int).tolist() == expected


@pytest.mark.parametrize("d", [36, 60, 100, 7, 0, -4])
def test_unsupported_sizes_rejected(d):
    assert not is_rotatable(d)
    with pytest.raises(ValueError, match="cannot be rotated|positive integer"):
        hadamard_block_size(d)
    if d > 0:
        with pytest.raises(ValueError):
            rotate(mx.zeros((1, d)), mx.ones((d,)))


def test_block_sizes():
    assert hadamard_block_size(128) == 128
    assert hadamard_block_size(80) == 80
    assert hadamard_block_size(144) == 48
    assert hadamard_block_size(176) == 16


def test_bad_inputs():
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        rotate(mx.zeros((2, 64), dtype=mx.int32), random_signs(0, 64))
    with pytest.raises(ValueError, match="length 32 but the vectors have dimension 64"):
        rotate(mx.zeros((2, 64)), random_signs(0, 32))
    with pytest.raises(ValueError, match="seed"):
        random_signs(seed=-1, dim=64)


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_low_precision_input(dtype):
    x = mx.random.normal((8, 128), key=mx.random.key(3))
    s = random_signs(0, 128)
    y = rotate(x.astype(dtype), s)
    assert y.dtype == dtype
    # the only error is the rounding of x and of y to dtype
    tol = 4 * float(mx.finfo(dtype).eps) * 4
    assert float(mx.abs(y.astype(mx.float32) - rotate(x, s)).max()) <= tol


@pytest.mark.parametrize("d", [128, 288])  # 288: block-diagonal, 3 x 96
def test_rotation_reduces_error_on_outliers(d):
    """A channel 30x larger than the rest dominates its group's abs-max
    without rotation; rotation spreads it over the whole (block of the) head."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((512, d)).astype(np.float32)
    x[:, 5] *= 30.0
    x[:, 70] += 20.0
    x = mx.array(x)
    signs = random_signs(0, d)

    def err(y):
        c, s = codec.quantize(y, bits=4, group_size=32)
        return float(mx.mean(mx.square(codec.dequantize(c, s, 4, 32) - y)))

    plain = err(x)
    rotated = float(mx.mean(mx.square(unrotate(codec.dequantize(*codec.quantize(rotate(x, signs), 4, 32), 4, 32), signs) - x)))
    assert rotated < 0.5 * plain, (rotated, plain)
    assert err(rotate(x, signs)) == pytest.approx(rotated, rel=1e-3)
