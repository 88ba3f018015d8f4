"""``oiq-generate``: mlx-lm text generation with an OIQ-quantized KV cache.

Every input a user can get wrong (options, model name, files, standard input)
ends in one ``oiq-generate: error: ...`` line and exit status 2, never a
traceback; warnings print as one plain line.  The OIQ options and the model
loading here are shared with ``oiq-cache-prompt`` (:mod:`oiq_mlx.cli.cache_prompt`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import mlx.core as mx
from mlx_lm import stream_generate
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler

from ..cache.batch import BatchOIQKVCache
from ..cache.sequence import OIQKVCache
from ..mlx_lm.calibrate import calibrate_layer_bits, parse_auto
from ..core.config import layer_bits_text
from ..mlx_lm.sharding import ShardedRun, check_layout
from ..mlx_lm.sharding import add_arguments as add_sharding_arguments
from ..mlx_lm.caches import model_head_dim, oiq_layer_indices
from ..mlx_lm.routing import install
from ..mlx_lm.models import resolve_model
from ..mlx_lm.prompt_files import load_cache_file
from .options import (DEFAULT_MODEL, ArgumentParser, HelpFormatter, UsageError, add_model_options, add_oiq_options, build_cache,
                      cache_label, check_no_oiq, config_from_args, count_arg, exit_process, load_from_args, memory_line, oiq_options_given,
                      positive_arg, preset_label, probability_arg, read_prompt, run, seed_arg, temperature_arg,
                      top_p_arg)

# how long a rank > 0 waits before it exits on an input error, so that rank 0 reports it
RANK_GRACE_S = 2.0


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="oiq-generate",
        description=(
            "Generate text with an mlx-lm model whose KV cache is stored at 1-8 bits by OIQ "
            "(randomized Hadamard rotation + per-group scales). Mirrors `mlx_lm.generate`; "
            "after generating it prints prompt and generation speed and the KV cache size held "
            "against what float16 keys and values of the same tokens would take."
        ),
        formatter_class=HelpFormatter,
    )
    g = p.add_argument_group("model and prompt")
    add_model_options(g, f"the model a --prompt-cache-file was made with, else '{DEFAULT_MODEL}'")
    g.add_argument("--prompt", "-p", default="Write a short story about a lighthouse keeper.",
                   help="the prompt; '-' reads it from standard input (UTF-8)")
    g.add_argument("--system-prompt", default=None, help="system message for the chat template")
    g.add_argument("--ignore-chat-template", action="store_true", help="feed the prompt as raw text")
    g.add_argument("--max-tokens", "-m", type=positive_arg, default=256, help="maximum number of tokens to generate")
    g.add_argument("--prompt-cache-file", default=None,
                   help="a prompt cache saved by oiq-cache-prompt: its prompt (a long document) is the "
                   "prefix and --prompt continues it; the cache's own OIQ configuration is used")
    s = p.add_argument_group("sampling")
    s.add_argument("--temp", type=temperature_arg, default=0.0, help="sampling temperature, >= 0 (0 = greedy)")
    s.add_argument("--top-p", type=top_p_arg, default=1.0, help="nucleus sampling threshold, in (0, 1]")
    s.add_argument("--top-k", type=count_arg, default=0, help="sample from the k most likely tokens (0 = off)")
    s.add_argument("--min-p", type=probability_arg, default=0.0,
                   help="minimum probability relative to the top token, in [0, 1]")
    s.add_argument("--seed", type=seed_arg, default=None, help="random seed for sampling, >= 0")
    add_oiq_options(p)
    p.add_argument("--quiet", action="store_true", help="print only the generated text")
    add_sharding_arguments(p)  # --sharding, for runs under mlx.launch
    return p


def _load_cache_file(path: str):
    install()  # registers OIQKVCache with mlx-lm's loader
    if not os.path.isfile(path):
        raise UsageError(f"prompt cache file not found: {path}")
    try:
        # every part of the file checked (class list, scalars, each layer's state): a ValueError
        cache, metadata = load_cache_file(path, return_metadata=True)
    except (OSError, ValueError) as e:
        raise UsageError(f"cannot load prompt cache {path}: {e}") from None
    if any(isinstance(c, BatchOIQKVCache) for c in cache):
        raise UsageError(f"cannot load prompt cache {path}: it holds a batch of sequences (BatchOIQKVCache); "
                         "oiq-generate continues one sequence's cache (oiq-cache-prompt writes one)")
    return cache, metadata


def _check_cache_config(args, cache):
    """The cache file decides the cache kind; options that say otherwise are an error (as in mlx_lm.generate)."""
    try:
        check_no_oiq(args)
    except ValueError as e:
        raise UsageError(str(e)) from None
    stored = [c.config for c in cache if isinstance(c, OIQKVCache)]
    given = oiq_options_given(args)
    if args.no_oiq and stored:
        raise UsageError("--no-oiq does not match the OIQ cache loaded from --prompt-cache-file")
    if given and not args.no_oiq:
        if not stored:
            raise UsageError(f"{' '.join(given)}: the cache loaded from --prompt-cache-file is not an OIQ cache")
        try:
            wanted = config_from_args(args)
        except ValueError as e:
            raise UsageError(str(e)) from None
        if wanted != stored[0]:
            # name the fields that differ (a preset that changed since the file was written shows here)
            diff = "; ".join(f"{f.name} {getattr(stored[0], f.name)!r} in the file, {getattr(wanted, f.name)!r} asked"
                             for f in dataclasses.fields(wanted) if getattr(wanted, f.name) != getattr(stored[0], f.name))
            raise UsageError(
                f"the OIQ options ({' '.join(given)}) do not match the cache loaded from --prompt-cache-file: "
                f"{diff} (leave them out to use the file's configuration)"
            )


def _prompt_tokens(tokenizer, args, prompt: str, cached: bool) -> list[int]:
    """Token ids of the prompt as mlx_lm.generate builds them; with a cached
    prefix, only the part of the chat-formatted prompt after the user's text starts."""
    use_chat_template = not args.ignore_chat_template and tokenizer.has_chat_template
    if not use_chat_template:
        # a cached prefix already starts with BOS
        return tokenizer.encode(prompt, add_special_tokens=not cached)
    messages = [{"role": "system", "content": args.system_prompt}] if args.system_prompt else []
    messages.append({"role": "user", "content": prompt})
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if cached:
        messages[-1]["content"] = "<query>"
        probe = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        text = text[probe.index("<query>"):]
    return tokenizer.encode(text, add_special_tokens=False)


