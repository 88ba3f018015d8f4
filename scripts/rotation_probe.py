#!/usr/bin/env python
"""Would a calibrated rotation on top of the random Hadamard base lower the error of the packed rows?

A probe of the calibrated-rotation idea (DESIGN.md section 9, "Calibrated rotation"): per layer
and KV head, an orthogonal R learned by Procrustes toward the hypercube corners (rows normalized,
targets sign(X R), R = U V^T of the SVD of X^T B, alternated), on the rows the cache quantizes
(after its own mean removal, key scaling and randomized Hadamard rotation; sinks left out).

  mse   relative squared error ||x - x_hat||^2 / ||x||^2 of the preset's quantizer on the eval
        text's rows from --eval-from on, per side: the Hadamard base alone, R calibrated on the
        first --calib-tokens positions of another text, and R calibrated on the eval text's own
        first --online rows (what a cache could learn from its prompt).
  ppl   values only: R folded into each layer's v_proj / o_proj weights (Q = M R M^T with M the
        cache's own rotation, exact in full precision: the fp row stays unchanged), then
        perplexity, KL and top-1 of the given caches against the fp cache on the eval text,
        before and after (oiq_mlx.eval.sweep, as scripts/fidelity_sweep.py measures them).

Keys are rotated by RoPE after k_proj, so their rotation cannot be folded into weights, and an R
learned on keys fits the positions it saw: on positions past them it buys nothing (see
docs/results.md, "Calibrated rotation"). The defaults are the bundled texts the presets were tuned
on: calibration on Pride and Prejudice, evaluation on Northanger Abbey.

    python scripts/rotation_probe.py mse --preset 2bit            # ~1 min on 2 CPU cores
    python scripts/rotation_probe.py ppl --chunk 64 --caches preset:2bit,preset:3bit   # ~3 min
"""

import argparse
import os

import oiq_mlx  # noqa: F401  (before mlx: preloads OpenBLAS on Linux)

from oiq_mlx.core.config import OIQConfig
from oiq_mlx.eval import probes, rotation
from oiq_mlx.eval import sweep as fidelity
from oiq_mlx.eval.quality import bundled_text
from oiq_mlx.eval.specs import split_spec_list


def run_mse(args, model, tokenizer, progress) -> dict:
    cfg = OIQConfig.preset(args.preset)
    # both texts tokenized (and long enough) before the model runs on either
    calib_ids = probes.tokens_of(tokenizer, args.calib, args.calib_tokens)
    held_ids = probes.tokens_of(tokenizer, args.text, args.tokens)
    progress(f"capturing {args.calib_tokens} tokens of {args.calib} and {args.tokens} of {args.text}")
    calib = rotation.packed_rows(model, calib_ids, cfg)
    held = rotation.packed_rows(model, held_ids, cfg)
    result = rotation.packed_errors(calib, held, cfg, eval_from=args.eval_from, online=args.online, progress=progress)
    print(f"{args.preset}: relative squared error of the packed rows, positions {args.eval_from}-{args.tokens} of "
          f"{os.path.basename(args.text)}; R calibrated on {os.path.basename(args.calib)} positions "
          f"0-{args.calib_tokens}, or on the text's own first {args.online} rows")
    print(rotation.errors_table(result))
    return result


def run_ppl(args, model, tokenizer, progress) -> dict:
    specs = [fidelity.parse_spec(c) for c in split_spec_list(args.caches)]
    tokens = probes.tokens_of(tokenizer, args.text)
    calib_ids = probes.tokens_of(tokenizer, args.calib, args.calib_tokens)  # refused now, not after a sweep
    kw = probes.sweep_options(args, progress)
    before = fidelity.sweep(model, tokens, specs, **kw)
    progress(f"calibrating value rotations on {args.calib_tokens} tokens of {args.calib}")
    cfg = OIQConfig.preset(args.preset)
    rotation.fold_value_rotations(model, rotation.packed_rows(model, calib_ids, cfg))
    result = {"before": before, "after": fidelity.sweep(model, tokens, specs, **kw)}
    print(f"{os.path.basename(args.text)}, prompt {args.prompt}, scored {args.scored}, chunk {args.chunk}, "
          f"{args.windows} windows; value rotations calibrated on {os.path.basename(args.calib)} "
          f"({args.calib_tokens} tokens)")
    print(rotation.fold_table(result))
    return result


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["mse", "ppl"])
    probes.add_model_options(p)
    p.add_argument("--preset", default="2bit", help="preset whose transforms and quantizer the rows go through (default 2bit)")
    p.add_argument("--calib", default=bundled_text("prideprejudice"), help="calibration text (default: bundled Pride and Prejudice)")
    p.add_argument("--calib-tokens", type=int, default=2048, help="calibration positions (default 2048)")
    p.add_argument("--text", default=bundled_text("northangerabbey"), help="evaluation text (default: bundled Northanger Abbey)")
    p.add_argument("--tokens", type=int, default=3072, help="mse: positions of the evaluation text captured (default 3072)")
    p.add_argument("--eval-from", type=int, default=2048, help="mse: first position measured (default 2048)")
    p.add_argument("--online", type=int, default=1024, help="mse: rows of the text's own start an R is learned on (default 1024)")
    p.add_argument("--caches", default="preset:2bit", help="ppl: comma-separated caches as fidelity_sweep.py names them")
    probes.add_protocol_options(p)
    args = p.parse_args(argv)
    if args.eval_from >= args.tokens or args.online < 1:
        p.error("--eval-from must be below --tokens, and --online at least 1")
    probes.run(args, "scripts/rotation_probe.py", run_mse if args.mode == "mse" else run_ppl, argv)


if __name__ == "__main__":
    main()
