#!/usr/bin/env python
"""Fidelity frontier: perplexity / KL / top-1 of KV caches against the
full-precision cache, with the bytes each spends per token (oiq_mlx.eval.sweep).

Caches: registry names of oiq_mlx.eval.specs (fp, mlx-q4-g64, oiq-4, ...),
oiq[field=value,...], mlx:BITS[:GROUP] (mlx-lm affine QuantizedKVCache),
preset:NAME or preset:NAME[field=value,...] (layer_bits=auto or auto:BUDGET in the brackets:
per-layer bits calibrated on each window's prompt, printed under the table).  The fp reference always runs.

Scoring feeds the continuation one token per call by default, through the
decode path, exactly as generation does; about 100 s per cache on SmolLM2 on
2 CPU cores.  Example (SmolLM2, the frontier of docs/results.md):

    python scripts/fidelity_sweep.py --json fidelity.json mlx:4 mlx:3 mlx:2 \\
        preset:4bit preset:3bit preset:2bit "preset:2bit[group_size=64,window=12]"
"""

import argparse
import json
import os
import sys
import time

import oiq_mlx  # noqa: F401  (before mlx: preloads OpenBLAS on Linux)
from oiq_mlx.eval.progress import Progress
from oiq_mlx.eval.quality import environment, load_model, text_tokens
from oiq_mlx.eval import sweep as fidelity
from oiq_mlx.core.config import layer_bits_text


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("caches", nargs="*", default=["mlx:4", "oiq-plain-4", "preset:4bit"], help="caches to compare")
    p.add_argument("--model", default="demo", help="demo (SmolLM2-135M), gemma3 (Gemma 3 270M), a .gguf path or an mlx-lm id")
    p.add_argument("--key-bias", type=float, default=0.0, metavar="RATIO",
                   help="Qwen-like stand-in: add a k_proj bias of RATIO x the median key-channel RMS on the "
                        "two slowest rotary pairs of every KV head (0: off; Qwen2.5-7B is about 27)")
    p.add_argument("--text", help="plain-text file (default: the vendored Austen excerpt)")
    p.add_argument("--prompt", type=int, default=256, help="tokens prefilled in one call (default 256)")
    p.add_argument("--scored", type=int, default=768, help="tokens scored after the prompt (default 768)")
    p.add_argument("--chunk", type=int, default=1,
                   help="tokens per call after the prompt (default 1: every scored token goes through the decode "
                        "path one step at a time, as in generation; a chunk of C is up to C times faster but its "
                        "queries attend to the chunk's own tokens exactly, which flatters windows smaller than C)")
    p.add_argument("--windows", type=int, default=1, help="non-overlapping text windows (default 1)")
    p.add_argument("--json", metavar="PATH", help="write settings and rows as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    args = p.parse_args(argv)
    if args.json:  # fail (or create the folder) now, not after a long run
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)

    specs = [fidelity.parse_spec(c) for c in args.caches]
    progress = Progress(enabled=not args.quiet)
    t0 = time.perf_counter()
    model, tokenizer, path = load_model(args.model)
    fidelity.key_bias_stand_in(model, args.key_bias, progress)
    tokens = text_tokens(tokenizer, args.text)
    rows = fidelity.sweep(model, tokens, specs, prompt_len=args.prompt, score_len=args.scored,
                          chunk=args.chunk, windows=args.windows, progress=progress)
    print(fidelity.frontier_table(rows))
    for r in rows:  # per-layer bits (layer_bits=auto: as calibrated on each window's prompt)
        for w, lb in enumerate(r["layer_bits"] or []):
            if lb:
                print(f"{r['name']}: window {w + 1} layer_bits {layer_bits_text(lb)}")
    wall = time.perf_counter() - t0
    progress(f"done in {wall:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": sys.argv, "model": args.model, "path": path, "key_bias": args.key_bias,
                       "prompt": args.prompt, "scored": args.scored, "chunk": args.chunk, "windows": args.windows,
                       "environment": environment(), "wall_seconds": wall, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
