"""The model runner: one forward pass over every scheduled sequence, then sampling, all lazy."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlx_infer.engine.request import Request, ScoredPositions
from mlx_infer.engine.scheduler import ScheduledRequest
from mlx_infer.interface.batch import SequenceSlice, build_metadata
from mlx_infer.interface.state import LayerState
from mlx_infer.kv.manager import KVCacheManager
from mlx_infer.kv.pages import allocate_pools, drop_blocks
from mlx_infer.plan import planner
from mlx_infer.sampling import SampleResult, SamplerRow, adjusts_logits, sample, token_logprobs

log = logging.getLogger("mlx_infer")


def activation_dtype(model: nn.Module) -> mx.Dtype:
    """The dtype the model computes in: what its embedding yields."""
    return model.embed(mx.array([0])).dtype


def kv_pool_dtype(choice: str, compute: mx.Dtype) -> mx.Dtype:
    """The KV pools' dtype for ``--kv-cache-dtype`` ``choice`` and the model's compute dtype, by the
    planner's rule (``auto``: float16 on the CPU backend, the compute dtype on Metal)."""
    return getattr(mx, planner.resolve_kv_dtype(choice, planner.backend_name(), dtype_name(compute)))


def dtype_name(dtype: mx.Dtype) -> str:
    """``mx.float16`` -> ``"float16"``."""
    return str(dtype).rsplit(".", 1)[-1]


def kv_bytes_per_token(model: nn.Module, dtype: mx.Dtype) -> int:
    """K and V bytes of one token over every pool-owning layer in pools of ``dtype`` (int8 rows carry a
    scale)."""
    return planner.layout_bytes_per_token(model.kv_layout(), dtype_name(dtype))


@dataclass
class InFlight:
    """A step whose samples the host has not read yet."""

    sampled: list[Request]
    result: SampleResult
    # What each sampled request proposed: its rows of ``result`` are 1 + len(proposal), in order.
    proposals: list[list[int]]

    def starts(self) -> list[int]:
        """The first row of ``result`` of each sampled request."""
        return list(itertools.accumulate((1 + len(p) for p in self.proposals[:-1]), initial=0))

    @property
    def verifies(self) -> bool:
        return any(self.proposals)

    def rows_by_request(self) -> dict[str, int]:
        """The row of each request's last sample (the token a pending slot stands for)."""
        return {
            r.request_id: start + len(p) for r, start, p in zip(self.sampled, self.starts(), self.proposals)
        }


