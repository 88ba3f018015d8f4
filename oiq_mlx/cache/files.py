"""The cache file format of :class:`~oiq_mlx.cache.OIQKVCache`: what its ``state`` holds
(:func:`cache_state`), how a state is validated before anything is computed from it
(:func:`parse_state`; ``load_prompt_cache`` hands states back) and how a cache takes it back
(:func:`restore_state`).

:attr:`OIQKVCache.state` (what ``save_prompt_cache`` writes) carries a format version and a
digest of its metadata; ``from_state`` refuses, naming the field, a state whose arrays do not
have exactly the shapes, dtypes and row counts the config and counters imply, whose counters
contradict each other, whose sign vectors are not the config's, whose means or key scales are
non-finite (or scales below 1), whose full-precision sink or window rows hold NaN or Inf, whose
group scales are negative, infinite or 0/NaN over non-zero codes, or whose metadata does not match
its digest.  A state is read under the format its writer used: one that says format 1 (or no
format, oiq_mlx 0.1.0) must have format 1's config fields and window layout (:func:`parse_state`).  Token data (codes, full-precision rows,
means) may hold any value, so an edit of those values that keeps every shape (one head's codes
copied over another's) is not detected: there is no checksum of the array data, which would cost
a pass over the cache every prefill step (mlx-lm evaluates ``cache.state`` there).
"""

from __future__ import annotations

import hashlib
import json

import mlx.core as mx

from ..core import fp4
from ..core.codec import join_rows
from ..core.config import OIQConfig
from .common import DTYPES, expected_signs

FORMAT_VERSION = 2
# Format 1 (and states without "format", oiq_mlx 0.1.0) stored the full-precision
# rows rotated, r((x - m) / lam), and the mean as r(m / lam); format 2 stores
# x - m and m (DESIGN.md section 5).  Older states are converted on load.
READABLE_FORMATS = (1, 2)
# Every format-1 writer (oiq_mlx 0.1.0 before format 2) wrote exactly these config fields;
# format 2 writes more (positional, align_scales, key_scaling_cap, exact_prefill).  A file that
# says format 1, or says no format, must have them: a format-2 file whose format field was
# removed or set to 1 (its digest recomputed) is refused instead of read as another cache.
FORMAT_1_CONFIG_FIELDS = frozenset((
    "k_bits", "v_bits", "group_size", "seed", "sink_tokens", "window", "quantize_after", "clip", "center_keys",
    "center_values", "trim_reserve", "rotation", "key_scaling", "layer_bits"))
_ARRAY_NAMES = ("codes", "scales", "sink", "recent", "signs", "mean", "lam")
# the metadata and config fields that set each array's expected shape and dtype (named when it
# does not fit: the array or one of them is at fault)
_IMPLIED_BY = {
    "codes": "q_end, sink_tokens, dims, k_bits/v_bits/layer_bits and layer_idx",
    "scales": "q_end, sink_tokens, dims, group_size and storage",
    "sink": "offset, sink_tokens, dims and dtype",
    "recent": "offset, recent_start, q_end, dims and dtype",
    "signs": "dims",
    "mean": "dims (center_keys/center_values)",
    "lam": "dims (key_scaling)",
}
_META_FIELDS = ("config", "layer_idx", "offset", "q_end", "recent_start", "dtype", "head_dims", "dims")


def digest(meta: dict) -> str:
    """Digest of the metadata fields: catches an edited config or counter that
    leaves the arrays consistent (e.g. ``clip`` or ``window`` changed)."""
    fields = {k: meta[k] for k in sorted(meta) if k != "digest"}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def held_rows(cache) -> tuple[int, int, int]:
    """Rows in use of the sink, the packed segment and the full-precision buffer of ``cache``."""
    s = cache.config.sink_tokens
    return min(s, cache.offset), max(0, cache.q_end - s), max(0, cache.offset - max(s, cache.recent_start))


