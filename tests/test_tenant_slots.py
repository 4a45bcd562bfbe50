"""Slots kept for light tenants while a flood holds the rest, on the scheduler alone: the
headroom below max_concurrency and the burst slots above it, who counts as light for them, and
that every slot comes back."""

import asyncio
import contextlib

from tests.test_fairness import make
from worker.fairness import Fairness
from worker.scheduler import TaskScheduler


async def test_headroom_keeps_slots_for_a_light_tenant_while_a_flood_holds_the_rest():
    clock = [0.0]

    def scheduler_of(headroom: int) -> TaskScheduler:
        return TaskScheduler(max_concurrency=8, max_queue=1000, queue_timeout_s=30.0, budget_tokens=10_000,
                             fairness=Fairness(headroom_slots=headroom, recent_s=30.0), clock=lambda: clock[0])

    async def flood_after_light(headroom: int, idle_s: float) -> tuple[int, bool]:
        """A light tenant asks once and is done; `idle_s` later the flood sends 12 and the light
        tenant asks again: (the flood's running requests, whether the light one started at once)."""
        scheduler = scheduler_of(headroom)
        scheduler.release(await scheduler.admit(10, tenant="light"))
        clock[0] += idle_s
        flood = [asyncio.create_task(scheduler.admit(10, tenant="flood")) for _ in range(12)]
        await asyncio.sleep(0)
        flood_running = scheduler.load().running
        light = asyncio.create_task(scheduler.admit(10, tenant="light"))
        await asyncio.sleep(0)
        started = light.done()
        for task in flood:
            task.cancel()
        for task in [*flood, light]:
            with contextlib.suppress(asyncio.CancelledError):
                scheduler.release(await task)
        assert scheduler.load() == make(max_concurrency=8).load()
        return flood_running, started

    assert await flood_after_light(0, 1.0) == (8, False), "without headroom the flood fills every slot"
    assert await flood_after_light(2, 1.0) == (6, True), "the light tenant starts at once, the flood queued"
    assert await flood_after_light(2, 31.0) == (8, False), "a tenant gone past recent_s holds no slots back"

    # Tenants that all have work waiting leave nothing idle: the headroom is taken by whoever is
    # under its share, and each holds its share once every slot is full.
    scheduler = scheduler_of(2)
    waiting = [asyncio.create_task(scheduler.admit(10, tenant=t)) for _ in range(10) for t in ("flood", "light")]
    await asyncio.sleep(0)
    assert scheduler.load().running == 8 and scheduler.tenant_running == {"flood": 4, "light": 4}
    while scheduler.queued_by_tenant()["light"]:  # the light tenant's requests end first, again and again
        running = [t.result() for t in waiting if t.done() and not t.result().released]
        scheduler.release(next(g for g in running if g.tenant == "light"))
        await asyncio.sleep(0)
        assert scheduler.load().running == 8, scheduler.tenant_running
    # Now the light tenant has nothing waiting: its share stays free for its next request.
    scheduler.release(next(t.result() for t in waiting if t.done() and t.result().tenant == "light"
                           and not t.result().released))
    await asyncio.sleep(0)
    assert scheduler.tenant_running == {"flood": 4, "light": 3}, "the flood, at its share, stays out of the headroom"
    for task in waiting:
        task.cancel()
    for task in waiting:
        with contextlib.suppress(asyncio.CancelledError):
            scheduler.release(await task)
    assert scheduler.load().running == 0 and not scheduler.tenant_running


