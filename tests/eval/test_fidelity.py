"""Presets, the statistics behind centering/key scaling, the Qwen-like stand-ins
and the fidelity sweep (oiq_mlx.eval.sweep), on tiny random models."""

import dataclasses

import mlx.core as mx
import pytest
from helpers import reference_attention, tiny_llama

from oiq_mlx.eval.fidelity import attention_fidelity
from oiq_mlx.eval import sweep as fidelity
from oiq_mlx.mlx_lm.routing import capture_attention_inputs
from oiq_mlx.cache.attention import oiq_attention
from oiq_mlx.cache.sequence import OIQKVCache
from oiq_mlx.core.config import PRESETS, OIQConfig
from oiq_mlx.eval.specs import parse_spec

# -- presets --------------------------------------------------------------------------


@pytest.mark.parametrize("name, d64, d128", [("4bit", 72, 144), ("3bit", 56, 112), ("2bit", 40, 80),
                                             ("2bit-ppl", 40, 80), ("1.5bit", 32, 64)])
def test_preset_bytes_per_token(name, d64, d128):
    cfg = OIQConfig.preset(name)
    assert cfg.bytes_per_token(64) == d64
    assert cfg.bytes_per_token(128) == d128
    assert OIQConfig.from_json(cfg.to_json()) == cfg


def test_presets_are_valid_configs_and_overridable():
    for name in PRESETS:
        cfg = OIQConfig.preset(name)
        assert cfg == OIQConfig(**dataclasses.asdict(cfg))
    assert OIQConfig.preset("4bit", window=64).window == 64
    with pytest.raises(ValueError, match="unknown OIQ preset 'fp8'.*4bit"):
        OIQConfig.preset("fp8")
    with pytest.raises(ValueError):
        OIQConfig.preset("3bit", k_bits=7)


def test_2bit_ppl_is_2bit_with_keys_half_way():
    # what docs/results.md measured as preset:2bit[key_alignment=0.5]
    assert OIQConfig.preset("2bit-ppl") == OIQConfig.preset("2bit", key_alignment=0.5)
    assert parse_spec("preset:2bit-ppl").oiq == parse_spec("preset:2bit[key_alignment=0.5]").oiq


def test_presets_fit_mlx_budgets():
    # each preset spends no more than mlx-lm's affine g64 cache of the same bits
    for name, bits in (("4bit", 4), ("3bit", 3), ("2bit", 2)):
        mlx = fidelity.parse_spec(f"mlx:{bits}")
        for d in (64, 128, 256):
            assert OIQConfig.preset(name).bytes_per_token(d) <= mlx.bytes_per_token(d)


# -- statistics estimated past the sinks ------------------------------------------------


def test_mean_and_key_scale_skip_sink_tokens():
    cfg = OIQConfig(k_bits=8, v_bits=8, sink_tokens=2, window=0, center_keys=True, center_values=True,
                    key_scaling=0.5, trim_reserve=0)
    x = mx.random.normal((1, 2, 40, 64), key=mx.random.key(0))
    x[:, :, :2] = 500.0  # outlying sink tokens (BOS-like)
    cache = OIQKVCache(cfg, head_dim=64)
    cache.update_and_fetch(x, x)
    cache.end_prefill()  # exact_prefill estimates when generation starts, on the same rows
    expect = mx.mean(x[:, :, 2:], axis=2, keepdims=True)
    # cache format 2 holds the means un-rotated (oiq_mlx.cache, DESIGN.md section 5)
    assert mx.allclose(cache.v.mean, expect, atol=1e-4)
    assert mx.allclose(cache.k.mean, expect, atol=1e-4)
    # the sink outliers did not inflate the key scales either
    assert mx.max(cache.k.lam).item() < 3.0


