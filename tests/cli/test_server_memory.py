"""What ``oiq-server``'s prompt cache and running sequences hold, over HTTP (``GET /v1/oiq/memory``).

Servers on 127.0.0.1 (:class:`~oiq_mlx.bench.server.ServerProcess`), the demo model, the ``4bit``
preset with a window of 16 (so that chats of 500-1000 tokens show what longer ones show with the
preset's window of 64: docs/serving.md has those), chats of one user message.  Ratios are against
float16 keys and values of the tokens held, with OIQ's full-precision rows at 2 bytes a value (a
float16 model's cache: this machine runs the model in float32).
"""

import json
import socket

import pytest

from oiq_mlx import demo_model_path, load
from oiq_mlx.bench.prompt_cache import chat, chat_texts, settled_memory, summary
from oiq_mlx.bench.server import ServerProcess, request

pytestmark = pytest.mark.slow

OIQ = ["--preset", "4bit", "--window", "16", "--prefill-step-size", "256"]


@pytest.fixture(scope="module")
def tokenizer():
    return load(demo_model_path())[1]


@pytest.mark.parametrize("mode", [[], ["--no-positional"]], ids=["positional", "no-positional"])
def test_a_chat_leaves_the_prompt_cache_at_a_third_of_fp16(tokenizer, tmp_path, mode):
    """A chat of about 1000 tokens leaves one entry, the finished chat (mlx-lm's checkpoint at the
    end of the user turn dropped, as mlx-lm drops it for caches it can trim), packed: 0.33x fp16
    or less (without positional, a copy of the live cache would hold the prompt in full precision:
    1.00x)."""
    with ServerProcess([*OIQ, *mode], log_path=tmp_path / "server.log") as srv:
        answer = chat(srv.port, chat_texts(tokenizer, 1000)[0])
        mem = settled_memory(srv.port, tokens=answer["usage"]["prompt_tokens"])
        log = srv.log()
    pc, s = mem["prompt_cache"], summary(mem)
    (finished,) = pc["items"]
    assert finished["type"] == "assistant" and finished["tokens"] > 1000
    assert s["float16_model_ratio"] == s["assistant_float16_model_ratio"] < 0.33
    assert pc["bytes"] == finished["bytes"] and pc["shared_bytes"] == 0 and pc["max_bytes"] is None
    assert mem["running"]["sequences"] == 0
    # one log line per entry: what it holds, what the sequence held, the prompt cache's total
    assert "prompt cache: user entry of" in log  # the checkpoint, inserted, then dropped by the chat
    assert f"prompt cache: assistant entry of {finished['tokens']} tokens kept" in log
    assert f"Prompt cache: 1 entry, {pc['bytes'] / 1e6:.2f} MB" in log


def test_kept_checkpoints_share_the_rows_of_the_chat(tokenizer, tmp_path):
    """With --keep-checkpoints the chat leaves two entries, the checkpoint holding the finished
    chat's packed rows as views: the two together hold 0.37x fp16 or less, where two entries of
    their own would hold about 0.63x."""
    with ServerProcess([*OIQ, "--keep-checkpoints"], log_path=tmp_path / "server.log") as srv:
        answer = chat(srv.port, chat_texts(tokenizer, 1000)[0])
        mem = settled_memory(srv.port, tokens=answer["usage"]["prompt_tokens"])
        log = srv.log()
    pc, s = mem["prompt_cache"], summary(mem)
    assert [i["type"] for i in pc["items"]] == ["user", "assistant"]
    user, finished = pc["items"]
    assert 1000 < user["tokens"] < finished["tokens"]
    assert s["user_float16_model_ratio"] < 0.33 and s["assistant_float16_model_ratio"] < 0.33
    assert user["shared_bytes"] > 0 and pc["shared_bytes"] == user["shared_bytes"]
    assert pc["fp16_bytes"] == finished["fp16_bytes"]  # the checkpoint's tokens are inside the chat
    assert s["float16_model_ratio"] <= 0.37 < 0.55 < s["unshared_float16_model_ratio"]
    assert pc["bytes"] == user["bytes"] + finished["bytes"]
    assert f"prompt cache: user entry of {user['tokens']} tokens kept" in log
    assert f"Prompt cache: 2 entries, {pc['bytes'] / 1e6:.2f} MB" in log


