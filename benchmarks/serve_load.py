"""The HTTP server's cost: one streamed answer through ``edge-spec serve`` vs ``edge-spec generate``, then
a bounded load run.

1. **Overhead.** ``edge-spec serve BUNDLE --threads T`` (the engine's defaults: spec mode) runs; for each of
   ``--repeats`` prompts (a different one each time, so no run reuses the previous run's cached prompt),
   ``edge-spec generate BUNDLE PROMPT --threads T --max-tokens N`` (greedy, same defaults, a fresh process:
   its stats line gives decode tok/s and prefill seconds = time to first token inside the engine), then the
   real ``openai`` client streams the same prompt from the server (interleaved, so drift in the machine's
   speed hits both): client-side time to first token (request sent → first content chunk) and decode tok/s
   ((completion tokens - 1) / (last content chunk - first content chunk)), next to the engine's own
   numbers for that request (``x_edge_spec``).  Per-token overhead = client ms/token - engine ms/token;
   request overhead = client wall time - engine prefill - engine decode.
2. **Load.** ``--requests`` chat requests (``--load-tokens`` each, greedy, different prompts) from
   ``--clients`` concurrent clients against the same server: all must complete; p50 / p95 latency,
   queue time, throughput.

Every wait is bounded (``--timeout`` per request, a deadline for the server to start).

Usage::

    .venv/bin/python benchmarks/serve_load.py                       # default bundle, --threads 2
    .venv/bin/python benchmarks/serve_load.py --repeats 3 --max-tokens 128 --requests 20 --clients 4
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [  # one per repeat, the same for generate and serve: no repeat reuses the last one's cached prompt
    "Write a Python function that checks whether a number is prime.",
    "Write a Python function that checks whether a string is a palindrome.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Write a Python function that flattens a nested list.",
    "Write a Python function that counts the words in a text file.",
]
LOAD_PROMPTS = [
    "Write a Python function that reverses a linked list.",
    "Explain what a Python generator is in two sentences.",
    "Write a SQL query that counts orders per customer.",
    "Write a bash one-liner that counts lines in all .py files.",
    "Write a Python function that merges two sorted lists.",
]
STATS_LINE = re.compile(r"\[(\d+) tokens, ([\d.]+) tok/s, prefill ([\d.]+) s(?:, τ ([\d.]+))?, (\w+)\]")


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "edge_spec.cli", *args]


def run_generate(bundle: str, prompt: str, threads: int, max_tokens: int, timeout: float) -> dict:
    started = time.perf_counter()
    result = subprocess.run(
        cli("generate", bundle, prompt, "--threads", str(threads), "--max-tokens", str(max_tokens)),
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
    wall = time.perf_counter() - started
    found = STATS_LINE.search(result.stderr)
    if result.returncode != 0 or found is None:
        raise SystemExit(f"generate failed ({result.returncode}):\n{result.stderr[-2000:]}")
    return {
        "new_tokens": int(found.group(1)),
        "tokens_per_second": float(found.group(2)),
        "ttft_seconds": float(found.group(3)),
        "tau": float(found.group(4) or 0),
        "stop": found.group(5),
        "process_seconds": round(wall, 2),
    }


class Server:
    def __init__(self, bundle: str, threads: int, start_timeout: float) -> None:
        self.log_path = Path(tempfile.mkstemp(prefix="edge-spec-serve-", suffix=".log")[1])
        with open(self.log_path, "w") as log:
            # the clients below name the model "bundle": an alias of the served one
            self.proc = subprocess.Popen(
                cli("serve", bundle, "--threads", str(threads), "--port", "0", "--alias", "bundle"),
                stdout=subprocess.DEVNULL,
                stderr=log,
                stdin=subprocess.DEVNULL,
            )
        deadline = time.monotonic() + start_timeout
        while time.monotonic() < deadline:
            found = re.search(r"serving on (http://\S+)", self.log_path.read_text())
            if found:
                self.url = found.group(1)
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        self.stop()
        raise SystemExit(f"the server did not start:\n{self.log_path.read_text()[-2000:]}")

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(timeout=10)


def stream_once(client, messages: list[dict], max_tokens: int) -> dict:
    sent = time.perf_counter()
    stream = client.chat.completions.create(
        model="bundle",
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    first = last = None
    stats, usage = None, None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            last = time.perf_counter()
            first = first or last
        if chunk.choices and chunk.choices[0].finish_reason:
            stats = chunk.model_extra.get("x_edge_spec")
        if chunk.usage is not None:
            usage = chunk.usage
    tokens = usage.completion_tokens
    client_tps = (tokens - 1) / (last - first) if tokens > 1 and last > first else 0.0
    return {
        "new_tokens": tokens,
        "ttft_seconds": round(first - sent, 4),
        "tokens_per_second": round(client_tps, 2),
        "engine_ttft_seconds": stats["prefill_seconds"],
        "engine_tokens_per_second": stats["tokens_per_second"],
        "request_overhead_seconds": round((last - sent) - stats["prefill_seconds"] - stats["decode_seconds"], 4),
        "tau": stats["tau"],
        "stop": stats["stop_reason"],
        "total_seconds": round(last - sent, 3),
    }


def load_run(url: str, requests: int, clients: int, max_tokens: int, timeout: float) -> dict:
    import openai

    lock = threading.Lock()
    todo = list(range(requests))
    results: list[dict] = []

    def worker(_: int) -> None:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="bench", max_retries=0, timeout=timeout)
        for _round in range(requests):  # bounded: at most every request once
            with lock:
                if not todo:
                    return
                i = todo.pop(0)
            prompt = f"{LOAD_PROMPTS[i % len(LOAD_PROMPTS)]} (request {i})"
            sent = time.perf_counter()
            response = client.chat.completions.create(
                model="bundle", max_tokens=max_tokens, temperature=0, messages=[{"role": "user", "content": prompt}]
            )
            seconds = time.perf_counter() - sent
            stats = response.model_extra["x_edge_spec"]
            with lock:
                results.append(
                    {
                        "request": i,
                        "seconds": seconds,
                        "queue_seconds": stats["queue_seconds"],
                        "new_tokens": response.usage.completion_tokens,
                        "finish_reason": response.choices[0].finish_reason,
                        "tokens_per_second": stats["tokens_per_second"],
                    }
                )

    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        for future in [pool.submit(worker, c) for c in range(clients)]:
            future.result(timeout=timeout * requests)
    wall = time.perf_counter() - started
    latencies = sorted(r["seconds"] for r in results)
    return {
        "requests": requests,
        "clients": clients,
        "completed": len(results),
        "all_complete": len(results) == requests and all(r["finish_reason"] in ("stop", "length") for r in results),
        "p50_seconds": round(statistics.median(latencies), 2),
        "p95_seconds": round(latencies[min(len(latencies) - 1, round(0.95 * (len(latencies) - 1)))], 2),
        "max_seconds": round(latencies[-1], 2),
        "mean_queue_seconds": round(statistics.mean(r["queue_seconds"] for r in results), 2),
        "wall_seconds": round(wall, 2),
        "throughput_tokens_per_second": round(sum(r["new_tokens"] for r in results) / wall, 2),
        "mean_engine_tokens_per_second": round(statistics.mean(r["tokens_per_second"] for r in results), 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bundle", default=str(ROOT / "models/bundles/qwen2.5-coder-1.5b-instruct-int4"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--load-tokens", type=int, default=64)
    parser.add_argument("--timeout", type=float, default=300.0, help="Seconds per request / generate run.")
    parser.add_argument("--output", type=Path, default=None, help="Also write the results as JSON here.")
    args = parser.parse_args()

    import openai

    result: dict = {
        "bundle": args.bundle,
        "threads": args.threads,
        "max_tokens": args.max_tokens,
        "generate": [],
        "serve": [],
    }
    server = Server(args.bundle, args.threads, start_timeout=args.timeout)
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="bench", max_retries=0, timeout=args.timeout)
        for i in range(args.repeats):  # interleaved, so drift in the machine's speed hits both alike
            prompt = PROMPTS[i % len(PROMPTS)]
            result["generate"].append(run_generate(args.bundle, prompt, args.threads, args.max_tokens, args.timeout))
            messages = [{"role": "user", "content": prompt}]
            result["serve"].append(stream_once(client, messages, args.max_tokens))
        result["load"] = load_run(server.url, args.requests, args.clients, args.load_tokens, args.timeout)
    finally:
        result["serve_exit"] = server.stop()
        result["server_log"] = str(server.log_path)

    gen, srv = result["generate"], result["serve"]
    med = statistics.median
    summary = {
        "generate_ttft_s": med(g["ttft_seconds"] for g in gen),
        "generate_tok_s": med(g["tokens_per_second"] for g in gen),
        "serve_client_ttft_s": med(s["ttft_seconds"] for s in srv),
        "serve_engine_ttft_s": med(s["engine_ttft_seconds"] for s in srv),
        "serve_client_tok_s": med(s["tokens_per_second"] for s in srv),
        "serve_engine_tok_s": med(s["engine_tokens_per_second"] for s in srv),
        "serve_request_overhead_s": med(s["request_overhead_seconds"] for s in srv),  # client wall - engine
    }
    summary["overhead_ms_per_token"] = round(
        1e3 / summary["serve_client_tok_s"] - 1e3 / summary["serve_engine_tok_s"], 3
    )
    summary["overhead_ms_per_token_vs_generate"] = round(
        1e3 / summary["serve_client_tok_s"] - 1e3 / summary["generate_tok_s"], 3
    )
    result["summary"] = {k: round(v, 4) for k, v in summary.items()}
    print(json.dumps(result, indent=1))
    if args.output:
        args.output.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
