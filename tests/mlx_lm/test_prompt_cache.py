"""The server's prompt cache (oiq_mlx/mlx_lm/prompt_cache.py) and its packed entries
(oiq_mlx/cache/entries.py), on a small random Llama: an entry is what the cache becomes once its
prefill ends, in compact buffers; by default a chat keeps one entry, its checkpoints dropped and
served by trimming it back; kept checkpoints (``keep_checkpoints``) hold views of the packed rows of
the sequence they prefix only when they are bit-identical, and take them back when that sequence
leaves; the bytes counted are the bytes held (measured with MLX's allocator); the byte bound holds."""

import copy
import gc

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from helpers import stored_arrays, tiny_llama
from oiq_mlx import OIQConfig, make_oiq_cache
from oiq_mlx.cache.entries import packed_entry, packed_rows
from oiq_mlx.mlx_lm.caches import float16_model_bytes, kv_memory
from oiq_mlx.mlx_lm.prompt_cache import OIQPromptCache

TOKENS = [int(x) for x in np.random.default_rng(0).integers(0, 128, 1300)]
POSITIONAL = OIQConfig.preset("4bit", window=16, positional=True)


def _leaving(cut: int, n: int) -> list:
    """A prompt that leaves TOKENS after its first ``cut``: ``n`` tokens of the model's vocabulary
    (128) that differ from TOKENS at ``cut`` (an id outside it would read past the embedding
    table, whatever memory lies there)."""
    return TOKENS[:cut] + [(TOKENS[cut] + 1 + i) % 128 for i in range(n)]


@pytest.fixture(scope="module")
def model():
    return tiny_llama(layers=2)


def _feed(model, cache, tokens, chunk=256):
    """Write ``tokens`` in calls of ``chunk`` (one-token calls for ``chunk=1``); the last logits."""
    y = None
    for a in range(0, len(tokens), chunk):
        y = model(mx.array(tokens[a : a + chunk])[None], cache=cache)
    mx.eval([c.state for c in cache])
    return y


def _arrays(cache: list) -> list:
    return [np.array(a) for c in cache for a in stored_arrays(c)]


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and np.array_equal(x, y) for x, y in zip(a, b))


def _conversation(model, cfg, tokens, checkpoint: int, prompt_cache, model_key="m"):
    """As the server: the prompt written in chunks, the checkpoint inserted after its first
    ``checkpoint`` tokens, the rest, one generated token, the finished sequence inserted."""
    live = make_oiq_cache(model, cfg)
    _feed(model, live, tokens[:checkpoint])
    prompt_cache.insert_cache(model_key, tokens[:checkpoint], live, cache_type="user")
    _feed(model, live, tokens[checkpoint:-1])
    _feed(model, live, tokens[-1:], chunk=1)
    prompt_cache.insert_cache(model_key, tokens, live, cache_type="assistant")
    return live


def _active_memory() -> int:
    gc.collect()
    return mx.get_active_memory()


@pytest.mark.parametrize("preset", ["4bit", "3bit"])
def test_an_entry_of_a_prefilling_cache_is_what_its_prefill_ends_in(model, preset):
    """exact_prefill keeps a prompt in full precision; its entry is packed, bit for bit as the
    same cache once its own prefill ends, and the live cache goes on as if no entry was taken."""
    cfg = OIQConfig.preset(preset, window=16)
    live, ref = make_oiq_cache(model, cfg), make_oiq_cache(model, cfg)
    for c in (live, ref):
        _feed(model, c, TOKENS[:300], chunk=128)
    before = _arrays(live)
    entry = [packed_entry(c) for c in live]
    assert all(c.prefilling for c in live) and _same(_arrays(live), before)
    assert not any(e.prefilling for e in entry)
    for c in ref:
        c.end_prefill()
    assert _same(_arrays(entry), _arrays(ref))
    assert [(e.offset, e.q_end, e.recent_start) for e in entry] == [(c.offset, c.q_end, c.recent_start) for c in ref]
    mem = kv_memory(entry)
    assert mem["held"] < 0.45 * kv_memory(live)["held"]  # the live cache holds the prompt in float32
    # the live sequence ends its own prefill at its next token; an entry served from the prompt
    # cache goes on from there identically
    for t in TOKENS[300:303]:
        a, b = (model(mx.array([[t]]), cache=c) for c in (live, entry))
        assert np.array_equal(np.array(a), np.array(b))
    assert _same(_arrays(live), _arrays(entry))


