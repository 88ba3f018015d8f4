"""Paired statistics: of a perplexity change on the same tokens (:func:`paired_change_ci`), and
of needle trials: Wilson intervals, McNemar's exact test, paired counts, and what the answer
margins say (:func:`margin_drop`, :func:`first_margin_change`, :func:`margin_noise`,
:func:`margin_attribution`), summed up per cache by :func:`summarize_needle_trials`."""

from __future__ import annotations

import math

import numpy as np


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


def paired_change_ci(diff, block: int = 32, z: float = 1.96) -> tuple[float, float]:
    """Interval (95% for z = 1.96) of a perplexity change ``exp(mean(diff)) - 1`` measured on
    the same tokens: ``diff`` holds each scored token's negative log-likelihood through a cache
    minus the reference's, in scoring order.  Neighbouring tokens' differences are not
    independent (one quantized key shifts a run of predictions), so the standard error is
    taken over the means of consecutive blocks of ``block`` tokens (batch means); a tail
    shorter than a block is left out of the error, not of the mean.  ``(0, 0)`` where every
    difference is zero (the reference against itself); NaN bounds with fewer than two blocks."""
    d = np.asarray(diff, dtype=np.float64).ravel()
    if d.size == 0:
        raise ValueError("no scored tokens")
    mean = float(d.mean())
    if not np.any(d):
        return 0.0, 0.0
    n_blocks = d.size // block
    if n_blocks < 2:
        return math.nan, math.nan
    means = d[: n_blocks * block].reshape(n_blocks, block).mean(axis=1)
    se = float(means.std(ddof=1)) / math.sqrt(n_blocks)
    return math.expm1(mean - z * se), math.expm1(mean + z * se)


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
