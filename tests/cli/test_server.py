"""``oiq-server`` as a subprocess on 127.0.0.1, talked to over HTTP.

Two servers (OIQ 4bit and K8V8, window 16 so that short prompts reach the
packed segment; positional, the server's default) and in-process references run
one sequence at a time with the same cache configuration, as ``oiq-generate
--positional`` runs them.
"""

import json
import socket

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from oiq_mlx import OIQConfig, demo_model_path, load, make_oiq_cache
from oiq_mlx.cli.server import build_parser, server_config
from oiq_mlx.cli.server import main as server_main
from oiq_mlx.bench.server import ServerProcess, complete, request, run_clients

pytestmark = pytest.mark.slow

WORDS = ("the keeper climbed the stair at dusk and lit the lamp while the sea rolled grey "
         "under a low sky and gulls wheeled over the rocks by the harbour wall").split()
MAX_TOKENS = 6
CFG_4BIT = OIQConfig.preset("4bit", window=16, positional=True)
CFG_K8V8 = OIQConfig(k_bits=8, v_bits=8, window=16, positional=True)


def _prompt(n_words: int, start: int = 0) -> str:
    return " ".join(WORDS[(start + i) % len(WORDS)] for i in range(n_words))


# eight prompts of 6 .. 90 words: some stay in the window, most reach the packed segment
PROMPTS = [_prompt(n, start=i) for i, n in enumerate((6, 12, 20, 31, 44, 58, 73, 90))]


@pytest.fixture(scope="module")
def demo():
    return load(demo_model_path())


def _greedy(model, tokenizer, prompt: str, cache, n: int = MAX_TOKENS) -> list:
    out = []
    for (tok, _), _ in zip(generate_step(mx.array(tokenizer.encode(prompt)), model, prompt_cache=cache), range(n)):
        out.append(int(tok))
        if tok in tokenizer.eos_token_ids:
            break
    return out


@pytest.fixture(scope="module")
def server_4bit(tmp_path_factory):
    log = tmp_path_factory.mktemp("srv") / "oiq4.log"
    with ServerProcess(["--preset", "4bit", "--window", "16", "--max-tokens", "64"], log_path=log) as s:
        yield s


@pytest.fixture(scope="module")
def server_k8v8(tmp_path_factory):
    log = tmp_path_factory.mktemp("srv") / "k8v8.log"
    with ServerProcess(["--k-bits", "8", "--v-bits", "8", "--window", "16"], log_path=log) as s:
        yield s


def _tokens(results):
    bad = [r for r in results if isinstance(r, Exception)]
    assert not bad, bad
    return [r.tokens for r in results]


def test_concurrent_clients_equal_one_at_a_time(server_4bit, demo):
    model, tokenizer = demo
    assert "continuous batching on" in server_4bit.log()
    want = [_greedy(model, tokenizer, p, make_oiq_cache(model, CFG_4BIT)) for p in PROMPTS]
    results, _ = run_clients(server_4bit.port, PROMPTS, MAX_TOKENS, stream=False)
    assert _tokens(results) == want
    # streaming, concurrently again: the same text; these requests also reuse
    # the prompt cache the first round left (the prompts are prefixes of its entries)
    streamed, _ = run_clients(server_4bit.port, PROMPTS[:4], MAX_TOKENS, stream=True)
    assert [r.text for r in streamed] == [r.text for r in results[:4]]
    assert all(r.n_tokens == len(w) for r, w in zip(streamed, want))


def test_prefix_reuse_gives_what_a_fresh_cache_gives(server_4bit, demo):
    model, tokenizer = demo
    shared = _prompt(70, start=5)
    first = complete(server_4bit.port, shared + " and the boats", MAX_TOKENS)
    second_prompt = shared + " while a ship"
    status, body = request(server_4bit.port, "POST", "/v1/completions", {
        "prompt": second_prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "logprobs": True})
    assert status == 200, body
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] > 60  # the shared prefix was reused
    got = [t["id"] for t in body["choices"][0]["logprobs"]["content"]]
    assert got == _greedy(model, tokenizer, second_prompt, make_oiq_cache(model, CFG_4BIT))
    assert first.n_tokens > 0


def test_k8v8_equals_full_precision(server_k8v8, demo):
    model, tokenizer = demo
    fp = [_greedy(model, tokenizer, p, make_prompt_cache(model)) for p in PROMPTS[::2]]
    k8 = [_greedy(model, tokenizer, p, make_oiq_cache(model, CFG_K8V8)) for p in PROMPTS[::2]]
    results, _ = run_clients(server_k8v8.port, PROMPTS[::2], MAX_TOKENS, stream=False)
    assert _tokens(results) == k8 == fp


def test_client_disconnecting_mid_stream_leaves_the_server_serving(server_4bit):
    body = json.dumps({"prompt": PROMPTS[3], "max_tokens": 60, "stream": True, "temperature": 0.0}).encode()
    with socket.create_connection(("127.0.0.1", server_4bit.port), timeout=120) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        seen = b""
        while b"data: " not in seen:
            chunk = sock.recv(4096)
            assert chunk, seen
            seen += chunk
        assert seen.startswith(b"HTTP/1.0 200") or seen.startswith(b"HTTP/1.1 200")
    ok = complete(server_4bit.port, PROMPTS[1], MAX_TOKENS)
    assert ok.n_tokens > 0 and server_4bit.alive()


