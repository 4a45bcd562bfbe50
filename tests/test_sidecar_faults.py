"""The sidecar under what production does to it: a stream silent for minutes, a worker that stops
answering (SIGSTOP), clients that send slowly or not at all, more connections than allowed."""

from __future__ import annotations

import select
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import grpc
import httpx
import pytest

from tests.test_sidecar import SYNTHETIC, grpc_stub, one_worker, wait_idle, worker_load  # noqa: F401 (a fixture)
from worker.gen.cyllm.inference.v1 import inference_pb2 as pb


def readyz(front) -> tuple[int, dict]:
    try:
        reply = httpx.get(f"{front.http}/readyz", timeout=2)
    except httpx.HTTPError:
        return 0, {}
    return reply.status_code, reply.json()


def metric(front, name: str, **labels: str) -> float:
    """The sum of a metric's samples whose labels include `labels`, from the sidecar's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{front.metrics_port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{key}="{value}"' in line for key, value in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
    return total


def complete(front, max_tokens: int = 4, timeout: float = 10.0) -> float:
    """One short completion through the sidecar; its latency in seconds."""
    started = time.perf_counter()
    reply = httpx.post(f"{front.http}/v1/completions", json={"prompt": "hi", "max_tokens": max_tokens}, timeout=timeout)
    assert reply.status_code == 200, reply.text
    return time.perf_counter() - started


class Stream(threading.Thread):
    """A gRPC stream through the sidecar, read on a thread: its messages and how it ended."""

    def __init__(self, front, request: pb.PredictRequest, timeout: float | None = None):
        super().__init__(daemon=True)
        self.channel, stub, _ = grpc_stub(front)
        self.call = stub.StreamPredict(request, timeout=timeout)
        self.messages: list[pb.PredictResponse] = []
        self.code: grpc.StatusCode | None = None
        self.ended_at: float | None = None
        self.first = threading.Event()
        self.start()

    def run(self) -> None:
        try:
            for message in self.call:
                self.messages.append(message)
                self.first.set()
            self.code = grpc.StatusCode.OK
        except grpc.RpcError as error:
            self.code = error.code()
        self.ended_at = time.monotonic()
        self.first.set()

    def close(self) -> None:
        self.call.cancel()
        self.join(10)
        self.channel.close()


def test_a_first_token_after_75_s_of_prefill_arrives_through_the_sidecar(worker_process, sidecar):
    """The worker's readiness counts prefill as progress: no output for 20 s once took a busy worker
    out of service, the sidecar then stopped the polls whose answers kept grpc's ping strikes at
    zero, and its streams died at ~60 s. Here the stream is silent for 75 s, another request served
    at 30 s. The polls hide the worker's ping policy from this test; test_faults checks it alone."""
    worker = worker_process(*SYNTHETIC, "--set", "engine.args.prefill_tokens_per_s=1")
    worker.wait_ready()
    front = sidecar([worker.socket_path])
    front.wait_ready()
    silent = Stream(front, pb.PredictRequest(prompt="word " * 80, sampling=pb.SamplingParams(max_tokens=20)))
    started, not_ready, served = time.monotonic(), [], False
    while time.monotonic() - started < 75:
        status, body = readyz(front)
        if status != 200:
            not_ready.append((round(time.monotonic() - started), status, body))
        if not served and time.monotonic() - started > 30:
            complete(front, timeout=30)
            served = True
        assert silent.is_alive(), f"the silent stream ended early: {silent.code}"
        time.sleep(1)
    silent.join(60)
    assert not_ready == [], "a worker busy with a long prompt must stay ready"
    assert silent.code == grpc.StatusCode.OK, silent.code
    assert silent.messages[-1].usage.completion_tokens == 20
    assert silent.messages[-1].timing.time_to_first_token_ms > 75_000
    silent.close()


