"""The fused Metal kernels, run on the CPU Metal emulator, against the reference codec and attention.

Packed codes and scales must be bit-exact (the kernels perform the reference's float
operations in the same order, Walsh-Hadamard butterflies included).  Attention is compared
with a float64 evaluation over the exact stored values: the kernel's error must be at most
twice the reference path's (also float32) plus a small atol.  Both compute in float32, so a
correct kernel errs by about as much as the reference; the factor 2 and the atol leave room
for its different (equally valid) summation order, while a real bug errs by far more.

Every template instantiation compiles once (~1-2 s with g++); the sweeps below are chosen so
that each template argument value, and each (d, bits, group) triple, occurs while the count of
distinct instantiations stays near 90.
"""

import copy
import itertools
import os
import subprocess
import sys
import traceback
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from metal_emu import MetalEmuError, emulator, use_emulator
from oiq_mlx.cache import attention
from oiq_mlx.core import codec, rotation
from oiq_mlx.kernels import dispatch
from oiq_mlx.bench import trace
from oiq_mlx.cache.sequence import OIQKVCache
from oiq_mlx.cache.common import halves
from oiq_mlx.core.config import OIQConfig
from oiq_mlx.kernels import launcher as _launch, source as _source
from oiq_mlx.kernels.source import SUPPORTED_DIMS
from oiq_mlx.kernels.decode_attention import decode_attention, fast_exp_relative_bound, query_rows_per_chunk
from oiq_mlx.kernels.instantiations import DTYPES as KERNEL_DTYPES
from oiq_mlx.kernels.instantiations import MASK_MODES, QUERY_ROWS, codec_params, production_instantiations
from oiq_mlx.kernels.dequantize import dequantize as kernel_dequantize
from oiq_mlx.kernels.quantize import quantize as kernel_quantize
from oiq_mlx.kernels.quantize import quantize_rows as kernel_quantize_rows

REPO = Path(__file__).resolve().parents[2]
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


def _assert_rows_bit_exact(got, want, code_words, what):
    """Packed rows (codec.join_rows) the same bit for bit, except that a NaN scale matches any NaN:
    MLX's CPU float32 -> float16 conversion makes NaN 0x7d00, the kernel 0x7e00."""
    assert got.dtype == want.dtype == mx.uint32 and got.shape == want.shape, (what, got.dtype, got.shape)
    g16, w16 = np.array(got).view(np.uint16), np.array(want).view(np.uint16)  # low half first
    scale_half = np.arange(g16.shape[-1]) >= 2 * code_words

    def nan(h):
        return ((h & 0x7C00) == 0x7C00) & ((h & 0x3FF) != 0)

    bad = np.argwhere((g16 != w16) & ~(scale_half & nan(g16) & nan(w16)))
    assert bad.size == 0, f"{what}: {len(bad)} mismatched half-words, first {bad[:3].tolist()}: " \
        f"{[(hex(g16[tuple(i)]), hex(w16[tuple(i)])) for i in bad[:3]]}"


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


def _spec_rows(x, lam, signs, bits, group_size, clip, align=False):
    """The specification of a packed row: codec.quantize(rotate(x / lam, signs), clip=clip, align=align)."""
    y = x.astype(mx.float32)
    return codec.quantize(rotation.rotate(y if lam is None else y / lam, signs), bits, group_size, clip=clip,
                          align=align)


@pytest.mark.parametrize("preset", ["4bit", "3bit", "2bit", "3bit:key_alignment=0", "2bit:key_alignment=0.5"])
@pytest.mark.parametrize("d, dtype", [(64, mx.float16), (128, mx.bfloat16), (32, mx.float32), (256, mx.float16)])
def test_fused_quantize_rows_bit_exact(metal_emulator, preset, d, dtype):
    """The production packing pass (key scales, per-side signs, Walsh-Hadamard, abs-max or the
    MSE clip search, rounding, aligned scales of each side's own alignment, packing) in one
    kernel, keys and values stacked as the cache stacks them: codes and scales bit-exact
    against the reference codec for every preset."""
    name, _, override = preset.partition(":")
    cfg = OIQConfig.preset(name, **({override.split("=")[0]: float(override.split("=")[1])} if override else {}))
    B, H, n = 1, 3, 16
    k = _heavy_tailed((B, H, n, d), dtype, seed=d)
    v = mx.random.normal((B, H, n, d), key=mx.random.key(d)).astype(dtype)
    lam = 1.0 + mx.abs(mx.random.normal((B, H, 1, d), key=mx.random.key(3))) ** 2
    ks, vs = rotation.random_signs(1, d), rotation.random_signs(2, d)
    codes, scales = kernel_quantize_rows(mx.stack([k, v]), bits=cfg.k_bits, group_size=cfg.group_size,
                                         clip=cfg.clip, lam=mx.stack([lam, mx.ones_like(lam)]),
                                         signs=mx.stack([ks, vs]).reshape(2, 1, 1, 1, d), rotate=True,
                                         align=cfg.scale_alignment)
    for i, (x, l_, s_) in enumerate(((k, lam, ks), (v, None, vs))):
        want_codes, want_scales = _spec_rows(x, l_, s_, cfg.k_bits, cfg.group_size, cfg.clip,
                                             cfg.scale_alignment[i])
        _assert_bit_exact(codes[i], want_codes, f"codes side {i}")
        _assert_bit_exact(scales[i], want_scales, f"scales side {i}")


@pytest.mark.parametrize("clip, align", [(True, False), (True, True), (False, True), (True, 0.5), (False, 0.5)],
                         ids=["clip", "clip-aligned", "absmax-aligned", "clip-half-aligned", "absmax-half-aligned"])
@pytest.mark.parametrize("bits, group_size", [(2, 32), (3, 64), (4, 128), (8, 32), (5, 32), (6, 64)])
def test_fused_clip_search_bit_exact_and_non_finite(metal_emulator, bits, group_size, clip, align):
    """The clip search and the aligned scale (no rotation, no key scales), with ties, zeros, huge
    and non-finite groups: the candidate order and the summation orders match codec.quantize."""
    y = _heavy_tailed((7, 128), mx.float32, seed=bits)
    y[0, :64] = 0.0
    y[1, 3] = mx.nan
    y[2, 40] = mx.inf
    y[3, :] = 1e30
    y[4, :32] = mx.array([1.0, -1.0] * 16)  # equal errors for several candidates
    y[5, :] = 3e18  # y * y overflows float32: the aligned scale keeps the chosen one
    codes, scales = kernel_quantize_rows(y, bits=bits, group_size=group_size, lam=None, signs=mx.ones((128,)),
                                         rotate=False, clip=clip, align=align)
    want_codes, want_scales = codec.quantize(y, bits, group_size, clip=clip, align=align)
    _assert_bit_exact(codes, want_codes, "codes")
    _assert_bit_exact(scales, want_scales, "scales")


