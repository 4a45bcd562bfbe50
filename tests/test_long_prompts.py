"""Long prompts on the native engine: prefill chunks sized by time, so a worker busy with one stays
ready, and a cancel or a deadline frees the engine at the next chunk."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2

from tests.conftest import running_worker
from worker.engines.native.model import ModelConfig
from worker.engines.native.pacer import MIN_CHUNK, PrefillPacer, Work
from worker.gen.cyllm.inference.v1 import inference_pb2 as pb
from worker.server import INFERENCE_SERVICE

LONG_PROMPT_TOKENS = 7_800  # the embedded model's context is 8,192


def test_pacer_cuts_chunks_to_its_time_and_shrinks_them_as_the_context_grows(embedded_model):
    pacer = PrefillPacer(ModelConfig.from_folder(embedded_model), target_s=0.25)
    assert pacer.chunk(0, 5000, 2048, Work()) == 2048, "no rate measured yet: the token budget alone"
    pacer.record(pacer.work(512, 0), 0.5, prefill_tokens=512)  # 512 tokens took 0.5 s
    early, late = pacer.chunk(0, 8000, 2048, Work()), pacer.chunk(7000, 1000, 2048, Work())
    assert late < early < 512
    for cached, chunk in ((0, early), (7000, late)):
        seconds = [pacer.priced(pacer.work(n, cached)) / pacer.rate for n in (chunk, chunk + 1)]
        assert seconds[0] <= 0.25 < seconds[1]
    assert pacer.chunk(7000, 1000, 2048, step=Work(1e15)) == MIN_CHUNK, "a full step still moves the prompt"
    pacer.record(pacer.work(8, 0), 10.0, prefill_tokens=8)  # too few prompt tokens to say anything
    assert pacer.chunk(0, 8000, 2048, Work()) == early


def test_the_pacer_learns_what_attention_costs_and_keeps_late_chunks_to_its_time(embedded_model):
    """Where attention's FLOPs run slower than the linear layers' (a CPU's), chunks priced alike
    overran the target more as the context grew. The pacer weighs a pair FLOP as the recent steps
    say, and a slow step (a compile) does not move that."""
    pacer = PrefillPacer(ModelConfig.from_folder(embedded_model), target_s=0.25)
    true_weight, linear_rate = 2.5, 5e11  # this device: a pair FLOP takes 2.5 linear ones' time

    def seconds(work: Work) -> float:
        return (work.linear + true_weight * work.pairs) / linear_rate

    pacer.record(pacer.work(64, 0), seconds(pacer.work(64, 0)), prefill_tokens=64)  # the warm-up
    assert pacer.weight == 1.0, "a step of little attention says little of its weight"
    cached, times = 0, []
    while cached < 7_800:
        chunk = pacer.chunk(cached, 7_800 - cached, 2048, Work())
        work = pacer.work(chunk, cached)
        times.append(seconds(work))
        pacer.record(work, 5.0 if len(times) == 6 else times[-1], prefill_tokens=chunk)  # the 6th compiled
        cached += chunk
    # (Priced alike, the 2nd-12th chunks took 0.32-0.46 s. The last chunk is what is left.)
    assert len(times) > 40 and all(0.2 <= t <= 0.28 for t in times[1:-1]), times
    assert 2 ** -0.25 <= pacer.weight / true_weight <= 2 ** 0.25


def test_a_step_slower_than_the_device_does_not_cut_the_chunks(embedded_model):
    """Steps slower than the device computes (the first prefill compiling kernels for a second, a
    short chunk bound by the host's launches) must not cut later prompts into chunks: the rate is
    the fastest recent step's, measured down to the smallest chunk."""
    pacer = PrefillPacer(ModelConfig.from_folder(embedded_model), target_s=0.25)
    pacer.record(pacer.work(60, 0), 1.0, prefill_tokens=60)  # compiled its kernels
    assert pacer.chunk(0, 1000, 2048, Work()) == MIN_CHUNK
    pacer.record(pacer.work(MIN_CHUNK, 0), pacer.priced(pacer.work(MIN_CHUNK, 0)) / 1e13, prefill_tokens=MIN_CHUNK)
    assert pacer.chunk(0, 1000, 2048, Work()) == 1000, "measured again at the smallest chunk"
    for _ in range(5):  # host-bound steps and another compile: far below the device's rate
        pacer.record(pacer.work(40, 0), 0.007, prefill_tokens=40)
    pacer.record(pacer.work(200, 0), 0.5, prefill_tokens=200)
    assert pacer.chunk(0, 4000, 8192, Work()) == 4000  # 1.6 TFLOP: 0.16 s at the device's rate
    for cached in range(0, 16 * 40, 40):  # a slower device: the fastest of the last 16 steps counts
        pacer.record(pacer.work(40, cached), 0.1, prefill_tokens=40)
    assert pacer.chunk(0, 1000, 2048, Work()) < 1000


def long_request(**fields) -> pb.PredictRequest:
    ids = [(i * 7919) % 40_000 + 100 for i in range(LONG_PROMPT_TOKENS)]
    return pb.PredictRequest(token_ids=pb.TokenIds(ids=ids),
                             sampling=pb.SamplingParams(max_tokens=8, ignore_eos=True, temperature=0), **fields)


async def time_to_first_token(client) -> float:
    started = time.perf_counter()
    call = client.inference.StreamPredict(pb.PredictRequest(
        prompt="What is the capital of France?", sampling=pb.SamplingParams(max_tokens=4, temperature=0)))
    async for response in call:
        if response.text:
            call.cancel()
            break
    return time.perf_counter() - started


async def test_a_long_prefill_keeps_the_worker_ready_and_a_cancel_frees_it_at_the_next_chunk(embedded_model):
    async with running_worker(**{"engine.name": "native", "engine.model": str(embedded_model),
                                 "server.progress_timeout_s": 2}) as (worker, client):
        baseline = min([await time_to_first_token(client) for _ in range(3)])
        engine = worker.engine
        chunks_before = engine.last_step_at

        # A deadline that passes mid-prefill ends the call, and the engine drops it at once.
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await client.collect(long_request(), timeout=2.0)
        assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        after_deadline = await time_to_first_token(client)
        assert engine.last_step_at > chunks_before

        # Several times the progress timeout of prefill, no output: still ready, steps completing.
        call = client.inference.StreamPredict(long_request())
        reader = asyncio.ensure_future(call.read())
        statuses, step_gaps, last_step = [], [], engine.last_step_at
        for _ in range(24):
            await asyncio.sleep(0.25)
            reply = await client.health.Check(health_pb2.HealthCheckRequest(service=INFERENCE_SERVICE))
            statuses.append(reply.status)
            step_gaps.append(engine.last_step_at - last_step)
            last_step = engine.last_step_at
        assert not reader.done(), "the prompt is still being prefilled"
        assert set(statuses) == {health_pb2.HealthCheckResponse.SERVING}
        # Chunks of about the pacer's 0.25 s (0.26-0.39 s on a quiet 2-core host, 0.40-0.65 in a CI run
        # on a busy one): at least a chunk a second on average. One step for the whole prompt takes
        # many seconds; a stretch past the 2-s progress timeout would have left SERVING above.
        assert sum(gap > 0 for gap in step_gaps) >= 6, f"prefill chunks should complete often: {step_gaps}"
        assert engine.num_unfinished() == 1
        call.cancel()
        after_cancel = await time_to_first_token(client)
        assert engine.num_unfinished() == 0
        # The short request waited for at most the chunk that was running (about 0.25 s here).
        assert after_deadline < baseline + 1.0 and after_cancel < baseline + 1.0, (baseline, after_deadline, after_cancel)
        assert (await client.wait_idle()).running == 0
