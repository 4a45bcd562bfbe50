"""A step's packed tokens for the model (model.py), and the index work each step does once for
all its layers: which rows are decodes, prompts with nothing cached, and prompt chunks after cached
blocks, with the tables and lengths the attention kernels read."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.engines.native import kernels, paged_prefill
from worker.engines.native.attention import decode_gather
from worker.engines.native.gemv import triton
from worker.engines.native.paged_decode import takes_long
from worker.engines.sampler import on_device


@dataclass
class Batch:
    """One step's packed tokens. T tokens in all, from S sequences."""

    input_ids: torch.Tensor  # (T,)
    positions: torch.Tensor  # (T,)
    slots: torch.Tensor  # (T,) flat cache slot (block * block_size + offset) each token's K/V goes to
    query_lens: list[int]  # per sequence: tokens in this step
    context_lens: list[int]  # per sequence: tokens in the cache after this step
    block_tables: list[list[int]]  # per sequence: its blocks, in order
    last_token_index: torch.Tensor  # (S,) index into T of each sequence's last token
    block_size: int
    # Filled by prepare(), or given directly (a CUDA graph's static decode batch):
    prefills: list[tuple[int, int, torch.Tensor | None, torch.Tensor | None]] | None = None
    """Sequences with several new tokens after cached ones: (offset in T, query_len, context slots, causal mask);
    on CUDA (offset, query_len, None, None), with paged_prefills for the kernel that takes them all."""
    paged_prefills: tuple | None = None  # paged_prefill.paged_prefill_meta of `prefills`, on CUDA
    fresh: list[tuple[int, int, int, torch.Tensor | None]] | None = None
    """Sequences whose context is only this step's tokens, grouped by length: (start, n, L, rows): n
    sequences of L tokens, at rows (n, L) of T, or None where they lie one after another from start."""
    decode_index: torch.Tensor | None = None  # (N,) rows of T that are one-token decodes; None: all of T
    decode_tables: torch.Tensor | None = None  # (N, max_blocks) int32, zero-padded
    decode_lens: torch.Tensor | None = None  # (N,) int32 context lengths
    decode_gather: tuple[torch.Tensor, torch.Tensor] | None = None  # without Triton or CPU kernels: see attention.decode_gather
    distinct: bool = False
    """Every row a decode of a sequence of its own (a CUDA graph's, with Triton): attention rotates and
    writes each row's K/V itself (attention.rope_store_and_decode), no row reading another's."""
    long_contexts: bool = False
    """The step's decode attention takes the long launch (paged_decode.takes_long): a context past
    paged_decode.LONG_CONTEXT tokens, every context split in more parts or its long ones split."""

    def prepare(self, head_dim: int, kv_heads: int) -> Batch:
        """Per-step index work, done once here rather than in every layer."""
        device = self.input_ids.device
        offsets = torch.arange(self.block_size, device=device)
        self.prefills, decodes, decode_rows, start = [], [], [], 0
        fresh: dict[int, list[int]] = {}
        paged = paged_prefill.supports(device, head_dim)
        paged_rows: list[int] = []
        for index, (query_len, context_len, blocks) in enumerate(zip(self.query_lens, self.context_lens, self.block_tables)):
            if query_len == 1:
                decodes.append(index)
                decode_rows.append(start)
            elif query_len == context_len:
                fresh.setdefault(query_len, []).append(start)
            elif paged:
                self.prefills.append((start, query_len, None, None))
                paged_rows.append(index)
            else:
                table = on_device(blocks, device, torch.long)
                slots = (table[:, None] * self.block_size + offsets[None, :]).reshape(-1)[:context_len]
                # Query i sits at context position context_len - query_len + i and sees up to it.
                mask = (torch.arange(context_len, device=device)[None, :]
                        <= (context_len - query_len + torch.arange(query_len, device=device))[:, None])
                self.prefills.append((start, query_len, slots, mask))
            start += query_len
        self.fresh = []
        for length, starts in fresh.items():
            if starts == list(range(starts[0], starts[0] + len(starts) * length, length)):  # one after another
                self.fresh.append((starts[0], len(starts), length, None))
            else:
                rows = on_device(starts, device, torch.long)[:, None] + torch.arange(length, device=device)[None, :]
                self.fresh.append((0, len(starts), length, rows))
        if paged_rows:
            self.paged_prefills = paged_prefill.paged_prefill_meta(
                [p[0] for p in self.prefills], [self.query_lens[i] for i in paged_rows],
                [self.context_lens[i] for i in paged_rows], [self.block_tables[i] for i in paged_rows], device)
        if decodes:
            # Triton compiles a variant of a kernel per integer argument divisible by 16 or not, and
            # per dtype: a table width a multiple of 16 and (on CUDA) int64 lengths, as in the CUDA
            # graphs, so an eager step runs the variant they compiled (another took ~0.4 s to build).
            width = -(-max(len(self.block_tables[i]) for i in decodes) // 16) * 16
            tables = [self.block_tables[i] + [0] * (width - len(self.block_tables[i])) for i in decodes]
            # Copied from pinned memory (sampler.on_device): from a list, each waits for the step before.
            self.decode_tables = on_device(tables, device, torch.int32)
            lens = [self.context_lens[i] for i in decodes]
            self.decode_lens = on_device(lens, device, torch.int64 if device.type == "cuda" else torch.int32)
            self.long_contexts = takes_long(lens, len(decodes), kv_heads)
            in_place = (device.type == "cuda" and triton is not None) or (device.type == "cpu" and kernels.loaded())
            if not in_place:
                self.decode_gather = decode_gather(self.decode_tables, self.decode_lens, self.block_size)
            if len(decodes) < len(self.query_lens):
                self.decode_index = on_device(decode_rows, device, torch.long)
        return self
