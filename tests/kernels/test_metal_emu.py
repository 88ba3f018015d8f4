"""The CPU Metal emulator runs MLX-generated kernels faithfully and catches misuse."""

import re

import mlx.core as mx
import numpy as np
import pytest

import metal_emu
from metal_emu import MetalEmuError, MetalEmuUnsupported, launch


def _kernel(name, source, inputs, outputs, header=""):
    return mx.fast.metal_kernel(name=name, input_names=inputs, output_names=outputs,
                                source=source, header=header, ensure_row_contiguous=True)


# ---------------------------------------------------------------- elementwise
_AXPB = _kernel("emu_axpb", """
    uint i = thread_position_in_grid.x;
    if (i >= n) return;
    out[i] = static_cast<T>(metal::exp(static_cast<float>(x[i])) * a + static_cast<float>(y[i]));
""", ["x", "y", "a", "n"], ["out"])


@pytest.mark.parametrize("dtype, tol", [
    # fp32 differs only by exp's last-ulp; half/bf16 by one rounding of the result.
    (mx.float32, 1e-6), (mx.float16, 1e-3), (mx.bfloat16, 8e-3)])
def test_elementwise_template_dtype(dtype, tol):
    n = 1000
    x = mx.random.normal((n,), key=mx.random.key(0)).astype(dtype)
    y = mx.random.normal((n,), key=mx.random.key(1)).astype(dtype)
    (out,) = launch(_AXPB, inputs=[x, y, 0.5, n], template=[("T", dtype)], grid=(1024, 1, 1),
                    threadgroup=(256, 1, 1), output_shapes=[(n,)], output_dtypes=[dtype])
    assert out.dtype == dtype and out.shape == (n,)
    ref = (mx.exp(x.astype(mx.float32)) * 0.5 + y.astype(mx.float32)).astype(dtype)
    err = mx.abs(out.astype(mx.float32) - ref.astype(mx.float32))
    scale = mx.maximum(mx.abs(ref.astype(mx.float32)), 1.0)
    assert (err / scale).max().item() <= tol


_FAST_EXP = _kernel("emu_fast_exp", """
    uint i = thread_position_in_grid.x;
    out[i] = fast::exp(x[i]);
    precise_out[i] = exp(x[i]);
""", ["x"], ["out", "precise_out"])


def _fast_exp_ulps(monkeypatch, mode, x):
    """fast::exp and exp of x (float32) under the emulator, and fast::exp's signed error in ulp
    of the float binade of exp(x) (float64)."""
    monkeypatch.setattr(metal_emu.emulator, "FAST_EXP", mode)
    n = x.size
    out, precise = launch(_FAST_EXP, inputs=[mx.array(x)], grid=(n, 1, 1), threadgroup=(min(n, 256), 1, 1),
                          output_shapes=[(n,), (n,)], output_dtypes=[mx.float32, mx.float32])
    y = np.exp(x.astype(np.float64))
    ulp = np.ldexp(1.0, np.frexp(y)[1] - 24)
    return np.array(out).astype(np.float64), np.array(precise).astype(np.float64), (np.array(out) - y) / ulp


def test_fast_exp_error_model(monkeypatch):
    """fast::exp is off exp(x) by Metal's documented fast-math bound 3 + floor(|2x|) ulp, up to one
    ulp more (MSL 8.4, Table 8.2), on a side that is a fixed function of x; the precise exp is not
    perturbed; `scale` multiplies the bound; results below FLT_MIN flush to zero."""
    x = np.concatenate([np.linspace(-87.0, 0.0, 1021), [0.0, -0.25, -1e-30]]).astype(np.float32)
    bound = 3 + np.floor(np.abs(2.0 * x.astype(np.float64)))
    fast, precise, err = _fast_exp_ulps(monkeypatch, ("hash", 1.0), x)
    assert (np.abs(err) >= bound).all() and (np.abs(err) < bound + 1).all()
    assert 0.4 < (err > 0).mean() < 0.6  # both sides
    assert np.abs((precise - np.exp(x.astype(np.float64))) / np.exp(x.astype(np.float64))).max() < 2 ** -23
    again, _, _ = _fast_exp_ulps(monkeypatch, ("hash", 1.0), x)
    assert (again == fast).all()  # deterministic
    _, _, up = _fast_exp_ulps(monkeypatch, ("up", 1.0), x)
    _, _, down = _fast_exp_ulps(monkeypatch, ("down", 1.0), x)
    assert (up >= bound).all() and (down <= -bound).all()
    _, _, big = _fast_exp_ulps(monkeypatch, ("up", 8.0), x)
    assert (big >= np.floor(8 * bound)).all()
    exact, _, e0 = _fast_exp_ulps(monkeypatch, ("exact", 1.0), x)
    assert np.abs(e0).max() <= 0.5
    tiny, _, _ = _fast_exp_ulps(monkeypatch, ("hash", 1.0), np.array([-88.0, -100.0, -np.inf], np.float32))
    assert (tiny == 0).all()
    nan, _, _ = _fast_exp_ulps(monkeypatch, ("hash", 1.0), np.array([np.nan], np.float32))
    assert np.isnan(nan).all()


