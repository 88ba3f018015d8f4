"""Bytes moved per decode step of one layer on the Metal path, traced primitive by primitive.

A decode step appends one token's key and value per sequence and attends one query over the
cache.  Its graph is built lazily as a Mac would build it (``trace.metal_kernels_selected``: the
OIQ Metal kernels selected and recorded, not run) and read with ``mx.export_function`` handed a
callback, which reports every primitive with its inputs' and outputs' shapes and dtypes.  What a
primitive moves is the bytes it reads plus the bytes it writes:

* views (``trace.VIEW_PRIMITIVES``: reshapes, transposes, slices, broadcasts, dtype views) move
  nothing; an array seen through views counts as the smaller of the view and the data under it
  (a slice of a buffer reads the slice, a broadcast scalar reads the scalar);
* a slice update or scatter (``IN_PLACE``) reads its update and indices and writes the update's
  bytes: MLX writes into the donated buffer in place when nothing else holds it, which is how
  every cache here (and mlx-lm's) writes a token row; a buffer that grows is a new
  allocation: the zero fill (``Full``) and the copy into it (a slice update or a concatenation
  of the old rows) count in full;
* a gather or dynamic slice (``READS_WHAT_IT_RETURNS``) reads the rows it returns (and its
  indices), not the whole source;
* a recorded kernel call reads every input array it is passed and writes its outputs.  The
  OIQ decode kernels are passed views of the rows in use (the packed codes and scales, the
  sinks, the window), so what they read is counted exactly; given a batch stacked on padded
  lengths, the decode kernel reads each sequence's own rows (its ``ranges`` input), and counts
  those (``kernels.decode_attention.attention_bytes_read``; that it reads no others,
  ``tests/kernels/test_kernels.py`` checks on the emulator with the padding poisoned);
* mlx's fused attention ``mx.fast.scaled_dot_product_attention`` (mlx-lm's full-precision
  caches) is recorded as one kernel, as it runs on a Mac: it reads the queries, keys, values
  and mask once and writes the output.  The partials of its two-pass variant, which MLX picks
  for long contexts (how long, and how many blocks, depend on the chip), are not counted: the
  full-precision figures are a floor.  The OIQ kernels' partials are counted, being the
  output of one recorded launch and the input of the next;
* ``mx.quantized_matmul`` (mlx-lm's quantized attention) is recorded too, not run (it is slow
  in float16 on the CPU backend): it reads its operands, the codes, scales and biases once each,
  and writes its product, what the graph would count for it;
* everything else reads its inputs and writes its outputs once.

What a cache evaluates eagerly within a step (``mx.eval``) leaves the traced graph and is not
counted: in the steps measured here, per-layer constants built once, and the copy that stacks a
batch's storage when it starts decoding (``oiq_mlx.cache.stacked``; once per batch membership,
about 0.4% of the ragged batch's 256-step mean if spread over it).

``mx.compile``'s fused kernels cannot be exported, so the step is traced with compilation
disabled and a chain of elementwise primitives is counted as ``mx.compile`` fuses it
(``FUSED``): its inputs read once and what leaves it written, the intermediates that only the
chain reads not at all (the OIQ cache's centering of the new key and value moves 16 KiB at
8 KV heads of 128, not the 60 KiB of its five operations).  A chain that runs uncompiled counts
as fused too, an undercount: mlx-lm's batch mask (a few KiB).  ``mx.export_function`` merges
identical operations on identical inputs, so two zero fills of one shape (mlx-lm's ``KVCache``
growing its keys and values) count once: an undercount of one fill once per 256 steps.

A run of steps is measured and averaged (:func:`decode_bytes`), so that what happens once per
block of steps (the OIQ cache packing 16 rows, growing its packed buffers and compacting its
window; mlx-lm's caches growing by 256 rows) counts at its real rate.  The ideal of a step is what
attention must read at least: the packed codes and scales of the packed tokens plus the
full-precision rows the cache holds, read once (``attention.attention_bytes_read``).
"""

from __future__ import annotations

import math
from collections import Counter
from contextlib import contextmanager

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

