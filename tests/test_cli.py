"""oiq-generate, run as a user would (subprocess)."""

import subprocess
import sys
from pathlib import Path

import pytest

from oiq_mlx import models

ROOT = Path(__file__).resolve().parent.parent


def _cli(*args, stdin=None):
    return subprocess.run(
        [sys.executable, "-m", "oiq_mlx.cli", *args], capture_output=True, text=True, cwd=ROOT, input=stdin
    )


def test_cli_help_lists_every_option():
    out = _cli("--help").stdout
    for opt in ("--model", "--prompt", "--preset", "--k-bits", "--v-bits", "--group-size", "--sink-tokens", "--window",
                "--quantize-after", "--clip", "--center-keys", "--no-center-keys", "--key-scaling", "--temp", "--seed",
                "--system-prompt", "--no-oiq", "--layer-bits"):
        assert opt in out


@pytest.mark.parametrize(
    "args,message",
    [
        (["--k-bits", "7"], "k_bits=7 is not supported"),
        (["--group-size", "48"], "group_size=48 is not supported"),
        (["--window", "-1"], "window must be >= 0"),
        (["--max-tokens", "0"], "--max-tokens must be >= 1"),
        (["--preset", "1bit"], "unknown OIQ preset '1bit'"),
        (["--layer-bits", "3:3"], "layer_bits entry '3:3' is not layer:k_bits:v_bits"),
        (["--layer-bits", "99:3:3"], "layer_bits names layers [99] that do not use OIQ in this model"),
        (["--model", "/nonexistent/model.gguf"], "GGUF file not found: /nonexistent/model.gguf"),
    ],
)
def test_bad_options_fail_cleanly(args, message):
    r = _cli(*args, "--prompt", "hi")
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_generates_from_stdin_and_reports_memory():
    try:
        models.demo_model_path(install=False)
    except FileNotFoundError as e:
        pytest.skip(str(e))
    r = _cli("--prompt", "-", "--max-tokens", "8", "--k-bits", "5", "--v-bits", "3", stdin="What is the capital of France?")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "tokens-per-sec" in r.stderr
    assert "KV cache (OIQ K5V3 g32)" in r.stderr and "at float16" in r.stderr


def test_options_build_the_config():
    from oiq_mlx import OIQConfig
    from oiq_mlx.cli import build_parser, config_from_args

    parse = build_parser().parse_args
    assert config_from_args(parse([])) == OIQConfig()
    assert config_from_args(parse(["--preset", "3bit"])) == OIQConfig.preset("3bit")
    cfg = config_from_args(parse(["--preset", "2bit", "--k-bits", "3", "--no-clip", "--window", "0"]))
    assert cfg == OIQConfig.preset("2bit", k_bits=3, clip=False, window=0)
    assert config_from_args(parse(["--no-center-keys", "--key-scaling", "0.5"])) == OIQConfig(center_keys=False, key_scaling=0.5)
    cfg = config_from_args(parse(["--preset", "2bit", "--layer-bits", "4:3:3,8:4:3"]))
    assert cfg == OIQConfig.preset("2bit", layer_bits=((4, 3, 3), (8, 4, 3)))


def test_scripts_create_the_json_folder_before_running(tmp_path):
    target = tmp_path / "new" / "folder" / "out.json"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "check_metal.py"), "--json", str(target)],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode != 0 and "Metal is not available" in r.stderr  # no Mac here
    assert target.parent.is_dir()
