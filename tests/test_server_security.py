"""``edge-spec serve`` against web pages and hostile clients: the HTTP policy (host, origin, CORS, content
type, body size, JSON nesting), prompt-length checks that do not stall the event loop, and connection
deadlines (slowloris).

The policy is checked in process through Starlette's TestClient; what needs real sockets and timing
(``/health`` answering beside a hostile request, connections closed on a deadline) runs a real uvicorn
server, configured as ``serve`` configures it, in a thread on a free loopback port.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")

from starlette.testclient import TestClient  # noqa: E402

from edge_spec.errors import EdgeSpecError  # noqa: E402
from edge_spec.runtime.engine import Engine  # noqa: E402
from edge_spec.server.body import nesting_depth  # noqa: E402
from edge_spec.server.guard import GuardPolicy, make_policy, normalize_origin, parse_size, split_host  # noqa: E402
from edge_spec.server.prompt_size import PromptFloor  # noqa: E402
from edge_spec.server.serve import build_app  # noqa: E402
from edge_spec.server.tokens import MAX_CHARACTERS, MAX_TOKENS  # noqa: E402
from tests import helpers  # noqa: E402
from tests.helpers import assert_one_line_error, cli  # noqa: E402

BASE = "http://127.0.0.1:8000"
EVIL = "http://evil.example"
CHAT = [{"role": "user", "content": "hello world"}]
BODY = {"messages": CHAT, "max_tokens": 3, "temperature": 0}
FAST = 0.1  # seconds /health may take while a hostile request is being handled
BUSY = 1.0  # ... while the server works through a large request (when that work held the GIL: many seconds)


@pytest.fixture(scope="module")
def engine(int4_bundle):
    return Engine.from_bundle(int4_bundle, mode="spec", threads=1)


def in_process(engine, **options):
    """A TestClient (context manager: the engine worker runs inside it) and the server's state."""
    app, state = build_app(engine, name="tiny", **options)
    return TestClient(app, base_url=BASE), state


def _error(response, status: int) -> dict:
    assert response.status_code == status, response.text[:500]
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


# -- origins and CORS ------------------------------------------------------------------------------


def test_cross_origin_preflight_refused_by_default(engine):
    client, _ = in_process(engine)
    with client:
        response = client.options(
            "/v1/chat/completions",
            headers={
                "Origin": EVIL,
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization, content-type",
            },
        )
    assert _error(response, 403)["code"] == "origin_not_allowed"
    assert "access-control-allow-origin" not in response.headers


def test_configured_origin_gets_preflight_and_cors_headers(engine):
    origin = "http://app.example:3000"
    client, state = in_process(engine, cors_origins=[origin + "/"])
    with client:
        preflight = client.options(
            "/v1/chat/completions",
            headers={
                "Origin": origin,
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os",
            },
        )
        answer = client.post("/v1/chat/completions", json=BODY, headers={"Origin": origin})
        refused = client.post("/v1/chat/completions", json=BODY, headers={"Origin": "http://app.example:3001"})
        too_big = client.post(
            "/v1/chat/completions",
            content=b"x" * (5 << 20),
            headers={"Origin": origin, "Content-Type": "application/json"},
        )
    assert preflight.status_code == 204
    assert preflight.headers["access-control-allow-origin"] == origin
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert preflight.headers["access-control-allow-headers"] == "authorization, content-type, x-stainless-os"
    assert "Origin" in preflight.headers["vary"]
    assert answer.status_code == 200, answer.text
    assert answer.headers["access-control-allow-origin"] == origin
    assert _error(refused, 403)["code"] == "origin_not_allowed"
    assert "access-control-allow-origin" not in refused.headers
    assert _error(too_big, 413)["code"] == "request_too_large"  # an allowed page can read why
    assert too_big.headers["access-control-allow-origin"] == origin
    assert state.worker.counts["completed"] == 1


