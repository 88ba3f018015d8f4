"""Measure ``oiq-server`` as clients see it: an HTTP client, a server
subprocess, concurrent load, and the KV capacity figure.

``scripts/bench_server.py`` is the front end; the tests use :class:`ServerProcess`
and :func:`complete`.  Every configuration (a name :func:`oiq_mlx.eval.specs.parse_spec` reads) is served
by the same code path (``python -m oiq_mlx.cli.server``): ``fp`` with
``--no-oiq`` (mlx-lm's batched full-precision server), ``mlx:B`` with
``--no-oiq --kv-bits B --quantized-kv-start 0`` (mlx-lm's quantized cache,
which mlx-lm serves one request at a time) and OIQ configurations.
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
from mlx.utils import tree_flatten

from ..mlx_lm import models
from ..mlx_lm.caches import end_prefill, model_head_dim
from ..mlx_lm.models import resolve_model
from ..eval.specs import parse_spec


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``python -m oiq_mlx.cli.server ARGS`` on 127.0.0.1 and a free port, as a context manager.

    Entering waits until ``/health`` answers (the model is loaded before the
    server listens); leaving sends SIGTERM, waits ``stop_timeout`` seconds and
    kills it if it is still alive.  ``stderr`` of the server goes to ``log_path``.
    ``launcher``: a command the server runs under, e.g. ``mlx.launch -n 2 ...``
    (the launcher and its ranks form one process group, signalled together).
    """

    def __init__(self, args, *, log_path, start_timeout: float = 180.0, env=None, launcher=()):
        self.args, self.log_path, self.start_timeout = list(args), Path(log_path), start_timeout
        self.launcher = list(launcher)
        self.env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
        self.port = free_port()
        self.proc = None
        self.exit_seconds = None

    def __enter__(self):
        cmd = [*self.launcher, sys.executable, "-m", "oiq_mlx.cli.server", "--host", "127.0.0.1", "--port",
               str(self.port), *self.args]
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=bool(self.launcher))
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
            self._signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.proc.wait()
            self.exit_seconds = time.monotonic() - t0
        self._log.close()

    def _signal(self, sig):
        if self.launcher:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass
        else:
            self.proc.send_signal(sig)

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
    """``oiq-server`` flags of a cache configuration name (:func:`oiq_mlx.eval.specs.parse_spec`)."""
    return parse_spec(spec).server_args()


def _kv_shape(model):
    args = model.args
    return getattr(args, "num_key_value_heads", None) or args.num_attention_heads, model_head_dim(model)


def _filled_cache(model, spec: str, tokens: int, dtype, key):
    """The server's caches for ``spec`` holding ``tokens`` random keys/values of the
    model's shapes, as a sequence holds them once it generates; and the next key."""
    n_kv, head_dim = _kv_shape(model)
    cache = parse_spec(spec).make_cache(model)
    for c in cache:
        for start in range(0, tokens, 1024):
            key, sub = mx.random.split(key)
            kv = mx.random.normal((1, n_kv, min(1024, tokens - start), head_dim), key=sub).astype(dtype)
            c.update_and_fetch(kv, kv)
            mx.eval(c.state)
    end_prefill(cache)  # exact_prefill: what the sequence holds once it generates
    mx.eval([c.state for c in cache])
    return cache, key


def _fp16_bytes(model, layers: int, tokens: int) -> int:
    n_kv, head_dim = _kv_shape(model)
    return layers * tokens * n_kv * head_dim * 2 * 2


def kv_bytes_per_sequence(model, spec: str, tokens: int, dtype, seed: int = 0) -> dict:
    """KV bytes one sequence of ``tokens`` tokens holds under ``spec``: the
    server's caches filled with random keys/values of the model's shapes
    (``dtype``, the model's compute dtype: the full-precision rows are stored in
    it), ``nbytes`` summed (allocated capacity included); ``fp16_bytes``: float16
    keys and values of the same tokens."""
    cache, _ = _filled_cache(model, spec, tokens, dtype, mx.random.key(seed))
    return {"tokens": tokens, "bytes": int(sum(c.nbytes for c in cache)), "fp16_bytes": _fp16_bytes(model, len(cache), tokens)}


