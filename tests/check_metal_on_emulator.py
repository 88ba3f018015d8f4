#!/usr/bin/env python
"""Run ``scripts/check_metal.py`` itself on the CPU Metal emulator (``tests/metal_emu``), as CI does
after the test suite (``.ci/run``):

    python tests/check_metal_on_emulator.py --quick

The emulator stands in for Metal: kernel launches run on it, the kernel path is selected as on a
Mac, and the script's Metal check is satisfied.  Everything else is the script's own: its grid,
compile step, checks, self-tests, report and exit status (0 only when every check holds).  The
tests of ``tests/kernels/test_check_metal.py`` show the same checks failing on broken kernels.
"""

import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "scripts"))


def main(argv=None) -> int:
    import pytest

    import check_metal
    import oiq_mlx  # noqa: F401  (platform setup before mlx.core)
    from metal_emu import use_emulator
    from oiq_mlx.bench import metal_check
    from oiq_mlx.kernels import dispatch

    patch = pytest.MonkeyPatch()
    # any first-use verdict goes to a folder of its own, not the user's cache, removed afterwards
    with tempfile.TemporaryDirectory(prefix="oiq_mlx_emulated_check_") as verdicts:
        try:
            use_emulator(patch)
            patch.setattr(dispatch, "kernels_enabled", lambda: True)
            patch.setattr(metal_check, "require_metal", lambda: None)
            patch.setenv("OIQ_MLX_KERNELS", "kernels")
            patch.setenv("OIQ_MLX_SELFTEST_DIR", verdicts)
            return check_metal.main(argv)
        finally:
            patch.undo()


if __name__ == "__main__":
    sys.exit(main())
