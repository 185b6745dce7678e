"""The KV pool takes memory as the scheduler needs it and gives it back when idle (issue 23).

Chunk bookkeeping on the block pool, pages that are allocated but not resident, outputs equal to a
fixed pool's, growth that copies nothing during decode, and a real server's resident size at start,
under load and after the idle period.
"""

from __future__ import annotations

import concurrent.futures
import os
import random
import time

import httpx
import mlx.core as mx
import numpy as np
import pytest
from engine_helpers import CharTokenizer, tiny_llama
from server_helpers import LiveServer, wait_for_idle

from mlx_infer.engine.engine import Engine, EngineConfig, check_block_accounting
from mlx_infer.engine.runner import activation_dtype, kv_bytes_per_token, kv_pool_dtype
from mlx_infer.engine.scheduler import SchedulerConfig
from mlx_infer.kv.block_pool import BlockPool
from mlx_infer.kv.pages import drop_pages, pages_droppable
from mlx_infer.sampling import SamplingParams

needs_droppable_pages = pytest.mark.skipif(
    not pages_droppable(), reason="pages of MLX arrays can be dropped on Linux CPU memory only"
)


def rss_bytes(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


def default_bytes_per_token(model) -> int:
    """K and V bytes a token takes in the pool the engine allocates by default (--kv-cache-dtype auto)."""
    return kv_bytes_per_token(model, kv_pool_dtype("auto", activation_dtype(model)))


def make_engine(model, num_blocks: int, chunk_tokens: int, block_size: int = 4, idle: float = 60.0) -> Engine:
    config = EngineConfig(
        block_size=block_size,
        num_blocks=num_blocks,
        kv_chunk_tokens=chunk_tokens,
        kv_idle_release=idle,
        scheduler=SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=256),
    )
    return Engine(model, CharTokenizer(), 256, config)


# ---- the block pool's chunks ----------------------------------------------------------------------
def test_pool_reserves_chunks_on_demand_and_gives_idle_ones_back():
    pool = BlockPool(10, chunk_blocks=4)  # chunks [0, 4), [4, 8), [8, 10)
    assert (pool.num_reserved, pool.num_free, pool.num_used) == (4, 10, 0)
    first = pool.allocate(3)
    assert set(first) <= set(range(4)) and pool.num_reserved == 4
    second = pool.allocate(3)  # one free block left in chunk 0: chunk 1 is reserved
    assert set(second) <= set(range(8)) and pool.num_reserved == 8
    assert pool.allocate(5) is None and pool.num_reserved == 8  # the budget (4 left) is short: nothing taken
    rest = pool.allocate(4)
    assert pool.num_reserved == 10 and pool.num_free == 0
    assert sorted(first + second + rest) == list(range(10))

    # A cached prefix in a released chunk is forgotten; a referenced block keeps its chunk reserved.
    holder = next(b for b in second + rest if b in range(4, 8))
    pool.register(holder, b"prefix")
    pool.release([b for b in second + rest if b != holder])
    assert pool.release_idle_chunks() == [range(8, 10)]
    assert pool.num_reserved == 8 and pool.num_free == 10 - 4
    pool.release([holder])
    assert pool.lookup(b"prefix") == holder  # still cached while its chunk is reserved
    assert pool.release_idle_chunks() == [range(4, 8)]
    assert pool.lookup(b"prefix") is None
    pool.release(first)
    assert pool.release_idle_chunks() == []  # the first chunk stays
    assert (pool.num_reserved, pool.num_free) == (4, 10)
    # Its free blocks are forgotten too when idle, so their memory can go back as well.
    pool.register(first[0], b"first")
    assert pool.forget_free_blocks() == [range(0, 4)]
    assert pool.lookup(b"first") is None and not pool.allocated_since_release
    assert pool.allocate(1) is not None and pool.allocated_since_release


def test_pool_grows_within_its_budget_before_evicting_a_cached_prefix():
    pool = BlockPool(10, chunk_blocks=4)
    first = pool.allocate(4)
    for i, block in enumerate(first):
        pool.register(block, f"prefix-{i}".encode())
    pool.release(first)  # four cached prefixes, free
    second = pool.allocate(3)  # from a new chunk, not over the cached blocks
    assert set(second) <= set(range(4, 8)) and pool.num_reserved == 8
    assert all(pool.lookup(f"prefix-{i}".encode()) is not None for i in range(4))
    # Only once the budget is reached do cached prefixes go, the least recently released first.
    third = pool.allocate(4)  # 1 left in chunk 1, 2 in the last chunk, then one cached block
    assert pool.num_reserved == 10 and len(set(third) & set(first)) == 1
    released_first = first[::-1]  # released in reverse: the tail first
    assert pool.lookup(b"prefix-3") is None and pool.lookup(b"prefix-0") == released_first[-1]
    assert pool.num_free == 3 and pool.num_cached == 3


