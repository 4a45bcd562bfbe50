"""What joins a request across the sidecar and the worker (its id), and the pod-level signals that
gateways and autoscalers read from the sidecar's metrics port."""

from __future__ import annotations

import contextlib
import json
import threading
import time

import grpc
import httpx

from tests.test_sidecar import SYNTHETIC, grpc_stub, one_worker, wait_idle  # noqa: F401 (a fixture)
from tests.test_sidecar_faults import metric
from worker.gen.cyllm.inference.v1 import inference_pb2 as pb


def logged(process, request_id: str) -> bool:
    """Whether the process logged the request's end under this id (both log `request ended`)."""
    return any("request ended" in line and request_id in line for line in process.log().splitlines())


def wait_for(condition, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_gateways_request_id_is_the_id_everywhere(one_worker):
    worker, front = one_worker
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    reply = httpx.post(f"{front.http}/v1/chat/completions", json=body, headers={"x-request-id": "gw-7f3a.1"})
    assert reply.status_code == 200 and reply.headers["x-request-id"] == "gw-7f3a.1"
    assert reply.json()["id"] == "gw-7f3a.1"
    with httpx.stream("POST", f"{front.http}/v1/completions", json={"prompt": "hi", "max_tokens": 4, "stream": True},
                      headers={"x-request-id": "gw-stream-2"}) as streamed:
        chunks = [json.loads(line[6:]) for line in streamed.iter_lines() if line.startswith("data: {")]
    assert streamed.headers["x-request-id"] == "gw-stream-2" and {c["id"] for c in chunks} == {"gw-stream-2"}
    # None given: one is made, the same in the header, the body and both logs.
    made = httpx.post(f"{front.http}/v1/chat/completions", json=body)
    assert made.headers["x-request-id"] == made.json()["id"] and made.json()["id"].startswith("chatcmpl-")
    # gRPC: the metadata's id, sent back in the response's metadata.
    channel, stub, _ = grpc_stub(front)
    with channel:
        call = stub.StreamPredict(pb.PredictRequest(prompt="hi", sampling=pb.SamplingParams(max_tokens=3)),
                                  metadata=[("x-request-id", "gw-grpc-3")], timeout=10)
        list(call)
        assert dict(call.initial_metadata())["x-request-id"] == "gw-grpc-3"
    for request_id in ("gw-7f3a.1", "gw-stream-2", made.json()["id"], "gw-grpc-3"):
        assert wait_for(lambda: logged(worker, request_id) and logged(front, request_id)), request_id
    # A malformed id is refused, naming the header, and reaches no worker.
    bad = httpx.post(f"{front.http}/v1/chat/completions", json=body, headers={"x-request-id": "has space"})
    assert bad.status_code == 400 and "x-request-id" in bad.json()["error"]["message"]
    assert wait_idle(worker.socket_path).running == 0


def test_the_pod_reports_queue_running_and_kv_use(worker_process, sidecar):
    workers = [worker_process(*SYNTHETIC, "--set", "resources.max_concurrency=1") for _ in range(2)]
    for worker in workers:
        worker.wait_ready()
    front = sidecar([w.socket_path for w in workers])
    front.wait_ready()
    assert metric(front, "cyllm_pod_requests_running") == 0 and metric(front, "cyllm_pod_kv_cache_usage_ratio") == 0
    # The Inference Extension's picker scrapes the port it routes to: the API port serves /metrics too.
    assert "cyllm_pod_requests_waiting " in httpx.get(f"{front.http}/metrics").text
    channel, stub, _ = grpc_stub(front)
    calls = [stub.StreamPredict(pb.PredictRequest(prompt="x", sampling=pb.SamplingParams(max_tokens=4000)), timeout=60)
             for _ in range(3)]  # one slot each: two run, the third waits in a queue
    def drain(call) -> None:
        with contextlib.suppress(grpc.RpcError):  # cancelled below
            for _ in call:
                pass

    for call in calls[:2]:
        threading.Thread(target=drain, args=(call,), daemon=True).start()
    try:
        assert wait_for(lambda: metric(front, "cyllm_pod_requests_running") == 2
                        and metric(front, "cyllm_pod_requests_waiting") == 1), front.log()[-2000:]
        usage = metric(front, "cyllm_pod_kv_cache_usage_ratio")
        assert 0 < usage <= 1
    finally:
        for call in calls:
            call.cancel()
        channel.close()
    for worker in workers:
        assert wait_idle(worker.socket_path).running == 0
    assert wait_for(lambda: metric(front, "cyllm_pod_requests_running") == 0
                    and metric(front, "cyllm_pod_requests_waiting") == 0 and metric(front, "cyllm_pod_kv_cache_usage_ratio") == 0)
    # The synthetic engine has no prefix cache: no hit ratio is made up for it.
    assert "cyllm_pod_prefix_cache_hit_ratio " not in httpx.get(f"http://127.0.0.1:{front.metrics_port}/metrics").text


def test_the_native_engines_prefix_hits_reach_the_pod_signal(worker_process, sidecar, embedded_model):
    worker = worker_process("--engine", "native", "--model", str(embedded_model))
    worker.wait_ready(300)
    front = sidecar([worker.socket_path])
    front.wait_ready()
    system = "You are a helpful assistant who answers in one short sentence. " * 8
    for question in ("What is 2+2?", "Name a colour."):
        httpx.post(f"{front.http}/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}], "max_tokens": 2})
    assert wait_for(lambda: 0 < metric(front, "cyllm_pod_prefix_cache_hit_ratio") < 1), front.log()[-2000:]
