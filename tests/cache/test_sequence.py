"""OIQKVCache: attention correctness, storage, mlx-lm contract (tiny random models)."""

import json
import threading
import warnings

import mlx.core as mx
import numpy as np
import pytest
from helpers import reference_attention, tiny_gemma3, tiny_llama
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache, RotatingKVCache, load_prompt_cache, make_prompt_cache, save_prompt_cache

from oiq_mlx.cache import attention, reading
from oiq_mlx.mlx_lm import caches, routing
from oiq_mlx.cache.attention import oiq_attention
from oiq_mlx.cache.sequence import OIQKVCache
from oiq_mlx.core.codec import bytes_per_token, quantize
from oiq_mlx.core.config import OIQConfig
from oiq_mlx.mlx_lm.caches import end_prefill, make_oiq_cache


def _feed(cache, chunks, B, n_kv, d, n_q, seed=0, dv=None):
    """Append chunks of random K/V; yield (q, all_k, all_v, out) after each."""
    dv = dv or d
    ks, vs = [], []
    key = mx.random.key(seed)
    for i, L in enumerate(chunks):
        k1, k2, k3, key = mx.random.split(key, 4)
        k = mx.random.normal((B, n_kv, L, d), key=k1)
        v = mx.random.normal((B, n_kv, L, dv), key=k2)
        q = mx.random.normal((B, n_q, L, d), key=k3)
        ks.append(k), vs.append(v)
        if L == 1 or cache.offset + L > cache.config.exact_prefill:
            cache.end_prefill()  # as the call itself does first (exact_prefill)
        cache.w0 = max(cache.q_end, cache.config.sink_tokens)  # the window's start as the call finds it
        cache.update_and_fetch(k, v)
        out = oiq_attention(q, cache, d**-0.5, "causal" if L > 1 else None)
        yield q, mx.concatenate(ks, 2), mx.concatenate(vs, 2), out


CONFIGS = [
    OIQConfig(k_bits=8, v_bits=8),
    OIQConfig(k_bits=5, v_bits=3, key_scaling=0.5),
    OIQConfig(k_bits=4, v_bits=3, sink_tokens=0, window=0, center_keys=False),
    OIQConfig(k_bits=2, v_bits=5, sink_tokens=7, window=5, center_values=True, clip=True, trim_reserve=3),
    OIQConfig(k_bits=6, v_bits=4, group_size=64, quantize_after=40, window=3),
    OIQConfig.preset("3bit"),  # key scaling 0.5 capped at 2x, clipped and aligned scales
    OIQConfig.preset("2bit"),  # + value mean, window 128 (past the first chunks here)
    OIQConfig.preset("1.5bit", window=16),  # 1-bit values, keys' scales aligned half way
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"k{c.k_bits}v{c.v_bits}s{c.sink_tokens}w{c.window}")
@pytest.mark.parametrize("shape", [(1, 2, 6, 64), (2, 1, 3, 128), (1, 3, 3, 80)], ids=lambda s: f"B{s[0]}kv{s[1]}q{s[2]}d{s[3]}")
def test_attention_over_stored_kv(cfg, shape):
    """Attention equals fp32 attention over exactly what the cache stores for
    the rows packed before the call and over the exact keys/values of the rows
    the call found in the window and of its own, across growths of the packed
    buffer and the sink/window/quantize_after edges."""
    B, n_kv, n_q, d = shape
    cache = OIQKVCache(cfg)
    chunks = [3, 1, 2, 40, 1, 1, 300, 1, 8, 1]
    for L, (q, k, v, out) in zip(chunks, _feed(cache, chunks, B, n_kv, d, n_q)):
        kd, vd = cache.dequantized_kv()
        assert kd.shape == k.shape and vd.shape == v.shape
        w0 = cache.w0
        ref = reference_attention(q, mx.concatenate([kd[:, :, :w0], k[:, :, w0:]], 2),
                                  mx.concatenate([vd[:, :, :w0], v[:, :, w0:]], 2), d**-0.5)
        # fp32 throughout; the rotation round trip adds ~1e-6
        assert float(mx.abs(out - ref).max()) < 2e-4
        # and the stored K/V are close to the inputs, by a margin set by the bits
        tol = {8: 0.05, 6: 0.2, 5: 0.4, 4: 0.8, 3: 1.6, 2: 3.5, 1: 6.0}
        assert float(mx.abs(kd - k).max()) < tol[cfg.k_bits]
        assert float(mx.abs(vd - v).max()) < tol[cfg.v_bits]
    assert cache.offset == sum(chunks)
    if cache.q_end > cfg.sink_tokens:  # the packed buffer grew over the calls, in steps of one block
        cap, packed = cache.k.codes.shape[2], cache.q_end - cfg.sink_tokens
        assert cap % OIQKVCache.step == 0 and packed <= cap < packed + OIQKVCache.step, (cap, packed)


def test_full_precision_segments_are_exact():
    """Sinks and the recent window hold keys/values without loss."""
    cfg = OIQConfig(k_bits=2, v_bits=2, sink_tokens=4, window=8, exact_prefill=0)  # packed as written
    cache = OIQKVCache(cfg)
    for q, k, v, out in _feed(cache, [20, 1, 1], 1, 2, 4, 64):
        kd, vd = cache.dequantized_kv()
        for a, b in ((kd, k), (vd, v)):
            assert float(mx.abs(a[:, :, :4] - b[:, :, :4]).max()) < 1e-5
            assert float(mx.abs(a[:, :, -8:] - b[:, :, -8:]).max()) < 1e-5
            assert float(mx.abs(a[:, :, 4:-8] - b[:, :, 4:-8]).max()) > 0.05


