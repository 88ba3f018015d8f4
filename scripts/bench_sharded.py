#!/usr/bin/env python
"""Decode latency and KV bytes per rank of a model sharded over mlx.launch ranks:
full precision vs OIQ presets, one process vs tensor- and pipeline-parallel.

Run it under mlx.launch; every rank runs this script. For each sharding, all
ranks run oiq_mlx.bench.latency.run_model on their shard (decode steps of every
cache configuration interleaved); then rank 0 runs the unsharded model alone
(the other ranks wait at a barrier) for the one-process column. Rank 0 prints
a markdown table (decode ms/token median, KV MiB held per rank) and writes the
JSON record (every sample); progress on stderr.

Examples:
  # loopback, 2 ranks on this machine (random-weight qwen2-shaped model):
  mlx.launch -n 2 --backend ring python scripts/bench_sharded.py --quick
  # a ring of Macs (hosts.json lists them; same checkout and Python on each):
  mlx.launch --hostfile hosts.json --backend ring python scripts/bench_sharded.py \\
      --model mlx-community/Qwen2.5-7B-Instruct-4bit --contexts 4k,16k
"""

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random",
                        help='"random": a seeded random-weight qwen2 model shaped by --shape (default); '
                             "or a .gguf path, mlx-lm model id or local mlx directory (loaded whole on every rank)")
    parser.add_argument("--shape", default="8,512,8,4,1408",
                        help="random model: layers, hidden size, query heads, KV heads, MLP size "
                             "(default 8,512,8,4,1408; head dim = hidden / heads)")
    parser.add_argument("--sharding", default="tensor,pipeline",
                        help="comma-separated shardings to run: tensor, pipeline (default both)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the one-process run on rank 0")
    parser.add_argument("--contexts", default=None,
                        help="comma-separated context lengths, k suffix allowed (default 1k,4k,16k; --quick 512,2k)")
    parser.add_argument("--oiq-bits", default="4,3,2", help="OIQ presets to run, by bits (default 4,3,2)")
    parser.add_argument("--decode-steps", type=int, default=None, help="timed decode steps (default 32; --quick 16)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed decode steps first (default 3)")
    parser.add_argument("--prefill-chunk", type=int, default=2048, help="prefill step size in tokens (default 2048)")
    parser.add_argument("--quick", action="store_true", help="contexts 512,2k and 16 decode steps")
    parser.add_argument("--json", default="bench_results/bench_sharded.json", metavar="PATH",
                        help="where rank 0 writes the JSON record (default bench_results/bench_sharded.json)")
    args = parser.parse_args(argv)

    import oiq_mlx  # noqa: F401  (first: preloads OpenBLAS before mlx.core is imported)
    import mlx.core as mx

    from oiq_mlx.bench import latency as bench
    from oiq_mlx.bench import sharded
    from oiq_mlx.eval.specs import parse_ints
    from oiq_mlx.mlx_lm.models import load

    group = mx.distributed.init()
    shardings = [s.strip() for s in args.sharding.split(",") if s.strip()]
    contexts = bench.parse_contexts(args.contexts or ("512,2k" if args.quick else "1k,4k,16k"))
    steps = args.decode_steps if args.decode_steps is not None else (16 if args.quick else 32)
    specs = bench.default_specs(parse_ints(args.oiq_bits), mlx_bits=())
    if args.model == "random":
        layers, hidden, heads, kv_heads, mlp = parse_ints(args.shape)

        def load_model():
            return sharded.random_model("qwen2", layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads,
                                            intermediate=mlp)

        tokenizer = sharded.ByteTokenizer()
    else:
        first = {}

        def load_model():  # the model loaded below first, then fresh copies
            return first.pop("model", None) or load(args.model)[0]

        first["model"], tokenizer = load(args.model)

    if group.size() == 1:
        print("bench_sharded: one rank; run it under mlx.launch -n 2 (or --hostfile) to shard", file=sys.stderr)
        return 2
    try:
        records = sharded.bench_sharded(load_model, tokenizer, group, shardings=shardings, specs=specs,
                                            contexts=contexts, decode_steps=steps, warmup=args.warmup,
                                            prefill_chunk=args.prefill_chunk, baseline=not args.no_baseline)
    except ValueError as e:  # the model cannot be sharded so: every rank stops here, before any collective
        if group.rank() == 0:
            print(f"bench_sharded: error: {e}", file=sys.stderr)
        return 2
    if group.rank() == 0:
        env = bench.environment()
        result = {"environment": env, "command": sys.argv, "ranks": group.size(),
                  "settings": {"model": args.model, "shape": args.shape if args.model == "random" else None,
                               "contexts": contexts, "decode_steps": steps, "warmup": args.warmup,
                               "specs": [bench.describe(s) for s in specs]},
                  "runs": records}
        print(f"## {args.model} over {group.size()} ranks, backend {env['backend']}\n")
        print(sharded.sharded_table(records) + "\n", flush=True)
        bench.save_json(result, args.json)
        print(f"bench_sharded: wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
