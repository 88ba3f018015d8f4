"""Bad input stays local, edge cases behave as mlx-lm's caches, and models OIQ
cannot serve are refused."""

import importlib
import math
import textwrap

import mlx.core as mx
import pytest
from helpers import reference_attention, tiny_gemma3, tiny_llama
from mlx_lm.models import gemma2, plamo2
from mlx_lm.models.cache import KVCache

from oiq_mlx.cache.attention import oiq_attention
from oiq_mlx.cache.sequence import OIQKVCache
from oiq_mlx.core.codec import dequantize, quantize
from oiq_mlx.core.config import MAX_TOKENS, OIQConfig
from oiq_mlx.mlx_lm.caches import make_oiq_cache
from oiq_mlx.mlx_lm.routing import unsupported_reason

B, H, D, HEAD = 1, 2, 64, 1  # the bad token is in kv head 1
# first chunk (the prompt, statistics estimated here), a second chunk, then single decode steps
CHUNKS = [100, 50] + [1] * 30
T = sum(CHUNKS)
POSITIONS = {"sink": 1, "first-chunk": 30, "packed": 110, "window": 175}
BAD = {"nan": math.nan, "inf": math.inf, "1e30": 1e30}


def _inputs(bad=None, position=None):
    k1, k2 = mx.random.split(mx.random.key(11))
    keys = mx.random.normal((B, H, T, D), key=k1) * 2 + 0.5
    values = mx.random.normal((B, H, T, D), key=k2)
    if bad is not None:
        hit = (mx.arange(H)[:, None, None] == HEAD) & (mx.arange(T)[:, None] == position) & (mx.arange(D) == 7)
        keys, values = (mx.where(hit, bad, x) for x in (keys, values))
    return keys, values


def _fill(cfg, keys, values):
    cache = OIQKVCache(cfg)
    start = 0
    for L in CHUNKS:
        cache.update_and_fetch(keys[:, :, start : start + L], values[:, :, start : start + L])
        start += L
    return cache


def _continue(cache, n=80):
    """Attention outputs of a clean continuation (a chunk, then decode steps), and
    the exact (fp32) outputs over the clean keys/values."""
    k1, k2, k3 = mx.random.split(mx.random.key(12), 3)
    keys = mx.random.normal((B, H, n, D), key=k1)
    values = mx.random.normal((B, H, n, D), key=k2)
    queries = mx.random.normal((B, 2 * H, n, D), key=k3)
    prefix_k, prefix_v = (x[:, :, : cache.offset] for x in _inputs())
    outs, exact, start = [], [], 0
    for L in (n - 8,) + (1,) * 8:
        cache.update_and_fetch(keys[:, :, start : start + L], values[:, :, start : start + L])
        q = queries[:, :, start : start + L]
        outs.append(oiq_attention(q, cache, D**-0.5, "causal" if L > 1 else None))
        start += L
        exact.append(reference_attention(q, mx.concatenate([prefix_k, keys[:, :, :start]], 2),
                                         mx.concatenate([prefix_v, values[:, :, :start]], 2), D**-0.5))
    return mx.concatenate(outs, axis=2), mx.concatenate(exact, axis=2)


@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("preset", ["4bit", "3bit", "2bit"])
def test_non_finite_input_stays_in_its_token_and_head(preset, position):
    """NaN, Inf and 1e30 in one coordinate of one token of one head, at a sink, a
    first-chunk (statistics), a packed and a window position: every other head is
    bit-identical to the clean cache, every other token of that head finite (and
    bit-identical unless the token was in the chunk the statistics come from, which
    then leave it out), and trimming the token restores finite attention."""
    # POSITIONS are laid out for a 64-token window and statistics from the first chunk alone (with
    # exact_prefill they would come from both chunks: test_statistics_ignore_bad_rows covers that)
    cfg = OIQConfig.preset(preset, window=64, exact_prefill=0)
    p = POSITIONS[position]
    clean = _fill(cfg, *_inputs())
    ck, cv = clean.dequantized_kv()
    truth_k, truth_v = _inputs()
    others = mx.array([t for t in range(T) if t != p])
    for name, bad in BAD.items():
        cache = _fill(cfg, *_inputs(bad, p))
        assert cache.q_end > POSITIONS["packed"] and cache.q_end < POSITIONS["window"]
        for got, want, truth in zip(cache.dequantized_kv(), (ck, cv), (truth_k, truth_v)):
            assert mx.array_equal(got[:, :HEAD], want[:, :HEAD]), (name, "another head changed")
            rest, rest_clean, rest_truth = (x[:, HEAD, others] for x in (got, want, truth))
            assert mx.all(mx.isfinite(rest)).item(), (name, "another token of the head is not finite")
            if position == "first-chunk":
                # statistics from one row fewer: the other tokens stay as accurate as in the clean
                # cache, in RMS error; the largest single error may move more (5-bit keys: 1.21x
                # with an RMS ratio of 0.999), so it only has to stay of the same size
                err, clean_err = (float(mx.sqrt(mx.mean((x - rest_truth) ** 2))) for x in (rest, rest_clean))
                assert err < 1.05 * clean_err, (name, err, clean_err)
                top, clean_top = (float(mx.abs(x - rest_truth).max()) for x in (rest, rest_clean))
                assert top < 1.5 * clean_top, (name, top, clean_top)
            else:
                assert mx.array_equal(rest, rest_clean), (name, "another token of the head changed")
            assert not mx.array_equal(got[:, HEAD, p], want[:, HEAD, p])
        for side in (cache.k, cache.v):
            for stat in (side.mean, side.lam):
                assert stat is None or mx.all(mx.isfinite(stat)).item()
        assert cache.trim(T - p) == T - p
        restored, exact = _continue(cache)
        reference, _ = _continue(_trimmed(cfg, T - p))
        assert mx.all(mx.isfinite(restored)).item(), name
        if position == "first-chunk":
            err, clean_err = (float(mx.mean(mx.abs(x - exact))) for x in (restored, reference))
            assert err < 1.2 * clean_err, (name, err, clean_err)
        else:
            assert mx.array_equal(restored, reference), name


