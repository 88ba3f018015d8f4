"""Shared fixtures (`metal_emulator` runs Metal kernels on the CPU emulator) and the test order.

``oiq_mlx`` is imported before anything imports ``mlx.core`` so that it can
preload OpenBLAS on Linux (see ``oiq_mlx/core/platform.py``).

pytest puts tests/ on sys.path (pyproject.toml: ``pythonpath``) so that test files import
``helpers`` and ``metal_emu`` by name.  The folder tests/mlx_lm/ has no ``__init__.py``: a
folder without one never shadows an installed package of the same name, so ``import mlx_lm``
still finds the real mlx-lm (checked below).

Order: the files run in a shuffled order and the tests of each file in a shuffled order (a
file's tests stay together, so a module-scoped fixture is built once).  The seed comes from
$OIQ_TEST_SEED, or is drawn fresh when it is unset; the header of the run prints it, and
``OIQ_TEST_SEED=<that seed>`` replays the same order.  ``OIQ_TEST_SEED=none`` keeps file order;
``OIQ_TEST_SEED=reverse`` runs the files and the tests of each file in reverse file order.
Under pytest-xdist (``-n 2 --dist loadfile``, as CI runs the suite) every worker takes the
controller's seed, and each file runs whole on one worker.
"""

import os
import random
from pathlib import Path

import pytest

import oiq_mlx  # noqa: F401  (must come first)
import mlx_lm  # noqa: E402
from metal_emu import metal_emulator  # noqa: F401,E402

assert Path(__file__).parent not in Path(mlx_lm.__file__).resolve().parents, (
    f"tests/mlx_lm shadows the mlx_lm package: {mlx_lm.__file__}")

SEED_VARIABLE = "OIQ_TEST_SEED"


def _order_seed():
    """The shuffle's seed: $OIQ_TEST_SEED (an integer), None for 'none', 'reverse', else a fresh one."""
    value = os.environ.get(SEED_VARIABLE, "").strip().lower()
    if value in ("none", "reverse"):
        return None if value == "none" else value
    if value:
        try:
            return int(value)
        except ValueError:
            raise ValueError(f"{SEED_VARIABLE} must be an integer or 'none', not {value!r}") from None
    return random.SystemRandom().randrange(10 ** 6)


def pytest_configure(config):
    worker = getattr(config, "workerinput", None)  # a pytest-xdist worker: the controller's seed
    config._oiq_order_seed = worker["oiq_order_seed"] if worker is not None else _order_seed()


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """pytest-xdist (``-n 2 --dist loadfile``, as CI runs the suite): every worker collects in the
    controller's order, which xdist requires of them."""
    node.workerinput["oiq_order_seed"] = node.config._oiq_order_seed


def pytest_report_header(config):
    seed = config._oiq_order_seed
    if seed is None:
        return f"test order: file order ({SEED_VARIABLE}=none)"
    if seed == "reverse":
        return f"test order: reverse file order ({SEED_VARIABLE}=reverse)"
    return f"test order: shuffled with {SEED_VARIABLE}={seed} (set it to replay this order; 'none': file order)"


def pytest_collection_modifyitems(session, config, items):
    seed = config._oiq_order_seed
    if seed is None:
        return
    if seed == "reverse":
        items.reverse()
        return
    rng = random.Random(seed)
    by_file = {}
    for item in items:
        by_file.setdefault(item.path, []).append(item)
    files = list(by_file)
    rng.shuffle(files)
    order = []
    for path in files:
        tests = by_file[path]
        rng.shuffle(tests)
        order.extend(tests)
    items[:] = order


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    # the header is not shown under -q: repeat the seed at the end, where a failure is read
    seed = config._oiq_order_seed
    terminalreporter.write_line(f"test order: {SEED_VARIABLE}={'none' if seed is None else seed}")
