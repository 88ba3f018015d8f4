"""Saved OIQ caches: every field of a file is checked on load (fuzzed here), the
format version, and loading / hand-built caches after ``import oiq_mlx`` alone."""

import json
import subprocess
import sys
import textwrap

import mlx.core as mx
import pytest
from helpers import tiny_llama
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from oiq_mlx.cache.files import FORMAT_VERSION, digest
from oiq_mlx.cache.sequence import OIQKVCache
from oiq_mlx.core.config import OIQConfig
from oiq_mlx.mlx_lm.caches import make_oiq_cache
from oiq_mlx.core.rotation import rotate

# every array present (key mean and scales, value mean), clipped scales, layer 1 at other bits (1-bit values)
CFG = OIQConfig(k_bits=3, v_bits=4, sink_tokens=3, window=6, trim_reserve=4, center_values=True, clip=True,
                layer_bits="1:4:1")
ARRAYS = ("codes", "scales", "sink", "recent", "signs", "mean", "lam")
PROMPT = list(range(1, 31))


def _continue(model, cache):
    """Logits of a continuation that reads every segment, quantizes more tokens
    (a chunk longer than the window), trims and decodes: what a loaded cache is used for."""
    out = [model(mx.array([[40, 41, 42, 43, 44, 45, 46, 47, 48]]), cache=cache)]
    out.append(model(mx.array([[50]]), cache=cache))
    assert all(c.trim(3) == 3 for c in cache)
    out += [model(mx.array([[t]]), cache=cache) for t in (51, 52)]
    mx.eval(out)
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A saved 2-layer cache, its raw arrays and metadata, and what the unmodified file gives."""
    model = tiny_llama(layers=2)
    cache = make_oiq_cache(model, CFG)
    model(mx.array([PROMPT]), cache=cache)
    for t in (31, 32):
        model(mx.array([[t]]), cache=cache)
    path = str(tmp_path_factory.mktemp("cache") / "cache.safetensors")
    save_prompt_cache(path, cache)
    arrays, metadata = mx.load(path, return_metadata=True)
    reference = _continue(model, load_prompt_cache(path))
    return model, path, arrays, metadata, reference


def _array_index(name: str, side: int) -> int:
    return 7 * side + ARRAYS.index(name)


def _meta(arrays, layer=0) -> dict:
    return json.loads("".join(chr(c) for c in arrays[f"{layer}.14"].tolist()))


def _with_meta(arrays, meta: dict, layer=0, redigest=False) -> dict:
    if redigest and "digest" in meta:
        meta = {**meta, "digest": digest(meta)}
    return {**arrays, f"{layer}.14": mx.array([ord(c) for c in json.dumps(meta)], mx.int32)}


def _write(tmp_path, arrays, metadata) -> str:
    path = str(tmp_path / "mutated.safetensors")
    mx.save_safetensors(path, arrays, metadata)
    return path


def _load_and_compare(saved, path, case=""):
    """Load ``path``: either a ValueError naming the problem (returned), or results
    identical to the unmodified file's (None)."""
    model, _, _, _, reference = saved
    try:
        cache = load_prompt_cache(path)
    except ValueError as e:
        assert "OIQKVCache state refused:" in str(e)
        return str(e)
    got = _continue(model, cache)
    for a, b in zip(got, reference):
        assert mx.array_equal(a, b), f"a mutated file loaded and gave different results: {case}"
    return None


def _set_first(a: mx.array, value: float) -> mx.array:
    flat = a.reshape(-1)
    return mx.concatenate([mx.array([value], a.dtype), flat[1:]]).reshape(a.shape)


