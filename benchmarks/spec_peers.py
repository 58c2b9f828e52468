"""The peers' speculative decoding on our bench prompts, per category, beside our modes, in one run.

Same pair everywhere: target qwen2.5-coder-1.5b-instruct, drafter qwen2.5-coder-0.5b-instruct (both
from our Q4_K_M GGUFs, same tokenizer).  Per bench prompt, one after the other (so drift in the shared
machine's speed hits all alike), greedy, ``--new-tokens`` (64) at most, stopping at EOS, 2 threads:

* **onnxruntime-genai** (``models/genai-venv``): the model builder's int4 CPU exports (``-p int4 -e cpu``,
  block 32, accuracy level 4) of both GGUFs, plain (``genai ar``) and its base speculative decoding
  (``genai K<k>``): a composite ``genai_config.json`` with a ``model.draft`` decoder block (the
  drafter's own builder config) and ``speculative.max_draft_tokens`` = K set per generation through
  ``GeneratorParams.set_speculative_options`` (fixed K: ``min_adaptive_k`` 0, no cooldown).
* **OpenVINO GenAI** (``models/openvino-venv``): ``optimum-cli export openvino`` of the same dequantized
  checkpoints (``OV_EXPORT_ARGS``: int4, symmetric, group 32, every layer incl. embedding and LM head,
  as our bundle), ``LLMPipeline(target, "CPU")`` (``openvino ar``) and ``LLMPipeline(target, "CPU",
  draft_model=draft_model(drafter, "CPU"))`` with ``GenerationConfig.num_assistant_tokens`` = K
  (``openvino K<k>``); both on its default CPU backend (paged attention / continuous batching, which
  keeps K fixed; its stateful backend would adapt K), ``INFERENCE_NUM_THREADS`` = threads on both
  models, the prompt handed over as an ``ov.Tensor`` of our token ids (no chat template applied); its
  default scheduler's prefix cache off, so that K8 and K16 read the prompt K4 read too.
* **llama.cpp** (``llama-server``, built by ``--prepare`` as ``benchmarks/session_peers.py`` builds it and
  started with its flags, imported, not copied), on the GGUFs themselves, one server per mode (one slot,
  ``--threads`` threads, ``-c`` = ``--ctx``): ``plain`` (``llamacpp ar``: no speculation), ``draft``
  (``llamacpp draft``: the 0.5B drafter GGUF, ``--spec-type draft-simple``, ``--spec-draft-n-max``
  ``--llamacpp-draft-max``, 3 by default, its own default) and ``ngram-mod`` (``llamacpp ngram-mod``:
  its hashed n-gram pool at its defaults, which learns from every request the server answers, as a
  long-running server's does; with ``--repeats`` the server starts afresh before each repeat of a prompt,
  which it would otherwise draft from its own earlier answer); ``--llamacpp-modes`` picks.  Each prompt goes to ``/completion`` as our
  token ids, greedy (temperature 0, no top-k/p cut), read whole: ``cache_prompt`` false and no prompt
  cache in RAM (``--cache-ram 0``).
* **edge-spec** (this venv): ``ar`` in an engine loaded for it alone, the bundle's default drafter head
  at fixed γ = each K (``ours γ<k>``) and our schedule (``ours schedule``), as ``edge-spec bench`` runs
  them (no prompt lookup unless ``--lookup``, no suffix cache unless ``--suffix``: with it ``ours
  schedule+suffix`` is our default; ``--our-k`` sets our fixed lengths apart from K, empty for none;
  ``--ar-exact`` adds the batch-invariant target-only
  answer our greedy speculative modes must equal); ``--eagle-head NAME`` adds the bundle's EAGLE head
  with that LM head (``ours eagle γ<k>``, ``ours eagle schedule``).  One mode at a time, each on
  emptied KV caches (target and drafter), so that every mode reads the whole prompt.

Every engine gets the same prompt token ids (our tokenizer, chat template, computed once).  tokens/s
is (answer tokens after the first) / decode time, pooled per category like ``edge-spec bench``, where
the answer stops before EOS: the pass that produced the EOS is in every engine's decode time, its token in
none's count (onnxruntime-genai leaves the EOS out of its sequence yet takes one more
``generate_next_token`` call for it, so counting calls would credit it one token per finished answer).
The decode time starts when the first new token is known (it comes out of the prefill):

* ours: the engine's own stats (first token yielded -> last token);
* onnxruntime-genai: from the end of ``append_tokens`` (the prefill of target and drafter) to the
  last ``generate_next_token``.  Its speculative ``generate_next_token`` runs a whole round on the
  first call and hands the round's tokens out one per call, so timing from the first emitted token
  would leave the first round out;
* OpenVINO: a ``StreamerBase`` timestamps every ``write``; the tokens delivered after the first
  write over the time from the first write to the last (equal to (n - 1) / ... when the first write
  is one token);
* llama.cpp: the server's own ``timings.predicted_ms``, from the first token sampled (after the prompt
  batches, which its drafter reads too, batch by batch beside the target) to the last.

The time to the first token (``TTFT ms``, the mean per category) is timed apart from the decode time:

* ours: from the request (its prompt ids) to the first token: the target's prompt reading, and the drafter's
  where the prompt brings at most 128 new tokens (a longer one the drafter reads after the first token, in
  the decode time) (``first_token_seconds``);
* onnxruntime-genai: ``append_tokens``, the prefill of target and drafter (the first token is picked
  from its logits);
* OpenVINO: from ``generate`` to the streamer's first write;
* llama.cpp: ``timings.prompt_ms``, from the start of the prompt's processing (target and drafter) to
  the first token sampled.

Each peer's greedy answer at every K is compared token for token with its own AR answer
(``identical_to_ar``), the check that its speculative mode is lossless (and really ran: see its
acceptance statistics in the JSON).

Prompts: the bench prompts and the low-acceptance set; ``--category long`` adds what agents and editors
send, code files of ~2,000 tokens to edit, explain or test (``edge_spec/bench/long_prompts.py``),
only when named: their prompt reading takes seconds per prompt and mode.

Usage::

    .venv/bin/python benchmarks/spec_peers.py --prepare       # venvs, exports, llama.cpp build (idempotent, resumable; long)
    .venv/bin/python benchmarks/spec_peers.py                 # all 52 prompts: 42 bench + 10 low-acceptance
    .venv/bin/python benchmarks/spec_peers.py --peers llamacpp --category long --category code --per-category 1
    .venv/bin/python benchmarks/spec_peers.py --per-category 1 --k 4,16 --new-tokens 64
    .venv/bin/python benchmarks/spec_peers.py --peers genai --no-ours --category code

Results: a table per category and overall on stdout, every record in ``bench-results/peers/peers.json``.
A run stopped early (Ctrl-C, a closed terminal, the machine taken back) keeps each prompt it finished in
``OUTPUT.partial.jsonl``; the same command run again measures only the rest, and refuses in one line where its
options, prompts or CPU differ (``edge_spec/bench/journal.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import ar_vs_ortgenai as shared  # the genai venv, the GGUF -> HF checkpoint and the genai builder steps

ROOT = shared.ROOT
sys.path.insert(0, str(ROOT))  # the peers' workers run in venvs without edge-spec installed
from edge_spec.bench.journal import RunJournal, fingerprint  # noqa: E402
from edge_spec.bench.journal import run_settings as run_settings_of  # noqa: E402
from edge_spec.bench.peers import (  # noqa: E402
    first_token_seconds,
    format_rows,
    peer_record,
    report,
    result,
    summarize,
)
from edge_spec.errors import EdgeSpecError  # noqa: E402
from edge_spec.files import write_text_atomic  # noqa: E402

TARGET = shared.NAME  # qwen2.5-coder-1.5b-instruct-q4_k_m
DRAFT = "qwen2.5-coder-0.5b-instruct-q4_k_m"
GENAI_SPEC_DIR = ROOT / "models" / "genai" / f"spec-{TARGET}+{DRAFT}"
OV_VENV = ROOT / "models" / "openvino-venv"
OV_PY = OV_VENV / "bin" / "python"
OV_REQUIREMENTS = ["openvino-genai==2026.4.1.0", "optimum-intel[openvino]==2.2.0", "nncf==3.4.0"]
# closest to our bundle (int4, symmetric, block 32, int4 embedding and LM head): every layer int4
OV_EXPORT_ARGS = [
    "--task",
    "text-generation-with-past",
    "--weight-format",
    "int4",
    "--sym",
    "--group-size",
    "32",
    "--ratio",
    "1.0",
    "--all-layers",
]
PROMPT_FILES = [ROOT / "edge_spec" / "data" / "bench" / name for name in ("prompts.jsonl", "low_acceptance.jsonl")]
OUTPUT = ROOT / "bench-results" / "peers" / "peers.json"
PEERS = ("genai", "openvino", "llamacpp")
LLAMACPP_MODES = ("plain", "draft", "ngram-mod")  # session_peers.py's flags for each
WARMUP_TOKENS = 8
log = shared.log


def ov_dir(name: str) -> Path:
    return ROOT / "models" / "openvino" / name


def llamacpp():
    """``benchmarks/session_peers.py``, which builds ``llama-server`` and runs it (its flags per mode, its
    requests, its timings), imported when llama.cpp is asked for: it imports this module itself."""
    import session_peers

    return session_peers


def llamacpp_runs(servers: dict, ids: list[int], repeat: int, new_tokens: int, eos, warmup_ids) -> list[dict]:
    """One answer to prompt ``ids`` from each llama.cpp server (mode: server, plain first), each compared with
    plain's.  A server that learns from its answers (``ngram-mod``) is started afresh before a prompt's repeats,
    so that a repeat is not drafted from its own earlier answer to the same prompt, as ours is not."""
    runs, plain_ids = [], None
    for mode, server in servers.items():
        if repeat and server.learns:
            server.restart(warmup_ids)
        answer = server.run(ids, new_tokens, 0.0, 0, eos)
        run = llamacpp().record_of(server.engine, answer)
        run["mode"] = mode
        if mode == "plain":
            plain_ids = answer["ids"]
        elif plain_ids is not None:
            run["identical_to_ar"] = answer["ids"] == plain_ids
        runs.append(run)
    return runs


# --------------------------------------------------------------------------- preparation (cached)


def ensure_genai_spec_dir(threads: int) -> Path:
    """The composite onnxruntime-genai model: the target's config with the drafter's decoder block as
    ``model.draft``; both ONNX files (and the tokenizer) linked in, so every path is relative to it."""
    if (GENAI_SPEC_DIR / "genai_config.json").is_file():
        return GENAI_SPEC_DIR
    shared.ensure_genai_venv()
    target, draft = shared.ensure_genai_model(threads, TARGET), shared.ensure_genai_model(threads, DRAFT)
    log(f"writing the speculative (target + draft) onnxruntime-genai config in {GENAI_SPEC_DIR}")
    partial = GENAI_SPEC_DIR.with_name(GENAI_SPEC_DIR.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    (partial / "draft").mkdir(parents=True)
    for source, into in ((target, partial), (draft, partial / "draft")):
        for f in source.iterdir():
            if f.name.startswith("model.onnx"):  # the graph and its external weights: linked, not copied
                (into / f.name).symlink_to(os.path.relpath(f, into))
            elif into == partial and f.is_file() and f.name != "genai_config.json":
                shutil.copy2(f, into / f.name)  # tokenizer files
    config = json.loads((target / "genai_config.json").read_text())
    draft_decoder = json.loads((draft / "genai_config.json").read_text())["model"]["decoder"]
    draft_decoder["filename"] = "draft/" + draft_decoder["filename"]
    config["model"]["draft"] = draft_decoder
    config["speculative"] = {"max_draft_tokens": 4}  # the default; each generation sets its own K
    (partial / "genai_config.json").write_text(json.dumps(config, indent=2))
    partial.rename(GENAI_SPEC_DIR)
    return GENAI_SPEC_DIR


def ensure_openvino_venv() -> None:
    shared.ensure_venv(OV_VENV, OV_REQUIREMENTS, "openvino_genai, optimum.intel, nncf")


def ensure_openvino_model(name: str) -> Path:
    """optimum-intel's OpenVINO export of models/hf/<name> (written to a .partial dir, renamed when done)."""
    out = ov_dir(name)
    if (out / "openvino_model.xml").is_file() and (out / "openvino_tokenizer.xml").is_file():
        return out
    hf = shared.ensure_hf_checkpoint(name)
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    cmd = [str(OV_VENV / "bin" / "optimum-cli"), "export", "openvino", "-m", str(hf), *OV_EXPORT_ARGS, str(partial)]
    log(f"exporting {name} to OpenVINO in {out} (once; takes minutes): {' '.join(cmd)}")
    started = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT)
    partial.rename(out)
    log(f"export done in {time.perf_counter() - started:.0f} s")
    return out


