"""mlx-lm's cache contract, call for call: mlx-lm's own ``KVCache`` / ``BatchKVCache`` and OIQ's
``OIQKVCache`` / ``BatchOIQKVCache`` driven through the same calls, their observable results
compared (return values, offsets, sizes, masks, ``nbytes`` bookkeeping, state round trips, the
model's logits).  Where OIQ differs by design, the test asserts OIQ's documented behaviour
(docs/serving.md, "mlx-lm's cache contract")."""

import mlx.core as mx
import pytest
from helpers import tiny_llama
from mlx_lm.models.cache import BatchKVCache, KVCache, load_prompt_cache, make_prompt_cache, save_prompt_cache

import oiq_mlx
from oiq_mlx import OIQConfig, OIQKVCache, make_oiq_cache
from oiq_mlx.cache.attention import oiq_attention
from oiq_mlx.cache.batch import BatchOIQKVCache

# 8 bits, window 8 + 2 sinks: rows really get packed after 10 tokens; exact_prefill=0 packs prompts at once
CFG8 = OIQConfig(k_bits=8, v_bits=8, window=8, sink_tokens=2, trim_reserve=4, exact_prefill=0)
# the 4bit preset (K5V3, clip, key scaling, exact_prefill) with a window small enough to pack
CFG4 = OIQConfig.preset("4bit", window=8, sink_tokens=2, trim_reserve=4)
CONFIGS = pytest.mark.parametrize("cfg", [CFG8, CFG4], ids=["8bit", "4bit-preset"])
H, D = 2, 64
CHUNKS = (5, 12, 1, 1, 20, 1, 3, 1, 1, 17, 1)


def _kv(seed, n, b=1):
    k = mx.random.normal((b, H, n, D), key=mx.random.key(seed)) * 2 + 1
    v = mx.random.normal((b, H, n, D), key=mx.random.key(seed + 1000))
    return k, v


def _oiq_arrays_nbytes(c):
    """Sum of the nbytes of every array an OIQKVCache holds, each buffer once: ``k.recent`` /
    ``v.recent`` (and ``k.rows`` / ``v.rows``) are views of the shared stacked buffers when those
    exist, so the stacked buffer is counted instead of its two halves."""
    views = set()
    if c._kv_recent is not None:
        views |= {id(c.k.recent), id(c.v.recent)}
    if c._kv_rows is not None:
        views |= {id(c.k.rows), id(c.v.rows)}
    total = 0
    for holder in (c, c.k, c.v):
        for name, a in vars(holder).items():
            if isinstance(a, mx.array) and id(a) not in views and name not in ("codes", "scales"):
                total += a.nbytes
    if c._stacked is not None:
        total += sum(a.nbytes for a in c._stacked if a is not None)
    if c._views is not None and c._views[2] is not None:
        # the codes kept repacked for MLX's CPU kernel (cpu_codes)
        total += sum(a.nbytes for a in c._views[2][1].values() if a is not None)
    return total


def _check_same_counters(fp, oiq):
    assert oiq.offset == fp.offset
    assert oiq.size() == fp.size() == fp.offset
    assert oiq.empty() == fp.empty()
    assert oiq.is_trimmable() is fp.is_trimmable() is True
    # nbytes: each class counts exactly the arrays it holds
    assert fp.nbytes == (0 if fp.keys is None else fp.keys.nbytes + fp.values.nbytes)
    assert oiq.nbytes == _oiq_arrays_nbytes(oiq)


