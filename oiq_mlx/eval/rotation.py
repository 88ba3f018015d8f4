"""A probe of calibrated rotations: an orthogonal ``R`` per layer and KV head on top of the
cache's randomized Hadamard rotation, learned by Procrustes toward the hypercube corners.

For rows ``X`` (the packed domain: centered, key-scaled, rotated; normalized per row) and the
current ``R``, the targets are ``B = sign(X R)``; the ``R`` minimising ``||X R - B||`` over
orthogonal matrices is ``U V^T`` of the SVD of ``X^T B``.  The two steps alternate
(:func:`procrustes`).  Spreading a row's energy evenly over its coordinates is what a per-group
abs-max scale wants.

Two measures (``scripts/rotation_probe.py`` is the front end; docs/results.md, "Calibrated
rotation"):

* :func:`packed_errors`: the relative squared error of a preset's quantizer on one text's rows,
  with the Hadamard base alone and with ``R`` learned on another text or on the text's own
  first rows;
* :func:`fold_value_rotations`: values only.  ``Q = M R M^T`` (``M`` the cache's own rotation)
  folded into ``v_proj`` and ``o_proj``: the cache receives ``v Q`` and the attention output is
  multiplied back by ``Q^T``, exact in full precision, so a perplexity run through the cache
  measures what storing values in the calibrated domain costs or buys.  Keys are rotated by
  RoPE after ``k_proj``; their ``R`` cannot be folded into weights.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..cache.sequence import OIQKVCache
from ..core.codec import dequantize, quantize
from ..core.config import OIQConfig
from ..core.rotation import rotation_matrix
from ..mlx_lm.routing import capture_attention_inputs

SIDES = {"k": "keys", "v": "values"}


def procrustes(x: np.ndarray, iters: int = 40) -> np.ndarray:
    """Orthogonal ``R`` (d x d, float64) that brings the normalized rows of ``x`` (n x d)
    toward the corners of the hypercube, from the identity, ``iters`` alternations."""
    xn = np.asarray(x, np.float64)
    xn = xn / (np.linalg.norm(xn, axis=1, keepdims=True) + 1e-12)
    r = np.eye(xn.shape[1])
    for _ in range(iters):
        b = np.where(xn @ r >= 0, 1.0, -1.0)
        u, _, vt = np.linalg.svd(xn.T @ b)
        r = u @ vt
    return r


def packed_rows(model, tokens, config: OIQConfig) -> dict:
    """``{(layer, "k" | "v"): (rows, signs)}`` for ``tokens`` run through ``model``: the rows an
    OIQ cache of ``config`` would quantize, ``(H, n, d)`` float64 (B = 1, the sink tokens left
    out), its statistics estimated on these tokens as a prompt of them would be, and the
    side's rotation signs."""
    out = {}
    for r in capture_attention_inputs(model, tokens):
        if r["layer"] is None or r["cache_type"] != "KVCache":
            continue
        c = OIQKVCache(config, layer_idx=r["layer"])
        c.update_and_fetch(r["keys"], r["values"])
        for name, side, x in (("k", c.k, r["keys"]), ("v", c.v, r["values"])):
            x = x.astype(mx.float32)[:, :, config.sink_tokens:]
            if side.mean is not None:
                x = x - side.mean
            out[(r["layer"], name)] = (np.array(side.window_to_packed(x))[0].astype(np.float64), side.signs)
    return out


def quant_error(x: np.ndarray, bits: int, config: OIQConfig, side: str, block: int = 64) -> tuple[float, float]:
    """``config``'s quantizer (clip search; the scale alignment of ``side``, ``"k"`` or ``"v"``)
    at ``bits`` on rows ``x`` (n x d): ``||x - x_hat||^2``, and how much the error survives
    averaging over ``block`` consecutive rows, as attention's weighted sums average it:
    ``block**2`` x the squared error of the block means over the squared error of the rows (1
    when the rows' errors are independent, ``block`` when every row of a block errs alike)."""
    if side not in SIDES:
        raise ValueError(f"side must be one of {tuple(SIDES)}, got {side!r}")
    align = config.scale_alignment[0 if side == "k" else 1]
    codes, scales = quantize(mx.array(np.asarray(x, np.float32)), bits, config.group_size, clip=config.clip,
                             align=align)
    e = x - np.array(dequantize(codes, scales, bits=bits, group_size=config.group_size)).astype(np.float64)
    sq = float((e ** 2).sum())
    n = e.shape[0] // block * block
    means = e[:n].reshape(-1, block, e.shape[1]).mean(axis=1)
    return sq, float(block * block * (means ** 2).sum() / max((e[:n] ** 2).sum(), 1e-30))


