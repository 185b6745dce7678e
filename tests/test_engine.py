"""Engine, scheduler, block pool and sampler on a tiny random Llama (CPU, no real weights)."""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np
import pytest
from engine_helpers import CharTokenizer, full_forward_logits, greedy_reference, tiny_llama

from mlx_infer import cpu_kernels, sampling
from mlx_infer.engine.engine import Engine, EngineConfig, check_block_accounting
from mlx_infer.engine.scheduler import SchedulerConfig
from mlx_infer.errors import ContextTooLong, EngineFailure, InvalidRequest
from mlx_infer.kv.block_pool import BlockPool
from mlx_infer.kv.manager import KVCacheManager
from mlx_infer.sampling import SamplerRow, SamplingParams, sample

PROMPTS = [list(range(5, 23)), [3, 4, 5], list(range(1, 40)), [9] * 20]


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


@pytest.fixture(scope="module")
def references(model):
    return [greedy_reference(model, p, 12) for p in PROMPTS]


def make_engine(
    model, num_blocks=64, block_size=4, budget=512, max_seqs=32, prefix=True, kv_cache_dtype="auto"
) -> Engine:
    config = EngineConfig(
        block_size=block_size,
        num_blocks=num_blocks,
        enable_prefix_caching=prefix,
        kv_cache_dtype=kv_cache_dtype,
        scheduler=SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget),
    )
    return Engine(model, CharTokenizer(), 256, config)


def run_all(engine: Engine, prompts, params_list) -> dict[str, list]:
    ids = [engine.add_request(p, params) for p, params in zip(prompts, params_list)]
    outputs = {i: [] for i in ids}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id].append(out)
    return [outputs[i] for i in ids]


def tokens_of(outputs) -> list[int]:
    return [t for o in outputs for t in o.token_ids]


@pytest.mark.parametrize(
    "num_blocks,budget,max_seqs",
    [(64, 512, 32), (14, 8, 32), (16, 5, 32), (64, 512, 1), (13, 3, 2)],
    ids=["roomy", "preempting", "tiny-budget", "one-at-a-time", "preempt-and-cap"],
)
def test_batched_greedy_equals_uncached_reference(model, references, num_blocks, budget, max_seqs):
    engine = make_engine(model, num_blocks=num_blocks, budget=budget, max_seqs=max_seqs)
    params = [SamplingParams(max_tokens=12) for _ in PROMPTS]
    results = run_all(engine, PROMPTS, params)
    assert [tokens_of(r) for r in results] == references
    assert engine.kv.pool.num_used == 0  # every block returned
    assert all(r[-1].finished for r in results)


def test_preemption_happens_and_recomputes(model, references):
    engine = make_engine(model, num_blocks=14, budget=8)
    run_all(engine, PROMPTS, [SamplingParams(max_tokens=12) for _ in PROMPTS])
    # A pool of 14 blocks of 4 cannot hold all four sequences: someone had to be recomputed.
    assert engine.scheduler.num_preemptions > 0


def test_prefix_cache_hits_and_counts(model):
    engine = make_engine(model, block_size=4)
    prompt = list(range(1, 30))
    first = run_all(engine, [prompt], [SamplingParams(max_tokens=3)])[0]
    second = run_all(engine, [prompt + [7, 8]], [SamplingParams(max_tokens=3)])[0]
    assert first[-1].num_cached_tokens == 0
    assert second[-1].num_cached_tokens == 28  # 7 full blocks of the shared 29-token prefix
    # The cached run gives what an uncached engine gives.
    fresh = run_all(make_engine(model, prefix=False), [prompt + [7, 8]], [SamplingParams(max_tokens=3)])[0]
    assert tokens_of(second) == tokens_of(fresh)


def test_same_step_requests_share_prompt_blocks(model):
    engine = make_engine(model, block_size=4)
    prompt = list(range(1, 22))
    results = run_all(engine, [prompt, prompt], [SamplingParams(max_tokens=4), SamplingParams(max_tokens=4)])
    assert tokens_of(results[0]) == tokens_of(results[1])
    assert results[1][-1].num_cached_tokens == 20


