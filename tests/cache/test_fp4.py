"""fp4 microscaling storage (OIQConfig.storage "mxfp4" / "nvfp4"): config, codec, the cache's
packed rows, attention against a float64 softmax, files, trim, batches, and that the int
Metal kernels never see fp4 data."""

import argparse
import copy

import mlx.core as mx
import numpy as np
import pytest
from helpers import chunk_data, run_chunks, tiny_llama
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from oiq_mlx.cache import attention
from oiq_mlx.cache.attention import oiq_attention, oiq_batch_attention
from oiq_mlx.cache.sequence import OIQKVCache
from oiq_mlx.cache.stacked import stackable
from oiq_mlx.cli.options import add_oiq_options, config_from_args
from oiq_mlx.core import fp4
from oiq_mlx.core.config import OIQConfig
from oiq_mlx.kernels import dispatch
from oiq_mlx.mlx_lm.caches import make_oiq_cache

FP4 = dict(k_bits=4, v_bits=4, clip=False, align_scales=False)
MX = OIQConfig(storage="mxfp4", group_size=32, sink_tokens=3, window=16, trim_reserve=16, **FP4)
NV = OIQConfig(storage="nvfp4", group_size=16, sink_tokens=3, window=16, trim_reserve=16, center_values=True, **FP4)
MXC = OIQConfig(storage="mxfp4", group_size=32, sink_tokens=3, window=16, trim_reserve=16, k_bits=4, v_bits=4,
                clip=True, align_scales=False)  # the exponent search
CONFIGS = pytest.mark.parametrize("cfg", [MX, NV, MXC], ids=["mxfp4", "nvfp4", "mxfp4-clip"])
D = 64


# ---------------------------------------------------------------- config


def test_config_validation_names_the_problem():
    cfg = OIQConfig.preset("4bit", storage="mxfp4", **FP4)
    assert cfg.bytes_per_token(64) == 68 and cfg.bytes_per_token(128) == 136
    assert OIQConfig(storage="nvfp4", group_size=16, **FP4).bytes_per_token(64) == 72
    cases = [
        (dict(storage="fp4"), "storage='fp4' is not one of"),
        (dict(storage="mxfp4", k_bits=4, v_bits=4, group_size=16, clip=False, align_scales=False),
         "group_size must be 32"),
        (dict(storage="nvfp4", k_bits=4, v_bits=4, group_size=32, clip=False, align_scales=False),
         "group_size must be 16"),
        (dict(storage="mxfp4", k_bits=5, v_bits=3, clip=False, align_scales=False), "k_bits and v_bits must be 4"),
        (dict(storage="mxfp4", k_bits=4, v_bits=4, clip=True, align_scales=True), "align_scales must be False"),
        (dict(storage="mxfp4", k_bits=4, v_bits=4, clip=False, align_scales=True), "align_scales must be False"),
        (dict(storage="nvfp4", group_size=16, k_bits=4, v_bits=4, clip=True, align_scales=False),
         "clip must be False"),
        (dict(storage="mxfp4", layer_bits="1:4:4", **FP4), "layer_bits must be empty"),
        (dict(group_size=16), "group_size=16 is not supported"),  # int storage: 16 stays refused
    ]
    for kw, msg in cases:
        with pytest.raises(ValueError, match=msg):
            OIQConfig(**kw)
    # heads are zero-padded to whole groups of the format (80: 96 in MXFP4, 80 in NVFP4)
    assert cfg.storage_dim(80) == 96 and OIQConfig(storage="nvfp4", group_size=16, **FP4).storage_dim(80) == 80
    assert cfg.bytes_per_token(80) == 2 * 96 // 2 + 8
    with pytest.raises(ValueError, match="not a multiple of its group size"):
        fp4.pair_width(40, "mxfp4")
    # configs written before the field are int storage
    text = OIQConfig().to_json().replace(', "storage": "int"', "")
    assert "storage" not in text and OIQConfig.from_json(text).storage == "int"
    assert OIQConfig.from_json(cfg.to_json()) == cfg
    # clip=True with MXFP4 is the exponent search: accepted, same bytes, and it round-trips
    searched = OIQConfig.preset("4bit", storage="mxfp4", k_bits=4, v_bits=4, align_scales=False)
    assert searched.clip and searched.bytes_per_token(64) == 68
    assert OIQConfig.from_json(searched.to_json()) == searched
    with pytest.raises(ValueError, match="clip must be False"):
        OIQConfig.from_json(searched.to_json().replace('"mxfp4"', '"nvfp4"').replace('"group_size": 32',
                                                                                      '"group_size": 16'))


