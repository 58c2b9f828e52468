"""``edge-spec bench --sessions``: decoding modes compared on session workloads (``bench.sessions``).

Drafting from the suffix cache (the engine's earlier answers) pays when later requests repeat earlier
material, which a set of unrelated prompts never does.  So every mode replays every session turn by turn,
its own answers feeding its own later turns, with the session's tools, and is timed as the prompt bench
times a prompt (:func:`edge_spec.bench._run_mode`): its records are the prompt bench's plus the session
and the turn, summarized by the same :func:`edge_spec.bench.summarize`.

The cache holds every answer the engine gives, in any mode, so a mode replays a whole session before the
next mode starts, on a cache emptied for it: a session's numbers show what it learns from itself, never
from another mode's answers to the same turns.  With ``warm`` the cache is emptied once per mode and
kept across the sessions, which then run one after the other as a long-running server would see them.

Greedy (and coupled) answers must equal ``ar-exact``'s token for token in every turn: once the first turn
agrees every later prompt agrees too, so a difference is a bug of the mode, reported by :func:`mismatches`.
"""

from __future__ import annotations

from edge_spec.bench.runs import BenchMode, _deterministic, _run_mode, keep_fastest, modes_for, summarize
from edge_spec.bench.sessions import turn_messages
from edge_spec.errors import EdgeSpecError
from edge_spec.runtime.engine import Engine
from edge_spec.runtime.loops.config import loop_config

NOCACHE = "spec-nocache"  # the default chain drafting from the request alone (prompt lookup)


def session_modes(
    engine: Engine,
    heads: list[str] | None,
    *,
    gamma: int | None = None,
    schedule: str | None = None,
    reference: bool = True,
    spec: bool = True,
    nocache: bool = True,
) -> list[BenchMode]:
    """ar (and, with ``reference``, ar-exact where the speculative modes are exact), then per drafter head
    (default: the engine's): ``spec-nocache`` (the default chain drafting by prompt lookup) and ``spec``
    (the default chain, drafting from the suffix cache), named ``+HEAD`` for a head other than full."""
    modes = modes_for(engine, heads, loop_config("spec"), reference=reference, spec=False)  # ar, ar-exact
    cached = loop_config("spec", gamma=gamma, schedule=schedule)
    uncached = loop_config("spec", gamma=gamma, schedule=schedule, suffix=False)
    for head in heads or [engine.bundle.draft_head]:
        label = "" if head == "full" else f"+{head}"
        if nocache:
            modes.append(BenchMode(f"{NOCACHE}{label}", head, uncached))
        if spec:
            modes.append(BenchMode(f"spec{label}", head, cached))
    return modes


def run_sessions(
    engine: Engine,
    sessions: list[dict],
    modes: list[BenchMode],
    *,
    temperatures: list[float],
    max_new_tokens: int | None = None,
    seed: int = 0,
    repeats: int = 1,
    warm: bool = False,
    baseline: Engine | None = None,
    sampler: str = "rejection",
    progress=None,
) -> dict:
    """Replay every session in every mode and temperature; return the records (one per mode, session and
    turn, with its answer) and their summaries per category.

    ``max_new_tokens``: at most this many new tokens per answer (None: each session's ``max_tokens``).
    The k-th turn of the file samples with ``seed + k`` in every mode.  ``baseline`` times ``ar`` as in
    :func:`edge_spec.bench.run_bench`.  With ``repeats`` > 1 each session (``warm``: the whole set) runs
    that many times in all modes and each turn keeps its fastest run."""
    if repeats < 1:
        raise EdgeSpecError("repeats must be at least 1")
    if max_new_tokens is not None and max_new_tokens < 1:
        raise EdgeSpecError("max_new_tokens must be at least 1")
    schedule = engine.config
    seeds, ordinal = {}, 0
    for session in sessions:
        for turn in range(len(session["turns"])):
            seeds[(session["id"], turn)] = seed + ordinal
            ordinal += 1
    blocks = [sessions] if warm else [[session] for session in sessions]
    records: list[dict] = []
    done = 0
    for temperature in temperatures:
        for block in blocks:
            references: dict[tuple[str, int], dict[bool, list[int]]] = {}
            fastest: dict[tuple[str, str, int], dict] = {}
            for _ in range(repeats):
                for mode in modes:
                    if mode.name == "ar-exact" and not _deterministic(temperature, sampler):
                        continue  # only greedy and coupled answers are compared token for token
                    runner = baseline if baseline is not None and mode.name == "ar" else engine
                    start_afresh(runner, mode)
                    turns = dict(temperature=temperature, max_new_tokens=max_new_tokens, sampler=sampler)
                    for session in block:
                        for key, record in _replay(runner, mode, session, references, seeds, **turns):
                            keep_fastest(fastest, (mode.name, *key), record)
            records.extend(fastest.values())
            done += sum(len(session["turns"]) for session in block)
            if progress:
                progress(done, ordinal * len(temperatures))
    engine.config = schedule
    summary = summarize(records)
    add_session_columns(summary, records)
    return {
        "records": records,
        "summary": summary,
        "mismatches": mismatches(records),
        "warm": warm,
        "max_new_tokens": max_new_tokens,
        "repeats": repeats,
        "sampler": sampler,
        "seed": seed,
        "gamma": schedule.gamma,
        "adaptive": getattr(schedule, "adaptive", False),
    }


