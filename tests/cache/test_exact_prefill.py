"""``OIQConfig.exact_prefill``: a prompt prefilled in chunks is stored and read as the
same prompt written in one call (README "Needle in a haystack")."""

import json

import mlx.core as mx
import numpy as np
import pytest
from helpers import chunk_data, run_chunks, stored_arrays, tiny_llama
from mlx_lm.generate import generate_step

from oiq_mlx import OIQConfig, OIQKVCache, make_oiq_cache
from oiq_mlx.cache.files import digest

H, D, N = 2, 64, 90
BASE = dict(window=8, sink_tokens=2, trim_reserve=4)
PLAIN = dict(BASE, exact_prefill=0)  # chunks read earlier chunks packed


def _data(seed=0):
    return chunk_data(seed, H, N, D)


def _run(cfg, chunks, data, cache=None, start=0):
    return run_chunks(cache or OIQKVCache(cfg), chunks, data, start)


def _assert_same_storage(a, b):
    x, y = stored_arrays(a), stored_arrays(b)
    assert len(x) == len(y)
    for u, w in zip(x, y):
        assert u.shape == w.shape and mx.array_equal(u, w).item()
    assert (a.offset, a.q_end) == (b.offset, b.q_end)


@pytest.mark.parametrize("preset", ["4bit", "3bit", "2bit"])
@pytest.mark.parametrize("chunks", [[30, 29, 30], [2, 50, 37], [88, 1]])
def test_chunked_prefill_is_stored_and_read_as_one_call(preset, chunks):
    """Chunks of a prompt, then one-token steps: every chunk attends the earlier ones
    exactly (its output is the one-call prompt's, up to the matmul's rounding), and from
    the first one-token step on the cache stores and returns bit for bit what a cache
    given the whole prompt in one call does, statistics (from the whole prompt) included."""
    data = _data()
    cfg = OIQConfig.preset(preset, **BASE, exact_prefill=N)
    prompt = sum(L for L in chunks if L > 1)  # a one-token call ends the prefill
    one, out_one = _run(OIQConfig.preset(preset, **PLAIN), [prompt] + [1] * (N - prompt), data)
    chunked, out_chunked = _run(cfg, [L for L in chunks if L > 1], data)
    assert chunked.prefilling and chunked.q_end == cfg.sink_tokens  # nothing packed yet
    np.testing.assert_allclose(np.array(out_chunked), np.array(out_one[:, :, :prompt]), atol=2e-5)
    # the one-token steps: the first packs the prompt, then reads it as the one-call cache does
    _, steps = _run(cfg, [1] * (N - prompt), data, chunked, start=prompt)
    assert not chunked.prefilling
    assert mx.array_equal(steps, out_one[:, :, prompt:]).item()
    _assert_same_storage(chunked, one)


def test_a_chunk_past_the_cap_packs_what_waited():
    """exact_prefill=40: two chunks of 20 wait; the chunk that would take the cache past 40
    first packs them with statistics from those 40 rows, as a cache given them in one
    call, attending them exactly as that cache's next chunk does."""
    data = _data(1)
    cfg = OIQConfig(**BASE, exact_prefill=40)
    capped, out_capped = _run(cfg, [20, 20, 30, 1], data)
    plain, out_plain = _run(OIQConfig(**PLAIN), [40, 30, 1], data)
    _assert_same_storage(capped, plain)
    np.testing.assert_allclose(np.array(out_capped[:, :, 40:]), np.array(out_plain[:, :, 40:]), atol=2e-5)
    # a prompt longer than the cap in its first call is packed as without exact_prefill
    long, _ = _run(cfg, [60, 1], data)
    _assert_same_storage(long, _run(OIQConfig(**PLAIN), [60, 1], data)[0])


def test_end_prefill_frees_the_full_precision_rows():
    data = _data(2)
    cache, _ = _run(OIQConfig(**BASE, exact_prefill=100), [45, 44], data)
    held = cache.nbytes
    cache.end_prefill()
    plain = _run(OIQConfig(**PLAIN), [89], data)[0]
    assert cache.nbytes == plain.nbytes < held and not cache.prefilling
    _assert_same_storage(cache, plain)
    cache.end_prefill()  # a no-op once ended
    assert cache.q_end == OIQConfig(**PLAIN).sink_tokens + (89 - 2 - 8) // 8 * 8


def test_state_saved_mid_prefill_continues_as_if_never_saved():
    data = _data(3)
    cfg = OIQConfig(**BASE, exact_prefill=N)
    saved, _ = _run(cfg, [40, 30], data)
    loaded = OIQKVCache()
    loaded.state = saved.state
    assert loaded.prefilling
    a, out_a = _run(cfg, [19, 1], data, loaded, start=70)
    b, out_b = _run(cfg, [40, 30, 19, 1], data)
    assert mx.array_equal(out_a, out_b[:, :, 70:]).item()
    _assert_same_storage(a, b)
    # after the prefill the flag is not saved: a loaded cache stays packed-as-it-goes
    again = OIQKVCache()
    again.state = a.state
    assert not again.prefilling