def test_cli_flag_sets_the_storage():
    p = argparse.ArgumentParser()
    add_oiq_options(p)
    args = p.parse_args("--preset 4bit --storage mxfp4 --k-bits 4 --v-bits 4 --no-clip --no-align-scales".split())
    cfg = config_from_args(args)
    assert cfg.storage == "mxfp4" and cfg.window == OIQConfig.preset("4bit").window and not cfg.clip
    searched = config_from_args(p.parse_args("--preset 4bit --storage mxfp4 --k-bits 4 --v-bits 4 "
                                             "--no-align-scales".split()))
    assert searched.storage == "mxfp4" and searched.clip  # the preset's clip: the exponent search
    with pytest.raises(ValueError, match="k_bits and v_bits must be 4"):
        config_from_args(p.parse_args("--preset 4bit --storage mxfp4".split()))
    with pytest.raises(SystemExit):
        p.parse_args(["--storage", "fp8"])
    from oiq_mlx.cli.options import cache_label

    assert cache_label([OIQKVCache(cfg)]) == "OIQ MXFP4 g32"


# ---------------------------------------------------------------- codec


@pytest.mark.parametrize("mode", ["mxfp4", "nvfp4"])
def test_codec_is_mlx_fp4_and_rows_join_and_split(mode):
    y = mx.random.normal((3, 5, D), key=mx.random.key(1)) * 3
    codes, scales = fp4.quantize(y, mode)
    want = mx.quantize(y, group_size=fp4.FP4_GROUP[mode], bits=4, mode=mode)
    assert mx.array_equal(codes, want[0]) and mx.array_equal(scales, want[1]) and scales.dtype == mx.uint8
    out = fp4.dequantize(codes, scales, mode)
    assert out.dtype == mx.float32
    assert (mx.mean(mx.square(out - y)) / mx.mean(y * y)).item() < 0.02
    # E2M1 levels: every decoded value is a level times its group's scale
    v = mx.random.normal((2, 3, 5, D), key=mx.random.key(2))
    c2, s2 = fp4.quantize(v, mode)
    rows = fp4.join_pair(codes, scales, c2[0], s2[0])
    assert rows.shape == (3, 5, fp4.pair_width(D, mode)) and rows.dtype == mx.uint32
    for which, (c, s) in enumerate(((codes, scales), (c2[0], s2[0]))):
        got = fp4.split_pair(rows, D, mode, which)
        assert mx.array_equal(got[0], c) and mx.array_equal(got[1], s)
    assert fp4.pair_bytes_per_token(D, "mxfp4") == 68 and fp4.pair_bytes_per_token(D, "nvfp4") == 72


@pytest.mark.parametrize("mode", ["mxfp4", "nvfp4"])
def test_codec_non_finite_group_decodes_to_nan_and_alone(mode):
    y = mx.random.normal((2, D), key=mx.random.key(3))
    bad = np.array(y)
    bad[0, 5] = np.nan
    bad[1, D - 1] = np.inf
    codes, scales = fp4.quantize(mx.array(bad), mode)
    out = np.array(fp4.dequantize(codes, scales, mode))
    g = fp4.FP4_GROUP[mode]
    assert np.isnan(out[0, :g]).all() and np.isnan(out[1, D - g :]).all()
    clean = np.array(fp4.dequantize(*fp4.quantize(y, mode), mode))
    np.testing.assert_array_equal(out[0, g:], clean[0, g:])
    np.testing.assert_array_equal(out[1, : D - g], clean[1, : D - g])


