"""An engine's prefix cache as events, for cache-aware routers (WorkerControl.CacheEvents).

The engine thread hands each step's changes to the event loop (`publish`); here they are netted
into one numbered batch, applied to a copy of the cache kept on the loop, and fanned out. A new
subscriber gets that copy first, as a snapshot numbered with the last batch it includes, so the
snapshot and the batches after it join without a gap or an overlap, and no thread reads the
engine's own tables. A subscriber that falls too far behind is ended (CacheSubscriberLagging) and
subscribes again for a new snapshot. An engine whose event source fails stops its events: each
subscriber is ended and new ones are refused (NoCacheEvents), so routers fall back to load instead
of trusting a view that no longer changes.
"""

from __future__ import annotations

import asyncio
import hashlib
from array import array
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from worker.errors import CacheSubscriberLagging, NoCacheEvents

# Batches one subscriber may have waiting before it is ended.
MAX_PENDING = 4096


def block_hash(parent: bytes | None, tokens: list[int]) -> bytes:
    """A block's name, chained over every token before it. A cryptographic hash: a collision would
    hand one prompt another's KV."""
    return hashlib.sha256((parent or b"") + array("q", tokens).tobytes()).digest()


def prompt_hashes(tokens: list[int], block_size: int) -> list[bytes]:
    """The names of a prompt's blocks that a cache can serve (the last prompt token is always
    computed: its logits are needed)."""
    hashes: list[bytes] = []
    for start in range(0, (len(tokens) - 1) // block_size * block_size, block_size):
        hashes.append(block_hash(hashes[-1] if hashes else None, tokens[start:start + block_size]))
    return hashes


@dataclass(frozen=True, slots=True)
class CacheBatch:
    sequence: int
    snapshot: bool
    stored: list[tuple[bytes, bytes, list[int]]]  # (hash, parent hash, token ids)
    removed: list[bytes]


class CacheEvents:
    def __init__(self, block_size: int, max_pending: int = MAX_PENDING):
        self.block_size = block_size
        self.sequence = 0
        self.max_pending = max_pending
        self._blocks: dict[bytes, tuple[bytes, list[int]]] = {}  # hash -> (parent hash, token ids)
        self._subscribers: set[asyncio.Queue] = set()
        self.stopped: str | None = None  # why the events stopped, once they have
        # Set in an engine's own process (hosted.py): publish and stop go, as (name, argument), to
        # the worker's process, whose CacheEvents does the rest.
        self.forward: Callable[[tuple[str, Any]], None] | None = None

    def publish(self, changes: list[tuple]) -> None:
        """Applies one step's ("stored", hash, parent, tokens) and ("removed", hash) changes, in
        order; the batch says only what changed from before the step to after it."""
        if self.forward is not None:
            self.forward(("publish", changes))
            return
        was: dict[bytes, bool] = {}  # hash -> cached before this step
        for change in changes:
            digest = change[1]
            was.setdefault(digest, digest in self._blocks)
            if change[0] == "stored":
                self._blocks[digest] = (change[2], list(change[3]))
            else:
                self._blocks.pop(digest, None)
        stored = [(h, *self._blocks[h]) for h, before in was.items() if h in self._blocks and not before]
        removed = [h for h, before in was.items() if before and h not in self._blocks]
        if not stored and not removed:
            return
        self.sequence += 1
        batch = CacheBatch(self.sequence, False, stored, removed)
        for queue in list(self._subscribers):
            if queue.qsize() >= self.max_pending:
                self._subscribers.discard(queue)
                # Ends it: its view would miss what is dropped here.
                queue.put_nowait(CacheSubscriberLagging(f"more than {self.max_pending} cache event batches "
                                                        "behind; subscribe again for a new snapshot"))
            else:
                queue.put_nowait(batch)

    def stop(self, reason: str) -> None:
        """The engine's event source failed: what it holds from now on is unknown."""
        self.stopped = reason
        if self.forward is not None:
            self.forward(("stop", reason))
            return
        for queue in self._subscribers:
            queue.put_nowait(NoCacheEvents(f"cache events stopped: {reason}"))
        self._subscribers.clear()

    async def subscribe(self) -> AsyncIterator[CacheBatch]:
        if self.stopped:
            raise NoCacheEvents(f"cache events stopped: {self.stopped}")
        queue: asyncio.Queue = asyncio.Queue()
        self._subscribers.add(queue)
        try:
            yield CacheBatch(self.sequence, True, [(h, p, t) for h, (p, t) in self._blocks.items()], [])
            while isinstance(batch := await queue.get(), CacheBatch):
                yield batch
            raise batch
        finally:
            self._subscribers.discard(queue)
