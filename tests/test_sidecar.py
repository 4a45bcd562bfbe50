"""The Rust sidecar in front of real Python workers: gRPC, the openai SDK, cancellation, failover, auth."""

import contextlib
import json
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import httpx
import openai
import pytest

from worker.gen.cyllm.inference.v1 import inference_pb2 as pb
from worker.gen.cyllm.inference.v1 import inference_pb2_grpc as pb_grpc

SYNTHETIC = ("--engine", "synthetic", "--set", "engine.args.tokens_per_s=400")


def grpc_stub(sidecar_process, key: str | None = None):
    channel = grpc.insecure_channel(f"127.0.0.1:{sidecar_process.grpc_port}")
    return channel, pb_grpc.InferenceServiceStub(channel), ([("authorization", f"Bearer {key}")] if key else None)


def worker_load(socket_path: str) -> pb.WorkerLoad:
    with grpc.insecure_channel(f"unix:{socket_path}") as channel:
        return pb_grpc.WorkerControlStub(channel).GetLoad(pb.GetLoadRequest(), timeout=2)


def wait_idle(socket_path: str, timeout: float = 5.0) -> pb.WorkerLoad:
    deadline = time.monotonic() + timeout
    while True:
        load = worker_load(socket_path)
        if (load.running, load.queued, load.budget_tokens_used) == (0, 0, 0) or time.monotonic() > deadline:
            return load
        time.sleep(0.02)


@pytest.fixture
def one_worker(worker_process, sidecar):
    worker = worker_process(*SYNTHETIC)
    worker.wait_ready()
    front = sidecar([worker.socket_path])
    front.wait_ready()
    return worker, front


def test_grpc_through_the_sidecar(one_worker):
    worker, front = one_worker
    channel, stub, _ = grpc_stub(front)
    with channel:
        responses = list(stub.StreamPredict(pb.PredictRequest(
            prompt="hello there", request_id="via-sidecar", sampling=pb.SamplingParams(max_tokens=12)), timeout=10))
        assert responses[-1].usage.completion_tokens == 12 and responses[-1].request_id == "via-sidecar"
        with pytest.raises(grpc.RpcError) as error:
            list(stub.StreamPredict(pb.PredictRequest(prompt="x", model="no-such-model"), timeout=10))
        assert error.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.RpcError) as error:
            list(stub.StreamPredict(pb.PredictRequest(prompt="x", sampling=pb.SamplingParams(top_p=3)), timeout=10))
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as error:
            list(stub.StreamPredict(pb.PredictRequest(prompt="x", sampling=pb.SamplingParams(max_tokens=5000)), timeout=0.3))
        assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    with grpc.insecure_channel(f"127.0.0.1:{front.grpc_port}", options=[("grpc.max_send_message_length", 64 << 20)]) as big:
        with pytest.raises(grpc.RpcError) as error:
            list(pb_grpc.InferenceServiceStub(big).StreamPredict(pb.PredictRequest(prompt="x" * (5 << 20)), timeout=10))
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert wait_idle(worker.socket_path).running == 0


