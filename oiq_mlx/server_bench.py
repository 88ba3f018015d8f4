"""Measure ``oiq-server`` as clients see it: an HTTP client, a server
subprocess, concurrent load, and the KV capacity figure.

``scripts/bench_server.py`` is the front end; the tests use :class:`ServerProcess`
and :func:`complete`.  Every configuration is served by the same code path
(``python -m oiq_mlx.server``): ``fp`` with ``--no-oiq`` (mlx-lm's batched
full-precision server), ``mlx:B`` with ``--no-oiq --kv-bits B`` (mlx-lm's
quantized cache, which mlx-lm serves one request at a time) and OIQ presets.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import QuantizedKVCache, make_prompt_cache

from .config import OIQConfig
from .integration import make_oiq_cache


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``python -m oiq_mlx.server ARGS`` on 127.0.0.1 and a free port, as a context manager.

    Entering waits until ``/health`` answers (the model is loaded before the
    server listens); leaving sends SIGTERM, waits ``stop_timeout`` seconds and
    kills it if it is still alive.  ``stderr`` of the server goes to ``log_path``.
    """

    def __init__(self, args, *, log_path, start_timeout: float = 180.0, env=None):
        self.args, self.log_path, self.start_timeout = list(args), Path(log_path), start_timeout
        self.env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
        self.port = free_port()
        self.proc = None
        self.exit_seconds = None

    def __enter__(self):
        cmd = [sys.executable, "-m", "oiq_mlx.server", "--host", "127.0.0.1", "--port", str(self.port), *self.args]
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=self.env)
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"oiq-server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if request(self.port, "GET", "/health", timeout=2)[0] == 200:
                    return self
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"oiq-server did not answer /health in {self.start_timeout} s:\n{self.log()}")

    def __exit__(self, *exc):
        self.stop()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 10.0):
        """SIGTERM, then SIGKILL after ``timeout`` s; records ``exit_seconds``."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            t0 = time.monotonic()
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.exit_seconds = time.monotonic() - t0
        self._log.close()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def peak_rss_bytes(self) -> int | None:
        """Peak resident memory of the server process (Linux ``VmHWM``), None elsewhere."""
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            return None
        return None


def request(port: int, method: str, path: str, body=None, *, timeout: float = 300, raw: bytes | None = None):
    """One HTTP request; returns ``(status, parsed JSON or text)``."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        headers = {"Content-Type": "application/json"} if data is not None else {}
        conn.request(method, path, body=data, headers=headers)
        resp = conn.getresponse()
        text = resp.read().decode(errors="replace")
        try:
            return resp.status, json.loads(text)
        except json.JSONDecodeError:
            return resp.status, text
    finally:
        conn.close()


@dataclasses.dataclass
class Completion:
    text: str
    tokens: list | None          # token ids (non-streaming requests)
    n_tokens: int
    finish_reason: str | None
    ttft: float                  # seconds to the first generated text (streaming) or the answer
    total: float
    gaps: list                   # seconds between streamed events


def complete(port: int, prompt: str, max_tokens: int, *, stream: bool = False, chat: bool = False,
             timeout: float = 600) -> Completion:
    """A greedy completion request (``temperature`` 0); raises ``RuntimeError`` on a non-200 answer."""
    body = {"max_tokens": max_tokens, "temperature": 0.0, "stream": stream}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = prompt
        path = "/v1/completions"
    if stream:
        body["stream_options"] = {"include_usage": True}
    else:
        body["logprobs"] = True
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    t0 = time.perf_counter()
    try:
        conn.request("POST", path, body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read().decode(errors='replace')}")
        if not stream:
            out = json.loads(resp.read())
            total = time.perf_counter() - t0
            choice = out["choices"][0]
            text = choice["message"]["content"] if chat else choice["text"]
            tokens = [t["id"] for t in choice.get("logprobs", {}).get("content", [])]
            return Completion(text, tokens, out["usage"]["completion_tokens"], choice["finish_reason"], total, total, [])
        text, times, usage, finish = [], [], None, None
        for line in resp:
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            payload = line[6:]
            if payload == b"[DONE]":
                break
            event = json.loads(payload)
            if event.get("usage") and not event.get("choices"):
                usage = event["usage"]
                continue
            choice = event["choices"][0]
            piece = choice.get("delta", {}).get("content") if chat else choice.get("text")
            if piece:
                text.append(piece)
                times.append(time.perf_counter() - t0)
            finish = choice.get("finish_reason") or finish
        total = time.perf_counter() - t0
        n = usage["completion_tokens"] if usage else len(times)
        return Completion("".join(text), None, n, finish, times[0] if times else total, total, list(np.diff(times)))
    finally:
        conn.close()


