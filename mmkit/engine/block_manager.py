"""BlockManager: fixed-size KV blocks, a free list, ref counts and copy-on-write.

A block holds `block_size` consecutive token positions of one sequence (for every layer).
Sequences forked from one prompt (n > 1) share the prompt's blocks; a shared block is
copied before a sequence writes into it.
"""

from __future__ import annotations

from collections import deque

from mmkit.engine.sequence import Sequence


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return (num_tokens + block_size - 1) // block_size


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.ref_counts: list[int] = [0] * num_blocks

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def num_new_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks to take from the free list so `seq` can write `num_new_tokens` more tokens."""
        end = seq.num_computed_tokens + num_new_tokens
        needed = blocks_needed(end, self.block_size) - len(seq.block_table)
        if num_new_tokens > 0 and self._first_write_is_shared(seq):
            needed += 1  # copy-on-write of the shared partial block
        return max(needed, 0)

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.num_new_blocks(seq, num_new_tokens) <= self.num_free_blocks

    # ------------------------------------------------------------------ mutations
    def allocate(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]]:
        """Extend `seq`'s block table to cover its next `num_new_tokens` positions.

        Returns the (src, dst) block copies the runner must do first (copy-on-write).
        """
        copies: list[tuple[int, int]] = []
        if num_new_tokens > 0 and self._first_write_is_shared(seq):
            idx = seq.num_computed_tokens // self.block_size
            src = seq.block_table[idx]
            dst = self._take()
            self._release(src)
            seq.block_table[idx] = dst
            copies.append((src, dst))
        end = seq.num_computed_tokens + num_new_tokens
        while len(seq.block_table) < blocks_needed(end, self.block_size):
            seq.block_table.append(self._take())
        return copies

    def fork(self, parent: Sequence, child: Sequence) -> None:
        child.block_table = list(parent.block_table)
        for block_id in child.block_table:
            self.ref_counts[block_id] += 1

    def free(self, seq: Sequence) -> None:
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table = []

    # ------------------------------------------------------------------ internals
    def _first_write_is_shared(self, seq: Sequence) -> bool:
        idx = seq.num_computed_tokens // self.block_size
        return idx < len(seq.block_table) and self.ref_counts[seq.block_table[idx]] > 1

    def _take(self) -> int:
        if not self.free_block_ids:
            raise RuntimeError("BlockManager: out of KV blocks (the scheduler should have preempted)")
        block_id = self.free_block_ids.popleft()
        assert self.ref_counts[block_id] == 0, f"block {block_id} on the free list is referenced"
        self.ref_counts[block_id] = 1
        return block_id

    def _release(self, block_id: int) -> None:
        count = self.ref_counts[block_id]
        if count <= 0:
            raise RuntimeError(f"BlockManager: block {block_id} freed twice")
        self.ref_counts[block_id] = count - 1
        if count == 1:
            self.free_block_ids.append(block_id)
