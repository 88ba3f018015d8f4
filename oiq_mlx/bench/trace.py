"""Count the GPU dispatches (primitives that launch work) of one decode step of one layer.

A decode step of one layer appends one token's key and value to the cache and attends one query
over it.  The step is built lazily and its graph read with ``mx.export_to_dot`` (what
``mx.export_function`` traces, without its limit that the ``Contiguous`` primitive of
``ensure_row_contiguous`` kernels cannot be serialised); every primitive counts except views and
broadcasts (``VIEW_PRIMITIVES``), which launch nothing.  A ``Compiled...`` primitive
(``mx.compile``'s fused elementwise kernel) counts once.

``kernels=True`` selects the Metal kernels as on a Mac (``dispatch.kernels_enabled``) and replaces
the launcher (``kernels.launcher.launch``) by one that records each kernel call and returns
evaluated zero placeholders: calling a kernel outside tracing raises "No Metal back-end" off a
Mac, and the placeholders keep the kernels' inputs out of the graph; each recorded call counts
as one dispatch, and the first-use self-test (``kernels.selftest``) is skipped (it would read
the placeholders).  On the reference path (``kernels=False``) the count is what the CPU backend
(and CI) runs, which is also what MLX would launch for that graph on any device.
"""

from __future__ import annotations

import re
import tempfile
from collections import Counter, namedtuple
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx

from ..kernels import decode_attention, dispatch
from ..kernels import launcher
from ..kernels import selftest

# "View" (a dtype reinterpretation) shares its input's buffer when the dtype narrows over a
# contiguous last axis, the one way the cache uses it (codec.split_rows: float16 scales out of
# uint32 packed rows); a Reshape of an array whose strides do not merge copies, so the decode
# step passes strided slices to kernels as they are instead of reshaping them.
VIEW_PRIMITIVES = frozenset({"Broadcast", "Reshape", "ExpandDims", "Squeeze", "Transpose", "Slice", "Flatten",
                             "Unflatten", "AsStrided", "StopGradient", "View"})