from . import trace
from .attention import attention_bytes_read, attention_call
from .latency import layer_cache
from ..cache.attention import oiq_batch_attention
from ..cache.sequence import OIQKVCache

# what mx.compile fuses into one kernel (the elementwise primitives a decode step uses)
ELEMENTWISE = frozenset({"Abs", "Add", "AsType", "BitwiseBinary", "Divide", "Equal", "Exp", "Greater",
                         "GreaterEqual", "Less", "LessEqual", "Log", "LogicalAnd", "LogicalNot", "LogicalOr",
                         "Maximum", "Minimum", "Multiply", "Negative", "NotEqual", "Power", "Round", "Rsqrt",
                         "Select", "Sqrt", "Square", "Subtract"})
IN_PLACE = frozenset({"SliceUpdate", "DynamicSliceUpdate", "Scatter", "ScatterAxis"})
READS_WHAT_IT_RETURNS = frozenset({"Gather", "GatherAxis", "DynamicSlice"})
# the names kernel calls, the fused attention and quantized products are counted under
KERNEL = "kernel"
FUSED_SDPA = "ScaledDotProductAttention"
QMM = "QuantizedMatmul"
FUSED = "fused elementwise"


def _nbytes(entry) -> int:
    """Bytes of an ``(name, shape, dtype)`` entry of ``mx.export_function``'s callback."""
    _, shape, dtype = entry
    return math.prod(shape) * dtype.size


def graph_bytes(outputs) -> Counter:
    """Primitive name -> bytes read plus written over the (unevaluated) graph that computes
    ``outputs``, by the rules of the module docstring (a fused elementwise chain under
    ``FUSED``)."""
    seen: dict[str, int] = {}  # array name -> bytes a reader of it reads (views resolved)
    under: dict[str, str] = {}  # a view's name -> the name of the array under it
    nodes, escaping = [], set()

    def read(entry) -> int:
        return seen.get(entry[0], _nbytes(entry))

    def on_entry(d):
        if d["type"] == "outputs":
            escaping.update(o[0] for o in d["outputs"])
        if d["type"] != "primitive":
            return
        name, ins, outs = d["name"], d["inputs"], d["outputs"]
        if name in trace.VIEW_PRIMITIVES:
            for o in outs:
                seen[o[0]] = min(_nbytes(o), read(ins[0]))
                under[o[0]] = under.get(ins[0][0], ins[0][0])
            return
        nodes.append((name, ins, outs))

    mx.export_function(on_entry, lambda: list(outputs))
    chains = _elementwise_chains(nodes, {under.get(n, n) for n in escaping}, under)
    moved: Counter = Counter()
    for chain in chains:
        if len(chain) > 1:
            inner = {o[0] for i in chain[:-1] for o in nodes[i][2]}
            ins = {x[0]: x for i in chain for x in nodes[i][1] if under.get(x[0], x[0]) not in inner}
            moved[FUSED] += sum(read(x) for x in ins.values()) + sum(_nbytes(o) for o in nodes[chain[-1]][2])
            continue
        name, ins, outs = nodes[chain[0]]
        if name in IN_PLACE:
            update = ins[1] if "Slice" in name else ins[-1]
            moved[name] += sum(read(x) for x in ins[1:]) + _nbytes(update)
        elif name in READS_WHAT_IT_RETURNS:
            moved[name] += sum(read(x) for x in ins[1:]) + 2 * sum(_nbytes(o) for o in outs)
        else:
            moved[name] += sum(read(x) for x in ins) + sum(_nbytes(o) for o in outs)
    return moved


def _elementwise_chains(nodes, escaping: set, under: dict) -> list[list[int]]:
    """``nodes`` (in graph order) grouped as ``mx.compile`` fuses them: an elementwise node whose
    one output is read by exactly one node, an elementwise one, and by nothing outside the graph
    (``escaping``) joins that node's chain; each chain lists its nodes in order, its last node
    the one whose output leaves it."""
    readers: dict[str, list[int]] = {}
    for j, (_, ins, _) in enumerate(nodes):
        for x in ins:
            readers.setdefault(under.get(x[0], x[0]), []).append(j)
    into = {}
    for i, (name, _, outs) in enumerate(nodes):
        if name in ELEMENTWISE and len(outs) == 1 and outs[0][0] not in escaping:
            r = readers.get(outs[0][0], [])
            if len(r) == 1 and nodes[r[0]][0] in ELEMENTWISE:
                into[i] = r[0]
    chains: dict[int, list[int]] = {}
    for i in range(len(nodes)):
        end = i
        while end in into:
            end = into[end]
        chains.setdefault(end, []).append(i)
    return list(chains.values())