def test_abort_returns_blocks_at_once(model):
    engine = make_engine(model)
    rid = engine.add_request(list(range(1, 30)), SamplingParams(max_tokens=50))
    engine.step()
    engine.step()
    assert engine.kv.pool.num_used > 0
    engine.abort(rid)
    assert engine.kv.pool.num_used == 0
    assert not engine.has_unfinished()


def test_a_long_prompts_chunks_run_one_step_at_a_time(model, monkeypatch):
    """Steps of partial prefills have no sample to read, so nothing made the host wait for them: every
    chunk of a long prompt was queued at once, and an abort (Ctrl-C in the chat) or a request arriving
    meanwhile waited behind all of them. Each such step is now waited for before the next is scheduled."""
    engine = make_engine(model, budget=8)
    events = []
    execute, wait = engine.runner.execute, engine.runner.wait_for_prefill

    def spied_execute(batch, *args):
        events.append(("launch", sum(s.num_new for s in batch)))
        return execute(batch, *args)

    def spied_wait():
        if engine.runner._prefill_launched:
            events.append(("waited",))
        wait()

    monkeypatch.setattr(engine.runner, "execute", spied_execute)
    monkeypatch.setattr(engine.runner, "wait_for_prefill", spied_wait)
    rid = engine.add_request(list(range(1, 41)), SamplingParams(max_tokens=1))
    for _ in range(3):
        engine.step()
    assert events == [("launch", 8), ("waited",), ("launch", 8), ("waited",), ("launch", 8)]
    engine.abort(rid)
    assert engine.kv.pool.num_used == 0 and not engine.has_unfinished()


def test_stop_string_across_tokens_is_not_emitted(model, references):
    # CharTokenizer maps token t to chr(97 + t % 26): a stop string of tokens 3 and 4 of the reference.
    ref = references[0]
    text = "".join(chr(97 + t % 26) for t in ref)
    stop = text[3:5]
    out = run_all(make_engine(model), [PROMPTS[0]], [SamplingParams(max_tokens=12, stop=[stop])])[0]
    emitted = "".join(o.text for o in out)
    assert emitted == text[: text.find(stop)]
    assert out[-1].finish_reason == "stop"


def test_eos_and_length_finish(model):
    engine = make_engine(model)
    out = run_all(engine, [PROMPTS[1]], [SamplingParams(max_tokens=5)])[0]
    assert out[-1].finish_reason == "length" and len(tokens_of(out)) == 5
    first = tokens_of(out)[0]
    engine.tokenizer.eos_token_ids = {first}
    try:
        out = run_all(engine, [PROMPTS[1]], [SamplingParams(max_tokens=5)])[0]
        assert out[-1].finish_reason == "stop" and tokens_of(out) == [first]
        out = run_all(engine, [PROMPTS[1]], [SamplingParams(max_tokens=5, ignore_eos=True)])[0]
        assert len(tokens_of(out)) == 5
    finally:
        engine.tokenizer.eos_token_ids = {0}


def test_rejects_impossible_requests(model):
    engine = make_engine(model, num_blocks=8)
    with pytest.raises(InvalidRequest):
        engine.add_request([], SamplingParams())
    with pytest.raises(ContextTooLong, match="256"):
        engine.add_request([1] * 300, SamplingParams(max_tokens=1))
    with pytest.raises(ContextTooLong, match="KV pool holds 32"):
        engine.add_request([1] * 40, SamplingParams(max_tokens=1))
    with pytest.raises(InvalidRequest, match="top_p"):
        engine.add_request([1], SamplingParams(top_p=0.0))
    assert not engine.has_unfinished()


def test_a_context_of_no_whole_blocks_gets_the_pool_it_needs(model):
    # No --kv-memory: the pool is sized for the context, rounded up to whole blocks of 16 (a prompt that
    # fits a 40-token context was refused by a pool of 32).
    config = EngineConfig(scheduler=SchedulerConfig(max_num_seqs=1))
    engine = Engine(model, CharTokenizer(), 40, config)
    assert engine.pool_tokens == 48 and engine.sequence_limit == 40
    out = run_all(engine, [[1] * 37], [SamplingParams(max_tokens=10, ignore_eos=True)])[0]
    assert out[-1].finish_reason == "length" and len(tokens_of(out)) == 3  # the context is full at 40


