"""The statistical needle harness (oiq_mlx.eval.evaluation.needle_stats): prompts at
exact lengths and depths on any text, the paired counting, the Wilson interval
and McNemar's test on constructed cases, the shared first prefill chunk against
whole-prompt ``generate_step``, and the script end to end on SmolLM2."""

import json
import runpy
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from helpers import NARROW_LLAMA, CharTokenizer, tiny_llama
from oiq_mlx.eval import needle as nd
from oiq_mlx.eval import needle_stats as ns
from oiq_mlx.eval import quality, stats
from oiq_mlx.eval.report import needle_stats_markdown
from oiq_mlx.cache.sequence import OIQKVCache
from oiq_mlx.eval.specs import parse_spec

ROOT = Path(__file__).resolve().parents[2]
TEXT_A = "It was a truth universally acknowledged. She smiled! Did he know? " * 40
TEXT_B = "The rain fell on the moor for three days and nights. Nobody came. " * 30


class WordTokenizer:
    """A word-level tokenizer (ids are positions in a growing vocabulary) with a
    chat template, to show the harness does not depend on one tokenization."""

    bos_token_id = None
    eos_token_ids = ()
    chat_template = "<user>{content}</user><assistant>"

    def __init__(self):
        self.vocab, self.words = {}, []

    def _id(self, w):
        if w not in self.vocab:
            self.vocab[w] = len(self.words)
            self.words.append(w)
        return self.vocab[w]

    def encode(self, text, add_special_tokens=True):
        import re

        return [self._id(w) for w in re.findall(r"\s*\S+|\s+", text)]

    def decode(self, ids):
        return "".join(self.words[i] for i in ids)

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        return self.chat_template.format(content=messages[0]["content"])


def _needle_ids(tok, key):
    return tok.encode(nd.NEEDLE_TEMPLATE.format(key=key), add_special_tokens=False)