def test_current_call_is_attended_in_full_precision():
    """A prompt longer than the window is quantized on write, but its own
    queries attend to its exact keys/values (prefill equals fp attention);
    the next call sees the stored, quantized version, and the full-precision
    copy is released once attention has read it (without exact_prefill, which keeps a
    prompt in full precision until generation starts: tests/cache/test_exact_prefill.py)."""
    cfg = OIQConfig(k_bits=2, v_bits=2, sink_tokens=4, window=8, exact_prefill=0)
    B, n_kv, n_q, d, L = 1, 2, 4, 64, 100
    k1, k2, k3, k4 = mx.random.split(mx.random.key(3), 4)
    k = mx.random.normal((B, n_kv, L, d), key=k1)
    v = mx.random.normal((B, n_kv, L, d), key=k2)
    q = mx.random.normal((B, n_q, L, d), key=k3)
    for mask_L in (L, 5):  # the prefill and the decode path (the last 5 queries)
        cache = OIQKVCache(cfg)
        cache.update_and_fetch(k, v)
        assert cache.q_end == L - 8  # most of the prompt is already packed
        assert cache._attend_from == 4  # everything past the sinks, packed or not, read exact
        qq = q[:, :, L - mask_L :]
        out = oiq_attention(qq, cache, d**-0.5, "causal")
        assert cache._attend_from is None
        ref = reference_attention(qq, k, v, d**-0.5)
        assert float(mx.abs(out - ref).max()) < 1e-4
    # the next step attends to what is stored: 2-bit keys/values, not the exact ones
    q1 = mx.random.normal((B, n_q, 1, d), key=k4)
    cache.update_and_fetch(k[:, :, :1], v[:, :, :1])
    assert cache.q_end == L - 8  # a one-token write stays inside the window: nothing packed
    out = oiq_attention(q1, cache, d**-0.5)
    kd, vd = cache.dequantized_kv()
    assert float(mx.abs(out - reference_attention(q1, kd, vd, d**-0.5)).max()) < 1e-4
    exact = reference_attention(q1, mx.concatenate([k, k[:, :, :1]], 2), mx.concatenate([v, v[:, :, :1]], 2), d**-0.5)
    assert float(mx.abs(out - exact).max()) > 1e-2


@pytest.mark.parametrize("center", ["keys", "values", "both"])
def test_centering_is_exact(center):
    """Mean removal leaves attention unchanged (fp32, nothing quantized)."""
    base = dict(quantize_after=10**6, sink_tokens=0, window=0)
    plain = OIQKVCache(OIQConfig(center_keys=False, key_scaling=0.0, **base))
    centered = OIQKVCache(
        OIQConfig(center_keys=center in ("keys", "both"), center_values=center in ("values", "both"), **base)
    )
    for (q, k, v, o1), (_, _, _, o2) in zip(
        _feed(plain, [33, 1, 5], 1, 2, 6, 64), _feed(centered, [33, 1, 5], 1, 2, 6, 64)
    ):
        assert float(mx.abs(o1 - o2).max()) < 1e-5
    assert centered.k.mean is not None or centered.v.mean is not None


def test_key_scaling_helps_outlier_channels():
    """A few channels 20x larger than the rest (after centering) are shrunk
    before the rotation: lower key error, scores unchanged (exactness above)."""
    k = mx.random.normal((1, 2, 300, 64), key=mx.random.key(4))
    k = k * mx.where(mx.arange(64) % 16 == 3, 20.0, 1.0)
    errs = {}
    for power in (0.0, 0.5):
        c = OIQKVCache(OIQConfig(k_bits=3, key_scaling=power, sink_tokens=0, window=0))
        c.update_and_fetch(k, k)
        c.end_prefill()
        kd = c.dequantized_kv()[0]
        q = mx.random.normal((1, 2, 1, 64), key=mx.random.key(5))
        errs[power] = float(mx.mean(mx.square((q * (kd - k)).sum(-1))))
    assert errs[0.5] < 0.5 * errs[0.0], errs


def test_key_scaling_cap_brings_loud_channels_within_the_cap():
    """lam = max(R**a, R / cap) per channel (R: RMS over the head's median): channels a few
    times the median keep the square root, channels 20x and 6x louder end within 2x of it;
    scores stay exact (the queries are scaled by the same lam), and the lam is stored."""
    loud = mx.where(mx.arange(64) % 16 == 3, 20.0, mx.where(mx.arange(64) % 16 == 7, 6.0,
                                                             mx.where(mx.arange(64) % 16 == 9, 3.0, 1.0)))
    k = mx.random.normal((1, 2, 400, 64), key=mx.random.key(8)) * loud
    lams, outs = {}, {}
    q = mx.random.normal((1, 2, 1, 64), key=mx.random.key(9))
    for cap in (0.0, 2.0):
        c = OIQKVCache(OIQConfig(k_bits=8, v_bits=8, key_scaling=0.5, key_scaling_cap=cap, sink_tokens=0, window=0))
        c.update_and_fetch(k, k)
        c.end_prefill()
        lams[cap] = np.array(c.k.lam)[0, 0, 0]
        outs[cap] = oiq_attention(q, c, scale=0.125)
    rms = np.sqrt(np.mean(np.square(np.array(k - mx.mean(k, axis=2, keepdims=True)))[0, 0], axis=0))
    med = np.sort(rms)[32]  # the cache's median of 64 channels: the upper middle one
    R = np.maximum(rms, med) / med
    np.testing.assert_allclose(lams[0.0], np.sqrt(R), rtol=0.02)
    np.testing.assert_allclose(lams[2.0], np.maximum(np.sqrt(R), R / 2), rtol=0.02)
    after = R / lams[2.0]
    assert after.max() <= 2.0 + 1e-3 and (R / lams[0.0]).max() > 4
    assert np.all(lams[2.0][np.arange(64) % 16 == 9] == lams[0.0][np.arange(64) % 16 == 9])  # 3x: sqrt only
    k_ref = mx.softmax((q @ k.swapaxes(-1, -2)) * 0.125, axis=-1) @ k
    for cap in (0.0, 2.0):
        assert float(mx.abs(outs[cap] - k_ref).max()) < 0.01 * float(mx.abs(k_ref).max())
    off = OIQKVCache(OIQConfig(key_scaling=0.0, key_scaling_cap=2.0))  # no key scaling: nothing to cap
    off.update_and_fetch(k, k)
    assert off.k.lam is None


def test_centering_helps_offset_keys():
    """Keys with a large common offset (Qwen-like k_proj bias) quantize far
    better once the mean is removed."""
    key = mx.random.key(3)
    k = mx.random.normal((1, 2, 300, 64), key=key)
    k = k + mx.where(mx.arange(64) % 9 == 0, 40.0, 0.0)
    errs = {}
    for center in (False, True):
        c = OIQKVCache(OIQConfig(center_keys=center, key_scaling=0.0, sink_tokens=0, window=0))
        c.update_and_fetch(k, k)
        c.end_prefill()
        errs[center] = float(mx.mean(mx.square(c.dequantized_kv()[0] - k)))
    assert errs[True] < 0.1 * errs[False]


