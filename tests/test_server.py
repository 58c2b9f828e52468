"""``edge-spec serve``: real server processes on loopback ports, driven by the real ``openai`` client.

Answers are checked against the engine's own greedy output for the same prompt (tiny bundle: gibberish,
but deterministic).  The tiny model writes thousands of tokens per second, so the tests that need an
answer still running (queue full, disconnect, SIGTERM) serve it through an engine slowed down per chunk
(``SLOWED``: same server code, same answers).  Every wait is bounded in time.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from edge_spec.runtime.engine import Engine  # noqa: E402
from edge_spec.runtime.text import TextTokenizer  # noqa: E402
from edge_spec.server import fim as fim_module  # noqa: E402
from edge_spec.server.errors import ApiError  # noqa: E402
from edge_spec.server.schemas import parse_chat, parse_completion, parse_json  # noqa: E402

KEY = "test-key"
CHAT = [{"role": "user", "content": "def is_prime(n):"}]  # greedy answer runs past 200 tokens (no EOS)
# `edge-spec serve` with Engine.generate sleeping after each chunk (argv[1]: seconds)
SLOWED = """
import sys, time
from edge_spec.runtime import engine
delay = float(sys.argv.pop(1))
generate = engine.Engine.generate
def slowed(self, *args, **kwargs):
    for chunk in generate(self, *args, **kwargs):
        time.sleep(delay)
        yield chunk
