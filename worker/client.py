"""A small gRPC client of the worker: `cy-llm generate` and readiness waits."""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from worker.gen.cyllm.inference.v1 import inference_pb2 as pb
from worker.gen.cyllm.inference.v1 import inference_pb2_grpc as pb_grpc

INFERENCE_SERVICE = pb.DESCRIPTOR.services_by_name["InferenceService"].full_name
FINISH_NAMES = {v.number: v.name.removeprefix("FINISH_REASON_").lower()
                for v in pb.DESCRIPTOR.enum_types_by_name["FinishReason"].values}


def channel_for(socket_path: str) -> grpc.Channel:
    return grpc.insecure_channel(f"unix:{socket_path}")


def wait_until_ready(channel: grpc.Channel, timeout_s: float) -> bool:
    """Polls the inference service's health until SERVING; False when the timeout passes first."""
    stub = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=INFERENCE_SERVICE), timeout=1.0)
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                return True
        except grpc.RpcError:
            pass  # not listening yet, or the service is not registered as healthy yet
        time.sleep(0.2)
    return False


def check_health(socket_path: str, ready: bool, timeout_s: float, out: TextIO = sys.stdout) -> int:
    """One grpc.health.v1 Check: the process (alive) or the inference service (ready). 0 when SERVING."""
    service = INFERENCE_SERVICE if ready else ""
    with channel_for(socket_path) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError as exc:
            print(f"{socket_path}: {exc.code().name} {exc.details() or ''}".rstrip(), file=out)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{socket_path} {service or '(process)'}: {status}", file=out)
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


def build_request(prompt: str, chat: bool = False, **fields: Any) -> pb.PredictRequest:
    """A PredictRequest from CLI-style keyword fields; sampling fields left as None stay unset."""
    sampling_names = {f.name for f in pb.SamplingParams.DESCRIPTOR.fields}
    sampling = {k: v for k, v in fields.items() if k in sampling_names and v not in (None, [], ())}
    other = {k: v for k, v in fields.items() if k not in sampling_names and v is not None}
    request = pb.PredictRequest(sampling=pb.SamplingParams(**sampling), **other)
    if chat:
        request.chat.messages.add(role="user", content=prompt)
    else:
        request.prompt = prompt
    return request


def generate(socket_path: str, request: pb.PredictRequest, wait_s: float = 0.0, timeout_s: float | None = None,
             out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    """Streams one request's text to `out`; usage and timing to `err`. Returns the exit code."""
    with channel_for(socket_path) as channel:
        if wait_s and not wait_until_ready(channel, wait_s):
            print(f"error: worker at {socket_path} not ready within {wait_s:g} s", file=err)
            return 2
        stub = pb_grpc.InferenceServiceStub(channel)
        last = None
        try:
            for response in stub.StreamPredict(request, timeout=timeout_s):
                out.write(response.text)
                out.flush()
                last = response
        except grpc.RpcError as exc:
            out.write("\n")
            print(f"error: {exc.code().name}: {exc.details()}", file=err)
            return 1
    out.write("\n")
    if last is not None:
        print(f"[{FINISH_NAMES.get(last.finish_reason, '?')}] prompt_tokens={last.usage.prompt_tokens} "
              f"completion_tokens={last.usage.completion_tokens} queue_ms={last.timing.queue_ms:.1f} "
              f"ttft_ms={last.timing.time_to_first_token_ms:.1f} total_ms={last.timing.total_ms:.1f}", file=err)
    return 0