@CONFIGS
def test_single_cache_calls_match_kvcache(cfg):
    fp, oiq = KVCache(), OIQKVCache(cfg)
    _check_same_counters(fp, oiq)
    assert oiq.empty() and oiq.nbytes == fp.nbytes == 0
    o = 0
    for i, L in enumerate(CHUNKS):
        k, v = _kv(i, L)
        got_fp, got_oiq = fp.update_and_fetch(k, v), oiq.update_and_fetch(k, v)
        # KVCache hands back the keys and values held; OIQ hands back itself twice (documented)
        assert got_fp[0].shape == (1, H, o + L, D) and got_fp[1].shape == (1, H, o + L, D)
        assert got_oiq[0] is oiq and got_oiq[1] is oiq
        o += L
        _check_same_counters(fp, oiq)
    assert oiq.q_end > cfg.sink_tokens or oiq.prefilling  # rows really packed (exact_prefill: on end_prefill)
    # an empty update stores nothing and returns as ever
    fp.update_and_fetch(*_kv(90, 0)), oiq.update_and_fetch(*_kv(90, 0))
    _check_same_counters(fp, oiq)
    # trim: the same return values and offsets (0, a few, more than held)
    for n in (0, 3, 1, 4):
        assert oiq.trim(n) == fp.trim(n) == n
        _check_same_counters(fp, oiq)
    k, v = _kv(91, 2)
    fp.update_and_fetch(k, v), oiq.update_and_fetch(k, v)
    _check_same_counters(fp, oiq)
    held = fp.offset
    assert oiq.trim(held + 7) == fp.trim(held + 7) == held
    _check_same_counters(fp, oiq)
    assert fp.offset == 0 and not fp.empty() and not oiq.empty()  # trimmed to 0, still written once
    # writing again after a full trim
    k, v = _kv(92, 6)
    fp.update_and_fetch(k, v), oiq.update_and_fetch(k, v)
    _check_same_counters(fp, oiq)


def test_empty_update_on_a_fresh_cache_matches_kvcache():
    fp, oiq = KVCache(), OIQKVCache(CFG8)
    fp.update_and_fetch(*_kv(0, 0)), oiq.update_and_fetch(*_kv(0, 0))
    _check_same_counters(fp, oiq)
    assert not fp.empty() and not oiq.empty() and fp.offset == 0


@pytest.mark.parametrize("N", [1, 4])
@pytest.mark.parametrize("offset", [0, 13])
def test_single_make_mask_matches_kvcache(N, offset):
    fp, oiq = KVCache(), OIQKVCache(CFG8)
    if offset:
        fp.update_and_fetch(*_kv(0, offset)), oiq.update_and_fetch(*_kv(0, offset))
    # mlx-lm's models pass both keywords (KVCache.make_mask requires them)
    for ra, ws in ((False, None), (True, None), (False, 5), (True, 3)):
        kw = {"return_array": ra, "window_size": ws}
        a, b = fp.make_mask(N, **kw), oiq.make_mask(N, **kw)
        if isinstance(a, mx.array):
            assert isinstance(b, mx.array) and a.shape == b.shape and mx.array_equal(a, b)
        else:
            assert a == b


@CONFIGS
def test_state_round_trip_matches_kvcache(cfg):
    """``from_state(state)`` gives a cache with the same offsets that attends the same from then on
    (mlx-lm 0.32.2 has no ``meta_state``: OIQ's metadata is the last element of ``state``)."""
    assert not hasattr(KVCache(), "meta_state")
    fp, oiq = KVCache(), OIQKVCache(cfg)
    for i, L in enumerate((23, 1, 1, 9)):
        k, v = _kv(i, L)
        fp.update_and_fetch(k, v), oiq.update_and_fetch(k, v)
    fp2, oiq2 = KVCache.from_state(fp.state), OIQKVCache.from_state(oiq.state)
    assert type(fp2) is KVCache and type(oiq2) is OIQKVCache
    _check_same_counters(fp2, oiq2)
    _check_same_counters(fp, oiq2)
    assert (oiq2.q_end, oiq2.recent_start, oiq2.prefilling) == (oiq.q_end, oiq.recent_start, oiq.prefilling)
    assert isinstance(oiq.state[-1], str) and oiq2.state[-1] == oiq.state[-1]
    for L, seed in ((1, 50), (6, 51), (1, 52)):
        k, v = _kv(seed, L)
        q = mx.random.normal((1, 2 * H, L, D), key=mx.random.key(seed))
        mask = "causal" if L > 1 else None
        outs = []
        for c in (oiq, oiq2):
            c.update_and_fetch(k, v)
            outs.append(oiq_attention(q, c, scale=D**-0.5, mask=mask))
        assert mx.array_equal(outs[0], outs[1])
        fp.update_and_fetch(k, v), fp2.update_and_fetch(k, v)
        _check_same_counters(fp2, oiq2)


def _logits(model, tokens, cache):
    return model(mx.array(tokens)[None] if isinstance(tokens[0], int) else mx.array(tokens), cache=cache)


def _rel(a, b):
    return float(mx.abs(a - b).max()) / float(mx.abs(a).max())


# OIQ at 8 bits against mlx-lm's full-precision caches on tests/helpers' tiny Llama: the largest
# logit difference, relative to the largest logit, over every call of the test, measured
# 4.3e-3 (single sequence) and 2.5e-3 (batch) on these prompts; bound at 1.5x for other BLAS orders
LOGIT_TOL_SINGLE = 6.5e-3
LOGIT_TOL_BATCH = 3.8e-3


