"""The vector-codebook probe (oiq_mlx.eval.codebook): data-free codebooks, the per-group scale
search, their rates, and the 8-bit carrier that puts a reconstruction into a real cache."""

import mlx.core as mx
import numpy as np
import pytest

from oiq_mlx.cache.sequence import OIQKVCache
from oiq_mlx.core.codec import dequantize, split_rows
from oiq_mlx.core.config import OIQConfig
from oiq_mlx.eval import codebook
from oiq_mlx.kernels import dispatch


def _distortion(z, book):
    return float(((z - book[codebook.nearest(z, book)]) ** 2).sum(1).mean())


def test_lloyd_lowers_the_distortion_of_its_start():
    z = np.random.default_rng(1).standard_normal((6000, 2))
    start = codebook.lloyd(z, 16, iters=0)
    book = codebook.lloyd(z, 16, iters=20)
    assert book.shape == (16, 2)
    assert _distortion(z, book) < 0.8 * _distortion(z, start)
    # k = 1 starts from quantiles: 4 levels of a unit Gaussian end near Lloyd-Max's +-0.45, +-1.51
    levels = np.sort(codebook.lloyd(z[:, :1], 4, iters=40)[:, 0])
    assert np.allclose(levels, [-1.51, -0.45, 0.45, 1.51], atol=0.08)


def test_reconstruct_is_the_nearest_codewords_at_the_searched_float16_scale():
    """One ratio: every group's scale is float16(RMS x ratio), every coordinate the nearest level
    times it, as numpy computes it.  More ratios can only lower each group's error."""
    rng = np.random.default_rng(2)
    y = rng.standard_normal((5, 64)).astype(np.float32) * rng.uniform(0.1, 10, (5, 1)).astype(np.float32)
    book = codebook.uniform_grid(2)
    got = np.array(codebook.reconstruct(mx.array(y), book, 32, ratios=(0.9,)))
    g = y.reshape(5, 2, 32)
    s = (np.sqrt((g ** 2).mean(-1, keepdims=True)) * np.float32(0.9)).astype(np.float16).astype(np.float32)
    levels = book[:, 0]
    want = levels[np.argmin(np.abs(g[..., None] / s[..., None] - levels), -1)] * s
    assert np.allclose(got, want.reshape(5, 64), rtol=1e-6, atol=1e-6)
    searched = np.array(codebook.reconstruct(mx.array(y), book, 32))
    err = lambda r: ((y - r) ** 2).reshape(5, 2, 32).sum(-1)
    assert np.all(err(searched) <= err(got) + 1e-5)
    assert err(searched).sum() < err(got).sum()


def test_aligned_scales_keep_the_searched_codewords_and_each_groups_projection():
    """align=1: the codewords of the search, at the scale sum(y*y) / sum(y*u), so that each group's
    reconstruction projects onto the group with the group's own squared length; align=0.5: the mean
    of that scale and the searched one.  A zero group decodes to zero."""
    rng = np.random.default_rng(3)
    y = rng.standard_normal((6, 64)).astype(np.float32) * rng.uniform(0.1, 10, (6, 1)).astype(np.float32)
    y[5, :32] = 0
    book = codebook.gaussian_codebook(4, 16, groups=2000, iters=10)
    searched, aligned, half = (np.array(codebook.reconstruct(mx.array(y), book, 32, align=a)).reshape(6, 2, 32)
                               for a in (0, 1, 0.5))
    g = y.reshape(6, 2, 32)
    assert np.all(searched[5, 0] == 0) and np.all(aligned[5, 0] == 0) and np.all(half[5, 0] == 0)
    live = np.ones((6, 2), bool)
    live[5, 0] = False
    # same codewords: the three reconstructions are positive multiples of each other per group
    norm = np.where(live, (searched * searched).sum(-1), 1)
    ratio_a = (aligned * searched).sum(-1) / norm
    assert np.allclose(aligned[live], (ratio_a[..., None] * searched)[live], rtol=1e-5, atol=1e-6)
    assert np.all(ratio_a[live] > 0)
    # aligned: <y, r> = <y, y>, to float16's rounding of the scale
    assert np.allclose((g * aligned).sum(-1)[live], (g * g).sum(-1)[live], rtol=2e-3)
    assert not np.allclose((g * searched).sum(-1)[live], (g * g).sum(-1)[live], rtol=2e-3)
    ratio_h = (half * searched).sum(-1) / norm
    assert np.allclose(ratio_h[live], (1 + ratio_a[live]) / 2, rtol=2e-3)
    with pytest.raises(ValueError):
        codebook.reconstruct(mx.array(y), book, 32, align=0.3)


def test_rates_and_names():
    assert codebook.bits_per_coordinate(codebook.uniform_grid(2)) == 2
    book = codebook.parse_variant("vq-4x64")
    assert book.shape == (64, 4) and codebook.bits_per_coordinate(book) == 1.5
    # at d = 64: 1.5 bits is 12 bytes of codes a side and two float16 scales; 2 bits is the 2bit preset's 40
    assert codebook.packed_bytes(64, book) == 32
    assert codebook.packed_bytes(64, codebook.uniform_grid(2)) == OIQConfig.preset("2bit").bytes_per_token(64) == 40
    for bad in ("vq-4", "uniform", "vq-3x8"):
        with pytest.raises(ValueError):
            codebook.parse_variant(bad)


def _filled(cfg, x):
    c = OIQKVCache(cfg)
    c.update_and_fetch(x[:, :, :200], x[:, :, :200])  # a prompt, packed by the first step
    for i in range(200, x.shape[2]):
        c.update_and_fetch(x[:, :, i : i + 1], x[:, :, i : i + 1] * 0.5)
    mx.eval(c.k.rows if c.k.rows is not None else c.packed_buffers())
    return c


