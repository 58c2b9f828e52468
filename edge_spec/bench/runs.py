"""``edge-spec bench``: speculative modes against autoregressive decoding on the same bundle, in one run.

For every prompt the target-only (``ar``) answer is generated first; each
speculative mode then answers the same prompt with the same settings.  Greedy
answers must be token-identical to target-only decoding with the same numerics:
the speculative modes run batch-invariant target passes (see ``runtime/decoder``),
so next to the fast one-row ``ar`` (the speed baseline, timed in an engine loaded for
target-only decoding alone: our fastest) greedy runs also time
``ar-exact``, target-only decoding with those passes, and each greedy record says
whether it equals that (``identical_to_ar``) and the one-row ``ar`` answer
(``identical_to_one_row_ar``: it may part from it at a numerical near-tie).
Per category we report τ (tokens per target call), MBSU = τ / (c·γ + 1) with c
the drafter/target parameter ratio of that mode, decode tokens/s and the
wall-clock speed-up against ``ar`` (ratio of decode throughput measured in this
run; absolute times on a shared machine are noisy, ratios much less so).
"""

from __future__ import annotations

import dataclasses
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from edge_spec.bench import long_prompts
from edge_spec.errors import EdgeSpecError
from edge_spec.paths import PACKAGE_DATA
from edge_spec.prompts import as_messages, read_prompt_file
from edge_spec.runtime.engine import Completion, Engine
from edge_spec.runtime.loaded import drafter_name
from edge_spec.runtime.loops.config import ArConfig, ChainConfig, LoopConfig, SsdConfig, TreeConfig
from edge_spec.runtime.model import huge_pages
from edge_spec.runtime.propose.drafters import DEFAULT_DRAFTER, DRAFTERS

DEFAULT_PROMPTS = PACKAGE_DATA / "bench" / "prompts.jsonl"


@dataclass(frozen=True)
class BenchMode:
    """One labelled way of answering: a loop configuration, a drafter head, the target's numerics."""

    name: str  # "ar", "spec" (full head), "spec+trim-16384", "spec+specvocab-r64-k256@γ2", ...
    head: str | None  # drafter head, None for ar
    config: LoopConfig = ArConfig()
    exact: bool | None = None  # batch-invariant target passes (None: the engine's default for the mode)
    drafter_head: str | None = None  # the LM head of the mode's drafter, where that is not the drafter model


def with_drafter(config: ChainConfig, drafter: str) -> ChainConfig:
    """``config`` drafting with the model drafter ``drafter`` (``propose.drafters.DRAFTERS``) in its drafter's place."""
    return dataclasses.replace(config, proposers=tuple(drafter if p in DRAFTERS else p for p in config.proposers))


SEQUENCES = ("lookup", "suffix")  # the proposers that draft from text already written (modes +lookup, +suffix)


def with_lookup(config: ChainConfig, lookup: bool, source: str = "lookup") -> ChainConfig:
    """``config`` drafting from the sequence too, by ``source`` (prompt lookup, or the suffix cache), first;
    or, with ``lookup`` False, by neither."""
    others = tuple(p for p in config.proposers if p not in SEQUENCES)
    return dataclasses.replace(config, proposers=(source,) + others if lookup else others)


def load_bench_prompts(path: Path | None, categories: list[str] | None, per_category: int | None) -> list[dict]:
    """The prompts of ``path`` (default: the shipped set) in ``categories`` (all when None or empty).  The
    ``long`` category (:mod:`edge_spec.bench.long_prompts`) joins only when named: each of its
    prompts of ~2,000 tokens takes seconds to read in every mode on a laptop CPU, which a default run
    of short prompts should not spend."""
    prompts = read_prompt_file(path or DEFAULT_PROMPTS, "bench prompt")
    if categories and long_prompts.CATEGORY in categories:
        if not any(p["category"] == long_prompts.CATEGORY for p in prompts):  # a file's own long category wins
            prompts += long_prompts.long_prompts()
    if categories:
        unknown = set(categories) - {p["category"] for p in prompts}
        if unknown:
            raise EdgeSpecError(f"unknown bench categories: {', '.join(sorted(unknown))}")
        prompts = [p for p in prompts if p["category"] in categories]
    if per_category:
        seen: dict[str, int] = defaultdict(int)
        kept = []
        for p in prompts:
            if seen[p["category"]] < per_category:
                kept.append(p)
                seen[p["category"]] += 1
        prompts = kept
    return prompts


