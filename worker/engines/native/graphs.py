"""CUDA graphs of the decode step, one per padded batch size (and, at the sizes whose attention launches
otherwise for a step with a context past paged_decode.LONG_CONTEXT, another: more parts to every
context, or the long ones split beside the others whole; paged_decode.launch).

A decode step launches a few hundred small kernels; replaying them as one graph removes the CPU
launch cost that otherwise dominates at small batches. Every graph reads the same static buffers
(token ids, positions, cache slots, block tables, context lengths) and writes its own logits; a
step of n sequences puts its inputs in (FEED_BYTES), pads to the next captured size with rows of length 0
whose K/V go to a scratch slot, and replays. Whatever a graph reads must outlive it: the buffers
are attributes here, never temporaries of the capture.
"""

from __future__ import annotations

import numpy as np
import torch

from worker.engines.native import blas
from worker.engines.native.batch import Batch
from worker.engines.native.model import LlamaModel
from worker.engines.native.paged_decode import LONG_CONTEXT, launch, takes_long
from worker.engines.native.sequence import Sequence, logit_rows, pick

try:
    import triton
    import triton.language as tl
except ImportError:  # without Triton: no graphs of distinct rows, inputs copied in
    triton = None


def graph_sizes(max_batch: int) -> list[int]:
    sizes = [size for size in (1, 2, 4, 8) if size <= max_batch] + list(range(16, max_batch + 1, 16))
    return sorted(set(sizes) | {max_batch})


DISTINCT_MIN_ROWS = 2
"""Steps of at least this many rows, each a sequence of its own, run graphs whose attention kernel
rotates and writes each row's K/V itself (Batch.distinct). On an H200 (Llama-1B shape, 128-token
prompts and 256 new tokens, alternated in one process, three rounds): 1.084 against 1.128 ms a step
at batch 16 and 1.303 against 1.341 at 64; later, 1.087 / 1.098 / 1.116 against 1.101 / 1.105 /
1.129 at batch 2 / 4 / 8. At batch 1 it took a step from 0.829 to 0.875 ms, so one row keeps the
two kernels (or, where gemv.ROPE_INSIDE says, rotates inside the qkv projection)."""
DISTINCT_WIDE_HEADS_MAX = 128
"""With heads wider than 64, graphs of distinct rows only up to this many (row, KV head) programs:
the attention kernel that also rotates holds more registers, and where many programs share the SMs
it is the slower. On an H200, 16 calls in a CUDA graph, us a layer at a 256-token context, the rope
kernel then attention against the one kernel: head_dim 128, batch 2 9.1 / 7.6, 16 9.3 / 7.2, but 64
23.2 / 25.3, 128 40.0 / 42.1, 256 72.7 / 78.5 (133.6 / 145.4 at 512 tokens); head_dim 64 is ahead
up to 128 rows (64 11.3 / 9.0, 128 26.2 / 25.1) and within 0.6 us either way at 256 (42.5 / 43.0,
at 160 tokens 32.5 / 33.1, at 512 78.1 / 77.4)."""


def rotates_inside(rows: int, kv_heads: int, head_dim: int) -> bool:
    """Whether the graph of `rows` distinct rows has its attention kernel rotate and write K/V
    (DISTINCT_MIN_ROWS, DISTINCT_WIDE_HEADS_MAX); else only the graph of rows side by side runs them."""
    return rows >= DISTINCT_MIN_ROWS and (head_dim <= 64 or rows * kv_heads <= DISTINCT_WIDE_HEADS_MAX)


FEED_BYTES = 1 << 18
"""Up to this many bytes of block tables (256 rows of 4k-token contexts), a step's inputs go in by a
kernel that reads the pinned host buffer over the bus itself (_feed_kernel), the pending tokens with
them; past it by copies, against which such reads were not timed. On an H200 (Llama-1B shape, batch
1) the host-to-device copy and the tokens' device-to-device copy after it, each waiting for the one
before, held the graph's first kernel 19 us after the argmax's end; the kernel, 6 us. Engines
alternated in one process, ms a step: batch 1 0.8060 against 0.8252 and 16 1.0734 against 1.0787
(five rounds); in another call 2 / 16 / 64 1.0606 / 1.0721 / 1.259 against 1.0679 / 1.0810 / 1.294,
256 within the runs' spread (2.26-3.02 ms either way)."""

ONE_COPY_BYTES = 1 << 20
"""Up to this, a step copies its block tables' rows whole with the packed rows (at 128k tokens of
context a row is 32 KiB: past 32 rows, only each table's used part goes, in a copy of its own)."""