def kv_bytes_in_batch(model, spec: str, tokens: int, dtype, batch: int = 8, steps: int = 16,
                      seed: int = 0) -> float | None:
    """KV bytes per sequence while ``batch`` sequences of ``tokens`` tokens decode
    together, as the server's batch holds them (mlx-lm's ``merge`` of each layer's
    caches, then ``steps`` one-token steps with attention, so that OIQ's stacked
    buffers and their spare rows are counted): the mean over the steps of the batch's
    ``nbytes`` / ``batch``, against float16 of the same tokens.  None for caches mlx-lm
    cannot batch (its quantized cache, which the server serves one request at a time)."""
    from ..mlx_lm.routing import scaled_dot_product_attention

    if not all(hasattr(c, "merge") for c in parse_spec(spec).make_cache(model)):
        return None
    key = mx.random.key(seed)
    seqs = []
    for _ in range(batch):
        cache, key = _filled_cache(model, spec, tokens, dtype, key)
        seqs.append(cache)
    layers = [type(cs[0]).merge(list(cs)) for cs in zip(*seqs)]
    del seqs
    n_kv, head_dim = _kv_shape(model)
    n_q = model.args.num_attention_heads
    ratios = []
    for step in range(1, steps + 1):
        outs = []
        for c in layers:
            key, k1, k2 = mx.random.split(key, 3)
            kv = mx.random.normal((batch, n_kv, 1, head_dim), key=k1).astype(dtype)
            q = mx.random.normal((batch, n_q, 1, head_dim), key=k2).astype(dtype)
            mask = c.make_mask(1)
            keys, values = c.update_and_fetch(kv, kv)
            outs.append(scaled_dot_product_attention(q, keys, values, c, head_dim**-0.5, mask))
        mx.eval(outs)
        held = sum(c.nbytes for c in layers) / batch
        ratios.append(held / _fp16_bytes(model, len(layers), tokens + step))
    return float(np.mean(ratios))


# -- the benchmark ------------------------------------------------------------


def _percentile(values, q):
    return float(np.percentile(values, q)) if len(values) else None


def _model_dtype(model):
    return next(v.dtype for _, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating))


