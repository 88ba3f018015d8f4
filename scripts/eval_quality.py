"""Quality of OIQ and baseline KV caches on a real model: perplexity, KL and
top-1 agreement through the real cache path, needle-in-a-haystack retrieval,
per-layer attention fidelity and key outlier statistics.

Thin front end over ``oiq_mlx.eval.quality``.  On the CPU backend the model runs
in fp32 (the GGUF loader dequantizes weights); the "fp" reference is mlx-lm's
plain KVCache at the model dtype, and bytes are reported fp16-equivalent.

Quick run (about 13 minutes on 2 idle CPU cores with SmolLM2-135M):
    python scripts/eval_quality.py --quick --json out/quick.json --plots out/
Its needle grid is one trial per cell on one text; retrieval with statistics
(many trials, several texts, paired against fp) is scripts/needle_stats.py.
Full run: 4 windows of 256 + 768 scored tokens, fidelity on 512 tokens, needle
at 1k/2k/4k/8000 tokens x 5 depths on 7 caches (hours on CPU, where the 8k
needle prompts dominate; not timed on a Mac here):
    python scripts/eval_quality.py --json out/full.json --plots out/
"""

import argparse
import json
import os
import sys

# importing oiq_mlx (first of all MLX users) preloads OpenBLAS on Linux
from oiq_mlx.eval.quality import (DEFAULT_CACHES, FULL_NEEDLE_CACHES, QUICK_NEEDLE_CACHES, EvalSettings,
                                  quick_settings, run_evaluation)
from oiq_mlx.eval.report import markdown_table, save_plots
from oiq_mlx.eval.specs import cache_registry, parse_floats, parse_ints, split_spec_list


def _names(text):
    return tuple(split_spec_list(text))


def main(argv=None):
    known = ", ".join(cache_registry())
    full = EvalSettings()
    quick = quick_settings()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="demo",
                   help='"demo" (SmolLM2-135M-Instruct GGUF, default), "gemma3" (Gemma 3 270M GGUF), '
                        "a .gguf path, or an mlx-lm model id / local mlx directory")
    p.add_argument("--text", default=None,
                   help="UTF-8 text file for perplexity and needle filler (default: the vendored Austen excerpt)")
    p.add_argument("--quick", action="store_true",
                   help=f"small settings: prompt {quick.prompt_len} + {quick.score_len} scored tokens, "
                        f"fidelity on {quick.fidelity_tokens} tokens, needle {list(quick.needle_lengths)} x "
                        f"{list(quick.needle_depths)} on {', '.join(quick.needle_caches)}; any option below overrides")
    p.add_argument("--caches", type=_names, default=None,
                   help=f"comma-separated caches to evaluate (fp is always added as the reference). "
                        f"Default: {','.join(DEFAULT_CACHES)}. Known: {known}. Also (the registry shared with "
                        f"bench_latency.py, fidelity_sweep.py, bench_server.py): mlx:B[:G], preset:NAME[field=value,...] "
                        f"and oiq[field=value,...] with OIQConfig fields, e.g. 'oiq[k_bits=4,v_bits=3,window=64]'")
    p.add_argument("--prompt-len", type=int, default=None,
                   help=f"tokens prefilled through each cache before scoring (default {full.prompt_len})")
    p.add_argument("--score-len", type=int, default=None,
                   help=f"continuation tokens scored through each cache per window (default {full.score_len})")
    p.add_argument("--chunk", type=int, default=None,
                   help=f"scored tokens fed per forward pass (default {full.chunk}: one decode step per token, as in "
                        "generation; larger chunks are faster but attend to their own tokens exactly)")
    p.add_argument("--windows", type=int, default=None,
                   help=f"non-overlapping text windows averaged (default {full.windows})")
    p.add_argument("--fidelity-tokens", type=int, default=None,
                   help=f"prompt length for attention fidelity and key outlier statistics (default {full.fidelity_tokens})")
    p.add_argument("--needle-caches", type=_names, default=None,
                   help=f"caches run in the needle test, or 'all' for every one of --caches "
                        f"(default {','.join(FULL_NEEDLE_CACHES)}; --quick: {','.join(QUICK_NEEDLE_CACHES)})")
    p.add_argument("--needle-lengths", type=parse_ints, default=None,
                   help=f"needle prompt lengths in tokens, comma-separated (default {','.join(map(str, full.needle_lengths))})")
    p.add_argument("--needle-depths", type=parse_floats, default=None,
                   help=f"needle depths in [0,1], comma-separated (default {','.join(map(str, full.needle_depths))})")
    p.add_argument("--no-chat", action="store_true",
                   help="needle prompt without the model's chat template (plain text + question + answer prefix)")
    p.add_argument("--skip", type=_names, default=(),
                   help="comma-separated parts to skip: ppl, fidelity, needle")
    p.add_argument("--seed", type=int, default=0, help="seed of the needle passkeys")
    p.add_argument("--json", default=None, help="write every number and the configuration to this JSON file")
    p.add_argument("--plots", default=None,
                   help="folder for frontier.png and needle.png (needs matplotlib; skipped with a message otherwise)")
    args = p.parse_args(argv)
    if args.json:  # fail (or create the folder) now, not after a long run
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)

    overrides = {
        "model": args.model,
        "text": args.text,
        "caches": args.caches,
        "prompt_len": args.prompt_len,
        "score_len": args.score_len,
        "chunk": args.chunk,
        "windows": args.windows,
        "fidelity_tokens": args.fidelity_tokens,
        "needle_caches": args.needle_caches,
        "needle_lengths": args.needle_lengths,
        "needle_depths": args.needle_depths,
        "needle_chat": False if args.no_chat else None,
        "skip": args.skip,
        "seed": args.seed,
    }
    if overrides["needle_caches"] == ("all",):
        overrides["needle_caches"] = args.caches or DEFAULT_CACHES
    overrides = {k: v for k, v in overrides.items() if v is not None}
    settings = quick_settings(**overrides) if args.quick else EvalSettings(**overrides)
    unknown = set(settings.skip) - {"ppl", "fidelity", "needle"}
    if unknown:
        p.error(f"--skip accepts ppl, fidelity, needle; got {sorted(unknown)}")

    result = run_evaluation(settings)
    result["command"] = " ".join(["scripts/eval_quality.py", *(argv if argv is not None else sys.argv[1:])])
    print(markdown_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plots:
        for path in save_plots(result, args.plots):
            print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
