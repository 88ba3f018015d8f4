"""Dispatches per layer per decode step (oiq_mlx.bench.trace): the reference path against mlx-lm's caches,
and the path with the Metal kernels selected, counted with a recording launcher."""

import mlx.core as mx
import pytest

from oiq_mlx.bench import attention, latency as bench
from oiq_mlx.bench import trace
from oiq_mlx.cache import reading
from oiq_mlx.cache.sequence import OIQKVCache
from oiq_mlx.core import codec
from oiq_mlx.core.config import OIQConfig

SHAPE = dict(n_q_heads=8, n_kv_heads=2, head_dim=64, context=300)
# two packed blocks (OIQKVCache.flush_block) per run, so the mean includes what packing costs
STEPS = 2 * OIQKVCache.flush_block


def _counts(name, kernels=False, dtype=mx.float32, steps=STEPS):
    spec = next(s for s in bench.default_specs((4, 3, 2), (4,)) if s.name == name)
    return trace.decode_dispatches(
        lambda: bench.layer_cache(spec), lambda c, fetched, q: attention.attention_call(spec, c, fetched, q, 0.125),
        steps=steps, kernels=kernels, dtype=dtype, **SHAPE)


@pytest.fixture(scope="module")
def mlx_q4():
    return _counts("mlx-q4")


def test_counter_counts_work_not_views():
    x = mx.random.normal((4, 8))
    mx.eval(x)
    counts = trace.launching_primitives([(x.reshape(8, 4).T * 2).sum(axis=0)])
    assert dict(counts) == {"Multiply": 1, "Sum": 1}


def test_reference_baselines():
    """mlx-lm's fp16 KVCache + SDPA and its 4-bit QuantizedKVCache, as counted here (CPU graph:
    SDPA decomposes into matmul / softmax / matmul)."""
    assert _counts("fp")["min"] == 6
    assert _counts("mlx-q4")["min"] == 12


def _repack_dispatches(bits: int, widths=codec.CPU_REPACK_BITS) -> int:
    """What repacking one side's packed rows for MLX's CPU ``quantized_matmul`` launches
    (``codec.repack_codes``: 2/3/5/6-bit values on the CPU, to the width ``widths`` gives), 0
    for 4- and 8-bit rows."""
    if bits not in widths:
        return 0
    rows = codec.pack_codes(mx.zeros((1, SHAPE["n_kv_heads"], 301, SHAPE["head_dim"]), mx.uint32), bits)
    mx.eval(rows)
    return sum(trace.launching_primitives([codec.repack_codes(rows, bits, widths[bits])]).values())


@pytest.mark.parametrize("preset", ["4bit", "3bit", "2bit"])
def test_reference_path_dispatches(preset, mlx_q4):
    """A decode step of the reference path launches at most mlx-lm 4-bit's count + 4.  Repacking
    its values, and 3/5/6-bit keys, for MLX's CPU kernel (a few fused passes that make the product
    faster) is kept until a row it holds is written again, so a side is repacked once per block:
    by the step after the one that packs a block (the step before it grows the packed buffer by
    that block, which keeps the copy; the packing step reads the rows it found), and by the
    first step of the run, which has nothing kept."""
    r = _counts(f"oiq-{preset}")
    cfg = OIQConfig.preset(preset)
    repack = _repack_dispatches(cfg.v_bits)
    kept = _repack_dispatches(cfg.v_bits, reading.CPU_MEMO_BITS["v"]) \
        + _repack_dispatches(cfg.k_bits, reading.CPU_MEMO_BITS["k"])
    assert 0 < kept <= 2 * repack <= 20
    assert r["min"] <= mlx_q4["min"] + 4, r
    blocks = STEPS // OIQKVCache.flush_block
    assert r["per_step"].count(r["min"]) >= STEPS - 3 * blocks - 1, r["per_step"]
    assert r["per_step"][0] == r["min"] + kept, r["per_step"]  # nothing kept yet: the first repacks
    steps, low = r["per_step"], r["min"]
    packing = [i for i, n in enumerate(steps) if n > low + kept + 2]
    assert len(packing) == blocks, steps
    # after a packing step: the repack and the drop of the block's dead rows (2); elsewhere at
    # most the growth of the packed buffers (2 each: 4bit's keys and values have one each)
    after = [i + 1 for i in packing if i + 1 < STEPS]
    assert all(steps[i] == low + kept + 2 for i in after), steps
    assert all(n <= low + 4 for i, n in enumerate(steps) if i not in [0, *packing, *after]), steps
    # (the packing step: 54 where keys and values share one quantize pass with the clip
    # search (3bit, 2bit); K5V3 (4bit) quantizes each side in its own pass, each with the clip
    # search and the aligned scales' two pairwise sums: 94.  One step in 16: the mean adds ~9)
    assert r["max"] <= 96, r
    assert r["mean"] <= mlx_q4["mean"] + 9.5 + kept * (blocks + 1) / STEPS, r