@pytest.mark.parametrize("positional", [True, False])
def test_an_entry_holds_exactly_its_rows(model, positional):
    cfg = OIQConfig.preset("4bit", window=16, positional=positional)
    live = make_oiq_cache(model, cfg)
    _feed(model, live, TOKENS[:333], chunk=100)
    _feed(model, live, TOKENS[333:341], chunk=1)
    entry = [packed_entry(c) for c in live]
    for e in entry:
        s = e.config.sink_tokens
        assert [b.shape[3] for b in e.packed_buffers()] == [packed_rows(e)] * 2 == [e.q_end - s] * 2
        assert e.k.recent.shape[2] == e.offset - e.recent_start
        assert e.recent_start == e.q_end - e.reserve  # the block packed last is dropped
        assert e.k.sink.shape[2] == s
        # nothing but the rows in use: the state (trimmed to them) is every byte held
        assert e.nbytes == sum(a.nbytes for a in stored_arrays(e))
    assert kv_memory(entry)["held"] < kv_memory(live)["held"]
    # a float32 model's full-precision rows at 2 bytes a value
    assert float16_model_bytes(entry) < kv_memory(entry)["held"]
    assert float16_model_bytes(make_prompt_cache(model)) == 0


def test_a_checkpoint_shares_the_rows_of_the_sequence_it_prefixes_and_bytes_are_what_is_held(model):
    """Checkpoint at 900 tokens, finished sequence at 1200: the checkpoint holds views of the
    finished entry's packed rows, counted once; when the finished entry is evicted the checkpoint
    takes its rows back (a copy: the finished entry's buffers are freed) and is counted at them.
    MLX's allocator agrees with the count at each step."""
    warm = OIQPromptCache(keep_checkpoints=True)  # the same steps once: compiles and caches what MLX keeps
    _conversation(model, POSITIONAL, TOKENS[:1200], 900, warm)
    warm.trim_to(n_sequences=1)
    del warm
    m0 = _active_memory()
    pc = OIQPromptCache(keep_checkpoints=True)
    live = _conversation(model, POSITIONAL, TOKENS[:1200], 900, pc)
    del live
    mem = pc.memory()
    user, finished = mem["items"]
    assert (user["type"], user["tokens"], finished["tokens"]) == ("user", 900, 1200)
    assert user["bytes"] < 0.3 * finished["bytes"] and user["shared_bytes"] > 2 * user["bytes"]
    assert mem["bytes"] == pc.nbytes == user["bytes"] + finished["bytes"]
    assert mem["fp16_bytes"] == finished["fp16_bytes"]  # the checkpoint's tokens are inside the finished one
    held = _active_memory() - m0
    assert abs(held - pc.nbytes) < 0.05 * pc.nbytes + 16384, (held, pc.nbytes)
    checkpoint = pc.held_entries()[0]
    rows = _arrays(checkpoint.prompt_cache)

    pc.trim_to(n_sequences=1)  # mlx-lm's LRU order evicts the finished sequence first
    mem = pc.memory()
    (alone,) = mem["items"]
    assert (alone["type"], alone["shared_bytes"]) == ("user", 0)
    assert alone["bytes"] == user["bytes"] + user["shared_bytes"] == pc.nbytes
    assert _same(_arrays(checkpoint.prompt_cache), rows)
    held = _active_memory() - m0
    assert abs(held - pc.nbytes) < 0.05 * pc.nbytes + 16384, (held, pc.nbytes)


