"""mlx-infer's own figures, measured through the engine exactly as ``generate`` and ``serve`` drive it.

Per batch size ``b``: ``b`` requests of ``p`` random prompt tokens, greedy, ``n`` tokens each with EOS
ignored. The scheduler's token budget is raised to ``b * p`` so the whole prefill is one step (what
llama-bench's ``pp`` test times); every later step is a pure decode of the ``b`` sequences.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from measure import Result
from mlx.utils import tree_flatten

from mlx_infer import blas, cpu_kernels
from mlx_infer.engine.engine import Engine, EngineConfig
from mlx_infer.engine.runner import dtype_name, kv_bytes_per_token
from mlx_infer.engine.scheduler import SchedulerConfig
from mlx_infer.loading import LoadedModel
from mlx_infer.sampling import SamplingParams


@dataclass
class OpProfile:
    batch: int
    ops_per_step: int
    by_op: dict[str, int]  # primitive name -> count, most frequent first

    @property
    def ops_per_token(self) -> float:
        return self.ops_per_step / self.batch


def weight_bytes_per_step(model: nn.Module) -> int:
    """Bytes of parameters one decode step reads: all of them, except an untied embedding table
    (a lookup reads a few rows; a tied one is read whole by the output head)."""
    params = tree_flatten(model.parameters())
    tied = not any(name.startswith("lm_head.") for name, _ in params)
    return sum(a.nbytes for name, a in params if tied or "embed_tokens" not in name)


def weights_label(model: nn.Module) -> str:
    """The dtype holding most of the weight bytes, and the BLAS when that is float32."""
    sizes: Counter = Counter()
    for _, a in tree_flatten(model.parameters()):
        sizes[a.dtype] += a.nbytes
    dtype = max(sizes, key=sizes.__getitem__)
    if dtype == mx.uint32:
        bits = sorted({m.bits for _, m in model.named_modules() if hasattr(m, "bits")})
        return "quantized " + "/".join(f"{b}-bit" for b in bits)
    name = str(dtype).removeprefix("mlx.core.")
    return f"{name} ({blas.active().split(' (')[0]})" if dtype == mx.float32 else name


def run(
    lm: LoadedModel, prompt_len: int, gen_len: int, repeats: int, batches: list[int], seed: int = 0,
    kv_dtypes: tuple[str, ...] = ("auto",), activations: tuple[str | None, ...] = (None,),
    bandwidth: Callable[[], float] | None = None,
) -> list[Result]:
    """Each CPU activation kind (``--cpu-activations`` values; None: the process's) with each KV cache
    dtype (``--kv-cache-dtype`` values) at each batch size; ``bandwidth`` (a memory bandwidth probe), if
    given, is measured right before each repetition (Result.bandwidth)."""
    results = []
    initial = cpu_kernels.activations() if cpu_kernels.applies() else None
    try:
        for kind in activations:
            if kind is not None:
                cpu_kernels.set_activations(kind)
            results += _run_kind(lm, prompt_len, gen_len, repeats, batches, seed, kv_dtypes, bandwidth)
    finally:
        if initial is not None and any(activations):
            # activations() names the build ("int8-avx512"); a kind that is not one was chosen by "int8"
            kind = initial if initial in cpu_kernels.ACTIVATIONS else initial.split("-")[0]
            cpu_kernels.set_activations(kind)
    return results


def _run_kind(
    lm: LoadedModel, prompt_len: int, gen_len: int, repeats: int, batches: list[int], seed: int,
    kv_dtypes: tuple[str, ...], bandwidth: Callable[[], float] | None,
) -> list[Result]:
    weight_bytes = weight_bytes_per_step(lm.model)
    label = weights_label(lm.model)
    if cpu_kernels.applies() and label.startswith("quantized"):
        label += f", {cpu_kernels.activations()} x"
    rng = np.random.default_rng(seed)
    results = []
    for kv_dtype, b in ((kv, b) for kv in kv_dtypes for b in batches):
        engine = _engine(lm, b, prompt_len, gen_len, kv_dtype)
        _generate(engine, rng, lm, b, min(prompt_len, 32), min(gen_len, 4))  # warm-up: first-call costs
        per_token_kv = kv_bytes_per_token(lm.model, engine.kv_dtype)  # the pool as allocated
        result = Result(
            "mlx-infer", label, b, weight_bytes=weight_bytes, kv_bytes_per_token=per_token_kv,
            decode_context=prompt_len + gen_len / 2, kv=dtype_name(engine.kv_dtype),
        )
        for _ in range(repeats):
            if bandwidth is not None:
                result.bandwidth.append(bandwidth())
            prefill_s, decode_s = _generate(engine, rng, lm, b, prompt_len, gen_len)
            result.prefill.append(b * prompt_len / prefill_s)
            if gen_len > 1:
                result.decode.append(b * (gen_len - 1) / decode_s)
        results.append(result)
    return results


def profile_ops(lm: LoadedModel, batch: int, prompt_len: int) -> OpProfile:
    """Count the MLX primitives in one decode step's graph (model, KV writes and sampling).

    The graph is caught just before the runner hands it to MLX: ``mx.eval``/``mx.async_eval`` as the
    runner module sees them are wrapped for that one step, and ``mx.export_to_dot`` writes the
    not-yet-evaluated graph, whose primitive nodes are counted.
    """
    import mlx_infer.engine.runner as runner_module

    engine = _engine(lm, batch, prompt_len, 2)
    rng = np.random.default_rng(1)
    for ids in _prompts(rng, lm, batch, prompt_len):
        engine.add_request(ids, SamplingParams(max_tokens=2, ignore_eos=True))
    engine.step()  # prefill
    dot = Path(f"/tmp/mlx-infer-bench-step-{batch}.dot")
    captured: list[bool] = []

    class _Capture:
        def __getattr__(self, name: str):
            return getattr(mx, name)

        def _export(self, arrays) -> None:
            if not captured:
                flat = [a for a in _flatten(arrays) if isinstance(a, mx.array)]
                mx.export_to_dot(str(dot), *flat)
                captured.append(True)

        def eval(self, *arrays) -> None:
            self._export(arrays)
            mx.eval(*arrays)

        def async_eval(self, *arrays) -> None:
            self._export(arrays)
            mx.async_eval(*arrays)

    runner_module.mx = _Capture()
    try:
        engine.step()  # one decode step of every sequence
    finally:
        runner_module.mx = mx
    if not captured:
        raise RuntimeError("the runner evaluated its step without mx.eval/mx.async_eval: update profile_ops")
    lines = dot.read_text().splitlines()
    ops = Counter(line.split('label ="')[1].split('"')[0] for line in lines if "shape=rectangle" in line)
    dot.unlink()
    return OpProfile(batch, sum(ops.values()), dict(ops.most_common()))


def _engine(lm: LoadedModel, batch: int, prompt_len: int, gen_len: int, kv_dtype: str = "auto") -> Engine:
    block = 16
    per_seq = math.ceil((prompt_len + gen_len) / block) + 1
    config = EngineConfig(
        block_size=block,
        num_blocks=batch * per_seq + 1,
        enable_prefix_caching=False,  # random prompts never share blocks; keep the cache out of it
        kv_cache_dtype=kv_dtype,
        scheduler=SchedulerConfig(
            max_num_seqs=max(batch, SchedulerConfig.max_num_seqs),
            max_num_batched_tokens=max(batch * prompt_len, SchedulerConfig.max_num_batched_tokens),
        ),
    )
    return Engine(lm.model, lm.tokenizer, lm.max_context, config)


def _prompts(rng: np.random.Generator, lm: LoadedModel, batch: int, prompt_len: int) -> list[list[int]]:
    vocab = int(lm.config.get("vocab_size") or lm.tokenizer.vocab_size)
    return [rng.integers(0, vocab, prompt_len).tolist() for _ in range(batch)]


def _generate(
    engine: Engine, rng: np.random.Generator, lm: LoadedModel, batch: int, prompt_len: int, gen_len: int
) -> tuple[float, float]:
    """Seconds until every sequence has its first token, then seconds for the remaining tokens."""
    ids = [engine.add_request(p, SamplingParams(max_tokens=gen_len, ignore_eos=True))
           for p in _prompts(rng, lm, batch, prompt_len)]
    pending = set(ids)
    start = time.perf_counter()
    while pending:
        pending -= {o.request_id for o in engine.step()}
    first = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return first - start, time.perf_counter() - first


def _flatten(tree) -> list:
    if isinstance(tree, (list, tuple)):
        return [leaf for item in tree for leaf in _flatten(item)]
    if isinstance(tree, dict):
        return [leaf for item in tree.values() for leaf in _flatten(item)]
    return [tree]
