"""Sampling parameters and a sampler vectorised over the batch.

One call turns the ``[B, V]`` logits of a step into ``B`` tokens (and log-probabilities when
asked) without leaving the device; the host only decides, per step, which transforms any
request needs, so a greedy-only batch pays for one ``argmax``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from mlx_infer import cpu_kernels
from mlx_infer.constraints.spec import ConstraintSpec
from mlx_infer.errors import InvalidRequest

SEED_MODULUS = 2**64  # mx.random.key takes an unsigned 64-bit seed


def rng_key(seed: int) -> mx.array:
    """The PRNG key of a seed: any integer (OpenAI seeds are signed 64-bit), reduced mod 2**64 so
    negative and large seeds reach MLX's unsigned range; a seed and its 64-bit two's complement agree."""
    return mx.random.key(seed % SEED_MODULUS)


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 disables
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # over prompt and output (as in HF and vLLM)
    presence_penalty: float = 0.0  # over output only (as in OpenAI)
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False  # vLLM's: the stop string reached ends the text
    # vLLM's: end-of-sequence and stop_token_ids cannot be drawn before this many tokens were generated.
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k >= 0: the chosen token's plus the top k
    # None: none; k >= 0: each prompt token's log-probability given the tokens before it, plus the top k
    # there (vLLM's prompt_logprobs; OpenAI's completions echo with logprobs). Such a prompt is computed
    # whole: a prefix found in the cache would skip the positions whose logits are wanted.
    prompt_logprobs: int | None = None
    constraint: ConstraintSpec | None = None  # structured output: what the text must match
    speculative: bool = True  # False: never speculate for this request (when the engine does)

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise InvalidRequest for the first bad field (token ids only once the vocabulary is known)."""
        checks = [
            (self.max_tokens >= 1, "max_tokens must be at least 1"),
            (0.0 <= self.temperature <= 100.0, "temperature must be in [0, 100]"),
            (self.top_k >= 0, "top_k must be >= 0"),
            (0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]"),
            (0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]"),
            (self.repetition_penalty > 0.0, "repetition_penalty must be > 0"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty must be in [-2, 2]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty must be in [-2, 2]"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs must be in [0, 20]"),
            (
                self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
                "prompt_logprobs must be in [0, 20]",
            ),
            (
                vocab_size is None or all(0 <= t < vocab_size for t in self.logit_bias),
                f"logit_bias token ids must be in [0, {vocab_size})",
            ),
            (
                vocab_size is None or all(0 <= t < vocab_size for t in self.stop_token_ids),
                f"stop_token_ids must be in [0, {vocab_size})",
            ),
            (0 <= self.min_tokens <= self.max_tokens, "min_tokens must be in [0, max_tokens]"),
        ]
        for ok, message in checks:
            if not ok:  # each message starts with the request field at fault
                raise InvalidRequest(message, param=message.split()[0])

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class SamplerRow:
    """What the sampler needs of one sequence this step."""

    params: SamplingParams
    prompt_ids: Sequence[int]  # only its set matters (repetition penalty): the engine passes it deduplicated
    output_ids: Sequence[int]
    rng_key: mx.array | None  # per-request key when seeded, advanced by the caller each step
    banned: Sequence[int] = ()  # tokens this draw may not take (the ends, before min_tokens)


@dataclass
class SampleResult:
    tokens: mx.array  # [B] int32
    logprobs: mx.array | None = None  # [B] log-probability of each chosen token
    top_ids: mx.array | None = None  # [B, K]
    top_logprobs: mx.array | None = None  # [B, K]


def _column(values: list[float]) -> mx.array:
    return mx.array(np.asarray(values, dtype=np.float32)[:, None])


def adjusts_logits(params: SamplingParams) -> bool:
    """Whether a request's penalties or logit biases change its logits (then its pending token counts)."""
    return (
        params.repetition_penalty != 1.0
        or params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
        or bool(params.logit_bias)
    )


