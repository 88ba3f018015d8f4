#!/usr/bin/env python
"""Check the fused Metal kernels on a Mac: compile every kernel instantiation first (printing each
failure with the Metal compiler's message), then compare the kernels with the reference on what users
run (every preset, contexts shorter than the window up to 32k, d = 64/128/256, B > 1, fp16 and bf16)
and time them against the reference path and SDPA on the uncompressed K/V, then run every
instantiation's first-use self-test (what a process runs before the kernels serve it; a failure there
gives users the reference path).  Prints one Markdown report to paste into an issue; exits 0 when
everything compiled, matched and passed, 1 otherwise.

Needs an Apple GPU; exits with status 2 and a message elsewhere.
"""

import argparse
import json
import os
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=20, help="timed calls per measurement (median reported)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    if args.json:  # fail (or create the folder) now, not after a long run
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)

    import oiq_mlx  # noqa: F401  (platform setup before mlx.core)
    from oiq_mlx.bench.metal_check import MetalUnavailable, report, require_metal, run_all

    try:
        require_metal()
    except MetalUnavailable as e:
        print(f"check_metal: {e}", file=sys.stderr)
        return 2
    compiled, checks, selftests = run_all(args.iters)
    print(report(compiled, checks, selftests), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"compiled": compiled, "checks": checks, "selftest": selftests}, f, indent=2)
    ok = all(r["error"] is None for r in compiled + selftests) and all(r["ok"] for r in checks)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
