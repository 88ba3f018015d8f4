"""The Mac go/no-go (``scripts/check_metal.py``): compile every fused kernel instantiation, check the
kernels against the reference path on caches built the way mlx-lm builds them, time them.

Every check is a row of its own (a failure, an exception included, is a row, never an abort) and
says whether it holds:

- **write path**: the same keys and values written to two caches the way mlx-lm writes them (the
  prompt in chunks of ``PREFILL_STEP`` rows, then one-token steps), one through the kernels, one
  through the reference path: every stored array (codes, scales, full-precision rows, statistics)
  bit for bit, for every preset and every option that changes what is written;
- **decode**: one attention call over such a cache through the kernels, against the reference path
  and against a float64 truth over the rows the cache holds (``dequantized_kv``): one-token steps,
  masked multi-token calls (causal, bool and additive masks: speculative decoding's verify calls),
  attention sinks, after ``trim``, after a save and load, a ragged batch (sequences of different
  lengths decoding together), up to 64k tokens;
- each check asserts what it claims to exercise: packed rows exist where the context passes the
  sinks and the window, and the kernels ran (their launches are counted), so a check cannot pass on
  full-precision rows or on a silent fallback to the reference path.

Then a speed table (decode attention of the ``4bit`` cache against ``scaled_dot_product_attention``
on float16 keys and values, 1k to 64k tokens) and an end-to-end line on the bundled model (OIQ,
float16 and mlx-lm's 4-bit cache through ``mlx_lm.generate``: tokens/s and peak memory).  The
report's first line is the verdict.

The checks take the launcher as installed in ``oiq_mlx.kernels.launcher`` (a Mac's Metal, or the
tests' CPU emulator with ``dispatch.kernels_enabled`` patched on), so everything but the timings
runs off a Mac too: ``QUICK`` is the grid CI runs on the emulator.
"""

from __future__ import annotations

import dataclasses
import math
import os
import platform
import tempfile
import time
import traceback
from contextlib import contextmanager

import mlx.core as mx
import numpy as np

from ..cache import attention
from ..cache.entries import packed_rows
from ..cache.sequence import OIQKVCache
from ..core import codec, rotation
from ..core.config import OIQConfig
from ..kernels import dispatch, launcher, selftest
from ..kernels.decode_attention import decode_attention
from ..kernels.dequantize import dequantize
from ..kernels.instantiations import production_instantiations
from ..kernels.quantize import quantize
from ..mlx_lm.prompt_files import load_cache_file, save_cache_file

PRESETS = ("4bit", "3bit", "2bit", "2bit-ppl", "1.5bit")
PREFILL_STEP = 2048  # mlx_lm.generate's prefill_step_size
# what changes the rows a cache writes, beside the preset (OIQConfig fields)
WRITE_OPTIONS = ({}, {"clip": False}, {"align_scales": False}, {"key_alignment": 0.5}, {"center_keys": False},
                 {"key_scaling": 0.0}, {"center_values": True}, {"positional": True}, {"exact_prefill": 0})


@dataclasses.dataclass(frozen=True)
class Grid:
    """Which checks run: ``FULL`` on a Mac, ``QUICK`` in CI on the emulator."""

    contexts: tuple = (40, 1024, 8192, 65536)  # the first shorter than sinks + window: nothing packed
    dims: tuple = (64, 128, 256)
    write_context: int = 1500
    write_options: tuple = WRITE_OPTIONS
    variant_presets: tuple = PRESETS  # masks, sinks, trim, save/load, ragged batch
    speed_contexts: tuple = (1024, 4096, 16384, 65536)
    end_to_end: bool = True


FULL = Grid()
# what the emulator runs in CI in a few minutes: every kind of check, one head size, short contexts
QUICK = Grid(contexts=(40, 200), dims=(64,), write_context=200, write_options=WRITE_OPTIONS[:2] + WRITE_OPTIONS[-2:],
             variant_presets=("4bit",), speed_contexts=(), end_to_end=False)


class MetalUnavailable(RuntimeError):
    pass


def require_metal():
    if not mx.metal.is_available():
        raise MetalUnavailable("Metal is not available on this machine (the kernels need an Apple GPU); "
                               "the reference path is used instead")
    mx.set_default_device(mx.gpu)


