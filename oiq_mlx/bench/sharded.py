"""Sharded decode benchmark (``scripts/bench_sharded.py``): decode latency and KV bytes per rank of
each cache configuration, sharded over the ranks of ``mlx.launch`` and unsharded, on seeded
random-weight models (no installed real model can be sharded over 2 ranks)."""

from __future__ import annotations

import dataclasses
import importlib
import sys

import mlx.core as mx
from mlx.utils import tree_map

from ..eval.specs import CacheSpec
from ..mlx_lm.sharding import ShardLayout, make_cache, shard_model
from .latency import run_model


@dataclasses.dataclass(frozen=True)
class ShardedCacheSpec(CacheSpec):
    """A :class:`~oiq_mlx.eval.specs.CacheSpec` whose OIQ caches are built for a
    sharded model (``layout`` None: unsharded)."""

    layout: ShardLayout | None = None

    @classmethod
    def of(cls, spec: CacheSpec, layout: ShardLayout | None) -> "ShardedCacheSpec":
        return cls(**{f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}, layout=layout)

    def make_cache(self, model) -> list:
        if self.layout is None or self.kind != "oiq":
            return super().make_cache(model)
        return make_cache(model, self.oiq, self.layout)


class ByteTokenizer:
    """UTF-8 bytes as token ids, for random-weight models (vocabulary >= 256)."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


def random_model(model_type: str = "qwen2", *, layers: int = 8, hidden: int = 512, heads: int = 8,
                 kv_heads: int = 4, intermediate: int = 1408, vocab: int = 1024, seed: int = 0):
    """A seeded random-weight mlx-lm model (the same weights on every rank).

    No model installed on the Linux CI machine can be sharded over 2 ranks
    (SmolLM2-135M has 3 KV heads and llama has no pipeline in mlx-lm 0.32.2;
    Gemma 3 supports neither), so the loopback benchmark uses one of these:
    its timings depend on the shapes only.  Weights are doubled so that greedy
    decoding does not settle on one token.
    """
    module = importlib.import_module(f"mlx_lm.models.{model_type}")
    mx.random.seed(seed)
    args = module.ModelArgs(model_type=model_type, hidden_size=hidden, num_hidden_layers=layers,
                            intermediate_size=intermediate, num_attention_heads=heads, num_key_value_heads=kv_heads,
                            rms_norm_eps=1e-6, vocab_size=vocab, rope_theta=10000.0, tie_word_embeddings=True,
                            max_position_embeddings=131072)
    model = module.Model(args)
    model.update(tree_map(lambda w: 2 * w, model.parameters()))
    mx.eval(model.parameters())
    return model


def bench_sharded(load_model, tokenizer, group, *, shardings, specs, contexts, decode_steps, warmup,
                  prefill_chunk=2048, baseline=True, progress=sys.stderr) -> list[dict]:
    """Decode latency and KV bytes per rank of each cache configuration, sharded
    each way in ``shardings`` over ``group`` and (``baseline``) unsharded.

    Collective: every rank calls it.  ``load_model()`` returns a fresh,
    unsharded model (the same on every rank).  Each sharded pass is
    :func:`oiq_mlx.bench.latency.run_model` on every rank at once (one decode step
    is one forward pass over the ring); the unsharded pass runs on rank 0 alone
    while the other ranks wait at a barrier.  Returns rank 0's records, each
    with ``"sharding"`` (``"none"`` for the baseline), ``"ranks"`` and, for the
    sharded ones, ``"kv_bytes_per_rank"``; other ranks return ``[]``.
    """
    rank = group.rank()
    out = []
    for sharding in shardings:
        model = load_model()
        layout = shard_model(model, sharding, group)
        sharded = [ShardedCacheSpec.of(s, layout) for s in specs]
        records = run_model(model, tokenizer, contexts=contexts, specs=sharded, decode_steps=decode_steps,
                            warmup=warmup, prefill_chunk=prefill_chunk, progress=progress if rank == 0 else None)
        mine = mx.array([[r["kv_bytes"] for r in records]], dtype=mx.int64)
        every = mx.distributed.all_gather(mine, group=group, stream=mx.cpu).tolist()
        for i, r in enumerate(records):
            r.update(sharding=sharding, ranks=group.size(), kv_bytes_per_rank=[int(row[i]) for row in every],
                     layout=layout.to_dict())
        out += records
        del model
        mx.clear_cache()
    if baseline and rank == 0:
        records = run_model(load_model(), tokenizer, contexts=contexts, specs=specs, decode_steps=decode_steps,
                            warmup=warmup, prefill_chunk=prefill_chunk, progress=progress)
        for r in records:
            r.update(sharding="none", ranks=1, kv_bytes_per_rank=[r["kv_bytes"]])
        out += records
    mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group, stream=mx.cpu))
    return out if rank == 0 else []


def sharded_table(records: list[dict]) -> str:
    """Markdown: one row per (context, cache), decode ms/token (median, p10 in
    parentheses) and KV MiB held per rank for each way of running it, side by side."""
    ways = []
    for r in records:
        way = (r["sharding"], r["ranks"])
        if way not in ways:
            ways.append(way)
    ways.sort(key=lambda w: w[0] != "none")  # the one-process column first
    names = ["1 process" if s == "none" else f"{s} x{n}" for s, n in ways]
    head = ("| context | cache | " + " | ".join(f"ms/token {n}" for n in names) + " | "
            + " | ".join(f"KV MiB per rank {n}" for n in names) + " |")
    lines = [head, "|---:|---|" + "---:|" * (2 * len(ways))]
    rows = {}
    for r in records:
        rows.setdefault((r["context"], r["cache"]), {})[(r["sharding"], r["ranks"])] = r
    for (context, cache), by_way in rows.items():
        ms, kv = [], []
        for way in ways:
            r = by_way.get(way)
            st = None if r is None else r["decode_ms_stats"]
            ms.append("-" if st is None else f"{st['median']:.1f} ({st['p10']:.1f})")
            kv.append("-" if r is None else " / ".join(f"{b / 2**20:.2f}" for b in r["kv_bytes_per_rank"]))
        lines.append(f"| {context} | {cache} | " + " | ".join(ms) + " | " + " | ".join(kv) + " |")
    return "\n".join(lines)
