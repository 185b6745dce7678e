"""Rank 0 tells the other ranks what each step computes, so every rank runs the same forward.

A step travels as int32s: the token ids and what :func:`mlx_infer.interface.batch.build_metadata` needs
(query and context lengths, block tables, the sliding-window pool's block tables where rank 0 has that pool,
recurrent-state slots, and the logit rows when they are not the default), so every rank
builds identical :class:`BatchMetadata`. It is broadcast with ``all_sum`` over a buffer that is zero except
on rank 0: one collective of ``CAPACITY`` ints for a small step, a second one only for the overflow of a big
one. ``all_sum`` reaches every rank whatever the ring's shape, unlike send/recv (neighbours only).
"""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import numpy as np

from mlx_infer.errors import DistributedError
from mlx_infer.interface.batch import BatchMetadata, SequenceSlice, build_metadata

from .traffic import Traffic

CAPACITY = 128  # int32s in the first message: a decode step of about a dozen sequences fits
_STEP, _STOP = 1, 2
_HEAD = 2  # kind, payload length


class StepChannel:
    def __init__(self, group: mx.distributed.Group, traffic: Traffic):
        self.group = group
        self.traffic = traffic

    # ---- rank 0 ------------------------------------------------------------------------------------
    def send_step(self, tokens: np.ndarray, meta: BatchMetadata) -> None:
        self._send(_STEP, encode_step(tokens, meta))

    def send_stop(self) -> None:
        self._send(_STOP, np.zeros(0, np.int32))

    def _send(self, kind: int, payload: np.ndarray) -> None:
        first = np.zeros(CAPACITY, np.int32)
        first[:_HEAD] = kind, payload.size
        room = CAPACITY - _HEAD
        first[_HEAD : _HEAD + min(room, payload.size)] = payload[:room]
        # Not waited for: the stream runs these before the step's forward, in submission order.
        mx.async_eval(self._all_sum(first))
        if payload.size > room:
            mx.async_eval(self._all_sum(payload[room:]))
        if kind == _STOP:
            mx.synchronize()

    # ---- the other ranks ---------------------------------------------------------------------------
    def receive(self) -> tuple[mx.array, BatchMetadata] | None:
        """The next step's (tokens, metadata), or None when rank 0 says stop."""
        first = np.array(self._all_sum(np.zeros(CAPACITY, np.int32)))
        kind, length = int(first[0]), int(first[1])
        if kind == _STOP:
            return None
        if kind != _STEP:  # the ring hands back zeros once rank 0's connection is gone
            raise DistributedError("lost rank 0: its connection closed")
        payload = first[_HEAD : _HEAD + length]
        if length > CAPACITY - _HEAD:
            rest = np.array(self._all_sum(np.zeros(length - (CAPACITY - _HEAD), np.int32)))
            payload = np.concatenate([payload, rest])
        return decode_step(payload)

    def _all_sum(self, values: np.ndarray) -> mx.array:
        self.traffic.add(values.nbytes)
        return mx.distributed.all_sum(mx.array(values), group=self.group)


def encode_step(tokens: np.ndarray, meta: BatchMetadata) -> np.ndarray:
    tables = np.array(meta.block_tables)
    rows = np.zeros(0, np.int32) if meta.logits_index is None else np.array(meta.logits_index)
    head = [
        len(tokens),
        meta.batch_size,
        tables.shape[1],
        meta.block_size,
        -1 if meta.logits_index is None else rows.size,
        meta.windowed is not None,
    ]
    # Hybrid models: rank 0's slot pool picks each sequence's state slot; every rank keeps its own slots.
    slots = np.arange(meta.batch_size) if meta.state_slots is None else np.array(meta.state_slots)
    window_tables = [] if meta.windowed is None else np.array(meta.windowed.block_tables).ravel()
    lengths = [meta.query_lens, np.array(meta.context_lens)]
    parts = [head, tokens, *lengths, slots, tables.ravel(), window_tables, rows]
    return np.concatenate([np.asarray(p, np.int32).ravel() for p in parts])


def decode_step(payload: np.ndarray) -> tuple[mx.array, BatchMetadata]:
    num_tokens, batch, width, block_size, num_rows, windowed = (int(v) for v in payload[:6])
    at = 6
    tokens = payload[at : at + num_tokens]
    at += num_tokens
    query_lens, context_lens = payload[at : at + batch], payload[at + batch : at + 2 * batch]
    slots = payload[at + 2 * batch : at + 3 * batch]
    at += 3 * batch
    tables = payload[at : at + batch * width].reshape(batch, width)
    at += batch * width
    window_tables = None
    if windowed:  # blocks given back appear as block 0, which their masked positions may read
        window_tables = payload[at : at + batch * width].reshape(batch, width)
        at += batch * width
    slices = [
        SequenceSlice(
            tables[i].tolist(),
            int(context_lens[i] - query_lens[i]),
            int(query_lens[i]),
            state_slot=int(slots[i]),
            window_table=None if window_tables is None else window_tables[i].tolist(),
        )
        for i in range(batch)
    ]
    meta = build_metadata(slices, block_size)
    if num_rows >= 0:  # rows other than each sequence's last token (build_metadata's default)
        meta = replace(meta, logits_index=mx.array(payload[at : at + num_rows]))
    return mx.array(tokens), meta
