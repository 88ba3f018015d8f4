"""Quality evaluation of KV caches on a real model.

Four measurements, each against mlx-lm's plain ``KVCache`` at the model's dtype
(the "fp" reference; on the CPU backend the GGUF loader gives fp32, DESIGN.md section 7):

* :func:`perplexity_eval`: a prompt of ``prompt_len`` tokens is prefilled
  through the cache under test, then continuation chunks are scored through
  the same cache, so every scored token attends to keys/values that went
  through it.  Per cache: perplexity, KL(fp || cache) of next-token
  distributions at the same positions, top-1 agreement.
* :func:`needle_eval`: a passkey sentence hidden at a depth of an Austen
  filler of a given token length; greedy decoding with ``generate_step``
  through the cache must reproduce the passkey exactly.
  :func:`needle_stats` repeats it over many trials per (length, depth) cell
  (passkeys, haystack texts and offsets drawn per trial) and compares every
  cache with fp on the same trials: rates with Wilson intervals, paired
  counts, McNemar's test (``scripts/needle_stats.py``).
* :func:`attention_fidelity`: the fp queries/keys/values of one prompt are
  captured per layer, written into each cache, and the cache's attention
  output (what the model would see) is compared with fp attention (cosine),
  together with the relative K/V reconstruction error.
* :func:`key_outlier_stats`: kurtosis, max/median channel magnitude and Gini
  of channel energies of the keys before and after the rotation.

:func:`run_evaluation` runs them all for a list of :class:`CacheSpec` and
returns one JSON-serialisable dict; :func:`markdown_table` and
:func:`save_plots` render it.  ``scripts/eval_quality.py`` is the front end.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import platform
import random
import re
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
from mlx_lm.generate import generate_step
from mlx_lm.models.base import quantized_scaled_dot_product_attention
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

from ..cache.attention import oiq_attention
from ..cache.sequence import OIQKVCache
from ..cache.common import layer_seed
from ..core.config import OIQConfig, layer_bits_text
from ..core.version import __version__
from ..core.platform import openblas_path
from ..mlx_lm import models
from ..mlx_lm.caches import end_prefill, model_head_dim, oiq_layer_indices
from ..core.metrics import channel_stats, cosine_rows, kl_divergence, log_softmax, relative_error
from ..mlx_lm.routing import capture_attention_inputs, install
from ..core.rotation import random_signs, rotate
from .specs import CacheSpec, Float16KVCache, cache_registry, parse_spec  # noqa: F401 (cache_registry: for the scripts)

DEFAULT_CACHES = (
    "fp", "mlx-q8-g64", "mlx-q4-g64", "mlx-q8-g32", "mlx-q4-g32", "absmax-4", "oiq-nosigns-4",
    "oiq-plain-4", "oiq-plain-3", "oiq-plain-2", "oiq-4", "oiq-3", "oiq-2",
)
FULL_NEEDLE_CACHES = ("fp", "mlx-q8-g64", "mlx-q4-g64", "absmax-4", "oiq-4", "oiq-3", "oiq-2")
QUICK_NEEDLE_CACHES = ("fp", "mlx-q4-g64", "oiq-4")


def select_caches(names) -> list[CacheSpec]:
    """Specs for ``names`` (anything :func:`oiq_mlx.eval.specs.parse_spec` reads), ``fp`` always first."""
    names = ["fp"] + [n for n in dict.fromkeys(names) if n != "fp"]
    return [parse_spec(n) for n in names]


# ---------------------------------------------------------------- progress


class Progress:
    """Lines on stderr with elapsed time, throughput and ETA."""

    def __init__(self, stream=sys.stderr, enabled: bool = True):
        self.stream, self.enabled = stream, enabled
        self.start = time.perf_counter()

    def __call__(self, msg: str):
        if self.enabled:
            print(f"[{_fmt_s(time.perf_counter() - self.start)}] {msg}", file=self.stream, flush=True)


def _fmt_s(s: float) -> str:
    s = max(0, round(s))
    return f"{s // 60}m{s % 60:02d}s"


def _eta(done: float, total: float, elapsed: float) -> str:
    if done <= 0:
        return "?"
    return _fmt_s(elapsed * (total - done) / done)


# ---------------------------------------------------------------- perplexity / KL


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
    "ppl_per_window", "measured_bytes_per_token_head", "fp16_bytes_per_token_head"}}``:
    the last two are ``nbytes`` per token per KV head at the end of a window, as the
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
                    "fp16_bytes": [], "layer_bits": [], "calibration_s": 0.0} for s in specs}
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
                     f"ETA {_eta(done_units, total_units, time.perf_counter() - t0)}")
        win_nll = {s.name: 0.0 for s in specs}
        for i in range(n_chunks):
            a = prompt_len + i * chunk
            b = min(a + chunk, prompt_len + score_len)
            x = mx.array(seq[a:b])[None]
            targets = mx.array(seq[a + 1 : b + 1])
            logp_ref = None
            rates = []
            for s, c in zip(specs, caches):
                t = time.perf_counter()
                logp = log_softmax(model(x, cache=c)[0])
                nll = -mx.take_along_axis(logp, targets[:, None], axis=-1).sum()
                if logp_ref is None:
                    logp_ref = logp
                    kl, top1 = mx.array(0.0), mx.array(b - a)
                else:
                    kl = kl_divergence(logp_ref, logp).sum()
                    top1 = (mx.argmax(logp, -1) == mx.argmax(logp_ref, -1)).sum()
                mx.eval(nll, kl, top1, logp_ref, _cache_arrays(c))
                dt = time.perf_counter() - t
                r = acc[s.name]
                r["seconds"] += dt
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
                         f"ETA {_eta(done_units, total_units, now - t0)}")
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
            "measured_bytes_per_token_head": float(np.mean(r["bytes"])),
            "fp16_bytes_per_token_head": float(np.mean(r["fp16_bytes"])),
        }
        if s.calibrate:
            out[s.name]["layer_bits"] = r["layer_bits"]
            out[s.name]["calibration_s"] = r["calibration_s"]
        progress(f"ppl {s.name}: ppl {out[s.name]['ppl']:.3f} KL {out[s.name]['kl']:.4f} "
                 f"top1 {out[s.name]['top1']:.3f} ({out[s.name]['tokens_per_s']:.0f} tok/s)")
    return out


# ---------------------------------------------------------------- needle in a haystack


@dataclasses.dataclass
class NeedlePrompt:
    ids: list
    passkey: str
    length: int
    depth: float
    needle_start: int  # index in ``ids`` of the first needle token
    hay_start: int  # index of the first filler token
    hay_len: int  # filler + needle tokens


NEEDLE_TEMPLATE = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "\n\nWhat is the pass key? Answer with the number only."
ANSWER_PREFIX = "The pass key is"


def _sentence_ends(tokenizer, ids) -> list[int]:
    """Indices ``i`` such that a sentence ends just before ``ids[i]``."""
    ends = [0]
    for i, t in enumerate(ids):
        if tokenizer.decode([t]).rstrip().endswith((".", "!", "?", '."', ".\u201d")):
            ends.append(i + 1)
    return ends


def _encode(tokenizer, text: str) -> list:
    return list(tokenizer.encode(text, add_special_tokens=False))


def needle_frame(tokenizer, chat: bool) -> tuple[list, list]:
    """Token ids before the haystack and after it (question + answer prefix)."""
    question, answer = _encode(tokenizer, QUESTION), _encode(tokenizer, ANSWER_PREFIX)
    if chat and getattr(tokenizer, "chat_template", None):
        marker = "\u2063HAYSTACK\u2063"
        text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False, add_generation_prompt=True)
        before, after = text.split(marker)
        return _encode(tokenizer, before), question + _encode(tokenizer, after) + answer
    bos = [tokenizer.bos_token_id] if getattr(tokenizer, "bos_token_id", None) is not None else []
    return bos, question + _encode(tokenizer, "\n") + answer


def build_needle_prompt(tokenizer, filler_ids, length: int, depth: float, passkey: str, *, chat: bool = True,
                        sentence_ends=None) -> NeedlePrompt:
    """A prompt of exactly ``length`` tokens: template, Austen filler with the
    passkey sentence inserted at a sentence boundary nearest ``depth`` (0 =
    start, 1 = end of the filler), question, answer prefix."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    head, tail = needle_frame(tokenizer, chat)
    needle = _encode(tokenizer, NEEDLE_TEMPLATE.format(key=passkey))
    n_hay = length - len(head) - len(tail) - len(needle)
    if n_hay < 1:
        raise ValueError(f"length {length} is too short for the needle frame ({length - n_hay} tokens)")
    filler = list(filler_ids)
    while len(filler) < n_hay:
        filler = filler + list(filler_ids)
    filler = filler[:n_hay]
    ends = sentence_ends if sentence_ends is not None else _sentence_ends(tokenizer, filler)
    ends = [e for e in ends if e <= n_hay]
    cut = min(ends, key=lambda e: abs(e - depth * n_hay))
    ids = head + filler[:cut] + needle + filler[cut:] + tail
    return NeedlePrompt(ids, passkey, len(ids), cut / n_hay, len(head) + cut, len(head), n_hay + len(needle))


