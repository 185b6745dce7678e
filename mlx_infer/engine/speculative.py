"""Speculative decoding: who proposes tokens, how many, and how many of them the target kept.

Verification itself is ordinary scheduling: a sequence with k proposed tokens gets k + 1 query rows in
the step (scheduler.py), the runner samples every row (runner.py), and the engine keeps the agreed
prefix plus one token of the target (engine.py). This module holds the parts that are not the
engine's: the proposer and the per-sequence choice of k.

Why sampling row j and comparing it with the proposal is exact: the n-gram proposer is deterministic
(its q is one-hot on the proposal d), so rejection sampling accepts d with probability min(1, p(d)/1)
= p(d) and otherwise resamples from p with d zeroed and renormalised. Drawing t ~ p and accepting iff
t == d does exactly that: P(t == d) = p(d), and t given t != d follows that renormalised p.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from mlx_infer.errors import InvalidRequest

METHODS = ("ngram", "draft")


@dataclass
class SpeculativeConfig:
    method: str | None = None  # None: off; "ngram": prompt lookup; "draft": a draft model
    num_draft_tokens: int = 4  # most tokens proposed per sequence and step (mlx-lm's name)
    max_batch: int = 2  # no speculation while more sequences than this are running (measured: README)
    ngram_max: int = 3  # longest suffix looked up
    ngram_min: int = 1  # shortest suffix looked up
    cooldown_steps: int = 4  # plain decode steps before a sequence whose k fell to 0 tries again

    def validate(self) -> None:
        if self.method is not None and self.method not in METHODS:
            raise InvalidRequest(f"--speculative must be one of {', '.join(METHODS)}, not {self.method!r}")
        if self.num_draft_tokens < 1:
            raise InvalidRequest(f"--num-draft-tokens must be at least 1, not {self.num_draft_tokens}")
        if self.max_batch < 1:
            raise InvalidRequest(f"--speculative-max-batch must be at least 1, not {self.max_batch}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise InvalidRequest("the n-gram lengths must satisfy 1 <= min <= max")


def ngram_propose(tokens: Sequence[int], k: int, max_n: int = 3, min_n: int = 1) -> list[int]:
    """Prompt lookup: find the longest suffix of ``tokens`` (``max_n`` down to ``min_n`` tokens) that
    occurred earlier, most recent occurrence first, and propose up to ``k`` tokens that followed it."""
    if k <= 0:
        return []
    total = len(tokens)
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        suffix = list(tokens[total - n :])
        # Most recent earlier occurrence: recent text predicts the continuation best (edits, lists).
        for start in range(total - n - 1, -1, -1):
            if tokens[start] == suffix[0] and list(tokens[start : start + n]) == suffix:
                follow = list(tokens[start + n : start + n + k])
                if follow:
                    return follow
    return []


class Proposer(Protocol):
    def propose(self, requests: Sequence[tuple[str, Sequence[int], int]]) -> list[list[int]]:
        """For each (request id, tokens so far, k): up to k tokens likely to follow (fewer or none when
        it has no guess). Called once a step for every speculating request together."""
        ...

    def release(self, request_id: str) -> None:
        """Forget a request that left the engine."""
        ...

    def release_idle_memory(self) -> int:
        """With no request in the engine: give back the memory it holds; returns the bytes."""
        ...


class PerSequenceProposer:
    """A proposer that looks at one sequence at a time and keeps no state."""

    def propose(self, requests: Sequence[tuple[str, Sequence[int], int]]) -> list[list[int]]:
        return [self.propose_one(tokens, k) for _, tokens, k in requests]

    def propose_one(self, tokens: Sequence[int], k: int) -> list[int]:
        raise NotImplementedError

    def release(self, request_id: str) -> None:
        pass

    def release_idle_memory(self) -> int:
        return 0


@dataclass
class NgramProposer(PerSequenceProposer):
    max_n: int = 3
    min_n: int = 1

    def propose_one(self, tokens: Sequence[int], k: int) -> list[int]:
        return ngram_propose(tokens, k, self.max_n, self.min_n)


def accepted_length(sampled: Sequence[int], proposal: Sequence[int]) -> int:
    """How many proposed tokens the target kept: the first row whose sample differs ends the run."""
    for j, token in enumerate(proposal):
        if sampled[j] != token:
            return j
    return len(proposal)


@dataclass
class SpecState:
    """A sequence's speculation length, adapted from how its recent proposals fared."""

    k: int
    cooldown: int = 0

    def update(self, proposed: int, accepted: int, max_k: int, cooldown_steps: int) -> None:
        """After a verification (``proposed`` 0: nothing was found to propose)."""
        if proposed and accepted == proposed:
            self.k = min(max_k, 2 * self.k)  # a full run: long matches tend to continue
        elif accepted == 0:
            self.k //= 2  # a miss or a rejected first token: the extra rows and the sync were wasted
            if self.k == 0:
                self.cooldown = cooldown_steps

    def tick(self) -> None:
        """A plain decode step of a sequence resting at k = 0: after the cooldown, try one token."""
        self.cooldown -= 1
        if self.cooldown <= 0:
            self.k = 1
