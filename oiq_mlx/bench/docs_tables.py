"""The measured tables of README.md and docs/, regenerated from the JSON files
that the documented commands write (kept under ``docs/results/``).

A table sits between two markers in a markdown file::

    <!-- table: [VIEW] FILE [FILE ...] -->
    ...generated...
    <!-- end table -->

``FILE`` is relative to the markdown file's folder.  Without a ``VIEW`` the
kind of table follows from the JSON: a ``fidelity_sweep.py`` file (perplexity,
KL, top-1 per cache), an ``eval_quality.py`` file (every baseline in one run),
a ``needle_stats.py`` results file (its report, the summary computed again from
its trials), a ``bench_latency.py`` record (the model table; the views
``attention``, ``dispatch`` and ``bytes`` give its other three tables), a ``bench_server.py``
record, a ``bench_sharded.py`` record, a ``rotation_probe.py`` or a ``codebook_probe.py`` result.
A needle file takes the view ``caches=fp,oiq-4,...``: the caches to report, where its trials
hold more.  The view ``summary`` takes a fidelity sweep, a ``bench_latency.py``
record and a ``bench_server.py --memory-only`` record and gives the README's one
table of the presets; the view ``spread`` takes fidelity sweeps (one configuration over
rotation seeds each) and gives one row per file: mean and range of perplexity
change and KL.

``scripts/docs_tables.py`` is the command-line front end: it rewrites every
table, or with ``--check`` rewrites nothing and exits 1 naming the stale ones.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from ..eval import codebook, rotation
from ..eval.needle_stats import resummarize_needle
from ..eval.report import markdown_table, needle_stats_markdown
from ..eval.specs import split_spec_list
from ..eval.sweep import frontier_table
from . import attention, latency, server, sharded
from . import bytes as moved

MARKER = re.compile(r"<!-- table: (?P<args>[^>]*?) -->\n(?P<body>.*?)<!-- end table -->", re.S)

PRESETS = ("4bit", "3bit", "2bit")


def load(path) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def kind_of(result: dict) -> str:
    """Which command wrote ``result``: fidelity (``fidelity_sweep.py``, and ``codebook_probe.py``'s
    ``ppl`` mode), quality, needle, latency, sharded, server, ``rotation_probe.py`` (rotation_fold:
    its ``ppl`` mode, rotation_errors: ``mse``) or ``codebook_probe.py mse`` (codebook_errors)."""
    if "rows" in result and "scored" in result:
        return "fidelity"
    if "bytes_per_token_head" in result:
        return "quality"
    if "records" in result and "summary" in result:
        return "needle"
    if "dispatch_counts" in result:
        return "latency"
    if "ranks" in result and "runs" in result:
        return "sharded"
    if "memory" in result and "runs" in result:
        return "server"
    if "before" in result and "after" in result:
        return "rotation_fold"
    if "errors" in result:
        return "rotation_errors"
    if "codebook_errors" in result:
        return "codebook_errors"
    raise ValueError("not a results file of fidelity_sweep.py, eval_quality.py, needle_stats.py, bench_latency.py, "
                     "bench_server.py, bench_sharded.py, rotation_probe.py or codebook_probe.py")


def fidelity_table(result: dict) -> str:
    return frontier_table(result["rows"])


def quality_table(result: dict) -> str:
    return markdown_table(result)


def needle_table(result: dict, caches: list[str] | None = None) -> str:
    """The report of a needle_stats.py results file; ``caches``: the caches to report (the
    first is the paired reference), where the file holds answers of more caches than its
    last run named."""
    if caches:
        missing = [n for n in caches if not any(n in r["results"] for r in result["records"])]
        if missing:
            raise ValueError(f"no trial of the needle file answered through {', '.join(missing)}")
        records = [{**r, "results": {n: r["results"][n] for n in caches if n in r["results"]}}
                   for r in result["records"]]
        result = {**result, "caches": caches, "records": records}
    return needle_stats_markdown(resummarize_needle(result))


def latency_table(result: dict, view: str = "model") -> str:
    if view == "model":
        return latency.model_table(result["model_runs"])
    if view == "attention":
        return attention.attention_table(result["attention_runs"])
    if view == "dispatch":
        return attention.dispatch_table(result["dispatch_counts"])
    if view == "bytes":
        return moved.bytes_table(result["bytes_moved"])
    raise ValueError(f"bench_latency view must be model, attention, dispatch or bytes, got {view!r}")


def server_table(result: dict) -> str:
    return server.markdown(result)


def sharded_table(result: dict) -> str:
    return sharded.sharded_table(result["runs"])


def _preset_of(spec_name: str) -> str | None:
    """'preset:4bit' -> '4bit', 'oiq-4bit' -> '4bit' (bench_latency's names)."""
    for p in PRESETS:
        if spec_name in (f"preset:{p}", f"oiq-{p}"):
            return p
    return None


def summary_table(quality: dict, latency: dict, memory: dict) -> str:
    """One row per preset (and mlx-lm's 4-bit cache): KV bytes vs fp16 at the
    longest length of ``memory``, held-out perplexity change and KL from
    ``quality``, decode speed against fp and against mlx-lm's 4-bit
    ``QuantizedKVCache`` at the longest context of ``latency``."""
    rows = {(_preset_of(r["name"]) or r["name"]): r for r in quality["rows"]}
    tokens = max(m["tokens"] for m in memory["memory"])
    mem = {(_preset_of(m["spec"]) or m["spec"]): m for m in memory["memory"] if m["tokens"] == tokens}
    runs = latency["model_runs"]
    context = max(r["context"] for r in runs)
    ms = {(_preset_of(r["cache"]) or r["cache"]): r["decode_ms_stats"]["median"] for r in runs if r["context"] == context}
    mlx4 = next(r["cache"] for r in runs if r["kind"] == "mlx" and r["bits"] == 4)
    mlx_ppl = next(r for r in quality["rows"] if r["kind"] == "mlx")
    lines = [
        f"| cache | KV size vs fp16 ({tokens} tokens) | held-out perplexity vs fp (KL) | decode speed vs fp "
        f"({context} tokens) | decode speed vs mlx-lm 4-bit |",
        "|---|---:|---:|---:|---:|",
    ]

    def speed(name, ref):
        return f"{ms[ref] / ms[name]:.2f}x"

    for p in PRESETS:
        q = rows[p]
        lines.append(f"| `{p}` | {mem[p]['fp16_model_bytes'] / mem[p]['fp16_bytes']:.2f}x | "
                     f"{100 * q['ppl_delta']:+.2f}% ({q['kl']:.4f}) | {speed(p, 'fp')} | {speed(p, mlx4)} |")
    m = mem.get("mlx:4")
    lines.append(f"| mlx-lm `QuantizedKVCache` 4-bit | {m['fp16_model_bytes'] / m['fp16_bytes']:.2f}x | "
                 f"{100 * mlx_ppl['ppl_delta']:+.2f}% ({mlx_ppl['kl']:.4f}) | {speed(mlx4, 'fp')} | 1.00x |")
    return "\n".join(lines)


def spread_table(results: list[dict], names: list[str]) -> str:
    """One row per fidelity file: the mean and range of its caches' perplexity change and KL
    (fp left out), as over the rotation seeds of one configuration."""
    lines = ["| file | caches | ppl vs fp: mean (range) | KL: mean (range) |", "|---|---:|---|---|"]
    for name, result in zip(names, results):
        if kind_of(result) != "fidelity":
            raise ValueError(f"the spread view takes fidelity_sweep.py files, not {name}")
        rows = [r for r in result["rows"] if r["kind"] != "fp"]
        ppl = [100 * r["ppl_delta"] for r in rows]
        kl = [r["kl"] for r in rows]
        lines.append(f"| `{Path(name).name}` | {len(rows)} | {sum(ppl) / len(ppl):+.2f}% ({min(ppl):+.2f}% to "
                     f"{max(ppl):+.2f}%) | {sum(kl) / len(kl):.4f} ({min(kl):.4f}-{max(kl):.4f}) |")
    return "\n".join(lines)


def render(args: list[str], base: Path) -> str:
    """The table a marker's arguments ask for; files relative to ``base``."""
    view = None
    if args and not args[0].endswith(".json"):
        view, args = args[0], args[1:]
    if not args:
        raise ValueError("a table marker names at least one JSON file")
    results = [load(base / a) for a in args]
    if view == "summary":
        by_kind = {kind_of(r): r for r in results}
        return summary_table(by_kind["fidelity"], by_kind["latency"], by_kind["server"])
    if view == "spread":
        return spread_table(results, args)
    if len(results) != 1:
        raise ValueError(f"only the summary and spread views take several files, got {' '.join(args)}")
    result = results[0]
    kind = kind_of(result)
    if kind == "latency":
        return latency_table(result, view or "model")
    if kind == "needle" and view is not None and view.startswith("caches="):
        return needle_table(result, split_spec_list(view[len("caches="):]))
    if view is not None:
        raise ValueError(f"a {kind} file has no view {view!r}")
    return {"fidelity": fidelity_table, "quality": quality_table, "needle": needle_table, "server": server_table,
            "sharded": sharded_table, "rotation_fold": rotation.fold_table,
            "rotation_errors": rotation.errors_table, "codebook_errors": codebook.errors_table}[kind](result)


def rewrite(text: str, base: Path) -> tuple[str, list[str]]:
    """``text`` with every table regenerated, and the markers whose table changed."""
    stale = []

    def one(m):
        args = m.group("args").split()
        body = render(args, base) + "\n"
        if body != m.group("body"):
            stale.append(m.group("args"))
        return f"<!-- table: {m.group('args')} -->\n{body}<!-- end table -->"

    return MARKER.sub(one, text), stale


def markdown_files(root: Path) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def update(root, *, check: bool = False) -> list[str]:
    """Regenerate every table of README.md and docs/*.md under ``root``; returns
    ``"FILE: MARKER"`` for each table whose text changed (with ``check``, nothing
    is written)."""
    root = Path(root).resolve()
    stale_all = []
    for path in markdown_files(root):
        if not path.exists():
            continue
        new, stale = rewrite(path.read_text(encoding="utf-8"), path.parent)
        stale_all += [f"{path.relative_to(root)}: {s}" for s in stale]
        if stale and not check:
            path.write_text(new, encoding="utf-8")
    return stale_all


def main(argv=None, root=None) -> int:
    """Rewrite the tables (``--check``: exit 1 naming the stale ones instead)."""
    import argparse

    p = argparse.ArgumentParser(prog="docs_tables", description="Rewrite the measured tables of README.md and docs/.")
    p.add_argument("--check", action="store_true", help="rewrite nothing; exit 1 naming every stale table")
    p.add_argument("--root", default=None, help="the repository root (default: the current folder)")
    args = p.parse_args(argv)
    stale = update(args.root or root or ".", check=args.check)
    for s in stale:
        print(("stale table " if args.check else "rewrote table ") + s)
    return 1 if (args.check and stale) else 0