def modes_for(
    engine: Engine,
    heads: list[str] | None,
    chain: ChainConfig,
    fixed_gammas: list[int] | None = None,
    trees: list[TreeConfig] = (),
    ssds: list[SsdConfig] = (),
    lookup: bool = False,
    reference: bool = True,
    suffix: bool = False,
    drafters: dict[str, list[str] | None] | None = None,
    spec: bool = True,
) -> list[BenchMode]:
    """ar (and, with ``reference``, ar-exact when the speculative modes are exact), then per head: one
    mode per fixed γ in ``fixed_gammas`` (a sweep), one per multi-draft configuration
    (``...+k2-spechub@γ2``), one per SSD configuration (``...+ssd@γ1``) and the run's own schedule
    ``chain``; with ``lookup`` every fixed-γ and schedule mode also runs with prompt lookup (``+lookup``), with
    ``suffix`` with the suffix cache (``+suffix``, the default chain's source).
    Each other model drafter in ``drafters`` (``propose.drafters.DRAFTERS``, e.g. the EAGLE head) gets the
    fixed-γ and schedule modes too, labelled by its ``DrafterSpec.label`` (``eagle@γ2``, ``eagle``), once
    per LM head its entry lists (None: the bundle's default; ``eagle`` is the full head, ``eagle+trim-4096``
    another).  With ``spec`` False the drafter model's chains without lookup
    (``spec``, ``spec@γ2``) are left out; its ``+lookup``, multi-draft and SSD modes still run."""
    available = list(engine.bundle.manifest["draft"]["heads"])
    chosen = heads or available
    for head in chosen:
        if head not in available:
            raise EdgeSpecError(f"bundle has no drafter head {head!r}; available: {', '.join(available)}")
    modes = [BenchMode("ar", None)]
    if reference and engine.exact_for("spec") and not engine.exact_for("ar"):
        modes.append(BenchMode("ar-exact", None, exact=True))  # the reference of greedy exact modes
    plain = with_drafter(with_lookup(chain, False), DEFAULT_DRAFTER)
    for head in chosen:
        name = _labelled(DRAFTERS[DEFAULT_DRAFTER].label, head)
        others = [BenchMode(f"{name}+k{tree.drafts}-{tree.verifier}@γ{tree.gamma}", head, tree) for tree in trees]
        others += [BenchMode(f"{name}+ssd@γ{ssd.gamma}", head, ssd) for ssd in ssds]
        modes += _chain_modes(name, head, plain, fixed_gammas, lookup, others, without_lookup=spec, suffix=suffix)
    for drafter, drafter_heads in (drafters or {}).items():
        if drafter not in DRAFTERS or drafter == DEFAULT_DRAFTER:
            others = [d for d in DRAFTERS if d != DEFAULT_DRAFTER]
            raise EdgeSpecError(f"no other drafter {drafter!r} to bench; choose from: {', '.join(others)}")
        spec = DRAFTERS[drafter]
        if not spec.present(engine.bundle.manifest):
            raise EdgeSpecError(f"this bundle has no {spec.title} head: {spec.remedy}")
        for name in drafter_heads or [None]:  # None: the bundle's default head of the drafter
            name = engine.bundle.check_head(name, drafter)
            modes += [
                dataclasses.replace(mode, drafter_head=name)
                for mode in _chain_modes(
                    _labelled(spec.label, name), chosen[0], with_drafter(plain, drafter), fixed_gammas, lookup
                )
            ]
    return modes


def _labelled(label: str, head: str | None) -> str:
    """A drafter's mode name: its label alone for its full head, else LABEL+HEAD."""
    return label if head in (None, "full") else f"{label}+{head}"


