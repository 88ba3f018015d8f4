#!/usr/bin/env python
"""oiq-server under concurrent load: full precision vs mlx-lm --kv-bits vs OIQ presets.

Every cache configuration is served by the same code path (``python -m
oiq_mlx.cli.server`` on 127.0.0.1, one process per configuration): ``fp`` is
mlx-lm's batched full-precision server (``--no-oiq``), ``mlx:4`` mlx-lm's
quantized cache (``--no-oiq --kv-bits 4``, which mlx-lm serves one request at
a time), ``preset:4bit`` / ``preset:3bit[window=32]`` OIQ.  For each number of
concurrent streaming clients and prompt length: aggregate generated tokens/s,
time to first token p50/p95, per-token latency p50/p95, peak server RSS,
failed or corrupted responses; and KV bytes per sequence with the number of
sequences that fit a KV budget.  Writes JSON, a markdown table (also on
stdout) and a PNG; a progress line per configuration on stderr.

Examples:
  python scripts/bench_server.py --quick          # a few minutes on 2 CPU cores
  python scripts/bench_server.py --memory-only --memory-lengths 1k,4k   # KV bytes only, no server
  python scripts/bench_server.py --model mlx-community/Llama-3.2-1B-Instruct-4bit   # Mac
"""

import argparse
import json
import os
import sys


FULL = dict(caches="fp,mlx:4,preset:4bit,preset:3bit", clients="1,4,8,16", lengths="512,2k,8k", max_tokens=64,
            memory_lengths="4k,8k")
QUICK = dict(caches="fp,mlx:4,preset:4bit", clients="1,8", lengths="256", max_tokens=16, memory_lengths="4k")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="demo", help="demo, gemma3, a .gguf path or an mlx-lm model id (default demo)")
    parser.add_argument("--caches", default=None,
                        help="comma-separated cache configurations, any name oiq_mlx.eval.specs.parse_spec reads "
                             "(the registry eval_quality.py, bench_latency.py and fidelity_sweep.py share): fp, "
                             "mlx:B[:G], preset:NAME[field=value,...], oiq[field=value,...], oiq-4, ... "
                             "(default fp,mlx:4,preset:4bit,preset:3bit; --quick fp,mlx:4,preset:4bit)")
    parser.add_argument("--clients", default=None, help="concurrent clients (default 1,4,8,16; --quick 1,8)")
    parser.add_argument("--lengths", default=None,
                        help="prompt lengths in tokens, k suffix allowed (default 512,2k,8k; --quick 256)")
    parser.add_argument("--max-tokens", type=int, default=None, help="tokens generated per request (default 64; --quick 16)")
    parser.add_argument("--memory-lengths", default=None,
                        help="sequence lengths of the KV bytes / capacity figure (default 4k,8k; --quick 4k)")
    parser.add_argument("--memory-batch", type=int, default=8,
                        help="sequences decoding together for the figure's in-a-batch column (default 8)")
    parser.add_argument("--kv-budget-mib", type=float, default=1024, help="KV budget for the capacity figure (default 1024)")
    parser.add_argument("--memory-only", action="store_true",
                        help="only the KV bytes / capacity figure (no server is started; a few minutes up to 8k tokens)")
    parser.add_argument("--quick", action="store_true",
                        help="fp, mlx:4, preset:4bit; 1 and 8 clients; 256-token prompts; 16 tokens each; KV bytes at 4k "
                             "(an option given explicitly keeps its value)")
    parser.add_argument("--out", default="bench_results/bench_server", help="output folder (default bench_results/bench_server)")
    args = parser.parse_args(argv)
    settings = QUICK if args.quick else FULL
    for name, value in settings.items():
        if getattr(args, name) is None:
            setattr(args, name, value)

    import oiq_mlx  # noqa: F401  (first: preloads OpenBLAS before mlx.core)
    from oiq_mlx.bench import server as server_bench
    from oiq_mlx.eval.specs import parse_ints, split_spec_list

    specs = split_spec_list(args.caches)
    try:
        for s in specs:
            server_bench.server_args(s)
        clients, lengths = parse_ints(args.clients, k=True), parse_ints(args.lengths, k=True)
        memory_lengths = parse_ints(args.memory_lengths, k=True)
        if args.memory_only:
            clients = lengths = []
        if args.memory_batch < 1:
            raise ValueError(f"--memory-batch must be >= 1, got {args.memory_batch}")
        if not memory_lengths and not (clients and lengths):
            raise ValueError("nothing to measure: give --memory-lengths, or --clients and --lengths")
    except ValueError as e:
        print(f"bench_server: error: {e}", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    result = server_bench.run_server_bench(
        model=args.model, specs=specs, clients=clients, lengths=lengths, max_tokens=args.max_tokens,
        kv_budget_bytes=int(args.kv_budget_mib * 2**20), log_dir=args.out, memory_lengths=memory_lengths,
        progress=lambda msg: print(msg, file=sys.stderr, flush=True), batch=args.memory_batch,
    )
    table = server_bench.markdown(result)
    with open(os.path.join(args.out, "bench_server.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(args.out, "bench_server.md"), "w") as f:
        f.write(table + "\n")
    plot = server_bench.save_plot(result, os.path.join(args.out, "bench_server.png"))
    print(table)
    print(f"wrote {args.out}/bench_server.json, bench_server.md" + (", bench_server.png" if plot else ""), file=sys.stderr)
    bad = sum(len(r["failed"]) + len(r["corrupted"]) for r in result["runs"])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