def _window_buffer(B, H, cap, d, dtype, seed):
    """A stacked window buffer ``(2, B, H, cap, d)`` and its per-side tables as the cache passes
    them: key scales ``(2, B, H, 1, d)`` (ones for values), signs ``(2, 1, 1, 1, d)``."""
    buf = mx.stack([_heavy_tailed((B, H, cap, d), dtype, seed=seed),
                    mx.random.normal((B, H, cap, d), key=mx.random.key(seed + 1)).astype(dtype)])
    lam = 1.0 + mx.abs(mx.random.normal((B, H, 1, d), key=mx.random.key(seed + 2))) ** 2
    lam = mx.stack([lam, mx.ones_like(lam)])
    signs = mx.stack([rotation.random_signs(1, d), rotation.random_signs(2, d)]).reshape(2, 1, 1, 1, d)
    mx.eval(buf, lam, signs)
    return buf, lam, signs


@pytest.mark.parametrize("preset", ["4bit", "3bit", "2bit"])
@pytest.mark.parametrize("d, group_size, dtype", [(64, 64, mx.float16), (64, None, mx.bfloat16),
                                                  (128, None, mx.float16), (128, 128, mx.float32)])
def test_fused_quantize_rows_joined_bit_exact(metal_emulator, preset, d, group_size, dtype):
    """joined=True writes codec.join_rows(codes, scales) directly, bit for bit (scale pairs in
    one word, low half first; one group per row leaves a zero high half), for every preset's
    bits and clip, reading a slice of a stacked window buffer in place; NaN groups included."""
    cfg = OIQConfig.preset(preset)
    g = group_size or cfg.group_size
    buf, lam, signs = _window_buffer(1, 3, 24, d, dtype, seed=d + g)
    buf[1, 0, 1, 9, 3] = mx.nan  # one value row: its first group's scale NaN, codes 0
    a, b = 5, 18
    rows = kernel_quantize_rows(buf[:, :, :, a:b], bits=cfg.k_bits, group_size=g, clip=cfg.clip, lam=lam,
                                signs=signs, rotate=True, joined=True, align=cfg.scale_alignment)
    w = codec.packed_width(d, cfg.k_bits)
    assert rows.dtype == mx.uint32 and rows.shape == (2, 1, 3, b - a, codec.row_width(d, cfg.k_bits, g))
    for i, lam_i in enumerate((lam[0], None)):
        want = codec.join_rows(*_spec_rows(buf[i, :, :, a:b], lam_i, signs[i].reshape(d), cfg.k_bits, g, cfg.clip,
                                           cfg.scale_alignment[i]))
        _assert_rows_bit_exact(rows[i], want, w, f"joined rows side {i}")
    with pytest.MonkeyPatch.context() as m:
        m.setattr(dispatch, "kernels_enabled", lambda: False)
        reference = dispatch.quantize_rows(buf[:, :, :, a:b], cfg.k_bits, g, clip=cfg.clip, lam=lam, signs=signs,
                                           joined=True, align=cfg.scale_alignment)
    _assert_rows_bit_exact(rows, reference, w, "joined rows against dispatch's reference path")
    # the rotation spreads the NaN over its row: every scale NaN, every code 0; other rows finite
    halves = np.array(rows)[..., w:].view(np.uint16)[..., : d // g] & 0x7FFF
    nan = halves > 0x7C00
    assert nan[1, 0, 1, 9 - a].all() and nan.sum() == d // g
    assert (np.array(rows[1, 0, 1, 9 - a, :w]) == 0).all()
    if (d // g) % 2:
        assert (np.array(rows[..., -1]) >> 16 == 0).all()  # the padding half


@pytest.mark.parametrize("joined", [False, True])
def test_quantize_rows_reads_strided_input_in_place(metal_emulator, joined):
    """A slice of the window buffer along the row axis (and a view whose last axis is not
    contiguous) gives what its contiguous copy gives."""
    d, bits, g = 128, 3, 32
    buf, lam, signs = _window_buffer(2, 2, 40, d, mx.float16, seed=4)

    def run(x):
        out = kernel_quantize_rows(x, bits=bits, group_size=g, clip=True, lam=lam, signs=signs, rotate=True,
                                   joined=joined)
        return out if joined else mx.concatenate([out[0], out[1].view(mx.uint32)], axis=-1)

    contiguous = mx.array(np.array(buf[:, :, :, 17:30]))
    want = run(contiguous)
    _assert_bit_exact(run(buf[:, :, :, 17:30]), want, "row slice")
    transposed = mx.array(np.ascontiguousarray(np.swapaxes(np.array(contiguous), -1, -2)))
    _assert_bit_exact(run(mx.swapaxes(transposed, -1, -2)), want, "last axis strided")


def test_quantize_rows_of_a_strided_slice_launches_only_the_kernel():
    """dispatch.quantize_rows(slice of the window buffer, joined=True): one kernel call whose
    inputs need no work (the slice reaches it as it is, not reshaped: a reshape of rows whose
    strides do not merge would copy), and its output is the kernel's own."""
    d, bits, g = 128, 4, 32
    buf, lam, signs = _window_buffer(1, 2, 32, d, mx.float16, seed=5)
    x = buf[:, :, :, 8:24]
    calls = []
    with trace.metal_kernels_selected(calls):
        rows = dispatch.quantize_rows(x, bits, g, lam=lam, signs=signs, clip=False, joined=True)
        graph = trace.launching_primitives([rows, *calls[0].inputs])
    assert len(calls) == 1 and graph == {}, graph
    assert calls[0].inputs[0].shape == x.shape
    assert rows.shape == (2, 1, 2, 16, codec.row_width(d, bits, g))


def test_cache_packs_through_the_fused_kernel(kernels_on):
    """With the kernels selected, a cache's packed rows come from one kernel call per block
    (keys and values together) and equal the reference path's."""
    cfg = OIQConfig.preset("3bit")
    x = _heavy_tailed((1, 2, 120, 64), mx.float16, seed=8)
    fused, reference = OIQKVCache(cfg), OIQKVCache(cfg)
    kernels_on.clear()
    fused.update_and_fetch(x, x + 1)
    fused.end_prefill()  # exact_prefill: the prompt is packed when generation starts
    assert len(kernels_on) == 1
    with pytest.MonkeyPatch.context() as m:
        m.setattr(dispatch, "kernels_enabled", lambda: False)
        reference.update_and_fetch(x, x + 1)
        reference.end_prefill()
    for a, b in ((fused.k, reference.k), (fused.v, reference.v)):
        _assert_bit_exact(a.codes[:, :, : fused.q_end - 4], b.codes[:, :, : fused.q_end - 4], "codes")
        _assert_bit_exact(a.scales[:, :, : fused.q_end - 4], b.scales[:, :, : fused.q_end - 4], "scales")


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
    """A cache after a prompt of T - L tokens and one step of L tokens (generation
    started: with exact_prefill the prompt is packed before the step)."""
    cache = OIQKVCache(cfg)
    k = _heavy_tailed((B, n_kv, T, d), dtype, seed=seed)
    v = mx.random.normal((B, n_kv, T, d), key=mx.random.key(seed + 1)).astype(dtype)
    if T > L:
        cache.update_and_fetch(k[:, :, : T - L], v[:, :, : T - L])
        cache.end_prefill()
    cache.update_and_fetch(k[:, :, T - L:], v[:, :, T - L:])
    return cache


def _queries(cache, B, n_q, L, d, seed=9):
    """Queries as the model gives them, in the cache dtype, as a transposed view (the layout
    of mlx-lm's attention: (B, L, H, d) swapped to (B, H, L, d))."""
    q = mx.random.normal((B, L, n_q, d), key=mx.random.key(seed)).astype(cache.dtype)
    return q.swapaxes(1, 2)


SCALE = {d: d ** -0.5 for d in (32, 64, 96, 128, 256)}


def _full_mask(mask, B, n_q, L, T):
    """The mask as a float64 additive (B, n_q, L, T) array (-inf where masked)."""
    if mask is None:
        return np.zeros((B, n_q, L, T))
    if isinstance(mask, str):
        keep = np.arange(T)[None, :] <= np.arange(T - L, T)[:, None]
        return np.broadcast_to(np.where(keep, 0.0, -np.inf), (B, n_q, L, T))
    m = np.broadcast_to(np.array(mask if mask.dtype == mx.bool_ else mask.astype(mx.float32)), (B, n_q, L, T))
    return np.where(m, 0.0, -np.inf) if m.dtype == np.bool_ else m.astype(np.float64)


def _reference(q, cache, mask, sinks, segments):
    """The reference path of attention.oiq_attention over ``segments``, float32."""
    return attention.reference_output(q, cache, SCALE[q.shape[-1]], mask, sinks, segments)


def truth_attention(q, cache, mask, sinks, segments=None):
    """float64 attention of the queries over exactly what ``segments`` hold (dequantized, back
    in the model's domain: un-rotated, key scales and means added back)."""
    sink_k, sink_v, quant, recent_k, recent_v = cache.segments() if segments is None else segments
    k, v, gs = cache.k, cache.v, cache.config.group_size
    ks, vs = [], []
    if sink_k is not None:
        ks.append(sink_k), vs.append(sink_v)
    if quant is not None:
        ks.append(k.packed_to_window(codec.dequantize(*quant[:2], k.bits, gs)))
        vs.append(v.packed_to_window(codec.dequantize(*quant[2:], v.bits, gs)))
    if recent_k is not None:
        ks.append(recent_k), vs.append(recent_v)
    K, V = (np.concatenate([np.array(a.astype(mx.float32)) for a in x], axis=2).astype(np.float64)
            for x in (ks, vs))
    if k.mean is not None:
        K = K + np.array(k.mean).astype(np.float64)
    if v.mean is not None:
        V = V + np.array(v.mean).astype(np.float64)
    B, n_q, L, d = q.shape
    rep = n_q // K.shape[1]
    K, V = np.repeat(K, rep, axis=1), np.repeat(V, rep, axis=1)
    s = np.einsum("bhld,bhtd->bhlt", np.array(q.astype(mx.float32)).astype(np.float64), K) * SCALE[d]
    s = s + _full_mask(mask, B, n_q, L, K.shape[2])
    if sinks is not None:  # (n_q,) or per query row (B, n_q, L)
        sl = np.array(sinks).astype(np.float64)
        sl = np.broadcast_to(sl[None, :, None, None] if sl.ndim == 1 else sl[..., None], (B, n_q, L, 1))
        s = np.concatenate([sl, s], axis=-1)
    p = np.exp(s - s.max(-1, keepdims=True))
    p = p / p.sum(-1, keepdims=True)
    if sinks is not None:
        p = p[..., 1:]
    return np.einsum("bhlt,bhtd->bhld", p, V)


def _kernel_attention(q, cache, mask=None, sinks=None, keys_per_part=None, segments=None, out_dtype=mx.float32):
    k, v, cfg = cache.k, cache.v, cache.config
    return decode_attention(q, scale=SCALE[q.shape[-1]], segments=cache.segments() if segments is None else segments,
                            k_bits=k.bits, v_bits=v.bits, group_size=cfg.group_size, k_lam=k.lam,
                            k_signs=k.signs if k.rotated else None, mask=mask, sinks=sinks, v_mean=v.mean,
                            v_signs=v.signs if v.rotated else None, keys_per_part_=keys_per_part,
                            out_dtype=out_dtype)


# half the spacing of float16 / bfloat16 values relative to the value (one rounding at the store),
# and the smallest spacing (float16 subnormals)
_STORE_ROUNDING = {mx.float32: (0.0, 0.0), mx.float16: (2.0 ** -11, 2.0 ** -25), mx.bfloat16: (2.0 ** -8, 0.0)}


def _check_attention(cache, q, mask=None, sinks=None, keys_per_part=None, segments=None, out_dtype=mx.float32):
    """The kernels (query preparation, both domains, merge with un-rotation and value mean)
    against the reference path, both against float64 attention over what the cache holds.
    Sinks here are passed as the kernel takes them (callers use center_keys=False).  An
    ``out_dtype`` below float32 adds one rounding of the result at the merge's store."""
    segments = cache.segments() if segments is None else segments
    out = _kernel_attention(q, cache, mask, sinks, keys_per_part, segments, out_dtype)
    ref = _reference(q, cache, mask, sinks, segments)
    truth = truth_attention(q, cache, mask, sinks, segments)
    assert out.shape == ref.shape and out.dtype == out_dtype
    got = np.array(out.astype(mx.float32))
    err = np.abs(got - truth)
    ref_err = np.abs(np.array(ref) - truth).max()
    # Both accumulate in float32 over <= a few thousand keys of O(1) outputs: ~1e-7 each.
    bound = 2 * ref_err + 2e-6
    rel, least = _STORE_ROUNDING[out_dtype]
    assert (err <= bound + rel * (np.abs(truth) + bound) + least).all(), (err.max(), ref_err)
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
    _check_attention(cache, _queries(cache, 1, n_kv * rep, L, d), mask)


@pytest.mark.parametrize("T, keys_per_part", [(1, None), (3, None), (20, 32), (33, 32), (95, 32), (96, 32),
                                              (97, 32), (700, None), (2049, None)])
def test_decode_attention_context_lengths_and_splits(metal_emulator, T, keys_per_part):
    # Sinks only (T <= 4), sinks + recent (T <= 20), all three segments; slices whose
    # boundaries fall inside and on the edges of segments; the automatic split.
    cfg = OIQConfig(k_bits=4, v_bits=4, group_size=32, sink_tokens=4, window=16)
    cache = _filled_cache(cfg, n_kv=2, d=128, T=T, dtype=mx.float16, seed=T)
    _check_attention(cache, _queries(cache, 1, 2, 1, 128), keys_per_part=keys_per_part)


def test_decode_attention_quantized_only(metal_emulator):
    cfg = OIQConfig(k_bits=4, v_bits=4, group_size=32, sink_tokens=0, window=0, trim_reserve=0)
    cache = _filled_cache(cfg, n_kv=2, d=128, T=77, dtype=mx.float16)
    sink_k, _, quant, recent_k, _ = cache.segments()
    assert sink_k is None and recent_k is None and quant is not None
    _check_attention(cache, _queries(cache, 1, 2, 1, 128), keys_per_part=32)


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
    _check_attention(cache, _queries(cache, B, n_kv * rep, L, 128), mask)


def test_decode_attention_sinks(metal_emulator):
    cfg = OIQConfig(k_bits=4, v_bits=4, group_size=32, sink_tokens=4, window=16, center_keys=False)
    cache = _filled_cache(cfg, n_kv=2, d=128, T=150, dtype=mx.float16)
    sinks = mx.array([0.5, 3.0, -1.0, 8.0, 0.0, 2.0])
    _check_attention(cache, _queries(cache, 1, 6, 1, 128), sinks=sinks)


@pytest.mark.parametrize("preset", ["4bit", "2bit"])
def test_kernel_path_against_float64_truth(kernels_on, monkeypatch, preset):
    """oiq_attention through the kernels and through the reference path, both against float64
    attention over what the cache holds (centered keys, key scales, value mean: 2bit)."""
    cache = _filled_cache(OIQConfig.preset(preset), n_kv=2, d=128, T=150, L=2, dtype=mx.float32)
    queries = mx.random.normal((1, 6, 2, 128), key=mx.random.key(5))
    truth = truth_attention(queries, cache, "causal", None)
    out = attention.oiq_attention(queries, cache, 128 ** -0.5, mask="causal")
    monkeypatch.setattr(dispatch, "kernels_enabled", lambda: False)
    ref = attention.oiq_attention(queries, cache, 128 ** -0.5, mask="causal")
    ref_err = np.abs(np.array(ref) - truth).max()
    assert ref_err < 1e-5
    assert np.abs(np.array(out) - truth).max() <= 2 * ref_err + 2e-6


def test_dispatch_sinks_with_centered_keys(kernels_on, monkeypatch):
    # Centered keys shift every score by -q.mean: the sink logit must be shifted too.
    cfg = OIQConfig(k_bits=4, v_bits=4, group_size=32, sink_tokens=4, window=16, center_keys=True)
    cache = _filled_cache(cfg, n_kv=2, d=128, T=150, L=2, dtype=mx.float32)
    queries = mx.random.normal((1, 6, 2, 128), key=mx.random.key(5))
    sinks = mx.array([0.5, 3.0, -1.0, 8.0, 0.0, 2.0])
    truth = truth_attention(queries, cache, "causal", sinks)
    kernels_on.clear()
    out = attention.oiq_attention(queries, cache, 128 ** -0.5, mask="causal", sinks=sinks)
    assert len(kernels_on) == 2
    monkeypatch.setattr(dispatch, "kernels_enabled", lambda: False)
    ref = attention.oiq_attention(queries, cache, 128 ** -0.5, mask="causal", sinks=sinks)
    ref_err = np.abs(np.array(ref) - truth).max()
    assert ref_err < 1e-5  # the reference shifts the sink logit the same way
    assert np.abs(np.array(out) - truth).max() <= 2 * ref_err + 2e-6


def _fast_exp_weight_errors(scores, kpp):
    """Per key, the bound of the relative error fast::exp puts on its weight, following pass 1's
    order (slices of kpp keys; a key below the running max: its own exp(s - m); a new max: exp(m -
    s) rescales every earlier key of the slice): each exp off by at most 4 + 2|x| ulp (Metal's
    3 + floor(2|x|), plus the emulator's one ulp of slack), an ulp of y = e^x being 2^(e-24)
    for y in [2^(e-1), 2^e)."""
    def rel(x):
        y = np.exp(x)
        return (4 + 2 * abs(x)) * np.ldexp(1.0, np.frexp(y)[1] - 24) / y

    log_rho = np.zeros(len(scores))
    for t0 in range(0, len(scores), kpp):
        m = -np.inf
        for t in range(t0, min(t0 + kpp, len(scores))):
            if scores[t] > m:
                if m > -np.inf:
                    log_rho[t0:t] += np.log1p(rel(m - scores[t]))
                m = scores[t]
            else:
                log_rho[t] += np.log1p(rel(scores[t] - m))
    return np.expm1(log_rho)


def _fast_exp_case(T=256, kpp=64, d=32, seed=3):
    """One query row over T float32 keys in slices of kpp, built against fast::exp: in each slice
    the even keys climb slowly (each one a new running max: a rescale of the slice so far) and
    the odd keys sit up to 2 below (weights from exps of arguments down to -2), and the first
    value channel follows the key's place in its slice, so that the errors, which grow towards
    a slice's start, do not cancel in the weighted sum.  Returns (segments, q, truth, bound): the
    float64 attention and, per channel, the bound of the deviation fast::exp may cause,
    ``max_i |v_i - o| * b / (1 - b)`` with ``b = sum_i w_i rho_i`` over this case's exps; that b
    is within the general ``fast_exp_relative_bound``."""
    rng = np.random.default_rng(seed)
    t = np.arange(T)
    pos = t % kpp
    s = np.where(t % 2 == 0, 0.004 * pos, 0.004 * pos - 2.0 * rng.random(T))
    k = np.zeros((1, 1, T, d), np.float32)
    k[0, 0, :, 0] = s / SCALE[d]
    v = rng.standard_normal((1, 1, T, d)).astype(np.float32)
    v[0, 0, :, 0] = pos / (kpp / 2) - 1.0
    q = np.zeros((1, 1, 1, d), np.float32)
    q[..., 0] = 1.0
    # the scores as pass 1 forms them: float32 (q * scale) * k, the other channels 0
    s32 = (np.float32(SCALE[d]) * k[0, 0, :, 0]).astype(np.float64)
    w = np.exp(s32 - s32.max())
    w /= w.sum()
    v64 = v[0, 0].astype(np.float64)
    o = w @ v64
    rho = _fast_exp_weight_errors(s32, kpp)
    b = float(w @ rho)
    assert b <= fast_exp_relative_bound(kpp, float(w @ (s32.max() - s32)))
    bound = (w * rho) @ np.abs(v64 - o) / (1 - b)
    segments = (None, None, None, mx.array(k), mx.array(v))
    return segments, mx.array(q), o, bound


def _fast_exp_run(monkeypatch, segments, q, kpp, mode):
    monkeypatch.setattr(emulator, "FAST_EXP", mode)
    out = decode_attention(q, scale=SCALE[q.shape[-1]], segments=segments, k_bits=4, v_bits=4, group_size=32,
                           keys_per_part_=kpp)
    return np.array(out)[0, 0, 0].astype(np.float64)


def _within_fast_exp_tolerance(out, exact, truth, bound):
    """The stated tolerance, per channel: twice the error of the same kernel with a correctly
    rounded exp, + 2.5e-7 (a few float32 ulps of these O(1) outputs: the two runs round their
    sums differently), + the fast::exp bound."""
    return (np.abs(out - truth) <= 2 * np.abs(exact - truth).max() + 2.5e-7 + bound).all()


@pytest.mark.parametrize("mode", [("hash", 1.0), ("up", 1.0), ("down", 1.0)])
def test_decode_attention_fast_exp_bound(metal_emulator, monkeypatch, mode):
    """With fast::exp off by Metal's documented bound (metal/README.md, "fast::exp"), the output
    stays within the stated tolerance of float64 attention; the systematic models move it."""
    kpp = 64
    segments, q, truth, bound = _fast_exp_case(kpp=kpp)
    exact = _fast_exp_run(monkeypatch, segments, q, kpp, ("exact", 1.0))
    out = _fast_exp_run(monkeypatch, segments, q, kpp, mode)
    assert not np.array_equal(out, exact)  # the model reached the kernel's exps
    assert np.abs(exact - truth).max() < 1e-6
    assert _within_fast_exp_tolerance(out, exact, truth, bound), (np.abs(out - truth) - bound).max()


def test_decode_attention_fast_exp_tolerance_can_fail(metal_emulator, monkeypatch):
    """An exp 4 times worse than Metal's documented fast-math bound breaks the tolerance of
    test_decode_attention_fast_exp_bound on the same case: the tolerance is not vacuous."""
    kpp = 64
    segments, q, truth, bound = _fast_exp_case(kpp=kpp)
    exact = _fast_exp_run(monkeypatch, segments, q, kpp, ("exact", 1.0))
    worse = _fast_exp_run(monkeypatch, segments, q, kpp, ("up", 4.0))
    assert not _within_fast_exp_tolerance(worse, exact, truth, bound)


def test_decode_attention_nan_group_shows(metal_emulator):
    cfg = OIQConfig(k_bits=4, v_bits=4, group_size=32, sink_tokens=4, window=16)
    cache = _filled_cache(cfg, n_kv=1, d=128, T=100, dtype=mx.float32)
    # one key group's scale NaN, written into the packed rows keys and values share
    codes, scales = codec.split_rows(cache._kv_rows, 128, 4, 32)
    scales = mx.array(np.array(scales))
    scales[0, 0, 0, 10, 1] = mx.nan
    cache._kv_rows = codec.join_rows(mx.contiguous(codes), scales)
    cache.k.rows, cache.v.rows = halves(cache._kv_rows)
    cache._views = None  # what the cache does whenever it writes packed rows
    assert np.isnan(np.array(cache.k.scales[0, 0, 10, 1])) and not np.isnan(np.array(cache.v.scales)).any()
    q = _queries(cache, 1, 1, 1, 128)
    out = _kernel_attention(q, cache)
    assert np.isnan(np.array(out)).all()
    assert np.isnan(np.array(_reference(q, cache, None, None, cache.segments()))).all()


# ---------------------------------------------------------------- dispatch

@pytest.fixture
def kernels_on(metal_emulator, monkeypatch):
    """Pretend Metal is here: dispatch picks kernels, which run on the emulator (without the
    first-use self-test, whose launches would count here: tests/kernels/test_selftest.py)."""
    monkeypatch.setattr(dispatch, "kernels_enabled", lambda: True)
    monkeypatch.setenv("OIQ_MLX_KERNELS", "kernels")
    calls = []
    real = _launch.launch

    def counting(kernel, **kwargs):
        calls.append(kernel)
        return real(kernel, **kwargs)

    monkeypatch.setattr(_launch, "launch", counting)
    return calls


NO_METAL = pytest.mark.skipif(mx.metal.is_available(), reason="asserts the behaviour of a machine without Metal")


@NO_METAL
def test_dispatch_reference_without_metal(monkeypatch):
    assert not dispatch.kernels_enabled()  # Linux / CPU
    monkeypatch.setattr(mx.metal, "is_available", lambda: True)
    monkeypatch.setattr(mx, "default_device", lambda: mx.gpu)
    assert dispatch.kernels_enabled()
    monkeypatch.setenv("OIQ_MLX_FORCE_REFERENCE", "1")
    assert not dispatch.kernels_enabled()


@NO_METAL
def test_dispatch_without_metal_returns_none_and_reference():
    cfg = OIQConfig()
    cache = _filled_cache(cfg, T=60)
    q = _queries(cache, 1, 2, 1, 128)
    assert attention.decode_attention_kernel(cache, q, SCALE[128], None, None) is None
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


@pytest.mark.parametrize("L", [1, 3, 8])
def test_positional_call_through_kernels(kernels_on, monkeypatch, L):
    """``positional``: a call that packs rows its queries attend (a block leaves the window
    during the call) reads them through the decode kernels with the per-query mask, as the
    reference path does."""
    cfg = OIQConfig(k_bits=4, v_bits=4, sink_tokens=4, window=16, positional=True)
    d, T = 128, 52  # packed_end moves from 20 to 36 with the last token of the call
    k = _heavy_tailed((1, 2, T, d), mx.float16, seed=5)
    v = mx.random.normal((1, 2, T, d), key=mx.random.key(6)).astype(mx.float16)
    cache = OIQKVCache(cfg)
    cache.update_and_fetch(k[:, :, : T - L], v[:, :, : T - L])
    cache.release_fresh()
    before = copy.deepcopy(cache)
    q = _queries(cache, 1, 6, L, d)
    mask = "causal" if L > 1 else None
    cache.update_and_fetch(k[:, :, T - L :], v[:, :, T - L :])
    assert cache.q_end > cache._attend_from  # the call packed rows its queries attend
    kernels_on.clear()
    out = attention.oiq_attention(q, cache, SCALE[d], mask=mask)
    assert len(kernels_on) == 2  # attention + merge
    monkeypatch.setattr(dispatch, "kernels_enabled", lambda: False)
    single = copy.deepcopy(before)
    before.update_and_fetch(k[:, :, T - L :], v[:, :, T - L :])
    ref = attention.oiq_attention(q, before, SCALE[d], mask=mask)
    assert mx.abs(out.astype(mx.float32) - ref.astype(mx.float32)).max().item() <= 2e-3
    # and each query sees what it sees in a call of its own token
    for i in range(L):
        single.update_and_fetch(k[:, :, T - L + i : T - L + i + 1], v[:, :, T - L + i : T - L + i + 1])
        one = attention.oiq_attention(q[:, :, i : i + 1], single, SCALE[d])
        assert mx.abs(out[:, :, i : i + 1].astype(mx.float32) - one.astype(mx.float32)).max().item() <= 2e-3


@pytest.mark.parametrize("rotation_kind", ["hadamard", "none"])
def test_dispatch_fused_unrotation_with_value_mean(kernels_on, rotation_kind):
    cfg = OIQConfig(k_bits=4, v_bits=4, group_size=32, sink_tokens=4, window=16, center_values=True,
                    rotation=rotation_kind)
    cache = _filled_cache(cfg, n_kv=2, d=64, T=120, dtype=mx.float32)
    q = _queries(cache, 1, 4, 1, 64)
    out = attention.decode_attention_kernel(cache, q, SCALE[64], None, None)
    truth = truth_attention(q, cache, None, None)
    ref_err = np.abs(np.array(_reference(q, cache, None, None, cache.segments())) - truth).max()
    assert np.abs(np.array(out) - truth).max() <= 2 * ref_err + 1e-6


def test_dispatch_declines_unsupported_attention(kernels_on):
    cfg = OIQConfig(k_bits=4, v_bits=4, group_size=32)
    cache = _filled_cache(cfg, n_kv=1, d=96, T=50)
    q = _queries(cache, 1, 1, 1, 96)
    assert attention.decode_attention_kernel(cache, q, SCALE[96], None, None) is None
    assert not kernels_on  # d = 96 is not a power of two: the quantize kernel declined too
    cache = _filled_cache(cfg, n_kv=1, d=64, T=50)
    kernels_on.clear()
    q = _queries(cache, 1, 1, 9, 64)
    assert attention.decode_attention_kernel(cache, q, SCALE[64], "causal", None) is None
    assert not kernels_on


# ---------------------------------------------------------------- scripts/check_metal.py

@NO_METAL
def test_check_metal_script_exits_without_metal():
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "check_metal.py")], capture_output=True,
                       text=True, env=env, timeout=120)
    assert r.returncode != 0
    assert "Metal" in r.stderr and "not available" in r.stderr


