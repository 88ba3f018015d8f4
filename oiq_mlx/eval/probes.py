"""What the probe scripts share (``scripts/rotation_probe.py``, ``scripts/codebook_probe.py``): the
model and protocol options, the run, and the results file."""

from __future__ import annotations

import json
import os
import sys
import time

from .progress import Progress
from .quality import environment, load_model, text_tokens
from .sweep import key_bias_stand_in


def add_model_options(p) -> None:
    p.add_argument("--model", default="demo", help="demo (SmolLM2-135M), gemma3, a .gguf path or an mlx-lm id")
    p.add_argument("--key-bias", type=float, default=0.0, metavar="RATIO",
                   help="Qwen-like stand-in: a k_proj bias of RATIO x the median key-channel RMS (as fidelity_sweep.py)")


def add_protocol_options(p) -> None:
    """The perplexity protocol of ``ppl`` modes (``oiq_mlx.eval.sweep``), and the output options."""
    p.add_argument("--prompt", type=int, default=768, help="ppl: tokens prefilled per window (default 768)")
    p.add_argument("--scored", type=int, default=256, help="ppl: tokens scored per window (default 256)")
    p.add_argument("--chunk", type=int, default=1, help="ppl: tokens per call after the prompt (default 1)")
    p.add_argument("--windows", type=int, default=3, help="ppl: text windows (default 3)")
    p.add_argument("--json", metavar="PATH", help="write the settings and results as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")


def sweep_options(args, progress) -> dict:
    """``oiq_mlx.eval.sweep.sweep``'s protocol keywords from the parsed options."""
    return dict(prompt_len=args.prompt, score_len=args.scored, chunk=args.chunk, windows=args.windows,
                progress=progress)


def tokens_of(tokenizer, path: str, n: int | None = None) -> list[int]:
    """:func:`oiq_mlx.eval.quality.text_tokens`, ending the script with its message when the text
    is too short."""
    try:
        return text_tokens(tokenizer, path, n)
    except ValueError as e:
        sys.exit(str(e))


def run(args, script: str, mode, argv=None) -> dict:
    """Load the model (the key-bias stand-in when asked), run ``mode(args, model, tokenizer,
    progress)``, and write its result with the command and settings to ``--json``."""
    if args.json:  # fail (or create the folder) now, not after a long run
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    progress = Progress(enabled=not args.quiet)
    t0 = time.perf_counter()
    model, tokenizer, path = load_model(args.model)
    key_bias_stand_in(model, args.key_bias, progress)
    result = mode(args, model, tokenizer, progress)
    progress(f"done in {time.perf_counter() - t0:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": ["python", script, *(sys.argv[1:] if argv is None else argv)], "model": args.model,
                       "path": path, "settings": {k: v for k, v in vars(args).items() if k != "json"},
                       "environment": environment(), **result}, f, indent=1)
    return result
