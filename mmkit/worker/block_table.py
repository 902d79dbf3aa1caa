"""BlockTables: the runner's block tables as rows of one persistent int64 tensor (vLLM v1's
`BlockTable`), written only where a block is added or freed.

A step's decode metadata is then one row gather in C (`gather`), instead of re-flattening
every sequence's whole table in Python each step (O(batch x blocks) Python work per step,
O(length^2) over a request's life). Rows and columns grow by doubling as sequences and
tables grow; entries past a row's length are always 0 (block 0 is the decode padding).
"""

from __future__ import annotations

import torch


class BlockTables:
    def __init__(self, num_rows: int = 16, num_cols: int = 16) -> None:
        self._table = torch.zeros(num_rows, num_cols, dtype=torch.long)  # [rows, max blocks]
        self._np = self._table.numpy()  # the same memory: element writes without torch's overhead
        self._row_of: dict[int, int] = {}  # seq_id -> row
        self._num_blocks: dict[int, int] = {}  # seq_id -> entries written in its row
        self._free_rows = list(range(num_rows - 1, -1, -1))

    def set_table(self, seq_id: int, block_ids: list[int] | tuple[int, ...]) -> None:
        """`seq_id`'s whole table (a new or rebuilt sequence)."""
        row = self._row_of.get(seq_id)
        if row is None:
            row = self._row_of[seq_id] = self._take_row()
        else:
            self._np[row, :self._num_blocks[seq_id]] = 0
        self._num_blocks[seq_id] = 0
        self.append(seq_id, block_ids)

    def append(self, seq_id: int, block_ids: list[int] | tuple[int, ...]) -> None:
        if not block_ids:
            return
        start = self._num_blocks[seq_id]
        end = start + len(block_ids)
        self._grow_cols(end)
        self._np[self._row_of[seq_id], start:end] = block_ids
        self._num_blocks[seq_id] = end

    def remove(self, seq_id: int) -> None:
        row = self._row_of.pop(seq_id, None)
        if row is not None:
            self._np[row, :self._num_blocks.pop(seq_id)] = 0
            self._free_rows.append(row)

    def row(self, seq_id: int) -> torch.Tensor:
        """[num_blocks] `seq_id`'s table (a view: valid until the next write)."""
        return self._table[self._row_of[seq_id], :self._num_blocks[seq_id]]

    def gather(self, seq_ids: list[int], num_blocks: list[int]) -> torch.Tensor:
        """[len(seq_ids) * max(num_blocks)]: the first `num_blocks[i]` entries of each table,
        padded with block 0 to the widest, flattened row-major."""
        width = max(num_blocks)
        rows = [self._row_of[s] for s in seq_ids]
        out = self._np[rows, :width]  # a copy: [num_seqs, width]
        for i, (seq_id, n) in enumerate(zip(seq_ids, num_blocks)):
            if self._num_blocks[seq_id] > n:  # the table reaches past what is read: pad
                out[i, n:] = 0
        return torch.from_numpy(out).reshape(-1)

    def _take_row(self) -> int:
        if not self._free_rows:
            rows, cols = self._table.shape
            self._resize(2 * rows, cols)
            self._free_rows = list(range(2 * rows - 1, rows - 1, -1))
        return self._free_rows.pop()

    def _grow_cols(self, num_cols: int) -> None:
        rows, cols = self._table.shape
        if num_cols > cols:
            self._resize(rows, max(num_cols, 2 * cols))

    def _resize(self, rows: int, cols: int) -> None:
        old = self._table
        self._table = torch.zeros(rows, cols, dtype=torch.long)
        self._table[:old.shape[0], :old.shape[1]] = old
        self._np = self._table.numpy()
