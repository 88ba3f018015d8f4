"""Per-layer bits chosen from a calibration pass on the prompt itself.

:func:`calibrate_layer_bits` runs the model once over the prompt with a
full-precision cache (:func:`oiq_mlx.mlx_lm.routing.capture_attention_inputs`),
then, for every OIQ layer and every candidate ``(k_bits, v_bits)``, writes
that layer's fp keys/values into an :class:`OIQKVCache` at those bits and
compares its attention output over the same queries (reading the stored,
quantized keys/values, as later queries would) with exact fp attention.  The
error of a layer at a candidate is the mean over query rows (batch, heads,
positions) of ``1 - cosine`` between the two outputs
(:func:`layer_errors`).  Errors do not compound across layers: every layer
sees the fp inputs.

:func:`allocate` then starts every layer at the cheapest candidate and
repeatedly upgrades the layer whose upgrade removes the most error per extra
byte, as long as the mean bytes per token over the OIQ layers stays within
the budget (by default the uniform config's own ``bytes_per_token``).

Default candidates (:func:`default_choices`): the config's bits one step
down, unchanged and one step up, keys and values together, within 2..6 bits:
``2bit`` -> K2V2, K3V3; ``3bit`` -> K2V2, K3V3, K4V4; ``4bit`` (K5V3) ->
K4V2, K5V3, K6V4; ``1.5bit`` (K2V1) -> K2V1, K3V2.
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx

from ..cache.attention import oiq_attention
from ..cache.sequence import OIQKVCache
from ..core.config import OIQConfig
from ..core.metrics import cosine_rows
from .caches import model_head_dim, oiq_layer_indices
from .routing import capture_attention_inputs

LADDER = (2, 3, 4, 5, 6)  # bits the default candidates move within


def parse_auto(text) -> tuple[bool, float | None]:
    """``(True, budget)`` for ``"auto"`` (budget None) or ``"auto:BUDGET"``,
    ``(False, None)`` for anything else; ``ValueError`` for a bad budget."""
    if not isinstance(text, str) or not (text == "auto" or text.startswith("auto:")):
        return False, None
    if text == "auto":
        return True, None
    raw = text[len("auto:"):]
    try:
        budget = float(raw)
    except ValueError:
        raise ValueError(f"layer_bits {text!r}: the budget {raw!r} is not a number of bytes per token") from None
    if not budget > 0 or budget == float("inf"):
        raise ValueError(f"layer_bits {text!r}: the budget must be a positive number of bytes per token")
    return True, budget


def default_choices(config: OIQConfig) -> list[tuple[int, int]]:
    """``(k_bits + s, v_bits + s)`` for ``s`` in -1, 0, 1, both within 2..6 bits; a config with a
    1-bit side (``1.5bit``, K2V1) keeps its own bits and steps up (K2V1, K3V2)."""
    kb, vb = config.k_bits, config.v_bits
    if not (1 <= kb <= LADDER[-1] and 1 <= vb <= LADDER[-1]):
        raise ValueError(f"automatic layer_bits has default candidates for 1-6 bits only, the config has "
                         f"K{kb}V{vb}; pass choices=[(k_bits, v_bits), ...]")
    return [(kb + s, vb + s) for s in (-1, 0, 1) if s == 0 or (kb + s in LADDER and vb + s in LADDER)]


def min_tokens(config: OIQConfig) -> int:
    """The shortest prompt :func:`calibrate_layer_bits` accepts: twice what the
    sinks, the window and one packed block hold, so that most of it is packed."""
    return 2 * (config.sink_tokens + config.window + OIQKVCache.flush_block)


def candidate_bytes(config: OIQConfig, head_dim: int, bits: tuple[int, int]) -> float:
    """Bytes per token per KV head of one layer at ``bits`` (``OIQConfig.bytes_per_token``)."""
    return dataclasses.replace(config, k_bits=bits[0], v_bits=bits[1], layer_bits=()).bytes_per_token(head_dim)


def layer_errors(model, tokens, config: OIQConfig, choices, *, records=None) -> dict[int, dict[tuple, float]]:
    """``{layer: {(k_bits, v_bits): error}}`` for every OIQ layer of ``model``
    and every candidate: mean over query rows of ``1 - cosine`` between the
    layer's attention output through an OIQ cache at those bits and exact fp
    attention, on the prompt ``tokens`` (module docstring).  ``records``:
    :func:`oiq_mlx.mlx_lm.routing.capture_attention_inputs` of ``tokens``, if
    already taken."""
    layers = set(oiq_layer_indices(model))
    head_dim = model_head_dim(model)
    records = records if records is not None else capture_attention_inputs(model, tokens)
    out = {}
    for rec in records:
        li = rec["layer"]
        if li not in layers:
            continue
        q, k, v, scale, sinks = rec["queries"], rec["keys"], rec["values"], rec["scale"], rec["sinks"]
        ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal", sinks=sinks)
        errs = {}
        for bits in choices:
            cfg = dataclasses.replace(config, k_bits=bits[0], v_bits=bits[1], layer_bits=())
            cache = OIQKVCache(cfg, layer_idx=li, head_dim=head_dim)
            cache.update_and_fetch(k, v)
            # as oiq_mlx.eval.fidelity._layer_attention: score what is stored, as later queries see it
            cache.release_fresh()
            cache.end_prefill()
            o = oiq_attention(q, cache, scale=scale, mask="causal", sinks=sinks)
            errs[tuple(bits)] = float(mx.mean(1.0 - cosine_rows(o, ref)))
        out[li] = errs
    return out


def allocate(errors: dict, costs: dict, budget: float) -> dict[int, tuple[int, int]]:
    """``{layer: (k_bits, v_bits)}`` with mean cost over the layers <= ``budget``.

    ``errors``: ``{layer: {bits: error}}``; ``costs``: ``{bits: bytes per token}``.
    Every layer starts at its cheapest candidate (the lowest error among equally
    cheap ones); then, while an upgrade fits, the one with the largest error
    reduction per extra byte is taken (an upgrade moves a layer to any costlier
    candidate with a lower error).  Ties go to the lower layer index, then the
    cheaper candidate.  ``ValueError`` when even the cheapest allocation is over
    the budget.
    """
    layers = sorted(errors)
    if not layers:
        raise ValueError("no layers to allocate bits to")
    order = lambda layer: sorted(errors[layer], key=lambda b: (costs[b], errors[layer][b], b))  # noqa: E731
    current = {layer: order(layer)[0] for layer in layers}
    n = len(layers)
    total = sum(costs[b] for b in current.values())
    cheapest = total / n
    eps = 1e-9 * max(1.0, abs(budget))
    if cheapest > budget + eps:
        raise ValueError(f"budget {budget:g} bytes per token is below the cheapest allocation "
                         f"({cheapest:g} bytes per token: every layer at "
                         f"{', '.join(sorted({f'K{b[0]}V{b[1]}' for b in current.values()}))})")
    while True:
        best = None  # (-ratio, layer, cost, bits)
        for layer in layers:
            cur = current[layer]
            for bits in errors[layer]:
                extra = costs[bits] - costs[cur]
                gain = errors[layer][cur] - errors[layer][bits]
                if extra <= 0 or gain <= 0 or (total + extra) / n > budget + eps:
                    continue
                key = (-gain / extra, layer, costs[bits], bits)
                if best is None or key < best:
                    best = key
        if best is None:
            return current
        _, layer, _, bits = best
        total += costs[bits] - costs[current[layer]]
        current[layer] = bits


def calibrate_layer_bits(model, tokens, config: OIQConfig, *, budget: float | None = None, choices=None,
                         records=None) -> OIQConfig:
    """``config`` with ``layer_bits`` chosen on the prompt ``tokens`` (module
    docstring): the per-layer bits that minimize the summed attention error of
    the OIQ layers, greedily, within ``budget`` bytes per token per KV head
    (mean over the OIQ layers; default: ``config.bytes_per_token(head_dim)``,
    the uniform config's own).  ``choices``: candidate ``(k_bits, v_bits)``
    pairs (default :func:`default_choices`).  Only layers whose bits differ
    from ``config.k_bits``/``v_bits`` are listed.  Deterministic for given
    inputs.

    ``ValueError`` for a config that already has ``layer_bits``, a model with
    no OIQ layers, a prompt shorter than :func:`min_tokens` and a budget below
    the cheapest allocation.
    """
    if config.layer_bits:
        raise ValueError(f"the config already has layer_bits {config.layer_bits}; calibration chooses them")
    layers = oiq_layer_indices(model)
    if not layers:
        raise ValueError("this model has no full-attention KVCache layers for OIQ, nothing to calibrate")
    tokens = list(tokens)
    need = min_tokens(config)
    if len(tokens) < need:
        raise ValueError(f"calibrating layer_bits needs a prompt of at least {need} tokens "
                         f"(2 x (sink_tokens {config.sink_tokens} + window {config.window} + {OIQKVCache.flush_block})), "
                         f"got {len(tokens)}")
    head_dim = model_head_dim(model)
    choices = [tuple(int(x) for x in b) for b in (choices if choices is not None else default_choices(config))]
    if not choices:
        raise ValueError("choices is empty")
    for b in choices:
        OIQConfig(k_bits=b[0], v_bits=b[1], group_size=config.group_size)  # checks the bits
    costs = {b: candidate_bytes(config, head_dim, b) for b in choices}
    if budget is None:
        budget = config.bytes_per_token(head_dim)
    errors = layer_errors(model, tokens, config, choices, records=records)
    missing = sorted(set(layers) - set(errors))
    if missing:
        raise ValueError(f"the calibration pass saw no attention call for OIQ layers {missing}")
    chosen = allocate(errors, costs, budget)
    base = (config.k_bits, config.v_bits)
    layer_bits = tuple((layer, *bits) for layer, bits in sorted(chosen.items()) if bits != base)
    return dataclasses.replace(config, layer_bits=layer_bits)