def test_a_call_attends_to_the_window_it_found_exactly():
    """A call of several tokens that moves the window on (a prefill chunk, a speculative draft)
    packs rows its queries would have seen exactly one call earlier: they still get them exact,
    and the next call gets them packed (without exact_prefill, under which a chunk finds
    the whole prompt in full precision)."""
    cfg = OIQConfig(k_bits=2, v_bits=2, sink_tokens=4, window=16, exact_prefill=0)
    d, L = 64, 16
    k1, k2, k3 = mx.random.split(mx.random.key(5), 3)
    k = mx.random.normal((1, 2, 60, d), key=k1)
    v = mx.random.normal((1, 2, 60, d), key=k2)
    q = mx.random.normal((1, 4, L, d), key=k3)
    cache = OIQKVCache(cfg)
    cache.update_and_fetch(k[:, :, :44], v[:, :, :44])
    cache.release_fresh()
    found = cache.q_end
    assert found == 20  # packed [4, 20), window [20, 44)
    cache.update_and_fetch(k[:, :, 44:], v[:, :, 44:])
    assert cache.q_end == 36 > found  # the call packed [20, 36), which it found in the window
    out = oiq_attention(q, cache, d**-0.5, "causal")
    kd, vd = cache.dequantized_kv()
    exact = reference_attention(q, mx.concatenate([kd[:, :, :found], k[:, :, found:]], 2),
                                mx.concatenate([vd[:, :, :found], v[:, :, found:]], 2), d**-0.5)
    packed = reference_attention(q, kd, vd, d**-0.5)
    assert float(mx.abs(out - exact).max()) < 1e-4
    assert float(mx.abs(out - packed).max()) > 1e-2
    # the next call reads what is stored
    q1 = q[:, :, :1]
    cache.update_and_fetch(k[:, :, :1], v[:, :, :1])
    kd, vd = cache.dequantized_kv()
    assert float(mx.abs(oiq_attention(q1, cache, d**-0.5) - reference_attention(q1, kd, vd, d**-0.5)).max()) < 1e-4


@pytest.mark.parametrize("preset", ["4bit", "2bit"])
def test_decode_and_prefill_paths_agree(preset, monkeypatch):
    cache = OIQKVCache(OIQConfig.preset(preset))
    k = mx.random.normal((1, 2, 200, 64))
    cache.update_and_fetch(k, k + 0.5)
    cache.release_fresh()
    cache.end_prefill()
    assert cache.k.codes is not None
    for L in (1, 4, 8):
        q = mx.random.normal((1, 6, L, 64))
        dec = oiq_attention(q, cache, 0.125, "causal")
        with monkeypatch.context() as m:
            m.setattr(attention, "DECODE_MAX_QUERIES", 0)
            pre = oiq_attention(q, cache, 0.125, "causal")
        assert float(mx.abs(dec - pre).max()) < 1e-4