def test_cross_site_post_never_runs(engine):
    """A page's "simple" POST (text/plain: no preflight) is refused for its Origin, and without one for
    its content type; nothing reaches the engine."""
    client, state = in_process(engine)
    raw = json.dumps(BODY)
    with client:
        cross = client.post("/v1/chat/completions", content=raw, headers={"Origin": EVIL, "Content-Type": "text/plain"})
        plain = client.post("/v1/chat/completions", content=raw, headers={"Content-Type": "text/plain"})
        form = client.post("/v1/completions", data={"prompt": "x"})
        missing = client.post("/v1/chat/completions", content=raw)
        json_get = client.get("/v1/models", headers={"Origin": EVIL})
        health = client.get("/health", headers={"Origin": "null"})
        assert state.worker.counts.get("completed", 0) == 0
        same_origin = client.post(
            "/v1/chat/completions",
            content=raw,
            headers={"Origin": BASE, "Content-Type": "application/json; charset=utf-8"},
        )
    assert _error(cross, 403)["code"] == "origin_not_allowed"
    assert _error(plain, 415)["code"] == "unsupported_media_type"
    assert "text/plain" in plain.json()["error"]["message"]
    assert _error(form, 415)["code"] == "unsupported_media_type"
    assert "no Content-Type" in _error(missing, 415)["message"]
    assert _error(json_get, 403)["code"] == "origin_not_allowed"
    assert _error(health, 403)["code"] == "origin_not_allowed"
    assert same_origin.status_code == 200, same_origin.text
    assert "access-control-allow-origin" not in same_origin.headers
    assert state.worker.counts["completed"] == 1


def test_cors_wildcard_needs_an_api_key():
    with pytest.raises(EdgeSpecError, match="needs --api-key"):
        make_policy(cors_origins=["*"])
    assert make_policy(cors_origins=["*"], api_key="k").origin_allowed("https://any.example")
    for bad in ("null", "app.example", "ftp://app.example", "http://app.example/path", "http://a.example:99999"):
        with pytest.raises(EdgeSpecError, match="--cors-origin"):
            make_policy(cors_origins=[bad])
    assert normalize_origin("HTTPS://App.Example:443") == "https://app.example"
    assert normalize_origin("http://[::1]:8000") == "http://[::1]:8000"


# -- hosts -----------------------------------------------------------------------------------------


def test_forged_host_refused_and_allowed_host_admits_it(engine):
    forged = {"Host": "rebind.attacker.example:8000"}
    client, _ = in_process(engine)
    with client:
        refused = client.get("/health", headers=forged)
        refused_post = client.post("/v1/chat/completions", json=BODY, headers=forged)
        for host in ("localhost:8000", "app.localhost", "127.0.0.2", "[::1]:8000", "127.0.0.1"):
            assert client.get("/health", headers={"Host": host}).status_code == 200, host
        for host in ("0.0.0.0:8000", "192.168.1.5:8000", "[::1", "localhost:http", "a:b:c"):
            assert _error(client.get("/health", headers={"Host": host}), 403)["code"] == "host_not_allowed", host
    assert _error(refused, 403)["code"] == "host_not_allowed"
    assert "--allowed-host" in refused.json()["error"]["message"]
    assert _error(refused_post, 403)["code"] == "host_not_allowed"
    for allowed in (["rebind.attacker.example"], ["*.attacker.example"], ["*"]):
        client, _ = in_process(engine, allowed_hosts=allowed)
        with client:
            assert client.get("/v1/models", headers=forged).status_code == 200, allowed
            assert client.post("/v1/chat/completions", json=BODY, headers=forged).status_code == 200, allowed


def test_host_rules_follow_the_bound_address():
    loopback = make_policy(bind_host="127.0.0.1")
    assert [split_host(h) for h in ("LocalHost.:80", "[::1]:8000", "[fe80::1%eth0]", "a:b")] == [
        "localhost",
        "::1",
        "fe80::1%eth0",
        None,
    ]
    assert not loopback.host_allowed("192.168.1.5") and not loopback.host_allowed("myhost.lan")
    lan = make_policy(bind_host="192.168.1.5")
    assert lan.host_allowed("192.168.1.5") and lan.host_allowed("localhost")
    every = make_policy(bind_host="0.0.0.0", allowed_hosts=["MyHost.Lan."])
    for host in ("10.0.0.7", "203.0.113.9", "fe80::1", "127.0.0.1", "localhost", "myhost.lan"):
        assert every.host_allowed(host), host
    assert not every.host_allowed("rebind.attacker.example")
    assert GuardPolicy().host_allowed("localhost")
    with pytest.raises(EdgeSpecError, match="--allowed-host"):
        make_policy(allowed_hosts=["http://myhost.lan"])


