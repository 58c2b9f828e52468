"""What agents and editors send, against ``edge-spec serve``: tool calls and structured output.

Starts one server on the bundle and sends, with the official ``openai`` client:

1. **Tools** (``tools.jsonl`` beside this script: prompts that call a tool, prompts that must not, and
   follow-ups after a tool result), each with ``tool_choice`` "auto" and, where a call is expected, with
   "required": the share of answers with well-formed ``tool_calls`` (a known function, JSON arguments
   that validate against its parameter schema), of answers that call nothing where no call is due, and
   of expected calls answered with text instead (an invented result).
2. **Structured output** (``schemas.jsonl``: prompts with a JSON schema): each prompt with
   ``response_format`` json_schema (strict) and, interleaved, without it; the share that parses and
   validates (jsonschema), tok/s of both, and the share of constrained tokens drafted for free because
   the grammar forced them (the answer's provenance).

``--tool-choice required`` sends instead each prompt that calls a tool with ``tool_choice`` "required" and
parallel calls allowed (OpenAI's default), and reports per answer what a client sees: the number of calls,
whether all are well-formed, the finish reason, whether ``content`` holds anything of a call, and how many
calls repeat an earlier one of the same answer (a model the constraint drives on writes the same call again).

``--engines ours,llamacpp`` sends the same requests to llama.cpp's ``llama-server`` on the default target's
GGUF too (its own chat template, tool-call parser and grammar engine; built by ``session_peers.py --prepare
--peers llamacpp``), one server after the other in one run: whether an answer that fails is the engine's
doing or the model's.

Usage::

    .venv/bin/python benchmarks/agent_api.py --bundle models/bundles/qwen2.5-coder-1.5b-instruct-int4 --threads 2
    .venv/bin/python benchmarks/agent_api.py --bundle BUNDLE --part tools --tool-choice required --max-tokens 256
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import jsonschema

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from serve_load import Server  # noqa: E402  (a sibling script)

ENGINES = ("ours", "llamacpp")


def load(name: str) -> list[dict]:
    return [json.loads(line) for line in (HERE / name).read_text().splitlines() if line.strip()]


def well_formed(calls, tools: list[dict]) -> bool:
    """Every call names one of the tools and its arguments parse and validate against that tool's schema."""
    schemas = {t["function"]["name"]: t["function"].get("parameters", {}) for t in tools}
    if not calls:
        return False
    for call in calls:
        if call.function.name not in schemas:
            return False
        try:
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        except (json.JSONDecodeError, jsonschema.ValidationError):
            return False
    return True


def answer_stats(response) -> dict:
    """Tokens, decode tok/s, τ and the share of tokens the grammar forced, from the engine's own report:
    ours in ``x_edge_spec`` (with the answer's provenance), llama.cpp's in ``timings`` (no τ, no provenance)."""
    extra = response.model_extra or {}
    if "x_edge_spec" in extra:
        stats = extra["x_edge_spec"]
        sources = [source for _, source in stats.get("provenance") or []]
        forced = sum(source == "forced" for source in sources) / max(len(sources), 1) if sources else None
        return {
            "tokens": stats["new_tokens"],
            "tok/s": stats["tokens_per_second"],
            "tau": stats["tau"],
            "forced": forced,
        }
    timings = extra.get("timings") or {}
    return {
        "tokens": response.usage.completion_tokens,
        "tok/s": timings.get("predicted_per_second", 0.0),
        "tau": None,
        "forced": None,
    }