def test_a_stopped_worker_is_routed_around_and_its_streams_end(worker_process, sidecar):
    slow = ("--engine", "synthetic", "--set", "engine.args.tokens_per_s=40")
    workers = [worker_process(*slow), worker_process(*slow)]
    for worker in workers:
        worker.wait_ready()
    front = sidecar([w.socket_path for w in workers], "--worker-stall-timeout-s", "3")
    front.wait_ready()
    streams = [Stream(front, pb.PredictRequest(prompt=f"story {i}", sampling=pb.SamplingParams(max_tokens=5000)))
               for i in range(4)]
    for stream in streams:
        assert stream.first.wait(10) and stream.code is None
    running = [worker_load(w.socket_path).running for w in workers]
    stopped_index = 0 if running[0] >= running[1] else 1
    stopped, other = workers[stopped_index], workers[1 - stopped_index]
    on_stopped = running[stopped_index]
    name = f"w{stopped_index}"

    stopped.signal(signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        while True:
            status, body = readyz(front)
            assert status == 200, "the other worker still serves the model"
            if not next(w for w in body["workers"] if w["name"] == name)["ready"]:
                break
            assert time.monotonic() - t0 < 6, "the stopped worker should be out of routing within the probe limit"
            time.sleep(0.1)
        unready_s = time.monotonic() - t0
        assert "unresponsive" in next(w for w in body["workers"] if w["name"] == name)["problem"]
        latencies = [complete(front, timeout=5) for _ in range(6)]  # none may go to the stopped worker
        assert max(latencies) < 3
        deadline = time.monotonic() + 15
        while sum(s.code == grpc.StatusCode.UNAVAILABLE for s in streams) < on_stopped:
            assert time.monotonic() < deadline, [s.code for s in streams]
            time.sleep(0.1)
        ended = [s for s in streams if s.code is not None]
        assert len(ended) == on_stopped, "streams on the answering worker go on"
        assert all(s.ended_at - t0 < 3 + 6 for s in ended)
        assert metric(front, "cyllm_sidecar_worker_unresponsive_total", worker=name) == 1
    finally:
        stopped.signal(signal.SIGCONT)
    deadline = time.monotonic() + 15
    while not next(w for w in readyz(front)[1]["workers"] if w["name"] == name)["ready"]:
        assert time.monotonic() < deadline, "the worker answers again after SIGCONT"
        time.sleep(0.1)
    # The streams the sidecar ended were cancelled on the worker when it came back.
    assert wait_idle(stopped.socket_path, timeout=10).running == 0
    for stream in streams:
        stream.close()
    assert wait_idle(other.socket_path).running == 0
    print(f"\nSIGSTOP -> out of routing {unready_s:.2f} s; requests meanwhile {max(latencies):.3f} s at most")


def test_a_stopped_lone_worker_fails_readyz_and_its_liveness_probe(worker_process, sidecar):
    worker = worker_process(*SYNTHETIC)
    worker.wait_ready()
    front = sidecar([worker.socket_path])
    front.wait_ready()
    probe = [sys.executable, "-m", "worker", "health", "--socket", worker.socket_path, "--timeout", "2"]
    assert subprocess.run(probe, capture_output=True, timeout=30).returncode == 0
    worker.signal(signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        while readyz(front)[0] != 503:
            assert time.monotonic() - t0 < 6
            time.sleep(0.1)
        started = time.monotonic()
        result = subprocess.run(probe, capture_output=True, text=True, timeout=30)
        assert result.returncode == 1 and "DEADLINE_EXCEEDED" in result.stdout, result.stdout
        assert time.monotonic() - started < 8, "the probe gives up at its --timeout"
    finally:
        worker.signal(signal.SIGCONT)
    front.wait_ready(15)
    assert subprocess.run(probe, capture_output=True, timeout=30).returncode == 0


def open_connections(port: int, count: int, payload: bytes) -> list[tuple[socket.socket, float]]:
    sockets = []
    for _ in range(count):
        connection = socket.create_connection(("127.0.0.1", port), timeout=5)
        if payload:
            connection.sendall(payload)
        connection.setblocking(False)
        sockets.append((connection, time.monotonic()))
    return sockets


def wait_closed(sockets: list[tuple[socket.socket, float]], limit_s: float) -> tuple[list[float], list[bytes]]:
    """How long each connection stayed open, and what it was answered, waiting at most limit_s."""
    held, answers, pending = {}, {}, {c: opened for c, opened in sockets}
    deadline = time.monotonic() + limit_s
    while pending and time.monotonic() < deadline:
        readable, _, _ = select.select(list(pending), [], [], 0.2)
        for connection in readable:
            try:
                data = connection.recv(4096)
            except ConnectionError:
                data = b""
            if data:
                answers[connection] = answers.get(connection, b"") + data
                continue
            held[connection] = time.monotonic() - pending.pop(connection)
            connection.close()
    for connection in pending:
        connection.close()
    return [held.get(c, float("inf")) for c, _ in sockets], [answers.get(c, b"") for c, _ in sockets]


@pytest.fixture
def guarded_front(worker_process, sidecar):
    worker = worker_process(*SYNTHETIC)
    worker.wait_ready()
    front = sidecar([worker.socket_path], "--header-read-timeout-s", "2", "--body-read-timeout-s", "2",
                    "--idle-timeout-s", "3")
    front.wait_ready()
    return worker, front


def test_slow_and_idle_clients_are_closed_at_their_limits_and_others_served(guarded_front):
    worker, front = guarded_front
    baseline = sorted(complete(front) for _ in range(5))[2]
    idle = open_connections(front.http_port, 100, b"")
    slow_head = open_connections(front.http_port, 100, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    slow_body = open_connections(front.http_port, 100, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                 b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"pro")
    silent_grpc = open_connections(front.grpc_port, 50, b"")
    during = sorted(complete(front) for _ in range(5))[2]
    (idle_held, _), (head_held, _), (body_held, body_answers), (grpc_held, _) = (
        wait_closed(group, 10) for group in (idle, slow_head, slow_body, silent_grpc))
    # The sidecar's clock starts at accept, a little before open_connections reads its own (on a loaded
    # 2-core machine one closed 3.4 ms short of 3 s by the client's clock).
    assert all(3 - 0.1 <= s < 3 + 2.5 for s in idle_held), sorted(idle_held)[::20]
    assert all(2 <= s < 2 + 2.5 for s in head_held), sorted(head_held)[::20]
    assert all(2 <= s < 2 + 2.5 for s in body_held), sorted(body_held)[::20]
    assert all(answer.startswith(b"HTTP/1.1 408") for answer in body_answers)
    assert all(2 <= s < 2 + 2.5 for s in grpc_held), sorted(grpc_held)[::10]
    assert during < baseline + 0.25, (baseline, during)
    timed_out = {phase: metric(front, "cyllm_sidecar_connections_timed_out_total", listener="http", phase=phase)
                 for phase in ("idle", "header")}
    assert timed_out["idle"] >= 100 and timed_out["header"] >= 100, timed_out
    assert metric(front, "cyllm_sidecar_connections_timed_out_total", listener="grpc", phase="header") >= 50
    # The sidecar's own refusals are requests too.
    assert metric(front, "cyllm_sidecar_requests_total", status="DEADLINE_EXCEEDED", worker="none") >= 100
    assert httpx.post(f"{front.http}/v1/completions", content=b"{nope").status_code == 400
    assert metric(front, "cyllm_sidecar_requests_total", status="INVALID_ARGUMENT", worker="none") >= 1
    assert httpx.get(f"{front.http}/health").status_code == 200
    assert metric(front, "cyllm_sidecar_connections_open", listener="http") <= 2
    assert wait_idle(worker.socket_path).running == 0


def test_connections_over_the_cap_are_closed_at_once(worker_process, sidecar):
    worker = worker_process(*SYNTHETIC)
    worker.wait_ready()
    front = sidecar([worker.socket_path], "--max-connections", "20")
    front.wait_ready()
    # wait_ready's own connection holds a slot until the sidecar has seen it close.
    deadline = time.monotonic() + 5
    while metric(front, "cyllm_sidecar_connections_open", listener="http") > 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    held = open_connections(front.http_port, 20, b"")
    deadline = time.monotonic() + 5
    while metric(front, "cyllm_sidecar_connections_open", listener="http") < 20:  # each accepted, holding a slot
        assert time.monotonic() < deadline
        time.sleep(0.05)
    refused_held, _ = wait_closed(open_connections(front.http_port, 5, b""), 3)
    assert all(s < 1 for s in refused_held), refused_held
    assert metric(front, "cyllm_sidecar_connections_refused_total", listener="http") >= 5
    for connection, _ in held:
        connection.close()
    deadline = time.monotonic() + 5
    while metric(front, "cyllm_sidecar_connections_open", listener="http") > 1:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    complete(front)


def test_a_deadline_passed_mid_stream_is_counted_as_one(one_worker):
    worker, front = one_worker
    channel, stub, _ = grpc_stub(front)
    with channel, pytest.raises(grpc.RpcError) as error:
        for _ in stub.StreamPredict(pb.PredictRequest(prompt="x", sampling=pb.SamplingParams(max_tokens=5000)), timeout=1):
            pass
    assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert wait_idle(worker.socket_path).running == 0
    time.sleep(0.2)
    assert metric(front, "cyllm_sidecar_requests_total", route="grpc", status="DEADLINE_EXCEEDED") == 1
    assert metric(front, "cyllm_sidecar_requests_total", route="grpc", status="CANCELLED") == 0
    # The worker's own count, re-exported by the sidecar.
    assert metric(front, "cyllm_requests_total", status="DEADLINE_EXCEEDED") == 1
    assert metric(front, "cyllm_requests_total", status="CANCELLED") == 0
