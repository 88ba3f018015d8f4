"""The fused Metal kernels, run on the CPU Metal emulator, against the reference codec and attention.

Packed codes and scales must be bit-exact (the kernels perform the reference's float
operations in the same order, Walsh-Hadamard butterflies included).  Attention is compared
with a float64 evaluation over the exact stored values: the kernel's error must be at most
twice the reference path's (also float32) plus a small atol (STYLE.md).

Every template instantiation compiles once (~1-2 s with g++); the sweeps below are chosen so
that each template argument value, and each (d, bits, group) triple, occurs while the count of
distinct instantiations stays near 90.
"""

import itertools
import math
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from metal_emu import MetalEmuError, launch as emu_launch
from oiq_mlx import attention, codec, dispatch, rotation
from oiq_mlx.cache import OIQKVCache
from oiq_mlx.config import OIQConfig
from oiq_mlx.kernels import _launch
from oiq_mlx.kernels._source import metal_source
from oiq_mlx.kernels.decode_attention import decode_attention
from oiq_mlx.kernels.dequantize import dequantize as kernel_dequantize
from oiq_mlx.kernels.quantize import quantize as kernel_quantize

REPO = Path(__file__).resolve().parent.parent
DTYPES = (mx.float32, mx.float16, mx.bfloat16)
DIMS = (64, 128, 256)


# ---------------------------------------------------------------- references (plain ops)

def ref_quantize(x, signs, bits, group_size):
    y = rotation.rotate(x, signs) if signs is not None else x
    return codec.quantize(y, bits, group_size)


def ref_dequantize(codes, scales, bits, group_size, dtype, signs):
    if signs is None:
        return codec.dequantize(codes, scales, bits, group_size, dtype=dtype)
    return rotation.unrotate(codec.dequantize(codes, scales, bits, group_size), signs).astype(dtype)


def _heavy_tailed(shape, dtype, seed):
    """Gaussian values with a few large outlier channels, like real keys."""
    x = mx.random.normal(shape, key=mx.random.key(seed))
    x = x * (1.0 + 20.0 * (mx.arange(shape[-1]) % 17 == 3))
    return x.astype(dtype)


def _assert_bit_exact(got, want, what):
    """Same bits everywhere, except that any NaN matches any NaN (payloads carry no meaning)."""
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, want.dtype, got.shape)
    nan_got = np.isnan(np.array(got.astype(mx.float32))) if mx.issubdtype(got.dtype, mx.floating) else 0
    nan_want = np.isnan(np.array(want.astype(mx.float32))) if mx.issubdtype(want.dtype, mx.floating) else 0
    as_bits = {mx.float32: mx.uint32, mx.float16: mx.uint16, mx.bfloat16: mx.uint16}
    got_b = np.array(got.view(as_bits.get(got.dtype, got.dtype)))
    want_b = np.array(want.view(as_bits.get(want.dtype, want.dtype)))
    bad = np.argwhere((got_b != want_b) & ~(nan_got & nan_want) | (nan_got != nan_want))
    assert bad.size == 0, f"{what}: {len(bad)} mismatches, first {bad[:3].tolist()}: " \
        f"{[(got_b[tuple(i)], want_b[tuple(i)]) for i in bad[:3]]}"


def _codec_cases():
    """All (d, bits, group) triples; the dtype rotates so each pairs with every d, bits, group."""
    cases = []
    for (i, d), (j, bits), (k, g) in itertools.product(
            enumerate(DIMS), enumerate(codec.SUPPORTED_BITS), enumerate(codec.SUPPORTED_GROUP_SIZES)):
        if d % g == 0:
            cases.append((d, bits, g, DTYPES[(i + j + k) % 3]))
    return cases


# ---------------------------------------------------------------- quantize

@pytest.mark.parametrize("d, bits, group_size, dtype", _codec_cases())
def test_quantize_bit_exact(metal_emulator, d, bits, group_size, dtype):
    x = _heavy_tailed((5, 3, d), dtype, seed=d + bits + group_size)
    signs = rotation.random_signs(seed=bits, dim=d)
    codes, scales = kernel_quantize(x, bits=bits, group_size=group_size, signs=signs)
    want_codes, want_scales = ref_quantize(x, signs, bits, group_size)
    _assert_bit_exact(codes, want_codes, "codes")
    _assert_bit_exact(scales, want_scales, "scales")