def test_running_sequences_are_reported_while_they_run(tokenizer, tmp_path):
    with ServerProcess([*OIQ, "--max-tokens", "64"], log_path=tmp_path / "server.log") as srv:
        # a text completion of prose: the demo model goes on for all 24 tokens
        body = json.dumps({"prompt": chat_texts(tokenizer, 100)[0], "max_tokens": 24, "stream": True,
                           "temperature": 0.0}).encode()
        with socket.create_connection(("127.0.0.1", srv.port), timeout=120) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            seen = b""
            while seen.count(b"data: ") < 3:  # a few tokens in: the sequence decodes
                chunk = sock.recv(4096)
                assert chunk, seen
                seen += chunk
            status, mem = request(srv.port, "GET", "/v1/oiq/memory")
            assert status == 200
            running = mem["running"]
            assert running["sequences"] == 1 and running["tokens"][0] >= 99 and running["bytes"] > 0
            while b"data: [DONE]" not in seen:
                chunk = sock.recv(4096)
                assert chunk, seen
                seen += chunk
        assert settled_memory(srv.port, tokens=100)["running"]["sequences"] == 0
        assert request(srv.port, "GET", "/v1/oiq/memory/")[0] == 200
        assert request(srv.port, "GET", "/v1/oiq/nothing")[0] == 404


def _fill(args, texts, tmp_path, name) -> list:
    """Each text as a chat, one after the other; the prompt cache after each."""
    out = []
    with ServerProcess([*args, "--prompt-cache-bytes", "14MB", "--prompt-cache-size", "64"],
                       log_path=tmp_path / f"{name}.log") as srv:
        for text in texts:
            answer = chat(srv.port, text)
            out.append(settled_memory(srv.port, tokens=answer["usage"]["prompt_tokens"])["prompt_cache"])
    return out


def test_the_prompt_cache_byte_bound_keeps_three_times_the_chats_of_full_precision(tokenizer, tmp_path):
    """``--prompt-cache-bytes 14MB``, chats of 232 tokens one after the other: the bound holds
    after every chat, counted at the bytes the entries hold; full precision (``--no-oiq``, float32
    on this machine: one entry of 10.7 MB a chat) keeps 1 chat, OIQ (one entry of 3.3 MB a chat)
    keeps 4, the latest (the bound with kept checkpoints: tests/mlx_lm/test_prompt_cache.py)."""
    texts = chat_texts(tokenizer, 200, n=5)
    fp = _fill(["--no-oiq"], texts[:2], tmp_path, "fp")
    oiq = _fill(OIQ, texts, tmp_path, "oiq")
    for pc in fp + oiq:
        assert pc["max_bytes"] == 14_000_000 and pc["bytes"] <= pc["max_bytes"]
        assert pc["bytes"] == sum(i["bytes"] for i in pc["items"])
    kept_fp = fp[-1]["by_type"]["assistant"]["n_sequences"]
    assert kept_fp == 1 and [pc["by_type"]["assistant"]["n_sequences"] for pc in fp] == [1, 1]
    kept = [pc["by_type"]["assistant"]["n_sequences"] for pc in oiq]
    assert kept[-1] >= 3 * kept_fp and kept == list(range(1, kept[-1] + 1)) + [kept[-1]] * (5 - kept[-1]), kept
    assert kept[-1] < 5  # the bound evicted
    # one entry a chat: the newest chats, each the whole chat
    assert [i["type"] for i in oiq[-1]["items"]] == ["assistant"] * kept[-1]
    assert all(i["tokens"] > 200 for i in oiq[-1]["items"])
