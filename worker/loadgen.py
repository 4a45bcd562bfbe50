"""`cy-llm bench`: N concurrent streams over the worker's socket, or against the same engine in-process."""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from worker.config import Config
from worker.engines.factory import create_engine
from worker.gen.cyllm.inference.v1 import inference_pb2 as pb
from worker.gen.cyllm.inference.v1 import inference_pb2_grpc as pb_grpc
from worker.request import GenerationRequest, SamplingParams
from worker.scheduler import TaskScheduler

DEFAULT_PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


@dataclass
class StreamTrace:
    started: float
    arrivals: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    error: str | None = None


async def run_over_grpc(target: str, streams: int, max_tokens: int, prompt: str) -> tuple[list[StreamTrace], float]:
    """`target` is a gRPC address: unix:/path/to.sock for a worker, host:port for the sidecar."""
    async with grpc.aio.insecure_channel(target) as channel:
        # Connect first: a gateway or sidecar keeps its connection, so setup is no part of TTFT.
        await asyncio.wait_for(channel.channel_ready(), 30)
        stub = pb_grpc.InferenceServiceStub(channel)

        async def one(index: int) -> StreamTrace:
            request = pb.PredictRequest(
                request_id=f"bench-{index}", prompt=prompt, return_token_ids=True,
                sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
            trace = StreamTrace(time.perf_counter())
            try:
                async for response in stub.StreamPredict(request):
                    trace.arrivals.append(time.perf_counter())
                    trace.tokens.append(len(response.token_ids))
            except grpc.aio.AioRpcError as exc:
                trace.error = exc.code().name
            return trace

        started = time.perf_counter()
        traces = await asyncio.gather(*(one(i) for i in range(streams)))
        return traces, time.perf_counter() - started


async def run_in_process(config: Config, streams: int, max_tokens: int,
                         prompt: str) -> tuple[list[StreamTrace], float, float]:
    """The same engine and scheduler the worker builds, driven directly: no gRPC, no protobuf.
    Returns the traces, the run's wall time and the seconds from start to ready."""
    engine = create_engine(config)
    load_started = time.perf_counter()
    await engine.load_model()
    resources = config.resources
    scheduler = TaskScheduler(max_concurrency=resources.max_concurrency, max_queue=resources.max_queue,
                              queue_timeout_s=resources.queue_timeout_s,
                              budget_tokens=resources.budget_tokens or engine.kv_budget_tokens())
    await engine.warmup()
    ready_s = time.perf_counter() - load_started
    try:
        async def one(index: int) -> StreamTrace:
            request = GenerationRequest(request_id=f"bench-{index}", prompt=prompt,
                                        sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            trace = StreamTrace(time.perf_counter())
            request.prompt_token_ids = engine.encode(request)
            async with scheduler.slot(len(request.prompt_token_ids) + max_tokens):
                async for output in engine.stream_predict(request):
                    trace.arrivals.append(time.perf_counter())
                    trace.tokens.append(len(output.token_ids))
            return trace

        started = time.perf_counter()
        traces = await asyncio.gather(*(one(i) for i in range(streams)))
        return traces, time.perf_counter() - started, ready_s
    finally:
        await engine.unload_model()


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def summarize(traces: list[StreamTrace], wall_s: float) -> dict:
    """tokens/s over the run; TTFT per stream; inter-token time as each message gap over its tokens."""
    ttft, gaps, per_token = [], [], []
    for trace in traces:
        first = next((i for i, n in enumerate(trace.tokens) if n), None)
        if first is None:
            continue
        ttft.append(trace.arrivals[first] - trace.started)
        for i in range(first + 1, len(trace.arrivals)):
            if trace.tokens[i]:
                gap = trace.arrivals[i] - trace.arrivals[i - 1]
                gaps.append(gap)
                per_token.append(gap / trace.tokens[i])
    tokens = sum(sum(t.tokens) for t in traces)
    messages = sum(len(t.arrivals) for t in traces)
    ms = 1000.0
    return {
        "streams": len(traces),
        "errors": sum(1 for t in traces if t.error),
        "wall_s": wall_s,
        "tokens": tokens,
        "messages": messages,
        "tokens_per_s": tokens / wall_s,
        "messages_per_s": messages / wall_s,
        "tokens_per_message": tokens / messages if messages else 0.0,
        "ttft_ms_p50": percentile(ttft, 50) * ms,
        "ttft_ms_p99": percentile(ttft, 99) * ms,
        "itl_ms_p50": percentile(per_token, 50) * ms,
        "itl_ms_p99": percentile(per_token, 99) * ms,
        "message_gap_ms_p50": percentile(gaps, 50) * ms,
        "message_gap_ms_p99": percentile(gaps, 99) * ms,
    }


def bench(target: str | None, config: Config | None, streams: int, max_tokens: int,
          prompt: str = DEFAULT_PROMPT, json_out: str | None = None) -> dict:
    extra = {}
    if config is not None:
        traces, wall, extra["ready_s"] = _run(run_in_process(config, streams, max_tokens, prompt))
        mode = "in_process"
    else:
        traces, wall = _run(run_over_grpc(target, streams, max_tokens, prompt))
        mode = "grpc_uds" if target.startswith("unix:") else "grpc_tcp"
    result = {"mode": mode, "max_tokens": max_tokens, **extra, **summarize(traces, wall)}
    if json_out:
        Path(json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(json_out).write_text(json.dumps(result, indent=2) + "\n")
    return result


def _run(coroutine):
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coroutine)
    return uvloop.run(coroutine) if os.name == "posix" else asyncio.run(coroutine)