def retrieved_passkey(text: str) -> str | None:
    """The first run of digits in the model's answer."""
    m = re.search(r"\d+", text)
    return m.group(0) if m else None


def greedy_answer(model, tokenizer, ids, cache, max_tokens: int = 8) -> str:
    out = []
    eos = set(getattr(tokenizer, "eos_token_ids", None) or [])
    for tok, _ in generate_step(mx.array(ids), model, prompt_cache=cache, max_tokens=max_tokens):
        t = int(tok)
        if t in eos:
            break
        out.append(t)
    return tokenizer.decode(out)


def needle_eval(model, tokenizer, specs, *, filler_text: str, lengths, depths, chat: bool = True, seed: int = 0,
                max_tokens: int = 8, progress=None) -> dict:
    """Exact passkey retrieval on a ``lengths x depths`` grid for each cache.

    Returns ``{"grid": {name: [[0/1 per depth] per length]}, "answers": ...,
    "score": {name: fraction}, "lengths", "depths", "chat"}``."""
    progress = progress or Progress(enabled=False)
    rng = random.Random(seed)
    filler = _encode(tokenizer, filler_text)
    need = max(lengths)
    while len(filler) < need:
        filler = filler + filler
    filler = filler[: need + 1]
    ends = _sentence_ends(tokenizer, filler)
    prompts = {}
    for L in lengths:
        for d in depths:
            prompts[(L, d)] = build_needle_prompt(
                tokenizer, filler, L, d, str(rng.randint(10000, 99999)), chat=chat, sentence_ends=ends
            )
    grid, answers, seconds = {}, {}, {}
    total = len(specs) * sum(lengths) * len(depths)
    done, t0 = 0, time.perf_counter()
    for s in specs:
        grid[s.name], answers[s.name] = [], []
        t_spec = time.perf_counter()
        for L in lengths:
            row, arow = [], []
            for d in depths:
                p = prompts[(L, d)]
                text = greedy_answer(model, tokenizer, p.ids, s.make_cache(model), max_tokens)
                ok = retrieved_passkey(text) == p.passkey
                row.append(int(ok))
                arow.append(text)
                done += L
                progress(f"needle {s.name} len {L} depth {d:.2f}: {'OK ' if ok else 'MISS'} {text.strip()[:30]!r} "
                         f"(key {p.passkey}); ETA {_eta(done, total, time.perf_counter() - t0)}")
            grid[s.name].append(row)
            answers[s.name].append(arow)
        seconds[s.name] = time.perf_counter() - t_spec
    return {
        "lengths": list(lengths),
        "depths": list(depths),
        "chat": chat,
        "format": {"needle": NEEDLE_TEMPLATE, "question": QUESTION, "answer_prefix": ANSWER_PREFIX},
        "passkeys": [[prompts[(L, d)].passkey for d in depths] for L in lengths],
        "actual_depths": [[prompts[(L, d)].depth for d in depths] for L in lengths],
        "grid": grid,
        "answers": answers,
        "score": {n: float(np.mean(g)) for n, g in grid.items()},
        "seconds": seconds,
    }


# ---------------------------------------------------------------- needle statistics


@dataclasses.dataclass
class Haystack:
    """One haystack text, tokenized once: ``ends`` are the indices where a
    sentence starts (offsets and needle cuts are taken there)."""

    name: str
    ids: list
    ends: list

    def filler(self, offset: int, n: int) -> tuple[list, list]:
        """``n`` tokens from ``offset`` (wrapping to the start of the text when it
        runs out) and the sentence starts inside them, relative to ``offset``."""
        ids, ends, base = [], [], 0
        start = offset
        while len(ids) < n:
            chunk = self.ids[start : start + n - len(ids)]
            ends += [base + e - start for e in self.ends if start <= e <= start + len(chunk)]
            ids += chunk
            base, start = len(ids), 0
        return ids, sorted(set(ends))


def prepare_haystack(tokenizer, name: str, text: str) -> Haystack:
    ids = _encode(tokenizer, text)
    if len(ids) < 2:
        raise ValueError(f"haystack text {name!r} has {len(ids)} tokens; it needs at least 2")
    return Haystack(name, ids, _sentence_ends(tokenizer, ids))


@dataclasses.dataclass
class NeedleTrial:
    """One haystack prompt, run through every cache."""

    index: int
    text: str  # haystack name
    offset: int  # first haystack token taken from the text
    length: int
    depth: float  # requested
    passkey: str
    prompt: NeedlePrompt


def plan_needle_trials(tokenizer, haystacks, lengths, depths, trials: int, *, seed: int = 0,
                       chat: bool = True) -> list[NeedleTrial]:
    """``trials`` prompts per (length, depth) cell, each with its own passkey,
    haystack text (round robin over ``haystacks``, shifted per cell so every
    text meets every depth) and random sentence-aligned offset into the text.

    Ordered round by round (trial k of every cell, then trial k + 1), so that a
    run stopped early has the same number of trials in each cell."""
    if trials < 1:
        raise ValueError(f"trials per cell must be >= 1, got {trials}")
    if not haystacks:
        raise ValueError("no haystack texts")
    for d in depths:
        if not 0.0 <= d <= 1.0:
            raise ValueError(f"depth must be in [0, 1], got {d}")
    head, tail = needle_frame(tokenizer, chat)
    rng = random.Random(seed)
    cells = [(L, d) for L in lengths for d in depths]
    out, keys = [], set()
    for k in range(trials):
        for c, (L, d) in enumerate(cells):
            hay = haystacks[(k + c) % len(haystacks)]
            key = str(rng.randint(10000, 99999))
            while key in keys:
                key = str(rng.randint(10000, 99999))
            keys.add(key)
            n_hay = L - len(head) - len(tail) - len(_encode(tokenizer, NEEDLE_TEMPLATE.format(key=key)))
            starts = [e for e in hay.ends if e + n_hay <= len(hay.ids)] or [0]
            offset = rng.choice(starts)
            filler, ends = hay.filler(offset, max(n_hay, 1))
            prompt = build_needle_prompt(tokenizer, filler, L, d, key, chat=chat, sentence_ends=ends)
            out.append(NeedleTrial(len(out), hay.name, offset, L, d, key, prompt))
    return out


