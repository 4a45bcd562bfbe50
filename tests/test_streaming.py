"""StreamPredict over a real Unix socket on the synthetic engine: streaming, admission, deadlines, cancel."""

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tests.conftest import running_worker, synthetic_request
from worker.gen.cyllm.inference.v1 import inference_pb2 as pb
from worker.server import INFERENCE_SERVICE

SLOW = {"engine.args.tokens_per_s": "200"}


async def test_streams_deltas_and_ends_with_usage_and_timing():
    async with running_worker() as (_, client):
        responses = await client.collect(synthetic_request(max_tokens=40, request_id="abc-1", return_token_ids=True))
        assert len(responses) > 1
        assert all(r.request_id == "abc-1" for r in responses)
        last = responses[-1]
        assert last.finish_reason == pb.FINISH_REASON_LENGTH
        assert all(r.finish_reason == pb.FINISH_REASON_UNSPECIFIED for r in responses[:-1])
        assert last.usage.completion_tokens == 40 == sum(len(r.token_ids) for r in responses)
        assert last.usage.prompt_tokens == 4
        assert len("".join(r.text for r in responses)) == 40
        assert 0 <= last.timing.queue_ms <= last.timing.time_to_first_token_ms <= last.timing.total_ms


async def test_generated_request_id_and_stop_string():
    async with running_worker() as (_, client):
        full = "".join(r.text for r in await client.collect(synthetic_request(max_tokens=30, sampling={"seed": 3})))
        stop = full[10:12]
        responses = await client.collect(synthetic_request(max_tokens=30, sampling={"seed": 3, "stop": [stop]}))
        assert responses[0].request_id and len(responses[0].request_id) == 32
        assert "".join(r.text for r in responses) == full[:full.index(stop)]
        assert responses[-1].finish_reason == pb.FINISH_REASON_STOP


async def test_health_reflection_info_and_metrics():
    async with running_worker() as (_, client):
        for service in ("", INFERENCE_SERVICE):
            reply = await client.health.Check(health_pb2.HealthCheckRequest(service=service))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(client.channel)
        names = set()
        async for reply in stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])):
            names |= {s.name for s in reply.list_services_response.service}
        assert {INFERENCE_SERVICE, "cyllm.inference.v1.WorkerControl", "grpc.health.v1.Health"} <= names
        info = await client.control.GetInfo(pb.GetInfoRequest())
        assert info.engine == "synthetic" and list(info.models) == ["synthetic"] and info.max_model_len == 8192
        await client.collect(synthetic_request())
        text = (await client.control.Metrics(pb.MetricsRequest())).text
        for name in ("cyllm_requests_total{status=\"OK\"}", "cyllm_queue_depth", "cyllm_running_requests",
                     "cyllm_time_to_first_token_seconds_bucket", "cyllm_kv_budget_total_tokens 1e+06",
                     "cyllm_generation_tokens_total"):
            assert name in text


async def test_concurrency_cap_queues_the_rest():
    async with running_worker(**SLOW, **{"resources.max_concurrency": "2"}) as (_, client):
        streams = [asyncio.create_task(client.collect(synthetic_request(max_tokens=20))) for _ in range(3)]
        for _ in range(200):
            load = await client.load()
            if load.running == 2 and load.queued == 1:
                break
            await asyncio.sleep(0.01)
        assert (load.running, load.queued) == (2, 1)
        assert load.budget_tokens_used == 2 * (4 + 20)
        await asyncio.gather(*streams)
        load = await client.wait_idle()
        assert (load.running, load.queued, load.budget_tokens_used) == (0, 0, 0)


async def test_queue_timeout_and_queue_full_are_resource_exhausted_before_any_message():
    settings = {**SLOW, "resources.max_concurrency": "1", "resources.max_queue": "1", "resources.queue_timeout_s": "0.2"}
    async with running_worker(**settings) as (worker, client):
        holder = asyncio.create_task(client.collect(synthetic_request(max_tokens=100)))
        while (await client.load()).running != 1:
            await asyncio.sleep(0.01)
        queued = asyncio.create_task(client.status_of(synthetic_request()))
        while (await client.load()).queued != 1:
            await asyncio.sleep(0.01)
        assert await client.status_of(synthetic_request()) == grpc.StatusCode.RESOURCE_EXHAUSTED  # queue full
        assert await queued == grpc.StatusCode.RESOURCE_EXHAUSTED  # queue timeout
        assert worker.scheduler.rejections["queue_full"] == 1 and worker.scheduler.rejections["queue_timeout"] == 1
        holder.cancel()
        assert (await client.wait_idle()).running == 0


