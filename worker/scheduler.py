"""TaskScheduler: admits requests against concurrency slots and a KV token budget, queueing the rest."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections import Counter
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from worker.errors import (
    Draining,
    OverBudget,
    QueueFull,
    QueueTimeout,
    RequestDeadlineExceeded,
    WorkerError,
)


@dataclass(slots=True)
class Grant:
    """A slot and `cost` budget tokens held by one request until released."""

    cost: int
    queued_s: float
    released: bool = False


@dataclass(frozen=True, slots=True)
class Load:
    running: int
    queued: int
    max_concurrency: int
    max_queue: int
    budget_used: int
    budget_total: int
    draining: bool


@dataclass(order=True, slots=True)
class _Waiter:
    sort_key: tuple[int, int]
    cost: int = field(compare=False)
    future: asyncio.Future[Grant] = field(compare=False)
    enqueued_at: float = field(compare=False)


class TaskScheduler:
    """All-or-nothing admission: a request runs once a slot is free and its whole cost fits.

    Waiting requests form a bounded priority queue (higher priority first, then arrival order);
    the head blocks those behind it so a large request is never starved by small ones.
    """

    def __init__(
        self,
        *,
        max_concurrency: int,
        max_queue: int,
        queue_timeout_s: float,
        budget_tokens: int,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.max_concurrency = max_concurrency
        self.max_queue = max_queue
        self.queue_timeout_s = queue_timeout_s
        self.budget_total = budget_tokens
        self._clock = clock
        self._running = 0
        self._budget_used = 0
        self._heap: list[_Waiter] = []
        self._sequence = itertools.count()
        self._draining = False
        self.rejections: Counter[str] = Counter()

    def load(self) -> Load:
        return Load(
            running=self._running,
            queued=len(self._heap),
            max_concurrency=self.max_concurrency,
            max_queue=self.max_queue,
            budget_used=self._budget_used,
            budget_total=self.budget_total,
            draining=self._draining,
        )

    def set_budget(self, budget_tokens: int) -> None:
        """Takes the engine's KV capacity once it is known; waiting requests may fit now."""
        self.budget_total = budget_tokens
        self._dispatch()

    @asynccontextmanager
    async def slot(self, cost: int, priority: int = 0, deadline: float | None = None) -> AsyncIterator[Grant]:
        """Admits, yields the grant, and gives it back however the body ends."""
        grant = await self.admit(cost, priority, deadline)
        try:
            yield grant
        finally:
            self.release(grant)

    async def admit(self, cost: int, priority: int = 0, deadline: float | None = None) -> Grant:
        """Waits until the request fits; raises a WorkerError saying why it was not admitted.

        `deadline` is on this scheduler's clock (time.monotonic by default).
        """
        now = self._clock()
        if self._draining:
            raise self._reject(Draining("worker is draining"))
        if cost > self.budget_total:
            raise self._reject(OverBudget(
                f"request needs {cost} KV tokens (prompt + max_tokens); the worker holds {self.budget_total}"))
        if deadline is not None and deadline <= now:
            raise self._reject(RequestDeadlineExceeded("deadline passed before admission"))
        if not self._heap and self._fits(cost):
            return self._grant(cost, 0.0)
        if len(self._heap) >= self.max_queue:
            raise self._reject(QueueFull(f"admission queue is full ({self.max_queue} waiting)"))

        waiter = _Waiter((-priority, next(self._sequence)), cost, asyncio.get_running_loop().create_future(), now)
        heapq.heappush(self._heap, waiter)
        wait_s = self.queue_timeout_s
        deadline_first = deadline is not None and deadline - now < wait_s
        if deadline_first:
            wait_s = deadline - now
        try:
            async with asyncio.timeout(wait_s):
                return await waiter.future
        except BaseException as exc:
            if waiter.future.done() and not waiter.future.cancelled() and waiter.future.exception() is None:
                # Granted in the same instant the wait ended: give it straight back.
                self.release(waiter.future.result())
            else:
                self._leave_queue(waiter)
            if isinstance(exc, TimeoutError):
                if deadline_first:
                    raise self._reject(RequestDeadlineExceeded("deadline passed while queued")) from None
                raise self._reject(QueueTimeout(
                    f"no slot or budget within the queue timeout of {self.queue_timeout_s:g} s")) from None
            if isinstance(exc, WorkerError):
                raise self._reject(exc) from None
            if isinstance(exc, asyncio.CancelledError):
                self.rejections["cancelled"] += 1
            raise

    def release(self, grant: Grant) -> None:
        """Gives a grant back; a second release of the same grant does nothing."""
        if grant.released:
            return
        grant.released = True
        self._running -= 1
        self._budget_used -= grant.cost
        self._dispatch()

    def drain(self) -> None:
        """Refuses new requests and fails every queued one with Draining; running ones go on."""
        self._draining = True
        while self._heap:
            waiter = heapq.heappop(self._heap)
            if not waiter.future.done():
                waiter.future.set_exception(Draining("worker is draining"))

    def _fits(self, cost: int) -> bool:
        return self._running < self.max_concurrency and self._budget_used + cost <= self.budget_total

    def _grant(self, cost: int, queued_s: float) -> Grant:
        self._running += 1
        self._budget_used += cost
        return Grant(cost, queued_s)

    def _dispatch(self) -> None:
        now = self._clock()
        while self._heap:
            head = self._heap[0]
            if head.future.done():
                heapq.heappop(self._heap)
                continue
            if not self._fits(head.cost):
                break
            heapq.heappop(self._heap)
            head.future.set_result(self._grant(head.cost, now - head.enqueued_at))

    def _leave_queue(self, waiter: _Waiter) -> None:
        if not waiter.future.done():
            waiter.future.cancel()
        if waiter in self._heap:
            self._heap.remove(waiter)
            heapq.heapify(self._heap)
        # The leaver may have been the head that blocked smaller requests behind it.
        self._dispatch()

    def _reject(self, error: WorkerError) -> WorkerError:
        self.rejections[getattr(error, "reason", type(error).__name__)] += 1
        return error