def _trimmed(cfg, n):
    cache = _fill(cfg, *_inputs())
    cache.trim(n)
    return cache


def test_statistics_ignore_bad_rows_and_cannot_overflow():
    """Rows with a non-finite value or one beyond float16 range are left out of the
    mean and key scales; a head with no usable row gets mean 0 and scale 1."""
    x = mx.random.normal((1, 2, 40, 64), key=mx.random.key(2)) + 3.0
    bad = mx.where((mx.arange(40)[:, None] == 5) & (mx.arange(64) == 0), 1e30, x)
    for rows in (x, bad):
        c = OIQKVCache(OIQConfig(sink_tokens=0, window=0))
        c.update_and_fetch(rows, rows)
        c.end_prefill()  # exact_prefill: estimated here, on the rows the prompt left waiting
        if rows is x:
            mean = c.k.mean
        else:
            c2 = OIQKVCache(OIQConfig(sink_tokens=0, window=0))
            kept = mx.concatenate([x[:, :, :5], x[:, :, 6:]], axis=2)
            c2.update_and_fetch(kept, kept)
            c2.end_prefill()
            assert mx.allclose(c.k.mean, c2.k.mean, atol=1e-5) and mx.allclose(c.k.lam, c2.k.lam, atol=1e-5)
            assert not mx.allclose(c.k.mean, mean, atol=1e-3)
    hopeless = mx.full((1, 1, 8, 64), mx.nan)
    c = OIQKVCache(OIQConfig(sink_tokens=0, window=0))
    c.update_and_fetch(hopeless, hopeless)
    c.end_prefill()
    assert mx.array_equal(c.k.mean, mx.zeros_like(c.k.mean)) and mx.array_equal(c.k.lam, mx.ones_like(c.k.lam))


@pytest.mark.parametrize("clip", [False, True])
def test_quantize_huge_and_non_finite_groups_stay_in_their_group(clip):
    """The clip search over a group holding 1e30 (whose squared error overflows
    float32) picks the saturated float16 scale, and no other group changes."""
    y = mx.random.normal((4, 128), key=mx.random.key(3))
    codes, scales = quantize(y, 3, 32, clip=clip)
    for bad in (1e30, -3e38, math.inf, math.nan):
        yb = mx.where((mx.arange(4)[:, None] == 2) & (mx.arange(128) == 40), bad, y)
        cb, sb = quantize(yb, 3, 32, clip=clip)
        others = mx.array([0, 1, 3])
        assert mx.array_equal(cb[others], codes[others]) and mx.array_equal(sb[others], scales[others])
        assert mx.array_equal(sb[2, mx.array([0, 2, 3])], scales[2, mx.array([0, 2, 3])])
        if math.isfinite(bad):
            assert float(sb[2, 1]) == 65504.0
            assert mx.all(mx.isfinite(dequantize(cb, sb, 3, 32))).item()
        else:
            assert math.isnan(float(sb[2, 1]))


