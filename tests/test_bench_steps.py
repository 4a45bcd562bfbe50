"""The GPU benches' decode step time (bench/native_burst.py), read from the streams a batch's
requests get: a first message read late, holding several tokens, must not make the steps look
shorter than they were; and their engines settled as the worker's are."""

import asyncio
from types import SimpleNamespace

from bench import native_burst
from worker.engines import hosted

STEP = 0.002


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


class PacedEngine:
    """A labelled test double: replays messages at set times on a fake clock, one step of STEP a
    token. messages: request index -> [(time, tokens in the message)]. The clock moves on only once
    the message before has been read: its reader asks for the next one."""

    def __init__(self, clock: Clock, messages: dict[int, list[tuple[float, int]]]):
        self.clock = clock
        self.queues = {index: asyncio.Queue() for index in messages}
        self.read = {index: asyncio.Event() for index in messages}
        self.subscribed = asyncio.Event()
        self.timeline = sorted((at, index, count) for index, sent in messages.items() for at, count in sent)

    async def drive(self) -> None:
        await self.subscribed.wait()
        for at, index, count in self.timeline:
            self.clock.now = at
            self.read[index].clear()
            self.queues[index].put_nowait(SimpleNamespace(token_ids=[7] * count))
            await self.read[index].wait()
        for queue in self.queues.values():
            queue.put_nowait(None)

    async def stream_predict(self, request):
        index = int(request.request_id[1:].split("-")[0])
        self.read[index].set()  # (nothing sent yet) its stream is open
        if all(read.is_set() for read in self.read.values()):
            self.subscribed.set()
        while (out := await self.queues[index].get()) is not None:
            yield out
            self.read[index].set()


async def steps_of(messages: dict[int, list[tuple[float, int]]], new_tokens: int, monkeypatch) -> float:
    clock = Clock()
    monkeypatch.setattr(native_burst.time, "perf_counter", clock)
    engine = PacedEngine(clock, messages)
    driver = asyncio.ensure_future(engine.drive())
    result = await native_burst.run_requests(engine, [[1]] * len(messages), new_tokens)
    await driver
    return result["decode_step_ms"]


async def test_a_step_is_the_time_between_tokens(monkeypatch):
    # Two requests in lockstep from the first step: a token each step.
    paced = {index: [(STEP * (step + 1), 1) for step in range(10)] for index in range(2)}
    assert abs(await steps_of(paced, 10, monkeypatch) - STEP * 1000) < 1e-9


async def test_a_first_message_read_late_does_not_shorten_the_steps(monkeypatch):
    # Request 1's first five tokens reach it in one message at step 5, its others a step apart: the
    # steps still took STEP each (counted as one token's message, 2 ms read as 1.1).
    late = [(STEP * 5, 5)] + [(STEP * (step + 1), 1) for step in range(5, 10)]
    paced = {0: [(STEP * (step + 1), 1) for step in range(10)], 1: late}
    assert abs(await steps_of(paced, 10, monkeypatch) - STEP * 1000) < 1e-9


async def test_a_settled_engine_is_frozen_until_it_unloads():
    """As the worker's process: what lives once a bench's engine is loaded is frozen, so a full
    collection does not walk it (one held a 1B engine's thread 164-171 ms on an H200), and thawed
    as the engine unloads, so its cycles are collected."""
    import gc

    unloaded = []

    class Engine:  # a labelled test double: records its unload
        async def unload_model(self) -> None:
            unloaded.append(gc.get_freeze_count())

    engine = Engine()
    try:
        hosted.settle()
        assert gc.get_freeze_count() > 0
        await native_burst.unload(engine)
    finally:
        gc.unfreeze()
    assert unloaded == [0]