@pytest.mark.parametrize("tok_cls, chat", [(CharTokenizer, False), (WordTokenizer, True)])
def test_planned_prompts_have_exact_length_depth_and_come_from_the_texts(tok_cls, chat):
    tok = tok_cls()
    hays = [nd.prepare_haystack(tok, "a", TEXT_A), nd.prepare_haystack(tok, "b", TEXT_B)]
    lengths = (120, 300) if tok_cls is WordTokenizer else (400, 1000)
    depths = (0.0, 0.3, 0.75, 1.0)
    plan = nd.plan_needle_trials(tok, hays, lengths, depths, 3, seed=1, chat=chat)
    assert len(plan) == 3 * len(lengths) * len(depths)
    # round by round: every cell once before any cell twice
    assert [(t.length, t.depth) for t in plan[:8]] == [(L, d) for L in lengths for d in depths]
    assert len({t.passkey for t in plan}) == len(plan)
    assert {t.text for t in plan[:8]} == {"a", "b"}  # texts alternate within a round too
    # each text meets each depth
    assert {(t.text, t.depth) for t in plan} == {(h, d) for h in "ab" for d in depths}
    for t in plan:
        p = t.prompt
        assert len(p.ids) == p.length == t.length
        needle = _needle_ids(tok, t.passkey)
        assert p.ids[p.needle_start : p.needle_start + len(needle)] == needle
        n_filler = p.hay_len - len(needle)
        # the needle sits at the sentence start nearest the requested depth; sentences are <= 15 words / 55 bytes
        slack = 15 if tok_cls is WordTokenizer else 55
        assert abs((p.needle_start - p.hay_start) - t.depth * n_filler) <= slack
        assert p.depth == pytest.approx((p.needle_start - p.hay_start) / n_filler)
        hay = next(h for h in hays if h.name == t.text)
        before = tok.decode(p.ids[p.hay_start : p.needle_start]).rstrip()
        assert before == "" or before[-1] in ".!?"
        # the haystack is the text from the trial's offset on (wrapping round), cut around the needle
        filler = p.ids[p.hay_start : p.needle_start] + p.ids[p.needle_start + len(needle) : p.hay_start + p.hay_len]
        expect = (hay.ids[t.offset :] + hay.ids * (2 + t.length // len(hay.ids)))[:n_filler]
        assert filler == expect
        assert t.offset in hay.ends
        assert tok.decode(p.ids).endswith(nd.ANSWER_PREFIX)
    assert len({t.offset for t in plan}) > 3


def test_haystack_filler_wraps_with_sentence_starts():
    tok = CharTokenizer()
    hay = nd.prepare_haystack(tok, "s", "Ab. Cd. ")
    assert hay.ends == [0, 3, 7]  # the text's start, after "Ab." and after "Cd."
    ids, ends = hay.filler(3, 12)
    assert tok.decode(ids) == " Cd. Ab. Cd."
    assert ends == [0, 4, 5, 8, 12]
    with pytest.raises(ValueError, match="at least 2"):
        nd.prepare_haystack(tok, "tiny", "x")


def test_plan_rejects_bad_input():
    tok = CharTokenizer()
    hays = [nd.prepare_haystack(tok, "a", TEXT_A)]
    with pytest.raises(ValueError, match="trials"):
        nd.plan_needle_trials(tok, hays, (300,), (0.5,), 0)
    with pytest.raises(ValueError, match="depth"):
        nd.plan_needle_trials(tok, hays, (300,), (1.5,), 2)
    with pytest.raises(ValueError, match="too short"):
        nd.plan_needle_trials(tok, hays, (60,), (0.5,), 1, chat=False)
    with pytest.raises(ValueError, match="no haystack"):
        nd.plan_needle_trials(tok, [], (300,), (0.5,), 1)


def test_paired_change_ci_takes_its_error_from_block_means():
    import math

    rng = np.random.default_rng(0)
    # a constant difference: no spread, the interval is the point
    lo, hi = stats.paired_change_ci(np.full(96, 0.01))
    assert lo == pytest.approx(math.expm1(0.01)) and hi == pytest.approx(math.expm1(0.01))
    assert stats.paired_change_ci(np.zeros(64)) == (0.0, 0.0)  # the reference against itself
    # by hand: the standard error of the 4 block means, the mean over every token
    d = rng.normal(0.02, 0.3, 4 * 32 + 5)
    means = d[:128].reshape(4, 32).mean(axis=1)
    se = means.std(ddof=1) / 2
    lo, hi = stats.paired_change_ci(d)
    assert (lo, hi) == pytest.approx((math.expm1(d.mean() - 1.96 * se), math.expm1(d.mean() + 1.96 * se)))
    assert lo < math.expm1(d.mean()) < hi
    # runs of equal differences (one bad key shifts a run of predictions): the blocks see the
    # spread that the token-by-token error would understate
    runs = np.repeat(rng.normal(0.0, 0.3, 32), 32)
    lo, hi = stats.paired_change_ci(runs)
    naive = runs.std(ddof=1) / math.sqrt(runs.size)
    assert hi - lo > 3 * (math.expm1(runs.mean() + 1.96 * naive) - math.expm1(runs.mean() - 1.96 * naive))
    assert all(math.isnan(x) for x in stats.paired_change_ci(rng.normal(size=40)))  # one block
    with pytest.raises(ValueError, match="no scored tokens"):
        stats.paired_change_ci([])


def test_wilson_interval_known_values():
    lo, hi = stats.wilson_interval(5, 10)
    assert (lo, hi) == (pytest.approx(0.2366, abs=1e-4), pytest.approx(0.7634, abs=1e-4))
    # 0 of 60: the upper bound is z^2 / (n + z^2)
    lo, hi = stats.wilson_interval(0, 60)
    assert lo == 0.0 and hi == pytest.approx(1.96**2 / (60 + 1.96**2))
    lo, hi = stats.wilson_interval(60, 60)
    assert hi == pytest.approx(1.0) and lo == pytest.approx(60 / (60 + 1.96**2))
    assert stats.wilson_interval(0, 0) == (0.0, 1.0)
    with pytest.raises(ValueError):
        stats.wilson_interval(3, 2)


def test_mcnemar_exact():
    assert stats.mcnemar_p(0, 0) == 1.0
    assert stats.mcnemar_p(0, 6) == pytest.approx(2 / 64)
    assert stats.mcnemar_p(4, 1) == pytest.approx(2 * 6 / 32)
    assert stats.mcnemar_p(3, 3) == 1.0


def test_paired_counts_constructed():
    ref = [1, 1, 1, 0, 0, 1, 1]
    other = [1, 0, 1, 1, 0, 0, 1]
    p = stats.paired_counts([bool(x) for x in ref], [bool(x) for x in other])
    assert (p["n"], p["both"], p["ref_only"], p["other_only"], p["neither"]) == (7, 3, 2, 1, 1)
    assert p["missed_of_ref"] == pytest.approx(2 / 5)
    assert p["missed_of_ref_ci"] == list(stats.wilson_interval(2, 5))
    assert p["mcnemar_p"] == pytest.approx(stats.mcnemar_p(2, 1))
    with pytest.raises(ValueError):
        stats.paired_counts([True], [True, False])


def test_margin_drop_constructed():
    m = stats.margin_drop([3.0, 2.0, 4.0], [2.0, 2.5, 1.0])
    assert m["n"] == 3 and m["mean"] == pytest.approx(3.5 / 3)
    assert m["se"] == pytest.approx(np.std([1.0, -0.5, 3.0], ddof=1) / np.sqrt(3))
    assert stats.margin_drop([], []) is None and stats.margin_drop([1.0], [0.5])["se"] is None
    with pytest.raises(ValueError):
        stats.margin_drop([1.0], [])


def _record(i, length, depth, hits):
    return {"index": i, "length": length, "depth": depth, "text": "a", "offset": 0, "passkey": str(10000 + i),
            "actual_depth": depth,
            "results": {n: {"hit": h, "answer": "", "margins": [9.0, 2.0 + i + (n == "fp")]} for n, h in hits.items()}}


def test_summary_per_length_and_depth():
    recs = [
        _record(0, 2048, 0.1, {"fp": True, "oiq-4": False}),
        _record(1, 2048, 0.9, {"fp": True, "oiq-4": True}),
        _record(2, 4096, 0.1, {"fp": False, "oiq-4": True}),
        _record(3, 4096, 0.9, {"fp": True, "oiq-4": True}),
        _record(4, 4096, 0.1, {"fp": False, "oiq-4": False}),
    ]
    s = stats.summarize_needle_trials(recs, ["fp", "oiq-4"])
    assert s["fp"]["all"]["hits"] == 3 and s["fp"]["all"]["n"] == 5
    assert s["fp"]["all"]["ci"] == list(stats.wilson_interval(3, 5))
    assert s["oiq-4"]["by_length"]["2048"]["hits"] == 1 and s["oiq-4"]["by_length"]["4096"]["hits"] == 2
    assert s["oiq-4"]["by_depth"]["0.1"]["hits"] == 1 and s["oiq-4"]["by_depth"]["0.9"]["n"] == 2
    p = s["oiq-4"]["paired"]
    assert (p["both"], p["ref_only"], p["other_only"], p["neither"]) == (2, 1, 1, 1)
    assert s["oiq-4"]["paired_by_length"]["2048"]["ref_only"] == 1
    assert s["oiq-4"]["paired_by_length"]["4096"]["other_only"] == 1
    assert "paired" not in s["fp"]
    # trials 1 and 3 both hit; fp's smallest margins are 1 larger
    assert s["oiq-4"]["margin_drop"] == {"n": 2, "mean": pytest.approx(1.0), "se": pytest.approx(0.0)}


def test_first_margin_change_and_coin_flips_constructed():
    c = stats.first_margin_change([1.0, 2.0, 3.0], [1.5, 1.5, 3.5])
    assert c["n"] == 3 and c["mean"] == pytest.approx(0.5 / 3)
    assert c["sd"] == pytest.approx(np.std([0.5, -0.5, 0.5], ddof=1))
    assert stats.first_margin_change([], []) is None and stats.first_margin_change([1.0], [2.0])["sd"] is None
    with pytest.raises(ValueError):
        stats.first_margin_change([1.0], [])

    def rec(i, fp, oiq):  # (hit, first-token margin) for each cache
        return {"index": i, "length": 512, "depth": 0.5, "actual_depth": 0.5, "text": "a", "offset": 0,
                "passkey": str(10000 + i),
                "results": {n: {"hit": h, "answer": "", "margins": [m, 5.0]} for n, (h, m) in
                            (("fp", fp), ("oiq-4", oiq))}}

    # first-token changes on the trials both retrieve: +0.2, -0.2, +0.2, -0.2 (sd 0.2309)
    recs = [rec(0, (True, 1.0), (True, 1.2)), rec(1, (True, 1.0), (True, 0.8)),
            rec(2, (True, 2.0), (True, 2.2)), rec(3, (True, 2.0), (True, 1.8)),
            rec(4, (True, 0.05), (False, 0.3)),   # fp barely chose: 0.22 sd, a coin flip
            rec(5, (True, 0.5), (False, 0.3)),    # 2.17 sd: a real loss
            rec(6, (False, 0.01), (True, 0.3))]   # fp's miss: no note
    s = stats.summarize_needle_trials(recs, ["fp", "oiq-4"])
    assert s["oiq-4"]["first_margin_change"]["n"] == 4
    assert s["oiq-4"]["first_margin_change"]["sd"] == pytest.approx(np.std([0.2, -0.2, 0.2, -0.2], ddof=1))
    res = {"caches": ["fp", "oiq-4"], "summary": s, "records": recs, "lengths": [512], "completed": 7,
           "planned": 7, "trials_per_cell": 7, "depths": [0.5], "texts": ["a"]}
    lines = {line.split(" ")[1]: line for line in needle_stats_markdown(res).splitlines() if line.startswith("- #")}
    assert set(lines) == {"#4", "#5", "#6"}
    assert "fp's first-token margin 0.050 = 0.22 sd of oiq-4's, a coin flip;" in lines["#4"]
    assert "= 2.17 sd of oiq-4's;" in lines["#5"] and "coin flip" not in lines["#5"]
    assert "[" not in lines["#6"]


def test_needle_stats_counts_constructed_answers_and_resumes(monkeypatch):
    """A stand-in for the model answers with the prompt's passkey, except that
    oiq-4 misses needles in the first 30% of the haystack and fp misses those
    past 70% (depth 1 puts the needle at the last sentence start): the records, the paired counts and the report must say exactly that."""
    tok = CharTokenizer()
    calls = []

    def answers(model, tokenizer, ids, specs, **kw):
        text = tokenizer.decode(ids)
        key = text.split("The pass key is ")[1][:5]
        needle = nd.NEEDLE_TEMPLATE.format(key=key)
        depth = text.index(needle) / (text.index(nd.QUESTION) - len(needle))
        calls.append(key)
        wrong = {"oiq-4": depth < 0.3, "fp": depth > 0.7, "oiq-3": False}
        return {s.name: {"answer": f" {int(key) + 1 if wrong[s.name] else key}.", "margins": [1.0], "seconds": 0.0}
                for s in specs}

    monkeypatch.setattr(ns, "trial_answers", answers)
    hays = [nd.prepare_haystack(tok, "a", TEXT_A), nd.prepare_haystack(tok, "b", TEXT_B)]
    specs = [parse_spec("fp"), parse_spec("oiq-4")]
    kw = dict(haystacks=hays, lengths=(600, 1200), depths=(0.0, 0.5, 1.0), trials=4, seed=2, chat=False)
    seen = []
    res = ns.needle_stats(None, tok, specs, checkpoint=lambda r: seen.append(r["completed"]), **kw)
    assert res["completed"] == res["planned"] == 24 and seen == list(range(1, 25))
    by_depth = {d: [r for r in res["records"] if r["depth"] == d] for d in (0.0, 0.5, 1.0)}
    assert all(not r["results"]["oiq-4"]["hit"] and r["results"]["fp"]["hit"] for r in by_depth[0.0])
    assert all(r["results"]["oiq-4"]["hit"] and not r["results"]["fp"]["hit"] for r in by_depth[1.0])
    p = res["summary"]["oiq-4"]["paired"]
    assert (p["both"], p["ref_only"], p["other_only"], p["neither"]) == (8, 8, 8, 0)
    assert res["summary"]["fp"]["all"]["hits"] == 16
    md = needle_stats_markdown(res)
    assert "| oiq-4 |" in md and "8/16" in md
    assert md.count("\n- #") == 16  # every discordant trial listed
    json.dumps(res)

    # resuming keeps finished trials and runs only the missing ones
    calls.clear()
    part = res["records"][:10]
    res2 = ns.needle_stats(None, tok, specs, done=part, **kw)
    assert len(calls) == 14 and res2["records"] == res["records"]
    other_plan = dict(kw, seed=3)
    with pytest.raises(ValueError, match="differs from this plan"):
        ns.needle_stats(None, tok, specs, done=part, **other_plan)

    # with the earlier run's specs, a cache added later runs alone on the finished
    # trials, a cache whose configuration changed under its name runs again, and
    # results of caches not named now are carried over
    ran = []
    monkeypatch.setattr(ns, "trial_answers", lambda m, t, ids, specs, **k: ran.append([s.name for s in specs])
                        or answers(m, t, ids, specs, **k))
    added = [parse_spec("fp"), parse_spec("oiq-3")]
    saved = []
    res3 = ns.needle_stats(None, tok, added, done=res["records"], done_specs=res["specs"], checkpoint=saved.append,
                           **kw)
    assert ran == [["oiq-3"]] * 24 and res3["specs"].keys() == {"fp", "oiq-4", "oiq-3"}
    # a run stopped after its first trial keeps the earlier run's other 23 trials in its file
    first = saved[0]
    assert first["completed"] == 1 and [r["index"] for r in first["records"]] == list(range(24))
    assert [sorted(r["results"]) for r in first["records"][:2]] == [["fp", "oiq-3", "oiq-4"], ["fp", "oiq-4"]]
    assert all(r["results"]["fp"] == o["results"]["fp"] and r["results"]["oiq-4"] == o["results"]["oiq-4"]
               for r, o in zip(res3["records"], res["records"]))
    ran.clear()
    changed = dict(res3["specs"], fp=dict(res3["specs"]["fp"], bits=8))
    ns.needle_stats(None, tok, added, done=res3["records"], done_specs=changed, **kw)
    assert ran == [["fp"]] * 24
    # changed under its name with only some trials rerun: the others lose that cache's stale
    # answers (the file holds one configuration per name), and the next resume runs them
    ran.clear()
    part4 = ns.needle_stats(None, tok, added, done=res3["records"], done_specs=changed, only=[0, 1], **kw)
    assert ran == [["fp"]] * 2
    assert [sorted(r["results"]) for r in part4["records"][1:3]] == [["fp", "oiq-3", "oiq-4"], ["oiq-3", "oiq-4"]]
    assert part4["completed"] == 2 and part4["summary"]["fp"]["all"]["n"] == 2
    ran.clear()
    ns.needle_stats(None, tok, added, done=part4["records"], done_specs=part4["specs"], **kw)
    assert ran == [["fp"]] * 22
    ran.clear()  # a reworded description is not another configuration
    reworded = dict(res3["specs"], fp=dict(res3["specs"]["fp"], description="another fp"))
    ns.needle_stats(None, tok, added, done=res3["records"], done_specs=reworded, **kw)
    assert ran == []
    ran.clear()
    ns.needle_stats(None, tok, added, done=res3["records"], done_specs=None, **kw)
    assert ran == []  # a file without specs: records that have every cache are kept whole

    # only: a few trials rerun with another cache; the stored trials are kept, and the
    # chosen ones get the new cache's answers on exactly the prompts they were planned with
    ran.clear()
    missed = [r["index"] for r in res["records"] if not r["results"]["oiq-4"]["hit"]]
    pick = missed[:3]
    res4 = ns.needle_stats(None, tok, [parse_spec("fp"), parse_spec("oiq-3")], done=res["records"],
                           done_specs=res["specs"], only=[pick[2], pick[0], pick[1], pick[0]], **kw)
    assert ran == [["oiq-3"]] * 3 and res4["only"] == sorted(pick)
    assert [r["index"] for r in res4["records"]] == list(range(24))
    assert [r["index"] for r in res4["records"] if "oiq-3" in r["results"]] == sorted(pick)
    assert all(r == o for r, o in zip(res4["records"], res["records"]) if r["index"] not in pick)
    rows = [r for r in res4["records"] if r["index"] in pick]
    assert all(r["results"]["oiq-3"]["answer"] == f" {r['passkey']}." for r in rows)
    p4 = res4["summary"]["oiq-3"]["paired"]
    assert (p4["both"] + p4["ref_only"] + p4["other_only"] + p4["neither"], p4["other_only"]) == (3, 0)
    assert "only trials " + ", ".join(f"#{i}" for i in sorted(pick)) in needle_stats_markdown(res4)
    for bad in ([24], [-1], []):
        with pytest.raises(ValueError, match="indices 0..23"):
            ns.needle_stats(None, tok, specs, only=bad, **kw)

    # attribute: stored trials without the hybrids run again, fp included (its prefill is what
    # they read); the hybrids' hits are scored like the answers; a second resume runs nothing
    def attributed(m, t, ids, specs, attribute=False, **k):
        ran.append([s.name for s in specs])
        out = answers(m, t, ids, specs, **k)
        for s in specs:
            out[s.name]["first_token"] = 0
            if attribute and s.kind == "oiq":
                out[s.name]["attribution"] = {"read": {"answer": " 1.", "margins": [1.0], "first_token": 1},
                                              "prefill": {"answer": " 2.", "margins": [0.5], "first_token": 2}}
        return out

    monkeypatch.setattr(ns, "trial_answers", attributed)
    ran.clear()
    res5 = ns.needle_stats(None, tok, specs, done=res["records"], done_specs=res["specs"], only=pick, attribute=True,
                           **kw)
    assert ran == [["fp", "oiq-4"]] * 3
    for r in res5["records"]:
        a = r["results"]["oiq-4"].get("attribution")
        assert (a is not None) == (r["index"] in pick)
        if a is not None:
            assert a["read"]["hit"] is False and a["prefill"]["hit"] is False
    att = res5["summary"]["oiq-4"]["attribution"]  # only the picked trials fp retrieves count
    assert att["n"] == sum(r["results"]["fp"]["hit"] for r in res5["records"] if r["index"] in pick)
    assert att["prefill"]["mean"] == pytest.approx(-1.5) and att["read"]["hits"] == 0
    ran.clear()
    ns.needle_stats(None, tok, specs, done=res5["records"], done_specs=res5["specs"], only=pick, attribute=True, **kw)
    assert ran == []


def needle_llama():
    # larger embeddings so that greedy answers depend on the context
    return tiny_llama(vocab=256, embed_scale=8, **NARROW_LLAMA)


@pytest.mark.parametrize("length, step", [(150, 64), (150, 512), (300, 100)])
def test_shared_first_chunk_gives_generate_steps_answers(length, step):
    """The first chunk computed once in fp and replayed into each cache, then
    the rest through generate_step, gives the caches generate_step builds from
    the whole prompt: same stored OIQ state, same answers and margins."""
    model, tok = needle_llama(), CharTokenizer()
    ids = tok.encode((TEXT_A * 3)[:length])
    specs = [parse_spec("fp"), parse_spec("oiq-4"), parse_spec("oiq-2"), parse_spec("mlx-q4-g32"),
             parse_spec("preset:4bit[window=16,positional=true]")]
    assert not nd.exact_first_chunk(specs[-1])  # its prompt runs through generate_step, not the replay
    shared = nd.trial_answers(model, tok, ids, specs, max_tokens=5, prefill_step_size=step)
    alone = nd.trial_answers(model, tok, ids, specs, max_tokens=5, prefill_step_size=step, share_prefill=False)
    for n in shared:
        assert shared[n]["answer"] == alone[n]["answer"], n
        np.testing.assert_allclose(shared[n]["margins"], alone[n]["margins"], atol=2e-3, err_msg=n)

    n1 = min(step, length - 1)
    _, log = nd.record_first_chunk(model, ids, n1)
    replayed = nd.replay_first_chunk(parse_spec("oiq-4").make_cache(model), log)
    direct = parse_spec("oiq-4").make_cache(model)
    model(mx.array(ids[:n1])[None], cache=direct)
    for a, b in zip(replayed, direct):
        assert isinstance(a, OIQKVCache) and a.offset == b.offset == n1
        for x, y in zip(a.dequantized_kv(), b.dequantized_kv()):
            np.testing.assert_allclose(np.array(x), np.array(y), atol=1e-4)


@pytest.mark.parametrize("step, oiq", [(512, "preset:4bit[window=16]"), (300, "oiq-4"),
                                       (64, "preset:4bit[window=4096]")])
@pytest.mark.parametrize("share", [True, False])
def test_attribution_hybrids_are_built_from_the_right_rows(step, oiq, share):
    """Where the OIQ prefill is exact (one prefill chunk, or a window that packs nothing),
    its keys and values are fp's: the ``read`` hybrid (fp's prefill written into the OIQ
    cache) must answer as the cache itself and the ``prefill`` hybrid (the OIQ prefill's
    rows in an fp cache) as fp, call for call, whether the first chunk was shared or not."""
    model, tok = needle_llama(), CharTokenizer()
    ids = tok.encode((TEXT_A * 3)[:300])
    specs = [parse_spec("fp"), parse_spec(oiq)]
    out = nd.trial_answers(model, tok, ids, specs, max_tokens=5, prefill_step_size=step, share_prefill=share,
                           attribute=True)
    a = out[oiq]["attribution"]
    assert "attribution" not in out["fp"]
    for hybrid, like in ((a["read"], out[oiq]), (a["prefill"], out["fp"])):
        assert (hybrid["answer"], hybrid["first_token"]) == (like["answer"], like["first_token"])
        np.testing.assert_allclose(hybrid["margins"], like["margins"], atol=2e-3)
    with pytest.raises(ValueError, match="fp cache as the first"):
        nd.trial_answers(model, tok, ids, specs[::-1], attribute=True)


def test_call_log_keeps_the_prompt_calls_and_restores_the_methods():
    cache = [parse_spec("fp").make_cache(needle_llama())[0]]
    with nd._CallLog(cache) as log:
        for n in (5, 3, 1, 1):
            cache[0].update_and_fetch(mx.zeros((1, 2, n, 32)), mx.zeros((1, 2, n, 32)))
    assert "update_and_fetch" not in vars(cache[0]) and cache[0].offset == 10
    assert [k.shape[2] for k, _ in log.prompt_calls(9)[0]] == [5, 3, 1]
    with pytest.raises(ValueError, match="wrote 8 rows where the prefill wrote 7"):
        log.prompt_calls(7)


def test_margin_attribution_constructed():
    def tr(hit, m, first=1):
        return {"hit": hit, "answer": "", "margins": [m, 5.0], "first_token": first}

    def rec(i, fp, full, read, prefill):
        return {"index": i, "length": 512, "depth": 0.5, "actual_depth": 0.5, "text": "a", "offset": 0,
                "passkey": str(10000 + i),
                "results": {"fp": tr(*fp), "oiq-4": {**tr(*full), "attribution": {"read": tr(*read),
                                                                                  "prefill": tr(*prefill)}}}}

    recs = [rec(0, (True, 1.0), (True, 0.6), (True, 0.7), (True, 1.1)),
            rec(1, (True, 0.3), (False, 0.2, 2), (True, 0.1), (False, 0.1, 3)),  # other first token: -0.2
            rec(2, (False, 0.5), (True, 9.0), (True, 9.0), (True, 9.0))]  # fp's miss: not counted
    recs.append({**rec(3, (True, 1.0), (True, 1.0), (True, 1.0), (True, 1.0))})
    del recs[-1]["results"]["oiq-4"]["attribution"]  # a trial run without --attribute: not counted
    a = stats.margin_attribution(recs, "fp", "oiq-4")
    assert a["n"] == 2
    assert a["full"]["mean"] == pytest.approx((-0.4 - 0.5) / 2) and a["full"]["hits"] == 1
    assert a["read"]["mean"] == pytest.approx((-0.3 - 0.2) / 2) and a["read"]["hits"] == 2
    assert a["prefill"]["mean"] == pytest.approx((0.1 - 0.4) / 2)
    assert a["prefill"]["sd"] == pytest.approx(np.std([0.1, -0.4], ddof=1)) and a["prefill"]["hits"] == 1
    assert stats.margin_attribution(recs[2:], "fp", "oiq-4") is None
    recs[1]["depth"] = 1.0
    s = stats.summarize_needle_trials(recs, ["fp", "oiq-4"])
    by = s["oiq-4"]["attribution"].pop("by_depth")
    assert s["oiq-4"]["attribution"] == a and "attribution" not in s["fp"]
    assert by == {"0.5": stats.margin_attribution(recs[:1], "fp", "oiq-4"),
                  "1.0": stats.margin_attribution(recs[1:2], "fp", "oiq-4")}
    s["oiq-4"]["attribution"]["by_depth"] = by
    res = {"caches": ["fp", "oiq-4"], "summary": s, "records": recs, "lengths": [512], "completed": 4,
           "planned": 4, "trials_per_cell": 4, "depths": [0.5], "texts": ["a"]}
    md = needle_stats_markdown(res)
    assert ("oiq-4, where the first answer token's margin goes (2 trials fp retrieves" in md
            and "the cache -0.45 ± 0.07 (1/2 retrieved); reading it after fp's prefill -0.25 ± 0.07 (2/2 "
            "retrieved); its prefill's keys and values read exactly -0.15 ± 0.35 (1/2 retrieved)." in md)
    assert "by depth (cache / read / prefill, mean change, retrieved of n): 0.50: -0.40 1 / -0.30 1 / +0.10 1 of 1; " \
           "1.00: -0.50 0 / -0.20 1 / -0.40 0 of 1" in md


def test_record_first_chunk_restores_the_cache_methods():
    model = needle_llama()
    cache, log = nd.record_first_chunk(model, list(range(40)), 30)
    assert all(k.shape[2] == 30 for k, _ in log)
    assert all("update_and_fetch" not in vars(c) for c in cache)
    assert all(c.offset == 30 for c in cache)


def test_record_first_chunk_refuses_shared_layers():
    """A model that writes one cache twice per pass cannot have its chunk replayed."""
    model = needle_llama()

    class Shared:
        layers = model.layers

        def __call__(self, inputs, cache=None):
            return model(inputs, cache=[cache[0], cache[0]])

    with pytest.raises(ValueError, match="written twice"):
        nd.record_first_chunk(Shared(), list(range(20)), 10)


def test_script_rejects_bad_options(capsys):
    """In one process (the script's main, as its command line calls it): each refusal is argparse's
    exit status 2 and a message naming the option, before any model loads."""
    main = runpy.run_path(str(ROOT / "scripts" / "needle_stats.py"), run_name="needle_stats")["main"]
    for args, msg in ((["--trials", "0"], "--trials"), (["--depths", "0.5,2"], "--depths"),
                      (["--resume"], "--resume needs --json"), (["--texts", "/nonexistent.txt"], "cannot read"),
                      (["--caches", "fp,nonsense-9"], "nonsense"),
                      (["--only", "180"], "indices 0..179"), (["--quick", "--only", "3,12"], "indices 0..11")):
        with pytest.raises(SystemExit) as exit_:
            main(args)
        assert exit_.value.code == 2, args
        assert msg in capsys.readouterr().err, args
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "needle_stats.py"), "--trials", "0"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--trials" in out.stderr, out.stderr


@pytest.mark.slow
def test_script_end_to_end_on_smollm2(tmp_path):
    out_json, out_md = tmp_path / "n.json", tmp_path / "n.md"
    texts = tmp_path / "t1.txt"
    texts.write_text(quality.load_text(None)[20000:40000], encoding="utf-8")
    cmd = [sys.executable, str(ROOT / "scripts" / "needle_stats.py"), "--lengths", "160", "--depths", "0.5",
           "--trials", "2", "--caches", "fp,oiq-4", "--texts", str(texts), "--json", str(out_json),
           "--markdown", str(out_md)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out_json.read_text())
    assert res["completed"] == 2 and res["texts"] == {"t1": res["texts"]["t1"]}
    assert res["summary"]["fp"]["all"]["hits"] == 2  # SmolLM2 finds a passkey in 160 tokens
    assert "| oiq-4 |" in out_md.read_text()
    again = subprocess.run(cmd + ["--resume"], capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "trial #" not in again.stderr
    assert json.loads(out_json.read_text())["records"] == res["records"]


def test_margin_noise_constructed():
    from math import erf, sqrt

    def rec(i, fp, oiq):  # (hit, answer, margins) for each cache
        return {"index": i, "length": 512, "depth": 0.5, "actual_depth": 0.5, "text": "a", "offset": 0,
                "passkey": str(10000 + i),
                "results": {n: {"hit": h, "answer": a, "margins": m} for n, (h, a, m) in
                            (("fp", fp), ("oiq-4", oiq))}}

    recs = [rec(0, (True, " 1.", [2.0, 1.0]), (True, " 1.", [2.3, 0.9])),   # changes +0.3, -0.1
            rec(1, (False, " x", [0.5, 1.5]), (False, " x", [0.4, 1.8])),   # fp misses: paired, -0.1 +0.3
            rec(2, (True, " 2.", [0.2, 3.0]), (False, " 3.", [0.1, 3.0]))]  # other answers: not paired
    c = stats.margin_noise(recs, "fp", "oiq-4")
    d = np.array([0.3, -0.1, -0.1, 0.3])
    rms = float(np.sqrt(np.mean(d * d)))
    assert c["tokens"] == 4 and c["mean"] == pytest.approx(0.1) and c["rms"] == pytest.approx(rms)
    phi = lambda x: 0.5 * (1 + erf(x / sqrt(2)))  # noqa: E731
    # fp's two hits: trial 0 (margins 2.0, 1.0) and trial 2 (0.2, 3.0)
    lost = [1 - (1 - phi(-2.0 / rms)) * (1 - phi(-1.0 / rms)), 1 - (1 - phi(-0.2 / rms)) * (1 - phi(-3.0 / rms))]
    assert c["ref_hits"] == 2 and c["narrowest_ref_hits"] == [[2, 0.2], [0, 1.0]]
    assert c["expected_misses"] == pytest.approx(sum(lost))
    assert c["p_no_miss"] == pytest.approx((1 - lost[0]) * (1 - lost[1]))
    assert c["p_no_miss"] < 0.9
    # the deviation that makes no miss 90% likely is smaller, and reaches 90% (to bisection precision)
    t = c["rms_for_target"]
    assert 0 < t < rms
    at = lambda s: (1 - phi(-2.0 / s)) * (1 - phi(-1.0 / s)) * (1 - phi(-0.2 / s)) * (1 - phi(-3.0 / s))  # noqa: E731
    assert at(t) == pytest.approx(0.9, abs=1e-6)
    # already quiet enough: the largest deviation that still keeps the chance, above the measured one
    half = stats.margin_noise(recs, "fp", "oiq-4", p_target=0.5)
    assert half["p_no_miss"] > 0.5 and half["rms_for_target"] > rms
    assert at(half["rms_for_target"]) == pytest.approx(0.5, abs=1e-6)
    # no paired tokens, or no fp hit: nothing to say
    assert stats.margin_noise(recs[2:], "fp", "oiq-4") is None
    assert stats.margin_noise(recs[1:2], "fp", "oiq-4") is None
    # the summary carries it and the report prints it
    s = stats.summarize_needle_trials(recs, ["fp", "oiq-4"])
    assert s["oiq-4"]["margin_noise"] == c and "margin_noise" not in s["fp"]
    res = {"caches": ["fp", "oiq-4"], "summary": s, "records": recs, "lengths": [512], "completed": 3,
           "planned": 3, "trials_per_cell": 3, "depths": [0.5], "texts": ["a"]}
    report = needle_stats_markdown(res)
    assert f"oiq-4: rms {rms:.3f} (mean +0.100) over 4 tokens" in report
    assert f"needs rms <= {t:.3f}; fp's narrowest hits: #2 0.20, #0 1.00)" in report
    # the miss of #2 is put in units of that noise (fp's narrowest margin there: 0.2)
    miss = next(line for line in report.splitlines() if line.startswith("- #2 "))
    assert f"fp's narrowest answer margin 0.200 = {0.2 / rms:.2f} rms of oiq-4's margin noise]" in miss


def test_report_of_merged_runs(monkeypatch, tmp_path):
    """A plan run as two ``only`` halves on copies and merged by hand (how the long plans are
    run side by side) reports, through ``--report``, exactly what the plan run whole reports:
    the summary and the completed count are computed again from the trials, nothing runs."""
    tok = CharTokenizer()

    def answers(model, tokenizer, ids, specs, **kw):
        key = tokenizer.decode(ids).split("The pass key is ")[1][:5]
        wrong = {"fp": int(key) % 3 == 0, "oiq-4": int(key) % 4 == 0}
        return {s.name: {"answer": f" {int(key) + 1 if wrong[s.name] else key}.", "margins": [0.5, 1.0],
                         "seconds": 0.0} for s in specs}

    monkeypatch.setattr(ns, "trial_answers", answers)
    hays = [nd.prepare_haystack(tok, "a", TEXT_A), nd.prepare_haystack(tok, "b", TEXT_B)]
    specs = [parse_spec("fp"), parse_spec("oiq-4")]
    kw = dict(haystacks=hays, lengths=(600,), depths=(0.0, 0.5, 1.0), trials=4, seed=5, chat=False)
    whole = ns.needle_stats(None, tok, specs, **kw)
    even = ns.needle_stats(None, tok, specs, only=list(range(0, 12, 2)), **kw)
    odd = ns.needle_stats(None, tok, specs, only=list(range(1, 12, 2)), **kw)
    merged = json.loads(json.dumps(even))
    merged["records"] = sorted(merged["records"] + odd["records"], key=lambda r: r["index"])
    merged["only"] = None
    assert merged["completed"] == 6 and merged["summary"] != whole["summary"]  # the stale summary of one half
    fixed = ns.resummarize_needle(merged)
    assert fixed["completed"] == 12
    assert json.loads(json.dumps(fixed["summary"])) == json.loads(json.dumps(whole["summary"]))
    p = whole["summary"]["oiq-4"]["paired"]
    assert p["ref_only"] + p["other_only"] > 0  # the halves disagree somewhere: the counts are not trivial

    path, md = tmp_path / "merged.json", tmp_path / "report.md"
    path.write_text(json.dumps(merged))
    script = [sys.executable, str(ROOT / "scripts" / "needle_stats.py")]
    out = subprocess.run(script + ["--report", str(path), "--markdown", str(md)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    expected = needle_stats_markdown(json.loads(json.dumps(whole)))
    assert out.stdout.strip() == expected.strip() == md.read_text().strip()
    assert "12/12 trials" in out.stdout and path.read_text() == json.dumps(merged)  # the file is left as it was

    (tmp_path / "other.json").write_text(json.dumps({"records": []}))
    for args, msg in ((["--report", str(path), "--trials", "3"], "--report takes no other option but --markdown, got --trials"),
                      (["--report", str(tmp_path / "other.json")], "not a needle_stats results file: no caches"),
                      (["--report", str(tmp_path / "none.json")], "cannot report")):
        bad = subprocess.run(script + args, capture_output=True, text=True, timeout=120)
        assert bad.returncode == 2 and msg in bad.stderr, (args, bad.stderr)
