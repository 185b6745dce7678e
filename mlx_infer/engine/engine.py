"""The engine: requests in, token/text deltas out, one ``step()`` at a time.

``generate`` and ``serve`` both drive this class; ``AsyncEngine`` runs it on a thread of its own.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections import Counter
from dataclasses import dataclass, field, replace

import mlx.core as mx
import mlx.nn as nn

from mlx_infer.constraints import ConstraintState, batch_mask, compile_constraint
from mlx_infer.engine.draft import DraftProposer
from mlx_infer.engine.request import PENDING_TOKEN, Request, RequestOutput, Status, TokenLogprob
from mlx_infer.engine.runner import (
    InFlight,
    ModelRunner,
    activation_dtype,
    dtype_name,
    kv_pool_dtype,
)
from mlx_infer.engine.scheduler import ScheduledRequest, Scheduler, SchedulerConfig
from mlx_infer.engine.speculative import (
    NgramProposer,
    Proposer,
    SpecState,
    SpeculativeConfig,
    accepted_length,
)
from mlx_infer.engine.stop import StopMatcher
from mlx_infer.errors import (
    ConstraintFailed,
    ContextTooLong,
    EngineFailure,
    InvalidRequest,
    UnsupportedArchitecture,
)
from mlx_infer.interface.kv import window_of
from mlx_infer.kv.manager import KVCacheManager
from mlx_infer.kv.memory import PoolMemory, describe_pool, kv_budget_bytes
from mlx_infer.plan import planner
from mlx_infer.sampling import SamplingParams

log = logging.getLogger("mlx_infer")


@dataclass
class EngineConfig:
    block_size: int = 16
    kv_memory: float | None = None  # GiB for the KV pool; None: a fraction of what the device has
    num_blocks: int | None = None  # exact pool size (tests); overrides kv_memory
    kv_cache_dtype: str = "auto"  # --kv-cache-dtype: auto, float32, float16, bfloat16 or int8
    enable_prefix_caching: bool = True
    kv_chunk_tokens: int = 1024  # the pool grows and shrinks by this many tokens' blocks
    kv_idle_release: float = 300.0  # seconds idle before the pool's memory is given back (Ollama's 5 min)
    # Sliding-window layers mixed with global ones get a block pool of their own (kv/window.py); off where
    # the ranks of a distributed session do not all have the same window.
    window_pool: bool = True
    max_context: int | None = None  # None: the model's own
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)


@dataclass
class EngineStats:
    prompt_tokens: int = 0  # computed (not cached) prompt tokens
    generated_tokens: int = 0
    steps: int = 0
    finished_requests: int = 0
    failed_requests: int = 0  # failed inside the engine (their clients got an error), engine unharmed
    failed_steps: int = 0  # steps that failed for the whole batch and were recovered from
    spec_proposed: int = 0  # speculative tokens proposed and verified
    spec_accepted: int = 0  # of those, tokens the target model agreed with (and were emitted)

    @property
    def spec_acceptance(self) -> float:
        return self.spec_accepted / self.spec_proposed if self.spec_proposed else 0.0


@dataclass
class _StepProgress:
    """How far a step got, so a failure fails the requests it held: the previous step's always, the
    running ones if scheduling was under way, the scheduled batch once it is known."""

    scheduling: bool = False
    batch: list[ScheduledRequest] | None = None


def window_pool_size(config: EngineConfig, window: int, shared_pool: int) -> int:
    """Blocks of the sliding-window layers' own pool: what the running sequences' windows span, no more
    than the ``shared_pool`` blocks one pool for every layer would have had; the main pool gets the rest
    of the budget. Every rank of a distributed session computes the same from the same config."""
    sched = config.scheduler
    blocks = planner.window_pool_blocks(
        window, config.block_size, sched.max_num_seqs, sched.max_num_batched_tokens
    )
    return min(blocks, shared_pool)


def pool_num_blocks(
    config: EngineConfig, max_context: int, kv_bytes_per_token: int, state_bytes: int = 0
) -> int:
    """KV blocks that fit the memory budget once ``state_bytes`` (the recurrent-state slots) are taken
    out of it, and no more than every running sequence at full context could use when no explicit
    budget is given."""
    tokens = max(kv_budget_bytes(config.kv_memory) - state_bytes, 0) // kv_bytes_per_token
    blocks = tokens // config.block_size
    if config.kv_memory is None:  # whole blocks: a context of 40 tokens needs 3 of 16, not 2
        blocks = min(blocks, config.scheduler.max_num_seqs * -(-max_context // config.block_size))
    return max(1, blocks)


class Engine:
    def __init__(
        self,
        model: nn.Module,
        tokenizer,
        max_context: int,
        config: EngineConfig | None = None,
        draft_model: nn.Module | None = None,
    ):
        """``draft_model``: the proposer's model for ``speculative.method == "draft"`` (same tokenizer)."""
        self.model = model
        self.tokenizer = tokenizer
        self.config = config or EngineConfig()
        self.config.speculative.validate()
        self.max_context = min(max_context, self.config.max_context or max_context)
        dtype = kv_pool_dtype(self.config.kv_cache_dtype, activation_dtype(model))
        layout = model.kv_layout()
        per_token = planner.layout_bytes_per_token(layout, dtype_name(dtype), windowed=False)
        window_per_token = planner.layout_bytes_per_token(layout, dtype_name(dtype), windowed=True)
        # Hybrid models: one recurrent-state slot per sequence that may run, and as many states saved for
        # prefix caching, out of the same budget.
        state_slots, per_sequence = hybrid_state(model, self.config)
        checkpoints = state_slots if self.config.enable_prefix_caching else 0
        self.state_bytes = (state_slots + checkpoints) * per_sequence
        bs = self.config.block_size
        window = window_of(layout) if self.config.window_pool else None
        window_blocks = 0
        if window is not None:
            shared_pool = self.config.num_blocks or pool_num_blocks(
                self.config, self.max_context, per_token + window_per_token, self.state_bytes
            )
            window_blocks = window_pool_size(self.config, window, shared_pool)
        num_blocks = self.config.num_blocks or pool_num_blocks(
            self.config, self.max_context, per_token, self.state_bytes + window_blocks * bs * window_per_token
        )
        chunk_blocks = max(1, self.config.kv_chunk_tokens // bs)
        self.kv = KVCacheManager(
            num_blocks,
            bs,
            self.config.enable_prefix_caching,
            chunk_blocks,
            num_state_slots=state_slots,
            num_state_checkpoints=checkpoints,
            window=window,
            window_blocks=window_blocks,
        )
        self.kv_block_bytes = bs * per_token
        self.window_block_bytes = bs * window_per_token
        self.runner = ModelRunner(model, self.kv, dtype, tokenizer.eos_token_ids)
        self.scheduler = Scheduler(self.config.scheduler, self.kv)
        self.requests: dict[str, Request] = {}
        self.stats = EngineStats()
        self._detokenizers: dict[str, object] = {}
        self._ids = itertools.count()
        self._in_flight: InFlight | None = None
        self.pool_tokens = num_blocks * self.config.block_size
        self.sequence_limit = min(self.max_context, self.pool_tokens)  # most tokens one sequence holds
        self.kv_dtype = dtype
        # Tests may put a proposer of their own in its place.
        self.proposer = _make_proposer(self.config.speculative, draft_model, num_blocks, bs,
                                       self.config.kv_cache_dtype)
        idle_release = self.config.kv_idle_release
        log.info(describe_pool(self.kv.pool, bs, self.kv_block_bytes, dtype_name(dtype), idle_release))
        if window is not None:
            log.info(
                "Sliding-window layers (window %d): a pool of their own, %d blocks (%s), holding only the "
                "blocks each sequence's window reaches",
                window, window_blocks, planner.human_bytes(window_blocks * self.window_block_bytes),
            )
        if state_slots:
            log.info(
                "Recurrent state: %d slot%s (one per running sequence) of %s; %s",
                state_slots,
                "" if state_slots == 1 else "s",
                planner.human_bytes(per_sequence),
                f"prefix caching up to block boundaries where a state was saved (the last one each sequence "
                f"reached; {checkpoints} kept, {planner.human_bytes(checkpoints * per_sequence)})"
                if checkpoints
                else "prefix caching off",
            )

    # ---- requests in -------------------------------------------------------------------------
    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise the typed error ``add_request`` would raise; touches no engine state (thread-safe)."""
        if not prompt_ids:
            raise InvalidRequest("the prompt is empty")
        params.validate(self.tokenizer.vocab_size)
        if params.constraint is not None:
            compile_constraint(params.constraint, self.tokenizer)  # an uncompilable one fails here
        # Only the prompt must fit, with room for one token: max_tokens is a cap, and an answer that
        # reaches the end of the context (or of the KV pool) finishes there with "length".
        if len(prompt_ids) >= self.max_context:
            raise ContextTooLong(
                f"the prompt has {len(prompt_ids)} tokens but the context holds {self.max_context}"
            )
        if len(prompt_ids) >= self.pool_tokens:
            raise ContextTooLong(
                f"the prompt has {len(prompt_ids)} tokens but the KV pool holds {self.pool_tokens}"
            )

    def add_request(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> str:
        self.check_request(prompt_ids, params)
        request_id = request_id or self.new_request_id()
        if request_id in self.requests:
            raise InvalidRequest(f"duplicate request id {request_id!r}")
        # Build everything before registering anything: a failure here leaves no trace in the engine.
        stop = StopMatcher(params.stop, params.include_stop_str_in_output)
        request = Request(request_id, list(prompt_ids), params, stop)
        if params.constraint is not None:
            request.constraint = ConstraintState(compile_constraint(params.constraint, self.tokenizer))
        # A constrained request does not speculate: its matcher must see (and mask) every token in turn.
        if self.proposer is not None and params.speculative and params.constraint is None:
            request.spec = SpecState(self.config.speculative.num_draft_tokens)
        detokenizer = self.tokenizer.detokenizer()
        self.requests[request_id] = request
        self._detokenizers[request_id] = detokenizer
        self.scheduler.add(request)
        return request_id

    def abort(self, request_id: str) -> None:
        """Stop a request at any point; its blocks return to the pool at once."""
        request = self.requests.pop(request_id, None)
        if request is not None and request.status is not Status.FINISHED:
            self.scheduler.finish(request, "abort")
        self._forget(request_id)

    # ---- KV memory ---------------------------------------------------------------------------
    def kv_memory(self) -> PoolMemory:
        memory = PoolMemory.of(self.kv.pool, self.kv_block_bytes)
        if self.kv.window is None:
            return memory
        return memory + PoolMemory.of(self.kv.window.pool, self.window_block_bytes)

    def kv_idle_timeout(self) -> float | None:
        """Seconds idle after which ``release_idle_kv`` would give memory back; None: nothing to give."""
        idle = self.config.kv_idle_release
        holding = any(
            p.num_reserved_chunks > p.min_chunks or p.allocated_since_release for p in self.kv.pools()
        )
        return idle if holding and math.isfinite(idle) else None

    def release_idle_kv(self) -> int:
        """While no request is unfinished: give back the memory of every KV block (the chunks above the
        first are unreserved; the prefix cache is forgotten) and MLX's cached buffers, so an idle server
        holds what it held at start; returns the pool bytes given back."""
        if self.has_unfinished():
            return 0
        reserved = self.kv_memory().reserved
        dropped = self.runner.release_idle_memory()
        if self.proposer is not None:
            dropped += self.proposer.release_idle_memory()  # a draft model's pool
        mx.clear_cache()
        log.info(
            "idle: KV pool reserved %.1f -> %.1f MiB", reserved / 2**20, self.kv_memory().reserved / 2**20
        )
        return dropped

    def has_unfinished(self) -> bool:
        if self.scheduler.has_unfinished():
            return True
        # A step in flight still owes tokens to the requests that have not stopped since it launched.
        return self._in_flight is not None and any(
            r.status is not Status.FINISHED for r in self._in_flight.sampled
        )

    # ---- one step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule and launch a step, then read the previous step's samples while this one computes.

        Sampled tokens enter ``token_ids`` as PENDING_TOKEN and the next step takes their values from
        the lazy samples on device, so the host never waits between steps (mlx-lm's ``async_eval``
        overlap, across a whole batch). Outputs therefore trail by one step; a request that stopped
        has one extra token computed and dropped. Penalties count a pending token from the lazy
        samples too.

        Failures stay as small as they can: a request whose own bookkeeping or detokenizing raises
        finishes alone with finish_reason "error" (and ``error`` set); a step that fails as a whole
        (an MLX error) fails the requests it held and the engine goes on (see ``_recover``). Only an
        engine whose state no longer adds up raises (EngineFailure).
        """
        previous, self._in_flight = self._in_flight, None
        progress = _StepProgress()
        outputs: list[RequestOutput] = []
        try:
            self._launch(previous, progress, outputs)
        except Exception as e:  # noqa: BLE001 - fail this step's requests, keep the engine
            held = list(previous.sampled) if previous is not None else []
            if progress.batch is not None:
                held += [s.request for s in progress.batch]
            elif progress.scheduling:  # scheduling itself failed: the running requests were being scheduled
                held += self.scheduler.running
            # Requests the scheduler failed alone before it raised are reported too.
            outputs += [self._fail(r, err, finish=False) for r, err in self.scheduler.failed]
            self.scheduler.failed = []
            outputs += self._recover(e, list({id(r): r for r in held}.values()))
        return outputs

    def _launch(self, previous: InFlight | None, progress: _StepProgress, outputs: list) -> None:
        self.runner.wait_for_prefill()
        if previous is not None and self._must_read_first(previous):
            outputs += self._read(previous)
            previous = None
        progress.scheduling = True
        self._propose()
        batch = progress.batch = self.scheduler.schedule()
        outputs += [self._fail(r, e, finish=False) for r, e in self.scheduler.failed]
        self.scheduler.failed = []

        def masks(requests: list[Request], width: int) -> mx.array | None:
            # Called once this step's forward pass runs: the previous samples advance the matchers first.
            nonlocal previous
            if previous is not None:
                outputs.extend(self._read(previous))
                previous = None
            return self._constraint_masks(requests, width, outputs)

        hook = masks if any(s.request.constraint is not None for s in batch) else None
        result, rows = self.runner.execute(batch, previous, hook) if batch else (None, [])
        if previous is not None:
            outputs += self._read(previous)
        if batch:
            self.stats.steps += 1
        sampled, sampling_rows = [], set(rows)
        for i, s in enumerate(batch):
            request = s.request
            if request.num_computed < request.num_prompt_tokens:
                self.stats.prompt_tokens += min(s.num_new, request.num_prompt_tokens - request.num_computed)
            request.num_computed += s.num_new
            if i in sampling_rows:
                sampled.append(request)
                if request.status is not Status.FINISHED:
                    request.token_ids.append(PENDING_TOKEN)
        if result is not None:
            self._in_flight = InFlight(sampled, result, [list(r.proposal) for r in sampled])
        for request in self.scheduler.running:
            request.proposal.clear()  # verified (the InFlight holds it) or not scheduled: gone either way

    def _must_read_first(self, previous: InFlight) -> bool:
        """Whether the previous samples are needed before this step is scheduled: a verification decides
        how many tokens a sequence keeps, and a proposal is looked up from the tokens so far. (Penalties
        take the previous samples where they lie: see sampling.sample's ``pending``.)"""
        if previous.verifies:
            return True
        return self._speculating() and any(
            r.spec is not None and r.spec.k > 0 and r.status is Status.RUNNING for r in previous.sampled
        )

    def _speculating(self) -> bool:
        return self.proposer is not None and len(self.scheduler.running) <= self.config.speculative.max_batch

    def _propose(self) -> None:
        """Set this step's proposal of every decoding request that speculates (see engine/speculative.py)."""
        if not self._speculating():
            return
        spec = self.config.speculative
        asking: list[Request] = []
        for r in self.scheduler.running:
            if r.spec is None or r.num_computed < r.num_prompt_tokens:
                continue
            if r.spec.k == 0:
                r.spec.tick()
            elif not r.has_pending_token:  # else its k rose after the step in flight launched
                asking.append(r)
        # No proposal past max_tokens or the sequence limit: those tokens could never be emitted.
        room = [
            min(r.params.max_tokens - r.num_output_tokens, self.sequence_limit - len(r.token_ids)) - 1
            for r in asking
        ]
        ks = [min(r.spec.k, n) for r, n in zip(asking, room)]
        asking, ks = [r for r, k in zip(asking, ks) if k > 0], [k for k in ks if k > 0]
        if not asking:
            return
        proposals = self.proposer.propose([(r.request_id, r.token_ids, k) for r, k in zip(asking, ks)])
        for r, proposal in zip(asking, proposals):
            r.proposal = proposal
            if not proposal:
                r.spec.update(0, 0, spec.num_draft_tokens, spec.cooldown_steps)

    def _constraint_masks(self, requests: list[Request], width: int, outputs: list) -> mx.array | None:
        """The sampled requests' mask rows (None: no row constrained); a request whose matcher fails
        while masking fails alone."""
        states = [r.constraint if r.status is not Status.FINISHED else None for r in requests]
        allowed, failed = batch_mask(states, width)
        for i in failed:
            error = ConstraintFailed(f"the output constraint failed: {states[i].error}")
            outputs.append(self._fail(requests[i], error))
        return allowed

    def _recover(self, error: Exception, held: list[Request]) -> list[RequestOutput]:
        """After a step failed as a whole: fail its requests, make the KV state trustworthy again, and
        check the block accounting before the next step (raising EngineFailure if it does not add up)."""
        log.error("engine step failed (%d requests fail with it)", len(held), exc_info=error)
        self.stats.failed_steps += 1
        self._in_flight = None
        outputs = [self._fail(r, error) for r in held if r.status is not Status.FINISHED]
        try:
            if not self._kv_pools_intact():
                # The pools themselves are lost: every request's K/V with them.
                log.error("KV pools lost in the failed step: reallocating; every request in flight fails")
                self._reset_kv_pools()
                outputs += [
                    self._fail(r, error)
                    for r in list(self.scheduler.running) + list(self.scheduler.waiting)
                    if r.status is not Status.FINISHED
                ]
            for r in list(self.scheduler.waiting):
                # A waiting request holds no blocks (it may have been half-way through admission).
                self.kv.free(r.request_id)
                r.num_computed = 0
            # Blocks the failed step was writing may hold garbage: none may be found as a cached prefix.
            for pool in self.kv.pools():
                pool.reset_prefix_cache()
            check_block_accounting(self)
        except Exception as e:
            raise EngineFailure(f"the engine cannot recover from a failed step: {e}") from e
        return outputs

    def _kv_pools_intact(self) -> bool:
        state = [a for layer in self.runner.cache for a in (layer.keys, layer.values)]
        if any(a is None for a in state):
            return False
        try:
            mx.eval(state)
        except Exception:  # noqa: BLE001 - an MLX error: the pools depend on the failed computation
            return False
        return True

    def _reset_kv_pools(self) -> None:
        self.runner.allocate_pools()

    def _fail(self, request: Request, error: Exception, finish: bool = True) -> RequestOutput:
        """Finish one request with finish_reason "error"; its blocks return to the pool."""
        if finish:
            self.scheduler.finish(request, "error")
        self.requests.pop(request.request_id, None)
        self._forget(request.request_id)
        self.stats.failed_requests += 1
        log.error("request %s failed: %s: %s", request.request_id, type(error).__name__, error)
        return RequestOutput(
            request_id=request.request_id,
            token_ids=[],
            text="",
            finished=True,
            finish_reason="error",
            error=error,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            num_cached_tokens=request.num_cached_prompt,
        )

    def _read(self, step: InFlight) -> list[RequestOutput]:
        """Read a step's samples on the host, put them in place of the pending tokens and emit them.

        A verifying request keeps the rows its proposal agreed with plus the next one (the target's own
        token); its rejected rows are uncounted and the blocks past them returned."""
        result = step.result
        tokens = result.tokens.tolist()
        logprobs = result.logprobs.tolist() if result.logprobs is not None else None
        top_ids = result.top_ids.tolist() if result.top_ids is not None else None
        top_lps = result.top_logprobs.tolist() if result.top_logprobs is not None else None
        spec = self.config.speculative
        outputs = []
        for request, start, proposal in zip(step.sampled, step.starts(), step.proposals):
            if request.status is Status.FINISHED:
                continue  # stopped (or aborted) after this step was launched: the token is dropped
            accepted = accepted_length(tokens[start : start + len(proposal)], proposal)
            if proposal:
                request.num_computed -= len(proposal) - accepted
                self.kv.trim(request.request_id, request.num_computed)
                request.spec.update(len(proposal), accepted, spec.num_draft_tokens, spec.cooldown_steps)
                self.stats.spec_proposed += len(proposal)
                self.stats.spec_accepted += accepted
            request.keep_rng_draws(accepted + 1)
            emitted = []
            for i in range(start, start + accepted + 1):
                token = tokens[i]
                if i == start:
                    request.token_ids[-1] = token
                else:
                    request.token_ids.append(token)
                self.stats.generated_tokens += 1
                token_logprobs = None
                if request.params.logprobs is not None and logprobs is not None:
                    k = request.params.logprobs
                    top = list(zip(top_ids[i][:k], top_lps[i][:k])) if k and top_ids is not None else []
                    token_logprobs = [TokenLogprob(token, logprobs[i], top)]
                try:
                    emitted.append(self._emit(request, token, token_logprobs))
                except Exception as e:  # noqa: BLE001 - detokenizing or stop matching: this request alone
                    emitted.append(self._fail(request, e))
                if emitted[-1].finished:
                    break  # a stop inside an accepted run: the tokens after it are dropped
            outputs.append(_merge(emitted))
        return outputs

    def _emit(self, request: Request, token: int, logprobs: list[TokenLogprob] | None) -> RequestOutput:
        params = request.params
        finish, complete = None, False
        is_stop_token = not params.ignore_eos and token in self.tokenizer.eos_token_ids
        if is_stop_token or token in params.stop_token_ids:
            # The ending token is no text, and (as OpenAI's logprobs cover the text returned) no entry.
            text, finish, logprobs = "", "stop", None
        else:
            text, hit_stop = request.stop.feed(self._detokenizers[request.request_id].add(token))
            if hit_stop:
                finish = "stop"
            elif request.constraint is not None and request.constraint.advance(token):
                finish, complete = "stop", True  # the grammar is complete: only end-of-sequence could follow
            elif (
                request.num_output_tokens >= params.max_tokens
                or len(request.token_ids) >= self.sequence_limit
            ):
                finish = "length"
        if finish is not None:
            if finish == "length" or complete:
                text += request.stop.feed(self._detokenizers[request.request_id].flush())[0]
                text += request.stop.flush()
            self._finish(request, finish)
        first = params.prompt_logprobs is not None and request.num_output_tokens == 1
        return RequestOutput(
            request_id=request.request_id,
            token_ids=[token],
            text=text,
            finished=finish is not None,
            finish_reason=finish,
            logprobs=logprobs,
            prompt_logprobs=request.read_prompt_logprobs() if first else None,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            num_cached_tokens=request.num_cached_prompt,
        )

    def _finish(self, request: Request, reason: str) -> None:
        self.scheduler.finish(request, reason)
        self.requests.pop(request.request_id, None)
        self._forget(request.request_id)
        self.stats.finished_requests += 1

    def _forget(self, request_id: str) -> None:
        """Drop what else the engine keeps for a request that left it."""
        self._detokenizers.pop(request_id, None)
        if self.proposer is not None:
            self.proposer.release(request_id)


def hybrid_state(model: nn.Module, config: EngineConfig) -> tuple[int, int]:
    """(state slots, bytes of one sequence's state) for a model whose layers keep a recurrent state
    (0, 0 otherwise): ``max_num_seqs`` slots, so a running sequence always finds one.

    Refuses speculative decoding for such a model: verification moves a sequence back past rejected
    tokens, which a recurrent state (unlike K/V) cannot undo."""
    per_sequence = planner.layout_state_bytes(model.kv_layout())
    if not per_sequence:
        return 0, 0
    if config.speculative.method is not None:
        raise UnsupportedArchitecture(
            f"speculative decoding (--speculative {config.speculative.method}) is not supported for "
            f"{getattr(model.args, 'model_type', 'this')} models: their linear-attention layers keep a "
            "recurrent state that cannot be rolled back past rejected draft tokens"
        )
    return config.scheduler.max_num_seqs, per_sequence


def _make_proposer(
    config: SpeculativeConfig, draft_model: nn.Module | None, num_blocks: int, block_size: int,
    kv_cache_dtype: str,
) -> Proposer | None:
    """The configured proposer (None: speculation off); a draft model gets a pool as large as the
    target's (in blocks: its sequences are as long), resident only where written (kv/pages.py), of the
    dtype ``--kv-cache-dtype`` gives the target: a draft equal to the target then computes what the
    target's verification does, and a float16 default does not cost the draft twice the memory."""
    if config.method == "ngram":
        return NgramProposer(config.ngram_max, config.ngram_min)
    if config.method == "draft":
        if draft_model is None:
            raise InvalidRequest("--speculative draft needs --draft-model")
        kv_dtype = kv_pool_dtype(kv_cache_dtype, activation_dtype(draft_model))
        return DraftProposer(draft_model, num_blocks, block_size, kv_dtype)
    return None


def _merge(outputs: list[RequestOutput]) -> RequestOutput:
    """One request's outputs of one step (several tokens after a verification) as one output."""
    if len(outputs) == 1:
        return outputs[0]
    last = outputs[-1]
    logprobs = [lp for o in outputs for lp in o.logprobs or []]
    return replace(
        last,
        prompt_logprobs=outputs[0].prompt_logprobs,
        token_ids=[t for o in outputs for t in o.token_ids],
        text="".join(o.text for o in outputs),
        logprobs=logprobs if any(o.logprobs is not None for o in outputs) else None,
    )


def check_block_accounting(engine: Engine) -> None:
    """Raise RuntimeError unless every block's reference count equals the block tables that hold it,
    every table belongs to a live request, and the free list holds exactly the unreferenced blocks."""
    kv = engine.kv
    live = {r.request_id for r in engine.scheduler.running} | {r.request_id for r in engine.scheduler.waiting}
    tables = [(kv.pool, kv.block_tables)]
    if kv.window is not None:
        tables.append((kv.window.pool, {s: kv.window.held(s) for s in kv.window.tables}))
    for pool, by_seq in tables:
        strays = set(by_seq) - live
        if any(by_seq[s] for s in strays):
            raise RuntimeError(f"block tables of finished requests: {sorted(strays)[:5]}")
        held = Counter(b for table in by_seq.values() for b in table)
        wrong = [b for b in range(pool.num_blocks) if pool.ref_counts[b] != held.get(b, 0)]
        if wrong:
            raise RuntimeError(f"{len(wrong)} blocks have reference counts that no block table accounts for")
        unreferenced = sum(1 for c in pool.ref_counts if c == 0)
        if pool.num_free != unreferenced:
            raise RuntimeError(f"{pool.num_free} free blocks but {unreferenced} unreferenced")
    if kv.state_slots is not None and set(kv.state_slots.owners()) - live:
        raise RuntimeError("recurrent-state slots held by finished requests")