def test_unwritten_output_is_poisoned():
    (out,) = launch(_AXPB, inputs=[mx.zeros((8,)), mx.zeros((8,)), 1.0, 8],
                    template=[("T", mx.float32)], grid=(8, 1, 1), threadgroup=(8, 1, 1),
                    output_shapes=[(16,)], output_dtypes=[mx.float32])
    assert np.all(np.array(out[:8]) == 1.0)
    assert np.all(np.isnan(np.array(out[8:])))


# ---------------------------------------------------------------- grid shape
_COUNT = _kernel("emu_count", """
    uint3 p = thread_position_in_grid;
    uint idx = (p.z * grid_size.y + p.y) * grid_size.x + p.x;
    hits[idx] += 1u;
    lin[idx] = thread_index_in_threadgroup
             + 10000u * (threadgroup_position_in_grid.x + 100u * threadgroup_position_in_grid.y);
    tpt[idx] = threads_per_threadgroup.x * threads_per_threadgroup.y * threads_per_threadgroup.z;
""", [], ["hits", "lin", "tpt"])


@pytest.mark.parametrize("grid, tg", [((257, 1, 1), (32, 1, 1)), ((37, 11, 3), (8, 4, 2))])
def test_partial_edge_threadgroups_run_every_thread_once(grid, tg):
    n = grid[0] * grid[1] * grid[2]
    hits, lin, tpt = launch(_COUNT, inputs=[], grid=grid, threadgroup=tg, init_value=0,
                            output_shapes=[(n,)] * 3, output_dtypes=[mx.uint32] * 3)
    assert np.array_equal(np.array(hits), np.ones(n, np.uint32))
    # Edge groups are smaller: their size is min(tg, grid - origin) per dimension.
    pos = np.stack(np.meshgrid(*[np.arange(g) for g in grid], indexing="ij"), -1)
    pos = pos.transpose(2, 1, 0, 3).reshape(-1, 3)
    origin = pos // np.array(tg) * np.array(tg)
    size = np.minimum(np.array(tg), np.array(grid) - origin)
    local = pos - origin
    want_lin = local[:, 0] + size[:, 0] * (local[:, 1] + size[:, 1] * local[:, 2])
    group = pos // np.array(tg)
    want_lin = want_lin + 10000 * (group[:, 0] + 100 * group[:, 1])
    assert np.array_equal(np.array(lin), want_lin)
    assert np.array_equal(np.array(tpt), size.prod(-1))


# ---------------------------------------------------------------- threadgroup memory
_TREE_SUM = """
    threadgroup float buf[TG];
    uint t = thread_position_in_threadgroup.x;
    uint row = threadgroup_position_in_grid.x;
    float acc = 0.0f;
    for (uint i = t; i < uint(n); i += TG) acc += x[row * n + i];
    buf[t] = acc;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint s = TG / 2; s > 0; s >>= 1) {
        if (t < s) buf[t] += buf[t + s];
        BARRIER
    }
    if (t == 0) out[row] = buf[0];
"""
_REDUCE = _kernel("emu_tree_sum", _TREE_SUM.replace(
    "BARRIER", "threadgroup_barrier(mem_flags::mem_threadgroup);"), ["x", "n"], ["out"])
