"""The TaskScheduler's sharing between tenants, on the scheduler alone: VTC's rules (no starvation
by a newcomer, no credit banked while idle, weights), priority bands over fairness, per-tenant
caps, FCFS when chosen, and a soak of random cancels that gives everything back (the headroom
and burst slots: test_tenant_slots.py)."""

import asyncio
import random
from collections import Counter

import pytest

from worker.config import ConfigError
from worker.config_loader import load_config
from worker.errors import InvalidRequest, OverBudget, QueueTimeout
from worker.fairness import Fairness, TenantLimits
from worker.scheduler import TaskScheduler


def make(fairness: Fairness | None = None, max_concurrency: int = 1, budget_tokens: int = 10_000,
         queue_timeout_s: float = 30.0) -> TaskScheduler:
    return TaskScheduler(max_concurrency=max_concurrency, max_queue=1000, queue_timeout_s=queue_timeout_s,
                         budget_tokens=budget_tokens, fairness=fairness)


class Backlog:
    """Requests queued behind one running request; each turn the running one is charged
    `generated` tokens and released, and whoever is admitted next runs."""

    def __init__(self, scheduler: TaskScheduler):
        self.scheduler = scheduler
        self.waiting: list[tuple[str, asyncio.Task]] = []
        self.running = None

    async def start(self, tenant: str = "seed") -> None:
        self.running = (tenant, await self.scheduler.admit(10, tenant=tenant))

    async def add(self, tenant: str, count: int = 1, priority: int = 0, prompt_tokens: int = 10) -> None:
        for _ in range(count):
            task = asyncio.create_task(self.scheduler.admit(10 + prompt_tokens, priority, tenant=tenant,
                                                            prompt_tokens=prompt_tokens))
            self.waiting.append((tenant, task))
        await asyncio.sleep(0)

    async def turns(self, count: int, generated: int = 10) -> list[str]:
        order = []
        for _ in range(count):
            self.scheduler.served(self.running[1], generated)
            self.scheduler.release(self.running[1])
            await asyncio.sleep(0)
            done = [(t, task) for t, task in self.waiting if task.done()]
            assert len(done) == 1, "exactly one admitted a turn"
            self.waiting.remove(done[0])
            self.running = (done[0][0], done[0][1].result())
            order.append(done[0][0])
        return order

    async def close(self) -> None:
        for _, task in self.waiting:
            task.cancel()
        await asyncio.gather(*(task for _, task in self.waiting), return_exceptions=True)
        self.scheduler.release(self.running[1])


async def test_backlogged_tenants_take_turns_whatever_they_sent():
    backlog = Backlog(make())
    await backlog.start()
    await backlog.add("flood", 30)
    await backlog.add("light", 3)
    order = await backlog.turns(6)
    assert Counter(order) == {"flood": 3, "light": 3}  # not the flood's 30 first
    await backlog.close()


async def test_a_new_tenant_does_not_starve_those_already_served():
    backlog = Backlog(make())
    await backlog.start("old")
    await backlog.add("old", 20)
    await backlog.turns(10)  # old's counter grows; newcomer starts level with it, not at zero
    await backlog.add("new", 10)
    assert Counter(await backlog.turns(8)) == {"old": 4, "new": 4}
    await backlog.close()


async def test_an_idle_tenant_banks_no_credit():
    scheduler = make()
    backlog = Backlog(scheduler)
    await backlog.start("busy")
    await backlog.add("busy", 30)
    await backlog.add("idle", 1)
    assert Counter(await backlog.turns(4)) == {"busy": 3, "idle": 1}
    await backlog.turns(12)  # idle has nothing waiting or running: busy alone
    assert scheduler.fairness.counters["busy"] > scheduler.fairness.counters["idle"] + 300
    await backlog.add("idle", 10)
    assert Counter(await backlog.turns(6)) == {"busy": 3, "idle": 3}
    await backlog.close()


async def test_weights_share_service_in_proportion():
    backlog = Backlog(make(Fairness(named={"gold": TenantLimits(weight=2.0)})))
    await backlog.start()
    await backlog.add("gold", 40)
    await backlog.add("basic", 40)
    assert Counter(await backlog.turns(30)) == {"gold": 20, "basic": 10}
    await backlog.close()


