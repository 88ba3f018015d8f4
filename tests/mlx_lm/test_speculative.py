"""Speculative decoding through mlx-lm's own ``speculative_generate_step`` (what ``generate``
runs with a draft model): the main model's verify calls write
several tokens at a time, so no one-token call ends ``exact_prefill``; the ``trim`` mlx-lm makes
after each verify call does, and the prompt is packed from then on (it stayed in full precision,
1.0x fp16, up to ``exact_prefill`` tokens)."""

import mlx.core as mx
from mlx_lm.generate import speculative_generate_step

from helpers import tiny_llama
from oiq_mlx import OIQConfig, OIQKVCache, kv_memory, make_oiq_cache


def _speculate(config):
    model, draft = tiny_llama(vocab=256, layers=2, seed=0), tiny_llama(vocab=256, layers=1, seed=1)
    tokens = [int(t) for t in mx.random.randint(0, 256, (400,), key=mx.random.key(3)).tolist()]
    cache = make_oiq_cache(model, config)
    steps = speculative_generate_step(mx.array(tokens), model, draft, num_draft_tokens=3, max_tokens=12,
                                      prompt_cache=cache + make_oiq_cache(draft))
    assert len(list(steps)) == 12
    return cache


def test_speculative_decoding_packs_the_prompt_after_the_first_verify_call():
    cache = _speculate(OIQConfig.preset("4bit"))
    layers = [c for c in cache if isinstance(c, OIQKVCache)]
    assert layers and all(not c.prefilling for c in layers)
    # everything but the sinks and the full-precision rows (window, trim reserve, a pending block) is packed
    assert all(c.q_end - c.config.sink_tokens >= c.offset - 64 - 16 - 16 - 4 for c in layers)
    # and it holds what a cache that packs as it goes (no exact_prefill) holds after the same run:
    # 0.72x the fp16 bytes here (a float32 model, 96 full-precision rows of 411 tokens per head)
    assert kv_memory(cache) == kv_memory(_speculate(OIQConfig.preset("4bit", exact_prefill=0)))
