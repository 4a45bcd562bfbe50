"""One request, one trace: the sidecar's and the worker's spans, exported over OTLP to a real
receiver (tests/otlp.py), nest as one trace that carries the GenAI attributes and no prompt text."""

from __future__ import annotations

import json

import grpc
import httpx
import pytest

from tests.otlp import Receiver
from tests.test_observability import wait_for
from tests.test_sidecar import SYNTHETIC, grpc_stub, one_full_one_free
from tests.test_sidecar_faults import metric
from worker.gen.cyllm.inference.v1 import inference_pb2 as pb
from worker.gen.cyllm.inference.v1 import inference_pb2_grpc as pb_grpc

SERVER, CLIENT = 2, 3  # OTLP's SpanKind numbers
CALLER_TRACE, CALLER_SPAN = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
PROMPT = "the secret prompt 7431"
# Batches leave every 100 ms (both SDKs read it), not every 5 s.
FAST = {"OTEL_BSP_SCHEDULE_DELAY": "100"}


@pytest.fixture
def receiver():
    receiver = Receiver()
    yield receiver
    receiver.stop()


def traced(receiver: Receiver) -> dict[str, str]:
    return {**FAST, "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint}


def whole_trace(receiver: Receiver, request_id: str, worker_spans: int = 1) -> list:
    """The trace of the request the sidecar logged under `request_id`, once its sidecar spans and
    `worker_spans` worker spans (with their prepare and queue children) are in."""
    def ready(r: Receiver):
        roots = [s for s in r.spans if s.kind == SERVER and s.attributes.get("cyllm.request_id") == request_id
                 and s.service == "cy-llm-sidecar"]
        if not roots:
            return None
        spans = r.trace(roots[0].trace_id)
        workers = [s for s in spans if s.service == "cy-llm-worker" and s.kind == SERVER]
        children = [s for s in spans if s.name in ("prepare", "queue")]
        return spans if len(workers) >= worker_spans and len(children) >= worker_spans else None

    spans = receiver.wait_for(ready)
    assert spans, f"no whole trace for {request_id}: {receiver.spans}"
    return spans


def one(spans: list, **match):
    found = [s for s in spans if all(getattr(s, k) == v for k, v in match.items())]
    assert len(found) == 1, (match, spans)
    return found[0]


def test_one_request_is_one_trace_across_sidecar_and_worker(worker_process, sidecar, receiver):
    worker = worker_process(*SYNTHETIC, env=traced(receiver))
    worker.wait_ready()
    front = sidecar([worker.socket_path], env=traced(receiver))
    front.wait_ready()
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 5, "temperature": 0.5}
    reply = httpx.post(f"{front.http}/v1/chat/completions", json=body, headers={"x-request-id": "trace-http-1"})
    assert reply.status_code == 200 and reply.headers["x-request-id"] == "trace-http-1"

    spans = whole_trace(receiver, "trace-http-1")
    request = one(spans, service="cy-llm-sidecar", kind=SERVER)
    attempt = one(spans, service="cy-llm-sidecar", kind=CLIENT)
    served = one(spans, service="cy-llm-worker", kind=SERVER)
    assert request.parent_id == "" and request.name == "POST /v1/chat/completions"  # no traceparent: a new trace
    assert attempt.parent_id == request.span_id and served.parent_id == attempt.span_id
    assert one(spans, name="prepare").parent_id == served.span_id == one(spans, name="queue").parent_id
    assert request.attributes["gen_ai.operation.name"] == "chat" and request.attributes["gen_ai.request.max_tokens"] == 5
    assert attempt.attributes["cyllm.worker"] == "w0" and attempt.attributes["cyllm.attempt"] == 1
    assert attempt.attributes["cyllm.routing.policy"] == "least-outstanding" and attempt.attributes["cyllm.status"] == "OK"
    assert attempt.attributes["gen_ai.usage.output_tokens"] == 5 and "first token" in attempt.events
    assert served.attributes["cyllm.request_id"] == "trace-http-1" and served.attributes["rpc.grpc.status_code"] == 0
    assert served.attributes["gen_ai.request.temperature"] == pytest.approx(0.5)
    assert served.attributes["gen_ai.usage.input_tokens"] > 0 and served.attributes["gen_ai.usage.output_tokens"] == 5
    assert served.attributes["gen_ai.response.finish_reasons"] == ["length"] and "first token" in served.events
    assert not any(s.error for s in spans)
    assert PROMPT not in repr(spans) and "secret" not in repr(spans)
    # Both logs name the trace next to the request id.
    for process in (front, worker):
        ended = [json.loads(line) for line in process.log().splitlines() if "request ended" in line and "trace-http-1" in line]
        assert ended and request.trace_id in json.dumps(ended), process.log()[-2000:]

    # gRPC with the caller's traceparent: the caller's trace goes on, under the caller's span.
    channel, stub, _ = grpc_stub(front)
    with channel:
        list(stub.StreamPredict(pb.PredictRequest(prompt=PROMPT, sampling=pb.SamplingParams(max_tokens=3)), timeout=10,
                                metadata=[("traceparent", f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"),
                                          ("x-request-id", "trace-grpc-2")]))
    spans = whole_trace(receiver, "trace-grpc-2")
    request = one(spans, service="cy-llm-sidecar", kind=SERVER)
    assert request.trace_id == CALLER_TRACE and request.parent_id == CALLER_SPAN
    assert request.name == "cyllm.inference.v1.InferenceService/StreamPredict"
    assert one(spans, service="cy-llm-worker", kind=SERVER).parent_id == one(spans, kind=CLIENT).span_id

    # A caller that sampled its trace out: nothing recorded here either (parent-based sampling).
    channel, stub, _ = grpc_stub(front)
    with channel:
        list(stub.StreamPredict(pb.PredictRequest(prompt="x", sampling=pb.SamplingParams(max_tokens=2)), timeout=10,
                                metadata=[("traceparent", f"00-{'ab' * 16}-{CALLER_SPAN}-00")]))
    assert wait_for(lambda: metric(front, "cyllm_sidecar_requests_total") >= 3)
    assert not receiver.wait_for(lambda r: [s for s in r.spans if s.trace_id == "ab" * 16], timeout=1.0)


def test_a_retried_request_shows_both_attempts(worker_process, sidecar, receiver):
    with one_full_one_free(worker_process, sidecar, env=traced(receiver)) as (_, _, front):
        channel, stub, _ = grpc_stub(front)
        with channel:
            for index in range(24):
                list(stub.StreamPredict(pb.PredictRequest(prompt="x", sampling=pb.SamplingParams(max_tokens=2)),
                                        metadata=[("x-request-id", f"retry-{index}")], timeout=10))
    retried = receiver.wait_for(lambda r: [s for s in r.spans if s.kind == CLIENT and s.attributes["cyllm.attempt"] == 2])
    assert retried, "no request was retried"
    spans = whole_trace(receiver, next(s for s in receiver.trace(retried[0].trace_id)
                                       if s.kind == SERVER and s.service == "cy-llm-sidecar").attributes["cyllm.request_id"],
                        worker_spans=2)
    attempts = sorted((s for s in spans if s.kind == CLIENT), key=lambda s: s.attributes["cyllm.attempt"])
    request = one(spans, service="cy-llm-sidecar", kind=SERVER)
    assert [a.attributes["cyllm.status"] for a in attempts] == ["RESOURCE_EXHAUSTED", "OK"]
    assert attempts[0].error and not attempts[1].error and not request.error
    assert {a.parent_id for a in attempts} == {request.span_id}
    assert attempts[0].attributes["cyllm.worker"] != attempts[1].attributes["cyllm.worker"]
    refused, served = (one(spans, service="cy-llm-worker", parent_id=a.span_id) for a in attempts)
    assert refused.error and refused.attributes["rpc.grpc.status_code"] == 8 and not served.error


def test_with_the_collector_down_requests_succeed_and_lost_spans_are_counted(worker_process, sidecar):
    receiver = Receiver()
    receiver.stop()  # its port, now closed
    env = {**FAST, "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "CYLLM_TRACING__EXPORT_TIMEOUT_S": "1"}
    worker = worker_process(*SYNTHETIC, env=env)
    worker.wait_ready()
    front = sidecar([worker.socket_path], "--otlp-timeout-s", "1", env=env)
    front.wait_ready()
    for _ in range(3):
        reply = httpx.post(f"{front.http}/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=10)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3
    assert wait_for(lambda: metric(front, "cyllm_sidecar_spans_dropped_total", reason="export_failed") >= 6
                    and metric(front, "cyllm_spans_dropped_total", reason="export_failed") >= 9, timeout=30), \
        (front.log()[-2000:], httpx.get(f"http://127.0.0.1:{front.metrics_port}/metrics").text[-3000:])
    assert metric(front, "cyllm_sidecar_spans_exported_total") == 0
