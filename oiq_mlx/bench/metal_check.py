"""Compile every fused kernel instantiation, then check the kernels against the reference on the cases
users run, and time them (``scripts/check_metal.py``).

The compile step and the checks take the launcher as it is installed in ``_launch`` (a Mac's Metal, or
the tests' CPU emulator), so everything here except the timings' meaning runs off a Mac too.
"""

from __future__ import annotations

import math
import platform
import time

import mlx.core as mx

from ..cache import attention
from ..core import codec, rotation
from ..cache.sequence import OIQKVCache
from ..core.config import OIQConfig
from ..kernels import selftest
from ..kernels.decode_attention import decode_attention
from ..kernels.dequantize import dequantize
from ..kernels.instantiations import production_instantiations
from ..kernels.quantize import quantize

PRESETS = ("4bit", "3bit", "2bit")
# shorter than sinks + window (nothing packed yet), then long chats
CONTEXTS = (40, 1024, 8192, 32768)
DIMS = (64, 128, 256)


class MetalUnavailable(RuntimeError):
    pass


def require_metal():
    if not mx.metal.is_available():
        raise MetalUnavailable("Metal is not available on this machine (the kernels need an Apple GPU); "
                               "the reference path is used instead")
    mx.set_default_device(mx.gpu)


def _time(fn, iters: int) -> float:
    """Median milliseconds per call of fn (evaluated)."""
    mx.eval(fn())
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t)
    return 1e3 * sorted(times)[len(times) // 2]


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
        name = kernel + "[" + ", ".join(f"{k}={str(v).replace('mlx.core.', '')}" for k, v in template) + "]"
        try:
            _smoke(kernel, dict(template))
            error = None
        except Exception as e:  # the report lists every failure with its message
            error = f"{type(e).__name__}: {e}"
        rows.append({"instantiation": name, "error": error})
    return rows


def check_selftest(instantiations=None):
    """The first-use self-test (``kernels.selftest``) of every production instantiation (or those
    given), run afresh: one row per test with ``error`` None or why it failed.  A failure here
    means users of this machine get the reference path (and a warning), not the kernels."""
    rows = []
    for kernel, template in production_instantiations() if instantiations is None else instantiations:
        case, why = selftest.check(kernel, template)
        rows.append({"instantiation": case, "error": why})
    return rows


def check_codec(d: int, bits: int, group_size: int, dtype, tokens: int, iters: int):
    x = mx.random.normal((tokens, 8, d), key=mx.random.key(0)).astype(dtype)
    signs = rotation.random_signs(0, d)
    codes, scales = quantize(x, bits=bits, group_size=group_size, signs=signs)
    ref_c, ref_s = codec.quantize(rotation.rotate(x, signs), bits, group_size)
    mismatches = int(mx.sum(codes != ref_c).item() + mx.sum(scales != ref_s).item())
    out = dequantize(ref_c, ref_s, bits=bits, group_size=group_size, dtype=dtype)
    deq_mismatch = int(mx.sum(out != codec.dequantize(ref_c, ref_s, bits, group_size, dtype=dtype)).item())
    return {
        "check": f"quantize+dequantize d={d} {bits}b g{group_size} {str(dtype).replace('mlx.core.', '')} "
                 f"T={tokens}",
        "ok": mismatches == 0 and deq_mismatch == 0,
        "error": f"{mismatches} codes/scales, {deq_mismatch} values differ" if mismatches or deq_mismatch
        else "bit-exact",
        "kernel ms": _time(lambda: quantize(x, bits=bits, group_size=group_size, signs=signs), iters) if iters else None,
        "reference ms": _time(lambda: codec.quantize(rotation.rotate(x, signs), bits, group_size), iters)
        if iters else None,
        "sdpa ms": None,
    }


def check_decode(preset: str, d: int, context: int, B: int, dtype, n_kv: int, rep: int, L: int, iters: int):
    """Decode attention of one OIQ cache built as users build it, kernel vs reference path vs SDPA on the
    uncompressed keys and values."""
    cfg = OIQConfig.preset(preset)
    cache = OIQKVCache(cfg)
    k = mx.random.normal((B, n_kv, context, d), key=mx.random.key(1)).astype(dtype)
    v = mx.random.normal((B, n_kv, context, d), key=mx.random.key(2)).astype(dtype)
    for a in range(0, context, 4096):  # prompt in chunks, as mlx-lm prefills
        cache.update_and_fetch(k[:, :, a:a + 4096], v[:, :, a:a + 4096])
    queries = mx.random.normal((B, n_kv * rep, L, d), key=mx.random.key(3)).astype(dtype)
    mask = "causal" if L > 1 else None
    segs = cache.segments()

    def kernel():
        return attention.decode_attention_kernel(cache, queries, d ** -0.5, mask, None, segments=segs)

    def reference():
        return attention.reference_output(queries, cache, d ** -0.5, mask, None, segs)

    out = kernel()
    if out is None:
        return {"check": f"decode {preset} d={d} ctx={context} B={B}", "ok": False,
                "error": "dispatch declined the kernel", "kernel ms": None, "reference ms": None,
                "sdpa ms": None}
    err = mx.abs(out - reference()).max().item()
    ok = math.isfinite(err) and err <= 1e-3
    return {
        "check": f"decode {preset} d={d} ctx={context} B={B} {str(dtype).replace('mlx.core.', '')} "
                 f"kv={n_kv} rep={rep} L={L}",
        "ok": ok,
        "error": f"max err {err:.2e}",
        "kernel ms": _time(kernel, iters) if iters else None,
        "reference ms": _time(reference, iters) if iters else None,
        "sdpa ms": _time(lambda: mx.fast.scaled_dot_product_attention(
            queries, k, v, scale=d ** -0.5, mask=mask), iters) if iters else None,
    }


def decode_cases():
    """Every preset at every context, head dims, batch and dtypes rotating over them."""
    cases = []
    for i, preset in enumerate(PRESETS):
        for j, context in enumerate(CONTEXTS):
            d = DIMS[(i + j) % len(DIMS)]
            n_kv, rep = {64: (3, 3), 128: (8, 4), 256: (1, 8)}[d]
            cases.append(dict(preset=preset, d=d, context=context, B=1 + (i + j) % 2,
                              dtype=(mx.float16, mx.bfloat16)[j % 2], n_kv=n_kv, rep=rep, L=1 + 3 * (j == 1)))
    return cases


def codec_cases():
    return [dict(d=d, bits=bits, group_size=32, dtype=dtype, tokens=512)
            for d in DIMS for bits in (5, 4, 3, 2) for dtype in (mx.float16, mx.bfloat16)]


def run_all(iters: int = 20, decode=None, codecs=None):
    """(compile rows, check rows, self-test rows): every instantiation compiled first, then the
    checks, then every instantiation's first-use self-test run afresh.  The checks skip the
    self-test (``selftest.trusted``): they measure the kernels themselves, which a failed
    self-test would replace by the reference path."""
    with selftest.trusted():
        compiled = compile_all()
        checks = [check_codec(**c, iters=iters) for c in (codec_cases() if codecs is None else codecs)]
        checks += [check_decode(**c, iters=iters) for c in (decode_cases() if decode is None else decode)]
    return compiled, checks, check_selftest()


def _ms(v):
    return "" if v is None else f"{v:.3f}"


def report(compiled, checks, selftests=()) -> str:
    """One Markdown report to paste into an issue: machine, compile summary, the check table,
    then every compile failure with its message, then the first-use self-test's summary and
    failures (``check_selftest`` rows, when given)."""
    failed = [r for r in compiled if r["error"]]
    try:
        device = mx.metal.device_info().get("device_name", "?") if mx.metal.is_available() else "no Metal"
    except (RuntimeError, AttributeError):
        device = "?"
    lines = [f"oiq_mlx check_metal: mlx {mx.__version__}, {platform.platform()}, {device}", "",
             f"compiled {len(compiled) - len(failed)} of {len(compiled)} kernel instantiations", "",
             "| check | result | detail | kernel ms | reference path ms | SDPA on uncompressed K/V ms |",
             "|---|---|---|---|---|---|"]
    for r in checks:
        lines.append(f"| {r['check']} | {'ok' if r['ok'] else 'FAIL'} | {r['error']} | {_ms(r['kernel ms'])} | "
                     f"{_ms(r['reference ms'])} | {_ms(r['sdpa ms'])} |")
    for r in failed:
        lines += ["", f"compile/launch failure: {r['instantiation']}", "```", r["error"], "```"]
    if selftests:
        bad = [r for r in selftests if r["error"]]
        lines += ["", f"first-use self-test: {len(selftests) - len(bad)} of {len(selftests)} passed"]
        lines += [f"- {r['instantiation']}: {r['error']}" for r in bad]
    return "\n".join(lines)
