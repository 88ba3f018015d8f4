#!/usr/bin/env python
"""The Mac go/no-go for the fused Metal kernels.  Compiles every kernel instantiation, then checks the
kernels against the reference path on caches built the way mlx-lm builds them (prompt in chunks of
2048, then one-token steps): the rows they write bit for bit under every preset and option, and
decode attention against the reference path and a float64 truth (every preset up to 64k tokens,
d = 64/128/256, B > 1, float16/bfloat16; masked multi-token calls, attention sinks, after trim, after
save/load, a ragged batch), each check asserting that packed rows exist and that the kernels ran.
Then a speed table against scaled_dot_product_attention on float16 keys and values (1k to 64k), every
instantiation's first-use self-test run afresh (what a process runs before the kernels serve it; a
failure there gives users the reference path), and an end-to-end line on the bundled model (OIQ vs
float16 vs mlx-lm's 4-bit cache through mlx-lm).

Prints one Markdown report to paste into an issue, its first line the verdict; progress on stderr.
Exits 0 when every instantiation compiled, every check held and every self-test passed, 1 otherwise,
2 without Metal.
"""

import argparse
import json
import os
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=20, help="timed calls per measurement (median reported)")
    parser.add_argument("--quick", action="store_true",
                        help="the reduced grid CI runs on the emulator (contexts 40 and 300, d = 64; no timings)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    if args.json:  # fail (or create the folder) now, not after a long run
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)

    import oiq_mlx  # noqa: F401  (platform setup before mlx.core)
    from oiq_mlx.bench.metal_check import FULL, QUICK, MetalUnavailable, report, require_metal, run_all, verdict

    try:
        require_metal()
    except MetalUnavailable as e:
        print(f"check_metal: {e}", file=sys.stderr)
        return 2
    compiled, rows, speed, e2e, selftests = run_all(QUICK if args.quick else FULL,
                                                    iters=0 if args.quick else args.iters,
                                                    progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(report(compiled, rows, speed, e2e, selftests), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"compiled": compiled, "checks": rows, "speed": speed, "end_to_end": e2e,
                       "selftest": selftests}, f, indent=2)
    return 0 if verdict(compiled, rows, speed, selftests)[0] else 1


if __name__ == "__main__":
    sys.exit(main())
