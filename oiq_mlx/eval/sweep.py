"""Fidelity sweeps: OIQ presets and levers against the full-precision cache
and mlx-lm's quantized cache, at equal bytes per token.

The measurement itself is :func:`oiq_mlx.eval.perplexity.perplexity_eval` (prefill
a prompt through the cache, then score the continuation fed in chunks through
the same cache; perplexity, KL(fp || cache), top-1 agreement) and
:func:`oiq_mlx.eval.fidelity.attention_fidelity` (per-layer attention-output
cosine).  This module adds:

* caches by text through the shared registry (:func:`oiq_mlx.eval.specs.parse_spec`,
  re-exported here), including ``preset:NAME`` and mlx-lm affine caches at any
  bits (``mlx:BITS[:GROUP]``);
* :func:`sweep`: one row per cache with the bytes it spends per token and KV
  head (keys + values; asymptotic, and everything the cache allocates at the end
  of the evaluation, from ``nbytes`` with float16 keys and values) next to its
  perplexity change, KL and top-1;
* :func:`add_key_bias` (:func:`key_bias_stand_in`: the scripts' ``--key-bias``) and
  :func:`tiny_qwen2`: stand-ins for Qwen2-family keys
  (a ``k_proj`` bias that puts a few channels at ~25x the median key-channel
  norm), on a real llama-style model or a random-weight mlx-lm qwen2 model.

``scripts/fidelity_sweep.py`` is the command-line front end.
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models import qwen2

from ..mlx_lm.routing import install
from ..mlx_lm.caches import model_head_dim, oiq_layer_indices
from .perplexity import perplexity_eval
from .specs import parse_spec


def sweep(model, tokens, specs, *, prompt_len: int = 256, score_len: int = 768, chunk: int = 1,
          windows: int = 1, progress=None) -> list[dict]:
    """Perplexity/KL/top-1 of every cache in ``specs`` (``fp`` is added first when
    missing) on ``tokens``; one dict per cache, fp first: ``name``, ``kind``,
    ``description``, ``config`` (OIQConfig fields or None), ``bytes_per_token``
    (asymptotic, K+V per KV head, floats counted as fp16), ``bytes_allocated``
    (``nbytes`` of the cache after the evaluated ``prompt_len + score_len`` tokens,
    per token and KV head: everything it allocates, sinks, window, reserve, means
    and spare capacity, with the keys and values of a float16 model;
    :func:`oiq_mlx.eval.perplexity.allocated_bytes_per_token`), ``layer_bits`` (OIQ:
    the ``[layer, k_bits, v_bits]`` triples, one list per window, calibrated on
    each window's prompt for a ``layer_bits=auto`` spec; None otherwise), ``ppl``, ``ppl_delta``
    (relative to fp), ``ppl_delta_ci95`` (its 95% interval from the per-token differences,
    :func:`oiq_mlx.eval.stats.paired_change_ci`; None under 64 scored tokens), ``kl``, ``top1``,
    ``tokens_per_s``."""
    install()
    specs = list(specs)
    if not specs or specs[0].kind != "fp":
        specs = [parse_spec("fp")] + [s for s in specs if s.kind != "fp"]
    head_dim = model_head_dim(model)
    layers = oiq_layer_indices(model)
    res = perplexity_eval(model, tokens, specs, prompt_len=prompt_len, score_len=score_len,
                          chunk=chunk, windows=windows, progress=progress)
    fp_ppl = res[specs[0].name]["ppl"]
    rows = []
    for s in specs:
        r = res[s.name]
        if s.calibrate:  # the calibrated configs' bytes, mean over windows
            calibrated = [dataclasses.replace(s.oiq, layer_bits=lb) for lb in r["layer_bits"]]
            bpt = float(np.mean([c.bytes_per_token(head_dim, layers) for c in calibrated]))
        else:
            bpt = s.bytes_per_token(head_dim, layers=layers)
        rows.append({
            "name": s.name,
            "kind": s.kind,
            "description": s.description,
            "config": None if s.oiq is None else dataclasses.asdict(s.oiq),
            "layer_bits": r.get("layer_bits", [[list(x) for x in s.oiq.layer_bits]] * windows if s.oiq is not None else None),
            "bytes_per_token": bpt,
            "bytes_allocated": r["fp16_bytes_per_token_head"],
            "ppl": r["ppl"],
            "ppl_delta": r["ppl"] / fp_ppl - 1,
            "ppl_delta_ci95": r["ppl_delta_ci95"],
            "kl": r["kl"],
            "top1": r["top1"],
            "tokens_per_s": r["tokens_per_s"],
        })
    return rows


def frontier_table(rows: list[dict]) -> str:
    """Markdown table of :func:`sweep` rows; with a "95% interval" column when every row has
    ``ppl_delta_ci95`` (sweeps written before it was measured have none)."""
    ci = all(r.get("ppl_delta_ci95") is not None for r in rows)
    lines = [
        "| cache | bytes/token/KV head (K+V) | nbytes/token/KV head (fp16) | ppl | vs fp |"
        + (" 95% interval |" if ci else "") + " KL | top-1 |",
        "|---|---|---|---|---|" + ("---|" if ci else "") + "---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['name']} | {r['bytes_per_token']:g} | {_allocated(r['bytes_allocated'])} | {r['ppl']:.3f} "
            f"| {100 * r['ppl_delta']:+.2f}% |" + (f" {_interval_text(r['ppl_delta_ci95'])} |" if ci else "")
            + f" {r['kl']:.4f} | {100 * r['top1']:.1f}% |"
        )
    return "\n".join(lines)


def _interval_text(ci) -> str:
    lo, hi = ci
    return "-" if lo == hi == 0 else f"{100 * lo:+.2f}% to {100 * hi:+.2f}%"


def _allocated(b) -> str:
    # None: a row measured through a carrier (scripts/codebook_probe.py), whose allocation is not its own
    return "—" if b is None else f"{b:.1f}"


# -- Qwen-like keys ----------------------------------------------------------------


def low_frequency_channels(head_dim: int, n_pairs: int, traditional: bool = False) -> list[int]:
    """The key channels of the ``n_pairs`` slowest rotary pairs (a bias there
    stays nearly constant after RoPE, as Qwen2's large key biases do)."""
    half = head_dim // 2
    pairs = range(half - n_pairs, half)
    if traditional:
        return sorted(c for i in pairs for c in (2 * i, 2 * i + 1))
    return sorted(c for i in pairs for c in (i, i + half))


def add_key_bias(model, ratio: float = 25.0, n_pairs: int = 2, seed: int = 0) -> list[int]:
    """Add to every layer's ``self_attn.k_proj`` a bias of ``ratio`` x the median
    key-channel RMS on the channels of the ``n_pairs`` slowest rotary pairs of
    every KV head (random sign per channel), in place.  Returns those channels.

    The median channel RMS is measured per layer on a short random-token
    probe through the unmodified projection.  Qwen2.5-7B's reported key norms
    (~600 on a few channels vs a median ~22) are a ratio of about 27.
    """
    layers = model.layers if hasattr(model, "layers") else model.model.layers
    args = model.args
    head_dim = model_head_dim(model)
    n_kv = args.num_key_value_heads
    channels = low_frequency_channels(head_dim, n_pairs, bool(getattr(args, "rope_traditional", False)))
    key = mx.random.key(seed)
    probe = mx.random.normal((256, args.hidden_size), key=key)
    for layer in layers:
        attn = layer.self_attn
        old = attn.k_proj
        w = old.weight if not isinstance(old, nn.QuantizedLinear) else None
        if w is None:
            raise ValueError("add_key_bias needs dense k_proj weights (load with dequantize=True)")
        k = layer.input_layernorm(probe) @ w.T
        rms = mx.sqrt(mx.mean(mx.square(k.reshape(-1, n_kv, head_dim)), axis=0))  # (n_kv, d)
        median = mx.sort(rms, axis=-1)[:, head_dim // 2]
        key, sub = mx.random.split(key)
        signs = mx.where(mx.random.uniform(shape=(n_kv, len(channels)), key=sub) < 0.5, -1.0, 1.0)
        bias = mx.zeros((n_kv, head_dim))
        bias[:, mx.array(channels)] = signs * (ratio * median)[:, None]
        new = nn.Linear(w.shape[1], w.shape[0], bias=True)
        new.weight = w
        old_bias = old.bias if "bias" in old else mx.zeros((w.shape[0],), w.dtype)
        new.bias = (old_bias + bias.reshape(-1)).astype(w.dtype)
        attn.k_proj = new
    mx.eval(model.parameters())
    return channels


def key_bias_stand_in(model, ratio: float, progress=None) -> list[int]:
    """The scripts' ``--key-bias RATIO``: :func:`add_key_bias` at ``ratio`` when it is nonzero,
    told to ``progress``; returns the channels biased (none for 0)."""
    if not ratio:
        return []
    channels = add_key_bias(model, ratio=ratio)
    if progress is not None:
        progress(f"k_proj bias {ratio} x median channel RMS on channels {channels}")
    return channels


def tiny_qwen2(head_dim: int = 64, n_heads: int = 4, n_kv_heads: int = 2, layers: int = 2, vocab: int = 256,
               bias_ratio: float = 25.0, n_pairs: int = 2, sharpen: float = 2.0, seed: int = 0):
    """A random-weight mlx-lm qwen2 model whose ``k_proj`` biases put the
    channels of ``n_pairs`` slow rotary pairs at ``bias_ratio`` x the median
    key-channel RMS (the rest of its biases random and small, as trained).
    ``sharpen`` multiplies the q/k projections so that attention is peaked,
    not near-uniform as with a plain random init."""
    mx.random.seed(seed)
    args = qwen2.ModelArgs(
        model_type="qwen2",
        hidden_size=head_dim * n_heads,
        num_hidden_layers=layers,
        intermediate_size=2 * head_dim * n_heads,
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv_heads,
        rms_norm_eps=1e-6,
        vocab_size=vocab,
        rope_theta=1_000_000.0,
        tie_word_embeddings=True,
    )
    model = qwen2.Model(args)
    for layer in model.model.layers:
        layer.self_attn.q_proj.weight = layer.self_attn.q_proj.weight * sharpen
        layer.self_attn.k_proj.weight = layer.self_attn.k_proj.weight * sharpen
    mx.eval(model.parameters())
    add_key_bias(model, ratio=bias_ratio, n_pairs=n_pairs, seed=seed)
    return model
