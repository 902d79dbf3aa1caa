"""CUDA graphs for decode steps: capture sizes, pad-up, persistent input buffers.

A decode step's forward is captured once per batch size in `capture_sizes` (vLLM's list: 1, 2,
4, then every 8 up to `max_num_seqs`); a step of n decodes replays the graph of the smallest
captured size >= n, its rows n.. padded with a harmless dummy (the null block, position 0).
A graph reads its inputs from fixed addresses, so every input lives in `DecodeBuffers`,
allocated once for the largest size and updated in place before each replay:

- token ids and positions: one host-to-device copy each per step;
- block tables `[max_batch, max_blocks_per_seq]` int32: grown incrementally. A row that
  holds the same sequence as in the previous step gets only its new columns written (one
  entry when a decode crosses into a new block, none otherwise); a row that changed sequence
  is rewritten whole; the writes of a step are one `index_put_`;
- slot mapping, sequence lengths, and FlexAttention's block lists: computed on the device
  from the buffers (`refresh`), no Python loop over rows and no host sync.

The null block is one cache block past those the block manager hands out (the runner
allocates `num_blocks + 1` when graphs are on): padded rows write their K/V there and read
only it. `GraphRunner` captures on CUDA; on CPU (the tests' stand-in) it runs the same
forward over the same buffers eagerly, so the bookkeeping is tested without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from mmkit.layers import flex_attention as flex


def capture_sizes(max_num_seqs: int, max_size: int = 512) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, then multiples of 8, up to max_num_seqs (its own
    multiple of 8 when it is not one), at most `max_size`."""
    limit = min(max_num_seqs, max_size)
    sizes = [s for s in (1, 2, 4) if s < limit] + list(range(8, limit, 8))
    top = limit if limit <= 4 else -(-limit // 8) * 8
    return sorted(set(sizes + [top]))


def padded_size(num_decodes: int, sizes: list[int]) -> int | None:
    """The smallest captured size >= num_decodes; None when the batch is larger (run eagerly)."""
    for size in sizes:
        if size >= num_decodes:
            return size
    return None


@dataclass
class BufferUpdate:
    """What `DecodeBuffers.update` wrote (for the tests and logs)."""

    num_decodes: int
    padded: int
    table_entries_written: int
    rows_rewritten: int


@dataclass
class DecodeBuffers:
    """The persistent inputs of captured decode steps (see the module docstring)."""

    max_batch: int
    max_blocks_per_seq: int
    block_size: int
    num_cache_blocks: int  # blocks in the cache tensors, the null block included
    null_block: int
    device: torch.device
    windows: tuple[int, ...] = (0,)  # the model's sliding windows (0: global layers)
    _row_seq: list = field(default_factory=list, repr=False)  # seq id per row, None = padding
    _row_blocks: list = field(default_factory=list, repr=False)  # table entries written per row

    def __post_init__(self) -> None:
        b, dev = self.max_batch, self.device
        self.input_ids = torch.zeros(b, dtype=torch.long, device=dev)
        self.positions = torch.zeros(b, dtype=torch.long, device=dev)
        self.seq_lens = torch.ones(b, dtype=torch.int32, device=dev)
        self.block_tables = torch.full((b, self.max_blocks_per_seq), self.null_block, dtype=torch.int32, device=dev)
        self.slot_mapping = torch.zeros(b, dtype=torch.long, device=dev)
        # FlexAttention's view of the decode rows (flex_attention.FlexMetadata), in place.
        self.physical_to_logical = torch.full((b, self.num_cache_blocks), -1, dtype=torch.int32, device=dev)
        self._rows = torch.arange(b, dtype=torch.int32, device=dev)
        self._zeros = torch.zeros(b, dtype=torch.int32, device=dev)
        self._pos32 = torch.zeros(b, dtype=torch.int32, device=dev)
        self._kv_num = {w: torch.zeros(b, dtype=torch.int32, device=dev) for w in self.windows}
        self._kv_idx = {w: torch.zeros(b, max(self.num_cache_blocks, self.max_blocks_per_seq), dtype=torch.int32,
                                       device=dev) for w in self.windows}
        self._row_seq = [None] * b
        self._row_blocks = [0] * b

    # ---------------------------------------------------------------- host side
    def update(self, seq_ids: list[int], token_ids: list[int], positions: list[int], tables: list[list[int]],
               sizes: list[int]) -> BufferUpdate:
        """Write one step of `len(seq_ids)` decodes (row i = decode i), padded up to a captured
        size; `tables[i]` is decode i's whole block table (only its unseen tail is copied)."""
        n = len(seq_ids)
        padded = padded_size(n, sizes)
        if padded is None or padded > self.max_batch:
            raise ValueError(f"decode batch of {n} is larger than the largest captured size {sizes[-1]}")
        rows, cols, values = [], [], []
        rewritten = 0
        for row in range(padded):
            seq = seq_ids[row] if row < n else None
            table = tables[row] if row < n else []
            if row < n and len(table) > self.max_blocks_per_seq:
                raise ValueError(f"sequence {seq}: {len(table)} blocks; buffers hold {self.max_blocks_per_seq}")
            start = self._row_blocks[row]
            if seq != self._row_seq[row] or seq is None:
                if self._row_seq[row] is not None or start:
                    rewritten += 1
                # A new owner: clear the old entries back to the null block, then write all.
                for col in range(len(table), start):
                    rows.append(row), cols.append(col), values.append(self.null_block)
                start = 0
                self._row_seq[row] = seq
            for col in range(start, len(table)):
                rows.append(row), cols.append(col), values.append(table[col])
            self._row_blocks[row] = len(table)
        if rows:
            index = torch.tensor([rows, cols], dtype=torch.long).to(self.device, non_blocking=True)
            self.block_tables.index_put_((index[0], index[1]),
                                         torch.tensor(values, dtype=torch.int32).to(self.device, non_blocking=True))
        pad = padded - n
        self.input_ids[:padded].copy_(_host(list(token_ids) + [0] * pad, self.device))
        self.positions[:padded].copy_(_host(list(positions) + [0] * pad, self.device))
        self.refresh(padded)
        return BufferUpdate(n, padded, len(rows), rewritten)

    # ---------------------------------------------------------------- device side
    def refresh(self, padded: int) -> None:
        """Slot mapping, lengths and block lists of rows [0, padded) from the buffers, on the device."""
        bs = self.block_size
        pos = self.positions[:padded]
        tables = self.block_tables[:padded]
        self.seq_lens[:padded].copy_(pos + 1)
        self._pos32[:padded].copy_(pos)
        block = tables.gather(1, (pos // bs)[:, None])[:, 0].long()
        self.slot_mapping[:padded].copy_(block * bs + pos % bs)
        lens = pos + 1
        p2l = self.physical_to_logical[:padded]
        p2l.fill_(-1)
        flex._scatter_logical(p2l, tables, -(-lens // bs))
        p2l[:, self.null_block] = torch.where(pos == 0, 0, -1).to(torch.int32)  # padding reads its own row 0
        for w in self.windows:
            kv_num, kv_idx = flex.decode_block_lists(tables, lens, bs, w, self.num_cache_blocks)
            self._kv_num[w][:padded].copy_(kv_num)
            self._kv_idx[w][:padded, :self.num_cache_blocks].copy_(kv_idx)

    def flex_metadata(self, padded: int) -> flex.FlexMetadata:
        """A FlexMetadata over rows [0, padded) whose tensors are views of the buffers: built
        once per captured size, valid for every later `update` of that size."""
        rows = flex.FlexRows(self._rows[:padded], self._pos32[:padded], self._zeros[:padded], self._zeros[:padded])
        fm = flex.FlexMetadata(self.block_size, self.num_cache_blocks, padded, 0, self.physical_to_logical[:padded],
                               [], [], rows, None)
        for w in self.windows:
            kv_idx = self._kv_idx[w][:padded, :self.num_cache_blocks]
            fm._masks[("decode", w)] = flex.BlockMask.from_kv_blocks(
                self._kv_num[w][:padded, None, None], kv_idx[:, None, None, :],
                BLOCK_SIZE=(flex.DECODE_Q_TILE, self.block_size),
                mask_mod=flex._mask_mod(fm, rows, w, lambda b, q: b),
                seq_lengths=(1, self.num_cache_blocks * self.block_size), compute_q_blocks=False)
        return fm


def _host(values: list[int], device: torch.device) -> torch.Tensor:
    tensor = torch.tensor(values, dtype=torch.long)
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor


class GraphRunner:
    """One captured forward per size. `forward(padded)` runs the decode forward over the
    buffers' first `padded` rows and returns [padded, hidden]; captured on CUDA, called
    eagerly elsewhere (the stand-in). `num_replays` counts replays per size (tests, logs)."""

    def __init__(self, sizes: list[int], forward: Callable[[int], torch.Tensor], device: torch.device) -> None:
        self.sizes = sorted(sizes)
        self.forward = forward
        self.use_graphs = device.type == "cuda"
        self.graphs: dict[int, tuple[object, torch.Tensor]] = {}
        self.num_replays: dict[int, int] = {s: 0 for s in self.sizes}

    def capture(self, warmup: int = 2) -> None:
        """Largest size first, sharing one memory pool (vLLM's order: the pool is sized by it)."""
        if not self.use_graphs:
            return
        pool = None
        for size in reversed(self.sizes):
            for _ in range(warmup):  # compile and autotune outside the capture
                self.forward(size)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.forward(size)
            pool = graph.pool()
            self.graphs[size] = (graph, out)

    def run(self, num_decodes: int, padded: int) -> torch.Tensor:
        """The hidden states of the first `num_decodes` rows, after the buffers were updated."""
        self.num_replays[padded] += 1
        if padded in self.graphs:
            graph, out = self.graphs[padded]
            graph.replay()
            return out[:num_decodes]
        return self.forward(padded)[:num_decodes]


def uses_decode_graphs(config, attention_backend: str, runner) -> bool:
    """Graphs for decode steps: CUDA, the flex backend, not `enforce_eager`, and a model whose
    decode step is plain 1-D positions (M-RoPE and DeepStack models run eagerly)."""
    return (config.model.device.type == "cuda" and attention_backend == "flex" and not config.enforce_eager
            and not runner.capabilities.uses_mrope and runner.capabilities.embed_width_factor == 1)


class DecodeGraphs:
    """The runner's decode steps through `DecodeBuffers` and `GraphRunner`.

    `try_run(order)` takes a step whose chunks are all single-token decodes and that fits the
    largest captured size, and returns the hidden states of its rows; any other step returns
    None and runs eagerly. Needs the null block: the runner's caches hold `num_blocks + 1`."""

    def __init__(self, runner, sizes: list[int] | None = None) -> None:
        from mmkit.layers.attention_backend import compiled_flex_attention

        if runner.capabilities.uses_mrope or runner.capabilities.embed_width_factor != 1:
            raise ValueError("decode graphs: M-RoPE and DeepStack models run their decode steps eagerly")
        config = runner.config
        mc = config.model
        self.runner = runner
        self.sizes = sizes or capture_sizes(config.scheduler.max_num_seqs)
        bs = runner.block_size
        cache_blocks = runner.num_cache_blocks
        if cache_blocks != runner.num_blocks + 1:
            raise ValueError(f"decode graphs: the KV cache holds {cache_blocks} blocks; expected num_blocks + 1 "
                             f"= {runner.num_blocks + 1} (the null block)")
        windows = tuple(sorted({w or 0 for w in mc.capabilities.layer_sliding_windows} or {0}))
        self.buffers = DecodeBuffers(self.sizes[-1], -(-mc.max_model_len // bs), bs, cache_blocks, runner.num_blocks,
                                     runner.device, windows)
        self._metas = {s: self.buffers.flex_metadata(s) for s in self.sizes}
        self._attend = compiled_flex_attention() if runner.device.type == "cuda" else None
        self.graph_runner = GraphRunner(self.sizes, self._forward, runner.device)

    @classmethod
    def enable(cls, runner, sizes: list[int] | None = None) -> "DecodeGraphs | None":
        """Graphs on a runner built without them (before any request): the caches get the null
        block. The CPU tests use it to run the stand-in inside a real engine. None for a model
        whose decode steps graphs do not take (M-RoPE, DeepStack)."""
        from mmkit.worker.kv_cache import allocate_kv_caches

        if runner.capabilities.uses_mrope or runner.capabilities.embed_width_factor != 1:
            return None

        runner.num_cache_blocks = runner.num_blocks + 1
        runner.kv_caches = allocate_kv_caches(runner.config.model, runner.num_cache_blocks, runner.block_size)
        runner.decode_graphs = cls(runner, sizes)
        runner.decode_graphs.capture()
        return runner.decode_graphs

    def capture(self) -> None:
        self.graph_runner.capture()

    def _forward(self, padded: int) -> torch.Tensor:
        from mmkit.layers.attention import AttentionMetadata
        from mmkit.layers.attention_backend import FlexAttend

        buf, model = self.buffers, self.runner.model
        meta = AttentionMetadata(slot_mapping=buf.slot_mapping[:padded], num_decode_tokens=padded,
                                 block_size=buf.block_size)
        meta.attend = FlexAttend(self._metas[padded], attend=self._attend)
        embeds = model.embed_tokens(buf.input_ids[:padded])
        return model(embeds, buf.positions[:padded], self.runner.kv_caches, meta)

    def try_run(self, order) -> torch.Tensor | None:
        """[num_decodes, hidden] for a decode-only step that fits, else None (run it eagerly)."""
        if not order or len(order) > self.sizes[-1] or any(c.end - c.start != 1 for c in order):
            return None
        seq_ids = [c.state.seq_id for c in order]
        update = self.buffers.update(seq_ids, [c.state.token_ids[c.start] for c in order], [c.start for c in order],
                                     [c.state.block_table for c in order], self.sizes)
        return self.graph_runner.run(update.num_decodes, update.padded)
