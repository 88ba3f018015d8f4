"""The edges a hurried user hits on the command line: conflicting options, typos, a pipe closed
early, Ctrl-C, and leaving the process (subprocesses, as a user runs them; helpers in-process)."""

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import demo_path_or_skip
from oiq_mlx.cli import options
from oiq_mlx.cli.server import main as server_main

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = {"oiq-generate": "oiq_mlx.cli.generate", "oiq-cache-prompt": "oiq_mlx.cli.cache_prompt",
           "oiq-server": "oiq_mlx.cli.server"}


def _run(prog, *args, timeout=120):
    return subprocess.run([sys.executable, "-m", SCRIPTS[prog], *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout)


@pytest.mark.parametrize("prog", ["oiq-generate", "oiq-cache-prompt"])
def test_no_oiq_with_oiq_options_is_an_error(prog, tmp_path):
    extra = ["--prompt-cache-file", str(tmp_path / "x.safetensors")] if prog == "oiq-cache-prompt" else []
    r = _run(prog, "--no-oiq", "--preset", "3bit", "--window", "32", "--prompt", "hi", *extra)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [
        f"{prog}: error: --no-oiq uses mlx-lm's own cache, which the OIQ options given (--preset --window) do "
        "not apply to"], r.stderr
    assert not (tmp_path / "x.safetensors").exists()


def test_server_refuses_no_oiq_with_oiq_options_before_serving(capsys):
    assert server_main(["--no-oiq", "--preset", "3bit", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == ("oiq-server: error: --no-oiq uses mlx-lm's own cache, which the OIQ options given "
                           "(--preset) do not apply to"), err


@pytest.mark.parametrize("prog", sorted(SCRIPTS))
def test_option_errors_are_one_line_and_a_pointer_to_help(prog, tmp_path):
    required = ["--prompt", "hi", "--prompt-cache-file", str(tmp_path / "x.safetensors")] * (prog == "oiq-cache-prompt")
    r = _run(prog, "--window", "many", *required)
    assert r.returncode == 2
    # argparse would print the whole usage (18 lines for oiq-generate) before the line that matters.
    # (oiq-server hands the options it does not know to mlx_lm.server, whose errors are mlx-lm's own.)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith(f"{prog}: error: argument --window: "), r.stderr
    assert lines[1] == f"(see {prog} --help)", r.stderr


def test_interrupt_and_closed_pipe_are_quiet_exits_in_run():
    def interrupted(argv):
        raise KeyboardInterrupt

    assert options.run("oiq-generate", interrupted, []) == 130


def test_exit_process_ends_with_os_exit_where_openblas_is_preloaded(monkeypatch):
    ended = []

    def fake_exit(code):
        ended.append(code)
        raise SystemExit(code)

    monkeypatch.setattr(options.os, "_exit", fake_exit)
    monkeypatch.setattr(options.core_platform, "openblas_path", "/usr/lib/x86_64-linux-gnu/libopenblas.so.0")
    with pytest.raises(SystemExit):
        options.exit_process(3)
    assert ended == [3]
    monkeypatch.setattr(options.core_platform, "openblas_path", None)
    with pytest.raises(SystemExit) as e:
        options.exit_process(4)
    assert e.value.code == 4 and ended == [3]  # sys.exit, library exit handlers run as usual


def _generating(*args):
    """An oiq-generate process with a long answer, once it has printed its first bytes.  It starts
    with SIGINT's default action, as from a terminal: a shell without job control starts background
    commands (a test run with ``&``) with SIGINT ignored, and the child would inherit that."""
    proc = subprocess.Popen([sys.executable, "-m", SCRIPTS["oiq-generate"], "--prompt", "Write a long story.",
                             "--max-tokens", "400", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    first = proc.stdout.read(5)
    assert first, proc.stderr.read().decode()
    return proc


@pytest.mark.slow
def test_a_reader_that_closes_the_pipe_ends_generation_quietly():
    """``oiq-generate ... | head -c 5``: status 141 (128 + SIGPIPE, as a shell reports it), no traceback."""
    demo_path_or_skip()
    proc = _generating()
    proc.stdout.close()
    rc = proc.wait(timeout=120)
    err = proc.stderr.read().decode()
    assert rc == 141, err
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


@pytest.mark.slow
def test_ctrl_c_ends_generation_quietly_with_status_130():
    demo_path_or_skip()
    proc = _generating()
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    rc = proc.wait(timeout=120)
    err = proc.stderr.read().decode()
    proc.stdout.close()
    assert rc == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