def test_single_logits_trim_and_prompt_file_match_mlx_lm(tmp_path):
    """Prefill in chunks, decode single tokens, trim and decode again, save and load with mlx-lm's
    own ``save_prompt_cache`` / ``load_prompt_cache``: offsets as mlx-lm's, logits within the
    8-bit tolerance, the loaded cache continuing bit for bit as the original."""
    model = tiny_llama()
    fp, oiq = make_prompt_cache(model), make_oiq_cache(model, CFG8)
    prompt = [(5 * j) % 120 + 3 for j in range(60)]
    worst, o = 0.0, 0
    for L in (30, 20, 1, 1, 7, 1):
        toks = prompt[o : o + L] if o + L <= len(prompt) else [o % 100 + 1] * L
        a, b = _logits(model, toks, fp), _logits(model, toks, oiq)
        worst = max(worst, _rel(a, b))
        o += L
        assert [c.offset for c in oiq] == [c.offset for c in fp] == [o, o]
    assert all(c.q_end > CFG8.sink_tokens for c in oiq)
    assert [c.trim(4) for c in oiq] == [c.trim(4) for c in fp] == [4, 4]
    o -= 4
    for t in (9, 17, 4):
        worst = max(worst, _rel(_logits(model, [t], fp), _logits(model, [t], oiq)))
        o += 1
    assert [c.offset for c in oiq] == [c.offset for c in fp] == [o, o]

    paths = [str(tmp_path / f"{n}.safetensors") for n in ("fp", "oiq")]
    save_prompt_cache(paths[0], fp, {"n": "1"})
    save_prompt_cache(paths[1], oiq, {"n": "1"})
    fp2, meta = load_prompt_cache(paths[0], return_metadata=True)
    oiq2, meta2 = load_prompt_cache(paths[1], return_metadata=True)  # mlx-lm's own, after import oiq_mlx
    oiq3 = oiq_mlx.load_prompt_cache(paths[1])
    assert meta == meta2 == {"n": "1"}
    assert [type(c) for c in oiq2] == [type(c) for c in oiq3] == [OIQKVCache] * 2
    for a, b, c in zip(fp2, oiq2, oiq3):
        _check_same_counters(a, b)
        assert b.offset == c.offset == o
    for t in ([3, 8, 1], [6]):
        a, b = _logits(model, t, fp2), _logits(model, t, oiq)
        assert mx.array_equal(b, _logits(model, t, oiq2)) and mx.array_equal(b, _logits(model, t, oiq3))
        worst = max(worst, _rel(a, b))
    assert worst < LOGIT_TOL_SINGLE, worst


def _right_padded(prompts):
    L = max(map(len, prompts))
    return [p + [0] * (L - len(p)) for p in prompts], [L - len(p) for p in prompts]


def _each_last(logits, lengths):
    """The logits of each sequence's last real token of a right-padded step."""
    return mx.concatenate([logits[i : i + 1, n - 1] for i, n in enumerate(lengths)])


def _batch_counters(fp, oiq):
    """Offsets per sequence (real tokens held), size, empty and the bookkeeping of nbytes."""
    assert oiq.offset.tolist() == fp.offset.tolist()
    # size(): mlx-lm's counts the columns it holds, left padding included (offset + left_padding,
    # the same for every sequence); OIQ stores no padding, so its size is the longest sequence's
    # offset.  Equal whenever mlx-lm's batch holds a sequence without left padding.
    assert fp.size() == max((fp.offset + fp.left_padding).tolist())
    assert oiq.size() == max(oiq.offset.tolist())
    if min(fp.left_padding.tolist()) == 0:
        assert oiq.size() == fp.size()
    assert oiq.empty() == fp.empty()
    assert oiq.is_trimmable() is fp.is_trimmable() is True
    assert fp.nbytes == (0 if fp.keys is None else fp.keys.nbytes + fp.values.nbytes)
    oiq.unstack()
    assert oiq.nbytes == sum(_oiq_arrays_nbytes(c) for c in oiq.caches)


