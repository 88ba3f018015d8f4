"""``oiq-server``: the command line of mlx-lm's OpenAI-compatible server with OIQ KV caches
(:mod:`oiq_mlx.mlx_lm.server` holds the hooks into ``mlx_lm.server``)."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from ..core.config import OIQConfig
from ..mlx_lm.server import serve
from .options import ArgumentParser, add_oiq_options, config_from_args, exit_process


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="oiq-server",
        description=(
            "mlx-lm's OpenAI-compatible HTTP server (mlx_lm.server) with every sequence's KV cache "
            "stored by OIQ, continuous batching kept on. Every mlx_lm.server flag is accepted "
            "(--model, --host, --port, --max-tokens, --decode-concurrency, --prompt-cache-size, ...; "
            "see `mlx_lm.server --help`); --model also takes 'demo', 'gemma3' and .gguf files."
        ),
    )
    add_oiq_options(p)
    p.add_argument("--dequantize-weights", choices=["auto", "yes", "no"], default="auto",
                   help="GGUF only: dequantize weights to float32 (auto: on the CPU backend)")
    p.add_argument("--keep-checkpoints", action="store_true",
                   help="keep the prompt checkpoints mlx-lm saves (end of the system prompt, of the user turn) "
                        "beside the finished chat, so that a request leaving a cached chat before its last "
                        "tokens (an edited or regenerated message, another chat on the same system prompt, "
                        "a template that re-renders the reply) continues exactly as a fresh server would; "
                        "costs the checkpoint's own window (about 0.05x fp16 more per chat at 2k tokens). "
                        "Default: one entry per chat, as mlx-lm keeps full-precision caches, and such a "
                        "request continues from the chat trimmed back, reading the window rows before the "
                        "cut packed")
    return p


def server_config(args) -> OIQConfig | None:
    """The OIQ configuration the server's options ask for (None: ``--no-oiq``).  As
    ``oiq-generate``'s, except that ``positional`` is on unless ``--no-positional``: the
    prompt cache reuses prefixes, which give what a fresh cache gives only then.
    ``exact_prefill`` contradicts that (it makes what is stored depend on the chunks), so
    it has no effect on positional caches, and asking for it without ``--no-positional`` is
    an error."""
    config = config_from_args(args)
    if config is None:
        return None
    if args.positional is None:
        if args.exact_prefill:
            raise ValueError("--exact-prefill needs --no-positional: oiq-server's caches are positional, "
                             "whose prefix reuse rests on the chunks changing nothing")
        return dataclasses.replace(config, positional=True)
    return config


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args, rest = build_parser().parse_known_args(argv)
    try:
        config = server_config(args)
    except ValueError as e:
        print(f"oiq-server: error: {e}", file=sys.stderr)
        return 2
    if config is not None and any(a == "--kv-bits" or a.startswith("--kv-bits=") for a in rest):
        print("oiq-server: error: --kv-bits selects mlx-lm's own quantized cache; add --no-oiq to use it",
              file=sys.stderr)
        return 2
    if "--model" not in rest and not any(a.startswith("--model=") for a in rest):
        rest = ["--model", "demo", *rest]
    dequantize = {"auto": None, "yes": True, "no": False}[args.dequantize_weights]
    try:
        serve(rest, config, dequantize, keep_checkpoints=args.keep_checkpoints)
    except (ValueError, FileNotFoundError) as e:
        print(f"oiq-server: error: {e}", file=sys.stderr)
        return 2
    return 0


def console_main() -> None:
    """The ``oiq-server`` console script: :func:`main` on the command line, then
    :func:`~oiq_mlx.cli.options.exit_process`."""
    exit_process(main())


if __name__ == "__main__":
    console_main()
