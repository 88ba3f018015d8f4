"""``OIQConfig.positional``: what a sequence stores and attends to depends on its tokens
alone, not on how they were split into calls (DESIGN.md section 11)."""

import mlx.core as mx
import numpy as np
import pytest
from helpers import chunk_data, run_chunks, stored_arrays, tiny_llama
from mlx_lm.generate import generate_step

from oiq_mlx import OIQConfig, OIQKVCache, make_oiq_cache
from oiq_mlx.cache.attention import oiq_attention
from oiq_mlx.cache.files import parse_state

H, D, N = 2, 64, 90
CONFIGS = {
    "4bit": OIQConfig(window=8, sink_tokens=2, trim_reserve=4, positional=True),
    "3bit-clip-scaled": OIQConfig.preset("3bit", window=8, sink_tokens=2, trim_reserve=4, positional=True),
    "vmean-late-start": OIQConfig(window=8, sink_tokens=2, center_values=True, quantize_after=40, positional=True),
}
CHUNKINGS = [[N], [30, 60], [5, 3, 50, 32], [2] * 45, [13, 1, 1, 75], [1] * N]


def _data(seed=0):
    return chunk_data(seed, H, N, D)


def _run(cfg, chunks, data):
    return run_chunks(OIQKVCache(cfg), chunks, data)


def _same_storage(a, b) -> bool:
    """Equal stored arrays, bit for bit.  The full-precision buffers are compared on the rows
    both hold: how many already packed rows a cache still holds for ``trim`` (at most the
    trim reserve) depends on its calls, as without ``positional``."""
    x, y = stored_arrays(a), stored_arrays(b)
    if len(x) != len(y):
        return False
    for i, (u, w) in enumerate(zip(x, y)):
        if i % 7 == 3:  # k_recent / v_recent: the rows both hold, at the end
            n = min(u.shape[2], w.shape[2])
            u, w = u[:, :, u.shape[2] - n :], w[:, :, w.shape[2] - n :]
        if not mx.array_equal(u, w).item():
            return False
    return True


@pytest.mark.parametrize("name", list(CONFIGS))
def test_storage_and_attention_do_not_depend_on_how_tokens_arrive(name):
    """One prompt, chunks of any size, or one token per call: the same stored arrays, bit for
    bit, and the same attention output for every query (to float rounding)."""
    cfg, data = CONFIGS[name], _data()
    ref_cache, ref = _run(cfg, [1] * N, data)
    assert ref_cache.q_end > cfg.sink_tokens  # blocks were packed
    for chunks in CHUNKINGS[:-1]:
        cache, out = _run(cfg, chunks, data)
        assert _same_storage(cache, ref_cache), chunks
        np.testing.assert_allclose(np.array(out), np.array(ref), atol=2e-5, err_msg=str(chunks))


def test_without_positional_the_path_shows():
    """The same check fails for the default semantics: a call attends the rows it packs
    exactly and the first call decides the statistics."""
    cfg = OIQConfig(window=8, sink_tokens=2, trim_reserve=4)
    data = _data()
    (a, out_a), (b, out_b) = _run(cfg, [1] * N, data), _run(cfg, [N], data)
    assert not _same_storage(a, b)
    assert mx.abs(out_a - out_b).max().item() > 1e-2


def test_statistics_come_from_the_rows_before_the_first_block():
    """The mean is estimated when the first block is packed, on the rows from the sinks up to
    there, and every full-precision row is stored centered from then on."""
    cfg = CONFIGS["4bit"]
    k, v, _ = _data()
    cache = OIQKVCache(cfg)
    end = cache.statistics_end
    assert end == cfg.sink_tokens + cfg.window + cache.block
    cache.update_and_fetch(k[:, :, : end - 1], v[:, :, : end - 1])
    assert cache.k.mean is None and cache.q_end == cfg.sink_tokens
    cache.update_and_fetch(k[:, :, end - 1 : end + 5], v[:, :, end - 1 : end + 5])
    want = mx.mean(k[:, :, cfg.sink_tokens : end], axis=2, keepdims=True)
    assert mx.allclose(cache.k.mean, want, atol=1e-6).item()
    n = cache.offset - cache.recent_start
    held = cache.k.recent[:, :, :n]
    assert mx.allclose(held, k[:, :, cache.recent_start : cache.offset] - cache.k.mean, atol=1e-5).item()


