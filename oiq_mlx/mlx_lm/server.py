"""``oiq-server``: mlx-lm's OpenAI-compatible server with OIQ KV caches, batching kept on.

HTTP (``/v1/chat/completions``, ``/v1/completions``, streaming), continuous
batching, the prompt cache, every flag and default are ``mlx_lm.server``'s
own.  oiq_mlx supplies caches and models through these hooks, checked against
mlx-lm 0.32.2:

* each loaded model gets a ``make_cache`` returning OIQ caches.
  ``make_prompt_cache`` defers to it, so the batch generator's new caches, the
  sequential path's caches and the server's batchability test (``merge`` on
  every cache) all see :class:`~oiq_mlx.cache.OIQKVCache`, whose ``merge``
  gives a :class:`~oiq_mlx.cache.batch.BatchOIQKVCache`: batching stays on
  (``kv_bits`` stays None);
* ``mlx_lm.server.load``, the name ``ModelProvider`` loads with, becomes
  :func:`load_model`, which also takes ``demo``, ``gemma3`` and ``.gguf`` files
  and installs that ``make_cache``;
* under ``mlx.launch`` with more than one rank, ``mlx_lm.server.sharded_load``
  becomes :func:`sharded_load_model`: the model is loaded whole (by
  :func:`load_model`), sharded by :func:`oiq_mlx.mlx_lm.sharding.shard_model`
  (``--pipeline`` as in mlx-lm, else tensor parallel), and its caches hold
  this rank's heads or layers with the unsharded layer numbers;
* ``mlx_lm.server.run`` becomes :func:`run`: it serves with
  :class:`OIQModelProvider`, :class:`OIQResponseGenerator` and
  :class:`OIQAPIHandler`, which answer a bad request at once with a status and
  a message (mlx-lm answers 404 to most, some only after the running batch):
  400 for empty ``messages``, an empty prompt, a prompt past the model's context
  or a ``max_tokens`` past what the context leaves (the server's default
  ``--max-tokens`` is cut to it instead); 404 for a name that names no model
  (before mlx-lm would drop the loaded model); 409 for another model while the
  loaded one answers requests; any name of the loaded model, or none, joins
  the running batch.  It listens with a backlog of 128 (socketserver's 5 resets
  clients that connect together) and turns SIGTERM into mlx-lm's own shutdown
  path (``KeyboardInterrupt``);
* the prompt cache is :class:`~oiq_mlx.mlx_lm.prompt_cache.OIQPromptCache`,
  mlx-lm's ``LRUPromptCache`` keeping the segment checkpoints of OIQ caches,
  trimming them only exactly, holding packed entries that share rows, and
  bounded by ``--prompt-cache-bytes`` at every insertion;
* ``GET /v1/oiq/memory`` (:class:`OIQAPIHandler`) reports what the prompt cache
  and the running sequences' caches hold (:class:`OIQBatchGenerator`, which
  ``mlx_lm.server`` builds in place of ``BatchGenerator``).

The caches are ``positional`` (:class:`~oiq_mlx.core.config.OIQConfig`) unless
``--no-positional``: what a sequence stores and attends to then depends only on
its tokens, so a request served from a cached prefix gets what a fresh cache
would give it, and batching or chunking never changes an answer.

The prompt cache holds OIQ caches, packed and compact
(:func:`~oiq_mlx.cache.entries.packed_entry`), counted by the bytes they hold;
no dequantized float copy is kept.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import signal
import sys
import threading
import time
import warnings
from http.server import ThreadingHTTPServer
from pathlib import Path

import mlx.core as mx
import mlx_lm.server as _server
import mlx_lm.utils
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import KVCache

from . import sharding as distributed, models
from ..core.config import OIQConfig
from .caches import make_oiq_cache
from .models import resolve_model
from .prompt_cache import OIQPromptCache

_MLX_LOAD = mlx_lm.utils.load
# tokens of the forward pass whose per-rank KV bytes a sharded server reports at start
KV_PROBE_TOKENS = 256


def use_oiq_caches(model, config: OIQConfig, layout: distributed.ShardLayout | None = None):
    """Make ``model.make_cache()`` (hence mlx-lm's ``make_prompt_cache``) return OIQ caches.

    The model's own cache kinds are kept (see :func:`make_oiq_cache`); with
    ``layout`` (a sharded model) the caches are this rank's
    (:func:`oiq_mlx.mlx_lm.sharding.make_cache`).  Raises ``ValueError`` when
    ``config`` does not fit the model.
    """
    own = getattr(model, "make_cache", None)
    build = make_oiq_cache if layout is None else functools.partial(distributed.make_cache, layout=layout)

    def base():
        return own() if own is not None else [KVCache() for _ in model.layers]

    def make_cache():
        # which layers stay full precision is said once, below; not per request
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return build(model, config, base=base())

    build(model, config, base=base())
    make_cache.oiq_config = config
    model.make_cache = make_cache
    return model


def load_model(path_or_repo, adapter_path=None, tokenizer_config=None, return_config=False, *,
               config: OIQConfig | None, dequantize: bool | None, **kwargs):
    """``mlx_lm.utils.load`` for the server: also ``demo``, ``gemma3`` and ``.gguf``
    files; with ``config`` the model's caches are OIQ (:func:`use_oiq_caches`)."""
    path = resolve_model(str(path_or_repo))
    if Path(path).suffix.lower() == ".gguf":
        if adapter_path is not None:
            raise ValueError("adapters apply to mlx-lm models, not .gguf files")
        if tokenizer_config and tokenizer_config.get("chat_template"):
            raise ValueError("--chat-template applies to mlx-lm models, not .gguf files")
        model, tokenizer = models.load(path, dequantize=dequantize)
        model_config = {}
    else:
        model, tokenizer, model_config = _MLX_LOAD(
            path, adapter_path=adapter_path, tokenizer_config=tokenizer_config, return_config=True, **kwargs
        )
    if config is not None:
        use_oiq_caches(model, config)
    return (model, tokenizer, model_config) if return_config else (model, tokenizer)


def sharded_load_model(path_or_repo, pipeline_group=None, tensor_group=None, return_config=False, *,
                       tokenizer_config=None, trust_remote_code=False, config: OIQConfig | None,
                       dequantize: bool | None):
    """``mlx_lm.utils.sharded_load`` (as mlx-lm 0.32.2's server calls it) for the
    server under ``mlx.launch``: the model is loaded whole on every rank, then
    sharded in place over the group, pipeline when mlx-lm's ``--pipeline`` gave a
    pipeline group, else tensor parallel; a model that cannot be sharded so is
    refused with its name (:func:`oiq_mlx.mlx_lm.sharding.shard_model`)."""
    model, tokenizer, model_config = load_model(
        path_or_repo, tokenizer_config=tokenizer_config, return_config=True, config=None, dequantize=dequantize,
        trust_remote_code=trust_remote_code,
    )
    group = pipeline_group if pipeline_group is not None else tensor_group
    sharding = "pipeline" if pipeline_group is not None else "tensor"
    layout = distributed.shard_model(model, sharding, group, name=str(path_or_repo))
    # the sharded weights are lazy slices made on this thread's stream: evaluate them
    # here, as mlx-lm's sharded_load does, before the generation thread uses them
    mx.eval(model.parameters())
    logging.info("oiq_mlx: %s", layout.describe())
    model.oiq_layout = layout
    if config is not None:
        use_oiq_caches(model, config, layout)
    return (model, tokenizer, model_config) if return_config else (model, tokenizer)


class OIQModelProvider(_server.ModelProvider):
    def request_key(self, model_path, adapter_path=None, draft_model_path=None) -> tuple:
        """The ``model_key`` (model, adapter, draft) a request naming these loads: the
        names mapped as ``ModelProvider.load`` maps them (``default_model``, a request
        without ``model``, is ``--model``), the model name resolved
        (:func:`~oiq_mlx.mlx_lm.models.resolve_model`), so that every name of the
        served model gives its key.  Raises ``ValueError`` / ``FileNotFoundError``
        for a name that names no model."""
        adapter_path = self._adapter_map.get(model_path, adapter_path)
        model_path = self._model_map.get(model_path, model_path)
        draft_model_path = self._draft_model_map.get(draft_model_path, draft_model_path)
        return resolve_model(model_path, install=False), adapter_path, draft_model_path

    def load(self, model_path, adapter_path=None, draft_model_path=None):
        # mlx-lm resets the loaded model before loading another: refuse bad
        # names first, so that a typo does not unload the served model
        return super().load(*self.request_key(model_path, adapter_path, draft_model_path))

    def served_name(self, key=None) -> str:
        """The model of ``key`` (default: the loaded one) as a client may name it:
        ``--model`` for the default model."""
        key = self.model_key if key is None else key
        if key is None or key == self.request_key("default_model", None, "default_model"):
            return str(self.cli_args.model)
        return str(key[0])


def context_length(model) -> int | None:
    value = getattr(getattr(model, "args", None), "max_position_embeddings", None)
    return int(value) if value else None


class RequestError(ValueError):
    """A request the server refuses, with the HTTP status to answer it with."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class DefaultMaxTokens(int):
    """``max_tokens`` of a request that gave none: the server's ``--max-tokens``."""


def check_lengths(n_prompt: int, args, limit: int | None) -> None:
    """Refuse a prompt that leaves no room in the model's context (``limit`` tokens,
    prompt and generated tokens together), and a ``max_tokens`` the request asked for
    past what the context leaves; the server's default ``--max-tokens`` is cut to it.

    mlx-lm has no convention here (it generates past the context); OpenAI's API, which
    the server follows, answers 400 when a request's ``max_tokens`` does not fit (so
    does vLLM), and a request that asked for nothing should not fail for the server's
    default: that one is clamped, as vLLM clamps its own default."""
    if n_prompt == 0:
        raise RequestError(400, "the prompt is empty: it gives no tokens to start from")
    if limit is None:
        return
    if n_prompt >= limit:
        raise RequestError(400, f"the prompt has {n_prompt} tokens; the model's context is {limit} tokens "
                                "(prompt and generated tokens together)")
    room = limit - n_prompt
    if args.max_tokens > room:
        if isinstance(args.max_tokens, DefaultMaxTokens):
            args.max_tokens = DefaultMaxTokens(room)
        else:
            raise RequestError(400, f"max_tokens is {args.max_tokens}, but the prompt has {n_prompt} tokens and "
                                    f"the model's context is {limit} tokens (prompt and generated tokens "
                                    f"together): at most {room} tokens can be generated")


class OIQBatchGenerator(BatchGenerator):
    """mlx-lm's ``BatchGenerator`` that reports, from the generation thread, what its sequences'
    caches hold: ``report(dict)`` after a step that changed which sequences run, at most every
    ``interval`` seconds otherwise, and ``report(None)`` once closed."""

    interval = 0.5

    def __init__(self, *args, report=None, **kwargs):
        super().__init__(*args, **kwargs)
        self._report, self._reported = report, (None, 0.0)

    def running(self) -> dict:
        """``sequences``, ``tokens`` (each sequence's, waiting, prefilling or decoding) and
        ``bytes``: what their caches hold together (mlx-lm's ``prompt_cache_nbytes``, the
        figure it subtracts from ``--prompt-cache-bytes``)."""
        tokens = [len(seq[4]) for seq in self._unprocessed_sequences]
        tokens += [len(t) for t in self._prompt_batch.tokens] + [len(t) for t in self._generation_batch.tokens]
        return {"sequences": len(tokens), "tokens": tokens, "bytes": self.prompt_cache_nbytes}

    def _publish(self, force: bool = False) -> None:
        if self._report is None:
            return
        uids = (tuple(s[0] for s in self._unprocessed_sequences), tuple(self._prompt_batch.uids),
                tuple(self._generation_batch.uids))
        now = time.monotonic()
        if force or uids != self._reported[0] or now - self._reported[1] >= self.interval:
            self._reported = (uids, now)
            self._report(self.running())

    def insert_segments(self, *args, **kwargs):
        out = super().insert_segments(*args, **kwargs)
        self._publish(force=True)
        return out

    def next(self):
        out = super().next()
        self._publish()
        return out

    def remove(self, uids, return_prompt_caches=False):
        out = super().remove(uids, return_prompt_caches=return_prompt_caches)
        self._publish(force=True)
        return out

    def close(self):
        super().close()
        if self._report is not None:
            self._report(None)


class OIQResponseGenerator(_server.ResponseGenerator):
    def __init__(self, model_provider, prompt_cache):
        # the requests being answered, per model key (see OIQAPIHandler.handle_completion)
        self.active: dict = {}
        self.active_lock = threading.Lock()
        # what the running sequences' caches hold (OIQBatchGenerator's report), None when none run
        self.running = None
        super().__init__(model_provider, prompt_cache)

    def report_running(self, running: dict | None) -> None:
        self.running = running

    def memory(self) -> dict:
        """``GET /v1/oiq/memory``: what the prompt cache holds (:meth:`OIQPromptCache.memory`),
        and what the running sequences' caches hold (None while no batch runs)."""
        cache = self.prompt_cache
        prompt = cache.memory() if isinstance(cache, OIQPromptCache) else {"entries": len(cache), "bytes": cache.nbytes}
        return {"prompt_cache": prompt, "running": self.running}

    def begin(self, key) -> tuple | None:
        """Count a request for model ``key`` as being answered; or, while requests for
        another model are, return that ``(key, count)`` and count nothing."""
        with self.active_lock:
            busy = [(k, n) for k, n in self.active.items() if k != key and n]
            if busy:
                return busy[0]
            self.active[key] = self.active.get(key, 0) + 1
            return None

    def end(self, key) -> None:
        with self.active_lock:
            self.active[key] -= 1

    def _next_request(self, timeout=None):
        item = super()._next_request(timeout)
        if item is not None:
            # mlx-lm adds a request to the running batch only when its model description
            # equals the batch's, else it lets the batch finish first: describe every
            # request by its model key, so that any name of the served model (or none) joins
            _, _, args = item
            try:
                key = self.model_provider.request_key(args.model.model, args.model.adapter, args.model.draft)
            except (ValueError, FileNotFoundError):
                return item  # the provider's load refuses it with this message
            args.model = _server.ModelDescription(model=key[0], adapter=key[1], draft=key[2])
        return item

    def _tokenize(self, tokenizer, request, args):
        try:
            result = super()._tokenize(tokenizer, request, args)
        except Exception as e:  # noqa: BLE001 - the prompt is made of what the client sent
            raise RequestError(400, f"the prompt could not be made from the request: {type(e).__name__}: {e}") from e
        check_lengths(len(result[0]), args, context_length(self.model_provider.model))
        return result


class OIQAPIHandler(_server.APIHandler):
    """mlx-lm's request handler, answering bad requests at once with a status that says
    what is wrong: 400 for a request that cannot be served as it is (empty
    ``messages``, a prompt or ``max_tokens`` past the context), 404 for a model name that
    names no model, 409 for another model while the served one is answering requests
    (mlx-lm would let them all finish first, the client waiting).  mlx-lm answers every
    error raised while a request is prepared with 404."""

    answering = None  # the model key of the request being answered (handle_completion)

    def validate_model_parameters(self) -> None:
        super().validate_model_parameters()
        if "max_tokens" not in self.body and self.body.get("max_completion_tokens") is None:
            self.max_tokens = DefaultMaxTokens(self.max_tokens)

    def handle_chat_completions(self):
        messages = self.body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError(400, "messages must be a non-empty list of messages "
                                    f"(got {json.dumps(messages)[:80]})")
        if not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            raise RequestError(400, "each message must be an object with a 'role' string "
                                    f"(got {json.dumps(messages)[:80]})")
        return super().handle_chat_completions()

    def do_GET(self):
        if self.path.split("?")[0].rstrip("/") == "/v1/oiq/memory":
            self._set_completion_headers(200)
            self.end_headers()
            self.wfile.write(json.dumps(self.response_generator.memory()).encode())
            return
        super().do_GET()

    def do_POST(self):
        self.answered = False
        try:
            super().do_POST()
        except UnicodeDecodeError as e:
            # mlx-lm decodes the body as UTF-8 before parsing it, outside its JSON error
            # handling: the client would get no answer at all
            if self.answered:
                raise
            self._refuse(400, f"Invalid JSON in request body: not UTF-8 ({e})")
        except (BrokenPipeError, ConnectionResetError):
            # the client left (its sequence has been told to stop): one line, not a traceback
            logging.info("oiq_mlx: the client of %s went away", self.path)

    def _set_stream_headers(self, status_code: int = 200):
        self.answered = True
        super()._set_stream_headers(status_code)

    def _set_completion_headers(self, status_code: int = 200):
        self.answered = True
        # mlx-lm answers an error of the generation thread with 404 from inside its
        # ``except`` clause; the error being handled there says the status
        error = sys.exc_info()[1]
        if status_code == 404 and isinstance(error, RequestError):
            status_code = error.status
        if status_code != 200:  # an error answer: the request is over
            self._answered()
        super()._set_completion_headers(status_code)

    def _refuse(self, status: int, message: str) -> None:
        self._set_completion_headers(status)
        self.end_headers()
        self.wfile.write(json.dumps({"error": message}).encode())

    def handle_completion(self, request, stop_words):
        generator = self.response_generator
        provider = generator.model_provider
        name = self.requested_model
        try:
            key = provider.request_key(name, self.adapter, self.requested_draft_model)
        except (ValueError, FileNotFoundError) as e:
            return self._refuse(404, f"model {name!r} is not available: {e}. This server serves "
                                     f"{provider.served_name()!r} (name it, or leave 'model' out)")
        busy = generator.begin(key)
        if busy is not None:
            served, asked = provider.served_name(busy[0]), provider.served_name(key)
            return self._refuse(409, f"model {asked!r} is not the model {served!r}, which is answering "
                                     f"{busy[1]} request(s); the server holds one model and loads {asked!r} "
                                     f"once they finish: retry then, or ask for {served!r}")
        self.answering = key
        try:
            return super().handle_completion(request, stop_words)
        finally:
            self._answered()

    def _answered(self) -> None:
        """Stop counting this request as being answered: once, before the last of its
        answer is written, so that a client reading the answer and asking at once for
        another model does not find this request still counted."""
        key, self.answering = self.answering, None
        if key is not None:
            self.response_generator.end(key)

    def generate_response(self, text, finish_reason, *args, **kwargs):
        if finish_reason is not None:  # the answer's last part (streamed or not)
            self._answered()
        return super().generate_response(text, finish_reason, *args, **kwargs)


class OIQHTTPServer(ThreadingHTTPServer):
    # socketserver listens with a backlog of 5: more clients connecting at once, while the
    # generation thread holds the interpreter, find their connections reset
    request_queue_size = 128


def run(host: str, port: int, model_provider: _server.ModelProvider, *, keep_checkpoints: bool = False, **_):
    """``mlx_lm.server.run`` with the OIQ provider and response generator (the prompt
    cache an :class:`OIQPromptCache`, ``keep_checkpoints`` as it takes it).

    The default model is loaded here, so that a model or cache configuration
    that cannot work stops the server with its message before it listens.
    """
    provider = OIQModelProvider(model_provider.cli_args)
    provider.load_default()
    oiq = getattr(getattr(provider.model, "make_cache", None), "oiq_config", None)
    logging.info(
        "oiq_mlx: KV cache %s; continuous batching %s",
        f"OIQ {oiq.to_json()}" if oiq is not None else "mlx-lm's own (--no-oiq)",
        "on" if provider.is_batchable and provider.cli_args.kv_bits is None else "off",
    )
    group = mx.distributed.init()
    if group.size() > 1:
        # every rank is here at once: report what each holds for one sequence, then let
        # rank 0 alone speak, as oiq-generate does under mlx.launch
        report = distributed.probe_kv_bytes(provider.model, group, tokens=KV_PROBE_TOKENS)
        if group.rank() != 0:
            logging.getLogger().setLevel(logging.WARNING)
        logging.info("oiq_mlx: %s, for one sequence of %d tokens",
                     distributed.format_kv_bytes(report, provider.model.oiq_layout), KV_PROBE_TOKENS)
    prompt_cache = OIQPromptCache(provider.cli_args.prompt_cache_size, provider.cli_args.prompt_cache_bytes,
                                  keep_checkpoints=keep_checkpoints)
    generator = None

    def report(running):
        if generator is not None:
            generator.report_running(running)

    # mlx_lm.server builds its batch generator by this name, on the generation thread
    _server.BatchGenerator = functools.partial(OIQBatchGenerator, report=report)
    generator = OIQResponseGenerator(provider, prompt_cache)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    if group.rank() == 0:
        _server._run_http_server(host, port, generator, server_class=OIQHTTPServer,
                                 handler_class=OIQAPIHandler)
    else:
        # as mlx_lm.server.run: the other ranks receive rank 0's requests
        # through the generation loop and serve no HTTP themselves
        generator.join()
    # the HTTP server is shut down and the generation thread joined; leaving
    # through interpreter teardown aborts in MLX's C++ threads ("terminate
    # called without an active exception", exit -6), so leave directly
    logging.info("oiq_mlx: server stopped")
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def serve(argv: list, config: OIQConfig | None, dequantize: bool | None, *, keep_checkpoints: bool = False) -> None:
    """Run ``mlx_lm.server.main`` on ``argv`` (mlx-lm's own flags) with the hooks above:
    models load through :func:`load_model` (or :func:`sharded_load_model`) with OIQ
    caches of ``config`` (None: mlx-lm's own caches), and :func:`run` serves them
    (``keep_checkpoints``: :class:`OIQPromptCache`'s)."""
    _server.load = functools.partial(load_model, config=config, dequantize=dequantize)
    _server.sharded_load = functools.partial(sharded_load_model, config=config, dequantize=dequantize)
    _server.run = functools.partial(run, keep_checkpoints=keep_checkpoints)
    saved = sys.argv
    sys.argv = ["oiq-server", *argv]
    try:
        _server.main()
    finally:
        sys.argv = saved