def test_the_carrier_packs_what_the_cache_would_and_the_reconstruction_in_its_place():
    """With the identity the carrier packs exactly what the cache packs itself (8-bit codes,
    plain abs-max); with a 2-bit grid the packed rows decode to that grid's reconstruction of
    the rows, up to the carrier's 8-bit rounding.  The cache's own quantizer is back on exit."""
    cfg = OIQConfig.preset("2bit", k_bits=8, v_bits=8, clip=False, align_scales=False)
    x = mx.random.normal((1, 2, 260, 64), key=mx.random.key(4)) * 3
    plain = _filled(cfg, x)
    with codebook.packing_through(lambda y: y):
        carried = _filled(cfg, x)
    assert dispatch.quantize_rows.__name__ == "quantize_rows"
    assert carried.q_end == plain.q_end > cfg.sink_tokens
    assert mx.array_equal(carried.packed_buffers()[0], plain.packed_buffers()[0]).item()

    book = codebook.uniform_grid(2)
    seen = []

    def grid(y):
        seen.append((y, codebook.reconstruct(y, book)))
        return seen[-1][1]

    with codebook.packing_through(grid):
        c = _filled(cfg, x)
    # the prompt's rows the first one-token step packs, keys and values stacked: (2, B, H, n, d)
    y, r = seen[0][0][0], seen[0][1][0]
    n = y.shape[2]
    assert n == c.packed_end(201) - cfg.sink_tokens > 0
    codes, scales = split_rows(c.packed_buffers()[0][0, :, :, :n], 64, 8, 32)
    back = dequantize(codes, scales, 8, 32)
    step = float(mx.max(mx.abs(r))) / 127
    assert float(mx.max(mx.abs(back - r))) <= step  # the 2-bit reconstruction, to an 8-bit step
    assert float(mx.max(mx.abs(back - y))) > 10 * step  # not the rows themselves


def test_the_carrier_leaves_caches_of_other_bits_as_they_are():
    """A preset beside the carrier packs exactly what it packs outside it."""
    x = mx.random.normal((1, 2, 260, 64), key=mx.random.key(4))
    plain = _filled(OIQConfig.preset("2bit"), x)
    with codebook.packing_through(lambda y: y * 0):
        beside = _filled(OIQConfig.preset("2bit"), x)
    assert beside.q_end == plain.q_end > 4
    assert mx.array_equal(beside.packed_buffers()[0], plain.packed_buffers()[0]).item()


def test_packed_errors_compare_the_preset_with_each_codebook_and_render_as_a_docs_table():
    from oiq_mlx.bench import docs_tables
    from oiq_mlx.eval.rotation import packed_rows
    from oiq_mlx.eval.sweep import tiny_qwen2

    model = tiny_qwen2(layers=2, seed=3)
    tokens = mx.random.randint(0, 256, (160,), key=mx.random.key(5)).tolist()
    cfg = OIQConfig.preset("2bit")
    books = {"uniform-2": codebook.uniform_grid(2), "vq-2x8": codebook.parse_variant("vq-2x8")}
    rows = packed_rows(model, tokens, cfg)
    result = codebook.packed_errors(rows, cfg, books)
    assert result["bytes"] == {"preset": 40, "uniform-2": 40, "vq-2x8": 32}
    for side in ("keys", "values"):
        e = result["codebook_errors"][side]
        assert 0.02 < e["preset"] < 0.2 and 0.02 < e["uniform-2"] < 0.2
        assert e["vq-2x8"] > e["uniform-2"]  # 1.5 bits lose to 2
    assert docs_tables.kind_of(result) == "codebook_errors"
    table = codebook.errors_table(result)
    assert table.count("\n") == 4 and "| vq-2x8 | 32 |" in table
    # aligned scales give up squared error for the rows' lengths: more error on these rows
    aligned = codebook.packed_errors(rows, cfg, books, align=1)["codebook_errors"]
    for side in ("keys", "values"):
        assert aligned[side]["preset"] == result["codebook_errors"][side]["preset"]
        for v in books:
            assert result["codebook_errors"][side][v] < aligned[side][v] < 1.5 * result["codebook_errors"][side][v]


def test_the_spread_view_gives_mean_and_range_over_a_files_caches(tmp_path):
    import json

    from oiq_mlx.bench import docs_tables

    def sweep_file(name, deltas, kls):
        rows = [{"name": "fp", "kind": "fp", "ppl_delta": 0.0, "kl": 0.0}] + [
            {"name": f"s{i}", "kind": "oiq", "ppl_delta": d, "kl": k} for i, (d, k) in enumerate(zip(deltas, kls))]
        (tmp_path / name).write_text(json.dumps({"rows": rows, "scored": 256}))
        return name

    a = sweep_file("a.json", [0.01, 0.03], [0.02, 0.04])
    b = sweep_file("b.json", [0.02], [0.03])
    table = docs_tables.render(["spread", a, b], tmp_path)
    assert "| `a.json` | 2 | +2.00% (+1.00% to +3.00%) | 0.0300 (0.0200-0.0400) |" in table
    assert "| `b.json` | 1 | +2.00% (+2.00% to +2.00%) | 0.0300 (0.0300-0.0300) |" in table
    (tmp_path / "c.json").write_text(json.dumps({"codebook_errors": {}, "bytes": {}}))
    with pytest.raises(ValueError, match="fidelity"):
        docs_tables.render(["spread", "c.json"], tmp_path)
