#!/usr/bin/env python
"""Would a vector codebook beat the presets' scalar grid at equal bytes, or reach 1.5 bits?

A probe of the codebook idea (oiq_mlx/eval/codebook.py; docs/results.md, "Vector codebooks"):
blocks of K rotated coordinates share one data-free codebook of C points, fitted by Lloyd's
algorithm to Gaussian groups.  Each group of 32 coordinates keeps one float16 scale, searched.
The rate is log2(C)/K bits per coordinate: vq-4x256 is 2 bits, vq-4x64 is 1.5 bits.
uniform-B is the integer codec's B-bit grid under the same scale search.

  mse   relative squared error ||x - x_hat||^2 / ||x||^2 on the rows a cache of --preset packs
        on the text (after its mean removal, key scaling and randomized Hadamard rotation;
        sinks left out): the preset's own quantizer (clip search, aligned scales), then each
        variant.
  ppl   perplexity, KL and top-1 against the fp cache on the text (oiq_mlx.eval.sweep, as
        scripts/fidelity_sweep.py measures them).  Each variant runs in a cache of --preset
        whose pack step stores the variant's reconstruction in 8-bit codes
        (eval.codebook.packing_through); the bytes shown are the variant's own, at 32 rotated
        coordinates per float16 scale.  --caches run as they are, for comparison.

The default text is Northanger Abbey, one of the texts the presets were tuned on.

    python scripts/codebook_probe.py mse --variants uniform-2,vq-2x16,vq-4x256,vq-4x64   # ~1 min
    python scripts/codebook_probe.py ppl --chunk 64 --variants vq-4x256                  # ~10 min
"""

import argparse
import json
import os
import sys
import time

import oiq_mlx  # noqa: F401  (before mlx: preloads OpenBLAS on Linux)

from oiq_mlx.core.config import OIQConfig
from oiq_mlx.eval import codebook
from oiq_mlx.eval import sweep as fidelity
from oiq_mlx.eval.progress import Progress
from oiq_mlx.eval.quality import environment, load_model, load_text
from oiq_mlx.eval.rotation import packed_rows
from oiq_mlx.eval.specs import split_spec_list
from oiq_mlx.mlx_lm.caches import model_head_dim


def bundled(name: str) -> str:
    """A text shipped in the package (``oiq_mlx/data``), as a path relative to the working directory."""
    return os.path.relpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "oiq_mlx", "data",
                                        f"austen_{name}.txt"))


def tokens_of(tokenizer, path: str, n: int | None = None) -> list[int]:
    ids = tokenizer.encode(load_text(path))
    if n is not None and len(ids) < n:
        sys.exit(f"{path} has {len(ids)} tokens, fewer than the {n} asked for")
    return ids if n is None else ids[:n]


def run_mse(args, model, tokenizer, books, progress) -> dict:
    cfg = OIQConfig.preset(args.preset)
    rows = packed_rows(model, tokens_of(tokenizer, args.text, args.tokens), cfg)
    result = codebook.packed_errors(rows, cfg, books, progress)
    print(f"{os.path.basename(args.text)}, {args.tokens} tokens, rows of preset {args.preset} "
          "(preset: its own quantizer)")
    print(codebook.errors_table(result))
    return result


def run_ppl(args, model, tokenizer, books, progress) -> dict:
    tokens = tokens_of(tokenizer, args.text)
    kw = dict(prompt_len=args.prompt, score_len=args.scored, chunk=args.chunk, windows=args.windows, progress=progress)
    specs = [fidelity.parse_spec(c) for c in split_spec_list(args.caches)] if args.caches else []
    rows = fidelity.sweep(model, tokens, specs, **kw)
    carrier = fidelity.parse_spec(f"preset:{args.preset}[k_bits=8,v_bits=8,seed={args.seed}]")
    d = model_head_dim(model)
    for v, book in books.items():
        progress(f"{v}: {codebook.bits_per_coordinate(book):g} bits per coordinate, in a {args.preset} cache")
        with codebook.packing_through(lambda y, book=book: codebook.reconstruct(y, book, carrier.oiq.group_size)):
            row = fidelity.sweep(model, tokens, [carrier], **kw)[1]
        row.update(name=f"{args.preset} + {v}", description=f"{carrier.description}, rows packed by {v}",
                   bytes_per_token=codebook.packed_bytes(d, book, carrier.oiq.group_size), bytes_allocated=None)
        rows.append(row)
    print(f"{os.path.basename(args.text)}, prompt {args.prompt}, scored {args.scored}, chunk {args.chunk}, "
          f"{args.windows} windows")
    print(fidelity.frontier_table(rows))
    return {"rows": rows, "scored": args.scored, "prompt": args.prompt, "chunk": args.chunk, "windows": args.windows}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["mse", "ppl"])
    p.add_argument("--model", default="demo", help="demo (SmolLM2-135M), gemma3, a .gguf path or an mlx-lm id")
    p.add_argument("--key-bias", type=float, default=0.0, metavar="RATIO",
                   help="Qwen-like stand-in: a k_proj bias of RATIO x the median key-channel RMS (as fidelity_sweep.py)")
    p.add_argument("--preset", default="2bit", help="preset whose transforms (and, for ppl, cache) the variants use "
                                                     "(default 2bit)")
    p.add_argument("--variants", default="uniform-2,vq-2x16,vq-4x256,vq-2x8,vq-4x64",
                   help="comma-separated codebooks: uniform-B (the B-bit grid) or vq-KxC (C points in R^K); "
                        "default %(default)s")
    p.add_argument("--text", default=bundled("northangerabbey"), help="text (default: bundled Northanger Abbey)")
    p.add_argument("--tokens", type=int, default=1024, help="mse: positions of the text captured (default 1024)")
    p.add_argument("--caches", default="preset:2bit",
                   help="ppl: caches run as they are, comma-separated as fidelity_sweep.py names them "
                        "(default %(default)s; empty: none)")
    p.add_argument("--seed", type=int, default=0, help="ppl: rotation seed of the variants' caches (default 0)")
    p.add_argument("--prompt", type=int, default=768, help="ppl: tokens prefilled per window (default 768)")
    p.add_argument("--scored", type=int, default=256, help="ppl: tokens scored per window (default 256)")
    p.add_argument("--chunk", type=int, default=1, help="ppl: tokens per call after the prompt (default 1)")
    p.add_argument("--windows", type=int, default=3, help="ppl: text windows (default 3)")
    p.add_argument("--json", metavar="PATH", help="write the settings and results as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    args = p.parse_args(argv)
    try:
        cfg = OIQConfig.preset(args.preset)
        books = {v: codebook.parse_variant(v, cfg.group_size) for v in args.variants.split(",") if v}
    except ValueError as e:
        p.error(str(e))
    if args.json:  # fail (or create the folder) now, not after a long run
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    progress = Progress(enabled=not args.quiet)
    t0 = time.perf_counter()
    model, tokenizer, path = load_model(args.model)
    fidelity.key_bias_stand_in(model, args.key_bias, progress)
    result = (run_mse if args.mode == "mse" else run_ppl)(args, model, tokenizer, books, progress)
    progress(f"done in {time.perf_counter() - t0:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": ["python", "scripts/codebook_probe.py", *(argv or sys.argv[1:])], "model": args.model,
                       "path": path, "settings": {k: v for k, v in vars(args).items() if k != "json"},
                       "environment": environment(), **result}, f, indent=1)


if __name__ == "__main__":
    main()
