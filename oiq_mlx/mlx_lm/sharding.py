"""OIQ caches on MLX's distributed engine: one model sharded over the ranks of
``mlx.launch`` (ring, MPI or JACCL backend), each rank's cache holding only
its own KV heads or layers, compressed.

* tensor parallel (``model.shard(group)``, mlx-lm's llama, qwen2, qwen3...):
  every rank runs every layer on a contiguous slice of the attention heads,
  rank ``r`` of ``N`` holding KV heads ``[r H / N, (r + 1) H / N)``.  The
  sign vectors are per layer and shared by the heads of a layer, and the key
  mean / key scaling statistics and the group scales are per head, so rank
  ``r``'s cache stores for its heads what an unsharded cache stores for them.
* pipeline parallel (``model.model.pipeline(group)``, mlx-lm's qwen2 and a few
  others): every rank runs a range of layers, rank 0 the *last* ones.  The
  local caches are numbered from the rank's first global layer
  (``make_oiq_cache(first_layer=)``), so each layer keeps its sign seed.

The model is loaded whole on every rank and then sharded (``mlx_lm.utils.
sharded_load`` needs a Hugging Face repository; ``oiq_mlx.load`` also reads
GGUF and local folders): fine for models that fit one machine, which is what
the tests and the loopback benchmark use.  Every cache an OIQ run builds
carries its :class:`ShardLayout` in its saved state; :func:`load_prompt_cache`
refuses a file saved on another layout.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import mlx.core as mx
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import make_prompt_cache

from ..cache.sequence import OIQKVCache
from ..core.config import OIQConfig
from .caches import leaves, end_prefill, kv_memory, make_oiq_cache, oiq_layer_indices
from .prompt_files import load_cache_file

SHARDINGS = ("tensor", "pipeline")


@dataclasses.dataclass(frozen=True)
class ShardLayout:
    """Which part of a model one rank holds.

    ``kv_heads``: the global KV heads ``[a, b)`` of every local layer (None:
    all of them, as under pipeline parallelism);
    ``layers``: the global model layers ``[a, b)`` this rank runs;
    ``first_cache``: the global cache index (``OIQKVCache.layer_idx``) of the
    rank's first cache; ``oiq_layers``: the global indices of every OIQ layer
    of the whole model (all ranks), against which ``layer_bits`` is checked.
    """

    sharding: str
    rank: int
    world_size: int
    kv_heads: tuple[int, int] | None
    layers: tuple[int, int]
    first_cache: int = 0
    oiq_layers: tuple[int, ...] = ()

    def to_dict(self) -> dict:
        """What a saved cache carries: the fields that must match to reuse it."""
        return {"sharding": self.sharding, "rank": self.rank, "world_size": self.world_size,
                "kv_heads": None if self.kv_heads is None else list(self.kv_heads), "layers": list(self.layers)}

    def describe(self) -> str:
        return describe_layout(self.to_dict())


def describe_layout(layout: dict | None) -> str:
    if layout is None:
        return "unsharded (one process)"
    heads = layout["kv_heads"]
    heads = "all KV heads" if heads is None else f"KV heads {heads[0]}-{heads[1] - 1}"
    return (f"rank {layout['rank']} of {layout['world_size']}, {layout['sharding']} parallel, {heads}, "
            f"layers {layout['layers'][0]}-{layout['layers'][1] - 1}")


def model_name(model, name: str | None = None) -> str:
    """``name (model_type)``, or the model type alone: the model in error messages."""
    model_type = getattr(getattr(model, "args", None), "model_type", None) or type(model).__module__.split(".")[-1]
    return f"{name} ({model_type})" if name else str(model_type)


def supported_shardings(model) -> tuple[str, ...]:
    """The shardings mlx-lm implements for ``model``, as ``mlx_lm.utils.sharded_load`` tells them."""
    found = []
    if hasattr(model, "shard"):
        found.append("tensor")
    if hasattr(getattr(model, "model", None), "pipeline"):
        found.append("pipeline")
    return tuple(found)


def _attention_heads(model) -> tuple[int, int]:
    """``(query heads, KV heads)`` per layer of an unsharded model."""
    heads = {(int(a.n_heads), int(a.n_kv_heads)) for a in
             (getattr(layer, "self_attn", None) for layer in model.layers if layer is not None)
             if a is not None and hasattr(a, "n_heads") and hasattr(a, "n_kv_heads")}
    if len(heads) != 1:
        raise ValueError(f"cannot tell the attention heads per layer of {model_name(model)} "
                         f"(found {sorted(heads) or 'none'})")
    return heads.pop()


def shard_model(model, sharding: str, group, *, name: str | None = None) -> ShardLayout:
    """Shard a fully loaded ``model`` in place over ``group``; returns this rank's layout.

    ``sharding``: ``"tensor"``, ``"pipeline"`` or ``"auto"`` (tensor where the
    model supports it, as ``sharded_load`` chooses).  Raises ``ValueError``
    naming the model when it supports neither, not the one asked for, or when
    its KV heads (tensor) or layers (pipeline) do not divide over the ranks.
    """
    n, rank = group.size(), group.rank()
    label = model_name(model, name)
    supported = supported_shardings(model)
    if sharding not in ("auto", *SHARDINGS):
        raise ValueError(f"sharding must be auto, tensor or pipeline, got {sharding!r}")
    if not supported:
        raise ValueError(f"{label} supports neither tensor parallelism (model.shard) nor pipeline "
                         f"parallelism (model.model.pipeline) in mlx-lm; run it on one rank")
    if sharding == "auto":
        sharding = supported[0]
    if sharding not in supported:
        raise ValueError(f"{label} does not support {sharding} parallelism in mlx-lm; "
                         f"it supports {' and '.join(supported)}")
    n_layers = len(model.layers)
    oiq_layers = tuple(oiq_layer_indices(model))
    if sharding == "tensor":
        n_heads, n_kv = _attention_heads(model)
        if n_kv % n or n_heads % n:
            hint = "; use --sharding pipeline" if "pipeline" in supported else ""
            raise ValueError(f"{label} has {n_heads} query and {n_kv} KV heads, which do not divide over "
                             f"{n} ranks (tensor parallelism gives each rank whole KV heads){hint}")
        try:
            model.shard(group)
        except ValueError as e:
            raise ValueError(f"{label} cannot be tensor-sharded over {n} ranks: {e}") from e
        per = n_kv // n
        return ShardLayout("tensor", rank, n, (rank * per, (rank + 1) * per), (0, n_layers), 0, oiq_layers)
    if n_layers < n:
        raise ValueError(f"{label} has {n_layers} layers, fewer than the {n} pipeline ranks")
    full = make_prompt_cache(model)
    model.model.pipeline(group)
    start, end = model.model.start_idx, model.model.end_idx
    local = make_prompt_cache(model)
    if len(local) != end - start:
        raise ValueError(f"{label}: after pipeline() the model builds {len(local)} caches for its "
                         f"{end - start} local layers; oiq_mlx cannot number them")
    first = sum(len(list(leaves([c]))) for c in full[:start])
    return ShardLayout("pipeline", rank, n, None, (start, end), first, oiq_layers)


def make_cache(model, config: OIQConfig | None, layout: ShardLayout, **kwargs) -> list:
    """The prompt cache of a sharded ``model`` (``config`` None: mlx-lm's own, full precision).

    OIQ layers keep their global layer index, so their sign seeds and
    ``layer_bits`` are those of the unsharded model; ``layer_bits`` is checked
    against the whole model's OIQ layers, and each rank keeps the entries of
    its own layers.  Every OIQ cache carries ``layout`` (saved with it).
    """
    if config is None:
        return make_prompt_cache(model)
    if config.layer_bits:
        stray = [t[0] for t in config.layer_bits if t[0] not in layout.oiq_layers]
        if stray:
            raise ValueError(f"layer_bits names layers {stray} that do not use OIQ in this model "
                             f"(its OIQ layers: {list(layout.oiq_layers)})")
        n_local = sum(len(list(leaves([c]))) for c in make_prompt_cache(model))
        local = range(layout.first_cache, layout.first_cache + n_local)
        config = dataclasses.replace(config, layer_bits=tuple(t for t in config.layer_bits if t[0] in local))
    cache = make_oiq_cache(model, config, first_layer=layout.first_cache, **kwargs)
    for c in leaves(cache):
        if isinstance(c, OIQKVCache):
            c.layout = layout.to_dict()
    return cache


def kv_bytes(cache: list, group) -> dict:
    """Collective (every rank must call it): ``{"held": [bytes per rank],
    "fp16": [float16 equivalent per rank], "held_total", "fp16_total"}``."""
    # generate_step leaves one decode step in flight on its own stream when it
    # stops; that step's collectives would interleave with this one on the ring
    mx.synchronize(generation_stream)
    mem = kv_memory(cache)
    mine = mx.array([[mem["held"], mem["fp16"]]], dtype=mx.int64)
    every = mx.distributed.all_gather(mine, group=group, stream=mx.cpu).tolist()
    held, fp16 = [int(r[0]) for r in every], [int(r[1]) for r in every]
    return {"held": held, "fp16": fp16, "held_total": sum(held), "fp16_total": sum(fp16)}


def probe_kv_bytes(model, group, tokens: int = 256) -> dict:
    """Collective: :func:`kv_bytes` of a fresh prompt cache of the sharded
    ``model`` after one forward pass over ``tokens`` tokens (every rank at once),
    for a server to report what each rank holds per sequence of that length."""
    cache = make_prompt_cache(model)
    logits = model(mx.zeros((1, tokens), dtype=mx.int32), cache=cache)
    end_prefill(cache)  # exact_prefill: what a sequence holds once it generates
    mx.eval(logits, [c.state for c in cache])
    return kv_bytes(cache, group)


def format_kv_bytes(report: dict, layout: ShardLayout) -> str:
    mib = [f"rank {i} {b / 2**20:.2f} MiB" for i, b in enumerate(report["held"])]
    ratio = report["fp16_total"] / report["held_total"] if report["held_total"] else float("nan")
    return (f"KV cache per rank ({layout.sharding} parallel over {layout.world_size} ranks): "
            f"{', '.join(mib)}; total {report['held_total'] / 2**20:.2f} MiB held vs "
            f"{report['fp16_total'] / 2**20:.2f} MiB at float16 ({ratio:.2f}x)")


def common_seed(seed: int | None, group) -> int:
    """Rank 0's ``seed`` (a fresh one when None) on every rank: sampling must
    draw the same token everywhere, or the ranks feed different tokens."""
    mine = seed if seed is not None else int.from_bytes(os.urandom(4), "little") >> 1
    return int(mx.distributed.all_sum(mx.array(mine if group.rank() == 0 else 0, dtype=mx.int64),
                                      group=group, stream=mx.cpu).item())


def check_layout(cache: list, layout: ShardLayout | None, source: str = "prompt cache") -> None:
    """Raise ``ValueError`` unless every OIQ cache in ``cache`` was saved on ``layout``
    (None: an unsharded run)."""
    want = None if layout is None else layout.to_dict()
    for c in leaves(cache):
        if isinstance(c, OIQKVCache) and c.layout != want:
            raise ValueError(f"{source} was saved {describe_layout(c.layout)}; this run is "
                             f"{describe_layout(want)}: a prompt cache loads only on the layout that saved it")


def load_prompt_cache(path, layout: ShardLayout | None, return_metadata: bool = False):
    """``mlx_lm``'s ``load_prompt_cache`` (checked: :func:`~oiq_mlx.mlx_lm.prompt_files.load_cache_file`),
    refusing a file saved on another layout."""
    cache, metadata = load_cache_file(str(path), return_metadata=True)
    check_layout(cache, layout, source=str(path))
    return (cache, metadata) if return_metadata else cache


class ShardedRun:
    """One process of a sharded run under ``mlx.launch``: the group, this rank's
    layout once the model is sharded, and rank-0-only output."""

    def __init__(self, group, sharding: str = "auto"):
        self.group, self.sharding, self.layout = group, sharding, None

    @classmethod
    def from_launch(cls, sharding: str = "auto", *, silence_other_ranks: bool = True):
        """The run when this process is one of several ranks (None for a single
        process).  With ``silence_other_ranks``, ranks other than 0 send stdout and
        stderr to /dev/null: every rank runs the same program on the same input,
        and rank 0 says what they all say."""
        group = mx.distributed.init()
        if group.size() == 1:
            return None
        if silence_other_ranks and group.rank() != 0:
            sys.stdout = sys.stderr = open(os.devnull, "w")
        return cls(group, sharding)

    @property
    def rank(self) -> int:
        return self.group.rank()

    def shard(self, model, name: str | None = None) -> ShardLayout:
        self.layout = shard_model(model, self.sharding, self.group, name=name)
        return self.layout

    def make_cache(self, model, config: OIQConfig | None, **kwargs) -> list:
        return make_cache(model, config, self.layout, **kwargs)

    def seed(self, seed: int | None) -> int:
        agreed = common_seed(seed, self.group)
        mx.random.seed(agreed)
        return agreed

    def print_kv_bytes(self, cache: list, file=None) -> dict:
        """Collective: per-rank and total KV bytes, printed by rank 0."""
        report = kv_bytes(cache, self.group)
        if self.rank == 0:
            print(format_kv_bytes(report, self.layout), file=file or sys.stderr)
        return report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--sharding", choices=("auto", *SHARDINGS), default="auto",
        help="under mlx.launch with more than one rank: tensor (each rank holds a slice of the "
             "attention heads, model.shard) or pipeline (a range of layers, model.model.pipeline); "
             "auto: tensor where the model supports it. A single process ignores it")
