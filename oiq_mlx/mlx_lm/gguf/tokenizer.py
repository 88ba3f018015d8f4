"""The tokenizer of a GGUF, rebuilt from its metadata: :func:`build_tokenizer`."""

from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path

import numpy as np
import tokenizers
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, SPMStreamingDetokenizer, TokenizerWrapper
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from ...core.disk import write_atomically
from .reader import GGUFError


# GGUF token types (llama.cpp llama_token_type) the tokenizer treats specially;
# the others are unknown (2), unused (5) and byte-fallback <0xNN> (6).
_TOKEN_NORMAL, _TOKEN_CONTROL, _TOKEN_USER_DEFINED = 1, 3, 4


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


def _backend(meta: dict, kind: str, pre, vocab: dict, token_types: list, specials, flags) -> Tokenizer:
    """The ``tokenizers`` backend of :func:`build_tokenizer` (``kind`` checked there)."""
    tokens = meta["tokenizer.ggml.tokens"]
    (bos, eos, unk), (add_bos, add_eos, add_space_prefix) = specials, flags
    if kind == "gpt2":
        merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
        backend = Tokenizer(
            models.BPE(vocab=vocab, merges=merges, fuse_unk=False, ignore_merges=pre in _IGNORE_MERGES)
        )
        backend.pre_tokenizer = _bpe_pre_tokenizer(pre)
        backend.decoder = decoders.ByteLevel()
    else:
        merges = meta.get("tokenizer.ggml.merges")
        if merges:
            merges = [tuple(m.split(" ", 1)) for m in merges]
        else:
            merges = _spm_merges(tokens, np.asarray(meta["tokenizer.ggml.scores"]).tolist(), token_types)
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
    return backend


# Part of every cache key: bump it when the backend built from the same metadata changes.
_CACHE_FORMAT = 1


def _json_array(a):
    if isinstance(a, np.ndarray):
        return [a.dtype.str, a.tolist()]
    raise TypeError(f"GGUF metadata value of type {type(a).__name__}")


def cache_key(meta: dict) -> str:
    """sha256 of what the tokenizer backend is built from: every ``tokenizer.ggml.*`` entry, the
    cache format and the ``tokenizers`` version (a new version rewrites the file it reads)."""
    digest = hashlib.sha256(f"oiq_mlx tokenizer {_CACHE_FORMAT} tokenizers {tokenizers.__version__}".encode())
    for key in sorted(k for k in meta if k.startswith("tokenizer.ggml.")):
        value = meta[key]
        if isinstance(value, np.ndarray):
            part = f"{key} {value.dtype.str}{value.shape}".encode() + np.ascontiguousarray(value).tobytes()
        else:  # str, int, float, bool, or a list of them (or of arrays): JSON tells them apart
            part = f"{key} ".encode() + json.dumps(value, default=_json_array).encode()
        digest.update(len(part).to_bytes(8, "little") + part)
    return digest.hexdigest()


def _content_tag(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def _read_cached(cache: Path, key: str, hf_args: dict):
    """The tokenizer saved under ``key`` (``<key>-<sha256 of the file, 16 digits>.json``),
    or None where there is none whose content matches its name."""
    for path in sorted(cache.glob(f"{key}-*.json")):
        try:
            if _content_tag(path.read_bytes()) != path.stem.rpartition("-")[2]:
                continue
            return PreTrainedTokenizerFast(tokenizer_file=str(path), **hf_args)
        except Exception:  # unreadable, or the tokenizers library refused it (plain Exceptions)
            continue
    return None


def _write_cached(cache: Path, key: str, text: str) -> Path | None:
    """Save ``text`` as the tokenizer of ``key``, removing older files of that key; None (nothing
    written) where the directory cannot be written: the cache only saves time."""
    data = text.encode("utf-8")
    path = cache / f"{key}-{_content_tag(data)}.json"
    if not write_atomically(path, data):
        return None
    for old in cache.glob(f"{key}-*.json"):
        if old != path:
            old.unlink(missing_ok=True)
    return path


def build_tokenizer(meta: dict, cache: str | Path | None = None):
    """Rebuild the tokenizer of a GGUF from its metadata.

    Returns an ``mlx_lm.tokenizer_utils.TokenizerWrapper`` around a
    ``transformers.PreTrainedTokenizerFast`` whose backend is built with the
    ``tokenizers`` library: byte-level BPE for ``tokenizer.ggml.model == "gpt2"``
    (pre-tokenizer per ``tokenizer.ggml.pre``, see ``BPE_PRE_TOKENIZERS``),
    byte-fallback BPE with merges derived from scores for ``"llama"`` (SPM).
    The chat template is ``tokenizer.chat_template`` (Gemma's turn format for a
    gemma3 file without one); generation stops at the EOS token and at the
    end-of-turn control tokens llama.cpp also stops at.

    With ``cache`` (a directory), the backend is saved there in the ``tokenizers`` format,
    named by :func:`cache_key` and the file's own sha256, and read from there by later calls
    with the same metadata: a 262k-token SentencePiece vocabulary (Gemma 3) takes seconds to
    rebuild.  A file whose content does not match its name, or that does not parse, is
    rebuilt and replaced; a directory that cannot be written is skipped.
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
        detokenizer_class = BPEStreamingDetokenizer
    elif kind == "llama":
        if meta.get("tokenizer.ggml.scores") is None:
            raise GGUFError("SPM ('llama') tokenizer without tokenizer.ggml.scores")
        detokenizer_class = lambda tok: SPMStreamingDetokenizer(  # noqa: E731
            tok, trim_space=add_space_prefix
        )
    else:
        raise GGUFError(f"unsupported GGUF tokenizer model {kind!r} (supported: gpt2, llama)")

    hf_args = dict(bos_token=bos, eos_token=eos, unk_token=unk, pad_token=pad,
                   chat_template=_chat_template(meta), clean_up_tokenization_spaces=False)
    hf = None
    if cache is not None:
        cache, key = Path(cache), cache_key(meta)
        hf = _read_cached(cache, key, hf_args)
    if hf is None:
        backend = _backend(meta, kind, pre, vocab, token_types, (bos, eos, unk), (add_bos, add_eos, add_space_prefix))
        if cache is not None and _write_cached(cache, key, backend.to_str()) is not None:
            # read back as later loads read it (transformers deep-copies a tokenizer object,
            # not a file); None if another process replaced it meanwhile
            hf = _read_cached(cache, key, hf_args)
        if hf is None:
            hf = PreTrainedTokenizerFast(tokenizer_object=backend, **hf_args)
    stop_ids = {vocab[t] for t in _END_OF_TURN_TOKENS if t in vocab and token_types[vocab[t]] == _TOKEN_CONTROL}
    stop_ids |= {
        int(meta[f"tokenizer.ggml.{key}_token_id"])
        for key in ("eot", "eom")
        if f"tokenizer.ggml.{key}_token_id" in meta
    }
    return TokenizerWrapper(hf, detokenizer_class=detokenizer_class, eos_token_ids=sorted(stop_ids))


__all__ = ["BPE_PRE_TOKENIZERS", "GEMMA_CHAT_TEMPLATE", "build_tokenizer", "cache_key"]
