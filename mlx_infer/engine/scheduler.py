"""vLLM V1-style scheduler: decodes first, then prefill chunks, under a per-step token budget.

It decides *what* runs each step; the KV manager decides *where* K/V lives; the model runner
executes. When blocks run out, the newest running request is preempted and later recomputed
(its prefix blocks usually survive in the prefix cache, so recomputation is mostly hits).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from mlx_infer.engine.request import Request, Status
from mlx_infer.kv.manager import KVCacheManager


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 32  # cap on running sequences
    max_num_batched_tokens: int = 512  # token budget of one step (bounds prefill chunks)


@dataclass
class ScheduledRequest:
    request: Request
    num_new: int

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the known tokens (and of the proposal, if any), so new
        tokens are sampled."""
        return self.num_new == self.request.num_to_compute


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager):
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.failed: list[tuple[Request, Exception]] = []  # of the last schedule(), see there

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledRequest]:
        """This step's requests. A request whose bookkeeping raises is finished with reason "error" and
        listed in ``failed`` (with its exception) for the engine to report; the others are scheduled."""
        self.failed = []
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted = False

        # Running requests first, in admission order, so streams keep flowing.
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = self._chunk(request, min(request.num_to_compute, budget))
            # A proposal that does not fit the budget is cut (to nothing if not even its first token fits).
            del request.proposal[max(0, num_new - request.num_uncomputed) :]
            try:
                victims = self._make_room(request, num_new)
            except Exception as e:  # noqa: BLE001 - this request fails alone
                self._fail(request, e)
                continue
            if victims:
                preempted = True
                gone = {id(v) for v in victims}
                scheduled = [s for s in scheduled if id(s.request) not in gone]
                if id(request) in gone:
                    continue
            scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
            index += 1
        for s in list(scheduled):
            r = s.request
            try:
                # A pending token's value is not known yet: its block is registered on a later step.
                known = min(r.num_computed + s.num_new, r.num_known_tokens)
                self.kv.register(r.request_id, r.token_ids, known)
            except Exception as e:  # noqa: BLE001 - this request fails alone
                self._fail(r, e)
                scheduled.remove(s)
        budget = self.config.max_num_batched_tokens - sum(s.num_new for s in scheduled)

        # Then waiting requests, oldest first, while blocks, budget and sequence slots last.
        while self.waiting and budget > 0 and not preempted and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            try:
                num_new = self._admit(request, budget)
            except Exception as e:  # noqa: BLE001 - this request fails alone
                self._fail(request, e)
                continue
            if num_new is None:
                break
            scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
        return scheduled

    def _chunk(self, request: Request, num_new: int) -> int:
        """Hybrid models with prefix caching: a chunk of several tokens ends on the last block boundary it
        crosses (the rest follows next step), so that the recurrent state is saved there and a later
        prompt with the same prefix can start from it (kv/state_slots.py)."""
        if self.kv.checkpoints is None or num_new <= 1:
            return num_new
        bs = self.kv.block_size
        boundary = (request.num_computed + num_new) // bs * bs
        return boundary - request.num_computed if boundary > request.num_computed else num_new

    def _make_room(self, request: Request, num_new: int) -> list[Request]:
        """Allocate a running request's blocks for this step, preempting the newest running requests
        until they fit; returns the preempted ones (the request itself, last, if even that was short)."""
        victims = []
        while not self.kv.allocate(
            request.request_id, request.token_ids, request.num_computed, num_new, register=False
        ):
            victim = self.running.pop()
            self._preempt(victim)
            victims.append(victim)
            if victim is request:
                break
        return victims

    def _admit(self, request: Request, budget: int) -> int | None:
        """Move the oldest waiting request to running with blocks for its first chunk; returns the chunk's
        length, or None (holding nothing) when the pool is short."""
        reuse = request.params.prompt_logprobs is None
        request.num_computed = self.kv.find_cached_prefix(request.request_id, request.token_ids, reuse)
        num_new = self._chunk(request, min(request.num_uncomputed, budget))
        if not self.kv.allocate(request.request_id, request.token_ids, request.num_computed, num_new):
            # Hand back the prefix blocks too: a waiting request must hold nothing, or it could
            # starve the running ones it waits for.
            self.kv.free(request.request_id)
            request.num_computed = 0
            return None
        if not request.admitted:
            request.num_cached_prompt = request.num_computed
        self.waiting.popleft()
        request.status = Status.RUNNING
        request.admitted = True
        self.running.append(request)
        return num_new

    def _fail(self, request: Request, error: Exception) -> None:
        self.finish(request, "error")
        self.failed.append((request, error))

    def _preempt(self, request: Request) -> None:
        self.kv.free(request.request_id)
        request.proposal.clear()
        request.num_computed = 0
        self.num_preemptions += 1
        request.status = Status.WAITING
        self.waiting.appendleft(request)

    def finish(self, request: Request, reason: str) -> None:
        """Remove a request wherever it is; its blocks return to the pool at once."""
        if request.status is Status.RUNNING:
            self.running.remove(request)
        elif request.status is Status.WAITING:
            self.waiting.remove(request)
        self.kv.free(request.request_id)
        request.status = Status.FINISHED
        request.finish_reason = reason
