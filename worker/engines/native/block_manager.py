"""Fixed-size KV blocks: a free list, and each sequence's block table grown as its tokens need."""

from __future__ import annotations

from collections import deque


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def can_grow(self, table: list[int], tokens: int) -> bool:
        return self.blocks_for(tokens) - len(table) <= len(self._free)

    def grow(self, table: list[int], tokens: int) -> None:
        """Extends `table` to hold `tokens` tokens; the caller checked can_grow."""
        while len(table) < self.blocks_for(tokens):
            table.append(self._free.popleft())

    def release(self, table: list[int]) -> None:
        self._free.extend(table)
        table.clear()
