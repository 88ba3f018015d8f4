"""Offline GGUF loader: a .gguf file -> mlx-lm's own model class + tokenizer.

Supported architectures (``general.architecture``): ``llama`` (Llama, SmolLM2,
and Mistral, which llama.cpp writes as ``llama``), ``qwen2``, ``qwen3``,
``phi3`` and ``gemma3`` (text only).  Weights come from ``mx.load`` when it can
read the file (F32/F16/Q4_0/Q4_1/Q8_0, which it returns as affine group-32
``weight/scales/biases``).  Otherwise they are read one tensor at a time: the
types affine per 32 values (Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K) become the same
affine arrays without a value changing, other quantized types (Q6_K, the smaller
K-quants) are dequantized by the ``gguf`` package's numpy code.

Modules: ``reader`` (the file header: :class:`GGUFFile`, :class:`GGUFError`),
``repack`` (those types -> MLX affine arrays), ``tokenizer``
(:func:`build_tokenizer` from the metadata) and ``convert`` (tensors and
metadata -> an mlx-lm model: :func:`load_gguf`).
"""

from .convert import SUPPORTED_ARCHITECTURES, load_gguf, metal_available
from .reader import GGUFError, GGUFFile
from .tokenizer import BPE_PRE_TOKENIZERS, GEMMA_CHAT_TEMPLATE, build_tokenizer

__all__ = [
    "BPE_PRE_TOKENIZERS",
    "GEMMA_CHAT_TEMPLATE",
    "GGUFError",
    "GGUFFile",
    "SUPPORTED_ARCHITECTURES",
    "build_tokenizer",
    "load_gguf",
    "metal_available",
]
