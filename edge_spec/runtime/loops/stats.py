"""Per-request accounting of the speculative loops: one ``record_round`` per verify pass, one typed summary."""

from __future__ import annotations

from dataclasses import dataclass, field

from edge_spec.runtime.logprobs import LogprobRecorder
from edge_spec.runtime.propose.base import DraftBlock

TARGET = "target"  # the source of the tokens the target itself chose (first token, corrections, bonuses)


@dataclass
class SourceTally:
    """Rounds one proposer drafted, its drafts and how many of them the target accepted."""

    rounds: int = 0
    drafted: int = 0
    accepted: int = 0


@dataclass
class SpecSummary:
    """What a speculative request did (``GenerationStats.spec``); ratios are per verify pass unless named."""

    tau: float  # block efficiency: tokens emitted per target pass
    target_calls: int
    mean_gamma: float  # drafts per target pass
    acceptance_rate: float  # accepted / drafted
    first_token_acceptance: float  # share of passes with drafts whose first draft was accepted
    draft_steps: int  # drafter model steps (heads run), wherever they ran
    draft_seconds: float  # drafting on the critical path (SSD: the misses)
    verify_seconds: float
    head_seconds: float  # drafter LM head time, all ``draft_steps`` of it
    candidate_recall: float  # verified positions whose target token was among the head's rows
    param_ratio: float  # c in MBSU: drafter parameters per target parameters
    bytes_ratio: float | None  # the same in bytes read per step
    mbsu: float  # τ / (c·γ + 1)
    mbsu_bytes: float | None
    sources: dict[str, SourceTally]  # per proposer name
    accepted_lengths: list[int]
    speculation_hits: int = 0  # SSD: rounds whose drafts were prepared while the last one was verified
    speculation_misses: int = 0
    speculations_prepared: int = 0
    prepare_seconds: float = 0.0  # SSD: drafting off the critical path
    drafted_lengths: list[int] = field(default_factory=list)  # drafts per verify pass, beside accepted_lengths

    @property
    def cache_hit_rate(self) -> float:
        rounds = self.speculation_hits + self.speculation_misses
        return self.speculation_hits / rounds if rounds else 0.0

    @property
    def head_ms_per_step(self) -> float:
        return 1e3 * self.head_seconds / self.draft_steps if self.draft_steps else 0.0

    def tally(self, source: str) -> SourceTally:
        return self.sources.get(source, SourceTally())


@dataclass
class SpecStats:
    """The running record of one request (see :meth:`record_round`)."""

    accepted: list[int] = field(default_factory=list)  # drafts accepted per verify pass
    drafted: list[int] = field(default_factory=list)  # drafts per verify pass (tree: drafter steps)
    first_accepted: int = 0  # verify passes that accepted their first draft position
    draft_steps: int = 0
    sources: dict[str, SourceTally] = field(default_factory=dict)
    speculation_hits: int = 0
    speculation_misses: int = 0
    speculations_prepared: int = 0
    prepare_seconds: float = 0.0
    draft_seconds: float = 0.0
    head_seconds: float = 0.0
    verify_seconds: float = 0.0
    candidate_hits: int = 0
    candidate_checks: int = 0
    # who each emitted token came from, in emission order, when asked for (None: not kept): the proposer
    # that drafted it ("model", "lookup", "forced", ...) or "target" (the first token, corrections, bonuses)
    token_sources: list[str] | None = None
    # each emitted token's log-probability and top alternatives under the target's raw row, in emission
    # order, when asked for (None: nothing computed; see ``logprobs``)
    token_logprobs: LogprobRecorder | None = None

    def record_round(
        self,
        block: DraftBlock,
        accepted: int,
        first_accepted: bool,
        emitted: list[int],
        *,
        drafted: int | None = None,
        draft_seconds: float = 0.0,
        verify_seconds: float = 0.0,
        head_seconds: float = 0.0,
    ) -> None:
        """One verify pass over ``block`` (``drafted``: its size when not ``len(block.tokens)``, a tree)."""
        drafted = len(block.tokens) if drafted is None else drafted
        self.accepted.append(accepted)
        self.drafted.append(drafted)
        self.first_accepted += first_accepted
        self.draft_steps += block.steps
        self.draft_seconds += draft_seconds
        self.verify_seconds += verify_seconds
        self.head_seconds += head_seconds
        tally = self.sources.setdefault(block.source or "none", SourceTally())
        tally.rounds += 1
        tally.drafted += drafted
        tally.accepted += accepted
        for token, ids in zip(emitted, block.candidates):  # was the target's token among the head's rows?
            self.candidate_checks += 1
            self.candidate_hits += bool(ids is None or token in ids)

    def tally(self, source: str) -> SourceTally:
        return self.sources.get(source, SourceTally())

    def summary(self, param_ratio: float, bytes_ratio: float | None = None) -> SpecSummary:
        calls = len(self.accepted)
        tau = (sum(self.accepted) + calls) / calls if calls else 0.0
        gamma = sum(self.drafted) / calls if calls else 0.0
        with_drafts = sum(1 for d in self.drafted if d)
        return SpecSummary(
            tau=tau,
            target_calls=calls,
            mean_gamma=gamma,
            acceptance_rate=sum(self.accepted) / sum(self.drafted) if sum(self.drafted) else 0.0,
            first_token_acceptance=self.first_accepted / with_drafts if with_drafts else 0.0,
            draft_steps=self.draft_steps,
            draft_seconds=self.draft_seconds,
            verify_seconds=self.verify_seconds,
            head_seconds=self.head_seconds,
            candidate_recall=self.candidate_hits / self.candidate_checks if self.candidate_checks else 0.0,
            param_ratio=param_ratio,
            bytes_ratio=bytes_ratio,
            mbsu=tau / (param_ratio * gamma + 1) if calls else 0.0,
            mbsu_bytes=tau / (bytes_ratio * gamma + 1) if calls and bytes_ratio else None,
            sources={name: SourceTally(**vars(t)) for name, t in self.sources.items()},
            accepted_lengths=list(self.accepted),
            speculation_hits=self.speculation_hits,
            speculation_misses=self.speculation_misses,
            speculations_prepared=self.speculations_prepared,
            prepare_seconds=self.prepare_seconds,
            drafted_lengths=list(self.drafted),
        )