def cache_state(cache) -> list:
    """What :attr:`OIQKVCache.state` returns: the arrays ``cache`` holds, trimmed to what is
    used, and a JSON string.

    ``[k_codes, k_scales, k_sink, k_recent, k_signs, k_mean, k_lam, (same for
    values), metadata]``, None for an array not held.  The metadata carries
    the format version, the config, the counters and a digest of itself;
    :func:`parse_state` checks all of it against the arrays.
    """
    cfg = cache.config
    n_sink, n_q, n_rec = held_rows(cache)
    # a prompt waiting whole (exact_prefill) holds its sinks at the front of the window buffer
    # too: the file keeps them once, as any cache does
    lead = max(0, cfg.sink_tokens - cache.recent_start)
    arrays = []
    for side in (cache.k, cache.v):
        arrays += [
            None if side.codes is None else side.codes[:, :, :n_q],
            None if side.scales is None else side.scales[:, :, :n_q],
            None if side.sink is None else (side.recent if lead else side.sink)[:, :, :n_sink],
            None if side.recent is None else side.recent[:, :, lead : lead + n_rec],
            side.signs,
            side.mean,
            side.lam,
        ]
    meta = {
        "format": FORMAT_VERSION,
        "config": cfg.to_json(),
        "layer_idx": cache.layer_idx,
        "offset": cache.offset,
        "q_end": cache.q_end,
        "recent_start": max(cfg.sink_tokens, cache.recent_start),
        "dtype": None if cache.dtype is None else str(cache.dtype).split(".")[-1],
        "head_dims": [cache.k.head_dim, cache.v.head_dim],
        "dims": [cache.k.dim, cache.v.dim],
    }
    if cache.layout is not None:
        meta["layout"] = cache.layout
    if cache.prefilling and cache.dtype is not None:
        meta["prefilling"] = True  # the rows wait in full precision for end_prefill
    meta["digest"] = digest(meta)
    return arrays + [json.dumps(meta)]


def restore_state(cache, v) -> dict:
    """Make ``cache`` (an :class:`OIQKVCache`) hold the state ``v``, validated by
    :func:`parse_state` first: its config, counters and arrays (rows past what the counters
    hold dropped, format 1 converted).  Returns the metadata; the cache then sets what it
    lays out itself (``OIQKVCache.state``'s setter: the exact_prefill flag and the buffers
    keys and values share) when it holds anything (``dtype`` not null)."""
    cfg, meta, sides = parse_state(v)
    cache.__init__(cfg, layer_idx=meta["layer_idx"])
    cache.layout = meta.get("layout")
    cache.offset, cache.q_end, cache.recent_start = meta["offset"], meta["q_end"], meta["recent_start"]
    if meta["dtype"] is None:
        return meta
    cache.dtype = DTYPES[meta["dtype"]]
    n_sink, n_q, n_rec = held_rows(cache)
    for i, (side, arrays) in enumerate(zip((cache.k, cache.v), sides)):
        side.head_dim, side.dim = meta["head_dims"][i], meta["dims"][i]
        side.rotated = cfg.rotation != "none"
        side.signs, side.mean, side.lam = arrays["signs"], arrays["mean"], arrays["lam"]
        # rows past what the counters hold are never read: they are dropped
        side.sink = arrays["sink"][:, :, :n_sink]
        # a buffer holding 0 rows comes back as one (format 1 saved arbitrary slices of emptied ones)
        recent, versioned = arrays["recent"], meta.get("format", 1) >= 2
        side.recent = None if recent is None or not (n_rec or versioned) else recent[:, :, :n_rec]
        if not versioned:
            side.mean = None if side.mean is None else side.packed_to_window(side.mean)
            side.sink = side.packed_to_window(side.sink).astype(cache.dtype)
            if side.recent is not None:
                side.recent = side.packed_to_window(side.recent).astype(cache.dtype)
        if cfg.storage == "int":
            side.rows = join_rows(arrays["codes"][:, :, :n_q], arrays["scales"][:, :, :n_q]) if n_q else None
    if cfg.storage != "int" and n_q:
        # fp4: one joined buffer of key and value rows, which both sides view
        rows = fp4.join_pair(*(a[name][:, :, :n_q] for a in sides for name in ("codes", "scales")))
        cache.k.rows = cache.v.rows = rows
    return meta


def _refuse(field: str, problem: str) -> ValueError:
    return ValueError(f"OIQKVCache state refused: {field} {problem}")


def _describe(a) -> str:
    return f"{a.dtype} {tuple(a.shape)}" if isinstance(a, mx.array) else type(a).__name__