def test_sequential_prompts_stay_cached_while_the_budget_allows(model):
    """Distinct prompts one after another: each stays in the prefix cache (the pool grows rather than
    reuse their blocks), so all of them hit when sent again."""
    engine = make_engine(model, num_blocks=200, chunk_tokens=32)  # 8 blocks (32 tokens) a chunk
    prompts = [[1 + (i * 7 + j) % 60 for j in range(40)] for i in range(6)]
    for _ in range(2):
        for prompt in prompts:
            engine.add_request(prompt, SamplingParams(max_tokens=2))
            while engine.has_unfinished():
                engine.step()
    assert engine.kv.pool.hits >= 6 * 9  # 9 full blocks of 4 of each 40-token prompt, found again
    check_block_accounting(engine)


# ---- pages --------------------------------------------------------------------------------------
@needs_droppable_pages
def test_dropped_pages_read_zero_and_leave_the_rest():
    a = mx.ones((1024, 1024), dtype=mx.float32)
    mx.eval(a)
    dropped = drop_pages(a, 4096 * 10, 4096 * 200)
    assert dropped >= 4096 * 189
    values = np.asarray(a).reshape(-1)
    assert values[: 4096 * 10 // 4].min() == 1 and values[4096 * 200 // 4 :].min() == 1
    assert values.sum() == values.size - dropped // 4


@needs_droppable_pages
def test_pool_memory_is_resident_only_where_written(model):
    """A 256 MiB budget costs nothing until blocks are written, and what was written goes back when idle."""
    per_token = default_bytes_per_token(model)
    num_blocks = 256 * 2**20 // (16 * per_token)
    before = rss_bytes()
    engine = make_engine(model, num_blocks, chunk_tokens=256, block_size=16, idle=0)
    assert rss_bytes() - before < 32 * 2**20
    assert engine.kv_memory().budget == num_blocks * 16 * per_token
    assert engine.kv_memory().reserved == 256 * per_token

    for i in range(16):  # distinct prompts: no shared prefix blocks
        engine.add_request(
            [i + 1] + [(i * j) % 60 + 1 for j in range(58)], SamplingParams(max_tokens=150, ignore_eos=True)
        )
    reserved = 0
    while engine.has_unfinished():
        engine.step()
        reserved = max(reserved, engine.kv_memory().reserved)
    assert 16 * 150 * per_token <= reserved <= 16 * 224 * per_token + 256 * per_token
    loaded = rss_bytes()
    assert engine.release_idle_kv() > reserved / 2
    assert engine.kv_memory().reserved == 256 * per_token
    assert loaded - rss_bytes() > reserved / 2
    check_block_accounting(engine)


# ---- growth under load --------------------------------------------------------------------------
def run_all(engine: Engine, n: int) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for i in range(n):
        prompt = [(7 * i + j) % 60 + 1 for j in range(24 + i)]
        out[engine.add_request(prompt, SamplingParams(max_tokens=40, ignore_eos=True))] = []
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.token_ids
    return out


@pytest.mark.parametrize("num_blocks", [400, 150])  # room for all 16; short enough to preempt
def test_growing_pool_answers_as_the_fixed_pool(model, num_blocks):
    """16 long requests: the pool grows chunk by chunk, preempts only when the budget is exhausted
    (as often as a pool reserved whole), and every answer equals the fixed pool's."""
    fixed = make_engine(model, num_blocks, chunk_tokens=num_blocks * 4)
    growing = make_engine(model, num_blocks, chunk_tokens=32)  # 8 blocks a chunk
    assert fixed.kv_memory().reserved == fixed.kv_memory().budget
    assert growing.kv_memory().reserved == 8 * growing.kv_block_bytes
    expected = run_all(fixed, 16)
    got = run_all(growing, 16)
    assert list(got.values()) == list(expected.values())
    assert all(len(tokens) == 40 for tokens in got.values())
    assert growing.scheduler.num_preemptions == fixed.scheduler.num_preemptions
    assert (growing.scheduler.num_preemptions > 0) == (num_blocks == 150)
    assert growing.kv_memory().reserved > 16 * 64 * growing.kv_block_bytes // 4 // 2
    check_block_accounting(growing)


def test_growth_during_decode_copies_nothing(model):
    """A decode step that reserves a new chunk costs what any step costs: no copy of the pool (the
    same check as test_engine's donated-pool test, with the pool growing under the request)."""

    def measure(chunk_tokens: int) -> tuple[float, int, int]:
        engine = make_engine(model, 64 * 256, chunk_tokens=chunk_tokens, block_size=16)
        engine.add_request(list(range(1, 20)), SamplingParams(max_tokens=80, ignore_eos=True))
        for _ in range(5):
            engine.step()
        reserved = engine.kv_memory().reserved
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        start = time.perf_counter()
        for _ in range(48):
            engine.step()
        return (
            (time.perf_counter() - start) / 48,
            mx.get_peak_memory() - base,
            engine.kv_memory().reserved - reserved,
        )

    fixed_time, _, _ = measure(64 * 256 * 16)
    grow_time, grow_mem, grown = measure(16)  # a chunk of one block: a new one every 16 tokens
    per_token = default_bytes_per_token(model)
    pool_bytes = 64 * 256 * 16 * per_token
    assert grown >= 2 * 16 * per_token  # at least two chunks reserved while decoding
    assert grow_mem < pool_bytes / 20, (grow_mem, pool_bytes)
    assert grow_time < fixed_time * 2 + 0.005, (fixed_time, grow_time)


# ---- a real server ------------------------------------------------------------------------------
@needs_droppable_pages
def test_server_memory_follows_load(smollm2_path):
    """`mlx-infer serve` with the default budget: resident size after start at most weights + 512 MiB,
    growing under 16 concurrent long requests (all complete), back within 20% of the start once idle."""
    server = LiveServer(smollm2_path, "--kv-idle-release", "2")
    try:
        time.sleep(1)
        start = rss_bytes(server.process.pid)
        weights = smollm2_path.stat().st_size
        assert start <= weights + 512 * 2**20, (start, weights)
        m = server.metrics()
        reserved_at_start = m["mlx_infer_kv_bytes_reserved"]
        assert m["mlx_infer_kv_bytes_budget"] > 10 * reserved_at_start and m["mlx_infer_kv_bytes_used"] == 0

        words = "river stone garden bridge forest island summer winter letter table street yellow".split()

        def ask(i: int) -> dict:
            rng = random.Random(i)  # distinct prompts: no shared prefix blocks
            prompt = " ".join(rng.choice(words) for _ in range(200 + 5 * i))
            body = {
                "model": "smollm2",
                "prompt": prompt,
                "max_tokens": 24,
                "temperature": 0,
                "ignore_eos": True,
            }
            return httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=600).json()

        peak_rss, peak_reserved = start, reserved_at_start
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            futures = [pool.submit(ask, i) for i in range(16)]
            while not all(f.done() for f in futures):
                peak_rss = max(peak_rss, rss_bytes(server.process.pid))
                peak_reserved = max(peak_reserved, server.metrics()["mlx_infer_kv_bytes_reserved"])
                time.sleep(0.2)
        answers = [f.result() for f in futures]
        assert all(a["usage"]["completion_tokens"] == 24 for a in answers), answers[0]
        assert peak_reserved > reserved_at_start
        assert peak_rss > start + 100 * 2**20  # 16 x ~250 tokens x 45 KiB of K/V, written

        wait_for_idle(server)
        deadline = time.monotonic() + 30
        while (
            server.metrics()["mlx_infer_kv_bytes_reserved"] > reserved_at_start
            and time.monotonic() < deadline
        ):
            time.sleep(0.5)
        time.sleep(0.5)
        idle = rss_bytes(server.process.pid)
        assert server.metrics()["mlx_infer_kv_bytes_reserved"] == reserved_at_start
        assert idle <= start * 1.2, (start, peak_rss, idle)
    finally:
        server.stop()


def test_a_kv_budget_past_the_machines_memory_is_refused(model, monkeypatch: pytest.MonkeyPatch):
    """The pool grows into --kv-memory as load comes, so a budget the machine cannot hold would end in
    the OS killing the process long after the start: it is a clear error at once instead."""
    from mlx_infer.errors import InvalidRequest
    from mlx_infer.kv.memory import kv_budget_bytes

    monkeypatch.setenv("MLX_INFER_MEMORY_BUDGET", "2GiB")
    assert kv_budget_bytes(1) == 2**30
    for too_much in (2, 1e6):
        with pytest.raises(InvalidRequest, match="more than this machine has left for it"):
            kv_budget_bytes(too_much)
    for nonsense in (float("inf"), float("nan"), -1):
        with pytest.raises(InvalidRequest, match="positive"):
            kv_budget_bytes(nonsense)
    with pytest.raises(InvalidRequest, match="more than this machine"):
        Engine(model, CharTokenizer(), 64, EngineConfig(kv_memory=3))
