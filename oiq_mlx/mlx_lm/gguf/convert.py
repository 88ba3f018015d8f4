"""A GGUF's tensors and metadata -> mlx-lm's own model class: :func:`load_gguf`.

Conventions llama.cpp applies when it writes a GGUF, undone here:
- llama arch only: Q/K projection rows are permuted (interleaved rotary pairs);
  they are un-permuted so the model matches the Hugging Face layout exactly and
  uses mlx-lm's default (non-traditional) RoPE.  qwen2, qwen3, phi3 and gemma3
  are written unpermuted (llama.cpp runs them with NeoX-style RoPE).
- gemma3: RMSNorm weights are stored as ``1 + w``; mlx-lm's Gemma RMSNorm adds
  the 1 itself, so 1 is subtracted.
- phi3: LongRoPE factors are tensors (``rope_factors_long/short``), not metadata.
"""

from __future__ import annotations

import importlib

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from . import repack
from .reader import GGUFError, GGUFFile
from .tokenizer import build_tokenizer

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3", "gemma3")

# GGUF tensor types mx.load understands (it fails on the whole file otherwise).
_MX_LOADABLE_TYPES = {"F32", "F16", "Q4_0", "Q4_1", "Q8_0"}
_FLOAT_TYPES = {"F32", "F16", "BF16"}


def metal_available() -> bool:
    """True when mlx has a usable Metal GPU (then quantized weights are fast)."""
    try:
        return bool(mx.metal.is_available())
    except Exception:
        return False


# ---------------------------------------------------------------- weights


