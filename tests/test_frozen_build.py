"""The frozen build (packaging/edge-spec.spec, PyInstaller): a one-folder ``edge-spec`` executable that
runs a bundle with no Python installed.  Built once per content of the spec, the package and the installed
libraries (kept under build/frozen/, reused while they stay the same), then run from a clean
environment (no PATH, no venv: only HOME and a fresh EDGE_SPEC_HOME) on the tiny bundle: its greedy
answer is the venv's, its package data is there, it serves the chat page and the API, and the export
commands, left out, say so in one line."""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.helpers import assert_one_line_error

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("PyInstaller") is None,
        reason="the frozen build needs PyInstaller: pip install -e '.[test]'",
    ),
]

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "packaging" / "edge-spec.spec"
CACHE = ROOT / "build" / "frozen"
BUILD_SECONDS = 900
EXCLUDED = ("torch", "transformers", "gguf", "scipy", "PySide6")  # the export and test extras stay out


def build_key() -> str:
    """What the build depends on: the spec, the package's files, the installed distributions, Python."""
    digest = hashlib.sha256(sys.version.encode())
    for path in sorted([*SPEC.parent.glob("*"), *(ROOT / "edge_spec").rglob("*")]):
        if path.is_file() and "__pycache__" not in path.parts:
            digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    for dist in sorted(f"{d.metadata['Name']}=={d.version}" for d in importlib.metadata.distributions()):
        digest.update(dist.encode() + b"\0")
    return digest.hexdigest()[:16]


@pytest.fixture(scope="module")
def frozen_app() -> Path:
    """The built executable: from the cache when nothing it depends on changed, else built now (into a
    temporary folder first, moved into place whole)."""
    folder = CACHE / build_key() / "edge-spec"
    if not (folder / "edge-spec").is_file():
        staging = CACHE / f"staging-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        started = time.perf_counter()
        result = subprocess.run(
            [sys.executable, "-m", "PyInstaller", "--noconfirm", "--log-level", "WARN"]
            + ["--distpath", str(staging), "--workpath", str(CACHE / "work"), str(SPEC)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=BUILD_SECONDS,
        )
        assert result.returncode == 0, result.stderr[-4000:]
        print(f"frozen build: {time.perf_counter() - started:.0f} s")
        for old in CACHE.iterdir():  # one build is kept
            if old.name not in ("work", staging.name):
                shutil.rmtree(old, ignore_errors=True)
        folder.parent.mkdir(parents=True)
        (staging / "edge-spec").rename(folder)
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def clean_env(tmp_path: Path) -> dict[str, str]:
    """What `env -i HOME=... EDGE_SPEC_HOME=...` leaves: no PATH, no venv, no edge-spec settings."""
    (tmp_path / "home").mkdir(parents=True, exist_ok=True)
    return {"HOME": str(tmp_path / "home"), "EDGE_SPEC_HOME": str(tmp_path / "edge-spec-home")}


def folder_size(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file() and not path.is_symlink())


def first_output(command: list[str], env: dict[str, str]) -> tuple[float, subprocess.CompletedProcess]:
    """Seconds from launch to the first byte of the answer on stdout, and the finished process."""
    started = time.perf_counter()
    # unbuffered: communicate() reads the pipe itself, past anything a buffered read(1) would keep
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0)
    first = process.stdout.read(1)
    seconds = time.perf_counter() - started
    rest, err = process.communicate(timeout=300)
    return seconds, subprocess.CompletedProcess(command, process.returncode, first + rest, err)


def test_the_frozen_app_answers_as_the_venv_does(frozen_app, fp32_bundle, tmp_path):
    app = frozen_app / "edge-spec"
    args = ["generate", str(fp32_bundle), "hi", "--max-tokens", "48"]
    venv_seconds, venv = first_output([sys.executable, "-m", "edge_spec.cli", *args], clean_env(tmp_path / "venv"))
    frozen_seconds, frozen = first_output([str(app), *args], clean_env(tmp_path / "frozen"))
    assert venv.returncode == 0, venv.stderr.decode()
    assert frozen.returncode == 0, frozen.stderr.decode()
    assert frozen.stdout == venv.stdout and len(frozen.stdout.strip()) > 0
    assert b"tok/s" in frozen.stderr
    again_seconds, again = first_output([str(app), *args], clean_env(tmp_path / "frozen"))  # the costs cached
    assert again.returncode == 0 and again.stdout == venv.stdout
    size = folder_size(frozen_app)
    print(
        f"frozen folder {size / (1 << 20):.0f} MiB; launch to first token on the tiny bundle: frozen "
        f"{frozen_seconds:.2f} s (first run, the machine's costs measured), {again_seconds:.2f} s (next run); "
        f"venv {venv_seconds:.2f} s (first run)"
    )
    internal = frozen_app / "_internal"
    assert not [name for name in EXCLUDED if (internal / name).exists()]


def test_the_frozen_app_has_its_data_and_says_what_it_leaves_out(frozen_app, fp32_bundle, tmp_path):
    app = str(frozen_app / "edge-spec")
    env = clean_env(tmp_path)
    bundles = Path(env["EDGE_SPEC_HOME"]) / "bundles"
    bundles.mkdir(parents=True)
    (bundles / "tiny").symlink_to(fp32_bundle)
    listed = subprocess.run([app, "models"], env=env, capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0 and "tiny  tiny-target / tiny-draft" in listed.stdout, listed.stdout + listed.stderr
    assert (frozen_app / "_internal" / "edge_spec" / "server" / "static" / "index.html").is_file()  # the chat page
    refused = subprocess.run([app, "export"], env=env, capture_output=True, text=True, timeout=120)
    assert_one_line_error(refused, "needs the export extra")


def test_the_frozen_app_serves(frozen_app, fp32_bundle, tmp_path):
    """The server's modules (uvicorn imports some by name) and the chat page are in the folder."""
    command = [str(frozen_app / "edge-spec"), "serve", str(fp32_bundle), "--port", "0"]
    server = subprocess.Popen(
        command, env=clean_env(tmp_path), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
    )
    try:
        ready = json.loads(server.stdout.readline())  # the sidecar's ready line, once it listens
        with urllib.request.urlopen(ready["url"] + "/", timeout=60) as page:
            assert b"<title>edge-spec chat</title>" in page.read()
        request = urllib.request.Request(
            ready["url"] + "/v1/chat/completions",
            data=json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "seed": 0}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            answer = json.loads(response.read())
        # a sampled answer of the random tiny model may end at its end-of-turn token before the limit
        tokens, reason = answer["usage"]["completion_tokens"], answer["choices"][0]["finish_reason"]
        assert (tokens, reason) == (4, "length") or (0 < tokens < 4 and reason == "stop"), answer
    finally:
        server.terminate()
        server.wait(timeout=30)
