"""Offline GGUF loader: a .gguf file -> mlx-lm's own model class + tokenizer.

Supported architectures: ``llama`` (e.g. SmolLM2) and ``gemma3`` (text only).
Weights come from ``mx.load`` when it can read the file (F32/F16/Q4_0/Q4_1/Q8_0,
which it returns as affine group-32 ``weight/scales/biases``) and otherwise from
the ``gguf`` package's numpy dequantizer (K-quants such as Q4_K/Q6_K).

Conventions llama.cpp applies when it writes a GGUF, undone here:
- llama arch: Q/K projection rows are permuted (interleaved rotary pairs); they
  are un-permuted so the model matches the Hugging Face layout exactly and uses
  mlx-lm's default (non-traditional) RoPE.
- gemma3: RMSNorm weights are stored as ``1 + w``; mlx-lm's Gemma RMSNorm adds
  the 1 itself, so 1 is subtracted.
"""

from __future__ import annotations

import struct
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

SUPPORTED_ARCHITECTURES = ("llama", "gemma3")

# GGUF tensor types mx.load understands (it fails on the whole file otherwise).
_MX_LOADABLE_TYPES = {"F32", "F16", "Q4_0", "Q4_1", "Q8_0"}
_FLOAT_TYPES = {"F32", "F16", "BF16"}

# GGUF token types (llama.cpp llama_token_type) the tokenizer treats specially;
# the others are unknown (2), unused (5) and byte-fallback <0xNN> (6).
_TOKEN_NORMAL, _TOKEN_CONTROL, _TOKEN_USER_DEFINED = 1, 3, 4

_GROUP_SIZE = 32  # the GGUF legacy quants mx.load reads are all group-32


class GGUFError(ValueError):
    """A GGUF file this loader cannot turn into an mlx-lm model."""


def metal_available() -> bool:
    """True when mlx has a usable Metal GPU (then quantized weights are fast)."""
    try:
        return bool(mx.metal.is_available())
    except Exception:
        return False


# ---------------------------------------------------------------- metadata


