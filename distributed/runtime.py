"""A distributed run: join the group, load this rank's shard, then drive (rank 0) or follow (the others).

Rank 0 owns tokenization, scheduling and sampling: its :class:`~mlx_infer.engine.engine.Engine` drives a
:class:`ShardedModel`, which broadcasts each step's batch before running the sharded forward, so the
engine, the scheduler, prefix caching and the continuous batcher work unchanged (and ``serve`` does too).
The other ranks run :meth:`Session.follow`: receive a step, run the same forward on their shard, repeat.
KV pools are per rank (each holds its layers' or heads' K/V) and have the same number of blocks everywhere,
because rank 0's block tables index every rank's pool; so do hybrid models' state slots (each holds its
layers' or heads' state), indexed by rank 0's slot pool.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlx_infer.engine.engine import Engine, EngineConfig, hybrid_state, pool_num_blocks, window_pool_size
from mlx_infer.engine.runner import kv_bytes_per_token, kv_pool_dtype
from mlx_infer.errors import DistributedError
from mlx_infer.interface.batch import BatchMetadata
from mlx_infer.interface.kv import LayerKV, window_of
from mlx_infer.kv.memory import device_memory_bytes
from mlx_infer.kv.pages import allocate_pools
from mlx_infer.loading import LoadedModel, load

from .channel import StepChannel
from .pipeline import PipelineShard, shard_pipeline
from .tensor import TensorShard, shard_tensor

log = logging.getLogger("mlx_infer")

STRATEGIES = ("pipeline", "tensor")
# Set by `mlx-infer launch` for every rank (next to MLX_RANK and the backend's own variables).
STRATEGY_ENV = "MLX_INFER_STRATEGY"
BACKEND_ENV = "MLX_INFER_BACKEND"
# Host files launch writes on each host; a rank deletes its own once it has joined.
TEMP_PREFIX = "mlx-infer-hosts."
LAUNCHER_PID_ENV = "MLX_INFER_LAUNCHER_PID"  # set for a rank `launch` started on its own machine
# How long a rank waits for the group to form: MLX's join waits forever for a peer that never comes (an
# ssh that connected but never started its rank), and nothing else would end the wait.
JOIN_TIMEOUT_ENV = "MLX_INFER_JOIN_TIMEOUT"
JOIN_TIMEOUT_S = 120.0
Shard = PipelineShard | TensorShard


def init_group() -> mx.distributed.Group | None:
    """The group this process was launched into, or None for a single process.

    Joins strictly: a rank that cannot reach its peers fails loudly instead of running alone.
    """
    backend = os.environ.get(BACKEND_ENV, "ring")
    if "MLX_RANK" not in os.environ:
        return None
    _stop_with_the_launcher()
    rank = os.environ["MLX_RANK"]
    timeout = float(os.environ.get(JOIN_TIMEOUT_ENV, JOIN_TIMEOUT_S))
    message = (
        f"error: rank {rank}: the {backend} group did not form within {timeout:.0f} s (a peer never joined: "
        f"is every host's rank running and reachable? ${JOIN_TIMEOUT_ENV} sets the wait)"
    )
    # MLX's join holds the interpreter (no thread of this process could act): a process of its own
    # waits for the join to end (its stdin closed) and, when it does not in time, says so and ends this.
    watchdog = subprocess.Popen(
        [sys.executable, "-c", _WATCHDOG, str(timeout), message, str(os.getpid())], stdin=subprocess.PIPE
    )
    try:
        group = mx.distributed.init(strict=True, backend=backend)
    except RuntimeError as e:
        raise DistributedError(f"rank {rank}: cannot join the {backend} group ({e})") from None
    finally:
        watchdog.stdin.close()
        watchdog.wait()
    for name in ("MLX_HOSTFILE", "MLX_IBV_DEVICES"):
        path = Path(os.environ.get(name, ""))
        if path.name.startswith(TEMP_PREFIX):
            path.unlink(missing_ok=True)
    return group if group.size() > 1 else None


_WATCHDOG = """
import os, select, signal, sys
timeout, message, pid = float(sys.argv[1]), sys.argv[2], int(sys.argv[3])
if not select.select([sys.stdin], [], [], timeout)[0]:
    print(message, file=sys.stderr, flush=True)
    os.kill(pid, signal.SIGKILL)