def parse_state(v):
    """Validate a state (what :attr:`OIQKVCache.state` returns, as
    ``load_prompt_cache`` hands it back) before anything is computed from it.

    Returns ``(config, metadata, [keys arrays, values arrays])``, each side a
    dict by array name.  Raises ``ValueError`` naming the field at fault.
    """
    if not isinstance(v, (list, tuple)) or len(v) != 2 * len(_ARRAY_NAMES) + 1 or not isinstance(v[-1], str):
        n = len(v) if isinstance(v, (list, tuple)) else "?"
        raise _refuse("state", f"must be 14 arrays (None where absent) and a metadata string; got "
                               f"{type(v).__name__} of {n} items")
    try:
        meta = json.loads(v[-1])
    except json.JSONDecodeError as e:
        raise _refuse("metadata", f"is not JSON ({e})") from None
    if not isinstance(meta, dict):
        raise _refuse("metadata", f"must be a JSON object, got {type(meta).__name__}")
    fmt = meta.get("format")
    if "format" in meta and (not isinstance(fmt, int) or isinstance(fmt, bool) or fmt not in READABLE_FORMATS):
        raise _refuse("format", f"{fmt!r} is not one this oiq_mlx reads {READABLE_FORMATS}; "
                                "the file was written by another version")
    expected = set(_META_FIELDS) | ({"format", "digest"} if "format" in meta else set())
    # a sharded run's caches also carry the layout they were made on (oiq_mlx.mlx_lm.sharding)
    if "format" in meta and "layout" in meta:
        expected.add("layout")
        if not isinstance(meta["layout"], dict):
            raise _refuse("layout", f"must be a JSON object, got {type(meta['layout']).__name__}")
    # a cache saved while exact_prefill kept its prompt in full precision
    if "format" in meta and "prefilling" in meta:
        expected.add("prefilling")
        if meta["prefilling"] is not True:
            raise _refuse("prefilling", f"must be true when present, got {meta['prefilling']!r}")
    if set(meta) != expected:
        raise _refuse("metadata", f"fields do not match format {FORMAT_VERSION}: missing "
                                  f"{sorted(expected - set(meta))}, unknown {sorted(set(meta) - expected)}")
    if not isinstance(meta["config"], str):
        raise _refuse("config", f"must be a JSON string, got {type(meta['config']).__name__}")
    try:
        cfg = OIQConfig.from_json(meta["config"])
    except ValueError as e:
        raise _refuse("config", f"is invalid: {e}") from None
    _check_format(meta)
    for name in ("layer_idx", "offset", "q_end", "recent_start"):
        x = meta[name]
        if isinstance(x, bool) or not isinstance(x, int) or x < 0:
            raise _refuse(name, f"must be an integer >= 0, got {x!r}")
    if meta["dtype"] is not None and (not isinstance(meta["dtype"], str) or meta["dtype"] not in DTYPES):
        raise _refuse("dtype", f"{meta['dtype']!r} is not one of {sorted(DTYPES)}")
    sides = []
    for i, side in enumerate(("keys", "values")):
        arrays = dict(zip(_ARRAY_NAMES, v[7 * i : 7 * i + 7]))
        for name, a in arrays.items():
            if a is not None and not isinstance(a, mx.array):
                raise _refuse(f"{side} {name}", f"is missing or not an array (got {type(a).__name__})")
        sides.append(arrays)
    s, offset, q_end, recent_start = cfg.sink_tokens, meta["offset"], meta["q_end"], meta["recent_start"]
    if meta["dtype"] is None:
        _check_empty_state(meta, sides, s)
    else:
        if meta.get("prefilling") and (cfg.positional or q_end != s or offset > cfg.exact_prefill):
            raise _refuse("prefilling", f"needs exact_prefill >= offset, positional off and nothing packed "
                                        f"(q_end = sink_tokens); got exact_prefill={cfg.exact_prefill}, "
                                        f"positional={cfg.positional}, offset={offset}, q_end={q_end}")
        if not s <= recent_start <= q_end <= max(s, offset):
            raise _refuse("q_end", f"and recent_start must satisfy sink_tokens <= recent_start <= q_end <= "
                                   f"max(sink_tokens, offset); got sink_tokens={s}, recent_start={recent_start}, "
                                   f"q_end={q_end}, offset={offset}")
        if meta.get("format", 1) == 1 and offset > cfg.quantize_after and offset - q_end > cfg.window:
            # format 1 packed every token past the window after each call (and trim kept that);
            # format 2 packs in blocks, so its window can hold up to a block - 1 more
            raise _refuse("format", f"1 packed every token past the window (offset - q_end <= window), but this "
                                    f"file's window holds {offset - q_end} rows for window={cfg.window} (offset "
                                    f"{offset}, q_end {q_end}): its arrays are laid out as format 2 lays them out")
        _check_arrays(cfg, meta, sides)
    if "format" in meta and meta["digest"] != digest(meta):
        raise _refuse("metadata", "does not match its digest: the config or the counters were edited "
                                  "or corrupted after the cache was saved")
    return cfg, meta, sides


