#!/usr/bin/env python
"""Run every fused Metal kernel against the reference and time it (kernel vs reference path vs fp16 SDPA).

Needs an Apple GPU; exits with status 2 and a message elsewhere.
"""

import argparse
import json
import os
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--iters", type=int, default=20, help="timed calls per measurement (median reported)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    if args.json:  # fail (or create the folder) now, not after a long run
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)

    import oiq_mlx  # noqa: F401  (platform setup before mlx.core)
    from oiq_mlx.kernels.check import MetalUnavailable, run_all

    results = []
    try:
        for r in run_all(args.iters):
            results.append(r)
            print(" | ".join(f"{k}: {v:.3g}" if isinstance(v, float) else f"{k}: {v}" for k, v in r.items()),
                  flush=True)
    except MetalUnavailable as e:
        print(f"check_metal: {e}", file=sys.stderr)
        return 2
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