def inputs(rows: int, max_blocks: int, device: torch.device, pin: bool = False) -> tuple[torch.Tensor, ...]:
    """(raw bytes, packed (4, rows) int64, tables (rows, max_blocks) int32): views of one buffer."""
    packed_bytes = 4 * rows * 8
    raw = torch.zeros(packed_bytes + rows * max_blocks * 4, dtype=torch.uint8, device=device, pin_memory=pin)
    return raw, raw[:packed_bytes].view(torch.int64).view(4, rows), raw[packed_bytes:].view(torch.int32).view(rows, max_blocks)


class DecodeGraphs:
    def __init__(self, model: LlamaModel, k_cache: torch.Tensor, v_cache: torch.Tensor, max_batch: int,
                 max_blocks: int, block_size: int, scratch_slot: int):
        device = k_cache.device
        self.sizes = graph_sizes(max_batch)
        self.scratch_slot = scratch_slot
        self.block_size = block_size
        largest = self.sizes[-1]
        # Rows: token ids, positions, cache slots, context lengths; then the block tables. Their
        # host side is pinned and laid out the same, so that most steps copy in one span.
        self.raw, self.packed, self.tables = inputs(largest, max_blocks, device)
        self.input_ids, self.positions, self.slots, self.lens = self.packed
        self.slots.fill_(scratch_slot)
        self.host = HostInputs(largest, max_blocks, pin=True)
        self.copied = torch.cuda.Event()
        self.every_row = torch.arange(largest, device=device)  # every row is a last token
        # Keyed (size, distinct, long): distinct graphs run steps whose rows are each a sequence of its
        # own (decode()), with each row's rotary embedding and cache write inside its attention kernel
        # (Batch.distinct); the others run rows of one sequence side by side (rows(), checks()). Long
        # ones, steps with a context past paged_decode.LONG_CONTEXT, where their attention splits
        # contexts in more parts than a short step's (Batch.long_contexts).
        self.graphs: dict[tuple[int, bool, bool], torch.cuda.CUDAGraph] = {}
        self.logits: dict[tuple[int, bool, bool], torch.Tensor] = {}
        pool = None
        side = torch.cuda.Stream(device)
        kv_heads = self.kv_heads = model.config.num_kv_heads
        for size in reversed(self.sizes):  # largest first, so the smaller ones fit in its memory pool
            inside = triton is not None and rotates_inside(size, kv_heads, model.config.head_dim)
            longer = triton is not None and launch(size, kv_heads, True) != launch(size, kv_heads, False)
            for distinct, long in [(distinct, long) for distinct in ((False, True) if inside else (False,))
                                   for long in ((False, True) if longer else (False,))]:
                batch = Batch(self.input_ids[:size], self.positions[:size], self.slots[:size], [], [], [],
                              self.every_row[:size], block_size, prefills=[], decode_tables=self.tables[:size],
                              decode_lens=self.lens[:size], distinct=distinct, long_contexts=long)
                side.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(side), blas.tuning():  # compiles the kernels, settles the allocator
                    model(batch, k_cache, v_cache)  # and picks cuBLAS's front end for each product
                torch.cuda.current_stream(device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.logits[size, distinct, long] = model(batch, k_cache, v_cache)
                pool = graph.pool()
                self.graphs[size, distinct, long] = graph
        torch.cuda.synchronize(device)

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def decode(self, seqs: list[Sequence], block_size: int, pending: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (n, vocab) of one token for each of the n sequences (rows as HostInputs writes
        them). `pending` (n,) on the device: each sequence's input is its token sampled by the step
        still running, not yet on the host (the engine's launch-ahead)."""
        self.copied.synchronize()  # the last run's copies out of the host inputs are done
        n, width = self.host.fill(seqs, block_size, ahead=pending is not None)
        return self.run(n, width, pending, distinct=True)

    def rows(self, scheduled: list[tuple[Sequence, int]], block_size: int, ahead: list[Sequence] = (),
             pending: torch.Tensor | None = None) -> torch.Tensor:
        """The logits the step keeps (sequence.logit_rows) of a step whose (sequence, tokens) rows
        all run as one-token decodes (sequence.DecodeRows): a graph row for every token, proposals'
        and short prompt chunks' too. `ahead`, `pending`: sequences whose rows come first, one decode
        each of its pending token (as decode() takes them); every one of their logits is kept."""
        self.copied.synchronize()
        first, width = self.host.fill(ahead, block_size, ahead=True) if ahead else (0, 0)
        n, more = self.host.fill_rows(scheduled, block_size, start=first)
        logits = self.run(n, max(width, more), pending)
        keep = [*range(first), *(first + row for row in logit_rows(scheduled))]
        if len(keep) == n:
            return logits
        return pick(logits, keep)

    def checks(self, seqs: list[Sequence], positions: list[int], drafts: list[list[int]], block_size: int,
               pending: torch.Tensor) -> torch.Tensor:
        """The logits of a verify step launched ahead (ahead.checks): seqs[i]'s token still
        on the device (pending[i]) at positions[i], then drafts[i] after it; returned as each
        sequence's 1 + len(drafts[i]) rows in order. The pending tokens take the first rows, whose
        ids run() replaces (a row is a one-token decode of its own: the order is free)."""
        self.copied.synchronize()
        m = len(seqs)
        _, width = self.host.fill_tokens([(seq, position, [0]) for seq, position in zip(seqs, positions)], block_size)
        n, more = self.host.fill_tokens([(seq, position + 1, draft) for seq, position, draft
                                         in zip(seqs, positions, drafts)], block_size, start=m)
        logits = self.run(n, max(width, more), pending)
        order, at = [], m
        for i, draft in enumerate(drafts):
            order += [i, *range(at, at + len(draft))]
            at += len(draft)
        return logits if m == 1 else pick(logits, order)

    def key(self, n: int, width: int, distinct: bool) -> tuple[int, bool, bool]:
        """The graph a step of n rows whose block tables are at most `width` long runs: (size,
        distinct, long), as `run` takes them."""
        size = next(s for s in self.sizes if s >= n)
        distinct = distinct and (size, True, False) in self.graphs
        # (a table as wide as LONG_CONTEXT holds no longer context: most steps read no lengths here)
        long = (width * self.block_size > LONG_CONTEXT and (size, distinct, True) in self.graphs
                and takes_long(self.host.packed.numpy()[3, :n], size, self.kv_heads))
        return size, distinct, long

    def run(self, n: int, width: int, input_ids: torch.Tensor | None = None, distinct: bool = False) -> torch.Tensor:
        """Logits (n, vocab) of the n one-token decodes in rows [0, n) of the host inputs, whose block
        tables are at most `width` long; valid until the next run. `input_ids` (m,) on the device
        replace the host inputs' token ids of the first m rows. `distinct`: every row is a sequence
        of its own, through the graphs made for that where there are some."""
        key = self.key(n, width, distinct)
        size = key[0]
        packed = self.host.packed.numpy()
        packed[:, n:size] = 0  # padding rows: length 0, their K/V written to the scratch slot (or nowhere)
        packed[2, n:size] = self.scratch_slot
        if triton is not None and n * width * self.tables.element_size() <= FEED_BYTES:
            # The sampler's tokens are int64 and contiguous already: no copy of them here.
            pending = (input_ids if input_ids is not None else self.input_ids).long().contiguous()
            _feed_kernel[(size,)](self.host.packed, self.host.tables, self.packed, self.tables, pending,
                                  len(input_ids) if input_ids is not None else 0, n, width, self.packed.stride(0),
                                  self.tables.stride(0), WIDTH=64)
            self.copied.record()
        else:
            # Whole rows, contiguous: a strided copy took ~3x the host time of a plain one (0.21 ms
            # against 0.07 on an H100 host; torch stages it through temporaries), at ~1 ms a step.
            span = self.packed.nbytes + n * self.tables.shape[1] * self.tables.element_size()
            if span <= ONE_COPY_BYTES:
                self.raw[:span].copy_(self.host.raw[:span], non_blocking=True)
            else:
                self.packed.copy_(self.host.packed, non_blocking=True)
                self.tables[:n, :width].copy_(self.host.tables[:n, :width], non_blocking=True)
            self.copied.record()
            if input_ids is not None:
                self.input_ids[:len(input_ids)].copy_(input_ids)
        self.graphs[key].replay()
        return self.logits[key][:n]


class HostInputs:
    """A decode step's inputs on the host, written in place: packed (4, rows) ids, positions,
    slots, lengths; tables (rows, max_blocks). Numpy views, no Python lists turned into tensors: at
    batch 256 writing them was about a third of the engine thread's step."""

    def __init__(self, rows: int, max_blocks: int, pin: bool):
        self.raw, self.packed, self.tables = inputs(rows, max_blocks, torch.device("cpu"), pin)
        # Per row, whose block table the buffer holds: (sequence, times released, length).
        self._tables_of: list[tuple | None] = [None] * rows
        self._ahead: list[Sequence] | None = None  # the rows of the last step launched ahead
        self._width = 0  # the longest block table among them

    def fill(self, seqs: list[Sequence], block_size: int, ahead: bool) -> tuple[int, int]:
        """Row i: one token of seqs[i], its last known one, or with `ahead` the one after (its
        pending token, whose id the device supplies). Returns (rows, the tables' width)."""
        (ids, positions, slots, lens), tables = self.packed.numpy(), self.tables.numpy()
        n = len(seqs)
        at = [len(seq.tokens) for seq in seqs] if ahead else [seq.num_cached for seq in seqs]
        if ahead and seqs is self._ahead and np.array_equal(positions[:n] + 1, at):
            return n, self._next_token(seqs, block_size)
        self._ahead = seqs if ahead else None
        held = [seq.blocks.blocks for seq in seqs]
        positions[:n] = at
        lens[:n] = positions[:n] + 1
        slots[:n] = [table[p // block_size] * block_size + p % block_size for table, p in zip(held, at)]
        if not ahead:
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
        self._width = width
        return n, width

    def _next_token(self, seqs: list[Sequence], block_size: int) -> int:
        """The rows of the step launched ahead before, one token further: each position, length
        and slot plus one, but where a row enters a block, whose slot and table come from its
        sequence (at batch 256 on a 2-core EPYC, 80 us a step against 180 for fill's pass over
        every row). Returns the width."""
        (_, positions, slots, lens), tables = self.packed.numpy(), self.tables.numpy()
        n = len(seqs)
        positions[:n] += 1
        lens[:n] += 1
        slots[:n] += 1
        for row in np.flatnonzero(positions[:n] % block_size == 0).tolist():
            seq, position = seqs[row], int(positions[row])
            table = seq.blocks.blocks
            slots[row] = table[position // block_size] * block_size
            tables[row, :len(table)] = table
            self._tables_of[row] = (seq, seq.blocks.released, len(table))
            self._width = max(self._width, len(table))
        return self._width

    def fill_rows(self, scheduled: list[tuple[Sequence, int]], block_size: int, start: int = 0) -> tuple[int, int]:
        """fill() for a step of (sequence, tokens) rows, some of more than one token (proposals,
        Sequence.draft, or a short prompt chunk): a row for each token, in order from row `start`."""
        return self.fill_tokens([(seq, seq.num_cached, (seq.tokens[seq.num_cached:seq.num_cached + count]
                                                         + seq.draft)[:count]) for seq, count in scheduled],
                                block_size, start)

    def fill_tokens(self, runs: list[tuple[Sequence, int, list[int]]], block_size: int, start: int = 0) -> tuple[int, int]:
        """For each (sequence, position, token ids): a row for each token, at that position and on,
        in order from row `start`, written one by one. Returns (rows in all, width)."""
        (ids, positions, slots, lens), tables = self.packed.numpy(), self.tables.numpy()
        self._ahead = None
        width, row = 0, start
        for seq, position, tokens in runs:
            table = seq.blocks.blocks
            for token in tokens:
                ids[row] = token
                positions[row] = position
                slots[row] = table[position // block_size] * block_size + position % block_size
                lens[row] = position + 1
                tables[row, :len(table)] = table
                self._tables_of[row] = None
                row += 1
                position += 1
            width = max(width, len(table))
        return row, width


if triton is not None:

    @triton.jit(do_not_specialize=["pending_ptr", "pending_rows", "rows", "width"])  # one variant: no compile in service
    def _feed_kernel(host_packed_ptr, host_tables_ptr, packed_ptr, tables_ptr, pending_ptr, pending_rows, rows,
                     width, stride_packed, stride_tables, WIDTH: tl.constexpr):
        """One graph row's inputs from the pinned host buffer (read over the bus, no copy of its own):
        its four packed values, its id replaced by pending_ptr's where row < pending_rows, and its
        block table's first `width` entries where row < rows (a padding row keeps the table it has)."""
        row = tl.program_id(0)
        fields = tl.arange(0, 4)
        values = tl.load(host_packed_ptr + fields * stride_packed + row)
        if row < pending_rows:
            values = tl.where(fields == 0, tl.load(pending_ptr + row), values)
        tl.store(packed_ptr + fields * stride_packed + row, values)
        if row < rows:
            for start in range(0, width, WIDTH):
                blocks = start + tl.arange(0, WIDTH)
                entries = tl.load(host_tables_ptr + row * stride_tables + blocks, mask=blocks < width)
                tl.store(tables_ptr + row * stride_tables + blocks, entries, mask=blocks < width)