_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Where each architecture differs from _BLOCK_NAMES.
_ARCH_BLOCK_NAMES = {
    # llama and its kin have one norm before the MLP; gemma3 has one after it too.
    "llama": {"ffn_norm": "post_attention_layernorm"},
    "qwen2": {"ffn_norm": "post_attention_layernorm"},
    "qwen3": {"ffn_norm": "post_attention_layernorm"},
    "phi3": {"ffn_norm": "post_attention_layernorm", "ffn_up": "mlp.gate_up_proj"},  # gate and up fused
    "gemma3": {"ffn_norm": "pre_feedforward_layernorm"},
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_ROPE_FACTOR_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")


def _mlx_name(gguf_name: str, architecture: str) -> str:
    """GGUF tensor name (``blk.3.attn_q.weight``) -> mlx-lm parameter path."""
    base, _, suffix = gguf_name.rpartition(".")
    if suffix not in ("weight", "bias"):
        raise GGUFError(f"unexpected tensor {gguf_name!r} for architecture {architecture!r}")
    if base in _TOP_NAMES:
        return f"{_TOP_NAMES[base]}.{suffix}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit():
        _, layer, name = parts
        target = _ARCH_BLOCK_NAMES[architecture].get(name) or _BLOCK_NAMES.get(name)
        if target is not None:
            return f"model.layers.{layer}.{target}.{suffix}"
    raise GGUFError(f"unexpected tensor {gguf_name!r} for architecture {architecture!r}")


def _unpermute_rows(w, n_heads: int):
    """Undo llama.cpp's Q/K row permutation (per head: interleaved -> halves)."""
    rows = w.shape[0]
    rest = w.shape[1:]
    w = w.reshape(n_heads, rows // n_heads // 2, 2, *rest)
    return w.swapaxes(1, 2).reshape(rows, *rest)


def _weights_via_mx_load(path):
    """{gguf tensor name: (weight, scales, biases, bits)} from mx.load, all at once (it reads a
    file of ``_MX_LOADABLE_TYPES`` faster than :func:`_tensors`, and as quantized as it is)."""
    try:
        raw = mx.load(str(path))
    except RuntimeError as e:  # GGUFFile checked the layout; this is mlx's own reader
        raise GGUFError(f"{path}: {e}") from None
    out = {}
    for key, value in raw.items():
        base, _, suffix = key.rpartition(".")
        if suffix in ("scales", "biases"):
            continue
        if suffix == "weight" and f"{base}.scales" in raw:
            s = raw[f"{base}.scales"]
            bits = value.shape[-1] * 32 // (s.shape[-1] * repack.GROUP_SIZE)
            out[key] = (value, s, raw[f"{base}.biases"], bits)
        else:
            out[key] = (value, None, None, None)
    return out


def _tensors(gguf_file, quantized: bool):
    """``(gguf name, (weight, scales, biases, bits))`` for each tensor, read when the loop asks for
    it: with ``quantized``, the types affine per 32 values as MLX affine arrays, exactly
    (``repack.affine``); every other tensor dequantized to fp32 by the gguf package (scales,
    biases and bits None).  One tensor at a time, so that a K-quant file never stands in memory
    in fp32 as a whole."""
    for name, (kind, shape, _) in gguf_file.tensors.items():
        if quantized and kind in repack.AFFINE_TYPES:
            yield name, repack.affine(gguf_file.raw(name), kind, shape)
        else:
            yield name, (mx.array(gguf_file.dequantized(name)), None, None, None)


# ---------------------------------------------------------------- model args


def _get(meta, arch, key, default=None, required=True):
    full = f"{arch}.{key}"
    if full in meta:
        value = meta[full]
        if isinstance(value, (list, np.ndarray)):  # per-layer values: only uniform ones fit mlx-lm's args
            if len(value) == 0 or any(v != value[0] for v in value):
                raise GGUFError(f"per-layer {full} = {list(value)} is not supported")
            return value[0]
        return value
    if required and default is None:
        raise GGUFError(f"GGUF metadata lacks {full}")
    return default


def _rope_scaling(meta, arch):
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return {"type": "linear", "factor": float(meta[f"{arch}.rope.scaling.factor"])}
    raise GGUFError(f"unsupported rope scaling {kind!r} in {arch} GGUF")


def _model_config(meta, arch, tensor_names, vocab_size, rope_factors):
    common = dict(
        hidden_size=int(_get(meta, arch, "embedding_length")),
        num_hidden_layers=int(_get(meta, arch, "block_count")),
        intermediate_size=int(_get(meta, arch, "feed_forward_length")),
        num_attention_heads=int(_get(meta, arch, "attention.head_count")),
        rms_norm_eps=float(_get(meta, arch, "attention.layer_norm_rms_epsilon")),
        vocab_size=int(vocab_size),
        max_position_embeddings=int(_get(meta, arch, "context_length")),
        rope_theta=float(_get(meta, arch, "rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(meta, arch),
        tie_word_embeddings="output" not in tensor_names,
    )
    common["num_key_value_heads"] = int(
        _get(meta, arch, "attention.head_count_kv", common["num_attention_heads"])
    )
    implied_head_dim = common["hidden_size"] // common["num_attention_heads"]
    head_dim = int(_get(meta, arch, "attention.key_length", implied_head_dim))
    common["head_dim"] = head_dim
    rope_dim = int(_get(meta, arch, "rope.dimension_count", head_dim))
    if arch in ("qwen2", "phi3") and head_dim != implied_head_dim:
        # mlx-lm's qwen2 and phi3 classes derive head_dim from hidden_size / heads
        raise GGUFError(f"{arch} GGUF with head_dim {head_dim} != hidden_size / heads ({implied_head_dim})")
    if arch != "phi3" and rope_dim != head_dim:
        raise GGUFError(f"{arch} GGUF with partial rotary embedding ({rope_dim} of {head_dim} dims) is not supported")
    if arch == "llama":
        return dict(
            common,
            model_type="llama",
            attention_bias="blk.0.attn_q.bias" in tensor_names,
            mlp_bias="blk.0.ffn_up.bias" in tensor_names,
        )
    if arch in ("qwen2", "qwen3"):
        return dict(common, model_type=arch)
    if arch == "phi3":
        config = dict(
            common,
            model_type="phi3",
            partial_rotary_factor=rope_dim / head_dim,
            original_max_position_embeddings=int(
                _get(meta, arch, "rope.scaling.original_context_length", common["max_position_embeddings"])
            ),
        )
        if rope_factors is not None:
            if common["rope_scaling"] is not None:
                raise GGUFError("phi3 GGUF with both rope factor tensors and rope.scaling.type")
            long_factor, short_factor = rope_factors
            config["rope_scaling"] = {"type": "longrope", "long_factor": long_factor, "short_factor": short_factor}
        return config
    if arch == "gemma3":
        h, nh, hd = common["hidden_size"], common["num_attention_heads"], common["head_dim"]
        # llama.cpp: Gemma 3 27B scales queries by hidden/heads, the rest by head_dim.
        q_scalar = h // nh if common["num_hidden_layers"] == 62 else hd
        return dict(
            common,
            model_type="gemma3_text",
            sliding_window=int(_get(meta, arch, "attention.sliding_window", 4096)),
            query_pre_attn_scalar=q_scalar,
        )
    raise GGUFError(
        f"unsupported GGUF architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
    )


# ---------------------------------------------------------------- load


def load_gguf(path, *, dequantize: bool | None = None, tokenizer_cache=None):
    """Load a GGUF file into an mlx-lm model and tokenizer, offline.

    Args:
        path: a ``.gguf`` file of an architecture in ``SUPPORTED_ARCHITECTURES``.
        dequantize: ``True`` -> dense fp32 weights; ``False`` -> mlx
            ``QuantizedLinear``/``QuantizedEmbedding`` (group 32; Q4_0, Q4_1,
            Q5_0, Q5_1, Q8_0, Q4_K and Q5_K tensors kept as they are, at their
            own bits, other quantized types such as Q6_K dequantized and
            re-quantized to 8 bits, float tensors kept float; float32 scales,
            except the float16 ones ``mx.load`` gives a file of F32/F16/Q4_0/
            Q4_1/Q8_0 tensors of an architecture other than gemma3);
            ``None`` -> ``False`` when Metal is available, else ``True``
            (quantized matmuls are ~10x slower on the CPU backend).
        tokenizer_cache: a directory where the rebuilt tokenizer is kept between loads
            (:func:`~oiq_mlx.mlx_lm.gguf.tokenizer.build_tokenizer`); ``None``: rebuilt
            every time. ``oiq_mlx.load`` passes ``cache_dir() / "tokenizers"``.

    Returns:
        ``(model, tokenizer)``: an ``mlx_lm.models.<arch>.Model`` in eval mode
        and an ``mlx_lm.tokenizer_utils.TokenizerWrapper``.

    Raises:
        FileNotFoundError: no such file.
        GGUFError: a truncated or corrupt file, or one this loader does not
            support (architecture, tokenizer, tensor type, rope scaling).
    """
    gguf_file = GGUFFile(path)
    meta = gguf_file.metadata
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(
            f"unsupported GGUF architecture {arch!r} in {path} "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    if dequantize is None:
        dequantize = not metal_available()
    tokenizer = build_tokenizer(meta, cache=tokenizer_cache)

    tensor_types = {name: info[0] for name, info in gguf_file.tensors.items()}
    tensor_names = {n.removesuffix(".weight") for n in tensor_types} | set(tensor_types)
    if "rope_freqs" in tensor_names:
        raise GGUFError("GGUF with rope_freqs (llama3-style rope scaling) is not supported")
    rope_factors = None
    if arch == "phi3" and _ROPE_FACTOR_TENSORS[0] in tensor_types:
        rope_factors = tuple(gguf_file.dequantized(n).tolist() for n in _ROPE_FACTOR_TENSORS)
    vocab_size = len(meta.get("tokenizer.ggml.tokens") or []) or _get(meta, arch, "vocab_size")
    config = _model_config(meta, arch, tensor_names, vocab_size, rope_factors)

    n_heads, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
    weights, quant = {}, {}
    if set(tensor_types.values()) <= _MX_LOADABLE_TYPES:
        loaded = _weights_via_mx_load(path).items()
    else:
        loaded = _tensors(gguf_file, quantized=not dequantize)
    for gguf_name, (w, scales, biases, bits) in loaded:
        if gguf_name in _ROPE_FACTOR_TENSORS:
            continue
        name = _mlx_name(gguf_name, arch)
        module = name.rpartition(".")[0]
        if arch == "llama" and gguf_name.rpartition(".")[0].endswith(("attn_q", "attn_k")):
            heads = n_heads if ".attn_q." in gguf_name else n_kv
            w = _unpermute_rows(w, heads)
            if scales is not None:
                scales, biases = _unpermute_rows(scales, heads), _unpermute_rows(biases, heads)
        if scales is not None and dequantize:  # from mx.load
            w = mx.dequantize(w, scales.astype(mx.float32), biases.astype(mx.float32),
                              group_size=repack.GROUP_SIZE, bits=bits)
        elif scales is not None:  # kept as it is (repack.affine or mx.load)
            if arch == "gemma3":
                # a quantized layer computes in its scales' dtype: mx.load's float16 scales would put
                # Gemma 3's residual stream, which float16 does not hold, in float16 (repack.affine's
                # are float32 already)
                scales, biases = scales.astype(mx.float32), biases.astype(mx.float32)
            weights[f"{module}.scales"] = scales
            weights[f"{module}.biases"] = biases
            quant[module] = {"group_size": repack.GROUP_SIZE, "bits": int(bits)}
        elif not dequantize and tensor_types[gguf_name] not in _FLOAT_TYPES:
            # Q6_K (groups of 16) and the smaller K-quants have no MLX layout; 8 bits adds little error.
            w, s, b = mx.quantize(w.astype(mx.float32), group_size=repack.GROUP_SIZE, bits=8)
            weights[f"{module}.scales"], weights[f"{module}.biases"] = s, b
            quant[module] = {"group_size": repack.GROUP_SIZE, "bits": 8}
        if w.dtype != mx.uint32:
            w = w.astype(mx.float32)
            if arch == "gemma3" and gguf_name.endswith("norm.weight"):
                w = w - 1.0
        weights[name] = w
        # now, so that this tensor's fp32 copy (dequantized, before requantizing) is freed
        # before the next one is read: the load's peak stays near the model's own size
        mx.eval(w, weights.get(f"{module}.scales"), weights.get(f"{module}.biases"))
    del gguf_file

    model_module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model = model_module.Model(model_module.ModelArgs.from_dict(config))
    if quant:
        nn.quantize(
            model,
            class_predicate=lambda p, m: quant.get(p, False)
            if hasattr(m, "to_quantized")
            else False,
        )
    if hasattr(model, "sanitize"):  # as mlx_lm.load: not every model class has one
        weights = model.sanitize(weights)
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:  # missing, extra or misshapen tensors
        raise GGUFError(f"{path}: tensors do not fit mlx-lm's {config['model_type']} model: {e}") from None
    mx.eval(model.parameters())
    model.eval()
    return model, tokenizer


__all__ = ["SUPPORTED_ARCHITECTURES", "load_gguf", "metal_available"]