async def test_priority_bands_come_before_fairness():
    backlog = Backlog(make())
    await backlog.start("heavy")
    await backlog.add("heavy", 10, priority=1)
    await backlog.turns(5)
    await backlog.add("light", 3, priority=0)
    # heavy is far ahead on service, but its requests are in the higher band.
    assert await backlog.turns(5) == ["heavy"] * 5
    assert await backlog.turns(3) == ["light"] * 3
    await backlog.close()


async def test_fcfs_admits_in_arrival_order():
    backlog = Backlog(make(Fairness(policy="fcfs")))
    await backlog.start()
    await backlog.add("flood", 5)
    await backlog.add("light", 2)
    assert await backlog.turns(7) == ["flood"] * 5 + ["light"] * 2


async def test_a_tenant_at_its_cap_waits_without_blocking_others():
    fairness = Fairness(named={"capped": TenantLimits(max_concurrency=1, max_budget_share=0.5)})
    scheduler = make(fairness, max_concurrency=4, budget_tokens=1000)
    first = await scheduler.admit(100, tenant="capped")
    second = asyncio.create_task(scheduler.admit(100, tenant="capped"))
    await asyncio.sleep(0)
    others = [await asyncio.wait_for(scheduler.admit(100, tenant="other"), 1) for _ in range(3)]
    assert not second.done() and scheduler.load().running == 4
    for grant in others:
        scheduler.release(grant)
    scheduler.release(first)
    scheduler.release(await asyncio.wait_for(second, 1))
    with pytest.raises(OverBudget, match="tenant 'capped' may hold 500"):
        await scheduler.admit(600, tenant="capped")
    assert scheduler.fairness.stats["capped"].rejections["over_budget"] == 1
    assert scheduler.load().running == 0 and not scheduler.tenant_running and not scheduler.tenant_budget


async def test_tenants_come_from_the_configured_key():
    fairness = Fairness(key="x-team")
    assert fairness.tenant_of({"x-team": "search"}) == "search"
    assert fairness.tenant_of({"x-other": "search"}) == "default"
    with pytest.raises(InvalidRequest):
        fairness.tenant_of({"x-team": "a" * 200})
    labelled = Fairness(named={"vip": TenantLimits()}, metric_tenants=2)
    assert [labelled.label(t) for t in ("a", "b", "vip", "c", "a")] == ["a", "b", "vip", "other", "a"]


def test_tenant_settings_are_checked_when_the_config_loads():
    config = load_config(env={}, overrides={"tenants.named.gold": {"weight": 2, "max_concurrency": 3}})
    assert Fairness.from_config(config.tenants).limits("gold") == TenantLimits(2.0, 3, 1.0)
    for bad, key in (({"weight": 0}, "tenants.named.gold.weight"), ({"share": 1}, "tenants.named.gold.share"),
                     ({"max_budget_share": 1.5}, "tenants.named.gold.max_budget_share")):
        with pytest.raises(ConfigError) as error:
            load_config(env={}, overrides={"tenants.named.gold": bad})
        assert error.value.key == key
    with pytest.raises(ConfigError, match="tenants.policy"):
        load_config(env={}, overrides={"tenants.policy": "lottery"})


async def test_a_soak_of_random_cancels_across_tenants_gives_everything_back():
    rng = random.Random(5)
    fairness = Fairness(named={"t0": TenantLimits(max_concurrency=2), "t1": TenantLimits(weight=3, max_budget_share=0.4)},
                        burst_slots=2)
    scheduler = make(fairness, max_concurrency=6, budget_tokens=2000, queue_timeout_s=0.2)
    outcomes = Counter()

    async def one(index: int) -> None:
        tenant = f"t{rng.randrange(5)}"
        try:
            async with scheduler.slot(rng.randint(20, 400), rng.choice((0, 0, 1)), tenant=tenant,
                                      prompt_tokens=10) as grant:
                for _ in range(rng.randint(1, 5)):
                    await asyncio.sleep(rng.uniform(0, 0.01))
                    scheduler.served(grant, 1)
            outcomes["done"] += 1
        except QueueTimeout:
            outcomes["timeout"] += 1

    tasks = [asyncio.create_task(one(i)) for i in range(400)]
    # 150 cancels, each due within half the queue timeout at a task picked up front: nearly all
    # find it queued or running however fast the loop turns (cancels timed by the loop's own
    # sleeps fell after the timeouts on a slow run: 46 of 150 landed).
    for task in rng.sample(tasks, 150):
        asyncio.get_running_loop().call_later(rng.uniform(0, 0.1), task.cancel)
    results = await asyncio.gather(*tasks, return_exceptions=True)
    outcomes["cancelled"] = sum(isinstance(r, asyncio.CancelledError) for r in results)
    assert min(outcomes["done"], outcomes["cancelled"], outcomes["timeout"]) > 50, outcomes
    load = scheduler.load()
    assert (load.running, load.queued, load.budget_used) == (0, 0, 0)
    assert not scheduler.tenant_running and not scheduler.tenant_budget and not scheduler.queued_by_tenant()
    admitted = sum(s.admitted for s in fairness.stats.values())
    assert admitted == outcomes["done"] + sum(1 for r in results if isinstance(r, asyncio.CancelledError)) - \
        sum(s.rejections["cancelled"] for s in fairness.stats.values())