def _greedy_trace(tokenizer, steps) -> dict:
    """Greedy tokens from a ``generate_step`` iterator, stopped once a run of
    digits has ended, with the log-probability margin between the chosen token
    and the runner-up at each step (how close a miss was)."""
    out, margins, first = [], [], None
    eos = set(getattr(tokenizer, "eos_token_ids", None) or [])
    for tok, logprobs in steps:
        t = int(tok)
        first = t if first is None else first
        top2 = mx.topk(logprobs.reshape(-1), 2)
        margins.append(float(top2.max() - top2.min()))
        if t in eos:
            break
        out.append(t)
        if re.search(r"\d+\D", tokenizer.decode(out)):
            break
    return {"answer": tokenizer.decode(out), "margins": margins, "first_token": first}


def answer_trace(model, tokenizer, ids, cache, *, max_tokens: int = 8, prefill_step_size: int = 2048) -> dict:
    """Greedy answer through ``generate_step`` (mlx-lm's prefill: all prompt
    tokens but the last in chunks of ``prefill_step_size``, the last one as a
    one-token step); see :func:`_greedy_trace`."""
    return _greedy_trace(tokenizer, generate_step(mx.array(ids), model, prompt_cache=cache, max_tokens=max_tokens,
                                                  prefill_step_size=prefill_step_size))


# cache kinds whose first prefill chunk attends to exactly the keys and values
# it writes (fp, and OIQ: DESIGN), so that chunk's per-layer writes are the same
# for every such cache and can be computed once per prompt
EXACT_FIRST_CHUNK_KINDS = ("fp", "oiq")


def exact_first_chunk(spec) -> bool:
    """True when ``spec``'s cache attends its first prefill chunk exactly: such a kind, and
    for OIQ not ``positional`` (whose chunk queries read the packed copies of the rows that
    left the window, so its later layers get other keys and values than fp's)."""
    return spec.kind in EXACT_FIRST_CHUNK_KINDS and not (spec.kind == "oiq" and spec.oiq.positional)


class _CallLog:
    """Records every ``update_and_fetch(keys, values)`` a prompt cache's layers get, in
    order, as long as it is active (the methods are restored on exit)."""

    def __init__(self, cache):
        self.cache, self.calls = cache, [[] for _ in cache]

    def __enter__(self):
        for i, c in enumerate(self.cache):
            def record(keys, values, _i=i, _orig=c.update_and_fetch):
                self.calls[_i].append((keys, values))
                return _orig(keys, values)

            c.update_and_fetch = record
        return self

    def __exit__(self, *exc):
        for c in self.cache:
            vars(c).pop("update_and_fetch", None)

    def prompt_calls(self, n: int) -> list:
        """Per layer, the logged calls that wrote the first ``n`` rows (a prompt's prefill)."""
        out = []
        for calls in self.calls:
            kept, rows = [], 0
            for k, v in calls:
                if rows >= n:
                    break
                kept.append((k, v))
                rows += k.shape[2]
            if rows != n:
                raise ValueError(f"the logged calls of a layer wrote {rows} rows where the prefill wrote {n}")
            out.append(kept)
        return out


def record_first_chunk(model, ids, n: int) -> tuple[list, list]:
    """Prefill ``ids[:n]`` into a fresh fp prompt cache, as ``generate_step``'s
    first chunk, recording each layer's ``update_and_fetch(keys, values)``
    arguments.  Returns the cache and the per-layer records."""
    cache = make_prompt_cache(model)
    with _CallLog(cache) as calls:
        model(mx.array(ids[:n])[None], cache=cache)
        mx.eval([c.state for c in cache] + [x for layer in calls.calls for kv in layer for x in kv])
    twice = [i for i, layer in enumerate(calls.calls) if len(layer) > 1]
    if twice:
        raise ValueError(f"cache layer {twice[0]} was written twice in one forward pass (a model that shares "
                         "caches between layers); run with share_prefill=False (--no-share-prefill)")
    if any(not layer for layer in calls.calls):
        raise ValueError("the model left some cache layers unwritten in its forward pass; run with "
                         "share_prefill=False (--no-share-prefill)")
    return cache, [layer[0] for layer in calls.calls]


def _write_calls(cache, calls) -> list:
    """Write recorded ``update_and_fetch`` calls (per layer, a list of ``(keys, values)``)
    into ``cache`` call by call, as the model wrote them, and evaluate it as
    ``generate_step`` does."""
    for c, layer_calls in zip(cache, calls):
        for k, v in layer_calls:
            c.update_and_fetch(k, v)
            if isinstance(c, OIQKVCache):
                c.release_fresh()
    mx.eval([c.state for c in cache])
    return cache


def replay_first_chunk(cache, log) -> list:
    """Write the recorded first chunk into ``cache`` (what the model would write
    into a cache that attends its first chunk exactly) and evaluate it as ``generate_step`` does."""
    return _write_calls(cache, [[kv] for kv in log])


def _answer_from(model, tokenizer, ids, cache, calls, *, max_tokens: int) -> dict:
    """Write the logged prefill ``calls`` into ``cache`` (:func:`_write_calls`), then
    answer from the last prompt token as ``generate_step`` does."""
    _write_calls(cache, calls)
    return _greedy_trace(tokenizer, generate_step(mx.array(ids[-1:]), model, prompt_cache=cache,
                                                  max_tokens=max_tokens))


def trial_answers(model, tokenizer, ids, specs, *, max_tokens: int = 8, prefill_step_size: int = 2048,
                  share_prefill: bool = True, attribute: bool = False) -> dict:
    """Each cache's :func:`answer_trace` on one prompt.  With ``share_prefill``
    the first prefill chunk (``min(prefill_step_size, len(ids) - 1)`` tokens) is
    run once in fp and replayed into every cache that attends it exactly
    (:func:`exact_prefill`); the rest of the prompt goes through
    ``generate_step`` with the same chunk boundaries, so each answer is the one
    ``generate_step`` gives on the whole prompt (up to float rounding).

    ``attribute`` (needs an fp spec first): each OIQ cache's trace also gets an
    ``attribution`` with two hybrid answers that split what it changes.  ``read``: the
    keys and values fp's prefill wrote, written into a fresh cache of this spec in the
    same calls, answered through it (what reading the packed cache costs alone);
    ``prefill``: the keys and values this cache's prefill wrote (computed by layers that
    read earlier chunks packed), written into a fresh fp cache and answered exactly
    (what the chunked prefill leaves in them alone)."""
    if attribute and (not specs or specs[0].kind != "fp"):
        raise ValueError("attribute needs the fp cache as the first spec")
    out = {}
    n = len(ids) - 1
    n1 = min(prefill_step_size, n)
    shared = [s for s in specs if exact_first_chunk(s)] if share_prefill and n1 > 0 else []
    log = fp_cache = fp_calls = None
    t0 = time.perf_counter()
    if shared:
        fp_cache, log = record_first_chunk(model, ids, n1)
    t_shared = time.perf_counter() - t0
    for s in specs:
        t_run = time.perf_counter()
        logged = attribute and s.kind in ("fp", "oiq")
        recorded = s in shared and s.kind == "fp" and fp_cache is not None  # the first chunk is in it already
        cache = fp_cache if recorded else s.make_cache(model)
        if s.kind == "fp":
            fp_cache = None
        calls = _CallLog(cache)
        with calls if logged else contextlib.nullcontext():
            if s not in shared:
                tr = answer_trace(model, tokenizer, ids, cache, max_tokens=max_tokens,
                                  prefill_step_size=prefill_step_size)
            else:
                if not recorded:
                    replay_first_chunk(cache, log)
                tr = _greedy_trace(tokenizer, generate_step(mx.array(ids[n1:]), model, prompt_cache=cache,
                                                            max_tokens=max_tokens, prefill_step_size=prefill_step_size))
        if logged and recorded:
            calls.calls = [[kv, *c] for kv, c in zip(log, calls.calls)]
        tr["seconds"] = time.perf_counter() - t_run + (t_shared / len(shared) if s in shared else 0.0)
        if logged and s.kind == "fp":
            fp_calls = calls.prompt_calls(n)
        elif logged:
            tr["attribution"] = {
                "read": _answer_from(model, tokenizer, ids, s.make_cache(model), fp_calls, max_tokens=max_tokens),
                "prefill": _answer_from(model, tokenizer, ids, make_prompt_cache(model), calls.prompt_calls(n),
                                        max_tokens=max_tokens),
            }
        out[s.name] = tr
    return out


