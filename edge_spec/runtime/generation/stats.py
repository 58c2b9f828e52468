"""What one answer reports: its statistics and, for a non-streaming call, the whole completion."""

from __future__ import annotations

from dataclasses import dataclass

from edge_spec.runtime.loops.stats import SpecSummary


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    stop_reason: str = ""
    mode: str = "ar"
    spec: SpecSummary | None = None  # what the speculative loop did (τ, acceptance, MBSU, ...); None in ar
    coupled_seed: int | None = None  # a coupled sampled answer's seed (drawn if none was given): it remakes the answer

    @property
    def tokens_per_second(self) -> float:
        """Decode speed: tokens after the first (which comes out of the prefill pass) per decode second."""
        return (self.new_tokens - 1) / self.decode_seconds if self.new_tokens > 1 and self.decode_seconds > 0 else 0.0


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    stats: GenerationStats