def prompt_texts(tokenizer, text: str, n: int, length: int) -> list[str]:
    """``n`` different prompts of about ``length`` tokens cut from ``text``
    (different offsets, so the server's prompt cache finds no shared prefix)."""
    ids = tokenizer.encode(text)
    if len(ids) < length + n * 97:
        ids = ids * (-(-(length + n * 97) // len(ids)))
    return [tokenizer.decode(ids[i * 97 : i * 97 + length]) for i in range(n)]


def run_load(port: int, prompts, max_tokens: int) -> dict:
    """All ``prompts`` at once (streaming); aggregate and per-client figures."""
    results, wall = run_clients(port, prompts, max_tokens, stream=True)
    ok = [r for r in results if not isinstance(r, Exception)]
    failed = [repr(r) for r in results if isinstance(r, Exception)]
    # a response that ends early without a stop, or is empty, counts as corrupted
    corrupted = [i for i, r in enumerate(ok) if r.n_tokens == 0 or (r.n_tokens < max_tokens and r.finish_reason != "stop")]
    gaps = [g for r in ok for g in r.gaps]
    tokens = sum(r.n_tokens for r in ok)
    return {
        "clients": len(prompts),
        "generated_tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall if wall > 0 else None,
        "ttft_p50_s": _percentile([r.ttft for r in ok], 50),
        "ttft_p95_s": _percentile([r.ttft for r in ok], 95),
        "token_latency_p50_s": _percentile(gaps, 50),
        "token_latency_p95_s": _percentile(gaps, 95),
        "failed": failed,
        "corrupted": corrupted,
    }


def run_server_bench(*, model: str, specs, clients, lengths, max_tokens: int, kv_budget_bytes: int,
                     log_dir, memory_lengths=(4096,), progress=None, text: str | None = None,
                     batch: int = 8) -> dict:
    """Every ``spec`` served by ``oiq-server`` (one process each), loaded with
    each number of concurrent ``clients`` at each prompt length (none when
    ``clients`` or ``lengths`` is empty); plus KV bytes per sequence at
    ``memory_lengths``, alone and in a decoding batch of ``batch``, and the number
    of sequences that fit ``kv_budget_bytes``."""
    log = progress or (lambda msg: None)
    path = resolve_model(model)
    local_model, tokenizer = models.load(path)
    dtype = _model_dtype(local_model)
    text = text if text is not None else models.default_text()
    runs, memory = [], []
    for spec in specs:
        for length in sorted(set(memory_lengths)):
            kv = kv_bytes_per_sequence(local_model, spec, length, dtype)
            kv.update(spec=spec, dtype=str(dtype).split(".")[-1],
                      sequences_in_budget=kv_budget_bytes // max(1, kv["bytes"]))
            # what a float16 model (a Mac's usual) holds: its full-precision rows at 2 bytes
            half = kv if dtype == mx.float16 else kv_bytes_per_sequence(local_model, spec, length, mx.float16)
            in_batch = kv_bytes_in_batch(local_model, spec, length, mx.float16, batch=batch)
            kv.update(fp16_model_bytes=half["bytes"],
                      fp16_model_sequences_in_budget=kv_budget_bytes // max(1, half["bytes"]),
                      fp16_model_batch_ratio=in_batch, batch=batch)
            memory.append(kv)
            log(f"[{spec}] KV bytes per sequence of {length} tokens: {kv['bytes'] / kv['fp16_bytes']:.3f}x fp16 "
                f"({kv['dtype']}), {half['bytes'] / kv['fp16_bytes']:.3f}x as a float16 model"
                + (f", {in_batch:.3f}x in a batch of {batch}" if in_batch is not None else ""))
        if not (lengths and clients):
            continue  # the memory figure only
        log_path = Path(log_dir) / f"server_{spec.replace(':', '_').replace('[', '_').replace(']', '')}.log"
        with ServerProcess([*server_args(spec), "--model", path, "--max-tokens", str(max_tokens)], log_path=log_path) as srv:
            run_load(srv.port, prompt_texts(tokenizer, text, 1, 16), 2)  # warm-up
            for length in lengths:
                for n in clients:
                    t0 = time.perf_counter()
                    rec = run_load(srv.port, prompt_texts(tokenizer, text, n, length), max_tokens)
                    rec.update(spec=spec, prompt_tokens=length, peak_rss_bytes=srv.peak_rss_bytes())
                    runs.append(rec)
                    log(f"[{spec}] {n} clients x {length} tokens: {rec['tokens_per_s']:.1f} tok/s, "
                        f"TTFT p50 {rec['ttft_p50_s']:.2f} s, token p50 {1000 * (rec['token_latency_p50_s'] or 0):.0f} ms, "
                        f"failed {len(rec['failed'])}, corrupted {len(rec['corrupted'])} "
                        f"({time.perf_counter() - t0:.0f} s)")
    return {"model": model, "max_tokens": max_tokens, "kv_budget_bytes": kv_budget_bytes,
            "runs": runs, "memory": memory}


def markdown(result: dict) -> str:
    fp = {(r["prompt_tokens"], r["clients"]): r["tokens_per_s"] for r in result["runs"] if r["spec"] == "fp"}
    lines = ["| cache | clients | prompt | tok/s | vs fp | TTFT p50/p95 s | token p50/p95 ms | failed | peak RSS MiB |",
             "|---|---|---|---|---|---|---|---|---|"] if result["runs"] else []
    for r in result["runs"]:
        ref = fp.get((r["prompt_tokens"], r["clients"]))
        ratio = f"{r['tokens_per_s'] / ref:.2f}x" if ref else "-"
        lines.append(
            f"| {r['spec']} | {r['clients']} | {r['prompt_tokens']} | {r['tokens_per_s']:.1f} | {ratio} | "
            f"{r['ttft_p50_s']:.2f} / {r['ttft_p95_s']:.2f} | {1000 * (r['token_latency_p50_s'] or 0):.0f} / "
            f"{1000 * (r['token_latency_p95_s'] or 0):.0f} | {len(r['failed']) + len(r['corrupted'])} | "
            f"{(r['peak_rss_bytes'] or 0) / 2**20:.0f} |")
    mem = result["memory"]
    if not mem:
        return "\n".join(lines)
    budget = result["kv_budget_bytes"] / 2**20
    lines += [""] * bool(lines) + [
        f"| cache | tokens | KV bytes / sequence ({mem[0]['dtype']}) | vs fp16 | sequences in {budget:.0f} MiB | "
        f"as a float16 model: vs fp16 | sequences in {budget:.0f} MiB | in a batch of {mem[0]['batch']}: vs fp16 |",
        "|---|---|---|---|---|---|---|---|"]
    for m in mem:
        in_batch = m["fp16_model_batch_ratio"]
        lines.append(f"| {m['spec']} | {m['tokens']} | {m['bytes'] / 2**20:.2f} MiB | "
                     f"{m['bytes'] / m['fp16_bytes']:.3f}x | {m['sequences_in_budget']} | "
                     f"{m['fp16_model_bytes'] / m['fp16_bytes']:.3f}x | {m['fp16_model_sequences_in_budget']} | "
                     + (f"{in_batch:.3f}x |" if in_batch is not None else "- (not batched) |"))
    return "\n".join(lines)


def save_plot(result: dict, path) -> str | None:
    """Aggregate tokens/s against concurrent clients, one line per cache and prompt length
    (None without server runs, or without matplotlib)."""
    if not result["runs"]:
        return None
    try:
        import matplotlib  # noqa: PLC0415 - optional dependency

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    keys = dict.fromkeys((r["spec"], r["prompt_tokens"]) for r in result["runs"])
    for spec, length in keys:
        rs = [r for r in result["runs"] if (r["spec"], r["prompt_tokens"]) == (spec, length)]
        ax.plot([r["clients"] for r in rs], [r["tokens_per_s"] for r in rs], marker="o", label=f"{spec}, {length} tok")
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("generated tokens/s (all clients)")
    ax.set_title(f"oiq-server throughput, {result['model']}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)