_REDUCE_NO_BARRIER = _kernel("emu_tree_sum_racy", _TREE_SUM.replace("BARRIER", ""),
                             ["x", "n"], ["out"])


def _tree_sum(kernel, x):
    rows, n = x.shape
    return launch(kernel, inputs=[x, n], template=[("TG", 128)], grid=(rows * 128, 1, 1),
                  threadgroup=(128, 1, 1), output_shapes=[(rows,)], output_dtypes=[mx.float32])[0]


def test_threadgroup_memory_tree_reduction():
    x = mx.random.uniform(shape=(5, 1000), key=mx.random.key(2))
    out = _tree_sum(_REDUCE, x)
    np.testing.assert_allclose(np.array(out), np.array(x, np.float64).sum(1), rtol=1e-5)


def test_missing_barrier_is_a_race_between_execution_orders(monkeypatch):
    # Without the barrier, which partial sums a thread sees depends on the order in which
    # threads run between synchronisation points: forward gives stale reads, and the
    # results of two orders differ, which the emulator reports as a race.
    x = mx.random.uniform(shape=(5, 1000), key=mx.random.key(2))
    ref = np.array(x, np.float64).sum(1)
    monkeypatch.setenv("OIQ_EMU_ORDERS", "forward")
    assert not np.allclose(np.array(_tree_sum(_REDUCE_NO_BARRIER, x)), ref, rtol=1e-3)
    monkeypatch.setenv("OIQ_EMU_ORDERS", "forward,reverse")
    with pytest.raises(MetalEmuError, match="results depend on the execution order"):
        _tree_sum(_REDUCE_NO_BARRIER, x)
    monkeypatch.delenv("OIQ_EMU_ORDERS")
    with pytest.raises(MetalEmuError, match="results depend on the execution order"):
        _tree_sum(_REDUCE_NO_BARRIER, x)  # the default runs several orders too
    np.testing.assert_allclose(np.array(_tree_sum(_REDUCE, x)), ref, rtol=1e-5)


_RANK = _kernel("emu_rank", """
    threadgroup uint counter[1];
    if (thread_position_in_threadgroup.x == 0) counter[0] = 0;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    rank[thread_position_in_grid.x] = counter[0];
    counter[0] = counter[0] + 1u;
""", [], ["rank"])


@pytest.mark.parametrize("order", ["forward", "reverse", "shuffle:1", "shuffle:2"])
def test_execution_orders(monkeypatch, order):
    # Between the barrier and the end each thread runs alone: its rank is its turn.
    monkeypatch.setenv("OIQ_EMU_ORDERS", order)
    (rank,) = launch(_RANK, inputs=[], grid=(64, 1, 1), threadgroup=(64, 1, 1), output_shapes=[(64,)],
                     output_dtypes=[mx.uint32])
    rank = np.array(rank)
    assert sorted(rank.tolist()) == list(range(64))
    if order == "forward":
        assert rank.tolist() == list(range(64))
    elif order == "reverse":
        assert rank.tolist() == list(range(63, -1, -1))
    else:
        assert rank.tolist() not in (list(range(64)), list(range(63, -1, -1)))
        other = "shuffle:2" if order == "shuffle:1" else "shuffle:1"
        monkeypatch.setenv("OIQ_EMU_ORDERS", other)
        again = launch(_RANK, inputs=[], grid=(64, 1, 1), threadgroup=(64, 1, 1), output_shapes=[(64,)],
                       output_dtypes=[mx.uint32])[0]
        assert not np.array_equal(np.array(again), rank)  # seeds give different orders


def test_threadgroup_memory_is_poisoned_per_group():
    k = _kernel("emu_tg_poison", """
        threadgroup uint buf[4];
        uint g = threadgroup_position_in_grid.x;
        if (g == 0 && thread_position_in_threadgroup.x == 0) buf[0] = 7u;
        threadgroup_barrier(mem_flags::mem_threadgroup);
        out[g] = buf[0];
    """, [], ["out"])
    (out,) = launch(k, inputs=[], grid=(2, 1, 1), threadgroup=(1, 1, 1), output_shapes=[(2,)],
                    output_dtypes=[mx.uint32])
    assert np.array(out).tolist() == [7, 0xFFFFFFFF]