# ---------------------------------------------------------------- inputs MLX binds `constant`
# MLX declares an input of fewer than 8 elements `const constant T*`; Metal refuses to pass it
# where `const device T*` is declared.  These are the shapes where production meets that.

@pytest.mark.parametrize("preset", ["3bit", "2bit"])
def test_short_chat_before_anything_is_packed(kernels_on, preset):
    # Fewer tokens than sinks + window: nothing packed, so the packed inputs are one-vector
    # placeholders of d*bits/32 = 6 and 4 words at d = 64.
    cfg = OIQConfig.preset(preset)
    cache = _filled_cache(cfg, n_kv=1, d=64, T=12, L=1, dtype=mx.float16)
    assert cache.segments()[2] is None
    q = _queries(cache, 1, 3, 1, 64)
    kernels_on.clear()
    out = attention.decode_attention_kernel(cache, q, SCALE[64], None, None)
    assert len(kernels_on) == 2
    truth = truth_attention(q, cache, None, None)
    ref_err = np.abs(np.array(_reference(q, cache, None, None, cache.segments())) - truth).max()
    assert np.abs(np.array(out) - truth).max() <= 2 * ref_err + 2e-6


def test_one_packed_vector_of_one_head_at_2_bits(metal_emulator):
    # One KV head, d = 64, 2 bits, one packed token: codes (1, 1, 1, 4) and scales (1, 1, 1, 2).
    cfg = OIQConfig(k_bits=2, v_bits=2, group_size=32, sink_tokens=4, window=16)
    cache = _filled_cache(cfg, n_kv=1, d=64, T=60, dtype=mx.float32)
    sink_k, sink_v, quant, recent_k, recent_v = cache.segments()
    one = tuple(a[:, :, :1] for a in quant)
    assert one[0].size < 8 and one[1].size < 8
    _check_attention(cache, _queries(cache, 1, 2, 1, 64), segments=(sink_k, sink_v, one, recent_k,
                                                                             recent_v))
    codes, scales = one[0], one[1]
    out = kernel_dequantize(codes, scales, bits=2, group_size=32)
    _assert_bit_exact(out, codec.dequantize(codes, scales, 2, 32), "values")


