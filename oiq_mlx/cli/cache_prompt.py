"""``oiq-cache-prompt``: save an OIQ prompt cache of a long prompt (a document) to a file.

Mirrors ``mlx_lm.cache_prompt``: the prompt goes in as an unfinished user
message of the chat template (or as raw text when the model has none), the
whole prompt is prefilled, and the cache is written with mlx-lm's
``save_prompt_cache`` with metadata ``model`` and ``tokenizer_config``.  Each
OIQ layer stores its ``OIQConfig`` in its own state, so the file loads back
with the configuration it was made with.  ``oiq-generate --prompt-cache-file``
then answers questions about the document.  OIQ options replace mlx-lm's
``--kv-bits``/``--kv-group-size``/``--quantized-kv-start``; ``--max-kv-size``,
adapters and remote code are not offered.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import save_prompt_cache

from .options import (
    DEFAULT_MODEL,
    ArgumentParser,
    HelpFormatter,
    UsageError,
    add_model_options,
    add_oiq_options,
    build_cache,
    cache_label,
    config_from_args,
    exit_process,
    load_from_args,
    memory_line,
    read_prompt,
    run,
)
from ..mlx_lm.caches import end_prefill


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="oiq-cache-prompt",
        description="Cache the state of a prompt (e.g. a long document) in an OIQ-quantized KV cache, "
        "to be reused with `oiq-generate --prompt-cache-file`. Mirrors `mlx_lm.cache_prompt`.",
        formatter_class=HelpFormatter,
    )
    g = p.add_argument_group("model and prompt")
    add_model_options(g, f"'{DEFAULT_MODEL}'")
    g.add_argument("--prompt-cache-file", required=True, help="the file to save the prompt cache in (.safetensors)")
    g.add_argument("--prompt", "-p", required=True,
                   help="the prompt to cache; '-' reads it from standard input (UTF-8)")
    add_oiq_options(p)
    return p


def _main(argv) -> int:
    args = build_parser().parse_args(argv)
    if not args.prompt_cache_file.endswith(".safetensors"):
        # mx.save_safetensors would append the suffix, and --prompt-cache-file would then miss the file
        raise UsageError(f"--prompt-cache-file must end in .safetensors, got {args.prompt_cache_file}")
    prompt = read_prompt(args.prompt)
    if not prompt:
        raise UsageError("the prompt is empty")
    try:
        config = config_from_args(args)
    except ValueError as e:
        raise UsageError(str(e)) from None
    name = args.model or DEFAULT_MODEL
    model, tokenizer = load_from_args(args, name)
    cache = build_cache(model, config)

    if tokenizer.has_chat_template:
        tokens = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=False, continue_final_message=True
        )
    else:
        tokens = tokenizer.encode(prompt)

    start = time.perf_counter()

    def progress(processed, total):
        speed = processed / max(time.perf_counter() - start, 1e-9)
        print(f"\rProcessed {processed:6d} of {total} tokens ({speed:6.2f} tok/s)", end="", file=sys.stderr, flush=True)

    for _ in generate_step(mx.array(tokens), model, max_tokens=0, prompt_cache=cache,
                           prompt_progress_callback=progress):
        pass
    print(file=sys.stderr)
    end_prefill(cache)  # exact_prefill: the file holds the prompt packed
    print(f"Peak memory: {mx.get_peak_memory() / 1e9:.3f} GB", file=sys.stderr)
    print(memory_line(cache, cache_label(cache)), file=sys.stderr)
    print(f"Saving {args.prompt_cache_file}", file=sys.stderr)
    save_prompt_cache(args.prompt_cache_file, cache, {"model": name, "tokenizer_config": json.dumps({})})
    return 0


def main(argv=None) -> int:
    return run("oiq-cache-prompt", _main, argv)


def console_main() -> None:
    """The ``oiq-cache-prompt`` console script: :func:`main` on the command line, then
    :func:`~oiq_mlx.cli.options.exit_process`."""
    exit_process(main())


if __name__ == "__main__":
    console_main()