# ---------------------------------------------------------------- simd collectives
_SIMD = _kernel("emu_simd", """
    uint i = thread_position_in_grid.x;
    uint lane = thread_index_in_simdgroup;
    float v = x[i];
    sum[i] = simd_sum(v);
    mx_[i] = simd_max(v);
    xr[i] = simd_shuffle_xor(v, 5);
    pre[i] = simd_prefix_exclusive_sum(v);
    bc[i] = simd_broadcast(v, 3);
    dn[i] = simd_shuffle_down(v, 4);
    isum[i] = simd_sum(int(lane));
    sg[i] = simdgroup_index_in_threadgroup;
""", ["x"], ["sum", "mx_", "xr", "pre", "bc", "dn", "isum", "sg"])


def test_simd_collectives():
    n = 128
    x = mx.random.normal((n,), key=mx.random.key(3))
    dts = [mx.float32] * 6 + [mx.int32, mx.uint32]
    outs = launch(_SIMD, inputs=[x], grid=(n, 1, 1), threadgroup=(64, 1, 1),
                  output_shapes=[(n,)] * 8, output_dtypes=dts)
    s, m, xr, pre, bc, dn, isum, sg = (np.array(o) for o in outs)
    xs = np.array(x).reshape(-1, 32)
    lane = np.arange(32)
    np.testing.assert_allclose(s, np.repeat(xs.sum(1), 32), rtol=1e-5, atol=1e-5)
    assert np.array_equal(m, np.repeat(xs.max(1), 32))
    assert np.array_equal(xr, xs[:, lane ^ 5].reshape(-1))
    excl = np.concatenate([np.zeros((4, 1)), np.cumsum(xs, 1)[:, :-1]], 1)
    np.testing.assert_allclose(pre, excl.reshape(-1), rtol=1e-5, atol=1e-5)
    assert np.array_equal(bc, np.repeat(xs[:, 3], 32))
    down = np.where(lane + 4 < 32, xs[:, np.minimum(lane + 4, 31)], xs)
    assert np.array_equal(dn, down.reshape(-1))
    assert np.all(isum == sum(range(32)))
    assert np.array_equal(sg, np.tile(np.repeat([0, 1], 32), 2))


_BITS16 = _kernel("emu_bits16", """
    uint i = thread_position_in_grid.x;
    out[i] = uint(as_type<ushort>(x[i])) | (uint(as_type<ushort>(T(float(x[i]) * 2.0f))) << 16);
""", ["x"], ["out"])


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_as_type_of_16_bit_floats(dtype):
    """as_type<ushort> of half / bfloat16_t: their bits (the type-checking build, whose stand-ins
    for them are wider types, compiles it too)."""
    x = mx.array([1.0, -2.5, 0.0, 65504.0 if dtype == mx.float16 else 3e38, 1e-7, float("inf"),
                  float("nan"), -0.0], dtype)
    (out,) = launch(_BITS16, inputs=[x], template=[("T", dtype)], grid=(8, 1, 1), threadgroup=(8, 1, 1),
                    output_shapes=[(8,)], output_dtypes=[mx.uint32])
    want = np.array(x.view(mx.uint16)).astype(np.uint32) | \
        (np.array((x.astype(mx.float32) * 2).astype(dtype).view(mx.uint16)).astype(np.uint32) << 16)
    assert np.array_equal(np.array(out)[:6], want[:6]) and np.array_equal(np.array(out)[7], want[7])
    assert (np.array(out)[6] & 0x7FFF) == (np.array(x.view(mx.uint16))[6] & 0x7FFF)  # the NaN's own bits


def test_partial_simdgroup_is_refused_for_simd_kernels():
    # Metal forms simdgroups of 32 threads; a kernel using simd_* on a 40-thread grid would
    # reduce over 8 lanes in the last group: refused before running.
    with pytest.raises(MetalEmuError, match=r"partial simdgroup"):
        launch(_SIMD, inputs=[mx.ones((40,))], grid=(40, 1, 1), threadgroup=(64, 1, 1),
               output_shapes=[(40,)] * 8, output_dtypes=[mx.float32] * 6 + [mx.int32, mx.uint32])
    with pytest.raises(MetalEmuError, match=r"16x1x1 = 16 threads"):
        launch(_SIMD, inputs=[mx.ones((64,))], grid=(64, 1, 1), threadgroup=(16, 1, 1),
               output_shapes=[(64,)] * 8, output_dtypes=[mx.float32] * 6 + [mx.int32, mx.uint32])