@pytest.mark.parametrize("preset", ["4bit", "3bit"])
def test_packed_keys_are_scored_a_chunk_at_a_time(preset, monkeypatch):
    """On the CPU a decode step scores the packed keys by dequantizing them a chunk of rows at a
    time (at most CPU_SCORE_VALUES values, so the float copy stays bounded at any length) and a
    matmul when a KV head has several query rows and those rows times the packed key values reach
    CPU_SCORE_MIN_WORK: every packed row once, and the output of many chunks is that of one and of
    quantized_matmul, which is attention over what the cache stores."""
    cache = OIQKVCache(OIQConfig.preset(preset))
    k, v = mx.random.normal((2, 1, 2, 700, 64), key=mx.random.key(3))
    cache.update_and_fetch(k, v)
    cache.release_fresh()
    cache.end_prefill()
    cache.update_and_fetch(k[:, :, :1], v[:, :, :1])
    q = mx.random.normal((1, 6, 1, 64), key=mx.random.key(4))
    rows, real = [], attention.dequantize_repacked

    def recording(codes, scales, bits, group_size):
        rows.append(codes.shape[2])
        return real(codes, scales, bits, group_size)

    monkeypatch.setattr(attention, "dequantize_repacked", recording)
    packed = cache.q_end - cache.config.sink_tokens
    monkeypatch.setattr(attention, "CPU_SCORE_MIN_WORK", 3 * packed * 2 * 64 + 1)  # too few: quantized_matmul
    below = oiq_attention(q, cache, 0.125)
    assert rows == [] and packed > 600
    monkeypatch.setattr(attention, "CPU_SCORE_MIN_WORK", 3 * packed * 2 * 64)  # 3 query rows per KV head
    whole = oiq_attention(q, cache, 0.125)
    assert rows == [packed]
    assert float(mx.abs(below - whole).max()) < 1e-5
    rows.clear()
    monkeypatch.setattr(attention, "CPU_SCORE_VALUES", 2 * 64 * 128)  # 2 heads x 64 values: 128 rows
    chunked = oiq_attention(q, cache, 0.125)
    assert sum(rows) == packed and max(rows) == 128 and len(rows) == -(-packed // 128), rows
    assert float(mx.abs(chunked - whole).max()) < 1e-6
    kd, vd = cache.dequantized_kv()
    assert float(mx.abs(whole - reference_attention(q, kd, vd, 0.125)).max()) < 1e-4
    rows.clear()  # one query row per KV head: MLX's quantized_matmul, which is faster there
    one = mx.random.normal((1, 2, 1, 64))
    assert float(mx.abs(oiq_attention(one, cache, 0.125) - reference_attention(one, kd, vd, 0.125)).max()) < 1e-4
    assert rows == []
    # the work is query rows times values: 3 rows fall short where 6 (two queries each) reach it
    monkeypatch.setattr(attention, "CPU_SCORE_MIN_WORK", 6 * packed * 2 * 64)
    oiq_attention(q, cache, 0.125)
    assert rows == []
    two = mx.random.normal((1, 6, 2, 64), key=mx.random.key(5))
    dequantized = oiq_attention(two, cache, 0.125)
    assert sum(rows) == packed, rows
    rows.clear()
    monkeypatch.setattr(attention, "CPU_SCORE_MIN_WORK", 6 * packed * 2 * 64 + 1)
    assert float(mx.abs(dequantized - oiq_attention(two, cache, 0.125)).max()) < 1e-5
    assert rows == []


@pytest.mark.parametrize("preset", ["4bit", "2bit", "1.5bit"])
def test_repacked_codes_are_kept_between_blocks_and_counted(preset, monkeypatch):
    """On the CPU a decode step reads the packed values, and 3-, 5- and 6-bit keys, repacked for
    MLX's kernel.  The copy kept until a row it holds is written again gives the outputs of
    repacking at every step, bit for bit, across block writes and buffer growth, with one repack a
    side per block written; it is counted in nbytes while kept, and none is kept past
    CPU_MEMO_ROWS packed rows."""
    kept, fresh = (OIQKVCache(OIQConfig.preset(preset)) for _ in range(2))
    k = mx.random.normal((1, 2, 300, 64), key=mx.random.key(1))
    for c in (kept, fresh):
        c.update_and_fetch(k, k + 0.5)
        c.release_fresh()
    held, ends, repacks, real = [], [], [], reading.repack_codes

    def counting(codes, bits, to_bits):
        if to_bits != bits:
            repacks.append(codes.shape[2])
        return real(codes, bits, to_bits)

    monkeypatch.setattr(reading, "repack_codes", counting)
    kept_repacks = 0
    for step, key in enumerate(mx.random.split(mx.random.key(2), 40)):
        k1, k2 = mx.random.split(key)
        x, q = mx.random.normal((1, 2, 1, 64), key=k1), mx.random.normal((1, 6, 1, 64), key=k2)
        outs = []
        repacks.clear()
        for c, rows in ((kept, reading.CPU_MEMO_ROWS), (fresh, 0)):
            with monkeypatch.context() as m:
                m.setattr(reading, "CPU_MEMO_ROWS", rows)
                c.update_and_fetch(x, x - 0.5)
                outs.append(np.array(oiq_attention(q, c, 0.125, None)))
        assert np.array_equal(*outs), step
        held.append(kept.cpu_codes_nbytes())
        ends.append(kept.q_end)
        kept_repacks += len(repacks) - 1  # the fresh cache repacks its values every step
        assert fresh.cpu_codes_nbytes() == 0
        assert kept.nbytes == fresh.nbytes + held[-1]
    # blocks were written; a step that packs reads its new rows as it found them (in full
    # precision), with the copy of the rows before them, so the next step makes a copy of all
    packing = [i for i in range(1, len(ends)) if ends[i] != ends[i - 1]]
    s = kept.config.sink_tokens
    rows = [ends[i - 1 if i in packing else i] - s for i in range(len(ends))]
    key_bits = reading.CPU_MEMO_BITS["k"].get(kept.k.bits, 0)  # 8 for 4bit's 5-bit keys, none for 2bit's
    assert len(packing) >= 2 and held == [2 * r * 64 * (4 + key_bits) // 8 for r in rows], (held, ends)  # 2 heads
    # once, and once after each block written (by the next step), for each side kept
    sides = 1 + (key_bits > 0)
    assert kept_repacks == sides * len(set(held)) == sides * (1 + sum(i < len(ends) - 1 for i in packing)), \
        (kept_repacks, held)
    # packed rows past the bound: the copy is dropped with the write (no step would read it)
    more = mx.random.normal((1, 2, reading.CPU_MEMO_ROWS, 64))
    kept.update_and_fetch(more, more)
    kept.release_fresh()
    assert kept.q_end - s > reading.CPU_MEMO_ROWS and kept.cpu_codes_nbytes() == 0
    long = OIQKVCache(OIQConfig.preset(preset))
    long.update_and_fetch(mx.random.normal((1, 2, 1200, 64)), mx.random.normal((1, 2, 1200, 64)))
    long.end_prefill()
    long.update_and_fetch(k[:, :, :1], k[:, :, :1])
    mx.eval(oiq_attention(mx.random.normal((1, 6, 1, 64)), long, 0.125, None))
    assert long.q_end - 4 > reading.CPU_MEMO_ROWS and long.cpu_codes_nbytes() == 0


def test_nbytes_matches_allocation_and_compression():
    cfg = OIQConfig(
        k_bits=4, v_bits=4, group_size=32, sink_tokens=0, window=0, trim_reserve=0, center_keys=False, key_scaling=0.0,
        exact_prefill=0,
    )
    cache = OIQKVCache(cfg)
    fp = KVCache()
    B, H, d, N = 1, 3, 64, 1024
    for L in (500, 524):
        k = mx.random.normal((B, H, L, d)).astype(mx.float16)
        cache.update_and_fetch(k, k)
        cache.release_fresh()  # as attention does after reading
        fp.update_and_fetch(k, k)
    per_token = 2 * bytes_per_token(d, 4, 32)
    assert per_token == 72
    cap = cache.k.codes.shape[2]
    recent = cache.k.recent.shape[2]
    signs = 2 * d * 4  # one float32 sign vector for keys, one for values
    expected = B * H * (cap * per_token + 2 * recent * d * 2) + signs
    assert cache.nbytes == expected == cache.quantized_nbytes_formula() + 2 * B * H * recent * d * 2 + signs
    assert cache.nbytes == sum(a.nbytes for a in cache.state[:-1] if a is not None) + (
        (cap - N) * per_token + 2 * (recent - (cache.offset - cache.recent_start)) * d * 2
    ) * B * H
    assert fp.nbytes / cache.nbytes >= 3.4, fp.nbytes / cache.nbytes
    # defaults (sinks, window, mean) cost little at long contexts
    default = OIQKVCache(OIQConfig())
    for _ in range(8):
        k = mx.random.normal((B, H, 2048, d)).astype(mx.float16)
        default.update_and_fetch(k, k)
        default.release_fresh()
    default.end_prefill()  # the prompt's 16384 tokens waited in full precision for generation
    assert (16384 * B * H * 2 * d * 2) / default.nbytes >= 3.4


@pytest.mark.parametrize("preset,window,reserve", [("4bit", 64, 16), ("3bit", 64, 16), ("2bit", 128, 16),
                                                   ("4bit", 32, 0), ("4bit", 8, 16), ("2bit", 64, 40)])
def test_full_precision_rows_allocated_stay_at_window_plus_reserve(preset, window, reserve):
    """Issue 16's fixed cost: after a prompt and through decoding (prompt lengths on and off
    the block grid), the full-precision rows a cache allocates are at most sinks + window +
    reserve + 16: the pending block (the window holds W to W + 15 rows) and the capacity
    rounding together, never a second block of dead rows; the same after every call of
    several tokens (chunked scoring, speculative drafts)."""
    cfg = OIQConfig.preset(preset, window=window, trim_reserve=reserve)
    for prompt, chunk in ((300, 1), (317, 1), (300, 7), (317, 32), (300, 64)):
        cache = OIQKVCache(cfg)
        k = mx.random.normal((1, 2, prompt, 64)).astype(mx.float16)
        cache.update_and_fetch(k, k)
        cache.release_fresh()
        cache.end_prefill()  # generation starts (exact_prefill): the calls below come after the prompt
        worst = 0
        for _ in range(192 // chunk + 2):
            cache.update_and_fetch(k[:, :, :chunk], k[:, :, :chunk])
            cache.release_fresh()
            worst = max(worst, cache.k.sink.shape[2] + cache.k.recent.shape[2])
        assert cache.q_end > prompt  # it packed blocks while decoding
        assert worst <= cfg.sink_tokens + window + cache.reserve + 16, (worst, cache.reserve)
        # and fp16 (the model's dtype) nbytes counts exactly these rows, at 2 bytes
        fp_rows = 2 * 2 * (cache.k.sink.shape[2] + cache.k.recent.shape[2]) * 64 * 2
        packed = [cache._kv_rows] if cache._kv_rows is not None else [cache.k.rows, cache.v.rows]
        assert cache.nbytes == fp_rows + sum(a.nbytes for a in packed) + sum(
            a.nbytes for side in (cache.k, cache.v) for a in (side.mean, side.signs, side.lam) if a is not None
        ) + sum(a.nbytes for a in (cache._stacked or ()) if a is not None)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(k_bits=7), "k_bits=7 is not supported"),
        (dict(v_bits=0), "v_bits=0 is not supported"),
        (dict(group_size=48), "group_size=48 is not supported"),
        (dict(window=-1), "window must be >= 0"),
        (dict(sink_tokens=1.5), "sink_tokens must be an integer"),
        (dict(rotation="random"), "rotation='random'"),
        (dict(clip="yes"), "clip must be True or False"),
        (dict(align_scales=1), "align_scales must be True or False"),
        (dict(key_scaling=2.0), "key_scaling must be a number in"),
        (dict(key_alignment=0.25), "key_alignment must be 0, 0.5 or 1, got 0.25"),
        (dict(key_alignment=True), "key_alignment must be 0, 0.5 or 1, got True"),
        (dict(key_alignment="0.5"), "key_alignment must be 0, 0.5 or 1, got '0.5'"),
        (dict(align_scales=False, key_alignment=0.5), r"key_alignment=0.5 .* needs align_scales=True \(.* set "
                                                      "key_alignment=1 too"),
        (dict(key_scaling_cap=0.5), "key_scaling_cap must be 0 \\(no cap\\) or a number >= 1"),
        (dict(key_scaling_cap=float("nan")), "key_scaling_cap must be"),
        (dict(key_scaling_cap=True), "key_scaling_cap must be"),
        (dict(layer_bits="3:3"), "is not layer:k_bits:v_bits"),
        (dict(layer_bits="3:7:3"), "layer 3 k_bits=7 is not supported"),
        (dict(layer_bits=((1, 3, 3), (1, 4, 4))), "names a layer twice"),
        (dict(layer_bits=((-1, 3, 3),)), "layer_bits layer must be >= 0"),
    ],
)
def test_bad_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        OIQConfig(**kwargs)


