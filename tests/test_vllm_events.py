"""vLLM's own KV-cache events (vllm_events.py) as ours: blocks named again from their tokens, and
lost or broken batches that never leave a stale view."""

from __future__ import annotations

import asyncio

import pytest

from tests.test_cache_events import chain
from worker.engines.cache_events import CacheEvents


def test_vllm_s_events_are_named_again_from_their_tokens():
    kv_events = pytest.importorskip("vllm.distributed.kv_events")
    from worker.engines.vllm_events import VLLMEventNames

    def stored(hashes, parent, tokens, lora_name=None):
        return kv_events.BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=4,
                                     lora_id=None, medium="GPU", lora_name=lora_name)

    names = VLLMEventNames(4)
    ids = list(range(20, 32))
    ours = chain(ids, 4)
    # Two batches of one chain (vLLM's own hashes are opaque: ints here), then a block with an unknown
    # parent, one keyed by a LoRA and a partial block: none of those can be named.
    first = names.changes([stored([101, 102], None, ids[:8])])
    assert first == [("stored", ours[0], b"", ids[:4]), ("stored", ours[1], ours[0], ids[4:8])]
    assert names.changes([stored([103], 102, ids[8:12])]) == [("stored", ours[2], ours[1], ids[8:12])]
    assert names.changes([stored([200], 999, ids[:4]), stored([300], None, ids[:4], lora_name="a"),
                          stored([400], None, ids[:3])]) == []
    assert names.changes([kv_events.BlockRemoved(block_hashes=[103, 999], medium="GPU")]) == [("removed", ours[2])]
    assert sorted(names.changes([kv_events.AllBlocksCleared()])) == sorted([("removed", ours[0]), ("removed", ours[1])])
    assert names.changes([kv_events.BlockRemoved(block_hashes=[101], medium="GPU")]) == []


async def test_vllm_s_events_lost_or_broken_leave_no_stale_view(tmp_path):
    """Followed over real ZMQ sockets in vLLM's wire format: batches lost beyond the replay start
    the view over (a lost BlockRemoved must not leave a block in it), and a publisher that breaks
    stops the events, so routers fall back to load."""
    kv_events = pytest.importorskip("vllm.distributed.kv_events")
    import msgspec
    import zmq
    import zmq.asyncio

    from worker.engines.vllm_events import END_OF_REPLAY, follow
    from worker.errors import NoCacheEvents

    context = zmq.asyncio.Context()
    pub, replay = context.socket(zmq.PUB), context.socket(zmq.ROUTER)
    pub.bind(f"ipc://{tmp_path}/events")
    replay.bind(f"ipc://{tmp_path}/replay")
    sent: list[tuple[int, bytes]] = []  # what the replay socket can give again

    async def serve_replays() -> None:
        while True:
            client, _, start = await replay.recv_multipart()
            for seq, payload in sent:
                if seq >= int.from_bytes(start, "big"):
                    await replay.send_multipart((client, b"", b"", seq.to_bytes(8, "big"), payload))
            await replay.send_multipart((client, b"", b"", END_OF_REPLAY, b""))

    async def publish(seq: int, payload: bytes, lost: bool = False) -> None:
        if not lost:
            sent.append((seq, payload))
            await pub.send_multipart((b"", seq.to_bytes(8, "big"), payload))

    def batch(*events) -> bytes:
        return msgspec.msgpack.encode(kv_events.KVEventBatch(ts=0.0, events=list(events)))

    def stored(hashes, parent, tokens):
        return kv_events.BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=4,
                                     lora_id=None, medium="GPU", lora_name=None)

    ours = chain(list(range(12)), 4)
    events = CacheEvents(4)
    tasks = [asyncio.create_task(serve_replays()),
             asyncio.create_task(follow(f"ipc://{tmp_path}/events", f"ipc://{tmp_path}/replay", events))]
    subscription = events.subscribe()
    try:
        assert (await anext(subscription)).stored == []
        await publish(0, batch(stored([1, 2], None, list(range(8)))))
        # A subscriber joins a PUB socket late: what it missed comes from the replay socket.
        while events.sequence == 0:
            await asyncio.sleep(0.05)
            await publish(len(sent), batch())
        assert [h for h, _, _ in (await anext(subscription)).stored] == ours[:2]
        await publish(len(sent), batch(kv_events.BlockRemoved(block_hashes=[1, 2], medium="GPU")), lost=True)
        await publish(len(sent) + 1, batch(stored([3], 2, list(range(8, 12)))))
        started_over = await asyncio.wait_for(anext(subscription), 10)
        assert started_over.stored == [] and sorted(started_over.removed) == sorted(ours[:2])  # the child of a lost parent is not named
        await publish(len(sent) + 1, b"not msgpack")
        with pytest.raises(NoCacheEvents):
            await asyncio.wait_for(anext(subscription), 10)
        with pytest.raises(NoCacheEvents):
            await anext(events.subscribe())
        assert events.stopped and tasks[1].done()
    finally:
        for task in tasks:
            task.cancel()
        pub.close(linger=0)
        replay.close(linger=0)
        context.term()