def test_too_many_threads_per_threadgroup_is_refused():
    with pytest.raises(MetalEmuError, match="at most 1024"):
        launch(_AXPB, inputs=[mx.zeros((8,)), mx.zeros((8,)), 1.0, 8], template=[("T", mx.float32)],
               grid=(2048, 1, 1), threadgroup=(2048, 1, 1), output_shapes=[(8,)],
               output_dtypes=[mx.float32])


# ---------------------------------------------------------------- scalars and shapes
def test_scalar_inputs_and_shape_strides_ndim():
    k = _kernel("emu_meta", """
        uint i = thread_position_in_grid.x;
        if (i >= uint(x_shape[0] * x_shape[1] * x_shape[2])) return;
        int64_t loc = elem_to_loc(i, x_shape, x_strides, x_ndim);
        out[i] = x[loc] * scale + float(offset) + float(x_ndim) * 1000.0f;
        if (i == 0) {
            for (int d = 0; d < x_ndim; ++d) meta[d] = int(x_strides[d]);
            meta[3] = x_shape[1];
        }
    """, ["x", "scale", "offset"], ["out", "meta"])
    base = mx.arange(2 * 3 * 4, dtype=mx.float32).reshape(4, 3, 2)
    x = base.transpose(2, 1, 0)  # ensure_row_contiguous copies it, as MLX does
    out, meta = launch(k, inputs=[x, mx.array(2.0), 7], grid=(32, 1, 1), threadgroup=(32, 1, 1),
                       output_shapes=[(2, 3, 4), (4,)], output_dtypes=[mx.float32, mx.int32])
    np.testing.assert_array_equal(np.array(out), np.array(x) * 2.0 + 7 + 3000.0)
    assert np.array(meta).tolist() == [12, 4, 1, 3]