def test_scale_alignment_per_side():
    """Keys take key_alignment, values the aligned scale, both nothing without align_scales (a
    preset's too); a config file written before the field existed reads as keys aligned all the
    way."""
    assert OIQConfig().scale_alignment == (1.0, 1.0)
    assert OIQConfig(key_alignment=0.5).scale_alignment == (0.5, 1.0)
    assert OIQConfig(key_alignment=0).scale_alignment == (0.0, 1.0)
    assert OIQConfig(align_scales=False).scale_alignment == (0.0, 0.0)
    for name in ("4bit", "3bit", "2bit"):
        assert OIQConfig.preset(name, align_scales=False).scale_alignment == (0.0, 0.0)
    with pytest.raises(ValueError, match="needs align_scales=True"):
        OIQConfig.preset("4bit", align_scales=False, key_alignment=0.5)
    assert OIQConfig.from_json(OIQConfig(key_alignment=0.5).to_json()).scale_alignment == (0.5, 1.0)
    old = json.loads(OIQConfig(key_alignment=0.5).to_json())
    del old["key_alignment"]
    assert OIQConfig.from_json(json.dumps(old)).key_alignment == 1.0


@pytest.mark.parametrize("preset", ["2bit", "4bit"])  # keys and values packed in one pass / one each
@pytest.mark.parametrize("key_alignment", [0.0, 0.5, 1.0])
def test_packed_rows_take_each_sides_alignment(preset, key_alignment):
    """The rows a cache packs (a prompt, then blocks of decode steps) are codec.quantize of its
    rows in the packed domain with the keys' alignment on the keys and 1 on the values."""
    cfg = OIQConfig.preset(preset, key_alignment=key_alignment, window=16, exact_prefill=0)
    x = mx.random.normal((2, 1, 2, 120, 64), key=mx.random.key(7)) * mx.linspace(0.5, 3.0, 64)
    cache = OIQKVCache(cfg)
    cache.update_and_fetch(x[0, :, :, :80], x[1, :, :, :80])
    for t in range(80, 120):
        cache.update_and_fetch(x[0, :, :, t : t + 1], x[1, :, :, t : t + 1])
        cache.release_fresh()
    s, n = cfg.sink_tokens, cache.q_end - cfg.sink_tokens
    assert n >= 96
    for i, (side, align) in enumerate(zip((cache.k, cache.v), (key_alignment, 1.0))):
        rows = x[i, :, :, s : s + n]
        y = side.window_to_packed(rows if side.mean is None else rows - side.mean)
        codes, scales = quantize(y, side.bits, cfg.group_size, clip=True, align=align)
        assert mx.array_equal(side.codes[:, :, :n], codes), (preset, key_alignment, i)
        assert mx.array_equal(side.scales[:, :, :n], scales), (preset, key_alignment, i)


