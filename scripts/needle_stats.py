"""Needle-in-a-haystack retrieval with statistics: many trials per (length,
depth) cell, each with its own passkey, haystack text and offset, every trial
run through every cache; retrieval rates with 95% Wilson intervals and a paired
comparison against the first cache (fp: how many of fp's hits each cache
misses, and the reverse, with McNemar's exact test); and how far each cache
moves the first answer token's margin on trials both retrieve, against which a
miss where fp itself barely chose the digits is marked a coin flip.  With
--attribute, each OIQ cache's change to that margin is split in two: reading the
packed cache after fp's own prefill, and the chunked prefill's keys and values
(computed by layers that read earlier chunks packed) read exactly.

Thin front end over ``oiq_mlx.eval.needle_stats.needle_stats``.  Answers are greedy,
through ``mlx_lm.generate_step`` as in ``mlx_lm.generate``: the prompt but its
last token is prefilled in chunks of --prefill-step-size (mlx-lm's 2048), the
last token is a one-token step, so the answer reads the cache as stored.

CI-sized run (SmolLM2, 512 tokens, 12 trials x 2 caches; a few minutes on 2 CPU cores):
    python scripts/needle_stats.py --quick --json out/needle_quick.json
Headline run (60 trials per length over three novels; many CPU-hours; --resume
continues a stopped run from its JSON):
    python scripts/needle_stats.py --texts novel1.txt,novel2.txt,novel3.txt \\
        --lengths 2048,4096,8000 --trials 12 --json out/needle.json --resume
The report of a results file, running nothing:
    python scripts/needle_stats.py --report out/needle.json
"""

import argparse
import json
import os
import sys
from pathlib import Path

# importing oiq_mlx (first of all MLX users) preloads OpenBLAS on Linux
from oiq_mlx.eval.needle import prepare_haystack
from oiq_mlx.eval.needle_stats import needle_stats, resummarize_needle
from oiq_mlx.eval.progress import Progress
from oiq_mlx.eval.quality import environment, load_model, load_text, select_caches
from oiq_mlx.eval.report import needle_stats_markdown
from oiq_mlx.eval.specs import parse_floats, parse_ints, split_spec_list

FULL = {"lengths": (2048, 4096, 8000), "depths": (0.0, 0.25, 0.5, 0.75, 1.0), "trials": 12,
        "caches": ("fp", "oiq-4", "oiq-3")}
