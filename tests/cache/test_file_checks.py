"""Cache files: read under the format their writer used or refused, non-finite full-precision
rows refused, files whose class list, scalars or layer count do not fit refused by the package's
loader and by ``oiq-generate``, and batch caches saved and loaded exactly."""

import json

import mlx.core as mx
import pytest
from helpers import tiny_llama
from mlx_lm.models.cache import save_prompt_cache

import oiq_mlx
from oiq_mlx.cache.batch import BatchOIQKVCache
from oiq_mlx.cache.files import FORMAT_1_CONFIG_FIELDS, digest
from oiq_mlx.cache.sequence import OIQKVCache
from oiq_mlx.cli import generate
from oiq_mlx.core.config import OIQConfig
from oiq_mlx.core.rotation import rotate
from oiq_mlx.mlx_lm.caches import make_oiq_cache
from oiq_mlx.mlx_lm.prompt_files import load_cache_file

ARRAYS = ("codes", "scales", "sink", "recent", "signs", "mean", "lam")
# a config format 1 can express (the fields format 2 added at the values format 1 implies)
CFG_1 = OIQConfig(k_bits=3, v_bits=4, sink_tokens=3, window=6, trim_reserve=4, center_values=True, clip=True,
                  layer_bits="1:4:2", align_scales=False, exact_prefill=0, key_scaling_cap=0.0, positional=False)
PROMPT = list(range(1, 31))


def _continue(model, cache):
    out = [model(mx.array([[40, 41, 42, 43, 44, 45, 46, 47, 48]]), cache=cache)]
    out += [model(mx.array([[t]]), cache=cache) for t in (50, 51, 52)]
    mx.eval(out)
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    model = tiny_llama(layers=2)
    cache = make_oiq_cache(model, CFG_1)
    model(mx.array([PROMPT]), cache=cache)
    for t in (31, 32):
        model(mx.array([[t]]), cache=cache)
    t = 33
    while cache[0].offset - cache[0].q_end != CFG_1.window:  # as format 1 left its window: `window` rows
        model(mx.array([[t]]), cache=cache)
        t += 1
    path = str(tmp_path_factory.mktemp("cache") / "cache.safetensors")
    save_prompt_cache(path, cache)
    arrays, metadata = mx.load(path, return_metadata=True)
    return model, arrays, metadata, _continue(model, load_cache_file(path))


def _key(layer, name, side):
    return f"{layer}.{7 * side + ARRAYS.index(name)}"


def _meta(arrays, layer):
    return json.loads("".join(chr(c) for c in arrays[f"{layer}.14"].tolist()))


def _with_meta(arrays, meta, layer):
    return {**arrays, f"{layer}.14": mx.array([ord(c) for c in json.dumps(meta)], mx.int32)}


def _write(tmp_path, arrays, metadata, name="mutated.safetensors"):
    path = str(tmp_path / name)
    mx.save_safetensors(path, arrays, metadata)
    return path


def _format_1(arrays, layer, meta):
    """One layer as format 1 stored it: rows r((x - m) / lam), the mean r(m / lam), the
    config without the fields format 2 added."""
    out = dict(arrays)
    for side in (0, 1):
        signs, lam = arrays[_key(layer, "signs", side)], arrays[_key(layer, "lam", side)]
        lam = lam if lam.size else None
        for name in ("sink", "recent", "mean"):
            a = arrays[_key(layer, name, side)]
            if a.size:
                x = a.astype(mx.float32)
                out[_key(layer, name, side)] = rotate(x if lam is None else x / lam, signs).astype(a.dtype)
    config = {k: v for k, v in json.loads(meta["config"]).items() if k in FORMAT_1_CONFIG_FIELDS}
    return _with_meta(out, {**meta, "config": json.dumps(config, sort_keys=True)}, layer)


def test_genuine_format_1_files_load(saved, tmp_path):
    """oiq_mlx 0.1.0's files (no format, no digest) and format 1 with a digest load, converted."""
    model, arrays, metadata, reference = saved
    legacy, declared = dict(arrays), dict(arrays)
    for layer in (0, 1):
        meta = {k: v for k, v in _meta(arrays, layer).items() if k not in ("format", "digest")}
        legacy = _format_1(legacy, layer, meta)
        declared = _format_1(declared, layer, {**meta, "format": 1})
        m = _meta(declared, layer)
        declared = _with_meta(declared, {**m, "digest": digest(m)}, layer)
    for arrays_1 in (legacy, declared):
        got = _continue(model, load_cache_file(_write(tmp_path, arrays_1, metadata)))
        for a, b in zip(got, reference):
            assert mx.allclose(a, b, atol=1e-4), float(mx.abs(a - b).max())


