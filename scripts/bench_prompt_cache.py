#!/usr/bin/env python
"""What oiq-server's prompt cache holds after one chat, against float16, from GET /v1/oiq/memory.

For each server configuration and chat length: a fresh server, one chat of one user message of
about that many tokens (2 generated), then the prompt cache's bytes: the finished chat, the
checkpoint mlx-lm saves at the end of the user turn where the server keeps it (--keep-checkpoints),
both together, and both together had the checkpoint kept its packed rows itself.  Full-precision rows count 2 bytes a value (a float16
model's cache; this machine runs the model in float32).  Writes JSON and a markdown table (also
on stdout); a progress line per chat on stderr.

Examples:
  python scripts/bench_prompt_cache.py    # 4bit, --keep-checkpoints, --no-positional, --no-oiq at 2k and 4k
  python scripts/bench_prompt_cache.py --lengths 1k --window 16
"""

import argparse
import json
import os
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="demo", help="demo, gemma3, a .gguf path or an mlx-lm model id (default demo)")
    parser.add_argument("--preset", default="4bit", help="OIQ preset of the OIQ servers (default 4bit)")
    parser.add_argument("--window", type=int, default=None, help="--window of the OIQ servers (default: the preset's)")
    parser.add_argument("--lengths", default="2k,4k", help="chat lengths in tokens, k suffix allowed (default 2k,4k)")
    parser.add_argument("--no-fp", action="store_true", help="leave out the --no-oiq server")
    parser.add_argument("--out", default="bench_results/prompt_cache", help="output folder (default bench_results/prompt_cache)")
    args = parser.parse_args(argv)

    import oiq_mlx  # noqa: F401  (first: preloads OpenBLAS before mlx.core)
    from oiq_mlx.bench import prompt_cache as bench
    from oiq_mlx.eval.specs import parse_ints

    try:
        lengths = parse_ints(args.lengths, k=True)
    except ValueError as e:
        print(f"bench_prompt_cache: error: {e}", file=sys.stderr)
        return 2
    oiq = ["--preset", args.preset] + ([] if args.window is None else ["--window", str(args.window)])
    configs = {"positional": oiq, "keep-checkpoints": [*oiq, "--keep-checkpoints"],
               "no-positional": [*oiq, "--no-positional"]}
    if not args.no_fp:
        configs["fp"] = ["--no-oiq"]
    os.makedirs(args.out, exist_ok=True)
    rows = bench.run_prompt_cache_bench(configs=configs, lengths=lengths, model=args.model, log_dir=args.out,
                                        progress=lambda msg: print(msg, file=sys.stderr, flush=True))
    table = bench.markdown(rows)
    with open(os.path.join(args.out, "bench_prompt_cache.json"), "w") as f:
        json.dump(rows, f, indent=1)
    with open(os.path.join(args.out, "bench_prompt_cache.md"), "w") as f:
        f.write(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
