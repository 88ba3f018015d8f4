"""oiq_mlx: a 2-8 bit KV cache for mlx-lm, by Orthogonal Invariance Quantization.

Every key and value head vector is rotated by a sign-randomized Walsh-Hadamard transform,
quantized per group with one float16 scale, and packed into uint32 words; attention rotates the
query instead of un-rotating keys.

The everyday API (``__all__``):

- ``OIQConfig``, ``OIQConfig.preset("4bit" | "3bit" | "2bit" | "2bit-ppl" | "1.5bit")``: the cache configuration;
- ``make_oiq_cache(model, config)``: a prompt-cache list for ``mlx_lm.generate``;
- ``OIQKVCache``, ``BatchOIQKVCache``: the cache classes (one sequence, a batch);
- ``end_prefill(cache)``, ``kv_memory(cache)``: pack a held prompt now; bytes held vs float16;
- ``save_prompt_cache``, ``load_prompt_cache``: mlx-lm's ``save_prompt_cache`` (a decoding batch
  unstacked first), and its ``load_prompt_cache`` with the file checked first (class list, scalars, layer count:
  ``oiq_mlx.mlx_lm.prompt_files``); mlx-lm's own loader also reads OIQ caches once ``oiq_mlx``
  is imported;
- ``load``, ``load_model``, ``resolve_model``, ``demo_model_path``, ``gemma3_model_path``,
  ``default_text``: models (GGUF offline) and the bundled text;
- ``install()``: route mlx-lm's attention to OIQ caches (done on import).

Everything else lives in its layer: ``oiq_mlx.core`` (rotation, codec, config), ``oiq_mlx.kernels``
(Metal), ``oiq_mlx.cache``, ``oiq_mlx.mlx_lm`` (what touches mlx-lm), ``oiq_mlx.eval``,
``oiq_mlx.bench``, ``oiq_mlx.cli``.
"""

# first of all MLX users: on Linux this loads OpenBLAS before mlx.core (DESIGN.md)
from .core.platform import preload_openblas

preload_openblas()


from .cache import BatchOIQKVCache, OIQKVCache  # noqa: E402
from .core.config import OIQConfig  # noqa: E402
from .core.version import __version__  # noqa: E402
from .mlx_lm.caches import end_prefill, kv_memory, make_oiq_cache  # noqa: E402
from .mlx_lm.prompt_files import load_cache_file as load_prompt_cache  # noqa: E402
from .mlx_lm.prompt_files import save_cache_file as save_prompt_cache  # noqa: E402
from .mlx_lm.models import default_text, demo_model_path, gemma3_model_path, load, load_model, resolve_model  # noqa: E402
from .mlx_lm.routing import install  # noqa: E402

# load_prompt_cache must find OIQKVCache, and hand-built OIQ caches must reach OIQ attention,
# without the user calling anything first
install()

__all__ = [
    "BatchOIQKVCache",
    "OIQConfig",
    "OIQKVCache",
    "__version__",
    "default_text",
    "demo_model_path",
    "end_prefill",
    "gemma3_model_path",
    "install",
    "kv_memory",
    "load",
    "load_model",
    "load_prompt_cache",
    "make_oiq_cache",
    "resolve_model",
    "save_prompt_cache",
]
