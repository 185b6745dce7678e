"""Speculative decoding: the output is the target model's own, token for token at temperature 0 and in
distribution when sampling, however many proposals are accepted, and the KV state stays clean.

Tiny random models get a scripted proposer (the plain run's own continuation with a wrong token now and
then), so every path is exercised: full runs, rejections at each position, EOS and stops inside a run.
The real SmolLM2 gets the n-gram proposer on a code-editing prompt on the default (int8) CPU path.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import replace

import pytest
from engine_helpers import CharTokenizer, tiny_llama

from mlx_infer.engine.engine import Engine, EngineConfig, check_block_accounting
from mlx_infer.engine.scheduler import SchedulerConfig
from mlx_infer.engine.speculative import (
    PerSequenceProposer,
    SpecState,
    SpeculativeConfig,
    accepted_length,
    ngram_propose,
)
from mlx_infer.sampling import SamplingParams

VOCAB = CharTokenizer.vocab_size
PROMPTS = [list(range(5, 23)), [3, 4, 5], list(range(1, 40)), [9] * 20, [7, 8, 9, 7, 8, 9, 7, 8]]


# ---- the pieces --------------------------------------------------------------------------------------
def test_ngram_proposes_what_followed_the_longest_recent_match():
    tokens = [1, 2, 3, 9, 1, 2, 3, 4, 5, 6, 7, 1, 2, 3]
    # "1 2 3" occurred twice; the most recent earlier occurrence is followed by 4 5 6.
    assert ngram_propose(tokens, 3) == [4, 5, 6]
    assert ngram_propose(tokens, 10) == [4, 5, 6, 7, 1, 2, 3]  # up to the end of what is known
    assert ngram_propose([1, 2, 3, 4], 3) == []  # nothing repeats
    assert ngram_propose([5, 6, 5], 2) == [6, 5]  # one-token match
    assert ngram_propose([5, 6, 5], 2, min_n=2) == []
    assert ngram_propose(tokens, 0) == []


def test_accepted_length_and_adaptation():
    assert accepted_length([4, 5, 6, 7], [4, 5, 6]) == 3
    assert accepted_length([4, 9, 6, 7], [4, 5, 6]) == 1
    assert accepted_length([9], []) == 0
    state = SpecState(2)
    state.update(2, 2, max_k=8, cooldown_steps=2)
    assert state.k == 4  # a full run doubles k
    state.update(4, 1, max_k=8, cooldown_steps=2)
    assert state.k == 4  # a partial one keeps it
    for _ in range(3):
        state.update(state.k, 0, max_k=8, cooldown_steps=2)
    assert state.k == 0  # nothing accepted halves it down to 0: the sequence just decodes
    state.tick()
    assert state.k == 0
    state.tick()
    assert state.k == 1  # after the cooldown it tries again


# ---- tiny models, scripted proposals -------------------------------------------------------------------
class ScriptedProposer(PerSequenceProposer):
    """Proposes each request's continuation from a plain run, with every third proposal wrong at its
    second token, so runs are accepted in full, in part and not at all."""

    def __init__(self, continuations: dict[tuple[int, ...], list[int]]):
        self.continuations = continuations
        self.calls = 0

    def propose_one(self, tokens: Sequence[int], k: int) -> list[int]:
        for prompt, reference in self.continuations.items():
            if tuple(tokens[: len(prompt)]) == prompt:
                done = len(tokens) - len(prompt)
                proposal = list(reference[done : done + k])
                break
        else:
            return []
        self.calls += 1
        if self.calls % 3 == 0 and proposal:
            at = min(1, len(proposal) - 1)
            proposal[at] = (proposal[at] + 1) % VOCAB
        return proposal


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


def make_engine(
    model, speculative: bool, num_blocks=96, block_size=4, prefix=True, max_batch=16, draft=None
) -> Engine:
    """A plain engine, or one speculating with n-gram lookup (or the ``draft`` model when given)."""
    method = ("draft" if draft is not None else "ngram") if speculative else None
    config = EngineConfig(
        block_size=block_size,
        num_blocks=num_blocks,
        enable_prefix_caching=prefix,
        scheduler=SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=256),
        speculative=SpeculativeConfig(method=method, num_draft_tokens=4, max_batch=max_batch),
    )
    return Engine(model, CharTokenizer(), 256, config, draft_model=draft)


def run_all(engine: Engine, prompts, params_list) -> list[list]:
    ids = [engine.add_request(p, params) for p, params in zip(prompts, params_list)]
    outputs = {i: [] for i in ids}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id].append(out)
    check_block_accounting(engine)
    assert engine.kv.pool.num_used == 0  # every block returned, rejected rows' blocks included
    return [outputs[i] for i in ids]


def tokens_of(outputs) -> list[int]:
    return [t for o in outputs for t in o.token_ids]


def logprobs_of(outputs) -> list[float]:
    return [lp.logprob for o in outputs for lp in o.logprobs or []]


def scripted(model, prompts, params_list, **engine_args) -> tuple[list[list], list[list], Engine]:
    """The plain run's outputs, and the speculative run's with the plain continuations proposed."""
    plain = run_all(make_engine(model, False, **engine_args), prompts, params_list)
    engine = make_engine(model, True, **engine_args)
    engine.proposer = ScriptedProposer(
        {tuple(p): plain_tokens(model, p, _longer(q)) for p, q in zip(prompts, params_list)}
    )
    spec = run_all(engine, prompts, params_list)
    return plain, spec, engine


def plain_tokens(model, prompt: list[int], params: SamplingParams) -> list[int]:
    return tokens_of(run_all(make_engine(model, False), [prompt], [params])[0])


def _longer(params: SamplingParams) -> SamplingParams:
    """The same request run past its own end, so proposals reach beyond cut-offs and stops."""
    return replace(params, max_tokens=params.max_tokens + 8, stop=[], ignore_eos=True)


def test_greedy_batch_of_one_equals_plain(model):
    params = SamplingParams(max_tokens=30, logprobs=2)
    proposed = accepted = 0
    for prompt in PROMPTS:
        plain, spec, engine = scripted(model, [prompt], [params])
        assert tokens_of(spec[0]) == tokens_of(plain[0])
        assert logprobs_of(spec[0]) == pytest.approx(logprobs_of(plain[0]), abs=1e-4)
        assert engine.stats.spec_accepted > 0
        proposed, accepted = proposed + engine.stats.spec_proposed, accepted + engine.stats.spec_accepted
    assert accepted < proposed  # rejections happened too


def test_greedy_mixed_batch_of_sixteen_equals_plain(model):
    prompts = [[(3 * i + j) % (VOCAB - 1) + 1 for j in range(4 + i)] for i in range(16)]
    params = [
        SamplingParams(
            max_tokens=20 + i,
            speculative=i % 2 == 0,  # half of them decode plainly beside the speculating ones
            repetition_penalty=1.3 if i % 4 == 1 else 1.0,
            frequency_penalty=0.5 if i % 4 == 2 else 0.0,
            logit_bias={5: 2.0} if i % 5 == 0 else {},
        )
        for i in range(16)
    ]
    plain, spec, engine = scripted(model, prompts, params)
    assert [tokens_of(s) for s in spec] == [tokens_of(p) for p in plain]
    assert engine.stats.spec_accepted > 0


def test_penalised_speculating_request_equals_plain(model):
    # Penalties of row j see the proposal's first j tokens: the tokens it emits if the run gets that far.
    params = SamplingParams(
        max_tokens=30, repetition_penalty=1.5, presence_penalty=0.7, frequency_penalty=0.4
    )
    plain, spec, engine = scripted(model, [PROMPTS[3]], [params])
    assert tokens_of(spec[0]) == tokens_of(plain[0])
    assert engine.stats.spec_accepted > 0


def test_max_tokens_cut_inside_an_accepted_run(model):
    for max_tokens in range(1, 9):
        params = SamplingParams(max_tokens=max_tokens)
        plain, spec, _ = scripted(model, [PROMPTS[0]], [params])
        assert tokens_of(spec[0]) == tokens_of(plain[0])
        assert len(tokens_of(spec[0])) == max_tokens
        assert spec[0][-1].finish_reason == "length"


def test_stop_string_inside_an_accepted_run(model):
    reference = plain_tokens(model, PROMPTS[2], SamplingParams(max_tokens=20))
    text = CharTokenizer().decode(reference)
    stop = text[6:8]
    params = SamplingParams(max_tokens=20, stop=[stop])
    plain, spec, _ = scripted(model, [PROMPTS[2]], [params])
    assert "".join(o.text for o in spec[0]) == "".join(o.text for o in plain[0]) == text[: text.find(stop)]
    assert spec[0][-1].finish_reason == "stop"


def test_eos_inside_a_proposal(model):
    reference = plain_tokens(model, PROMPTS[0], SamplingParams(max_tokens=12))
    engine_eos = reference[5]  # a token the target emits mid-way becomes end-of-sequence
    plain_engine, spec_engine = make_engine(model, False), make_engine(model, True)
    long = plain_tokens(model, PROMPTS[0], SamplingParams(max_tokens=20))
    spec_engine.proposer = ScriptedProposer({tuple(PROMPTS[0]): long})
    for e in (plain_engine, spec_engine):
        e.tokenizer.eos_token_ids = {engine_eos}
    params = SamplingParams(max_tokens=20)
    plain = run_all(plain_engine, [PROMPTS[0]], [params])[0]
    spec = run_all(spec_engine, [PROMPTS[0]], [params])[0]
    assert tokens_of(spec) == tokens_of(plain) == reference[: reference.index(engine_eos) + 1]
    assert spec[-1].finish_reason == "stop"


def test_prefix_cache_never_serves_rejected_rows(model):
    # Block size 4 and frequent rejections: rejected K/V lands in partial blocks that later fill up.
    plain, spec, engine = scripted(model, [PROMPTS[2]], [SamplingParams(max_tokens=24)])
    assert engine.stats.spec_accepted < engine.stats.spec_proposed
    # A follow-up whose prompt is the first request's whole sequence: its cached blocks must hold
    # exactly what an engine without a cache computes.
    follow = PROMPTS[2] + tokens_of(spec[0]) + [3, 4]
    params = SamplingParams(max_tokens=8, logprobs=0)
    engine.proposer = None  # the follow-up decodes plainly: only the cached K/V is under test
    cached = run_all(engine, [follow], [params])[0]
    assert cached[-1].num_cached_tokens >= len(PROMPTS[2]) + 16
    fresh = run_all(make_engine(model, False, prefix=False), [follow], [params])[0]
    assert tokens_of(cached) == tokens_of(fresh)
    assert logprobs_of(cached) == pytest.approx(logprobs_of(fresh), abs=1e-5)


def test_constrained_and_opted_out_requests_do_not_speculate(model):
    engine = make_engine(model, True)
    rid = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=4, speculative=False))
    assert engine.requests[rid].spec is None
    rid = engine.add_request(PROMPTS[1], SamplingParams(max_tokens=4))
    assert engine.requests[rid].spec is not None


def test_request_field_and_flags_reach_the_engine():
    import argparse

    from mlx_infer import cli_options
    from mlx_infer.errors import InvalidRequest
    from mlx_infer.server.schemas import ChatCompletionRequest, CompletionRequest

    off = CompletionRequest(model="m", prompt="x", speculative=False)
    assert off.sampling_params(16, None, 0).speculative is False
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}])
    assert chat.sampling_params(16, None, 0).speculative is True
    parser = argparse.ArgumentParser()
    cli_options.add_engine_arguments(parser, max_num_seqs=1)
    args = parser.parse_args(["--speculative", "ngram", "--num-draft-tokens", "6"])
    config = cli_options.engine_config(args)
    assert (config.speculative.method, config.speculative.num_draft_tokens) == ("ngram", 6)
    assert cli_options.engine_config(parser.parse_args(["--draft-model", "d"])).speculative.method == "draft"
    assert cli_options.engine_config(parser.parse_args([])).speculative.method is None
    with pytest.raises(InvalidRequest, match="needs --draft-model"):
        cli_options.engine_config(parser.parse_args(["--speculative", "draft"]))
    with pytest.raises(InvalidRequest, match="num-draft-tokens"):
        cli_options.engine_config(parser.parse_args(["--speculative", "ngram", "--num-draft-tokens", "0"]))
    for tuning in (["--num-draft-tokens", "5"], ["--speculative-max-batch", "3"]):  # without --speculative
        with pytest.raises(InvalidRequest, match=f"{tuning[0]} goes with --speculative"):
            cli_options.engine_config(parser.parse_args(tuning))


def test_speculation_backs_off_in_large_batches(model):
    engine = make_engine(model, True, max_batch=2)
    engine.proposer = ScriptedProposer({})
    engine.proposer.propose_one = lambda tokens, k: pytest.fail("proposed in a batch above max_batch")
    run_all(engine, PROMPTS[:3], [SamplingParams(max_tokens=6)] * 3)
    assert engine.stats.spec_proposed == 0


def test_seeded_sampling_equals_plain(model):
    # Row j draws with the key the plain run uses for that token, so seeded output is unchanged too.
    params = [SamplingParams(max_tokens=16, temperature=0.8, seed=s) for s in range(6)]
    prompts = [PROMPTS[s % len(PROMPTS)] for s in range(6)]
    plain, spec, engine = scripted(model, prompts, params)
    assert [tokens_of(s) for s in spec] == [tokens_of(p) for p in plain]
    assert engine.stats.spec_accepted > 0


# ---- tiny models, a draft model -------------------------------------------------------------------------
def run_with_draft(model, draft, prompts, params_list) -> tuple[list[list], Engine]:
    engine = make_engine(model, True, draft=draft)
    outputs = run_all(engine, prompts, params_list)
    assert engine.proposer.kv.pool.num_used == 0  # the draft's blocks went back too
    return outputs, engine


def test_draft_equal_to_target_accepts_every_proposal(model):
    params = [SamplingParams(max_tokens=24, ignore_eos=True) for _ in PROMPTS]
    plain = run_all(make_engine(model, False), PROMPTS, params)
    spec, engine = run_with_draft(model, tiny_llama(), PROMPTS, params)  # the same weights
    assert [tokens_of(s) for s in spec] == [tokens_of(p) for p in plain]
    assert engine.stats.spec_proposed > 0
    assert engine.stats.spec_accepted == engine.stats.spec_proposed
    from mlx_infer.kv.pages import pages_droppable

    # Idle, the draft pool's written pages are given back as the model's are.
    assert engine.proposer.release_idle_memory() > 0 or not pages_droppable()


def test_other_draft_mixed_batch_and_seeded_sampling_equal_plain(model):
    draft = tiny_llama(seed=1, layers=1)
    prompts = [[(5 * i + j) % (VOCAB - 1) + 1 for j in range(3 + i)] for i in range(16)]
    params = [
        SamplingParams(
            max_tokens=18 + i % 5,
            speculative=i % 3 != 0,
            repetition_penalty=1.2 if i % 4 == 1 else 1.0,
            temperature=0.9 if i % 4 == 3 else 0.0,
            seed=i if i % 4 == 3 else None,
        )
        for i in range(16)
    ]
    plain = run_all(make_engine(model, False), prompts, params)
    spec, engine = run_with_draft(model, draft, prompts, params)
    assert [tokens_of(s) for s in spec] == [tokens_of(p) for p in plain]
    assert 0 < engine.stats.spec_accepted < engine.stats.spec_proposed


def chi_square_homogeneity(a: Counter, b: Counter) -> tuple[float, int]:
    """Two-sample chi-square statistic over the tokens both samples saw, tokens expected fewer than 5
    times pooled into one cell; returns (statistic, degrees of freedom)."""
    na, nb = sum(a.values()), sum(b.values())
    cells, rare = [], [0, 0]
    for t in set(a) | set(b):
        if (a[t] + b[t]) * min(na, nb) / (na + nb) < 5:
            rare[0], rare[1] = rare[0] + a[t], rare[1] + b[t]
        else:
            cells.append((a[t], b[t]))
    if sum(rare):
        cells.append(tuple(rare))
    stat = 0.0
    for ca, cb in cells:
        total = ca + cb
        for observed, n in ((ca, na), (cb, nb)):
            expected = total * n / (na + nb)
            stat += (observed - expected) ** 2 / expected
    return stat, len(cells) - 1


def chi_square_critical(df: int, z: float = 3.09) -> float:
    """The chi-square quantile at the normal quantile ``z`` (3.09: p = 0.001), Wilson-Hilferty."""
    return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


def test_sampled_token_frequencies_match_plain(model):
    """Unseeded sampling at temperature 1.5, 960 requests each way: the frequencies of the second to
    fifth tokens (drawn after proposals accepted or rejected) each pass a two-sample chi-square test of
    homogeneity against plain decoding at p = 0.001."""
    import mlx.core as mx

    prompt, n = [7, 8, 9, 7, 8], 960
    params = SamplingParams(max_tokens=5, temperature=1.5)
    greedy = plain_tokens(model, prompt, SamplingParams(max_tokens=8))

    def frequencies(speculative: bool) -> list[Counter]:
        mx.random.seed(1 if speculative else 2)
        engine = make_engine(model, speculative, num_blocks=256)
        if speculative:
            engine.proposer = ScriptedProposer({tuple(prompt): greedy})  # accepted with probability p
        counts = [Counter() for _ in range(params.max_tokens)]
        for _ in range(n // 16):
            for out in run_all(engine, [prompt] * 16, [params] * 16):
                for position, token in enumerate(tokens_of(out)):
                    counts[position][token] += 1
        if speculative:
            assert 0 < engine.stats.spec_accepted < engine.stats.spec_proposed
        return counts

    plain, spec = frequencies(False), frequencies(True)
    for position in range(1, params.max_tokens):
        stat, df = chi_square_homogeneity(plain[position], spec[position])
        assert df >= 5  # the test has cells enough to see a skew
        assert stat < chi_square_critical(df), (position, stat, df)


# ---- the real model, n-gram proposals, default CPU path -----------------------------------------------
CODE = '''def compute_totals(orders, tax_rate):
    totals = {}
    for order in orders:
        customer = order["customer"]
        amount = order["amount"]
        if amount <= 0:
            continue
        taxed = amount * (1 + tax_rate)
        if customer not in totals:
            totals[customer] = 0.0
        totals[customer] += taxed
    result = []
    for customer, total in totals.items():
        result.append((customer, round(total, 2)))
    result.sort(key=lambda item: item[1], reverse=True)
    return result
'''
EDIT = "Rewrite this function, renaming the variable `totals` to `sums`. Output only the code.\n\n" + CODE


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    from mlx_infer import cpu_kernels
    from mlx_infer.loading import load

    if not cpu_kernels.available():
        pytest.skip(cpu_kernels.unavailable_reason())
    return load(str(smollm2_path))


@pytest.fixture
def int8_activations():
    """The path users run; the rest of the suite pins float32 (conftest.py)."""
    from mlx_infer import cpu_kernels

    cpu_kernels.set_activations("int8")
    yield
    cpu_kernels.set_activations("float32")


@pytest.mark.slow
def test_smollm2_greedy_with_ngram_equals_plain(smollm2, int8_activations):
    tok = smollm2.tokenizer
    edit = tok.encode_chat([{"role": "user", "content": EDIT}])
    other = tok.encode_chat([{"role": "user", "content": "Name three primary colours."}])

    def run(method: str | None, prompts: list[list[int]], speculate: list[bool]) -> tuple[list, Engine]:
        spec = SpeculativeConfig(method=method, num_draft_tokens=4, max_batch=16)
        config = EngineConfig(num_blocks=1024, speculative=spec, scheduler=SchedulerConfig(max_num_seqs=16))
        engine = Engine(smollm2.model, tok, 2048, config)
        params = [SamplingParams(max_tokens=48 if s else 24, speculative=s, logprobs=0) for s in speculate]
        return run_all(engine, prompts, params), engine

    plain, _ = run(None, [edit], [True])
    spec, engine = run("ngram", [edit], [True])
    assert tokens_of(spec[0]) == tokens_of(plain[0])
    assert engine.stats.spec_accepted > 0

    # 16 requests, speculating code edits beside plain chat answers, all in the same steps.
    prompts = [edit if i % 2 == 0 else other for i in range(16)]
    speculate = [i % 2 == 0 for i in range(16)]
    batch, engine = run("ngram", prompts, speculate)
    assert engine.stats.spec_accepted > 0
    alone = tokens_of(run(None, [other], [False])[0][0])
    for i, out in enumerate(batch):
        assert tokens_of(out) == (tokens_of(plain[0]) if i % 2 == 0 else alone), i


@pytest.mark.slow
def test_smollm2_draft_equal_to_target_accepts_every_proposal(smollm2, smollm2_path, int8_activations):
    # The draft's one-row decode steps and the target's verification rows compute every row alike (the
    # int8 kernels are row-invariant), so a draft with the target's weights is always right.
    from mlx_infer.loading import load

    draft = load(str(smollm2_path)).model
    tok = smollm2.tokenizer
    prompts = [tok.encode_chat([{"role": "user", "content": c}]) for c in (EDIT, "Write a haiku about tea.")]
    params = [SamplingParams(max_tokens=40) for _ in prompts]
    plain = run_all(Engine(smollm2.model, tok, 2048, EngineConfig(num_blocks=512)), prompts, params)
    config = EngineConfig(num_blocks=512, speculative=SpeculativeConfig("draft", 4, max_batch=16))
    engine = Engine(smollm2.model, tok, 2048, config, draft_model=draft)
    out = run_all(engine, prompts, params)
    assert [tokens_of(o) for o in out] == [tokens_of(p) for p in plain]
    assert 0 < engine.stats.spec_accepted == engine.stats.spec_proposed