def test_only_block_steps_quantize():
    """Between blocks a step quantizes nothing: the packed end moves by whole blocks."""
    cache = OIQKVCache(OIQConfig.preset("4bit"))
    k = mx.random.normal((1, 2, 300, 64))
    cache.update_and_fetch(k, k)
    ends = []
    for _ in range(STEPS):
        cache.update_and_fetch(k[:, :, :1], k[:, :, :1])
        ends.append(cache.q_end)
    assert len(set(ends)) == 3 and all((b - 4) % cache.block == 0 for b in ends)
    assert 64 <= cache.offset - cache.q_end < 64 + cache.block



@pytest.mark.parametrize("preset", ["4bit", "3bit", "2bit"])
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16], ids=["float16", "bfloat16"])
def test_metal_path_dispatches(preset, dtype):
    """With the Metal kernels selected (as on a Mac; kernel calls recorded, not run), a decode step
    is at most the fp16 KVCache + SDPA count (3-4) plus 2.  Steady: 4 (the centering pass of key
    and value, one slice update into the window keys and values share, the two attention kernels;
    the merge kernel writes the queries' dtype, so no cast follows).  The step that packs a block of
    16 rows adds the fused quantize kernel, reading the rows where they lie in the window buffer,
    and one slice update of the packed rows (codes and scales joined): 6 where keys and values
    have the same bits and share one packed buffer (3bit, 2bit); `4bit` stores keys at 5 bits and
    values at 3, rows of different widths in two buffers, so that step launches one quantize
    kernel and one write per side: 8.  A step that compacts the window buffer (the step after a
    packing step, which drops the block's dead rows so that the buffer stays at window + reserve +
    one block) adds a zero fill of the rows to come and a concatenation after the rows kept: 6.
    The step before a packing step that needs the room grows each packed buffer (by 1/32 of its
    rows, at least one block), a zero fill and a concatenation per buffer: 6, or 8 for `4bit`.
    Nothing is cast or made contiguous on any step; the only concatenations are those copies."""
    cfg = OIQConfig.preset(preset)
    pack = 6 if cfg.k_bits == cfg.v_bits else 8
    r = _counts(f"oiq-{preset}", kernels=True, dtype=dtype, steps=20 * OIQKVCache.flush_block)
    assert r["min"] == 4, r["breakdown"]
    assert r["breakdown"]["kernel"] == 2 and "Hadamard" not in r["breakdown"], r["breakdown"]
    for n, g in zip(r["per_step"], r["breakdowns"]):
        assert not {"AsType", "Contiguous", "Hadamard"} & set(g), g
        assert g.get("Concatenate", 0) == g.get("Full", 0), g
        assert n <= pack, g
    assert sum(1 for g in r["breakdowns"] if g.get("Full")) >= 2, "no step grew or compacted a buffer"
    # per block of 16 steps: steady steps, the packing and the compacting step, and at most one
    # growing step; growing costs what packing does (per packed buffer, two dispatches)
    assert r["per_step"].count(pack) >= 16, r["per_step"]
    assert r["mean"] <= 4 + (2 * (pack - 4) + 2) / OIQKVCache.flush_block + 0.05, r["per_step"]


