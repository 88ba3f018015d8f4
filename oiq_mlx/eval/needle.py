"""Needle-in-a-haystack prompts and answers.

:func:`needle_eval`: a passkey sentence hidden at a depth of an Austen filler of a given token
length; greedy decoding with ``generate_step`` through the cache must reproduce the passkey
exactly (one trial per length x depth cell).

For the statistical harness (:mod:`oiq_mlx.eval.needle_stats`): haystack texts
(:func:`prepare_haystack`), the trial plan (:func:`plan_needle_trials`), greedy answers with
their log-probability margins (:func:`answer_trace`), and :func:`trial_answers`, which answers
one prompt through every cache, the first prefill chunk computed once in fp and replayed into
the caches that attend it exactly (:func:`record_first_chunk`, :func:`replay_first_chunk`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import re
import time

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from ..cache.sequence import OIQKVCache
from .progress import Progress, eta


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
                         f"(key {p.passkey}); ETA {eta(done, total, time.perf_counter() - t0)}")
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
