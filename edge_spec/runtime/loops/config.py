"""Each loop's settings, and the one place where a user's settings become a loop's configuration.

A loop gets only the settings it honours (the dataclasses below); :func:`loop_config` maps a mode
plus the settings a user gave (CLI flags, API keywords) onto one of them and refuses, in one line,
a setting the chosen loop cannot honour -- never silently ignoring it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar, Union

from edge_spec.errors import EdgeSpecError
from edge_spec.runtime.propose import DRAFTERS, PROPOSERS
from edge_spec.runtime.propose.drafters import DEFAULT_DRAFTER
from edge_spec.runtime.verify.sampling import SamplingParams
from edge_spec.runtime.verify.tree import VERIFIERS

MODES = ("ar", "spec", "ssd")  # the user's word for the loop family; spec runs a chain or (drafts > 1) a tree
# The adaptive schedule's ceiling is only a ceiling: each round's length comes from the measured row-cost
# curve and the running acceptance (``schedule.policy``), so a machine whose extra verify rows are cheap
# drafts long on confident stretches and one where they are dear never gets there.  A fixed schedule
# drafts its γ every round, whatever the acceptance, so its default stays short.
ADAPTIVE_GAMMA_MAX = 32
FIXED_GAMMA = 4


@dataclass(frozen=True)
class ArConfig:
    """Target-only decoding: nothing to set."""

    mode: ClassVar[str] = "ar"
    gamma: ClassVar[int] = 0
    proposers: ClassVar[tuple[str, ...]] = ()  # the target alone


@dataclass(frozen=True)
class ChainConfig:
    """One chain of drafts per round (``loops.chain``)."""

    mode: ClassVar[str] = "spec"
    gamma: int = ADAPTIVE_GAMMA_MAX  # drafts per round; the most per round when adaptive
    adaptive: bool = True  # choose each round's drafts from measured costs and running acceptance
    min_confidence: float = 0.0  # stop drafting once the drafter's top probability falls below this
    # in order of preference (propose.PROPOSERS, and one of the model drafters: propose.drafters.DRAFTERS)
    proposers: tuple[str, ...] = ("suffix", DEFAULT_DRAFTER, "guess")

    def __post_init__(self) -> None:
        _check_gamma(self.gamma)
        if not 0.0 <= self.min_confidence <= 1.0:
            raise EdgeSpecError(f"min_confidence must be in [0, 1], not {self.min_confidence}")
        unknown = [p for p in self.proposers if p not in PROPOSERS and p not in DRAFTERS]
        if unknown:
            known = [*DRAFTERS, *PROPOSERS]
            raise EdgeSpecError(f"unknown proposer {unknown[0]!r}; choose from: {', '.join(known)}")


@dataclass(frozen=True)
class TreeConfig:
    """Several drafter branches verified in one tree-shaped pass (``loops.tree``), fixed shape."""

    mode: ClassVar[str] = "spec"
    proposers: ClassVar[tuple[str, ...]] = (DEFAULT_DRAFTER,)  # the branches are the drafter model's
    gamma: int = 2  # each branch's length
    drafts: int = 2  # branches
    verifier: str = "spechub"  # multi-draft sampling scheme and its verifier (``verify.tree.VERIFIERS``)

    def __post_init__(self) -> None:
        _check_gamma(self.gamma)
        if self.drafts < 2:
            raise EdgeSpecError("multi-draft decoding needs at least 2 drafts")
        if self.verifier not in VERIFIERS:
            raise EdgeSpecError(
                f"unknown multi-draft verifier {self.verifier!r}; choose one of: {', '.join(VERIFIERS)}"
            )


@dataclass(frozen=True)
class SsdConfig:
    """Speculative speculative decoding (``loops.ssd``): fixed γ, drafting ahead while the target verifies."""

    mode: ClassVar[str] = "ssd"
    proposers: ClassVar[tuple[str, ...]] = (DEFAULT_DRAFTER,)  # drafting ahead needs the drafter model's probabilities
    gamma: int = 1  # drafts per round (a round on two cores: see the README's SSD section)
    fan_out: int = 3  # correction/bonus tokens predicted per possible stop point (Saguaro's F)
    speculations: int = -1  # outcomes prepared per round; -1 = as many as fit while the target verifies

    def __post_init__(self) -> None:
        _check_gamma(self.gamma)
        if self.fan_out < 1:
            raise EdgeSpecError("fan_out must be at least 1")
        if self.speculations < -1:
            raise EdgeSpecError("speculations must be -1 (as many as fit) or more")


LoopConfig = Union[ArConfig, ChainConfig, TreeConfig, SsdConfig]

# settings a user may give -> (the flag that names it, the loops that honour it)
SETTINGS = {
    "gamma": ("--gamma", (ChainConfig, TreeConfig, SsdConfig)),
    "schedule": ("--schedule", (ChainConfig,)),
    "lookup": ("--lookup", (ChainConfig,)),
    "suffix": ("--suffix-cache", (ChainConfig,)),
    "min_confidence": ("--min-confidence", (ChainConfig,)),
    "drafts": ("--drafts", (ChainConfig, TreeConfig)),
    "verifier": ("--verifier", (TreeConfig,)),
    "fan_out": ("--fan-out", (SsdConfig,)),
    "speculations": ("--speculations", (SsdConfig,)),
    "drafter": ("--drafter", (ChainConfig,)),
}
DEFAULTS_ANYWHERE = {"drafts": 1, "drafter": DEFAULT_DRAFTER}  # values every speculative loop honours


def loop_config(mode: str, **settings) -> LoopConfig:
    """The configuration of ``mode`` with the given settings (None: not given, the loop's default).

    ``spec`` with ``drafts`` > 1 is the tree loop.  ``schedule`` is "adaptive" or "fixed"; ``lookup``
    adds or removes drafting from the sequence among the chain's proposers; ``suffix`` (default True)
    drafts it from this request and the engine's earlier answers (the suffix cache), False from this
    request alone by prompt lookup."""
    given = {k: v for k, v in settings.items() if v is not None}
    unknown = set(given) - set(SETTINGS)  # a caller's mistake, not a user's
    if unknown:
        raise TypeError(f"unknown loop settings: {', '.join(sorted(unknown))}")
    if mode not in MODES:
        raise EdgeSpecError(f"unknown mode {mode!r}; choose one of: {', '.join(MODES)}")
    loop = {"ar": ArConfig, "ssd": SsdConfig}.get(mode) or (TreeConfig if given.get("drafts", 1) > 1 else ChainConfig)
    for name, value in given.items():
        flag, honoured_by = SETTINGS[name]
        if loop not in honoured_by and not (DEFAULTS_ANYWHERE.get(name) == value and loop is not ArConfig):
            raise EdgeSpecError(
                f"{flag} does not apply to {_describe(loop)}; it applies to "
                f"{' and '.join(_describe(c) for c in honoured_by)}"
            )
    if loop is ChainConfig:
        given.pop("drafts", None)
        schedule = given.pop("schedule", "adaptive")
        if schedule not in ("adaptive", "fixed"):
            raise EdgeSpecError(f"--schedule must be adaptive or fixed, not {schedule!r}")
        lookup = given.pop("lookup", True)
        sequence = "suffix" if given.pop("suffix", True) else "lookup"
        drafter = given.pop("drafter", DEFAULT_DRAFTER)
        if drafter not in DRAFTERS:
            raise EdgeSpecError(f"--drafter must be one of {', '.join(DRAFTERS)}, not {drafter!r}")
        named = {DEFAULT_DRAFTER: drafter, "suffix": sequence}
        proposers = tuple(named.get(p, p) for p in ChainConfig.proposers if lookup or p != "suffix")
        if schedule == "fixed":
            given.setdefault("gamma", FIXED_GAMMA)
        return ChainConfig(adaptive=schedule == "adaptive", proposers=proposers, **given)
    known = {f.name for f in fields(loop)}
    return loop(**{k: v for k, v in given.items() if k in known})


def check_sampling(config: LoopConfig, params: SamplingParams) -> None:
    """Refuse, in one line, a sampling setting the loop cannot honour: multi-draft trees draw their
    branches for rejection sampling, so coupled sampling (``verify.coupled``) has no tree verifier."""
    if params.coupled and isinstance(config, TreeConfig):
        raise EdgeSpecError(
            "--sampler coupled applies to --mode ar, ssd and one-chain spec; multi-draft trees "
            "draw their branches for rejection sampling (--drafts 1, or --sampler rejection)"
        )


def _describe(loop: type) -> str:
    return {
        ArConfig: "--mode ar",
        ChainConfig: "--mode spec",
        TreeConfig: "multi-draft spec (--drafts > 1)",
        SsdConfig: "--mode ssd",
    }[loop]


def _check_gamma(gamma: int) -> None:
    if gamma < 1:
        raise EdgeSpecError("--gamma must be at least 1")