@contextmanager
def reference_path():
    """Everything inside runs the reference path (``dispatch.kernels_enabled`` answers False, as
    with ``OIQ_MLX_FORCE_REFERENCE=1``)."""
    real = dispatch.kernels_enabled
    dispatch.kernels_enabled = lambda: False
    try:
        yield
    finally:
        dispatch.kernels_enabled = real


@contextmanager
def launches():
    """The kernel launches made inside, counted (a list, one entry per launch)."""
    calls, real = [], launcher.launch

    def counting(kernel, **kwargs):
        calls.append(kernel)
        return real(kernel, **kwargs)

    launcher.launch = counting
    try:
        yield calls
    finally:
        launcher.launch = real


def _dtype_name(dtype) -> str:
    return str(dtype).replace("mlx.core.", "")


def isolated(name: str, fn) -> dict:
    """``fn()``'s row (``ok``, ``detail``, timings), or a failed row naming the exception it raised."""
    try:
        row = fn()
    except Exception as e:  # a check that raises is a failed row, and the report goes on
        frame = traceback.extract_tb(e.__traceback__)[-1]
        row = {"ok": False, "detail": f"{type(e).__name__}: {e} ({os.path.basename(frame.filename)}:{frame.lineno})"}
    return {"check": name, "kernel ms": None, "reference ms": None, "sdpa ms": None, **row}


# -- compiling ------------------------------------------------------------------------------------


def _smoke(kernel: str, template: dict):
    """Launch one instantiation on the smallest inputs that select it (small inputs are the ones MLX
    binds `constant`); returns its outputs, evaluated."""
    d = template["D"]
    if kernel == "oiq_quantize":
        x = mx.ones((1, 2, d), template["T"])
        out = quantize(x, bits=2, group_size=32, signs=rotation.random_signs(0, d))
    elif kernel == "oiq_dequantize":
        codes, scales = codec.quantize(mx.ones((1, d)), 2, 32)
        out = dequantize(codes, scales, bits=2, group_size=32, dtype=template["OutT"])
    elif kernel == "oiq_decode_attention":
        qb = template["QB"]
        fp = mx.ones((1, 1, 1, d), template["FT"])
        q = mx.ones((1, qb, 1, d), template["FT"])
        out = decode_attention(q, scale=d ** -0.5, segments=(fp, fp, None, None, None), k_bits=2, v_bits=2,
                               group_size=32)
    elif kernel == "oiq_decode_merge":
        fp = mx.ones((1, 1, 1, d), mx.float32)
        out = decode_attention(mx.ones((1, 1, 1, d)), scale=d ** -0.5, segments=(fp, fp, None, None, None),
                               k_bits=2, v_bits=2, group_size=32, sinks=mx.zeros((1,)),
                               v_mean=mx.zeros((1, 1, 1, d)), v_signs=rotation.random_signs(0, d),
                               out_dtype=template["OutT"])
    else:
        raise ValueError(f"unknown kernel {kernel!r}")
    mx.eval(out)
    return out


def compile_all(instantiations=None):
    """Build and launch every instantiation dispatch can request (or those given); one row per
    instantiation with ``error`` None or the compiler's / runtime's message."""
    rows = []
    for kernel, template in production_instantiations() if instantiations is None else instantiations:
        name = kernel + "[" + ", ".join(f"{k}={_dtype_name(v)}" for k, v in template) + "]"
        try:
            _smoke(kernel, dict(template))
            error = None
        except Exception as e:  # the report lists every failure with its message
            error = f"{type(e).__name__}: {e}"
        rows.append({"instantiation": name, "error": error})
    return rows


# -- caches as mlx-lm builds them --------------------------------------------------------------------


def _kv(shape, dtype, seed: int):
    """Keys with a few large outlier channels, as real keys have, and Gaussian values."""
    k = mx.random.normal(shape, key=mx.random.key(seed))
    k = k * (1.0 + 20.0 * (mx.arange(shape[-1]) % 17 == 3)) + 0.5
    v = mx.random.normal(shape, key=mx.random.key(seed + 1))
    return k.astype(dtype), v.astype(dtype)


