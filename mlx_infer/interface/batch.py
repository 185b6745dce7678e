"""A step's batch as every layer and kernel sees it (:class:`BatchMetadata`), and its host-side
construction from per-sequence block tables (:func:`build_metadata`)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import mlx.core as mx
import numpy as np


@dataclass
class BatchMetadata:
    """One model step over ``B`` sequences whose new tokens are flattened into ``T`` rows.

    Host-built once per step (numpy) by the model runner; all arrays are int32.
    """

    positions: mx.array  # [T] absolute position of each new token (RoPE, causal and window masks)
    slot_mapping: mx.array  # [T] flat pool slot (block * block_size + offset) receiving each token's K/V
    block_tables: mx.array  # [B, max_blocks] physical block of each logical block (padding: 0)
    context_lens: mx.array  # [B] tokens in the cache once this step's tokens are written
    query_lens: tuple[int, ...]  # host copy: new tokens per sequence (sum = T)
    key_slots: mx.array  # [B, L] pool slot of logical key position j (L = max_blocks * block_size)
    q_pad_index: mx.array | None  # [B, Qmax] row of T for each padded query (None when every Q is 1)
    q_unpad_index: mx.array | None  # [T] row of the padded [B * Qmax] layout for each token
    q_positions: mx.array  # [B, Qmax] position of each padded query (padding: 0, so no row is fully masked)
    logits_index: mx.array | None  # rows of T whose logits are wanted (None: all rows)
    block_size: int
    state_slots: mx.array | None = None  # [B] recurrent-state slot of each sequence (interface/state.py)
    # The same step paged by the sliding-window layers' own block tables (their pool keeps only the
    # blocks inside the window; kv/window.py): block_tables, key_slots and slot_mapping differ.
    windowed: BatchMetadata | None = None

    def pages(self, windowed: bool) -> BatchMetadata:
        """The metadata that pages a pool: a windowed pool's (``LayerKV.windowed``) or the main one's."""
        if not windowed:
            return self
        if self.windowed is None:
            raise ValueError("a windowed KV pool needs the batch's windowed block tables")
        return self.windowed

    @property
    def batch_size(self) -> int:
        return len(self.query_lens)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens)


@dataclass
class SequenceSlice:
    """What one sequence contributes to a step."""

    block_table: list[int]  # physical blocks, in logical order, covering at least context_len tokens
    num_computed: int  # tokens already in the cache before this step
    num_new: int  # tokens this step appends (and computes)
    want_all_logits: bool = False  # logits for every new token instead of only the last one
    state_slot: int | None = None  # recurrent-state slot (hybrid models); None: the sequence's batch index
    # Blocks of the sliding-window layers' pool, in logical order; a block lying wholly before the window
    # was given back and a placeholder stands in (its positions are masked, so any block may).
    window_table: list[int] | None = None


def build_metadata(slices: list[SequenceSlice], block_size: int) -> BatchMetadata:
    query_lens = tuple(s.num_new for s in slices)
    batch, q_max = len(slices), max(query_lens)
    context_lens = np.array([s.num_computed + s.num_new for s in slices], dtype=np.int32)
    max_blocks = max(-(-int(c) // block_size) for c in context_lens)
    positions = np.concatenate(
        [np.arange(s.num_computed, s.num_computed + s.num_new, dtype=np.int32) for s in slices]
    )
    seq_of_token = np.repeat(np.arange(batch), query_lens)
    block_tables, key_slots, slot_mapping = _paging(
        [s.block_table for s in slices], block_size, max_blocks, seq_of_token, positions
    )

    starts = np.concatenate([[0], np.cumsum(query_lens)[:-1]]).astype(np.int32)
    q_positions = np.zeros((batch, q_max), dtype=np.int32)
    if q_max == 1:
        q_pad_index = q_unpad_index = None
        q_positions[:, 0] = positions
    else:
        col = np.arange(q_max, dtype=np.int32)[None, :]
        valid = col < np.array(query_lens)[:, None]
        pad_index = np.where(valid, starts[:, None] + col, starts[:, None])
        q_positions = np.where(valid, positions[pad_index], 0).astype(np.int32)
        token_col = np.arange(len(positions), dtype=np.int32) - np.repeat(starts, query_lens)
        q_unpad_index = mx.array((seq_of_token * q_max + token_col).astype(np.int32))
        q_pad_index = mx.array(pad_index.astype(np.int32))

    if any(s.want_all_logits for s in slices):
        rows = np.concatenate(
            [
                np.arange(st, st + s.num_new) if s.want_all_logits else np.array([st + s.num_new - 1])
                for st, s in zip(starts, slices)
            ]
        )
        logits_index = None if len(rows) == len(positions) else mx.array(rows.astype(np.int32))
    else:
        last = starts + np.array(query_lens, dtype=np.int32) - 1
        logits_index = None if q_max == 1 else mx.array(last.astype(np.int32))

    meta = BatchMetadata(
        positions=mx.array(positions),
        slot_mapping=slot_mapping,
        block_tables=block_tables,
        context_lens=mx.array(context_lens),
        query_lens=query_lens,
        key_slots=key_slots,
        q_pad_index=q_pad_index,
        q_unpad_index=q_unpad_index,
        q_positions=mx.array(q_positions),
        logits_index=logits_index,
        block_size=block_size,
        state_slots=mx.array(
            [i if s.state_slot is None else s.state_slot for i, s in enumerate(slices)], dtype=mx.int32
        ),
    )
    if slices[0].window_table is None:
        return meta
    tables, key_slots, slot_mapping = _paging(
        [s.window_table for s in slices], block_size, max_blocks, seq_of_token, positions
    )
    meta.windowed = replace(meta, block_tables=tables, key_slots=key_slots, slot_mapping=slot_mapping)
    return meta


def _paging(
    tables: list[list[int]],
    block_size: int,
    max_blocks: int,
    seq_of_token: np.ndarray,
    positions: np.ndarray,
) -> tuple[mx.array, mx.array, mx.array]:
    """(block tables ``[B, max_blocks]``, key slots ``[B, L]``, slot mapping ``[T]``) of one pool's
    per-sequence block tables; padding reads block 0, masked."""
    block_tables = np.zeros((len(tables), max_blocks), dtype=np.int32)
    for i, table in enumerate(tables):
        row = table[:max_blocks]
        block_tables[i, : len(row)] = row
    offsets = np.arange(block_size, dtype=np.int32)
    key_slots = (block_tables[:, :, None] * block_size + offsets).reshape(len(tables), -1)
    slot_mapping = key_slots[seq_of_token, positions]
    return tuple(mx.array(a.astype(np.int32)) for a in (block_tables, key_slots, slot_mapping))