async def test_priority_decides_who_runs_next():
    async with running_worker(**SLOW, **{"resources.max_concurrency": "1"}) as (_, client):
        holder = asyncio.create_task(client.collect(synthetic_request(max_tokens=30)))
        while (await client.load()).running != 1:
            await asyncio.sleep(0.01)
        finished = []

        async def run(name, priority):
            await client.collect(synthetic_request(max_tokens=2, priority=priority))
            finished.append(name)

        tasks = []
        for name, priority in [("low", 0), ("high", 9), ("mid", 3)]:
            tasks.append(asyncio.create_task(run(name, priority)))
            while (await client.load()).queued != len(tasks):
                await asyncio.sleep(0.01)
        await asyncio.gather(holder, *tasks)
        assert finished == ["high", "mid", "low"]


async def test_deadline_while_queued_and_while_running_frees_the_slot():
    async with running_worker(**SLOW, **{"resources.max_concurrency": "1"}) as (_, client):
        holder = asyncio.create_task(client.collect(synthetic_request(max_tokens=60)))
        while (await client.load()).running != 1:
            await asyncio.sleep(0.01)
        assert await client.status_of(synthetic_request(), timeout=0.1) == grpc.StatusCode.DEADLINE_EXCEEDED
        holder.cancel()
        await client.wait_idle()
        assert await client.status_of(synthetic_request(max_tokens=500), timeout=0.3) == grpc.StatusCode.DEADLINE_EXCEEDED
        load = await client.wait_idle()
        assert (load.running, load.queued, load.budget_tokens_used) == (0, 0, 0)


async def test_one_millisecond_deadline():
    async with running_worker() as (_, client):
        assert await client.status_of(synthetic_request(max_tokens=500), timeout=0.001) == grpc.StatusCode.DEADLINE_EXCEEDED
        assert (await client.wait_idle()).running == 0
        assert await client.status_of(synthetic_request()) == grpc.StatusCode.OK


async def test_cancel_storm_of_100_streams_leaves_no_slot_in_use():
    settings = {**SLOW, "resources.max_concurrency": "16", "resources.max_queue": "200"}
    async with running_worker(**settings) as (worker, client):
        calls = [client.inference.StreamPredict(synthetic_request(max_tokens=1000)) for _ in range(100)]
        while ((load := await client.load()).running, load.queued) != (16, 84):
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)  # let the running 16 stream some tokens
        for call in calls:
            call.cancel()
        load = await client.wait_idle()
        assert (load.running, load.queued, load.budget_tokens_used) == (0, 0, 0)
        assert not worker.engine._running
        for _ in range(500):  # every handler records its ending once it has unwound
            text = (await client.control.Metrics(pb.MetricsRequest())).text
            if 'cyllm_requests_total{status="CANCELLED"} 100.0' in text:
                break
            await asyncio.sleep(0.01)
        assert "cyllm_running_requests 0.0" in text and "cyllm_queue_depth 0.0" in text
        assert "cyllm_kv_budget_used_tokens 0.0" in text
        assert 'cyllm_requests_total{status="CANCELLED"} 100.0' in text
        assert await client.status_of(synthetic_request()) == grpc.StatusCode.OK


async def test_over_the_whole_budget_is_resource_exhausted():
    async with running_worker(**{"engine.args.budget_tokens": "100"}) as (_, client):
        assert await client.status_of(synthetic_request(max_tokens=200)) == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert await client.status_of(synthetic_request(max_tokens=20)) == grpc.StatusCode.OK


