"""BlockManager: fixed-size KV blocks, a free list, ref counts and the prefix cache (vLLM
v1's KV cache manager).

A block holds `block_size` consecutive token positions (for every layer). A block is shared
only through the prefix cache: full blocks, never written again, so nothing is ever copied
(the n samples of one prompt are independent requests that hit the same cached blocks).
The block manager decides and returns (cached prefixes with the number of tokens they hold,
the new block ids of an allocation); it writes nothing into the scheduler's requests.

Prefix caching: a full block gets a hash chaining its parent's hash, its token ids and,
where it covers image placeholders, each image's content hash and offset (placeholder ids
are the same for every image). A freed block keeps its hash and stays reusable until it is
taken again; the free list is ordered least recently used first, so eviction is LRU.

A freed block without a hash (a sequence's last, partial block; every block when prefix
caching is off) holds nothing worth keeping: it goes to a second free list that is used
first, most recently freed first. Its pages are already resident and warm, so resident
memory follows the blocks in use instead of walking through the pool's never-written blocks
(on CPU the pool is committed page by page on first write; see kv_cache.py).

Block tables are the block manager's own (vLLM v1's `req_to_blocks`): `seq_id -> [block id]`,
written only here; the scheduler reads them (`get_block_ids`, the ids `allocate` returns) to describe a
step, and `Sequence` holds no copy.

Registration is incremental (vLLM v1's `num_cached_block`): each sequence remembers how many
leading blocks were already considered, so a step publishes only the blocks it fills. A full
block whose key another block already publishes stays private; it is retried only when that
key leaves the cache (evicted or forgotten), which gives the same blocks as re-walking every
full block each step, at the cost of the blocks filled instead of the sequence's length.

Sliding windows (vLLM's sliding-window manager): when every layer of the model attends
through a window of W tokens, a block whose positions all lie before the next query's window
(position N - W + 1 once N tokens are computed) is never read again. `free_out_of_window`
releases it and leaves `NULL_BLOCK` at its index in the table, so a long request holds at
most ceil(W / block_size) + 1 blocks while it decodes. A model with any global layer keeps
every block (those layers read the whole context).
"""

from __future__ import annotations

from collections import OrderedDict

from mmkit.engine.sequence import Sequence