def run_clients(port: int, prompts, max_tokens: int, *, stream: bool = True, chat: bool = False):
    """Send ``prompts`` at once, one thread each; returns ``(completions or exceptions, wall seconds)``."""
    results = [None] * len(prompts)

    def work(i, p):
        try:
            results[i] = complete(port, p, max_tokens, stream=stream, chat=chat)
        except Exception as e:  # noqa: BLE001 - counted as a failed response by the caller
            results[i] = e

    threads = [threading.Thread(target=work, args=(i, p)) for i, p in enumerate(prompts)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, time.perf_counter() - t0


# -- configurations ---------------------------------------------------------


def server_args(spec: str) -> list:
    """``oiq-server`` flags of a cache configuration name.

    ``fp``: ``--no-oiq`` (mlx-lm's full-precision batched server);
    ``mlx:B``: ``--no-oiq --kv-bits B`` (mlx-lm's quantized cache, served one
    request at a time); ``preset:NAME`` or ``preset:NAME[field=value,...]``:
    ``--preset NAME --field value ...`` (OIQ).
    """
    if spec == "fp":
        return ["--no-oiq"]
    if spec.startswith("mlx:"):
        bits = spec[4:]
        if not bits.isdigit():
            raise ValueError(f"cache configuration {spec!r}: mlx:B needs integer bits")
        return ["--no-oiq", "--kv-bits", bits]
    if spec.startswith("preset:"):
        name, _, fields = spec[7:].partition("[")
        args = ["--preset", name]
        if fields:
            if not fields.endswith("]"):
                raise ValueError(f"cache configuration {spec!r}: unclosed '['")
            for item in filter(None, fields[:-1].split(",")):
                key, eq, value = item.partition("=")
                if not eq:
                    raise ValueError(f"cache configuration {spec!r}: {item!r} is not field=value")
                args += [f"--{key.strip().replace('_', '-')}", value.strip()]
        return args
    raise ValueError(f"unknown cache configuration {spec!r}: use fp, mlx:B or preset:NAME[field=value,...]")


def spec_cache(model, spec: str) -> list:
    """A one-sequence cache of ``model`` as the server builds it for ``spec``."""
    args = server_args(spec)
    if spec == "fp":
        return make_prompt_cache(model)
    if spec.startswith("mlx:"):
        return [QuantizedKVCache(group_size=64, bits=int(args[2])) if type(c).__name__ == "KVCache" else c
                for c in make_prompt_cache(model)]
    preset, fields = args[1], dict(zip(args[2::2], args[3::2]))
    overrides = {k[2:].replace("-", "_"): _number(v) for k, v in fields.items()}
    return make_oiq_cache(model, OIQConfig.preset(preset, **overrides))


def _number(text: str):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def kv_bytes_per_sequence(model, spec: str, tokens: int, dtype, seed: int = 0) -> dict:
    """KV bytes one sequence of ``tokens`` tokens holds under ``spec``: the
    server's caches filled with random keys/values of the model's shapes
    (``dtype``, the model's compute dtype), ``nbytes`` summed (allocated
    capacity included); ``fp16``: float16 keys and values of the same tokens."""
    args = model.args
    n_kv = getattr(args, "num_key_value_heads", None) or args.num_attention_heads
    head_dim = getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads
    cache = spec_cache(model, spec)
    key = mx.random.key(seed)
    for c in cache:
        for start in range(0, tokens, 1024):
            key, sub = mx.random.split(key)
            kv = mx.random.normal((1, n_kv, min(1024, tokens - start), head_dim), key=sub).astype(dtype)
            c.update_and_fetch(kv, kv)
            mx.eval(c.state)
    fp16 = len(cache) * tokens * n_kv * head_dim * 2 * 2
    return {"tokens": tokens, "bytes": int(sum(c.nbytes for c in cache)), "fp16_bytes": fp16}
