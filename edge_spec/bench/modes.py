"""The words of ``edge-spec bench --modes``: the kinds of mode bench compares, what each runs, and the
checks of a --modes list.  Light (no command line, no engine): the command's help lists these words."""

from __future__ import annotations

from edge_spec.errors import EdgeSpecError
from edge_spec.runtime.propose.drafters import DEFAULT_DRAFTER, DRAFTERS
from edge_spec.runtime.verify.tree import VERIFIERS

# the words of --modes: the kinds of mode bench compares (each run per drafter head and γ as it says); each
# model drafter but the drafter model (``spec``) is one more, by its name (``mode_groups``)
BASE_GROUPS = (
    (("ar",), "target only, the baseline of every speed-up (always run)"),
    (("ar-exact",), "greedy: target only in batch-invariant passes, the answer the exact modes must equal"),
    (("spec",), "the drafter model at the --schedule and at each --sweep γ, per --draft-head"),
    (("lookup",), "spec (and eagle) drafting by prompt lookup too, as modes +lookup"),
    (("suffix",), "spec drafting from the suffix cache too (the default chain's source), as modes +suffix"),
    (("ssd",), "speculative speculative decoding per --draft-head at each --sweep γ (else --gamma)"),
    (
        VERIFIERS,
        "multi-draft verified by that verifier, --drafts branches per step, per --draft-head at each "
        "--sweep γ (else --gamma)",
    ),
    (("nocache",), "with --sessions: spec drafting from the request alone, without the suffix cache (spec-nocache)"),
)
DEFAULT_MODES = ("ar", "ar-exact", "spec")
SESSION_MODES = ("ar", "ar-exact", "spec", "nocache")  # the kinds --sessions runs (and its default)


def other_drafters() -> list[str]:
    """The model drafters bench runs besides the drafter model, each a --modes word (its name)."""
    return [name for name in DRAFTERS if name != DEFAULT_DRAFTER]


def _head_flag(option: str | None) -> str:
    return "" if option is None else f", per --{option.replace('_', '-')}"


def mode_groups() -> tuple[tuple[tuple[str, ...], str], ...]:
    """The --modes words and what each runs: the fixed kinds, then one per other model drafter."""
    drafters = tuple(
        (
            (name,),
            f"{DRAFTERS[name].summary} at the --schedule and each --sweep γ{_head_flag(DRAFTERS[name].head_option)}",
        )
        for name in other_drafters()
    )
    return BASE_GROUPS[:-1] + drafters + BASE_GROUPS[-1:]


def mode_kinds(text: str) -> set[str]:
    """The kinds ``--modes`` names."""
    kinds = {kind.strip() for kind in text.split(",") if kind.strip()}
    known = [kind for words, _ in mode_groups() for kind in words]
    unknown = sorted(kinds - set(known))
    if unknown:
        raise EdgeSpecError(f"--modes: unknown mode {unknown[0]!r}; choose from {', '.join(known)}")
    return kinds


def benched_drafters(kinds: set[str], eagle_heads: list[str]) -> dict[str, list[str] | None]:
    """The other model drafters --modes names, each with the LM heads its option lists (None: its default)."""
    heads = {"eagle_head": eagle_heads or None}  # the head options bench has, by LoadOptions field
    named = [name for name in other_drafters() if name in kinds]
    return {name: heads.get(DRAFTERS[name].head_option) for name in named}


def check_session_flags(kinds: set[str], given: dict[str, bool]) -> None:
    """Refuse, in one line, a --modes kind or a flag that --sessions cannot honour."""
    other = sorted(kinds - set(SESSION_MODES))
    if other:
        raise EdgeSpecError(f"--sessions compares {', '.join(SESSION_MODES)}; --modes {other[0]} applies to prompts")
    for flag, used in given.items():
        if used:
            raise EdgeSpecError(f"{flag} applies to prompt benchmarks, not --sessions")