_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                   10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class GGUFFile:
    """The header of a GGUF file: metadata and tensor descriptions, read fast.

    ``gguf.GGUFReader`` builds a numpy view per array element, which takes
    ~15 s for a 262k-token vocabulary; this reads the same header in well
    under a second and leaves tensor data memory-mapped.

    Attributes:
        metadata: {key: value}; arrays of numbers are numpy arrays, arrays of
            strings are lists of str.
        tensors: {name: (ggml type name, shape in numpy order, byte offset)}.
    """

    def __init__(self, path):
        from gguf import GGMLQuantizationType

        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {self.path}")
        # A plain ndarray view: slicing an np.memmap is slow in numpy's hot loops.
        self._data = np.asarray(np.memmap(self.path, dtype=np.uint8, mode="r"))
        self._buf = memoryview(self._data)
        self._pos = 0
        if bytes(self._buf[:4]) != b"GGUF":
            raise GGUFError(f"{self.path} is not a GGUF file (bad magic)")
        self._pos = 4
        version = self._scalar("<I")
        if version not in (2, 3):
            raise GGUFError(f"{self.path}: unsupported GGUF version {version}")
        n_tensors, n_kv = self._scalar("<Q"), self._scalar("<Q")
        self.metadata = {}
        for _ in range(n_kv):
            key = self._string()
            self.metadata[key] = self._value(self._scalar("<I"))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            n_dims = self._scalar("<I")
            dims = [self._scalar("<Q") for _ in range(n_dims)]
            kind, offset = self._scalar("<I"), self._scalar("<Q")
            try:
                kind_name = GGMLQuantizationType(kind).name
            except ValueError:
                raise GGUFError(f"unknown tensor type id {kind} for {name}") from None
            infos.append((name, kind_name, tuple(reversed(dims)), offset))
        align = int(self.metadata.get("general.alignment", 32))
        base = -(-self._pos // align) * align
        self.tensors = {n: (k, s, base + o) for n, k, s, o in infos}

    def _scalar(self, fmt):
        (value,) = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self):
        n = self._scalar("<Q")
        s = bytes(self._buf[self._pos : self._pos + n]).decode("utf-8", "replace")
        self._pos += n
        return s

    def _value(self, kind):
        if kind == _STRING:
            return self._string()
        if kind == _ARRAY:
            item_kind, count = self._scalar("<I"), self._scalar("<Q")
            if item_kind == _STRING:
                return [self._string() for _ in range(count)]
            if item_kind == _ARRAY:
                return [self._value(self._scalar("<I")) for _ in range(count)]
            dtype = np.dtype(_SCALAR_FORMATS[item_kind])
            out = np.frombuffer(self._buf, dtype=dtype, count=count, offset=self._pos).copy()
            self._pos += dtype.itemsize * count
            return out
        if kind not in _SCALAR_FORMATS:
            raise GGUFError(f"{self.path}: unknown metadata value type {kind}")
        return self._scalar(_SCALAR_FORMATS[kind])

    def dequantized(self, name) -> np.ndarray:
        """Tensor ``name`` as fp32 numpy (numpy shape order), via the gguf package."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import dequantize as gguf_dequantize

        kind, shape, offset = self.tensors[name]
        qtype = GGMLQuantizationType[kind]
        block, type_size = GGML_QUANT_SIZES[qtype]
        n_bytes = int(np.prod(shape)) // block * type_size
        raw = self._data[offset : offset + n_bytes]
        if kind in ("F32", "F16"):
            return raw.view(np.float32 if kind == "F32" else np.float16).astype(np.float32).reshape(shape)
        row_bytes = shape[-1] // block * type_size
        try:
            out = gguf_dequantize(raw.reshape(-1, row_bytes), qtype)
        except NotImplementedError as e:
            raise GGUFError(f"unsupported tensor type {kind} for {name}") from e
        return np.asarray(out, np.float32).reshape(shape)


# ---------------------------------------------------------------- tokenizer


def _spm_merges(tokens, scores, token_types):
    """BPE merges for a SentencePiece-style vocabulary, ranked by score.

    SentencePiece BPE (and llama.cpp's SPM tokenizer) repeatedly merges the
    adjacent pair whose concatenation is the highest-scoring vocabulary piece;
    ranking every (left, right) split of each piece by that piece's score gives
    the same order to a plain BPE model.
    """
    mergeable = {
        t: i
        for i, t in enumerate(tokens)
        if token_types[i] in (_TOKEN_NORMAL, _TOKEN_USER_DEFINED)
    }
    merges = []
    for piece, piece_id in mergeable.items():
        score = scores[piece_id]
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            left_id = mergeable.get(left)
            if left_id is None:
                continue
            right_id = mergeable.get(right)
            if right_id is None:
                continue
            merges.append((-score, piece_id, left_id, right_id, left, right))
    merges.sort()
    return [(m[4], m[5]) for m in merges]


def build_tokenizer(meta: dict):
    """Rebuild the tokenizer of a GGUF from its metadata.

    Returns an ``mlx_lm.tokenizer_utils.TokenizerWrapper`` around a
    ``transformers.PreTrainedTokenizerFast`` whose backend is built with the
    ``tokenizers`` library: byte-level BPE for ``tokenizer.ggml.model == "gpt2"``,
    byte-fallback BPE with merges derived from scores for ``"llama"`` (SPM).
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from tokenizers import normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    from mlx_lm.tokenizer_utils import (
        BPEStreamingDetokenizer,
        SPMStreamingDetokenizer,
        TokenizerWrapper,
    )

    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if kind is None or tokens is None:
        raise GGUFError("GGUF has no tokenizer (tokenizer.ggml.model/tokens missing)")
    n = len(tokens)
    token_types = meta.get("tokenizer.ggml.token_type")
    token_types = [_TOKEN_NORMAL] * n if token_types is None else np.asarray(token_types).tolist()
    vocab = {t: i for i, t in enumerate(tokens)}

    def token_at(key):
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[i] if i is not None and 0 <= i < n else None

    bos, eos, unk, pad = (token_at(k) for k in ("bos", "eos", "unknown", "padding"))
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    add_space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", False))

    if kind == "gpt2":
        merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
        backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
        pre = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
        # The GPT-2 split regex; llama.cpp's "smollm" pre-tokenizer first splits
        # digits individually. Other "pre" types (llama3, qwen2, ...) use their
        # own regexes, not rebuilt here: their token boundaries may differ.
        if meta.get("tokenizer.ggml.pre") == "smollm":
            pre.insert(0, pre_tokenizers.Digits(individual_digits=True))
        backend.pre_tokenizer = pre_tokenizers.Sequence(pre)
        backend.decoder = decoders.ByteLevel()
        detokenizer_class = BPEStreamingDetokenizer
    elif kind == "llama":
        scores = meta.get("tokenizer.ggml.scores")
        if scores is None:
            raise GGUFError("SPM ('llama') tokenizer without tokenizer.ggml.scores")
        merges = meta.get("tokenizer.ggml.merges")
        if merges:
            merges = [tuple(m.split(" ", 1)) for m in merges]
        else:
            merges = _spm_merges(tokens, np.asarray(scores).tolist(), token_types)
        backend = Tokenizer(
            models.BPE(
                vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True
            )
        )
        norm = [normalizers.Replace(" ", "▁")]
        if add_space_prefix:
            norm.insert(0, normalizers.Prepend("▁"))
        backend.normalizer = normalizers.Sequence(norm)
        dec = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        if add_space_prefix:
            dec.append(decoders.Strip(content=" ", left=1))
        backend.decoder = decoders.Sequence(dec)
        detokenizer_class = lambda tok: SPMStreamingDetokenizer(  # noqa: E731
            tok, trim_space=add_space_prefix
        )
    else:
        raise GGUFError(f"unsupported GGUF tokenizer model {kind!r} (supported: gpt2, llama)")

    # Control tokens are special (never produced from plain text by BPE, skipped
    # on decode with skip_special_tokens); user-defined ones are matched verbatim.
    added = [
        AddedToken(t, special=token_types[i] == _TOKEN_CONTROL, normalized=False)
        for i, t in enumerate(tokens)
        if token_types[i] in (_TOKEN_CONTROL, _TOKEN_USER_DEFINED)
    ]
    backend.add_tokens(added)

    single, special = "$A", []
    if add_bos and bos is not None:
        single = f"{bos} {single}"
        special.append((bos, vocab[bos]))
    if add_eos and eos is not None:
        single = f"{single} {eos}"
        special.append((eos, vocab[eos]))
    if special:
        backend.post_processor = processors.TemplateProcessing(
            single=single, pair=f"{single} $B:1", special_tokens=special
        )

    hf = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=bos,
        eos_token=eos,
        unk_token=unk,
        pad_token=pad,
        chat_template=meta.get("tokenizer.chat_template"),
        clean_up_tokenization_spaces=False,
    )
    return TokenizerWrapper(hf, detokenizer_class=detokenizer_class)


