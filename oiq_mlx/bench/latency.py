"""Latency and memory benchmark of KV caches: full precision, mlx-lm quantized, OIQ.

Two modes, both measuring every cache configuration side by side in one
process (decode steps are interleaved round-robin across configurations, so
noise from other processes hits all of them alike):

* model (:func:`run_model`): a real model, the same prompt cut to each context
  length; prefill time, decode ms/token (every sample kept), KV bytes held
  (``nbytes`` summed over layers) and peak memory of prefill and decode;
* attention (:func:`oiq_mlx.bench.attention.run_attention`): one layer with
  synthetic q/K/V, timing the cache append (quantize) and the decode attention
  alone, the bytes that attention reads per step and the resulting GB/s.

This module holds the cache configurations, the helpers both modes share, the
model mode and the reporting (model table, plots, JSON); the attention mode and
the dispatch counts of one decode step are in :mod:`oiq_mlx.bench.attention`.

Peak memory comes from ``mx.get_peak_memory`` (tracked by the CPU allocator
too), reported *over* the memory that was active before the measured work
started (model weights and other configurations' caches excluded).

``scripts/bench_latency.py`` is the command-line front end.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import sys
import time

import mlx.core as mx
import mlx_lm
import numpy as np
from mlx_lm.generate import maybe_quantize_kv_cache
from mlx_lm.models.cache import CacheList, KVCache, QuantizedKVCache, make_prompt_cache

from ..core.version import __version__
from ..core.platform import openblas_path
from ..cache.sequence import OIQKVCache
from ..mlx_lm.routing import install
from ..mlx_lm.models import default_text
from ..eval.specs import CacheSpec, parse_spec

MLX_QUANTIZED_KV_START = 0  # quantize from the first prefill chunk on (mlx_lm's default start is 5000)
DEFAULT_CONTEXTS = (512, 1024, 2048, 4096, 8192, 16384, 32768)
QUICK_CONTEXTS = (512, 2048)


def model_cache(spec: CacheSpec, model) -> list:
    """The cache the model runs start from: OIQ, else mlx-lm's own (``mlx``
    caches are converted by :func:`after_chunk`, as ``mlx_lm.generate`` does)."""
    if spec.kind == "oiq":
        return spec.make_cache(model)
    return make_prompt_cache(model)


def after_chunk(spec: CacheSpec, cache: list) -> None:
    """What ``mlx_lm.generate`` does after each prefill chunk: with
    ``kv_bits`` set, convert every cache that holds ``quantized_kv_start``
    (here 0) tokens to ``QuantizedKVCache``, so the first chunk runs in
    full precision and later chunks and decoding on the quantized cache."""
    if spec.kind == "mlx":
        maybe_quantize_kv_cache(cache, MLX_QUANTIZED_KV_START, spec.group_size, spec.bits)


def layer_cache(spec: CacheSpec):
    if spec.kind == "oiq":
        return OIQKVCache(spec.oiq, layer_idx=0)
    if spec.kind == "mlx":
        return QuantizedKVCache(group_size=spec.group_size, bits=spec.bits)
    return KVCache()


def describe(spec: CacheSpec) -> dict:
    d = {"name": spec.name, "kind": spec.kind, "bits": None if spec.kind == "fp" else spec.bits}
    if spec.oiq is not None:
        d["oiq_config"] = dataclasses.asdict(spec.oiq)
    if spec.kind == "mlx":
        d["group_size"] = spec.group_size
        d["quantized_kv_start"] = MLX_QUANTIZED_KV_START
    return d


def default_specs(oiq_bits=(4, 3, 2), mlx_bits=(4, 8), group_size: int | None = None, fp: bool = True):
    """fp, then mlx-lm quantized at each of ``mlx_bits`` (group 64), then OIQ
    at each of ``oiq_bits`` bits per coordinate: the preset of that name
    (``OIQConfig.preset("4bit")``, K5V3 ...) where one exists, else the defaults
    with ``k_bits = v_bits`` at those bits; ``group_size`` replaces the OIQ group size and nothing else.  Named as
    :func:`oiq_mlx.eval.specs.parse_spec` reads them (``mlx-q4``, ``oiq-4bit``)."""
    specs = [parse_spec("fp")] if fp else []
    specs += [parse_spec(f"mlx-q{b}") for b in mlx_bits]
    for b in oiq_bits:
        spec = parse_spec(f"oiq-{b}bit")
        if group_size is not None:
            spec = dataclasses.replace(spec, group_size=group_size,
                                       oiq=dataclasses.replace(spec.oiq, group_size=group_size),
                                       description=f"{spec.description}, group {group_size}")
        specs.append(spec)
    return specs


# -- helpers ---------------------------------------------------------------------


def parse_contexts(text: str) -> list[int]:
    """``"512,1k,2k"`` -> ``[512, 1024, 2048]``."""
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        n = int(float(part[:-1]) * 1024) if part.endswith("k") else int(part)
        if n < 1:
            raise ValueError(f"context lengths must be positive, got {part!r}")
        out.append(n)
    if not out:
        raise ValueError("no context lengths given")
    return out


def cache_arrays(obj):
    """Every mx.array a cache (or list of caches) holds."""
    if obj is None:
        return []
    if isinstance(obj, mx.array):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [a for x in obj for a in cache_arrays(x)]
    if isinstance(obj, OIQKVCache):
        return [a for side in (obj.k, obj.v) for a in _side_arrays(side).values()]
    if isinstance(obj, CacheList):
        return cache_arrays(list(obj.caches))
    return cache_arrays(getattr(obj, "keys", None)) + cache_arrays(getattr(obj, "values", None))


def _side_arrays(side) -> dict:
    return {name: a for name, a in vars(side).items() if isinstance(a, mx.array)}


def kv_nbytes(cache) -> int:
    """``nbytes`` summed over the layers of a prompt cache (allocated capacity)."""
    return int(sum(c.nbytes for c in cache if not c.empty()))  # QuantizedKVCache.nbytes fails when empty


def sample_stats(samples_ms) -> dict:
    a = np.asarray(samples_ms, dtype=np.float64)
    return {
        "median": float(np.median(a)),
        "p10": float(np.percentile(a, 10)),
        "p90": float(np.percentile(a, 90)),
        "mean": float(a.mean()),
        "n": int(a.size),
    }


def log_progress(progress, msg):
    if progress is not None:
        print(msg, file=progress, flush=True)


def environment() -> dict:
    """Machine, backend and versions, for the JSON record."""
    metal = bool(mx.metal.is_available())
    return {
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
        },
        "backend": "gpu (metal)" if mx.default_device() == mx.gpu and metal else str(mx.default_device()),
        "metal_available": metal,
        "openblas_preloaded": openblas_path,
        "versions": {"mlx": mx.__version__, "mlx_lm": mlx_lm.__version__, "oiq_mlx": __version__, "numpy": np.__version__},
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def ratio_vs_mlx(row: dict, rows: list[dict], stats: str, name: str) -> None:
    """An OIQ row's median over the mlx-lm quantized row of the same bits, measured alongside."""
    mlx = next((r for r in rows if r["kind"] == "mlx" and r["bits"] == row["bits"]), None)
    if row["kind"] == "oiq" and mlx is not None:
        row[name] = row[stats]["median"] / mlx[stats]["median"]