def test_sharing_in_either_order_and_a_chain_handed_over(model):
    """Entries of 300, 600 and 1000 tokens of one sequence, the longest inserted first: both
    shorter ones hold views of its rows.  When it goes, the 600-token entry takes a copy and the
    300-token one holds views of that; each serves what a cache that never was in the prompt
    cache serves."""
    pc = OIQPromptCache()
    live = make_oiq_cache(model, POSITIONAL)
    states, start = {}, 0
    for n in (300, 600, 1000):
        _feed(model, live, TOKENS[start:n])
        states[n], start = [packed_entry(c) for c in live], n
    for n in (1000, 600, 300):
        pc.insert_cache("m", TOKENS[:n], states[n])
    by_tokens = {len(e.tokens): e for e in pc.held_entries()}
    assert by_tokens[600].owner is by_tokens[1000] and by_tokens[300].owner is by_tokens[1000]
    assert pc.nbytes == sum(i["bytes"] for i in pc.memory()["items"])
    before = {n: _arrays(by_tokens[n].prompt_cache) for n in (300, 600)}

    pc.trim_to(n_sequences=2)  # the oldest (the 1000-token entry) goes
    assert by_tokens[600].owner is None and by_tokens[300].owner is by_tokens[600]
    assert by_tokens[600].sharers == [by_tokens[300]]
    items = {i["tokens"]: i for i in pc.memory()["items"]}
    assert items[600]["shared_bytes"] == 0 < items[300]["shared_bytes"]
    assert pc.nbytes == items[300]["bytes"] + items[600]["bytes"]
    for n in (300, 600):
        assert _same(_arrays(by_tokens[n].prompt_cache), before[n])
        cache, rest = pc.fetch_nearest_cache("m", TOKENS[: n + 5])
        assert len(rest) == 5
        fresh = make_oiq_cache(model, POSITIONAL)  # written in the calls the live cache took
        for a, z in ((0, 300), (300, 600))[: n // 300]:
            _feed(model, fresh, TOKENS[a:z])
        for t in TOKENS[n : n + 5]:
            a, b = (model(mx.array([[t]]), cache=c) for c in (cache, fresh))
            assert np.array_equal(np.array(a), np.array(b))


def test_rows_are_shared_only_when_bit_identical(model):
    """Without positional, a checkpoint's statistics come from its own rows: a checkpoint one
    token short of the prompt (where the server takes it) packs the rows the finished sequence
    packs, and shares them; one taken mid-prompt packs other codes, and keeps its own."""
    cfg = OIQConfig.preset("4bit", window=16)
    pc = OIQPromptCache(keep_checkpoints=True)
    _conversation(model, cfg, TOKENS[:500], 499, pc, model_key="a")
    _conversation(model, cfg, TOKENS[:500], 300, pc, model_key="b")
    items = pc.memory()["items"]
    assert [(i["type"], i["tokens"], i["shared_bytes"] > 0) for i in items] == [
        ("user", 499, True), ("assistant", 500, False), ("user", 300, False), ("assistant", 500, False)]
    assert pc.nbytes == sum(i["bytes"] for i in items)


@pytest.mark.parametrize("keep", [False, True])
def test_the_byte_bound_holds_at_every_insertion(model, keep):
    """Conversations of 600 tokens under a bound of two and a half conversations (one entry, or the
    checkpoint and the finished sequence with ``keep_checkpoints``):
    the bound holds after every insertion (mlx-lm applies it only when a request joins the batch),
    the newest conversations are kept, the count is what the entries hold; full-precision caches
    of the same conversations, under the same bound, keep fewer."""
    one = OIQPromptCache(keep_checkpoints=keep)
    _conversation(model, POSITIONAL, TOKENS[:600], 599, one)
    assert len(one.held_entries()) == (2 if keep else 1)
    bound = int(2.5 * one.nbytes)
    pc = OIQPromptCache(max_size=100, max_bytes=bound, keep_checkpoints=keep)
    for i in range(5):
        tokens = [i] + TOKENS[i * 100 : i * 100 + 599]
        _conversation(model, POSITIONAL, tokens, 599, pc)
        assert pc.nbytes <= bound
        assert pc.nbytes == sum(it["bytes"] for it in pc.memory()["items"])
    kept = [e.tokens[0] for e in pc.held_entries() if e.cache_type == "assistant"]
    assert kept == [3, 4]

    fp = OIQPromptCache(max_size=100, max_bytes=bound)
    for i in range(5):
        tokens = [i] + TOKENS[i * 100 : i * 100 + 599]
        cache = make_prompt_cache(model)
        _feed(model, cache, tokens[:599])
        fp.insert_cache("m", tokens[:599], copy.deepcopy(cache), cache_type="user")
        _feed(model, cache, tokens[599:], chunk=1)
        fp.insert_cache("m", tokens, copy.deepcopy(cache), cache_type="assistant")
        assert fp.nbytes <= bound
    assert len(fp.held_entries()) < len(kept)
    # mlx-lm's own handling of caches it can trim: the finished sequence replaces its checkpoint
    assert {e.cache_type for e in fp.held_entries()} <= {"assistant"}


def test_kept_checkpoints_and_a_longer_entry_trimmed_only_exactly(model):
    """With ``keep_checkpoints``, a prompt that leaves a cached sequence deeper than the trim
    reserve is served from the checkpoint, not from an inexact trim of the longer entry."""
    pc = OIQPromptCache(keep_checkpoints=True)
    _conversation(model, POSITIONAL, TOKENS[:500], 400, pc)
    cache, rest = pc.fetch_nearest_cache("m", _leaving(450, 3))
    assert cache[0].offset == 400 and len(rest) == 53
    cache, rest = pc.fetch_nearest_cache("m", _leaving(495, 2))
    assert cache[0].offset == 495 and len(rest) == 2  # within the reserve: the trim is exact


def test_a_chat_keeps_one_entry_and_is_trimmed_back(model):
    """By default the finished chat replaces its checkpoint (as mlx-lm keeps trimmable caches):
    the prompt cache holds what the finished sequence holds.  A prompt that leaves the chat is
    served from the chat trimmed back, deeper than the reserve too: the rows packed since the cut
    stay packed, and the next tokens read what that trimmed copy holds."""
    pc = OIQPromptCache()
    _conversation(model, POSITIONAL, TOKENS[:500], 400, pc)
    (finished,) = pc.held_entries()
    assert (finished.cache_type, len(finished.tokens), finished.owner, finished.sharers) == ("assistant", 500, None, [])
    assert pc.nbytes == finished.nbytes == kv_memory(finished.prompt_cache)["held"]
    rows = _arrays(finished.prompt_cache)
    fresh = make_oiq_cache(model, POSITIONAL)  # what a cache holds at 450 tokens
    _feed(model, fresh, TOKENS[:449])
    _feed(model, fresh, TOKENS[449:450], chunk=1)
    for cut in (450, 495):
        cache, rest = pc.fetch_nearest_cache("m", _leaving(cut, 3))
        assert cache[0].offset == cut and len(rest) == 3
        trimmed = copy.deepcopy(finished.prompt_cache)
        for c in trimmed:
            c.trim(500 - cut)
        for t in rest:
            a, b = (model(mx.array([[t]]), cache=c) for c in (cache, trimmed))
            assert np.array_equal(np.array(a), np.array(b))
        assert _same(_arrays(finished.prompt_cache), rows)  # served from a copy
        if cut == 450:  # past the reserve: rows the cache held in full precision at 450 are packed
            assert packed_rows(cache[0]) > packed_rows(fresh[0])