def wilson_interval(hits: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of a binomial rate (95% for z = 1.96); (0, 1) for n = 0."""
    if n == 0:
        return 0.0, 1.0
    if not 0 <= hits <= n:
        raise ValueError(f"hits must be in [0, {n}], got {hits}")
    p = hits / n
    den = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return max(0.0, mid - half), min(1.0, mid + half)


def mcnemar_p(b: int, c: int) -> float:
    """Exact two-sided McNemar p-value for ``b`` and ``c`` discordant pairs."""
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(b, c) + 1)) / 2**n
    return min(1.0, 2 * tail)


def paired_counts(ref, other) -> dict:
    """Paired outcome counts of two caches on the same trials (sequences of bools):
    ``both``, ``ref_only`` (fp-hits the cache misses), ``other_only`` (hits fp
    misses), ``neither``; ``missed_of_ref`` with its Wilson interval; McNemar p."""
    if len(ref) != len(other):
        raise ValueError(f"paired outcomes need equal lengths, got {len(ref)} and {len(other)}")
    both = sum(1 for a, b in zip(ref, other) if a and b)
    ref_only = sum(1 for a, b in zip(ref, other) if a and not b)
    other_only = sum(1 for a, b in zip(ref, other) if b and not a)
    ref_hits = both + ref_only
    return {
        "n": len(ref), "both": both, "ref_only": ref_only, "other_only": other_only,
        "neither": len(ref) - both - ref_only - other_only,
        "missed_of_ref": ref_only / ref_hits if ref_hits else None,
        "missed_of_ref_ci": list(wilson_interval(ref_only, ref_hits)),
        "mcnemar_p": mcnemar_p(ref_only, other_only),
    }


def _paired_differences(ref: list, other: list):
    """``ref - other`` as float64 over paired trials, None when there are none."""
    if len(ref) != len(other):
        raise ValueError(f"paired margins need equal lengths, got {len(ref)} and {len(other)}")
    if not ref:
        return None
    return np.asarray(ref, dtype=np.float64) - np.asarray(other, dtype=np.float64)


def margin_drop(ref: list, other: list) -> dict | None:
    """Mean and standard error of ``ref - other`` over paired trials: how much
    closer to a miss a cache's answers came than fp's (each value the smallest
    top-1 vs runner-up log-probability margin over a trial's answer tokens)."""
    diff = _paired_differences(ref, other)
    if diff is None:
        return None
    se = float(diff.std(ddof=1) / math.sqrt(diff.size)) if diff.size > 1 else None
    return {"n": int(diff.size), "mean": float(diff.mean()), "se": se}


def first_margin_change(ref: list, other: list) -> dict | None:
    """Mean and standard deviation of ``other - ref`` over paired trials, each value
    the margin of the first answer token (top-1 vs runner-up log-probability): how
    far a cache moves the decision a retrieval turns on.  A miss on a trial whose
    reference margin is well inside that spread is a coin flip of the cache's noise,
    not a sign that the cache lost the needle."""
    diff = _paired_differences(ref, other)
    if diff is None:
        return None
    diff = -diff
    sd = float(diff.std(ddof=1)) if diff.size > 1 else None
    return {"n": int(diff.size), "mean": float(diff.mean()), "sd": sd}


def _normal_cdf(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


def margin_noise(records: list, ref: str, name: str, p_target: float = 0.9) -> dict | None:
    """How many of ``ref``'s hits cache ``name``'s noise is expected to lose, from the
    margins alone.

    The noise: ``name``'s margin minus ``ref``'s, token by token, over the trials where
    both give the same answer (the same tokens, so the margins pair up): ``rms`` its root
    mean square over ``tokens`` tokens (its mean, ``mean``, reported and included).  A
    trial ``ref`` retrieves is lost when any answer token's margin ``m`` falls below zero;
    taking each token's change as an independent zero-mean normal of deviation ``rms``,
    it is lost with probability ``1 - prod(1 - Phi(-m / rms))``.  ``expected_misses``
    sums that over ``ref``'s hits, ``p_no_miss`` is the chance that none is lost, and
    ``rms_for_target`` the largest deviation at which that chance still reaches ``p_target``
    (above the measured one when it already does); ``narrowest_ref_hits``: ``[index, smallest
    margin]`` of ``ref``'s three closest hits, which decide that deviation.  A
    statistical lens, not a count: near-ties in ``ref``'s own answers (margins of a few
    hundredths) are lost by almost any noise.  None without two paired tokens or
    without ``ref`` hits."""
    diffs, hit_margins, narrow = [], [], []
    for r in records:
        res = r["results"]
        if ref not in res or name not in res:
            continue
        a, b = res[ref], res[name]
        if a["answer"] == b["answer"] and len(a["margins"]) == len(b["margins"]):
            diffs += [y - x for x, y in zip(a["margins"], b["margins"])]
        if a["hit"]:
            hit_margins.append(a["margins"])
            narrow.append([r["index"], min(a["margins"])])
    if len(diffs) < 2 or not hit_margins:
        return None
    d = np.asarray(diffs, dtype=np.float64)
    mean, rms = float(d.mean()), float(np.sqrt(np.mean(d * d)))

    def lost(s: float) -> list:
        if s <= 0:
            return [float(any(m < 0 for m in ms)) for ms in hit_margins]
        return [1.0 - math.prod(1.0 - _normal_cdf(-m / s) for m in ms) for ms in hit_margins]

    def p_none(s: float) -> float:
        return math.prod(1.0 - p for p in lost(s))

    p_lost = lost(rms)
    p_measured = math.prod(1.0 - p for p in p_lost)
    lo, hi = 0.0, max(rms, 1e-6)  # p_none falls as the deviation grows
    while p_none(hi) >= p_target and hi < 1e6:
        lo, hi = hi, 2 * hi
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if p_none(mid) >= p_target else (lo, mid)
    target = lo
    return {"tokens": int(d.size), "mean": mean, "rms": rms, "ref_hits": len(hit_margins),
            "expected_misses": float(sum(p_lost)), "p_no_miss": p_measured, "p_target": p_target,
            "rms_for_target": target, "narrowest_ref_hits": sorted(narrow, key=lambda x: x[1])[:3]}


def _signed_first_margin(trace: dict, ref_trace: dict) -> float:
    """The first answer token's margin, negative when that token is not ``ref``'s."""
    m = trace["margins"][0]
    return m if trace["first_token"] == ref_trace["first_token"] else -m


def margin_attribution(records: list, ref: str, name: str) -> dict | None:
    """Where cache ``name`` moves the first answer token's margin, over the trials ``ref``
    retrieves whose results hold ``name``'s ``attribution`` (:func:`trial_answers`): the
    change against ``ref`` (mean and standard deviation; negative when the first token is
    another) of the cache itself (``full``), of reading it after ``ref``'s prefill
    (``read``) and of its prefill's keys and values read exactly (``prefill``), and how
    many of those trials each retrieves.  None without such trials."""
    rows = [r["results"] for r in records
            if r["results"][ref]["hit"] and "attribution" in r["results"].get(name, {})]
    if not rows:
        return None
    out = {"n": len(rows)}
    for part in ("full", "read", "prefill"):
        traces = [(x[name] if part == "full" else x[name]["attribution"][part], x[ref]) for x in rows]
        diff = np.array([_signed_first_margin(t, r) - r["margins"][0] for t, r in traces])
        out[part] = {"mean": float(diff.mean()), "sd": float(diff.std(ddof=1)) if diff.size > 1 else None,
                     "hits": int(sum(bool(t["hit"]) for t, _ in traces))}
    return out


def _rate(hits: list) -> dict:
    lo, hi = wilson_interval(sum(hits), len(hits))
    return {"hits": int(sum(hits)), "n": len(hits), "rate": sum(hits) / len(hits) if hits else None, "ci": [lo, hi]}


def summarize_needle_trials(records: list, names, ref: str = "fp") -> dict:
    """Per cache, overall and per length and per depth: hits, rate, Wilson 95%
    interval; paired against ``ref`` on the trials both ran."""
    out = {}
    for n in names:
        rows = [r for r in records if n in r["results"]]
        hit = lambda rs: [bool(r["results"][n]["hit"]) for r in rs]  # noqa: E731
        entry = {
            "all": _rate(hit(rows)),
            "by_length": {str(L): _rate(hit([r for r in rows if r["length"] == L]))
                          for L in sorted({r["length"] for r in rows})},
            "by_depth": {str(d): _rate(hit([r for r in rows if r["depth"] == d]))
                         for d in sorted({r["depth"] for r in rows})},
        }
        if n != ref:
            both = [r for r in rows if ref in r["results"]]
            entry["paired"] = paired_counts([r["results"][ref]["hit"] for r in both], [r["results"][n]["hit"] for r in both])
            hits = [r for r in both if r["results"][ref]["hit"] and r["results"][n]["hit"]]
            entry["margin_drop"] = margin_drop([min(r["results"][ref]["margins"]) for r in hits],
                                               [min(r["results"][n]["margins"]) for r in hits])
            entry["first_margin_change"] = first_margin_change([r["results"][ref]["margins"][0] for r in hits],
                                                               [r["results"][n]["margins"][0] for r in hits])
            entry["margin_noise"] = margin_noise(both, ref, n)
            attribution = margin_attribution(both, ref, n)
            if attribution is not None:
                attribution["by_depth"] = {str(d): a for d in sorted({r["depth"] for r in both})
                                           if (a := margin_attribution([r for r in both if r["depth"] == d], ref, n))}
                entry["attribution"] = attribution
            entry["paired_by_length"] = {
                str(L): paired_counts([r["results"][ref]["hit"] for r in both if r["length"] == L],
                                      [r["results"][n]["hit"] for r in both if r["length"] == L])
                for L in sorted({r["length"] for r in both})
            }
        out[n] = entry
    return out


def needle_stats(model, tokenizer, specs, *, haystacks, lengths, depths, trials: int, seed: int = 0,
                 chat: bool = True, max_tokens: int = 8, prefill_step_size: int = 2048, share_prefill: bool = True,
                 progress=None, done=None, done_specs=None, checkpoint=None, only=None, attribute: bool = False) -> dict:
    """Passkey retrieval over many trials per (length, depth) cell, every trial
    run through every cache in ``specs`` (the first is the paired reference).

    ``only``: run just these trials of the plan (their ``index``, the report's
    ``#``), e.g. to rerun the trials a cache missed with other caches; the
    result (and with ``done``, the stored trials) keeps the others as they were.

    ``done``: records of an earlier run of the same plan (by trial index);
    ``done_specs``: that run's ``specs`` (name -> :meth:`CacheSpec.to_dict`).  A
    cache's stored result is kept instead of rerun when its name was run with
    the same configuration, descriptions aside (so fp results are reused when caches are added, and
    a cache whose configuration changed under the same name runs again);
    without ``done_specs`` (a file from before they were recorded) a record is
    kept only when it has every cache.  ``checkpoint(result)`` is called after
    each trial so a stopped run keeps what it measured (and the earlier run's
    trials not reached yet, as they were).  Returns a
    JSON-serialisable dict with the per-trial ``records`` and the ``summary``.

    ``attribute``: each OIQ cache's results also get :func:`trial_answers`'s
    ``attribution`` (the summary its :func:`margin_attribution`); a stored trial
    without it is run again, fp included (its prefill is what the hybrids read)."""
    progress = progress or Progress(enabled=False)
    plan = plan_needle_trials(tokenizer, haystacks, lengths, depths, trials, seed=seed, chat=chat)
    planned = len(plan)
    if only is not None:
        only = sorted(set(only))
        outside = [i for i in only if not 0 <= i < planned]
        if outside or not only:
            raise ValueError(f"trials to run must be indices 0..{planned - 1} of the plan "
                             f"({planned} trials), got {outside or 'none'}")
        plan = [t for t in plan if t.index in only]
    names = [s.name for s in specs]
    spec_dicts = {s.name: json.loads(json.dumps(s.to_dict())) for s in specs}
    done = {r["index"]: r for r in (done or [])}
    recorded_specs = {**(done_specs or {}), **spec_dicts}

    def reusable(old_rec) -> set:
        have = set(old_rec["results"])
        if attribute and any(s.kind == "oiq" and "attribution" not in old_rec["results"].get(s.name, {})
                             for s in specs):
            return set()
        if done_specs is None:
            return set(names) if have >= set(names) else set()
        return {n for n in names if n in have and _same_config(done_specs.get(n), spec_dicts[n])}

    def todo(t) -> list:
        return [s for s in specs if s.name not in reusable(done[t.index])] if t.index in done else list(specs)

    def carried(old_rec) -> dict:
        # a stored trial this run does not reach keeps its answers, except those of a cache
        # named now whose configuration changed: the file records one configuration per
        # name, so they would be read as the new one's (a later --resume runs them again)
        stale = {n for n in names if n in old_rec["results"] and done_specs is not None
                 and not _same_config(done_specs.get(n), spec_dicts[n])}
        if not stale:
            return old_rec
        return {**old_rec, "results": {n: r for n, r in old_rec["results"].items() if n not in stale}}

    records = []

    def result() -> dict:
        # the earlier run's trials not reached yet (or not chosen by ``only``) stay in the
        # file: stopping again, or rerunning a few trials, loses nothing
        visited = {r["index"] for r in records}
        kept = sorted(records + [carried(done[i]) for i in done if i not in visited], key=lambda r: r["index"])
        return _needle_stats_result(kept, names, recorded_specs, planned, only, lengths, depths, trials, seed,
                                    chat, prefill_step_size, share_prefill, haystacks)

    # prefill dominates: a trial costs about its length in tokens per cache
    total = sum(t.length * len(todo(t)) for t in plan)
    spent, t0 = 0, time.perf_counter()
    for t in plan:
        kept = {}
        if t.index in done:
            old = done[t.index]
            if (old["passkey"], old["length"], old["text"], old["offset"]) != (t.passkey, t.length, t.text, t.offset):
                raise ValueError(f"trial {t.index} of the resumed run differs from this plan "
                                 f"(other seed, texts, lengths, depths or model?)")
            kept = {n: old["results"][n] for n in reusable(old)}
        run = todo(t)
        rec = {
            "index": t.index, "text": t.text, "offset": t.offset, "length": t.length, "depth": t.depth,
            "actual_depth": t.prompt.depth, "needle_token": t.prompt.needle_start, "passkey": t.passkey,
            # results of caches this run does not name are carried over, not dropped
            "results": {n: r for n, r in done[t.index]["results"].items() if n not in names} if t.index in done else {},
        }
        answers = trial_answers(model, tokenizer, t.prompt.ids, run, max_tokens=max_tokens,
                                prefill_step_size=prefill_step_size, share_prefill=share_prefill,
                                attribute=attribute) if run else {}
        hit = lambda tr: {"hit": retrieved_passkey(tr["answer"]) == t.passkey, **tr}  # noqa: E731
        for name in names:
            if name in kept:
                rec["results"][name] = kept[name]
            else:
                rec["results"][name] = hit(answers[name])
                if "attribution" in answers[name]:
                    rec["results"][name]["attribution"] = {k: hit(v) for k, v in answers[name]["attribution"].items()}
        records.append(rec)
        if not run:
            continue
        spent += t.length * len(run)
        verdicts = " ".join(f"{n}:{'+' if rec['results'][n]['hit'] else '-'}" for n in names)
        progress(f"trial #{t.index} ({len(records)}/{len(plan)}) len {t.length} depth {t.depth:.2f} {t.text}@{t.offset} "
                 f"key {t.passkey}: {verdicts}; ETA {_eta(spent, total, time.perf_counter() - t0)}")
        if checkpoint is not None:
            checkpoint(result())
    return result()


def _same_config(a, b) -> bool:
    """Two :meth:`CacheSpec.to_dict` records describe the same cache: equal but for the
    description, which is prose (a reworded description must not rerun a finished run), with
    OIQ fields added since a record was written read as :meth:`OIQConfig.from_json` reads
    them (what the cache did before the field existed)."""
    if a is None or b is None:
        return False
    def normal(spec):
        out = {k: v for k, v in spec.items() if k != "description"}
        if isinstance(out.get("oiq"), dict):
            try:
                out["oiq"] = json.loads(OIQConfig.from_json(json.dumps(out["oiq"])).to_json())
            except ValueError:
                pass  # not a config this version reads: compared as recorded
        return out

    return normal(a) == normal(b)


def _recount(records, names) -> dict:
    """What a results file derives from its trials: ``completed`` (trials every named cache
    has run; a checkpoint also holds an earlier run's trials as they were) and ``summary``."""
    return {"completed": sum(all(n in r["results"] for n in names) for r in records),
            "summary": summarize_needle_trials(records, names, ref=names[0])}


def _needle_stats_result(records, names, recorded_specs, planned, only, lengths, depths, trials, seed, chat,
                         prefill_step_size, share_prefill, haystacks):
    counts = _recount(records, names)
    return {
        "caches": names,
        "specs": recorded_specs,
        "lengths": list(lengths),
        "depths": list(depths),
        "trials_per_cell": trials,
        "planned": planned,
        # the trials this run was limited to (None: the whole plan)
        "only": only,
        "completed": counts["completed"],
        "seed": seed,
        "chat": chat,
        "prefill_step_size": prefill_step_size,
        "share_prefill": share_prefill,
        "texts": {h.name: len(h.ids) for h in haystacks},
        "format": {"needle": NEEDLE_TEMPLATE, "question": QUESTION, "answer_prefix": ANSWER_PREFIX},
        "summary": counts["summary"],
        "records": records,
    }


def resummarize_needle(result: dict) -> dict:
    """``result`` (what :func:`needle_stats` returns or wrote) with its ``summary`` and
    ``completed`` computed again from its ``records``: the report of a results file whose
    trials were merged from several runs (``--only`` halves on copies) counts them all.
    Raises ``ValueError`` naming what a dict that is not such a result lacks."""
    if not isinstance(result, dict):
        raise ValueError(f"not a needle_stats results file: a JSON object was expected, got {type(result).__name__}")
    missing = [k for k in ("caches", "records", "lengths", "depths", "planned", "trials_per_cell", "texts")
               if k not in result]
    if missing:
        raise ValueError(f"not a needle_stats results file: no {', '.join(missing)}")
    names, records = result["caches"], result["records"]
    if not names or not isinstance(records, list):
        raise ValueError("not a needle_stats results file: no caches, or records is not a list")
    return {**result, **_recount(records, names)}


def _fmt_rate(r: dict) -> str:
    if not r["n"]:
        return "-"
    return f"{r['hits']}/{r['n']} ({r['rate']:.0%}, {r['ci'][0]:.0%}-{r['ci'][1]:.0%})"


def needle_stats_markdown(result: dict) -> str:
    """Retrieval per cache and length with 95% Wilson intervals, the paired
    comparison against the reference, and every discordant trial."""
    names, summary = result["caches"], result["summary"]
    ref = names[0]
    lengths = [str(L) for L in result["lengths"]]
    only = result.get("only")
    lines = [
        f"{result['completed']}/{result['planned']} trials ({result['trials_per_cell']} per length x depth, "
        f"depths {result['depths']}, texts {', '.join(result['texts'])}); hits/trials (rate, 95% Wilson interval)",
        *([f"this run: only trials {', '.join(f'#{i}' for i in only)}"] if only else []),
        "",
        "| cache | " + " | ".join(lengths) + " | all | " + f"{ref}-hits missed | hits {ref} missed | McNemar p "
        f"| margin drop vs {ref} |",
        "|---|" + "---|" * (len(lengths) + 5),
    ]
    for n in names:
        s = summary[n]
        cells = [_fmt_rate(s["by_length"][L]) if L in s["by_length"] else "-" for L in lengths]
        if "paired" in s:
            p = s["paired"]
            ci = p["missed_of_ref_ci"]
            missed = f"{p['ref_only']}/{p['both'] + p['ref_only']} (95% <= {ci[1]:.0%})"
            m = s["margin_drop"]
            drop = "-" if m is None else f"{m['mean']:+.2f}" + ("" if m["se"] is None else f" ± {m['se']:.2f}")
            extra = [missed, str(p["other_only"]), f"{p['mcnemar_p']:.3g}", drop]
        else:
            extra = ["-", "-", "-", "-"]
        lines.append(f"| {n} | " + " | ".join(cells) + f" | {_fmt_rate(s['all'])} | " + " | ".join(extra) + " |")
    lines += ["", "margin: the smallest log-probability gap between the chosen answer token and the runner-up over "
              f"a trial's answer; margin drop: its mean decrease against {ref} (± standard error) on trials both "
              "retrieve.", *_first_margin_lines(names, summary, ref), *_noise_lines(names, summary, ref),
              *_attribution_lines(names, summary, ref),
              "", "by depth (all lengths): " + "; ".join(
        f"{n}: " + ", ".join(f"{float(d):.2f} {r['hits']}/{r['n']}" for d, r in summary[n]["by_depth"].items())
        for n in names)]
    discordant = [r for r in result["records"] if len({bool(v["hit"]) for v in r["results"].values()}) > 1]
    if discordant:
        lines += ["", "trials where the caches disagree:", ""]
        for r in discordant:
            answers = "; ".join(f"{n} {'+' if v['hit'] else '-'} {v['answer'].strip()[:24]!r} "
                                f"(margin {min(v['margins']):.2f})" for n, v in r["results"].items())
            lines.append(f"- #{r['index']} len {r['length']} depth {r['actual_depth']:.2f} {r['text']}@{r['offset']} "
                         f"key {r['passkey']}: {answers}{_coin_flip_note(r, summary, ref)}")
    return "\n".join(lines)


def _first_margin_lines(names, summary, ref) -> list:
    parts = [f"{n} {c['mean']:+.2f} ± {c['sd']:.2f} (n = {c['n']})" for n in names
             if (c := summary[n].get("first_margin_change")) and c["sd"] is not None]
    if not parts:
        return []
    return ["", f"first answer token's margin, change against {ref} on trials both retrieve (mean ± standard "
            "deviation): " + "; ".join(parts) + f". A miss of a trial {ref} retrieves with a first-token margin "
            "within one such deviation is marked a coin flip: the cache's usual noise decides it."]


def _noise_lines(names, summary, ref) -> list:
    parts = []
    for n in names:
        c = summary[n].get("margin_noise")
        if not c:
            continue
        narrow = ", ".join(f"#{i} {m:.2f}" for i, m in c["narrowest_ref_hits"])
        parts.append(f"{n}: rms {c['rms']:.3f} (mean {c['mean']:+.3f}) over {c['tokens']} tokens, "
                     f"{c['expected_misses']:.2f} expected misses of {c['ref_hits']}, no miss with probability "
                     f"{c['p_no_miss']:.0%} ({c['p_target']:.0%} needs rms <= {c['rms_for_target']:.3f}; "
                     f"{ref}'s narrowest hits: {narrow})")
    if not parts:
        return []
    return ["", f"margin noise (each answer token's margin minus {ref}'s, on trials with the same answer; a "
            f"{ref} hit is lost when a token's margin crosses zero, each change taken as an independent normal "
            "of mean zero and that root mean square): " + "; ".join(parts) + "."]


def _attribution_lines(names, summary, ref) -> list:
    lines = []
    for n in names:
        a = summary[n].get("attribution")
        if a is None:
            continue
        sd = lambda p: "" if a[p]["sd"] is None else f" ± {a[p]['sd']:.2f}"  # noqa: E731
        part = lambda p: f"{a[p]['mean']:+.2f}{sd(p)} ({a[p]['hits']}/{a['n']} retrieved)"  # noqa: E731
        lines.append(f"{n}, where the first answer token's margin goes ({a['n']} trials {ref} retrieves; change "
                     f"against {ref}, mean ± sd, negative when the first token is another): the cache "
                     f"{part('full')}; reading it after {ref}'s prefill {part('read')}; its prefill's keys and "
                     f"values read exactly {part('prefill')}.")
        by = a.get("by_depth", {})
        if len(by) > 1:
            lines.append("  by depth (cache / read / prefill, mean change, retrieved of n): " + "; ".join(
                f"{float(d):.2f}: " + " / ".join(f"{b[p]['mean']:+.2f} {b[p]['hits']}" for p in ("full", "read", "prefill"))
                + f" of {b['n']}" for d, b in by.items()))
    return ["", *lines] if lines else []


def _coin_flip_note(record, summary, ref) -> str:
    """For a trial ``ref`` retrieves and some cache misses: ``ref``'s first-token
    margin in units of each missing cache's first-token margin spread, and ``ref``'s
    narrowest answer margin in units of that cache's margin noise (a digit lost later in
    the answer is judged by the second)."""
    r = record["results"]
    if ref not in r or not r[ref]["hit"]:
        return ""
    m, narrowest = r[ref]["margins"][0], min(r[ref]["margins"])
    notes = []
    for n, v in r.items():
        if n == ref or v["hit"]:
            continue
        entry = summary.get(n, {})
        c, noise = entry.get("first_margin_change"), entry.get("margin_noise")
        if c and c["sd"]:
            z = m / c["sd"]
            notes.append(f"{ref}'s first-token margin {m:.3f} = {z:.2f} sd of {n}'s" + (", a coin flip" if z < 1 else ""))
        if noise and noise["rms"]:
            notes.append(f"{ref}'s narrowest answer margin {narrowest:.3f} = {narrowest / noise['rms']:.2f} rms of "
                         f"{n}'s margin noise")
    return f" [{'; '.join(notes)}]" if notes else ""


# ---------------------------------------------------------------- attention fidelity


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


# ---------------------------------------------------------------- the whole run


@dataclasses.dataclass
class EvalSettings:
    """Everything a run depends on (stored verbatim in the JSON)."""

    model: str = "demo"
    text: str | None = None
    caches: tuple = DEFAULT_CACHES
    prompt_len: int = 256
    score_len: int = 768
    # one scored token per call, through the decode path, as generation runs; a
    # chunk of C lets its queries attend to the chunk's own tokens exactly
    # (OIQKVCache.attention_segments), which flatters windows smaller than C
    chunk: int = 1
    windows: int = 4
    needle_caches: tuple | None = FULL_NEEDLE_CACHES
    # 8000, not 8192: the prompt plus the answer stay inside SmolLM2's 8192 positions
    needle_lengths: tuple = (1024, 2048, 4096, 8000)
    needle_depths: tuple = (0.0, 0.25, 0.5, 0.75, 1.0)
    needle_chat: bool = True
    fidelity_tokens: int = 512
    seed: int = 0
    skip: tuple = ()


def quick_settings(**overrides) -> EvalSettings:
    """About 13 minutes on 2 CPU cores with SmolLM2 (see the script's --help)."""
    base = {
        "prompt_len": 256, "score_len": 256, "chunk": 1, "windows": 1, "needle_caches": QUICK_NEEDLE_CACHES,
        "needle_lengths": (512, 1024), "needle_depths": (0.0, 0.5, 1.0), "fidelity_tokens": 256,
    }
    base.update(overrides)
    return EvalSettings(**base)


def load_model(name: str):
    """``"demo"`` (SmolLM2-135M), ``"gemma3"`` (Gemma 3 270M), a ``.gguf`` path or
    an mlx-lm model id; returns ``(model, tokenizer, resolved_path)``."""
    path = models.resolve_model(name)
    model, tokenizer = models.load(path)
    return model, tokenizer, path


def load_text(path: str | None) -> str:
    if path is None:
        return models.default_text()
    return Path(path).read_text(encoding="utf-8")


def environment() -> dict:
    metal = mx.metal.is_available()
    return {
        "oiq_mlx": __version__,
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "device": str(mx.default_device()),
        "metal": metal,
        "openblas": openblas_path,
        "cpu_count": os.cpu_count(),
    }


def run_evaluation(settings: EvalSettings, *, model=None, tokenizer=None, progress=None) -> dict:
    """Run every measurement ``settings`` asks for; returns a JSON-serialisable dict.

    ``model``/``tokenizer`` may be passed in (tests); otherwise
    ``settings.model`` is loaded with :func:`load_model`.  ``settings.skip``
    may hold ``"ppl"``, ``"needle"``, ``"fidelity"``.
    """
    progress = progress or Progress()
    t_start = time.perf_counter()
    model_path = None
    if model is None:
        progress(f"loading model {settings.model}")
        model, tokenizer, model_path = load_model(settings.model)
    install()
    head_dim = model_head_dim(model)
    skipped = {}

    def usable(names):
        keep = []
        for s in select_caches(names):
            why = s.supports(head_dim) if head_dim else None
            if why:
                skipped[s.name] = why
                progress(f"skipping {s.name}: {why}")
            else:
                keep.append(s)
        return keep

    specs = usable(settings.caches)
    text = load_text(settings.text)
    result = {
        "settings": dataclasses.asdict(settings),
        "model": {"name": settings.model, "path": model_path, "args": _model_args(model), "head_dim": head_dim},
        "environment": environment(),
        "caches": [s.to_dict() for s in specs],
        "skipped_caches": skipped,
        "bytes_per_token_head": {},
        "notes": [
            ("fp = mlx-lm KVCache at the model dtype; bytes are counted as fp16 (2 bytes per value) for it "
             "and for every scale/bias/mean/full-precision segment ('fp16-equivalent')."),
            "mlx-q* caches are quantized from token 0 (generate_step's quantized_kv_start=0).",
            "measured_bytes_per_token_head = sum of nbytes (allocated capacity, real dtypes) / (tokens x KV layers x KV heads); "
            "fp16_bytes_per_token_head = the same after the same calls with float16 keys and values "
            "(allocated_bytes_per_token).",
        ],
    }
    layers = oiq_layer_indices(model)
    for s in specs:
        result["bytes_per_token_head"][s.name] = {"asymptotic": s.bytes_per_token(head_dim, layers=layers)}
    tokens = tokenizer.encode(text)
    result["text"] = {"source": settings.text or "oiq_mlx default_text (Austen, Persuasion)", "tokens": len(tokens)}
    if "ppl" not in settings.skip:
        progress(f"perplexity: {len(specs)} caches, prompt {settings.prompt_len} + {settings.score_len} scored, "
                 f"chunks of {settings.chunk}, {settings.windows} window(s)")
        result["perplexity"] = perplexity_eval(model, tokens, specs, prompt_len=settings.prompt_len,
                                               score_len=settings.score_len, chunk=settings.chunk,
                                               windows=settings.windows, progress=progress)
    if "fidelity" not in settings.skip:
        progress(f"attention fidelity on {settings.fidelity_tokens} tokens")
        records = capture_attention_inputs(model, tokens[: settings.fidelity_tokens])
        result["fidelity"] = attention_fidelity(model, None, specs, records=records, progress=progress)
        result["key_outliers"] = key_outlier_stats(records, seed=OIQConfig().seed)
        k = result["key_outliers"]
        progress(f"key outliers: gini {k['before']['gini']:.3f} -> {k['rotated']['gini']:.3f}, "
                 f"kurtosis {k['before']['kurtosis']:.2f} -> {k['rotated']['kurtosis']:.2f}")
        del records
    if "needle" not in settings.skip:
        needle_specs = usable(settings.needle_caches) if settings.needle_caches else specs
        progress(f"needle: {len(needle_specs)} caches x lengths {list(settings.needle_lengths)} x depths {list(settings.needle_depths)}")
        result["needle"] = needle_eval(model, tokenizer, needle_specs, filler_text=text, lengths=settings.needle_lengths,
                                       depths=settings.needle_depths, chat=settings.needle_chat, seed=settings.seed,
                                       progress=progress)
    result["wall_seconds"] = time.perf_counter() - t_start
    progress(f"done in {_fmt_s(result['wall_seconds'])}")
    return result


def _model_args(model) -> dict:
    args = getattr(model, "args", None)
    if args is None:
        return {}
    if dataclasses.is_dataclass(args):
        d = dataclasses.asdict(args)
    else:
        d = dict(vars(args))
    d.pop("layer_types", None)
    return {k: v for k, v in d.items() if isinstance(v, (int, float, str, bool, type(None), list))}


# ---------------------------------------------------------------- reporting


def markdown_table(result: dict) -> str:
    """One row per cache: bytes, perplexity, KL, top-1, fidelity, needle."""
    ppl = result.get("perplexity", {})
    fid = result.get("fidelity", {})
    needle = result.get("needle", {})
    bpt = result["bytes_per_token_head"]
    base = ppl.get("fp", {}).get("ppl")
    head = ["cache", "B/tok/head", "nbytes/tok/head (fp16)", "nbytes/tok/head", "ppl", "Δppl",
            "KL (nats)", "top-1", "attn cos", "K rel err", "V rel err", "needle"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for spec in result["caches"]:
        n = spec["name"]
        p, f = ppl.get(n), fid.get(n)
        g = needle.get("grid", {}).get(n)
        cells = [
            n,
            f"{bpt[n]['asymptotic']:.1f}",
            f"{p['fp16_bytes_per_token_head']:.1f}" if p else "-",
            f"{p['measured_bytes_per_token_head']:.0f}" if p else "-",
            f"{p['ppl']:.2f}" if p else "-",
            (f"{100 * (p['ppl'] / base - 1):+.1f}%" if p and base else "-"),
            f"{p['kl']:.4f}" if p else "-",
            f"{100 * p['top1']:.1f}%" if p else "-",
            f"{f['cos_mean']:.4f}" if f else "-",
            f"{f['k_rel_err']:.3f}" if f else "-",
            f"{f['v_rel_err']:.3f}" if f else "-",
            f"{int(np.sum(g))}/{int(np.size(g))}" if g is not None else "-",
        ]
        rows.append("| " + " | ".join(cells) + " |")
    lines = rows + [
        "",
        ("B/tok/head: bytes per token per KV head, K+V, of the quantized storage (every float counted as fp16). "
         "nbytes/tok/head: allocated nbytes (capacity, sinks, window, reserve and means included) / (tokens x "
         "layers x KV heads) at the end of the perplexity run, with float16 keys and values (as a float16 model "
         "on a Mac) and as run here (the model's dtype on this machine)."),
    ]
    k = result.get("key_outliers")
    if k:
        lines += ["", "| keys | kurtosis | max/median channel | Gini of channel energy |", "|---|---|---|---|"]
        for label in ("before", "rotated", "rotated_nosigns"):
            lines.append(f"| {label} | {k[label]['kurtosis']:.2f} | {k[label]['max_median']:.2f} | {k[label]['gini']:.3f} |")
    if needle:
        lines += ["", f"needle grid (rows: length, columns: depth {needle['depths']}; 1 = exact passkey)"]
        for n, g in needle["grid"].items():
            cells = "; ".join(f"{L}: {''.join(str(x) for x in row)}" for L, row in zip(needle["lengths"], g))
            lines.append(f"- {n}: {cells}")
    return "\n".join(lines)


def save_plots(result: dict, out_dir) -> list[str]:
    """Frontier (KL and perplexity vs bytes per token) and needle heatmaps as
    PNG files in ``out_dir``; returns the paths, or [] when matplotlib is
    missing (a message goes to stderr)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots", file=sys.stderr)
        return []
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    ppl = result.get("perplexity")
    if ppl:
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        for ax, metric, label in ((axes[0], "ppl", "perplexity"), (axes[1], "kl", "KL(fp || cache), nats")):
            for n, r in ppl.items():
                x = result["bytes_per_token_head"][n]["asymptotic"]
                y = max(r[metric], 1e-6) if metric == "kl" else r[metric]
                kind = next(c["kind"] for c in result["caches"] if c["name"] == n)
                ax.scatter([x], [y], marker={"fp": "*", "mlx": "s", "oiq": "o"}[kind], s=50)
                ax.annotate(n, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
            ax.set_xlabel("bytes per token per KV head (K+V, fp16-equivalent, asymptotic)")
            ax.set_ylabel(label)
            ax.set_xscale("log", base=2)
            if metric == "kl":
                ax.set_yscale("log")
            ax.grid(alpha=0.3)
        fig.suptitle(f"{result['model']['name']}: quality vs cache size")
        fig.tight_layout()
        p = out_dir / "frontier.png"
        fig.savefig(p, dpi=120)
        plt.close(fig)
        paths.append(str(p))
    needle = result.get("needle")
    if needle:
        names = list(needle["grid"])
        fig, axes = plt.subplots(1, len(names), figsize=(2.2 + 2.2 * len(names), 2.5 + 0.3 * len(needle["lengths"])), squeeze=False)
        for ax, n in zip(axes[0], names):
            ax.imshow(np.array(needle["grid"][n]), cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
            ax.set_xticks(range(len(needle["depths"])), [f"{d:.0%}" for d in needle["depths"]], fontsize=7)
            ax.set_yticks(range(len(needle["lengths"])), [str(L) for L in needle["lengths"]], fontsize=7)
            ax.set_title(n, fontsize=9)
            ax.set_xlabel("depth", fontsize=8)
        axes[0][0].set_ylabel("prompt tokens")
        fig.tight_layout()
        p = out_dir / "needle.png"
        fig.savefig(p, dpi=120)
        plt.close(fig)
        paths.append(str(p))
    return paths