def _peak_since(active_before: int) -> int:
    return int(mx.get_peak_memory()) - active_before


def _start_peak() -> int:
    mx.synchronize()
    mx.reset_peak_memory()
    return int(mx.get_active_memory())


# -- model mode ------------------------------------------------------------------


def prompt_tokens(tokenizer, n: int, text: str | None = None) -> list[int]:
    """The first ``n`` tokens of ``text`` (default: the vendored Austen excerpt), repeated as needed."""
    if text is None:
        text = default_text()
    ids = list(tokenizer.encode(text))
    if not ids:
        raise ValueError("the prompt text encodes to no tokens")
    while len(ids) < n:
        ids = ids + ids
    return ids[:n]


def model_max_context(model) -> int | None:
    args = getattr(model, "args", None)
    n = getattr(args, "max_position_embeddings", None)
    return int(n) if n else None


def _prefill(model, spec: CacheSpec, cache, tokens: list[int], chunk: int) -> tuple[float, int]:
    """Feed ``tokens`` in chunks, evaluating only the cache (as ``mlx_lm.generate``
    does: no logits for prompt positions).  Returns (seconds, peak bytes over
    the memory active before the call, this cache's bytes included)."""
    seconds, peak = 0.0, 0
    for i in range(0, len(tokens), chunk):
        held = kv_nbytes(cache)
        before = _start_peak()
        t0 = time.perf_counter()
        model(mx.array(tokens[i : i + chunk])[None], cache=cache)
        after_chunk(spec, cache)
        mx.eval(cache_arrays(cache))
        seconds += time.perf_counter() - t0
        peak = max(peak, held + _peak_since(before))
    return seconds, peak