def _array_mutations(a: mx.array, name: str):
    """(label, mutated array) for one stored array: shape, dtype and row-count
    changes for all, value changes for the arrays whose values are constrained
    (token data, codes and means can hold any value: see the module docstring
    of oiq_mlx.cache, "cache files")."""
    out = [("zero-size", a[..., :0]), ("scalar", mx.array(1.0)), ("last-dim-1", a[..., :-1])]
    if a.dtype == mx.uint32:
        out += [("as-uint8", a.astype(mx.uint8)), ("as-float32", a.astype(mx.float32))]
    else:
        out += [("as-float16" if a.dtype != mx.float16 else "as-float32",
                 a.astype(mx.float16 if a.dtype != mx.float16 else mx.float32)), ("as-int32", a.astype(mx.int32))]
    if name in ("signs", "lam", "scales"):
        out += [("zeros", mx.zeros_like(a)), ("negated", -a), ("nan-first", _set_first(a, mx.nan)),
                ("inf-first", _set_first(a, mx.inf))]
    if name == "mean":
        out += [("nan-first", _set_first(a, mx.nan)), ("inf-first", _set_first(a, -mx.inf))]
    if name == "signs":
        out.append(("one-flipped", _set_first(a, -a[0].item())))
    if a.ndim == 4:
        out += [("rows-1", a[:, :, :-1]), ("rows+1", mx.concatenate([a, a[:, :, -1:]], 2)), ("rows-0", a[:, :, :0]),
                ("head-copied-to-two", mx.concatenate([a, a[:, :1]], 1)), ("batch-2", mx.concatenate([a, a], 0)),
                ("one-head", a[:, :1])]
    if a.ndim == 1:
        out.append(("longer", mx.concatenate([a, a[:1]])))
    return out


def test_every_array_mutation_is_refused_or_harmless(saved, tmp_path):
    """Shapes, dtypes, row counts, missing arrays, bad values of every stored array of
    both layers: a ValueError naming the array, or results bit-identical to the
    unmodified file (never NaN, never a silent difference)."""
    _, _, arrays, metadata, _ = saved
    refused, harmless = [], []
    for layer in (0, 1):
        for side, side_name in enumerate(("keys", "values")):
            for name in ARRAYS:
                key = f"{layer}.{_array_index(name, side)}"
                if arrays[key].size == 0:  # stored None (the values have no lam)
                    continue
                mutations = [("missing", None)] + _array_mutations(arrays[key], name)
                for label, new in mutations:
                    mutated = {k: v for k, v in arrays.items() if k != key}
                    if new is not None:
                        mutated[key] = new
                    case = f"layer {layer} {side_name} {name} {label}"
                    error = _load_and_compare(saved, _write(tmp_path, mutated, metadata), case)
                    if error is None:
                        harmless.append(case)
                    else:
                        assert f"{side_name} {name}" in error or "state must be" in error or "keys sink" in error, (
                            case, error)
                        refused.append(case)
    assert not harmless, harmless
    assert len(refused) > 200


# (field, new value, field the error names): edits that leave the arrays as they are
META_EDITS = [
    ("offset", -1, "offset"), ("offset", "32", "offset"), ("offset", 31, "recent"), ("offset", 33, "recent"),
    ("offset", 0, "q_end"), ("offset", 2**40, "recent"),
    ("q_end", 33, "q_end"), ("q_end", 25, "keys codes"), ("q_end", 27, "keys codes"), ("q_end", -1, "q_end"),
    ("q_end", 2, "q_end"),
    ("recent_start", 2, "q_end"), ("recent_start", 4, "recent"), ("recent_start", 27, "q_end"),
    ("layer_idx", 1, "codes"), ("layer_idx", 5, "keys"), ("layer_idx", -1, "layer_idx"),
    ("layer_idx", True, "layer_idx"),
    ("dtype", "float16", "sink"), ("dtype", "int8", "dtype"), ("dtype", None, "offset"),
    ("head_dims", [32, 64], "dims"), ("head_dims", [64], "head_dims"), ("head_dims", [80, 64], "dims"),
    ("head_dims", [0, 64], "head_dims"), ("dims", [96, 64], "dims"), ("dims", None, "dims"),
    ("format", 2, "format"), ("format", "1", "format"), ("format", None, "format"),
    ("config", "{", "config"), ("config", 3, "config"),
]
CONFIG_EDITS = [
    ("k_bits", 4, "keys codes"), ("v_bits", 3, "values codes"), ("k_bits", 7, "config"), ("group_size", 64, "scales"),
    ("seed", 1, "signs"), ("sink_tokens", 2, "sink"), ("sink_tokens", 4, "sink"), ("sink_tokens", 40, "sink"),
    ("center_keys", False, "keys mean"), ("center_values", False, "values mean"), ("key_scaling", 0.0, "keys lam"),
    ("rotation", "hadamard_nosigns", "signs"), ("rotation", "none", "signs"), ("layer_bits", "0:4:1;1:4:1", "codes"),
    ("layer_bits", [], "codes"), ("sink_tokens", 10**9, "config"), ("unknown_field", 1, "config"),
]
# config edits that do not concern the layer whose metadata is edited: they load, and change nothing
HARMLESS = {0: {"config.layer_bits=[]"}, 1: {"config.layer_bits=0:4:1;1:4:1", "config.k_bits=4", "config.v_bits=3"}}
# edits no array reveals (they only change how later tokens are stored): the digest refuses them
DIGEST_ONLY_EDITS = [
    ("clip", False), ("window", 7), ("window", 0), ("quantize_after", 50), ("trim_reserve", 0), ("key_scaling", 0.25),
    ("key_scaling_cap", 3.0),
]