def _chain_modes(
    name: str,
    head: str,
    plain: ChainConfig,
    fixed_gammas: list[int] | None,
    lookup: bool,
    others: list[BenchMode] = (),
    without_lookup: bool = True,
    suffix: bool = False,
) -> list[BenchMode]:
    """One mode per fixed γ, then ``others``, then the run's schedule as ``name``: each without prompt
    lookup (unless ``without_lookup`` is False) and, with ``lookup``, with it (``name+lookup``)."""
    modes = []
    for gamma in fixed_gammas or []:
        fixed = dataclasses.replace(plain, gamma=gamma, adaptive=False)
        if without_lookup:
            modes.append(BenchMode(f"{name}@γ{gamma}", head, fixed))
        if lookup:
            modes.append(BenchMode(f"{name}+lookup@γ{gamma}", head, with_lookup(fixed, True)))
        if suffix:
            modes.append(BenchMode(f"{name}+suffix@γ{gamma}", head, with_lookup(fixed, True, "suffix")))
    modes += others
    if without_lookup:
        modes.append(BenchMode(name, head, plain))
    if lookup:
        modes.append(BenchMode(f"{name}+lookup", head, with_lookup(plain, True)))
    if suffix:
        modes.append(BenchMode(f"{name}+suffix", head, with_lookup(plain, True, "suffix")))
    return modes


def run_bench(
    engine: Engine,
    prompts: list[dict],
    modes: list[BenchMode],
    *,
    temperatures: list[float],
    max_new_tokens: int,
    seed: int = 0,
    repeats: int = 1,
    progress=None,
    baseline: Engine | None = None,
    sampler: str = "rejection",
    warm: bool = False,
) -> dict:
    """Run every prompt in every mode and temperature; return raw records plus per-category summaries.

    ``baseline``: the engine that times the ``ar`` mode -- our fastest target-only decoding, loaded for
    it alone (its ORT threads spin on between passes, as ``generate --mode ar`` runs them; an engine
    loaded for speculative decoding stops them at the end of every pass, so that they never spin on the
    cores the drafter's next step needs, which costs a lone one-row pass a little).  The
    same bundle, provider and threads as ``engine``; None times ``ar`` on ``engine``.

    With ``repeats`` > 1 each prompt goes through all modes that many times, interleaved, and each mode
    keeps its fastest run (the least disturbed by other load on the machine); the identity flags must
    hold in every run.  ``sampler`` "coupled": sampled answers are fixed by the seed, so every mode
    gives the same text, compared token for token like greedy answers (``verify.coupled``).

    Every answer starts on a suffix cache holding nothing, or with ``warm`` the ``ar`` answers to the
    earlier prompts, as a server that answered them before would hold -- never this prompt's own answer."""
    if repeats < 1:
        raise EdgeSpecError("repeats must be at least 1")
    records = []
    history: list[tuple[list[int], list[int], int]] = []  # earlier prompts' ar answers: (prompt ids, answer, index)
    schedule = engine.config  # the run's schedule, reported beside the results
    total = len(prompts) * len(temperatures)
    done = 0
    for temperature in temperatures:
        for index, item in enumerate(prompts):
            messages = as_messages(item["prompt"])
            references: dict[bool, list[int]] = {}  # target-only answers by numerics (exact or one-row)
            fastest: dict[str, dict] = {}
            for _ in range(repeats):
                for mode in modes:
                    if mode.name == "ar-exact" and not _deterministic(temperature, sampler):
                        continue  # only greedy and coupled answers are compared token for token
                    runner = baseline if baseline is not None and mode.name == "ar" else engine
                    # the prompts are unrelated: no answer drafts from an earlier one (another mode's answer to
                    # this very prompt included, which the suffix cache would copy whole)
                    runner.bundle.suffix_cache.clear()
                    for prompt_ids, answer, earlier in history if warm else ():
                        if earlier != index:  # never this prompt's own answer
                            runner.bundle.suffix_cache.remember(prompt_ids, answer)
                    record, completion = _run_mode(
                        runner,
                        mode,
                        messages,
                        references,
                        max_new_tokens=max_new_tokens,
                        temperature=temperature,
                        seed=seed + index,
                        sampler=sampler,
                    )
                    record.update(category=item["category"], prompt_index=index)
                    if mode.name == "ar" and not any(h[2] == index for h in history):
                        history.append((runner.prompt_ids(messages, check_length=False), completion.token_ids, index))
                    keep_fastest(fastest, mode.name, record)
            records.extend(fastest.values())
            done += 1
            if progress:
                progress(done, total)
    engine.config = schedule
    return {
        "records": records,
        "summary": summarize(records),
        "gamma": schedule.gamma,
        "adaptive": getattr(schedule, "adaptive", False),
        "max_new_tokens": max_new_tokens,
        "repeats": repeats,
        "sampler": sampler,
    }


