"""BatchOIQKVCache against the same sequences run alone (mlx-lm 0.32 batch contract)."""

import copy
import dataclasses

import mlx.core as mx
import numpy as np
import pytest
from helpers import tiny_gemma3, tiny_llama
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import LRUPromptCache

from oiq_mlx import OIQConfig, OIQKVCache, make_oiq_cache
from oiq_mlx.cache.attention import oiq_attention, oiq_batch_attention
from oiq_mlx.bench.bytes import held_arrays
from oiq_mlx.cache.batch import BatchOIQKVCache
from oiq_mlx.core.codec import bytes_per_token

# window 8 + 2 sinks: prompts of 5, 23 and 40 tokens put the packed-segment
# boundary at different places in one batch (5 crosses it only while decoding)
CFG = OIQConfig(window=8, sink_tokens=2, trim_reserve=4, exact_prefill=0)
PROMPT_LENGTHS = (5, 23, 40)
H, D = 2, 64


def _prompts(lengths=PROMPT_LENGTHS):
    return [[(7 * i + 3 * j) % 120 + 1 for j in range(n)] for i, n in enumerate(lengths)]


def _alone(model, prompt, n, cfg=CFG):
    """Greedy tokens of one sequence with its own OIQ cache, chunked as BatchGenerator
    chunks it (the prompt but its last token, then one token per step)."""
    cache = make_oiq_cache(model, cfg)
    model(mx.array([prompt[:-1]]), cache=cache)
    tok, out = prompt[-1], []
    for _ in range(n):
        tok = int(mx.argmax(model(mx.array([[tok]]), cache=cache)[0, -1]))
        out.append(tok)
    model(mx.array([[tok]]), cache=cache)  # BatchGenerator has fed the last token too
    return out, cache


def _batched(model, prompts, n, cfg=CFG):
    gen = BatchGenerator(model, max_tokens=n)
    uids = gen.insert(prompts, caches=[make_oiq_cache(model, cfg) for _ in prompts])
    tokens, caches = {u: [] for u in uids}, {}
    while len(caches) < len(uids):
        for r in gen.next_generated():
            tokens[r.uid].append(r.token)
            if r.finish_reason is not None:
                caches[r.uid] = r.prompt_cache
    return [tokens[u] for u in uids], [caches[u] for u in uids]


def _oiq_layers(cache):
    return [c for c in cache if isinstance(c, OIQKVCache)]


@pytest.mark.filterwarnings("ignore:oiq_mlx")
@pytest.mark.parametrize("make_model", [tiny_llama, tiny_gemma3], ids=["llama", "gemma3"])
@pytest.mark.parametrize("mode", ["", "positional", "exact_prefill"])
@pytest.mark.parametrize("clip", [False, True], ids=["absmax", "clip"])
def test_batch_generator_matches_sequences_alone(make_model, mode, clip):
    """Right-padded prompts of different lengths prefilled as one batch, then decoded stacked:
    each sequence gets the tokens and stores the rows it would alone (positional: its padded
    queries come after its real ones, and the 5-token one estimates its statistics stacked;
    exact_prefill: the prompts wait in full precision until the stacked decode packs them)."""
    model = make_model()
    prompts = _prompts()
    cfg = OIQConfig(**{**vars(CFG), "positional": mode == "positional", "clip": clip, "align_scales": clip,
                       "exact_prefill": 64 if mode == "exact_prefill" else 0})
    tokens, caches = _batched(model, prompts, 16, cfg)
    for prompt, got, cache in zip(prompts, tokens, caches):
        want, alone = _alone(model, prompt, 16, cfg)
        assert got == want
        for b, a in zip(_oiq_layers(cache), _oiq_layers(alone)):
            assert (b.offset, b.q_end) == (a.offset, a.q_end) and b.k.mean is not None
            # the same rows through the same code; batched matmuls round differently (~1e-6)
            np.testing.assert_allclose(np.array(b.k.mean), np.array(a.k.mean), atol=1e-5)
            for x, y in zip(b.dequantized_kv(), a.dequantized_kv()):
                # rows that differ by that rounding can still round a rotated coordinate to
                # the neighbouring code (spread over the row by the inverse rotation) or, with
                # clip, pick a neighbouring candidate scale for a group: one or two rows of a
                # layer may differ, by a fraction of a quantization step
                x, y = np.array(x), np.array(y)
                rows = np.abs(x - y).max(axis=-1) > 1e-4
                assert rows.sum() <= 2, np.argwhere(rows)
                np.testing.assert_allclose(x, y, atol=0.02)


