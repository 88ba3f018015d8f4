#!/usr/bin/env python
"""Decode latency and memory of KV caches: full precision vs mlx-lm quantized vs OIQ.

For each context length, the same model and prompt: prefill time, decode
ms/token (median, p10/p90), decode ratio vs the full-precision cache, KV bytes
held and peak memory of prefill and decode; plus an attention-only mode (one
layer, synthetic q/K/V: append/quantize and decode attention timed alone,
bytes read per step, GB/s). Every mode ends with two counted (not timed) tables of
one layer's decode step on the Metal path: the dispatches, and the bytes every
primitive reads and writes against the ideal (oiq_mlx.bench.bytes; about a minute
on 2 CPU cores). Writes JSON (every sample), markdown tables on stdout, PNG plots
(with matplotlib); progress on stderr.

Examples:
  python scripts/bench_latency.py --quick                  # ~10 min on 2 CPU cores
  python scripts/bench_latency.py --model mlx-community/Llama-3.2-1B-Instruct-4bit  # Mac, Metal
  python scripts/bench_latency.py --mode counts            # dispatches and bytes per decode step only
"""

import argparse
import os
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="demo",
                        help='"demo" (bundled SmolLM2-135M GGUF, fp32 dense on CPU), a .gguf path, or an mlx-lm '
                             "model id / local mlx directory (default: demo)")
    parser.add_argument("--contexts", default=None,
                        help="comma-separated context lengths, k suffix allowed (default: 512,1k,2k,4k,8k,16k,32k, "
                             "those the model allows; --quick: 512,2k)")
    parser.add_argument("--oiq-bits", default="4,3,2", help="OIQ settings to run: the preset of that name where one exists (4: the 4bit preset, "
                             "K5V3), else k_bits = v_bits at those bits (default 4,3,2)")
    parser.add_argument("--mlx-bits", default="4,8",
                        help="mlx-lm QuantizedKVCache bit widths, group 64 (default 4,8; empty string: none)")
    parser.add_argument("--caches", default="", metavar="SPEC,...",
                        help="further caches to run after the others, by the names fidelity_sweep.py takes "
                             "(oiq_mlx.eval.specs: preset:NAME[field=value,...], oiq[...]), e.g. "
                             "'oiq[storage=mxfp4,k_bits=4,v_bits=4,clip=False,align_scales=False]'")
    parser.add_argument("--group-size", type=int, default=None, help="OIQ group size, replacing the presets' (32)")
    parser.add_argument("--decode-steps", type=int, default=None, help="timed decode steps per configuration (default 32; --quick 20)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed decode steps before the timed ones (default 3; at least 1: the first step "
                             "after a prefill counts as prefill, as mlx-lm counts the last prompt token's step)")
    parser.add_argument("--prefill-chunk", type=int, default=2048,
                        help="prefill step size in tokens, as mlx_lm.generate's prefill_step_size (default 2048)")
    parser.add_argument("--mode", choices=("both", "model", "attention", "counts"), default="both",
                        help="model: full-model prefill/decode; attention: one synthetic layer; both (default); "
                             "counts: only the dispatch and bytes tables")
    parser.add_argument("--attn-shape", default="32,8,128",
                        help="attention mode: query heads, KV heads, head dim (default 32,8,128; B = 1)")
    parser.add_argument("--attn-contexts", default=None,
                        help="attention mode context lengths (default: the model mode's list, no model maximum)")
    parser.add_argument("--attn-dtype", choices=("float16", "bfloat16", "float32"), default=None,
                        help="attention mode K/V/q dtype (default float16 on Metal, float32 on CPU)")
    parser.add_argument("--quick", action="store_true",
                        help="contexts 512,2k, 20 decode steps, 2 warm-up steps: about 10 minutes on 2 CPU cores")
    parser.add_argument("--json", default="bench_results/bench_latency.json", metavar="PATH",
                        help="where to write the JSON record (default bench_results/bench_latency.json)")
    parser.add_argument("--plots", default=None, metavar="DIR",
                        help="folder for the PNG plots (default: the JSON's folder)")
    parser.add_argument("--no-plots", action="store_true", help="do not write PNG plots")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU backend even where Metal is available")
    args = parser.parse_args(argv)

    import oiq_mlx  # noqa: F401  (first: preloads OpenBLAS before mlx.core is imported)
    import mlx.core as mx

    from oiq_mlx.bench import attention, bytes as moved, latency as bench
    from oiq_mlx.eval.specs import parse_ints, parse_spec, split_spec_list

    if args.cpu:
        mx.set_default_device(mx.cpu)
    contexts = bench.parse_contexts(args.contexts) if args.contexts else list(
        bench.QUICK_CONTEXTS if args.quick else bench.DEFAULT_CONTEXTS)
    attn_contexts = bench.parse_contexts(args.attn_contexts) if args.attn_contexts else contexts
    steps = args.decode_steps if args.decode_steps is not None else (20 if args.quick else 32)
    warmup = 2 if args.quick and args.warmup == 3 else args.warmup
    specs = bench.default_specs(parse_ints(args.oiq_bits), parse_ints(args.mlx_bits), args.group_size)
    specs += [parse_spec(name) for name in split_spec_list(args.caches)]

    result = {"environment": bench.environment(), "command": sys.argv,
              "settings": {"contexts": contexts, "decode_steps": steps, "warmup": warmup,
                           "prefill_chunk": args.prefill_chunk, "specs": [bench.describe(s) for s in specs]}}
    if args.mode in ("both", "model"):
        from mlx.utils import tree_flatten

        from oiq_mlx.mlx_lm.models import load, resolve_model

        path = resolve_model(args.model)
        print(f"bench: loading {path}", file=sys.stderr, flush=True)
        model, tokenizer = load(path)
        weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
        result["model"] = {"path": str(path), "args": repr(getattr(model, "args", None)),
                           "weight_bytes": int(weights), "max_context": bench.model_max_context(model)}
        result["model_runs"] = bench.run_model(model, tokenizer, contexts=contexts, specs=specs, decode_steps=steps,
                                               warmup=warmup, prefill_chunk=args.prefill_chunk)
        print(f"## Model: {os.path.basename(str(path))}, backend {result['environment']['backend']}\n")
        print(bench.model_table(result["model_runs"]) + "\n", flush=True)
    if args.mode in ("both", "attention"):
        hq, hkv, d = (int(x) for x in args.attn_shape.split(","))
        dtype = getattr(mx, args.attn_dtype) if args.attn_dtype else None
        result["attention_runs"] = attention.run_attention(contexts=attn_contexts, specs=specs, steps=steps, warmup=warmup,
                                                           n_q_heads=hq, n_kv_heads=hkv, head_dim=d, dtype=dtype)
        print(f"## Attention only: one layer, B=1, {hq} query heads, {hkv} KV heads, d={d}, "
              f"backend {result['environment']['backend']}\n")
        print(attention.attention_table(result["attention_runs"]) + "\n", flush=True)
    hq, hkv, d = (int(x) for x in args.attn_shape.split(","))
    result["dispatch_counts"] = attention.dispatch_counts(specs, n_q_heads=hq, n_kv_heads=hkv, head_dim=d)
    print(f"## Dispatches per layer per decode step: one layer, B=1, {hq} query heads, {hkv} KV heads, d={d}, "
          "2048 tokens, 32 steps (oiq_mlx.bench.trace; views not counted; Metal kernels counted off a Mac)\n")
    print(attention.dispatch_table(result["dispatch_counts"]) + "\n", flush=True)
    result["bytes_moved"] = moved.bytes_per_step(specs, n_q_heads=hq, n_kv_heads=hkv, head_dim=d)
    print(f"## Bytes moved per layer per decode step: one layer, {hq} query heads, {hkv} KV heads, d={d}, float16, "
          f"mean of {result['bytes_moved'][0]['steps']} steps from each context, B=1 and a ragged batch "
          "(oiq_mlx.bench.bytes; Metal path traced off a Mac; ideal: what attention reads at least)\n")
    print(moved.bytes_table(result["bytes_moved"]) + "\n", flush=True)
    bench.save_json(result, args.json)
    print(f"bench: wrote {args.json}", file=sys.stderr)
    if not args.no_plots:
        for p in bench.write_plots(result, args.plots or os.path.dirname(os.path.abspath(args.json))):
            print(f"bench: wrote {p}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
