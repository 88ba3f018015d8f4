"""The latency benchmark runs end to end on a tiny random llama and reports
byte counts that match each cache's storage formula.

Timings are recorded, never asserted: this is not a timed test.
"""

import io
import itertools
import json
import math
import subprocess
import sys
from pathlib import Path

import oiq_mlx  # noqa: F401  (preloads OpenBLAS before mlx is imported)

import mlx.core as mx
import pytest

from helpers import tiny_gemma3, tiny_llama
from oiq_mlx.bench import attention, latency as bench
from oiq_mlx.cache import reading
from oiq_mlx.cache.sequence import OIQKVCache
from oiq_mlx.core.config import OIQConfig

ROOT = Path(__file__).resolve().parents[2]
N_LAYERS, N_HEADS, N_KV, HEAD_DIM = 2, 4, 2, 64
CONTEXTS, STEPS, WARMUP, CHUNK = (40, 300), 3, 1, 128
STEP = 256  # mlx-lm KVCache / QuantizedKVCache growth step


class ByteTokenizer:
    def encode(self, text):
        return list(text.encode("utf-8"))


@pytest.fixture(scope="module")
def tiny_model():
    return tiny_llama(head_dim=HEAD_DIM, n_heads=N_HEADS, n_kv_heads=N_KV, layers=N_LAYERS, vocab=256,
                      intermediate_size=256, max_position_embeddings=4096)


@pytest.fixture(scope="module")
def model_result(tiny_model, tmp_path_factory):
    specs = bench.default_specs(oiq_bits=(4, 3, 2), mlx_bits=(4, 8))
    records = bench.run_model(
        tiny_model, ByteTokenizer(), contexts=CONTEXTS, specs=specs, decode_steps=STEPS, warmup=WARMUP,
        prefill_chunk=CHUNK, text="It is a truth universally acknowledged. " * 20, progress=None,
    )
    path = tmp_path_factory.mktemp("bench") / "out.json"
    bench.save_json({"environment": bench.environment(), "model_runs": records}, path)
    return json.loads(path.read_text()), specs


def appends(last_context, kind):
    """Chunk sizes written to a cache, in order, up to the decode steps at
    ``last_context``: prefill to each context, then single decode steps;
    mlx-lm quantized caches start from scratch at each context."""
    out, fed = [], 0
    for n in CONTEXTS[: CONTEXTS.index(last_context) + 1]:
        if kind == "mlx":
            out, fed = [], 0
        out += [min(CHUNK, n - i) for i in range(fed, n, CHUNK)] + [1] * (WARMUP + STEPS)
        fed = n + WARMUP + STEPS
    return out


def mlx_capacity(chunks):
    """Capacity rule of mlx-lm's KVCache and QuantizedKVCache: on overflow, trim to
    the used length if it is not a step multiple, then add ceil(L / step) steps."""
    cap = used = 0
    for n in chunks:
        if used + n > cap:
            cap = (used if used % STEP else cap) + math.ceil(n / STEP) * STEP
        used += n
    return cap


def oiq_bytes_per_token(dim, bits, group_size):
    return dim * bits // 8 + 2 * (dim // group_size)


def test_records_are_complete(model_result):
    result, specs = model_result
    runs = result["model_runs"]
    assert [(r["context"], r["cache"]) for r in runs] == [(n, s.name) for n in CONTEXTS for s in specs]
    for r in runs:
        assert len(r["decode_ms"]) == STEPS and all(t > 0 for t in r["decode_ms"])
        st = r["decode_ms_stats"]
        assert st["p10"] <= st["median"] <= st["p90"]
        assert r["prefill_s"] > 0 and r["prefill_peak_bytes"] > 0 and r["decode_peak_bytes"] >= r["kv_bytes"] > 0
        assert r["cache_tokens"] == r["context"] + WARMUP + STEPS
        assert r["kv_dtype"] == "float32"
    assert result["environment"]["versions"]["mlx"] == mx.__version__
    fp = [r for r in runs if r["kind"] == "fp"]
    assert all(r["decode_ratio_vs_fp"] == 1.0 for r in fp)