def _edit(meta, field, value):
    meta = dict(meta)
    if value is None and field in ("format",):
        meta.pop(field)
    else:
        meta[field] = value
    return meta


def _edit_config(meta, field, value):
    config = json.loads(meta["config"])
    config[field] = value
    return {**meta, "config": json.dumps(config, sort_keys=True)}


@pytest.mark.parametrize("layer", [0, 1])
def test_every_metadata_edit_is_refused_naming_the_field(saved, tmp_path, layer):
    """Counters, dtype, dims, format and config fields: refused naming the field
    (the digest recomputed, as someone editing the file on purpose would), and
    refused by the digest when it is left as saved."""
    _, _, arrays, metadata, _ = saved
    meta = _meta(arrays, layer)
    assert meta["format"] == FORMAT_VERSION
    edits = [(_edit(meta, f, v), f"{f}={v}", named) for f, v, named in META_EDITS]
    edits += [(_edit_config(meta, f, v), f"config.{f}={v}", named) for f, v, named in CONFIG_EDITS]
    loaded = set()
    for new, what, named in edits:
        if new == meta:
            continue
        for redigest in (True, False):
            error = _load_and_compare(saved, _write(tmp_path, _with_meta(arrays, new, layer, redigest), metadata),
                                      f"{what} redigest={redigest}")
            if error is None:
                loaded.add(what)
            elif redigest:
                assert named in error, (what, error)
    assert loaded == HARMLESS[layer]
    for field, value in DIGEST_ONLY_EDITS:
        new = _edit_config(meta, field, value)
        error = _load_and_compare(saved, _write(tmp_path, _with_meta(arrays, new, layer), metadata), field)
        assert error is not None and "digest" in error, (field, error)
    missing_digest = {k: v for k, v in meta.items() if k != "digest"}
    assert "missing ['digest']" in _load_and_compare(saved, _write(tmp_path, _with_meta(arrays, missing_digest, layer),
                                                                   metadata))
    extra = {**meta, "note": 1}
    assert "unknown ['note']" in _load_and_compare(saved, _write(tmp_path, _with_meta(arrays, extra, layer, True),
                                                                 metadata))


def _as_format_1(arrays, layer, meta):
    """The arrays of one layer as format 1 (oiq_mlx 0.1.0) stored them: full-precision
    rows r((x - m) / lam) and the mean r(m / lam), where format 2 stores x - m and m."""
    out = dict(arrays)
    for side in (0, 1):
        signs, lam = (arrays.get(f"{layer}.{_array_index(n, side)}") for n in ("signs", "lam"))
        lam = lam if lam is not None and lam.size else None
        for name in ("sink", "recent", "mean"):
            key = f"{layer}.{_array_index(name, side)}"
            if key in arrays and arrays[key].size:
                x = arrays[key].astype(mx.float32)
                out[key] = rotate(x if lam is None else x / lam, signs).astype(arrays[key].dtype)
    return _with_meta(out, meta, layer)


def test_unmodified_and_legacy_files_load(saved, tmp_path):
    """The saved file reproduces the cache it came from; its arrays converted to format 1
    (no format and no digest as oiq_mlx 0.1.0, or format 1 with a digest) are refused: its
    config has fields only format 2 writes (genuine format-1 files load:
    tests/cache/test_file_checks.py)."""
    model, path, arrays, metadata, reference = saved
    assert _load_and_compare(saved, path) is None
    legacy, format_1 = dict(arrays), dict(arrays)
    for layer in (0, 1):
        meta = _meta(arrays, layer)
        legacy = _as_format_1(legacy, layer, {k: v for k, v in meta.items() if k not in ("format", "digest")})
        format_1 = _as_format_1(format_1, layer, {**meta, "format": 1, "digest": digest({**meta, "format": 1})})
    for converted in (legacy, format_1):
        with pytest.raises(ValueError, match="state refused: format .* only format 2 writes"):
            load_prompt_cache(_write(tmp_path, converted, metadata))
    # the same arrays read as format 2 are another cache: the format field is what tells them apart
    as_2 = _with_meta(_with_meta(legacy, _meta(arrays, 0), 0), _meta(arrays, 1), 1)
    got = _continue(model, load_prompt_cache(_write(tmp_path, as_2, metadata)))
    assert not all(mx.allclose(a, b, atol=1e-4) for a, b in zip(got, reference))


