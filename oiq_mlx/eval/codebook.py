"""A probe of vector codebooks for the packed rows, measured before one is built.

A codebook of ``C`` points in ``R^k`` quantizes the rotated rows in blocks of ``k`` consecutive
coordinates, with one float16 scale per group of ``group_size`` coordinates as the integer
codec has.  It costs ``log2(C) / k`` bits per coordinate, so fractional rates need no
variable-length codes (1.5 bits: ``k = 4``, ``C = 64``).  A scalar grid is the case ``k = 1``.

The codebooks are data-free.  Lloyd's algorithm (k-means) runs on Gaussian groups normalized
by their RMS: after the randomized Hadamard rotation, rows are close to that distribution.
FibQuant builds its codebook for the same distribution in closed form.  No text is looked at,
so there is nothing to tune on one text and find missing on another.

Each group's scale is its RMS times the best of ``RATIOS`` (least squared error), rounded to
float16.  The codes for a scale are the nearest codewords (:func:`reconstruct`).

A cache cannot store codebook indices.  :func:`packing_through` makes the cache's pack step
store ``reconstruct(y)`` in place of the rotated rows ``y``, in 8-bit codes: configure the
cache with ``k_bits = v_bits = 8``.  The carrier adds a relative squared error of at most about
2e-5 (a 4-D codebook's points are not on its grid; a scalar grid's are, nearly), against about 0.1
for a 2-bit codebook.  Everything else is the preset's: sinks, window, means,
key scaling, the rotation, exact prefill.  ``scripts/codebook_probe.py`` is the front end
(docs/results.md, "Vector codebooks").
"""

from __future__ import annotations

import contextlib
import math
import re

import mlx.core as mx
import numpy as np

from ..core import codec, rotation
from ..kernels import dispatch
from .rotation import quant_error

# scale = group RMS x ratio, the ratio searched per group (least squared error); on Gaussian
# groups every codebook here does best near 1, and a grid from 0.3 to 2 gains nothing over this
RATIOS = tuple(round(0.6 + 0.05 * i, 2) for i in range(19))  # 0.6 ... 1.5


def lloyd(z: np.ndarray, size: int, *, iters: int = 30, seed: int = 0) -> np.ndarray:
    """``size`` points in ``R^k`` for the rows of ``z`` (``n x k``) by Lloyd's algorithm
    (k-means): start from ``size`` rows drawn at random (quantiles when ``k = 1``), then assign
    every row to its nearest point and move each point to the mean of its rows.  A point left
    without rows takes a random row."""
    rng = np.random.default_rng(seed)
    z = np.asarray(z, np.float64)
    if z.shape[1] == 1:
        book = np.quantile(z[:, 0], (np.arange(size) + 0.5) / size)[:, None]
    else:
        book = z[rng.choice(len(z), size, replace=False)].copy()
    for _ in range(iters):
        idx = nearest(z, book)
        sums = np.zeros_like(book)
        np.add.at(sums, idx, z)
        counts = np.bincount(idx, minlength=size)
        empty = counts == 0
        book = np.where(empty[:, None], z[rng.choice(len(z), size)], sums / np.maximum(counts, 1)[:, None])
    return book


def nearest(z: np.ndarray, book: np.ndarray, chunk: int = 65536) -> np.ndarray:
    """Index of the nearest point of ``book`` for each row of ``z``."""
    b2 = (book ** 2).sum(1)
    out = np.empty(len(z), np.int64)
    for i in range(0, len(z), chunk):
        out[i : i + chunk] = np.argmin(b2[None] - 2 * z[i : i + chunk] @ book.T, axis=1)
    return out