def keep_fastest(fastest: dict, key, record: dict) -> None:
    """Keep in ``fastest[key]`` the faster of ``record`` and the run kept there; an identity flag
    (greedy answer equal to the reference) holds only if it held in every run."""
    kept = fastest.setdefault(key, record)
    for flag in ("identical_to_ar", "identical_to_one_row_ar"):
        if flag in record:
            record[flag] = kept[flag] = record[flag] and kept[flag]
    if record["decode_seconds"] < kept["decode_seconds"]:
        fastest[key] = record


def _run_mode(
    engine: Engine,
    mode: BenchMode,
    messages: list[dict],
    references: dict[bool, list[int]],
    *,
    max_new_tokens: int,
    temperature: float,
    seed: int,
    sampler: str = "rejection",
    tools: list[dict] | None = None,
) -> tuple[dict, Completion]:
    """One answer in one mode: its record and the answer itself.  The first target-only answer per
    numerics becomes the reference.  ``tools`` go to the chat template with the messages."""
    loop = mode.config.mode
    if mode.head:
        engine.config = mode.config
        engine.use_draft_head(mode.head)
        if mode.drafter_head:
            engine.use_head(drafter_name(mode.config), mode.drafter_head)
    decoders = {
        "target": engine.bundle.target,
        "draft": engine.bundle.active_drafter(mode.config).decoder if mode.head else None,
    }
    huge_pages.wait_all()  # a model loaded just now is timed on the pages it will keep (model/huge_pages.py)
    before = {role: _pass_log(d) for role, d in decoders.items()}
    started = time.perf_counter()
    completion = engine.complete(
        messages,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        seed=seed,
        sampler=sampler,
        mode=loop,
        exact=mode.exact,
        tools=tools,
    )
    exact = engine.exact_for(loop, mode.exact, deterministic=_deterministic(temperature, sampler))
    stats = completion.stats
    record = {
        "temperature": temperature,
        "sampler": sampler,
        "mode": mode.name,
        "prompt_tokens": stats.prompt_tokens,
        "new_tokens": stats.new_tokens,
        "first_token_seconds": stats.prefill_seconds,
        "decode_seconds": stats.decode_seconds,
        "wall_seconds": time.perf_counter() - started,
        "tokens_per_second": stats.tokens_per_second,
    }
    for role, decoder in decoders.items():  # ORT passes of this answer by rows, prompt processing left out
        record[f"{role}_passes"] = _decode_passes(before[role], _pass_log(decoder))
    if mode.head is None:
        references.setdefault(exact, completion.token_ids)
        return record, completion
    record.update(_spec_columns(stats.spec))
    reference = references.get(exact)  # None: no target-only run with these numerics (--no-reference)
    record["identical_to_ar"] = None if reference is None else completion.token_ids == reference
    record["identical_to_one_row_ar"] = completion.token_ids == references.get(False)
    return record, completion


SPEC_COLUMNS = (
    "tau",
    "mbsu",
    "acceptance_rate",
    "mean_gamma",
    "param_ratio",
    "target_calls",
    "draft_seconds",
    "verify_seconds",
    "head_seconds",
    "draft_steps",
    "candidate_recall",
    "first_token_acceptance",
    "cache_hit_rate",
)
SEQUENCE_SOURCES = ("guess", "lookup", "suffix")  # proposers whose rounds and accepted tokens a record counts


def _spec_columns(spec) -> dict:
    """A speculative answer's columns: its speculation statistics and each sequence source's rounds."""
    columns = {k: getattr(spec, k) for k in SPEC_COLUMNS}
    for source in SEQUENCE_SOURCES:
        columns[f"{source}_rounds"] = spec.tally(source).rounds
        columns[f"{source}_accepted"] = spec.tally(source).accepted
    return columns