def _group_errors(y, codes, scales, g=32):
    out = mx.dequantize(codes, scales, group_size=g, bits=4, mode="mxfp4", dtype=mx.float32)
    return np.array(mx.sum(mx.square(out - y).reshape(*y.shape[:-1], -1, g), axis=-1))


def test_e2m1_rounding_is_mlx_quantize_at_its_own_exponent():
    """The search's own rounding (used for the neighbouring exponents) writes, at MLX's exponent,
    the codes mx.quantize writes: the same nearest level, saturation and nibble layout."""
    from oiq_mlx.core.codec import pack_codes

    for i, spread in enumerate((0.01, 1.0, 300.0)):
        y = mx.random.normal((50, 2 * D), key=mx.random.key(20 + i)) * spread
        codes, scales = mx.quantize(y, group_size=32, bits=4, mode="mxfp4")[:2]
        inv = mx.power(mx.array(2.0), 127 - scales.astype(mx.float32))
        mine = pack_codes(fp4.e2m1_codes(y.reshape(50, -1, 32) * inv[..., None]).reshape(y.shape), 4)
        assert mx.array_equal(mine, codes)


def test_exponent_search_never_worse_per_group_and_better_on_gaussian_rows():
    y = mx.random.normal((8, 64, D), key=mx.random.key(31))
    mlx_codes, mlx_scales = fp4.quantize(y, "mxfp4")
    codes, scales = fp4.quantize(y, "mxfp4", clip=True)
    assert codes.shape == mlx_codes.shape and codes.dtype == mx.uint32
    assert scales.shape == mlx_scales.shape and scales.dtype == mx.uint8
    e_mlx, e = _group_errors(y, mlx_codes, mlx_scales), _group_errors(y, codes, scales)
    assert (e <= e_mlx).all()
    assert e.sum() < 0.97 * e_mlx.sum()  # Gaussian groups of 32: about 7% less squared error
    # each group moved its exponent by at most one; where it kept MLX's, it kept MLX's codes
    step = np.array(scales).astype(int) - np.array(mlx_scales).astype(int)
    assert set(np.unique(step)) <= {-1, 0, 1} and (step != 0).any()
    words = np.array(codes).reshape(*step.shape, 4)
    mlx_words = np.array(mlx_codes).reshape(*step.shape, 4)
    np.testing.assert_array_equal(words[step == 0], mlx_words[step == 0])
    # a changed group is exactly E2M1 at its stored exponent: level x 2^(e - 127), saturated at 6
    out = np.array(fp4.dequantize(codes, scales, "mxfp4")).reshape(*step.shape, 32)
    unit = np.exp2(np.array(scales).astype(np.float64) - 127)[..., None]
    levels = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6])
    yn = np.array(y, np.float64).reshape(out.shape) / unit
    nearest = np.sign(yn) * levels[np.abs(np.abs(yn)[..., None] - levels).argmin(-1)]
    np.testing.assert_allclose(out / unit, nearest, atol=1e-6)
    # the cache's joined rows carry the searched codes and scales, split back as views
    rows = fp4.quantize_pair(mx.stack([y, 2 * y]), "mxfp4", clip=True)
    got = fp4.split_pair(rows, D, "mxfp4", 0)
    assert mx.array_equal(got[0], codes) and mx.array_equal(got[1], scales)
    with pytest.raises(ValueError, match="serves mxfp4"):
        fp4.quantize(y, "nvfp4", clip=True)