def test_trim_back_past_the_first_block_estimates_again():
    """Trimmed back to before the first packed block (rows still held), the cache forgets the
    statistics and holds what a cache that only ever saw the kept tokens holds; fed the same
    tokens again both go on alike."""
    cfg = CONFIGS["4bit"]
    data = _data()
    k, v, q = data
    cache, _ = _run(cfg, [OIQKVCache(cfg).statistics_end + 3], data)
    assert cache.k.mean is not None
    keep = cache.statistics_end - 1
    cache.trim(cache.offset - keep)
    assert cache.k.mean is None and cache.k.lam is None and cache.q_end == cfg.sink_tokens
    fresh, _ = _run(cfg, [keep], data)
    for a, b in zip(cache.dequantized_kv(), fresh.dequantized_kv()):
        np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-5)
    other = mx.random.normal((1, H, 30, D), key=mx.random.key(7)) * 3 - 1  # different tokens after the cut
    for c in (cache, fresh):
        c.update_and_fetch(other, other)
    a = oiq_attention(q[:, :, :1], cache, scale=D**-0.5)
    b = oiq_attention(q[:, :, :1], fresh, scale=D**-0.5)
    np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-4)
    assert mx.allclose(cache.k.mean, fresh.k.mean, atol=1e-5).item()


def test_state_before_and_after_the_statistics_round_trips():
    cfg = CONFIGS["3bit-clip-scaled"]
    data = _data()
    for n in (10, 40):
        cache, _ = _run(cfg, [n], data)
        loaded = OIQKVCache()
        loaded.state = cache.state
        assert _same_storage(cache, loaded)
        k, v, _ = data
        for c in (cache, loaded):
            c.update_and_fetch(k[:, :, n : n + 20], v[:, :, n : n + 20])
        assert _same_storage(cache, loaded)


def test_statistics_present_before_anything_is_packed_are_refused():
    cfg = CONFIGS["4bit"]
    early, _ = _run(cfg, [10], _data())
    late, _ = _run(cfg, [40], _data())
    state = list(early.state)
    state[5] = late.state[5]  # keys' mean, from a cache that has packed
    with pytest.raises(ValueError, match="nothing is packed yet"):
        parse_state(state)
    state = list(late.state)
    state[5] = None
    with pytest.raises(ValueError, match="something is packed"):
        parse_state(state)


def test_prefix_reuse_gives_what_a_fresh_cache_gives():
    """A prompt cache's use: one sequence's cache, trimmed back to a shared prefix (within the
    trim reserve), then a different continuation, gives the tokens a fresh cache gives, even
    with blocks packed inside the prefix and the statistics estimated before the cut."""
    model = tiny_llama()
    cfg = OIQConfig(window=8, sink_tokens=2, trim_reserve=8, positional=True)
    shared = [(5 * j) % 100 + 1 for j in range(40)]
    first, second = shared + [7, 9, 11], shared + [21, 23]

    def greedy(prompt, cache, n=12):
        out = []
        for (tok, _), _ in zip(generate_step(mx.array(prompt), model, prompt_cache=cache), range(n)):
            out.append(int(tok))
        return out

    reused = make_oiq_cache(model, cfg)
    greedy(first, reused, n=3)
    oiq = [c for c in reused if isinstance(c, OIQKVCache)]
    assert oiq[0].q_end > cfg.sink_tokens and oiq[0].k.mean is not None
    for c in reused:
        c.trim(c.offset - len(shared))
    got = greedy(second[len(shared):], reused)  # the suffix only, as mlx-lm's server feeds it
    assert got == greedy(second, make_oiq_cache(model, cfg))