@pytest.mark.parametrize("kernels,score_min", [(False, 0), (False, 1 << 40), (True, 0)],
                         ids=["reference-dequantized-keys", "reference-quantized-matmul", "metal"])
def test_stacked_batch_step_dispatches_do_not_grow_with_the_batch(kernels, score_min, monkeypatch):
    """One decode step of a batch over stacked storage (oiq_mlx.cache.stacked) launches as much for
    eight sequences of different lengths as for one; on the Metal path (traced, unverified on
    hardware) that is the centering, the window write, the attention and merge kernels.  The
    reference path scores packed keys by dequantizing them or by MLX's quantized_matmul, by their
    size (CPU_SCORE_MIN_WORK, which eight sequences pass and one does not): each way is compared
    with itself."""
    from oiq_mlx.cache import attention
    from oiq_mlx.cache.attention import oiq_batch_attention

    monkeypatch.setattr(attention, "CPU_SCORE_MIN_WORK", score_min)
    cfg = OIQConfig.preset("4bit")
    H, d = 2, 64

    def steady(n_seq):
        caches = []
        for i in range(n_seq):
            c = OIQKVCache(cfg)
            kv = mx.random.normal((2, 1, H, 300 + 37 * i, d), key=mx.random.key(i))
            c.update_and_fetch(kv[0], kv[1])
            c.release_fresh()
            caches.append(c)
        batch = OIQKVCache.merge(caches)
        counts = []
        for t in range(20):
            kv = mx.random.normal((2, n_seq, H, 1, d), key=mx.random.key(100 + t))
            k_new, v_new = kv[0], kv[1]
            q = mx.random.normal((n_seq, 2 * H, 1, d), key=mx.random.key(200 + t))
            mx.eval(k_new, v_new, q)

            def append():
                fetched = batch.update_and_fetch(k_new, v_new)
                return fetched, [a for a in batch.state if isinstance(a, mx.array)]

            total, _ = trace.step_dispatches(append, lambda f: oiq_batch_attention(q, batch, scale=0.125),
                                             kernels=kernels)
            counts.append(total)
        assert batch.stacked is not None
        return min(counts)

    one, eight = steady(1), steady(8)
    assert one == eight, (one, eight)
    if kernels:
        assert eight == 4, eight  # centering, window write, attention and merge kernels


def _batch_of_eight(make_cache, attend, spacing, kernels, dtype, steps=48):
    """Dispatches of each decode step of 8 sequences of 300 + spacing * i tokens (2 KV heads,
    d = 64), merged into one batch cache: per step, from the second on (the first step after a
    prefill counts as prefill: it packs every held prompt, as mlx-lm counts the last prompt
    token's step)."""
    H, d, n = 2, 64, 8
    caches = []
    for i in range(n):
        c = make_cache()
        kv = mx.random.normal((2, 1, H, 300 + spacing * i, d), key=mx.random.key(i)).astype(dtype)
        c.update_and_fetch(kv[0], kv[1])
        if hasattr(c, "release_fresh"):
            c.release_fresh()
        caches.append(c)
    batch = type(caches[0]).merge(caches)
    counts = []
    for t in range(steps):
        kv = mx.random.normal((2, n, H, 1, d), key=mx.random.key(100 + t)).astype(dtype)
        k_new, v_new = kv[0], kv[1]
        q = mx.random.normal((n, 2 * H, 1, d), key=mx.random.key(200 + t)).astype(dtype)
        mx.eval(k_new, v_new, q)

        def append():
            mask = None if hasattr(batch, "stacked") else batch.make_mask(1, return_array=True)
            fetched = batch.update_and_fetch(k_new, v_new)
            return (fetched, mask), trace.arrays_of(batch) + ([] if mask is None else [mask])

        total, _ = trace.step_dispatches(append, lambda f: attend(q, batch, f), kernels=kernels)
        counts.append(total)
    return counts[1:]


