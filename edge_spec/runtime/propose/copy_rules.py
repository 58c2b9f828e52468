"""Which of two ways of copying a request's own text rewards: the suffix cache's (the longest match, the
continuation most earlier occurrences took) or prompt lookup's (the latest occurrence of the last 2-4
tokens).

Neither wins everywhere.  Replayed over the shipped sessions (every answer position, 8 drafts against
the tokens that followed): a file rewritten with one change is copied best by the longest match (7.7
tokens of 8 against 6.4: a long match says where in the file the answer is), tests for the second and
third of three similar functions best by the latest occurrence (4.3 against 3.2: the newest test is the
one the next resembles, whatever most earlier ones went on with).  So every round both rules offer their
drafts; once the tokens that followed an offer decide between them, each rule is credited with the
drafts it would have had accepted, and the next rounds follow the rule ahead (a tie: the longest match).
The record is a function of the request's tokens alone, like the drafts themselves.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DECAY = 0.9  # per decided offer: about the last ten decide


@dataclass
class Offer:
    position: int  # where the drafts would start (the committed length when offered)
    longest: list[int]
    latest: list[int]


@dataclass
class CopyRuleRecord:
    """Per request: how many drafts each rule would have had accepted lately (decayed)."""

    longest: float = 0.0
    latest: float = 0.0
    pending: list[Offer] = field(default_factory=list)

    def prefers_latest(self) -> bool:
        return self.latest > self.longest

    def offer(self, position: int, longest: list[int], latest: list[int]) -> None:
        """Both rules' drafts at ``position``; judged by :meth:`settle` once the answer has gone on."""
        if longest != latest:  # the same drafts can never tell the rules apart
            self.pending.append(Offer(position, list(longest), list(latest)))

    def settle(self, committed: list[int]) -> None:
        """Credit every offer the tokens after it now decide: each rule's drafts matched as far as they
        match what followed, once both are known to have stopped matching or the longer one is."""
        waiting = []
        for offer in self.pending:
            followed = committed[offer.position : offer.position + max(len(offer.longest), len(offer.latest))]
            longest, latest = _agreeing(offer.longest, followed), _agreeing(offer.latest, followed)
            if _decided(longest, len(offer.longest), followed) and _decided(latest, len(offer.latest), followed):
                self.longest = DECAY * self.longest + longest
                self.latest = DECAY * self.latest + latest
            else:
                waiting.append(offer)
        self.pending = waiting


def _agreeing(drafts: list[int], followed: list[int]) -> int:
    """How many of ``drafts`` equal the tokens that followed, from the first on."""
    count = 0
    for draft, token in zip(drafts, followed):
        if draft != token:
            break
        count += 1
    return count


def _decided(agreeing: int, offered: int, followed: list[int]) -> bool:
    """A rule's credit is final once a draft of it missed, or every one of them is known to match."""
    return agreeing < min(offered, len(followed)) or len(followed) >= offered