def _kv(seed, n, scale=1.0):
    k = mx.random.normal((1, H, n, D), key=mx.random.key(seed)) * scale
    v = mx.random.normal((1, H, n, D), key=mx.random.key(seed + 1000)) * scale
    return k, v


def _padded(rows, L, pad_value=1e4):
    """Right-pad (1, H, n, D) arrays to L rows with a value that would wreck any
    statistic, sink or scale it reached."""
    return mx.concatenate(
        [mx.concatenate([r, mx.full((1, H, L - r.shape[2], D), pad_value)], axis=2) for r in rows], axis=0
    )


def _assert_same_storage(a: OIQKVCache, b: OIQKVCache):
    assert (a.offset, a.q_end) == (b.offset, b.q_end)
    for sa, sb in ((a.k, b.k), (a.v, b.v)):
        for name in ("sink", "codes", "scales", "mean", "lam"):
            x, y = getattr(sa, name), getattr(sb, name)
            assert (x is None) == (y is None), name
            if x is not None:
                n = a.q_end - a.config.sink_tokens if name in ("codes", "scales") else x.shape[2]
                assert mx.array_equal(x[:, :, :n], y[:, :, :n]), name
    for x, y in zip(a.segments(), b.segments()):
        if isinstance(x, tuple):
            assert all(mx.array_equal(p, q) for p, q in zip(x, y))
        else:
            assert (x is None and y is None) or mx.array_equal(x, y)


def test_contract_against_alone_padding_never_stored():
    """merge, prepare(lengths=, right_padding=) over two chunks, finalize,
    filter, extend, a decode step and extract: every sequence's storage equals
    the same rows written to a cache of its own."""
    history = [3, 0, 11]        # tokens each cache holds before it joins the batch
    new = [6, 13, 2]            # the next prompt rows, right-padded to 13
    alone = [OIQKVCache(CFG) for _ in history]
    joined = [OIQKVCache(CFG) for _ in history]
    for i, n in enumerate(history):
        if n:
            for c in (alone[i], joined[i]):
                c.update_and_fetch(*_kv(i, n))
    batch = OIQKVCache.merge(joined)
    assert isinstance(batch, BatchOIQKVCache)
    assert batch.offset.tolist() == history
    rows = [_kv(10 + i, n) for i, n in enumerate(new)]
    for c, (k, v) in zip(alone, rows):
        # the same chunks as the batch's two prefill steps (statistics come from the first)
        c.update_and_fetch(k[:, :, :5], v[:, :, :5])
        if k.shape[2] > 5:
            c.update_and_fetch(k[:, :, 5:], v[:, :, 5:])
    L = max(new)
    batch.prepare(lengths=new, right_padding=[L - n for n in new])
    keys, values = _padded([k for k, _ in rows], L), _padded([v for _, v in rows], L)
    batch.update_and_fetch(keys[:, :, :5], values[:, :, :5])   # prefill in two chunks
    batch.update_and_fetch(keys[:, :, 5:], values[:, :, 5:])
    batch.finalize()
    assert batch.offset.tolist() == [h + n for h, n in zip(history, new)]
    for a, b in zip(alone, batch.caches):
        _assert_same_storage(a, b)

    batch.filter([2, 0])
    extra = OIQKVCache(CFG)
    extra.update_and_fetch(*_kv(99, 20))
    extra_alone = copy.deepcopy(extra)
    batch.extend(OIQKVCache.merge([extra]))
    order = [alone[2], alone[0], extra_alone]
    step = [_kv(50 + i, 1) for i in range(3)]
    batch.update_and_fetch(mx.concatenate([k for k, _ in step]), mx.concatenate([v for _, v in step]))
    for c, (k, v) in zip(order, step):
        c.update_and_fetch(k, v)
    extracted = [batch.extract(i) for i in range(3)]
    for a, b in zip(order, extracted):
        _assert_same_storage(a, b)
    # an extracted cache is the sequence's own: later batch writes do not reach it
    before = [mx.array(e.segments()[3]) for e in extracted]
    batch.update_and_fetch(*(mx.ones((3, H, 1, D)),) * 2)
    for e, b, a in zip(extracted, before, order):
        assert e.offset == a.offset
        assert mx.array_equal(e.segments()[3], b)
    # neither do writes to the caches that were merged
    assert extra.offset == 20