def test_prefilling_flag_is_checked_on_load():

    def flagged(cache):
        state = list(cache.state)
        meta = json.loads(state[-1])
        meta["prefilling"] = True
        meta["digest"] = digest(meta)
        return state[:-1] + [json.dumps(meta)]

    packed, _ = _run(OIQConfig(**BASE, exact_prefill=N), [40, 30, 1], _data(4))  # rows packed: the flag lies
    waiting, _ = _run(OIQConfig(**PLAIN), [40], _data(4))  # a config without exact_prefill
    for cache in (packed, waiting):
        with pytest.raises(ValueError, match="prefilling"):
            OIQKVCache().state = flagged(cache)


def test_exact_prefill_is_the_presets_and_has_no_effect_with_positional():
    assert OIQConfig().exact_prefill == 16384
    assert all(OIQConfig.preset(p).exact_prefill == 16384 for p in ("4bit", "3bit", "2bit"))
    assert not OIQKVCache(OIQConfig(positional=True)).prefilling and OIQKVCache(OIQConfig()).prefilling
    with pytest.raises(ValueError, match="exact_prefill"):
        OIQConfig(exact_prefill=-1)
    assert OIQConfig.from_json(OIQConfig(exact_prefill=8).to_json()).exact_prefill == 8
    # a config written before the field existed did what 0 does
    old = json.loads(OIQConfig().to_json())
    del old["exact_prefill"]
    assert OIQConfig.from_json(json.dumps(old)).exact_prefill == 0


@pytest.mark.filterwarnings("ignore:oiq_mlx")
def test_generation_with_chunked_prefill_equals_one_chunk():
    """mlx-lm's generate_step with 16-token prefill chunks gives the tokens (and the
    stored cache) a one-call prefill gives."""
    model = tiny_llama()
    prompt = mx.array([(5 * j) % 120 + 1 for j in range(75)])
    cfg = OIQConfig(**BASE, exact_prefill=4096)

    def run(step_size, config):
        cache = make_oiq_cache(model, config)
        toks = [int(t) for t, _ in zip((t for t, _ in generate_step(prompt, model, max_tokens=12, prompt_cache=cache,
                                                                      prefill_step_size=step_size)), range(12))]
        return toks, cache

    want, one = run(4096, OIQConfig(**PLAIN))
    got, chunked = run(16, cfg)
    assert got == want
    for a, b in zip(chunked, one):
        # the same rows up to the rounding of matmuls over chunks of another length (~1e-6),
        # which can move a coordinate to the neighbouring code in a row or two
        assert (a.offset, a.q_end, a.prefilling) == (b.offset, b.q_end, False)
        np.testing.assert_allclose(np.array(a.k.mean), np.array(b.k.mean), atol=1e-5)
        for x, y in zip(a.dequantized_kv(), b.dequantized_kv()):
            x, y = np.array(x), np.array(y)
            assert (np.abs(x - y).max(axis=-1) > 1e-4).sum() <= 2
            np.testing.assert_allclose(x, y, atol=0.02)
    # without exact_prefill the 16-token chunks read earlier chunks packed: another cache
    plain = run(16, OIQConfig(**PLAIN))[1]
    assert not np.allclose(np.array(plain[0].k.mean), np.array(one[0].k.mean), atol=1e-3)


@pytest.mark.parametrize("preset", ["4bit", "2bit"])
@pytest.mark.parametrize("piece", [7, 16, 61])
def test_a_prompt_packed_in_pieces_is_packed_as_in_one_pass(monkeypatch, preset, piece):
    """end_prefill and a long call pack in pieces of PIECE_ROWS rows, each evaluated before the
    next (prefill.py): the codes and scales are those of one pass over all rows, which pieces
    larger than the prompt give."""
    import oiq_mlx.cache.sequence as sequence

    data = _data(4)
    cfg = OIQConfig.preset(preset, **BASE, exact_prefill=N)
    monkeypatch.setattr(sequence, "PIECE_ROWS", 10**6)
    whole, out_whole = _run(cfg, [40, 40, 1, 1], data)
    monkeypatch.setattr(sequence, "PIECE_ROWS", piece)
    pieces, out_pieces = _run(cfg, [40, 40, 1, 1], data)
    assert pieces.q_end > cfg.sink_tokens + 4 * piece or piece == 61  # several pieces were packed
    assert mx.array_equal(out_pieces, out_whole).item()
    _assert_same_storage(pieces, whole)
    # a call past exact_prefill packs its own rows in pieces too
    plain = OIQConfig.preset(preset, **PLAIN)
    monkeypatch.setattr(sequence, "PIECE_ROWS", 10**6)
    whole = _run(plain, [N], data)[0]
    monkeypatch.setattr(sequence, "PIECE_ROWS", piece)
    _assert_same_storage(_run(plain, [N], data)[0], whole)