def launching_primitives(outputs) -> Counter:
    """Primitive name -> count over the (unevaluated) graph that computes ``outputs``, views left out."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "graph.dot"
        mx.export_to_dot(str(path), *outputs)
        names = re.findall(r'label ="([A-Za-z0-9_]+)', path.read_text())
    return Counter(n for n in names if n not in VIEW_PRIMITIVES)


# one recorded kernel call: its input arrays and the (zero) arrays it returned in place of its outputs
# reads: the bytes the kernel reads of its inputs where it says so (the decode kernel given
# per-sequence row ranges: decode_attention.attention_bytes_read), else None (all of them)
KernelCall = namedtuple("KernelCall", ["inputs", "outputs", "reads"], defaults=[None])


def recorded_call(calls: list, inputs, output_shapes, output_dtypes, reads: int | None = None) -> list:
    """Append a :class:`KernelCall` to ``calls`` and return its outputs: evaluated zeros of
    ``output_shapes`` / ``output_dtypes``, so that nothing downstream depends on the inputs'
    graph through them."""
    outs = [mx.zeros(s, t) for s, t in zip(output_shapes, output_dtypes)]
    mx.eval(outs)
    calls.append(KernelCall([x for x in inputs if isinstance(x, mx.array)], outs, reads))
    return outs


@contextmanager
def metal_kernels_selected(calls: list):
    """Within: dispatch picks the Metal kernels, and each kernel call appends a
    :class:`KernelCall` to ``calls`` (what computes its inputs is part of the step) and
    returns evaluated zeros of its output shapes."""

    def counting(kernel, **kwargs):
        reads = None
        if decode_attention.is_attention_kernel(kernel):
            reads = decode_attention.attention_bytes_read(kwargs["inputs"])
        return recorded_call(calls, kwargs["inputs"], kwargs["output_shapes"], kwargs["output_dtypes"], reads)

    real_launch, real_enabled = launcher.launch, dispatch.kernels_enabled
    launcher.launch, dispatch.kernels_enabled = counting, lambda: True
    try:
        with selftest.trusted():  # a self-test would read the placeholders and decline the kernels
            yield calls
    finally:
        launcher.launch, dispatch.kernels_enabled = real_launch, real_enabled


def step_dispatches(append, attend, *, kernels: bool = False) -> tuple[int, Counter]:
    """Dispatches of one decode step: ``append()`` returns whatever ``attend(fetched)`` needs
    (the cache's ``update_and_fetch`` result) and ``attend`` the output; the cache arrays
    to count are returned by ``append`` too, as ``(fetched, cache_arrays)``.  Evaluates the
    step afterwards, so the next one starts from evaluated state.  Returns the total and the
    count per primitive (kernel calls under ``"kernel"``)."""
    calls: list = []
    if kernels:
        with metal_kernels_selected(calls):
            fetched, arrays = append()
            out = attend(fetched)
            graph = launching_primitives([out, *arrays, *(x for call in calls for x in call.inputs)])
    else:
        fetched, arrays = append()
        out = attend(fetched)
        graph = launching_primitives([out, *arrays])
    mx.eval(out, arrays)
    if calls:
        graph["kernel"] = len(calls)
    return sum(graph.values()), graph


def arrays_of(cache) -> list:
    """The arrays a cache holds (what a step writes), for mlx-lm's caches (batch ones too),
    OIQKVCache and BatchOIQKVCache."""
    if hasattr(cache, "caches") and hasattr(cache, "stacked"):
        return [a for a in cache.state if isinstance(a, mx.array)]
    if hasattr(cache, "k") and hasattr(cache.k, "codes"):
        return [a for side in (cache.k, cache.v) for a in vars(side).values() if isinstance(a, mx.array)]
    out = []
    for x in (getattr(cache, "keys", None), getattr(cache, "values", None)):
        out += [a for a in (x if isinstance(x, (list, tuple)) else [x]) if isinstance(a, mx.array)]
    return out


def fill(cache, context: int, *, n_kv_heads: int, head_dim: int, dtype, key) -> mx.array:
    """Write a prompt of ``context`` synthetic Gaussian tokens into ``cache`` (B = 1) in chunks of
    2048, as a prefill does, and end the prefill; returns the random key to go on with."""
    for a in range(0, context, 2048):
        k1, key = mx.random.split(key)
        kv = mx.random.normal((2, 1, n_kv_heads, min(2048, context - a), head_dim), key=k1).astype(dtype)
        cache.update_and_fetch(kv[0], kv[1])
        if hasattr(cache, "release_fresh"):
            cache.release_fresh()  # what attention over the prompt would do after reading it
        mx.eval(arrays_of(cache))
    if hasattr(cache, "end_prefill"):
        # exact_prefill packs the prompt in the first decode step, once: the steps measured
        # after it are the ones after that
        cache.end_prefill()
        mx.eval(arrays_of(cache))
    return key


def decode_dispatches(make_cache, attend, *, context: int, n_q_heads: int, n_kv_heads: int, head_dim: int,
                      steps: int, dtype=mx.float32, kernels: bool = False, seed: int = 0) -> dict:
    """Dispatches per decode step of one layer, B = 1, over ``steps`` consecutive steps after a
    prompt of ``context`` tokens (synthetic Gaussian keys, values and queries).

    ``make_cache()`` builds the layer's cache; ``attend(cache, fetched, q)`` runs attention with
    what ``update_and_fetch`` returned.  Returns ``{"min", "max", "mean", "per_step",
    "breakdown"}``: the steady step, the costliest (an OIQ step that packs a block, an mlx-lm step
    that grows its buffers), the mean, every step's count, and the primitives of the first step
    (``"breakdowns"``: of every step).
    """
    key = mx.random.key(seed)
    cache = make_cache()
    key = fill(cache, context, n_kv_heads=n_kv_heads, head_dim=head_dim, dtype=dtype, key=key)
    per_step, breakdowns = [], []
    for _ in range(steps):
        k1, k2, key = mx.random.split(key, 3)
        kv = mx.random.normal((2, 1, n_kv_heads, 1, head_dim), key=k1).astype(dtype)
        q = mx.random.normal((1, n_q_heads, 1, head_dim), key=k2).astype(dtype)
        k_new, v_new = kv[0:1].reshape(kv.shape[1:]), kv[1:2].reshape(kv.shape[1:])
        mx.eval(k_new, v_new, q)

        def append():
            return cache.update_and_fetch(k_new, v_new), arrays_of(cache)

        total, graph = step_dispatches(append, lambda fetched: attend(cache, fetched, q), kernels=kernels)
        per_step.append(total)
        breakdowns.append(dict(graph))
    return {"min": min(per_step), "max": max(per_step), "mean": sum(per_step) / len(per_step),
            "per_step": per_step, "breakdown": breakdowns[0], "breakdowns": breakdowns}