# ---------------------------------------------------------------- weights


_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
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
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def _mlx_name(gguf_base: str, architecture: str) -> str:
    """GGUF tensor base name (no .weight) -> mlx-lm module path."""
    if gguf_base in _TOP_NAMES:
        return _TOP_NAMES[gguf_base]
    parts = gguf_base.split(".")
    if len(parts) == 3 and parts[0] == "blk":
        _, layer, name = parts
        if name == "ffn_norm":
            # llama: the norm before the MLP; gemma3 also has one after it.
            target = "post_attention_layernorm" if architecture == "llama" else "pre_feedforward_layernorm"
            return f"model.layers.{layer}.{target}"
        if name in _BLOCK_NAMES:
            return f"model.layers.{layer}.{_BLOCK_NAMES[name]}"
    raise GGUFError(f"unexpected tensor {gguf_base!r} for architecture {architecture!r}")


def _unpermute_rows(w, n_heads: int):
    """Undo llama.cpp's Q/K row permutation (per head: interleaved -> halves)."""
    rows = w.shape[0]
    rest = w.shape[1:]
    w = w.reshape(n_heads, rows // n_heads // 2, 2, *rest)
    return w.swapaxes(1, 2).reshape(rows, *rest)


def _weights_via_mx_load(path):
    """{gguf base name: (weight, scales, biases, bits)} from mx.load; None if unreadable."""
    raw = mx.load(str(path))
    grouped = {}
    for key, value in raw.items():
        base, _, suffix = key.rpartition(".")
        grouped.setdefault(base, {})[suffix] = value
    out = {}
    for base, parts in grouped.items():
        w = parts["weight"]
        if "scales" in parts:
            s = parts["scales"]
            bits = w.shape[-1] * 32 // (s.shape[-1] * _GROUP_SIZE)
            out[base] = (w, s, parts["biases"], bits)
        else:
            out[base] = (w, None, None, None)
    return out


def _weights_via_numpy(gguf_file):
    """{gguf base name: fp32 mx.array} dequantized with the gguf package."""
    return {
        name.removesuffix(".weight"): mx.array(gguf_file.dequantized(name))
        for name in gguf_file.tensors
    }


# ---------------------------------------------------------------- model args


def _get(meta, arch, key, default=None, required=True):
    full = f"{arch}.{key}"
    if full in meta:
        value = meta[full]
        return value[0] if isinstance(value, list) else value
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


def _model_config(meta, arch, tensor_names, vocab_size):
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
    )
    common["num_key_value_heads"] = int(
        _get(meta, arch, "attention.head_count_kv", common["num_attention_heads"])
    )
    head_dim = _get(meta, arch, "attention.key_length", required=False)
    if head_dim is None:
        head_dim = common["hidden_size"] // common["num_attention_heads"]
    common["head_dim"] = int(head_dim)
    if arch == "llama":
        return dict(
            common,
            model_type="llama",
            tie_word_embeddings="output" not in tensor_names,
        )
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