def test_seeded_sampling_is_reproducible_and_batch_independent(model):
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=1234)
    alone = tokens_of(run_all(make_engine(model), [PROMPTS[0]], [params])[0])
    crowd = run_all(
        make_engine(model),
        [PROMPTS[2], PROMPTS[0], PROMPTS[1]],
        [
            SamplingParams(max_tokens=10, temperature=1.0),
            params,
            SamplingParams(max_tokens=10, temperature=0.7),
        ],
    )
    assert tokens_of(crowd[1]) == alone
    other = tokens_of(
        run_all(make_engine(model), [PROMPTS[0]], [SamplingParams(max_tokens=10, temperature=1.0, seed=99)])[
            0
        ]
    )
    assert other != alone


def test_logprobs_match_log_softmax(model):
    # The oracle's cache is float32: so is the engine's here, for logprobs equal to 1e-4.
    engine = make_engine(model, kv_cache_dtype="float32")
    out = run_all(engine, [PROMPTS[0]], [SamplingParams(max_tokens=1, logprobs=3)])[0][0]
    logits = full_forward_logits(model, PROMPTS[0]).astype(mx.float32)
    expected = np.array(logits - mx.logsumexp(logits))
    entry = out.logprobs[0]
    assert entry.token_id == int(np.argmax(expected))
    assert entry.logprob == pytest.approx(float(expected.max()), abs=1e-4)
    top_ids = [t for t, _ in entry.top]
    assert top_ids == list(np.argsort(-expected)[:3])


@pytest.mark.parametrize(
    "num_blocks,budget", [(64, 512), (64, 5), (14, 8)], ids=["one-chunk", "chunked", "preempting"]
)
def test_prompt_logprobs_match_log_softmax_of_each_prefix(model, num_blocks, budget):
    # Each prompt token's log-probability given the tokens before it, against the uncached forward of
    # each prefix; with the same prompt already in the prefix cache, in a batch, chunked, preempted.
    oracle = {}
    for prompt in (PROMPTS[0], PROMPTS[2]):
        for p in range(1, len(prompt)):
            logits = full_forward_logits(model, prompt[:p]).astype(mx.float32)
            oracle[tuple(prompt[: p + 1])] = np.array(logits - mx.logsumexp(logits))
    engine = make_engine(model, num_blocks=num_blocks, budget=budget, kv_cache_dtype="float32")
    run_all(engine, [PROMPTS[0]], [SamplingParams(max_tokens=2)])  # its blocks are now cached
    scored = SamplingParams(max_tokens=3, prompt_logprobs=2)
    outs = run_all(
        engine,
        [PROMPTS[2], PROMPTS[0], PROMPTS[3]],
        [scored, SamplingParams(max_tokens=3, prompt_logprobs=0), SamplingParams(max_tokens=4)],
    )
    for prompt, out, k in ((PROMPTS[2], outs[0], 2), (PROMPTS[0], outs[1], 0)):
        entries = out[0].prompt_logprobs
        assert len(entries) == len(prompt) and (entries[0].token_id, entries[0].logprob) == (prompt[0], None)
        assert all(o.prompt_logprobs is None for o in out[1:])
        for p in range(1, len(prompt)):
            expected = oracle[tuple(prompt[: p + 1])]
            assert entries[p].token_id == prompt[p]
            assert entries[p].logprob == pytest.approx(float(expected[prompt[p]]), abs=1e-4)
            assert [t for t, _ in entries[p].top] == list(np.argsort(-expected)[:k])
    assert outs[2][0].prompt_logprobs is None
    assert (engine.scheduler.num_preemptions > 0) == (num_blocks == 14)
    _assert_idle(engine)