def test_exponent_search_edges_non_finite_zero_tiny_and_huge_groups():
    base = np.array(mx.random.normal((6, D), key=mx.random.key(40)))
    base[0, 5] = np.nan  # a NaN group: codes 0, the NaN scale, decodes to NaN
    base[1, D - 1] = -np.inf
    base[2, :32] = 0.0  # a zero group decodes to zeros
    base[3, :32] *= 1e-30  # tiny and huge groups: scale bytes far from 127, never the NaN byte
    base[4, :32] = np.linspace(-1e38, 1e38, 32)
    base[5, 32:] = np.r_[np.full(31, 0.01), 6.0]  # one outlier: the search keeps MLX's exponent
    y = mx.array(base.astype(np.float32))
    codes, scales = fp4.quantize(y, "mxfp4", clip=True)
    c, s = np.array(codes).reshape(6, 2, 4), np.array(scales)
    out = np.array(fp4.dequantize(codes, scales, "mxfp4"))
    assert s[0, 0] == 0xFF and (c[0, 0] == 0).all() and np.isnan(out[0, :32]).all()
    assert s[1, 1] == 0xFF and (c[1, 1] == 0).all() and np.isnan(out[1, 32:]).all()
    assert (out[2, :32] == 0).all() and np.isfinite(out[2:]).all()
    assert s[3, 0] < 40 and s[4, 0] > 240 and (s[2:] != 0xFF).all()
    for row in range(6):  # the other groups: never worse than MLX's
        clean = mx.array(np.where(np.isfinite(base[row]), base[row], 0)[None].astype(np.float32))
        fine = np.isfinite(base[row]).reshape(2, 32).all(-1)
        e = _group_errors(clean, codes[row : row + 1], scales[row : row + 1])[0]
        e_mlx = _group_errors(clean, *fp4.quantize(clean, "mxfp4"))[0]
        assert (e[fine] <= e_mlx[fine]).all()
    assert s[5, 1] == np.array(fp4.quantize(y, "mxfp4")[1])[5, 1]


# ---------------------------------------------------------------- the cache


def _filled(cfg, n=120, decode=20, seed=0):
    data = chunk_data(seed=seed, n=n + decode, d=D)
    cache, _ = run_chunks(OIQKVCache(cfg), [n] + [1] * decode, data)
    return cache, data


@CONFIGS
def test_packed_rows_are_the_rotated_rows_in_fp4(cfg):
    cache, (k, v, _) = _filled(cfg)
    s, q_end = cfg.sink_tokens, cache.q_end
    assert q_end > s + 32
    assert cache._kv_rows.shape[:1] == (1,) and cache.k.rows.shape[-1] == fp4.pair_width(D, cfg.storage)
    assert cache.k.scales.dtype == mx.uint8 and cache.k.codes.shape[-1] == D // 8
    for side, x in ((cache.k, k), (cache.v, v)):
        centered = x[:, :, s:q_end].astype(mx.float32) - (0 if side.mean is None else side.mean)
        want = fp4.quantize(side.window_to_packed(centered), cfg.storage, clip=cfg.clip)
        n = q_end - s
        assert mx.array_equal(side.codes[:, :, :n], want[0]) and mx.array_equal(side.scales[:, :, :n], want[1])
        if cfg.clip:  # the search moved some exponents away from MLX's
            assert not mx.array_equal(side.scales[:, :, :n], fp4.quantize(side.window_to_packed(centered),
                                                                          cfg.storage)[1])
    kd, vd = cache.dequantized_kv()
    for got, x in ((kd, k), (vd, v)):
        x = x[:, :, : cache.offset]
        # sinks and window in full precision (x - m stored, m added back: float rounding)
        np.testing.assert_allclose(np.array(got[:, :, :s]), np.array(x[:, :, :s]), atol=1e-5)
        np.testing.assert_allclose(np.array(got[:, :, q_end:]), np.array(x[:, :, q_end:]), atol=1e-5)
        err = mx.mean(mx.square(got[:, :, s:q_end] - x[:, :, s:q_end])) / mx.mean(mx.square(x[:, :, s:q_end]))
        assert err.item() < 0.02
    # nbytes counts the joined buffer once
    assert any(a is cache.k.rows for a in cache.k.arrays()) and all(a is not cache.v.rows for a in cache.v.arrays())
    assert cache.quantized_nbytes_formula() == cache.k.rows.shape[2] * 2 * cfg.bytes_per_token(D)


