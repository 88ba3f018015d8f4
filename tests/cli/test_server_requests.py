"""Bad requests to ``oiq-server``, as a hostile or hurried client sends them: each is answered
at once with a status and a message saying what is wrong, and the server keeps serving the
others exactly (one server on 127.0.0.1, every request with a timeout)."""

import json
import re
import socket
import threading
import time
from types import SimpleNamespace

import pytest

from oiq_mlx import demo_model_path
from oiq_mlx.bench.server import ServerProcess, request
from oiq_mlx.mlx_lm.server import DefaultMaxTokens, RequestError, check_lengths

TIMEOUT = 120  # seconds any one request may take here
AT_ONCE = 10  # seconds a refusal may take on 2 busy cores (mlx-lm's took until the batch finished)
MAX_TOKENS = 6
WORDS = ("the keeper climbed the stair at dusk and lit the lamp while the sea rolled grey "
         "under a low sky and gulls wheeled over the rocks by the harbour wall").split()
# sixteen prompts of 4 .. 34 words, different starts
PROMPTS = [" ".join(WORDS[(i + j) % len(WORDS)] for j in range(4 + 2 * i)) for i in range(16)]
OVERLONG = re.compile(r"max_tokens is 100000, but the prompt has (\d+) tokens and the model's context is 8192 "
                      r"tokens \(prompt and generated tokens together\): at most (\d+) tokens can be generated")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("srv") / "requests.log"
    with ServerProcess(["--preset", "4bit", "--window", "16", "--max-tokens", "8"], log_path=log) as s:
        yield s
        assert s.alive(), s.log()
        assert "Traceback" not in s.log(), s.log()


def _post(port, body, path="/v1/completions", **kw):
    t0 = time.monotonic()
    status, answer = request(port, "POST", path, body, timeout=TIMEOUT, **kw)
    return status, answer, time.monotonic() - t0


def _good(prompt):
    return {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "logprobs": True}


def _tokens(answer):
    return [t["id"] for t in answer["choices"][0]["logprobs"]["content"]]


def _refused(port, body, status, message, path="/v1/completions"):
    got, answer, seconds = _post(port, body, path)
    assert got == status, (body, got, answer)
    assert isinstance(answer, dict) and set(answer) == {"error"}, answer
    assert re.search(message, answer["error"]), answer["error"]
    assert seconds < AT_ONCE, seconds
    return answer["error"]


@pytest.mark.slow
def test_bad_requests_get_a_status_and_a_message(server):
    port = server.port
    error = _refused(port, {"prompt": "the sea", "max_tokens": 100000}, 400, OVERLONG)
    n, room = map(int, OVERLONG.search(error).groups())
    assert n + room == 8192
    _refused(port, {"prompt": "the sea", "max_completion_tokens": 100000}, 400, OVERLONG)
    _refused(port, {"prompt": "the sea", "max_tokens": 100000, "stream": True}, 400, OVERLONG)
    _refused(port, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100000}, 400, OVERLONG,
             "/v1/chat/completions")
    _refused(port, {"prompt": "the sea", "max_tokens": 2, "model": "no-such-model"}, 404,
             r"^model 'no-such-model' is not available: unknown model 'no-such-model'.*\. This server serves "
             r"'demo' \(name it, or leave 'model' out\)$")
    _refused(port, {"prompt": "the sea", "model": "no/such/path.gguf"}, 404,
             r"^model 'no/such/path.gguf' is not available: GGUF file not found")
    _refused(port, {"messages": [], "max_tokens": 2}, 400, r"^messages must be a non-empty list of messages \(got \[\]\)$",
             "/v1/chat/completions")
    _refused(port, {"messages": "hi"}, 400, r"^messages must be a non-empty list", "/v1/chat/completions")
    _refused(port, {"max_tokens": 2}, 400, r"^messages must be a non-empty list", "/v1/chat/completions")
    _refused(port, {"messages": [42], "max_tokens": 2}, 400,
             r"^each message must be an object with a 'role' string \(got \[42\]\)$", "/v1/chat/completions")
    _refused(port, {"messages": [{"content": "hi"}]}, 400, r"^each message must be an object with a 'role' string",
             "/v1/chat/completions")
    _refused(port, {"messages": [{"role": "user", "content": 7}], "max_tokens": 2}, 400,
             r"^the prompt could not be made from the request: ", "/v1/chat/completions")
    _refused(port, {"prompt": ["the", 7], "max_tokens": 2}, 400, r"^the prompt could not be made from the request: ")
    _refused(port, {"prompt": "", "max_tokens": 2}, 400, r"^the prompt is empty: it gives no tokens to start from$")
    _refused(port, {"prompt": "sea " * 9000, "max_tokens": 2}, 400,
             r"^the prompt has \d+ tokens; the model's context is 8192 tokens \(prompt and generated tokens together\)$")
    _refused(port, {"messages": [{"role": "user", "content": "sea " * 9000}]}, 400,
             r"^the prompt has \d+ tokens; the model's context is 8192 tokens", "/v1/chat/completions")
    _refused(port, {"prompt": "the sea", "max_tokens": 0}, 400, r"^max_tokens must be at least 1$")
    for raw, message in ((b'{"prompt": "hi", ', r"^Invalid JSON in request body"),
                         (b'["prompt"]', r"^Request should be a JSON dictionary$"),
                         (b"\xff\xfe", r"^Invalid JSON in request body")):
        status, answer, seconds = _post(port, None, raw=raw)
        assert status == 400 and re.search(message, answer["error"]), (raw, status, answer)
    # the server's own --max-tokens (8) fits: a request that gives none is served with it
    status, answer, _ = _post(port, {"prompt": PROMPTS[0], "temperature": 0.0})
    assert status == 200 and answer["usage"]["completion_tokens"] == 8, answer
    assert request(port, "GET", "/health", timeout=TIMEOUT)[0] == 200


