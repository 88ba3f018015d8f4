#!/usr/bin/env python
"""Would a 2-bit codebook beat the preset's clipped uniform grid at equal bytes?

A probe of the codebook lever (DESIGN.md section 9), on the data OIQ actually quantizes: the keys
and values a model produces on a text, after the cache's own transforms (mean
removed, key scaling, randomized Hadamard rotation; sink tokens left out), in
groups of ``group_size`` coordinates with one float16 scale per group and 2 bits
per coordinate in every variant:

  uniform    the ``2bit`` preset: 4 evenly spaced levels, MSE-clipped abs-max scale
             (``codec.quantize(clip=True)``)
  lloyd-max  4 scalar levels fitted by Lloyd's algorithm to the pooled,
             RMS-normalized coordinates; per-group scale searched
  vq-2d      16 codewords in R^2 (k-means on normalized coordinate pairs, 4 bits per
             pair); per-group scale searched

Codebooks are fitted on one half of the groups and measured on the other.  Prints
the relative squared error ||y - y_hat||^2 / ||y||^2 per side (equal to the mean
relative error of a dot product with an isotropic query).  A few minutes on 2 CPU
cores; numpy only past the model pass.

    python scripts/codebook_probe.py --text ../shared/data/northangerabbey.txt
"""

import argparse

import oiq_mlx  # noqa: F401  (before mlx: preloads OpenBLAS on Linux)
import mlx.core as mx
import numpy as np

from oiq_mlx.eval.quality import load_model, load_text
from oiq_mlx.core.codec import dequantize, quantize
from oiq_mlx.core.config import OIQConfig
from oiq_mlx.eval.rotation import packed_rows


def packed_domain(model, ids, config):
    """Per side, the (n, group_size) groups the cache would quantize for ``ids``."""
    rows = packed_rows(model, ids, config)
    return {name: np.concatenate([x.reshape(-1, config.group_size).astype(np.float32)
                                  for (_, s), (x, _) in sorted(rows.items()) if s == side])
            for side, name in (("k", "keys"), ("v", "values"))}


def fit(groups, dim, size, rng, iters=25):
    """A codebook of ``size`` points in R^dim for RMS-normalized groups (Lloyd / k-means)."""
    z = (groups / (np.sqrt((groups**2).mean(1, keepdims=True)) + 1e-12)).reshape(-1, dim)
    z = z[rng.choice(len(z), min(len(z), 400_000), replace=False)]
    book = np.quantile(z, (np.arange(size) + 0.5) / size)[:, None] if dim == 1 else z[rng.choice(len(z), size, replace=False)]
    for _ in range(iters):
        idx = np.argmin(((z[:, None, :] - book[None]) ** 2).sum(-1), -1)
        book = np.stack([z[idx == j].mean(0) if np.any(idx == j) else book[j] for j in range(size)])
    return book.astype(np.float32)


def encode(groups, book, ratios=np.linspace(0.3, 1.6, 27)):
    """Each group at its best float16 scale (RMS x ratio) and nearest codewords."""
    rms = np.sqrt((groups**2).mean(1, keepdims=True)) + 1e-12
    best, out = np.full(len(groups), np.inf), np.zeros_like(groups)
    for a in ratios:
        s = (rms * a).astype(np.float16).astype(np.float32)
        z = (groups / s).reshape(len(groups), -1, book.shape[1])
        h = book[np.argmin(((z[:, :, None, :] - book[None, None]) ** 2).sum(-1), -1)].reshape(groups.shape) * s
        err = ((groups - h) ** 2).sum(1)
        better = err < best
        best[better], out[better] = err[better], h[better]
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="demo", help="demo (SmolLM2-135M), gemma3, a .gguf path or an mlx-lm id")
    p.add_argument("--text", help="plain-text file (default: the vendored Austen excerpt)")
    p.add_argument("--tokens", type=int, default=1024, help="tokens of the text run through the model (default 1024)")
    p.add_argument("--group-size", type=int, default=32, help="coordinates per float16 scale (default 32)")
    args = p.parse_args(argv)
    model, tokenizer, _ = load_model(args.model)
    ids = tokenizer.encode(load_text(args.text))[: args.tokens]
    if len(ids) < args.tokens:
        p.error(f"the text has {len(ids)} tokens, fewer than --tokens {args.tokens}")
    cfg = OIQConfig.preset("2bit", group_size=args.group_size)
    rng = np.random.default_rng(0)
    print(f"{args.model}, {len(ids)} tokens, 2 bits per coordinate, group {args.group_size}: relative squared error")
    for side, groups in packed_domain(model, ids, cfg).items():
        rng.shuffle(groups)
        train, test = groups[: len(groups) // 2], groups[len(groups) // 2 :]
        codes, scales = quantize(mx.array(test), 2, args.group_size, clip=True)
        variants = {
            "uniform": np.array(dequantize(codes, scales, bits=2, group_size=args.group_size)),
            "lloyd-max": encode(test, fit(train, 1, 4, rng)),
            "vq-2d": encode(test, fit(train, 2, 16, rng)),
        }
        den = float((test**2).sum())
        errs = {k: float(((test - h) ** 2).sum()) / den for k, h in variants.items()}
        print(f"{side:6s} " + "  ".join(f"{k} {v:.4f} ({100 * (v / errs['uniform'] - 1):+.1f}%)" for k, v in errs.items())
              + f"  [{len(test)} groups]")


if __name__ == "__main__":
    main()
