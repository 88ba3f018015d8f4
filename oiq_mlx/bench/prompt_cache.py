"""What ``oiq-server``'s prompt cache holds after chats, read from ``GET /v1/oiq/memory``.

``scripts/bench_prompt_cache.py`` is the front end; ``tests/cli/test_server_memory.py`` uses
:func:`chat_texts`, :func:`chat`, :func:`settled_memory` and :func:`summary`.  Each configuration runs in a
server of its own (:class:`~oiq_mlx.bench.server.ServerProcess`), one chat per length, each
a single user message of about that many tokens, each finished chat (and its checkpoint, with
``--keep-checkpoints``) staying in the prompt cache.  Ratios are against float16 keys and values of the tokens held
(``fp16_bytes``: a checkpoint inside a finished chat counted once, as mlx-lm keeps a float16
cache), with full-precision rows at 2 bytes a value (``float16_model_bytes``: what a float16
model, a Mac's usual, holds; this machine runs the model in float32).
"""

from __future__ import annotations

import time
from pathlib import Path

from ..mlx_lm import models
from ..mlx_lm.models import resolve_model
from .server import ServerProcess, request


def chat_texts(tokenizer, length: int, n: int = 1, text: str | None = None) -> list[str]:
    """``n`` different texts of about ``length`` tokens (consecutive slices of ``text``, by default
    the package's text), repeated when it is too short."""
    ids = tokenizer.encode(text if text is not None else models.default_text())
    while len(ids) < length * n:
        ids = ids + ids
    return [tokenizer.decode(ids[i * length : (i + 1) * length]) for i in range(n)]


def chat(port: int, content: str, max_tokens: int = 2) -> dict:
    """One greedy chat request with one user message; returns the answer (raises on a non-200)."""
    status, body = request(port, "POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0.0})
    if status != 200:
        raise RuntimeError(f"HTTP {status}: {body}")
    return body


def settled_memory(port: int, finished: int = 1, tokens: int = 0, timeout: float = 30.0) -> dict:
    """``GET /v1/oiq/memory`` once no sequence runs and the prompt cache holds ``finished``
    finished sequences (entries of type ``assistant``), the latest of more than ``tokens``
    tokens (mlx-lm answers a request just before it inserts the finished sequence)."""
    deadline = time.monotonic() + timeout
    while True:
        status, mem = request(port, "GET", "/v1/oiq/memory")
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {mem}")
        pc = mem["prompt_cache"]
        last = pc["items"][-1] if pc["items"] else {}
        done = (pc["by_type"]["assistant"]["n_sequences"] >= finished and last.get("type") == "assistant"
                and last["tokens"] > tokens)
        if done and not (mem["running"] or {}).get("sequences"):
            return mem
        if time.monotonic() > deadline:
            raise TimeoutError(f"the prompt cache did not settle in {timeout} s: {mem}")
        time.sleep(0.1)


def summary(mem: dict) -> dict:
    """Ratios of a ``/v1/oiq/memory`` answer's prompt cache to float16: all in, without sharing
    (each entry holding its packed rows itself), and per entry type (as a float16 model)."""
    pc = mem["prompt_cache"]
    fp16 = max(1, pc["fp16_bytes"])
    out = {"entries": pc["entries"], "bytes": pc["bytes"], "fp16_bytes": pc["fp16_bytes"],
           "ratio": pc["bytes"] / fp16, "float16_model_ratio": pc["float16_model_bytes"] / fp16,
           "unshared_float16_model_ratio": (pc["float16_model_bytes"] + pc["shared_bytes"]) / fp16}
    for item in pc["items"]:
        out[f"{item['type']}_tokens"] = item["tokens"]
        out[f"{item['type']}_float16_model_ratio"] = item["float16_model_bytes"] / max(1, item["fp16_bytes"])
    return out


def run_prompt_cache_bench(*, configs: dict, lengths, model: str = "demo", log_dir, progress=None) -> list[dict]:
    """For each ``name: server arguments`` of ``configs`` and each length: one chat of about
    ``length`` tokens in a fresh server, and :func:`summary` of its prompt cache afterwards."""
    log = progress or (lambda msg: None)
    path = resolve_model(model)
    _, tokenizer = models.load(path)
    rows = []
    for name, args in configs.items():
        for length in lengths:
            log_path = Path(log_dir) / f"prompt_cache_{name}_{length}.log"
            with ServerProcess(["--model", path, *args], log_path=log_path) as srv:
                t0 = time.perf_counter()
                answer = chat(srv.port, chat_texts(tokenizer, length)[0])
                mem = settled_memory(srv.port, tokens=answer["usage"]["prompt_tokens"])
                row = {"config": name, "args": " ".join(args), "length": length, **summary(mem),
                       "seconds": time.perf_counter() - t0, "memory": mem}
            rows.append(row)
            log(f"[{name}] {length} tokens: prompt cache {row['float16_model_ratio']:.3f}x fp16 as a float16 model "
                f"({row['unshared_float16_model_ratio']:.3f}x without sharing), {row['seconds']:.0f} s")
    return rows


def markdown(rows: list[dict]) -> str:
    """One line per server and chat: the finished chat's entry, what the checkpoint holds itself,
    the two together, and the two had each held its packed rows itself (as a float16 model)."""
    lines = ["| server | tokens in the chat | finished chat | checkpoint (shared rows left out) | "
             "prompt cache, all in | without sharing |", "|---|---|---|---|---|---|"]
    for r in rows:
        checkpoint = r.get("user_float16_model_ratio")
        lines.append(f"| `oiq-server {r['args']}` | {r.get('assistant_tokens', r['length'])} | "
                     f"{r['assistant_float16_model_ratio']:.3f}x | "
                     + ("dropped (the chat is trimmed back)" if checkpoint is None else f"{checkpoint:.3f}x")
                     + f" | {r['float16_model_ratio']:.3f}x | {r['unshared_float16_model_ratio']:.3f}x |")
    return "\n".join(lines)