def _apply_penalties(logits: mx.array, rows: list[SamplerRow], pending: mx.array | None) -> mx.array:
    """Repetition, frequency and presence penalties, then logit biases: natively at just the tokens they
    touch (cpu_kernels.adjust_logits), with dense [B, V] MLX ops elsewhere. ``pending`` (see sample)
    counts as one more output token of its row."""
    if not any(adjusts_logits(r.params) for r in rows):
        return logits
    if pending is None:
        pending = mx.full((len(rows),), -1, dtype=mx.int32)
    native = cpu_kernels.adjust_logits(logits, *_penalty_entries(rows, logits.shape[-1]), pending)
    return native if native is not None else _apply_penalties_dense(logits, rows, pending)


def _penalty_entries(
    rows: list[SamplerRow], vocab: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """adjust_logits' inputs: each row's distinct tokens with their output count, seen flag and bias (ids
    outside the logits dropped: no logit of theirs exists), and the rows' penalties."""
    starts, ids, entries = [0], [], []
    for r in rows:
        row_ids, row = _row_entries(r, vocab)
        starts.append(starts[-1] + len(row_ids))
        ids.append(row_ids)
        entries.append(row)
    params = [(r.params.repetition_penalty, r.params.frequency_penalty, r.params.presence_penalty)
              for r in rows]
    return (
        np.asarray(starts, dtype=np.int32),
        np.concatenate(ids).astype(np.int32),
        np.concatenate(entries),
        np.asarray(params, dtype=np.float32),
    )


def _row_entries(r: SamplerRow, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """One row's distinct ids and their [count, seen, bias] entries: first the tokens of the output and
    the biases (few, sorted here), then the prompt's other tokens (seen only, when repetition is
    penalised), found by a search in the few rather than by sorting the prompt again every step."""
    p = r.params
    none = np.zeros(0, dtype=np.int64)
    output = np.asarray(r.output_ids, dtype=np.int64)
    penalises_repeats = p.repetition_penalty != 1.0
    distinct, occurrences = np.unique(output, return_counts=True)
    counts_output = p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
    counted, counts = (distinct, occurrences) if counts_output else (none, none)
    seen = distinct if penalises_repeats else none
    biased = np.fromiter(p.logit_bias, dtype=np.int64, count=len(p.logit_bias))
    biases = np.fromiter(p.logit_bias.values(), dtype=np.float32, count=len(p.logit_bias))
    listed = np.unique(np.concatenate([seen, counted, biased]))
    listed = listed[(listed >= 0) & (listed < vocab)]
    row = np.zeros((len(listed), 3), dtype=np.float32)
    flags = np.ones(len(seen), dtype=np.float32)
    for column, tokens, values in ((0, counted, counts), (1, seen, flags), (2, biased, biases)):
        inside = (tokens >= 0) & (tokens < vocab)
        row[np.searchsorted(listed, tokens[inside]), column] = values[inside]
    if not penalises_repeats:
        return listed, row
    prompt = np.asarray(r.prompt_ids, dtype=np.int64)
    if not (np.diff(prompt) > 0).all():  # the engine passes it sorted and distinct (prompt_token_set)
        prompt = np.unique(prompt)
    prompt = prompt[(prompt >= 0) & (prompt < vocab)]
    at = np.minimum(np.searchsorted(listed, prompt), max(len(listed) - 1, 0))
    already = listed[at] == prompt if len(listed) else np.zeros(len(prompt), dtype=bool)
    row[at[already], 1] = 1.0
    rest = prompt[~already]
    rest_row = np.zeros((len(rest), 3), dtype=np.float32)
    rest_row[:, 1] = 1.0
    return np.concatenate([listed, rest]), np.concatenate([row, rest_row])


def _apply_penalties_dense(logits: mx.array, rows: list[SamplerRow], pending: mx.array) -> mx.array:
    """_apply_penalties with [B, V] MLX ops over every logit (where the native kernels do not run)."""
    batch, vocab = logits.shape
    is_pending = mx.arange(vocab)[None, :] == pending[:, None]  # -1 matches no token
    rep = [r.params.repetition_penalty for r in rows]
    if any(p != 1.0 for p in rep):
        seen = np.zeros((batch, vocab), dtype=bool)
        for i, r in enumerate(rows):
            seen[i, np.asarray(r.prompt_ids, dtype=np.int64)] = True
            seen[i, np.asarray(r.output_ids, dtype=np.int64)] = True
        penalty = _column(rep)
        penalised = mx.where(logits > 0, logits / penalty, logits * penalty)
        logits = mx.where(mx.array(seen) | is_pending, penalised, logits)
    presence = [r.params.presence_penalty for r in rows]
    frequency = [r.params.frequency_penalty for r in rows]
    if any(presence) or any(frequency):
        counts = np.zeros((batch, vocab), dtype=np.float32)
        for i, r in enumerate(rows):
            np.add.at(counts[i], np.asarray(r.output_ids, dtype=np.int64), 1.0)
        counts_mx = mx.array(counts) + is_pending
        logits = logits - _column(frequency) * counts_mx - _column(presence) * (counts_mx > 0)
    if any(r.params.logit_bias for r in rows):
        bias = np.zeros((batch, vocab), dtype=np.float32)
        for i, r in enumerate(rows):
            for token, value in r.params.logit_bias.items():
                bias[i, token] = value
        logits = logits + mx.array(bias)
    return logits


def _truncate(logits: mx.array, rows: list[SamplerRow]) -> mx.array:
    """Top-k, then top-p, then min-p; masked entries become -inf."""
    top_k = [r.params.top_k for r in rows]
    top_p = [r.params.top_p for r in rows]
    min_p = [r.params.min_p for r in rows]
    cuts_top = any(top_k) or any(p < 1.0 for p in top_p)
    if not cuts_top and not any(min_p):
        return logits
    native = cpu_kernels.truncate_top(logits, top_k, top_p, min_p)
    if native is not None:
        return native
    if cuts_top:
        logits = _truncate_top(logits, top_k, top_p)
    if any(min_p):
        probs = mx.softmax(logits, axis=-1)
        threshold = _column(min_p) * probs.max(axis=-1, keepdims=True)
        logits = mx.where(probs >= threshold, logits, -mx.inf)
    return logits


def _truncate_top(logits: mx.array, top_k: list[int], top_p: list[float]) -> mx.array:
    """Top-k then top-p with MLX ops (cpu_kernels.truncate_top where the native kernels run): a full sort."""
    vocab = logits.shape[-1]
    order = mx.argsort(-logits, axis=-1)
    sorted_logits = mx.take_along_axis(logits, order, axis=-1)
    keep = mx.ones(sorted_logits.shape, dtype=mx.bool_)
    if any(top_k):
        k = np.asarray([t if t > 0 else vocab for t in top_k], dtype=np.int32)[:, None]
        keep = keep & (mx.arange(vocab)[None, :] < mx.array(k))
    if any(p < 1.0 for p in top_p):
        probs = mx.softmax(mx.where(keep, sorted_logits, -mx.inf), axis=-1)
        # Keep a token when the mass before it is below top_p: the first token always stays.
        mass_before = mx.cumsum(probs, axis=-1) - probs
        keep = keep & (mass_before < _column(top_p))
    inverse = mx.argsort(order, axis=-1)
    return mx.where(mx.take_along_axis(keep, inverse, axis=-1), logits, -mx.inf)


def _draw(logits: mx.array, rows: list[SamplerRow]) -> mx.array:
    """Categorical draws at each row's temperature (greedy rows take the argmax): natively from one uniform a
    row on the CPU (cpu_kernels.draw), by Gumbel-max with MLX ops elsewhere."""
    temps = [r.params.temperature for r in rows]
    if all(t == 0.0 for t in temps):
        return cpu_kernels.argmax(logits)
    drawn = cpu_kernels.draw(logits, temps, _uniforms(rows))
    if drawn is not None:
        return drawn
    greedy = cpu_kernels.argmax(logits)
    scaled = logits / _column([t if t > 0 else 1.0 for t in temps])
    if any(r.rng_key is not None for r in rows):
        # Seeded rows draw from their own key, so a request's output does not depend on its batch.
        shared = mx.random.gumbel(scaled.shape)
        noise = mx.stack(
            [
                mx.random.gumbel((scaled.shape[-1],), key=r.rng_key) if r.rng_key is not None else shared[i]
                for i, r in enumerate(rows)
            ]
        )
    else:
        noise = mx.random.gumbel(scaled.shape)
    sampled = cpu_kernels.argmax(scaled + noise)
    return mx.where(mx.array([t == 0.0 for t in temps]), greedy, sampled)


def _uniforms(rows: list[SamplerRow]) -> mx.array:
    """One uniform in [0, 1) a row: a seeded row's from its own key, so that its draw does not depend on
    its batch."""
    shared = mx.random.uniform(shape=(len(rows),))
    if all(r.rng_key is None for r in rows):
        return shared
    own = [mx.random.uniform(shape=(), key=r.rng_key) if r.rng_key is not None else None for r in rows]
    return mx.stack([u if u is not None else shared[i] for i, u in enumerate(own)])


def sample(
    logits: mx.array, rows: list[SamplerRow], allowed: mx.array | None = None, pending: mx.array | None = None
) -> SampleResult:
    """Sample one token per row of ``logits`` ([B, V]); lazy, nothing is evaluated here.

    ``allowed``: a [B, V] boolean mask of the tokens each row may take (structured output); rows that
    allow every token sample exactly as without it. ``pending``: [B] int32, a token each row's output
    holds beyond its ``output_ids`` (-1: none), the previous step's lazy sample, so that penalties need
    not wait for the host to read it."""
    logits = logits.astype(mx.float32)
    processed = _apply_penalties(logits, rows, pending)
    if allowed is not None:
        processed = mx.where(allowed, processed, -mx.inf)
    banned = [(i, t) for i, r in enumerate(rows) for t in r.banned if 0 <= t < logits.shape[-1]]
    if banned:
        at_rows, at_ids = zip(*banned)
        processed[mx.array(at_rows), mx.array(at_ids)] = -mx.inf
    processed = _truncate(processed, rows)
    tokens = _draw(processed, rows).astype(mx.int32)
    result = SampleResult(tokens=tokens)
    want = [r.params.logprobs for r in rows if r.params.logprobs is not None]
    if want:
        result.logprobs, result.top_ids, result.top_logprobs = token_logprobs(logits, tokens, max(want))
    return result


def token_logprobs(
    logits: mx.array, tokens: mx.array, k: int
) -> tuple[mx.array, mx.array | None, mx.array | None]:
    """Log-probabilities of the model's distribution (before penalties and truncation), as vLLM reports:
    the chosen tokens' and, for ``k`` > 0, the top ``k`` ids and log-probabilities, descending."""
    native = cpu_kernels.logprobs(logits, tokens, k)
    if native is not None:
        chosen, top_ids, top_lp = native
        return (chosen, top_ids, top_lp) if k > 0 else (chosen, None, None)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    if k == 0:
        return chosen, None, None
    top_ids = mx.argpartition(-logprobs, k - 1, axis=-1)[:, :k]
    top_lp = mx.take_along_axis(logprobs, top_ids, axis=-1)
    order = mx.argsort(-top_lp, axis=-1)
    top_ids = mx.take_along_axis(top_ids, order, axis=-1).astype(mx.int32)
    return chosen, top_ids, mx.take_along_axis(top_lp, order, axis=-1)