def _replay(runner: Engine, mode: BenchMode, session: dict, references: dict, seeds: dict, **turns):
    """Answer ``session`` turn by turn in ``mode``, each answer feeding the next turn's messages; yields
    each turn's key and record.  ``turns``: temperature, max_new_tokens (None: the session's), sampler."""
    max_new_tokens = turns.pop("max_new_tokens")
    answers: list[str] = []
    for turn in range(len(session["turns"])):
        key = (session["id"], turn)
        limit = session["max_tokens"]
        record, completion = _run_mode(
            runner,
            mode,
            turn_messages(session, turn, answers),
            references.setdefault(key, {}),
            max_new_tokens=limit if max_new_tokens is None else min(limit, max_new_tokens),
            seed=seeds[key],
            tools=session["tools"],
            **turns,
        )
        answers.append(completion.text)
        record.update(category=session["category"], session=session["id"], turn=turn, answer=completion.text)
        yield key, record


def start_afresh(engine: Engine, mode: BenchMode) -> None:
    """Before a mode replays a session (``warm``: the sessions): an empty suffix cache, and KV caches that
    hold no earlier prompt, so that no mode reads its first prompt faster for following another mode
    through the same session (within the session each request reuses its conversation's prefix, as a
    server's would)."""
    engine.bundle.suffix_cache.clear()
    engine.bundle.target.reset()
    if mode.head:
        engine.use_draft_head(mode.head)
        engine.bundle.active_drafter(mode.config).decoder.reset()


def add_session_columns(summary: list[dict], records: list[dict]) -> None:
    """Add to each summary row its mean time to the first token and, for a mode drafting from the suffix
    cache, its decode speed over the same chain's without the cache (``speedup_vs_nocache``)."""
    rate = {(r["temperature"], r["category"], r["mode"]): r["tokens_per_second"] for r in summary}
    for row in summary:
        rows = [
            r
            for r in records
            if r["temperature"] == row["temperature"]
            and r["mode"] == row["mode"]
            and row["category"] in ("overall", r["category"])
        ]
        row["first_token_seconds"] = sum(r["first_token_seconds"] for r in rows) / len(rows)
        if row["mode"].startswith("spec") and not row["mode"].startswith(NOCACHE):
            partner = rate.get((row["temperature"], row["category"], NOCACHE + row["mode"].removeprefix("spec")))
            row["speedup_vs_nocache"] = row["tokens_per_second"] / partner if partner else None


def cache_report(summary: list[dict]) -> str:
    """One line per (temperature, category, cached mode): decode tokens/s against ar and against the same
    chain without the suffix cache, and the mean time to the first token."""
    rows = [row for row in summary if row.get("speedup_vs_nocache") is not None]
    width = max((len(row["mode"]) for row in rows), default=0)
    lines = []
    for row in rows:
        lines.append(
            f"{row['temperature']:>4.1f} {row['category']:10s} {row['mode']:{width}s} "
            f"{row['tokens_per_second']:6.1f} tok/s"
            f"  {row['speedup_vs_ar'] or 0:5.2f}x ar  {row['speedup_vs_nocache']:5.3f}x {NOCACHE}"
            f"  first token {row['first_token_seconds']:.2f} s"
        )
    return "\n".join(lines)


def mismatches(records: list[dict]) -> list[str]:
    """One line per (temperature, mode, session) whose greedy or coupled answer differs from ar-exact's
    in some turn, naming the first such turn (the later ones answer other prompts from there on)."""
    first: dict[tuple, dict] = {}
    for r in sorted(records, key=lambda r: r["turn"]):
        if r.get("identical_to_ar") is False:
            first.setdefault((r["temperature"], r["mode"], r["session"]), r)
    return [
        f"T={temperature}: {mode} answered turn {r['turn'] + 1} of session {session!r} differently from ar-exact"
        for (temperature, mode, session), r in sorted(first.items())
    ]