@pytest.mark.parametrize("mask", [None, "causal"])
def test_head_dim_32(metal_emulator, mask):
    # d = 32: one value per lane, one group per vector (scales of 1 element, codes of d*b/32 words).
    cfg = OIQConfig(k_bits=3, v_bits=2, group_size=32, sink_tokens=4, window=16)
    cache = _filled_cache(cfg, n_kv=2, d=32, T=90, L=2 if mask else 1, dtype=mx.bfloat16)
    _check_attention(cache, _queries(cache, 1, 4, 2 if mask else 1, 32), mask)
    x = _heavy_tailed((3, 1, 32), mx.float16, seed=5)
    signs = rotation.random_signs(seed=3, dim=32)
    codes, scales = kernel_quantize(x, bits=3, group_size=32, signs=signs)
    want = ref_quantize(x, signs, 3, 32)
    _assert_bit_exact(codes, want[0], "codes")
    _assert_bit_exact(scales, want[1], "scales")


# ---------------------------------------------------------------- mutations
# Each broken variant of a kernel must make a kernel test fail: the tests can see these bugs.

def _quantize_check(d=128, bits=4, dtype=mx.float32, rotate=True):
    def check():
        x = _heavy_tailed((9, d), dtype, seed=11)
        signs = rotation.random_signs(seed=0, dim=d) if rotate else None
        codes, scales = kernel_quantize(x, bits=bits, group_size=32, signs=signs)
        want = ref_quantize(x, signs, bits, 32)
        _assert_bit_exact(codes, want[0], "codes")
        _assert_bit_exact(scales, want[1], "scales")
    return check