def test_attention_exact_with_outlying_sinks():
    cfg = OIQConfig(k_bits=8, v_bits=8, sink_tokens=2, window=4, center_keys=True, center_values=True,
                    key_scaling=1.0)
    k = mx.random.normal((1, 2, 48, 64), key=mx.random.key(1))
    v = mx.random.normal((1, 2, 48, 64), key=mx.random.key(2))
    k[:, :, 0] = 80.0
    v[:, :, 0] = -60.0
    q = mx.random.normal((1, 4, 3, 64), key=mx.random.key(3))
    cache = OIQKVCache(cfg, head_dim=64)
    cache.update_and_fetch(k[:, :, :32], v[:, :, :32])
    cache.update_and_fetch(k[:, :, 32:], v[:, :, 32:])
    out = oiq_attention(q, cache, scale=0.125, mask="causal")
    ref = reference_attention(q, k, v, 0.125)
    cos = mx.sum(out * ref, -1) / (mx.linalg.norm(out, axis=-1) * mx.linalg.norm(ref, axis=-1))
    # measured 1.0 (both calls are prefill: exact_prefill keeps their rows in full precision), so
    # only float32 rounding is left; 1e-5 is far above that rounding and far below a real error
    assert mx.min(cos).item() > 1 - 1e-5


# -- Qwen-like stand-ins -------------------------------------------------------------


def test_low_frequency_channels():
    assert fidelity.low_frequency_channels(64, 2) == [30, 31, 62, 63]
    assert fidelity.low_frequency_channels(64, 1, traditional=True) == [62, 63]


def test_add_key_bias_makes_outlier_channels():
    model = tiny_llama(head_dim=64, n_heads=4, n_kv_heads=2, layers=1)
    channels = fidelity.add_key_bias(model, ratio=25.0, n_pairs=2)
    recs = capture_attention_inputs(model, list(range(64)))
    k = recs[0]["keys"][0]  # (H, L, d), post-RoPE
    rms = mx.sqrt(mx.mean(k * k, axis=1))
    ratio = mx.max(rms[:, mx.array(channels)], axis=-1) / mx.sort(rms, axis=-1)[:, 32]
    assert mx.min(ratio).item() > 10


def test_key_bias_stand_in_biases_only_when_asked_and_says_where():
    model = tiny_llama(head_dim=64, n_heads=4, n_kv_heads=2, layers=1)
    said = []
    assert fidelity.key_bias_stand_in(model, 0.0, said.append) == []
    assert said == [] and "bias" not in model.layers[0].self_attn.k_proj
    channels = fidelity.key_bias_stand_in(model, 25.0, said.append)
    assert channels == fidelity.low_frequency_channels(64, 2)
    assert len(said) == 1 and str(channels) in said[0]
    bias = model.layers[0].self_attn.k_proj.bias.reshape(2, 64)
    assert mx.all(mx.abs(bias[:, mx.array(channels)]) > 0).item()


@pytest.fixture(scope="module")
def qwen2_fidelity():
    model = fidelity.tiny_qwen2(bias_ratio=25.0)
    ids = mx.random.randint(0, 256, (384,), key=mx.random.key(1)).tolist()
    recs = capture_attention_inputs(model, ids)
    specs = [fidelity.parse_spec(s) for s in ("oiq-plain-4", "mlx:4", "preset:4bit", "oiq-plain-3", "preset:3bit",
                                              "oiq-plain-2", "preset:2bit")]
    return {n: r["cos_mean"] for n, r in attention_fidelity(model, None, specs, records=recs).items()}


def test_qwen2_biased_keys_presets_beat_plain(qwen2_fidelity):
    cos = qwen2_fidelity
    # measured: 4-bit plain 0.964, preset 0.991 (K5V3; K4V4 had 0.996: 3-bit values cost
    # attention-output cosine, while 5-bit keys lower the end-to-end KL, README), mlx-lm 4-bit
    # g64 0.80 (same bytes/token); 3-bit plain 0.840, preset 0.986; 2-bit plain 0.570, preset 0.952
    assert cos["preset:4bit"] >= 0.99
    assert cos["preset:4bit"] > cos["oiq-plain-4"] + 0.02
    assert cos["preset:4bit"] > cos["mlx-q4-g64"]
    for bits in (3, 2):
        assert cos[f"preset:{bits}bit"] > cos[f"oiq-plain-{bits}"]
    assert cos["preset:3bit"] >= 0.98
    assert cos["preset:2bit"] >= 0.94