def _decode_step(model, cache, token: int):
    logits = model(mx.array([[token]]), cache=cache)
    nxt = mx.argmax(logits[:, -1, :], axis=-1)
    mx.eval(nxt, cache_arrays(cache))
    return nxt


def _mlx_quantization_gap(model) -> str | None:
    """Why ``mlx_lm.generate(kv_bits=...)`` cannot run on ``model``, or None:
    mlx-lm converts every layer's cache with ``to_quantized``, which its
    ``RotatingKVCache`` (sliding-window layers, as Gemma 3's) does not implement."""
    for c in make_prompt_cache(model):
        try:
            c.to_quantized(group_size=64, bits=4)
        except NotImplementedError as e:
            return f"{type(c).__name__} cannot be quantized by mlx-lm ({e})"
    return None


def run_model(
    model,
    tokenizer,
    *,
    contexts,
    specs,
    decode_steps: int = 20,
    warmup: int = 3,
    prefill_chunk: int = 2048,
    text: str | None = None,
    progress=sys.stderr,
) -> list[dict]:
    """Prefill + decode benchmark; one record per (context, cache configuration).

    One pass per configuration over one prompt, contexts in increasing order:
    each cache is prefilled up to the next context length ``n`` (chunks of at
    most ``prefill_chunk`` tokens that end at the context lengths; only the
    cache is evaluated, as in ``mlx_lm.generate``), then all configurations
    run ``warmup + decode_steps`` decode steps, one step each in turn; the
    last ``decode_steps`` are timed.  mlx-lm quantized caches instead
    prefill from scratch at every context (see :func:`after_chunk`).
    A step is a full forward pass of one
    token, the greedy argmax and evaluating the cache; the token fed is the
    next prompt token (teacher forcing: same work as free-running decoding,
    and the cache keeps holding the prompt, so the next context continues
    from it).  ``prefill_s`` is the prefill time of all ``n`` tokens (sum of
    chunk times and of the first decode step after each prefill, as mlx-lm counts
    the last prompt token's step as prompt time; with ``exact_prefill`` that step
    packs the prompt); ``prefill_peak_bytes`` the largest peak of those so far.
    ``kv_bytes_after_prefill`` is taken before that step (an ``exact_prefill``
    cache still holds the prompt in full precision there).  The last context is
    shortened when decoding would pass the model's maximum (``prompt_tokens`` says
    by how much).

    Every byte figure is over the memory active before the measured work:
    the cache's own ``nbytes`` plus what the step allocated on top.
    """
    install()
    if decode_steps < 1 or warmup < 0:
        raise ValueError("decode_steps must be >= 1 and warmup >= 0")
    warmup = max(warmup, 1)  # the first step after a prefill is prefill's (below), never timed as decode
    n_dec = warmup + decode_steps
    max_ctx = model_max_context(model)
    unsupported = _mlx_quantization_gap(model)
    if unsupported and any(spec.kind == "mlx" for spec in specs):
        log_progress(progress, f"bench: skipping mlx-lm's quantized caches: {unsupported}")
        specs = [spec for spec in specs if spec.kind != "mlx"]
    stages = []
    for n in sorted(set(contexts)):
        n_prompt = n if max_ctx is None else min(n, max_ctx - n_dec)
        if n_prompt < 1 or (max_ctx is not None and n > max_ctx) or (stages and n_prompt <= stages[-1][1] + n_dec):
            log_progress(progress, f"bench: skipping context {n}: the model's maximum is {max_ctx}")
            continue
        stages.append((n, n_prompt))
    if not stages:
        return []
    tokens = prompt_tokens(tokenizer, stages[-1][1] + n_dec, text)
    caches = [model_cache(spec, model) for spec in specs]
    prefill = [[0.0, 0] for _ in specs]
    fed = 0
    records = []
    for n, n_prompt in stages:
        rows = []
        for i, spec in enumerate(specs):
            mx.clear_cache()
            start = fed
            if spec.kind == "mlx":
                # mlx_lm.generate prefills the first chunk in full precision and quantizes
                # after it: continuing a cache quantized at a shorter context would not
                start, prefill[i] = 0, [0.0, 0]
                caches[i] = model_cache(spec, model)
            cache = caches[i]
            seconds, peak = _prefill(model, spec, cache, tokens[start:n_prompt], prefill_chunk)
            prefill[i][0] += seconds
            prefill[i][1] = max(prefill[i][1], peak)
            rows.append({
                "context": n,
                "prompt_tokens": n_prompt,
                "cache": spec.name,
                **{k: v for k, v in describe(spec).items() if k != "name"},
                "prefill_s": prefill[i][0],
                "prefill_tokens_per_s": n_prompt / prefill[i][0],
                "prefill_peak_bytes": prefill[i][1],
                "kv_bytes_after_prefill": kv_nbytes(cache),
                "kv_dtype": _fp_dtype(cache),
                "decode_ms": [],
                "decode_peak_bytes": 0,
            })
            log_progress(progress, f"bench: ctx {n} {spec.name}: prefill to {n_prompt} tokens {seconds:.2f} s")
        for step in range(n_dec):
            token = tokens[n_prompt + step]
            for i, (cache, row) in enumerate(zip(caches, rows)):
                held = kv_nbytes(cache)
                before = _start_peak()
                t0 = time.perf_counter()
                _decode_step(model, cache, token)
                dt = time.perf_counter() - t0
                if step == 0:
                    # the step after a prefill belongs to it (mlx_lm.generate counts the last
                    # prompt token's step as prompt time), and with exact_prefill it packs the prompt
                    prefill[i][0] += dt
                    prefill[i][1] = max(prefill[i][1], held + _peak_since(before))
                    row["prefill_s"], row["prefill_peak_bytes"] = prefill[i]
                    row["prefill_tokens_per_s"] = n_prompt / prefill[i][0]
                if step >= warmup:
                    row["decode_ms"].append(dt * 1e3)
                    row["decode_peak_bytes"] = max(row["decode_peak_bytes"], held + _peak_since(before))
        fed = n_prompt + n_dec
        for cache, row in zip(caches, rows):
            row["cache_tokens"] = _offset(cache)
            row["kv_bytes"] = kv_nbytes(cache)
            row["kv_layout"] = _layout(cache)
            row["decode_ms_stats"] = sample_stats(row["decode_ms"])
        fp = next((r for r in rows if r["kind"] == "fp"), None)
        for row in rows:
            if fp is not None:
                row["decode_ratio_vs_fp"] = row["decode_ms_stats"]["median"] / fp["decode_ms_stats"]["median"]
                row["kv_ratio_vs_fp"] = row["kv_bytes"] / fp["kv_bytes"]
            ratio_vs_mlx(row, rows, "decode_ms_stats", "decode_ratio_vs_mlx")
            st = row["decode_ms_stats"]
            log_progress(progress, f"bench: ctx {n} {row['cache']}: decode {st['median']:.2f} ms/token "
                                   f"(p10 {st['p10']:.2f}, p90 {st['p90']:.2f}), KV {row['kv_bytes'] / 2**20:.1f} MiB")
        records.extend(rows)
    return records