def _check_format(meta: dict):
    """A file is read under the format its writer used: format 1 (declared, or no format
    field as in oiq_mlx 0.1.0) only with the config fields every format-1 writer wrote."""
    if meta.get("format", 1) != 1:
        return
    newer = sorted(set(json.loads(meta["config"])) - FORMAT_1_CONFIG_FIELDS)
    if newer:
        said = "says format 1" if "format" in meta else "has no format field (format 1, oiq_mlx 0.1.0)"
        raise _refuse("format", f"{said} but its config has fields {newer} that only format "
                                f"{FORMAT_VERSION} writes: the format field was removed or edited")


def _check_finite_rows(side: str, name: str, a):
    """Full-precision rows are written finite unless the model gave non-finite keys or values;
    a file holding NaN or Inf there would make every later attention output NaN."""
    if a is not None and a.size and not mx.all(mx.isfinite(a)).item():
        raise _refuse(f"{side} {name}", "holds non-finite values (NaN or Inf) in its full-precision rows")


def _check_empty_state(meta: dict, sides, sink_tokens: int):
    if meta["offset"] != 0 or meta["q_end"] != sink_tokens or meta["recent_start"] != sink_tokens:
        raise _refuse("offset", f"q_end and recent_start of a cache that holds nothing (dtype null) must be "
                                f"0, {sink_tokens}, {sink_tokens}; got {meta['offset']}, {meta['q_end']}, "
                                f"{meta['recent_start']}")
    if meta["head_dims"] != [None, None] or meta["dims"] != [None, None]:
        raise _refuse("head_dims", "and dims of a cache that holds nothing must be [null, null]")
    for side, arrays in zip(("keys", "values"), sides):
        for name, a in arrays.items():
            if a is not None:
                raise _refuse(f"{side} {name}", "is present in a cache that holds nothing (dtype null)")