def test_kv_bytes_match_cache_formulas(model_result):
    result, _ = model_result
    for r in result["model_runs"]:
        T = r["cache_tokens"]
        chunks = appends(r["context"], r["kind"])
        assert sum(chunks) == T
        cap = mlx_capacity(chunks)
        if r["kind"] == "fp":
            per_layer = 2 * N_KV * cap * HEAD_DIM * 4
        elif r["kind"] == "mlx":
            words = HEAD_DIM * r["bits"] // 32
            per_layer = 2 * N_KV * cap * (4 * words + 2 * 4 * HEAD_DIM // 64)
        else:
            b = r["bits"]
            cfg = OIQConfig.preset(f"{b}bit")  # the benchmark's OIQ caches are the presets
            # packed rows in whole blocks, capacity in steps of one block
            n_q = max(0, OIQKVCache(cfg).packed_end(T) - cfg.sink_tokens)
            cap_q = math.ceil(n_q / OIQKVCache.step) * OIQKVCache.step
            quant = N_KV * cap_q * 2 * oiq_bytes_per_token(HEAD_DIM, b, cfg.group_size)
            sink = 2 * N_KV * cfg.sink_tokens * HEAD_DIM * 4
            mean = (int(cfg.center_keys) + int(cfg.center_values)) * N_KV * HEAD_DIM * 4
            lam = N_KV * HEAD_DIM * 4 if cfg.key_scaling else 0  # per-channel key scales
            signs = 2 * HEAD_DIM * 4
            # once a block of at most 64 rows was packed (a decode step's, not a prompt's): the
            # stacked quantize pass's copies of both sides' key scales and signs
            ends = list(itertools.accumulate(chunks, initial=0))
            packed_end = OIQKVCache(cfg).packed_end
            moved = [packed_end(b) - packed_end(a) for a, b in zip(ends, ends[1:])]
            stacked = (2 * lam + signs) if any(0 < m <= 64 for m in moved) else 0
            recent_caps = {layer["arrays"]["k.recent"][2] for layer in r["kv_layout"]}
            assert len(recent_caps) == 1
            cap_r = recent_caps.pop()
            # the window buffer: whole steps of recent_step rows, at most window + reserve + one block
            step = OIQKVCache.recent_step
            assert cap_r % step == 0 and min(cfg.window, T) <= cap_r <= cfg.window + cfg.trim_reserve + step
            # on the CPU, up to CPU_MEMO_ROWS packed rows, the values (and 3/5/6-bit keys)
            # kept repacked for MLX's kernel: the rows the last step read, which are those packed
            # before it when it packed a block (the next step repacks)
            kept_bits = sum(reading.CPU_MEMO_BITS[side].get(bits, 0) for side, bits in (("k", cfg.k_bits),
                                                                                          ("v", cfg.v_bits)))
            read = n_q if moved[-1] == 0 else max(0, packed_end(ends[-2]) - cfg.sink_tokens) or n_q
            held = mx.default_device() == mx.cpu and 0 < read <= reading.CPU_MEMO_ROWS
            kept = N_KV * read * HEAD_DIM * kept_bits // 8 if held else 0
            per_layer = quant + sink + mean + lam + signs + stacked + kept + 2 * N_KV * cap_r * HEAD_DIM * 4
        assert r["kv_bytes"] == N_LAYERS * per_layer, (r["context"], r["cache"])


def test_sliding_window_model_skips_mlx_quantized_caches():
    """mlx-lm cannot quantize a RotatingKVCache (Gemma 3's local layers): the bench
    says so and runs the other caches rather than crashing on its first prefill."""
    log = io.StringIO()
    specs = bench.default_specs(oiq_bits=(4,), mlx_bits=(4,))
    records = bench.run_model(tiny_gemma3(layers=3, sliding_window=16), ByteTokenizer(), contexts=(40,), specs=specs,
                              decode_steps=1, warmup=1, prefill_chunk=32, text="abc " * 30, progress=log)
    assert sorted(r["cache"] for r in records) == sorted(s.name for s in specs if s.kind != "mlx")
    assert "skipping mlx-lm's quantized caches: RotatingKVCache" in log.getvalue(), log.getvalue()


def test_attention_mode():
    specs = bench.default_specs(oiq_bits=(4,), mlx_bits=(4,))
    records = attention.run_attention(contexts=(40, 300), specs=specs, steps=2, warmup=1, n_q_heads=4, n_kv_heads=2,
                                  head_dim=64, progress=None)
    assert len(records) == 2 * len(specs)
    by = {(r["context"], r["cache"]): r for r in records}
    for n in (40, 300):
        T = n + 2 + 1  # tokens present at the last timed step
        assert by[(n, "fp")]["bytes_read"][-1] == 2 * 2 * T * 64 * 4
        assert by[(n, "mlx-q4")]["bytes_read"][-1] == 2 * 2 * T * (64 * 4 // 8 + 2 * 4)
        cfg = OIQConfig()
        n_q = OIQKVCache(cfg).packed_end(T) - cfg.sink_tokens  # whole blocks past sinks + window
        fp_rows = T - n_q
        expected = 2 * n_q * 2 * oiq_bytes_per_token(64, 4, 32) + 2 * 2 * fp_rows * 64 * 4
        assert by[(n, "oiq-4bit")]["bytes_read"][-1] == expected
        for r in (by[(n, s.name)] for s in specs):
            assert r["gb_per_s"] > 0 and len(r["attention_ms"]) == 2 and len(r["append_ms"]) == 2


def test_tables_and_contexts(model_result):
    result, _ = model_result
    table = bench.model_table(result["model_runs"])
    assert table.count("\n") == 1 + len(result["model_runs"])
    assert bench.parse_contexts("512,1k, 2k") == [512, 1024, 2048]
    with pytest.raises(ValueError):
        bench.parse_contexts("")


def test_script_help():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_latency.py"), "--help"],
                         capture_output=True, text=True, check=True, timeout=60).stdout
    for option in ("--model", "--contexts", "--quick", "--json", "--mode", "--oiq-bits", "--mlx-bits"):
        assert option in out


def test_oiq_settings_are_the_presets():
    specs = {s.name: s for s in bench.default_specs(oiq_bits=(4, 3, 2, 8), mlx_bits=())}
    for b in (4, 3, 2):
        assert specs[f"oiq-{b}bit"].oiq == OIQConfig.preset(f"{b}bit")
    assert specs["oiq-8bit"].oiq == OIQConfig(k_bits=8, v_bits=8)


def test_group_size_replaces_only_the_group_size():
    """``bench_latency.py --group-size`` benchmarks the presets at another group size (it once
    replaced every preset by the 4bit defaults at the preset's bits)."""
    specs = {s.name: s for s in bench.default_specs(oiq_bits=(4, 3, 2), mlx_bits=(), group_size=64, fp=False)}
    for b in (4, 3, 2):
        assert specs[f"oiq-{b}bit"].oiq == OIQConfig.preset(f"{b}bit", group_size=64)
        assert specs[f"oiq-{b}bit"].group_size == 64


def test_server_bench_memory_only(tmp_path):
    """``bench_server.py --memory-only``: the KV bytes / capacity figure without starting a
    server, in the model's dtype (float32 here) and as a float16 model holds it; OIQ's packed
    buffers hold no unused rows (capacity grows one block at a time)."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_server.py"), "--memory-only", "--memory-lengths", "1000",
         "--caches", "fp,preset:4bit", "--kv-budget-mib", "64", "--memory-batch", "2", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert "sequences in 64 MiB" in out.stdout and "tok/s" not in out.stdout
    assert not list(tmp_path.glob("server_*.log"))  # no server was started
    mem = {m["spec"]: m for m in json.loads((tmp_path / "bench_server.json").read_text())["memory"]}
    fp, oiq = mem["fp"], mem["preset:4bit"]
    # mlx-lm's KVCache: capacity in steps of 256 (1024 rows for 1000 tokens), 4 bytes a value here
    assert fp["dtype"] == "float32" and fp["bytes"] == 2 * fp["fp16_model_bytes"] == 2 * fp["fp16_bytes"] * 1024 // 1000
    assert fp["sequences_in_budget"] == 64 * 2**20 // fp["bytes"]
    # one layer's cache of the demo model's shape (3 KV heads of 64), filled the same way
    cache = OIQKVCache(OIQConfig.preset("4bit"))
    kv = mx.random.normal((1, 3, 1000, 64)).astype(mx.float16)
    cache.update_and_fetch(kv, kv)
    cache.end_prefill()
    assert cache.k.rows.shape[2] == cache.q_end - cache.config.sink_tokens  # no unused packed rows
    assert oiq["fp16_model_bytes"] == 30 * cache.nbytes
    assert oiq["fp16_model_bytes"] < oiq["bytes"] < fp["fp16_bytes"] / 2
    # two sequences decoding together: mlx-lm's BatchKVCache (its merge and its steps of 256 rows
    # leave 1256 rows allocated for 1001-1016 tokens), and OIQ's stacked buffers, which hold each
    # sequence's rows plus spare window rows
    assert fp["batch"] == oiq["batch"] == 2
    assert fp["fp16_model_batch_ratio"] == pytest.approx(sum(1256 / (1000 + t) for t in range(1, 17)) / 16)
    assert oiq["fp16_model_bytes"] / oiq["fp16_bytes"] < oiq["fp16_model_batch_ratio"] < 0.4


@pytest.mark.parametrize("argv,message", [
    (["--memory-only", "--memory-lengths", ""], "nothing to measure"),
    (["--memory-only", "--memory-batch", "0"], "--memory-batch must be >= 1, got 0"),
])
def test_server_bench_rejects_empty_measurements(argv, message, tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_server.py"), *argv, "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and message in out.stderr, out.stderr
    assert not list(tmp_path.iterdir())  # refused before writing anything
