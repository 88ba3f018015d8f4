"""First use of a kernel: each instantiation is run on a tiny input and compared with the reference
before it serves the process.

The kernels are compiled by the Metal toolchain of the machine they run on, which no test here
sees (they are exercised under a CPU emulator).  So before dispatch or attention launches an
instantiation for the first time in a process, it runs that instantiation on a few rows and
compares the result with the reference built from ``core`` (codec, rotation): packed codes and
scales, and dequantized values, bit for bit; decode attention (which runs the attention kernel
and the merge kernel as one pair) within the rounding of its output dtype.  Only the
instantiations a process uses are tested, each once: the verdicts are kept in memory and on
disk (:func:`cache_path`), keyed by the MLX version, the Metal device, the oiq_mlx version and
a hash of the kernel sources (the Metal text, the Python that launches it and this module), so a
machine pays the cost once per upgrade.

A failure (wrong values, or an exception compiling or launching) gives one warning naming the
instantiation, and from then on every kernel declines (the reference path, which gives the
same results, serves the rest of the process): one wrong instantiation means this toolchain
does not build the sources as intended, so the others are not trusted either.  Nothing raises.
A failure read from disk does the same at once (delete the file to test again).

``OIQ_MLX_KERNELS`` picks the path: ``auto`` (default: kernels where they serve, after their
self-test), ``reference`` (never the kernels, as ``OIQ_MLX_FORCE_REFERENCE=1``), ``kernels``
(the kernels without the self-test).  Another value warns and counts as ``auto``.

The self-test calls the kernel modules directly (never dispatch), so its own launches do not
ask for a verdict again.  It evaluates only arrays of its own, which ``mx.compile`` and
``mx.export_function`` allow while they trace a caller.  Code that replaces the launcher (the
dispatch counts of ``bench.trace``, whose launches return placeholders) runs inside
:func:`trusted`, where no self-test runs.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
import warnings
from importlib import metadata
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..core import codec, disk, rotation
from . import dequantize as dequantize_module
from . import decode_attention as attention_module
from . import quantize as quantize_module
from . import source

MODE_VARIABLE = "OIQ_MLX_KERNELS"
MODES = ("auto", "reference", "kernels")
DIR_VARIABLE = "OIQ_MLX_SELFTEST_DIR"  # where the verdicts are kept (default: the package's cache folder)
METAL_FILES = ("oiq_common.h", "quantize.metal", "dequantize.metal", "decode_attention.metal", "decode_merge.metal")
# the host side of the same kernels (argument order and parameter words are part of what passed)
# and this module (the checks themselves)
HOST_MODULES = (quantize_module, dequantize_module, attention_module)
# attention output within this much of the float64 reference, relative to max(1, its largest
# value): about two roundings of the output dtype (the kernels compute in float32, and the
# fast::exp bound is far below these).  Under the emulator the real kernels err by at most a
# quarter of it, and each mutated kernel of tests/kernels/test_kernels.py fails.
ATTENTION_TOLERANCE = {mx.float32: 2e-5, mx.float16: 2e-3, mx.bfloat16: 1.6e-2}

_lock = threading.Lock()
_state = {"verdicts": None, "failed": None, "trusted": 0}  # verdicts: case -> None (passed) or why it failed
_passed: set = set()  # the argument tuples that passed in this process: the per-call fast path
_warned_modes: set = set()


def mode() -> str:
    """``OIQ_MLX_KERNELS`` (``auto`` when unset); an unknown value warns once and counts as ``auto``."""
    value = os.environ.get(MODE_VARIABLE, "").strip().lower() or "auto"
    if value in MODES:
        return value
    if value not in _warned_modes:
        _warned_modes.add(value)
        warnings.warn(f"{MODE_VARIABLE}={value!r} is not one of {', '.join(MODES)}: using 'auto' "
                      "(kernels after their self-test)", RuntimeWarning, stacklevel=2)
    return "auto"


@contextlib.contextmanager
def trusted():
    """Within: every instantiation counts as tested (for code whose launcher is replaced, whose
    self-test would read placeholders)."""
    _state["trusted"] += 1
    try:
        yield
    finally:
        _state["trusted"] -= 1


def clear() -> None:
    """Forget the verdicts held in memory (as a new process would); the disk file stays."""
    with _lock:
        _state["verdicts"] = None
        _state["failed"] = None
        _passed.clear()


# -- what dispatch and attention ask ---------------------------------------------------------


def quantize_ok(dtype, d: int) -> bool:
    """May ``oiq_quantize`` (T=dtype, D=d) serve (testing it now on first use)?"""
    return _ok(("oiq_quantize", dtype, d), lambda: _quantize_case(dtype, d), lambda: _check_quantize(dtype, d))


def dequantize_ok(dtype, d: int) -> bool:
    """May ``oiq_dequantize`` (OutT=dtype, D=d) serve (testing it now on first use)?"""
    return _ok(("oiq_dequantize", dtype, d), lambda: _case("oiq_dequantize", ("OutT", dtype), ("D", d)),
               lambda: _check_dequantize(dtype, d))


def attention_ok(fp_dtype, d: int, qb: int, out_dtype) -> bool:
    """May decode attention (FT=fp_dtype, D=d, QB=qb) with its merge (OutT=out_dtype, D=d) serve
    (testing the pair now on first use)?"""
    return _ok(("oiq_decode_attention", fp_dtype, d, qb, out_dtype),
               lambda: _attention_case(fp_dtype, d, qb, out_dtype),
               lambda: _check_attention(fp_dtype, d, qb, out_dtype))


def check(kernel: str, template) -> tuple[str, str | None]:
    """``(case, None or why it failed)`` of the self-test of one production instantiation
    (``instantiations.production_instantiations()``; attention with the merge writing its own
    dtype, a merge with the attention of its dtype at one query row), run now, neither read from
    nor kept in memory or on disk: what ``scripts/check_metal.py`` reports on a Mac."""
    t = dict(template)
    if kernel == "oiq_quantize":
        return _quantize_case(t["T"], t["D"]), _run(lambda: _check_quantize(t["T"], t["D"]))
    if kernel == "oiq_dequantize":
        return _case(kernel, *template), _run(lambda: _check_dequantize(t["OutT"], t["D"]))
    ft, qb, out = (t["FT"], t["QB"], t["FT"]) if kernel == "oiq_decode_attention" else (t["OutT"], 1, t["OutT"])
    return _attention_case(ft, t["D"], qb, out), _run(lambda: _check_attention(ft, t["D"], qb, out))


def _quantize_case(dtype, d: int) -> str:
    return _case("oiq_quantize", ("T", dtype), ("D", d), ("ROWS", quantize_module.ROWS_PER_THREADGROUP))


def _attention_case(fp_dtype, d: int, qb: int, out_dtype) -> str:
    return (_case("oiq_decode_attention", ("FT", fp_dtype), ("D", d), ("QB", qb),
                  ("TGP", attention_module.PARTS_PER_THREADGROUP)) + "+"
            + _case("oiq_decode_merge", ("OutT", out_dtype), ("D", d)))


def _case(kernel: str, *template) -> str:
    return kernel + "[" + ",".join(f"{k}={_name(v)}" for k, v in template) + "]"


def _name(v) -> str:
    return str(v).replace("mlx.core.", "") if isinstance(v, mx.Dtype) else str(v)


def _ok(key: tuple, describe, check) -> bool:
    """The verdict on the instantiation ``key`` stands for (``describe()`` names it): passed
    before in this process, else from disk (where any failure turns every kernel off at once),
    else ``check()`` run now and its verdict kept in both.  Asked on every kernel call: the
    common answer is one set lookup."""
    if _state["trusted"]:
        return True
    m = mode()
    if m != "auto":
        return m == "kernels"
    if key in _passed:
        return True
    case = describe()
    with _lock:
        if _state["verdicts"] is None:
            _state["verdicts"] = _load()
            bad = next((c for c, why in _state["verdicts"].items() if why is not None), None)
            if bad is not None:
                _fail(bad, _state["verdicts"][bad], cached=True)
        if _state["failed"] is not None:
            return False
        if case not in _state["verdicts"]:
            why = _run(check)
            _state["verdicts"][case] = why
            _save(case, why)
            if why is not None:
                _fail(case, why, cached=False)
                return False
        _passed.add(key)
        return True


def _run(check) -> str | None:
    """None when ``check`` passes, else why not (its mismatch, or the exception it raised)."""
    try:
        return check()
    except Exception as e:  # compile errors, launch errors, anything: the reference path serves
        return f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"


def _fail(case: str, why: str, cached: bool) -> None:
    _state["failed"] = case
    _passed.clear()
    where = f" (verdict kept in {cache_path()}; delete it to test again)" if cached else ""
    warnings.warn(f"oiq_mlx: Metal kernel {case} failed its self-test: {why}{where}; the reference path "
                  "serves this process from now on", RuntimeWarning, stacklevel=4)


# -- the disk cache --------------------------------------------------------------------------


def cache_path() -> Path:
    """``$OIQ_MLX_SELFTEST_DIR``, else the package's cache folder (:func:`oiq_mlx.core.disk.cache_dir`),
    then ``selftest-<key>.json``: one file per MLX version, device, oiq_mlx version and kernel sources."""
    folder = os.environ.get(DIR_VARIABLE)
    return Path(folder or disk.cache_dir()) / f"selftest-{cache_key()[:16]}.json"


def cache_key() -> str:
    """sha256 of what a verdict depends on: MLX version, device name, oiq_mlx version, the Metal
    sources, the Python modules that launch them and the checks (this module)."""
    h = hashlib.sha256()
    for part in (mx.__version__, _device_name(), _package_version()):
        h.update(part.encode() + b"\0")
    for name in METAL_FILES:
        h.update(source.metal_source(name).encode() + b"\0")
    for path in (*(m.__file__ for m in HOST_MODULES), __file__):
        h.update(Path(path).read_bytes() + b"\0")
    return h.hexdigest()


def _device_name() -> str:
    try:
        if mx.metal.is_available():
            return str(mx.metal.device_info().get("device_name", "metal"))
    except (RuntimeError, AttributeError):
        pass
    return "no metal"


def _package_version() -> str:
    try:
        return metadata.version("oiq-mlx")
    except metadata.PackageNotFoundError:
        return "unknown"


def _load() -> dict:
    """The verdicts on disk; an absent, unreadable or malformed file is an empty one."""
    try:
        data = json.loads(cache_path().read_text())
    except (OSError, ValueError):
        return {}
    verdicts = data.get("verdicts") if isinstance(data, dict) else None
    if not isinstance(verdicts, dict):
        return {}
    return {c: w for c, w in verdicts.items() if isinstance(c, str) and (w is None or isinstance(w, str))}


def _save(case: str, why: str | None) -> None:
    """Add one verdict to the file (merged with what other processes wrote; replaced atomically).
    A folder that cannot be written only means the next process tests again."""
    path = cache_path()
    verdicts = _load()
    verdicts[case] = why
    data = {"mlx": mx.__version__, "device": _device_name(), "oiq_mlx": _package_version(), "verdicts": verdicts}
    disk.write_atomically(path, json.dumps(data, indent=1, sort_keys=True).encode())


# -- the checks: tiny inputs against the core reference --------------------------------------


def _inputs(shape, dtype, seed: int, outliers: bool = False) -> mx.array:
    """Gaussian values; ``outliers``: one channel in eight eight times larger (what rotation and
    the clip search act on)."""
    x = mx.random.normal(shape, key=mx.random.key(seed))
    if outliers:
        x = x * (1.0 + 7.0 * (mx.arange(shape[-1]) % 8 == 3))
    return x.astype(dtype)


def _same_bits(a: mx.array, b: mx.array) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    as_int = {mx.float32: mx.uint32, mx.float16: mx.uint16, mx.bfloat16: mx.uint16}.get(a.dtype)
    return bool(mx.array_equal(a.view(as_int), b.view(as_int)) if as_int else mx.array_equal(a, b))


def _check_quantize(dtype, d: int) -> str | None:
    """Six rows through the packing pass (key scales, signs, Walsh-Hadamard, clip search and
    aligned scales as the presets pack, keys half way and values all the way, joined rows, 3 bits
    whose codes straddle words; then 2 bits, abs-max, no key scales, one group a row where
    d <= 128: an odd count of scales in the joined row) and the plain quantize (abs-max, 4 bits)."""
    x = _inputs((2, 3, d), dtype, seed=d, outliers=True)
    lam = 1.0 + mx.abs(_inputs((2, 1, d), mx.float32, seed=d + 1))
    signs = rotation.random_signs(seed=1, dim=d)
    y = x.astype(mx.float32)
    for bits, g, lam_, clip, align in ((3, 32, lam, True, (0.5, 1.0)), (2, min(d, 128), None, False, (0, 0))):
        # x's first axis as the cache stacks keys and values, each side with its own alignment
        rows = quantize_module.quantize_rows(x, bits=bits, group_size=g, lam=lam_, signs=signs, rotate=True,
                                             clip=clip, joined=True, align=align)
        y_rot = rotation.hadamard((y if lam_ is None else y / lam_) * signs)
        want = mx.stack([codec.join_rows(*codec.quantize(y_rot[i], bits, g, clip=clip, align=a))
                         for i, a in enumerate(align)])
        if not _same_bits(rows, want):
            how = f"{bits} bits, groups of {g}" + (", clip search, aligned scales" if clip else "")
            return f"packed rows ({how}) differ from the reference"
    codes, scales = quantize_module.quantize(x, bits=4, group_size=32, signs=signs)
    want_codes, want_scales = codec.quantize(rotation.rotate(x, signs), 4, 32)
    if not (_same_bits(codes, want_codes) and _same_bits(scales, want_scales)):
        return "codes or scales (4 bits) differ from the reference"
    return None


def _check_dequantize(dtype, d: int) -> str | None:
    """Six rows of 4-bit codes decoded, un-rotated and not, bit for bit."""
    codes, scales = codec.quantize(_inputs((2, 3, d), mx.float32, seed=d + 2, outliers=True), 4, 32)
    signs = rotation.random_signs(seed=2, dim=d)
    plain = dequantize_module.dequantize(codes, scales, bits=4, group_size=32, dtype=dtype)
    turned = dequantize_module.dequantize(codes, scales, bits=4, group_size=32, dtype=dtype, signs=signs)
    values = codec.dequantize(codes, scales, 4, 32)
    want_plain = codec.dequantize(codes, scales, 4, 32, dtype=dtype)
    want_turned = rotation.unrotate(values, signs).astype(dtype)
    mx.eval(plain, turned, want_plain, want_turned)
    if not (_same_bits(plain, want_plain) and _same_bits(turned, want_turned)):
        return "dequantized values differ from the reference"
    return None


def _f64(x: mx.array) -> np.ndarray:
    return np.array(x.astype(mx.float32), dtype=np.float64)


def _check_attention(fp_dtype, d: int, qb: int, out_dtype) -> str | None:
    """QB query rows per KV head (one position at QB = 1, else two) over two KV heads, twice:
    2 sink, 5 packed (4-bit keys, 3-bit values, key scales, rotated) and 3 recent rows with a
    mask (boolean, dropping keys of every segment, at one position; causal at two), sink
    logits moved by a key mean and a value mean, in slices of two keys (the merge reads six partials); then 2 bits
    and 6 recent rows only, nothing else (the start of a generation: placeholders for every
    absent input, which MLX binds ``constant`` where small, another generated kernel).
    Against a float64 softmax over the stored values."""
    for case in ("full", "window"):
        why = _attention_trial(fp_dtype, d, qb, out_dtype, case == "full")
        if why is not None:
            return f"{why} ({case})"
    why = _ranges_trial(fp_dtype, d, qb, out_dtype)
    return None if why is None else f"{why} (batch ranges)"


def _ranges_trial(fp_dtype, d: int, qb: int, out_dtype) -> str | None:
    """A decode step of two sequences stacked on padded lengths (``ranges``, what a stacked batch
    decodes with), QB query heads on one KV head, 4 packed and 4 recent rows of room, the second
    sequence holding 2 packed and 2 recent rows and every other row NaN: each must get the
    softmax over its own rows."""
    n_kv, g, bits = 1, 32, 4
    q = _inputs((2, qb, 1, d), fp_dtype, seed=d + 11)
    rk, rv = (_inputs((2, n_kv, 4, d), fp_dtype, seed=d + 12 + i) for i in range(2))
    kc, ks = codec.quantize(_inputs((2, n_kv, 4, d), mx.float32, seed=d + 14), bits, g)
    vc, vs = codec.quantize(_inputs((2, n_kv, 4, d), mx.float32, seed=d + 15), bits, g)
    held = np.array([[4, 0, 4], [2, 1, 3]], np.int32)  # packed rows, recent rows [lo, hi)
    nan = np.full((2, n_kv, 4, 1), False)
    nan[1, :, 2:] = True
    ks_bad = mx.where(mx.array(nan), mx.array(float("nan"), ks.dtype), ks)
    vs_bad = mx.where(mx.array(nan), mx.array(float("nan"), vs.dtype), vs)
    rnan = np.full((2, n_kv, 4, 1), False)
    rnan[1, :, [0, 3]] = True
    rk_bad, rv_bad = (mx.where(mx.array(rnan), mx.array(float("nan"), x.dtype), x) for x in (rk, rv))
    out = attention_module.decode_attention(
        q, scale=d ** -0.5, segments=(None, None, (kc, ks_bad, vc, vs_bad), rk_bad, rv_bad), k_bits=bits,
        v_bits=bits, group_size=g, ranges=mx.array(held), keys_per_part_=2, out_dtype=out_dtype)
    mx.eval(out)
    got = _f64(out)
    for b, (n_p, lo, hi) in enumerate(held):
        keys = np.concatenate([_f64(codec.dequantize(kc, ks, bits, g))[b, 0, :n_p], _f64(rk)[b, 0, lo:hi]])
        values = np.concatenate([_f64(codec.dequantize(vc, vs, bits, g))[b, 0, :n_p], _f64(rv)[b, 0, lo:hi]])
        scores = _f64(q)[b, :, 0] @ keys.T * d ** -0.5  # (QB, rows)
        w = np.exp(scores - scores.max(-1, keepdims=True))
        want = (w / w.sum(-1, keepdims=True)) @ values
        err = float(np.max(np.abs(got[b, :, 0] - want)))
        bound = ATTENTION_TOLERANCE[out_dtype] * max(1.0, float(np.max(np.abs(want))))
        if not err <= bound:
            return f"sequence {b}'s output off the reference by {err:.3g} (bound {bound:.3g})"
    return None


def _attention_trial(fp_dtype, d: int, qb: int, out_dtype, full: bool) -> str | None:
    L = 2 if qb >= 2 else 1
    n_kv, rep = 2, qb // L
    n_sink, n_packed, n_recent = (2, 5, 3) if full else (0, 0, 6)
    n_q, T, g = n_kv * rep, n_sink + n_packed + n_recent, 32
    k_bits, v_bits = (4, 3) if full else (2, 2)
    q = _inputs((1, n_q, L, d), fp_dtype, seed=d + 3)
    fp_k = _inputs((1, n_kv, n_sink + n_recent, d), fp_dtype, seed=d + 4)
    fp_v = _inputs((1, n_kv, n_sink + n_recent, d), fp_dtype, seed=d + 5)
    t, pos = np.arange(T)[None, :], np.arange(L)[:, None]
    if L > 1:
        keep, mask = t <= T - L + pos, "causal"  # a step of L tokens, as mlx-lm asks for it
    elif full:
        keep = (t + pos) % 4 != 1
        mask = mx.array(keep[None, None])
    else:
        keep, mask = t >= 0, None
    scale = d ** -0.5
    if full:
        k_lam = 1.0 + mx.abs(_inputs((1, n_kv, 1, d), mx.float32, seed=d + 6))
        k_signs, v_signs = rotation.random_signs(seed=3, dim=d), rotation.random_signs(seed=4, dim=d)
        kc, ks = codec.quantize(rotation.rotate(_inputs((1, n_kv, n_packed, d), mx.float32, seed=d + 7), k_signs),
                                k_bits, g)
        vc, vs = codec.quantize(rotation.rotate(_inputs((1, n_kv, n_packed, d), mx.float32, seed=d + 8), v_signs),
                                v_bits, g)
        v_mean = _inputs((1, n_kv, 1, d), mx.float32, seed=d + 9) * 0.1
        k_mean = _inputs((1, n_kv, 1, d), mx.float32, seed=d + 10) * 0.1
        sinks = mx.linspace(-1.0, 1.0, n_q)
        segments = (fp_k[:, :, :n_sink], fp_v[:, :, :n_sink], (kc, ks, vc, vs), fp_k[:, :, n_sink:],
                    fp_v[:, :, n_sink:])
        out = attention_module.decode_attention(
            q, scale=scale, segments=segments, k_bits=k_bits, v_bits=v_bits, group_size=g, k_lam=k_lam,
            k_signs=k_signs, mask=mask, sinks=sinks, v_mean=v_mean, v_signs=v_signs, k_mean=k_mean,
            keys_per_part_=2, out_dtype=out_dtype)
    else:
        out = attention_module.decode_attention(
            q, scale=scale, segments=(None, None, None, fp_k, fp_v), k_bits=k_bits, v_bits=v_bits, group_size=g,
            mask=mask, out_dtype=out_dtype)
    mx.eval(out)

    keys = [_f64(fp_k[:, :, :n_sink]), _f64(fp_k[:, :, n_sink:])]
    values = [_f64(fp_v[:, :, :n_sink]), _f64(fp_v[:, :, n_sink:])]
    if full:
        keys.insert(1, _f64(rotation.unrotate(codec.dequantize(kc, ks, k_bits, g), k_signs)) * _f64(k_lam))
        values.insert(1, _f64(rotation.unrotate(codec.dequantize(vc, vs, v_bits, g), v_signs)))
    keys, values = np.concatenate(keys, axis=2)[0], np.concatenate(values, axis=2)[0]  # (n_kv, T, d)
    qh = _f64(q)[0].reshape(n_kv, rep, L, d) * scale
    scores = np.where(keep, np.einsum("hrld,htd->hrlt", qh, keys), -np.inf)
    if full:  # the stored keys are centered: each sink logit moves by -scale * q . key mean
        sink_logits = _f64(sinks).reshape(n_kv, rep, 1, 1) - np.einsum("hrld,hd->hrl", qh, _f64(k_mean)[0, :, 0])[
            ..., None]
    else:
        sink_logits = np.full((n_kv, rep, L, 1), -np.inf)
    top = np.maximum(scores.max(-1, keepdims=True), sink_logits)
    w = np.exp(scores - top)
    w = w / (w.sum(-1, keepdims=True) + np.exp(sink_logits - top))
    want = np.einsum("hrlt,htd->hrld", w, values) + (_f64(v_mean)[0][:, None] if full else 0.0)
    want = want.reshape(1, n_q, L, d)
    got = _f64(out)
    err = float(np.max(np.abs(got - want))) if got.shape == want.shape else float("inf")
    bound = ATTENTION_TOLERANCE[out_dtype] * max(1.0, float(np.max(np.abs(want))))
    if not err <= bound:  # NaN fails too
        return f"attention output off the reference by {err:.3g} (bound {bound:.3g})"
    return None
