"""One attention layer at decode, B = 1, synthetic q/K/V: the attention mode of the latency
benchmark (:func:`run_attention`: append and attention times, bytes read per step, GB/s) and the
dispatches per decode step of each cache configuration (:func:`dispatch_counts`, counted by
``oiq_mlx.bench.trace``).

The cache configurations, the shared helpers and the model mode are in :mod:`oiq_mlx.bench.latency`;
``scripts/bench_latency.py`` is the command-line front end of both.
"""

from __future__ import annotations

import functools
import sys
import time

import mlx.core as mx
import numpy as np
from mlx_lm.models.base import quantized_scaled_dot_product_attention

from . import trace
from ..cache.attention import oiq_attention
from ..cache.sequence import OIQKVCache
from ..eval.specs import CacheSpec
from .latency import cache_arrays, describe, layer_cache, log_progress, mib, ratio_vs_mlx, sample_stats


def attention_call(spec: CacheSpec, cache, fetched, q, scale):
    """The decode attention of query ``q`` over ``cache`` (``fetched``: what its ``update_and_fetch``
    returned), as a model running that configuration computes it."""
    if spec.kind == "oiq":
        return oiq_attention(q, cache, scale=scale, mask=None)
    keys, values = fetched
    if spec.kind == "mlx":
        return quantized_scaled_dot_product_attention(q, keys, values, scale=scale, mask=None,
                                                      group_size=spec.group_size, bits=spec.bits)
    return mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=None)