def _joined_check(d, group_size, bits=4):
    def check():
        x = _heavy_tailed((2, 5, d), mx.float16, seed=d)
        signs = rotation.random_signs(seed=0, dim=d)
        rows = kernel_quantize_rows(x, bits=bits, group_size=group_size, lam=None, signs=signs, rotate=True,
                                    clip=False, joined=True)
        _assert_rows_bit_exact(rows, codec.join_rows(*_spec_rows(x, None, signs, bits, group_size, False)),
                               codec.packed_width(d, bits), "rows")
    return check


def _dequantize_check(bits=3):
    def check():
        y = _heavy_tailed((5, 128), mx.float32, seed=2)
        codes, scales = codec.quantize(y, bits, 32)
        _assert_bit_exact(kernel_dequantize(codes, scales, bits=bits, group_size=32),
                          codec.dequantize(codes, scales, bits, 32), "values")
    return check


def _attention_check(mask=None, L=1, d=128, T=150, n_kv=2):
    def check():
        cfg = OIQConfig(k_bits=4, v_bits=4, group_size=32, sink_tokens=4, window=16)
        cache = _filled_cache(cfg, n_kv=n_kv, d=d, T=T, L=L, dtype=mx.float16)
        _check_attention(cache, _queries(cache, 1, 2 * n_kv, L, d), mask)
    return check