def test_batch_attention_equals_each_sequence_alone():
    history, new = [0, 9, 30], [4, 1, 7]
    L = max(new)
    alone = [OIQKVCache(CFG) for _ in history]
    for i, n in enumerate(history):
        if n:
            alone[i].update_and_fetch(*_kv(i, n))
    batch = OIQKVCache.merge(alone)
    batch.prepare(lengths=new, right_padding=[L - n for n in new])
    mask = batch.make_mask(L)
    assert mask.shape == (3, 1, L, max(h + n for h, n in zip(history, new)))
    rows = [_kv(20 + i, n) for i, n in enumerate(new)]
    batch.update_and_fetch(_padded([k for k, _ in rows], L), _padded([v for _, v in rows], L))
    batch.finalize()
    q = mx.random.normal((3, 2 * H, L, D), key=mx.random.key(7))
    out = oiq_batch_attention(q, batch, scale=D**-0.5, mask=mask)
    for i, ((k, v), n) in enumerate(zip(rows, new)):
        alone[i].update_and_fetch(k, v)
        want = oiq_attention(q[i : i + 1, :, :n], alone[i], scale=D**-0.5, mask="causal")
        np.testing.assert_allclose(np.array(out[i : i + 1, :, :n]), np.array(want), atol=1e-5)

    # one decode step: no mask, every sequence sees all of its own keys
    assert batch.make_mask(1) is None
    step = [_kv(40 + i, 1) for i in range(3)]
    batch.update_and_fetch(mx.concatenate([k for k, _ in step]), mx.concatenate([v for _, v in step]))
    q1 = mx.random.normal((3, 2 * H, 1, D), key=mx.random.key(8))
    out = oiq_batch_attention(q1, batch, scale=D**-0.5)
    for i, (k, v) in enumerate(step):
        alone[i].update_and_fetch(k, v)
        want = oiq_attention(q1[i : i + 1], alone[i], scale=D**-0.5)
        np.testing.assert_allclose(np.array(out[i : i + 1]), np.array(want), atol=1e-5)


def test_merge_and_prepare_reject_what_they_cannot_serve():
    a, b = OIQKVCache(CFG), OIQKVCache(OIQConfig(window=16))
    with pytest.raises(ValueError, match="one config"):
        OIQKVCache.merge([a, b])
    with pytest.raises(ValueError, match="left padding"):
        OIQKVCache.merge([a]).prepare(left_padding=[2])
    with pytest.raises(ValueError, match="must be equal"):
        OIQKVCache.merge([a, OIQKVCache(CFG)]).prepare(lengths=[2, 3], right_padding=[1, 1])


def test_prompt_cache_copies_and_counts_oiq_caches():
    """mlx-lm's LRUPromptCache deep-copies what it hands out and counts ``nbytes``:
    the copy is independent and no float copy of the packed segment is kept."""
    cache = [OIQKVCache(CFG) for _ in range(2)]
    for c in cache:
        c.update_and_fetch(*_kv(3, 40))
        c.release_fresh()
    lru = LRUPromptCache(max_size=4)
    tokens = list(range(40))
    lru.insert_cache("m", tokens, cache)
    assert lru.nbytes == sum(c.nbytes for c in cache)
    # nbytes is every array the cache holds: no float copy of the packed tokens on the side
    for c in cache:
        assert c._attend_from is None
        # keys and values share the stacked window buffer, of which c.k / c.v hold views:
        # count those once (the default K5V3 packs each side into its own buffer)
        views = {id(a) for side in (c.k, c.v) for a in (side.recent,)}
        assert c._kv_recent is not None and c._kv_rows is None and c.k.rows is not None
        assert c.nbytes == sum(a.nbytes for a in held_arrays(c) if id(a) not in views)
    got, rest = lru.fetch_nearest_cache("m", tokens + [7, 8])
    assert rest == [7, 8]
    for a, b in zip(cache, got):
        _assert_same_storage(a, b)
        b.update_and_fetch(*_kv(5, 3))
        assert a.offset == 40