def test_the_servers_default_max_tokens_is_cut_to_the_context_and_a_requested_one_refused():
    args = SimpleNamespace(max_tokens=DefaultMaxTokens(512))
    check_lengths(8000, args, 8192)
    assert args.max_tokens == 192 and isinstance(args.max_tokens, DefaultMaxTokens)
    check_lengths(100, args, 8192)
    assert args.max_tokens == 192
    args = SimpleNamespace(max_tokens=512)
    with pytest.raises(RequestError, match="max_tokens is 512, but the prompt has 8000 tokens") as e:
        check_lengths(8000, args, 8192)
    assert e.value.status == 400
    check_lengths(7680, args, 8192)  # exactly fits
    assert args.max_tokens == 512
    with pytest.raises(RequestError, match="the prompt has 8192 tokens; the model's context is 8192") as e:
        check_lengths(8192, SimpleNamespace(max_tokens=DefaultMaxTokens(1)), 8192)
    with pytest.raises(RequestError, match="the prompt is empty"):
        check_lengths(0, args, None)
    check_lengths(10**6, args, None)  # no known context: nothing to check


class _Stream:
    """A streaming request held open: reads up to its first generated text, then waits."""

    def __init__(self, port, body):
        data = json.dumps({**body, "stream": True}).encode()
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
        self.sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
        self.seen = b""
        while b"data: " not in self.seen:
            chunk = self.sock.recv(4096)
            assert chunk, self.seen
            self.seen += chunk
        assert self.seen.startswith((b"HTTP/1.0 200", b"HTTP/1.1 200")), self.seen

    def finished(self) -> bool:
        self.sock.settimeout(0.01)
        try:
            while chunk := self.sock.recv(65536):
                self.seen += chunk
        except (TimeoutError, BlockingIOError):
            pass
        return b"[DONE]" in self.seen

    def disconnect(self):
        self.sock.close()


@pytest.mark.slow
def test_other_model_names_while_a_batch_runs_are_answered_at_once(server, tmp_path):
    port = server.port
    other = tmp_path / "other.gguf"  # another model: the demo's file under another name
    other.symlink_to(demo_model_path())
    # minutes of work: no end of sequence (the demo's are tokens 0 and 2)
    long = _Stream(port, {"prompt": PROMPTS[5], "max_tokens": 4000, "temperature": 0.0,
                          "logit_bias": {"0": -100, "2": -100}})
    try:
        # any name of the served model, or none, joins the running batch
        want = _post(port, _good(PROMPTS[2]))
        for name in ("demo", str(demo_model_path())):
            status, answer, seconds = _post(port, {**_good(PROMPTS[2]), "model": name})
            assert status == 200 and _tokens(answer) == _tokens(want[1]), answer
            assert answer["model"] == name
        _refused(port, {"prompt": "the sea", "max_tokens": 2, "model": "no-such-model"}, 404,
                 r"^model 'no-such-model' is not available: unknown model")
        assert not long.finished()
        _refused(port, {"prompt": "the sea", "max_tokens": 2, "model": str(other)}, 409,
                 rf"^model '{re.escape(str(other))}' is not the model 'demo', which is answering 1 request\(s\); "
                 rf"the server holds one model and loads '{re.escape(str(other))}' once they finish: retry then, "
                 r"or ask for 'demo'$")
        assert not long.finished()
    finally:
        long.disconnect()  # a client leaving mid-stream
    # its sequence leaves the batch (once the server writes to the closed connection); then
    # the other model is loaded and serves (the same weights: the same answer), and back
    deadline = time.monotonic() + AT_ONCE
    while True:
        status, answer, _ = _post(port, {**_good(PROMPTS[2]), "model": str(other)})
        if status != 409 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert status == 200 and _tokens(answer) == _tokens(want[1]), answer
    status, answer, _ = _post(port, _good(PROMPTS[2]))
    assert status == 200 and _tokens(answer) == _tokens(want[1])
    assert server.alive()