# -- sweep -------------------------------------------------------------------------------


def test_parse_spec():
    s = fidelity.parse_spec("mlx:3")
    assert (s.kind, s.bits, s.group_size) == ("mlx", 3, 64)
    assert s.bytes_per_token(64) == 56
    s = fidelity.parse_spec("preset:2bit[window=8, clip=false]")
    assert s.oiq == OIQConfig.preset("2bit", window=8, clip=False)
    assert fidelity.parse_spec("oiq-4").oiq == parse_spec("oiq-4").oiq
    with pytest.raises(ValueError, match="unknown OIQ preset"):
        fidelity.parse_spec("preset:1bit")


def test_sweep_rows_on_tiny_model():
    model = tiny_llama(head_dim=64, n_heads=4, n_kv_heads=2, layers=2, vocab=128)
    tokens = mx.random.randint(0, 128, (200,), key=mx.random.key(4)).tolist()
    specs = [fidelity.parse_spec(s) for s in ("oiq[k_bits=8,v_bits=8]", "preset:2bit")]
    rows = fidelity.sweep(model, tokens, specs, prompt_len=96, score_len=96, chunk=32)
    assert [r["name"] for r in rows] == ["fp", "oiq[k_bits=8,v_bits=8]", "preset:2bit"]
    assert rows[0]["ppl_delta"] == 0 and rows[0]["kl"] == 0
    # KL measured 1.0e-6 (top-1 1.0): 3x, as the sweep is deterministic on a fixed model and tokens
    assert rows[1]["kl"] < 3e-6 and rows[1]["top1"] > 0.97
    assert rows[2]["bytes_per_token"] == 40
    # nbytes with float16 keys and values, after the evaluation's calls: fp is mlx-lm's
    # KVCache, 256 rows allocated (steps of 256) for 192 tokens; the preset adds to its
    # 40 bytes the sinks, window, reserve and means, within issue 16's fixed cost
    assert rows[0]["bytes_allocated"] == pytest.approx(256 * 256 / 192)
    # packed rows: whole blocks, capacity one block ahead at most (grown on the step before packing)
    cfg = OIQConfig.preset("2bit")
    packed = (OIQKVCache(cfg).packed_end(192) - cfg.sink_tokens + OIQKVCache.step) * 40
    # full-precision rows; float32 vectors per KV head: key and value means, key scales and
    # their stacked copy (2), and the 4 sign vectors of the layer over its 2 KV heads
    window = OIQConfig.preset("2bit").window
    fixed = (4 + window + 16 + 16) * 256 + (2 + 1 + 2 + 4 // 2) * 64 * 4
    assert 40 < rows[2]["bytes_allocated"] <= (packed + fixed) / 192
    assert "| preset:2bit | 40 |" in fidelity.frontier_table(rows)
    # the perplexity change's 95% interval (3 blocks of 32 scored tokens) holds the change
    assert rows[0]["ppl_delta_ci95"] == [0.0, 0.0]
    for r in rows[1:]:
        lo, hi = r["ppl_delta_ci95"]
        assert lo < r["ppl_delta"] < hi
    table = fidelity.frontier_table(rows)
    assert "| vs fp | 95% interval | KL |" in table and "| +0.00% | - |" in table
    lo, hi = rows[2]["ppl_delta_ci95"]
    assert f"| {100 * lo:+.2f}% to {100 * hi:+.2f}% |" in table
    # rows written before the interval was measured keep the table they had
    assert "95% interval" not in fidelity.frontier_table([{**r, "ppl_delta_ci95": None} for r in rows])