@pytest.mark.parametrize("seed", [-1, -(2**63), 2**63 - 1, 2**64 + 5])
def test_any_integer_seed_is_mapped_into_mlx_key_range(model, seed):
    # mx.random.key takes only [0, 2**64): the seed is reduced mod 2**64, so -1 and 2**64 - 1 agree.
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=seed)
    same = SamplingParams(max_tokens=6, temperature=1.0, seed=seed % 2**64)
    out, again = run_all(make_engine(model), [PROMPTS[0], PROMPTS[0]], [params, same])
    assert len(tokens_of(out)) == 6 and tokens_of(out) == tokens_of(again)


# ---- failures stay with the request (or the step) they belong to ---------------------------------
class _FailingDetok:
    def add(self, token: int) -> str:
        raise ValueError("injected detokenizer failure")

    def flush(self) -> str:
        return ""


def _assert_idle(engine: Engine) -> None:
    assert not engine.has_unfinished()
    assert engine.kv.pool.num_used == 0 and not engine.requests and not engine._detokenizers
    check_block_accounting(engine)


def test_detokenizer_failure_fails_that_request_alone(model, references):
    engine = make_engine(model, block_size=4)
    ids = [engine.add_request(p, SamplingParams(max_tokens=12)) for p in PROMPTS]
    engine._detokenizers[ids[1]] = _FailingDetok()
    outputs = {i: [] for i in ids}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id].append(out)
    failed = outputs[ids[1]]
    assert [o.finish_reason for o in failed] == ["error"]
    assert isinstance(failed[0].error, ValueError) and failed[0].finished
    for i, ref in ((0, references[0]), (2, references[2]), (3, references[3])):
        assert tokens_of(outputs[ids[i]]) == ref
    assert engine.stats.failed_requests == 1
    _assert_idle(engine)


def test_step_failure_fails_its_requests_and_the_engine_goes_on(model, references, monkeypatch):
    engine = make_engine(model, block_size=4)
    run_all(engine, [PROMPTS[0]], [SamplingParams(max_tokens=12)])  # its prefix blocks are now cached
    ids = [engine.add_request(p, SamplingParams(max_tokens=12)) for p in PROMPTS[:2]]
    engine.step()
    engine.step()
    execute = engine.runner.execute

    def broken(*args):
        # As when an MLX op fails half-way through a step's graph: the KV pools are gone with it.
        engine.runner.cache[0].keys = None
        raise RuntimeError("injected step failure")

    monkeypatch.setattr(engine.runner, "execute", broken)
    outputs = engine.step()
    assert {o.request_id for o in outputs} == set(ids)
    assert all(o.finish_reason == "error" and isinstance(o.error, RuntimeError) for o in outputs)
    assert engine.stats.failed_steps == 1
    _assert_idle(engine)
    assert engine.kv.pool.num_cached == 0  # no prefix that the failed step was writing can be found
    monkeypatch.setattr(engine.runner, "execute", execute)
    results = run_all(engine, PROMPTS, [SamplingParams(max_tokens=12)] * len(PROMPTS))
    assert [tokens_of(r) for r in results] == references
    _assert_idle(engine)


def test_scheduling_failure_of_one_request_fails_it_alone(model, references, monkeypatch):
    engine = make_engine(model, block_size=4)
    ids = [engine.add_request(p, SamplingParams(max_tokens=12)) for p in PROMPTS[:3]]
    find = engine.kv.find_cached_prefix

    def find_or_fail(seq_id, token_ids, reuse=True):
        if seq_id == ids[1]:
            raise KeyError("injected scheduling failure")
        return find(seq_id, token_ids, reuse)

    monkeypatch.setattr(engine.kv, "find_cached_prefix", find_or_fail)
    outputs = {i: [] for i in ids}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id].append(out)
    assert [o.finish_reason for o in outputs[ids[1]]] == ["error"]
    assert tokens_of(outputs[ids[0]]) == references[0] and tokens_of(outputs[ids[2]]) == references[2]
    _assert_idle(engine)