def _deterministic(temperature: float, sampler: str) -> bool:
    """Whether an answer is fixed by its prompt and seed (``SamplingParams.deterministic``): greedy, or
    coupled sampling."""
    return temperature == 0 or sampler == "coupled"


def _pass_log(decoder) -> dict[int, tuple[int, float]]:
    """A decoder's cumulative (calls, seconds) per number of rows fed outside prefill (empty for no decoder)."""
    if decoder is None:
        return {}
    stats = decoder.stats
    return {
        n: (stats.calls[n] - stats.prefill_calls.get(n, 0), stats.seconds[n] - stats.prefill_seconds.get(n, 0.0))
        for n in stats.calls
    }


def _decode_passes(before: dict, after: dict) -> dict[str, list[float]]:
    """Passes made between two logs as {rows: [calls, seconds]}."""
    passes = {}
    for n, (calls, seconds) in after.items():
        done, spent = before.get(n, (0, 0.0))
        if calls > done:
            passes[n] = [calls - done, seconds - spent]
    return {str(n): v for n, v in sorted(passes.items())}


def pass_prices(records: list[dict]) -> dict[tuple[str, str], float]:
    """Mean latency of one ORT pass per (decoder: "target" or "draft", rows as a string) over a run's records."""
    table: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0])
    for r in records:
        for role in ("target", "draft"):
            for n, (calls, seconds) in r.get(f"{role}_passes", {}).items():
                table[(role, n)][0] += calls
                table[(role, n)][1] += seconds
    return {key: seconds / calls for key, (calls, seconds) in table.items() if calls}


def cost_normalized_seconds(records: list[dict]) -> dict[int, float]:
    """Per record (by ``id``): its decode time with every ORT pass priced at the run's mean latency for
    that decoder and row count, plus the record's own time outside ORT (head, numpy, Python).

    Why: on a shared machine two runs of the same passes differ by ±5%, about the size of the
    differences between γ schedules; pricing all modes' passes with one table keeps exactly what a
    schedule changes (how many passes of how many rows, how many drafter steps) and drops when each
    run happened to be slowed down by other load."""
    price = pass_prices(records)
    normalized = {}
    for r in records:
        if "target_passes" not in r:
            continue
        measured = priced = 0.0
        for role in ("target", "draft"):
            for n, (calls, seconds) in r.get(f"{role}_passes", {}).items():
                measured += seconds
                priced += calls * price[(role, n)]
        normalized[id(r)] = priced + max(r["decode_seconds"] - measured, 0.0)
    return normalized


