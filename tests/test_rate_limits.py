"""The sidecar's rate limits per caller: requests/s and tokens/min, OpenAI's headers, reload."""

import json
import random
import threading
import time

import grpc
import httpx
import pytest

from tests.test_sidecar import SYNTHETIC, grpc_stub, wait_idle
from tests.test_observability import wait_for
from tests.test_sidecar_faults import metric
from worker.gen.cyllm.inference.v1 import inference_pb2 as pb
from worker.gen.cyllm.inference.v1 import inference_pb2_grpc as pb_grpc


@pytest.fixture
def limited(worker_process, sidecar, tmp_path):
    """A synthetic worker behind a sidecar with named keys and a limits file; yields what a test needs."""
    worker = worker_process(*SYNTHETIC)
    worker.wait_ready()
    keys = tmp_path / "keys"
    keys.write_text("# name key\nteam-a sk-a\nteam-b   sk-b\nsk-plain\n")
    limits = tmp_path / "limits.json"
    limits.write_text(json.dumps({"default": {"tokens_per_min": 600},
                                  "tenants": {"team-a": {"requests_per_s": 1}}}))
    front = sidecar([worker.socket_path], "--api-keys-file", str(keys), "--rate-limits-file", str(limits))
    front.wait_ready()
    return worker, front, limits


def post(front, key: str, max_tokens: int = 4, **headers: str) -> httpx.Response:
    return httpx.post(f"{front.http}/v1/completions", json={"prompt": "hi", "max_tokens": max_tokens},
                      headers={"authorization": f"Bearer {key}", **headers}, timeout=10)


def test_requests_per_second_refuse_429_with_openai_s_headers_then_refill(limited):
    worker, front, _ = limited
    first = post(front, "sk-a")
    assert first.status_code == 200, first.text
    assert (first.headers["x-ratelimit-limit-requests"], first.headers["x-ratelimit-remaining-requests"]) == ("1", "0")
    refused = post(front, "sk-a")
    assert refused.status_code == 429
    assert refused.json()["error"]["type"] == "rate_limit_error"
    assert "team-a" in refused.json()["error"]["message"] and "requests" in refused.json()["error"]["message"]
    assert refused.headers["retry-after"] == "1"
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert refused.headers["x-ratelimit-reset-requests"].endswith("ms")
    assert post(front, "sk-b").status_code == 200, "another key has a bucket of its own"

    channel, stub, auth = grpc_stub(front, "sk-a")
    with channel, pytest.raises(grpc.RpcError) as error:
        list(stub.StreamPredict(pb.PredictRequest(prompt="hi", sampling=pb.SamplingParams(max_tokens=2)),
                                metadata=auth, timeout=10))
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert dict(error.value.trailing_metadata())["retry-after"] == "1"

    # The bucket refills with time: after the wait the refusal named, a request goes through.
    time.sleep(float(refused.headers["retry-after"]))
    assert post(front, "sk-a").status_code == 200, "one request a second comes back"
    assert metric(front, "cyllm_sidecar_rate_limited_total", tenant="team-a", limit="requests") == 2
    # The worker shares its slots by the key's name, having no fairness header to go by.
    with grpc.insecure_channel(f"unix:{worker.socket_path}") as direct:
        text = pb_grpc.WorkerControlStub(direct).Metrics(pb.MetricsRequest(), timeout=5).text
    assert 'cyllm_tenant_admitted_total{tenant="team-a"} 2.0' in text, text


def test_tokens_are_held_while_a_request_runs_and_charged_after(limited):
    _, front, _ = limited
    # Default limits (600 tokens a minute) for team-b: "hi" is estimated at 1 token, plus max_tokens.
    first = post(front, "sk-b", max_tokens=200)
    assert first.status_code == 200, first.text
    assert first.headers["x-ratelimit-remaining-tokens"] == "399", "the estimate is held at admission"
    used = first.json()["usage"]["total_tokens"]
    second = post(front, "sk-b", max_tokens=200)
    remaining = int(second.headers["x-ratelimit-remaining-tokens"])
    # 600 - what the first used - the second's estimate, plus a few seconds' refill at 10 a second.
    assert 600 - used - 201 <= remaining <= 600 - used - 201 + 30, (used, remaining)
    refused = post(front, "sk-b", max_tokens=400)
    assert refused.status_code == 429
    assert "tokens" in refused.json()["error"]["message"]
    assert int(refused.headers["retry-after"]) >= 5
    assert refused.headers["x-ratelimit-limit-tokens"] == "600"
    # An unnamed key goes by the tenant its request names, else `default`; each with its own bucket.
    assert post(front, "sk-plain", max_tokens=400, **{"x-gateway-inference-fairness-id": "team-c"}).status_code == 200
    assert post(front, "sk-plain", max_tokens=400).status_code == 200
    assert metric(front, "cyllm_sidecar_rate_limit_held_tokens") == 0


def test_the_limits_file_is_reloaded_when_it_changes(limited):
    _, front, limits = limited
    assert [post(front, "sk-a").status_code for _ in range(3)].count(429) >= 1
    limits.write_text(json.dumps({"tenants": {"team-a": {"requests_per_s": 50}}}))
    assert wait_for(lambda: metric(front, "cyllm_sidecar_rate_limit_reloads_total", result="ok") == 1, 10)
    assert [post(front, "sk-a").status_code for _ in range(5)] == [200] * 5
    limits.write_text("{ not json")
    assert wait_for(lambda: metric(front, "cyllm_sidecar_rate_limit_reloads_total", result="error") == 1, 10)
    assert [post(front, "sk-a").status_code for _ in range(5)] == [200] * 5, "a broken file keeps the limits in force"


def test_a_soak_of_random_cancels_gives_every_hold_back(limited):
    worker, front, limits = limited
    limits.write_text(json.dumps({"default": {"requests_per_s": 1000, "tokens_per_min": 1_000_000}}))
    assert wait_for(lambda: metric(front, "cyllm_sidecar_rate_limit_reloads_total", result="ok") == 1, 10)
    rng, lock, outcomes = random.Random(3), threading.Lock(), []

    def client(key: str, seed: int) -> None:
        local = random.Random(seed)
        for _ in range(6):
            body = {"prompt": "hi", "max_tokens": local.choice([8, 64]), "stream": True}
            with httpx.Client(timeout=20) as http, http.stream(
                    "POST", f"{front.http}/v1/completions", json=body,
                    headers={"authorization": f"Bearer {key}"}) as reply:
                cut = local.random() < 0.5
                for line in reply.iter_lines():
                    if cut and line.startswith("data: {"):
                        break  # the client leaves mid-stream
                with lock:
                    outcomes.append((reply.status_code, cut))

    threads = [threading.Thread(target=client, args=(key, rng.random())) for key in ("sk-a", "sk-b", "sk-plain") * 2]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(outcomes) == 36 and {status for status, _ in outcomes} == {200}
    assert any(cut for _, cut in outcomes) and not all(cut for _, cut in outcomes)
    assert wait_for(lambda: metric(front, "cyllm_sidecar_rate_limit_held_tokens") == 0, 10)
    assert metric(front, "cyllm_sidecar_tenant_tokens_total", tenant="other") > 0
    load = wait_idle(worker.socket_path)
    assert (load.running, load.queued, load.budget_tokens_used) == (0, 0, 0)