def prompt_cache(cfg: OIQConfig, k: mx.array, v: mx.array, steps: int = 1) -> OIQKVCache:
    """A cache after a prompt written as ``mlx_lm.generate`` writes it: all rows of ``k``/``v`` but
    the last ``steps`` in chunks of ``PREFILL_STEP``, then one-token steps (the first ends the
    prefill: ``exact_prefill`` packs the prompt there)."""
    cache = OIQKVCache(cfg)
    n = k.shape[2] - steps
    for a in range(0, n, PREFILL_STEP):
        cache.update_and_fetch(k[:, :, a : min(n, a + PREFILL_STEP)], v[:, :, a : min(n, a + PREFILL_STEP)])
        cache.release_fresh()  # what attention over the chunk does once it has read it
        mx.eval(cache.state)
    for t in range(n, k.shape[2]):
        cache.update_and_fetch(k[:, :, t : t + 1], v[:, :, t : t + 1])
        mx.eval(cache.state)
    return cache


def _expect_packed(cache: OIQKVCache, context: int):
    """Raise when the cache holds no packed row though its context passes the sinks and the window
    (the check would compare full-precision rows only)."""
    cfg = cache.config
    if context > cfg.sink_tokens + cfg.window + cfg.trim_reserve + 2 * OIQKVCache.flush_block and \
            packed_rows(cache) == 0:
        raise AssertionError(f"no packed rows at {context} tokens: the check would read full-precision rows only")


def check_write_path(preset: str, options: dict, d: int, dtype, context: int) -> dict:
    """The rows the kernels write, bit for bit against the reference path's."""
    cfg = OIQConfig.preset(preset, **options)
    k, v = _kv((1, 2, context, d), dtype, seed=5)
    with launches() as calls:
        fused = prompt_cache(cfg, k, v, steps=3)
    with reference_path():
        ref = prompt_cache(cfg, k, v, steps=3)
    _expect_packed(fused, context)
    if not calls:
        raise AssertionError("the kernels never ran (dispatch declined them)")
    a, b = ([x for x in c.state if isinstance(x, mx.array)] for c in (fused, ref))
    if len(a) != len(b):
        return {"ok": False, "detail": f"{len(a)} stored arrays against the reference's {len(b)}"}
    differ = sum(int(mx.sum(x != y).item()) if x.shape == y.shape and x.dtype == y.dtype else x.size
                 for x, y in zip(a, b))
    return {"ok": differ == 0, "detail": f"{packed_rows(fused)} packed rows, "
            + ("bit-exact" if differ == 0 else f"{differ} stored values differ")}