QUICK = {"lengths": (512,), "depths": (0.1, 0.5, 0.9), "trials": 4, "caches": ("fp", "oiq-4")}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="demo", help='"demo" (SmolLM2-135M, default), "gemma3", a .gguf file, '
                                                   "an mlx-lm folder or an org/name id")
    p.add_argument("--texts", default=None,
                   help="comma-separated UTF-8 haystack text files, used round robin (default: the vendored "
                        "Austen excerpt, oiq_mlx/data/austen_persuasion.txt)")
    p.add_argument("--caches", default=None,
                   help=f"comma-separated caches (registry names such as fp16 (float16 keys and values), preset:NAME[...], oiq[...], mlx:B[:G]); fp is "
                        f"always added first as the paired reference (default {','.join(FULL['caches'])}; "
                        f"--quick: {','.join(QUICK['caches'])})")
    p.add_argument("--lengths", type=parse_ints, default=None,
                   help=f"prompt lengths in tokens (default {','.join(map(str, FULL['lengths']))}; "
                        f"--quick: {','.join(map(str, QUICK['lengths']))})")
    p.add_argument("--depths", type=parse_floats, default=None,
                   help=f"needle depths in [0, 1] (default {','.join(map(str, FULL['depths']))}; "
                        f"--quick: {','.join(map(str, QUICK['depths']))})")
    p.add_argument("--trials", type=int, default=None,
                   help=f"trials per length x depth cell (default {FULL['trials']}; --quick: {QUICK['trials']})")
    p.add_argument("--quick", action="store_true", help="CI-sized defaults (any option given overrides them)")
    p.add_argument("--seed", type=int, default=0, help="seed of passkeys, offsets and text order")
    p.add_argument("--no-chat", action="store_true", help="no chat template around the haystack")
    p.add_argument("--max-tokens", type=int, default=8, help="answer tokens at most (default 8)")
    p.add_argument("--prefill-step-size", type=int, default=2048,
                   help="generate_step's prefill chunk (default 2048, mlx-lm's)")
    p.add_argument("--no-share-prefill", action="store_true",
                   help="prefill the whole prompt once per cache; by default the first prefill chunk is computed "
                        "once in fp and replayed into the fp and OIQ caches (both attend to it exactly), which "
                        "gives the same answers up to float rounding")
    p.add_argument("--only", type=parse_ints, default=None,
                   help="run just these trials of the plan: comma-separated indices as the report lists them "
                        "('#4' is 4; 0 to trials x cells - 1), e.g. the ones a cache missed, with other caches. "
                        "The same plan options as the run they come from pick the same trials; with --resume "
                        "on its file the other trials are kept as they are")
    p.add_argument("--attribute", action="store_true",
                   help="split each OIQ cache's effect on the answer: also answer from fp's prefill written into the "
                        "OIQ cache (what reading the packed cache costs) and from the OIQ prefill's keys and values "
                        "in an fp cache (what the chunked prefill costs). About two extra answers per trial and cache; "
                        "with --resume, stored trials without it run again, fp included")
    p.add_argument("--json", default=None, help="results file, rewritten after every trial")
    p.add_argument("--markdown", default=None, help="also write the markdown report to this file")
    p.add_argument("--report", default=None, metavar="JSON",
                   help="print the report of a results file and run nothing (no model is loaded): its summary is "
                        "computed again from its trials, so a file merged from --only runs reports them all; with "
                        "--markdown also written there. Takes no other option")
    p.add_argument("--resume", action="store_true", help="keep the trials already in --json (same plan) and run the rest; on finished trials, run "
                        "only the caches that are new or whose configuration changed (fp answers are reused)")
    args = p.parse_args(argv)
    if args.report:
        others = [k for k, v in vars(args).items() if k not in ("report", "markdown") and v != p.get_default(k)]
        if others:
            p.error("--report takes no other option but --markdown, got " + ", ".join(f"--{k.replace('_', '-')}" for k in others))
        try:
            with open(args.report) as f:
                report = needle_stats_markdown(resummarize_needle(json.load(f)))
        except (OSError, ValueError, KeyError, TypeError) as e:
            p.error(f"--report: cannot report {args.report}: {type(e).__name__}: {e}")
        if args.markdown:
            Path(args.markdown).write_text(report + "\n", encoding="utf-8")
        print(report)
        return
    base = QUICK if args.quick else FULL
    lengths = args.lengths or base["lengths"]
    depths = args.depths or base["depths"]
    trials = args.trials if args.trials is not None else base["trials"]
    if trials < 1:
        p.error(f"--trials must be >= 1, got {trials}")
    if any(not 0.0 <= d <= 1.0 for d in depths):
        p.error(f"--depths must lie in [0, 1], got {list(depths)}")
    if args.prefill_step_size < 1:
        p.error(f"--prefill-step-size must be >= 1, got {args.prefill_step_size}")
    planned = trials * len(lengths) * len(depths)
    if args.only is not None and (not args.only or min(args.only) < 0 or max(args.only) >= planned):
        p.error(f"--only needs trial indices 0..{planned - 1} (the plan has {planned} trials), "
                f"got {','.join(map(str, args.only)) or 'none'}")
    if args.resume and not args.json:
        p.error("--resume needs --json")
    try:
        specs = select_caches(split_spec_list(args.caches) if args.caches else base["caches"])
    except ValueError as e:
        p.error(str(e))
    paths = [x for x in (args.texts or "").split(",") if x]
    texts = {}
    for path in paths:
        try:
            texts[Path(path).stem] = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            p.error(f"--texts: cannot read {path}: {e}")
    if not texts:
        texts = {"austen_persuasion": load_text(None)}
    if len(texts) != len(paths) and paths:
        p.error("--texts: two files have the same name; haystacks are told apart by file name")
    done = done_specs = None
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        if args.resume and os.path.exists(args.json):
            with open(args.json) as f:
                old = json.load(f)
            if old.get("model") != args.model:
                p.error(f"--resume: {args.json} was run with model {old.get('model')!r}, not {args.model!r}")
            done, done_specs = old["records"], old.get("specs")

    progress = Progress()
    model, tokenizer, path = load_model(args.model)
    haystacks = [prepare_haystack(tokenizer, name, text) for name, text in texts.items()]
    progress(f"{args.model}: {len(specs)} caches, texts " + ", ".join(f"{h.name} ({len(h.ids)} tokens)" for h in haystacks))
    command = " ".join(["scripts/needle_stats.py", *(argv if argv is not None else sys.argv[1:])])

    def finish(result):
        result.update(model=args.model, model_path=str(path), command=command, environment=environment())
        return result

    def checkpoint(result):
        if args.json:
            tmp = args.json + ".tmp"
            with open(tmp, "w") as f:
                json.dump(finish(result), f, indent=1)
            os.replace(tmp, args.json)

    result = needle_stats(model, tokenizer, specs, haystacks=haystacks, lengths=lengths, depths=depths,
                          trials=trials, seed=args.seed, chat=not args.no_chat, max_tokens=args.max_tokens,
                          prefill_step_size=args.prefill_step_size,
                          share_prefill=not args.no_share_prefill, progress=progress, done=done, done_specs=done_specs,
                          checkpoint=checkpoint, only=args.only, attribute=args.attribute)
    checkpoint(result)
    report = needle_stats_markdown(finish(result))
    print(report)
    if args.markdown:
        Path(args.markdown).write_text(report + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