def _short_chat_check():
    cfg = OIQConfig.preset("2bit")
    cache = _filled_cache(cfg, n_kv=1, d=64, T=12, dtype=mx.float16)
    _check_attention(cache, _queries(cache, 1, 1, 1, 64))


MUTATIONS = {
    "no threadgroup_barrier": ("quantize.metal", "threadgroup_barrier(mem_flags::mem_threadgroup);", "",
                               _quantize_check()),
    "simd_max for simd_sum": ("decode_attention.metal", "score[j][i] = simd_sum(partial[j][i]);",
                              "score[j][i] = simd_max(partial[j][i]);", _attention_check()),
    "butterfly sign in registers": ("oiq_common.h", "x[j + h] = a - b;", "x[j + h] = b - a;",
                                    _quantize_check(d=128)),
    "butterfly sign across lanes": ("oiq_common.h", "x[e] = upper ? other - x[e] : x[e] + other;",
                                    "x[e] = upper ? x[e] - other : x[e] + other;", _quantize_check(d=64)),
    "pack mask one bit wide": ("oiq_common.h", "uint mask = (1u << bits) - 1u;", "uint mask = (2u << bits) - 1u;",
                               _dequantize_check()),
    "straddling bits dropped": ("quantize.metal", "(v >> uint(-off))", "0u", _quantize_check(bits=3)),
    "odd scale count not padded": ("quantize.metal", "(g + 1 < G ? bits_next : 0u)", "bits_next",
                                   _joined_check(d=64, group_size=64)),
    "scale pair swapped": ("quantize.metal", "bits_here | ((g + 1 < G ? bits_next : 0u) << 16)",
                           "(g + 1 < G ? bits_next : 0u) | (bits_here << 16)", _joined_check(d=128, group_size=32)),
    "causal mask off by one": ("decode_attention.metal", "s = tj <= T - L + qpos[i] ? s : -INFINITY;",
                               "s = tj < T - L + qpos[i] ? s : -INFINITY;", _attention_check("causal", L=3)),
    "new max without rescale": ("decode_attention.metal", "o[i][e] = o[i][e] * f + vv[j][e];",
                                "o[i][e] = o[i][e] + vv[j][e];", _attention_check()),
    "device pointer in oiq_unpack": ("oiq_common.h", "template <int E, typename P>\nMETAL_FUNC void oiq_unpack(P words",
                                     "template <int E>\nMETAL_FUNC void oiq_unpack(const device uint32_t* words",
                                     _short_chat_check),
}


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_mutated_kernel_fails_a_kernel_test(metal_emulator, monkeypatch, mutation):
    file, old, new, check = MUTATIONS[mutation]
    original = _source.metal_source
    assert original(file).count(old) == 1, f"{mutation}: the mutated text is not in {file}"
    check()  # the unmutated kernel passes
    monkeypatch.setattr(_source, "metal_source",
                        lambda name: original(name).replace(old, new) if name == file else original(name))
    _source.build_kernel.cache_clear()
    try:
        with pytest.raises((AssertionError, MetalEmuError)):
            check()
    finally:
        _source.build_kernel.cache_clear()


