"""The tokenizer of a GGUF, rebuilt from its metadata: :func:`build_tokenizer`."""

from __future__ import annotations

import warnings

import numpy as np
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, SPMStreamingDetokenizer, TokenizerWrapper
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

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


__all__ = ["BPE_PRE_TOKENIZERS", "GEMMA_CHAT_TEMPLATE", "build_tokenizer"]