def test_format_2_files_claiming_format_1_are_refused(saved, tmp_path):
    """A format-2 file with format and digest deleted, or format set to 1 and the digest
    recomputed, is refused naming the format field (it loaded as another cache before)."""
    _, arrays, metadata, _ = saved
    meta = _meta(arrays, 0)
    assert meta["format"] == 2
    removed = {k: v for k, v in meta.items() if k not in ("format", "digest")}
    claimed = {**meta, "format": 1}
    claimed["digest"] = digest(claimed)
    for new in (removed, claimed):
        with pytest.raises(ValueError, match="state refused: format .* only format 2 writes"):
            load_cache_file(_write(tmp_path, _with_meta(arrays, new, 0), metadata))


def test_a_format_2_window_is_not_read_as_format_1(tmp_path):
    """Format 1 packed every token past the window; format 2 packs in blocks, so its window
    can hold more than ``window`` rows.  Such a file, its format and digest deleted and its
    config cut to format 1's fields (the same config), is refused naming the format."""
    model = tiny_llama(layers=2)
    cache = make_oiq_cache(model, CFG_1)
    model(mx.array([PROMPT]), cache=cache)
    t = 31
    while cache[0].offset - cache[0].q_end == CFG_1.window:
        model(mx.array([[t]]), cache=cache)
        t += 1
    path = str(tmp_path / "two.safetensors")
    save_prompt_cache(path, cache)
    arrays, metadata = mx.load(path, return_metadata=True)
    for layer in (0, 1):
        meta = {k: v for k, v in _meta(arrays, layer).items() if k not in ("format", "digest")}
        config = {k: v for k, v in json.loads(meta["config"]).items() if k in FORMAT_1_CONFIG_FIELDS}
        assert OIQConfig.from_json(json.dumps(config)) == CFG_1
        arrays = _with_meta(arrays, {**meta, "config": json.dumps(config)}, layer)
    with pytest.raises(ValueError, match="state refused: format 1 packed every token past the window"):
        load_cache_file(_write(tmp_path, arrays, metadata))


@pytest.mark.parametrize("name", ["sink", "recent"])
@pytest.mark.parametrize("side", [0, 1])
@pytest.mark.parametrize("value", [mx.nan, mx.inf])
def test_non_finite_full_precision_rows_are_refused(saved, tmp_path, name, side, value):
    _, arrays, metadata, _ = saved
    key = _key(1, name, side)
    a = arrays[key]
    assert a.shape[2] > 0
    bad = mx.concatenate([a[:, :, :1], mx.full(a[:, :, 1:2].shape, value, a.dtype), a[:, :, 2:]], axis=2)
    what = f"{('keys', 'values')[side]} {name}"
    with pytest.raises(ValueError, match=f"{what} holds non-finite values"):
        load_cache_file(_write(tmp_path, {**arrays, key: bad}, metadata))