# ---------------------------------------------------------------- every production instantiation

def _instantiation_id(kernel, template):
    return kernel + "[" + ",".join(f"{k}={emulator._tname(v)}" for k, v in template) + "]"


PRODUCTION = production_instantiations()


def _sweep_quantize(d, dtype, _):
    for n, (bits, g) in enumerate(codec_params(d)):
        x = _heavy_tailed((3, 2, d), dtype, seed=bits + g)
        signs = rotation.random_signs(seed=bits, dim=d) if n % 2 == 0 else None
        codes, scales = kernel_quantize(x, bits=bits, group_size=g, signs=signs)
        want = ref_quantize(x, signs, bits, g)
        _assert_bit_exact(codes, want[0], f"codes {bits}b g{g}")
        _assert_bit_exact(scales, want[1], f"scales {bits}b g{g}")


def _sweep_dequantize(d, dtype, _):
    for n, (bits, g) in enumerate(codec_params(d)):
        y = _heavy_tailed((2, 3, d), mx.float32, seed=bits * g)
        codes, scales = codec.quantize(y, bits, g)
        signs = rotation.random_signs(seed=5, dim=d) if n % 2 else None
        out = kernel_dequantize(codes, scales, bits=bits, group_size=g, dtype=dtype, signs=signs)
        _assert_bit_exact(out, ref_dequantize(codes, scales, bits, g, dtype, signs), f"values {bits}b g{g}")


# (B, n_kv, rep, L) giving rep * L query rows for each QB; masks, sinks, value mean rotate.
_ROWS = {1: (2, 1, 1, 1), 2: (1, 2, 2, 1), 4: (1, 1, 2, 2), 8: (2, 1, 3, 2)}


