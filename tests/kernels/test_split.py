"""The split of the decode kernel's key sequence into slices (kernels.decode_attention.split_parts and
keys_per_part; metal/README.md, "Split sizes"): properties of the rule, not timings (it is unverified
on hardware)."""

import itertools
import math

import mlx.core as mx
import pytest

from oiq_mlx.kernels import decode_attention as da

TOTALS = [1, 2, 63, 64, 65, 100, 255, 256, 1000, 4096, 4100, 8192, 32768, 131072, 10 ** 6]
PROGRAMS = [1, 2, 4, 8, 16, 32, 64, 100, 256, 1024, 4096]
KMINS = [1, 64, 100, 231, 520, 4096]


def test_parts_monotone_and_bounded():
    for n, k in itertools.product(PROGRAMS, KMINS):
        parts = [da.split_parts(t, n, k) for t in TOTALS]
        assert parts == sorted(parts), (n, k, parts)  # more keys, never fewer slices
    for t, k in itertools.product(TOTALS, KMINS):
        parts = [da.split_parts(t, n, k) for n in PROGRAMS]
        assert parts == sorted(parts, reverse=True), (t, k, parts)  # more programs, never more slices
    for t, n in itertools.product(TOTALS, PROGRAMS):
        parts = [da.split_parts(t, n, k) for k in KMINS]
        assert parts == sorted(parts, reverse=True), (t, n, parts)
    for t, n, k in itertools.product(TOTALS, PROGRAMS, KMINS):
        p = da.split_parts(t, n, k)
        assert 1 <= p <= da.MAX_PARTS - 2
        assert p == 1 or t // p >= k                      # no slice below kmin keys (but one)
        assert n * p < da.TARGET_SIMDGROUPS + n            # no more simdgroups than the target asks
        # as many as the target asks, unless kmin or the merge's cap stops it
        assert p == min(math.ceil(da.TARGET_SIMDGROUPS / n), max(1, t // k), da.MAX_PARTS - 2)


@pytest.mark.parametrize("d, qb", [(32, 8), (64, 8), (128, 4), (128, 1), (256, 2)])
def test_min_keys_per_part_keeps_partials_small(d, qb):
    fp16 = da.bytes_per_key(d, 4, 4, 32, 0, 1, 2)
    costs = sorted([da.bytes_per_key(d, b, b, g, 1, 0, 2) for b in (2, 3, 4, 8) for g in (32, 128)] + [fp16])
    kmins = [da.min_keys_per_part(d, qb, c) for c in costs]
    assert kmins == sorted(kmins, reverse=True)  # cheaper keys, longer slices
    for c, k in zip(costs, kmins):
        assert k >= da.KEYS_PER_PART_MIN
        # the partial outputs (written + read) within 1/PARTIAL_TRAFFIC_SHARE of the slice's reads
        assert 2 * qb * (d + 2) * 4 * da.PARTIAL_TRAFFIC_SHARE <= k * c
    assert da.min_keys_per_part(d, qb, costs[0]) >= da.min_keys_per_part(d, max(1, qb // 2), costs[0])


def test_every_split_fits_the_merge():
    """Whatever the segment lengths, programs and head sizes, the slices (segments rounded up
    apart) never exceed what the merge reads, and cover every key."""
    for T, n, d, qb, bits in itertools.product([1, 5, 36, 37, 100, 4096, 4133, 32768, 131075],
                                                [1, 8, 64, 512], [64, 128, 256], [1, 2, 4], [2, 4, 8]):
        for sink, recent in ((4, 32), (0, 0), (4, 0), (T, 0), (0, T)):
            if sink + recent > T:
                continue
            quant = T - sink - recent
            c = da.bytes_per_key(d, bits, bits, 32, quant, sink + recent, 2)
            kpp = da.keys_per_part(T, n, d=d, qb=qb, bytes_per_key=c)
            parts = da.segment_parts(kpp, sink, quant, recent)
            assert sum(parts) <= da.MAX_PARTS, (T, n, d, qb, bits, sink, recent, kpp, parts)
            assert all(p * kpp >= m for p, m in zip(parts, (sink, quant, recent)))
            # in whole threadgroups of one domain each: the merge reads at most 34 partials
            p_fp, P = da.launch_parts(*parts)
            tgp = da.PARTS_PER_THREADGROUP
            assert p_fp % tgp == 0 and P % tgp == 0 and p_fp >= parts[0] + parts[2] and P - p_fp >= parts[1]
            assert P - sum(parts) <= 2 * (tgp - 1) and P // tgp <= 34


def test_slices_beyond_the_merge_are_refused():
    fp = mx.zeros((1, 1, 200, 64), mx.float16)
    with pytest.raises(ValueError, match="the merge reads at most"):
        da.decode_attention(mx.zeros((1, 1, 1, 64), mx.float16), scale=0.125, segments=(fp, fp, None, None, None),
                            k_bits=4, v_bits=4, group_size=32, keys_per_part_=1)


def test_split_table_of_the_readme():
    """The rows of metal/README.md's tables (d = 128, 8 KV heads, GQA 4 so QB = 4, batch 1, the
    presets' 4 sink + 64 recent fp16 rows, the rest packed at group 32)."""
    rows = {}
    for bits, T in itertools.product((4, 3, 2), (4096, 32768)):
        c = da.bytes_per_key(128, bits, bits, 32, T - 68, 68, 2)
        kpp = da.keys_per_part(T, 8, d=128, qb=4, bytes_per_key=c)
        parts = da.segment_parts(kpp, 4, T - 68, 64)
        rows[bits, T] = (kpp, sum(parts), da.launch_parts(*parts)[1] // da.PARTS_PER_THREADGROUP)
    assert rows == {(4, 4096): (228, 20, 6), (4, 32768): (261, 128, 33), (3, 4096): (293, 16, 5),
                    (3, 32768): (296, 113, 29), (2, 4096): (410, 12, 4), (2, 32768): (415, 81, 21)}, rows
