"""Python API edges: bad constructor arguments, reading an empty cache, and mlx-lm's ``kv_bits``
on caches that are quantized already."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

from helpers import tiny_llama
from oiq_mlx import OIQConfig, OIQKVCache, make_oiq_cache


@pytest.mark.parametrize("kwargs,message", [
    (dict(layer_idx=-1), "layer_idx must be an integer >= 0, got -1"),
    (dict(layer_idx=1.5), "layer_idx must be an integer >= 0, got 1.5"),
    (dict(layer_idx=True), "layer_idx must be an integer >= 0, got True"),
    (dict(head_dim=0), "head_dim must be an integer >= 1, got 0"),
    (dict(head_dim="64"), "head_dim must be an integer >= 1, got '64'"),
])
def test_bad_constructor_arguments_name_the_argument(kwargs, message):
    with pytest.raises(ValueError, match=message):
        OIQKVCache(OIQConfig(), **kwargs)


def test_numpy_integers_are_integers():
    assert OIQKVCache(OIQConfig(), layer_idx=np.int64(3)).layer_idx == 3


def test_keys_must_have_the_head_dim_the_cache_was_made_for():
    cache = OIQKVCache(OIQConfig(), head_dim=64)
    x = mx.zeros((1, 2, 3, 128))
    with pytest.raises(ValueError, match="made for head_dim 64, got keys of 128"):
        cache.update_and_fetch(x, x)
    assert cache.empty()  # nothing was written


def test_dequantized_kv_of_an_empty_cache_says_so():
    with pytest.raises(ValueError, match="the cache is empty"):
        OIQKVCache(OIQConfig()).dequantized_kv()


def test_kv_bits_on_oiq_caches_is_said_not_silently_ignored():
    """mlx-lm converts caches to its quantized cache from ``quantized_kv_start`` on: an OIQ cache
    stays itself (it is quantized already) and a warning says so."""
    model = tiny_llama()
    prompt = mx.array([1, 2, 3, 4, 5])
    plain = [t for t, _ in generate_step(prompt, model, prompt_cache=make_oiq_cache(model), max_tokens=6)]
    cache = make_oiq_cache(model)
    with pytest.warns(UserWarning, match=r"kv_bits=4 is ignored: OIQ caches are quantized already \(K5V3\)"):
        asked = [t for t, _ in generate_step(prompt, model, prompt_cache=cache, max_tokens=6, kv_bits=4,
                                              quantized_kv_start=0)]
    assert all(isinstance(c, OIQKVCache) for c in cache)
    assert asked == plain


def test_trimming_past_the_trim_reserve_keeps_the_packed_rows_packed():
    """``trim`` returns up to ``trim_reserve`` packed tokens to the window exactly; trimmed deeper,
    the tokens that remain stay as they were stored (packed), so the window holds fewer than
    ``window`` full-precision rows until new tokens arrive (docs/configuration.md, trim_reserve)."""
    cfg = OIQConfig(window=8, sink_tokens=2, trim_reserve=4, exact_prefill=0)
    cache = OIQKVCache(cfg)
    mx.random.seed(0)
    xs = mx.random.normal((1, 2, 40, 64))
    for i in range(40):
        cache.update_and_fetch(xs[:, :, i:i + 1], xs[:, :, i:i + 1])
    before_k, _ = cache.dequantized_kv()
    assert cache.offset - cache.q_end <= cfg.window + 15  # window and reserve in full precision
    cache.trim(cfg.trim_reserve)  # within the reserve: the window is whole again
    assert cache.offset - cache.q_end >= cfg.window
    cache.trim(12)  # past the reserve
    assert cache.offset == 24
    assert cache.offset - cache.q_end < cfg.window  # fewer full-precision rows than the window
    after_k, _ = cache.dequantized_kv()
    q = cache.q_end
    assert q > cfg.sink_tokens
    assert mx.array_equal(after_k[:, :, :q], before_k[:, :, :q]).item()  # packed rows as they were stored
    assert mx.allclose(after_k[:, :, q:], xs[:, :, q:24], atol=1e-6).item()  # the rest exact
