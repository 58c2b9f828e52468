"""A machine kind's headline row, from the runs ``benchmarks/machine_kind.py`` makes.

Each figure is a ratio within one run: our default against the fastest peer mode of the same run (every mode of
every peer the run had), so that a machine's speed, which moves between runs, cancels.  The row reads as
docs/measurements.md's headline table does: all bench prompts; the lowest category; first token against the
soonest peer mode's; our ``ar`` against onnxruntime-genai's plain decoding; long prompts (decode, and first token
in seconds); agent and edit sessions pooled, and ``actions``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from edge_spec.bench.peers import peer_label, summarize

#: our default in a spec_peers run (schedule, suffix cache) and in a session_peers run
OURS_PROMPTS = "ours schedule+suffix"
OURS_SESSIONS = "ours spec"
OUR_AR = "ours ar"
GENAI_PLAIN = "genai ar"
#: the session categories the headline pools, and the one it shows apart
AGENT_AND_EDIT = ("agent", "edit")
ACTIONS = "actions"


@dataclass(frozen=True)
class Lead:
    """Our default against the fastest peer mode of one category of one run."""

    category: str
    ours: float  # decode tokens/s
    peer: str  # the fastest peer mode, as the tables name it
    peer_speed: float
    first_token_ms: float | None  # ours
    soonest_peer_ms: float | None  # the soonest peer mode's

    @property
    def ratio(self) -> float:
        return self.ours / self.peer_speed


def is_peer(engine: str) -> bool:
    return not engine.startswith("ours")


def lead(rows: Iterable[dict], category: str, ours: str) -> Lead:
    """``ours`` against the fastest peer mode in ``category`` of a summary (``edge_spec.bench.peers.summarize``);
    a summary without our default or without a peer is refused (ValueError), since there is no ratio to show."""
    here = {row["engine"]: row for row in rows if row["category"] == category}
    peers = {engine: row for engine, row in here.items() if is_peer(engine)}
    if ours not in here or not peers:
        raise ValueError(f"category {category!r} needs {ours!r} and a peer mode, has {sorted(here)}")
    fastest = max(peers.values(), key=lambda row: row["tokens_per_second"])
    firsts = [row["first_token_ms"] for row in peers.values() if row.get("first_token_ms") is not None]
    return Lead(
        category=category,
        ours=here[ours]["tokens_per_second"],
        peer=peer_label(fastest["engine"]),
        peer_speed=fastest["tokens_per_second"],
        first_token_ms=here[ours].get("first_token_ms"),
        soonest_peer_ms=min(firsts) if firsts else None,
    )


def lowest_category(rows: list[dict], ours: str) -> Lead:
    """The category where our lead is smallest (``overall`` left out)."""
    categories = sorted({row["category"] for row in rows} - {"overall"})
    return min((lead(rows, category, ours) for category in categories), key=lambda item: item.ratio)


def speeds(rows: Iterable[dict], category: str) -> dict[str, float]:
    """Each engine's decode tokens/s in ``category`` of a summary."""
    return {row["engine"]: row["tokens_per_second"] for row in rows if row["category"] == category}


def ar_against_genai(rows: list[dict], category: str = "overall") -> float | None:
    """Our one-row ``ar`` against onnxruntime-genai's plain decoding (None where the run lacks either)."""
    speed = speeds(rows, category)
    return speed[OUR_AR] / speed[GENAI_PLAIN] if OUR_AR in speed and GENAI_PLAIN in speed else None


def pooled_sessions(records: list[dict], categories: Iterable[str], label: str) -> list[dict]:
    """A session run's turns of ``categories`` summarized as one category ``label`` (tokens pooled, as
    ``summarize`` pools a category)."""
    wanted = set(categories)
    chosen = [dict(record, category=label) for record in records if record["category"] in wanted]
    if not chosen:
        raise ValueError(f"no turns of {sorted(wanted)} in the session run")
    return summarize(chosen, list(dict.fromkeys(record["engine"] for record in chosen)))


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value / 1000:.2f}"


def headline_row(
    kind: str,
    prompts: list[dict],
    long: list[dict] | None,
    sessions: list[dict] | None,
    first_tokens: list[dict] | None = None,
) -> str:
    """The markdown row: ``prompts`` and ``long`` are spec_peers summaries, ``sessions`` a session run's records,
    ``first_tokens`` a spec_peers summary of the long prompts' first tokens, each the soonest of several runs
    (without it the long run's own first tokens, timed once, marked so)."""
    overall = lead(prompts, "overall", OURS_PROMPTS)
    lowest = lowest_category(prompts, OURS_PROMPTS)
    ar = ar_against_genai(prompts)
    cells = [
        kind,
        f"**{overall.ratio:.3f}x** ({overall.ours:.2f} against {overall.peer}'s {overall.peer_speed:.2f} tok/s)",
        f"{lowest.ratio:.3f}x {lowest.category}",
        f"{_ms(overall.first_token_ms)} / {_ms(overall.soonest_peer_ms)}",
        "-" if ar is None else f"**{ar:.2f}x**",
    ]
    if long:
        far = lead(long, "overall", OURS_PROMPTS)
        first = lead(first_tokens, "overall", OURS_PROMPTS) if first_tokens else far
        once = "" if first_tokens else " (timed once)"
        cells.append(
            f"**{far.ratio:.3f}x**; {_seconds(first.first_token_ms)} / {_seconds(first.soonest_peer_ms)}{once}"
        )
    else:
        cells.append("-")
    if sessions:
        pooled = lead(pooled_sessions(sessions, AGENT_AND_EDIT, "agent and edit"), "agent and edit", OURS_SESSIONS)
        actions = lead(pooled_sessions(sessions, [ACTIONS], ACTIONS), ACTIONS, OURS_SESSIONS)
        cells.append(
            f"**{pooled.ratio:.3f}x**, first token {_seconds(pooled.first_token_ms)} / "
            f"{_seconds(pooled.soonest_peer_ms)} s; **{actions.ratio:.3f}x**"
        )
    else:
        cells.append("-")
    return "| " + " | ".join(cells) + " |"


HEADER = (
    "| machine kind | all bench prompts | lowest category | first token, ms: ours / the soonest peer mode's | "
    "our `ar` / onnxruntime-genai's plain | long prompts: decode; first token, s: ours / the soonest peer mode's | "
    "agent and edit sessions, first token: ours / the soonest peer mode's; `actions` |\n"
    "|---|---|---|---|---|---|---|"
)


def category_rows(prompts: list[dict]) -> str:
    """Per category: our default, our ``ar``, the fastest peer mode and the ratios (the section tables' core)."""
    lines = [
        "| category | ours, tok/s | our `ar` | fastest peer mode | its tok/s | ours / it | our `ar` / genai's plain |",
        "|---|---|---|---|---|---|---|",
    ]
    categories = sorted({row["category"] for row in prompts} - {"overall"}) + ["overall"]
    for category in categories:
        item = lead(prompts, category, OURS_PROMPTS)
        ar = speeds(prompts, category).get(OUR_AR)
        versus = ar_against_genai(prompts, category)
        lines.append(
            f"| {category} | {item.ours:.2f} | {'-' if ar is None else f'{ar:.2f}'} | "
            f"{item.peer} | {item.peer_speed:.2f} | {item.ratio:.3f} | {'-' if versus is None else f'{versus:.2f}'} |"
        )
    return "\n".join(lines)