def test_unrecoverable_step_failure_raises_engine_failure(model, monkeypatch):
    engine = make_engine(model)
    engine.add_request(PROMPTS[0], SamplingParams(max_tokens=12))
    engine.step()

    def broken(*args):
        engine.kv.pool.ref_counts[-1] += 1  # block accounting no longer adds up
        raise RuntimeError("injected step failure")

    monkeypatch.setattr(engine.runner, "execute", broken)
    with pytest.raises(EngineFailure, match="reference counts"):
        engine.step()


# ---- the sampler alone ---------------------------------------------------------------------------
def _rows(params: SamplingParams, n: int = 1, prompt=(), output=()):
    return [SamplerRow(params, list(prompt), list(output), None) for _ in range(n)]


def test_sampler_truncations():
    # 2000 draws: token 0 has 1.2% of the mass, which 200 draws missed one time in ten.
    logits = mx.array([[0.0, 1.0, 2.0, 3.0, 4.0]] * 2000)
    draws = lambda p: set(sample(logits, _rows(p, 2000)).tokens.tolist())  # noqa: E731
    assert draws(SamplingParams(temperature=1.0, top_k=1)) == {4}
    assert draws(SamplingParams(temperature=1.0, top_k=2)) <= {3, 4}
    # softmax of 0..4: the top token has 0.636 of the mass, the top two 0.87.
    assert draws(SamplingParams(temperature=1.0, top_p=0.6)) == {4}
    assert draws(SamplingParams(temperature=1.0, top_p=0.8)) == {3, 4}
    assert draws(SamplingParams(temperature=1.0, min_p=0.3)) == {3, 4}  # e^-1 = 0.37 >= 0.3 > e^-2
    assert len(draws(SamplingParams(temperature=1.0))) == 5


def test_sampler_penalties_and_bias():
    logits = mx.array([[1.0, 2.0, 3.0, 2.5]])
    greedy = lambda p, **kw: sample(logits, _rows(p, **kw)).tokens.item()  # noqa: E731
    assert greedy(SamplingParams()) == 2
    assert greedy(SamplingParams(logit_bias={0: 10.0})) == 0
    assert greedy(SamplingParams(repetition_penalty=2.0), prompt=[2]) == 3  # 3/2 < 2.5
    assert greedy(SamplingParams(presence_penalty=1.0), output=[2]) == 3  # 3-1 < 2.5
    assert greedy(SamplingParams(frequency_penalty=0.3), output=[2, 2]) == 3  # 3-0.6 < 2.5
    assert greedy(SamplingParams(frequency_penalty=0.3), output=[2]) == 2


@pytest.mark.skipif(not cpu_kernels.available(), reason="the native CPU kernels are not built here")
def test_native_penalties_equal_the_dense_mlx_ops():
    """cpu_kernels.adjust_logits touches only the tokens a row lists; the dense [B, V] MLX ops (kept for
    other backends) compute every logit: the same logits, each row by its own settings (one row's
    penalties leave another row as it was), repeated tokens counted, prompt tokens only for repetition,
    and a row's pending token (the previous step's lazy sample) counted as one more output token."""
    rng = np.random.default_rng(7)
    vocab = 500
    logits = mx.array((rng.standard_normal((5, vocab)) * 3).astype(np.float32))
    settings = [
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(frequency_penalty=0.4, presence_penalty=-0.7),
        SamplingParams(),
        SamplingParams(repetition_penalty=0.8, frequency_penalty=-1.1, logit_bias={3: 5.0, 499: -9, 7: 0.5}),
        SamplingParams(logit_bias={0: 1.5}),
    ]
    rows = [
        SamplerRow(p, rng.integers(0, vocab, 40).tolist(), rng.integers(0, 20, 30).tolist(), None)
        for p in settings
    ]
    rows[3].prompt_ids.append(499)  # biased and seen in the prompt only
    # Pending tokens: one already in its row's output, one new to it, one for a row without penalties.
    pending = mx.array([-1, int(rows[1].output_ids[0]), 123, 45, -1], dtype=mx.int32)
    native = np.array(sampling._apply_penalties(logits, rows, pending))
    dense = np.array(sampling._apply_penalties_dense(logits, rows, pending))
    np.testing.assert_array_equal(native, dense)
    np.testing.assert_array_equal(native[2], np.array(logits)[2])
    without = np.array(sampling._apply_penalties(logits, rows, None))
    assert (without[[1, 3]] != native[[1, 3]]).any(axis=1).all() and (without[[0, 4]] == native[[0, 4]]).all()
    assert (native[0] != np.array(logits)[0]).sum() > 30  # repetition reached the prompt's tokens too