def _model_class(model_type):
    if model_type == "llama":
        from mlx_lm.models import llama as module
    else:
        from mlx_lm.models import gemma3_text as module
    return module


# ---------------------------------------------------------------- load


def load_gguf(path, *, dequantize: bool | None = None):
    """Load a GGUF file into an mlx-lm model and tokenizer, offline.

    Args:
        path: a ``.gguf`` file (llama or gemma3 architecture).
        dequantize: ``True`` -> dense fp32 weights; ``False`` -> mlx
            ``QuantizedLinear``/``QuantizedEmbedding`` (group 32; GGUF legacy
            quants kept as is, other quantized types such as K-quants
            dequantized and re-quantized to 8 bits, float tensors kept float);
            ``None`` -> ``False`` when Metal is available, else ``True``
            (quantized matmuls are ~10x slower on the CPU backend).

    Returns:
        ``(model, tokenizer)``: an ``mlx_lm.models.<arch>.Model`` in eval mode
        and an ``mlx_lm.tokenizer_utils.TokenizerWrapper``.
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

    tensor_types = {name: info[0] for name, info in gguf_file.tensors.items()}
    tensor_names = {n.removesuffix(".weight") for n in tensor_types}
    if "rope_freqs" in tensor_names:
        raise GGUFError("GGUF with rope_freqs (llama3-style rope scaling) is not supported")
    vocab_size = len(meta.get("tokenizer.ggml.tokens") or []) or _get(meta, arch, "vocab_size")
    config = _model_config(meta, arch, tensor_names, vocab_size)

    if set(tensor_types.values()) <= _MX_LOADABLE_TYPES:
        loaded = _weights_via_mx_load(path)
    else:
        loaded = {k: (v, None, None, None) for k, v in _weights_via_numpy(gguf_file).items()}
    del gguf_file

    n_heads, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
    weights, quant = {}, {}
    for base, (w, scales, biases, bits) in loaded.items():
        name = _mlx_name(base, arch)
        if arch == "llama" and base.endswith(("attn_q", "attn_k")):
            heads = n_heads if base.endswith("attn_q") else n_kv
            w = _unpermute_rows(w, heads)
            if scales is not None:
                scales, biases = _unpermute_rows(scales, heads), _unpermute_rows(biases, heads)
        if scales is not None:
            if dequantize:
                w = mx.dequantize(
                    w,
                    scales.astype(mx.float32),
                    biases.astype(mx.float32),
                    group_size=_GROUP_SIZE,
                    bits=bits,
                )
            else:
                weights[f"{name}.scales"] = scales
                weights[f"{name}.biases"] = biases
                quant[name] = {"group_size": _GROUP_SIZE, "bits": int(bits)}
        elif not dequantize and tensor_types[f"{base}.weight"] not in _FLOAT_TYPES:
            # K-quants (read via numpy) have no mlx layout; 8 bits adds little error.
            w, s, b = mx.quantize(w.astype(mx.float32), group_size=_GROUP_SIZE, bits=8)
            weights[f"{name}.scales"], weights[f"{name}.biases"] = s, b
            quant[name] = {"group_size": _GROUP_SIZE, "bits": 8}
        if w.dtype != mx.uint32:
            w = w.astype(mx.float32)
            if arch == "gemma3" and base.endswith("norm"):
                w = w - 1.0
        weights[f"{name}.weight"] = w

    module = _model_class(config["model_type"])
    model = module.Model(module.ModelArgs.from_dict(config))
    if quant:
        nn.quantize(
            model,
            class_predicate=lambda p, m: quant.get(p, False)
            if hasattr(m, "to_quantized")
            else False,
        )
    weights = model.sanitize(weights)
    model.load_weights(list(weights.items()), strict=True)
    mx.eval(model.parameters())
    model.eval()

    tokenizer = build_tokenizer(meta)
    return model, tokenizer


__all__ = [
    "GGUFError",
    "SUPPORTED_ARCHITECTURES",
    "build_tokenizer",
    "load_gguf",
    "metal_available",
    "GGUFFile",
]