def gaussian_codebook(dim: int, size: int, *, group_size: int = 32, groups: int = 50_000,
                      iters: int = 30, seed: int = 0) -> np.ndarray:
    """A codebook of ``size`` points in ``R^dim`` for Gaussian groups of ``group_size``
    coordinates divided by their RMS (:func:`lloyd` on ``groups`` such groups)."""
    if group_size % dim:
        raise ValueError(f"blocks of {dim} coordinates do not tile groups of {group_size}")
    if size > groups * group_size // dim:
        raise ValueError(f"{size} points need more than {groups} groups of samples")
    g = np.random.default_rng(seed).standard_normal((groups, group_size))
    g /= np.sqrt((g ** 2).mean(1, keepdims=True))
    return lloyd(g.reshape(-1, dim), size, iters=iters, seed=seed)


def uniform_grid(bits: int) -> np.ndarray:
    """The integer codec's levels for ``bits`` as a codebook in ``R^1`` (a mid-rise grid:
    ``i - (2^bits - 1) / 2``), with which :func:`reconstruct` searches the scale."""
    return (np.arange(1 << bits) - ((1 << bits) - 1) / 2)[:, None]


def parse_variant(name: str, group_size: int = 32) -> np.ndarray:
    """The codebook a variant name stands for: ``uniform-B`` (:func:`uniform_grid`) or
    ``vq-KxC`` (:func:`gaussian_codebook` of ``C`` points in ``R^K``)."""
    m = re.fullmatch(r"uniform-(\d+)|vq-(\d+)x(\d+)", name)
    if m is None:
        raise ValueError(f"unknown codebook {name!r}: expected uniform-B or vq-KxC (e.g. vq-4x64)")
    if m.group(1):
        return uniform_grid(int(m.group(1)))
    return gaussian_codebook(int(m.group(2)), int(m.group(3)), group_size=group_size)


def bits_per_coordinate(book: np.ndarray) -> float:
    return math.log2(len(book)) / book.shape[1]


