"""Perplexity, KL and top-1 agreement through the real cache path (:func:`perplexity_eval`),
and the bytes a cache allocates per token (:func:`measured_bytes_per_token`,
:func:`allocated_bytes_per_token`).

A prompt of ``prompt_len`` tokens is prefilled through the cache under test, then continuation
chunks are scored through the same cache, so every scored token attends to keys/values that went
through it.  Per cache: perplexity, KL(fp || cache) of next-token distributions at the same
positions, top-1 agreement, against mlx-lm's plain ``KVCache`` at the model's dtype (the "fp"
reference; on the CPU backend the GGUF loader gives fp32, DESIGN.md section 7).
"""

from __future__ import annotations

import math
import time

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from ..cache.sequence import OIQKVCache
from ..core.config import layer_bits_text
from ..core.metrics import kl_divergence, log_softmax
from ..mlx_lm.caches import end_prefill
from .progress import Progress, eta
from .specs import CacheSpec
from .stats import paired_change_ci


def _cache_arrays(cache) -> list:
    """The arrays a prompt cache holds, to evaluate them with the step."""
    out = []
    for c in cache:
        if isinstance(c, OIQKVCache):
            for side in (c.k, c.v):
                out += [a for a in (side.codes, side.scales, side.sink, side.recent, side.mean) if a is not None]
        elif not c.empty():
            out.append(c.state)
    return out


def measured_bytes_per_token(cache, tokens: int) -> float:
    """Allocated bytes of the cache's quantized-or-fp layers (``nbytes``,
    capacity included, in the arrays' real dtypes) per token per KV head."""
    total, units = 0, 0
    for c in cache:
        shape = _kv_shape(c)
        if shape is not None:
            total += c.nbytes
            units += shape[1]
    return total / (units * tokens) if units and tokens else 0.0


def _kv_shape(c):
    """``(B, H, k_dim, v_dim)`` of a holding OIQ, mlx-lm quantized or plain ``KVCache``
    layer (the ones :func:`measured_bytes_per_token` counts), else None."""
    if isinstance(c, OIQKVCache):
        return None if c.empty() else (*c.batch_heads, c.k.head_dim, c.v.head_dim)
    if isinstance(c, QuantizedKVCache):
        if c.keys is None:
            return None
        width = lambda packed: packed[0].shape[-1] * 32 // c.bits  # noqa: E731
        return (*c.keys[0].shape[:2], width(c.keys), width(c.values))
    if type(c) is KVCache and c.keys is not None:
        return (*c.keys.shape[:2], c.keys.shape[-1], c.values.shape[-1])
    return None


def allocated_bytes_per_token(spec: CacheSpec, model, evaluated: list, calls, dtype=mx.float16) -> float:
    """:func:`measured_bytes_per_token` of a fresh ``spec`` cache after the update calls
    ``calls`` (token counts, e.g. a prompt then chunks), the model's keys and values in
    ``dtype``: what the cache allocates for a ``dtype`` model (a float16 model on a Mac)
    when this machine ran the model in another one.

    ``evaluated`` is the cache the evaluation used (its layers give the shapes).  What a
    cache allocates depends on the calls and shapes, not on the values, so zeros are
    written (OIQ caches release each call's full-precision rows as attention would).
    """
    fresh = spec.make_cache(model)
    layers = [(c, shape) for c, shape in zip(fresh, map(_kv_shape, evaluated)) if shape is not None]
    for i, n in enumerate(calls):
        for c, (b, h, dk, dv) in layers:
            c.update_and_fetch(mx.zeros((b, h, n, dk), dtype), mx.zeros((b, h, n, dv), dtype))
            if isinstance(c, OIQKVCache):
                c.release_fresh()
                if i == 0:
                    c.end_prefill()  # as perplexity_eval ends it after the prompt
        mx.eval(_cache_arrays(fresh))
    return measured_bytes_per_token(fresh, sum(calls))


def _change_interval(diff) -> list | None:
    low, high = paired_change_ci(diff)
    return None if math.isnan(low) else [low, high]


