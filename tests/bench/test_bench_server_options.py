"""``scripts/bench_server.py --quick``: its settings fill in only what the command line leaves open."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quick_keeps_the_caches_and_lengths_given(tmp_path):
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_server.py"), "--quick", "--memory-only", "--caches", "fp",
         "--memory-lengths", "64", "--memory-batch", "1", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    memory = json.loads((tmp_path / "bench_server.json").read_text())["memory"]
    # --quick alone would measure fp, mlx:4 and preset:4bit at 4096 tokens
    assert [(m["spec"], m["tokens"]) for m in memory] == [("fp", 64)]