def run_tools(client, items: list[dict], tools: list[dict], max_tokens: int) -> dict:
    tally = {
        "expected": 0,
        "called well-formed (auto)": 0,
        "answered in text instead (auto)": 0,
        "forced well-formed": 0,
        "no call due": 0,
        "no call made where none due": 0,
        "follow-ups": 0,
        "follow-up answered in text": 0,
    }
    rows = []
    for item in items:
        messages = item["messages"]
        auto = client.chat.completions.create(
            model="bundle", messages=messages, tools=tools, temperature=0, max_tokens=max_tokens
        )
        message = auto.choices[0].message
        row = {
            "id": item["id"],
            "expect": item["expect"],
            "auto_calls": [(c.function.name, c.function.arguments) for c in message.tool_calls or []],
            "auto_text": (message.content or "")[:120],
        }
        if item["expect"] == "call":
            tally["expected"] += 1
            tally["called well-formed (auto)"] += well_formed(message.tool_calls, tools)
            tally["answered in text instead (auto)"] += not message.tool_calls
            forced = client.chat.completions.create(
                model="bundle",
                messages=messages,
                tools=tools,
                temperature=0,
                max_tokens=max_tokens,
                tool_choice="required",
                parallel_tool_calls=False,
            )
            ok = well_formed(forced.choices[0].message.tool_calls, tools)
            tally["forced well-formed"] += ok
            row["forced_calls"] = [
                (c.function.name, c.function.arguments) for c in forced.choices[0].message.tool_calls or []
            ]
        elif item["expect"] == "none":
            tally["no call due"] += 1
            tally["no call made where none due"] += not message.tool_calls
        else:  # "answer": a follow-up after a tool result
            tally["follow-ups"] += 1
            tally["follow-up answered in text"] += bool(not message.tool_calls and message.content)
        rows.append(row)
    return {"tally": tally, "answers": rows}


def run_required(client, items: list[dict], tools: list[dict], max_tokens: int) -> dict:
    """Each prompt that calls a tool, with tool_choice "required" and parallel calls allowed."""
    rows = []
    for item in (item for item in items if item["expect"] == "call"):
        response = client.chat.completions.create(
            model="bundle",
            messages=item["messages"],
            tools=tools,
            temperature=0,
            max_tokens=max_tokens,
            tool_choice="required",
        )
        message = response.choices[0].message
        calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
        content = message.content or ""
        rows.append(
            {
                "id": item["id"],
                "calls": len(calls),
                "well-formed": well_formed(message.tool_calls, tools),
                "finish_reason": response.choices[0].finish_reason,
                "call text in content": any(mark in content for mark in ("<tool_call>", "</tool_call>", '"name"')),
                "repeated calls": len(calls) - len(set(calls)),
                "tokens": response.usage.completion_tokens,
                "answer": calls[:4],
                "content": content[:160],
            }
        )
    return {
        "tally": {
            "prompts": len(rows),
            "well-formed": sum(r["well-formed"] for r in rows),
            "finish tool_calls": sum(r["finish_reason"] == "tool_calls" for r in rows),
            "finish length": sum(r["finish_reason"] == "length" for r in rows),
            "call text in content": sum(r["call text in content"] for r in rows),
            "answers with a repeated call": sum(r["repeated calls"] > 0 for r in rows),
            "calls per answer": [r["calls"] for r in rows],
        },
        "answers": rows,
    }


