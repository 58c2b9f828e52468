"""Session workloads on the peers and on edge-spec in one run: decode tokens/s per session category.

A session is a sequence of requests whose later turns repeat earlier material (a file edited again, a
tool result quoted back, an answer revised); drafting from text that earlier requests produced pays
there, and only there, so a prompt-by-prompt benchmark cannot show it.  The sessions come from
``edge_spec/data/bench/sessions.jsonl`` through :mod:`edge_spec.bench.sessions`: each turn's
request is built from the session's script plus *that engine's own* earlier answers, so every engine
replays the session as a client talking to it would.

Same pair everywhere: target qwen2.5-coder-1.5b-instruct, drafter qwen2.5-coder-0.5b-instruct (our
Q4_K_M GGUFs in ``models/gguf``), ``--threads`` (2) threads, greedy unless ``--temperature``:

* **llama.cpp** (``llama-server`` built by ``--prepare`` from the sources vendored in the
  llama-cpp-python sdist ``LLAMA_CPP_PYTHON``, in ``models/llamacpp``), on the GGUFs themselves, one
  server per mode, started once and kept for the whole run (one slot, ``cache_prompt``), so its n-gram
  tables learn from every request it serves, as a long-running server's do:

  - ``plain`` (labelled ``llamacpp ar``): no speculation;
  - ``draft`` (``llamacpp draft``): the 0.5B drafter, ``-md DRAFT --spec-type draft-simple
    --spec-draft-n-max N --spec-draft-n-min 0`` with N = ``--llamacpp-draft-max`` (default 3, this
    llama.cpp's own default; older servers drafted 16 with ``--draft-max``, a flag it has removed),
    ``--spec-draft-p-min`` left at its default (0);
  - ``ngram-mod`` (``llamacpp ngram-mod``): its hashed n-gram pool shared by all requests, at its
    defaults (match 24 tokens, draft 48 to 64);
  - ``ngram-cache`` (``llamacpp ngram-cache``): its context n-gram statistics, 8 tokens a draft, no
    static or dynamic cache files.

  ``--llamacpp-extra`` appends further ``llama-server`` arguments to every mode (e.g. to tune n-gram
  lengths).  Each request goes to ``/completion`` as token ids; its timings are the server's own.
* **onnxruntime-genai** (``models/genai-venv``; ``benchmarks/spec_peers.py``'s worker and exports,
  imported, not copied): plain (``genai ar``) and speculative with the drafter at fixed K (``genai K4``
  ...), greedy only.
* **edge-spec** (this venv): one engine per mode, each loaded for it alone: ``ar``, ``spec`` (the
  default chain, drafting from the suffix cache) and ``spec-nocache`` (the same chain drafting from
  the request alone: ``loop_config("spec", suffix=False)``).  Every engine's suffix cache is cleared
  before each session, so a session never drafts from another's answers (llama.cpp's n-gram tables,
  by contrast, carry over: a server cannot be told where a session starts); ``--warm`` keeps ours
  across sessions too, cleared once at the start.

Every engine gets its prompt as the same kind of token ids: our tokenizer's chat template (with the
session's tools) over the turn's messages.  tokens/s is one rule for all (``edge_spec/bench/
peers.py``): the answer's tokens after the first, up to and without any EOS, over the time from the first
token (the prefill's pick) to the last, the pass that produced the EOS included; llama.cpp's time is its
``timings.predicted_ms`` (first sampled token to last), onnxruntime-genai's and ours as in
``spec_peers.py``.  Pooled per category (all turns, and later turns alone, where the repeats are).
The turns interleave: turn t of a session runs on every engine before turn t + 1, so drift in the
machine's speed hits all alike.  Where an engine's prompt equals its family's ``ar`` prompt for the
turn, its greedy answer is compared with that ``ar`` answer (``= ar``: the losslessness check).

Usage::

    .venv/bin/python benchmarks/session_peers.py --prepare        # llama.cpp build + genai exports (idempotent, resumable; long)
    .venv/bin/python benchmarks/session_peers.py                  # every session, every engine and mode
    .venv/bin/python benchmarks/session_peers.py --peers llamacpp --llamacpp-modes plain,ngram-mod \\
        --ours ar,spec --per-category 1 --turns 2 --max-tokens 16
    .venv/bin/python benchmarks/session_peers.py --report bench-results/sessions   # re-table a saved run

Results: the tables on stdout and in ``OUTPUT/summary.md``, one JSON file per engine mode (every turn's
record and answer) and ``OUTPUT/run.json`` (settings, versions, summary); the servers' logs beside them.
A run stopped early keeps each session it finished in ``OUTPUT.partial.jsonl``, and the same command run again
replays only the rest (not with ``--warm``, whose suffix caches would start empty: it starts over).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tarfile
import time
import urllib.error
import urllib.request
from dataclasses import asdict
from pathlib import Path

import cpu_mask  # what each of benchmarks/cpu_mask.py's masks hides
import spec_peers  # onnxruntime-genai's worker, exports and preparation; puts the repository on sys.path

shared = spec_peers.shared
ROOT = spec_peers.ROOT
from edge_spec.bench.journal import RunJournal, fingerprint  # noqa: E402
from edge_spec.bench.journal import run_settings as run_settings_of  # noqa: E402
from edge_spec.bench.peers import decode_tokens, ms_cell, ratio_cell, result, summarize  # noqa: E402
from edge_spec.errors import EdgeSpecError  # noqa: E402
from edge_spec.files import write_text_atomic  # noqa: E402

LLAMA_CPP_PYTHON = "0.3.36"  # its sdist vendors ggml-org/llama.cpp@0c1e57098; the flags below are that version's
LLAMACPP_DIR = ROOT / "models" / "llamacpp"
LLAMACPP_SDIST_DIR = LLAMACPP_DIR / "src"
LLAMACPP_SOURCE = LLAMACPP_SDIST_DIR / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"
# a CPU made to look like another kind (benchmarks/cpu_mask.py) gets its own build, for that kind's instruction sets
CPU_MASK = os.environ.get("CPUID_MASK", "")
LLAMACPP_BUILD = LLAMACPP_DIR / (f"build-{CPU_MASK}" if CPU_MASK else "build")
LLAMACPP_TARGETS = ("llama-server", "llama-speculative-simple")
LLAMA_SERVER = LLAMACPP_BUILD / "bin" / "llama-server"
# CPU, tuned for this machine, static binaries; no network at build or run time (no TLS, no web UI download)
CMAKE_OPTIONS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
]
# ggml's x86 options for what /proc/cpuinfo reports: on a CPU with AMX they replace -march=native, which
# would turn on this llama.cpp's AMX matmul (ggml_backend_amx_mul_mat), which crashes at the first decode on
# an Intel Xeon with AMX (the kernel granting the tile state); every other instruction set stays on
X86_FEATURES = {
    "avx": "GGML_AVX",
    "avx2": "GGML_AVX2",
    "fma": "GGML_FMA",
    "f16c": "GGML_F16C",
    "bmi2": "GGML_BMI2",
    "avx_vnni": "GGML_AVX_VNNI",
    "avx512f": "GGML_AVX512",
    "avx512vbmi": "GGML_AVX512_VBMI",
    "avx512_vnni": "GGML_AVX512_VNNI",
    "avx512_bf16": "GGML_AVX512_BF16",
}
TARGET_GGUF = ROOT / "models" / "gguf" / f"{spec_peers.TARGET}.gguf"
DRAFT_GGUF = ROOT / "models" / "gguf" / f"{spec_peers.DRAFT}.gguf"
LLAMACPP_MODES = ("plain", "draft", "ngram-mod", "ngram-cache")
#: the modes whose server drafts from n-gram tables fed by every answer it gives (``LlamaServer.learns``)
LEARNING_MODES = frozenset({"ngram-mod", "ngram-cache"})
OURS_MODES = ("ar", "spec", "spec-nocache")
PEERS = ("llamacpp", "genai")
OUTPUT = ROOT / "bench-results" / "sessions"
WARMUP_TOKENS = spec_peers.WARMUP_TOKENS
SERVER_START_SECONDS = 600
log = shared.log


# --------------------------------------------------------------------------- preparation (cached)


def ensure_llamacpp_source() -> Path:
    """llama.cpp's sources as vendored in the pinned llama-cpp-python sdist (pip's ordinary download of
    it), unpacked under models/llamacpp/src (through a .partial directory, renamed when complete)."""
    if (LLAMACPP_SOURCE / "CMakeLists.txt").is_file():
        return LLAMACPP_SOURCE
    sdist = LLAMACPP_SDIST_DIR / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
    if not sdist.is_file():
        log(f"downloading the llama-cpp-python {LLAMA_CPP_PYTHON} sdist into {LLAMACPP_SDIST_DIR} (once)")
        subprocess.run(
            [
                *(sys.executable, "-m", "pip", "download", f"llama-cpp-python=={LLAMA_CPP_PYTHON}"),
                *("--no-binary", ":all:", "--no-deps", "-d", str(LLAMACPP_SDIST_DIR)),
            ],
            check=True,
        )
    unpacked = LLAMACPP_SOURCE.parents[1]
    partial = LLAMACPP_SDIST_DIR / "unpack.partial"
    shutil.rmtree(partial, ignore_errors=True)
    log(f"unpacking {sdist.name}")
    with tarfile.open(sdist) as tar:
        tar.extractall(partial, filter="data")
    shutil.rmtree(unpacked, ignore_errors=True)  # an unpacked tree without its sources: replaced
    (partial / unpacked.name).rename(unpacked)
    shutil.rmtree(partial)
    return LLAMACPP_SOURCE


def ensure_llamacpp() -> Path:
    """``llama-server`` (and ``llama-speculative-simple``, for checks by hand) built with CMake into
    models/llamacpp/build/bin; an interrupted build resumes where it stopped."""
    binaries = [LLAMACPP_BUILD / "bin" / target for target in LLAMACPP_TARGETS]
    if all(b.is_file() for b in binaries):
        return LLAMA_SERVER
    source = ensure_llamacpp_source()
    if not (LLAMACPP_BUILD / "CMakeCache.txt").is_file():
        generator = ["-G", "Ninja"] if shutil.which("ninja") else []
        log(f"configuring llama.cpp in {LLAMACPP_BUILD}")
        options = [*CMAKE_OPTIONS, *cpu_options()]
        subprocess.run(["cmake", "-S", str(source), "-B", str(LLAMACPP_BUILD), *generator, *options], check=True)
    log(f"building {', '.join(LLAMACPP_TARGETS)} (once; tens of minutes on 2 cores)")
    started = time.perf_counter()
    jobs = str(min(os.cpu_count() or 2, 2))  # more jobs than cores only adds memory
    subprocess.run(["cmake", "--build", str(LLAMACPP_BUILD), "-j", jobs, "--target", *LLAMACPP_TARGETS], check=True)
    log(f"llama.cpp built in {time.perf_counter() - started:.0f} s: {llamacpp_version()}")
    return LLAMA_SERVER


def cpu_options() -> list[str]:
    """``-march=native`` (``GGML_NATIVE``), or on an x86 CPU with AMX, or one that ``benchmarks/cpu_mask.py``
    makes look like another kind, its (remaining) instruction sets one by one."""
    flags = cpu_mask.cpu_flags()
    if CPU_MASK:
        flags -= cpu_mask.HIDDEN_FLAGS[CPU_MASK]
    elif "amx_int8" not in flags:
        return ["-DGGML_NATIVE=ON"]
    return ["-DGGML_NATIVE=OFF"] + [f"-D{option}={'ON' if f in flags else 'OFF'}" for f, option in X86_FEATURES.items()]


def llamacpp_version() -> str:
    """``llama-server --version``'s version line, e.g. ``version: 0 (0c1e570)``."""
    out = subprocess.run([str(LLAMA_SERVER), "--version"], capture_output=True, text=True)
    lines = [line for line in (out.stdout + out.stderr).splitlines() if line.startswith("version")]
    return lines[0] if lines else "unknown"