def perplexity_eval(model, tokens, specs, *, prompt_len: int, score_len: int, chunk: int = 1,
                    windows: int = 1, progress=None) -> dict:
    """Perplexity, KL and top-1 agreement through each cache.

    ``windows`` non-overlapping windows of ``prompt_len + score_len + 1``
    tokens are taken from ``tokens``.  In each, every cache prefills the
    prompt, then the next ``score_len`` tokens are fed in chunks of ``chunk``
    and the prediction of each following token is scored.  All caches advance
    chunk by chunk together, so the fp reference distribution of a chunk is
    compared with every cache at the same positions.

    Returns ``{name: {"ppl", "nll", "kl", "top1", "tokens", "tokens_per_s",
    "ppl_per_window", "ppl_delta_ci95", "measured_bytes_per_token_head",
    "fp16_bytes_per_token_head"}}``: ``ppl_delta_ci95`` is ``[low, high]``, the 95%
    interval of the perplexity change against the fp reference on the same tokens
    (:func:`~oiq_mlx.eval.stats.paired_change_ci`; None under two blocks of 32 scored
    tokens); the last two are ``nbytes`` per token per KV head at the end of a window, as the
    evaluation ran (the model's dtype on this machine) and as a float16 model's cache
    allocates them after the same calls (:func:`allocated_bytes_per_token`; the mean
    over windows for a calibrated spec).

    A spec with ``layer_bits=auto`` (``CacheSpec.calibrate``) is calibrated on each
    window's prompt (:meth:`CacheSpec.for_prompt`) before its cache is made; its
    result adds ``"layer_bits"`` (the chosen ``[layer, k_bits, v_bits]`` triples,
    one list per window) and ``"calibration_s"`` (not counted in ``tokens_per_s``).
    """
    progress = progress or Progress(enabled=False)
    span = prompt_len + score_len + 1
    tokens = list(tokens)
    if len(tokens) < span * windows:
        raise ValueError(f"need {span * windows} tokens for {windows} window(s) of {span}, the text has {len(tokens)}")
    if specs[0].kind != "fp":
        raise ValueError("the first spec must be the fp reference")
    acc = {s.name: {"nll": 0.0, "kl": 0.0, "top1": 0, "n": 0, "seconds": 0.0, "win_nll": [], "bytes": [],
                    "fp16_bytes": [], "layer_bits": [], "calibration_s": 0.0, "diff": []} for s in specs}
    n_chunks = -(-score_len // chunk)
    # the update calls of a window (the prompt, then the chunks), replayed for the float16 bytes
    calls = [prompt_len] + [min(chunk, prompt_len + score_len - a) for a in range(prompt_len, span - 1, chunk)]
    total_units = windows * (n_chunks + 1) * len(specs)
    done_units, t0 = 0, time.perf_counter()
    last_line = t0
    for w in range(windows):
        seq = tokens[w * span : (w + 1) * span]
        window_specs = []
        for s in specs:  # layer_bits=auto: chosen on this window's prompt (not timed with the cache)
            if s.calibrate:
                t = time.perf_counter()
                cal = s.for_prompt(model, seq[:prompt_len])
                acc[s.name]["calibration_s"] += time.perf_counter() - t
                acc[s.name]["layer_bits"].append([list(x) for x in cal.oiq.layer_bits])
                progress(f"ppl window {w + 1}/{windows}: {s.name} calibrated layer_bits "
                         f"{layer_bits_text(cal.oiq.layer_bits) or 'none (uniform)'}")
                s = cal
            window_specs.append(s)
        caches = [s.make_cache(model) for s in window_specs]
        prompt = mx.array(seq[:prompt_len])[None]
        for s, c in zip(specs, caches):
            t = time.perf_counter()
            model(prompt, cache=c)  # the logits stay lazy, never computed: only the cache is evaluated
            # the scored chunks come after the prompt, as generated tokens do: with chunks of
            # more than one token, exact_prefill would otherwise keep attending them exactly
            end_prefill(c)
            mx.eval(_cache_arrays(c))
            dt = time.perf_counter() - t
            acc[s.name]["seconds"] += dt
            done_units += 1
            progress(f"ppl window {w + 1}/{windows}: {s.name} prefilled {prompt_len} tokens ({prompt_len / dt:.0f} tok/s); "
                     f"ETA {eta(done_units, total_units, time.perf_counter() - t0)}")
        win_nll = {s.name: 0.0 for s in specs}
        for i in range(n_chunks):
            a = prompt_len + i * chunk
            b = min(a + chunk, prompt_len + score_len)
            x = mx.array(seq[a:b])[None]
            targets = mx.array(seq[a + 1 : b + 1])
            logp_ref = nll_ref = None
            rates = []
            for s, c in zip(specs, caches):
                t = time.perf_counter()
                logp = log_softmax(model(x, cache=c)[0])
                token_nll = -mx.take_along_axis(logp, targets[:, None], axis=-1)[:, 0].astype(mx.float32)
                nll = token_nll.sum()
                if logp_ref is None:
                    logp_ref, nll_ref = logp, token_nll
                    kl, top1 = mx.array(0.0), mx.array(b - a)
                else:
                    kl = kl_divergence(logp_ref, logp).sum()
                    top1 = (mx.argmax(logp, -1) == mx.argmax(logp_ref, -1)).sum()
                diff = token_nll - nll_ref
                mx.eval(nll, kl, top1, logp_ref, diff, _cache_arrays(c))
                dt = time.perf_counter() - t
                r = acc[s.name]
                r["seconds"] += dt
                r["diff"].append(np.array(diff))
                r["nll"] += nll.item()
                r["kl"] += kl.item()
                r["top1"] += int(top1.item())
                r["n"] += b - a
                win_nll[s.name] += nll.item()
                rates.append(f"{s.name} {(b - a) / dt:.0f}")
                done_units += 1
            now = time.perf_counter()
            if now - last_line >= 5 or i == n_chunks - 1:  # one line per ~5 s at most (chunks of 1 are fast)
                last_line = now
                progress(f"ppl window {w + 1}/{windows} chunk {i + 1}/{n_chunks}: tok/s {', '.join(rates)}; "
                         f"ETA {eta(done_units, total_units, now - t0)}")
        for s, ws, c in zip(specs, window_specs, caches):
            acc[s.name]["win_nll"].append(math.exp(win_nll[s.name] / score_len))
            acc[s.name]["bytes"].append(measured_bytes_per_token(c, span - 1))
            # every window makes the same calls; a calibrated spec's bits may differ per window
            if w == 0 or s.calibrate:
                acc[s.name]["fp16_bytes"].append(allocated_bytes_per_token(ws, model, c, calls))
        del caches
    out = {}
    for s in specs:
        r = acc[s.name]
        out[s.name] = {
            "ppl": math.exp(r["nll"] / r["n"]),
            "nll": r["nll"] / r["n"],
            "kl": r["kl"] / r["n"],
            "top1": r["top1"] / r["n"],
            "tokens": r["n"],
            "tokens_per_s": windows * (span - 1) / r["seconds"] if r["seconds"] else None,
            "ppl_per_window": r["win_nll"],
            "ppl_delta_ci95": _change_interval(np.concatenate(r["diff"])),
            "measured_bytes_per_token_head": float(np.mean(r["bytes"])),
            "fp16_bytes_per_token_head": float(np.mean(r["fp16_bytes"])),
        }
        if s.calibrate:
            out[s.name]["layer_bits"] = r["layer_bits"]
            out[s.name]["calibration_s"] = r["calibration_s"]
        progress(f"ppl {s.name}: ppl {out[s.name]['ppl']:.3f} KL {out[s.name]['kl']:.4f} "
                 f"top1 {out[s.name]['top1']:.3f} ({out[s.name]['tokens_per_s']:.0f} tok/s)")
    return out
