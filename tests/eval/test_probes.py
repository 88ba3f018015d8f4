"""The probe scripts end to end on the bundled model (a few hundred tokens): their options, the
results file they write, and the docs table it renders to."""

import json
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from oiq_mlx.bench import docs_tables

ROOT = Path(__file__).resolve().parents[2]


def _run(*args):
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_codebook_probe_mse_writes_what_the_docs_render(tmp_path):
    out = tmp_path / "cb.json"
    r = _run("scripts/codebook_probe.py", "mse", "--tokens", "200", "--variants", "uniform-2,vq-2x8", "--quiet",
             "--json", str(out))
    assert r.returncode == 0, r.stderr
    result = json.loads(out.read_text())
    assert result["settings"]["text"] == "oiq_mlx/data/austen_northangerabbey.txt"  # repository-relative
    assert result["command"][:3] == ["python", "scripts/codebook_probe.py", "mse"]
    assert set(result["codebook_errors"]) == {"keys", "values"}
    assert docs_tables.render([out.name], tmp_path) == r.stdout.strip().split("\n", 1)[1]


def test_probes_refuse_a_text_too_short_and_an_unknown_codebook(capsys):
    """Before the model runs on any text: the scripts' own main, in this process."""
    rotation_probe = runpy.run_path(str(ROOT / "scripts" / "rotation_probe.py"), run_name="probe")["main"]
    codebook_probe = runpy.run_path(str(ROOT / "scripts" / "codebook_probe.py"), run_name="probe")["main"]
    # the script ends with the message (sys.exit(text): exit status 1, the text on stderr)
    with pytest.raises(SystemExit, match="northangerabbey.* fewer than the 99999 asked for"):
        rotation_probe(["mse", "--tokens", "99999", "--eval-from", "100", "--quiet"])
    with pytest.raises(SystemExit, match="prideprejudice.* fewer than the 99999 asked for"):
        rotation_probe(["ppl", "--calib-tokens", "99999", "--quiet"])
    with pytest.raises(SystemExit) as exit_:
        codebook_probe(["mse", "--variants", "vq-4", "--quiet"])
    assert exit_.value.code == 2 and "unknown codebook 'vq-4'" in capsys.readouterr().err
    r = _run("scripts/codebook_probe.py", "mse", "--variants", "vq-4", "--quiet")  # and from the command line
    assert r.returncode == 2 and "unknown codebook 'vq-4'" in r.stderr


def test_codebook_probe_ppl_runs_each_seed_and_alignment_as_a_row(tmp_path, capsys):
    """In this process, one short window (past 2bit's 128-token window): a carrier row per seed,
    named by variant, alignment and seed, beside fp; the docs render the file."""
    probe = runpy.run_path(str(ROOT / "scripts" / "codebook_probe.py"), run_name="probe")["main"]
    out = tmp_path / "cb.json"
    probe(["ppl", "--prompt", "160", "--scored", "64", "--chunk", "64", "--windows", "1", "--variants", "uniform-2",
           "--align", "0.5", "--seed", "0,1", "--caches", "", "--quiet", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["name"] for r in rows] == ["fp", "2bit + uniform-2 aligned 0.5 (seed 0)",
                                         "2bit + uniform-2 aligned 0.5 (seed 1)"]
    assert [r["config"]["seed"] for r in rows[1:]] == [0, 1] and rows[1]["kl"] != rows[2]["kl"]
    assert all(r["bytes_per_token"] == 40 and r["kl"] > 0 for r in rows[1:])
    assert "| 2bit + uniform-2 aligned 0.5 (seed 1) | 40 |" in capsys.readouterr().out
    assert "| 2bit + uniform-2 aligned 0.5 (seed 1) | 40 |" in docs_tables.render([out.name], tmp_path)
    for bad in ("1,1", "a", "-1"):
        with pytest.raises(SystemExit):
            probe(["ppl", "--seed", bad])