def attention_bytes_read(spec: CacheSpec, cache) -> int:
    """Bytes of cached K/V one decode attention step reads (used tokens only,
    not spare capacity): fp K and V; mlx-lm codes, scales and biases; OIQ
    codes and scales of the packed segment plus the full-precision sink and
    window rows (the per-head vectors, signs and means, are left out)."""
    if spec.kind == "oiq":
        sink_k, sink_v, quant, recent_k, recent_v = cache.segments()
        parts = [sink_k, sink_v, recent_k, recent_v] + list(quant or ())
        return int(sum(a.nbytes for a in parts if a is not None))
    n = cache.offset
    arrays = cache_arrays(cache)
    return int(sum(a.nbytes // a.shape[2] * n for a in arrays))


def run_attention(
    *,
    contexts,
    specs,
    steps: int = 20,
    warmup: int = 3,
    n_q_heads: int = 32,
    n_kv_heads: int = 8,
    head_dim: int = 128,
    dtype=None,
    fill_chunk: int = 2048,
    seed: int = 0,
    progress=sys.stderr,
) -> list[dict]:
    """One attention layer at decode, B = 1, synthetic Gaussian q/K/V.

    Each cache is filled to ``n`` tokens, then every step appends one token
    (``append_ms``: ``update_and_fetch`` and evaluating the cache, i.e. the
    quantization of the token leaving the window for OIQ) and runs the decode
    attention of one query (``attention_ms``).  ``dtype`` defaults to float16
    on Metal and float32 elsewhere (float16 is emulated, slow, on x86).
    """
    if dtype is None:
        dtype = mx.float16 if mx.metal.is_available() and mx.default_device() == mx.gpu else mx.float32
    scale = head_dim ** -0.5
    key = mx.random.key(seed)
    records = []
    for n in contexts:
        caches, rows = [], []
        for spec in specs:
            cache = layer_cache(spec)
            for i in range(0, n, fill_chunk):
                m = min(fill_chunk, n - i)
                k1, k2, key = mx.random.split(key, 3)
                kv = mx.random.normal((2, 1, n_kv_heads, m, head_dim), key=k1).astype(dtype)
                cache.update_and_fetch(kv[0], kv[1])
                mx.eval(cache_arrays(cache))
            if isinstance(cache, OIQKVCache):
                cache.end_prefill()  # exact_prefill: the decode steps timed here read the prompt packed
                mx.eval(cache_arrays(cache))
            caches.append(cache)
            rows.append({
                "context": n, "cache": spec.name, **{k: v for k, v in describe(spec).items() if k != "name"},
                "n_q_heads": n_q_heads, "n_kv_heads": n_kv_heads, "head_dim": head_dim,
                "dtype": str(dtype).split(".")[-1], "append_ms": [], "attention_ms": [], "bytes_read": [],
            })
        log_progress(progress, f"bench: attention ctx {n}: caches filled")
        for step in range(warmup + steps):
            k1, k2, key = mx.random.split(key, 3)
            kv = mx.random.normal((2, 1, n_kv_heads, 1, head_dim), key=k1).astype(dtype)
            q = mx.random.normal((1, n_q_heads, 1, head_dim), key=k2).astype(dtype)
            mx.eval(kv, q)
            for spec, cache, row in zip(specs, caches, rows):
                mx.synchronize()
                t0 = time.perf_counter()
                fetched = cache.update_and_fetch(kv[0], kv[1])
                mx.eval(cache_arrays(cache))
                t1 = time.perf_counter()
                out = attention_call(spec, cache, fetched, q, scale)
                mx.eval(out)
                t2 = time.perf_counter()
                if step >= warmup:
                    row["append_ms"].append((t1 - t0) * 1e3)
                    row["attention_ms"].append((t2 - t1) * 1e3)
                    row["bytes_read"].append(attention_bytes_read(spec, cache))
        for cache, row in zip(caches, rows):
            row["append_ms_stats"] = sample_stats(row["append_ms"])
            row["attention_ms_stats"] = sample_stats(row["attention_ms"])
            row["kv_bytes"] = int(cache.nbytes)
            med_bytes = float(np.median(row["bytes_read"]))
            row["bytes_read_per_step"] = int(med_bytes)
            row["gb_per_s"] = med_bytes / (row["attention_ms_stats"]["median"] * 1e-3) / 1e9
        fp = next((r for r in rows if r["kind"] == "fp"), None)
        for row in rows:
            ratio_vs_mlx(row, rows, "append_ms_stats", "append_ratio_vs_mlx")
            if fp is not None:
                row["attention_ratio_vs_fp"] = row["attention_ms_stats"]["median"] / fp["attention_ms_stats"]["median"]
            log_progress(progress, f"bench: attention ctx {n} {row['cache']}: append {row['append_ms_stats']['median']:.3f} ms, "
                                   f"attention {row['attention_ms_stats']['median']:.3f} ms, {row['gb_per_s']:.2f} GB/s")
        records.extend(rows)
        del caches
    return records


def attention_table(records: list[dict]) -> str:
    lines = [
        "| context | cache | append ms (p10-p90) | append vs mlx-lm same bits | attention ms (p10-p90) | vs fp | bytes read/step | GB/s |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in records:
        a, t = r["append_ms_stats"], r["attention_ms_stats"]
        ratio = f"{r['attention_ratio_vs_fp']:.2f}x" if "attention_ratio_vs_fp" in r else "-"
        append_ratio = f"{r['append_ratio_vs_mlx']:.2f}x" if "append_ratio_vs_mlx" in r else "-"
        lines.append(
            f"| {r['context']} | {r['cache']} | {a['median']:.3f} ({a['p10']:.3f}-{a['p90']:.3f}) | {append_ratio} | "
            f"{t['median']:.3f} ({t['p10']:.3f}-{t['p90']:.3f}) | {ratio} | {mib(r['bytes_read_per_step'])} MiB | {r['gb_per_s']:.2f} |"
        )
    return "\n".join(lines)


def dispatch_counts(specs, *, n_q_heads: int = 32, n_kv_heads: int = 8, head_dim: int = 128, context: int = 2048,
                    steps: int = 32, kernels=(False, True)) -> list[dict]:
    """Dispatches per layer per decode step of each configuration (``oiq_mlx.bench.trace``): the
    reference path, and for OIQ the path with the Metal kernels selected (counted off a Mac)."""
    out = []
    for spec in specs:
        for k in kernels if spec.kind == "oiq" else (False,):
            r = trace.decode_dispatches(
                functools.partial(layer_cache, spec),
                lambda c, fetched, q, spec=spec: attention_call(spec, c, fetched, q, head_dim ** -0.5),
                context=context, n_q_heads=n_q_heads, n_kv_heads=n_kv_heads, head_dim=head_dim, steps=steps,
                kernels=k)
            out.append({"cache": spec.name, "kind": spec.kind, "path": "metal kernels" if k else "reference",
                        "context": context, **{f: r[f] for f in ("min", "max", "mean", "breakdown")}})
    return out


def dispatch_table(records: list[dict]) -> str:
    lines = ["| cache | path | dispatches per layer per decode step (steady) | costliest step | mean |",
             "|---|---|---:|---:|---:|"]
    for r in records:
        lines.append(f"| {r['cache']} | {r['path']} | {r['min']} | {r['max']} | {r['mean']:.2f} |")
    return "\n".join(lines)