def test_bad_requests_get_4xx_and_the_server_stays_up(server_4bit):
    port = server_4bit.port
    status, body = request(port, "POST", "/v1/completions", raw=b'{"prompt": "hi", ')
    assert status == 400 and "Invalid JSON" in body["error"]
    status, body = request(port, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": -3})
    assert status == 400 and "max_tokens" in body["error"]
    status, body = request(port, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2, "model": "no-such-model"})
    assert 400 <= status < 500 and "unknown model 'no-such-model'" in body["error"]
    status, body = request(port, "POST", "/v1/completions", {"prompt": "sea " * 9000, "max_tokens": 2})
    assert 400 <= status < 500 and "context is 8192 tokens" in body["error"]
    assert request(port, "GET", "/health")[0] == 200
    assert complete(port, PROMPTS[0], 2).n_tokens == 2


def test_sigterm_stops_the_server_within_seconds(tmp_path):
    server = ServerProcess(["--preset", "2bit"], log_path=tmp_path / "stop.log")
    with server:
        assert complete(server.port, PROMPTS[0], 2).n_tokens == 2
    assert server.proc.returncode == 0, server.log()
    assert server.exit_seconds < 5


def test_server_caches_are_positional_unless_asked_not_to_be():
    def config(*argv):
        return server_config(build_parser().parse_known_args(list(argv))[0])

    assert config("--preset", "3bit") == OIQConfig.preset("3bit", positional=True)
    assert config("--preset", "3bit", "--no-positional") == OIQConfig.preset("3bit")
    assert config("--no-oiq") is None
    # exact_prefill makes what is stored depend on the chunks: only without positional
    assert config("--no-positional", "--exact-prefill", "4096") == OIQConfig(exact_prefill=4096)
    with pytest.raises(ValueError, match="--exact-prefill needs --no-positional"):
        config("--exact-prefill", "4096")


def test_bad_server_options_fail_before_serving(capsys):
    assert server_main(["--kv-bits", "4"]) == 2
    assert "--kv-bits selects mlx-lm's own quantized cache; add --no-oiq" in capsys.readouterr().err
    assert server_main(["--preset", "9bit"]) == 2
    assert "unknown OIQ preset '9bit'" in capsys.readouterr().err


def _chat_tokens(port, messages, max_tokens=MAX_TOKENS):
    status, body = request(port, "POST", "/v1/chat/completions", {
        "messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "logprobs": True})
    assert status == 200, body
    content = body["choices"][0]["logprobs"]["content"]
    return ([(t["id"], t["logprob"]) for t in content],
            body["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0))


def test_system_prompt_reuse(server_4bit, tmp_path):
    """A chat that shares its system prompt with an earlier, finished one reuses it.  By default
    (one entry per chat, as mlx-lm) it continues from the finished chat trimmed back, deeper than
    the trim reserve: the window rows before the cut are read packed, so its log-probabilities are
    close to a fresh server's, not the same.  With --keep-checkpoints it continues from the
    checkpoint saved at the end of that segment, the state a fresh server reaches there: the same
    greedy tokens with the same log-probabilities."""
    system = {"role": "system", "content": "You are a lighthouse keeper. " + _prompt(60, start=3)}
    first = [system, {"role": "user", "content": "Where do the boats go at night? " + _prompt(20, start=9)}]
    second = [system, {"role": "user", "content": "What did the captain say?"}]
    with ServerProcess(["--preset", "4bit", "--window", "16", "--max-tokens", "64"],
                       log_path=tmp_path / "fresh.log") as fresh:
        want, cached = _chat_tokens(fresh.port, second)
        assert cached == 0
    _chat_tokens(server_4bit.port, first, max_tokens=24)
    got, cached = _chat_tokens(server_4bit.port, second)
    assert cached > 60  # the system prompt came from the first chat
    n = 8  # greedy tokens could part ways later on
    assert [t for t, _ in got[:n]] == [t for t, _ in want[:n]]
    # measured: at most 0.09 apart (6 tokens); the same tokens, not the same numbers
    np.testing.assert_allclose([p for _, p in got[:n]], [p for _, p in want[:n]], rtol=0, atol=0.25)
    assert max(abs(p - q) for (_, p), (_, q) in zip(got, want)) > 1e-6
    with ServerProcess(["--preset", "4bit", "--window", "16", "--max-tokens", "64", "--keep-checkpoints"],
                       log_path=tmp_path / "keep.log") as keep:
        _chat_tokens(keep.port, first, max_tokens=24)
        got, cached = _chat_tokens(keep.port, second)
    assert cached > 60  # the system prompt came from the checkpoint
    assert [t for t, _ in got] == [t for t, _ in want]
    np.testing.assert_allclose([p for _, p in got], [p for _, p in want], rtol=0, atol=1e-6)
