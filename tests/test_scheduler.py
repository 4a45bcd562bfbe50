"""TaskScheduler on its own: slots, budget, queue bound, priority, timeouts, deadlines, cancellation, drain."""

import asyncio

import pytest

from worker.errors import Draining, OverBudget, QueueFull, QueueTimeout, RequestDeadlineExceeded
from worker.scheduler import TaskScheduler


def make(max_concurrency=2, max_queue=8, queue_timeout_s=5.0, budget_tokens=1000) -> TaskScheduler:
    return TaskScheduler(max_concurrency=max_concurrency, max_queue=max_queue,
                         queue_timeout_s=queue_timeout_s, budget_tokens=budget_tokens)


def assert_empty(scheduler: TaskScheduler) -> None:
    load = scheduler.load()
    assert (load.running, load.queued, load.budget_used) == (0, 0, 0)


async def test_admits_up_to_the_cap_then_queues():
    scheduler = make(max_concurrency=2)
    first, second = await scheduler.admit(10), await scheduler.admit(10)
    third = asyncio.create_task(scheduler.admit(10))
    await asyncio.sleep(0)
    assert scheduler.load().running == 2 and scheduler.load().queued == 1
    scheduler.release(first)
    grant = await third
    assert grant.queued_s >= 0 and scheduler.load().running == 2
    for g in (second, grant):
        scheduler.release(g)
    assert_empty(scheduler)


async def test_budget_is_all_or_nothing_and_the_head_is_not_starved():
    scheduler = make(max_concurrency=10, budget_tokens=100)
    held = await scheduler.admit(60)
    big = asyncio.create_task(scheduler.admit(80))
    await asyncio.sleep(0)
    small = asyncio.create_task(scheduler.admit(10))
    await asyncio.sleep(0)
    # 10 would fit beside 60, but the 80 at the head waits first: no starvation of large requests.
    assert not big.done() and not small.done()
    assert scheduler.load().budget_used == 60
    scheduler.release(held)
    big_grant, small_grant = await big, await small
    assert scheduler.load().budget_used == 90
    scheduler.release(big_grant)
    scheduler.release(small_grant)
    assert_empty(scheduler)


async def test_over_the_whole_budget_is_refused_at_once():
    scheduler = make(budget_tokens=100)
    with pytest.raises(OverBudget):
        await scheduler.admit(101)
    assert scheduler.rejections["over_budget"] == 1
    assert_empty(scheduler)


async def test_queue_full_is_refused_before_waiting():
    scheduler = make(max_concurrency=1, max_queue=1)
    held = await scheduler.admit(1)
    waiting = asyncio.create_task(scheduler.admit(1))
    await asyncio.sleep(0)
    with pytest.raises(QueueFull):
        await scheduler.admit(1)
    assert scheduler.rejections["queue_full"] == 1
    scheduler.release(held)
    scheduler.release(await waiting)
    assert_empty(scheduler)


async def test_queue_timeout_holds_nothing():
    scheduler = make(max_concurrency=1, queue_timeout_s=0.05)
    held = await scheduler.admit(1)
    with pytest.raises(QueueTimeout):
        await scheduler.admit(1)
    assert scheduler.load().queued == 0 and scheduler.rejections["queue_timeout"] == 1
    scheduler.release(held)
    assert_empty(scheduler)


async def test_deadline_while_queued_and_already_passed():
    scheduler = make(max_concurrency=1, queue_timeout_s=10)
    held = await scheduler.admit(1)
    loop_now = asyncio.get_running_loop().time()
    with pytest.raises(RequestDeadlineExceeded):
        await scheduler.admit(1, deadline=loop_now + 0.05)
    with pytest.raises(RequestDeadlineExceeded):
        await scheduler.admit(1, deadline=loop_now - 1)
    assert scheduler.rejections["deadline"] == 2
    scheduler.release(held)
    assert_empty(scheduler)


async def test_priority_order_then_arrival_order():
    scheduler = make(max_concurrency=1)
    held = await scheduler.admit(1)
    order = []

    async def request(name: str, priority: int):
        grant = await scheduler.admit(1, priority=priority)
        order.append(name)
        scheduler.release(grant)

    tasks = [asyncio.create_task(request(name, priority))
             for name, priority in [("low", 0), ("high", 5), ("low2", 0), ("mid", 2)]]
    await asyncio.sleep(0)
    scheduler.release(held)
    await asyncio.gather(*tasks)
    assert order == ["high", "mid", "low", "low2"]
    assert_empty(scheduler)


async def test_cancel_storm_leaves_nothing_held():
    scheduler = make(max_concurrency=4, max_queue=200, budget_tokens=10_000)

    async def hold():
        async with scheduler.slot(10):
            await asyncio.Event().wait()

    tasks = [asyncio.create_task(hold()) for _ in range(100)]
    await asyncio.sleep(0.01)
    assert scheduler.load().running == 4 and scheduler.load().queued == 96
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert_empty(scheduler)
    assert scheduler.rejections["cancelled"] == 96


async def test_a_cancelled_head_unblocks_those_behind_it():
    scheduler = make(max_concurrency=4, budget_tokens=100)
    held = await scheduler.admit(50)
    big = asyncio.create_task(scheduler.admit(90))
    await asyncio.sleep(0)
    small = asyncio.create_task(scheduler.admit(10))
    await asyncio.sleep(0)
    big.cancel()
    grant = await asyncio.wait_for(small, 1)
    scheduler.release(grant)
    scheduler.release(held)
    assert_empty(scheduler)


async def test_grant_racing_a_timeout_is_given_back():
    scheduler = make(max_concurrency=1, queue_timeout_s=0.05)
    held = await scheduler.admit(1)
    waiter = asyncio.create_task(scheduler.admit(1))
    await asyncio.sleep(0.049)
    scheduler.release(held)  # grants the waiter in the same instant its timer may fire
    try:
        scheduler.release(await waiter)
    except QueueTimeout:
        pass
    assert_empty(scheduler)


async def test_drain_fails_the_queue_and_refuses_new_requests():
    scheduler = make(max_concurrency=1)
    held = await scheduler.admit(1)
    queued = asyncio.create_task(scheduler.admit(1))
    await asyncio.sleep(0)
    scheduler.drain()
    with pytest.raises(Draining):
        await queued
    with pytest.raises(Draining):
        await scheduler.admit(1)
    assert scheduler.load().running == 1  # running work goes on
    scheduler.release(held)
    scheduler.release(held)  # a second release changes nothing
    assert_empty(scheduler)


async def test_set_budget_admits_waiting_requests():
    scheduler = make(budget_tokens=10)
    waiter = asyncio.create_task(scheduler.admit(10))
    held = await waiter
    pending = asyncio.create_task(scheduler.admit(5))
    await asyncio.sleep(0)
    assert not pending.done()
    scheduler.set_budget(20)
    scheduler.release(await asyncio.wait_for(pending, 1))
    scheduler.release(held)
    assert_empty(scheduler)
