"""Bytes moved per decode step of one layer on the Metal path (oiq_mlx.bench.bytes): the counting
rules, mlx-lm's fp16 KVCache against first principles, what each configuration moves now (upper
bounds that catch a regression) and the goals, as strict xfails that flip when a goal is met.

The figures use 8 query heads and 2 KV heads of dimension 128 (bytes / 4 of the benchmark's 32 and
8 heads, ratios equal to within 0.01) and 256 steps from each context: a multiple of mlx-lm's
growth step (256 rows) and of the OIQ block (16 rows), so every periodic copy counts at its rate.
"""

import mlx.core as mx
import pytest

from oiq_mlx.bench import bytes as moved
from oiq_mlx.bench import latency as bench
from oiq_mlx.bench import trace

SHAPE = dict(n_q_heads=8, n_kv_heads=2, head_dim=128)
PRESETS = ["4bit", "3bit", "2bit"]
RAGGED = "/".join(str(n) for n in moved.RAGGED)


@pytest.fixture(scope="module")
def records():
    return moved.bytes_per_step(bench.default_specs((4, 3, 2), (4,)), **SHAPE)


def _row(records, cache, context, layout="one sequence"):
    return next(r for r in records if r["cache"] == cache and r["context"] == context and r["layout"] == layout)


def test_views_are_free_updates_in_place_gathers_read_what_they_return():
    buf = mx.random.normal((16, 8))  # float32: a row is 32 bytes
    row, idx = mx.ones((1, 8)), mx.array([3, 5])
    mx.eval(buf, row, idx)
    # the multiply reads the transposed reshape (128 bytes, no copy) and the broadcast scalar (4)
    counts = moved.graph_bytes([(buf[:4].reshape(8, 4).T * 2).sum(axis=0)])
    assert dict(counts) == {"Multiply": 128 + 4 + 128, "Reduce": 128 + 32}
    updated = mx.slice_update(buf, row, mx.array([2]), axes=(0,))
    assert dict(moved.graph_bytes([updated])) == {"DynamicSliceUpdate": 32 + 4 + 32}
    assert dict(moved.graph_bytes([mx.take(buf, idx, axis=0)])) == {"Gather": 8 + 2 * 64}


def test_an_elementwise_chain_counts_as_mx_compile_fuses_it():
    """Read once, written once: what leaves the chain; an intermediate read outside it is written."""
    x, m = mx.ones((4, 8), mx.float16), mx.ones((1, 8))
    mx.eval(x, m)
    wide = x.astype(mx.float32) - m
    assert dict(moved.graph_bytes([wide.astype(mx.float16)])) == {moved.FUSED: 64 + 32 + 64}
    assert dict(moved.graph_bytes([wide.astype(mx.float16), wide])) == {
        moved.FUSED: 64 + 32 + 128, "AsType": 128 + 64}


def test_a_kernel_call_reads_its_inputs_and_writes_its_outputs():
    calls = []
    out = trace.recorded_call(calls, [mx.zeros((4, 8)), 3, mx.zeros((2,), mx.float16)], [(5,)], [mx.int32])
    assert out[0].shape == (5,) and moved.call_bytes(calls[0]) == 128 + 4 + 20


def test_fp16_kvcache_moves_what_it_reads_writes_and_copies():
    """mlx-lm's KVCache + fused attention from first principles: each step writes a key and a
    value row and attention reads the query, every key and value row and writes the output; the
    first step of the run grows both buffers by 256 rows (a zero fill and a concatenation copying
    the 1024 rows held).  The two fills of one shape are one node after export's merge."""
    spec = bench.default_specs((), ())[0]
    n, steps, row, q = 1024, 256, 2 * 128 * 2, 8 * 128 * 2
    cache = bench.layer_cache(spec)
    trace.fill(cache, n, n_kv_heads=2, head_dim=128, dtype=mx.float16, key=mx.random.key(0))
    r = moved.decode_bytes(cache, moved.decode_step(spec, 128 ** -0.5), batch=1, steps=steps, **SHAPE)
    total = {name: round(b * steps) for name, b in r["breakdown"].items()}
    fill = 2 + 256 * row
    assert total == {
        "SliceUpdate": steps * 2 * (row + row),
        moved.FUSED_SDPA: sum(2 * q + 2 * (n + t + 1) * row for t in range(steps)),
        "Concatenate": 2 * 2 * (n + 256) * row,
        "Full": fill,
    }, total


# what a step moves now over its ideal, per context (the largest over the presets, plus 0.02): a
# regression bound; the goals below are lower
NOW = {1024: 1.43, 2048: 1.40, 4096: 1.37, 16384: 1.345}


def test_no_step_moves_less_than_its_ideal_and_none_moves_more_than_now(records):
    for r in records:
        if r["layout"] == "one sequence":
            assert 1.0 <= r["vs_ideal"], r
            assert r["vs_ideal"] <= NOW[r["context"]], r
    for c in NOW:
        assert _row(records, "fp", c)["vs_ideal"] <= 1.015
        # mlx-lm 4-bit: its float16 scores written by the first quantized matmul, read by the
        # softmax, written in float32 and read by the second
        assert _row(records, "mlx-q4", c)["vs_ideal"] <= 1.27


def test_a_ragged_batch_moves_at_most_twice_what_separate_caches_move_now(records):
    """Stacked, every sequence is padded to the longest (4096 of 512/1k/2k/4k): about twice
    the bytes of the four caches apart; mlx-lm's BatchKVCache (left-padded) likewise."""
    for preset in PRESETS:
        assert _row(records, f"oiq-{preset}", RAGGED, "batch")["vs_separate"] <= 2.03
    assert _row(records, "fp", RAGGED, "batch")["vs_separate"] <= 2.1


def _goal(reason):
    return [pytest.param(p, marks=pytest.mark.xfail(strict=True, reason=reason)) for p in PRESETS]


@pytest.mark.parametrize("preset", _goal("goal: within 1.15x of the ideal from 4k tokens (now 1.32-1.35: the "
                                         "packed buffers grow by a copy every 16 rows, fp32 attention partials)"))
def test_goal_within_1_15x_of_the_ideal_from_4k(records, preset):
    for c in (4096, 16384):
        assert _row(records, f"oiq-{preset}", c)["vs_ideal"] <= 1.15


@pytest.mark.parametrize("preset", _goal("goal: within 1.3x of the ideal at 1k tokens (now 1.38-1.41)"))
def test_goal_within_1_3x_of_the_ideal_at_1k(records, preset):
    assert _row(records, f"oiq-{preset}", 1024)["vs_ideal"] <= 1.3


@pytest.mark.xfail(strict=True, reason="goal: 4bit at or below mlx-lm's 4-bit cache from 2k tokens "
                                       "(now 1.18x at 2k, 1.13x at 4k, 1.08x at 16k)")
def test_goal_4bit_at_or_below_mlx_4bit_from_2k(records):
    for c in (2048, 4096, 16384):
        assert _row(records, "oiq-4bit", c)["bytes"] <= _row(records, "mlx-q4", c)["bytes"]


@pytest.mark.parametrize("preset", _goal("goal: a ragged batch within 1.15x of the same sequences held as "
                                         "separate caches (now 1.86-2.00x: stacked storage pads to the longest)"))
def test_goal_ragged_batch_within_1_15x_of_separate_caches(records, preset):
    assert _row(records, f"oiq-{preset}", RAGGED, "batch")["vs_separate"] <= 1.15
