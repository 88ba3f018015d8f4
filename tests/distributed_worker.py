"""One rank of a loopback test of oiq_mlx.mlx_lm.sharding (run by mlx.launch from
tests/mlx_lm/test_distributed.py; not a test module itself).

Every rank builds the same seeded random-weight model twice: one copy runs
unsharded in this process (the reference), the other is sharded over the
launched group (each ``arch:sharding`` of ``--runs`` in turn).  Both decode greedily through OIQ caches; the rank writes a
JSON record of tokens, logit differences, what its caches store against the
reference's caches for the same heads and layers, its KV bytes and the
layout checks of its saved prompt cache to ``--out/rank{r}.json``.
"""

import argparse
import json
import sys
from pathlib import Path

import oiq_mlx  # noqa: F401  (first: preloads OpenBLAS before mlx.core)
import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.generate import generate_step
from mlx_lm.models import qwen2, qwen3
from mlx_lm.models.cache import save_prompt_cache

from helpers import tiny_llama, tiny_qwen
from oiq_mlx import OIQConfig, make_oiq_cache
from oiq_mlx.mlx_lm import sharding as distributed
from oiq_mlx.cache.sequence import OIQKVCache

PROMPT_TOKENS = 40
PREFILL_STEP = 16  # several prefill chunks: under pipeline only the caches are evaluated then
DECODE_TOKENS = 10
CONFIGS = {
    "k8v8": OIQConfig(k_bits=8, v_bits=8, sink_tokens=2, window=8),
    "4bit": OIQConfig.preset("4bit", sink_tokens=2, window=8),
}


def build(arch: str):
    if arch == "llama":
        model = tiny_llama(head_dim=64, n_heads=4, n_kv_heads=2, layers=2, seed=1)
    elif arch == "qwen3":
        model = tiny_qwen(qwen3, layers=2, seed=2)
    elif arch == "qwen2":
        model = tiny_qwen(qwen2, layers=3, seed=3)
    else:
        raise ValueError(arch)
    # at the default init the greedy tokens of these random models repeat one token;
    # doubled weights make them vary, so equal token lists say something
    model.update(tree_map(lambda w: 2 * w, model.parameters()))
    mx.eval(model.parameters())
    return model


def decode(model, cache):
    prompt = mx.array([(7 * i + 3) % 128 for i in range(PROMPT_TOKENS)])
    tokens, logprobs = [], []
    for tok, lp in generate_step(prompt, model, prompt_cache=cache, max_tokens=DECODE_TOKENS,
                                 prefill_step_size=PREFILL_STEP):
        tokens.append(int(tok))
        logprobs.append(lp)
    return tokens, mx.stack(logprobs)


def _oiq(cache):
    return [c for c in cache if isinstance(c, OIQKVCache)]


def compare_storage(ref_cache, cache, layout):
    """Per local OIQ layer: are codes and scales (and the mean / key scaling
    vectors, the signs) equal to the reference's for this rank's heads?"""
    a, b = layout.kv_heads or (None, None)
    by_layer = {c.layer_idx: c for c in _oiq(ref_cache)}
    rows = []
    for c in _oiq(cache):
        ref = by_layer[c.layer_idx]
        row = {"layer": c.layer_idx, "q_end": c.q_end, "ref_q_end": ref.q_end}
        for side_name, side, ref_side in (("k", c.k, ref.k), ("v", c.v, ref.v)):
            n = c.q_end - c.config.sink_tokens
            for field in ("codes", "scales"):
                mine, theirs = getattr(side, field)[:, :, :n], getattr(ref_side, field)[:, a:b, :n]
                row[f"{side_name}_{field}_equal"] = bool(mx.array_equal(mine, theirs, equal_nan=True))
                row[f"{side_name}_{field}_mismatch"] = int(mx.sum(mine != theirs).item())
            row[f"{side_name}_codes_words"] = side.codes[:, :, :n].size
            row[f"{side_name}_signs_equal"] = bool(mx.array_equal(side.signs, ref_side.signs))
            # one quantization step of these heads (largest group scale, times the
            # largest key scaling factor for keys): the most a code flipped at a
            # rounding boundary moves a dequantized coordinate
            step = mx.max(ref_side.scales[:, a:b, :n].astype(mx.float32))
            if ref_side.lam is not None:
                step = step * mx.max(ref_side.lam[:, a:b])
            row[f"{side_name}_step"] = float(step.item())
            for field in ("mean", "lam"):
                mine = getattr(side, field)
                if mine is not None:
                    theirs = getattr(ref_side, field)[:, a:b]
                    row[f"{side_name}_{field}_maxdiff"] = float(mx.max(mx.abs(mine - theirs)).item())
        for side_name, mine, theirs in zip("kv", c.dequantized_kv(), ref.dequantized_kv()):
            row[f"{side_name}_dequantized_maxdiff"] = float(mx.max(mx.abs(mine - theirs[:, a:b])).item())
        rows.append(row)
    return rows


def layout_checks(cache, layout, out: Path, rank: int) -> dict:
    """Save this rank's cache; reload it on the same layout and on others."""
    path = out / f"cache.rank{rank}.safetensors"
    save_prompt_cache(str(path), cache)
    result = {}
    loaded = distributed.load_prompt_cache(path, layout)
    result["same_layout_offsets"] = [c.offset for c in loaded]
    result["same_layout_layers"] = [c.layer_idx for c in _oiq(loaded)]
    others = {
        "other_rank": distributed.ShardLayout(layout.sharding, 1 - rank, layout.world_size, layout.kv_heads,
                                              layout.layers),
        "other_sharding": distributed.ShardLayout("pipeline" if layout.sharding == "tensor" else "tensor",
                                                  rank, layout.world_size, layout.kv_heads, layout.layers),
        "unsharded": None,
    }
    for key, other in others.items():
        try:
            distributed.load_prompt_cache(path, other)
            result[key] = "loaded"
        except ValueError as e:
            result[key] = str(e)
    return result


def run(arch: str, sharding: str, config_name: str, group, out: Path) -> dict:
    config = CONFIGS[config_name]
    reference = build(arch)
    ref_cache = make_oiq_cache(reference, config)
    ref_tokens, ref_logprobs = decode(reference, ref_cache)

    model = build(arch)
    layout = distributed.shard_model(model, sharding, group, name=f"tiny-{arch}")
    cache = distributed.make_cache(model, config, layout)
    tokens, logprobs = decode(model, cache)
    return {
        "layout": layout.to_dict(),
        "first_cache": layout.first_cache,
        "ref_tokens": ref_tokens,
        "tokens": tokens,
        "logprob_maxdiff": float(mx.max(mx.abs(logprobs - ref_logprobs)).item()),
        "storage": compare_storage(ref_cache, cache, layout),
        "kv_bytes": distributed.kv_bytes(cache, group),
        "local_held": sum(c.nbytes for c in cache),
        "ref_held": sum(c.nbytes for c in ref_cache),
        "layout_checks": layout_checks(cache, layout, out / config_name, group.rank()),
    }


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--runs", required=True, help="arch:sharding,... e.g. llama:tensor,qwen2:pipeline")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--out", required=True)
    args = p.parse_args()
    out = Path(args.out)
    group = mx.distributed.init()
    record = {"rank": group.rank(), "world_size": group.size()}
    for spec in args.runs.split(","):
        arch, sharding = spec.split(":")
        record[spec] = {}
        for name in args.configs.split(","):
            (out / spec / name).mkdir(parents=True, exist_ok=True)
            record[spec][name] = run(arch, sharding, name, group, out / spec)
    (out / f"rank{group.rank()}.json").write_text(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
