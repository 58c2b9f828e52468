"""Every number of a machine kind's headline row, in one resumable run, and the row itself.

Runs, one after another and most telling first, the measurements docs/measurements.md's headline table holds for
a machine kind, each its own script's run with its output in ``--output``:

0. ``prepare.log``: the peers' environments and exports (``spec_peers.py --prepare``; seconds where they are
   built already, about a quarter of an hour on a bare machine), so one command measures a new machine, and no
   peer's conversion runs beside a timed step;
1. ``peers-52.json``: all 52 bench prompts, 128 new tokens, our default, ``ar`` and ``ar --exact`` against every
   mode of onnxruntime-genai, OpenVINO GenAI (plain, K = 4, 8) and llama.cpp (plain, its drafter, ``ngram-mod``);
2. ``peers-long.json``: the same on the long prompts (code files of 2,128-2,403 tokens to edit, explain or test);
3. ``sessions/``: the agent, edit and ``actions`` sessions against llama.cpp (plain, ``ngram-mod``) and
   onnxruntime-genai (plain, K = 4), with our ``ar`` and the default with and without its suffix cache;
4. ``ttft-long.json``: the first token on the long prompts, each timed three times and the soonest kept, against
   every peer's plain decoding (one answer's first token moves by up to a quarter between runs);
5. ``attention-2800.log``: one decode step after a 2,800-token prompt, profiled (attention's share);
6. ``verify-rows-256.log``, ``verify-rows-2800.log``: what each verify row costs on a short and a long cache.

A step whose output exists is skipped, and the peer runs keep every prompt or session they finish
(``edge_spec/bench/journal.py``), so the same command run again after a stop goes on where it stopped; on a slow
CPU the whole takes hours (step 1 alone answers 52 prompts in a dozen engine modes).  Then, and with
``--report`` alone, it prints the headline row and the per-category table from what is there
(``edge_spec/bench/headline.py``).  Under a CPU mask every step runs masked:

    python benchmarks/machine_kind.py --bundle BUNDLE --output bench-results/kind-NAME --kind "NAME"
    python benchmarks/cpu_mask.py avx2 -- python benchmarks/machine_kind.py --output bench-results/kind-NAME-avx2
    python benchmarks/machine_kind.py --output bench-results/kind-NAME --kind "NAME" --report
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from shlex import split

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import session_peers  # noqa: E402  (a saved session run's records)

from edge_spec.bench.headline import HEADER, category_rows, headline_row  # noqa: E402

VERIFY_ROWS = "--steps 16 --rows 1,2,4,8,16 --context"
PEERS = "genai,openvino,llamacpp"


@dataclass(frozen=True)
class Step:
    """One measurement: its output (done when it exists) and the script with its arguments."""

    output: str
    script: str
    arguments: tuple[str, ...]
    log_only: bool = False  # the step's output is its log (a profile's printout)


def steps(bundle: str, threads: int) -> list[Step]:
    common = ("--bundle", bundle, "--threads", str(threads))
    peers = (*common, "--peers", PEERS, *split('--k 4,8 --our-k "" --suffix --ar-exact --new-tokens 128'))
    return [
        Step("prepare.log", "spec_peers.py", ("--prepare", "--peers", PEERS, "--threads", str(threads)), True),
        Step("peers-52.json", "spec_peers.py", peers),
        Step("peers-long.json", "spec_peers.py", (*peers, *split("--category long --per-category 3"))),
        Step(
            "sessions",
            "session_peers.py",
            (
                *common,
                *split(
                    "--peers llamacpp,genai --llamacpp-modes plain,ngram-mod --k 4 --ours ar,spec-nocache,spec "
                    "--temperature 0 --per-category 1 --category agent --category edit --category actions"
                ),
            ),
        ),
        Step(
            "ttft-long.json",
            "spec_peers.py",
            (
                *common,
                "--peers",
                PEERS,
                *split(
                    '--llamacpp-modes plain --k "" --our-k "" --suffix --new-tokens 16 '
                    "--repeats 3 --category long --per-category 3"
                ),
            ),
        ),
        Step("attention-2800.log", "profile_step.py", (*common, *split("--steps 12 --context 2800")), True),
        Step("verify-rows-256.log", "verify_rows_profile.py", (*common, *split(VERIFY_ROWS), "256"), True),
        Step("verify-rows-2800.log", "verify_rows_profile.py", (*common, *split(VERIFY_ROWS), "2800"), True),
    ]


def done(directory: Path, step: Step) -> bool:
    path = directory / step.output
    return (path / "run.json").is_file() if step.script == "session_peers.py" else path.is_file()


def run(directory: Path, step: Step) -> None:
    """The step's script, its printout in ``OUTPUT.log`` (a log-only step's output appears whole or not at all)."""
    target = directory / step.output
    log = target.with_name(target.name + ".partial") if step.log_only else target.with_name(target.name + ".log")
    command = [sys.executable, str(HERE / step.script), *step.arguments]
    if not step.log_only:
        command += ["--output", str(target)]
    print(f"== {step.output}: {' '.join(command[1:])}", flush=True)
    with log.open("w") as handle:
        code = subprocess.call(command, stdout=handle, stderr=subprocess.STDOUT, env=os.environ.copy())
    if code != 0:
        raise SystemExit(f"{step.output}: {step.script} stopped with exit code {code}; its printout is in {log}")
    if step.log_only:
        log.replace(target)


def report(directory: Path, kind: str) -> str:
    """The headline row and the per-category table from the steps that finished."""
    prompts = directory / "peers-52.json"
    if not prompts.is_file():
        raise SystemExit(f"no {prompts} yet: run the steps first")
    summary = json.loads(prompts.read_text())["summary"]
    long = directory / "peers-long.json"
    first_tokens = directory / "ttft-long.json"
    sessions = directory / "sessions"
    try:
        row = headline_row(
            kind,
            summary,
            json.loads(long.read_text())["summary"] if long.is_file() else None,
            session_peers.saved_records(sessions) if (sessions / "run.json").is_file() else None,
            json.loads(first_tokens.read_text())["summary"] if first_tokens.is_file() else None,
        )
    except ValueError as error:  # a run without our default or without a peer mode: no ratio to show
        raise SystemExit(f"{directory}: {error}") from None
    return f"{HEADER}\n{row}\n\n{category_rows(summary)}\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", help="our bundle (default: the README's export)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", type=Path, required=True, help="directory for every step's output")
    parser.add_argument("--kind", default="this machine", help="the machine kind, as the row names it")
    parser.add_argument("--report", action="store_true", help="print the row from what is there and stop")
    args = parser.parse_args()
    if args.threads < 1:
        raise SystemExit("--threads must be at least 1")
    if not args.report:
        from edge_spec.errors import EdgeSpecError
        from edge_spec.manifest import read_manifest
        from edge_spec.paths import find_bundle

        try:  # a missing or damaged bundle refused in one line before hours of steps
            bundle = find_bundle(args.bundle).resolve()
            read_manifest(bundle)
        except EdgeSpecError as error:
            raise SystemExit(str(error)) from None
        args.output.mkdir(parents=True, exist_ok=True)
        for step in steps(str(bundle), args.threads):
            if done(args.output, step):
                print(f"== {step.output}: done before", flush=True)
                continue
            run(args.output, step)
    print(report(args.output, args.kind), end="")


if __name__ == "__main__":
    main()