engine.Engine.generate = slowed
from edge_spec.cli import main
sys.argv[0] = "edge-spec"
main()
"""


def wait_for(condition, timeout: float, what: str, step: float = 0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(step)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


class Server:
    """``edge-spec serve BUNDLE --port 0 --threads 1 ARGS`` in a subprocess (``delay``: slowed engine)."""

    def __init__(self, bundle, log_dir, *args: str, delay: float = 0.0, api_key: str | None = None) -> None:
        self.api_key = api_key
        self.err_path = log_dir / "server.err"
        command = ["serve", str(bundle), "--port", "0", "--threads", "1", *args]
        if api_key:
            command += ["--api-key", api_key]
        launcher = ["-c", SLOWED, str(delay)] if delay else ["-m", "edge_spec.cli"]
        with open(self.err_path, "w") as err, open(log_dir / "server.out", "w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, *launcher, *command], stdout=out, stderr=err, stdin=subprocess.DEVNULL
            )
        try:
            port = wait_for(self._port, 60, "the server to start", step=0.05)
        except AssertionError:
            self.stop()
            raise AssertionError(self.log()) from None
        self.url = f"http://127.0.0.1:{port}"

    def _port(self):
        found = re.search(r"serving on http://127\.0\.0\.1:(\d+)", self.log())
        if found is None and self.proc.poll() is not None:
            raise AssertionError(f"server exited {self.proc.returncode}:\n{self.log()}")
        return found and int(found.group(1))

    def log(self) -> str:
        return self.err_path.read_text()

    def client(self, **kwargs):
        kwargs.setdefault("api_key", self.api_key or "anything")
        return openai.OpenAI(base_url=f"{self.url}/v1", max_retries=0, timeout=30, **kwargs)

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health", timeout=10).json()

    def wait_idle(self) -> dict:
        def idle():
            health = self.health()
            return health if not health["busy"] and not health["waiting"] else None

        return wait_for(idle, 20, "the server to be idle")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            return self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(timeout=10)


@pytest.fixture(scope="module")
def engine(int4_bundle):
    """The reference: the engine `serve` runs by default (spec mode, exact), used one request at a time."""
    return Engine.from_bundle(int4_bundle, mode="spec", threads=1)


def greedy(engine, prompt, n: int, **kwargs) -> str:
    return engine.complete(prompt, max_new_tokens=n, temperature=0.0, **kwargs).text


@pytest.fixture(scope="module")
def server(int4_bundle, tmp_path_factory):
    srv = Server(int4_bundle, tmp_path_factory.mktemp("server"), "--alias", "m", api_key=KEY)
    yield srv
    assert srv.stop() == 0
    assert "Traceback" not in srv.log()


@pytest.fixture(scope="module")
def slow_server(int4_bundle, tmp_path_factory):
    """No API key, one place in the queue, 10 ms per chunk: a 200-token answer takes about 2 s."""
    srv = Server(int4_bundle, tmp_path_factory.mktemp("slow"), "--max-queue", "1", "--alias", "m", delay=0.01)
    yield srv
    assert srv.stop() == 0
    assert "Traceback" not in srv.log()


# -- answers ---------------------------------------------------------------------------------------


def test_models_lists_the_bundle_by_name_and_its_alias(server, int4_bundle):
    client = server.client()
    assert [m.id for m in client.models.list().data] == [int4_bundle.name, "m"]
    assert client.models.retrieve(int4_bundle.name).id == int4_bundle.name
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="gpt-4o", messages=CHAT, max_tokens=2)
    assert missing.value.body["code"] == "model_not_found"


def test_chat_equals_engine_greedy(server, engine, int4_bundle):
    expected = greedy(engine, CHAT, 24)
    response = server.client().chat.completions.create(
        model=int4_bundle.name, messages=CHAT, max_tokens=24, temperature=0
    )
    assert response.choices[0].message.content == expected
    assert response.choices[0].finish_reason == "length"
    assert response.usage.prompt_tokens == engine.last_stats.prompt_tokens
    assert response.usage.completion_tokens == 24
    stats = response.model_extra["x_edge_spec"]
    assert stats["mode"] == "spec" and stats["new_tokens"] == 24 and stats["tau"] >= 1.0
    assert stats["drafted"] >= stats["accepted"] >= 0 and stats["tokens_per_second"] > 0


def test_streamed_chat_equals_engine_greedy_with_usage_chunk(server, engine):
    expected = greedy(engine, CHAT, 20)
    stream = server.client().chat.completions.create(
        model="m",
        messages=CHAT,
        max_completion_tokens=20,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    *_, last_choice, usage = chunks
    assert last_choice.choices[0].finish_reason == "length" and "x_edge_spec" in last_choice.model_extra
    assert usage.choices == [] and usage.usage.completion_tokens == 20
    assert all(c.usage is None for c in chunks[:-1])


def test_stream_ends_with_done(server):
    body = {"messages": CHAT, "max_tokens": 5, "temperature": 0, "stream": True}
    with httpx.stream(
        "POST", f"{server.url}/v1/chat/completions", json=body, timeout=30, headers={"Authorization": f"Bearer {KEY}"}
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines)
    assert "usage" not in json.loads(lines[-2][6:])  # no usage chunk unless asked for


def test_completions_raw_prompt_with_stop_strings(server, engine):
    prompt = "def is_prime(n):"
    full = greedy(engine, prompt, 40)
    stop = full[12:14]
    stops = ["<|fim_pad|>", "\n\n\n", "class ", stop, "zzzz", "def main", "# end", "if __name__", "qqq", "```"]
    expected = greedy(engine, prompt, 40, stop=stops)
    assert len(expected) < len(full) and full.startswith(expected)
    client = server.client()
    response = client.completions.create(model="m", prompt=prompt, max_tokens=40, temperature=0, stop=stops)
    assert response.choices[0].text == expected and response.choices[0].finish_reason == "stop"
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens
    stream = client.completions.create(
        model="m",
        prompt=prompt,
        max_tokens=40,
        temperature=0,
        stop=stops,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == response.usage.completion_tokens


def test_concurrent_clients_get_their_sequential_answers(server, engine):
    prompts = [[{"role": "user", "content": f"Question {i}: what is {i} * 7?"}] for i in range(8)]
    expected = [greedy(engine, p, 24) for p in prompts]
    barrier = threading.Barrier(8, timeout=30)

    def ask(i: int) -> str:
        client = server.client()
        barrier.wait()
        if i % 2:
            stream = client.chat.completions.create(
                model="m", messages=prompts[i], max_tokens=24, temperature=0, stream=True
            )
            return "".join(c.choices[0].delta.content or "" for c in stream)
        response = client.chat.completions.create(model="m", messages=prompts[i], max_tokens=24, temperature=0)
        return response.choices[0].message.content

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, range(8), timeout=60))
    assert answers == expected


# -- errors ----------------------------------------------------------------------------------------


def _post(server, path: str, content, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if isinstance(content, (bytes, str)):
        return httpx.post(
            server.url + path, content=content, timeout=30, headers={**headers, "Content-Type": "application/json"}
        )
    return httpx.post(server.url + path, json=content, headers=headers, timeout=30)


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def test_request_errors(server, int4_bundle):
    assert "parse the JSON" in _error(_post(server, "/v1/chat/completions", b'{"messages": [}'), 400)["message"]
    assert _error(_post(server, "/v1/chat/completions", {"model": "m"}), 400)["param"] == "messages"
    assert _error(_post(server, "/v1/chat/completions", {"messages": CHAT, "n": 2}), 400)["param"] == "n"
    assert (
        _error(_post(server, "/v1/chat/completions", {"messages": CHAT, "temperature": "hot"}), 400)["param"]
        == "temperature"
    )
    long_chat = [{"role": "user", "content": "word " * 400}]
    error = _error(_post(server, "/v1/chat/completions", {"messages": long_chat}), 400)
    assert error["code"] == "context_length_exceeded"
    assert re.search(r"context length is 256 tokens, but the prompt is (at least )?\d{3,} tokens", error["message"])
    assert _error(_post(server, "/v1/completions", {"prompt": "x", "suffix": "y"}), 400)["param"] == "suffix"
    assert (
        _error(_post(server, "/v1/chat/completions", {"messages": CHAT}, key="wrong"), 401)["code"] == "invalid_api_key"
    )
    _error(_post(server, "/v1/chat/completions", {"messages": CHAT}, key=None), 401)
    _error(httpx.get(server.url + "/v1/models", timeout=10), 401)
    _error(httpx.get(server.url + "/v1/nothing", timeout=10), 404)
    with pytest.raises(openai.AuthenticationError):
        server.client(api_key="wrong").chat.completions.create(model="m", messages=CHAT, max_tokens=2)
    # unknown fields and fields that change nothing are ignored; one that would change the answer is refused
    assert (
        _error(_post(server, "/v1/chat/completions", {"messages": CHAT, "presence_penalty": 0.5}), 400)["param"]
        == "presence_penalty"
    )
    body = {
        "messages": CHAT,
        "max_tokens": 3,
        "temperature": 0,
        "presence_penalty": 0,
        "logit_bias": {},
        "user": "u",
        "tools": [],
        "some_future_field": {"x": 1},
    }
    assert _post(server, "/v1/chat/completions", body).status_code == 200
    assert server.health()["requests"].get("failed", 0) == 0


def test_any_key_accepted_without_api_key(slow_server):
    slow_server.wait_idle()
    assert slow_server.client(api_key="sk-anything").models.list().data
    assert _post(slow_server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2}, key=None).status_code == 200


# -- queue, disconnects, shutdown ------------------------------------------------------------------


def test_queue_full_gets_429_with_retry_after(slow_server, engine):
    slow_server.wait_idle()
    short = [{"role": "user", "content": "hello world"}]
    expected_long, expected_short = greedy(engine, CHAT, 150), greedy(engine, short, 8)
    client = slow_server.client()
    stream = client.chat.completions.create(model="m", messages=CHAT, max_tokens=150, temperature=0, stream=True)
    # headers come once the answer has started: the engine is busy now, so the next request waits
    with ThreadPoolExecutor(1) as pool:
        queued = pool.submit(
            lambda: (
                client.chat.completions.create(model="m", messages=short, max_tokens=8, temperature=0)
                .choices[0]
                .message.content
            )
        )
        wait_for(lambda: slow_server.health()["waiting"] == 1, 10, "the second request to queue")
        with pytest.raises(openai.RateLimitError) as refused:
            client.chat.completions.create(model="m", messages=short, max_tokens=8, temperature=0)
        text = "".join(c.choices[0].delta.content or "" for c in stream)
        assert queued.result(timeout=30) == expected_short
    assert text == expected_long
    assert int(refused.value.response.headers["retry-after"]) >= 1
    assert refused.value.body["code"] == "queue_full"
    assert slow_server.health()["requests"]["refused"] >= 1


def test_disconnect_cancels_and_next_request_starts_promptly(slow_server, int4_bundle):
    slow_server.wait_idle()
    cancelled_before = slow_server.health()["requests"].get("cancelled", 0)
    client = slow_server.client()
    stream = client.chat.completions.create(model="m", messages=CHAT, max_tokens=200, temperature=0, stream=True)
    for count, _ in enumerate(stream, 1):  # a few chunks of a ~2 s answer, then hang up
        if count == 3:
            break
    stream.close()
    other = [{"role": "user", "content": "hello world"}]
    started = time.monotonic()
    response = client.chat.completions.create(model="m", messages=other, max_tokens=8, temperature=0)
    elapsed = time.monotonic() - started
    fresh = Engine.from_bundle(int4_bundle, mode="spec", threads=1)
    assert response.choices[0].message.content == greedy(fresh, other, 8)
    assert elapsed < 1.0 and response.model_extra["x_edge_spec"]["queue_seconds"] < 0.5
    health = slow_server.wait_idle()
    assert health["requests"]["cancelled"] == cancelled_before + 1
    assert re.search(r"\(cancelled, disconnect\)", slow_server.log())


@pytest.mark.parametrize("grace", ["10", "0"])
def test_sigterm_during_stream_exits_cleanly(int4_bundle, tmp_path, engine, grace):
    """Grace 10 s: the answer in progress is finished; grace 0: it stops at the next token and the
    stream ends with an error event.  Either way exit status 0 and no traceback."""
    expected = greedy(engine, CHAT, 120)
    srv = Server(int4_bundle, tmp_path, "--shutdown-grace", grace, "--alias", "m", delay=0.01)
    try:
        stream = srv.client().chat.completions.create(
            model="m", messages=CHAT, max_tokens=120, temperature=0, stream=True
        )
        chunks = [next(stream), next(stream)]
        srv.proc.send_signal(signal.SIGTERM)
        error = None
        try:
            chunks += list(stream)
        except openai.APIError as exc:
            error = exc
        returncode = srv.proc.wait(timeout=30)
    finally:
        srv.stop()
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    log = srv.log()
    assert returncode == 0, log
    assert "Traceback" not in log and "stopped" in log
    if grace == "10":
        assert error is None and text == expected and chunks[-1].choices[0].finish_reason == "length"
    else:
        assert error is not None and "shutting down" in str(error)
        assert expected.startswith(text) and len(text) < len(expected)


def test_serve_refuses_a_busy_port(int4_bundle, tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "edge_spec.cli", "serve", str(int4_bundle), "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
            stdin=subprocess.DEVNULL,
        )
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert f"error: cannot listen on 127.0.0.1:{port}" in result.stderr


# -- in-process: request parsing, FIM --------------------------------------------------------------


def test_request_parsing():
    chat = parse_chat(
        {
            "messages": [
                {"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": None},
            ],
            "max_tokens": 5,
            "max_completion_tokens": 7,
            "stop": "x",
            "seed": 3,
            "unknown": 1,
        }
    )
    assert chat.messages == [{"role": "system", "content": "ab"}, {"role": "assistant", "content": ""}]
    assert chat.sampling.max_tokens == 7 and chat.sampling.stop == ("x",) and chat.sampling.seed == 3
    assert chat.sampling.temperature == 1.0 and not chat.stream  # OpenAI's defaults
    assert chat.sampling.sampler is None and chat.sampling.resolved().sampler == "coupled"  # seeded: reproducible
    assert chat.sampling.resolved(coupled_available=False).sampler == "rejection"
    assert parse_chat({"messages": CHAT}).sampling.resolved().sampler == "rejection"
    assert parse_chat({"messages": CHAT, "sampler": "coupled"}).sampling.options().sampler == "coupled"
    completion = parse_completion(
        {"prompt": ["p"], "suffix": "s", "stream": True, "stream_options": {"include_usage": True}}
    )
    assert (completion.prompt, completion.suffix, completion.sampling.max_tokens) == ("p", "s", 16)
    assert completion.stream and completion.include_usage
    for bad, param in (
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": ""}]}, "messages[0].role"),
        ({"messages": CHAT, "stop": [1]}, "stop"),
        ({"messages": CHAT, "max_tokens": 0}, "max_tokens"),
        ({"messages": CHAT, "top_p": 0}, "top_p"),
        ({"messages": CHAT, "stream": "yes"}, "stream"),
        ({"messages": CHAT, "sampler": "gumbel"}, "sampler"),
    ):
        with pytest.raises(ApiError) as error:
            parse_chat(bad)
        assert error.value.status == 400 and error.value.param == param
    with pytest.raises(ApiError):
        parse_completion({"prompt": [1, 2, 3]})
    with pytest.raises(ApiError):
        parse_json(b"[1, 2]")


@pytest.fixture(scope="module")
def fim_bundle(int4_bundle, tmp_path_factory):
    """The tiny bundle with Qwen's FIM markers in its vocabulary but not among the added tokens, as in a
    bundle exported from GGUF."""
    bundle = tmp_path_factory.mktemp("fim") / "tiny-fim"
    shutil.copytree(int4_bundle, bundle)
    path = bundle / "tokenizer.json"
    data = json.loads(path.read_text())
    vocab = data["model"]["vocab"]
    for name in ("<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>"):
        vocab[name] = len(vocab)
    path.write_text(json.dumps(data))
    from edge_spec.manifest import read_manifest, tokenizer_record, write_manifest

    manifest = read_manifest(bundle)
    manifest["tokenizer"] = tokenizer_record(bundle)  # the edited file is the bundle's tokenizer now
    write_manifest(bundle, manifest)
    return bundle


def test_fim_markers_are_one_token_each(fim_bundle):
    from tokenizers import Tokenizer

    from edge_spec.runtime.text import register_control_tokens

    raw = Tokenizer.from_file(str(fim_bundle / "tokenizer.json"))
    assert len(raw.encode("<|fim_prefix|>", add_special_tokens=False).ids) > 1  # the file alone splits it
    assert register_control_tokens(raw) == ["<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>"]
    tokenizer = TextTokenizer(fim_bundle)  # registers them at load, for generate --raw as for the server
    prefix_id = tokenizer.tokenizer.token_to_id("<|fim_prefix|>")
    assert tokenizer.encode("<|fim_prefix|>") == [prefix_id]
    fim = fim_module.fim_tokens(tokenizer)
    prompt = fim.prompt("def f(x):\n    ", "\n    return y\n")
    ids = tokenizer.encode(prompt)
    assert ids[0] == prefix_id and ids[-1] == tokenizer.tokenizer.token_to_id("<|fim_middle|>")
    assert tokenizer.decode(ids) == prompt  # kept in decoded text: stop strings naming them can match


def test_fim_completion_in_process(fim_bundle):
    from starlette.testclient import TestClient

    from edge_spec.server.serve import build_app

    fim_engine = Engine.from_bundle(fim_bundle, mode="spec", threads=1)
    app, state = build_app(fim_engine, name="tiny-fim")
    before, after = "def f(x):\n    ", "\n    return y\n"
    prompt = "<|fim_prefix|>" + before + "<|fim_suffix|>" + after + "<|fim_middle|>"
    expected = greedy(fim_engine, prompt, 12)  # the markers are special tokens since build_app
    with TestClient(app, base_url="http://127.0.0.1:8000") as client:
        body = {
            "model": "tiny-fim",
            "prompt": before,
            "suffix": after,
            "max_tokens": 12,
            "temperature": 0,
            "stop": ["\n\n"] * 3,
        }
        response = client.post("/v1/completions", json=body, headers={"Authorization": "Bearer any"})
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == expected.split("\n\n")[0]
        raw = client.post("/v1/completions", json={**body, "suffix": None, "prompt": prompt})
        assert raw.json()["choices"][0]["text"] == response.json()["choices"][0]["text"]
    assert state.worker.counts["completed"] == 2
