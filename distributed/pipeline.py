"""Pipeline parallel: each rank keeps a contiguous range of layers; the hidden state goes round the ring.

Rank 0 embeds the tokens, runs its layers and sends the hidden state to rank 1; every rank runs its layers
and passes the result on; the last rank sends back only the rows whose logits are wanted, to rank 0 (its
ring neighbour), which applies the final norm and head and samples. The ring backend connects only
neighbours, and this path only ever sends from rank r to rank r + 1 (mod n).

So rank 0 keeps the embedding, the final norm and the head (tied or not) and the other ranks only their
layers: everything else is dropped before the lazily loaded weights are evaluated, so it is never read.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from itertools import accumulate

import mlx.core as mx
import mlx.nn as nn

from mlx_infer.errors import DistributedError
from mlx_infer.interface.batch import BatchMetadata
from mlx_infer.interface.kv import KVSpec, LayerKV
from mlx_infer.models.base import select_rows

from .traffic import Traffic


@dataclass
class PipelineShard:
    group: mx.distributed.Group
    start: int  # this rank's layers are [start, stop) of the full model
    stop: int
    hidden_size: int
    dtype: mx.Dtype  # the activations' dtype (the KV cache's follows from it: runner.kv_pool_dtype)
    traffic: Traffic = field(default_factory=Traffic)

    @property
    def rank(self) -> int:
        return self.group.rank()

    @property
    def size(self) -> int:
        return self.group.size()

    def leader(
        self, model: nn.Module, tokens: mx.array, cache: list[LayerKV], meta: BatchMetadata
    ) -> mx.array:
        """Rank 0's step: embed, own layers, send on; then the returning rows -> final norm and head."""
        h = _run_layers(model, model.embed(tokens), cache, meta)
        sent = self._send(h, 1)
        # Queue the send before the receive below: the CPU stream runs in submission order, and the
        # receive would otherwise wait for rows the other ranks cannot compute yet.
        mx.async_eval(sent, *[a for kv in cache for a in kv.state()])
        back = mx.distributed.recv(
            (_logit_rows(meta, tokens.shape[0]), self.hidden_size),
            self.dtype,
            self.size - 1,
            group=self.group,
        )
        # Consumed even when the runner wants no logits this step, so the next step's receive gets its own.
        mx.async_eval(back)
        return model.logits(back, replace(meta, logits_index=None))

    def follower(
        self, model: nn.Module, tokens: mx.array, cache: list[LayerKV], meta: BatchMetadata
    ) -> list[mx.array]:
        """Another rank's step: receive, own layers, send on (the last rank: the logit rows, to rank 0)."""
        h = mx.distributed.recv(
            (tokens.shape[0], self.hidden_size), self.dtype, self.rank - 1, group=self.group
        )
        h = _run_layers(model, h, cache, meta)
        last = self.rank == self.size - 1
        sent = self._send(select_rows(h, meta) if last else h, (self.rank + 1) % self.size)
        return [sent, *[a for kv in cache for a in kv.state()]]

    def _send(self, h: mx.array, dst: int) -> mx.array:
        self.traffic.add(h.nbytes)
        return mx.distributed.send(h, dst, group=self.group)


def layer_ranges(num_layers: int, weights: list[float]) -> list[tuple[int, int]]:
    """Contiguous layer ranges, one per rank, sized in proportion to ``weights`` (at least one layer each)."""
    n = len(weights)
    if num_layers < n:
        raise DistributedError(
            f"pipeline over {n} ranks needs at least {n} layers; the model has {num_layers}"
        )
    if any(w <= 0 for w in weights):
        raise DistributedError("pipeline weights must be positive")
    total = sum(weights)
    bounds = [round(num_layers * c / total) for c in accumulate(weights)]
    bounds[-1] = num_layers
    # Every rank keeps at least one layer: push boundaries up from the front, then down from the back.
    for i in range(n):
        bounds[i] = max(bounds[i], (bounds[i - 1] if i else 0) + 1)
    for i in range(n - 1, -1, -1):
        bounds[i] = min(bounds[i], num_layers - (n - 1 - i))
    return list(zip([0, *bounds[:-1]], bounds))


def shard_pipeline(
    model: nn.Module, group: mx.distributed.Group, weights_fraction: list[float] | None = None
) -> PipelineShard:
    """Keep this rank's layers of ``model`` (in place) and drop what the rank does not run.

    ``weights_fraction``: one positive number per rank (e.g. each host's memory); None splits evenly.
    """
    size, rank = group.size(), group.rank()
    weights = weights_fraction or [1.0] * size
    if len(weights) != size:
        raise DistributedError(f"pipeline weights name {len(weights)} ranks but the group has {size}")
    ranges = layer_ranges(len(model.layers), weights)
    start, stop = ranges[rank]
    layout = _stage_layout(model, ranges, rank)
    dtype = model.embed(mx.array([0])).dtype  # lazy: only the dtype is read, nothing is evaluated
    owner = _layers_owner(model)
    owner.layers = model.layers[start:stop]
    model.kv_layout = lambda: layout  # an instance attribute shadows the method
    if rank != 0:
        for parent, name in ((owner, "embed_tokens"), (owner, "norm"), (model, "lm_head")):
            parent.pop(name, None)
    return PipelineShard(group, start, stop, model.args.hidden_size, dtype)


def _stage_layout(model: nn.Module, ranges: list[tuple[int, int]], rank: int) -> list[KVSpec]:
    """The K/V layout of ``rank``'s layers, a sharing layer's source renumbered within the stage.

    Refuses what a stage cannot run: layers that take per-layer inputs (Gemma 4's), which travel
    beside the hidden state, and a layer reading the K/V of a layer another stage holds (checked
    for every stage, so that every rank refuses alike)."""
    name = getattr(model.args, "model_type", type(model).__module__)
    if getattr(model, "needs_per_layer_inputs", False):
        raise DistributedError(
            f"{name}: its layers take per-layer inputs beside the hidden state, which a pipeline does not "
            "pass between stages; run it in one process"
        )
    layout = model.kv_layout()
    for first, last in ranges:
        for i in range(first, last):
            source = layout[i].source
            if source is not None and not first <= source < last:
                raise DistributedError(
                    f"{name}: layer {i} reads the K/V of layer {source}, which another pipeline stage "
                    f"holds (stages {ranges}); weight the hosts so both fall in one stage, or run it in "
                    "one process"
                )
    start, stop = ranges[rank]
    return [s if s.source is None else replace(s, source=s.source - start) for s in layout[start:stop]]


def _layers_owner(model: nn.Module) -> nn.Module:
    """The submodule holding the ``layers`` list (``model.model`` in every architecture of the zoo)."""
    for child in model.children().values():
        if isinstance(child, nn.Module) and child.get("layers") is model.layers:
            return child
    raise DistributedError(f"{type(model).__module__}: cannot find the module that holds the layers")


def _run_layers(model: nn.Module, h: mx.array, cache: list[LayerKV], meta: BatchMetadata) -> mx.array:
    for layer, kv in zip(model.layers, cache):
        h = layer(h, kv, meta)
    return h


def _logit_rows(meta: BatchMetadata, num_tokens: int) -> int:
    return num_tokens if meta.logits_index is None else meta.logits_index.shape[0]