"""


def _stop_with_the_launcher() -> None:
    """A rank started by ``launch`` on this machine stops (SIGTERM, as ``launch`` would stop it) once
    ``launch`` is gone without stopping it (SIGKILL): its ranks run in sessions of their own, so nothing
    else would end them, and rank 0's end then ends the others' ("lost rank 0")."""
    launcher = int(os.environ.get(LAUNCHER_PID_ENV, "-1"))
    if os.getppid() != launcher:
        return

    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="mlx-infer-launcher-watch", daemon=True).start()


class ShardedModel:
    """Rank 0's model: the model contract (``__call__``, ``embed``, ``layers``, ``kv_layout``) over the group.

    Each call first broadcasts the step, then runs rank 0's part of the sharded forward.
    """

    def __init__(self, model: nn.Module, shard: Shard, channel: StepChannel):
        self.model, self.shard, self.channel = model, shard, channel

    def __call__(self, tokens: mx.array, cache: list[LayerKV], meta: BatchMetadata) -> mx.array:
        self.channel.send_step(np.array(tokens), meta)
        return self.shard.leader(self.model, tokens, cache, meta)

    def __getattr__(self, name: str):
        return getattr(self.model, name)


@dataclass
class Session:
    loaded: LoadedModel  # this rank's shard (model) and the tokenizer
    group: mx.distributed.Group
    shard: Shard
    channel: StepChannel
    config: EngineConfig  # num_blocks agreed by all ranks
    window_blocks: int | None = None  # a follower's sliding-window pool, once follow() allocated it

    @property
    def rank(self) -> int:
        return self.group.rank()

    def engine(self) -> Engine:
        """Rank 0's engine over the whole group."""
        model = ShardedModel(self.loaded.model, self.shard, self.channel)
        return Engine(model, self.loaded.tokenizer, self.loaded.max_context, self.config)

    def follow(self) -> None:
        """Run rank 0's steps on this rank's shard until rank 0 closes the session."""
        model = self.loaded.model  # prepared by the loader as rank 0's: the same kernels on every rank
        # Resident only where written, as rank 0's pools (kv/pages.py); a follower never releases.
        config = self.config
        kv_dtype = kv_pool_dtype(config.kv_cache_dtype, self.shard.dtype)  # as rank 0's engine resolves it
        # Hybrid models: as many state slots as rank 0's slot pool hands out.
        slots = max(1, hybrid_state(model, config)[0])
        # Sliding-window layers: a pool of their own as large as rank 0's, paged by its windowed tables.
        window = window_of(model.kv_layout()) if config.window_pool else None
        self.window_blocks = None if window is None else window_pool_size(config, window, config.num_blocks)
        cache = allocate_pools(
            model, config.num_blocks, config.block_size, kv_dtype, slots, self.window_blocks
        )
        try:
            while (step := self.channel.receive()) is not None:
                tokens, meta = step
                mx.eval(self.shard.follower(model, tokens, cache, meta))
        except RuntimeError as e:  # how the ring backend reports a peer that went away
            raise DistributedError(f"rank {self.rank}: {e}") from None

    def close(self) -> None:
        """Rank 0: let the followers return."""
        self.channel.send_stop()


def open_session(
    spec: str,
    group: mx.distributed.Group,
    config: EngineConfig,
    strategy: str | None = None,
    keep_quantized: bool | None = None,
) -> Session:
    """Load this rank's shard of ``spec`` and agree on the KV pool size with the other ranks."""
    strategy = strategy or os.environ.get(STRATEGY_ENV, "pipeline")
    if strategy not in STRATEGIES:
        raise DistributedError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    if strategy == "pipeline":
        # Layers in proportion to each host's memory.
        memory = mx.distributed.all_gather(mx.array([device_memory_bytes() / 2**30]), group=group)
        weights = memory.tolist()

        def transform(m: nn.Module) -> Shard:
            return shard_pipeline(m, group, weights)
    else:

        def transform(m: nn.Module) -> Shard:
            return shard_tensor(m, group)

    loaded, shard = load_sharded(spec, transform, keep_quantized)
    if isinstance(shard, PipelineShard):
        log.info("rank %d: layers %d-%d of the model", group.rank(), shard.start, shard.stop - 1)
    context = min(loaded.max_context, config.max_context or loaded.max_context)
    kv_dtype = kv_pool_dtype(config.kv_cache_dtype, shard.dtype)
    per_token = kv_bytes_per_token(loaded.model, kv_dtype)  # this rank's share of the KV
    state_slots, per_sequence = hybrid_state(loaded.model, config)  # this rank's share of each state
    if state_slots and config.enable_prefix_caching:
        # Prefix caching saves and restores recurrent states outside the step (rank 0's runner), which
        # the step broadcast does not carry: each rank's states would diverge.
        log.info("no prefix caching for a hybrid model over several ranks")
        config = replace(config, enable_prefix_caching=False)
    num_blocks = config.num_blocks or pool_num_blocks(config, context, per_token, state_slots * per_sequence)
    # Rank 0's block tables index every pool: all ranks take the smallest pool any of them can hold.
    num_blocks = int(mx.distributed.all_min(mx.array([num_blocks]), group=group).item())
    # Rank 0's windowed block tables page every rank's sliding-window pool: only where every rank's layers
    # have that pool, with the same window (pipeline stages may differ), since its size follows the window.
    window = window_of(loaded.model.kv_layout()) or 0
    bounds = mx.distributed.all_min(mx.array([window, -window]), group=group).tolist()
    if bounds[0] != -bounds[1] or not window:
        config = replace(config, window_pool=False)
    return Session(
        loaded, group, shard, StepChannel(group, shard.traffic), replace(config, num_blocks=num_blocks)
    )


def load_sharded(
    spec: str, transform: Callable[[nn.Module], Shard], keep_quantized: bool | None = None
) -> tuple[LoadedModel, Shard]:
    """``mlx_infer.loading.load`` with ``transform`` applied before the weights are evaluated.

    ``mx.load`` is lazy: weights of the layers a shard drops (or the rows and columns it slices away)
    are never materialized, so a rank's peak memory follows its share of the model.
    """
    shards: list[Shard] = []

    def prepare(model: nn.Module) -> None:
        shards.append(transform(model))

    loaded = load(spec, keep_quantized=keep_quantized, prepare=prepare)
    return loaded, shards[0]