def _shard(shard_run, model, name: str):
    """Shard ``model`` over the launched ranks (None, doing nothing, for one process); UsageError
    when the model cannot be sharded that way."""
    if shard_run is None:
        return None
    try:
        return shard_run.shard(model, name=name)
    except ValueError as e:
        raise UsageError(str(e)) from None


def _calibrate(model, tokens, config, budget, *, quiet: bool):
    """``config`` with layer_bits calibrated on the prompt ``tokens``; the choice on stderr."""
    try:
        calibrated = calibrate_layer_bits(model, tokens, config, budget=budget)
    except ValueError as e:
        raise UsageError(f"--layer-bits auto: {e}") from None
    if not quiet:
        head_dim, layers = model_head_dim(model), oiq_layer_indices(model)
        chosen = layer_bits_text(calibrated.layer_bits) or "none (uniform)"
        limit = config.bytes_per_token(head_dim) if budget is None else budget
        print(f"layer bits calibrated on the {len(tokens)} prompt tokens: {chosen}; "
              f"{calibrated.bytes_per_token(head_dim, layers):g} bytes/token/KV head (budget {limit:g})",
              file=sys.stderr)
    return calibrated


def _main(argv) -> int:
    args = build_parser().parse_args(argv)
    prompt = read_prompt(args.prompt)
    if not prompt:
        raise UsageError("the prompt is empty")

    # one process: None; under mlx.launch the model is sharded and ranks > 0 print nothing
    shard_run = ShardedRun.from_launch(args.sharding)
    try:
        return _generate(args, prompt, shard_run)
    except UsageError:
        if shard_run is not None and shard_run.rank != 0:
            # rank 0 says what every rank says; a rank that exits first makes mlx.launch stop
            # rank 0, maybe before its error line is out
            time.sleep(RANK_GRACE_S)
        raise