def call_bytes(call: trace.KernelCall) -> int:
    """What a recorded kernel call moves: its input arrays read (or what it says it reads of
    them), its outputs written."""
    reads = sum(x.nbytes for x in call.inputs) if call.reads is None else call.reads
    return reads + sum(x.nbytes for x in call.outputs)


@contextmanager
def metal_path(calls: dict):
    """Within: the decode step is built as on a Mac: the OIQ Metal kernels selected and each
    call recorded in ``calls[KERNEL]`` (``trace.metal_kernels_selected``), each call of mlx's
    fused attention and of ``mx.quantized_matmul`` recorded as a kernel call in
    ``calls[FUSED_SDPA]`` and ``calls[QMM]``, ``mx.compile`` off (see the module docstring)."""

    def fused_sdpa(q, k, v, *, scale, mask=None, sinks=None, **kwargs):
        arrays = [q, k, v] + [x for x in (mask, sinks) if isinstance(x, mx.array)]
        (out,) = trace.recorded_call(calls[FUSED_SDPA], arrays, [(*q.shape[:-1], v.shape[-1])], [q.dtype])
        return out

    def quantized_matmul(x, w, scales, biases=None, transpose=True, group_size=64, bits=4, **kwargs):
        n = w.shape[-2] if transpose else w.shape[-1] * 32 // bits
        shape = (*mx.broadcast_shapes(x.shape[:-2], w.shape[:-2]), x.shape[-2], n)
        (out,) = trace.recorded_call(calls[QMM], [x, w, scales, biases], [shape], [x.dtype])
        return out

    for name in (KERNEL, FUSED_SDPA, QMM):
        calls.setdefault(name, [])
    real = mx.fast.scaled_dot_product_attention, mx.quantized_matmul
    mx.fast.scaled_dot_product_attention, mx.quantized_matmul = fused_sdpa, quantized_matmul
    mx.disable_compile()
    try:
        with trace.metal_kernels_selected(calls[KERNEL]):
            yield
    finally:
        mx.enable_compile()
        mx.fast.scaled_dot_product_attention, mx.quantized_matmul = real