def _same_state(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        if isinstance(x, mx.array) and isinstance(y, mx.array):
            assert x.dtype == y.dtype and x.shape == y.shape and mx.array_equal(x, y).item()
        else:
            assert x == y, (x, y)


def test_a_window_of_zero_rows_loads_exactly():
    """A cache whose full-precision buffer holds 0 rows (trimmed back to its sinks) loads with
    that buffer, not None: its state after loading is the state it was saved from."""
    cfg = OIQConfig(sink_tokens=3, window=4)
    cache = OIQKVCache(cfg)
    k = mx.random.normal((1, 2, 12, 64), key=mx.random.key(1))
    cache.update_and_fetch(k, k * 0.5)
    cache.trim(9)
    state = cache.state
    assert state[3] is not None and state[3].shape[2] == 0
    loaded = OIQKVCache.from_state(state)
    _same_state(state, loaded.state)
    for c in (cache, loaded):
        c.update_and_fetch(k[:, :, :5], k[:, :, :5])
    _same_state(cache.state, loaded.state)


def _layer_files(tmp_path, model, n_layers):
    cache = make_oiq_cache(model, CFG_1)
    model(mx.array([PROMPT[:12]]), cache=cache)
    path = str(tmp_path / "good.safetensors")
    save_prompt_cache(path, cache, {"model": "tiny"})
    return path


def _tampered(tmp_path, path, edit_meta=None, edit_arrays=None, name="bad.safetensors"):
    arrays, metadata = mx.load(path, return_metadata=True)
    if edit_meta:
        edit_meta(metadata)
    if edit_arrays:
        edit_arrays(arrays)
    return _write(tmp_path, arrays, metadata, name)


def _string_as_float(arrays):
    arrays["0.14"] = arrays["0.14"].astype(mx.float32)


def _drop_last_class(metadata):
    last = max(k for k in metadata if k.startswith("1."))
    del metadata[last]


TAMPERED = {
    "class load_prompt_cache": (lambda m: m.update({"1.0": "load_prompt_cache"}), None,
                                "names cache class 'load_prompt_cache'"),
    "class unknown": (lambda m: m.update({"1.1": "NoSuchCache"}), None, "names cache class 'NoSuchCache'"),
    "string as float32": (None, _string_as_float, "string 0.14 must be a 1-D integer array"),
    "class list one short": (_drop_last_class, None, "holds the states of 2 layers but names 1 cache classes"),
    "scalar kind": (lambda m: m.update({"2.1.1": "complex"}), None, "unknown kind 'complex'"),
}


@pytest.fixture(scope="module")
def good_file(tmp_path_factory):
    model = tiny_llama(layers=2)
    return _layer_files(tmp_path_factory.mktemp("good"), model, 2)


@pytest.mark.parametrize("case", sorted(TAMPERED))
def test_tampered_files_are_refused_by_the_package_loader(good_file, tmp_path, case):
    edit_meta, edit_arrays, message = TAMPERED[case]
    path = _tampered(tmp_path, good_file, edit_meta, edit_arrays)
    assert oiq_mlx.load_prompt_cache is load_cache_file
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        oiq_mlx.load_prompt_cache(path)


@pytest.mark.parametrize("case", sorted(TAMPERED))
def test_tampered_files_end_oiq_generate_in_one_error_line(good_file, tmp_path, case, capsys):
    edit_meta, edit_arrays, message = TAMPERED[case]
    path = _tampered(tmp_path, good_file, edit_meta, edit_arrays)
    assert generate.main(["--prompt-cache-file", path, "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("oiq-generate: error: cannot load prompt cache"), err
    assert message in err, err


def _decode(model, cache, tokens):
    out = [model(mx.array([[t] for t in step]), cache=cache) for step in tokens]
    mx.eval(out)
    return out


def test_a_batch_cache_saves_and_loads_exactly(tmp_path, capsys):
    """Save a decoding batch (each layer a BatchOIQKVCache of two sequences), load it, and
    decode on: the same logits, bit for bit, as the batch that was never saved."""
    model = tiny_llama(layers=2)
    per_seq = []
    for prompt in (PROMPT[:20], PROMPT[5:30]):
        cache = make_oiq_cache(model, CFG_1)
        model(mx.array([prompt]), cache=cache)
        per_seq.append(cache)
    batch = [OIQKVCache.merge([c[i] for c in per_seq]) for i in range(2)]
    _decode(model, batch, [(60, 61), (62, 63)])  # decodes stacked
    for b in batch:
        b.unstack()
    path = str(tmp_path / "batch.safetensors")
    save_prompt_cache(path, batch)
    assert generate.main(["--prompt-cache-file", path, "--prompt", "hi"]) == 2  # one sequence's cache only
    assert "holds a batch of sequences" in capsys.readouterr().err
    for load in (load_cache_file, oiq_mlx.load_prompt_cache):
        loaded = load(path)
        assert all(type(b) is BatchOIQKVCache and len(b.caches) == 2 for b in loaded)
        for a, b in zip(batch, loaded):
            for x, y in zip(a.caches, b.caches):
                _same_state(x.state, y.state)
    steps = [(70 + i, 80 + i) for i in range(20)]
    want = _decode(model, batch, steps)
    got = _decode(model, loaded, steps)
    for a, b in zip(got, want):
        assert mx.array_equal(a, b)


def test_a_batch_saved_while_stacked(tmp_path):
    """A decoding batch holds its storage stacked, and its ``state`` is that storage: mlx-lm's own
    ``save_prompt_cache`` writes it, and loading refuses the file saying what to do;
    ``oiq_mlx.save_prompt_cache`` unstacks first, and the file loads and decodes on exactly."""
    model = tiny_llama(layers=2)
    per_seq = []
    for prompt in (PROMPT[:20], PROMPT[:25]):
        cache = make_oiq_cache(model, CFG_1)
        model(mx.array([prompt]), cache=cache)
        per_seq.append(cache)
    batch = [OIQKVCache.merge([c[i] for c in per_seq]) for i in range(2)]
    _decode(model, batch, [(60, 61)])
    assert batch[0].stacked is not None
    path = str(tmp_path / "stacked.safetensors")
    save_prompt_cache(path, batch)
    with pytest.raises(ValueError, match="stacked decode storage .* unstack"):
        load_cache_file(path)
    _decode(model, batch, [(62, 63)])  # stacked again
    assert batch[0].stacked is not None
    path = str(tmp_path / "saved.safetensors")
    oiq_mlx.save_prompt_cache(path, batch)
    loaded = oiq_mlx.load_prompt_cache(path)
    steps = [(70 + i, 80 + i) for i in range(20)]
    want = _decode(model, batch, steps)
    got = _decode(model, loaded, steps)
    for a, b in zip(got, want):
        assert mx.array_equal(a, b)