def _decode_side_by_side(batch, alone, steps, seed, cfg=CFG, check=None):
    """``steps`` decode steps of ``batch`` and of each cache of ``alone`` with the same rows
    and queries; attention outputs must agree (``check(step)`` runs after each)."""
    for t in range(steps):
        rows = [_kv(seed + 100 * t + i, 1) for i in range(len(alone))]
        batch.update_and_fetch(mx.concatenate([k for k, _ in rows]), mx.concatenate([v for _, v in rows]))
        q = mx.random.normal((len(alone), 2 * H, 1, D), key=mx.random.key(seed + t))
        out = oiq_batch_attention(q, batch, scale=D**-0.5)
        assert batch.stacked is not None
        for i, (c, (k, v)) in enumerate(zip(alone, rows)):
            c.update_and_fetch(k, v)
            want = oiq_attention(q[i : i + 1], c, scale=D**-0.5)
            np.testing.assert_allclose(np.array(out[i : i + 1]), np.array(want), atol=1e-5)
        if check is not None:
            check(t)


@pytest.mark.parametrize("cfg", [CFG, OIQConfig.preset("3bit", window=8, sink_tokens=2, trim_reserve=4, key_alignment=0.5),
                                 OIQConfig(window=8, sink_tokens=2, trim_reserve=20, center_values=True)],
                         ids=["4bit", "3bit-clip-scaled-keys-half-aligned", "reserve20-vmean"])
def test_stacked_decode_equals_each_sequence_alone(cfg):
    """Decode steps over storage stacked across sequences: every sequence attends to and
    stores exactly what it would alone, across packed blocks, compactions of the window,
    the packed buffer growing, a sequence leaving (filter) and one extracted mid-batch."""
    history = [3, 17, 40, 300]
    alone = [OIQKVCache(cfg) for _ in history]
    joined = [OIQKVCache(cfg) for _ in history]
    for i, n in enumerate(history):
        for c in (alone[i], joined[i]):
            c.update_and_fetch(*_kv(i, n))
            c.release_fresh()
    batch = OIQKVCache.merge(joined)
    _decode_side_by_side(batch, alone, 30, seed=1000, cfg=cfg)
    # one sequence leaves while stacked; the others go on stacked
    batch.filter([3, 0, 2])
    alone = [alone[3], alone[0], alone[2]]
    assert batch.stacked is not None and batch.offset.tolist() == [c.offset for c in alone]
    _decode_side_by_side(batch, alone, 290, seed=2000, cfg=cfg)  # the 300-token one's buffer grows
    mid = batch.extract(1)
    assert batch.stacked is not None
    emptied = copy.deepcopy(batch)
    emptied.update_and_fetch(*(mx.zeros((3, H, 1, D)),) * 2)
    emptied.filter([])
    assert emptied.stacked is None and emptied.caches == [] and emptied.nbytes == 0
    _assert_same_storage(alone[1], mid)
    _decode_side_by_side(batch, alone, 5, seed=3000, cfg=cfg)
    assert mid.offset == alone[1].offset - 5  # later steps do not reach an extracted cache
    # trim gives the storage back and trims each sequence as it would trim alone
    batch.trim(3)
    for c in alone:
        c.trim(3)
    assert batch.stacked is None
    for a, b in zip(alone, batch.caches):
        _assert_same_storage(a, b)
    _decode_side_by_side(batch, alone, 4, seed=4000, cfg=cfg)
    # a prompt chunk gives the storage back to the sequences' caches
    n = 3
    batch.update_and_fetch(*(mx.concatenate([_kv(9000 + i, n)[j] for i in range(3)]) for j in (0, 1)))
    assert batch.stacked is None
    for i, c in enumerate(alone):
        c.update_and_fetch(*_kv(9000 + i, n))
    for a, b in zip(alone, batch.caches):
        _assert_same_storage(a, b)