def packed_bytes(dim: int, book: np.ndarray, group_size: int = 32) -> float:
    """Keys and values of one token and KV head at ``book``'s rate: codes, and one float16
    scale per group."""
    return 2 * (dim * bits_per_coordinate(book) / 8 + dim // group_size * 2)


def reconstruct(y: mx.array, book, group_size: int = 32, ratios=RATIOS, align: float = 0.0) -> mx.array:
    """``y`` (``(..., d)``) quantized by ``book`` (``C x k``) and decoded: per group of
    ``group_size`` coordinates the float16 scale (RMS times one of ``ratios``) whose nearest
    codewords leave the least squared error.  With ``align`` (1 or 0.5), the codewords so
    chosen keep that choice and the group stores the aligned scale ``sum(y*y) / sum(y*u)``
    (``u``: the chosen codewords at scale 1), or the mean of it and the searched one, as
    ``codec.quantize(align=...)`` does for the integer grid.  Float32, the shape of ``y``."""
    align = codec.check_alignment(align)
    book = mx.array(np.asarray(book, np.float32))
    k = book.shape[1]
    d = y.shape[-1]
    if d % group_size or group_size % k:
        raise ValueError(f"groups of {group_size} do not tile {d} coordinates in blocks of {k}")
    g = y.astype(mx.float32).reshape(-1, d // group_size, group_size)
    rms = mx.sqrt(mx.mean(g * g, axis=-1, keepdims=True))
    b2 = mx.sum(book * book, axis=1)
    best_err = best = best_s = None
    for a in ratios:
        s = (rms * a).astype(mx.float16).astype(mx.float32)
        s = mx.where(s > 0, s, 1.0)
        z = (g / s).reshape(-1, k)
        idx = mx.argmin(b2[None] - 2 * (z @ book.T), axis=1)
        u = book[idx].reshape(g.shape)
        err = mx.sum(mx.square(g - u * s), axis=-1, keepdims=True)
        if best is None:
            best_err, best, best_s = err, u, s
        else:
            better = err < best_err
            best_err, best, best_s = (mx.where(better, err, best_err), mx.where(better, u, best),
                                      mx.where(better, s, best_s))
        mx.eval(best_err, best, best_s)
    scale = mx.where(rms > 0, best_s, 0.0)  # a zero group decodes to zero
    if align:
        yy = mx.sum(g * g, axis=-1, keepdims=True)
        yu = mx.sum(g * best, axis=-1, keepdims=True)
        ratio = yy / mx.where(yu > 0, yu, 1.0)
        target = ratio if align == 1.0 else 0.5 * (scale + ratio)
        scale = mx.where(yu > 0, target.astype(mx.float16).astype(mx.float32), scale)
    return (best * scale).reshape(y.shape)


@contextlib.contextmanager
def packing_through(reconstruct_rows):
    """Within the block, every cache of 8-bit keys and values packs ``reconstruct_rows(y)``
    in place of its rotated rows ``y`` (module docstring): ``dispatch.quantize_rows``, which
    the caches call to pack, is replaced, and restored on exit.  Caches of other bits pack as
    they do outside it, so presets can run beside the carrier in one paired comparison."""
    original = dispatch.quantize_rows

    def carried(x, bits, group_size, *, lam, signs, rotate=True, clip=False, joined=False, align=False):
        if bits != 8:
            return original(x, bits, group_size, lam=lam, signs=signs, rotate=rotate, clip=clip, joined=joined,
                            align=align)
        y = (x.astype(mx.float32) if lam is None else x.astype(mx.float32) / lam) * signs
        if rotate:
            y = rotation.hadamard(y)
        codes, scales = codec.quantize(reconstruct_rows(y), 8, group_size)
        return codec.join_rows(codes, scales) if joined else (codes, scales)

    dispatch.quantize_rows = carried
    try:
        yield
    finally:
        dispatch.quantize_rows = original


def packed_errors(rows: dict, config, books: dict, progress=None, align: float = 0.0) -> dict:
    """Relative squared errors ``||x - x_hat||^2 / ||x||^2`` on the packed rows ``rows``
    (:func:`oiq_mlx.eval.rotation.packed_rows` of a cache of ``config``), per side: ``config``'s
    own quantizer (clip search, each side's scale alignment; named ``"preset"``), then each of ``books``
    (``{name: codebook}``) at ``config``'s group size, scales aligned by ``align``
    (:func:`reconstruct`).  Returns ``{"codebook_errors": {side:
    {name: error}}, "bytes": {name: bytes per token and KV head}}``."""
    errors = {}
    d = next(iter(rows.values()))[0].shape[-1]
    for side, name in (("k", "keys"), ("v", "values")):
        bits = config.k_bits if side == "k" else config.v_bits
        x = mx.array(np.concatenate([r.reshape(-1, d) for (_, s), (r, _) in sorted(rows.items()) if s == side])
                     .astype(np.float32))
        den = float(mx.sum(x * x))
        e = {"preset": quant_error(np.array(x), bits, config, side)[0] / den}
        for v, book in books.items():
            if progress is not None:
                progress(f"{name}: {v}")
            e[v] = float(mx.sum(mx.square(x - reconstruct(x, book, config.group_size, align=align)))) / den
        errors[name] = e
    return {"codebook_errors": errors, "bytes": {"preset": config.bytes_per_token(d)} | {
        v: packed_bytes(d, book, config.group_size) for v, book in books.items()}}


def errors_table(result: dict) -> str:
    """Markdown table of a ``codebook_probe.py mse`` result: each quantizer's relative squared
    error per side, and its change against the preset's own quantizer (the first row)."""
    sides = list(result["codebook_errors"])
    names = list(result["codebook_errors"][sides[0]])
    lines = ["| quantizer | bytes/token/KV head (K+V) | " + " | ".join(f"{s}: squared error" for s in sides) + " |",
             "|---|---:|" + "---:|" * len(sides)]
    for n in names:
        cells = []
        for s in sides:
            e, base = result["codebook_errors"][s][n], result["codebook_errors"][s][names[0]]
            cells.append(f"{e:.4f}" if n == names[0] else f"{e:.4f} ({100 * (e / base - 1):+.1f}%)")
        lines.append(f"| {n} | {result['bytes'][n]:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
