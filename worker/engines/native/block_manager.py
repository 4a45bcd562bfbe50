"""Fixed-size KV blocks with prefix sharing, and the zeroed memory that holds them.

Each sequence has a block table grown as its tokens need. A block once full is named by a hash of
its tokens chained to its parent's, so equal prefixes have equal names: a new sequence takes the
cached blocks of its longest full-block prefix instead of recomputing them. Blocks are reference
counted; one that no sequence holds stays cached until the least recently freed is reused.
"""

from __future__ import annotations

import math
import mmap
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from worker.engines.cache_events import block_hash


@dataclass
class BlockTable:
    """A sequence's blocks in order, and the hashes of the leading ones that are full."""

    blocks: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)
    released: int = 0
    """Times its blocks were given back: a table of the same length may hold other blocks since."""

    def __len__(self) -> int:
        return len(self.blocks)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._refs = [0] * num_blocks
        # Blocks no sequence holds, least recently freed first; cached ones among them keep their hash.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[bytes, int] = {}  # hash -> block
        self._hash_of: dict[int, bytes] = {}  # block -> hash
        # What changed in the cache since take_changes(): ("stored", hash, parent, tokens) and
        # ("removed", hash), for subscribers to the cache's events (cache_events.py).
        self._changes: list[tuple] = []

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def can_grow(self, table: BlockTable, tokens: int) -> bool:
        return self.blocks_for(tokens) - len(table) <= len(self._free)

    def grow(self, table: BlockTable, tokens: int) -> None:
        """Extends `table` to hold `tokens` tokens; the caller checked can_grow."""
        while len(table) < self.blocks_for(tokens):
            block, _ = self._free.popitem(last=False)
            self._uncache(block)
            self._refs[block] = 1
            table.blocks.append(block)

    def match_prefix(self, table: BlockTable, tokens: list[int]) -> tuple[int, int]:
        """Takes the cached blocks of the longest full-block prefix of `tokens` into an empty table.
        Returns (tokens they hold, tokens that could have been shared). The last token is always
        left to compute: its logits are needed."""
        if not self.prefix_caching:
            return 0, 0
        usable = (len(tokens) - 1) // self.block_size
        parent = None
        for index in range(usable):
            digest = self._hash(parent, tokens, index)
            block = self._cached.get(digest)
            if block is None:
                break
            if self._refs[block] == 0:
                del self._free[block]
            self._refs[block] += 1
            table.blocks.append(block)
            table.hashes.append(digest)
            parent = digest
        return len(table) * self.block_size, usable * self.block_size

    def commit(self, table: BlockTable, tokens: list[int], num_computed: int) -> None:
        """Names the blocks that `num_computed` computed tokens have filled, so others can share them."""
        done = num_computed // self.block_size
        if not self.prefix_caching or done <= len(table.hashes):  # most calls: no block filled
            return
        for index in range(len(table.hashes), done):
            parent = table.hashes[-1] if table.hashes else None
            chunk = tokens[index * self.block_size:(index + 1) * self.block_size]
            digest = block_hash(parent, chunk)
            table.hashes.append(digest)
            block = table.blocks[index]
            if digest not in self._cached:  # else an equal block is cached already; this one stays private
                self._cached[digest] = block
                self._hash_of[block] = digest
                self._changes.append(("stored", digest, parent or b"", chunk))

    def release(self, table: BlockTable) -> None:
        """Gives back a finished, aborted or preempted sequence's blocks; the last ones are freed
        first, so a shared prefix outlives the tails that hang off it."""
        for block in reversed(table.blocks):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free[block] = None
        table.blocks.clear()
        table.hashes.clear()
        table.released += 1

    def take_changes(self) -> list[tuple]:
        changes, self._changes = self._changes, []
        return changes

    def _uncache(self, block: int) -> None:
        digest = self._hash_of.pop(block, None)
        if digest is not None:
            del self._cached[digest]
            self._changes.append(("removed", digest))

    def _hash(self, parent: bytes | None, tokens: list[int], index: int) -> bytes:
        return block_hash(parent, tokens[index * self.block_size:(index + 1) * self.block_size])


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed cache. On CPU from an anonymous mapping, which the kernel fills with zero pages as
    they are first touched: torch.zeros would write every byte before the worker is ready (7 s for
    2 GiB on the 2-core machine)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape)
    return torch.frombuffer(mmap.mmap(-1, count * dtype.itemsize), dtype=dtype, count=count).view(shape)
