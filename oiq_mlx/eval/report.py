"""Reports of evaluation results: :func:`needle_stats_markdown` (a :func:`needle_stats
<oiq_mlx.eval.needle_stats.needle_stats>` result), :func:`markdown_table` and :func:`save_plots`
(a :func:`run_evaluation <oiq_mlx.eval.quality.run_evaluation>` result)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np


def _fmt_rate(r: dict) -> str:
    if not r["n"]:
        return "-"
    return f"{r['hits']}/{r['n']} ({r['rate']:.0%}, {r['ci'][0]:.0%}-{r['ci'][1]:.0%})"


def needle_stats_markdown(result: dict) -> str:
    """Retrieval per cache and length with 95% Wilson intervals, the paired
    comparison against the reference, and every discordant trial."""
    names, summary = result["caches"], result["summary"]
    ref = names[0]
    lengths = [str(L) for L in result["lengths"]]
    only = result.get("only")
    lines = [
        f"{result['completed']}/{result['planned']} trials ({result['trials_per_cell']} per length x depth, "
        f"depths {result['depths']}, texts {', '.join(result['texts'])}); hits/trials (rate, 95% Wilson interval)",
        *([f"this run: only trials {', '.join(f'#{i}' for i in only)}"] if only else []),
        "",
        "| cache | " + " | ".join(lengths) + " | all | " + f"{ref}-hits missed | hits {ref} missed | McNemar p "
        f"| margin drop vs {ref} |",
        "|---|" + "---|" * (len(lengths) + 5),
    ]
    for n in names:
        s = summary[n]
        cells = [_fmt_rate(s["by_length"][L]) if L in s["by_length"] else "-" for L in lengths]
        if "paired" in s:
            p = s["paired"]
            ci = p["missed_of_ref_ci"]
            missed = f"{p['ref_only']}/{p['both'] + p['ref_only']} (95% <= {ci[1]:.0%})"
            m = s["margin_drop"]
            drop = "-" if m is None else f"{m['mean']:+.2f}" + ("" if m["se"] is None else f" ± {m['se']:.2f}")
            extra = [missed, str(p["other_only"]), f"{p['mcnemar_p']:.3g}", drop]
        else:
            extra = ["-", "-", "-", "-"]
        lines.append(f"| {n} | " + " | ".join(cells) + f" | {_fmt_rate(s['all'])} | " + " | ".join(extra) + " |")
    lines += ["", "margin: the smallest log-probability gap between the chosen answer token and the runner-up over "
              f"a trial's answer; margin drop: its mean decrease against {ref} (± standard error) on trials both "
              "retrieve.", *_first_margin_lines(names, summary, ref), *_noise_lines(names, summary, ref),
              *_attribution_lines(names, summary, ref),
              "", "by depth (all lengths): " + "; ".join(
        f"{n}: " + ", ".join(f"{float(d):.2f} {r['hits']}/{r['n']}" for d, r in summary[n]["by_depth"].items())
        for n in names)]
    discordant = [r for r in result["records"] if len({bool(v["hit"]) for v in r["results"].values()}) > 1]
    if discordant:
        lines += ["", "trials where the caches disagree:", ""]
        for r in discordant:
            answers = "; ".join(f"{n} {'+' if v['hit'] else '-'} {v['answer'].strip()[:24]!r} "
                                f"(margin {min(v['margins']):.2f})" for n, v in r["results"].items())
            lines.append(f"- #{r['index']} len {r['length']} depth {r['actual_depth']:.2f} {r['text']}@{r['offset']} "
                         f"key {r['passkey']}: {answers}{_coin_flip_note(r, summary, ref)}")
    return "\n".join(lines)


def _first_margin_lines(names, summary, ref) -> list:
    parts = [f"{n} {c['mean']:+.2f} ± {c['sd']:.2f} (n = {c['n']})" for n in names
             if (c := summary[n].get("first_margin_change")) and c["sd"] is not None]
    if not parts:
        return []
    return ["", f"first answer token's margin, change against {ref} on trials both retrieve (mean ± standard "
            "deviation): " + "; ".join(parts) + f". A miss of a trial {ref} retrieves with a first-token margin "
            "within one such deviation is marked a coin flip: the cache's usual noise decides it."]


def _noise_lines(names, summary, ref) -> list:
    parts = []
    for n in names:
        c = summary[n].get("margin_noise")
        if not c:
            continue
        narrow = ", ".join(f"#{i} {m:.2f}" for i, m in c["narrowest_ref_hits"])
        parts.append(f"{n}: rms {c['rms']:.3f} (mean {c['mean']:+.3f}) over {c['tokens']} tokens, "
                     f"{c['expected_misses']:.2f} expected misses of {c['ref_hits']}, no miss with probability "
                     f"{c['p_no_miss']:.0%} ({c['p_target']:.0%} needs rms <= {c['rms_for_target']:.3f}; "
                     f"{ref}'s narrowest hits: {narrow})")
    if not parts:
        return []
    return ["", f"margin noise (each answer token's margin minus {ref}'s, on trials with the same answer; a "
            f"{ref} hit is lost when a token's margin crosses zero, each change taken as an independent normal "
            "of mean zero and that root mean square): " + "; ".join(parts) + "."]


def _attribution_lines(names, summary, ref) -> list:
    lines = []
    for n in names:
        a = summary[n].get("attribution")
        if a is None:
            continue
        sd = lambda p: "" if a[p]["sd"] is None else f" ± {a[p]['sd']:.2f}"  # noqa: E731
        part = lambda p: f"{a[p]['mean']:+.2f}{sd(p)} ({a[p]['hits']}/{a['n']} retrieved)"  # noqa: E731
        lines.append(f"{n}, where the first answer token's margin goes ({a['n']} trials {ref} retrieves; change "
                     f"against {ref}, mean ± sd, negative when the first token is another): the cache "
                     f"{part('full')}; reading it after {ref}'s prefill {part('read')}; its prefill's keys and "
                     f"values read exactly {part('prefill')}.")
        by = a.get("by_depth", {})
        if len(by) > 1:
            lines.append("  by depth (cache / read / prefill, mean change, retrieved of n): " + "; ".join(
                f"{float(d):.2f}: " + " / ".join(f"{b[p]['mean']:+.2f} {b[p]['hits']}" for p in ("full", "read", "prefill"))
                + f" of {b['n']}" for d, b in by.items()))
    return ["", *lines] if lines else []


def _coin_flip_note(record, summary, ref) -> str:
    """For a trial ``ref`` retrieves and some cache misses: ``ref``'s first-token
    margin in units of each missing cache's first-token margin spread, and ``ref``'s
    narrowest answer margin in units of that cache's margin noise (a digit lost later in
    the answer is judged by the second)."""
    r = record["results"]
    if ref not in r or not r[ref]["hit"]:
        return ""
    m, narrowest = r[ref]["margins"][0], min(r[ref]["margins"])
    notes = []
    for n, v in r.items():
        if n == ref or v["hit"]:
            continue
        entry = summary.get(n, {})
        c, noise = entry.get("first_margin_change"), entry.get("margin_noise")
        if c and c["sd"]:
            z = m / c["sd"]
            notes.append(f"{ref}'s first-token margin {m:.3f} = {z:.2f} sd of {n}'s" + (", a coin flip" if z < 1 else ""))
        if noise and noise["rms"]:
            notes.append(f"{ref}'s narrowest answer margin {narrowest:.3f} = {narrowest / noise['rms']:.2f} rms of "
                         f"{n}'s margin noise")
    return f" [{'; '.join(notes)}]" if notes else ""


def markdown_table(result: dict) -> str:
    """One row per cache: bytes, perplexity, KL, top-1, fidelity, needle."""
    ppl = result.get("perplexity", {})
    fid = result.get("fidelity", {})
    needle = result.get("needle", {})
    bpt = result["bytes_per_token_head"]
    base = ppl.get("fp", {}).get("ppl")
    head = ["cache", "B/tok/head", "nbytes/tok/head (fp16)", "nbytes/tok/head", "ppl", "Δppl",
            "KL (nats)", "top-1", "attn cos", "K rel err", "V rel err", "needle"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for spec in result["caches"]:
        n = spec["name"]
        p, f = ppl.get(n), fid.get(n)
        g = needle.get("grid", {}).get(n)
        cells = [
            n,
            f"{bpt[n]['asymptotic']:.1f}",
            f"{p['fp16_bytes_per_token_head']:.1f}" if p else "-",
            f"{p['measured_bytes_per_token_head']:.0f}" if p else "-",
            f"{p['ppl']:.2f}" if p else "-",
            (f"{100 * (p['ppl'] / base - 1):+.1f}%" if p and base else "-"),
            f"{p['kl']:.4f}" if p else "-",
            f"{100 * p['top1']:.1f}%" if p else "-",
            f"{f['cos_mean']:.4f}" if f else "-",
            f"{f['k_rel_err']:.3f}" if f else "-",
            f"{f['v_rel_err']:.3f}" if f else "-",
            f"{int(np.sum(g))}/{int(np.size(g))}" if g is not None else "-",
        ]
        rows.append("| " + " | ".join(cells) + " |")
    lines = rows + [
        "",
        ("B/tok/head: bytes per token per KV head, K+V, of the quantized storage (every float counted as fp16). "
         "nbytes/tok/head: allocated nbytes (capacity, sinks, window, reserve and means included) / (tokens x "
         "layers x KV heads) at the end of the perplexity run, with float16 keys and values (as a float16 model "
         "on a Mac) and as run here (the model's dtype on this machine)."),
    ]
    k = result.get("key_outliers")
    if k:
        lines += ["", "| keys | kurtosis | max/median channel | Gini of channel energy |", "|---|---|---|---|"]
        for label in ("before", "rotated", "rotated_nosigns"):
            lines.append(f"| {label} | {k[label]['kurtosis']:.2f} | {k[label]['max_median']:.2f} | {k[label]['gini']:.3f} |")
    if needle:
        lines += ["", f"needle grid (rows: length, columns: depth {needle['depths']}; 1 = exact passkey)"]
        for n, g in needle["grid"].items():
            cells = "; ".join(f"{L}: {''.join(str(x) for x in row)}" for L, row in zip(needle["lengths"], g))
            lines.append(f"- {n}: {cells}")
    return "\n".join(lines)


def save_plots(result: dict, out_dir) -> list[str]:
    """Frontier (KL and perplexity vs bytes per token) and needle heatmaps as
    PNG files in ``out_dir``; returns the paths, or [] when matplotlib is
    missing (a message goes to stderr)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots", file=sys.stderr)
        return []
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    ppl = result.get("perplexity")
    if ppl:
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        for ax, metric, label in ((axes[0], "ppl", "perplexity"), (axes[1], "kl", "KL(fp || cache), nats")):
            for n, r in ppl.items():
                x = result["bytes_per_token_head"][n]["asymptotic"]
                y = max(r[metric], 1e-6) if metric == "kl" else r[metric]
                kind = next(c["kind"] for c in result["caches"] if c["name"] == n)
                ax.scatter([x], [y], marker={"fp": "*", "mlx": "s", "oiq": "o"}[kind], s=50)
                ax.annotate(n, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
            ax.set_xlabel("bytes per token per KV head (K+V, fp16-equivalent, asymptotic)")
            ax.set_ylabel(label)
            ax.set_xscale("log", base=2)
            if metric == "kl":
                ax.set_yscale("log")
            ax.grid(alpha=0.3)
        fig.suptitle(f"{result['model']['name']}: quality vs cache size")
        fig.tight_layout()
        p = out_dir / "frontier.png"
        fig.savefig(p, dpi=120)
        plt.close(fig)
        paths.append(str(p))
    needle = result.get("needle")
    if needle:
        names = list(needle["grid"])
        fig, axes = plt.subplots(1, len(names), figsize=(2.2 + 2.2 * len(names), 2.5 + 0.3 * len(needle["lengths"])), squeeze=False)
        for ax, n in zip(axes[0], names):
            ax.imshow(np.array(needle["grid"][n]), cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
            ax.set_xticks(range(len(needle["depths"])), [f"{d:.0%}" for d in needle["depths"]], fontsize=7)
            ax.set_yticks(range(len(needle["lengths"])), [str(L) for L in needle["lengths"]], fontsize=7)
            ax.set_title(n, fontsize=9)
            ax.set_xlabel("depth", fontsize=8)
        axes[0][0].set_ylabel("prompt tokens")
        fig.tight_layout()
        p = out_dir / "needle.png"
        fig.savefig(p, dpi=120)
        plt.close(fig)
        paths.append(str(p))
    return paths