def packed_errors(calib: dict, held: dict, config: OIQConfig, *, eval_from: int, online: int,
                  progress=None) -> dict:
    """Means over layers and KV heads of what :func:`quant_error` gives on the rows of ``held``
    (:func:`packed_rows`) from row ``eval_from`` on, per side (``"keys"``, ``"values"``) and
    rotation: ``"hadamard"`` (the base alone), ``"calibration text"`` (``R`` learned on the
    same layer and head of ``calib``), ``"own first rows"`` (learned on ``held``'s first
    ``online`` rows).  Returns ``{"errors": relative squared error, "block_errors": the
    error left by 64-row means, relative to independent errors}``, each ``{side: {rotation:
    value}}``."""
    errs: dict = {}
    blocks: dict = {}
    for (layer, side), (x, _) in sorted(held.items()):
        bits = config.k_bits if side == "k" else config.v_bits
        for h in range(x.shape[0]):
            test = x[h, eval_from:]
            den = float((test ** 2).sum())
            for name, r in (("hadamard", None), ("calibration text", procrustes(calib[(layer, side)][0][h])),
                            ("own first rows", procrustes(x[h, :online]))):
                sq, corr = quant_error(test if r is None else test @ r, bits, config, side)
                errs.setdefault(SIDES[side], {}).setdefault(name, []).append(sq / den)
                blocks.setdefault(SIDES[side], {}).setdefault(name, []).append(corr)
        if progress is not None:
            progress(f"layer {layer} {SIDES[side]}")

    def mean(d):
        return {side: {name: float(np.mean(v)) for name, v in by.items()} for side, by in d.items()}

    return {"errors": mean(errs), "block_errors": mean(blocks)}


def fold_value_rotations(model, rows: dict) -> int:
    """Fold ``Q = M R M^T`` per layer and KV head into the dense ``v_proj`` (weight and bias)
    and ``o_proj`` of ``model``, in place, ``R`` from :func:`procrustes` on the values of
    ``rows`` (:func:`packed_rows`) and ``M`` the cache's rotation of that layer's values.  The
    model's full-precision outputs stay the same (up to rounding); an OIQ cache then stores
    the values as ``(v Q)``'s packed domain, ``rotate(v - m) R``.  Returns the layers folded."""
    layers = model.layers if hasattr(model, "layers") else model.model.layers
    folded = 0
    for layer, block in enumerate(layers):
        if (layer, "v") not in rows:
            continue
        attn = block.self_attn
        for name in ("v_proj", "o_proj"):
            if not isinstance(getattr(attn, name), nn.Linear):  # nn.QuantizedLinear is not one
                raise ValueError(f"fold_value_rotations needs dense {name} weights (load with dequantize=True)")
        x, signs = rows[(layer, "v")]
        m = np.array(rotation_matrix(signs)).astype(np.float64)  # rotate(v) = v @ m
        wv = np.array(attn.v_proj.weight).astype(np.float64)  # (n_kv * d, hidden): v = x wv^T + b
        wo = np.array(attn.o_proj.weight).astype(np.float64)  # (hidden, n_q * d)
        bv = np.array(attn.v_proj.bias).astype(np.float64) if "bias" in attn.v_proj else None
        n_kv, d = x.shape[0], x.shape[2]
        rep = wo.shape[1] // d // n_kv
        for h in range(n_kv):
            q = m @ procrustes(x[h]) @ m.T
            rows_h = slice(h * d, (h + 1) * d)
            wv[rows_h] = q.T @ wv[rows_h]
            if bv is not None:
                bv[rows_h] = bv[rows_h] @ q
            for j in range(h * rep, (h + 1) * rep):
                wo[:, j * d:(j + 1) * d] = wo[:, j * d:(j + 1) * d] @ q
        dtype = attn.v_proj.weight.dtype
        attn.v_proj.weight = mx.array(wv.astype(np.float32)).astype(dtype)
        if bv is not None:
            attn.v_proj.bias = mx.array(bv.astype(np.float32)).astype(dtype)
        attn.o_proj.weight = mx.array(wo.astype(np.float32)).astype(attn.o_proj.weight.dtype)
        folded += 1
    mx.eval(model.parameters())
    return folded


def errors_table(result: dict) -> str:
    """Markdown table of a ``rotation_probe.py mse`` result."""
    lines = ["| side | measure | Hadamard base | + R from the calibration text | + R from its own first rows |",
             "|---|---|---:|---:|---:|"]
    for key, measure in (("errors", "squared error"), ("block_errors", "error of 64-row means")):
        for side, e in result[key].items():
            base = e["hadamard"]
            cells = [f"{base:.4f}"] + [f"{e[n]:.4f} ({100 * (e[n] / base - 1):+.1f}%)"
                                       for n in ("calibration text", "own first rows")]
            lines.append(f"| {side} | {measure} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def fold_table(result: dict) -> str:
    """Markdown table of a ``rotation_probe.py ppl`` result: each cache before and after."""
    lines = ["| cache | ppl vs fp | KL | top-1 | with the value rotation: ppl vs fp | KL | top-1 |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for b, r in zip(result["before"], result["after"]):
        lines.append(f"| {b['name']} | {100 * b['ppl_delta']:+.2f}% | {b['kl']:.4f} | {b['top1']:.3f} | "
                     f"{100 * r['ppl_delta']:+.2f}% | {r['kl']:.4f} | {r['top1']:.3f} |")
    return "\n".join(lines)