@pytest.mark.parametrize("cfg", [OIQConfig.preset("4bit", window=8, sink_tokens=2, trim_reserve=4, exact_prefill=0),
                                 OIQConfig.preset("3bit", window=8, sink_tokens=2, trim_reserve=4, exact_prefill=0)],
                         ids=["K5V3", "3bit"])
def test_sequences_packing_on_one_step_pack_together_as_each_alone(cfg, monkeypatch):
    """Sequences whose windows fill on the same step (lengths equal modulo the block) pack
    together: one gather of their rows, one quantize pass per packed buffer with each sequence's
    key scales, one scatter; each stores exactly what it stores alone."""
    from oiq_mlx.cache.stacked import StackedDecode

    together = []
    real = StackedDecode._pack_together
    monkeypatch.setattr(StackedDecode, "_pack_together", lambda self, due: (together.append(len(due)), real(self, due)))
    history = [40, 48, 56, 72, 13]  # the first four in one phase, the last in another
    alone = [OIQKVCache(cfg) for _ in history]
    joined = [OIQKVCache(cfg) for _ in history]
    for i, n in enumerate(history):
        for c in (alone[i], joined[i]):
            c.update_and_fetch(*_kv(i, n, scale=1.0 + i))
            c.release_fresh()
    batch = OIQKVCache.merge(joined)
    _decode_side_by_side(batch, alone, 3 * 8 + 1, seed=500, cfg=cfg)
    assert together == [4, 4, 4], together
    batch.unstack()
    for a, b in zip(alone, batch.caches):
        _assert_same_storage(a, b)


def test_batches_of_other_shapes_at_the_same_positions_pack_their_own_rows():
    """The row indices a step builds for packing sequences together are reused by every layer of
    that step, and only by a batch of the same shape: two batches at the same positions, one with
    a KV head fewer, interleaved step by step, each store what their sequences store alone."""
    cfg = OIQConfig.preset("3bit", window=8, sink_tokens=2, trim_reserve=4, exact_prefill=0)
    history = [40, 48]
    runs = []
    for heads in (2, 1):
        alone, joined = [OIQKVCache(cfg) for _ in history], [OIQKVCache(cfg) for _ in history]
        for i, n in enumerate(history):
            k, v = _kv(i, n)
            for c in (alone[i], joined[i]):
                c.update_and_fetch(k[:, :heads], v[:, :heads])
                c.release_fresh()
        runs.append((heads, OIQKVCache.merge(joined), alone))
    for t in range(9):
        for heads, batch, alone in runs:
            rows = [_kv(700 + 10 * t + i, 1) for i in range(len(alone))]
            rows = [(k[:, :heads], v[:, :heads]) for k, v in rows]
            batch.update_and_fetch(mx.concatenate([k for k, _ in rows]), mx.concatenate([v for _, v in rows]))
            for c, (k, v) in zip(alone, rows):
                c.update_and_fetch(k, v)
    for _, batch, alone in runs:
        batch.unstack()
        for a, b in zip(alone, batch.caches):
            _assert_same_storage(a, b)