# -- bodies ----------------------------------------------------------------------------------------


def test_body_size_cap(engine):
    client, state = in_process(engine, max_body="1K")
    padded = {**BODY, "user": "x" * 2000}

    def chunks():
        yield json.dumps(padded).encode()

    with client:
        by_length = client.post("/v1/chat/completions", json=padded)
        counted = client.post("/v1/chat/completions", content=chunks(), headers={"Content-Type": "application/json"})
        fits = client.post("/v1/chat/completions", json=BODY)
    for response in (by_length, counted):
        error = _error(response, 413)
        assert error["code"] == "request_too_large" and "1024 bytes" in error["message"]
        assert response.headers["connection"] == "close"
    assert fits.status_code == 200
    assert state.worker.counts["completed"] == 1
    assert [parse_size(s) for s in ("4M", "8MiB", "512k", "1048576", "1G", "2 MB")] == [
        4 << 20,
        8 << 20,
        512 << 10,
        1 << 20,
        1 << 30,
        2 << 20,
    ]
    for bad in ("lots", "-1", "0", "4T", "1.5M"):
        with pytest.raises(EdgeSpecError, match="--max-body"):
            parse_size(bad)


def test_large_bodies_give_their_memory_back(engine, monkeypatch):
    """Once a request of a large body is answered, or refused for its size, the allocator is asked to
    return what it freed (throttled); small requests never pay for that."""
    from edge_spec.runtime import heap
    from edge_spec.server.guard import TRIM_BODY_BYTES

    calls = []
    monkeypatch.setattr(heap, "trim", lambda min_interval=0.0: calls.append(min_interval) or True)
    client, _ = in_process(engine, max_body="3M")
    large = {"messages": [{"role": "user", "content": "hello world " * (TRIM_BODY_BYTES // 10)}]}
    with client:
        small = client.post("/v1/chat/completions", json=BODY)
        assert small.status_code == 200 and calls == []
        assert _error(client.post("/v1/chat/completions", json=large), 400)["code"] == "context_length_exceeded"
        assert len(calls) == 1
        pieces = (b"x" * (1 << 20) for _ in range(4))  # no Content-Length: read until past the cap
        too_large = client.post("/v1/chat/completions", content=pieces, headers={"Content-Type": "application/json"})
        assert _error(too_large, 413)["code"] == "request_too_large"
        assert len(calls) == 2


def test_detokenize_counts_the_vocabulary_once(engine, monkeypatch):
    """Counting a tokenizer's ids with its added tokens walks the whole vocabulary (a second for a real
    one, holding the GIL): a prepared server has the count, and ``/detokenize`` never walks it again."""
    client, state = in_process(engine)
    state.prepare()
    text = engine.bundle.tokenizer
    size = text.tokenizer.get_vocab_size(with_added_tokens=True)

    class Counted:
        def __init__(self, inner) -> None:
            self.inner = inner

        def get_vocab_size(self, with_added_tokens: bool = True) -> int:
            raise AssertionError("the vocabulary was counted again")

        def __getattr__(self, name):
            return getattr(self.inner, name)

    monkeypatch.setattr(text, "tokenizer", Counted(text.tokenizer))
    with client:
        fits = client.post("/detokenize", json={"tokens": [1, 2, 3]})
        outside = client.post("/detokenize", json={"tokens": [size]})
    assert fits.status_code == 200, fits.text
    assert f"0 to {size - 1}" in _error(outside, 400)["message"]


def test_trimming_the_heap_is_throttled():
    from edge_spec.runtime import heap

    if heap._malloc_trim() is None:
        pytest.skip("no malloc_trim here")
    assert heap.trim(0.0) is True
    assert heap.trim(60.0) is False  # done a moment ago
    assert heap.trim(0.0) is True


def test_nesting_is_bounded(engine):
    assert nesting_depth(b'{"a": "[[[[{{", "b": [{"c": "\\"]]"}]}') == 3
    assert nesting_depth(b"[" * 100000) == 100000
    client, _ = in_process(engine)
    with client:
        deep = client.post("/v1/chat/completions", content=b"[" * 100000, headers={"Content-Type": "application/json"})
        just_too_deep = client.post("/v1/chat/completions", json={**BODY, "x": json.loads("[" * 64 + "]" * 64)})
        deepest = client.post("/v1/chat/completions", json={**BODY, "x": json.loads("[" * 63 + "]" * 63)})
        brackets = client.post(
            "/v1/chat/completions", json={**BODY, "messages": [{"role": "user", "content": "[" * 5000}]}
        )
    assert "100000 levels" in _error(deep, 400)["message"]
    assert "65 levels" in _error(just_too_deep, 400)["message"]
    assert deepest.status_code == 200, deepest.text
    assert brackets.status_code == 400 and brackets.json()["error"]["code"] == "context_length_exceeded"


POST_ROUTES = {
    "/v1/chat/completions": '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": %s}',
    "/v1/completions": '{"prompt": "hi", "seed": %s}',
    "/tokenize": '{"content": "hi", "n": %s}',
    "/detokenize": '{"tokens": [%s]}',
}


@pytest.mark.parametrize("route", list(POST_ROUTES))
def test_numbers_past_what_python_reads_are_a_400(engine, route):
    """An integer literal over Python's 4300-digit conversion limit is a 400 naming the limit; a float
    that overflows reads as infinity and a huge integer as out of range, never a 500."""
    client, _ = in_process(engine)
    with client:
        huge = client.post(
            route, content=POST_ROUTES[route] % ("1" + "0" * 5000), headers={"Content-Type": "application/json"}
        )
        below = client.post(
            route, content=POST_ROUTES[route] % ("-1" + "0" * 4000), headers={"Content-Type": "application/json"}
        )
        overflowing = client.post(
            route, content=POST_ROUTES[route] % "1e999999", headers={"Content-Type": "application/json"}
        )
    assert "4300 digits" in _error(huge, 400)["message"]
    assert "0" * 4000 not in huge.text
    for response in (below, overflowing):
        assert response.status_code in (200, 400), response.text
        if response.status_code == 400:
            _error(response, 400)


@pytest.mark.parametrize("field", ["temperature", "top_p"])
@pytest.mark.parametrize("value", ["1" + "0" * 400, "-1" + "0" * 400, "1e999999", "-1e999999", "NaN"])
def test_numbers_too_large_for_a_float_are_a_400_naming_the_field(engine, field, value):
    client, _ = in_process(engine)
    body = '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "%s": %s}' % (field, value)
    with client:
        response = client.post("/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
    assert _error(response, 400)["param"] == field


def test_bodies_of_too_many_values_are_refused_before_decoding(engine):
    """Decoding holds the GIL for its whole run: a body of a million small values (``[1,1,...]``,
    ``[{},{},...]``) would stall every other request, so the values are counted first."""
    client, _ = in_process(engine)
    ids = json.dumps({"tokens": [5, 6, 7, 8] * 300_000})  # 3.6 MB, under the body limit
    objects = json.dumps({"messages": CHAT, "x": [{}] * 1_000_000})
    commas_in_text = {"messages": [{"role": "user", "content": "a, " * 1_000_000}]}
    with client:
        refused = [
            client.post(route, content=raw, headers={"Content-Type": "application/json"})
            for route, raw in (("/detokenize", ids), ("/v1/chat/completions", objects))
        ]
        text = client.post("/v1/chat/completions", json=commas_in_text)
    for response in refused:
        assert "values" in _error(response, 400)["message"]
    assert _error(text, 400)["code"] == "context_length_exceeded"  # the commas in a string are text


def test_tokenize_and_detokenize_name_their_limits(engine):
    client, _ = in_process(engine)
    with client:
        too_long = client.post("/tokenize", json={"content": "x" * (MAX_CHARACTERS + 1)})
        too_many_tokens = client.post("/tokenize", json={"content": "hello world " * 7000})  # ~77k tokens here
        too_many_ids = client.post("/detokenize", json={"tokens": [5] * (MAX_TOKENS + 1)})
        fits = client.post("/detokenize", json={"tokens": [5] * MAX_TOKENS})
        pieces = client.post("/tokenize", json={"content": "hello world " * 4000, "with_pieces": True})
    for response, param, limit in (
        (too_long, "content", MAX_CHARACTERS),
        (too_many_tokens, "content", MAX_TOKENS),
        (too_many_ids, "tokens", MAX_TOKENS),
    ):
        error = _error(response, 400)
        assert error["param"] == param and f"at most {limit}" in error["message"], error
    assert fits.status_code == 200 and fits.headers["content-type"] == "application/json"
    assert len(pieces.json()["tokens"]) > 40_000
    assert "".join(p["piece"] for p in pieces.json()["tokens"]) == "hello world " * 4000


# -- prompt length ---------------------------------------------------------------------------------


def test_prompt_floors_never_exceed_the_count(engine):
    floor = PromptFloor(engine.bundle.tokenizer.tokenizer)
    assert floor.token_chars == max(len(t) for t in engine.bundle.tokenizer.tokenizer.get_vocab(with_added_tokens=True))
    assert floor.by_characters("x" * (floor.token_chars * 300)) == 300
    assert floor.by_characters([{"role": "user", "content": "ab"}, {"role": "user", "content": "c"}]) == 1
    for prompt in (
        "def is_prime(n):\n    return n > 1",
        "<|im_start|>user hi <|im_end|> " * 5,
        [{"role": "system", "content": "be brief <|im_end|>"}, {"role": "user", "content": "word " * 50}],
    ):
        exact = len(engine.prompt_ids(prompt, check_length=False))
        assert floor.by_characters(prompt) <= floor.by_tokenizing(prompt) <= exact
    assert floor.by_tokenizing("word " * 50) == len(engine.bundle.tokenizer.tokenizer.encode("word " * 50).ids)


def test_oversized_prompts_refused_with_counts(engine):
    client, _ = in_process(engine)
    capacity = engine.bundle.target.capacity
    fitting = "hello world"
    while len(engine.prompt_ids(fitting + " hello world", check_length=False)) < capacity - 1:
        fitting += " hello world"  # the longest such prompt: one token remains for the answer
    with client:
        huge = client.post("/v1/completions", json={"prompt": "x" * (floor_chars(engine) * capacity)})
        long = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "word " * 400}]})
        edge = client.post("/v1/completions", json={"prompt": fitting, "max_tokens": 1})
    huge_error = _error(huge, 400)
    assert huge_error["code"] == "context_length_exceeded" and huge_error["param"] == "prompt"
    assert f"but the prompt is at least {capacity} tokens" in huge_error["message"]
    assert _error(long, 400)["code"] == "context_length_exceeded"
    assert edge.status_code == 200, edge.text


def floor_chars(engine) -> int:
    return PromptFloor(engine.bundle.tokenizer.tokenizer).token_chars


def test_cli_refuses_bad_security_options_in_one_line(int4_bundle):
    result = cli("serve", str(int4_bundle), "--port", "0", "--cors-origin", "*", timeout=120)
    assert_one_line_error(result, "--cors-origin '*'")
    result = cli("serve", str(int4_bundle), "--port", "0", "--max-body", "lots", timeout=120)
    assert_one_line_error(result, "--max-body must be a size")
    help_text = cli("serve", "--help", timeout=120).stdout
    assert "--allowed-host" in help_text and "--cors-origin" in help_text and "4M" in help_text


# -- a real server: /health beside hostile requests, connection deadlines --------------------------


class LiveServer(helpers.LiveServer):
    """The live server with short deadlines, so the connection tests finish quickly."""

    def __init__(self, app, *, header_timeout: float = 1.0, keep_alive: int = 1) -> None:
        super().__init__(app, header_timeout=header_timeout, keep_alive=keep_alive)


@pytest.fixture(scope="module")
def live(engine):
    app, state = build_app(engine, name="tiny", body_timeout=1.0)
    server = LiveServer(app)
    server.state = state
    yield server
    server.stop()


def health_latencies(url: str, busy: threading.Thread, probes: int = 8) -> list[float]:
    """Seconds each of ``probes`` /health requests took, sent one after another while ``busy`` runs."""
    times = []
    with httpx.Client(base_url=url, timeout=30) as client:
        for _ in range(probes):
            started = time.perf_counter()
            assert client.get("/health").status_code == 200
            times.append(time.perf_counter() - started)
            time.sleep(0.01)
    busy.join(timeout=60)
    assert not busy.is_alive()
    return times


def in_background(function, *args) -> tuple[threading.Thread, dict]:
    """``function(*args)`` in a started thread; its result (or exception) lands in the returned dict."""
    outcome: dict = {}

    def target():
        try:
            outcome["result"] = function(*args)
        except Exception as exc:  # noqa: BLE001  (asserted on by the test)
            outcome["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, outcome


def post_raw(port: int, size: int, chunked: bool, started: threading.Event) -> tuple[bytes, int]:
    """POST ``size`` bytes of one huge JSON message through a raw socket, reading the answer while
    sending: the status line and how many bytes went out before the server stopped taking them."""
    head = [
        "POST /v1/chat/completions HTTP/1.1",
        "Host: 127.0.0.1",
        "Content-Type: application/json",
        "Transfer-Encoding: chunked" if chunked else f"Content-Length: {size}",
    ]
    sent = 0
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        answer = bytearray()

        def read():
            while b"\r\n" not in answer:
                try:
                    data = sock.recv(65536)
                except OSError:
                    return
                if not data:
                    return
                answer.extend(data)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
        piece = b'{"messages": [{"role": "user", "content": "' + b"a" * (1 << 20)
        try:
            while sent < size and not answer:
                sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
                sent += len(piece)
                started.set()
        except OSError:  # the server closed the connection: it stopped reading
            pass
        started.set()
        reader.join(timeout=30)
    return bytes(answer).split(b"\r\n")[0], sent


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_huge_body_refused_at_once_while_health_stays_fast(live, chunked):
    size = 50 << 20
    started = threading.Event()
    thread, outcome = in_background(post_raw, live.port, size, chunked, started)
    assert started.wait(30)
    latencies = health_latencies(live.url, thread)
    status, sent = outcome["result"]
    assert status.startswith(b"HTTP/1.1 413"), status
    assert sent < size  # the server stopped reading long before the end
    assert max(latencies) < FAST, latencies


def test_nested_json_is_a_400_and_health_stays_fast(live, caplog):
    caplog.set_level(logging.DEBUG)
    thread, outcome = in_background(
        lambda: httpx.post(
            f"{live.url}/v1/chat/completions",
            content=b"[" * 100000,
            headers={"Content-Type": "application/json"},
            timeout=60,
        )
    )
    latencies = health_latencies(live.url, thread)
    response = outcome["result"]
    assert response.status_code == 400 and "nests 100000 levels" in response.json()["error"]["message"]
    assert max(latencies) < FAST, latencies
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert "Traceback" not in caplog.text and "RecursionError" not in caplog.text


def test_huge_message_refused_without_blocking_health(live):
    body = json.dumps({"messages": [{"role": "user", "content": "hello world " * 250_000}]}).encode()  # 3 MB
    thread, outcome = in_background(
        lambda: httpx.post(
            f"{live.url}/v1/chat/completions", content=body, timeout=60, headers={"Content-Type": "application/json"}
        )
    )
    latencies = health_latencies(live.url, thread)
    error = _error(outcome["result"], 400)
    assert error["code"] == "context_length_exceeded" and "at least" in error["message"]
    assert max(latencies) < FAST, latencies


def health_during(url: str, busy: threading.Thread) -> list[float]:
    """Seconds each /health request took, sent one after another until ``busy`` ends (three at least)."""
    times = []
    with httpx.Client(base_url=url, timeout=60) as client:
        while busy.is_alive() or len(times) < 3:
            started = time.perf_counter()
            assert client.get("/health").status_code == 200
            times.append(time.perf_counter() - started)
            time.sleep(0.01)
    busy.join(timeout=120)
    return times


def test_huge_tokenize_refused_at_once_while_health_stays_fast(live):
    body = {"content": "hello world " * 325_000, "with_pieces": True}  # 3.9 MB, under the body limit
    thread, outcome = in_background(lambda: httpx.post(f"{live.url}/tokenize", json=body, timeout=120))
    latencies = health_latencies(live.url, thread)
    assert max(latencies) < BUSY, latencies
    error = _error(outcome["result"], 400)
    assert error["param"] == "content" and f"at most {MAX_CHARACTERS}" in error["message"]


@pytest.mark.parametrize(
    "route, body, status",
    [
        ("/tokenize", {"content": "hello world " * 18_000}, 400),  # 216k characters: too many tokens here
        ("/tokenize", {"content": "hello world " * 5_000, "with_pieces": True}, 200),
        ("/detokenize", {"tokens": list(range(300)) * 200}, 200),
    ],
    ids=["tokens-counted-then-refused", "pieces", "detokenize"],
)
def test_tokenizing_leaves_health_fast(live, route, body, status):
    """Tokenizing the most text a request may send takes the tiny tokenizer (a token per character or so)
    a second or more; ``/health`` answers meanwhile."""
    thread, outcome = in_background(lambda: httpx.post(f"{live.url}{route}", json=body, timeout=120))
    latencies = health_during(live.url, thread)
    assert outcome["result"].status_code == status, outcome["result"].text[:300]
    assert max(latencies) < BUSY, latencies


def closed_within(sock: socket.socket, seconds: float, dribble: bytes = b"") -> float | None:
    """Seconds until the server closes ``sock`` (None: still open after ``seconds``), sending one byte of
    ``dribble`` every 0.2 s meanwhile."""
    started = time.monotonic()
    sock.settimeout(0.2)
    position = 0
    while time.monotonic() - started < seconds:
        try:
            if position < len(dribble):
                sock.send(dribble[position : position + 1])
                position += 1
            if sock.recv(4096) == b"":
                return time.monotonic() - started
        except TimeoutError:
            continue
        except OSError:  # reset by the server
            return time.monotonic() - started
    return None


@pytest.mark.parametrize(
    "opening",
    [b"", b"GET /hea", b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "],
    ids=["silent", "request-line", "headers"],
)
def test_slow_request_headers_are_cut_off(live, opening):
    with socket.create_connection(("127.0.0.1", live.port), timeout=10) as sock:
        sock.sendall(opening)
        took = closed_within(sock, 5.0, dribble=b"a" * 100)
    assert took is not None and took < 2.5, took


def test_slow_headers_after_a_request_on_the_same_connection_are_cut_off(live):
    with socket.create_connection(("127.0.0.1", live.port), timeout=10) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        took = closed_within(sock, 5.0, dribble=b"a" * 100)
    assert took is not None and took < 2.5, took


def test_many_slow_connections_neither_lock_out_others_nor_stay(live):
    socks = [socket.create_connection(("127.0.0.1", live.port), timeout=10) for _ in range(100)]
    try:
        for sock in socks:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: a")
        started = time.perf_counter()
        health = httpx.get(f"{live.url}/health", timeout=10)
        took = time.perf_counter() - started
        assert health.status_code == 200 and took < FAST, (health.status_code, took)
        time.sleep(2.0)  # past the 1 s header deadline
        for sock in socks:
            sock.settimeout(2.0)
            try:
                assert sock.recv(4096) == b""
            except ConnectionResetError:
                pass
    finally:
        for sock in socks:
            sock.close()


def test_stalled_body_gets_408(live):
    with socket.create_connection(("127.0.0.1", live.port), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"messages": '
        )
        started = time.monotonic()
        answer = sock.recv(65536)
        took = time.monotonic() - started
    assert answer.startswith(b"HTTP/1.1 408") and took < 3.0, (answer, took)


def test_long_stream_outlives_the_connection_deadlines(int4_bundle, engine):
    """An answer streaming for longer than the header and keep-alive deadlines is not cut."""
    slow = Engine.from_bundle(int4_bundle, mode="spec", threads=1)
    generate = slow.generate

    def slowed(*args, **kwargs):
        for chunk in generate(*args, **kwargs):
            time.sleep(0.03)
            yield chunk

    slow.generate = slowed
    app, _ = build_app(slow, name="tiny")
    server = LiveServer(app, header_timeout=0.5, keep_alive=1)
    try:
        body = {"messages": CHAT, "max_tokens": 120, "temperature": 0, "stream": True}
        started = time.monotonic()
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as response:
            lines = [line for line in response.iter_lines() if line]
        took = time.monotonic() - started
    finally:
        server.stop()
    assert lines[-1] == "data: [DONE]"
    text = "".join(
        json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
        for line in lines[:-1]
        if json.loads(line[6:])["choices"]
    )
    assert text == engine.complete(CHAT, max_new_tokens=120, temperature=0.0).text
    assert took > 1.5, took
