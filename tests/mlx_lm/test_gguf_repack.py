"""GGUF quants that are affine per 32 values (the legacy types, Q4_K, Q5_K) as MLX affine arrays
(``oiq_mlx.mlx_lm.gguf.repack``): the same values as the gguf package's dequantizer, bit for bit."""

import oiq_mlx  # noqa: F401  (preloads OpenBLAS before mlx is imported)

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants

from oiq_mlx.mlx_lm.gguf import repack

BITS = {"Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5, "Q8_0": 8}


@pytest.mark.parametrize("kind", sorted(BITS))
@pytest.mark.parametrize("shape", [(3, 64), (2, 5, 96)])
def test_affine_arrays_dequantize_to_the_files_values(kind, shape):
    rng = np.random.default_rng(sorted(BITS).index(kind))
    x = (rng.standard_normal(shape) * rng.choice([0.01, 1.0, 40.0], shape[:-1])[..., None]).astype(np.float32)
    x[0, :32] = 0.0  # a zero block: scale 0
    raw = quants.quantize(x, GGMLQuantizationType[kind])
    want = quants.dequantize(raw, GGMLQuantizationType[kind])
    w, scales, biases, bits = repack.affine(raw.reshape(-1), kind, shape)
    assert bits == BITS[kind] and w.dtype == mx.uint32 and scales.dtype == biases.dtype == mx.float32
    assert w.shape == (*shape[:-1], shape[-1] * bits // 32) and scales.shape == (*shape[:-1], shape[-1] // 32)
    got = np.array(mx.dequantize(w, scales, biases, group_size=32, bits=bits))
    assert np.array_equal(got, want)


def test_a_minimum_past_float16_stays_exact():
    # one Q8_0 block with scale 1024: its implicit minimum -128 * 1024 is past float16's range
    block = np.zeros(34, np.uint8)
    block[:2] = np.array([1024.0], np.float16).view(np.uint8)
    block[2:] = np.arange(-16, 16, dtype=np.int8).view(np.uint8)
    w, scales, biases, bits = repack.affine(block, "Q8_0", (1, 32))
    got = np.array(mx.dequantize(w, scales, biases, group_size=32, bits=bits))
    assert np.array_equal(got, quants.dequantize(block[None], GGMLQuantizationType.Q8_0))
    assert got[0, -1] == 15 * 1024


def _k_blocks(kind, n, rng):
    """``n`` random K-quant super-blocks: random code, scale and fifth-bit bytes (every pattern is
    valid), finite float16 ``d`` and ``dmin`` of mixed magnitudes."""
    size = {"Q4_K": 144, "Q5_K": 176}[kind]
    blocks = rng.integers(0, 256, (n, size), dtype=np.uint8)
    halves = (rng.standard_normal((n, 2)) * 10.0 ** rng.integers(-4, 1, (n, 1))).astype(np.float16)
    blocks[:, :4] = halves.view(np.uint8)
    return blocks


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K"])
@pytest.mark.parametrize("shape", [(2, 256), (3, 2, 512)])
def test_k_quants_dequantize_to_the_files_values(kind, shape):
    rng = np.random.default_rng(len(shape))
    blocks = _k_blocks(kind, int(np.prod(shape)) // 256, rng)
    want = quants.dequantize(blocks, GGMLQuantizationType[kind]).reshape(shape)
    w, scales, biases, bits = repack.affine(blocks.reshape(-1), kind, shape)
    assert bits == int(kind[1]) and w.shape == (*shape[:-1], shape[-1] * bits // 32)
    got = np.array(mx.dequantize(w, scales, biases, group_size=32, bits=bits))
    assert np.array_equal(got, want)
