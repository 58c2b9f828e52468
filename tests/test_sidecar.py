"""``edge-spec serve`` as an application's sidecar: ``--port 0`` and one JSON ready line on stdout,
``--api-key auto``, and ``--exit-with-parent``: the server is gone within 2 s of its parent's death (the
parent SIGKILLed, never getting to stop it), or of its stdin closing, and leaves no process behind.
The Node example (``examples/sidecar``) runs under ``node --test`` against the same tiny bundle."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.slow  # subprocesses that load a bundle

ROOT = Path(__file__).resolve().parents[1]
EXIT_SECONDS = 2.0
SERVE = [sys.executable, "-m", "edge_spec.cli", "serve"]
# A parent process, as an application is: starts the server (argv[1]: stdin "pipe" or "null"; the rest:
# its command), reads its ready line, prints it with the server's pid, then lives on until killed; a line
# "close" on its own stdin makes it close the server's.
PARENT = """
import json, subprocess, sys, time
stdin = subprocess.PIPE if sys.argv[1] == "pipe" else subprocess.DEVNULL
server = subprocess.Popen(sys.argv[2:], stdin=stdin, stdout=subprocess.PIPE, stderr=sys.stderr)
line = server.stdout.readline()
print(json.dumps({"pid": server.pid, "ready": line.decode()}), flush=True)
for command in sys.stdin:
    if command.strip() == "close":
        server.stdin.close()
time.sleep(3600)
"""


def process_gone(pid: int) -> bool:
    """No such process, or only its exit status left (a zombie: the init of a container may not reap)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):  # no /proc: not a zombie that could be told apart
        return False


def wait_gone(pid: int, timeout: float) -> float | None:
    """Seconds until ``pid`` is gone (None: still there after ``timeout``)."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if process_gone(pid):
            return time.monotonic() - started
        time.sleep(0.02)
    return None


def kill_quietly(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class Sidecar:
    """The server started by a parent process of its own (``PARENT``)."""

    def __init__(self, bundle: Path, log: Path, stdin: str = "pipe", *flags: str) -> None:
        command = [*SERVE, str(bundle), "--port", "0", "--threads", "1", "--api-key", "auto", *flags]
        self.log = log
        with open(log, "w") as err:
            self.parent = subprocess.Popen(
                [sys.executable, "-c", PARENT, stdin, *command],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
            )
        line = self.parent.stdout.readline()
        if not line:
            self.parent.kill()
            raise AssertionError(f"no ready line:\n{log.read_text()}")
        started = json.loads(line)
        self.pid = started["pid"]
        self.ready_line = started["ready"]
        self.ready = json.loads(self.ready_line)

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.ready['api_key']}"}

    def close(self) -> None:
        kill_quietly(self.parent.pid)
        self.parent.wait(10)
        kill_quietly(self.pid)


@pytest.fixture()
def sidecar(int4_bundle, tmp_path):
    started = []

    def start(stdin: str = "pipe", *flags: str) -> Sidecar:
        started.append(Sidecar(int4_bundle, tmp_path / f"server{len(started)}.err", stdin, *flags))
        return started[-1]

    yield start
    for one in started:
        one.close()


def test_the_ready_line_names_the_url_the_key_and_the_model(sidecar, int4_bundle):
    server = sidecar("pipe", "--exit-with-parent")
    assert server.ready_line.endswith("\n") and server.ready_line.count("\n") == 1
    assert set(server.ready) == {"url", "api_key", "model"}
    assert server.ready["url"].startswith("http://127.0.0.1:") and not server.ready["url"].endswith(":0")
    assert server.ready["model"] == int4_bundle.name
    assert len(server.ready["api_key"]) >= 32
    url = server.ready["url"]
    assert httpx.get(f"{url}/v1/models", timeout=10).status_code == 401  # the key is required
    models = httpx.get(f"{url}/v1/models", headers=server.headers(), timeout=10)
    assert models.status_code == 200 and models.json()["data"][0]["id"] == server.ready["model"]


def test_each_launch_gets_its_own_key(sidecar):
    assert sidecar().ready["api_key"] != sidecar().ready["api_key"]


def stream_a_little(server: Sidecar) -> str:
    body = {"messages": [{"role": "user", "content": "def is_prime(n):"}], "max_tokens": 8, "stream": True}
    text = ""
    with httpx.stream(
        "POST", f"{server.ready['url']}/v1/chat/completions", json=body, headers=server.headers(), timeout=30
    ) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                text += json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
    return text


@pytest.mark.parametrize("stdin", ["pipe", "null"])  # null: the parent-death signal and the polling alone
def test_the_server_exits_within_two_seconds_of_its_parent_being_killed(sidecar, stdin):
    server = sidecar(stdin, "--exit-with-parent")
    assert stream_a_little(server)
    port_url = server.ready["url"]
    os.kill(server.parent.pid, signal.SIGKILL)
    server.parent.wait(10)
    took = wait_gone(server.pid, 10)
    print(f"server gone {took} s after its parent was killed (stdin {stdin})")
    assert took is not None and took < EXIT_SECONDS, (took, server.log.read_text()[-2000:])
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{port_url}/health", timeout=2)


def test_the_server_exits_when_its_stdin_closes(sidecar):
    """The parent lives on but closes the server's stdin (what a parent that dies does too)."""
    server = sidecar("pipe", "--exit-with-parent")
    server.parent.stdin.write("close\n")
    server.parent.stdin.flush()
    took = wait_gone(server.pid, 10)
    assert took is not None and took < EXIT_SECONDS, (took, server.log.read_text()[-2000:])
    assert server.parent.poll() is None
    assert "stdin was closed: stopping" in server.log.read_text()


def test_without_the_flag_the_server_outlives_its_parent(sidecar):
    """Negative control: the watch is what stops it."""
    server = sidecar("pipe")
    os.kill(server.parent.pid, signal.SIGKILL)
    server.parent.wait(10)
    assert wait_gone(server.pid, 3.0) is None
    assert httpx.get(f"{server.ready['url']}/health", timeout=5).status_code == 200


NODE = shutil.which("node")


@pytest.mark.skipif(NODE is None, reason="node is not installed (the sidecar example is a Node program)")
def test_the_node_example(int4_bundle, tmp_path):
    env = {
        **os.environ,
        "EDGE_SPEC_BUNDLE": str(int4_bundle),
        "EDGE_SPEC_COMMAND": json.dumps([*SERVE, "--threads", "1"]),
    }
    # the test file named: from Node 22 on, --test takes glob patterns rather than directories
    result = subprocess.run(
        [NODE, "--test", "examples/sidecar/sidecar.test.mjs"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "# pass 3" in result.stdout and "# fail 0" in result.stdout, result.stdout[-4000:]
