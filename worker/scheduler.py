"""TaskScheduler: admits requests against concurrency slots and a KV token budget, queueing the rest,
and shares both between tenants (fairness.py)."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections import Counter, OrderedDict
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
from worker.fairness import DEFAULT_TENANT, Fairness


@dataclass(slots=True)
class Grant:
    """A slot and `cost` budget tokens held by one request until released."""

    cost: int
    queued_s: float
    tenant: str = DEFAULT_TENANT
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
    sort_key: tuple[int, int]  # (-priority, arrival): a tenant's own requests in this order
    cost: int = field(compare=False)
    future: asyncio.Future[Grant] = field(compare=False)
    enqueued_at: float = field(compare=False)
    tenant: str = field(compare=False)
    prompt_tokens: int = field(compare=False)


class TaskScheduler:
    """All-or-nothing admission: a request runs once a slot is free and its whole cost fits.

    Waiting requests form a bounded queue, one heap per tenant (higher priority first, then
    arrival). The next to admit is the best head by the fairness policy among tenants under their
    caps; it blocks the others until it fits, so a large request is never starved by small ones.
    """

    def __init__(
        self,
        *,
        max_concurrency: int,
        max_queue: int,
        queue_timeout_s: float,
        budget_tokens: int,
        fairness: Fairness | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.max_concurrency = max_concurrency
        self.max_queue = max_queue
        self.queue_timeout_s = queue_timeout_s
        self.budget_total = budget_tokens
        self._clock = clock
        self.fairness = fairness or Fairness()
        self._running = 0
        self._budget_used = 0
        self._waiting: dict[str, list[_Waiter]] = {}  # tenant -> heap; no empty ones
        self._queued = 0
        self._sequence = itertools.count()
        self._draining = False
        self.rejections: Counter[str] = Counter()
        self.tenant_running: Counter[str] = Counter()
        self.tenant_budget: Counter[str] = Counter()
        self._seen: OrderedDict[str, float] = OrderedDict()  # tenant -> when it last asked or had one end
        self._recent = 1  # tenants active or seen within fairness.recent_s: the headroom's shares

    def load(self) -> Load:
        return Load(
            running=self._running,
            queued=self._queued,
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

    def queued_by_tenant(self) -> Counter[str]:
        return Counter({tenant: len(heap) for tenant, heap in self._waiting.items()})

    @asynccontextmanager
    async def slot(self, cost: int, priority: int = 0, deadline: float | None = None, tenant: str = DEFAULT_TENANT,
                   prompt_tokens: int = 0) -> AsyncIterator[Grant]:
        """Admits, yields the grant, and gives it back however the body ends."""
        grant = await self.admit(cost, priority, deadline, tenant, prompt_tokens)
        try:
            yield grant
        finally:
            self.release(grant)

    async def admit(self, cost: int, priority: int = 0, deadline: float | None = None, tenant: str = DEFAULT_TENANT,
                    prompt_tokens: int = 0) -> Grant:
        """Waits until the request fits; raises a WorkerError saying why it was not admitted.

        `deadline` is on this scheduler's clock (time.monotonic by default). `prompt_tokens` are
        charged to the tenant's service on admission, generated ones through `served`.
        """
        now = self._clock()
        if self._draining:
            raise self._reject(Draining("worker is draining"), tenant)
        if cost > self.budget_total:
            raise self._reject(OverBudget(
                f"request needs {cost} KV tokens (prompt + max_tokens); the worker holds {self.budget_total}"), tenant)
        if cost > self._tenant_budget(tenant):
            raise self._reject(OverBudget(
                f"request needs {cost} KV tokens (prompt + max_tokens); tenant {tenant!r} may hold "
                f"{self._tenant_budget(tenant)}"), tenant)
        if deadline is not None and deadline <= now:
            raise self._reject(RequestDeadlineExceeded("deadline passed before admission"), tenant)
        if not self.tenant_running[tenant] and tenant not in self._waiting:
            self.fairness.activate(tenant, set(self.tenant_running) | set(self._waiting))
        self._saw(tenant, now)
        if not self._queued and self._fits(cost, tenant):
            return self._grant(cost, tenant, prompt_tokens, 0.0)
        if self._queued >= self.max_queue:
            raise self._reject(QueueFull(f"admission queue is full ({self.max_queue} waiting)"), tenant)

        waiter = _Waiter((-priority, next(self._sequence)), cost, asyncio.get_running_loop().create_future(), now,
                         tenant, prompt_tokens)
        heapq.heappush(self._waiting.setdefault(tenant, []), waiter)
        self._queued += 1
        self._dispatch()  # a tenant with a lower counter, or under its cap, may go ahead of the head
        wait_s = self.queue_timeout_s
        deadline_first = deadline is not None and deadline - now < wait_s
        if deadline_first:
            wait_s = deadline - now
        try:
            async with asyncio.timeout(wait_s):
                return await waiter.future
        except BaseException as exc:
            if waiter.future.done() and not waiter.future.cancelled() and waiter.future.exception() is None:
                # Granted in the same instant the wait ended: give it straight back, never run.
                self.release(waiter.future.result())
                self.fairness.charge(tenant, prompt_tokens=-prompt_tokens)
                self.fairness.stats_of(tenant).admitted -= 1
            else:
                self._leave_queue(waiter)
            if isinstance(exc, TimeoutError):
                if deadline_first:
                    raise self._reject(RequestDeadlineExceeded("deadline passed while queued"), tenant) from None
                raise self._reject(QueueTimeout(
                    f"no slot or budget within the queue timeout of {self.queue_timeout_s:g} s"), tenant) from None
            if isinstance(exc, WorkerError):
                raise self._reject(exc, tenant) from None
            if isinstance(exc, asyncio.CancelledError):
                self.rejections["cancelled"] += 1
                self.fairness.stats_of(tenant).rejections["cancelled"] += 1
            raise

    def served(self, grant: Grant, generated_tokens: int) -> None:
        """Charges tokens generated for a running request to its tenant."""
        self.fairness.charge(grant.tenant, generated_tokens=generated_tokens)

    def release(self, grant: Grant) -> None:
        """Gives a grant back; a second release of the same grant does nothing."""
        if grant.released:
            return
        grant.released = True
        self._running -= 1
        self._budget_used -= grant.cost
        self.tenant_running[grant.tenant] -= 1
        self.tenant_budget[grant.tenant] -= grant.cost
        if not self.tenant_running[grant.tenant]:
            del self.tenant_running[grant.tenant], self.tenant_budget[grant.tenant]
        self._saw(grant.tenant, self._clock())
        self._dispatch()

    def drain(self) -> None:
        """Refuses new requests and fails every queued one with Draining; running ones go on."""
        self._draining = True
        waiting, self._waiting, self._queued = self._waiting, {}, 0
        for heap in waiting.values():
            for waiter in heap:
                if not waiter.future.done():
                    waiter.future.set_exception(Draining("worker is draining"))

    def _tenant_budget(self, tenant: str) -> int:
        return int(self.budget_total * self.fairness.limits(tenant).max_budget_share)

    def _under_cap(self, cost: int, tenant: str) -> bool:
        cap = self.fairness.limits(tenant).max_concurrency
        return ((not cap or self.tenant_running[tenant] < cap)
                and self.tenant_budget[tenant] + cost <= self._tenant_budget(tenant)
                and self._running < self._slots_for(tenant))

    def _saw(self, tenant: str, now: float) -> None:
        """Counts the tenants active now or seen within fairness.recent_s (the headroom and burst read it)."""
        if not (self.fairness.headroom_slots or self.fairness.burst_slots):
            return
        self._seen[tenant] = now
        self._seen.move_to_end(tenant)
        since = now - self.fairness.recent_s
        while self._seen and next(iter(self._seen.values())) < since:
            self._seen.popitem(last=False)
        self._recent = max(1, len(self._seen.keys() | self.tenant_running.keys() | self._waiting.keys()))

    def _light(self, tenant: str) -> bool:
        """Whether `tenant` runs fewer than its share of the slots among the tenants seen lately;
        with burst slots, among those with work now where they are fewer (two at least, so a
        tenant alone with work does not take the burst slots between the others' requests).
        Tenants seen lately with nothing running or waiting do not shrink a light one's share
        then: three light tenants at 2 requests/s each beside a flood (2-core CPU, 6 burst slots)
        got a TTFT p99 of 130 ms with a quarter of the slots each and 66-116 ms with this (50-55
        with the pool to themselves; 30 s runs).

        Under VTC a tenant with fewer slots and less service than every tenant that holds its
        share is light too: VTC admits it first, and only the slots the others hold keep it out.
        Poisson arrivals now and then bring a light tenant's third request while two run; it
        waited for one of them to end (38-154 ms: the p99's tail, 96-116 ms against 71-72 with
        this) though it had had less service than the flood."""
        tenants = self._recent
        if self.fairness.burst_slots:
            tenants = min(tenants, max(2, len(self.tenant_running.keys() | self._waiting.keys())))
        share, running = self.max_concurrency / tenants, self.tenant_running[tenant]
        if running < share:
            return True
        if not self.fairness.burst_slots:
            return False
        holding = [t for t, n in self.tenant_running.items() if n >= share and t != tenant]
        return (bool(holding) and all(running < self.tenant_running[t] for t in holding)
                and self.fairness.behind(tenant, holding))

    def _slots_for(self, tenant: str) -> int:
        """The running requests under which `tenant` may start one. A tenant running fewer than its
        share of the slots (_light) may go burst_slots above them; one that holds its share may
        fill them all but the headroom. So a light tenant between two requests keeps its share,
        and one alone, or tenants that all have work waiting, leave nothing idle."""
        if self._light(tenant):
            return self.max_concurrency + self.fairness.burst_slots
        return self.max_concurrency - min(self.fairness.headroom_slots, self.max_concurrency - 1)

    def _fits(self, cost: int, tenant: str) -> bool:
        return self._budget_used + cost <= self.budget_total and self._under_cap(cost, tenant)

    def _grant(self, cost: int, tenant: str, prompt_tokens: int, queued_s: float) -> Grant:
        self._running += 1
        self._budget_used += cost
        self.tenant_running[tenant] += 1
        self.tenant_budget[tenant] += cost
        self.fairness.charge(tenant, prompt_tokens=prompt_tokens)
        self.fairness.stats_of(tenant).admitted += 1
        return Grant(cost, queued_s, tenant)

    def _next(self) -> _Waiter | None:
        """The head to admit next: by the fairness policy among the tenants under their caps (and
        outside the headroom, or in a burst slot, by their share)."""
        best, best_key = None, None
        for tenant, heap in self._waiting.items():
            head = heap[0]
            if not self._under_cap(head.cost, tenant):
                continue
            key = self.fairness.order(tenant, -head.sort_key[0], head.sort_key[1])
            if best_key is None or key < best_key:
                best, best_key = head, key
        return best

    def _dispatch(self) -> None:
        now = self._clock()
        while (head := self._next()) is not None:
            if head.future.done():  # cancelled, its task not yet told
                self._pop(head)
                continue
            if not self._fits(head.cost, head.tenant):
                break
            self._pop(head)
            head.future.set_result(self._grant(head.cost, head.tenant, head.prompt_tokens, now - head.enqueued_at))

    def _pop(self, waiter: _Waiter) -> None:
        heap = self._waiting[waiter.tenant]
        if heap[0] is waiter:
            heapq.heappop(heap)
        else:
            heap.remove(waiter)
            heapq.heapify(heap)
        if not heap:
            del self._waiting[waiter.tenant]
        self._queued -= 1

    def _leave_queue(self, waiter: _Waiter) -> None:
        if not waiter.future.done():
            waiter.future.cancel()
        if waiter in self._waiting.get(waiter.tenant, ()):
            self._pop(waiter)
        # The leaver may have been the head that blocked smaller requests behind it.
        self._dispatch()

    def _reject(self, error: WorkerError, tenant: str = DEFAULT_TENANT) -> WorkerError:
        reason = getattr(error, "reason", type(error).__name__)
        self.rejections[reason] += 1
        self.fairness.stats_of(tenant).rejections[reason] += 1
        return error