def _float64_attention(q, kd, vd, scale, causal):
    """Softmax attention in float64 over the dequantized rows (GQA), the mask aligned to the last key."""
    q, kd, vd = (np.array(x, np.float64) for x in (q, kd, vd))
    rep = q.shape[1] // kd.shape[1]
    kd, vd = np.repeat(kd, rep, 1), np.repeat(vd, rep, 1)
    s = np.einsum("bhld,bhtd->bhlt", q, kd) * scale
    L, T = q.shape[2], kd.shape[2]
    if causal and L > 1:
        s = np.where(np.arange(T - L, T)[:, None] >= np.arange(T)[None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("bhlt,bhtd->bhld", p / p.sum(-1, keepdims=True), vd)


@CONFIGS
@pytest.mark.parametrize("L", [1, 4, 12])
def test_attention_equals_a_float64_softmax_over_the_dequantized_rows(cfg, L):
    """Decode (L <= 8: mx.quantized_matmul(mode=) on the packed rows) and prefill (L > 8: the
    packed rows dequantized for SDPA) read what dequantized_kv gives."""
    cache, (k, v, q) = _filled(cfg)
    cache.release_fresh()
    kd, vd = cache.dequantized_kv()
    queries = mx.random.normal((1, 4, L, D), key=mx.random.key(9))
    # attend over what is stored: a call of L tokens that packs nothing reads the window as is
    cache.update_and_fetch(k[:, :, -L:], v[:, :, -L:])
    kd = mx.concatenate([kd, k[:, :, -L:].astype(mx.float32)], axis=2)
    vd = mx.concatenate([vd, v[:, :, -L:].astype(mx.float32)], axis=2)
    assert cache.q_end - cfg.sink_tokens > 0
    out = oiq_attention(queries, cache, D**-0.5, mask="causal" if L > 1 else None)
    want = _float64_attention(queries, kd, vd, D**-0.5, causal=True)
    np.testing.assert_allclose(np.array(out), want, atol=2e-5, rtol=1e-4)


@CONFIGS
def test_save_load_round_trip_and_mismatches_refused(cfg, tmp_path):
    model = tiny_llama(layers=2)
    cache = make_oiq_cache(model, cfg)
    model(mx.array([list(range(1, 60))]), cache=cache)
    for t in (61, 62, 63):
        model(mx.array([[t]]), cache=cache)
    path = str(tmp_path / "c.safetensors")
    save_prompt_cache(path, cache)
    loaded = load_prompt_cache(path)
    for a, b in zip(cache, loaded):
        assert b.config.storage == cfg.storage
        for x, y in zip(a.state[:-1], b.state[:-1]):
            assert (x is None and y is None) or mx.array_equal(x, y)
    step = mx.array([[70]])
    np.testing.assert_array_equal(np.array(model(step, cache=cache)), np.array(model(step, cache=loaded)))
    # the format is in the file: an fp4 state read as int storage is refused, naming the scales
    state = list(cache[0].state)
    meta = __import__("json").loads(state[-1])
    from oiq_mlx.cache.files import digest

    meta["config"] = OIQConfig(sink_tokens=cfg.sink_tokens, window=cfg.window, trim_reserve=16,
                               center_values=cfg.center_values).to_json()
    meta["digest"] = digest(meta)
    with pytest.raises(ValueError, match="keys (codes|scales) is .*expected"):
        OIQKVCache.from_state(state[:-1] + [__import__("json").dumps(meta)])
    # and an int state read as fp4 too
    int_cache = make_oiq_cache(model, OIQConfig(sink_tokens=3, window=16))
    model(mx.array([list(range(1, 60))]), cache=int_cache)
    model(mx.array([[5]]), cache=int_cache)
    state = list(int_cache[0].state)
    meta = __import__("json").loads(state[-1])
    meta["config"] = OIQConfig(storage="mxfp4", sink_tokens=3, window=16, **FP4).to_json()
    meta["digest"] = digest(meta)
    with pytest.raises(ValueError, match="keys (codes|scales) is .*expected"):
        OIQKVCache.from_state(state[:-1] + [__import__("json").dumps(meta)])
    # a NaN scale over codes that are not 0 is refused
    state = list(cache[0].state)
    scales = np.array(state[1])
    codes = np.array(state[0])
    codes[0, 0, 0, 0] = 1
    scales[0, 0, 0, 0] = 0xFF if cfg.storage == "mxfp4" else 0x7F
    with pytest.raises(ValueError, match="NaN"):
        OIQKVCache.from_state([mx.array(codes), mx.array(scales)] + state[2:])
    if cfg.storage == "nvfp4":
        scales = np.array(state[1])
        scales[0, 0, 0, 0] = 0x85
        with pytest.raises(ValueError, match="negative"):
            OIQKVCache.from_state([state[0], mx.array(scales)] + state[2:])


@CONFIGS
def test_trim_within_the_reserve_restores_what_a_fresh_cache_holds(cfg):
    data = chunk_data(seed=4, n=140, d=D)
    a, _ = run_chunks(OIQKVCache(cfg), [100] + [1] * 40, data)
    b, _ = run_chunks(OIQKVCache(cfg), [100] + [1] * 30, data)
    assert a.trim(10) == 10 and a.offset == b.offset and a.q_end == b.q_end
    n = a.q_end - cfg.sink_tokens
    for side in ("k", "v"):  # the packed rows, bit for bit; the window from the reserve, exactly
        sa, sb = getattr(a, side), getattr(b, side)
        assert mx.array_equal(sa.codes[:, :, :n], sb.codes[:, :, :n])
        assert mx.array_equal(sa.scales[:, :, :n], sb.scales[:, :, :n])
    for x, y in zip(a.dequantized_kv(), b.dequantized_kv()):
        assert mx.array_equal(x, y)
    q = mx.random.normal((1, 4, 1, D), key=mx.random.key(5))
    k, v, _ = data
    for c in (a, b):
        c.update_and_fetch(k[:, :, 130:131], v[:, :, 130:131])
    np.testing.assert_array_equal(np.array(oiq_attention(q, a, D**-0.5)), np.array(oiq_attention(q, b, D**-0.5)))


@CONFIGS
def test_chunked_prompt_is_stored_as_one_call_is(cfg):
    """exact_prefill: a prompt in chunks packs, when generation starts, what one call packs."""
    data = chunk_data(seed=6, n=130, d=D)
    a, _ = run_chunks(OIQKVCache(cfg), [128, 1, 1], data)
    b, _ = run_chunks(OIQKVCache(cfg), [40, 40, 48, 1, 1], data)
    for x, y in zip(a.state[:-1], b.state[:-1]):
        assert (x is None and y is None) or mx.array_equal(x, y)


@CONFIGS
def test_batch_decodes_one_by_one_never_stacked(cfg):
    """Stacked decode does not build the joined fp4 layout: a batch of fp4 caches is never stacked,
    and each sequence attends exactly what it attends alone."""
    datas = [chunk_data(seed=10 + i, n=80 + 30 * i, d=D) for i in range(2)]
    alone = [run_chunks(OIQKVCache(cfg), [60 + 30 * i], d)[0] for i, d in enumerate(datas)]
    joined = [copy.deepcopy(c) for c in alone]
    assert not stackable(joined)
    batch = OIQKVCache.merge(joined)
    for t in range(20):
        ks = [d[0][:, :, 60 + 30 * i + t : 61 + 30 * i + t] for i, d in enumerate(datas)]
        vs = [d[1][:, :, 60 + 30 * i + t : 61 + 30 * i + t] for i, d in enumerate(datas)]
        batch.update_and_fetch(mx.concatenate(ks), mx.concatenate(vs))
        q = mx.random.normal((2, 4, 1, D), key=mx.random.key(100 + t))
        out = oiq_batch_attention(q, batch, scale=D**-0.5)
        assert batch.stacked is None
        for i, c in enumerate(alone):
            c.update_and_fetch(ks[i], vs[i])
            np.testing.assert_array_equal(np.array(out[i : i + 1]), np.array(oiq_attention(q[i : i + 1], c, D**-0.5)))


@CONFIGS
def test_int_kernels_never_run_on_fp4_data(cfg, monkeypatch):
    """With every kernel switched on (as on a Mac), an fp4 cache still quantizes and attends
    through MLX's fp4 ops: the int kernels are never launched."""
    monkeypatch.setattr(dispatch, "kernels_enabled", lambda: True)

    def refuse(*args, **kwargs):
        raise AssertionError("an int kernel was asked to run on fp4 data")

    for name in ("kernel_quantize_rows", "kernel_quantize", "kernel_dequantize"):
        monkeypatch.setattr(dispatch, name, refuse)
    monkeypatch.setattr(attention, "decode_attention", refuse)
    data = chunk_data(seed=8, n=100, d=D)
    cache, _ = run_chunks(OIQKVCache(cfg), [60] + [1] * 30 + [9], data)  # prompt, decode steps, a prefill chunk
    assert cache.q_end > cfg.sink_tokens
    q = mx.random.normal((1, 4, 1, D), key=mx.random.key(1))
    assert attention.decode_attention_kernel(cache, q, D**-0.5, None, None) is None


def test_fp4_needs_one_head_dimension_for_keys_and_values():
    c = OIQKVCache(MX)
    with pytest.raises(ValueError, match="one head dimension"):
        c.update_and_fetch(mx.zeros((1, 2, 4, 64)), mx.zeros((1, 2, 4, 32)))


def test_generation_through_mlx_lm_runs_on_fp4():
    model = tiny_llama(layers=2)
    logits = {}
    for name, cfg in (("fp", None), ("mxfp4", MX), ("nvfp4", NV)):
        cache = make_oiq_cache(model, cfg) if cfg is not None else None
        if cache is None:
            from mlx_lm.models.cache import make_prompt_cache

            cache = make_prompt_cache(model)
        model(mx.array([list(range(1, 80))]), cache=cache)
        logits[name] = np.concatenate([np.array(model(mx.array([[t]]), cache=cache)) for t in range(80, 100)], 1)
    for name in ("mxfp4", "nvfp4"):
        assert np.isfinite(logits[name]).all()
        assert np.abs(logits[name] - logits["fp"]).max() < 0.05 * np.abs(logits["fp"]).max()


def test_prompt_cache_entries_share_the_joined_rows():
    """oiq-server's prompt cache: an fp4 entry's packed rows are the first rows of a longer entry's,
    held as views of its one joined buffer, and taken back as a copy of their own."""
    from oiq_mlx.cache.entries import own_packed_rows, packed_entry, packed_rows_match, share_packed_rows

    data = chunk_data(seed=12, n=200, d=D)
    a, _ = run_chunks(OIQKVCache(MX), [100] + [1] * 20, data)
    b, _ = run_chunks(OIQKVCache(MX), [100] + [1] * 60, data)
    ea, eb = packed_entry(a), packed_entry(b)
    assert packed_rows_match(ea, eb) and ea.packed_layout() == [(1, fp4.pair_width(D, "mxfp4"))]
    want = [packed_entry(a).dequantized_kv(), a.dequantized_kv()]
    share_packed_rows(ea, eb)
    for got in (ea.dequantized_kv(), (own_packed_rows(ea), ea.dequantized_kv())[1]):
        for x, y in zip(got, want[0]):
            assert mx.array_equal(x, y)
        for x, y in zip(got, want[1]):
            assert mx.array_equal(x, y)


def test_positional_fp4_stores_the_same_however_tokens_arrive():
    """positional (oiq-server's default): one prompt call or chunks and single tokens store the same rows."""
    import dataclasses

    cfg = dataclasses.replace(MX, positional=True)
    data = chunk_data(seed=14, n=120, d=D)
    a, out_a = run_chunks(OIQKVCache(cfg), [100] + [1] * 20, data)
    b, out_b = run_chunks(OIQKVCache(cfg), [7, 30, 1, 1, 61] + [1] * 20, data)
    for x, y in zip(a.state[:-1], b.state[:-1]):
        assert (x is None and y is None) or mx.array_equal(x, y)
    np.testing.assert_allclose(np.array(out_a), np.array(out_b), atol=1e-5)
