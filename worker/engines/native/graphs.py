"""CUDA graphs of the decode step, one per padded batch size.

A decode step launches a few hundred small kernels; replaying them as one graph removes the CPU
launch cost that otherwise dominates at small batches. Every graph reads the same static buffers
(token ids, positions, cache slots, block tables, context lengths) and writes its own logits; a
step of n sequences copies its inputs in, pads to the next captured size with rows of length 0
whose K/V go to a scratch slot, and replays. Whatever a graph reads must outlive it: the buffers
are attributes here, never temporaries of the capture.
"""

from __future__ import annotations

import numpy as np
import torch

from worker.engines.native.model import Batch, LlamaModel
from worker.engines.native.sequence import Sequence


def graph_sizes(max_batch: int) -> list[int]:
    sizes = [size for size in (1, 2, 4, 8) if size <= max_batch] + list(range(16, max_batch + 1, 16))
    return sorted(set(sizes) | {max_batch})


class DecodeGraphs:
    def __init__(self, model: LlamaModel, k_cache: torch.Tensor, v_cache: torch.Tensor, max_batch: int,
                 max_blocks: int, block_size: int, scratch_slot: int):
        device = k_cache.device
        self.sizes = graph_sizes(max_batch)
        self.scratch_slot = scratch_slot
        largest = self.sizes[-1]
        # Rows: token ids, positions, cache slots, context lengths; one copy in per step.
        self.packed = torch.zeros(4, largest, dtype=torch.long, device=device)
        self.input_ids, self.positions, self.slots, self.lens = self.packed
        self.slots.fill_(scratch_slot)
        self.tables = torch.zeros(largest, max_blocks, dtype=torch.int32, device=device)
        # Their host side, pinned: a step writes its inputs there in place (numpy views, no Python
        # lists turned into tensors) and they go over without blocking the engine thread.
        self.host_packed = torch.zeros(4, largest, dtype=torch.long, pin_memory=True)
        self.host_tables = torch.zeros(largest, max_blocks, dtype=torch.int32, pin_memory=True)
        # Per row, whose block table the host buffer holds: (sequence, times released, length).
        self._tables_of: list[tuple | None] = [None] * largest
        self.copied = torch.cuda.Event()
        self.rows = torch.arange(largest, device=device)  # every row is a last token
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        pool = None
        side = torch.cuda.Stream(device)
        for size in reversed(self.sizes):  # largest first, so the smaller ones fit in its memory pool
            batch = Batch(self.input_ids[:size], self.positions[:size], self.slots[:size], [], [], [],
                          self.rows[:size], block_size, prefills=[],
                          decode_tables=self.tables[:size], decode_lens=self.lens[:size])
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):  # compiles the kernels and settles the allocator
                model(batch, k_cache, v_cache)
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[size] = model(batch, k_cache, v_cache)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize(device)

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def host_inputs(self) -> tuple[np.ndarray, np.ndarray]:
        """(packed (4, max_batch): ids, positions, slots, lengths; tables (max_batch, max_blocks)) to
        fill for the next run, once the last run's copies out of them are done."""
        self.copied.synchronize()
        return self.host_packed.numpy(), self.host_tables.numpy()

    def decode(self, seqs: list[Sequence], block_size: int, pending: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (n, vocab) of one token for each of the n sequences, their inputs written straight
        into the pinned host buffers (at batch 256 this was about a third of the engine thread's
        step). `pending` (n,) on the device: each sequence's input is its token sampled by the step
        still running, not yet on the host (the engine's launch-ahead). A sequence with proposals
        (Sequence.draft, never with `pending`) has a row for its last token and one for each
        proposal, in order."""
        if any(seq.draft for seq in seqs):
            return self._decode_drafts(seqs, block_size)
        (ids, positions, slots, lens), tables = self.host_inputs()
        n = len(seqs)
        at = [len(seq.tokens) for seq in seqs] if pending is not None else [seq.num_cached for seq in seqs]
        held = [seq.blocks.blocks for seq in seqs]
        positions[:n] = at
        lens[:n] = positions[:n] + 1
        slots[:n] = [table[p // block_size] * block_size + p % block_size for table, p in zip(held, at)]
        if pending is None:
            ids[:n] = [seq.tokens[p] for seq, p in zip(seqs, at)]
        # A row's table is written only when another sequence, or more blocks, took the row: a
        # block table changes every block_size tokens (at batch 256 the rewrite was 0.3 ms a step).
        width, filled = 0, self._tables_of
        for row, (seq, table) in enumerate(zip(seqs, held)):
            key = (seq, seq.blocks.released, len(table))
            if filled[row] != key:
                tables[row, :len(table)] = table
                filled[row] = key
            width = max(width, len(table))
        return self.run(n, width, pending)

    def _decode_drafts(self, seqs: list[Sequence], block_size: int) -> torch.Tensor:
        """decode() where some sequences have proposals: rows per sequence vary, written one by one."""
        (ids, positions, slots, lens), tables = self.host_inputs()
        width = row = 0
        for seq in seqs:
            position, table = seq.num_cached, seq.blocks.blocks
            for token in ([seq.tokens[position], *seq.draft] if seq.draft else (seq.tokens[position],)):
                ids[row] = token
                positions[row] = position
                slots[row] = table[position // block_size] * block_size + position % block_size
                lens[row] = position + 1
                tables[row, :len(table)] = table
                self._tables_of[row] = None
                row += 1
                position += 1
            width = max(width, len(table))
        return self.run(row, width)

    def run(self, n: int, width: int, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (n, vocab) of the n one-token decodes in rows [0, n) of the host inputs, whose block
        tables are at most `width` long; valid until the next run. `input_ids` (n,) on the device
        replace the host inputs' token ids."""
        size = next(s for s in self.sizes if s >= n)
        packed = self.host_packed.numpy()
        packed[:, n:size] = 0  # padding rows: length 0, their K/V written to the scratch slot
        packed[2, n:size] = self.scratch_slot
        self.packed[:, :size].copy_(self.host_packed[:, :size], non_blocking=True)
        self.tables[:n, :width].copy_(self.host_tables[:n, :width], non_blocking=True)
        self.copied.record()
        if input_ids is not None:
            self.input_ids[:n].copy_(input_ids)
        self.graphs[size].replay()
        return self.logits[size][:n]