def test_openai_sdk_streaming_and_not(one_worker):
    _, front = one_worker
    client = openai.OpenAI(base_url=f"{front.http}/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list()] == ["synthetic"]
    completion = client.completions.create(model="synthetic", prompt="one two three", max_tokens=7)
    assert len(completion.choices[0].text) == 7 and completion.choices[0].finish_reason == "length"
    assert completion.usage.completion_tokens == 7 and completion.usage.prompt_tokens == 3
    chat = client.chat.completions.create(model="synthetic", messages=[{"role": "user", "content": "hi"}], max_tokens=5)
    assert chat.choices[0].message.role == "assistant" and len(chat.choices[0].message.content) == 5
    chunks = list(client.chat.completions.create(
        model="synthetic", messages=[{"role": "user", "content": "hi"}], max_tokens=20, stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(text) == 20
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 20
    streamed = list(client.completions.create(model="synthetic", prompt="a b", max_tokens=9, stream=True))
    assert len("".join(c.choices[0].text for c in streamed)) == 9


def test_openai_errors(one_worker):
    _, front = one_worker
    client = openai.OpenAI(base_url=f"{front.http}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-17", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model="synthetic", prompt="x", temperature=float(9))
    assert "temperature" in error.value.message
    bad_json = httpx.post(f"{front.http}/v1/chat/completions", content=b"{nope", headers={"content-type": "application/json"})
    assert bad_json.status_code == 400 and bad_json.json()["error"]["type"] == "invalid_request_error"
    huge = httpx.post(f"{front.http}/v1/completions", json={"prompt": "x" * (5 << 20)})
    assert huge.status_code == 413 and "error" in huge.json()


def test_client_cancel_frees_the_worker_slot(one_worker):
    worker, front = one_worker
    channel, stub, _ = grpc_stub(front)
    with channel:
        call = stub.StreamPredict(pb.PredictRequest(prompt="long", sampling=pb.SamplingParams(max_tokens=3000)))
        next(call)
        assert worker_load(worker.socket_path).running == 1
        call.cancel()
        assert wait_idle(worker.socket_path).running == 0
    with httpx.stream("POST", f"{front.http}/v1/completions",
                      json={"prompt": "x", "max_tokens": 3000, "stream": True}, timeout=10) as response:
        lines = response.iter_lines()
        first = next(lines)
        assert first.startswith("data: ") and "choices" in json.loads(first[6:]), first
        assert worker_load(worker.socket_path).running == 1
    load = wait_idle(worker.socket_path)
    assert (load.running, load.budget_tokens_used) == (0, 0)


def test_worker_killed_mid_stream_fails_fast_and_traffic_moves(worker_process, sidecar):
    first, second = worker_process(*SYNTHETIC), worker_process(*SYNTHETIC)
    first.wait_ready()
    second.wait_ready()
    front = sidecar([first.socket_path, second.socket_path])
    front.wait_ready()
    channel, stub, _ = grpc_stub(front)
    with channel:
        calls = [stub.StreamPredict(pb.PredictRequest(prompt=f"p{i}", sampling=pb.SamplingParams(max_tokens=3000)))
                 for i in range(6)]
        for call in calls:
            next(call)
        assert worker_load(first.socket_path).running > 0 and worker_load(second.socket_path).running > 0
        first.signal(signal.SIGKILL)
        killed_at = time.monotonic()
        ended = {}

        def drain(index, call):
            try:
                for _ in call:
                    pass
                ended[index] = ("OK", time.monotonic() - killed_at)
            except grpc.RpcError as exc:
                ended[index] = (exc.code().name, time.monotonic() - killed_at)

        threads = [threading.Thread(target=drain, args=(i, c), daemon=True) for i, c in enumerate(calls)]
        for thread in threads:
            thread.start()
        time.sleep(1.5)
        failed = {i: v for i, v in ended.items() if v[0] != "OK"}
        assert failed, "streams on the killed worker must end"
        assert all(code == "UNAVAILABLE" and after < 1.0 for code, after in failed.values()), failed
        for _ in range(6):
            responses = list(stub.StreamPredict(pb.PredictRequest(prompt="after", sampling=pb.SamplingParams(max_tokens=3)), timeout=10))
            assert responses[-1].usage.completion_tokens == 3
        for call in calls:
            call.cancel()
    readyz = httpx.get(f"{front.http}/readyz").json()
    assert [w["ready"] for w in readyz["workers"]] == [False, True]


@contextlib.contextmanager
def one_full_one_free(worker_process, sidecar, env: dict[str, str] | None = None):
    """A worker with its one slot held (no queue) and a free one, behind a sidecar blind to their
    load (no GetLoad after the first, skipped, tick): routing picks the full worker about half the
    time, and only a retry can serve those requests. Yields (full, free, front)."""
    full = worker_process(*SYNTHETIC, "--set", "resources.max_concurrency=1", "--set", "resources.max_queue=0", env=env)
    free = worker_process(*SYNTHETIC, env=env)
    full.wait_ready()
    free.wait_ready()
    with grpc.insecure_channel(f"unix:{full.socket_path}") as direct:
        holder = pb_grpc.InferenceServiceStub(direct).StreamPredict(
            pb.PredictRequest(prompt="hold", sampling=pb.SamplingParams(max_tokens=4000)))
        next(holder)
        front = sidecar([full.socket_path, free.socket_path], "--load-poll-s", "1000", env=env)
        front.wait_ready()
        try:
            yield full, free, front
        finally:
            holder.cancel()


def test_retry_on_a_full_worker_goes_to_the_other(worker_process, sidecar):
    with one_full_one_free(worker_process, sidecar) as (_, _, front):
        channel, stub, _ = grpc_stub(front)
        with channel:
            for _ in range(24):
                assert list(stub.StreamPredict(pb.PredictRequest(prompt="x", sampling=pb.SamplingParams(max_tokens=2)),
                                               timeout=10))[-1].usage.completion_tokens == 2
    metrics = httpx.get(f"http://127.0.0.1:{front.metrics_port}/metrics").text
    assert 'cyllm_sidecar_retries_total{route="grpc",code="RESOURCE_EXHAUSTED"}' in metrics


def test_api_keys_on_grpc_and_http(worker_process, sidecar):
    worker = worker_process(*SYNTHETIC)
    worker.wait_ready()
    keys = Path(tempfile.mkstemp(prefix="cyllm-keys-", dir="/tmp")[1])
    keys.write_text("# keys\nsk-file-key\n")
    try:
        front = sidecar([worker.socket_path], "--api-keys-file", str(keys), env={"CYLLM_SIDECAR_API_KEYS": "sk-env-key"})
        front.wait_ready()
        channel, stub, good = grpc_stub(front, "sk-env-key")
        with channel:
            request = pb.PredictRequest(prompt="x", sampling=pb.SamplingParams(max_tokens=2))
            assert list(stub.StreamPredict(request, metadata=good, timeout=10))[-1].usage.completion_tokens == 2
            with pytest.raises(grpc.RpcError) as error:
                list(stub.StreamPredict(request, metadata=[("authorization", "Bearer wrong")], timeout=10))
            assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{front.http}/v1", api_key="wrong", max_retries=0).models.list()
        client = openai.OpenAI(base_url=f"{front.http}/v1", api_key="sk-file-key", max_retries=0)
        assert client.completions.create(model="synthetic", prompt="x", max_tokens=2).usage.completion_tokens == 2
        assert httpx.get(f"{front.http}/healthz").status_code == 200
        assert httpx.get(f"http://127.0.0.1:{front.metrics_port}/metrics").status_code == 200
    finally:
        keys.unlink()


def test_sigterm_finishes_open_streams_then_exits(one_worker):
    worker, front = one_worker
    channel, stub, _ = grpc_stub(front)
    with channel:
        call = stub.StreamPredict(pb.PredictRequest(prompt="x", sampling=pb.SamplingParams(max_tokens=400)))
        next(call)
        front.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{front.http}/readyz", timeout=0.5).status_code == 503:
                    break
            except httpx.TransportError:
                break  # the listener already closed: not ready either
        responses = list(call)
        assert responses[-1].usage.completion_tokens == 400
    assert front.proc.wait(10) == 0


@pytest.mark.skipif(shutil.which("prometheus") is None, reason="needs Debian's prometheus package (.ci/run installs it)")
def test_a_real_prometheus_scrapes_the_whole_stack(one_worker):
    _, front = one_worker
    openai.OpenAI(base_url=f"{front.http}/v1", api_key="x", max_retries=0).completions.create(
        model="synthetic", prompt="x", max_tokens=3)
    workdir = Path(tempfile.mkdtemp(prefix="cyllm-prom-", dir="/tmp"))
    port = __import__("tests.conftest", fromlist=["free_port"]).free_port()
    (workdir / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s}\nscrape_configs:\n  - job_name: cy-llm\n"
        f"    static_configs: [{{targets: ['127.0.0.1:{front.metrics_port}']}}]\n")
    prom = subprocess.Popen(["prometheus", f"--config.file={workdir / 'prometheus.yml'}",
                             f"--storage.tsdb.path={workdir / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        found = {}
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(found) < 2:
            for query in ("cyllm_sidecar_requests_total", 'cyllm_requests_total{worker="w0"}'):
                try:
                    reply = json.load(urllib.request.urlopen(
                        f"http://127.0.0.1:{port}/api/v1/query?query={urllib.parse.quote(query)}", timeout=2))
                    if reply["data"]["result"]:
                        found[query] = reply["data"]["result"]
                except OSError:
                    pass
            time.sleep(0.5)
        assert set(found) == {"cyllm_sidecar_requests_total", 'cyllm_requests_total{worker="w0"}'}, found
        targets = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/targets", timeout=2))
        assert targets["data"]["activeTargets"][0]["health"] == "up"
    finally:
        prom.terminate()
        prom.wait(10)
        shutil.rmtree(workdir, ignore_errors=True)


def test_a_sidecar_started_before_its_worker_learns_the_models_when_it_turns_ready(worker_process, sidecar):
    from tests.conftest import short_tmpdir

    socket_path = f"{short_tmpdir()}/w.sock"
    front = sidecar([socket_path])
    assert front.wait_readyz({200, 503}) == 503  # listening (the process may take a moment), not ready
    worker = worker_process(*SYNTHETIC, "--set", "engine.args.prefill_tokens_per_s=1000", socket_path=socket_path)
    worker.wait_ready()
    front.wait_ready()
    client = openai.OpenAI(base_url=f"{front.http}/v1", api_key="unused", max_retries=0)
    assert client.completions.create(model="synthetic", prompt="x", max_tokens=3).usage.completion_tokens == 3


def test_reflection_lists_what_the_sidecar_serves(one_worker):
    from grpc_reflection.v1alpha import reflection_pb2

    _, front = one_worker
    with grpc.insecure_channel(f"127.0.0.1:{front.grpc_port}") as channel:
        # v1's messages are v1alpha's under another service name; Python's client speaks v1alpha.
        info = channel.stream_stream("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
                                     request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                                     response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)
        reply = next(info(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10))
    services = {service.name for service in reply.list_services_response.service}
    assert services == {"cyllm.inference.v1.InferenceService", "grpc.health.v1.Health"}, services