def _sweep_attention(d, dtype, qb):
    i = SUPPORTED_DIMS.index(d) * 3 + KERNEL_DTYPES.index(dtype) + QUERY_ROWS.index(qb)
    bits = codec.SUPPORTED_BITS
    groups = [g for b, g in codec_params(d) if b == bits[0]]
    k_bits, g = bits[i % len(bits)], groups[(i // len(bits) + i) % len(groups)]  # every bits, every group
    v_bits = bits[(i * 5 + 1) % len(bits)]
    B, n_kv, rep, L = _ROWS[qb]
    assert query_rows_per_chunk(rep * L, d) == qb
    cfg = OIQConfig(k_bits=k_bits, v_bits=v_bits, group_size=g, sink_tokens=4, window=16,
                    center_values=i % 2 == 0, center_keys=False, key_scaling=0.5 * (i % 2),
                    rotation="none" if i % 5 == 4 else "hadamard")
    T = 70
    cache = _filled_cache(cfg, B=B, n_kv=n_kv, d=d, T=T, L=L, dtype=dtype, seed=i)
    q = _queries(cache, B, n_kv * rep, L, d, seed=i)
    t = mx.arange(T)[None, None, None, :]
    keep = t <= mx.arange(T - L, T)[None, None, :, None] - (i % 3)
    mask = [None, "causal", keep, mx.where(keep, 0.0, -1e4).astype(dtype)][i % 4]
    sinks = mx.linspace(-1.0, 2.0, n_kv * rep) if i % 3 == 0 else None
    _check_attention(cache, q, mask, sinks, out_dtype=dtype)  # the merge writes the queries' dtype


_SWEEPS = {"oiq_quantize": _sweep_quantize, "oiq_dequantize": _sweep_dequantize,
           "oiq_decode_attention": _sweep_attention}


@pytest.fixture(scope="module")
def production_run():
    """(launches, resources, failures) of every production sweep and of the packing pass with and
    without the clip search, key scales and joined rows (runtime values the sweeps leave out),
    recorded afresh: the tests below read what these launched, whichever tests ran before them.
    Each sweep checks its outputs against the reference; ``failures`` maps the id of each
    instantiation whose sweep raised to the traceback (test_production_instantiation reports it)."""
    failures = {}
    with pytest.MonkeyPatch.context() as m:
        use_emulator(m)
        m.setattr(emulator, "LAUNCHES", [])
        m.setattr(emulator, "RESOURCES", {})
        for kernel, template in PRODUCTION:
            if kernel in _SWEEPS:
                try:
                    _sweep(kernel, template)
                except Exception:
                    failures[_instantiation_id(kernel, template)] = traceback.format_exc()
        buf, lam, signs = _window_buffer(1, 2, 24, 64, mx.float16, seed=7)
        mx.eval(kernel_quantize_rows(buf, bits=4, group_size=32, clip=True, lam=lam, signs=signs, rotate=True,
                                     joined=True))
        return list(emulator.LAUNCHES), dict(emulator.RESOURCES), failures


@pytest.mark.parametrize("kernel, template", [p for p in PRODUCTION if p[0] in _SWEEPS],
                         ids=[_instantiation_id(*p) for p in PRODUCTION if p[0] in _SWEEPS])
def test_production_instantiation(production_run, kernel, template):
    """Each instantiation dispatch can request, against the reference (its sweep in
    production_run); the merge kernel runs with every attention case."""
    failure = production_run[2].get(_instantiation_id(kernel, template))
    assert failure is None, failure


def _sweep(kernel, template):
    t = dict(template)
    _SWEEPS[kernel](t["D"], t.get("T", t.get("OutT", t.get("FT"))), t.get("QB"))


def _launched(launches, kernel):
    return [r for r in launches if r["host"].startswith(f"custom_kernel_{kernel}_")]


def test_every_production_instantiation_ran(production_run):
    """Every instantiation dispatch can request ran under the emulator, with every runtime
    parameter value it takes (bits, groups, mask modes, merge flags, GQA, L, batch)."""
    launches, _, _ = production_run
    ran_ids = {_instantiation_id(k, r["template"]) for k in {p[0] for p in PRODUCTION} for r in _launched(launches, k)}
    missing = [_instantiation_id(*p) for p in PRODUCTION if _instantiation_id(*p) not in ran_ids]
    assert not missing, f"{len(missing)} production instantiations never ran: {missing}"

    def values(kernel, *idx):
        return {tuple(r["params"][i] for i in idx) for r in _launched(launches, kernel)}

    all_pairs = {(b, g) for d in SUPPORTED_DIMS for b, g in codec_params(d)}
    assert values("oiq_quantize", 0, 1) == all_pairs and values("oiq_quantize", 2) == {(0,), (1,)}
    assert values("oiq_quantize", 3) == {(0,), (1,)}                                           # clip search
    assert values("oiq_quantize", 7) == {(0,), (1,)}                                           # joined rows
    assert {r["params"][4] > 0 for r in _launched(launches, "oiq_quantize")} == {False, True}  # key scales
    assert values("oiq_dequantize", 0, 1) == all_pairs and values("oiq_dequantize", 2) == {(0,), (1,)}
    att = _launched(launches, "oiq_decode_attention")
    assert {(r["params"][8],) for r in att} == {(b,) for b in codec.SUPPORTED_BITS}          # k bits
    assert {(r["params"][9],) for r in att} == {(b,) for b in codec.SUPPORTED_BITS}          # v bits
    assert {r["params"][10] for r in att} == set(codec.SUPPORTED_GROUP_SIZES)
    assert {r["params"][11] for r in att} == set(MASK_MODES)
    assert max(r["params"][4] for r in att) > 1 and max(r["params"][5] for r in att) > 1    # GQA, L > 1
    assert any(r["grid"][2] > r["params"][3] * r["params"][7] for r in att)                   # batch > 1
    assert values("oiq_decode_merge", 6) == {(0,), (1,)}                                       # sinks
    assert values("oiq_decode_merge", 7) == {(0,), (1,)}                                       # value mean
    assert values("oiq_decode_merge", 8) == {(0,), (1,)}                                       # un-rotate
    assert {(r["params"][14], r["params"][15]) for r in att} >= {(0, 1), (1, 1), (0, 0)}     # key scales, rotation


def test_resources_of_production_instantiations(production_run):
    """Threadgroup memory and the per-thread state estimate of every production instantiation."""
    _, resources, _ = production_run
    rows = [r for r in resources.values() if r["kernel"].startswith("oiq_")]
    assert {(r["kernel"], r["template"]) for r in rows} == {
        (k, ", ".join(f"{a}={emulator._tname(v)}" for a, v in t)) for k, t in PRODUCTION}
    for r in rows:
        assert r["threadgroup_bytes"] <= 32768 and r["threads_per_threadgroup"] <= 1024, r
        assert r["private_bytes"] is not None and r["private_bytes"] > 0, r
    print("\n" + emulator.resource_table(rows))


def _poison_padding(st):
    """NaN in every row of a stacked batch's buffers that no sequence attends this step nor holds:
    the packed rows past each sequence's (scales all ones: float16 NaN) and its window rows outside
    [the q_end the step found, offset)."""
    s = st.config.sink_tokens
    start = st.attend_from
    for i, (q, r, o) in enumerate(zip(start, st.recent_start, st.offsets)):
        for rows in st.rows:
            rows[:, i : i + 1, :, st.q_end[i] - s :] = mx.array(0xFFFFFFFF, mx.uint32)
        st.recent[:, i : i + 1, :, : q - r] = mx.array(float("nan"), st.recent.dtype)
        st.recent[:, i : i + 1, :, o - r :] = mx.array(float("nan"), st.recent.dtype)
    st._views()
    st._segments = None


@pytest.mark.parametrize("preset, lengths", [(None, (30, 75, 140)), ("4bit", (34, 50, 66)), ("3bit", (34, 50, 66))],
                         ids=["K4V4-ragged", "4bit-in-phase", "3bit-in-phase"])
def test_stacked_batch_decode_through_kernels(kernels_on, preset, lengths):
    """A decode step of sequences of different lengths over storage stacked across them
    (oiq_mlx.cache.stacked) is one attention + one merge launch for the whole batch, and each
    sequence gets what the kernels give it alone: the kernel reads each sequence's own rows
    (its ranges), never the padding, which is NaN here.  Sequences in one phase pack their
    blocks together on the second step (one quantize launch per packed buffer, each with its
    own key scales) and store the codes each stores alone."""
    from oiq_mlx.cache.attention import oiq_batch_attention

    if preset is None:
        cfg = OIQConfig(k_bits=4, v_bits=4, group_size=32, sink_tokens=4, window=16)
    else:
        cfg = OIQConfig.preset(preset, sink_tokens=4, window=16, exact_prefill=0)
    d, n_kv = 128, 2
    alone, joined = [], []
    for i, n in enumerate(lengths):
        for group in (alone, joined):
            c = OIQKVCache(cfg)
            k = _heavy_tailed((1, n_kv, n, d), mx.float16, seed=i)
            v = mx.random.normal((1, n_kv, n, d), key=mx.random.key(i + 50)).astype(mx.float16)
            c.update_and_fetch(k, v)
            c.release_fresh()
            group.append(c)
    batch = OIQKVCache.merge(joined)
    for t in range(3):
        k = mx.random.normal((3, n_kv, 1, d), key=mx.random.key(100 + t)).astype(mx.float16)
        v = mx.random.normal((3, n_kv, 1, d), key=mx.random.key(200 + t)).astype(mx.float16)
        kernels_on.clear()
        batch.update_and_fetch(k, v)
        assert batch.stacked is not None
        q = mx.random.normal((3, 6, 1, d), key=mx.random.key(300 + t)).astype(mx.float16)
        if preset is not None and t == 1:
            assert len(kernels_on) == len(batch.stacked.rows)  # the three blocks: one quantize per buffer
        _poison_padding(batch.stacked)
        kernels_on.clear()
        out = oiq_batch_attention(q, batch, scale=SCALE[d])
        mx.eval(out)
        assert len(kernels_on) == 2  # attention + merge, for all three sequences
        for i, c in enumerate(alone):
            c.update_and_fetch(k[i : i + 1], v[i : i + 1])
            want = attention.oiq_attention(q[i : i + 1], c, SCALE[d])
            np.testing.assert_allclose(np.array(out[i : i + 1], np.float32), np.array(want, np.float32),
                                       atol=2e-3, rtol=2e-3)
    if preset is not None:  # the packed rows, bit for bit (the padding poisoned above is past them)
        packed = [[np.array(b[:, :, :, : c.q_end - cfg.sink_tokens]) for b in c.packed_buffers()] for c in alone]
        batch.unstack()
        for want, c in zip(packed, batch.caches):
            for w, b in zip(want, c.packed_buffers()):
                np.testing.assert_array_equal(np.array(b[:, :, :, : c.q_end - cfg.sink_tokens]), w)