def prepare(peers: list[str], threads: int) -> None:
    if "llamacpp" in peers:
        log("prepare llamacpp")
        ensure_llamacpp()
    if "genai" in peers:
        spec_peers.prepare(["genai"], threads)


# --------------------------------------------------------------------------- llama.cpp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_help() -> str:
    return subprocess.run([str(LLAMA_SERVER), "--help"], capture_output=True, text=True).stdout


def mode_flags(mode: str, threads: int, draft_max: int, extra: str = "") -> list[str]:
    """The ``llama-server`` arguments that make ``mode`` (one of :data:`LLAMACPP_MODES`), then ``extra``
    (split as a shell would): none for plain, the drafter GGUF for draft, the n-gram types at their defaults."""
    if mode not in LLAMACPP_MODES:
        raise ValueError(f"unknown llama.cpp mode {mode!r}; choose among {', '.join(LLAMACPP_MODES)}")
    flags = {
        "plain": [],
        "draft": [
            *("-md", str(DRAFT_GGUF), "--spec-type", "draft-simple", "-td", str(threads), "-tbd", str(threads)),
            *("--spec-draft-n-max", str(draft_max), "--spec-draft-n-min", "0"),
        ],
        "ngram-mod": ["--spec-type", "ngram-mod"],
        "ngram-cache": ["--spec-type", "ngram-cache"],
    }[mode]
    return flags + shlex.split(extra)