def test_penalised_requests_equal_a_reference_that_knows_every_token(model, references):
    """Penalties count the previous step's token from the lazy samples instead of the engine reading them
    first: batched penalised requests give the tokens of a loop that samples each from an uncached
    forward pass with every earlier token known."""
    settings = [  # each changes its prompt's greedy text (at tokens 1, 9, 11 and 7)
        SamplingParams(max_tokens=12, ignore_eos=True, repetition_penalty=1.6),
        SamplingParams(max_tokens=12, ignore_eos=True, repetition_penalty=1.6, logit_bias={7: 0.2}),
        SamplingParams(max_tokens=12, ignore_eos=True, frequency_penalty=0.9, presence_penalty=0.4),
        SamplingParams(max_tokens=12, ignore_eos=True, frequency_penalty=2.0),
    ]
    results = run_all(make_engine(model), PROMPTS, settings)
    for prompt, params, outputs, plain in zip(PROMPTS, settings, results, references):
        tokens, want = list(prompt), []
        for _ in range(params.max_tokens):
            row = SamplerRow(params, list(prompt), list(want), None)
            want.append(sample(full_forward_logits(model, tokens)[None], [row]).tokens.item())
            tokens.append(want[-1])
        assert tokens_of(outputs) == want
        assert want[: len(plain)] != plain  # the penalties changed the greedy text


# ---- the block pool alone ------------------------------------------------------------------------
def test_block_pool_lru_eviction_only_when_unreferenced():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    tokens_a = [1, 2, 3, 4, 5]
    assert kv.allocate("a", tokens_a, 0, 5)
    assert kv.pool.num_used == 3 and kv.pool.num_cached == 2
    kv.free("a")
    assert kv.pool.num_used == 0 and kv.pool.num_cached == 2
    # A new sequence with the same prefix finds both full blocks.
    assert kv.find_cached_prefix("b", tokens_a) == 4
    # Filling the pool evicts cached blocks only once they are unreferenced.
    assert kv.allocate("c", [9, 9, 9, 9], 0, 4)
    assert kv.pool.num_cached == 4  # a's two (still referenced by b) and c's two
    assert not kv.allocate("d", [8, 8], 0, 2)  # nothing unreferenced is left
    kv.free("b")
    assert kv.allocate("d", [8, 8], 0, 2)
    assert kv.pool.num_cached == 4  # one of a's blocks evicted, d's own registered
    # The tail block of the freed prefix went first: its head block is still found.
    assert kv.find_cached_prefix("e", tokens_a) == 2


def test_block_pool_refcounts_reject_double_free():
    pool = BlockPool(2)
    blocks = pool.allocate(2)
    pool.release(blocks)
    with pytest.raises(RuntimeError):
        pool.release(blocks)


def test_decode_step_cost_independent_of_pool_size(model):
    """KV writes are in-place scatters into a donated pool: a step must not copy the pool."""

    def measure(num_blocks: int) -> tuple[float, int]:
        engine = make_engine(model, num_blocks=num_blocks, block_size=16)
        engine.add_request(list(range(1, 20)), SamplingParams(max_tokens=60, ignore_eos=True))
        for _ in range(5):
            engine.step()
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        start = time.perf_counter()
        for _ in range(40):
            engine.step()
        return (time.perf_counter() - start) / 40, mx.get_peak_memory() - base

    small_time, small_mem = measure(64)
    big_time, big_mem = measure(64 * 256)  # 256x the pool: a copy per step would be ~100 MB
    pool_bytes = 64 * 256 * 16 * 2 * 2 * 16 * 4 * len(model.layers)
    assert big_mem < pool_bytes / 20, (small_mem, big_mem, pool_bytes)
    assert big_time < small_time * 3 + 0.005, (small_time, big_time)
