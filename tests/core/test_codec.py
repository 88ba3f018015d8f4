"""Reference codec: layout, error bounds, bad input, non-finite containment."""

import mlx.core as mx
import numpy as np
import pytest

from oiq_mlx.core import codec
from oiq_mlx.core.codec import (SUPPORTED_BITS, SUPPORTED_GROUP_SIZES, alignment_pair, bytes_per_token, dequantize,
                                 join_rows, quantize)

COMBOS = [(b, g) for b in SUPPORTED_BITS for g in SUPPORTED_GROUP_SIZES]


def _data(shape, seed=0, outliers=True):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    if outliers:
        flat = x.reshape(-1)
        idx = rng.choice(flat.size, size=max(1, flat.size // 100), replace=False)
        flat[idx] *= 25.0
    return mx.array(x)


@pytest.mark.parametrize("bits,group", COMBOS)
def test_layout_matches_mx_quantize(bits, group):
    x = _data((3, 5, 256), seed=bits * group)
    # our pack/unpack reproduces mx.quantize's words bit for bit
    w, _, _ = mx.quantize(x, group_size=group, bits=bits)
    assert mx.array_equal(codec.pack_codes(codec.unpack_codes(w, bits), bits), w)
    # and mx.dequantize decodes our codes with the derived biases
    codes, scales = quantize(x, bits, group)
    assert codes.dtype == mx.uint32 and codes.shape == (3, 5, 256 * bits // 32)
    assert scales.dtype == mx.float16 and scales.shape == (3, 5, 256 // group)
    s32 = scales.astype(mx.float32)
    theirs = mx.dequantize(codes, s32, codec.affine_biases(s32, bits), group_size=group, bits=bits)
    ours = dequantize(codes, scales, bits, group)
    # both are exact fp32 evaluations of s * c + b vs s * (c - h): a few ulp of the largest value
    assert float(mx.abs(theirs - ours).max()) <= 1e-5 * float(mx.abs(ours).max())


@pytest.mark.parametrize("bits,group", COMBOS)
def test_error_bound(bits, group):
    x = _data((64, 256), seed=bits + group)
    codes, scales = quantize(x, bits, group)
    err = mx.abs(dequantize(codes, scales, bits, group) - x).reshape(64, 256 // group, group)
    half_step = scales.astype(mx.float32)[..., None] / 2
    # mid-rise abs-max: every value within half a step of its level; the fp16
    # rounding of the scale may push the outermost value out by <= 2^-11 relative
    amax = mx.abs(x).reshape(64, 256 // group, group).max(axis=-1, keepdims=True)
    assert bool(mx.all(err <= half_step + amax * 2.0**-10))
    # all 2**bits codes are in use (mid-rise: no wasted code)
    used = np.unique(np.array(codec.unpack_codes(codes, bits)))
    assert used.min() == 0 and used.max() == 2**bits - 1


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_clip_search_lowers_mse(bits):
    x = _data((256, 128), seed=5, outliers=False)
    plain = mx.mean(mx.square(dequantize(*quantize(x, bits, 32), bits, 32) - x)).item()
    clipped = mx.mean(mx.square(dequantize(*quantize(x, bits, 32, clip=True), bits, 32) - x)).item()
    assert clipped < plain * (0.9 if bits <= 3 else 1.0)


@pytest.mark.parametrize("clip", [False, True])
@pytest.mark.parametrize("bits", [2, 3, 5])
def test_aligned_scales_keep_each_group_along_itself(bits, clip):
    """align=True keeps the codes and stores s = |y|^2 / <y, u>: each decoded group has the
    projection on its input that the input has (up to the float16 rounding of s), where the
    MSE-chosen scale of the clip search shrinks it; a zero group keeps scale 0, a NaN group
    stays NaN; the squared error stays within 15% of the clip search's."""
    x = _data((256, 128), seed=bits, outliers=False)
    x[0, :32] = 0.0
    x[1, 40] = mx.nan
    plain_codes, plain_scales = quantize(x, bits, 32, clip=clip)
    codes, scales = quantize(x, bits, 32, clip=clip, align=True)
    assert mx.array_equal(codes, plain_codes)
    assert float(scales[0, 0]) == 0.0 and bool(mx.isnan(scales[1, 1])) and not bool(mx.isnan(scales[1, 0]))

    def along(codes, scales):
        y = dequantize(codes, scales, bits, 32)[2:].reshape(-1, 32)
        g = x[2:].reshape(-1, 32)
        return mx.sum(y * g, -1) / mx.sum(g * g, -1)

    assert float(mx.abs(along(codes, scales) - 1).max()) < 2.0**-10  # float16 rounding of s
    if clip:
        assert float(mx.mean(along(plain_codes, plain_scales))) < (0.999 if bits == 5 else 0.98)
        mse = [mx.mean(mx.square(dequantize(c, s, bits, 32)[2:] - x[2:])).item()
               for c, s in ((plain_codes, plain_scales), (codes, scales))]
        assert mse[1] < 1.15 * mse[0]


@pytest.mark.parametrize("bits", [2, 3])
def test_half_aligned_scales_are_the_mean_of_chosen_and_aligned(bits):
    """align=0.5 keeps the codes and stores (s_chosen + s_aligned) / 2 rounded to float16 (from
    the aligned scale before its own rounding, so within a float16 step of the stored ones'): the
    decoded group's projection on its input lies between the clip search's and 1; a zero group
    keeps scale 0, a NaN group stays NaN; other alignments are refused by name."""
    x = _data((128, 64), seed=bits + 7, outliers=False)
    x[0, :32] = 0.0
    x[1, 40] = mx.nan
    (c0, s0), (c1, s1), (ch, sh) = (quantize(x, bits, 32, clip=True, align=a) for a in (False, True, 0.5))
    assert mx.array_equal(ch, c0) and mx.array_equal(ch, c1)
    want = (s0.astype(mx.float32) + s1.astype(mx.float32)) * 0.5
    finite = ~mx.isnan(s0)
    gap = mx.where(finite, mx.abs(sh.astype(mx.float32) - want) / mx.maximum(want, 1e-30), 0)
    assert float(gap.max()) <= 2.0**-10 and mx.sum(sh != s0).item() > 0.9 * finite.sum().item()
    assert float(sh[0, 0]) == 0.0 and bool(mx.isnan(sh[1, 1]))

    def along(codes, scales):
        y = dequantize(codes, scales, bits, 32)[2:].reshape(-1, 32)
        g = x[2:].reshape(-1, 32)
        return mx.mean(mx.sum(y * g, -1) / mx.sum(g * g, -1)).item()

    assert along(c0, s0) < along(ch, sh) < along(c1, s1)
    for bad in (0.25, 2, "0.5", None):
        with pytest.raises(ValueError, match="align must be one of"):
            quantize(x, bits, 32, align=bad)
    # per side: keys and values stacked on a first axis of 2, or one alignment for every row
    assert alignment_pair((0.5, True), (2, 5)) == (0.5, 1.0) and alignment_pair(True, (3, 5)) == (1.0, 1.0)
    assert alignment_pair((1, 1), (3, 5)) == (1.0, 1.0)
    with pytest.raises(ValueError, match="a pair needs keys and values stacked on the first axis"):
        alignment_pair((0.5, 1.0), (3, 5))
    with pytest.raises(ValueError, match="one for keys and one for values"):
        alignment_pair((0.5, 1.0, 1.0), (2, 5))


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
def test_dtypes_and_leading_shapes(dtype):
    x = _data((2, 3, 4, 64)).astype(dtype)
    codes, scales = quantize(x, 4, 32)
    assert codes.shape == (2, 3, 4, 8) and scales.shape == (2, 3, 4, 2)
    ref_codes, ref_scales = quantize(x.astype(mx.float32), 4, 32)
    assert mx.array_equal(codes, ref_codes) and mx.array_equal(scales, ref_scales)
    y = dequantize(codes, scales, 4, 32, dtype=dtype)
    assert y.dtype == dtype


def test_strided_input():
    x = _data((64, 128))
    xt = x.T.T[:, ::1]
    sl = mx.concatenate([x, x], axis=-1)[:, 128:]
    for view in (xt, sl):
        assert mx.array_equal(quantize(view, 3, 32)[0], quantize(x, 3, 32)[0])


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
def test_zero_groups(bits):
    x = mx.zeros((3, 64))
    codes, scales = quantize(x, bits, 32)
    assert not bool(mx.any(codes)) and not bool(mx.any(scales))
    y = dequantize(codes, scales, bits, 32)
    assert not bool(mx.any(mx.isnan(y))) and not bool(mx.any(y))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_contained(bad):
    x = np.array(_data((4, 3, 128)))
    x[1, 2, 40] = bad
    codes, scales = quantize(mx.array(x), 4, 32)
    clean_codes, clean_scales = quantize(mx.array(np.where(np.isfinite(x), x, 0)), 4, 32)
    codes, scales, clean_codes, clean_scales = map(np.array, (codes, scales, clean_codes, clean_scales))
    # the bad group decodes to NaN with zero codes ...
    assert np.isnan(scales[1, 2, 1]) and (codes[1, 2, 4:8] == 0).all()
    # ... and nothing else changes
    mask = np.ones(scales.shape, bool)
    mask[1, 2, 1] = False
    assert (scales[mask] == clean_scales[mask]).all()
    wmask = np.ones(codes.shape, bool)
    wmask[1, 2, 4:8] = False
    assert (codes[wmask] == clean_codes[wmask]).all()
    y = np.array(dequantize(mx.array(codes), mx.array(scales), 4, 32))
    assert np.isnan(y[1, 2, 32:64]).all()
    y[1, 2, 32:64] = 0
    assert np.isfinite(y).all()


def test_huge_values_saturate_scale():
    x = mx.full((1, 32), 1e6)
    codes, scales = quantize(x, 2, 32)
    assert float(scales[0, 0]) == 65504.0
    assert np.isfinite(np.array(dequantize(codes, scales, 2, 32))).all()


def test_bytes_per_token():
    assert bytes_per_token(128, 4, 32) == 72
    assert bytes_per_token(128, 3, 32) == 56
    assert bytes_per_token(128, 2, 32) == 40
    assert bytes_per_token(64, 4, 32) == 36
    # one group: its float16 scale takes a whole word of the packed row (half of it padding)
    assert bytes_per_token(128, 8, 128) == 132
    for bits, group in ((3, 32), (8, 128)):
        rows = join_rows(*quantize(mx.zeros((10, 128)), bits, group))
        assert rows.nbytes == 10 * bytes_per_token(128, bits, group)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(bits=7), "bits=7 is not supported"),
        (dict(bits=0), "bits=0 is not supported"),
        (dict(bits=4.0), "bits=4.0 is not supported"),
        (dict(group_size=48), "group_size=48 is not supported"),
        (dict(group_size=16), "group_size=16 is not supported"),
    ],
)
def test_bad_parameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        quantize(mx.zeros((2, 128)), **kwargs)


def test_bad_inputs():
    with pytest.raises(ValueError, match="not divisible by group_size=64"):
        quantize(mx.zeros((2, 96)), 4, 64)
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        quantize(mx.zeros((2, 64), dtype=mx.int32), 4, 32)
    with pytest.raises(ValueError, match="mx.array"):
        quantize(np.zeros((2, 64), np.float32), 4, 32)
    codes, scales = quantize(mx.zeros((2, 64)), 4, 32)
    with pytest.raises(ValueError, match="scales shape"):
        dequantize(codes, scales[:, :1], 4, 32)
    with pytest.raises(ValueError, match="uint32"):
        dequantize(codes.astype(mx.int32), scales, 4, 32)


@pytest.mark.parametrize("bits,to", [(b, t) for b in sorted(codec.CPU_REPACK_BITS) for t in (4, 8) if t > b])
@pytest.mark.parametrize("rows", [1, 63, 64, 1500])
def test_repack_codes_keeps_every_code(bits, to, rows):
    """Codes repacked for MLX's fast CPU widths (the cache's ``CPU_REPACK_BITS`` and 4 bits)
    decode to the same values: unpacked, and through ``mx.quantized_matmul(transpose=False)``
    with the original scales and biases (bit-exact)."""
    assert codec.CPU_REPACK_BITS[bits] in (4, 8)
    rng = np.random.default_rng(bits * 1000 + rows)
    codes = mx.array(rng.integers(0, 1 << bits, size=(2, 3, rows, 64)).astype(np.uint32))
    packed = codec.pack_codes(codes, bits)
    # a strided view of joined rows (codes then scales), as the cache hands them over
    joined = mx.concatenate([packed, mx.zeros((2, 3, rows, 1), mx.uint32)], axis=-1)[..., : packed.shape[-1]]
    out = codec.repack_codes(joined, bits, to)
    assert out.shape == (2, 3, rows, 64 * to // 32) and out.dtype == mx.uint32
    assert mx.array_equal(codec.unpack_codes(out, to), codes).item()
    scales = mx.array(rng.uniform(0.5, 2.0, size=(2, 3, rows, 2)).astype(np.float32))
    biases = codec.affine_biases(scales, bits)
    p = mx.array(rng.standard_normal((2, 3, 4, rows)).astype(np.float32))
    want = mx.quantized_matmul(p, packed, scales, biases, transpose=False, group_size=32, bits=bits)
    got = mx.quantized_matmul(p, out, scales, biases, transpose=False, group_size=32, bits=to)
    assert mx.array_equal(got, want).item()


@pytest.mark.parametrize("bits", codec.SUPPORTED_BITS)
@pytest.mark.parametrize("group_size,rows", [(32, 1), (64, 63), (128, 1500), (32, 700)])
def test_dequantize_repacked_is_dequantize(bits, group_size, rows):
    """The CPU path's dequantization (codes repacked to bytes, one fused decode) gives
    ``dequantize``'s float32 values bit for bit, from a strided view of joined rows as the
    cache hands them over, float16 or float32 scales."""
    y = mx.random.normal((2, 3, rows, 128), key=mx.random.key(bits * 7 + rows))
    codes, scales = quantize(y, bits, group_size, clip=True)
    joined = mx.concatenate([codes, mx.zeros((2, 3, rows, 1), mx.uint32)], axis=-1)[..., : codes.shape[-1]]
    want = dequantize(codes, scales, bits, group_size)
    for s in (scales, scales.astype(mx.float32)):
        got = codec.dequantize_repacked(joined, s, bits, group_size)
        assert got.dtype == mx.float32 and got.shape == want.shape
        assert mx.array_equal(got, want).item()


def test_repack_codes_bad_widths():
    packed = codec.pack_codes(mx.zeros((4, 32), mx.uint32), 3)
    with pytest.raises(ValueError, match="4 or 8 bits"):
        codec.repack_codes(packed, 3, 2)
    with pytest.raises(ValueError, match="4 or 8 bits"):
        codec.repack_codes(packed, 5, 4)
    with pytest.raises(ValueError, match="chunks"):
        codec.repack_codes(packed[:, :2], 3, 4)
    assert codec.repack_codes(packed, 3, 3) is packed
