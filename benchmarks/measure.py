"""What every engine's run produces: one row per (engine, batch size), as llama-bench reports it."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field


@dataclass
class Result:
    engine: str  # "mlx-infer", "mlx-lm", "llama.cpp"
    weights: str  # what the engine computes with, e.g. "float32 (MKL)", "bfloat16", "Q4_1"
    batch: int  # concurrent sequences
    prefill: list[float] = field(default_factory=list)  # tokens/s of each repetition
    decode: list[float] = field(default_factory=list)
    weight_bytes: int = 0  # bytes of weights one decode step reads
    kv_bytes_per_token: int = 0  # bytes of KV cache one context token costs a decode step
    decode_context: float = 0.0  # mean context length during the timed decode steps
    note: str = ""
    kv: str = ""  # the KV cache's type, e.g. "float16", "int8", llama.cpp's "q8_0"
    # the memory read bandwidth (bytes/s) measured right before each repetition, where one was
    bandwidth: list[float] = field(default_factory=list)

    def to_json(self) -> dict:
        out = asdict(self)
        out.update(
            prefill_mean=mean(self.prefill), prefill_std=std(self.prefill),
            decode_mean=mean(self.decode), decode_std=std(self.decode),
        )
        return out


def mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def std(values: list[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else 0.0
