"""The public surface: ``oiq_mlx.__all__`` is what ``help(oiq_mlx)`` lists (the README's API table is
checked against it in tests/docs), and a console script loads only the layers it runs."""

import json
import pydoc
import re
import subprocess
import sys

import pytest

import oiq_mlx


def test_every_public_name_resolves():
    missing = [name for name in oiq_mlx.__all__ if not hasattr(oiq_mlx, name)]
    assert missing == []


def test_help_lists_the_public_names_and_only_those():
    text = pydoc.render_doc(oiq_mlx, renderer=pydoc.plaintext)
    documented = set(re.findall(r"``([A-Za-z_0-9]+)", oiq_mlx.__doc__))
    assert set(oiq_mlx.__all__) - {"__version__"} <= documented, sorted(set(oiq_mlx.__all__) - documented)
    for name in oiq_mlx.__all__:
        assert name in text, name
    # help() shows __all__'s names: the layers' own names (the codec, the kernels) stay in their modules
    for hidden in ("rotate", "quantize", "oiq_attention", "preload_openblas"):
        assert not re.search(rf"^\s+{hidden}\(", text, re.M), hidden


@pytest.mark.parametrize("module,forbidden", [
    ("oiq_mlx.cli.generate", ("oiq_mlx.eval", "oiq_mlx.bench", "oiq_mlx.cli.server")),
    ("oiq_mlx.cli.cache_prompt", ("oiq_mlx.eval", "oiq_mlx.bench", "oiq_mlx.cli.server")),
    ("oiq_mlx.cli.server", ("oiq_mlx.eval", "oiq_mlx.bench")),
])
def test_a_console_script_imports_only_what_it_runs(module, forbidden):
    code = f"import sys, json, {module}; print(json.dumps(sorted(m for m in sys.modules if m.startswith('oiq_mlx'))))"
    loaded = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert module in loaded
    assert [m for m in loaded if m.startswith(forbidden)] == []