@pytest.mark.parametrize("tokens", [1, 7, 255, 257])
def test_quantize_token_counts(metal_emulator, tokens):
    # Rows = tokens x 2 heads; partial last threadgroups when rows % 4 != 0.
    x = _heavy_tailed((tokens, 2, 128), mx.float16, seed=tokens)
    signs = rotation.random_signs(seed=1, dim=128)
    codes, scales = kernel_quantize(x, bits=4, group_size=32, signs=signs)
    want_codes, want_scales = ref_quantize(x, signs, 4, 32)
    _assert_bit_exact(codes, want_codes, "codes")
    _assert_bit_exact(scales, want_scales, "scales")


def test_quantize_nan_zero_and_huge_groups_without_rotation(metal_emulator):
    # Already rotated input (ROTATE=false): NaN/Inf stay confined to their group.
    y = _heavy_tailed((6, 128), mx.float32, seed=7)
    y[0, :32] = 0.0                       # an all-zero group: codes 0, scale 0
    y[1, :] = 0.0                         # an all-zero vector
    y[2, 40] = mx.nan                     # NaN in the second group only
    y[3, 100] = mx.inf                    # Inf in the fourth group only
    y[4, 64:96] = 1e9                     # scale saturates at 65504 (3 bits)
    codes, scales = kernel_quantize(y, bits=3, group_size=32)
    want_codes, want_scales = ref_quantize(y, None, 3, 32)
    _assert_bit_exact(codes, want_codes, "codes")
    _assert_bit_exact(scales, want_scales, "scales")
    s = np.array(scales)
    assert np.isnan(s[2, 1]) and np.isfinite(np.delete(s[2], 1)).all()
    assert np.isnan(s[3, 3]) and np.isfinite(s[3, :3]).all()
    assert s[4, 2] == 65504.0 and s[0, 0] == 0 and (s[1] == 0).all()
    assert (np.array(codec.unpack_codes(codes, 3))[2, 32:64] == 0).all()


def test_quantize_nan_token_confined_with_rotation(metal_emulator):
    # After rotation a NaN spreads over its own token and head only.
    x = _heavy_tailed((4, 2, 64), mx.float32, seed=3)
    x[1, 0, 5] = mx.nan
    signs = rotation.random_signs(seed=2, dim=64)
    codes, scales = kernel_quantize(x, bits=2, group_size=32, signs=signs)
    want_codes, want_scales = ref_quantize(x, signs, 2, 32)
    _assert_bit_exact(codes, want_codes, "codes")
    _assert_bit_exact(scales, want_scales, "scales")
    s = np.array(scales)
    assert np.isnan(s[1, 0]).all() and np.isfinite(np.delete(s.reshape(8, -1), 2, axis=0)).all()


def test_emulator_catches_quantize_without_barrier():
    """A variant of the quantize kernel with its threadgroup_barrier removed packs stale codes."""
    barrier = "threadgroup_barrier(mem_flags::mem_threadgroup);"
    src = metal_source("quantize.metal")
    assert src.count(barrier) == 1
    broken = mx.fast.metal_kernel(
        name="oiq_quantize_no_barrier", input_names=["x", "signs", "rot_scale"],
        output_names=["codes", "scales"], source=src.replace(barrier, ""),
        header=metal_source("oiq_common.h"))
    x = _heavy_tailed((8, 128), mx.float32, seed=11)
    signs = rotation.random_signs(seed=0, dim=128)
    want_codes, _ = ref_quantize(x, signs, 4, 32)
    try:
        codes, _ = emu_launch(
            broken, inputs=[x, signs, 1.0 / math.sqrt(128)],
            template=[("T", mx.float32), ("D", 128), ("BITS", 4), ("GROUP", 32), ("ROTATE", True),
                      ("ROWS", 4)],
            grid=(32, 8, 1), threadgroup=(32, 4, 1), output_shapes=[(8, 16), (8, 4)],
            output_dtypes=[mx.uint32, mx.float16])
    except MetalEmuError:
        return
    assert not mx.array_equal(codes, want_codes)


# ---------------------------------------------------------------- dequantize

