"""Layout of a draft tree for one target pass: node order, rotary positions, attention mask.

The tree verified here is what multi-draft decoding proposes: a root (the
pending token, already emitted but not yet in the cache) with k branches, each
a chain of drafts.  Nodes are laid out parents-first -- root, then branch 1's
chain, then branch 2's, ... -- so a node's ancestors always precede it and the
causal mask of GroupQueryAttention already hides every later node; the bias
only has to hide *earlier* nodes of other branches.  A node's rotary position
is the cache length plus its depth, so every branch sees exactly the
positions it would see if it were decoded alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class DraftTree:
    root: int  # the pending token
    branches: tuple[tuple[int, ...], ...]  # each branch's chain of draft tokens

    @property
    def tokens(self) -> list[int]:
        """All nodes in pass order (root first)."""
        return [self.root] + [t for branch in self.branches for t in branch]

    @property
    def size(self) -> int:
        return 1 + sum(len(b) for b in self.branches)

    def nodes(self, branch: int) -> list[int]:
        """Pass-order indices of ``branch``'s chain (depth 1, 2, ...)."""
        start = 1 + sum(len(b) for b in self.branches[:branch])
        return list(range(start, start + len(self.branches[branch])))

    def depths(self) -> np.ndarray:
        return np.array([0] + [d for b in self.branches for d in range(1, len(b) + 1)], dtype=np.int64)

    def positions(self, past: int) -> np.ndarray:
        """Rotary position of each node when the cache holds ``past`` tokens."""
        return past + self.depths()

    def attention_bias(self, past: int) -> np.ndarray:
        """[S, past + S] additive bias: 0 where a node may attend (the cache, its ancestors, itself),
        -inf on nodes of other branches."""
        size = self.size
        bias = np.zeros((size, past + size), dtype=np.float32)
        owner = np.zeros(size, dtype=np.int64)  # branch of each node, -1 for the root
        owner[0] = -1
        for j in range(len(self.branches)):
            owner[self.nodes(j)] = j
        other_branch = (owner[:, None] != owner[None, :]) & (owner[None, :] >= 0)
        bias[:, past:][other_branch] = -np.inf
        return bias
