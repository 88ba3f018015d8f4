"""Rewrite the measured tables of README.md and docs/*.md from the JSON files under docs/results/.

Every table sits between `<!-- table: [VIEW] FILE ... -->` and `<!-- end table -->`
(oiq_mlx.bench.docs_tables says which views there are). With --check nothing is
written: the command exits 1 and names each table whose JSON says otherwise.

    python scripts/docs_tables.py            # rewrite the tables
    python scripts/docs_tables.py --check    # are they up to date?
"""

import argparse
import sys
from pathlib import Path

from oiq_mlx.bench.docs_tables import update


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="rewrite nothing; exit 1 naming every stale table")
    p.add_argument("--root", default=str(Path(__file__).resolve().parent.parent),
                   help="the repository root (default: this script's checkout)")
    args = p.parse_args(argv)
    stale = update(args.root, check=args.check)
    for s in stale:
        print(("stale table " if args.check else "rewrote table ") + s)
    return 1 if (args.check and stale) else 0


if __name__ == "__main__":
    sys.exit(main())