NULL_BLOCK = -1  # a block-table entry whose block was freed (entirely out of every window)


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return (num_tokens + block_size - 1) // block_size


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 sliding_window: int | None = None) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window  # set only when every layer slides
        # NOTE: every block with ref count 0 is in `free_blocks` (oldest first); some of
        # them still carry a hash and can be revived by a prefix-cache hit.
        self.free_blocks: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        # Free blocks that were written and carry no hash: taken first, last freed first.
        self.free_unhashed: OrderedDict[int, None] = OrderedDict()
        self.ref_counts: list[int] = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # SHA-256 block key -> block id
        # The block tables: seq_id -> block id per `block_size` positions (NULL_BLOCK: freed out
        # of the window). A sequence holding no block has no entry.
        self.req_to_blocks: dict[int, list[int]] = {}
        # Prefix-cache registration, incremental (see the module docstring):
        self._num_registered: dict[int, int] = {}  # seq_id -> leading table entries considered
        self._private: dict[int, list[int]] = {}  # seq_id -> indices of full blocks kept private
        self._blocked_by: dict[bytes, set[int]] = {}  # published key -> seq ids with a private copy
        self._recheck: set[int] = set()  # seq ids whose private copies may be published now
        self.num_cache_queries = 0  # tokens looked up
        self.num_cache_hits = 0  # tokens found

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        """Blocks not held by a live sequence (evictable cached blocks count as free)."""
        return len(self.free_blocks) + len(self.free_unhashed)

    @property
    def free_block_ids(self) -> list[int]:
        return list(self.free_unhashed) + list(self.free_blocks)

    def get_block_ids(self, seq: Sequence) -> tuple[int, ...]:
        """`seq`'s block table (empty while it holds no block)."""
        return tuple(self.req_to_blocks.get(seq.seq_id, ()))

    def num_new_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks to take from the free list so `seq` can write `num_new_tokens` more tokens."""
        end = seq.num_computed_tokens + num_new_tokens
        return max(blocks_needed(end, self.block_size) - len(self.req_to_blocks.get(seq.seq_id, ())), 0)

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.num_new_blocks(seq, num_new_tokens) <= self.num_free_blocks

    # ------------------------------------------------------------------ prefix cache
    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Blocks holding the longest cached prefix of a sequence that has computed nothing.

        At least one token is always left to compute (its logits are needed).
        """
        if not self.enable_prefix_caching or seq.num_computed_tokens or seq.seq_id in self.req_to_blocks:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hits = []
        for block_hash in seq.block_hashes[:max_blocks]:
            block_id = self.cached.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def can_allocate_with_prefix(self, seq: Sequence, hits: list[int], num_new_tokens: int) -> bool:
        revived = sum(1 for b in hits if self.ref_counts[b] == 0)
        end = len(hits) * self.block_size + num_new_tokens
        fresh = blocks_needed(end, self.block_size) - len(hits)
        return revived + fresh <= self.num_free_blocks

    def use_cached_prefix(self, seq: Sequence, hits: list[int], num_queried: int) -> int:
        """Give `seq` the cached blocks; returns how many of its tokens they hold (the
        scheduler, which owns the sequence, marks them computed)."""
        self.num_cache_queries += num_queried
        self.num_cache_hits += len(hits) * self.block_size
        for block_id in hits:
            if self.ref_counts[block_id] == 0:
                del self.free_blocks[block_id]
            self.ref_counts[block_id] += 1
        if hits:
            self.req_to_blocks[seq.seq_id] = list(hits)
            self._num_registered[seq.seq_id] = len(hits)  # published already
        return len(hits) * self.block_size

    def register_full_blocks(self, seq: Sequence, num_computed: int) -> list[int]:
        """Publish the hashes of `seq`'s blocks that are full once `num_computed` tokens are.

        Called when a step is scheduled: a later sequence of the same step may already hit
        these blocks, because every layer writes the step's K/V before it attends. Returns
        the newly published blocks (`forget` them if the step fails).
        """
        if not self.enable_prefix_caching:
            return []
        seq_id = seq.seq_id
        num_full = min(num_computed // self.block_size, len(seq.block_hashes))
        table = self.req_to_blocks.get(seq_id, [])
        published: list[int] = []
        # NOTE: private copies all lie before the first unconsidered entry, so blocks are
        # visited in table order, as a walk over every full block would visit them.
        if seq_id in self._recheck:
            self._recheck.discard(seq_id)
            for i in self._private.pop(seq_id, ()):
                self._publish(seq, table, i, published)
        first = self._num_registered.get(seq_id, 0)
        for i in range(first, num_full):
            self._publish(seq, table, i, published)
        if num_full > first:
            self._num_registered[seq_id] = num_full
        return published

    def reconsider(self, seq: Sequence) -> None:
        """Walk all of `seq`'s full blocks again at its next registration: the step that
        registered some of them failed (`forget` unpublished them). Rare, so a whole walk once."""
        self._num_registered.pop(seq.seq_id, None)
        self._private.pop(seq.seq_id, None)  # (stale `_blocked_by` entries cost a retry at most)
        self._recheck.discard(seq.seq_id)

    def forget(self, block_ids: list[int]) -> None:
        """Unpublish blocks whose K/V was never computed (the step that would fill them failed)."""
        for block_id in block_ids:
            block_hash = self.block_hash[block_id]
            if block_hash is not None:
                self.block_hash[block_id] = None
                if self.cached.get(block_hash) == block_id:
                    self._uncache(block_hash)

    # ------------------------------------------------------------------ mutations
    def allocate(self, seq: Sequence, num_new_tokens: int) -> list[int]:
        """Extend `seq`'s block table to cover its next `num_new_tokens` positions; returns
        the block ids added (what the runner appends to its copy of the table)."""
        table = self.req_to_blocks.setdefault(seq.seq_id, [])
        first_new = len(table)
        end = seq.num_computed_tokens + num_new_tokens
        while len(table) < blocks_needed(end, self.block_size):
            table.append(self._take())
        if not table:
            del self.req_to_blocks[seq.seq_id]  # nothing to hold (no new token)
        return table[first_new:]

    def free(self, seq: Sequence) -> None:
        # Tail blocks first, so the head of a prefix (shared most often) is evicted last.
        for block_id in reversed(self.req_to_blocks.pop(seq.seq_id, ())):
            if block_id != NULL_BLOCK:
                self._release(block_id)
        self._num_registered.pop(seq.seq_id, None)
        self._recheck.discard(seq.seq_id)
        for i in self._private.pop(seq.seq_id, ()):
            waiting = self._blocked_by.get(seq.block_hashes[i])
            if waiting is not None:
                waiting.discard(seq.seq_id)
                if not waiting:
                    del self._blocked_by[seq.block_hashes[i]]

    def free_out_of_window(self, seq: Sequence) -> int:
        """Release `seq`'s blocks that lie entirely before the window of its next query
        (only when every layer slides). Returns the number of blocks released."""
        if self.sliding_window is None:
            return 0
        first_needed = seq.num_computed_tokens - self.sliding_window + 1  # first key still read
        released = 0
        # NOTE: released blocks always form a prefix of the table (only this releases them, in
        # order), so walk back from the window's start and stop at the first released one: the
        # per-step cost is the blocks released now, not the sequence's length.
        table = self.req_to_blocks.get(seq.seq_id, [])
        i = min(max(first_needed, 0) // self.block_size, len(table)) - 1
        while i >= 0 and table[i] != NULL_BLOCK:
            self._release(table[i])
            table[i] = NULL_BLOCK
            released += 1
            i -= 1
        return released

    # ------------------------------------------------------------------ internals
    def _publish(self, seq: Sequence, table: list[int], index: int, published: list[int]) -> None:
        """Publish the full block at `index` of `seq`'s table, unless it is (or an identical
        block is) published already: then it stays private until that key leaves the cache."""
        block_id = table[index]
        if block_id == NULL_BLOCK or self.block_hash[block_id] is not None:
            return  # freed out of the window, or published already (a prefix-cache hit)
        block_hash = seq.block_hashes[index]
        if block_hash in self.cached:
            self._private.setdefault(seq.seq_id, []).append(index)
            self._blocked_by.setdefault(block_hash, set()).add(seq.seq_id)
            return
        self.block_hash[block_id] = block_hash
        self.cached[block_hash] = block_id
        published.append(block_id)

    def _uncache(self, block_hash: bytes) -> None:
        """`block_hash` leaves the cache: private copies of it may be published again."""
        del self.cached[block_hash]
        waiting = self._blocked_by.pop(block_hash, None)
        if waiting:
            self._recheck |= waiting

    def _take(self) -> int:
        if self.free_unhashed:
            block_id, _ = self.free_unhashed.popitem(last=True)  # most recently freed
            self.ref_counts[block_id] = 1
            return block_id
        if not self.free_blocks:
            raise RuntimeError("BlockManager: out of KV blocks (the scheduler should have preempted)")
        block_id, _ = self.free_blocks.popitem(last=False)  # least recently used
        assert self.ref_counts[block_id] == 0, f"block {block_id} on the free list is referenced"
        old_hash = self.block_hash[block_id]
        if old_hash is not None:  # evict
            self.block_hash[block_id] = None
            if self.cached.get(old_hash) == block_id:
                self._uncache(old_hash)
        self.ref_counts[block_id] = 1
        return block_id

    def _release(self, block_id: int) -> None:
        count = self.ref_counts[block_id]
        if count <= 0:
            raise RuntimeError(f"BlockManager: block {block_id} freed twice")
        self.ref_counts[block_id] = count - 1
        if count == 1:
            if self.block_hash[block_id] is None:
                self.free_unhashed[block_id] = None
            else:
                self.free_blocks[block_id] = None