def test_head_dims_are_padded_or_rejected():
    cfg = OIQConfig()
    assert cfg.storage_dim(64) == 64 and cfg.storage_dim(80) == 96 and cfg.storage_dim(36) == 64
    assert OIQConfig(group_size=128).storage_dim(80) == 128
    with pytest.raises(ValueError, match="head_dim must be an integer >= 1, got 0"):
        OIQKVCache(cfg, head_dim=0)
    model = tiny_llama(head_dim=64)
    model.args.head_dim = -3
    with pytest.raises(ValueError, match="head_dim"):
        make_oiq_cache(model, cfg)


def test_bad_updates():
    cache = OIQKVCache()
    with pytest.raises(ValueError, match="floating point"):
        cache.update_and_fetch(mx.zeros((1, 2, 3, 64), mx.int32), mx.zeros((1, 2, 3, 64), mx.int32))
    with pytest.raises(ValueError, match="shape"):
        cache.update_and_fetch(mx.zeros((2, 3, 64)), mx.zeros((2, 3, 64)))
    cache.update_and_fetch(mx.zeros((1, 2, 3, 64)), mx.zeros((1, 2, 3, 64)))
    with pytest.raises(ValueError, match="this cache holds"):
        cache.update_and_fetch(mx.zeros((1, 4, 1, 64)), mx.zeros((1, 4, 1, 64)))
    assert cache.offset == 3


def _logits(model, tokens, cache):
    return model(mx.array(tokens)[None], cache=cache)


def test_generation_matches_full_precision_at_8_bits():
    """Logits that read 8-bit packed rows stay near full precision's, and greedy generation
    picks the same tokens.  (A 40-token prompt in one call read no packed row at all: the
    call attends its own rows exactly, and sinks + window held them.)"""
    model = tiny_llama()
    prompt = list(range(5, 125))
    cfg = OIQConfig(k_bits=8, v_bits=8)
    fp, oiq = make_prompt_cache(model), make_oiq_cache(model, cfg)
    assert all(isinstance(c, OIQKVCache) for c in oiq)
    _logits(model, prompt[:100], fp)
    _logits(model, prompt[:100], oiq)
    end_prefill(oiq)
    assert all(c.q_end - c.config.sink_tokens == 32 for c in oiq)  # the next call reads 32 packed rows
    a = _logits(model, prompt[100:], fp)
    b = _logits(model, prompt[100:], oiq)
    # measured 1.05e-3 of the largest logit; 3x for other seeds and BLAS orders
    assert float(mx.abs(a - b).max()) < 3.2e-3 * float(mx.abs(a).max())
    toks_fp = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=12, prompt_cache=make_prompt_cache(model))]
    toks_oiq = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=12, prompt_cache=make_oiq_cache(model, cfg))]
    assert toks_fp == toks_oiq