def truth(queries: mx.array, cache, scale: float, mask, sinks, chunk: int = 8192) -> np.ndarray:
    """float64 attention of ``queries`` over the rows ``cache`` holds (``dequantized_kv``), heads
    grouped and the rows taken ``chunk`` at a time (64k tokens stay within a few hundred MB)."""
    K, V = (np.array(x) for x in cache.dequantized_kv())  # float32 (B, n_kv, T, d)
    B, n_q, L, d = queries.shape
    n_kv, T = K.shape[1], K.shape[2]
    q = np.array(queries.astype(mx.float32)).astype(np.float64).reshape(B, n_kv, n_q // n_kv * L, d)
    s = np.concatenate([np.einsum("bgrd,bgtd->bgrt", q, K[:, :, a : a + chunk].astype(np.float64))
                        for a in range(0, T, chunk)], axis=-1).reshape(B, n_q, L, T) * scale
    if isinstance(mask, str):
        s = s + np.where(np.arange(T)[None, :] <= np.arange(T - L, T)[:, None], 0.0, -np.inf)
    elif mask is not None:
        m = np.array(mask.astype(mx.float32) if mask.dtype != mx.bool_ else mask)
        s = s + (np.where(m, 0.0, -np.inf) if m.dtype == np.bool_ else m.astype(np.float64))
    top = s.max(-1, keepdims=True)
    if sinks is not None:
        top = np.maximum(top, np.array(sinks).astype(np.float64)[None, :, None, None])
    p = np.exp(s - top)
    total = p.sum(-1, keepdims=True)
    if sinks is not None:
        total = total + np.exp(np.array(sinks).astype(np.float64)[None, :, None, None] - top)
    p = (p / total).reshape(B, n_kv, n_q // n_kv * L, T)
    out = sum(np.einsum("bgrt,bgtd->bgrd", p[..., a : a + chunk], V[:, :, a : a + chunk].astype(np.float64))
              for a in range(0, T, chunk))
    return out.reshape(B, n_q, L, V.shape[-1])


def _compare(out: mx.array, ref: mx.array, want: np.ndarray, calls: list, expect: int = 2) -> dict:
    """Kernel output against the reference path's and the float64 truth: the kernels must agree with
    the reference to 1e-3 and be no further from the truth than twice the reference plus 1e-3."""
    if len(calls) < expect:
        raise AssertionError(f"{len(calls)} kernel launches, {expect} expected: the reference path served the call")
    got, r = np.array(out.astype(mx.float32)), np.array(ref.astype(mx.float32))
    err_ref = float(np.abs(got - r).max())
    err_truth, ref_truth = float(np.abs(got - want).max()), float(np.abs(r - want).max())
    ok = math.isfinite(err_ref) and err_ref <= 1e-3 and err_truth <= 2 * ref_truth + 1e-3
    return {"ok": ok, "detail": f"vs reference {err_ref:.1e}, vs float64 {err_truth:.1e} (reference {ref_truth:.1e})"}


def _mask(kind: str, B: int, L: int, T: int):
    if kind in ("none", "causal"):
        return None if kind == "none" else "causal"
    seen = mx.arange(T)[None, :] <= mx.arange(T - L, T)[:, None]
    seen = mx.broadcast_to(seen, (B, 1, L, T))
    if kind == "bool":
        return seen
    return mx.where(seen, 0.0, -1e9).astype(mx.float32)  # additive


def check_decode(preset: str, d: int, context: int, B: int, dtype, n_kv: int, rep: int, L: int = 1,
                 mask: str = "none", sinks: bool = False, after: str = "", iters: int = 0) -> dict:
    """One attention call of ``L`` queries over a cache built as mlx-lm builds it, through the kernels,
    against the reference path and the float64 truth; ``after`` "trim" (decode steps, then a trim)
    or "load" (the cache saved and loaded back)."""
    cfg = OIQConfig.preset(preset)
    k, v = _kv((B, n_kv, context + 8, d), dtype, seed=1)  # "trim" writes 6 steps from context - L
    cache = prompt_cache(cfg, k[:, :, : context - L], v[:, :, : context - L], steps=1)
    if after == "trim":
        for t in range(context - L, context - L + 6):
            cache.update_and_fetch(k[:, :, t : t + 1], v[:, :, t : t + 1])
        cache.trim(6)
    elif after == "load":
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "cache.safetensors")
            save_cache_file(path, [cache])
            (cache,) = load_cache_file(path)
    cache.update_and_fetch(k[:, :, context - L : context], v[:, :, context - L : context])
    mx.eval(cache.state)
    _expect_packed(cache, context)
    queries = mx.random.normal((B, L, n_kv * rep, d), key=mx.random.key(3)).astype(dtype).swapaxes(1, 2)
    m = _mask(mask, B, L, context)
    s = mx.random.normal((n_kv * rep,), key=mx.random.key(4)) if sinks else None
    scale = d ** -0.5

    def kernel():
        return attention.oiq_attention(queries, cache, scale, m, s)

    with launches() as calls:
        out = kernel()
        mx.eval(out)
    with reference_path():
        ref = kernel()
        mx.eval(ref)
    row = _compare(out, ref, truth(queries, cache, scale, m, s), calls)
    row["detail"] = f"{packed_rows(cache)} packed rows, " + row["detail"]
    if iters:
        kf, vf = k[:, :, :context].astype(mx.float16), v[:, :, :context].astype(mx.float16)
        qf = queries.astype(mx.float16)
        row["kernel ms"] = _time(kernel, iters)
        with reference_path():
            row["reference ms"] = _time(kernel, iters)
        row["sdpa ms"] = _time(lambda: mx.fast.scaled_dot_product_attention(qf, kf, vf, scale=scale, mask=m), iters)
    return row


def check_ragged(preset: str, d: int, lengths: tuple, dtype) -> dict:
    """Sequences of different lengths decoding together (mlx-lm's ``BatchGenerator``): the batch's
    kernel call against each sequence alone through the reference path and the float64 truth."""
    cfg = OIQConfig.preset(preset)
    n_kv, rep = 2, 3
    alone, joined = [], []
    for i, n in enumerate(lengths):
        k, v = _kv((1, n_kv, n, d), dtype, seed=10 + i)
        alone.append(prompt_cache(cfg, k, v))
        joined.append(prompt_cache(cfg, k, v))
    batch = OIQKVCache.merge(joined)
    k, v = _kv((len(lengths), n_kv, 1, d), dtype, seed=30)
    batch.update_and_fetch(k, v)
    queries = mx.random.normal((len(lengths), n_kv * rep, 1, d), key=mx.random.key(31)).astype(dtype)
    with launches() as calls:
        out = attention.oiq_batch_attention(queries, batch, d ** -0.5)
        mx.eval(out)
    refs, wants = [], []
    for i, c in enumerate(alone):
        c.update_and_fetch(k[i : i + 1], v[i : i + 1])
        _expect_packed(c, c.offset)
        with reference_path():
            refs.append(attention.oiq_attention(queries[i : i + 1], c, d ** -0.5))
        wants.append(truth(queries[i : i + 1], c, d ** -0.5, None, None))
    return _compare(out, mx.concatenate(refs), np.concatenate(wants), calls)


def check_codec(d: int, bits: int, group_size: int, dtype, tokens: int, iters: int = 0) -> dict:
    """The quantize and dequantize kernels against plain ``codec`` (abs-max, no clip search)."""
    x = mx.random.normal((tokens, 8, d), key=mx.random.key(0)).astype(dtype)
    signs = rotation.random_signs(0, d)
    with launches() as calls:
        codes, scales = quantize(x, bits=bits, group_size=group_size, signs=signs)
        ref_c, ref_s = codec.quantize(rotation.rotate(x, signs), bits, group_size)
        out = dequantize(ref_c, ref_s, bits=bits, group_size=group_size, dtype=dtype)
        mx.eval(codes, scales, out)
    if len(calls) < 2:
        raise AssertionError(f"{len(calls)} kernel launches, 2 expected")
    mismatches = int(mx.sum(codes != ref_c).item() + mx.sum(scales != ref_s).item())
    deq_mismatch = int(mx.sum(out != codec.dequantize(ref_c, ref_s, bits, group_size, dtype=dtype)).item())
    row = {"ok": mismatches == 0 and deq_mismatch == 0,
           "detail": f"{mismatches} codes/scales, {deq_mismatch} values differ" if mismatches or deq_mismatch
           else "bit-exact"}
    if iters:
        row["kernel ms"] = _time(lambda: quantize(x, bits=bits, group_size=group_size, signs=signs), iters)
        row["reference ms"] = _time(lambda: codec.quantize(rotation.rotate(x, signs), bits, group_size), iters)
    return row


# -- the grid ----------------------------------------------------------------------------------------


def _heads(d: int):
    return {64: (3, 3), 128: (8, 4), 256: (1, 8)}[d]


def checks(grid: Grid = FULL, iters: int = 0) -> list:
    """``(name, fn)`` of every check of ``grid``."""
    out = []
    for i, d in enumerate(grid.dims):
        for bits in (5, 4, 3, 2, 1):
            dt = (mx.float16, mx.bfloat16)[i % 2]
            out.append((f"codec d={d} {bits}b g32 {_dtype_name(dt)}",
                        lambda d=d, bits=bits, dt=dt: check_codec(d, bits, 32, dt, 512, iters)))
    for preset in PRESETS:
        for options in grid.write_options:
            for j, d in enumerate(grid.dims):
                dt = (mx.float16, mx.bfloat16, mx.float32)[j % 3]
                opt = ", ".join(f"{k}={v}" for k, v in options.items()) or "preset"
                out.append((f"write {preset} [{opt}] d={d} {_dtype_name(dt)} T={grid.write_context}",
                            lambda p=preset, o=options, d=d, dt=dt: check_write_path(p, o, d, dt, grid.write_context)))
    for i, preset in enumerate(PRESETS):
        for j, context in enumerate(grid.contexts):
            d = grid.dims[(i + j) % len(grid.dims)]
            n_kv, rep = _heads(d)
            case = dict(preset=preset, d=d, context=context, B=1 + (i + j) % 2, dtype=(mx.float16, mx.bfloat16)[j % 2],
                        n_kv=n_kv, rep=rep)
            out.append((f"decode {preset} d={d} T={context} B={case['B']} {_dtype_name(case['dtype'])}",
                        lambda c=case: check_decode(**c, iters=iters)))
    d = grid.dims[0]
    n_kv, rep = _heads(d)
    T = max(c for c in grid.contexts if c <= 8192)
    for preset in grid.variant_presets:
        base = dict(preset=preset, d=d, context=T, B=1, dtype=mx.float16, n_kv=n_kv, rep=rep)
        variants = [("verify L=4 causal", dict(L=4, mask="causal")), ("verify L=4 bool mask", dict(L=4, mask="bool")),
                    ("verify L=3 additive mask", dict(L=3, mask="additive")),
                    ("after trim", dict(after="trim")), ("after save/load", dict(after="load"))]
        if not OIQConfig.preset(preset).center_values:  # sinks refuse a value mean (attention.oiq_attention)
            variants += [("sinks", dict(sinks=True)), ("sinks, verify L=4", dict(L=4, mask="causal", sinks=True))]
        for name, extra in variants:
            out.append((f"decode {preset} d={d} T={T} {name}", lambda c={**base, **extra}: check_decode(**c)))
        lengths = (T // 8, T // 4, T // 2, T)
        out.append((f"ragged batch {preset} d={d} T={lengths}",
                    lambda p=preset, lengths=lengths: check_ragged(p, d, lengths, mx.float16)))
    return out


def check_selftest(instantiations=None):
    """The first-use self-test (``kernels.selftest``) of every production instantiation (or those
    given), run afresh: one row per test with ``error`` None or why it failed.  A failure here
    means users of this machine get the reference path (and a warning), not the kernels."""
    rows = []
    for kernel, template in production_instantiations() if instantiations is None else instantiations:
        case, why = selftest.check(kernel, template)
        rows.append({"instantiation": case, "error": why})
    return rows


def run_all(grid: Grid = FULL, iters: int = 20, progress=None):
    """(compile rows, check rows, speed rows, end-to-end row or None, self-test rows).  The compile
    step, the checks and the speed table skip the first-use self-test (``selftest.trusted``): they
    measure the kernels themselves, which a failed self-test would replace by the reference path;
    then every instantiation's self-test runs afresh, and the end-to-end line runs as users run."""
    rows = []
    with selftest.trusted():
        compiled = compile_all()
        for name, fn in checks(grid, iters=0):
            rows.append(isolated(name, fn))
            if progress:
                progress(f"{'ok  ' if rows[-1]['ok'] else 'FAIL'} {name}: {rows[-1]['detail']}")
        speed = [isolated(f"speed 4bit d=128 T={t}", lambda t=t: check_decode(
            "4bit", 128, t, 1, mx.float16, 8, 4, iters=iters)) for t in grid.speed_contexts] if iters else []
    selftests = check_selftest()
    e2e = end_to_end() if grid.end_to_end and iters else None
    return compiled, rows, speed, e2e, selftests


def _time(fn, iters: int) -> float:
    """Median milliseconds per call of fn (evaluated)."""
    mx.eval(fn())
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t)
    return 1e3 * sorted(times)[len(times) // 2]


def end_to_end(prompt_tokens: int = 2000, max_tokens: int = 64) -> dict:
    """The bundled model through ``mlx_lm.generate``'s own loop: the OIQ ``4bit`` cache, mlx-lm's
    float16 cache and its 4-bit cache (``kv_bits=4``): generation tokens/s and peak memory."""
    from mlx_lm.generate import stream_generate
    from mlx_lm.models.cache import make_prompt_cache

    from ..mlx_lm.caches import make_oiq_cache
    from ..mlx_lm.models import default_text, load

    model, tokenizer = load("demo")
    prompt = tokenizer.encode(default_text())[:prompt_tokens]
    out = {}
    for name, cache, extra in (("oiq-4bit", lambda: make_oiq_cache(model, OIQConfig.preset("4bit")), {}),
                               ("fp16", lambda: make_prompt_cache(model), {}),
                               ("mlx-lm 4-bit", lambda: make_prompt_cache(model), {"kv_bits": 4, "kv_group_size": 64})):
        mx.clear_cache()
        mx.reset_peak_memory()
        last = None
        for last in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens, prompt_cache=cache(), **extra):
            pass
        out[name] = {"tokens/s": last.generation_tps, "peak GB": last.peak_memory}
    return out


# -- the report ---------------------------------------------------------------------------------------


def _ms(v):
    return "" if v is None else f"{v:.3f}"


def verdict(compiled, rows, speed=(), selftests=()) -> tuple:
    """``(passed, line)``: the report's first line."""
    failed = [r for r in (*rows, *speed) if not r["ok"]]
    bad = [r for r in compiled if r["error"]]
    bad_selftests = [r for r in selftests if r["error"]]
    n = len(rows) + len(speed)
    if not failed and not bad and not bad_selftests:
        return True, (f"check_metal: PASS: {n} checks, {len(compiled)} kernel instantiations compiled"
                      + (f", {len(selftests)} first-use self-tests passed" if selftests else ""))
    first = failed[0] if failed else None
    what = [f"{len(failed)} of {n} checks failed"] if failed else []
    what += [f"{len(bad)} of {len(compiled)} instantiations did not compile"] if bad else []
    what += [f"{len(bad_selftests)} of {len(selftests)} first-use self-tests failed"] if bad_selftests else []
    line = "check_metal: FAIL: " + ", ".join(what)
    if first is not None:
        line += f" (first: {first['check']}: {first['detail']})"
    return False, line


def report(compiled, rows, speed=(), e2e=None, selftests=()) -> str:
    """One Markdown report to paste into an issue: the verdict, the machine, the compile summary,
    every check, the speed table, the end-to-end line, every compile failure with its message, then
    the first-use self-test's summary and failures."""
    bad = [r for r in compiled if r["error"]]
    try:
        device = mx.metal.device_info().get("device_name", "?") if mx.metal.is_available() else "no Metal"
    except (RuntimeError, AttributeError):
        device = "?"
    lines = [verdict(compiled, rows, speed, selftests)[1], "",
             f"mlx {mx.__version__}, {platform.platform()}, {device}", "",
             f"compiled {len(compiled) - len(bad)} of {len(compiled)} kernel instantiations", "",
             "| check | result | detail |", "|---|---|---|"]
    lines += [f"| {r['check']} | {'ok' if r['ok'] else 'FAIL'} | {r['detail']} |" for r in rows]
    if speed:
        lines += ["", "| decode attention, 4bit, d=128, 32/8 heads, float16 | kernels ms | reference path ms | "
                  "SDPA on float16 K/V ms | kernels / SDPA |", "|---|---|---|---|---|"]
        for r in speed:
            ratio = r["kernel ms"] / r["sdpa ms"] if r.get("kernel ms") and r.get("sdpa ms") else None
            lines.append(f"| {r['check']} ({'ok' if r['ok'] else 'FAIL'}) | {_ms(r['kernel ms'])} | "
                         f"{_ms(r['reference ms'])} | {_ms(r['sdpa ms'])} | "
                         + ("" if ratio is None else f"{ratio:.2f}x") + " |")
    if e2e:
        lines += ["", "end to end (demo model, 2000-token prompt, 64 tokens, mlx_lm.stream_generate): " + "; ".join(
            f"{k} {v['tokens/s']:.1f} tokens/s, peak {v['peak GB']:.2f} GB" for k, v in e2e.items())]
    for r in bad:
        lines += ["", f"compile/launch failure: {r['instantiation']}", "```", r["error"], "```"]
    if selftests:
        failed = [r for r in selftests if r["error"]]
        lines += ["", f"first-use self-test: {len(selftests) - len(failed)} of {len(selftests)} passed"]
        lines += [f"- {r['instantiation']}: {r['error']}" for r in failed]
    return "\n".join(lines)