def test_truncated_file_is_refused(saved, tmp_path):
    _, path, _, _, _ = saved
    data = open(path, "rb").read()
    for n in (len(data) - 1, len(data) // 2, 20):
        cut = tmp_path / f"cut{n}.safetensors"
        cut.write_bytes(data[:n])
        with pytest.raises((RuntimeError, ValueError)):
            load_prompt_cache(str(cut))


def test_state_of_wrong_length_or_type_is_refused():
    state = OIQKVCache().state
    with pytest.raises(ValueError, match="must be 14 arrays"):
        OIQKVCache.from_state(state[:-2] + state[-1:])
    with pytest.raises(ValueError, match="metadata is not JSON"):
        OIQKVCache.from_state(state[:-1] + ["{"])
    with pytest.raises(ValueError, match=r"keys codes is missing or not an array \(got dict\)"):
        OIQKVCache.from_state([{}] + state[1:])


def _run_fresh(code: str, cwd) -> str:
    """Run ``code`` in a new interpreter (nothing of this test process imported)."""
    env_path = ":".join([str(cwd)] + [p for p in sys.path if p])
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, capture_output=True, text=True,
                            env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"}, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_load_after_import_alone_in_a_fresh_process(saved, tmp_path):
    """``import oiq_mlx`` is all ``load_prompt_cache`` needs (no install(), no make_oiq_cache)."""
    _, path, _, _, _ = saved
    out = _run_fresh(f"""
        import oiq_mlx
        from mlx_lm.models.cache import load_prompt_cache
        cache = load_prompt_cache({path!r})
        print(type(cache[0]).__name__, cache[0].offset)
    """, tmp_path)
    assert out.split() == ["OIQKVCache", "32"]


def test_hand_built_caches_work_in_a_fresh_process(tmp_path):
    """``[OIQKVCache(cfg, layer_idx=i) ...]`` in a model whose module was imported
    before oiq_mlx (llama) and after it (qwen2) gives what make_oiq_cache gives;
    so does a user's module that bound mlx-lm's attention before oiq_mlx was imported."""
    (tmp_path / "user_attention.py").write_text(textwrap.dedent("""
        from mlx_lm.models.base import scaled_dot_product_attention

        def attend(q, k, v, cache):
            keys, values = cache.update_and_fetch(k, v)
            return scaled_dot_product_attention(q, keys, values, cache=cache, scale=0.125, mask="causal")
    """))
    out = _run_fresh("""
        import user_attention
        import mlx_lm.models.llama as llama
        import oiq_mlx
        import mlx.core as mx
        import mlx_lm.models.qwen2 as qwen2
        from oiq_mlx import OIQConfig, OIQKVCache, make_oiq_cache
        for module in (llama, qwen2):
            mx.random.seed(0)
            args = module.ModelArgs(model_type="x", hidden_size=128, num_hidden_layers=2, intermediate_size=64,
                                    num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
                                    vocab_size=64, tie_word_embeddings=True)
            model = module.Model(args)
            tokens = mx.array([list(range(40))])
            cfg = OIQConfig(window=4)
            by_hand = model(tokens, cache=[OIQKVCache(cfg, layer_idx=i) for i in range(2)])
            made = model(tokens, cache=make_oiq_cache(model, cfg))
            print(module.__name__, mx.array_equal(by_hand, made).item(), mx.isfinite(by_hand).all().item())
        k = mx.random.normal((1, 2, 9, 64))
        q = mx.random.normal((1, 4, 9, 64))
        out = user_attention.attend(q, k, k, OIQKVCache(OIQConfig(k_bits=8, v_bits=8)))
        exact = mx.fast.scaled_dot_product_attention(q, k, k, scale=0.125, mask="causal")
        print("user", mx.allclose(out, exact, atol=1e-5).item())
    """, tmp_path)
    assert out.split() == ["mlx_lm.models.llama", "True", "True", "mlx_lm.models.qwen2", "True", "True",
                           "user", "True"]
