"""Small random-weight mlx-lm models and reference attention for tests."""

import mlx.core as mx
from mlx_lm.models import gemma3_text, llama


def tiny_llama(head_dim=64, n_heads=6, n_kv_heads=2, layers=2, vocab=128, seed=0):
    mx.random.seed(seed)
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=head_dim * n_heads,
        num_hidden_layers=layers,
        intermediate_size=128,
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=1e-5,
        vocab_size=vocab,
        rope_theta=10000.0,
        tie_word_embeddings=True,
    )
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


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
    return model


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
