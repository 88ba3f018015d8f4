"""Quality evaluation of KV caches on a real model: every measurement in one run.

Each measurement is against mlx-lm's plain ``KVCache`` at the model's dtype (the "fp"
reference; on the CPU backend the GGUF loader gives fp32, DESIGN.md section 7):
perplexity, KL and top-1 agreement (:func:`oiq_mlx.eval.perplexity.perplexity_eval`), attention
fidelity and key outliers (:mod:`oiq_mlx.eval.fidelity`), needle retrieval on a grid
(:func:`oiq_mlx.eval.needle.needle_eval`; with statistics: :mod:`oiq_mlx.eval.needle_stats`).

:func:`run_evaluation` runs them all for a list of :class:`CacheSpec` and returns one
JSON-serialisable dict; :func:`oiq_mlx.eval.report.markdown_table` and
:func:`oiq_mlx.eval.report.save_plots` render it.  ``scripts/eval_quality.py`` is the front end.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import time
from pathlib import Path

import mlx.core as mx
import mlx_lm

from ..core.config import OIQConfig
from ..core.platform import openblas_path
from ..core.version import __version__
from ..mlx_lm import models
from ..mlx_lm.caches import model_head_dim, oiq_layer_indices
from ..mlx_lm.routing import capture_attention_inputs, install
from .fidelity import attention_fidelity, key_outlier_stats
from .needle import needle_eval
from .perplexity import perplexity_eval
from .progress import Progress, fmt_s
from .specs import CacheSpec, parse_spec


DEFAULT_CACHES = (
    "fp", "mlx-q8-g64", "mlx-q4-g64", "mlx-q8-g32", "mlx-q4-g32", "absmax-4", "oiq-nosigns-4",
    "oiq-plain-4", "oiq-plain-3", "oiq-plain-2", "oiq-4", "oiq-3", "oiq-2",
)
FULL_NEEDLE_CACHES = ("fp", "mlx-q8-g64", "mlx-q4-g64", "absmax-4", "oiq-4", "oiq-3", "oiq-2")
QUICK_NEEDLE_CACHES = ("fp", "mlx-q4-g64", "oiq-4")


def select_caches(names) -> list[CacheSpec]:
    """Specs for ``names`` (anything :func:`oiq_mlx.eval.specs.parse_spec` reads), ``fp`` always first."""
    names = ["fp"] + [n for n in dict.fromkeys(names) if n != "fp"]
    return [parse_spec(n) for n in names]


@dataclasses.dataclass
class EvalSettings:
    """Everything a run depends on (stored verbatim in the JSON)."""

    model: str = "demo"
    text: str | None = None
    caches: tuple = DEFAULT_CACHES
    prompt_len: int = 256
    score_len: int = 768
    # one scored token per call, through the decode path, as generation runs; a
    # chunk of C lets its queries attend to the chunk's own tokens exactly
    # (OIQKVCache.attention_segments), which flatters windows smaller than C
    chunk: int = 1
    windows: int = 4
    needle_caches: tuple | None = FULL_NEEDLE_CACHES
    # 8000, not 8192: the prompt plus the answer stay inside SmolLM2's 8192 positions
    needle_lengths: tuple = (1024, 2048, 4096, 8000)
    needle_depths: tuple = (0.0, 0.25, 0.5, 0.75, 1.0)
    needle_chat: bool = True
    fidelity_tokens: int = 512
    seed: int = 0
    skip: tuple = ()


def quick_settings(**overrides) -> EvalSettings:
    """About 13 minutes on 2 CPU cores with SmolLM2 (see the script's --help)."""
    base = {
        "prompt_len": 256, "score_len": 256, "chunk": 1, "windows": 1, "needle_caches": QUICK_NEEDLE_CACHES,
        "needle_lengths": (512, 1024), "needle_depths": (0.0, 0.5, 1.0), "fidelity_tokens": 256,
    }
    base.update(overrides)
    return EvalSettings(**base)


def load_model(name: str):
    """``"demo"`` (SmolLM2-135M), ``"gemma3"`` (Gemma 3 270M), a ``.gguf`` path or
    an mlx-lm model id; returns ``(model, tokenizer, resolved_path)``."""
    path = models.resolve_model(name)
    model, tokenizer = models.load(path)
    return model, tokenizer, path


def load_text(path: str | None) -> str:
    if path is None:
        return models.default_text()
    return Path(path).read_text(encoding="utf-8")


def bundled_text(name: str) -> str:
    """The path of a text shipped in the package, ``oiq_mlx/data/austen_NAME.txt``, relative to
    the working directory (what a results file records as the command's setting)."""
    return os.path.relpath(Path(__file__).resolve().parents[1] / "data" / f"austen_{name}.txt")


def text_tokens(tokenizer, path: str | None, n: int | None = None) -> list[int]:
    """The token ids of the text at ``path`` (:func:`load_text`), its first ``n`` when given;
    ValueError naming the file when it has fewer."""
    ids = tokenizer.encode(load_text(path))
    if n is not None and len(ids) < n:
        raise ValueError(f"{path} has {len(ids)} tokens, fewer than the {n} asked for")
    return ids if n is None else ids[:n]


def environment() -> dict:
    metal = mx.metal.is_available()
    return {
        "oiq_mlx": __version__,
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "device": str(mx.default_device()),
        "metal": metal,
        "openblas": openblas_path,
        "cpu_count": os.cpu_count(),
    }


def run_evaluation(settings: EvalSettings, *, model=None, tokenizer=None, progress=None) -> dict:
    """Run every measurement ``settings`` asks for; returns a JSON-serialisable dict.

    ``model``/``tokenizer`` may be passed in (tests); otherwise
    ``settings.model`` is loaded with :func:`load_model`.  ``settings.skip``
    may hold ``"ppl"``, ``"needle"``, ``"fidelity"``.
    """
    progress = progress or Progress()
    t_start = time.perf_counter()
    model_path = None
    if model is None:
        progress(f"loading model {settings.model}")
        model, tokenizer, model_path = load_model(settings.model)
    install()
    head_dim = model_head_dim(model)
    skipped = {}

    def usable(names):
        keep = []
        for s in select_caches(names):
            why = s.supports(head_dim) if head_dim else None
            if why:
                skipped[s.name] = why
                progress(f"skipping {s.name}: {why}")
            else:
                keep.append(s)
        return keep

    specs = usable(settings.caches)
    text = load_text(settings.text)
    result = {
        "settings": dataclasses.asdict(settings),
        "model": {"name": settings.model, "path": model_path, "args": _model_args(model), "head_dim": head_dim},
        "environment": environment(),
        "caches": [s.to_dict() for s in specs],
        "skipped_caches": skipped,
        "bytes_per_token_head": {},
        "notes": [
            ("fp = mlx-lm KVCache at the model dtype; bytes are counted as fp16 (2 bytes per value) for it "
             "and for every scale/bias/mean/full-precision segment ('fp16-equivalent')."),
            "mlx-q* caches are quantized from token 0 (generate_step's quantized_kv_start=0).",
            "measured_bytes_per_token_head = sum of nbytes (allocated capacity, real dtypes) / (tokens x KV layers x KV heads); "
            "fp16_bytes_per_token_head = the same after the same calls with float16 keys and values "
            "(allocated_bytes_per_token).",
        ],
    }
    layers = oiq_layer_indices(model)
    for s in specs:
        result["bytes_per_token_head"][s.name] = {"asymptotic": s.bytes_per_token(head_dim, layers=layers)}
    tokens = tokenizer.encode(text)
    result["text"] = {"source": settings.text or "oiq_mlx default_text (Austen, Persuasion)", "tokens": len(tokens)}
    if "ppl" not in settings.skip:
        progress(f"perplexity: {len(specs)} caches, prompt {settings.prompt_len} + {settings.score_len} scored, "
                 f"chunks of {settings.chunk}, {settings.windows} window(s)")
        result["perplexity"] = perplexity_eval(model, tokens, specs, prompt_len=settings.prompt_len,
                                               score_len=settings.score_len, chunk=settings.chunk,
                                               windows=settings.windows, progress=progress)
    if "fidelity" not in settings.skip:
        progress(f"attention fidelity on {settings.fidelity_tokens} tokens")
        records = capture_attention_inputs(model, tokens[: settings.fidelity_tokens])
        result["fidelity"] = attention_fidelity(model, None, specs, records=records, progress=progress)
        result["key_outliers"] = key_outlier_stats(records, seed=OIQConfig().seed)
        k = result["key_outliers"]
        progress(f"key outliers: gini {k['before']['gini']:.3f} -> {k['rotated']['gini']:.3f}, "
                 f"kurtosis {k['before']['kurtosis']:.2f} -> {k['rotated']['kurtosis']:.2f}")
        del records
    if "needle" not in settings.skip:
        needle_specs = usable(settings.needle_caches) if settings.needle_caches else specs
        progress(f"needle: {len(needle_specs)} caches x lengths {list(settings.needle_lengths)} x depths {list(settings.needle_depths)}")
        result["needle"] = needle_eval(model, tokenizer, needle_specs, filler_text=text, lengths=settings.needle_lengths,
                                       depths=settings.needle_depths, chat=settings.needle_chat, seed=settings.seed,
                                       progress=progress)
    result["wall_seconds"] = time.perf_counter() - t_start
    progress(f"done in {fmt_s(result['wall_seconds'])}")
    return result


def _model_args(model) -> dict:
    args = getattr(model, "args", None)
    if args is None:
        return {}
    if dataclasses.is_dataclass(args):
        d = dataclasses.asdict(args)
    else:
        d = dict(vars(args))
    d.pop("layer_types", None)
    return {k: v for k, v in d.items() if isinstance(v, (int, float, str, bool, type(None), list))}
