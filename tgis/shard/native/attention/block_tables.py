"""The persistent batch state of the native engine: every live sequence's KV block table as
one row of a numpy array, updated in place from each step's diff.

A Step names only the blocks a sequence gained, so a row is written where the sequence's
table grows (or from column 0 when it is resumed after a preemption) and never rebuilt.
``flatten`` then lays out the scheduled tokens of a step with numpy in bulk (positions, KV
slots, the step's tables: an ``attention.BatchLayout``) instead of per-token Python, and
``BatchLayout.to_device`` moves the step's integer inputs to the device in one copy.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf

import numpy as np

from tgis.shard.native.attention.interface import BatchLayout
from tgis.shard.step.plan import WorkItem


class BlockTables:
    """Rows of block ids by request id; rows and columns grow on demand."""

    def __init__(self, rows: int = 64, columns: int = 64) -> None:
        self.table = np.zeros((rows, columns), dtype=np.int64)
        self.row_of: dict[int, int] = {}
        self._free_rows = list(range(rows - 1, -1, -1))

    def row(self, request_id: int) -> int:
        """The sequence's row (allocated at its first step)."""
        row = self.row_of.get(request_id)
        if row is None:
            if not self._free_rows:
                old = self.table.shape[0]
                self.table = np.concatenate([self.table, np.zeros_like(self.table)])
                self._free_rows = list(range(2 * old - 1, old - 1, -1))
            row = self._free_rows.pop()
            self.row_of[request_id] = row
        return row

    def write(self, row: int, first: int, block_ids: SequenceOf[int]) -> None:
        """Put ``block_ids`` at columns ``first ..`` of ``row``."""
        end = first + len(block_ids)
        if end > self.table.shape[1]:
            grow = max(end, 2 * self.table.shape[1]) - self.table.shape[1]
            self.table = np.pad(self.table, ((0, 0), (0, grow)))
        self.table[row, first:end] = block_ids

    def release(self, request_id: int) -> None:
        """Forget a sequence (finished or failed); its row is reused."""
        row = self.row_of.pop(request_id, None)
        if row is not None:
            self._free_rows.append(row)

    def clear(self) -> None:
        for request_id in list(self.row_of):
            self.release(request_id)


def flatten(work: SequenceOf[WorkItem], tables: BlockTables, block_size: int) -> BatchLayout:
    """Write the step's new blocks into ``tables`` and lay out its tokens."""
    count = len(work)
    rows = np.empty(count, dtype=np.int64)
    starts = np.empty(count, dtype=np.int64)
    ends = np.empty(count, dtype=np.int64)
    ids: list[int] = []
    for i, item in enumerate(work):
        seq = item.seq
        row = tables.row(seq.request_id)
        rows[i] = row
        starts[i] = item.start
        ends[i] = item.end
        if item.new_block_ids:
            tables.write(row, item.prior_blocks, item.new_block_ids)
        if item.end - item.start == 1 and not item.drafts:
            ids.append(seq.token_ids[item.start])
        else:
            ids.extend(item.input_ids())
    lens = ends - starts
    query_starts = np.cumsum(lens) - lens
    total = int(lens.sum())
    positions = np.arange(total, dtype=np.int64) + np.repeat(starts - query_starts, lens)
    max_blocks = int(-(-ends.max() // block_size)) if count else 0
    step_tables = tables.table[rows, :max_blocks]
    token_seq = np.repeat(np.arange(count), lens)
    blocks = step_tables[token_seq, positions // block_size]
    return BatchLayout(
        input_ids=np.asarray(ids, dtype=np.int64),
        positions=positions,
        slot_mapping=blocks * block_size + positions % block_size,
        query_lens=lens,
        context_lens=ends,
        query_starts=query_starts,
        block_tables=step_tables,
    )