@CONFIGS
def test_batch_calls_and_logits_match_batchkvcache(cfg, tmp_path):
    """What mlx-lm's BatchGenerator does, on BatchKVCache and BatchOIQKVCache side by side:
    merge per-sequence caches with history, prepare(lengths=, right_padding=), a right-padded
    prefill in two chunks, finalize, decode steps, filter, extend, extract, trim, make_mask, and a
    state round trip through save_prompt_cache / load_prompt_cache.  The logits are held to
    mlx-lm's at 8 bits; the 4bit preset's calls and counters must match all the same."""
    model = tiny_llama()
    history = [[(3 * j + i) % 100 + 2 for j in range(n)] for i, n in enumerate((3, 1, 25))]
    fp_seq, oiq_seq = [], []
    for h in history:
        fp_seq.append(make_prompt_cache(model))
        oiq_seq.append(make_oiq_cache(model, cfg))
        _logits(model, h, fp_seq[-1]), _logits(model, h, oiq_seq[-1])
    fp = [KVCache.merge([c[i] for c in fp_seq]) for i in range(2)]
    oiq = [OIQKVCache.merge([c[i] for c in oiq_seq]) for i in range(2)]
    assert [type(c) for c in fp + oiq] == [BatchKVCache] * 2 + [BatchOIQKVCache] * 2
    for a, b in zip(fp, oiq):
        _batch_counters(a, b)
        assert b.offset.tolist() == [3, 1, 25]
        # masks of an N-token step: mlx-lm's columns hold each sequence's keys right-aligned after
        # its left padding, OIQ's hold them right-aligned; equal for steps without right padding
        for N in (2, 5):
            m_fp, m_oiq = a.make_mask(N), b.make_mask(N)
            assert m_fp.shape == m_oiq.shape and mx.array_equal(m_fp, m_oiq)
        # one-token steps: mlx-lm masks its left padding; OIQ's batch has none, so every key is
        # visible and the mask is None (documented), the same columns when asked for an array
        assert b.make_mask(1) is None
        assert mx.array_equal(a.make_mask(1), b.make_mask(1, return_array=True))
    worst = 0.0

    def step(tokens, lengths=None):
        nonlocal worst
        a, b = _logits(model, tokens, fp), _logits(model, tokens, oiq)
        if lengths is not None:
            a, b = _each_last(a, lengths), _each_last(b, lengths)
        worst = max(worst, _rel(a, b))
        return b

    # a right-padded prompt, in two chunks, as BatchGenerator sends it
    prompts = [[(7 * j + i) % 110 + 5 for j in range(n)] for i, n in enumerate((6, 13, 2))]
    padded, padding = _right_padded(prompts)
    lengths = [len(p) for p in prompts]
    for c in fp + oiq:
        c.prepare(lengths=lengths, right_padding=padding)
    a0 = _logits(model, [p[:5] for p in padded], fp)
    b0 = _logits(model, [p[:5] for p in padded], oiq)
    a1 = _logits(model, [p[5:] for p in padded], fp)
    b1 = _logits(model, [p[5:] for p in padded], oiq)
    a, b = mx.concatenate([a0, a1], axis=1), mx.concatenate([b0, b1], axis=1)
    worst = max(worst, _rel(_each_last(a, lengths), _each_last(b, lengths)))
    for c in fp + oiq:
        c.finalize()
    for a, b in zip(fp, oiq):
        _batch_counters(a, b)
        assert b.offset.tolist() == [9, 14, 27]
        # mlx-lm moves right padding to the left (left_padding grows); OIQ stores none at all
        assert a.left_padding.tolist() == [38 - 9, 38 - 14, 38 - 27] and a.size() == 38 and b.size() == 27
    for t in range(3):
        step([[t + 1], [t + 40], [t + 80]])
    for a, b in zip(fp, oiq):
        _batch_counters(a, b)

    # filter, then extend with a new merged sequence
    for c in fp + oiq:
        c.filter([2, 0])
    for a, b in zip(fp, oiq):
        _batch_counters(a, b)
    new_fp, new_oiq = make_prompt_cache(model), make_oiq_cache(model, cfg)
    extra = [(11 * j) % 90 + 7 for j in range(40)]
    _logits(model, extra, new_fp), _logits(model, extra, new_oiq)
    for a, b, na, nb in zip(fp, oiq, new_fp, new_oiq):
        a.extend(KVCache.merge([na])), b.extend(OIQKVCache.merge([nb]))
        _batch_counters(a, b)
        assert b.offset.tolist() == [30, 12, 40]
    for t in range(3):
        step([[t + 2], [t + 50], [t + 90]])
    for a, b in zip(fp, oiq):
        _batch_counters(a, b)

    # trim: the same return value and offsets
    assert [c.trim(2) for c in oiq] == [c.trim(2) for c in fp] == [2, 2]
    for a, b in zip(fp, oiq):
        _batch_counters(a, b)
    step([[4], [5], [6]])

    # extract: a single-sequence cache of the sequence's length, continuing as the batch would
    for i in range(3):
        ex_fp, ex_oiq = [c.extract(i) for c in fp], [c.extract(i) for c in oiq]
        assert [type(c) for c in ex_fp + ex_oiq] == [KVCache] * 2 + [OIQKVCache] * 2
        for a, b in zip(ex_fp, ex_oiq):
            _check_same_counters(a, b)
        a, b = _logits(model, [9, 3], ex_fp), _logits(model, [9, 3], ex_oiq)
        worst = max(worst, _rel(a, b))

    # state round trip, directly and through a file, then both continue alike
    for c in oiq:
        c.unstack()  # a decoding batch's state is its stacked storage (documented)
    rt_fp = [BatchKVCache.from_state(c.state) for c in fp]
    rt_oiq = [BatchOIQKVCache.from_state(c.state) for c in oiq]
    save_prompt_cache(str(tmp_path / "b.safetensors"), oiq)
    save_prompt_cache(str(tmp_path / "bfp.safetensors"), fp)
    file_oiq = load_prompt_cache(str(tmp_path / "b.safetensors"))
    file_fp = load_prompt_cache(str(tmp_path / "bfp.safetensors"))
    assert [type(c) for c in file_oiq] == [BatchOIQKVCache] * 2
    for group_fp, group_oiq in ((rt_fp, rt_oiq), (file_fp, file_oiq)):
        for a, b, ref in zip(group_fp, group_oiq, oiq):
            _batch_counters(a, b)
            assert b.offset.tolist() == ref.offset.tolist()
    want = _logits(model, [[7], [8], [9]], oiq)
    for group_fp, group_oiq in ((rt_fp, rt_oiq), (file_fp, file_oiq)):
        assert mx.array_equal(_logits(model, [[7], [8], [9]], group_oiq), want)
        worst = max(worst, _rel(_logits(model, [[7], [8], [9]], group_fp), want))
    # rows really packed (the 15-token sequence holds its all in sinks + window)
    assert [c.q_end > cfg.sink_tokens for b in oiq for c in b.caches] == [True, False, True] * 2
    if cfg is CFG8:
        assert worst < LOGIT_TOL_BATCH, worst