def _offset(cache) -> int:
    return max(int(getattr(c, "offset", 0)) for c in cache)


def _fp_dtype(cache):
    for c in cache:
        if type(c) is KVCache and c.keys is not None:
            return str(c.keys.dtype).split(".")[-1]
        if isinstance(c, OIQKVCache) and c.dtype is not None:
            return str(c.dtype).split(".")[-1]
        if isinstance(c, QuantizedKVCache) and c.keys is not None:
            return str(c.keys[1].dtype).split(".")[-1]
    return None


def _layout(cache) -> list[dict]:
    """Per layer: the shapes behind ``nbytes``, so a reader can check the byte counts."""
    out = []
    for c in cache:
        if isinstance(c, OIQKVCache):
            out.append({"type": "OIQKVCache", "arrays": {
                f"{w}.{name}": list(a.shape) + [str(a.dtype).split(".")[-1]]
                for w, side in (("k", c.k), ("v", c.v)) for name, a in _side_arrays(side).items()
            }})
        else:
            out.append({"type": type(c).__name__, "arrays": [list(a.shape) + [str(a.dtype).split(".")[-1]] for a in cache_arrays(c)]})
    return out


# -- reporting --------------------------------------------------------------------


def mib(b) -> str:
    return f"{b / 2**20:.1f}"


