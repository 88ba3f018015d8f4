"""The wheel carries everything the package reads at run time."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_wheel_contains_metal_sources_and_data(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT)],
        check=True,
    )
    (wheel,) = tmp_path.glob("oiq_mlx-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for src in (ROOT / "metal").iterdir():
        if src.suffix in (".metal", ".h"):
            assert f"oiq_mlx/metal/{src.name}" in names
    assert "oiq_mlx/data/austen_persuasion.txt" in names
    assert any(n.endswith("entry_points.txt") for n in names)
