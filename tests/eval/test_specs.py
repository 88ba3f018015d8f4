"""The shared registry of cache configurations (oiq_mlx.eval.specs)."""

import argparse

import mlx.core as mx

import pytest
from helpers import tiny_llama
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from oiq_mlx import OIQConfig, OIQKVCache
from oiq_mlx.cli.options import add_oiq_options, config_from_args
from oiq_mlx.eval.specs import Float16KVCache, cache_registry, parse_spec, split_spec_list


def test_one_name_per_cache_across_the_scripts():
    # bench_latency's names, eval_quality's names and the fidelity/server syntax agree
    assert parse_spec("mlx-q4").bits == parse_spec("mlx:4").bits == parse_spec("mlx-q4-g64").bits == 4
    assert parse_spec("mlx-q4").group_size == parse_spec("mlx:4").group_size == 64
    assert parse_spec("mlx:4:32") == cache_registry()["mlx-q4-g32"]
    assert parse_spec("oiq-4bit").oiq == parse_spec("oiq-4").oiq == parse_spec("preset:4bit").oiq
    assert parse_spec("oiq-8bit").oiq == parse_spec("oiq-8").oiq == OIQConfig(k_bits=8, v_bits=8)
    assert parse_spec("preset:3bit[window=32, clip=false]").oiq == OIQConfig.preset("3bit", window=32, clip=False)
    assert parse_spec("oiq[k_bits=4,v_bits=3]").oiq == OIQConfig(k_bits=4, v_bits=3)
    assert split_spec_list("fp, preset:3bit[window=32,clip=false],mlx:4") == [
        "fp", "preset:3bit[window=32,clip=false]", "mlx:4"]


@pytest.mark.parametrize("text, message", [
    ("nope", "unknown cache 'nope'"),
    ("preset:1bit", "unknown OIQ preset"),
    ("preset:4bit[window]", "is not field=value"),
    ("oiq[nonsense=1]", "'nonsense' is not an OIQConfig field"),
])
def test_bad_names_say_what_is_wrong(text, message):
    with pytest.raises(ValueError, match=message):
        parse_spec(text)


@pytest.mark.parametrize("name", ["oiq-4", "oiq-2", "preset:3bit[window=32,sink_tokens=0]",
                                  "oiq[k_bits=5,v_bits=3,center_values=true,layer_bits=1:8:8]",
                                  "preset:3bit[align_scales=true]", "oiq[align_scales=false]",
                                  "preset:4bit[exact_prefill=16384]"])
def test_server_flags_reproduce_the_config(name):
    spec = parse_spec(name)
    parser = argparse.ArgumentParser()
    add_oiq_options(parser)
    assert config_from_args(parser.parse_args(spec.server_args())) == spec.oiq


def test_server_flags_of_mlx_lm_caches_and_unservable_fields():
    assert parse_spec("fp").server_args() == ["--no-oiq"]
    assert parse_spec("mlx:4").server_args() == ["--no-oiq", "--kv-bits", "4", "--kv-group-size", "64",
                                                "--quantized-kv-start", "0"]
    with pytest.raises(ValueError, match="no flag for rotation"):
        parse_spec("absmax-4").server_args()
    with pytest.raises(ValueError, match="no flag for float16 storage"):
        parse_spec("fp16").server_args()


def test_make_cache_kinds():
    model = tiny_llama(layers=1)
    assert type(parse_spec("fp").make_cache(model)[0]) is KVCache
    assert isinstance(parse_spec("mlx:8").make_cache(model)[0], QuantizedKVCache)
    assert parse_spec("preset:2bit").make_cache(model)[0].config == OIQConfig.preset("2bit")
    assert isinstance(parse_spec("oiq-4").make_cache(model)[0], OIQKVCache)


def test_fp16_stores_float16_and_attends_at_the_model_dtype():
    model = tiny_llama(layers=1)
    (cache,) = parse_spec("fp16").make_cache(model)
    assert type(cache) is Float16KVCache
    k, v = mx.random.normal((1, 2, 5, 16)), mx.random.normal((1, 2, 5, 16))
    kh, vh = cache.update_and_fetch(k, v)
    assert kh.dtype == vh.dtype == mx.float32 and cache.keys.dtype == mx.float16
    assert mx.array_equal(kh, k.astype(mx.float16).astype(mx.float32)).item()
    assert not mx.array_equal(kh, k).item()  # the rounding is there
    assert cache.nbytes == 2 * (2 * 256 * 16) * 2  # keys and values, mlx-lm's 256-token step, 2 bytes