def prepare(peers: list[str], threads: int) -> None:
    steps = {
        "genai": [lambda: ensure_genai_spec_dir(threads)],
        "openvino": [ensure_openvino_venv, lambda: ensure_openvino_model(TARGET), lambda: ensure_openvino_model(DRAFT)],
        "llamacpp": [lambda: llamacpp().ensure_llamacpp()],
    }
    for peer in peers:
        for number, step in enumerate(steps[peer], 1):
            log(f"prepare {peer}: step {number}/{len(steps[peer])}")
            step()
    log(
        "prepared: "
        + ", ".join(
            f"{d.relative_to(ROOT)} {du(d)}"
            for d in (
                ROOT / "models" / "hf",
                ROOT / "models" / "genai",
                shared.GENAI_VENV,
                ROOT / "models" / "openvino",
                OV_VENV,
                ROOT / "models" / "llamacpp",
            )
            if d.exists()
        )
    )


def du(path: Path) -> str:
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())
    return f"{size / 2**30:.2f} GiB"


# --------------------------------------------------------------------------- the peers' workers (in their venvs)


def reply(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def serve(load, run) -> None:
    """Worker protocol, one JSON object a line: a spec in -> {"ready", ...} out after ``load(spec)`` and
    one warm-up per mode; then each request ``{"ids", "k"}`` (k 0: AR; an optional ``"new_tokens"``
    overrides the spec's, as session turns each have their own) in -> one timed generation out."""
    spec = json.loads(sys.stdin.readline())
    info = load(spec)
    for k in [0, *spec["ks"]]:
        run(spec["warmup_ids"], k, WARMUP_TOKENS)
    reply({"ready": True, **info})
    for line in sys.stdin:
        request = json.loads(line)
        reply(run(request["ids"], request["k"], request.get("new_tokens", spec["new_tokens"])))


def genai_worker() -> None:
    import onnxruntime_genai as og

    models, state = {}, {}

    def load(spec):
        models["ar"] = shared.load_genai_model(og, spec["ar_dir"], spec["threads"])
        models["spec"] = shared.load_genai_model(og, spec["spec_dir"], spec["threads"], ("decoder", "draft"))
        state["eos"] = set(int(t) for t in list(og.Tokenizer(models["ar"]).eos_token_ids))
        return {"version": og.__version__}

    def run(prompt, k, n_new):
        model = models["spec" if k else "ar"]
        params = og.GeneratorParams(model)
        params.set_search_options(do_sample=False, max_length=len(prompt) + n_new, batch_size=1)
        if k:
            params.set_speculative_options(max_draft_tokens=k, min_adaptive_k=0, cooldown=False)
        gen = og.Generator(model, params)
        start = time.perf_counter()
        gen.append_tokens(prompt)  # prefill (target and drafter)
        prefilled = time.perf_counter()
        while not gen.is_done():
            gen.generate_next_token()
        end = time.perf_counter()
        ids = [int(t) for t in gen.get_sequence(0)][len(prompt) :]
        extra = {}
        if k:
            stats = dict(gen.get_speculative_stats())
            extra["stats"] = {
                key: stats[key]
                for key in (
                    "rounds",
                    "draft_tokens_proposed",
                    "draft_tokens_accepted",
                    "acceptance_rate",
                    "target_verify_forward_passes",
                    "target_forward_passes",
                    "draft_forward_passes",
                    "effective_k",
                    "tokens_emitted",
                    "total_draft_ms",
                    "total_target_ms",
                )
                if key in stats
            }
        return result(ids, state["eos"], 1, end - prefilled, prefilled - start, **extra)  # call 1: the prefill's pick

    serve(load, run)


def openvino_worker() -> None:
    import numpy as np
    import openvino as ov
    import openvino_genai as ov_genai

    class Stamps(ov_genai.StreamerBase):
        """Timestamps every write (one token, or a round's accepted tokens at once)."""

        def __init__(self):
            super().__init__()
            self.writes = []

        def write(self, token):
            self.writes.append((time.perf_counter(), 1 if isinstance(token, int) else len(token)))
            return ov_genai.StreamingStatus.RUNNING

        def end(self):
            pass

    pipes, state = {}, {}

    def load(spec):
        props = {"INFERENCE_NUM_THREADS": spec["threads"]}
        # the CPU default's scheduler (GenAI's latency-oriented one: no limit on the tokens of a pass) without
        # its prefix cache, which would let K8 and K16 find the prompt K4 read: every answer reads its prompt
        scheduler = ov_genai.SchedulerConfig()
        scheduler.max_num_batched_tokens = 2**63 - 1
        scheduler.enable_prefix_caching = False
        pipes["ar"] = ov_genai.LLMPipeline(spec["target_dir"], "CPU", scheduler_config=scheduler, **props)
        draft = ov_genai.draft_model(spec["draft_dir"], "CPU", **props)
        pipes["spec"] = ov_genai.LLMPipeline(
            spec["target_dir"], "CPU", draft_model=draft, scheduler_config=scheduler, **props
        )
        tokenizer = pipes["ar"].get_tokenizer()
        state["eos"] = {int(tokenizer.get_eos_token_id())}
        state["eos"] |= set(int(t) for t in (pipes["ar"].get_generation_config().stop_token_ids or ()))
        return {"version": ov_genai.__version__, "eos": sorted(state["eos"])}

    def run(prompt, k, n_new):
        pipe = pipes["spec" if k else "ar"]
        config = pipe.get_generation_config()  # a copy, with the model's EOS
        config.max_new_tokens = n_new
        config.do_sample = False
        config.stop_token_ids = state["eos"]
        if k:
            config.num_assistant_tokens = k
        streamer = Stamps()
        ids_in = ov.Tensor(np.array([prompt], dtype=np.int64))
        start = time.perf_counter()
        out = pipe.generate(ids_in, config, streamer)
        writes = streamer.writes
        ids = [int(t) for t in out.tokens[0]]
        first, last = writes[0][0], writes[-1][0]
        extra = {"writes": len(writes), "first_write_tokens": writes[0][1]}
        metrics = getattr(out, "extended_perf_metrics", None)
        if k and metrics:
            extra["stats"] = {
                "num_accepted_tokens": metrics.get_num_accepted_tokens(),
                "target_iterations": len(metrics.main_model_metrics.raw_metrics.m_durations),
                "draft_generated_tokens": metrics.draft_model_metrics.get_num_generated_tokens(),
            }
        return result(ids, state["eos"], writes[0][1], last - first, first - start, **extra)

    serve(load, run)


class Peer:
    """A worker process in its peer's venv, kept alive so its runs interleave with the others'."""

    def __init__(self, name: str, python: Path, spec: dict) -> None:
        self.name = name
        self.proc = subprocess.Popen(
            [str(python), str(Path(__file__).resolve()), "--worker", name],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.info = self.ask(spec)

    def ask(self, obj: dict) -> dict:
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline()
        if not answer:
            raise SystemExit(f"{self.name} worker failed (exit {self.proc.wait()})")
        return json.loads(answer)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


# --------------------------------------------------------------------------- edge-spec side


class Ours:
    """Our ar (an engine loaded for it alone) and our drafter at fixed γ = each K plus the schedule,
    through ``edge_spec.bench.run_bench`` one prompt at a time."""

    def __init__(self, args) -> None:
        from edge_spec.bench.runs import modes_for
        from edge_spec.runtime.engine import Engine
        from edge_spec.runtime.loops.config import loop_config

        chain = loop_config("spec", lookup=False, **({} if args.gamma is None else {"gamma": args.gamma}))
        self.engine = Engine.from_bundle(args.bundle, threads=args.threads, config=chain)
        self.baseline = Engine.from_bundle(args.bundle, threads=args.threads, mode="ar")
        self.modes = modes_for(
            self.engine,
            [self.engine.bundle.draft_head],
            chain,
            args.k if args.our_k is None else args.our_k,
            lookup=args.lookup,
            suffix=args.suffix,
            reference=args.ar_exact,
            drafters={"eagle": args.eagle_head} if args.eagle_head else None,
        )
        for engine in (self.engine, self.baseline):
            engine.complete("warm up", max_new_tokens=4)
        if args.ar_exact:
            self.engine.complete("warm up", max_new_tokens=4, mode="ar", exact=True)
        self.args = args

    def run(self, item: dict) -> list[dict]:
        """Every mode's answer to ``item``, one mode at a time on emptied KV caches (target and drafter), so
        that each reads the whole prompt as a new request does and its time to the first token is a new
        request's: run together, the modes after the first would find the prompt in the cache.  The
        greedy answers are compared with the target-only ones as ``run_bench`` compares them."""
        from edge_spec.bench.runs import run_bench

        references: dict[bool, list[int]] = {}  # the target-only answers by numerics (exact or one-row)
        records = []
        for mode in self.modes:
            runner = self.baseline if mode.name == "ar" else self.engine
            runner.bundle.target.rewind(0)
            if mode.head:
                runner.bundle.active_drafter(mode.config).rewind(0)
            (record,) = run_bench(
                self.engine,
                [item],
                [mode],
                temperatures=[0.0],
                max_new_tokens=self.args.new_tokens,
                baseline=self.baseline,
            )["records"]
            answer = list(runner.last_token_ids)
            exact = runner.exact_for(mode.config.mode, mode.exact)
            if mode.head is None:
                references.setdefault(exact, answer)
            else:
                reference = references.get(exact)
                record["identical_to_ar"] = None if reference is None else answer == reference
                record["identical_to_one_row_ar"] = answer == references.get(False)
            records.append(dict(record, engine=self.label(record["mode"])))
        return records

    @staticmethod
    def label(mode: str) -> str:
        """``ours ar``, ``ours γ4`` (``spec+<head>@γ4``), ``ours schedule`` (``spec+<head>``), ``+lookup`` kept;
        the EAGLE head's modes as ``ours eagle γ4`` / ``ours eagle+<head> schedule``."""
        if mode in ("ar", "ar-exact"):
            return f"ours {mode}"
        gamma = mode.partition("@")[2]
        drafter = mode.partition("@")[0].removesuffix("+lookup") + " " if mode.startswith("eagle") else ""
        source = "+lookup" if "+lookup" in mode else "+suffix" if "+suffix" in mode else ""
        return f"ours {drafter}{gamma or 'schedule'}{source}"


def load_prompts(args) -> list[dict]:
    """The prompt files' prompts, and the ``long`` category's when ``--category long`` asks for it (never
    by default: edge_spec/bench/long_prompts.py)."""
    from edge_spec.bench import long_prompts
    from edge_spec.bench.runs import load_bench_prompts

    items = [
        item for path in args.prompts or PROMPT_FILES for item in load_bench_prompts(path, None, args.per_category)
    ]
    if long_prompts.CATEGORY in args.category and all(i["category"] != long_prompts.CATEGORY for i in items):
        try:
            items += long_prompts.long_prompts()[: args.per_category]
        except EdgeSpecError as error:
            raise SystemExit(str(error)) from None
    unknown = set(args.category) - {item["category"] for item in items}
    if unknown:
        raise SystemExit(f"unknown categories: {', '.join(sorted(unknown))}")
    return [item for item in items if not args.category or item["category"] in args.category]


# --------------------------------------------------------------------------- main


def keep_fastest(fastest: dict[str, dict], run: dict) -> None:
    """Keep, per engine, the repeat that decoded fastest, with the soonest first token of any repeat (the two
    are timed apart, and a shared machine's drift may slow either one in a given repeat)."""
    kept = fastest.setdefault(run["engine"], run)
    if run["decode_seconds"] < kept["decode_seconds"]:
        fastest[run["engine"]] = run
    firsts = [t for t in map(first_token_seconds, (kept, run)) if t is not None]
    if firsts:
        fastest[run["engine"]]["first_token_seconds"] = min(firsts)


#: options that change where a run's results go or what a command does besides measuring, not the measurement
NOT_SETTINGS = ("output", "report", "plot", "plot_title", "prepare", "worker")


def run_settings(args: argparse.Namespace, items: list[dict]) -> dict:
    """What a run measures under (every option but ``NOT_SETTINGS``, the prompts' token ids, the machine): a
    run stopped early resumes only under the very same (``edge_spec.bench.journal``)."""
    return run_settings_of(vars(args), NOT_SETTINGS, prompt_ids=fingerprint(item["ids"] for item in items))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prepare", action="store_true", help="build the venvs and exports (idempotent) and stop")
    parser.add_argument("--peers", default=",".join(PEERS), help="comma list of peers (genai, openvino, llamacpp)")
    parser.add_argument(
        "--llamacpp-modes",
        default=",".join(LLAMACPP_MODES),
        help="comma list of llama.cpp modes: plain (no speculation), draft (the 0.5B drafter), ngram-mod",
    )
    parser.add_argument(
        "--llamacpp-draft-max", type=int, default=3, help="llama.cpp draft mode's --spec-draft-n-max (its default: 3)"
    )
    parser.add_argument("--llamacpp-extra", default="", help="further llama-server arguments, for every mode")
    parser.add_argument("--ctx", type=int, default=8192, help="llama-server's context (-c), prompt + answer")
    parser.add_argument("--no-ours", dest="ours", action="store_false", help="time the peers only")
    parser.add_argument(
        "--k", default="4,8,16", help="draft lengths (comma list, 1-16; empty: the peers' plain decoding alone)"
    )
    parser.add_argument("--lookup", action="store_true", help="our modes also draft by prompt lookup")
    parser.add_argument(
        "--suffix",
        action="store_true",
        help="our modes also draft from the suffix cache (the default chain: earlier answers and the prompt); "
        "the cache starts empty for every prompt, as edge-spec bench runs it",
    )
    parser.add_argument(
        "--our-k",
        default=None,
        help="our fixed draft lengths (comma list; default: --k; empty: our schedule only)",
    )
    parser.add_argument(
        "--eagle-head",
        action="append",
        help="also time our EAGLE head with this LM head "
        "(repeatable; fixed γ = each K and the schedule, as for the drafter)",
    )
    parser.add_argument(
        "--ar-exact",
        action="store_true",
        help="also time our ar-exact (batch-invariant "
        "target-only decoding), the answer our greedy speculative modes must equal token for token",
    )
    parser.add_argument(
        "--bundle",
        type=Path,
        help="our bundle (default: the README's export); the peers "
        "re-quantize the dequantized GGUFs to int4, as an export with --gguf-blocks none does",
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--gamma", type=int, help="our schedule's ceiling on drafts per round (default: edge-spec's)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompts", type=Path, action="append", help="prompt files (default: bench + low-acceptance)")
    parser.add_argument(
        "--category",
        action="append",
        default=[],
        help="only these categories (repeatable); long (code files of ~2,000 tokens) runs only when named",
    )
    parser.add_argument("--per-category", type=int, help="at most this many prompts per category")
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs per prompt and engine; the fastest decode and, apart, the soonest first token are kept "
        "(llama.cpp's ngram-mod server is started afresh before each repeat: it would draft from its own answer)",
    )
    parser.add_argument("--output", type=Path, default=OUTPUT)
    parser.add_argument("--report", type=Path, help="print the tables of a saved run (its JSON) and stop")
    parser.add_argument(
        "--plot",
        type=Path,
        help="with --report: draw our default (ours schedule+suffix) against our ar and each category's fastest "
        "peer mode into this PNG (needs the bench extra)",
    )
    parser.add_argument("--plot-title", default="", help="the plot's title (machine, date)")
    parser.add_argument("--worker", choices=("genai", "openvino"), help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.report:
        try:
            print(report(args.report))
        except ValueError as error:
            raise SystemExit(str(error)) from None
        if args.plot:
            from edge_spec.bench.peers_plot import plot_peers

            if not plot_peers(json.loads(args.report.read_text())["records"], args.plot, title=args.plot_title):
                raise SystemExit("--plot needs matplotlib: pip install 'edge-spec[bench]'")
            print(f"wrote {args.plot}")
        return

    if args.worker:  # we are a peer's child process, inside its venv
        {"genai": genai_worker, "openvino": openvino_worker}[args.worker]()
        return
    peers = [p for p in args.peers.split(",") if p]
    if set(peers) - set(PEERS):
        raise SystemExit(f"--peers: choose among {', '.join(PEERS)}")
    args.llamacpp_modes = [m for m in args.llamacpp_modes.split(",") if m]
    if set(args.llamacpp_modes) - set(LLAMACPP_MODES):
        raise SystemExit(f"--llamacpp-modes: choose among {', '.join(LLAMACPP_MODES)}")
    if "llamacpp" not in peers:
        args.llamacpp_modes = []
    for name in ("threads", "ctx", "new_tokens", "llamacpp_draft_max", "per_category", "repeats"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be at least 1")
    args.k = [int(k) for k in args.k.split(",") if k]
    if args.our_k is not None:
        args.our_k = [int(k) for k in args.our_k.split(",") if k]
    if args.k and (min(args.k) < 1 or max(args.k) > 16):
        raise SystemExit("--k values must be 1-16 (onnxruntime-genai's limit)")
    if args.prepare:
        prepare(peers, args.threads)
        return
    for peer, ready in (
        ("genai", GENAI_SPEC_DIR / "genai_config.json"),
        ("openvino", ov_dir(DRAFT) / "openvino_model.xml"),
    ):
        if peer in peers and not ready.is_file():
            raise SystemExit(f"{peer} is not prepared: run {Path(__file__).name} --prepare first")
    if args.llamacpp_modes:
        if not llamacpp().LLAMA_SERVER.is_file():
            raise SystemExit(f"llamacpp is not prepared: run {Path(__file__).name} --prepare --peers llamacpp first")
        llamacpp().check_prepared(argparse.Namespace(peers=["llamacpp"], llamacpp_modes=args.llamacpp_modes))

    from edge_spec.paths import DEFAULT_BUNDLE
    from edge_spec.prompts import as_messages
    from edge_spec.runtime.text import TextTokenizer

    args.bundle = args.bundle or DEFAULT_BUNDLE
    items = load_prompts(args)
    tokenizer = TextTokenizer(args.bundle)
    for item in items:  # tokenized once, the same ids for every engine
        item["ids"] = tokenizer.encode_chat(as_messages(item["prompt"]))
    longest = max((len(item["ids"]) for item in items), default=0)
    if args.llamacpp_modes and longest + args.new_tokens > args.ctx:
        raise SystemExit(f"a {longest}-token prompt and {args.new_tokens} new tokens exceed --ctx {args.ctx}")
    eos = set(tokenizer.eos_token_ids)
    warmup_ids = tokenizer.encode_chat([{"role": "user", "content": "warm up"}])
    spec = {"threads": args.threads, "new_tokens": args.new_tokens, "ks": args.k, "warmup_ids": warmup_ids}
    try:
        journal = RunJournal(args.output, run_settings(args, items))
    except EdgeSpecError as error:
        raise SystemExit(str(error)) from None
    load = os.getloadavg()
    workers, servers, versions = {}, {}, {}
    try:
        if "genai" in peers:
            log("loading onnxruntime-genai (ar + speculative) in models/genai-venv")
            workers["genai"] = Peer(
                "genai",
                shared.GENAI_PY,
                dict(spec, ar_dir=str(shared.ensure_genai_model(args.threads, TARGET)), spec_dir=str(GENAI_SPEC_DIR)),
            )
        if "openvino" in peers:
            log("loading OpenVINO GenAI (ar + speculative) in models/openvino-venv")
            workers["openvino"] = Peer(
                "openvino", OV_PY, dict(spec, target_dir=str(ov_dir(TARGET)), draft_dir=str(ov_dir(DRAFT)))
            )
        if args.llamacpp_modes:
            args.output.parent.mkdir(parents=True, exist_ok=True)
            versions["llamacpp"] = llamacpp().llamacpp_version()
            for mode in args.llamacpp_modes:  # each prompt read whole: no KV reuse, no prompt cache in RAM
                server = llamacpp().LlamaServer(mode, args, args.output.parent, reuse_prompts=False)
                servers[mode] = server
                server.warm_up(warmup_ids, 0.0, 0)
        ours = None
        if args.ours:
            log("loading edge-spec (ar engine + speculative engine)")
            ours = Ours(args)
        records = []
        if journal.done:
            log(f"resuming: {len(journal.done)} of {len(items)} prompts measured before ({journal.path})")
        for index, item in enumerate(items):
            if index in journal:
                records.extend(journal.get(index))
                continue
            fastest: dict[str, dict] = {}
            for repeat in range(args.repeats):
                for peer, worker in workers.items():
                    ar_ids = None
                    for k in [0, *args.k]:
                        answer = worker.ask({"ids": item["ids"], "k": k})
                        ar_ids = answer["ids"] if not k else ar_ids
                        run = peer_record(peer, k, answer, ar_ids)
                        keep_fastest(fastest, run)
                for run in llamacpp_runs(servers, item["ids"], repeat, args.new_tokens, eos, warmup_ids):
                    keep_fastest(fastest, run)
                for run in ours.run(item) if ours else []:
                    keep_fastest(fastest, run)
            for run in fastest.values():
                run.update(category=item["category"], prompt_index=index, prompt_tokens=len(item["ids"]))
            journal.add(index, list(fastest.values()))
            records.extend(journal.get(index))
            log(
                f"prompt {index + 1}/{len(items)} ({item['category']}): "
                + ", ".join(f"{r['engine']} {r['tokens_per_second']:.1f}" for r in fastest.values())
            )
    except KeyboardInterrupt:
        raise SystemExit(journal.stopped(len(items), "prompts")) from None
    finally:
        for worker in workers.values():
            worker.close()
        for server in servers.values():
            server.close()

    engines = list(dict.fromkeys(r["engine"] for r in records))
    rows = summarize(records, engines)
    load_after = os.getloadavg()
    print()
    print(
        f"{len(items)} prompts, greedy, at most {args.new_tokens} new tokens (stop at EOS), {args.threads} threads, "
        f"K = {', '.join(map(str, args.k))}, fastest of {args.repeats} per prompt; "
        + ", ".join(
            [f"{p} {w.info['version']}" for p, w in workers.items()] + [f"llama.cpp {v}" for v in versions.values()]
        )
    )
    print(
        f"load average 1/5/15 min: before {load[0]:.2f}/{load[1]:.2f}/{load[2]:.2f}, "
        f"after {load_after[0]:.2f}/{load_after[1]:.2f}/{load_after[2]:.2f} (machine has {os.cpu_count()} cores)"
    )
    print(format_rows(rows))
    print(
        "= ar: greedy answers token-identical to the same engine's ar (ours: to its one-row ar, which our exact "
        "batch-invariant passes may leave at a numerical near-tie)"
    )
    write_text_atomic(
        args.output,
        json.dumps(
            {
                "target": TARGET,
                "draft": DRAFT,
                "threads": args.threads,
                "new_tokens": args.new_tokens,
                "k": args.k,
                "gamma": args.gamma,
                "repeats": args.repeats,
                "peers": {p: w.info for p, w in workers.items()},
                "llamacpp": {
                    "version": versions.get("llamacpp"),
                    "ctx": args.ctx,
                    "flags": {mode: server.flags for mode, server in servers.items()},
                },
                "openvino_export": OV_EXPORT_ARGS,
                "load_before": load,
                "load_after": load_after,
                "summary": rows,
                "records": records,
            },
            indent=1,
        ),
    )
    journal.finish()
    print(f"\nwrote {args.output}")


if __name__ == "__main__":
    main()