@pytest.mark.parametrize("cfg", [CFG, dataclasses.replace(CFG, k_bits=4, v_bits=4)], ids=["K5V3", "K4V4"])
def test_stacked_state_holds_no_copy_and_nbytes_counts_it(cfg):
    batch = OIQKVCache.merge([OIQKVCache(cfg) for _ in range(3)])
    for i, c in enumerate(batch.caches):
        c.update_and_fetch(*_kv(i, 20 + 30 * i))
        c.release_fresh()
    before = batch.nbytes
    batch.update_and_fetch(*(mx.ones((3, H, 1, D)),) * 2)
    st = batch.stacked
    assert st is not None
    # the sequences' buffers moved into the stacked ones (nothing held twice)
    for c in batch.caches:
        assert c._kv_recent is None and c._kv_rows is None and c.k.rows is None and c.v.rows is None
        assert c.k.sink is None
    # one packed buffer for both sides when they have the same bits, one per side otherwise
    assert len(st.rows) == (1 if cfg.k_bits == cfg.v_bits else 2)
    assert batch.nbytes == (st.sinks.nbytes + st.recent.nbytes + sum(r.nbytes for r in st.rows)
                            + sum(c.nbytes for c in batch.caches))
    assert batch.nbytes < 3 * before
    mx.eval(batch.state)


def test_stacked_step_launches_as_much_work_for_eight_sequences_as_for_one():
    """The primitives of one decode step (write + attention) over a stacked batch do not grow
    with the number of sequences; run per sequence they would."""
    from oiq_mlx.bench import trace

    def step_count(n_seq):
        batch = OIQKVCache.merge([OIQKVCache(CFG) for _ in range(n_seq)])
        for i, c in enumerate(batch.caches):
            c.update_and_fetch(*_kv(i, 40 + 3 * i))
            c.release_fresh()
        batch.update_and_fetch(*(mx.ones((n_seq, H, 1, D)),) * 2)  # stacks
        mx.eval(oiq_batch_attention(mx.ones((n_seq, 2 * H, 1, D)), batch, scale=0.1), batch.state)
        batch.update_and_fetch(*(mx.ones((n_seq, H, 1, D)),) * 2)
        out = oiq_batch_attention(mx.ones((n_seq, 2 * H, 1, D)), batch, scale=0.1)
        return sum(trace.launching_primitives([out, *held_arrays(batch.state)]).values())

    one, eight = step_count(1), step_count(8)
    assert one == eight, (one, eight)


def test_a_stacked_step_builds_its_mask_and_index_once_for_all_layers(monkeypatch):
    """Every layer of a step has the same positions: the host-built mask and write index
    are built by the first layer and reused by the others, and a new step builds new ones."""
    from oiq_mlx.cache import stacked

    model = tiny_llama()
    n_layers = len(model.layers)
    assert n_layers > 1
    gen = BatchGenerator(model, max_tokens=6)
    gen.insert(_prompts(), caches=[make_oiq_cache(model, CFG) for _ in PROMPT_LENGTHS])
    for _ in range(2):
        gen.next_generated()  # the prompts, then the first stacked steps
    builds = {"mask": 0, "index": 0}
    real_mask, real_get = stacked.StackedDecode._mask, stacked._INDEX.get

    def counting_mask(self, *args):
        builds["mask"] += 1
        return real_mask(self, *args)

    def counting_index(key, build):
        return real_get(key, lambda: (builds.__setitem__("index", builds["index"] + 1), build())[1])

    monkeypatch.setattr(stacked.StackedDecode, "_mask", counting_mask)
    monkeypatch.setattr(stacked._INDEX, "get", counting_index)
    batch = gen._generation_batch.prompt_cache
    assert all(layer.stacked is not None for layer in batch)
    for step in range(1, 3):
        gen.next_generated()
        assert builds == {"mask": step, "index": step}, (step, builds)
    gen.close()