class LlamaServer:
    """One ``llama-server`` in one mode, alive for the whole run: one slot, so every request reuses the
    previous one's KV cache where the prompts agree and feeds the same n-gram tables.  With
    ``reuse_prompts`` False every request reads its whole prompt (``cache_prompt`` false, and no prompt
    cache in RAM to restore one from), as a benchmark of unrelated prompts and their first tokens needs."""

    def __init__(self, mode: str, args, log_dir: Path, reuse_prompts: bool = True) -> None:
        self.mode = mode
        self.engine = f"llamacpp {'ar' if mode == 'plain' else mode}"
        self.reuse_prompts = reuse_prompts
        threads = str(args.threads)
        self.flags = mode_flags(mode, args.threads, args.llamacpp_draft_max, args.llamacpp_extra)
        if not reuse_prompts:
            self.flags = ["--cache-ram", "0", *self.flags]
        self.port = free_port()
        command = [
            *(str(LLAMA_SERVER), "-m", str(TARGET_GGUF), "-c", str(args.ctx), "-np", "1"),
            *("--threads", threads, "--threads-batch", threads, "--host", "127.0.0.1", "--port", str(self.port)),
            "--no-webui",
            *self.flags,
        ]
        self.command = command
        self.log_path = log_dir / f"llama-server-{mode}.log"
        self.log_file = self.log_path.open("w")
        log(f"starting llama-server ({mode}): {shlex.join(command[1:])}")
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen(self.command, stdout=self.log_file, stderr=subprocess.STDOUT, cwd=ROOT)
        try:
            self.wait_ready()
        except BaseException:
            self.close()  # a server that never became ready is not left behind
            raise

    @property
    def learns(self) -> bool:
        """Whether the server drafts from what its earlier requests answered (its n-gram tables): a prompt
        asked again would be drafted from its own earlier answer."""
        return self.mode in LEARNING_MODES

    def restart(self, warmup_ids: list[int]) -> None:
        """The same server started afresh (its n-gram tables empty), warmed up as at the start."""
        self.stop()
        self.start()
        self.warm_up(warmup_ids, 0.0, 0)

    def failure(self, what: str) -> SystemExit:
        tail = self.log_path.read_text(errors="replace").strip().splitlines()[-1:] or ["(empty log)"]
        return SystemExit(f"llama-server ({self.mode}) {what}; its log {self.log_path} ends: {tail[0]}")

    def wait_ready(self) -> None:
        deadline = time.monotonic() + SERVER_START_SECONDS
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise self.failure(f"exited with status {self.proc.returncode} while starting")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as answer:
                    if answer.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        raise self.failure(f"was not ready after {SERVER_START_SECONDS} s")

    def complete(self, ids: list[int], new_tokens: int, temperature: float, seed: int) -> dict:
        """One completion of ``ids``; its sampling settings are ours (no top-k, top-p or min-p cut)."""
        body = {
            "prompt": ids,
            "n_predict": new_tokens,
            "temperature": temperature,
            "seed": seed,
            "top_k": 0,
            "top_p": 1.0,
            "min_p": 0.0,
            "repeat_penalty": 1.0,
            "cache_prompt": self.reuse_prompts,
            "return_tokens": True,
            "stream": False,
        }
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/completion",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=3600) as answer:
                return json.load(answer)
        except urllib.error.HTTPError as error:
            raise SystemExit(f"llama-server ({self.mode}) refused a request: {error.read().decode()[:300]}") from None
        except (urllib.error.URLError, ConnectionError) as error:
            raise self.failure(f"did not answer ({error})") from None

    def run(self, ids: list[int], new_tokens: int, temperature: float, seed: int, eos: set[int]) -> dict:
        """A :func:`result` from the server's own timings: ``predicted_ms`` runs from the first sampled
        token to the last (the EOS's pass included), ``predicted_n`` counts every token, the EOS too."""
        answer = self.complete(ids, new_tokens, temperature, seed)
        timings = answer["timings"]
        stats = {key: timings[key] for key in ("predicted_n", "predicted_ms", "prompt_n", "prompt_ms", "cache_n")}
        for key in ("draft_n", "draft_n_accepted"):
            if key in timings:
                stats[key] = timings[key]
        stats["stop_type"] = answer.get("stop_type")
        return result(
            [int(t) for t in answer["tokens"]],
            eos,
            1,
            timings["predicted_ms"] / 1000,
            timings["prompt_ms"] / 1000,
            stats=stats,
        )

    def warm_up(self, ids: list[int], temperature: float, seed: int) -> None:
        """One short completion, which also shows that the server runs the speculative type asked for
        (its flags have changed between llama.cpp versions; a wrong one would time plain decoding)."""
        answer = self.complete(ids, WARMUP_TOKENS, temperature, seed)
        types = str(answer.get("generation_settings", {}).get("speculative.types")).split(",")
        expected = {"plain": "none", "draft": "draft-simple"}.get(self.mode, self.mode)
        if expected not in types or (self.mode == "plain" and types != ["none"]):
            raise SystemExit(f"llama-server ({self.mode}) runs speculative types {','.join(types)}, not {expected}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def close(self) -> None:
        self.stop()
        self.log_file.close()


# --------------------------------------------------------------------------- edge-spec


class Ours:
    """One engine per mode, each loaded for it alone (an ar answer must not fill the spec engine's
    suffix cache with the session's text)."""

    def __init__(self, modes: list[str], args) -> None:
        from edge_spec.runtime.engine import Engine
        from edge_spec.runtime.loops.config import loop_config
        from edge_spec.runtime.model import huge_pages

        ceiling = {} if args.gamma is None else {"gamma": args.gamma}

        def config(mode: str):
            if mode == "spec-nocache":
                try:
                    return loop_config("spec", suffix=False, **ceiling)
                except TypeError:
                    raise SystemExit("--ours spec-nocache: this edge-spec has no suffix cache setting") from None
            return loop_config(mode, **({} if mode == "ar" else ceiling))

        self.engines = {
            mode: Engine.from_bundle(args.bundle, threads=args.threads, config=config(mode)) for mode in modes
        }
        for engine in self.engines.values():
            engine.complete("warm up", max_new_tokens=WARMUP_TOKENS)
        huge_pages.wait_all()  # timed on the pages the models keep (model/huge_pages.py)

    def start_session(self) -> None:
        for engine in self.engines.values():
            cache = getattr(engine, "suffix_cache", None)
            if cache is not None:
                cache.clear()

    def run(self, mode: str, messages: list[dict], tools, new_tokens: int, temperature: float, seed: int) -> dict:
        engine = self.engines[mode]
        for _ in engine.generate(
            messages, tools=tools or None, max_new_tokens=new_tokens, temperature=temperature, seed=seed
        ):
            pass
        stats = engine.last_stats
        extra = {}
        if stats.spec is not None:
            summary = asdict(stats.spec)
            extra["stats"] = {
                key: summary[key] for key in ("tau", "mean_gamma", "acceptance_rate", "target_calls", "sources")
            }
        eos = set(engine.bundle.tokenizer.eos_token_ids)
        return result(list(engine.last_token_ids), eos, 1, stats.decode_seconds, stats.prefill_seconds, **extra)

    def close(self) -> None:
        for engine in self.engines.values():
            engine.close()


# --------------------------------------------------------------------------- the sessions


def load_sessions(args) -> list[dict]:
    """The sessions asked for (``--sessions``, ``--category``, ``--per-category``), refused in one line
    where the file or a category is wrong."""
    from edge_spec.bench.sessions import load_sessions as load
    from edge_spec.bench.sessions import select_sessions

    try:
        return select_sessions(load(args.sessions), args.category, args.per_category)
    except EdgeSpecError as error:
        raise SystemExit(str(error)) from None


def slug(engine: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", engine).strip("-")


def mark_identical(turn: dict[str, dict]) -> None:
    """At one turn: each speculative answer against its family's ar answer, where the prompts agree."""
    for engine, run in turn.items():
        family = engine.split()[0]
        own_ar = turn.get(f"{family} ar")
        if own_ar is None or own_ar is run:
            continue
        run["record"]["identical_to_ar"] = (
            run["answer"] == own_ar["answer"] if run["prompt"] == own_ar["prompt"] else None
        )


# --------------------------------------------------------------------------- tables


def tables(records: list[dict]) -> str:
    """Markdown: per category (all turns, then turns 2 and later) and overall, every engine's pooled
    decode tokens/s, its ratio to its family's ar and to our ar, its greedy answers equal to ar, and its mean
    time to the first token (each turn's prompt read, as far as the engine had not read it already)."""
    engines = list(dict.fromkeys(r["engine"] for r in records))
    later = [r for r in records if r["turn"] > 0]
    rows = summarize(records, engines) + [
        dict(row, category=f"{row['category']}, turns 2+") for row in summarize(later, engines)
    ]
    # each category's all-turns table, then its later turns; overall last
    rows.sort(key=lambda r: (r["category"].startswith("overall"), r["category"].split(",")[0], r["category"]))
    out, category = [], None
    for row in rows:
        if row["category"] != category:
            category = row["category"]
            out += [
                "",
                f"### {category}",
                "",
                "| engine | turns | tok/s | vs own ar | vs ours ar | = ar | mean tokens | TTFT ms |",
                "|---|---:|---:|---:|---:|---:|---:|---:|",
            ]
        out.append(
            f"| {row['engine']} | {row['prompts']} | {row['tokens_per_second']:.2f} | {ratio_cell(row['vs_own_ar'])} | "
            f"{ratio_cell(row['vs_ours_ar'])} | {row['identical_to_ar'] or '-'} | {row['mean_new_tokens']:.1f} | "
            f"{ms_cell(row.get('first_token_ms'))} |"
        )
    return "\n".join(out).strip() + "\n"


def report(directory: Path) -> str:
    """The tables of a saved run, recomputed from the engine files' records in ``directory``."""
    return tables(saved_records(directory))


def saved_records(directory: Path) -> list[dict]:
    """Every turn record of a saved run, engine by engine in the run's order (refused in one line where
    ``directory`` holds no readable run)."""
    if not directory.is_dir():
        raise SystemExit(f"--report: no such directory: {directory}")
    files: dict[str, list[dict]] = {}
    order: list[str] = []  # the run's engine order, from its run.json
    for path in sorted(directory.glob("*.json")):
        try:
            saved = json.loads(path.read_text())
        except (OSError, ValueError, RecursionError) as error:
            raise SystemExit(f"{path}: not readable as JSON ({type(error).__name__})") from None
        if not isinstance(saved, dict):
            continue
        if isinstance(saved.get("engine"), str) and isinstance(saved.get("records"), list):
            files[saved["engine"]] = saved["records"]
        elif path.name == "run.json" and isinstance(saved.get("settings"), dict):
            order = list(saved["settings"])
    if not files:
        raise SystemExit(f"{directory}: no session_peers engine results in it")
    engines = [e for e in order if e in files] + [e for e in files if e not in order]
    return [r for engine in engines for r in files[engine]]


# --------------------------------------------------------------------------- main


def comma_list(value: str, allowed: tuple[str, ...], option: str) -> list[str]:
    items = [v for v in value.split(",") if v]
    unknown = [v for v in items if v not in allowed]
    if unknown:
        raise SystemExit(f"{option}: unknown {', '.join(unknown)}; choose among {', '.join(allowed)}")
    return items


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prepare", action="store_true", help="build llama.cpp and the genai exports, then stop")
    parser.add_argument("--peers", default=",".join(PEERS), help="comma list: llamacpp, genai ('' for none)")
    parser.add_argument("--llamacpp-modes", default=",".join(LLAMACPP_MODES), help="comma list of llama.cpp modes")
    parser.add_argument(
        "--llamacpp-draft-max", type=int, default=3, help="llama.cpp draft mode's --spec-draft-n-max (its default: 3)"
    )
    parser.add_argument("--llamacpp-extra", default="", help="further llama-server arguments, for every mode")
    parser.add_argument("--k", default="4,8,16", help="onnxruntime-genai's draft lengths (comma list, 1-16)")
    parser.add_argument("--ours", default=",".join(OURS_MODES), help="comma list of our modes ('' for none)")
    parser.add_argument("--gamma", type=int, help="our ceiling on drafts per round (default: edge-spec's)")
    parser.add_argument("--bundle", type=Path, help="our bundle (default: the README's export)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (onnxruntime-genai: only 0)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed of every request")
    parser.add_argument("--ctx", type=int, default=16384, help="llama-server's context (-c), prompt + answer")
    parser.add_argument("--sessions", type=Path, help="session file (default: the shipped set)")
    parser.add_argument("--category", action="append", default=[], help="only sessions of this category (repeatable)")
    parser.add_argument("--per-category", type=int, help="at most this many sessions per category")
    parser.add_argument("--turns", type=int, help="at most this many turns of each session")
    parser.add_argument("--max-tokens", type=int, help="cap every turn's answer at this many tokens")
    parser.add_argument(
        "--warm",
        action="store_true",
        help="keep our suffix caches across sessions (emptied once, at the start), as llama.cpp keeps its n-gram tables",
    )
    parser.add_argument("--output", type=Path, default=OUTPUT, help="directory for the results")
    parser.add_argument("--report", type=Path, help="print the tables of a saved run (its directory) and stop")
    args = parser.parse_args()
    args.peers = comma_list(args.peers, PEERS, "--peers")
    args.llamacpp_modes = comma_list(args.llamacpp_modes, LLAMACPP_MODES, "--llamacpp-modes")
    args.ours = comma_list(args.ours, OURS_MODES, "--ours")
    try:
        args.k = [int(k) for k in args.k.split(",") if k]
    except ValueError:
        raise SystemExit(f"--k: a comma list of integers, not {args.k!r}") from None
    if args.k and (min(args.k) < 1 or max(args.k) > 16):
        raise SystemExit("--k values must be 1-16 (onnxruntime-genai's limit)")
    for name in ("threads", "ctx", "per_category", "turns", "max_tokens", "llamacpp_draft_max"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be at least 1")
    if args.temperature < 0:
        raise SystemExit("--temperature must be 0 or more")
    if args.temperature > 0 and "genai" in args.peers:
        raise SystemExit("--temperature > 0: the onnxruntime-genai worker decodes greedily only; leave genai out")
    try:
        shlex.split(args.llamacpp_extra)
    except ValueError as error:
        raise SystemExit(f"--llamacpp-extra: {error}") from None
    return args


def check_prepared(args) -> None:
    if "llamacpp" in args.peers and args.llamacpp_modes:
        if not LLAMA_SERVER.is_file():
            raise SystemExit(f"llama.cpp is not built: run {Path(__file__).name} --prepare --peers llamacpp first")
        missing = [m for m in args.llamacpp_modes if m not in ("plain", "draft") and m not in server_help()]
        if missing:
            raise SystemExit(f"this llama-server has no --spec-type {', '.join(missing)} ({llamacpp_version()})")
        for gguf in (TARGET_GGUF, DRAFT_GGUF):
            if not gguf.is_file():
                raise SystemExit(f"missing {gguf.relative_to(ROOT)}: fetch the default pair's GGUFs first")
    if "genai" in args.peers and not (spec_peers.GENAI_SPEC_DIR / "genai_config.json").is_file():
        raise SystemExit(f"onnxruntime-genai is not prepared: run {Path(__file__).name} --prepare --peers genai first")


def record_of(engine: str, answer: dict) -> dict:
    """An engine's :func:`result` as a table record (its ids left out), tokens/s by the shared rule."""
    record = {key: value for key, value in answer.items() if key != "ids"}
    seconds = answer["decode_seconds"]
    record.update(
        engine=engine,
        peer=engine.split()[0],
        tokens_per_second=decode_tokens(answer) / seconds if seconds > 0 else 0.0,
    )
    return record


def start_engines(args, warmup_ids: list[int], eos: set[int], stack: list) -> dict:
    """Every engine mode asked for, loaded and warmed up: its label -> a function of one turn
    ``(ids, messages, tools, new_tokens)`` returning a :func:`result`.  ``stack`` collects what to close."""
    runners, settings = {}, {}
    if "llamacpp" in args.peers:
        for mode in args.llamacpp_modes:
            server = LlamaServer(mode, args, args.output)
            stack.append(server)
            server.warm_up(warmup_ids, args.temperature, args.seed)
            settings[server.engine] = {"llama_server_flags": server.flags, "ctx": args.ctx}
            runners[server.engine] = lambda ids, messages, tools, n, s=server: s.run(
                ids, n, args.temperature, args.seed, eos
            )
    if "genai" in args.peers:
        log("loading onnxruntime-genai (ar + speculative) in models/genai-venv")
        spec = {
            "threads": args.threads,
            "new_tokens": WARMUP_TOKENS,
            "ks": args.k,
            "warmup_ids": warmup_ids,
            "ar_dir": str(shared.ensure_genai_model(args.threads, spec_peers.TARGET)),
            "spec_dir": str(spec_peers.GENAI_SPEC_DIR),
        }
        worker = spec_peers.Peer("genai", shared.GENAI_PY, spec)
        stack.append(worker)
        for k in [0, *args.k]:
            engine = f"genai {f'K{k}' if k else 'ar'}"
            settings[engine] = {"k": k, "version": worker.info["version"]}
            runners[engine] = lambda ids, messages, tools, n, k=k: worker.ask({"ids": ids, "k": k, "new_tokens": n})
    if args.ours:
        log(f"loading edge-spec: one engine for each of {', '.join(args.ours)}")
        ours = Ours(args.ours, args)
        stack.append(ours)
        for mode in args.ours:
            settings[f"ours {mode}"] = {"mode": mode, "bundle": str(args.bundle)}
            runners[f"ours {mode}"] = lambda ids, messages, tools, n, mode=mode: ours.run(
                mode, messages, tools, n, args.temperature, args.seed
            )
    return runners, settings


def replay(sessions: list[dict], runners: dict, ours, tokenizer, args, journal) -> dict[str, list[dict]]:
    """Every session, turn by turn, on every engine (turn t everywhere before turn t + 1); each engine's
    answers feed its own later turns.  A session the journal holds is not run again.  Returns each engine's
    records."""
    from edge_spec.bench.sessions import turn_messages

    records: dict[str, list[dict]] = {engine: [] for engine in runners}
    if journal.done:
        log(f"resuming: {len(journal.done)} of {len(sessions)} sessions measured before ({journal.path})")
    for index, session in enumerate(sessions):
        if index in journal:
            for engine, rows in journal.get(index).items():
                records[engine].extend(rows)
            continue
        if ours is not None and (index == 0 or not args.warm):
            ours.start_session()
        answers: dict[str, list[str]] = {engine: [] for engine in runners}
        turns = len(session["turns"]) if args.turns is None else min(args.turns, len(session["turns"]))
        new_tokens = session["max_tokens"] if args.max_tokens is None else min(args.max_tokens, session["max_tokens"])
        tools = session.get("tools") or None
        for t in range(turns):
            turn = {}
            for engine, runner in runners.items():
                messages = turn_messages(session, t, answers[engine])
                ids = tokenizer.encode_chat(messages, tools=tools)
                if engine.startswith("llamacpp") and len(ids) + new_tokens > args.ctx:
                    raise SystemExit(
                        f"session {session['id']} turn {t + 1}: {len(ids)} prompt + {new_tokens} answer tokens "
                        f"exceed llama-server's context {args.ctx}: raise --ctx"
                    )
                answer = runner(ids, messages, tools, new_tokens)
                text = tokenizer.decode(answer["ids"])
                answers[engine].append(text)
                record = record_of(engine, answer)
                record.update(
                    category=session["category"],
                    session=session["id"],
                    session_index=index,
                    turn=t,
                    prompt_tokens=len(ids),
                    text=text,
                )
                turn[engine] = {"record": record, "prompt": ids, "answer": answer["ids"]}
            mark_identical(turn)
            for engine, run in turn.items():
                records[engine].append(run["record"])
            # every turn so far, kept as it comes: a run stopped early still leaves what it measured
            write_text_atomic(args.output / "turns.json", json.dumps(records))
            log(
                f"session {index + 1}/{len(sessions)} ({session['category']}, {session['id']}) turn {t + 1}/{turns}: "
                + ", ".join(f"{e} {r['record']['tokens_per_second']:.1f}" for e, r in turn.items())
            )
        journal.add(
            index, {engine: [r for r in rows if r["session_index"] == index] for engine, rows in records.items()}
        )
    return records


#: options that change where a run's results go or what a command does besides measuring, not the measurement
NOT_SETTINGS = ("output", "report", "prepare")


def run_settings(args: argparse.Namespace, sessions: list[dict]) -> dict:
    """What a run measures under (every option but ``NOT_SETTINGS``, the sessions themselves, the machine): a run
    stopped early resumes only under the very same (``edge_spec.bench.journal``)."""
    return run_settings_of(vars(args), NOT_SETTINGS, sessions=fingerprint(sessions))


def open_journal(args: argparse.Namespace, sessions: list[dict]) -> RunJournal:
    """The run's journal, refused in one line where it cannot resume: other settings, or ``--warm``, whose
    suffix caches a resumed run would start empty."""
    try:
        journal = RunJournal(args.output, run_settings(args, sessions))
    except EdgeSpecError as error:
        raise SystemExit(str(error)) from None
    if journal.done and args.warm:
        raise SystemExit(
            f"{journal.path}: a --warm run cannot resume (its suffix caches would start empty): remove that file "
            "to start over"
        )
    return journal


def main() -> None:
    args = parse_args()
    if args.report:
        print(report(args.report), end="")
        return
    if args.prepare:
        prepare(args.peers, args.threads)
        return
    check_prepared(args)
    from edge_spec.bench.sessions import DEFAULT_SESSIONS
    from edge_spec.paths import DEFAULT_BUNDLE
    from edge_spec.runtime.text import TextTokenizer

    sessions = load_sessions(args)
    source = args.sessions or DEFAULT_SESSIONS
    args.bundle = args.bundle or DEFAULT_BUNDLE
    tokenizer = TextTokenizer(args.bundle)
    warmup_ids = tokenizer.encode_chat([{"role": "user", "content": "warm up"}])
    journal = open_journal(args, sessions)
    args.output.mkdir(parents=True, exist_ok=True)
    versions = {"llamacpp": llamacpp_version()} if "llamacpp" in args.peers and args.llamacpp_modes else {}
    load_before = os.getloadavg()
    stack: list = []
    try:
        runners, settings = start_engines(args, warmup_ids, set(tokenizer.eos_token_ids), stack)
        if not runners:
            raise SystemExit("no engines: name some with --peers, --llamacpp-modes, --k or --ours")
        ours = next((item for item in stack if isinstance(item, Ours)), None)
        records = replay(sessions, runners, ours, tokenizer, args, journal)
    except KeyboardInterrupt:
        raise SystemExit(journal.stopped(len(sessions), "sessions")) from None
    finally:
        for item in reversed(stack):
            item.close()
    load_after = os.getloadavg()
    for engine, rows in records.items():
        path = args.output / f"{slug(engine)}.json"
        write_text_atomic(path, json.dumps({"engine": engine, "settings": settings[engine], "records": rows}, indent=1))
    everything = [r for rows in records.values() for r in rows]
    table = tables(everything)
    heading = (
        f"{len(sessions)} sessions from {source.name}, "
        f"{'greedy' if args.temperature == 0 else f'temperature {args.temperature}, seed {args.seed}'}, "
        f"{args.threads} threads; {', '.join(f'{p} {v}' for p, v in versions.items()) or 'no llama.cpp'}; "
        f"load average 1/5/15 min before {'/'.join(f'{x:.2f}' for x in load_before)}, "
        f"after {'/'.join(f'{x:.2f}' for x in load_after)} ({os.cpu_count()} cores)"
    )
    write_text_atomic(args.output / "summary.md", f"{heading}\n\n{table}")
    write_text_atomic(  # written last: a run whose run.json exists is whole (machine_kind.py skips it)
        args.output / "run.json",
        json.dumps(
            {
                "target": spec_peers.TARGET,
                "draft": spec_peers.DRAFT,
                "sessions": str(source),
                "session_ids": [s["id"] for s in sessions],
                "threads": args.threads,
                "gamma": args.gamma,
                "temperature": args.temperature,
                "seed": args.seed,
                "turns": args.turns,
                "max_tokens": args.max_tokens,
                "warm": args.warm,
                "versions": versions,
                "settings": settings,
                "load_before": load_before,
                "load_after": load_after,
                "summary": summarize(everything, list(records)),
            },
            indent=1,
        ),
    )
    journal.finish()
    print(f"\n{heading}\n\n{table}\nwrote {args.output}/ (summary.md, run.json, one JSON per engine mode)")


if __name__ == "__main__":
    main()