# ---------------------------------------------------------------- MLX's own kernel code
def _mlx_definitions(header, names):
    """The top-level template functions called `names` in one of MLX's Metal headers."""
    text = (metal_emu.emulator.MLX_INCLUDE / "mlx/backend/metal/kernels" / header).read_text()
    out = []
    for m in re.finditer(r"^template <[^\n]*>\n(?:inline|METAL_FUNC)[^\n(]*?\b(\w+)\(", text, re.M):
        if m.group(1) not in names:
            continue
        i, depth = text.index("{", m.end()), 0
        while True:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
            if depth == 0:
                break
        out.append(text[m.start():i])
    assert len(out) >= len(names)
    return "\n\n".join(out)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_mlx_qmv_fast_matches_quantized_matmul(bits):
    # The whole quantized.h needs MLX's steel GEMM headers, so only the
    # mat-vec path is pasted in, unmodified.
    header = ("#define MLX_MTL_CONST static constant constexpr const\n"
              "MLX_MTL_CONST int SIMD_SIZE = 32;\n") + _mlx_definitions(
        "quantized.h", {"get_pack_factor", "get_bytes_per_pack", "load_vector", "qdot",
                        "qmv_fast_impl"})
    k = _kernel("emu_qmv", """
        qmv_fast_impl<T, GS, BITS>(w, scales, biases, x, y, in_vec_size, out_vec_size,
            threadgroup_position_in_grid, simdgroup_index_in_threadgroup,
            thread_index_in_simdgroup);
    """, ["w", "scales", "biases", "x", "in_vec_size", "out_vec_size"], ["y"], header=header)
    rows, cols = 64, 512
    wq, scales, biases = mx.quantize(mx.random.normal((rows, cols), key=mx.random.key(4)),
                                     group_size=32, bits=bits)
    x = mx.random.normal((cols,), key=mx.random.key(5))
    (y,) = launch(k, inputs=[wq, scales, biases, x, cols, rows],
                  template=[("T", mx.float32), ("GS", 32), ("BITS", bits)],
                  grid=(32, 2 * rows // 8, 1), threadgroup=(32, 2, 1), output_shapes=[(rows,)],
                  output_dtypes=[mx.float32])
    ref = mx.quantized_matmul(x[None], wq, scales, biases, transpose=True, group_size=32,
                              bits=bits)[0]
    # Same fp32 products, different summation order: a few ulps of |y| ~ 20.
    np.testing.assert_allclose(np.array(y), np.array(ref), rtol=0, atol=1e-4)


# ---------------------------------------------------------------- misuse
def test_barrier_in_divergent_branch_raises():
    k = _kernel("emu_bad_barrier", """
        uint t = thread_position_in_threadgroup.x;
        if (t < 16) {
            threadgroup_barrier(mem_flags::mem_threadgroup);
        }
        out[thread_position_in_grid.x] = 1.0f;
    """, [], ["out"])
    with pytest.raises(MetalEmuError, match="only part of the threadgroup"):
        launch(k, inputs=[], grid=(32, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(32,)],
               output_dtypes=[mx.float32])


def test_simd_op_divergence_raises():
    k = _kernel("emu_bad_simd", """
        uint lane = thread_index_in_simdgroup;
        float v = 1.0f;
        if (lane < 8) v = simd_sum(v); else v = simd_max(v);
        out[thread_position_in_grid.x] = v;
    """, [], ["out"])
    with pytest.raises(MetalEmuError, match="simdgroup 0 diverged"):
        launch(k, inputs=[], grid=(32, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(32,)],
               output_dtypes=[mx.float32])


def test_simdgroup_matrix_is_unsupported():
    k = _kernel("emu_mma", """
        simdgroup_float8x8 a;
        simdgroup_load(a, x, 8);
        out[0] = 0.0f;
    """, ["x"], ["out"])
    with pytest.raises(MetalEmuUnsupported, match="simdgroup_matrix"):
        launch(k, inputs=[mx.zeros((64,))], grid=(32, 1, 1), threadgroup=(32, 1, 1),
               output_shapes=[(1,)], output_dtypes=[mx.float32])


def test_out_of_bounds_write_raises():
    k = _kernel("emu_oob", "out[thread_position_in_grid.x + 1] = 1.0f;", [], ["out"])
    with pytest.raises(MetalEmuError, match=r"thread \(3, 0, 0\) wrote 4 bytes at byte offset 16 .* "
                                            r"output 'out' .* outside the array"):
        launch(k, inputs=[], grid=(4, 1, 1), threadgroup=(4, 1, 1), output_shapes=[(4,)],
               output_dtypes=[mx.float32])


_STRIDED_COPY_SOURCE = """
    uint i = thread_position_in_grid.x;
    uint j = thread_position_in_grid.y;
    out[i * x_shape[1] + j] = x[i * x_strides[0] + j * x_strides[1] + EXTRA];
    if (i == 0 && j == 0) { meta[0] = x_strides[0]; meta[1] = x_strides[1]; }
"""
_STRIDED_COPY = mx.fast.metal_kernel(name="emu_strided", input_names=["x"], output_names=["out", "meta"],
                                     source=_STRIDED_COPY_SOURCE, ensure_row_contiguous=False)


def _strided_copy(x, extra=0):
    return launch(_STRIDED_COPY, inputs=[x], template=[("EXTRA", extra)], grid=(x.shape[0], x.shape[1], 1),
                  threadgroup=(1, 1, 1), output_shapes=[x.shape, (2,)], output_dtypes=[mx.float32, mx.int64])


def test_inputs_keep_their_strides_offsets_and_broadcasts():
    # A slice of a larger buffer and a stride-0 broadcast reach an ensure_row_contiguous=False
    # kernel as MLX binds them, not as dense copies.
    base = mx.arange(6 * 10, dtype=mx.float32).reshape(6, 10)
    view = base[1:5, 2:5]
    out, meta = _strided_copy(view)
    assert np.array(meta).tolist() == [10, 1]
    assert np.array_equal(np.array(out), np.array(view))
    row = mx.broadcast_to(mx.array([1.0, 2.0, 3.0]), (4, 3))
    out, meta = _strided_copy(row)
    assert np.array(meta).tolist() == [0, 1]
    assert np.array_equal(np.array(out), np.array(row))
    # ensure_row_contiguous=True kernels get MLX's contiguous copy instead.
    out, meta = launch(_kernel("emu_strided_rc", _STRIDED_COPY_SOURCE, ["x"], ["out", "meta"]),
                       inputs=[view], template=[("EXTRA", 0)], grid=(4, 3, 1), threadgroup=(1, 1, 1),
                       output_shapes=[(4, 3), (2,)], output_dtypes=[mx.float32, mx.int64])
    assert np.array(meta).tolist() == [3, 1] and np.array_equal(np.array(out), np.array(view))


def test_out_of_bounds_read_raises():
    x = mx.arange(12, dtype=mx.float32).reshape(4, 3)
    with pytest.raises(MetalEmuError, match=r"read 4 bytes at byte offset 48 .* input 'x' .* outside the array"):
        _strided_copy(x, extra=1)


def test_read_between_the_elements_of_a_slice_raises():
    # x[:, :3] of a (4, 10) buffer: element 3 of a row lies in the parent buffer, not in
    # the view; on a GPU the read would return stale data from the capacity buffer.
    base = mx.arange(40, dtype=mx.float32).reshape(4, 10)
    with pytest.raises(MetalEmuError, match=r"input 'x' \(shape \(4, 3\), byte strides \(40, 4\)\), "
                                            r"inside the span of its elements but in a gap"):
        _strided_copy(base[:, :3], extra=1)


_AS_HEADER = """
template <typename P>
METAL_FUNC float first_any(P p) { return float(p[0]); }
METAL_FUNC float first_device(const device float* p) { return p[0]; }
"""


@pytest.mark.parametrize("n, call, ok", [
    (16, "first_device(x)", True),      # 16 elements: `const device float*`
    (4, "first_device(x)", False),      # 4 elements: MLX declares `const constant float*`
    (4, "first_any(x)", True),          # a template on the pointer type takes either
])
def test_address_spaces_are_types(n, call, ok):
    k = _kernel(f"emu_as_{n}_{ok}", f"out[0] = {call};", ["x"], ["out"], header=_AS_HEADER)
    args = dict(inputs=[mx.arange(n, dtype=mx.float32) + 1], grid=(1, 1, 1), threadgroup=(1, 1, 1),
                output_shapes=[(1,)], output_dtypes=[mx.float32])
    if ok:
        assert launch(k, **args)[0].item() == 1.0
    else:
        with pytest.raises(metal_emu.MetalEmuCompileError,
                           match=r"cannot pass pointer to address space '2' \(constant\) as a pointer to "
                                 r"address space '1' \(device\)"):
            launch(k, **args)


def test_threadgroup_memory_limit():
    src = "threadgroup float buf[N]; buf[thread_position_in_threadgroup.x] = 1.0f; out[0] = buf[0];"
    k = _kernel("emu_tg_limit", src, [], ["out"])
    args = dict(inputs=[], grid=(1, 1, 1), threadgroup=(1, 1, 1), output_shapes=[(1,)],
                output_dtypes=[mx.float32])
    launch(k, template=[("N", 8192)], **args)  # exactly 32 KiB
    name = next(n for n in metal_emu.emulator.RESOURCES if n.startswith("custom_kernel_emu_tg_limit"))
    assert metal_emu.emulator.RESOURCES[name]["threadgroup_bytes"] == 32768
    with pytest.raises(MetalEmuError, match="32772 bytes of threadgroup memory; Metal allows 32768"):
        launch(k, template=[("N", 8193)], **args)


def test_compile_error_names_the_line():
    k = _kernel("emu_typo", "out[0] = not_a_function(1.0f);", [], ["out"])
    with pytest.raises(metal_emu.MetalEmuCompileError, match="not_a_function"):
        launch(k, inputs=[], grid=(1, 1, 1), threadgroup=(1, 1, 1), output_shapes=[(1,)],
               output_dtypes=[mx.float32])


def test_use_emulator_patches_the_launcher(monkeypatch):
    import oiq_mlx.kernels.launcher as _launch

    metal_emu.use_emulator(monkeypatch)
    (out,) = _launch.launch(_AXPB, inputs=[mx.zeros((4,)), mx.ones((4,)), 2.0, 4],
                            template=[("T", mx.float32)], grid=(4, 1, 1), threadgroup=(4, 1, 1),
                            output_shapes=[(4,)], output_dtypes=[mx.float32])
    assert np.array(out).tolist() == [3.0] * 4