def summarize(records: list[dict]) -> list[dict]:
    """Aggregate per (temperature, category, mode), plus an 'overall' category."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        groups[(r["temperature"], r["category"], r["mode"])].append(r)
        groups[(r["temperature"], "overall", r["mode"])].append(r)
    normalized = cost_normalized_seconds(records)
    throughput, priced = {}, {}
    for key, rows in groups.items():
        tokens = sum(max(r["new_tokens"] - 1, 0) for r in rows)
        seconds = sum(r["decode_seconds"] for r in rows)
        throughput[key] = tokens / seconds if seconds else 0.0
        if all(id(r) in normalized for r in rows):
            seconds = sum(normalized[id(r)] for r in rows)
            priced[key] = tokens / seconds if seconds else 0.0
    out = []
    for (temperature, category, mode), rows in sorted(
        groups.items(), key=lambda kv: (kv[0][0], kv[0][1] == "overall", kv[0][1], kv[0][2] != "ar", kv[0][2])
    ):
        row = {
            "temperature": temperature,
            "category": category,
            "mode": mode,
            "prompts": len(rows),
            "tokens_per_second": throughput[(temperature, category, mode)],
        }
        ar = throughput.get((temperature, category, "ar"))
        row["speedup_vs_ar"] = row["tokens_per_second"] / ar if ar else None
        key, ar_key = (temperature, category, mode), (temperature, category, "ar")
        if key in priced and priced.get(ar_key):  # the same ratio with every pass at the run's mean price
            row["normalized_tokens_per_second"] = priced[key]
            row["normalized_speedup_vs_ar"] = priced[key] / priced[ar_key]
        if "tau" in rows[0]:  # a speculative mode
            calls = sum(r["target_calls"] for r in rows)
            emitted = sum(r["tau"] * r["target_calls"] for r in rows)
            tau = emitted / calls if calls else 0.0
            gamma = sum(r["mean_gamma"] * r["target_calls"] for r in rows) / calls if calls else 0.0
            compared = all(_deterministic(r["temperature"], r.get("sampler", "rejection")) for r in rows)
            c = rows[0]["param_ratio"]
            steps = sum(r["draft_steps"] for r in rows)
            row["head_ms_per_step"] = 1e3 * sum(r["head_seconds"] for r in rows) / steps if steps else 0.0
            row["draft_ms_per_step"] = 1e3 * sum(r["draft_seconds"] for r in rows) / steps if steps else 0.0
            row["candidate_recall"] = (
                sum(r["candidate_recall"] * r["draft_steps"] for r in rows) / steps if steps else 0.0
            )
            row.update(
                {
                    "tau": tau,
                    "mbsu": tau / (c * gamma + 1),
                    "mean_gamma": gamma,
                    "param_ratio": c,
                    "acceptance_rate": sum(r["acceptance_rate"] for r in rows) / len(rows),
                    "cache_hit_rate": (
                        sum(r.get("cache_hit_rate", 0.0) * r["target_calls"] for r in rows) / calls if calls else 0.0
                    ),
                    "first_token_acceptance": (
                        sum(r.get("first_token_acceptance", 0.0) * r["target_calls"] for r in rows) / calls
                        if calls
                        else 0.0
                    ),
                    "identical_to_ar": (
                        all(r["identical_to_ar"] for r in rows)
                        if compared and all(r["identical_to_ar"] is not None for r in rows)
                        else None
                    ),
                    "identical_to_one_row_ar": (sum(r["identical_to_one_row_ar"] for r in rows) if compared else None),
                }
            )
        out.append(row)
    return out


def format_table(summary: list[dict]) -> str:
    """One row per (temperature, category, mode).  ``x ar``: wall-clock speed-up; ``xar$``: the same with
    every ORT pass priced at the run's mean latency (see :func:`cost_normalized_seconds`); ``same``:
    greedy answers equal target-only decoding with the same numerics; ``=ar1``: how many equal one-row ar."""
    lines = []
    header = (
        f"{'T':>4} {'category':14s} {'mode':36s} {'tau':>5} {'MBSU':>5} {'1st acc':>7} {'recall':>6} "
        f"{'draft ms':>8} {'head ms':>7} "
        f"{'tok/s':>6} {'x ar':>5} {'xar$':>5} {'same':>5} {'=ar1':>5}"
    )
    current = None
    for row in summary:
        if row["temperature"] != current:
            current = row["temperature"]
            lines += ["", header, "-" * len(header)]
        same = row.get("identical_to_ar")
        one_row = row.get("identical_to_one_row_ar")
        one_row = "" if one_row is None else f"{one_row}/{row['prompts']}"
        lines.append(
            f"{row['temperature']:>4.1f} {row['category']:14s} {row['mode']:36s} "
            f"{row.get('tau', 1.0):5.2f} {row.get('mbsu', 1.0):5.2f} {row.get('first_token_acceptance', 0.0):7.3f} "
            f"{row.get('candidate_recall', 1.0):6.3f} "
            f"{row.get('draft_ms_per_step', 0.0):8.2f} {row.get('head_ms_per_step', 0.0):7.2f} "
            f"{row['tokens_per_second']:6.1f} "
            f"{row['speedup_vs_ar'] or 0:5.2f} {row.get('normalized_speedup_vs_ar') or 0:5.2f} "
            f"{'' if same is None else ('yes' if same else 'NO'):>5} "
            f"{one_row:>5}"
        )
    return "\n".join(lines)


def schedule_report(summary: list[dict]) -> str:
    """Per category: the schedule mode (e.g. adaptive) against the best fixed γ of the same head, in
    wall-clock and (when the run logged its passes) with every pass at the run's mean price."""
    lines = []
    by_key = {(r["temperature"], r["category"], r["mode"]): r for r in summary}
    for (temperature, category, mode), row in by_key.items():
        fixed = [
            r for (t, c, m), r in by_key.items() if t == temperature and c == category and m.startswith(mode + "@γ")
        ]
        if not fixed or mode == "ar":
            continue
        line = f"{temperature:>4.1f} {category:14s} {mode:30s}"
        for label, rate in (("wall", "tokens_per_second"), ("priced", "normalized_tokens_per_second")):
            if rate not in row:
                continue
            best = max(fixed, key=lambda r: r[rate])
            ar = by_key[(temperature, category, "ar")][rate]
            line += (
                f" | {label}: {row[rate] / ar:5.2f}x ar, best fixed {best['mode'].rsplit('@', 1)[1]} "
                f"{best[rate] / ar:5.2f}x, schedule / best = {row[rate] / best[rate]:.3f}"
            )
        lines.append(line)
    return "\n".join(lines)


