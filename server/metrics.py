"""Prometheus metrics: engine state read at scrape time, latencies observed per request."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest

from mlx_infer.engine.async_engine import AsyncEngine

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120)


class Metrics:
    def __init__(self, async_engine: AsyncEngine):
        engine = self.engine = async_engine.engine
        self.registry = CollectorRegistry()
        r = self.registry
        kv = engine.kv
        Gauge("mlx_infer_requests_running", "Requests being decoded or prefilled", registry=r).set_function(
            lambda: len(engine.scheduler.running)
        )
        Gauge("mlx_infer_requests_waiting", "Requests waiting for admission", registry=r).set_function(
            lambda: len(engine.scheduler.waiting)
        )
        Gauge("mlx_infer_kv_blocks_total", "KV blocks in the pool", registry=r).set(kv.pool.num_blocks)
        Gauge("mlx_infer_kv_blocks_used", "KV blocks referenced by requests", registry=r).set_function(
            lambda: kv.pool.num_used
        )
        Gauge(
            "mlx_infer_kv_blocks_cached", "KV blocks findable in the prefix cache", registry=r
        ).set_function(lambda: kv.pool.num_cached)
        Gauge("mlx_infer_kv_bytes_budget", "Bytes the KV pool may grow to (--kv-memory)", registry=r).set(
            engine.kv_memory().budget
        )
        Gauge(
            "mlx_infer_kv_bytes_reserved",
            "Bytes of the KV pool's reserved chunks (it grows with load and shrinks when idle)",
            registry=r,
        ).set_function(lambda: engine.kv_memory().reserved)
        Gauge(
            "mlx_infer_kv_bytes_used", "Bytes of KV blocks referenced by requests", registry=r
        ).set_function(lambda: engine.kv_memory().used)
        Gauge(
            "mlx_infer_prefix_cache_hit_rate", "Prefix-cache block hits / lookups", registry=r
        ).set_function(kv.hit_rate)
        Gauge(
            "mlx_infer_prompt_tokens_computed_total", "Prompt tokens computed (cache misses)", registry=r
        ).set_function(lambda: engine.stats.prompt_tokens)
        Gauge("mlx_infer_generation_tokens_total", "Tokens generated", registry=r).set_function(
            lambda: engine.stats.generated_tokens
        )
        Gauge(
            "mlx_infer_generation_tokens_per_second",
            "Generation throughput since the last scrape",
            registry=r,
        ).set_function(self._throughput)
        Gauge(
            "mlx_infer_spec_proposed_tokens_total", "Speculative tokens proposed and verified", registry=r
        ).set_function(lambda: engine.stats.spec_proposed)
        Gauge(
            "mlx_infer_spec_accepted_tokens_total", "Speculative tokens the model accepted", registry=r
        ).set_function(lambda: engine.stats.spec_accepted)
        Gauge(
            "mlx_infer_spec_acceptance_rate", "Accepted / proposed speculative tokens since start", registry=r
        ).set_function(lambda: engine.stats.spec_acceptance)
        Gauge("mlx_infer_preemptions_total", "Requests preempted for recompute", registry=r).set_function(
            lambda: engine.scheduler.num_preemptions
        )
        Gauge(
            "mlx_infer_requests_finished_total", "Requests that ran to a stop or their length", registry=r
        ).set_function(lambda: engine.stats.finished_requests)
        Gauge(
            "mlx_infer_requests_failed_total", "Requests that failed inside the engine", registry=r
        ).set_function(lambda: engine.stats.failed_requests)
        Gauge(
            "mlx_infer_engine_steps_failed_total",
            "Engine steps that failed and were recovered from",
            registry=r,
        ).set_function(lambda: engine.stats.failed_steps)
        # Entries in the engine's request tables: back to 0 when idle, or something leaked.
        Gauge(
            "mlx_infer_engine_requests_tracked", "Requests in the engine's tables", registry=r
        ).set_function(lambda: len(engine.requests) + async_engine.num_tracked)
        Gauge(
            "mlx_infer_requests_pending", "Requests admitted by the API and not yet finished", registry=r
        ).set_function(lambda: async_engine.num_pending)
        self.ttft = Histogram(
            "mlx_infer_time_to_first_token_seconds",
            "Time to first token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "mlx_infer_time_per_output_token_seconds",
            "Time per output token after the first",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self._last = (time.monotonic(), 0)

    def _throughput(self) -> float:
        t, tokens = time.monotonic(), self.engine.stats.generated_tokens
        last_t, last_tokens = self._last
        self._last = (t, tokens)
        return (tokens - last_tokens) / (t - last_t) if t > last_t else 0.0

    def observe(self, ttft: float | None, tpot: float | None) -> None:
        if ttft is not None:
            self.ttft.observe(ttft)
        if tpot is not None:
            self.tpot.observe(tpot)

    def render(self) -> bytes:
        return generate_latest(self.registry)
