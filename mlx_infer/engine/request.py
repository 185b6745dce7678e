"""A request's state as it moves through the engine."""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from mlx_infer.constraints import ConstraintState
from mlx_infer.engine.speculative import SpecState
from mlx_infer.engine.stop import StopMatcher
from mlx_infer.sampling import SamplingParams, rng_key

# Stands in for a sampled token still being computed: the engine schedules the next step before the
# host has read the last one (see Engine.step).
PENDING_TOKEN = -1


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float | None  # None only for an echoed prompt's first token, which nothing predicts
    top: list[tuple[int, float]]  # (token id, logprob), best first


@dataclass
class ScoredPositions:
    """One step's log-probabilities of prompt tokens ``first + 1 .. first + count`` (lazy arrays, rows
    ``offset ..`` of the step's scored rows), for a request with ``prompt_logprobs``."""

    first: int
    count: int
    offset: int
    chosen: mx.array
    top_ids: mx.array | None
    top_logprobs: mx.array | None


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    stop: StopMatcher
    token_ids: list[int] = field(default_factory=list)  # prompt followed by the output so far
    num_computed: int = 0  # tokens whose K/V is in the cache
    num_cached_prompt: int = 0  # prompt tokens found in the prefix cache at first admission
    status: Status = Status.WAITING
    finish_reason: str | None = None
    rng_key: mx.array | None = None
    admitted: bool = False
    constraint: ConstraintState | None = None  # structured output: the matcher its tokens advance
    spec: SpecState | None = None  # speculation state; None: this request does not speculate
    proposal: list[int] = field(default_factory=list)  # tokens proposed for this step (not in token_ids)
    rng_after: list[mx.array] = field(default_factory=list)  # key after each of the last step's draws
    scored: list[ScoredPositions] = field(default_factory=list)  # prompt_logprobs, until the first token

    def __post_init__(self):
        self.token_ids = list(self.prompt_ids)
        if self.params.seed is not None:
            self.rng_key = rng_key(self.params.seed)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @functools.cached_property
    def prompt_token_set(self) -> np.ndarray:
        """The prompt's distinct tokens, sorted: all a repetition penalty needs of it, found once rather
        than every step."""
        return np.unique(np.asarray(self.prompt_ids, dtype=np.int64))

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_ids) :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_ids)

    @property
    def has_pending_token(self) -> bool:
        return self.token_ids[-1] == PENDING_TOKEN

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose values the host has read (all but a pending last one)."""
        return len(self.token_ids) - self.has_pending_token

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def num_to_compute(self) -> int:
        """Query rows this request wants in the next step: its uncomputed tokens and its proposal."""
        return self.num_uncomputed + len(self.proposal)

    @property
    def scores_prompt(self) -> bool:
        """Whether this request's next step must compute its prompt positions' logits: it wants prompt
        log-probabilities, has emitted nothing yet (a preempted one recomputes, but sent them already),
        and prompt tokens whose logits are missing remain."""
        return (
            self.params.prompt_logprobs is not None
            and self.num_output_tokens == 0
            and self.num_computed < self.num_prompt_tokens - 1
        )

    def read_prompt_logprobs(self) -> list[TokenLogprob]:
        """Each prompt token's log-probability (None for the first, which nothing predicts), read from
        the steps that computed them; a recomputed position (after a preemption) keeps its last value."""
        entries = [TokenLogprob(token, None, []) for token in self.prompt_ids]
        k = self.params.prompt_logprobs or 0
        for part in self.scored:
            end = part.offset + part.count
            chosen = part.chosen[part.offset : end].tolist()
            ids = part.top_ids[part.offset : end, :k].tolist() if k and part.top_ids is not None else None
            lps = part.top_logprobs[part.offset : end, :k].tolist() if ids is not None else None
            for j in range(part.count):
                position = part.first + j + 1
                top = list(zip(ids[j], lps[j])) if ids is not None else []
                entries[position] = TokenLogprob(self.prompt_ids[position], chosen[j], top)
        self.scored.clear()
        return entries

    def next_rng_keys(self, n: int) -> list[mx.array | None]:
        """Keys for this step's ``n`` draws (one per sampled row); advancing the key per draw keeps seeded
        output independent of batching and of speculation. The key after each draw is kept in
        ``rng_after``, so a verification that keeps only some rows can rewind (``keep_rng_draws``)."""
        if self.rng_key is None:
            return [None] * n
        keys, self.rng_after = [], []
        for _ in range(n):
            self.rng_key, key = mx.random.split(self.rng_key)
            keys.append(key)
            self.rng_after.append(self.rng_key)
        return keys

    def keep_rng_draws(self, n: int) -> None:
        """Only the first ``n`` draws of the last step made tokens: the next draw uses the key after them."""
        if self.rng_key is not None and 0 < n <= len(self.rng_after):
            self.rng_key = self.rng_after[n - 1]


@dataclass
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"
    logprobs: list[TokenLogprob] | None = None
    # With prompt_logprobs, on a request's first output only: one entry a prompt token (the first
    # without a log-probability).
    prompt_logprobs: list[TokenLogprob] | None = None
    error: Exception | None = None  # set with finish_reason "error": why this request failed alone
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