def test_server_prompt_cache_keeps_checkpoints_and_trims_only_exactly():
    """oiq-server's prompt cache with --keep-checkpoints: a checkpoint that is a prefix of a
    finished sequence is kept (mlx-lm drops it for trimmable caches, as OIQPromptCache does by
    default) and serves a request that would otherwise need the finished sequence trimmed deeper
    than the trim reserve; a trim within the reserve still reuses the longer entry, and with no
    shorter entry a deeper trim is not made at all."""
    from oiq_mlx.mlx_lm.prompt_cache import OIQPromptCache, trim_is_exact

    def cache_of(n, seed=3):
        c = OIQKVCache(CFG)
        for j in range(n):  # one token per call, as a checkpoint and its continuation are made
            c.update_and_fetch(*_kv(seed * 1000 + j, 1))
            c.release_fresh()
        return [c]

    checkpoint, finished = cache_of(30), cache_of(60)
    assert trim_is_exact(finished, 2) and not trim_is_exact(finished, 30)
    lru = OIQPromptCache(max_size=8, keep_checkpoints=True)
    lru.insert_cache("m", list(range(30)), checkpoint, cache_type="system")
    lru.insert_cache("m", list(range(60)), finished)
    assert len(lru) == 2
    # shares 35 tokens with the finished sequence (a trim of 25): the checkpoint serves it
    got, rest = lru.fetch_nearest_cache("m", list(range(35)) + [999])
    assert got[0].offset == 30 and rest == [30, 31, 32, 33, 34, 999]
    _assert_same_storage(checkpoint[0], got[0])
    # shares 58 (a trim of 2, within the reserve): the finished sequence serves it
    got, rest = lru.fetch_nearest_cache("m", list(range(58)) + [999])
    assert got[0].offset == 58 and rest == [999]
    # shares 25 with a sequence and nothing shorter is cached: a fresh prefill, not a deep trim
    alone = OIQPromptCache(max_size=8, keep_checkpoints=True)
    alone.insert_cache("m", list(range(60)), finished)
    got, rest = alone.fetch_nearest_cache("m", list(range(25)) + [999])
    assert got is None and rest == list(range(25)) + [999]


def test_sequences_joining_a_stacked_batch_are_appended_to_it():
    """extend of a decoding (stacked) batch with newly prefilled sequences appends them to the
    stacked storage; every sequence still stores and attends what it would alone."""
    alone, joined = [], []
    for i, n in enumerate((12, 50, 33, 140)):
        for group in (alone, joined):
            c = OIQKVCache(CFG)
            c.update_and_fetch(*_kv(i, n))
            c.release_fresh()
            group.append(c)
    batch = OIQKVCache.merge(joined[:2])
    _decode_side_by_side(batch, alone[:2], 20, seed=500)
    stacked = batch.stacked
    batch.extend(OIQKVCache.merge(joined[2:]))
    assert batch.stacked is stacked and batch.offset.tolist() == [c.offset for c in alone]
    _decode_side_by_side(batch, alone, 40, seed=600)
    for i, a in enumerate(alone):
        _assert_same_storage(a, batch.extract(i))


def test_batch_generator_sequences_hold_what_one_sequence_holds():
    """mlx-lm's BatchGenerator (the server's path) with the 4bit preset: each finished
    sequence's cache holds what the same sequence generated alone holds (the same rows packed and
    in full precision; batched matmuls round apart from one sequence's), in no more bytes (its packed buffers come back from the stacked batch at the rows held,
    rounded to a block; alone they may hold up to one growth step more), and that is packed
    (about 0.3x float16 at 2k tokens, not the prompt in full precision)."""
    from oiq_mlx.mlx_lm.caches import float16_model_bytes, kv_memory

    model = tiny_llama(head_dim=64, n_heads=4, n_kv_heads=2, layers=2, vocab=256)
    prompts = [[(7 * i + 3) % 256 for i in range(n)] for n in (2000, 1500)]
    cfg = OIQConfig.preset("4bit")
    _, caches = _batched(model, prompts, 4, cfg)
    for prompt, cache in zip(prompts, caches):
        _, alone = _alone(model, prompt, 4, cfg)
        for a, b in zip(_oiq_layers(alone), _oiq_layers(cache)):
            assert (a.offset, a.q_end, a.recent_start) == (b.offset, b.q_end, b.recent_start)
        held = float16_model_bytes(cache)
        assert held <= float16_model_bytes(alone)
        growth = sum(c.growth_step(c.q_end) * int(np.prod(c.batch_heads))
                     * sum(bytes_per_token(side.dim, side.bits, cfg.group_size) for side in (c.k, c.v))
                     for c in _oiq_layers(alone))
        assert float16_model_bytes(alone) - held <= growth
        ratio = float16_model_bytes(cache) / kv_memory(cache)["fp16"]
        assert ratio < (0.33 if len(prompt) == 2000 else 0.35), ratio