def _dequant_cases():
    """Every (bits, group) pair, d and dtype rotating, un-rotation on every other case."""
    cases = []
    for n, (bits, g) in enumerate(itertools.product(codec.SUPPORTED_BITS, codec.SUPPORTED_GROUP_SIZES)):
        d = DIMS[n % 3] if DIMS[n % 3] % g == 0 else 256
        cases.append((d, bits, g, DTYPES[(n // 3 + n) % 3], n % 2 == 0))
    return cases


@pytest.mark.parametrize("d, bits, group_size, dtype, unrotate", _dequant_cases())
def test_dequantize_bit_exact(metal_emulator, d, bits, group_size, dtype, unrotate):
    y = _heavy_tailed((3, 5, d), mx.float32, seed=bits * group_size)
    y[0, 0, :group_size] = 0.0
    codes, scales = codec.quantize(y, bits, group_size)
    signs = rotation.random_signs(seed=5, dim=d) if unrotate else None
    out = kernel_dequantize(codes, scales, bits=bits, group_size=group_size, dtype=dtype, signs=signs)
    _assert_bit_exact(out, ref_dequantize(codes, scales, bits, group_size, dtype, signs), "values")


def test_dequantize_nan_scale(metal_emulator):
    y = _heavy_tailed((4, 128), mx.float32, seed=2)
    y[1, 70] = mx.nan
    codes, scales = codec.quantize(y, 4, 32)
    out = np.array(kernel_dequantize(codes, scales, bits=4, group_size=32))
    assert np.isnan(out[1, 64:96]).all()
    assert np.isfinite(np.delete(out, 1, axis=0)).all() and np.isfinite(out[1, :64]).all()


# ---------------------------------------------------------------- decode attention

def _filled_cache(cfg, *, B=1, n_kv=2, d=128, T=200, L=1, dtype=mx.float16, seed=0):
    """A cache after a prompt of T - L tokens and one step of L tokens."""
    cache = OIQKVCache(cfg)
    k = _heavy_tailed((B, n_kv, T, d), dtype, seed=seed)
    v = mx.random.normal((B, n_kv, T, d), key=mx.random.key(seed + 1)).astype(dtype)
    if T > L:
        cache.update_and_fetch(k[:, :, : T - L], v[:, :, : T - L])
    cache.update_and_fetch(k[:, :, T - L:], v[:, :, T - L:])
    return cache


def _rotated_queries(cache, B, n_q, L, d, seed=9):
    q = mx.random.normal((B, n_q, L, d), key=mx.random.key(seed))
    return rotation.rotate(q * d ** -0.5, cache.k.signs)


def _full_mask(mask, B, n_q, L, T):
    """The mask as a float64 additive (B, n_q, L, T) array (-inf where masked)."""
    if mask is None:
        return np.zeros((B, n_q, L, T))
    if isinstance(mask, str):
        keep = np.arange(T)[None, :] <= np.arange(T - L, T)[:, None]
        return np.broadcast_to(np.where(keep, 0.0, -np.inf), (B, n_q, L, T))
    m = np.broadcast_to(np.array(mask), (B, n_q, L, T))
    return np.where(m, 0.0, -np.inf) if m.dtype == np.bool_ else m.astype(np.float64)


def truth_attention(q, cache, mask, sinks):
    """float64 attention over exactly the stored (dequantized) rotated values."""
    sink_k, sink_v, quant, recent_k, recent_v = cache.segments()
    gs = cache.config.group_size
    ks, vs = [], []
    if sink_k is not None:
        ks.append(sink_k), vs.append(sink_v)
    if quant is not None:
        ks.append(codec.dequantize(*quant[:2], cache.k.bits, gs))
        vs.append(codec.dequantize(*quant[2:], cache.v.bits, gs))
    if recent_k is not None:
        ks.append(recent_k), vs.append(recent_v)
    K = np.concatenate([np.array(a.astype(mx.float32)) for a in ks], axis=2).astype(np.float64)
    V = np.concatenate([np.array(a.astype(mx.float32)) for a in vs], axis=2).astype(np.float64)
    B, n_q, L, _ = q.shape
    rep = n_q // K.shape[1]
    K, V = np.repeat(K, rep, axis=1), np.repeat(V, rep, axis=1)
    s = np.einsum("bhld,bhtd->bhlt", np.array(q).astype(np.float64), K) + _full_mask(mask, B, n_q, L, K.shape[2])
    if sinks is not None:  # (n_q,) or per query row (B, n_q, L)
        sl = np.array(sinks).astype(np.float64)
        sl = np.broadcast_to(sl[None, :, None, None] if sl.ndim == 1 else sl[..., None], (B, n_q, L, 1))
        s = np.concatenate([sl, s], axis=-1)
    p = np.exp(s - s.max(-1, keepdims=True))
    p = p / p.sum(-1, keepdims=True)
    if sinks is not None:
        p = p[..., 1:]
    return np.einsum("bhlt,bhtd->bhld", p, V)


def _check_attention(cache, q, mask=None, sinks=None, keys_per_part=None):
    cfg = cache.config
    out = decode_attention(q, segments=cache.segments(), k_bits=cfg.k_bits, v_bits=cfg.v_bits,
                           group_size=cfg.group_size, mask=mask, sinks=sinks, keys_per_part_=keys_per_part)
    ref = attention._decode_reference(q, cache, mask, sinks)
    truth = truth_attention(q, cache, mask, sinks)
    assert out.shape == ref.shape and out.dtype == mx.float32
    err = np.abs(np.array(out) - truth).max()
    ref_err = np.abs(np.array(ref) - truth).max()
    # Both accumulate in float32 over <= a few thousand keys of O(1) outputs: ~1e-7 each.
    assert err <= 2 * ref_err + 2e-6, (err, ref_err)
    return out


ATTENTION_CASES = [
    # (n_kv, rep, L, d, k_bits, v_bits, group, dtype, mask)
    (2, 1, 1, 128, 4, 4, 32, mx.float16, None),
    (2, 3, 1, 64, 3, 2, 64, mx.bfloat16, None),
    (1, 8, 1, 256, 8, 5, 128, mx.float32, None),
    (2, 3, 2, 128, 4, 6, 32, mx.float16, "causal"),
    (1, 1, 8, 64, 5, 3, 32, mx.float32, "causal"),
    (1, 8, 8, 64, 2, 8, 32, mx.float16, "causal"),
]


@pytest.mark.parametrize("n_kv, rep, L, d, k_bits, v_bits, group_size, dtype, mask", ATTENTION_CASES)
def test_decode_attention_matches_reference(metal_emulator, n_kv, rep, L, d, k_bits, v_bits, group_size,
                                            dtype, mask):
    cfg = OIQConfig(k_bits=k_bits, v_bits=v_bits, group_size=group_size, sink_tokens=4, window=16)
    cache = _filled_cache(cfg, n_kv=n_kv, d=d, T=150, L=L, dtype=dtype, seed=rep)
    _check_attention(cache, _rotated_queries(cache, 1, n_kv * rep, L, d), mask)


@pytest.mark.parametrize("T, keys_per_part", [(1, None), (3, None), (20, 32), (33, 32), (95, 32), (96, 32),
                                              (97, 32), (700, None), (2049, None)])
def test_decode_attention_context_lengths_and_splits(metal_emulator, T, keys_per_part):
    # Sinks only (T <= 4), sinks + recent (T <= 20), all three segments; slices whose
    # boundaries fall inside and on the edges of segments; the automatic split.
    cfg = OIQConfig(k_bits=4, v_bits=4, group_size=32, sink_tokens=4, window=16)
    cache = _filled_cache(cfg, n_kv=2, d=128, T=T, dtype=mx.float16, seed=T)
    _check_attention(cache, _rotated_queries(cache, 1, 2, 1, 128), keys_per_part=keys_per_part)


def test_decode_attention_quantized_only(metal_emulator):
    cfg = OIQConfig(k_bits=4, v_bits=4, group_size=32, sink_tokens=0, window=0, trim_reserve=0)
    cache = _filled_cache(cfg, n_kv=2, d=128, T=77, dtype=mx.float16)
    sink_k, _, quant, recent_k, _ = cache.segments()
    assert sink_k is None and recent_k is None and quant is not None
    _check_attention(cache, _rotated_queries(cache, 1, 2, 1, 128), keys_per_part=32)


@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_decode_attention_array_masks(metal_emulator, kind):
    # Batch of 2 with left padding on the second sequence, L = 2, per-head-broadcast mask.
    cfg = OIQConfig(k_bits=4, v_bits=4, group_size=32, sink_tokens=4, window=16)
    B, n_kv, rep, L, T = 2, 2, 3, 2, 120
    cache = _filled_cache(cfg, B=B, n_kv=n_kv, d=128, T=T, L=L, dtype=mx.float16)
    pad = mx.array([0, 37])[:, None, None, None]
    t = mx.arange(T)[None, None, None, :]
    keep = (t >= pad) & (t <= mx.arange(T - L, T)[None, None, :, None])
    mask = keep if kind == "bool" else mx.where(keep, 0.0, -1e9).astype(mx.float16) + 0.25 * (t % 3 == 0)
    _check_attention(cache, _rotated_queries(cache, B, n_kv * rep, L, 128), mask)


def test_decode_attention_sinks(metal_emulator):
    cfg = OIQConfig(k_bits=4, v_bits=4, group_size=32, sink_tokens=4, window=16, center_keys=False)
    cache = _filled_cache(cfg, n_kv=2, d=128, T=150, dtype=mx.float16)
    sinks = mx.array([0.5, 3.0, -1.0, 8.0, 0.0, 2.0])
    _check_attention(cache, _rotated_queries(cache, 1, 6, 1, 128), sinks=sinks)


def test_dispatch_sinks_with_centered_keys(kernels_on):
    # Centered keys shift every score by -q.mean: the sink logit must be shifted too.
    cfg = OIQConfig(k_bits=4, v_bits=4, group_size=32, sink_tokens=4, window=16, center_keys=True)
    cache = _filled_cache(cfg, n_kv=2, d=128, T=150, L=2, dtype=mx.float16)
    q = _rotated_queries(cache, 1, 6, 2, 128)
    sinks = mx.array([0.5, 3.0, -1.0, 8.0, 0.0, 2.0])
    out = dispatch.decode_attention_kernel(cache, q, "causal", sinks)
    shifted = sinks.reshape(1, 6, 1) - mx.sum(
        q.reshape(1, 2, 3, 2, 128) * mx.expand_dims(cache.k.mean, 2), axis=-1).reshape(1, 6, 2)
    truth = truth_attention(q, cache, "causal", shifted)
    ref = attention._decode_reference(q, cache, "causal", sinks)
    ref_err = np.abs(np.array(ref) - truth).max()
    assert ref_err < 1e-5  # the reference shifts the sink logit the same way
    assert np.abs(np.array(out) - truth).max() <= 2 * ref_err + 2e-6


def test_decode_attention_nan_group_shows(metal_emulator):
    cfg = OIQConfig(k_bits=4, v_bits=4, group_size=32, sink_tokens=4, window=16)
    cache = _filled_cache(cfg, n_kv=1, d=128, T=100, dtype=mx.float32)
    cache.k.scales[0, 0, 10, 1] = mx.nan
    q = _rotated_queries(cache, 1, 1, 1, 128)
    out = decode_attention(q, segments=cache.segments(), k_bits=4, v_bits=4, group_size=32)
    assert np.isnan(np.array(out)).all()
    assert np.isnan(np.array(attention._decode_reference(q, cache, None, None))).all()


# ---------------------------------------------------------------- dispatch

@pytest.fixture
def kernels_on(metal_emulator, monkeypatch):
    """Pretend Metal is here: dispatch picks kernels, which run on the emulator."""
    monkeypatch.setattr(dispatch, "kernels_enabled", lambda: True)
    calls = []
    real = _launch.launch

    def counting(kernel, **kwargs):
        calls.append(kernel)
        return real(kernel, **kwargs)

    monkeypatch.setattr(_launch, "launch", counting)
    return calls


def test_dispatch_reference_without_metal(monkeypatch):
    assert not dispatch.kernels_enabled()  # Linux / CPU
    monkeypatch.setattr(mx.metal, "is_available", lambda: True)
    monkeypatch.setattr(mx, "default_device", lambda: mx.gpu)
    assert dispatch.kernels_enabled()
    monkeypatch.setenv("OIQ_MLX_FORCE_REFERENCE", "1")
    assert not dispatch.kernels_enabled()


def test_dispatch_without_metal_returns_none_and_reference():
    cfg = OIQConfig()
    cache = _filled_cache(cfg, T=60)
    q = _rotated_queries(cache, 1, 2, 1, 128)
    assert dispatch.decode_attention_kernel(cache, q, None, None) is None
    x = _heavy_tailed((3, 128), mx.float32, seed=0)
    assert dispatch.quantize_kernel(x, 4, 32) is None
    codes, scales = dispatch.quantize(x, 4, 32)
    assert mx.array_equal(codes, codec.quantize(x, 4, 32)[0])


def test_dispatch_codec_uses_kernels_and_falls_back(kernels_on):
    signs = rotation.random_signs(seed=0, dim=128)
    x = _heavy_tailed((3, 2, 128), mx.float16, seed=4)
    codes, scales = dispatch.quantize(x, 4, 32, signs=signs)
    assert len(kernels_on) == 1
    want = ref_quantize(x, signs, 4, 32)
    assert mx.array_equal(codes, want[0]) and mx.array_equal(scales, want[1])
    out = dispatch.dequantize(codes, scales, 4, 32, dtype=mx.float16, signs=signs)
    assert len(kernels_on) == 2
    assert mx.array_equal(out, ref_dequantize(codes, scales, 4, 32, mx.float16, signs))
    # Not served: a non-power-of-two head (96) and clip=True take the reference path.
    y96 = _heavy_tailed((3, 96), mx.float32, seed=1)
    assert mx.array_equal(dispatch.quantize(y96, 4, 32)[0], codec.quantize(y96, 4, 32)[0])
    assert mx.array_equal(dispatch.quantize(x, 4, 32, clip=True)[0], codec.quantize(x, 4, 32, clip=True)[0])
    assert len(kernels_on) == 2


@pytest.mark.parametrize("L, mask", [(1, None), (3, "causal")])
def test_oiq_attention_through_kernels(kernels_on, monkeypatch, L, mask):
    """attention.oiq_attention with the kernel path equals its reference path."""
    cfg = OIQConfig(k_bits=4, v_bits=3, group_size=32, sink_tokens=4, window=16)
    cache = _filled_cache(cfg, n_kv=2, d=128, T=90, L=L, dtype=mx.float16)
    assert kernels_on  # the cache quantized its rows through the quantize kernel
    kernels_on.clear()
    queries = mx.random.normal((1, 6, L, 128), key=mx.random.key(3)).astype(mx.float16)
    out = attention.oiq_attention(queries, cache, 128 ** -0.5, mask=mask)
    assert len(kernels_on) == 2  # attention + merge
    monkeypatch.setattr(dispatch, "kernels_enabled", lambda: False)
    ref = attention.oiq_attention(queries, cache, 128 ** -0.5, mask=mask)
    # Both end in a float16 rounding of the output: one half-ulp at |out| < 1 each.
    assert mx.abs(out.astype(mx.float32) - ref.astype(mx.float32)).max().item() <= 2e-3


@pytest.mark.parametrize("rotation_kind", ["hadamard", "none"])
def test_dispatch_fused_unrotation_with_value_mean(kernels_on, rotation_kind):
    cfg = OIQConfig(k_bits=4, v_bits=4, group_size=32, sink_tokens=4, window=16, center_values=True,
                    rotation=rotation_kind)
    cache = _filled_cache(cfg, n_kv=2, d=64, T=120, dtype=mx.float32)
    q = _rotated_queries(cache, 1, 4, 1, 64)
    out = dispatch.decode_attention_kernel(cache, q, None, None, unrotate=True)
    mean = mx.repeat(cache.v.mean, 2, axis=1)
    ref = cache.v.unrotate(attention._decode_reference(q, cache, None, None) + mean)
    m = np.array(rotation.rotation_matrix(cache.v.signs)).astype(np.float64) if cache.v.rotated else np.eye(64)
    truth = (truth_attention(q, cache, None, None) + np.array(mean)) @ m.T
    ref_err = np.abs(np.array(ref) - truth).max()
    assert np.abs(np.array(out) - truth).max() <= 2 * ref_err + 1e-6


def test_dispatch_declines_unsupported_attention(kernels_on):
    cfg = OIQConfig(k_bits=4, v_bits=4, group_size=32)
    cache = _filled_cache(cfg, n_kv=1, d=96, T=50)
    q = _rotated_queries(cache, 1, 1, 1, 96)
    assert dispatch.decode_attention_kernel(cache, q, None, None) is None
    assert not kernels_on  # d = 96 is not a power of two: the quantize kernel declined too
    cache = _filled_cache(cfg, n_kv=1, d=64, T=50)
    kernels_on.clear()
    q = _rotated_queries(cache, 1, 1, 9, 64)
    assert dispatch.decode_attention_kernel(cache, q, "causal", None) is None
    assert not kernels_on


# ---------------------------------------------------------------- scripts/check_metal.py

@pytest.mark.skipif(mx.metal.is_available(), reason="this machine has Metal")
def test_check_metal_script_exits_without_metal():
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "check_metal.py")], capture_output=True,
                       text=True, env=env, timeout=120)
    assert r.returncode != 0
    assert "Metal" in r.stderr and "not available" in r.stderr
