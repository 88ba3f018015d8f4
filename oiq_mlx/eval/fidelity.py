"""Attention fidelity and key outliers.

* :func:`attention_fidelity`: the fp queries/keys/values of one prompt are captured per layer,
  written into each cache, and the cache's attention output (what the model would see) is
  compared with fp attention (cosine), together with the relative K/V reconstruction error.
* :func:`key_outlier_stats`: kurtosis, max/median channel magnitude and Gini of channel energies
  of the keys before and after the rotation.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx_lm.models.base import quantized_scaled_dot_product_attention
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from ..cache.attention import oiq_attention
from ..cache.common import layer_seed
from ..cache.sequence import OIQKVCache
from ..core.config import OIQConfig
from ..core.metrics import channel_stats, cosine_rows, relative_error
from ..core.rotation import random_signs, rotate
from ..mlx_lm.routing import capture_attention_inputs
from .progress import Progress
from .specs import CacheSpec, Float16KVCache


def _layer_attention(spec: CacheSpec, layer_cache, rec) -> tuple | None:
    """(output, k_hat, v_hat) of one layer's cache fed the fp K/V, or None
    when this spec keeps that layer in full precision anyway."""
    q, k, v, scale = rec["queries"], rec["keys"], rec["values"], rec["scale"]
    if isinstance(layer_cache, OIQKVCache):
        layer_cache.update_and_fetch(k, v)
        # score what is stored, as later queries see it: a prompt's own queries
        # would get its exact keys/values (OIQKVCache.attention_segments), and
        # exact_prefill packs the prompt only when generation starts
        layer_cache.release_fresh()
        layer_cache.end_prefill()
        out = oiq_attention(q, layer_cache, scale=scale, mask="causal", sinks=rec["sinks"])
        k_hat, v_hat = layer_cache.dequantized_kv()
        return out, k_hat, v_hat
    if isinstance(layer_cache, QuantizedKVCache):
        qk, qv = layer_cache.update_and_fetch(k, v)
        # a fresh array: mlx-lm scales its queries in place (``queries *= scale``)
        out = quantized_scaled_dot_product_attention(q * 1.0, qk, qv, scale=scale, mask="causal",
                                                     group_size=layer_cache.group_size, bits=layer_cache.bits)
        deq = lambda t: mx.dequantize(*t, group_size=layer_cache.group_size, bits=layer_cache.bits)
        return out, deq(qk), deq(qv)
    if isinstance(layer_cache, Float16KVCache):
        k, v = layer_cache.update_and_fetch(k, v)  # rounded to float16, as attention reads them
    elif not (type(layer_cache) is KVCache and spec.kind == "fp"):
        return None
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal", sinks=rec["sinks"]), k, v


def attention_fidelity(model, tokens, specs, *, records=None, progress=None) -> dict:
    """Per-layer attention-output cosine and relative K/V error of each cache.

    The fp queries/keys/values of ``tokens`` (one causal prefill) are
    captured per layer; each cache layer receives the fp keys/values in one
    chunk (as a prompt prefill would write them), and its attention over the
    same queries, reading the stored (quantized) keys/values as later queries
    would, is compared with ``mx.fast.scaled_dot_product_attention``
    on the fp keys/values.  Errors therefore do not compound across layers.

    Returns ``{name: {"cos_mean", "cos_min_layer", "k_rel_err", "v_rel_err",
    "per_layer": [{"layer", "cos", "cos_min", "k_rel_err", "v_rel_err"}]}}``.
    """
    progress = progress or Progress(enabled=False)
    records = records if records is not None else capture_attention_inputs(model, tokens)
    out = {}
    for s in specs:
        cache = s.make_cache(model)
        per_layer = []
        for rec in records:
            li = rec["layer"]
            if li is None:
                continue
            q, k, v = rec["queries"], rec["keys"], rec["values"]
            res = _layer_attention(s, cache[li], rec)
            if res is None:
                continue
            o, k_hat, v_hat = res
            ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=rec["scale"], mask="causal", sinks=rec["sinks"])
            cos = cosine_rows(o, ref)
            per_layer.append({
                "layer": li,
                "cos": float(cos.mean()),
                "cos_min": float(cos.min()),
                "k_rel_err": relative_error(k_hat, k),
                "v_rel_err": relative_error(v_hat, v),
            })
        if not per_layer:
            continue
        out[s.name] = {
            "cos_mean": float(np.mean([p["cos"] for p in per_layer])),
            "cos_min_layer": float(np.min([p["cos"] for p in per_layer])),
            "k_rel_err": float(np.mean([p["k_rel_err"] for p in per_layer])),
            "v_rel_err": float(np.mean([p["v_rel_err"] for p in per_layer])),
            "per_layer": per_layer,
        }
        progress(f"fidelity {s.name}: attention cos {out[s.name]['cos_mean']:.5f} "
                 f"K err {out[s.name]['k_rel_err']:.4f} V err {out[s.name]['v_rel_err']:.4f}")
    return out


def key_outlier_stats(records, seed: int = 0, group_size: int = 32) -> dict:
    """Outlier statistics of the fp keys of each full-attention layer before
    rotation, after the sign-randomized Hadamard rotation OIQ applies (the
    layer's own signs), and after the Hadamard transform without signs.

    Returns ``{"before"|"rotated"|"rotated_nosigns": {"kurtosis", "max_median",
    "gini"} averaged over layers, "per_layer": [...]}``."""
    cfg = OIQConfig(group_size=group_size, seed=seed)
    per_layer = []
    for rec in records:
        if rec["layer"] is None or rec["cache_type"] != "KVCache":
            continue
        k = rec["keys"].astype(mx.float32)
        dim = cfg.storage_dim(k.shape[-1])
        if dim != k.shape[-1]:
            k = mx.pad(k, [(0, 0)] * 3 + [(0, dim - k.shape[-1])])
        signs = random_signs(layer_seed(seed, rec["layer"], 0), dim)
        entry = {"layer": rec["layer"]}
        for label, x in (("before", k), ("rotated", rotate(k, signs)), ("rotated_nosigns", rotate(k, mx.ones_like(signs)))):
            entry[label] = channel_stats(np.array(x[0]))
        per_layer.append(entry)
    summary = {}
    for label in ("before", "rotated", "rotated_nosigns"):
        summary[label] = {m: float(np.mean([e[label][m] for e in per_layer])) for m in ("kurtosis", "max_median", "gini")}
    summary["per_layer"] = per_layer
    return summary