def _check_arrays(cfg: OIQConfig, meta: dict, sides):
    """Shapes, dtypes and values of the arrays of a non-empty state."""
    dtype, layer = DTYPES[meta["dtype"]], meta["layer_idx"]
    for name in ("head_dims", "dims"):
        x = meta[name]
        positive = [not isinstance(d, bool) and isinstance(d, int) and d >= 1 for d in x] if isinstance(x, list) else []
        if len(positive) != 2 or not all(positive):
            raise _refuse(name, f"must be two positive integers, got {x!r}")
    sink = sides[0]["sink"]
    if sink is None or sink.ndim != 4 or min(sink.shape[:2]) < 1:
        raise _refuse("keys sink", f"must be an array (B, n_kv_heads, rows, dim), got {_describe(sink)}")
    bh = tuple(sink.shape[:2])
    s, offset = cfg.sink_tokens, meta["offset"]
    n_sink, n_q, n_rec = min(s, offset), max(0, meta["q_end"] - s), max(0, offset - meta["recent_start"])
    bits = cfg.bits_for_layer(layer)
    versioned = "format" in meta
    for which, (side, arrays) in enumerate(zip(("keys", "values"), sides)):
        head_dim, dim = meta["head_dims"][which], meta["dims"][which]
        try:
            storage = cfg.storage_dim(head_dim)
        except ValueError as e:
            raise _refuse("head_dims", f"do not fit the config: {e}") from None
        if dim != storage:
            raise _refuse("dims", f"{side}: {dim} is not the storage dimension {storage} of head_dims' {head_dim}")

        def check(name, a, want_dtype, want_shape, rows=None):
            """``a`` must have ``want_dtype`` and ``want_shape`` (axis 2 any of ``rows`` when given)."""
            ok = isinstance(a, mx.array) and a.dtype == want_dtype and a.ndim == len(want_shape)
            if ok and a.ndim == 4 and tuple(a.shape[:2]) != bh:
                raise _refuse(f"{side} {name}", f"has (B, n_kv_heads) = {tuple(a.shape[:2])} where keys sink "
                                                f"has {bh}")
            if ok and rows is not None:
                ok = a.shape[2] in rows and a.shape[3:] == want_shape[3:]
            elif ok:
                ok = tuple(a.shape) == want_shape
            if not ok:
                want = f"{want_dtype} {want_shape}"
                if rows is not None and len(rows) > 1:
                    want += f" (or {sorted(rows)} rows on axis 2)"
                raise _refuse(f"{side} {name}", f"is {_describe(a)}, expected {want} (as {_IMPLIED_BY[name]} imply)")

        def check_rows(name, n):
            """A per-token array holding ``n`` rows (absent or empty when n is 0)."""
            a = arrays[name]
            if n or a is not None:
                width = {"codes": dim * bits[which] // 32, "scales": dim // cfg.group_size}.get(name, dim)
                want_dtype = {"codes": mx.uint32, "scales": mx.float16 if cfg.storage == "int" else mx.uint8}.get(
                    name, dtype)
                check(name, a, want_dtype, (*bh, n, width), rows={n})

        # oiq_mlx 0.1.0 saved the sink buffer at its full sink_tokens rows (always: its layout),
        # and an arbitrary slice of an emptied full-precision buffer; those rows are never read
        check("sink", arrays["sink"], dtype, (*bh, n_sink, dim), rows={n_sink} if versioned else {s})
        _check_finite_rows(side, "sink", arrays["sink"][:, :, :n_sink])
        if n_rec or versioned:
            check_rows("recent", n_rec)
            _check_finite_rows(side, "recent", arrays["recent"])
        check_rows("codes", n_q)
        check_rows("scales", n_q)
        if n_q and cfg.storage != "int":
            _check_fp4_scales(cfg.storage, side, arrays["codes"], arrays["scales"])
        elif n_q:
            scales = arrays["scales"]
            # nothing writes a negative or infinite scale; NaN (a group that held
            # non-finite input) and 0 (an all-zero group) are written with codes 0
            if mx.any(mx.logical_or(scales < 0, mx.isinf(scales))).item():
                raise _refuse(f"{side} scales", "hold negative or infinite values")
            codes = arrays["codes"]
            words = codes.reshape(*codes.shape[:3], dim // cfg.group_size, -1)
            codeless = mx.logical_not(scales > 0)[..., None]
            if mx.any(mx.logical_and(codeless, words != 0)).item():
                raise _refuse(f"{side} scales", "are 0 or NaN for groups whose codes are not 0 (a group is "
                                                "stored with scale 0 or NaN only with codes 0)")
        check("signs", arrays["signs"], mx.float32, (dim,))
        if not mx.array_equal(arrays["signs"], expected_signs(cfg, layer, which, dim)).item():
            raise _refuse(f"{side} signs", f"are not the sign vector of layer {layer} under rotation="
                                           f"{cfg.rotation!r}, seed={cfg.seed}")
        center = cfg.center_keys if which == 0 else cfg.center_values
        power = cfg.key_scaling if which == 0 else 0.0
        for name, used in (("mean", center), ("lam", power > 0)):
            a = arrays[name]
            if not used:
                if a is not None:
                    raise _refuse(f"{side} {name}", "is present but the config does not use it "
                                                    "(center_keys/center_values, key_scaling)")
                continue
            if cfg.positional and not n_q:
                # positional statistics are estimated when the first block is packed
                if a is not None:
                    raise _refuse(f"{side} {name}", "is present but nothing is packed yet (positional=true "
                                                    "estimates it when the first block is packed)")
                continue
            if meta.get("prefilling"):
                # exact_prefill estimates them when the prefill ends
                if a is not None:
                    raise _refuse(f"{side} {name}", "is present but the prompt is still being prefilled "
                                                    "(exact_prefill estimates it when the prefill ends)")
                continue
            if a is None:
                if offset > 0:
                    what = "something is packed" if cfg.positional else "the cache holds tokens"
                    raise _refuse(f"{side} {name}", f"is missing (the config uses it and {what}: "
                                                    "center_keys/center_values, key_scaling)")
                continue
            check(name, a, mx.float32, (*bh, 1, dim))
            if not mx.all(mx.isfinite(a)).item():
                raise _refuse(f"{side} {name}", "holds non-finite values")
        lam, mean = arrays["lam"], arrays["mean"]
        if lam is not None and not mx.all(lam >= 1).item():
            raise _refuse(f"{side} lam", "holds values below 1 (key scales only ever shrink channels)")
        if center and power > 0 and (mean is None) != (lam is None):
            raise _refuse(f"{side} mean", "and lam must be both present or both absent")


def _check_fp4_scales(mode: str, side: str, codes, scales):
    """fp4 scales (uint8: E8M0 for MXFP4, E4M3 for NVFP4): NVFP4 writes no negative scale, and the
    NaN scale only over codes 0 (a group that held non-finite input, ``core/fp4.py``)."""
    if mode == "nvfp4" and mx.any(scales >= 0x80).item():
        raise _refuse(f"{side} scales", "hold negative E4M3 values (nvfp4 scales are never negative)")
    nan = (scales == 0xFF) if mode == "mxfp4" else (scales == 0x7F)
    words = codes.reshape(*codes.shape[:3], scales.shape[-1], -1)
    if mx.any(mx.logical_and(nan[..., None], words != 0)).item():
        raise _refuse(f"{side} scales", f"are NaN ({mode}) for groups whose codes are not 0 (a group is stored "
                                        "with the NaN scale only with codes 0)")