class ModelRunner:
    def __init__(
        self, model: nn.Module, kv: KVCacheManager, kv_dtype: mx.Dtype, eos_token_ids: Iterable[int] = ()
    ):
        """``model`` as the loader prepared it for this backend (``loading.policy.prepare_for_backend``);
        ``eos_token_ids``: the tokens a request's ``min_tokens`` holds off, with its stop_token_ids."""
        self.model = model
        self.eos_token_ids = tuple(eos_token_ids)
        self.kv = kv
        self.kv_dtype = kv_dtype
        self._prefill_launched: list[mx.array] = []  # a step of partial prefills, until waited for
        self.allocate_pools()

    def allocate_pools(self) -> None:
        """(Re)allocate every layer's pools at the full budget, resident only once written (see
        kv/pages.py). Called on the constructing thread: the pools are touched by every step,
        whichever thread runs it."""
        kv = self.kv
        kv.forget_states()  # saved recurrent states may come from the graph of a failed step
        slots = max(1, kv.num_state_slots)
        window_blocks = None if kv.window is None else kv.window.pool.num_blocks
        self.cache = allocate_pools(
            self.model, kv.pool.num_blocks, kv.block_size, self.kv_dtype, slots, window_blocks
        )

    def wait_for_prefill(self) -> None:
        """Wait for the last step if it was one of partial prefills only (a chunk's ~0.1-1 s of compute
        against a few ms of host work for the next: nothing worth overlapping is lost)."""
        launched, self._prefill_launched = self._prefill_launched, []
        if launched:
            mx.eval(launched)

    def release_idle_memory(self) -> int:
        """Unreserve each pool's unreferenced top chunks, forget the free blocks of the others, and give
        back the memory of both; returns the bytes."""
        self.kv.forget_states()  # what prefix caching saved of hybrid models' states goes with the blocks
        dropped = 0
        for pool, windowed in zip(self.kv.pools(), (False, True)):
            released = pool.release_idle_chunks() + pool.forget_free_blocks()
            dropped += drop_blocks(self.cache, released, windowed) if released else 0
        return dropped

    def execute(
        self,
        batch: list[ScheduledRequest],
        pending: InFlight | None = None,
        masks: Callable[[list[Request], int], mx.array | None] | None = None,
    ) -> tuple[SampleResult | None, list[int]]:
        """Run one step; returns the lazy sample result and the batch rows it covers (sampling ones).

        A request whose last token is still pending takes it from ``pending``'s lazy samples, so this
        step's graph is built while the previous one computes. ``masks(requests, vocab)``, when given,
        returns the sampled requests' allowed-token masks (structured output): it is called once the
        forward pass is running, so the host fills them while the model computes.
        """
        slices, tokens, pending_at, pending_rows, scoring = [], [], [], [], []
        rows_of = pending.rows_by_request() if pending is not None else {}
        for s in batch:
            r = s.request
            # A proposal is verified as extra query rows after the sequence's own tokens, each row's
            # logits sampled (see engine/speculative.py); its requests have no pending token. A prompt
            # whose log-probabilities are wanted needs every row's logits too.
            scoring.append(r.scores_prompt)
            all_rows = (s.samples and bool(r.proposal)) or scoring[-1]
            table, slot = self.kv.block_tables[r.request_id], self.kv.state_slot(r.request_id)
            window_table = self.kv.window_table(r.request_id)
            slices.append(SequenceSlice(table, r.num_computed, s.num_new, all_rows, slot, window_table))
            tokens.extend((r.token_ids + r.proposal)[r.num_computed : r.num_computed + s.num_new])
            if r.has_pending_token:
                pending_at.append(len(tokens) - 1)
                pending_rows.append(rows_of[r.request_id])
        meta = build_metadata(slices, self.kv.block_size)
        inputs = _inputs(tokens, pending_at, pending_rows, pending)
        self._load_checkpoints(batch)
        logits = self.model(inputs, self.cache, meta)
        # Each sequence's first logit row: it has one, or one per new token (build_metadata's rows).
        widths = [s.num_new if piece.want_all_logits else 1 for s, piece in zip(batch, slices)]
        starts = list(itertools.accumulate(widths, initial=0))
        saved = self._save_checkpoints(batch) + self._score_prompts(batch, scoring, starts, logits)
        rows = [i for i, s in enumerate(batch) if s.samples]
        if not rows:
            # A step of partial prefills only: the K/V writes are all it produces. The next step waits
            # for them first (wait_for_prefill): with no sample to read, every chunk of a long prompt
            # would otherwise be queued at once, and an abort, or a request arriving meanwhile, would
            # wait behind all of them.
            self._prefill_launched = [c for layer in self.cache for c in layer.state()] + saved
            mx.async_eval(self._prefill_launched)
            return None, rows
        # Keep the sampled logit rows: a verifying sequence's 1 + len(proposal), another's last.
        logit_rows, owner = [], []  # owner: the index in ``rows`` each kept logit row belongs to
        for i in rows:
            kept = 1 + len(batch[i].request.proposal)
            owner.extend([owner[-1] + 1 if owner else 0] * kept)
            logit_rows.extend(range(starts[i + 1] - kept, starts[i + 1]))
        if len(logit_rows) < starts[-1]:
            logits = logits[mx.array(logit_rows)]
        allowed = None
        if masks is not None:
            mx.async_eval(logits)
            allowed = masks([batch[i].request for i in rows], logits.shape[-1])
            if allowed is not None and len(owner) > len(rows):
                allowed = allowed[mx.array(owner)]
        sampler_rows, pending_of_row = [], []
        for i in rows:
            r = batch[i].request
            output_ids = r.output_ids[: r.num_known_tokens - r.num_prompt_tokens]
            keys = r.next_rng_keys(1 + len(r.proposal))
            # Only a repetition penalty looks at the prompt, and only at its set of tokens.
            prompt = r.prompt_token_set if r.params.repetition_penalty != 1.0 else r.prompt_ids
            for j, key in enumerate(keys):
                # Row j is emitted only if proposal[:j] is: its penalties see exactly those tokens, and
                # it is the request's output token number num_output_tokens + j (a pending one counted).
                early = r.num_output_tokens + j < r.params.min_tokens
                banned = (*self.eos_token_ids, *r.params.stop_token_ids) if early else ()
                sampler_rows.append(SamplerRow(r.params, prompt, output_ids + r.proposal[:j], key, banned))
                # A request with a proposal has no pending token (its previous samples were read).
                pending_of_row.append(rows_of[r.request_id] if r.has_pending_token else -1)
        # Only penalties and biases look at the pending tokens: no gather for the steps without them.
        counted = any(adjusts_logits(row.params) for row in sampler_rows)
        in_flight = _pending_tokens(pending, pending_of_row) if counted else None
        result = sample(logits, sampler_rows, allowed, in_flight)
        mx.async_eval(
            [
                a
                for a in (result.tokens, result.logprobs, result.top_ids, result.top_logprobs)
                if a is not None
            ]
            + saved  # computed now, so they hold no reference to the state arrays the next step writes
        )
        return result, rows

    def _score_prompts(
        self, batch: list[ScheduledRequest], scoring: list[bool], starts: list[int], logits: mx.array
    ) -> list[mx.array]:
        """Log-probabilities of the prompt tokens this step predicts, for the requests that want them
        (``scoring``; ``starts``: each sequence's first logit row): kept lazily on each request
        (``Request.scored``) and returned, to be evaluated with the step."""
        if not any(scoring):
            return []
        rows, targets, owners = [], [], []
        for s, scores, at in zip(batch, scoring, starts):
            if scores:
                r = s.request
                # Row j predicts token num_computed + j + 1; the last prompt row predicts the first
                # output token, which is sampled, not scored.
                count = min(s.num_new, r.num_prompt_tokens - 1 - r.num_computed)
                owners.append((r, r.num_computed, count, len(rows)))
                rows.extend(range(at, at + count))
                targets.extend(r.prompt_ids[r.num_computed + 1 : r.num_computed + 1 + count])
        k = max(r.params.prompt_logprobs for r, *_ in owners)
        scored = logits[mx.array(rows)].astype(mx.float32)
        chosen, top_ids, top_lps = token_logprobs(scored, mx.array(targets, dtype=mx.int32), k)
        for r, first, count, offset in owners:
            r.scored.append(ScoredPositions(first, count, offset, chosen, top_ids, top_lps))
        return [a for a in (chosen, top_ids, top_lps) if a is not None]

    def _states(self) -> list[LayerState]:
        return [layer for layer in self.cache if isinstance(layer, LayerState)]

    def _load_checkpoints(self, batch: list[ScheduledRequest]) -> None:
        """Hybrid models: a sequence that starts from a cached prefix gets the recurrent state saved where
        that prefix ends, in its slot, before the step reads it."""
        for s in batch:
            rows = self.kv.restores.pop(s.request.request_id, None)
            if rows is None:
                continue
            slot = mx.array([self.kv.state_slot(s.request.request_id)], dtype=mx.int32)
            for i, layer in enumerate(self._states()):
                n = len(layer.arrays)
                for j, saved in enumerate(rows[i * n : (i + 1) * n]):
                    layer.put(j, slot, saved)

    def _save_checkpoints(self, batch: list[ScheduledRequest]) -> list[mx.array]:
        """Hybrid models with prefix caching: the state of each sequence whose computed tokens end on a
        block boundary after this step, for later prompts with the same prefix (kv/state_slots.py)."""
        kv = self.kv
        if kv.checkpoints is None:
            return []
        saved = []
        for s in batch:
            r = s.request
            end = r.num_computed + s.num_new
            if end % kv.block_size == 0:
                rows = [a for layer in self._states() for a in layer.save(kv.state_slot(r.request_id))]
                kv.save_state(r.request_id, end, rows)
                saved += rows
        return saved


def _inputs(
    tokens: list[int], pending_at: list[int], pending_rows: list[int], pending: InFlight | None
) -> mx.array:
    """The step's input tokens, those still pending (at ``pending_at``) taken from the previous step's lazy
    samples (rows ``pending_rows``). A pure decode step's inputs are all pending: then they are the samples
    themselves, or a gather of them, rather than a scatter into a host array (six graph ops)."""
    if len(pending_at) == len(tokens):
        samples = pending.result.tokens
        if pending_rows == list(range(samples.shape[0])):
            return samples
        return samples[mx.array(pending_rows, dtype=mx.int32)]
    inputs = mx.array(np.asarray(tokens, dtype=np.int32))
    if pending_at:
        inputs[mx.array(pending_at)] = pending.result.tokens[mx.array(pending_rows)]
    return inputs


def _pending_tokens(pending: InFlight | None, rows: list[int]) -> mx.array | None:
    """Each sampler row's token still on its way from the previous step (its row there, -1: none), lazy:
    the penalties count it without the host reading it first."""
    if pending is None or all(row < 0 for row in rows):
        return None
    at = mx.array(rows, dtype=mx.int32)
    return mx.where(at >= 0, pending.result.tokens[mx.maximum(at, 0)], -1).astype(mx.int32)
