"""Offline GGUF loader: a .gguf file -> mlx-lm's own model class + tokenizer.

Supported architectures (``general.architecture``): ``llama`` (Llama, SmolLM2,
and Mistral, which llama.cpp writes as ``llama``), ``qwen2``, ``qwen3``,
``phi3`` and ``gemma3`` (text only).  Weights come from ``mx.load`` when it can
read the file (F32/F16/Q4_0/Q4_1/Q8_0, which it returns as affine group-32
``weight/scales/biases``) and otherwise from the ``gguf`` package's numpy
dequantizer (K-quants such as Q4_K/Q6_K).

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
import math
import struct
import warnings
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, SPMStreamingDetokenizer, TokenizerWrapper
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3", "gemma3")

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
_MAX_DIMS = 4  # ggml tensors have at most four dimensions


class GGUFFile:
    """The header of a GGUF file: metadata and tensor descriptions, read fast.

    ``gguf.GGUFReader`` builds a numpy view per array element, which takes
    ~15 s for a 262k-token vocabulary; this reads the same header in well
    under a second and leaves tensor data memory-mapped.  Every read is
    bounds-checked and every tensor's bytes must lie inside the file, so a
    truncated or corrupt file raises :class:`GGUFError` here, never later.

    Attributes:
        metadata: {key: value}; arrays of numbers are numpy arrays, arrays of
            strings are lists of str.
        tensors: {name: (ggml type name, shape in numpy order, byte offset)}.
    """

    def __init__(self, path):
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {self.path}")
        if self.path.stat().st_size < 4:
            raise GGUFError(f"{self.path} is not a GGUF file (only {self.path.stat().st_size} bytes)")
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
            if n_dims > _MAX_DIMS:
                raise GGUFError(f"{self.path}: tensor {name!r} has {n_dims} dimensions (corrupt header?)")
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
        for name in self.tensors:
            end = self.tensors[name][2] + self.nbytes(name)
            if end > len(self._data):
                raise GGUFError(
                    f"{self.path}: tensor {name!r} ends at byte {end}, past the end of the file "
                    f"({len(self._data)} bytes): truncated or incomplete download?"
                )

    def _truncated(self, need: int):
        return GGUFError(
            f"{self.path}: GGUF header truncated or corrupt (needs {need} bytes at offset "
            f"{self._pos}, the file has {len(self._data)}): incomplete download?"
        )

    def _take(self, n: int) -> int:
        """Advance past ``n`` bytes; returns where they start."""
        if n < 0 or self._pos + n > len(self._data):
            raise self._truncated(n)
        start = self._pos
        self._pos += n
        return start

    def _scalar(self, fmt):
        (value,) = struct.unpack_from(fmt, self._buf, self._take(struct.calcsize(fmt)))
        return value

    def _string(self):
        n = self._scalar("<Q")
        start = self._take(n)
        return bytes(self._buf[start : start + n]).decode("utf-8", "replace")

    def _value(self, kind):
        if kind == _STRING:
            return self._string()
        if kind == _ARRAY:
            item_kind, count = self._scalar("<I"), self._scalar("<Q")
            if item_kind == _STRING:
                return [self._string() for _ in range(count)]
            if item_kind == _ARRAY:
                return [self._value(self._scalar("<I")) for _ in range(count)]
            if item_kind not in _SCALAR_FORMATS:
                raise GGUFError(f"{self.path}: unknown metadata array item type {item_kind}")
            dtype = np.dtype(_SCALAR_FORMATS[item_kind])
            start = self._take(dtype.itemsize * count)
            return np.frombuffer(self._buf, dtype=dtype, count=count, offset=start).copy()
        if kind not in _SCALAR_FORMATS:
            raise GGUFError(f"{self.path}: unknown metadata value type {kind}")
        return self._scalar(_SCALAR_FORMATS[kind])

    def nbytes(self, name) -> int:
        """Bytes tensor ``name`` occupies in the file."""
        kind, shape, _ = self.tensors[name]
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
        if shape and shape[-1] % block:
            raise GGUFError(f"tensor {name!r}: rows of {shape[-1]} are not whole {kind} blocks of {block}")
        return math.prod(shape) // block * type_size

    def dequantized(self, name) -> np.ndarray:
        """Tensor ``name`` as fp32 numpy (numpy shape order), via the gguf package."""
        kind, shape, offset = self.tensors[name]
        qtype = GGMLQuantizationType[kind]
        block, type_size = GGML_QUANT_SIZES[qtype]
        raw = self._data[offset : offset + self.nbytes(name)]
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


# The split regexes of the Hugging Face tokenizers that llama.cpp's
# ``tokenizer.ggml.pre`` names stand for (GPT-2's own is ByteLevel's built-in one).
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_SPLIT = _QWEN2_SPLIT.replace(r"|\p{N}|", r"|\p{N}{1,3}|")
# Mistral's Tekken: words split at lower-to-upper case changes ("HelloWorld" -> "Hello", "World")
_TEKKEN_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                 r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                 r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
BPE_PRE_TOKENIZERS = ("gpt2", "smollm", "qwen2", "llama-bpe", "tekken")
# Llama 3 and Tekken (tiktoken-style) take a pre-token that is itself in the
# vocabulary whole, without merging, and add BOS unless the file says otherwise
# (llama.cpp does both for these two).
_IGNORE_MERGES = _BOS_BY_DEFAULT = ("llama-bpe", "tekken")


def _bpe_pre_tokenizer(pre):
    """The pre-tokenizer of a byte-level BPE vocabulary with ``tokenizer.ggml.pre == pre``."""
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "gpt2":
        return gpt2
    if pre == "smollm":  # GPT-2's split after splitting digits one by one
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2])
    split = {"qwen2": _QWEN2_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "tekken": _TEKKEN_SPLIT}.get(pre)
    if split is None:
        # Another split would give other token boundaries than the model was trained on.
        raise GGUFError(
            f"BPE pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported "
            f"(supported: {', '.join(BPE_PRE_TOKENIZERS)})"
        )
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


# Control tokens that end a turn: llama.cpp stops generating at these too, not
# only at tokenizer.ggml.eos_token_id (e.g. Gemma's <end_of_turn>, ChatML's <|im_end|>).
_END_OF_TURN_TOKENS = ("<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<EOT>")

# Gemma's chat format, for gemma3 GGUFs written without tokenizer.chat_template.
# Gemma has no system role: a system message opens the first user turn.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set first_prefix = messages[0]['content'] + '\\n\\n' -%}"
    "{%- set messages = messages[1:] -%}"
    "{%- else -%}{%- set first_prefix = '' -%}{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_prefix if loop.first else '') "
    "+ message['content'] | trim + '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)


def _chat_template(meta: dict):
    template = meta.get("tokenizer.chat_template")
    if template is None and meta.get("general.architecture") == "gemma3":
        return GEMMA_CHAT_TEMPLATE
    return template


def build_tokenizer(meta: dict):
    """Rebuild the tokenizer of a GGUF from its metadata.

    Returns an ``mlx_lm.tokenizer_utils.TokenizerWrapper`` around a
    ``transformers.PreTrainedTokenizerFast`` whose backend is built with the
    ``tokenizers`` library: byte-level BPE for ``tokenizer.ggml.model == "gpt2"``
    (pre-tokenizer per ``tokenizer.ggml.pre``, see ``BPE_PRE_TOKENIZERS``),
    byte-fallback BPE with merges derived from scores for ``"llama"`` (SPM).
    The chat template is ``tokenizer.chat_template`` (Gemma's turn format for a
    gemma3 file without one); generation stops at the EOS token and at the
    end-of-turn control tokens llama.cpp also stops at.
    """
    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if kind is None or tokens is None:
        raise GGUFError("GGUF has no tokenizer (tokenizer.ggml.model/tokens missing)")
    n = len(tokens)
    token_types = meta.get("tokenizer.ggml.token_type")
    token_types = [_TOKEN_NORMAL] * n if token_types is None else np.asarray(token_types).tolist()
    if len(token_types) != n:
        raise GGUFError(f"tokenizer.ggml.token_type has {len(token_types)} entries for {n} tokens")
    vocab = {t: i for i, t in enumerate(tokens)}

    def token_at(key):
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[i] if i is not None and 0 <= i < n else None

    bos, eos, unk, pad = (token_at(k) for k in ("bos", "eos", "unknown", "padding"))
    pre = meta.get("tokenizer.ggml.pre")
    if kind == "gpt2" and pre is None:  # files from before llama.cpp recorded it
        warnings.warn("GGUF has no tokenizer.ggml.pre: splitting text as GPT-2 does; token boundaries "
                      "may differ from the model's own tokenizer", stacklevel=2)
        pre = "gpt2"
    # llama.cpp's defaults where the file does not say: SentencePiece vocabularies
    # add BOS and a leading space; byte-level BPE adds BOS for Llama 3 and Tekken.
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama" or pre in _BOS_BY_DEFAULT))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    add_space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", kind == "llama"))

    if kind == "gpt2":
        merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
        backend = Tokenizer(
            models.BPE(vocab=vocab, merges=merges, fuse_unk=False, ignore_merges=pre in _IGNORE_MERGES)
        )
        backend.pre_tokenizer = _bpe_pre_tokenizer(pre)
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
        chat_template=_chat_template(meta),
        clean_up_tokenization_spaces=False,
    )
    stop_ids = {vocab[t] for t in _END_OF_TURN_TOKENS if t in vocab and token_types[vocab[t]] == _TOKEN_CONTROL}
    stop_ids |= {
        int(meta[f"tokenizer.ggml.{key}_token_id"])
        for key in ("eot", "eom")
        if f"tokenizer.ggml.{key}_token_id" in meta
    }
    return TokenizerWrapper(hf, detokenizer_class=detokenizer_class, eos_token_ids=sorted(stop_ids))


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
    """{gguf tensor name: (weight, scales, biases, bits)} from mx.load."""
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
            bits = value.shape[-1] * 32 // (s.shape[-1] * _GROUP_SIZE)
            out[key] = (value, s, raw[f"{base}.biases"], bits)
        else:
            out[key] = (value, None, None, None)
    return out


def _weights_via_numpy(gguf_file):
    """{gguf tensor name: (fp32 mx.array, None, None, None)} dequantized with the gguf package."""
    return {name: (mx.array(gguf_file.dequantized(name)), None, None, None) for name in gguf_file.tensors}


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


def load_gguf(path, *, dequantize: bool | None = None):
    """Load a GGUF file into an mlx-lm model and tokenizer, offline.

    Args:
        path: a ``.gguf`` file of an architecture in ``SUPPORTED_ARCHITECTURES``.
        dequantize: ``True`` -> dense fp32 weights; ``False`` -> mlx
            ``QuantizedLinear``/``QuantizedEmbedding`` (group 32; GGUF legacy
            quants kept as is, other quantized types such as K-quants
            dequantized and re-quantized to 8 bits, float tensors kept float);
            ``None`` -> ``False`` when Metal is available, else ``True``
            (quantized matmuls are ~10x slower on the CPU backend).

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
    tokenizer = build_tokenizer(meta)

    tensor_types = {name: info[0] for name, info in gguf_file.tensors.items()}
    tensor_names = {n.removesuffix(".weight") for n in tensor_types} | set(tensor_types)
    if "rope_freqs" in tensor_names:
        raise GGUFError("GGUF with rope_freqs (llama3-style rope scaling) is not supported")
    rope_factors = None
    if arch == "phi3" and _ROPE_FACTOR_TENSORS[0] in tensor_types:
        rope_factors = tuple(gguf_file.dequantized(n).tolist() for n in _ROPE_FACTOR_TENSORS)
    vocab_size = len(meta.get("tokenizer.ggml.tokens") or []) or _get(meta, arch, "vocab_size")
    config = _model_config(meta, arch, tensor_names, vocab_size, rope_factors)

    if set(tensor_types.values()) <= _MX_LOADABLE_TYPES:
        loaded = _weights_via_mx_load(path)
    else:
        loaded = _weights_via_numpy(gguf_file)
    del gguf_file

    n_heads, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
    weights, quant = {}, {}
    for gguf_name, (w, scales, biases, bits) in loaded.items():
        if gguf_name in _ROPE_FACTOR_TENSORS:
            continue
        name = _mlx_name(gguf_name, arch)
        module = name.rpartition(".")[0]
        if arch == "llama" and gguf_name.rpartition(".")[0].endswith(("attn_q", "attn_k")):
            heads = n_heads if ".attn_q." in gguf_name else n_kv
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
                weights[f"{module}.scales"] = scales
                weights[f"{module}.biases"] = biases
                quant[module] = {"group_size": _GROUP_SIZE, "bits": int(bits)}
        elif not dequantize and tensor_types[gguf_name] not in _FLOAT_TYPES:
            # K-quants (read via numpy) have no mlx layout; 8 bits adds little error.
            w, s, b = mx.quantize(w.astype(mx.float32), group_size=_GROUP_SIZE, bits=8)
            weights[f"{module}.scales"], weights[f"{module}.biases"] = s, b
            quant[module] = {"group_size": _GROUP_SIZE, "bits": 8}
        if w.dtype != mx.uint32:
            w = w.astype(mx.float32)
            if arch == "gemma3" and gguf_name.endswith("norm.weight"):
                w = w - 1.0
        weights[name] = w

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