def per_prompt_schedule(records: list[dict]) -> list[dict]:
    """Per (temperature, schedule mode, prompt): the schedule's decode speed over the best fixed γ of
    the same head on that very prompt (wall clock) -- the schedule has to choose well on every prompt,
    not only on average.  One row per schedule mode: the minimum and median ratio, and where the
    minimum was."""
    speed = {(r["temperature"], r["mode"], r["prompt_index"]): r for r in records}
    rows = []
    for temperature, mode in sorted({(t, m) for t, m, _ in speed}):
        prompts = sorted(i for t, m, i in speed if (t, m) == (temperature, mode))
        ratios = []
        for index in prompts:
            fixed = [
                r for (t, m, i), r in speed.items() if t == temperature and i == index and m.startswith(mode + "@γ")
            ]
            if fixed and mode != "ar":
                best = max(fixed, key=lambda r: r["tokens_per_second"])
                ratios.append(
                    (
                        speed[(temperature, mode, index)]["tokens_per_second"] / best["tokens_per_second"],
                        index,
                        speed[(temperature, mode, index)]["category"],
                    )
                )
        if ratios:
            ratios.sort()
            rows.append(
                {
                    "temperature": temperature,
                    "mode": mode,
                    "prompts": len(ratios),
                    "min": ratios[0][0],
                    "min_prompt": ratios[0][1],
                    "min_category": ratios[0][2],
                    "median": ratios[len(ratios) // 2][0],
                }
            )
    return rows


def per_prompt_report(rows: list[dict]) -> str:
    return "\n".join(
        f"{r['temperature']:>4.1f} {r['mode']:30s} schedule / best fixed γ per prompt: median "
        f"{r['median']:.3f}, min {r['min']:.3f} (prompt {r['min_prompt']}, {r['min_category']})"
        for r in rows
    )


def plot(summary: list[dict], path: Path) -> bool:
    """Speed-up and τ against the drafter head's measured cost per draft step (overall rows):
    VocabTrim at several K and SpecVocab land on one axis, so "better τ at equal head cost" is visible.

    Returns False, writing nothing, when matplotlib (the ``bench`` extra) is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.5))
    for temperature in sorted({r["temperature"] for r in summary}):
        rows = sorted(
            (r for r in summary if r["temperature"] == temperature and r["category"] == "overall" and "tau" in r),
            key=lambda r: r["head_ms_per_step"],
        )
        cost = [r["head_ms_per_step"] for r in rows]
        ax1.plot(cost, [r["speedup_vs_ar"] for r in rows], marker="o", ls=":", label=f"T={temperature}")
        ax2.plot(cost, [r["tau"] for r in rows], marker="o", ls=":", label=f"T={temperature}")
        for r in rows:
            ax2.annotate(
                r["mode"].removeprefix("spec+"),
                (r["head_ms_per_step"], r["tau"]),
                fontsize=7,
                xytext=(3, 3),
                textcoords="offset points",
            )
    for ax, title in ((ax1, "wall-clock speed-up vs ar"), (ax2, "τ (tokens per target call)")):
        ax.set_xlabel("drafter head ms per draft step (measured)")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
