"""The commands of README.md and docs/*.md run from a clone of the repository.

Every fenced code block is read: no path in it may leave the repository (``../``, an
absolute path other than under /tmp); every ``python scripts/X.py`` it names exists, and so
does every console script (``oiq-generate``, ...). The cheap commands run: ``--help`` of
every script and console script named, the ``python -c`` one-liners, a five-token
``oiq-generate`` (the README's first command) and ``scripts/docs_tables.py --check`` (every
measured table agrees with its JSON). The longer quick paths are marked slow.

Console scripts run as ``python -c "from MODULE import main; main()"`` with the entry point
that pyproject.toml names, so that this checkout's code runs, not an installed copy.
"""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(?P<lang>[\w-]*)\n(?P<body>.*?)^```", re.S | re.M)
# a path that leaves the repository: ../ anywhere, or an absolute path outside /tmp
OUTSIDE = re.compile(r"""(?:^|[\s"'(=<>,:])(\.\./|/(?!tmp/)(?:[\w.-]+/)+[\w.-]*)""")
URL = re.compile(r"\b[\w.-]+://\S+|\blocalhost:\d+/\S*")
# each help or one-liner imports the package and MLX: about 2 s on 2 cores
TIMEOUT_S = 60


def _blocks():
    for path in DOCS:
        for m in FENCE.finditer(path.read_text(encoding="utf-8")):
            yield path.relative_to(ROOT), m.group("lang"), m.group("body")


def _commands():
    """(file, words) for every shell command of a bash block: lines continued by a
    backslash or by an open quote joined, comments dropped."""
    out = []
    for path, lang, body in _blocks():
        if lang not in ("bash", "sh", "shell"):
            continue
        buf = ""
        for line in body.splitlines(keepends=True):
            buf += line
            if buf.rstrip().endswith("\\"):
                continue
            try:
                words = shlex.split(buf.replace("\\\n", " "), comments=True)
            except ValueError:  # a quote still open: the command goes on
                continue
            if words:
                out.append((str(path), words))
            buf = ""
        assert not buf.strip(), f"{path}: unterminated command {buf!r}"
    return out


def _segments(words):
    """The simple commands of a command line (split at |, &&, ;), as word lists; a
    command under ``mlx.launch ... --`` counts as its own."""
    seg = []
    for w in words + ["|"]:
        if w in ("|", "&&", ";", "||"):
            if seg:
                if seg[0] == "mlx.launch" and "--" in seg:
                    seg = seg[seg.index("--") + 1 :]
                yield seg
            seg = []
        else:
            seg.append(w)


def _console_scripts():
    """pyproject.toml's [project.scripts] (read without tomllib, which Python 3.10 lacks)."""
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    table = text.split("[project.scripts]", 1)[1].split("\n[", 1)[0]
    return dict(re.findall(r'^([\w-]+)\s*=\s*"([^"]+)"', table, re.M))


def _console_argv(name):
    module, func = _console_scripts()[name].split(":")
    code = f"import sys; from {module} import {func}; sys.argv[0] = {name!r}; sys.exit({func}())"
    return [sys.executable, "-c", code]


def _env():
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def _run(argv, *, stdin=None, timeout=TIMEOUT_S):
    return subprocess.run(argv, cwd=ROOT, env=_env(), input=stdin, capture_output=True, text=True, timeout=timeout)


def _named():
    """Scripts (scripts/X.py) and console scripts the commands run."""
    scripts, consoles = set(), set()
    for _, words in _commands():
        for seg in _segments(words):
            if seg[0] == "python" and len(seg) > 1 and seg[1].startswith("scripts/"):
                scripts.add(seg[1])
            elif seg[0].startswith("oiq-"):
                consoles.add(seg[0])
    return sorted(scripts), sorted(consoles)


SCRIPTS, CONSOLES = _named()


def test_commands_are_found():
    # the README's two commands are there, in its first 40 lines
    head = "\n".join((ROOT / "README.md").read_text(encoding="utf-8").splitlines()[:40])
    assert 'pip install -e . && oiq-generate --prompt "What is the capital of France?"' in head
    assert "oiq-generate --prompt - --preset 3bit" in head
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) <= 200
    assert "scripts/fidelity_sweep.py" in SCRIPTS and "oiq-server" in CONSOLES


def test_no_path_leaves_the_repository():
    bad = []
    for path, _, body in _blocks():
        for line in body.splitlines():
            for m in OUTSIDE.finditer(URL.sub("", line)):
                bad.append(f"{path}: {m.group(1)!r} in {line.strip()!r}")
    assert not bad, "paths outside the repository:\n" + "\n".join(bad)


def test_outside_paths_are_caught():
    for line in ("python x.py --text ../shared/data/a.txt", "cat /home/me/a.txt", 'f("/etc/x")'):
        assert OUTSIDE.search(URL.sub("", line)), line
    for line in ("python x.py --json /tmp/a.json", "curl localhost:8080/v1/chat/completions",
                 "oiq_mlx/data/a.txt", "see https://github.com/ml-explore/mlx-lm"):
        assert not OUTSIDE.search(URL.sub("", line)), line


def test_named_scripts_exist():
    assert SCRIPTS
    missing = [s for s in SCRIPTS if not (ROOT / s).is_file()]
    assert not missing, f"commands name scripts that do not exist: {missing}"
    unknown = [c for c in CONSOLES if c not in _console_scripts()]
    assert not unknown, f"commands name console scripts pyproject.toml does not declare: {unknown}"


def test_text_files_named_ship():
    named = {f for _, words in _commands() for w in words for f in re.findall(r"oiq_mlx/data/[\w.]+", w)}
    assert named and all((ROOT / f).is_file() for f in named), sorted(named)


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_help(script):
    r = _run([sys.executable, script, "--help"])
    assert r.returncode == 0 and "usage:" in r.stdout, r.stderr[-2000:]


@pytest.mark.parametrize("name", CONSOLES)
def test_console_script_help(name):
    r = _run([*_console_argv(name), "--help"])
    assert r.returncode == 0 and f"usage: {name}" in r.stdout, r.stderr[-2000:]


def _one_liners():
    return [(p, w[2]) for p, w in _commands() if w[:2] == ["python", "-c"] and len(w) == 3]


@pytest.mark.parametrize("path,code", _one_liners())
def test_python_one_liners(path, code):
    r = _run([sys.executable, "-c", code])
    assert r.returncode == 0 and r.stdout.strip(), f"{path}: python -c {code!r}\n{r.stderr[-2000:]}"


def test_tables_match_their_json():
    r = _run([sys.executable, "scripts/docs_tables.py", "--check"])
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]


def test_result_files_record_a_command_that_writes_them():
    """Every measured JSON under docs/results records the command that made it, and that command
    writes the file where it lies (its --json / --out argument), so the docs' commands rebuild it."""
    import json

    files = sorted((ROOT / "docs" / "results").glob("*.json"))
    assert files
    for f in files:
        rel = f.relative_to(ROOT).as_posix()
        cmd = json.loads(f.read_text(encoding="utf-8")).get("command")
        assert cmd, f"{rel}: no command recorded"
        words = cmd if isinstance(cmd, list) else shlex.split(cmd)
        outs = [words[i + 1] for i, w in enumerate(words[:-1]) if w in ("--json", "--out")]
        assert outs == [rel], f"{rel}: the recorded command writes {outs}"


def test_needle_view_names_caches_with_commas_and_refuses_unknown_ones():
    """A needle table's ``caches=`` view splits on commas outside ``[...]``; a name no trial answered
    through is an error, not a table of empty rows."""
    from oiq_mlx.bench.docs_tables import render

    view = "caches=fp,preset:2bit,preset:2bit[v_bits=1,key_alignment=0.5]"
    table = render([view, "results/needle2k_1.5bit_tuning.json"], ROOT / "docs")
    assert "40/40 trials" in table and "| preset:2bit[v_bits=1,key_alignment=0.5] | 26/40" in table
    with pytest.raises(ValueError, match=r"through preset:2bit\[v_bits=1\]"):
        render(["caches=fp,preset:2bit[v_bits=1]", "results/needle2k_1.5bit_tuning.json"], ROOT / "docs")


def test_quick_generate():
    """The README's first command (after pip install), five tokens."""
    r = _run([*_console_argv("oiq-generate"), "--prompt", "What is the capital of France?", "--max-tokens", "5"])
    assert r.returncode == 0, r.stderr[-2000:]
    assert "KV cache (OIQ" in r.stdout + r.stderr


@pytest.mark.slow
def test_stdin_example():
    """The README's second command, with a shorter prompt (about 500 tokens, still past the window:
    rows are packed) and fewer tokens."""
    code = "import oiq_mlx; print(oiq_mlx.default_text()[:2000] + '\\n\\nWho is Sir Walter Elliot?')"
    prompt = _run([sys.executable, "-c", code])
    assert prompt.returncode == 0, prompt.stderr
    r = _run([*_console_argv("oiq-generate"), "--prompt", "-", "--preset", "3bit", "--max-tokens", "5"],
             stdin=prompt.stdout, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


@pytest.mark.slow
def test_prompt_cache_file_example(tmp_path):
    """docs/file-format.md: cache a document (its first 2000 characters, about 500 tokens), then ask
    against it."""
    doc = (ROOT / "oiq_mlx/data/austen_persuasion.txt").read_text(encoding="utf-8")[:2000]
    cache = str(tmp_path / "doc.safetensors")
    r = _run([*_console_argv("oiq-cache-prompt"), "--model", "demo", "--preset", "3bit", "--prompt-cache-file",
              cache, "--prompt", "-"], stdin=doc, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    r = _run([*_console_argv("oiq-generate"), "--prompt-cache-file", cache, "--prompt", " Who is Sir Walter Elliot?",
              "--max-tokens", "5"], timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


def test_links_reach_files_and_headings():
    """Every relative link of README.md and docs/ names a file of the repository and, with a
    #fragment, a heading of it (GitHub's anchors: lower case, punctuation dropped, spaces to -)."""
    def anchors(path):
        heads = re.findall(r"^#+ (.+)$", path.read_text(encoding="utf-8"), re.M)
        return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}

    bad = []
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text(encoding="utf-8")):
            if "://" in target:
                continue
            file, _, frag = target.partition("#")
            path = (doc.parent / file).resolve() if file else doc
            if not path.is_relative_to(ROOT) or not path.exists():
                bad.append(f"{doc.relative_to(ROOT)}: {target} (no such file)")
            elif frag and frag not in anchors(path):
                bad.append(f"{doc.relative_to(ROOT)}: {target} (no such heading)")
    assert not bad, "\n".join(bad)


def test_readme_api_lists_all():
    """The README's "Python API" table names exactly ``oiq_mlx.__all__``."""
    import oiq_mlx

    if "BatchOIQKVCache" not in oiq_mlx.__all__:
        pytest.skip("this oiq_mlx predates the everyday __all__ the README lists")
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## Python API", 1)[1].split("\n## ", 1)[0]
    rows = [line.split(" | ")[0] for line in section.splitlines() if line.startswith("| `")]
    listed = {re.match(r"\w+", name).group(0) for row in rows for name in re.findall(r"`([^`]+)`", row)}
    assert listed == set(oiq_mlx.__all__), (sorted(listed - set(oiq_mlx.__all__)), sorted(set(oiq_mlx.__all__) - listed))