async def test_burst_slots_start_a_light_tenant_above_the_limit_and_keep_the_flood_within_it():
    def running(tasks):
        return [t.result() for t in tasks if t.done() and not t.cancelled() and not t.result().released]

    async def light_while_flooded(burst: int) -> tuple[TaskScheduler, list, list]:
        scheduler = TaskScheduler(max_concurrency=8, max_queue=1000, queue_timeout_s=30.0, budget_tokens=10_000,
                                  fairness=Fairness(burst_slots=burst))
        flood = [asyncio.create_task(scheduler.admit(10, tenant="flood")) for _ in range(12)]
        await asyncio.sleep(0)
        light = [asyncio.create_task(scheduler.admit(10, tenant="light")) for _ in range(3)]
        await asyncio.sleep(0)
        return scheduler, flood, light

    scheduler, flood, light = await light_while_flooded(0)
    assert scheduler.load().running == 8 and not any(t.done() for t in light), "without burst the light one waits"
    scheduler, flood, light = await light_while_flooded(2)
    assert scheduler.tenant_running == {"flood": 8, "light": 2}, "two light requests start at once, above the 8"
    # A flood request ends: the flood, at its share, starts again only below the 8; the light
    # tenant, under its share of 4, takes the slot above them.
    scheduler.release(running(flood)[0])
    await asyncio.sleep(0)
    assert scheduler.tenant_running == {"flood": 7, "light": 3} and all(t.done() for t in light)
    # The light tenant done, the flood fills the 8 again and no more.
    for grant in running(light):
        scheduler.release(grant)
    await asyncio.sleep(0)
    assert scheduler.tenant_running == {"flood": 8} and scheduler.load().queued == 3
    for task in flood:
        task.cancel()
    for task in flood:
        with contextlib.suppress(asyncio.CancelledError):
            scheduler.release(await task)
    assert scheduler.load() == make(max_concurrency=8).load()
    # A tenant alone is under its share until it holds all 8, and stops there.
    scheduler = make(Fairness(burst_slots=2), max_concurrency=8)
    alone = [asyncio.create_task(scheduler.admit(10, tenant="solo")) for _ in range(12)]
    await asyncio.sleep(0)
    assert scheduler.tenant_running == {"solo": 8}
    for task in alone:
        task.cancel()
    for task in alone:
        with contextlib.suppress(asyncio.CancelledError):
            scheduler.release(await task)


async def test_burst_shares_count_the_tenants_with_work_not_every_one_seen_lately():
    """Four tenants seen lately, two with work: a light tenant's share for the burst slots is half
    the slots, not a quarter, and the flood, alone with work, still stays within the limit."""
    scheduler = make(Fairness(burst_slots=3, recent_s=30.0), max_concurrency=8)
    for tenant in ("a", "b", "c"):
        scheduler.release(await scheduler.admit(10, tenant=tenant))
    flood = [asyncio.create_task(scheduler.admit(10, tenant="flood")) for _ in range(12)]
    await asyncio.sleep(0)
    assert scheduler.tenant_running == {"flood": 8}, "alone with work, the flood takes no burst slot"
    light = [asyncio.create_task(scheduler.admit(10, tenant="a")) for _ in range(3)]
    await asyncio.sleep(0)
    assert scheduler.tenant_running == {"flood": 8, "a": 3}, "a quarter of the slots would have started two"
    for task in [*flood, *light]:
        task.cancel()
    for task in [*flood, *light]:
        with contextlib.suppress(asyncio.CancelledError):
            scheduler.release(await task)
    assert scheduler.load() == make(max_concurrency=8).load() and not scheduler.tenant_running


async def test_a_tenant_served_less_than_those_holding_their_share_takes_a_burst_slot_past_its_own():
    """Four tenants with work, a share of two slots each: a light tenant's third request (Poisson
    arrivals bring one now and then) starts at once while it has had less service than the
    flood, which holds its eight; once it has had more, it waits like anyone at their share."""
    scheduler = make(Fairness(burst_slots=6), max_concurrency=8)
    flood = [asyncio.create_task(scheduler.admit(10, tenant="flood")) for _ in range(12)]
    await asyncio.sleep(0)
    others = [asyncio.create_task(scheduler.admit(10, tenant=t)) for t in ("b", "c", "a", "a")]
    await asyncio.sleep(0)
    assert scheduler.tenant_running == {"flood": 8, "b": 1, "c": 1, "a": 2}, "each one lifted to the flood's counter"
    for grant in [task.result() for task in flood if task.done()]:
        scheduler.served(grant, 10)  # the flood's eight rows make tokens while "a"'s two do
    others.append(asyncio.create_task(scheduler.admit(10, tenant="a")))
    await asyncio.sleep(0)
    assert scheduler.tenant_running == {"flood": 8, "b": 1, "c": 1, "a": 3}
    scheduler.served(others[-1].result(), 100)  # now "a" has had more than the flood
    late = asyncio.create_task(scheduler.admit(10, tenant="a"))
    await asyncio.sleep(0)
    assert not late.done() and scheduler.tenant_running["a"] == 3 and scheduler.load().running == 13
    for task in [*flood, *others, late]:
        task.cancel()
    for task in [*flood, *others, late]:
        with contextlib.suppress(asyncio.CancelledError):
            scheduler.release(await task)
    assert scheduler.load() == make(max_concurrency=8).load() and not scheduler.tenant_running