def test_batch_of_empty_caches_matches_batchkvcache():
    fp = KVCache.merge([KVCache(), KVCache()])
    oiq = OIQKVCache.merge([OIQKVCache(CFG8), OIQKVCache(CFG8)])
    _batch_counters(fp, oiq)
    assert oiq.empty() and oiq.offset.tolist() == [0, 0] and oiq.size() == 0
    k, v = _kv(0, 4, b=2)
    fp.update_and_fetch(k, v)
    got = oiq.update_and_fetch(k, v)
    assert got[0] is oiq and got[1] is oiq  # as the single cache: the batch itself, twice
    _batch_counters(fp, oiq)
    assert oiq.trim(10) == fp.trim(10) == 4
    _batch_counters(fp, oiq)


def test_batch_trim_past_a_short_sequence():
    """mlx-lm's BatchKVCache trims every sequence by the same n, so a sequence shorter than n gets a
    negative offset; each OIQ sequence trims at most what it holds (its offset stops at 0).  The
    return value (n, at most the longest sequence) is the same."""
    fp = KVCache.merge([KVCache(), KVCache()])
    oiq = OIQKVCache.merge([OIQKVCache(CFG8), OIQKVCache(CFG8)])
    for seq, n in enumerate((3, 12)):
        a, b = KVCache(), OIQKVCache(CFG8)
        a.update_and_fetch(*_kv(seq, n)), b.update_and_fetch(*_kv(seq, n))
        fp.extend(KVCache.merge([a])), oiq.extend(OIQKVCache.merge([b]))
    fp.filter([2, 3]), oiq.filter([2, 3])
    assert fp.offset.tolist() == oiq.offset.tolist() == [3, 12]
    assert oiq.trim(5) == fp.trim(5) == 5
    assert fp.offset.tolist() == [-2, 7]
    assert oiq.offset.tolist() == [0, 7]