def _handler(monkeypatch, answer):
    """An OIQAPIHandler, without a socket, whose mlx-lm part is ``answer(handler)`` (in place of
    mlx-lm's ``handle_completion``), for one model ``"demo"``."""
    from mlx_lm import server as mlx_server

    from oiq_mlx.mlx_lm.server import OIQAPIHandler, OIQResponseGenerator

    generator = OIQResponseGenerator.__new__(OIQResponseGenerator)
    generator.active, generator.active_lock = {}, threading.Lock()
    generator.model_provider = SimpleNamespace(request_key=lambda *a: ("demo", None, None),
                                               served_name=lambda key=None: "demo")
    handler = OIQAPIHandler.__new__(OIQAPIHandler)
    handler.response_generator = generator
    handler.requested_model, handler.adapter, handler.requested_draft_model = "demo", None, None
    handler.answered = False
    monkeypatch.setattr(mlx_server.APIHandler, "handle_completion", lambda self, *a: answer(self))
    monkeypatch.setattr(mlx_server.APIHandler, "generate_response", lambda self, *a, **k: {})
    monkeypatch.setattr(mlx_server.APIHandler, "_set_completion_headers", lambda self, status: None)
    return handler, generator


@pytest.mark.parametrize("how", ["whole", "streamed", "error"])
def test_a_request_is_no_longer_counted_when_its_answer_is_written(monkeypatch, how):
    # a client that reads its answer and at once asks for another model must not find this
    # request still counted as being answered (the 409 of the test above, by a race)
    seen = []

    def answer(handler):  # the order of mlx-lm's handle_completion
        if how == "error":
            try:
                raise RequestError(400, "bad")
            except RequestError:
                handler._set_completion_headers(404)
        else:
            if how == "streamed":
                handler.generate_response("a", None)
            seen.append(dict(generator.active))  # generating: counted
            handler.generate_response("b", "stop")
        seen.append(dict(generator.active))  # the answer's last bytes are written here

    handler, generator = _handler(monkeypatch, answer)
    handler._set_completion_headers(404)  # an error answer to a GET: nothing counted, nothing released
    assert generator.active == {}
    handler.handle_completion(None, [])
    assert seen[-1] == {("demo", None, None): 0}, seen
    if how != "error":
        assert seen[0] == {("demo", None, None): 1}, seen
    assert generator.active == {("demo", None, None): 0}  # released once, not twice
    handler.handle_completion(None, [])  # the same connection's next request
    assert generator.active == {("demo", None, None): 0}


def _round(port, bad=None):
    """The fifteen good prompts at once, and ``bad`` (a request body, or ``"disconnect"``) among them."""
    answers = [None] * 16

    def good(i):
        try:
            answers[i] = _post(port, _good(PROMPTS[i]))[:2]
        except Exception as e:  # noqa: BLE001 - compared below
            answers[i] = e

    def send_bad():
        try:
            if bad == "disconnect":
                _Stream(port, {"prompt": PROMPTS[15], "max_tokens": 400, "temperature": 0.0}).disconnect()
                answers[15] = "disconnected"
            else:
                answers[15] = _post(port, bad)[:2]
        except Exception as e:  # noqa: BLE001
            answers[15] = e

    threads = [threading.Thread(target=good, args=(i,)) for i in range(15)]
    if bad is not None:
        threads.insert(7, threading.Thread(target=send_bad))
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT + 10)
    assert not any(t.is_alive() for t in threads)
    return answers


@pytest.mark.slow
def test_sixteen_clients_one_bad_the_others_as_without_it(server):
    port = server.port
    alone = _round(port)
    assert all(isinstance(a, tuple) and a[0] == 200 for a in alone[:15]), [a for a in alone if a is None or a[0] != 200]
    want = [_tokens(a[1]) for a in alone[:15]]
    assert all(want) and sum(map(len, want)) > 12 * MAX_TOKENS, want
    for bad, check in (({"prompt": PROMPTS[15], "max_tokens": 100000, "temperature": 0.0},
                        lambda a: a[0] == 400 and OVERLONG.search(a[1]["error"])),
                       ({"prompt": PROMPTS[15], "max_tokens": 4, "model": "no-such-model"},
                        lambda a: a[0] == 404 and "unknown model 'no-such-model'" in a[1]["error"]),
                       ("disconnect", lambda a: a == "disconnected")):
        answers = _round(port, bad)
        assert check(answers[15]), (bad, answers[15])
        assert all(isinstance(a, tuple) and a[0] == 200 for a in answers[:15]), (bad, [a for a in answers[:15] if not isinstance(a, tuple) or a[0] != 200])
        assert [_tokens(a[1]) for a in answers[:15]] == want, bad