def held_arrays(obj, seen=None) -> list:
    """Every array ``obj`` holds, through its attributes, lists, tuples and dicts."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    if isinstance(obj, mx.array):
        return [obj]
    if isinstance(obj, dict):
        items = obj.values()
    elif isinstance(obj, (list, tuple)):
        items = obj
    else:
        items = vars(obj).values() if hasattr(obj, "__dict__") and not isinstance(obj, type) else ()
    return [a for x in items for a in held_arrays(x, seen)]


def step_bytes(build, cache) -> Counter:
    """Bytes one decode step of ``cache`` moves, per primitive (recorded calls under
    ``KERNEL``, ``FUSED_SDPA`` and ``QMM``).  ``build()`` makes the step and returns
    ``(output, cache_arrays)``: the attention output and the arrays the cache holds after the
    step (whose writes are part of it).  Evaluates everything the cache holds afterwards, so
    the next step starts from evaluated state (after ``mx.export_function`` evaluating a view
    no longer leaves the buffer under it evaluated, so each buffer is evaluated itself)."""
    calls: dict = {}
    with metal_path(calls):
        out, arrays = build()
    recorded = [(name, c) for name, cs in calls.items() for c in cs]
    moved = graph_bytes([out, *arrays, *(x for _, c in recorded for x in c.inputs)])
    for name, call in recorded:
        moved[name] += call_bytes(call)
    mx.eval(out, arrays, held_arrays(cache))
    return moved


def decode_bytes(cache, step, *, batch: int, n_q_heads: int, n_kv_heads: int, head_dim: int, steps: int,
                 dtype=mx.float16, ideal=None, seed: int = 0) -> dict:
    """Bytes moved per decode step over ``steps`` consecutive steps of ``cache`` (filled), each
    appending one synthetic Gaussian token per sequence (``batch`` of them) and attending one
    query per sequence.

    ``step(cache, k, v, q)`` makes one step and returns ``(output, cache_arrays)`` (see
    :func:`step_bytes`); ``ideal(cache)``, where given, is the step's ideal after it.  Returns
    ``{"mean", "per_step", "breakdown", "ideal"}``: the bytes per step averaged over the run,
    each step's, the mean per primitive, and the mean ideal (None without ``ideal``).
    """
    key = mx.random.key(seed)
    per_step, ideals, total = [], [], Counter()
    for _ in range(steps):
        k1, k2, key = mx.random.split(key, 3)
        kv = mx.random.normal((2, batch, n_kv_heads, 1, head_dim), key=k1).astype(dtype)
        q = mx.random.normal((batch, n_q_heads, 1, head_dim), key=k2).astype(dtype)
        k_new, v_new = kv[0:1].reshape(kv.shape[1:]), kv[1:2].reshape(kv.shape[1:])
        mx.eval(k_new, v_new, q)
        moved = step_bytes(lambda: step(cache, k_new, v_new, q), cache)
        per_step.append(sum(moved.values()))
        total.update(moved)
        if ideal is not None:
            ideals.append(ideal(cache))
    return {"mean": sum(per_step) / steps, "per_step": per_step,
            "breakdown": {name: b / steps for name, b in total.items()},
            "ideal": sum(ideals) / steps if ideals else None}


# -- the table of scripts/bench_latency.py --------------------------------------------------------

DEFAULT_CONTEXTS = (1024, 2048, 4096, 16384)
RAGGED = (512, 1024, 2048, 4096)


def _filled(spec, context: int, *, n_kv_heads: int, head_dim: int, dtype, seed: int):
    cache = layer_cache(spec)
    trace.fill(cache, context, n_kv_heads=n_kv_heads, head_dim=head_dim, dtype=dtype, key=mx.random.key(seed))
    return cache


def decode_step(spec, scale: float):
    """One decode step over a cache of ``spec``, one sequence or a batch of them (mlx-lm's
    ``BatchKVCache`` attends with the mask of its left padding, built before the write as a
    model builds it)."""

    def step(cache, k, v, q):
        if hasattr(cache, "stacked"):  # BatchOIQKVCache
            cache.update_and_fetch(k, v)
            return oiq_batch_attention(q, cache, scale=scale), trace.arrays_of(cache)
        if isinstance(cache, BatchKVCache):
            mask = cache.make_mask(1, return_array=True)
            keys, values = cache.update_and_fetch(k, v)
            return mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask), trace.arrays_of(cache)
        fetched = cache.update_and_fetch(k, v)
        return attention_call(spec, cache, fetched, q, scale), trace.arrays_of(cache)

    return step


def bytes_per_step(specs, *, contexts=DEFAULT_CONTEXTS, ragged=RAGGED, n_q_heads: int = 32, n_kv_heads: int = 8,
                   head_dim: int = 128, steps: int = 256, dtype=mx.float16, seed: int = 0) -> list[dict]:
    """Bytes moved per decode step of one layer on the Metal path (:func:`decode_bytes`), one
    record per configuration of ``specs`` and context (B = 1), then for the ragged batch of
    ``ragged`` sequence lengths: the full-precision caches as mlx-lm's ``BatchKVCache`` and each
    OIQ configuration as a ``BatchOIQKVCache`` decoding stacked, beside the same sequences held as
    separate caches (the sum of one-sequence runs; mlx-lm's quantized cache has no batch form).

    ``steps`` (default 256, a multiple of mlx-lm's growth step and of the OIQ block) are averaged,
    from the context on.  Each record: ``bytes`` (mean per step), ``ideal`` (mean per step: what
    attention reads at least, ``attention.attention_bytes_read``), ``vs_ideal``, ``vs_fp16``
    (over the ideal of the full-precision cache holding the same tokens, where ``specs`` has
    one), ``vs_mlx`` (OIQ over mlx-lm's quantized cache of the same bits), ``breakdown`` (mean
    bytes per primitive).  A ragged ``batch`` record's ideal is that of the separate caches, and
    ``vs_separate`` its bytes over theirs.
    """
    shape = dict(n_q_heads=n_q_heads, n_kv_heads=n_kv_heads, head_dim=head_dim, steps=steps, dtype=dtype, seed=seed)
    scale = head_dim ** -0.5
    out = []

    measured = {}  # (configuration, context) -> its one-sequence run: the ragged batch reuses them

    def single(spec, n):
        if (spec.name, n) not in measured:
            cache = _filled(spec, n, n_kv_heads=n_kv_heads, head_dim=head_dim, dtype=dtype, seed=seed)
            measured[spec.name, n] = decode_bytes(cache, decode_step(spec, scale), batch=1,
                                                  ideal=lambda c: attention_bytes_read(spec, c), **shape)
        return measured[spec.name, n]

    def record(spec, context, layout, r):
        return {"cache": spec.name, "kind": spec.kind, "bits": None if spec.kind == "fp" else spec.bits,
                "context": context, "layout": layout, "steps": steps, "bytes": r["mean"], "ideal": r["ideal"],
                "vs_ideal": r["mean"] / r["ideal"], "breakdown": r["breakdown"]}

    for n in contexts:
        rows = [record(spec, n, "one sequence", single(spec, n)) for spec in specs]
        _compare(rows)
        out += rows
    if ragged:
        label = "/".join(str(n) for n in ragged)
        rows = []
        for spec in specs:
            if spec.kind == "mlx":
                continue
            alone = [single(spec, n) for n in ragged]
            separate = {"mean": sum(r["mean"] for r in alone), "ideal": sum(r["ideal"] for r in alone),
                        "breakdown": dict(sum((Counter(r["breakdown"]) for r in alone), Counter()))}
            caches = [_filled(spec, n, n_kv_heads=n_kv_heads, head_dim=head_dim, dtype=dtype, seed=seed + i)
                      for i, n in enumerate(ragged)]
            joined = (OIQKVCache if spec.kind == "oiq" else BatchKVCache).merge(caches)
            r = decode_bytes(joined, decode_step(spec, scale), batch=len(ragged), **shape)
            r["ideal"] = separate["ideal"]
            rows.append(record(spec, label, "separate caches", separate))
            rows.append({**record(spec, label, "batch", r), "vs_separate": r["mean"] / separate["mean"]})
        _compare(rows)
        out += rows
    return out


def _compare(rows: list[dict]) -> None:
    """Add ``vs_fp16`` and ``vs_mlx`` to rows of one context (and layout)."""
    fp = next((r for r in rows if r["kind"] == "fp" and r["layout"] != "batch"), None)
    for row in rows:
        if fp is not None:
            row["vs_fp16"] = row["bytes"] / fp["ideal"]
        mlx = next((r for r in rows if r["kind"] == "mlx" and r["bits"] == row["bits"]), None)
        if row["kind"] == "oiq" and mlx is not None:
            row["vs_mlx"] = row["bytes"] / mlx["bytes"]


def bytes_table(records: list[dict]) -> str:
    """Markdown table of :func:`bytes_per_step`'s records."""
    lines = ["| context | cache | layout | MiB per step | ideal MiB | vs ideal | vs fp16 ideal | vs mlx-lm same bits "
             "| batch vs separate |", "|---|---|---|---:|---:|---:|---:|---:|---:|"]

    def f(r, key, fmt):
        return format(r[key], fmt) if key in r else "-"

    for r in records:
        lines.append(f"| {r['context']} | {r['cache']} | {r['layout']} | {r['bytes'] / 2**20:.2f} | "
                     f"{r['ideal'] / 2**20:.2f} | {r['vs_ideal']:.3f} | {f(r, 'vs_fp16', '.3f')} | "
                     f"{f(r, 'vs_mlx', '.3f')} | {f(r, 'vs_separate', '.3f')} |")
    return "\n".join(lines)