def model_table(records: list[dict]) -> str:
    lines = [
        "| context | cache | prefill s | decode ms/token median (p10-p90) | decode vs fp | vs mlx-lm same bits | KV MiB | KV vs fp | prefill peak MiB | prefill peak vs fp | decode peak MiB |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    fp_peak = {r["context"]: r["prefill_peak_bytes"] for r in records if r["kind"] == "fp"}
    for r in records:
        base = fp_peak.get(r["context"])
        peak = f"{r['prefill_peak_bytes'] / base:.2f}x" if base else "-"
        s = r["decode_ms_stats"]
        ratio = f"{r['decode_ratio_vs_fp']:.2f}x" if "decode_ratio_vs_fp" in r else "-"
        ratio += f" | {r['decode_ratio_vs_mlx']:.2f}x" if "decode_ratio_vs_mlx" in r else " | -"
        kvr = f"{r['kv_ratio_vs_fp']:.3f}" if "kv_ratio_vs_fp" in r else "-"
        name = r["cache"] + (f" ({r['kv_dtype']})" if r["kind"] == "fp" and r.get("kv_dtype") else "")
        lines.append(
            f"| {r['context']} | {name} | {r['prefill_s']:.2f} | {s['median']:.1f} ({s['p10']:.1f}-{s['p90']:.1f}) | "
            f"{ratio} | {mib(r['kv_bytes'])} | {kvr} | {mib(r['prefill_peak_bytes'])} | {peak} | {mib(r['decode_peak_bytes'])} |"
        )
    return "\n".join(lines)


def write_plots(result: dict, folder, progress=sys.stderr) -> list[str]:
    """PNG plots next to the JSON; returns the paths written ([] without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log_progress(progress, "bench: matplotlib is not installed; no plots written")
        return []
    os.makedirs(folder, exist_ok=True)
    backend = result["environment"]["backend"]
    written = []

    def plot(records, y, ylabel, title, fname, yscale="linear"):
        if not records:
            return
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for name in dict.fromkeys(r["cache"] for r in records):
            rs = [r for r in records if r["cache"] == name]
            ax.plot([r["context"] for r in rs], [y(r) for r in rs], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale(yscale)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{title} [{backend}]")
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = os.path.join(folder, fname)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    m, a = result.get("model_runs", []), result.get("attention_runs", [])
    plot(m, lambda r: r["decode_ms_stats"]["median"], "decode ms/token (median)", "Decode latency", "decode_ms_vs_context.png")
    plot(m, lambda r: r["kv_bytes"] / 2**20, "KV cache MiB (nbytes)", "KV cache memory", "kv_bytes_vs_context.png", "log")
    plot(m, lambda r: r["decode_peak_bytes"] / 2**20, "decode peak MiB over model", "Decode peak memory", "decode_peak_vs_context.png", "log")
    plot(m, lambda r: r["prefill_peak_bytes"] / 2**20, "prefill peak MiB over model", "Prefill peak memory", "prefill_peak_vs_context.png", "log")
    plot(a, lambda r: r["attention_ms_stats"]["median"], "attention ms/step (median)", "Decode attention, one layer", "attention_ms_vs_context.png", "log")
    return written


def save_json(result: dict, path) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