async def test_a_worker_serves_the_light_tenant_between_the_flood_s_requests():
    """Through StreamPredict: the tenant comes from the metadata key, the light tenant's requests
    are admitted ahead of the flood's backlog, and the metrics say who got what."""
    import grpc

    from tests.conftest import running_worker, synthetic_request
    from worker.gen.cyllm.inference.v1 import inference_pb2 as pb

    settings = {"resources.max_concurrency": "1", "engine.args": "{tokens_per_s: 400}"}
    async with running_worker(**settings) as (worker, client):
        finished: list[str] = []

        async def ask(tenant: str, index: int) -> None:
            request = synthetic_request(max_tokens=8, metadata={"x-gateway-inference-fairness-id": tenant})
            async for reply in client.inference.StreamPredict(request):
                if reply.finish_reason:
                    finished.append(f"{tenant}{index}")

        flood = [asyncio.create_task(ask("flood", i)) for i in range(6)]
        while worker.scheduler.load().queued < 5:  # the flood's backlog is queued before light asks
            await asyncio.sleep(0.001)
        light = [asyncio.create_task(ask("light", i)) for i in range(2)]
        await asyncio.gather(*flood, *light)
        assert max(finished.index("light0"), finished.index("light1")) <= 4, finished
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await client.inference.StreamPredict(synthetic_request(metadata={"x-gateway-inference-fairness-id": "x" * 300})).read()
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        text = (await client.control.Metrics(pb.MetricsRequest())).text
        assert 'cyllm_tenant_admitted_total{tenant="flood"} 6.0' in text
        assert 'cyllm_tenant_tokens_total{kind="generated",tenant="light"} 16.0' in text
        assert 'cyllm_tenant_queue_time_seconds_count{tenant="light"} 2.0' in text
        assert 'cyllm_tenant_running_requests' in text and worker.scheduler.load().running == 0


def test_the_sidecar_forwards_the_gateway_s_fairness_key(worker_process, sidecar):
    import grpc
    import httpx

    from tests.test_sidecar import grpc_stub
    from worker.gen.cyllm.inference.v1 import inference_pb2 as pb
    from worker.gen.cyllm.inference.v1 import inference_pb2_grpc as pb_grpc

    worker = worker_process("--engine", "synthetic")
    worker.wait_ready()
    front = sidecar([worker.socket_path])
    front.wait_ready()
    reply = httpx.post(f"{front.http}/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                       headers={"x-gateway-inference-fairness-id": "team-a"}, timeout=10)
    assert reply.status_code == 200, reply.text
    channel, stub, _ = grpc_stub(front)
    with channel:
        list(stub.StreamPredict(pb.PredictRequest(prompt="hi", sampling=pb.SamplingParams(max_tokens=2)),
                                metadata=(("x-gateway-inference-fairness-id", "team-b"),), timeout=10))
    with grpc.insecure_channel(f"unix:{worker.socket_path}") as direct:
        text = pb_grpc.WorkerControlStub(direct).Metrics(pb.MetricsRequest(), timeout=5).text
    for tenant in ("team-a", "team-b"):
        assert f'cyllm_tenant_admitted_total{{tenant="{tenant}"}} 1.0' in text, text
