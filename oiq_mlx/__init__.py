"""oiq_mlx: 2-8 bit KV cache for mlx-lm with Orthogonal Invariance Quantization.

Every key and value head vector is rotated by a sign-randomized Walsh-Hadamard
transform, quantized per group with one float16 scale, and packed into uint32
words; attention rotates the query instead of un-rotating keys.
"""


from ._platform import preload_openblas  # noqa: E402

preload_openblas()

from .codec import (  # noqa: E402
    SUPPORTED_BITS,
    SUPPORTED_GROUP_SIZES,
    bytes_per_token,
    dequantize,
    pack_codes,
    quantize,
    unpack_codes,
)
from .rotation import hadamard_block_size, is_rotatable, random_signs, rotate, rotation_matrix, unrotate  # noqa: E402
from .config import OIQConfig  # noqa: E402
from .cache import OIQKVCache  # noqa: E402
from .attention import oiq_attention  # noqa: E402
from .integration import end_prefill, install, make_oiq_cache  # noqa: E402

# load_prompt_cache must find OIQKVCache, and hand-built OIQ caches must reach OIQ attention,
# without the user calling anything first
install()

from .models import default_text, demo_model_path, gemma3_model_path, load, load_model, resolve_model  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "OIQConfig",
    "OIQKVCache",
    "default_text",
    "end_prefill",
    "demo_model_path",
    "gemma3_model_path",
    "install",
    "load",
    "load_model",
    "resolve_model",
    "make_oiq_cache",
    "oiq_attention",
    "SUPPORTED_BITS",
    "SUPPORTED_GROUP_SIZES",
    "bytes_per_token",
    "dequantize",
    "hadamard_block_size",
    "is_rotatable",
    "pack_codes",
    "quantize",
    "random_signs",
    "rotate",
    "rotation_matrix",
    "unpack_codes",
    "unrotate",
]