def _bad_requests():
    ok = synthetic_request
    chat_unknown_role = pb.PredictRequest(chat=pb.ChatInput(messages=[pb.ChatMessage(role="wizard", content="hi")]))
    yield "empty prompt", pb.PredictRequest(prompt=""), grpc.StatusCode.INVALID_ARGUMENT
    yield "no input", pb.PredictRequest(), grpc.StatusCode.INVALID_ARGUMENT
    yield "empty chat", pb.PredictRequest(chat=pb.ChatInput()), grpc.StatusCode.INVALID_ARGUMENT
    yield "unknown role", chat_unknown_role, grpc.StatusCode.INVALID_ARGUMENT
    yield "empty token ids", pb.PredictRequest(token_ids=pb.TokenIds()), grpc.StatusCode.INVALID_ARGUMENT
    yield "token out of vocab", pb.PredictRequest(token_ids=pb.TokenIds(ids=[5, 32000])), grpc.StatusCode.INVALID_ARGUMENT
    for value in (float("nan"), -0.5, 1e30, float("inf")):
        yield f"temperature {value}", ok(sampling={"temperature": value}), grpc.StatusCode.INVALID_ARGUMENT
    for value in (0.0, 1.5, -1.0, float("nan")):
        yield f"top_p {value}", ok(sampling={"top_p": value}), grpc.StatusCode.INVALID_ARGUMENT
    yield "top_k < 0", ok(sampling={"top_k": -1}), grpc.StatusCode.INVALID_ARGUMENT
    yield "min_p > 1", ok(sampling={"min_p": 1.5}), grpc.StatusCode.INVALID_ARGUMENT
    yield "repetition_penalty 0", ok(sampling={"repetition_penalty": 0.0}), grpc.StatusCode.INVALID_ARGUMENT
    yield "presence_penalty 9", ok(sampling={"presence_penalty": 9.0}), grpc.StatusCode.INVALID_ARGUMENT
    yield "max_tokens 0", ok(max_tokens=0), grpc.StatusCode.INVALID_ARGUMENT
    yield "over the context", ok(max_tokens=8190), grpc.StatusCode.INVALID_ARGUMENT
    yield "1000 stop strings", ok(sampling={"stop": [f"s{i}" for i in range(1000)]}), grpc.StatusCode.INVALID_ARGUMENT
    yield "empty stop string", ok(sampling={"stop": [""]}), grpc.StatusCode.INVALID_ARGUMENT
    yield "bad request id", ok(request_id="a b"), grpc.StatusCode.INVALID_ARGUMENT
    yield "unknown model", ok(model="gpt-17"), grpc.StatusCode.NOT_FOUND
    yield "unknown adapter", ok(adapter="rag-nope"), grpc.StatusCode.NOT_FOUND
    yield "5 MiB request", pb.PredictRequest(prompt="x" * (5 << 20)), grpc.StatusCode.RESOURCE_EXHAUSTED


@pytest.mark.parametrize(("name", "request_pb", "code"), list(_bad_requests()), ids=[c[0] for c in _bad_requests()])
async def test_bad_input_gets_its_status_and_the_next_request_is_served(name, request_pb, code):
    async with running_worker() as (_, client):
        assert await client.status_of(request_pb) == code
        load = await client.wait_idle()
        assert (load.running, load.queued, load.budget_tokens_used) == (0, 0, 0)
        responses = await client.collect(synthetic_request(max_tokens=5))
        assert responses[-1].usage.completion_tokens == 5


async def test_model_by_name_and_chat_and_token_ids_inputs():
    async with running_worker() as (_, client):
        chat = pb.PredictRequest(model="synthetic", chat=pb.ChatInput(messages=[
            pb.ChatMessage(role="system", content="be brief"), pb.ChatMessage(role="user", content="hi there")]),
            sampling=pb.SamplingParams(max_tokens=3))
        assert (await client.collect(chat))[-1].usage.prompt_tokens == 7  # one token per word
        ids = pb.PredictRequest(token_ids=pb.TokenIds(ids=[1, 2, 3]), sampling=pb.SamplingParams(max_tokens=3))
        assert (await client.collect(ids))[-1].usage.prompt_tokens == 3


async def test_stop_token_id_ends_with_stop():
    async with running_worker() as (_, client):
        first = await client.collect(synthetic_request(max_tokens=10, return_token_ids=True, sampling={"seed": 1}))
        ids = [t for r in first for t in r.token_ids]
        second = await client.collect(synthetic_request(
            max_tokens=10, return_token_ids=True, sampling={"seed": 1, "stop_token_ids": [ids[4]]}))
        assert [t for r in second for t in r.token_ids] == ids[:5]
        assert second[-1].finish_reason == pb.FINISH_REASON_STOP


async def test_lockstep_mode_gives_every_stream_one_token_per_step():
    async with running_worker(**{"engine.args.step_ms": "20"}) as (_, client):
        started = asyncio.get_running_loop().time()
        results = await asyncio.gather(*(client.collect(synthetic_request(max_tokens=5, return_token_ids=True))
                                         for _ in range(3)))
        elapsed = asyncio.get_running_loop().time() - started
        assert all(sum(len(r.token_ids) for r in responses) == 5 for responses in results)
        assert all(len(r.token_ids) <= 1 for responses in results for r in responses)
        assert 0.09 < elapsed < 1.0  # five 20 ms steps


async def test_a_streams_messages_are_spaced_by_the_shortest_interval():
    """server.min_message_interval_s spaces one stream's messages even when it runs alone (here the
    synthetic engine's 200 tokens in ~0.1 s would otherwise be a message each, or nearly): every
    token still arrives once, the first and last messages included."""
    counts = {}
    for interval in ("0.02", "0"):
        async with running_worker(**{"server.min_message_interval_s": interval}) as (_, client):
            responses = await client.collect(synthetic_request(max_tokens=200, return_token_ids=True))
        assert sum(len(r.token_ids) for r in responses) == 200 == responses[-1].usage.completion_tokens
        counts[interval] = len(responses)
    assert counts["0.02"] <= 10 < counts["0"], counts