def test_per_layer_bits():
    """layer_bits gives single layers other bits: their storage, their bytes and
    their error follow, the rest keep the base bits; text and triples agree,
    the config survives JSON, and layers the model lacks are refused."""
    cfg = OIQConfig(k_bits=2, v_bits=2, window=0, sink_tokens=0, layer_bits="1:8:6")
    assert cfg == OIQConfig(k_bits=2, v_bits=2, window=0, sink_tokens=0, layer_bits=[[1, 8, 6]])
    assert OIQConfig.from_json(cfg.to_json()) == cfg
    assert cfg.bits_for_layer(0) == (2, 2) and cfg.bits_for_layer(1) == (8, 6)
    assert cfg.bytes_per_token(64, layers=[0, 1]) == (64 * 4 / 8 + 64 * 14 / 8) / 2 + 8
    with pytest.raises(ValueError, match="needs the OIQ layer indices"):
        cfg.bytes_per_token(64)
    model = tiny_llama(layers=2)
    cache = make_oiq_cache(model, cfg)
    assert [(c.k.bits, c.v.bits) for c in cache] == [(2, 2), (8, 6)]
    _logits(model, list(range(40)), cache)
    end_prefill(cache)
    k = mx.random.normal((1, 2, 40, 64), key=mx.random.key(0))
    errs = []
    for c in cache:
        c2 = OIQKVCache(cfg, layer_idx=c.layer_idx)
        c2.update_and_fetch(k, k)
        c2.end_prefill()
        errs.append(float(mx.mean(mx.square(c2.dequantized_kv()[0] - k))))
        assert (c.k.codes.shape[-1], c.v.codes.shape[-1]) == (64 * c.k.bits // 32, 64 * c.v.bits // 32)
    assert errs[1] < errs[0] / 100
    # group 32 at d = 64: 2 + 2 bits -> 16 + 16 bytes of codes + 8 of scales; 8 + 6 bits -> 112 + 8
    assert cache[1].quantized_nbytes_formula() / cache[0].quantized_nbytes_formula() == 120 / 40
    with pytest.raises(ValueError, match=r"layer_bits names layers \[5\]"):
        make_oiq_cache(model, OIQConfig(layer_bits="5:3:3"))


def test_save_load_round_trip(tmp_path):
    model = tiny_llama()
    cfg = OIQConfig(k_bits=3, v_bits=5, window=8, sink_tokens=2, center_values=True)
    cache = make_oiq_cache(model, cfg)
    _logits(model, list(range(70)), cache)
    for t in (3, 4, 5):
        _logits(model, [t], cache)
    path = str(tmp_path / "cache.safetensors")
    save_prompt_cache(path, cache, {"note": "x"})
    loaded, meta = load_prompt_cache(path, return_metadata=True)
    assert meta["note"] == "x"
    for a, b in zip(cache, loaded):
        assert type(b) is OIQKVCache and b.offset == a.offset and b.config == a.config
        sa, sb = a.state, b.state
        assert sa[-1] == sb[-1]
        for x, y in zip(sa[:-1], sb[:-1]):
            assert (x is None and y is None) or (x.dtype == y.dtype and mx.array_equal(x, y))
    # both continue identically
    assert mx.array_equal(_logits(model, [9, 8], cache), _logits(model, [9, 8], loaded))


@pytest.mark.parametrize("cfg", [OIQConfig(window=6, trim_reserve=8, sink_tokens=2), OIQConfig(window=0, sink_tokens=0, k_bits=3), OIQConfig(quantize_after=60, window=4)])
def test_trim_then_continue_equals_never_generated(cfg):
    model = tiny_llama()
    prompt = list(range(1, 58))
    a = make_oiq_cache(model, cfg)
    b = make_oiq_cache(model, cfg)
    _logits(model, prompt, a)
    _logits(model, prompt, b)
    end_prefill(b)  # as a's first one-token step ends it
    for t in (7, 8, 9, 10, 11):  # speculative tokens, later rejected
        _logits(model, [t], a)
    assert all(c.trim(5) == 5 for c in a)
    la = _logits(model, [20, 21, 22], a)
    lb = _logits(model, [20, 21, 22], b)
    assert mx.allclose(la, lb, atol=1e-5)
    for ca, cb in zip(a, b):
        assert ca.offset == cb.offset and ca.q_end == cb.q_end
        ka, _ = ca.dequantized_kv()
        kb, _ = cb.dequantized_kv()
        assert mx.allclose(ka, kb, atol=1e-6)


def test_speculative_decoding_with_draft():
    from mlx_lm.generate import speculative_generate_step

    model = tiny_llama(seed=0)
    draft = tiny_llama(seed=1, layers=1)
    prompt = mx.array(list(range(3, 40)))
    cfg = OIQConfig(k_bits=8, v_bits=8, window=4)
    cache = make_oiq_cache(model, cfg) + make_oiq_cache(draft, cfg)
    spec = [int(t) for t, _, _ in speculative_generate_step(prompt, model, draft, num_draft_tokens=3, max_tokens=16, prompt_cache=cache)]
    plain = [int(t) for t, _ in generate_step(prompt, model, max_tokens=16, prompt_cache=make_oiq_cache(model, cfg))]
    assert len(spec) == 16
    # greedy speculative decoding reproduces greedy decoding of the main model
    assert spec == plain


def test_sliding_window_layers_keep_rotating_cache():
    model = tiny_gemma3(layers=3, sliding_window=16)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        cache = make_oiq_cache(model, OIQConfig(k_bits=8, v_bits=8))
    assert [type(c) for c in cache] == [RotatingKVCache, RotatingKVCache, OIQKVCache]
    assert any("2 x RotatingKVCache" in str(x.message) for x in w)
    assert caches.oiq_layer_indices(model) == [cache[2].layer_idx] == [2]
    with warnings.catch_warnings(), pytest.raises(ValueError, match=r"layer_bits names layers \[0\] that do not use "
                                                                  r"OIQ in this model \(its OIQ layers: \[2\]\)"):
        warnings.simplefilter("ignore")
        make_oiq_cache(model, OIQConfig(layer_bits="0:3:3"))
    prompt = mx.array(list(range(2, 42)))  # longer than the window
    fp = [int(t) for t, _ in generate_step(prompt, model, max_tokens=10, prompt_cache=make_prompt_cache(model))]
    oq = [int(t) for t, _ in generate_step(prompt, model, max_tokens=10, prompt_cache=cache)]
    assert fp == oq


def test_routing_is_idempotent_and_leaves_other_caches_alone():
    model = tiny_llama()
    make_oiq_cache(model)
    assert routing.install() == 0
    import mlx_lm.models.base as base
    import mlx_lm.models.llama as llama_mod

    assert base.scaled_dot_product_attention is routing.scaled_dot_product_attention
    assert llama_mod.scaled_dot_product_attention is routing.scaled_dot_product_attention
    q = mx.random.normal((1, 4, 3, 64), key=mx.random.key(1))
    k = mx.random.normal((1, 2, 5, 64), key=mx.random.key(2))
    v = mx.random.normal((1, 2, 5, 64), key=mx.random.key(3))
    kv = KVCache()
    keys, values = kv.update_and_fetch(k, v)
    out = base.scaled_dot_product_attention(q, keys, values, kv, 0.125, "causal")
    # against MLX's fused attention (not the function the wrapper itself calls) and a float64 truth
    assert mx.array_equal(out, mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal"))
    qn, kn, vn = (np.repeat(np.array(x, np.float64), 2 if x is not q else 1, axis=1) for x in (q, k, v))
    s = qn @ kn.swapaxes(-1, -2) * 0.125
    s = np.where(np.arange(2, 5)[:, None] >= np.arange(5)[None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    truth = (p / p.sum(-1, keepdims=True)) @ vn
    assert np.abs(np.array(out, np.float64) - truth).max() < 1e-5


def test_state_of_empty_cache_round_trips():
    c = OIQKVCache(OIQConfig(k_bits=2))
    c2 = OIQKVCache.from_state(c.state)
    assert c2.empty() and c2.config == c.config and c2.offset == 0


@pytest.mark.parametrize("L", [1, 12])
@pytest.mark.parametrize("center_keys", [False, True])
def test_attention_sinks_argument(L, center_keys):
    """Learned per-head sink logits (GPT-OSS style) in both paths, with and
    without key centering (which must not shift scores against the sink)."""
    cache = OIQKVCache(OIQConfig(k_bits=8, v_bits=8, window=0, sink_tokens=0, center_keys=center_keys))
    k = mx.random.normal((1, 1, 20, 64)) + 3.0
    cache.update_and_fetch(k[:, :, :19], k[:, :, :19])
    cache.update_and_fetch(k[:, :, 19:], k[:, :, 19:])  # this call's token is attended exactly
    q = mx.random.normal((1, 2, L, 64))
    sinks = mx.array([0.5, -1.0])
    out = oiq_attention(q, cache, 0.125, "causal", sinks=sinks)
    kd, vd = cache.dequantized_kv()
    kd, vd = (mx.concatenate([x[:, :, :19], k[:, :, 19:]], 2) for x in (kd, vd))
    s = (q * 0.125) @ mx.repeat(kd, 2, 1).swapaxes(-1, -2)
    s = mx.where(mx.arange(20 - L, 20)[:, None] >= mx.arange(20)[None], s, -mx.inf)
    full = mx.concatenate([mx.broadcast_to(sinks.reshape(1, 2, 1, 1), (1, 2, L, 1)), s], axis=-1)
    p = mx.softmax(full, axis=-1)[..., 1:]
    assert float(mx.abs(out - p @ mx.repeat(vd, 2, 1)).max()) < 1e-4


def test_defaults_are_the_4bit_preset():
    assert OIQConfig() == OIQConfig.preset("4bit")
    assert OIQConfig.preset("2bit", window=0).window == 0


def test_seed_and_rotation_options():
    k = mx.random.normal((1, 2, 40, 64), key=mx.random.key(7))
    base = dict(sink_tokens=0, window=0, center_keys=False, key_scaling=0.0, clip=False, align_scales=False)
    caches = {}
    for name, cfg in {
        "seed0": OIQConfig(seed=0, **base),
        "seed1": OIQConfig(seed=1, **base),
        "nosigns": OIQConfig(rotation="hadamard_nosigns", **base),
        "none": OIQConfig(rotation="none", **base),
    }.items():
        c = OIQKVCache(cfg, layer_idx=3)
        c.update_and_fetch(k, k)
        c.end_prefill()
        caches[name] = c
    assert not mx.array_equal(caches["seed0"].k.signs, caches["seed1"].k.signs)
    assert not mx.array_equal(caches["seed0"].k.codes, caches["seed1"].k.codes)
    assert mx.array_equal(caches["nosigns"].k.signs, mx.ones((64,)))
    # rotation="none" is plain group abs-max on the raw vectors
    codes, scales = quantize(k, OIQConfig().k_bits, 32)
    assert mx.array_equal(caches["none"].k.codes[:, :, :40], codes)
    assert mx.array_equal(caches["none"].k.scales[:, :, :40], scales)
    # the signs depend on the layer too, and every layer's keys and values differ
    other = OIQKVCache(OIQConfig(seed=0, **base), layer_idx=4)
    other.update_and_fetch(k, k)
    other.end_prefill()
    assert not mx.array_equal(other.k.signs, caches["seed0"].k.signs)
    assert not mx.array_equal(caches["seed0"].k.signs, caches["seed0"].v.signs)


def test_cache_works_on_a_thread_of_its_own():
    """mlx-lm's server runs generation on its own thread and stream: nothing the
    cache or attention evaluates may be a lazy array made on the importing thread."""
    errors = []

    def run():
        try:
            with mx.stream(mx.new_stream(mx.default_device())):
                for preset in ("4bit", "3bit", "2bit"):
                    c = OIQKVCache(OIQConfig.preset(preset, window=16))
                    k, v = mx.random.normal((1, 3, 40, 64)), mx.random.normal((1, 3, 40, 64))
                    q = mx.random.normal((1, 9, 40, 64))
                    c.update_and_fetch(k, v)
                    mx.eval(oiq_attention(q, c, scale=0.125, mask="causal"), c.state)
                    for i in range(20):  # past a packed block
                        c.update_and_fetch(k[:, :, i : i + 1], v[:, :, i : i + 1])
                        mx.eval(oiq_attention(q[:, :, :1], c, scale=0.125), c.state)
        except Exception as e:  # re-raised on the test's thread
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert not errors, errors


@pytest.mark.parametrize("k_bits,v_bits,group_size,head_dim", [(2, 2, 64, 64), (2, 2, 32, 64), (3, 3, 64, 64),
                                                               (4, 2, 32, 128), (3, 4, 128, 80), (2, 3, 64, 256),
                                                               (2, 1, 32, 64), (1, 1, 64, 128)])
def test_bytes_per_token_is_what_the_packed_rows_hold(k_bits, v_bits, group_size, head_dim):
    """OIQConfig.bytes_per_token counts the packed rows as stored, in whole words: at d = 64 and
    group 64 the one float16 scale of a side takes a word (K2V2 is 40 bytes, as at group 32)."""
    cfg = OIQConfig(k_bits=k_bits, v_bits=v_bits, group_size=group_size, sink_tokens=0, window=0, trim_reserve=0)
    cache = OIQKVCache(cfg)
    x = mx.random.normal((1, 2, 100, head_dim))
    cache.update_and_fetch(x, x)
    cache.end_prefill()
    packed = sum(side.rows.nbytes for side in (cache.k, cache.v))
    assert packed == cfg.bytes_per_token(head_dim) * 2 * cache.k.rows.shape[2]
    if (k_bits, v_bits, group_size, head_dim) == (2, 2, 64, 64):
        assert cfg.bytes_per_token(64) == OIQConfig(k_bits=2, v_bits=2, group_size=32).bytes_per_token(64) == 40


@pytest.mark.parametrize("preset", ["3bit", "2bit"])
def test_aligned_scales_keep_every_packed_vector_along_itself(preset):
    """``align_scales``: each packed group keeps its projection on itself, so (the rotation
    being orthogonal) each packed key and value, as attention reads it, has ``<x_hat, x> =
    |x|^2`` up to the float16 scales; the clip search's own scales shrink it.  The field
    survives JSON, and a config written before it existed reads as False (what such a cache did)."""
    k = mx.random.normal((1, 2, 80, 64), key=mx.random.key(3))
    ratio = {}
    for align in (False, True):
        cfg = OIQConfig.preset(preset, window=0, sink_tokens=0, center_keys=False, center_values=False,
                               key_scaling=0.0, align_scales=align)
        cache = OIQKVCache(cfg)
        cache.update_and_fetch(k, k)
        cache.end_prefill()
        kd, vd = cache.dequantized_kv()
        ratio[align] = [mx.sum(x * k, -1) / mx.sum(k * k, -1) for x in (kd, vd)]
    assert all(float(mx.abs(r - 1).max()) < 2.0**-9 for r in ratio[True])
    assert all(float(mx.mean(r)) < 0.985 for r in ratio[False])
    cfg = OIQConfig.preset(preset, align_scales=True)
    assert OIQConfig.from_json(cfg.to_json()) == cfg
    legacy = json.loads(cfg.to_json())
    del legacy["align_scales"], legacy["key_scaling_cap"]
    old = OIQConfig.from_json(json.dumps(legacy))
    assert old.align_scales is False and old.key_scaling_cap == 0.0  # what a file from before they existed did