def run_schemas(client, items: list[dict], max_tokens: int) -> dict:
    valid, rows, constrained_tps, free_tps, forced_share = 0, [], [], [], []
    for item in items:
        messages = [{"role": "user", "content": item["prompt"]}]
        fmt = {"type": "json_schema", "json_schema": {"name": item["id"], "schema": item["schema"], "strict": True}}
        plain = client.chat.completions.create(model="bundle", messages=messages, temperature=0, max_tokens=max_tokens)
        started = time.perf_counter()
        shaped = client.chat.completions.create(
            model="bundle",
            messages=messages,
            temperature=0,
            max_tokens=max_tokens,
            response_format=fmt,
            extra_body={"x_edge_spec": {"provenance": True}},
        )
        wall = time.perf_counter() - started
        text = shaped.choices[0].message.content or ""
        try:
            jsonschema.validate(json.loads(text), item["schema"])
            ok = True
        except (json.JSONDecodeError, jsonschema.ValidationError) as exc:
            ok, text = False, f"{text[:200]} ({type(exc).__name__})"
        valid += ok
        stats, plain_stats = answer_stats(shaped), answer_stats(plain)
        constrained_tps.append(stats["tok/s"])
        free_tps.append(plain_stats["tok/s"])
        if stats["forced"] is not None:
            forced_share.append(stats["forced"])
        rows.append(
            {
                "id": item["id"],
                "valid": ok,
                "tokens": stats["tokens"],
                "wall_seconds": round(wall, 2),
                "tok/s": stats["tok/s"],
                "unconstrained tok/s": plain_stats["tok/s"],
                "tau": stats["tau"],
                "forced share": None if stats["forced"] is None else round(stats["forced"], 3),
                "finish_reason": shaped.choices[0].finish_reason,
                "answer": text[:160],
            }
        )
    return {
        "valid": valid,
        "total": len(items),
        "constrained tok/s (median)": statistics.median(constrained_tps),
        "unconstrained tok/s (median)": statistics.median(free_tps),
        "constrained / unconstrained (median of per-prompt ratios)": round(
            statistics.median(c / f for c, f in zip(constrained_tps, free_tps) if f), 3
        ),
        "forced-draft share of constrained tokens (mean)": (
            round(statistics.mean(forced_share), 3) if forced_share else None
        ),
        "answers": rows,
    }


@contextlib.contextmanager
def served(engine: str, args):
    """An OpenAI client of ``engine``'s server, started on the default pair's target and stopped after."""
    import openai

    if engine == "ours":
        server = Server(args.bundle, args.threads, start_timeout=900)
        url, stop = server.url, server.stop
    else:
        import session_peers

        settings = argparse.Namespace(
            peers=("llamacpp",),
            llamacpp_modes=("plain",),
            threads=args.threads,
            ctx=4096,
            llamacpp_extra="--jinja",
            llamacpp_draft_max=16,
        )
        session_peers.check_prepared(settings)  # llama.cpp built, the default pair's GGUFs fetched
        args.log_dir.mkdir(parents=True, exist_ok=True)
        server = session_peers.LlamaServer("plain", settings, args.log_dir)
        url, stop = f"http://127.0.0.1:{server.port}", server.close
    try:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="local", max_retries=0, timeout=900)
    finally:
        stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bundle", required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=320)
    parser.add_argument("--part", choices=["tools", "schemas", "both"], default="both")
    parser.add_argument(
        "--tool-choice",
        choices=["auto", "required"],
        default="auto",
        help='tools part: auto (and required, one call) per prompt as above, or only "required" with parallel calls',
    )
    parser.add_argument("--engines", default="ours", help=f"comma list of: {', '.join(ENGINES)}")
    parser.add_argument("--output", type=Path)
    parser.add_argument("--log-dir", type=Path, default=Path("bench-results/agent-api-logs"), help="peer server logs")
    args = parser.parse_args()
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = [e for e in engines if e not in ENGINES]
    if unknown or not engines:
        raise SystemExit(f"--engines: choose from {', '.join(ENGINES)}")

    tools, tool_prompts = json.loads((HERE / "tools.json").read_text()), load("tools.jsonl")
    schema_prompts = load("schemas.jsonl")
    report: dict = {}
    for engine in engines:
        parts = report.setdefault(engine, {}) if len(engines) > 1 else report
        with served(engine, args) as client:
            if args.part in ("tools", "both") and args.tool_choice == "required":
                parts["tools (required)"] = run_required(client, tool_prompts, tools, args.max_tokens)
            elif args.part in ("tools", "both"):
                parts["tools"] = run_tools(client, tool_prompts, tools, 128)
            if args.part in ("schemas", "both"):
                parts["schemas"] = run_schemas(client, schema_prompts, args.max_tokens)
    print(json.dumps(summary_of(report), indent=1))
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(report, indent=1))
    return 0


def summary_of(report: dict) -> dict:
    """The report without the per-answer rows."""
    return {
        key: summary_of(body) if "answers" not in body else {k: v for k, v in body.items() if k != "answers"}
        for key, body in report.items()
    }


if __name__ == "__main__":
    sys.exit(main())