@pytest.mark.parametrize("preset", ["4bit", "3bit"])
@pytest.mark.parametrize("spacing", [16, 37], ids=["in-phase", "ragged"])
def test_a_batch_of_eight_steps_within_fp16_plus_two(monkeypatch, preset, spacing):
    """B = 8 on the Metal path (traced, unverified on hardware) against mlx-lm's BatchKVCache with
    SDPA counted as the one kernel it is on a Mac (its mask built per step, two writes): no step
    over fp16's + 2.  Sequences that pack a block on the same step (in phase) pack in one gather,
    one quantize pass per packed buffer and one scatter per buffer; the packed buffers grow on a
    step that packs nothing."""
    from mlx_lm.models.cache import KVCache

    from oiq_mlx.cache.attention import oiq_batch_attention

    calls = []

    def fused_sdpa(q, k, v, *, scale, mask=None, **kwargs):
        return trace.recorded_call(calls, [q, k, v, mask], [q.shape], [q.dtype])[0]

    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", fused_sdpa)

    def fp_attend(q, batch, fetched):
        (k, v), mask = fetched
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)

    fp = _batch_of_eight(KVCache, fp_attend, spacing, False, mx.float16)
    fp = [n + 1 for n in fp]  # the recorded SDPA launch, one per step
    assert len(calls) == 48 and min(fp) == max(fp) == 8, fp  # the mask in plain ops (5), two writes, SDPA
    oiq = _batch_of_eight(lambda: OIQKVCache(OIQConfig.preset(preset)),
                          lambda q, batch, f: oiq_batch_attention(q, batch, scale=0.125), spacing, True, mx.float16)
    assert max(oiq) <= max(fp) + 2, oiq
    # steady 4 (centering, write, attention, merge); a packing step 7-9: the mean stays below fp16's
    assert min(oiq) == 4 and sum(oiq) / len(oiq) <= sum(fp) / len(fp), oiq


def test_attention_sinks_cost_no_dispatch():
    """A model with attention sinks (per-head logits, as gpt-oss) on the Metal path: the sink
    logit follows the key centering (minus scale * q . mean), which pass 1 computes from the
    queries it loads and the merge kernel subtracts, reading the logits per head as given: 4
    per step, as without sinks (float32 logits; logits in another dtype add one cast).
    mlx-lm's KVCache + SDPA with sinks counts 7 in the same (CPU) graph, 3-4 on a Mac."""
    from mlx_lm.models.cache import KVCache

    from oiq_mlx.cache.attention import oiq_attention

    sinks = mx.random.normal((8,), key=mx.random.key(99))
    sinks16 = sinks.astype(mx.float16)
    mx.eval(sinks, sinks16)

    def counts(make, attend, kernels):
        """Each of 3 decode steps after a 300-token prompt (8 query / 2 KV heads, d = 64, float16)."""
        return trace.decode_dispatches(make, attend, context=300, n_q_heads=8, n_kv_heads=2, head_dim=64, steps=3,
                                       dtype=mx.float16, kernels=kernels)

    make = lambda: OIQKVCache(OIQConfig.preset("4bit"))  # noqa: E731
    without = counts(make, lambda c, f, q: oiq_attention(q, c, 0.125, None, None), kernels=True)
    with_sinks = counts(make, lambda c, f, q: oiq_attention(q, c, 0.125, None, sinks), kernels=True)
    assert without["per_step"] == [4] * 3, without
    assert with_sinks["per_step"] == [4] * 3, with_sinks
    half = counts(make, lambda c, f, q: oiq_attention(q, c, 0.125, None, sinks16), kernels=True)
    assert half["per_step"] == [5] * 3 and half["breakdown"]["AsType"] == 1, half
    fp = counts(KVCache, lambda c, f, q: mx.fast.scaled_dot_product_attention(q, f[0], f[1], scale=0.125,
                                                                                sinks=sinks16), kernels=False)
    assert fp["per_step"] == [7] * 3, fp
