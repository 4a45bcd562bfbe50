"""vLLM's own KV-cache events (its KVEventsConfig ZMQ publisher) as ours (cache_events.py).

vLLM names a block by its own hash; a router needs the names every engine uses, so each stored
block is named again from the token ids vLLM sends with it: our name of its parent, then its
tokens. A block whose parent we never saw stored (a batch lost, or one cached before we listened)
cannot be named and is left out, so the view only ever holds less than the cache does. Blocks keyed
by more than their tokens (a LoRA, multimodal inputs, a cache salt) cannot match a prompt's names
and are left out too.
"""

from __future__ import annotations

import asyncio

from worker.engines.cache_events import CacheEvents, block_hash
from worker.telemetry import get_logger

log = get_logger(__name__)
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


class VLLMEventNames:
    """Turns vLLM's event batches into our ("stored", ...) / ("removed", ...) changes."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self._ours: dict[object, bytes] = {}  # vLLM's block hash -> our name

    def changes(self, events: list) -> list[tuple]:
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

        out: list[tuple] = []
        for event in events:
            if isinstance(event, BlockStored):
                out += self._stored(event)
            elif isinstance(event, BlockRemoved):
                out += [("removed", ours) for h in event.block_hashes if (ours := self._ours.pop(h, None))]
            elif isinstance(event, AllBlocksCleared):
                out += self.forget()
        return out

    def forget(self) -> list[tuple]:
        """Every block named so far, as removed: after a lost batch, what is cached is unknown."""
        out = [("removed", ours) for ours in self._ours.values()]
        self._ours.clear()
        return out

    def _stored(self, event) -> list[tuple]:
        if event.lora_name or event.lora_id or any(event.extra_keys or []) or event.block_size != self.block_size:
            return []
        parent = self._ours.get(event.parent_block_hash) if event.parent_block_hash is not None else b""
        out = []
        for index, theirs in enumerate(event.block_hashes):
            tokens = list(event.token_ids[index * self.block_size:(index + 1) * self.block_size])
            if parent is None or len(tokens) != self.block_size:
                break
            ours = block_hash(parent or None, tokens)
            self._ours[theirs] = ours
            out.append(("stored", ours, parent, tokens))
            parent = ours
        return out


async def follow(endpoint: str, replay_endpoint: str, events: CacheEvents) -> None:
    """Subscribes to vLLM's publisher and feeds `events` until cancelled or it fails (then `events`
    stop). Batches missed (a subscriber joins a PUB socket some time after it connects) are asked
    for again from the replay socket."""
    import msgspec
    import zmq
    import zmq.asyncio
    from vllm.distributed.kv_events import KVEventBatch

    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    names = VLLMEventNames(events.block_size)
    context = zmq.asyncio.Context()
    sub = context.socket(zmq.SUB)
    sub.connect(endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    expected = 0

    def apply(seq_bytes: bytes, payload: bytes) -> None:
        nonlocal expected
        seq = int.from_bytes(seq_bytes, "big")
        if seq < expected:
            return  # already had it (replayed and then published)
        if seq > expected:
            # Lost, the replay included: a lost BlockRemoved would leave a block in the view that
            # the cache no longer holds, so the view starts over and names only what comes next.
            log.warning("vLLM cache events lost", first=expected, resumed=seq)
            events.publish(names.forget())
        events.publish(names.changes(decoder.decode(payload).events))
        expected = seq + 1

    try:
        while True:
            _, seq_bytes, payload = await sub.recv_multipart()
            if int.from_bytes(seq_bytes, "big") > expected:
                await _replay(context, replay_endpoint, expected, apply)
            apply(seq_bytes, payload)
    except Exception as exc:  # noqa: BLE001 (any failure: the view can no longer follow the cache)
        log.error("vLLM cache events failed; routed by load from now on", error=repr(exc))
        events.stop(f"following vLLM's publisher failed: {exc!r}")
    finally:
        sub.close(linger=0)
        context.term()


async def _replay(context, endpoint: str, start: int, apply) -> None:
    import zmq

    dealer = context.socket(zmq.DEALER)
    dealer.connect(endpoint)
    try:
        await dealer.send_multipart((b"", start.to_bytes(8, "big")))
        while True:
            frames = await asyncio.wait_for(dealer.recv_multipart(), 5)
            _, _, seq_bytes, payload = frames
            if seq_bytes == END_OF_REPLAY:
                return
            apply(seq_bytes, payload)
    except TimeoutError:
        return
    finally:
        dealer.close(linger=0)
