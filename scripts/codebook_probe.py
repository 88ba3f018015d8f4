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
    python scripts/codebook_probe.py ppl --chunk 64 --variants vq-4x256                  # ~5 min
    python scripts/codebook_probe.py ppl --chunk 64 --variants vq-4x256 --align 1        # aligned scales
"""

import argparse
import os

import oiq_mlx  # noqa: F401  (before mlx: preloads OpenBLAS on Linux)

from oiq_mlx.core.config import OIQConfig
from oiq_mlx.eval import codebook, probes
from oiq_mlx.eval import sweep as fidelity
from oiq_mlx.eval.quality import bundled_text
from oiq_mlx.eval.rotation import packed_rows
from oiq_mlx.eval.specs import split_spec_list
from oiq_mlx.mlx_lm.caches import model_head_dim


def run_mse(args, model, tokenizer, progress, books) -> dict:
    cfg = OIQConfig.preset(args.preset)
    rows = packed_rows(model, probes.tokens_of(tokenizer, args.text, args.tokens), cfg)
    result = codebook.packed_errors(rows, cfg, books, progress, align=args.align)
    print(f"{os.path.basename(args.text)}, {args.tokens} tokens, rows of preset {args.preset} "
          "(preset: its own quantizer)")
    print(codebook.errors_table(result))
    return result


def run_ppl(args, model, tokenizer, progress, books) -> dict:
    tokens = probes.tokens_of(tokenizer, args.text)
    kw = probes.sweep_options(args, progress)
    specs = [fidelity.parse_spec(c) for c in split_spec_list(args.caches)] if args.caches else []
    rows = fidelity.sweep(model, tokens, specs, **kw)
    carriers = [fidelity.parse_spec(f"preset:{args.preset}[k_bits=8,v_bits=8,seed={s}]") for s in args.seed]
    d = model_head_dim(model)
    for v, book in books.items():
        progress(f"{v}: {codebook.bits_per_coordinate(book):g} bits per coordinate, in a {args.preset} cache")
        with codebook.packing_through(lambda y, book=book: codebook.reconstruct(
                y, book, carriers[0].oiq.group_size, align=args.align)):
            runs = fidelity.sweep(model, tokens, carriers, **kw)[1:]
        for seed, carrier, row in zip(args.seed, carriers, runs):
            name = f"{args.preset} + {v}" + (f" (seed {seed})" if len(args.seed) > 1 else "")
            row.update(name=name, description=f"{carrier.description}, rows packed by {v}",
                       bytes_per_token=codebook.packed_bytes(d, book, carrier.oiq.group_size), bytes_allocated=None)
            rows.append(row)
    print(f"{os.path.basename(args.text)}, prompt {args.prompt}, scored {args.scored}, chunk {args.chunk}, "
          f"{args.windows} windows")
    print(fidelity.frontier_table(rows))
    return {"rows": rows, "scored": args.scored, "prompt": args.prompt, "chunk": args.chunk, "windows": args.windows}


def _seeds(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"seeds are comma-separated integers, got {text!r}") from None
    if any(s < 0 for s in seeds) or len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"seeds must be distinct and >= 0, got {text!r}")
    return seeds


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["mse", "ppl"])
    probes.add_model_options(p)
    p.add_argument("--preset", default="2bit", help="preset whose transforms (and, for ppl, cache) the variants use "
                                                     "(default 2bit)")
    p.add_argument("--variants", default="uniform-2,vq-2x16,vq-4x256,vq-2x8,vq-4x64",
                   help="comma-separated codebooks: uniform-B (the B-bit grid) or vq-KxC (C points in R^K); "
                        "default %(default)s")
    p.add_argument("--text", default=bundled_text("northangerabbey"), help="text (default: bundled Northanger Abbey)")
    p.add_argument("--tokens", type=int, default=1024, help="mse: positions of the text captured (default 1024)")
    p.add_argument("--caches", default="preset:2bit",
                   help="ppl: caches run as they are, comma-separated as fidelity_sweep.py names them "
                        "(default %(default)s; empty: none)")
    p.add_argument("--align", type=float, default=0.0, choices=(0.0, 0.5, 1.0),
                   help="keep each group's codewords and store the aligned scale sum(y*y)/sum(y*u) (1), the mean "
                        "of it and the searched one (0.5), or the searched one (0, the default), as the presets' "
                        "align_scales / key_alignment do for the integer grid")
    p.add_argument("--seed", type=_seeds, default=[0],
                   help="ppl: rotation seed of the variants' caches, or several, comma-separated, each a row "
                        "(default 0)")
    probes.add_protocol_options(p)
    args = p.parse_args(argv)
    try:
        cfg = OIQConfig.preset(args.preset)
        books = {v + (f" aligned {args.align:g}" if args.align else ""): codebook.parse_variant(v, cfg.group_size)
                 for v in args.variants.split(",") if v}
    except ValueError as e:
        p.error(str(e))
    mode = run_mse if args.mode == "mse" else run_ppl
    probes.run(args, "scripts/codebook_probe.py", lambda *a: mode(*a, books), argv)


if __name__ == "__main__":
    main()