def test_stacked_batch_decode_estimates_like_each_sequence_alone():
    """In a decoding batch stacked across sequences, a short sequence reaches its first block
    while stacked: it estimates its statistics and centers its rows as it would alone."""
    from oiq_mlx.cache.attention import oiq_batch_attention

    cfg = CONFIGS["3bit-clip-scaled"]
    lengths = (3, 10, 40)
    alone = [OIQKVCache(cfg) for _ in lengths]
    joined = [OIQKVCache(cfg) for _ in lengths]
    for i, n in enumerate(lengths):
        kv = mx.random.normal((1, H, n, D), key=mx.random.key(i)) + 1
        for c in (alone[i], joined[i]):
            c.update_and_fetch(kv, kv * 0.5)
            c.release_fresh()
    assert [c.k.mean is None for c in joined] == [True, True, False]
    batch = OIQKVCache.merge(joined)
    for t in range(25):
        rows = [mx.random.normal((1, H, 1, D), key=mx.random.key(100 + 10 * t + i)) + 1 for i in range(3)]
        batch.update_and_fetch(mx.concatenate(rows), mx.concatenate(rows) * 0.5)
        q = mx.random.normal((3, 2 * H, 1, D), key=mx.random.key(500 + t))
        out = oiq_batch_attention(q, batch, scale=D**-0.5)
        assert batch.stacked is not None
        for i, c in enumerate(alone):
            c.update_and_fetch(rows[i], rows[i] * 0.5)
            want = oiq_attention(q[i : i + 1], c, scale=D**-0.5)
            np.testing.assert_allclose(np.array(out[i : i + 1]), np.array(want), atol=1e-5)
    assert all(c.k.mean is not None for c in alone)
    for a, b in zip(alone, batch.stacked.unstack()):
        assert _same_storage(a, b)


def test_positional_mask_applies_the_models_mask_bool_or_additive():
    """The model's mask (over the ``offset`` positions) is carried onto the segments' columns,
    packed and full-precision copies of a row alike."""
    cfg = CONFIGS["4bit"]
    k, v, _ = _data()
    cache = OIQKVCache(cfg)
    cache.update_and_fetch(k[:, :, :30], v[:, :, :30])
    cache.release_fresh()
    cache.update_and_fetch(k[:, :, 30:40], v[:, :, 30:40])  # packs rows this call's queries attend
    L, offset = 10, cache.offset
    causal = np.array(cache.positional_mask("causal", L))
    hide = np.ones((1, 1, L, offset), bool)
    hide[..., 5] = False  # position 5: in the packed segment now
    got = np.array(cache.positional_mask(mx.array(hide), L))
    start = cache._attend_from
    cols = np.concatenate([np.arange(cfg.sink_tokens), np.arange(cfg.sink_tokens, cache.q_end), np.arange(start, offset)])
    assert np.array_equal(got, causal & (cols != 5))
    additive = np.where(hide, 0.0, -np.inf).astype(np.float32)
    add = np.array(cache.positional_mask(mx.array(additive), L))
    assert np.array_equal(add, np.where(got, 0.0, -np.inf))
    cache.release_fresh()


def test_a_model_call_builds_the_positional_mask_once_for_all_layers(monkeypatch):
    """Every layer of a call has the same positions: the host-built columns of the
    positional mask are built by the first layer and reused by the others."""
    model = tiny_llama()
    assert len(model.layers) > 1
    cfg = OIQConfig(window=8, sink_tokens=2, positional=True)
    builds = []
    real = OIQKVCache._positional_columns
    monkeypatch.setattr(OIQKVCache, "_positional_columns", lambda self, *a: builds.append(a) or real(self, *a))
    cache = make_oiq_cache(model, cfg)
    model(mx.array([list(range(1, 41))]), cache=cache)  # packs rows its own queries attend
    assert len(builds) == 1
    model(mx.array([list(range(41, 61))]), cache=cache)
    assert len(builds) == 2