def test_empty_updates_are_accepted_at_any_time():
    """L = 0 writes (first included) store nothing, as mlx-lm's KVCache, and leave the
    cache exactly as without them; zero queries give an empty output."""
    keys = mx.random.normal((1, 2, 90, 64), key=mx.random.key(4))
    q = mx.random.normal((1, 4, 1, 64), key=mx.random.key(5))
    empty = keys[:, :, :0]
    plain, with_empty = OIQKVCache(), OIQKVCache()
    assert with_empty.update_and_fetch(empty, empty) == (with_empty, with_empty)
    fp = KVCache()
    fp.update_and_fetch(empty, empty)
    assert with_empty.offset == fp.offset == 0 and not with_empty.empty() and not fp.empty()
    assert oiq_attention(q[:, :, :0], with_empty, 0.125).shape == (1, 4, 0, 64)
    with pytest.raises(ValueError, match="no key to attend to"):
        oiq_attention(q, with_empty, 0.125)
    restored = OIQKVCache.from_state(with_empty.state)
    for cache in (plain, with_empty, restored):
        for a, b in ((0, 70), (70, 70), (70, 71), (71, 71), (71, 90)):
            cache.update_and_fetch(keys[:, :, a:b], keys[:, :, a:b])
    out = [oiq_attention(q, c, 0.125) for c in (plain, with_empty, restored)]
    assert mx.array_equal(out[0], out[1]) and mx.array_equal(out[0], out[2])
    for x, y in zip(plain.state[:-1], with_empty.state[:-1]):
        assert (x is None and y is None) or mx.array_equal(x, y)


@pytest.mark.parametrize("field", ["sink_tokens", "window", "trim_reserve"])
def test_token_counts_are_bounded(field):
    with pytest.raises(ValueError, match=f"{field} must be <= {MAX_TOKENS}, got 1000000000"):
        OIQConfig(**{field: 10**9})
    assert getattr(OIQConfig(**{field: MAX_TOKENS}), field) == MAX_TOKENS


def test_buffers_are_sized_to_what_is_held():
    """A huge sink_tokens (or window) costs only the tokens held."""
    keys = mx.random.normal((1, 2, 5, 64), key=mx.random.key(6))
    for cfg in (OIQConfig(sink_tokens=100_000), OIQConfig(sink_tokens=MAX_TOKENS), OIQConfig(window=MAX_TOKENS)):
        c = OIQKVCache(cfg)
        c.update_and_fetch(keys, keys)
        assert c.nbytes < 300_000, (cfg, c.nbytes)  # 5 tokens, at most one 256-row step per buffer
        assert mx.allclose(c.dequantized_kv()[0], keys, atol=1e-5)  # all 5 held in full precision


def _tiny_gemma2():
    mx.random.seed(0)
    args = gemma2.ModelArgs(model_type="gemma2", hidden_size=64, num_hidden_layers=2, intermediate_size=64,
                            num_attention_heads=2, head_dim=32, rms_norm_eps=1e-5, vocab_size=32,
                            num_key_value_heads=1)
    return gemma2.Model(args)


def _tiny_plamo2():
    mx.random.seed(0)
    args = plamo2.ModelArgs(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                            hidden_size_per_head=32, mamba_d_state=8, mamba_num_heads=2, intermediate_size=64,
                            vocab_size=32, mamba_chunk_size=16)
    return plamo2.Model(args)


@pytest.mark.parametrize("build,model_type,why", [
    (_tiny_gemma2, "gemma2", r"Attention.__call__ uses `keys` as an array: `mx.expand_dims\(keys, 2\)`"),
    (_tiny_plamo2, "plamo2", r"calls mx.fast.scaled_dot_product_attention itself"),
])
def test_models_oiq_cannot_serve_are_refused(build, model_type, why):
    """gemma2 computes attention from the returned keys itself; plamo2 calls
    mx.fast attention itself: both are refused by name, before any forward pass."""
    model = build()
    with pytest.raises(ValueError, match=f"cannot serve model type '{model_type}': .*{why}"):
        make_oiq_cache(model)


def test_supported_models_pass_the_check():
    for model in (tiny_llama(), tiny_gemma3()):
        assert unsupported_reason(model) is None


def test_attention_through_another_function_of_that_name_is_refused(tmp_path, monkeypatch):
    """A model module with its own ``scaled_dot_product_attention`` is never routed to OIQ."""
    (tmp_path / "own_attention.py").write_text(textwrap.dedent("""
        import mlx.core as mx
        from mlx_lm.models import llama

        def scaled_dot_product_attention(queries, keys, values, cache, scale, mask):
            return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)

        class Attention(llama.Attention):
            def __call__(self, x, mask=None, cache=None):
                B, L, _ = x.shape
                q, k, v = (p(x).reshape(B, L, n, -1).transpose(0, 2, 1, 3) for p, n in (
                    (self.q_proj, self.n_heads), (self.k_proj, self.n_kv_heads), (self.v_proj, self.n_kv_heads)))
                keys, values = cache.update_and_fetch(k, v)
                out = scaled_dot_product_attention(q, keys, values, cache=cache, scale=self.scale, mask=mask)
                return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    own = importlib.import_module("own_attention")
    model = tiny_llama()
    for layer in model.layers:
        layer.self_attn.__class__ = own.Attention
    with pytest.raises(ValueError, match="own_attention has its own scaled_dot_product_attention"):
        make_oiq_cache(model)