def _generate(args, prompt: str, shard_run) -> int:
    if args.prompt_cache_file is not None:
        cache, metadata = _load_cache_file(args.prompt_cache_file)
        _check_cache_config(args, cache)
        stored_model = metadata.get("model")
        name = args.model or stored_model or DEFAULT_MODEL
        if args.model is not None and stored_model is not None:
            try:
                same = resolve_model(args.model) == resolve_model(stored_model)
            except (OSError, ValueError) as e:
                raise UsageError(str(e)) from None
            if not same:
                raise UsageError(
                    f"--model {args.model} is not the model the prompt cache was made with ({stored_model})"
                )
        model, tokenizer = load_from_args(args, name)
        layout = _shard(shard_run, model, name)
        try:
            check_layout(cache, layout, source=args.prompt_cache_file)
        except ValueError as e:
            raise UsageError(str(e)) from None
        n_layers = len(make_prompt_cache(model))
        if len(cache) != n_layers:
            raise UsageError(f"the prompt cache has {len(cache)} layers, the model {name} {n_layers}")
    else:
        try:
            auto, budget = parse_auto(args.layer_bits)
        except ValueError as e:
            raise UsageError(str(e)) from None
        if auto and args.no_oiq:
            raise UsageError("--layer-bits auto does not apply with --no-oiq")
        try:
            config = config_from_args(args, allow_auto=True)
        except ValueError as e:
            raise UsageError(str(e)) from None
        if auto and shard_run is not None:
            raise UsageError("--layer-bits auto does not support --sharding (give the layers explicitly)")
        model, tokenizer = load_from_args(args, args.model or DEFAULT_MODEL)
        if auto:
            cache = None  # built below, once the prompt tokens are known
        elif _shard(shard_run, model, args.model or DEFAULT_MODEL) is None:
            cache = build_cache(model, config)
        else:
            try:
                cache = shard_run.make_cache(model, config)
            except ValueError as e:
                raise UsageError(str(e)) from None

    if shard_run is not None:
        shard_run.seed(args.seed)  # every rank must sample the same token
    elif args.seed is not None:
        mx.random.seed(args.seed)
    tokens = _prompt_tokens(tokenizer, args, prompt, cached=args.prompt_cache_file is not None)
    if cache is None:
        config = _calibrate(model, tokens, config, budget, quiet=args.quiet)
        cache = build_cache(model, config)
    sampler = make_sampler(temp=args.temp, top_p=args.top_p, min_p=args.min_p, top_k=args.top_k)
    response = None
    for response in stream_generate(
        model, tokenizer, tokens, max_tokens=args.max_tokens, sampler=sampler, prompt_cache=cache
    ):
        print(response.text, end="", flush=True)
    print()
    if not args.quiet and response is not None:
        print("=" * 10, file=sys.stderr)
        print(f"Prompt: {response.prompt_tokens} tokens, {response.prompt_tps:.1f} tokens-per-sec", file=sys.stderr)
        print(f"Generation: {response.generation_tokens} tokens, {response.generation_tps:.1f} tokens-per-sec",
              file=sys.stderr)
        print(f"Peak memory: {response.peak_memory:.3f} GB", file=sys.stderr)
        label = cache_label(cache) + preset_label(args)
        print(memory_line(cache, label), file=sys.stderr)
        if shard_run is not None:
            shard_run.print_kv_bytes(cache)
    return 0


def main(argv=None) -> int:
    return run("oiq-generate", _main, argv)


def console_main() -> None:
    """The ``oiq-generate`` console script: :func:`main` on the command line, then
    :func:`~oiq_mlx.cli.options.exit_process`."""
    exit_process(main())


if __name__ == "__main__":
    console_main()
