"""Passkey retrieval with statistics (:func:`needle_stats`): many trials per (length, depth)
cell (passkeys, haystack texts and offsets drawn per trial), every cache compared with fp on the
same trials: rates with Wilson intervals, paired counts, McNemar's test
(``scripts/needle_stats.py``).  A stopped run resumes from its records; :func:`resummarize_needle`
recounts a results file merged from several runs."""

from __future__ import annotations

import json
import time

from ..core.config import OIQConfig
from .needle import ANSWER_PREFIX, NEEDLE_TEMPLATE, QUESTION, plan_needle_trials, retrieved_passkey, trial_answers
from .progress import Progress, eta
from .stats import summarize_needle_trials


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
                 f"key {t.passkey}: {verdicts}; ETA {eta(spent, total, time.perf_counter() - t0)}")
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
