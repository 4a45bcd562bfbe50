"""The worker as a process: drain on SIGTERM, one instance per socket, stale sockets, bad paths, Drain RPC."""

import gc
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.conftest import REPO, running_worker, short_tmpdir
from worker.config_loader import load_config
from worker.engines.base import ModelInfo, RequestStream
from worker.engines.synthetic import SyntheticEngine
from worker.engines.threaded import ThreadedEngine
from worker.errors import EngineDead
from worker.gen.cyllm.inference.v1 import inference_pb2 as pb
from worker.gen.cyllm.inference.v1 import inference_pb2_grpc as pb_grpc
from worker.server import INFERENCE_SERVICE

SYNTHETIC = ("--engine", "synthetic", "--set", "engine.args.tokens_per_s=100")


def stream_in_thread(socket_path: str, max_tokens: int, results: dict) -> threading.Thread:
    """Reads one stream on a thread; results get 'responses', 'code' and 'first' (an Event)."""
    results["first"] = threading.Event()

    def read():
        responses = []
        with grpc.insecure_channel(f"unix:{socket_path}") as channel:
            stub = pb_grpc.InferenceServiceStub(channel)
            try:
                for response in stub.StreamPredict(pb.PredictRequest(
                        prompt="hello", sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True))):
                    responses.append(response)
                    results["first"].set()
                results["code"] = grpc.StatusCode.OK
            except grpc.RpcError as exc:
                results["code"] = exc.code()
        results["responses"] = responses
        results["first"].set()

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


def health_status(socket_path: str, service: str):
    with grpc.insecure_channel(f"unix:{socket_path}") as channel:
        return health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=2).status


def test_sigterm_drains_in_flight_streams_and_refuses_new_ones(worker_process):
    worker = worker_process(*SYNTHETIC, "--set", "server.drain_timeout_s=30")
    worker.wait_ready()
    results = {}
    thread = stream_in_thread(worker.socket_path, 150, results)
    assert results["first"].wait(10)
    worker.signal(signal.SIGTERM)
    deadline = time.monotonic() + 2
    while health_status(worker.socket_path, "") != health_pb2.HealthCheckResponse.NOT_SERVING:
        assert time.monotonic() < deadline, "health did not go NOT_SERVING at once"
        time.sleep(0.02)
    assert health_status(worker.socket_path, INFERENCE_SERVICE) == health_pb2.HealthCheckResponse.NOT_SERVING
    with grpc.insecure_channel(f"unix:{worker.socket_path}") as channel:
        try:
            list(pb_grpc.InferenceServiceStub(channel).StreamPredict(pb.PredictRequest(prompt="late"), timeout=5))
            raise AssertionError("a new call during drain was served")
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE
    thread.join(30)
    assert results["code"] == grpc.StatusCode.OK
    assert results["responses"][-1].usage.completion_tokens == 150
    assert worker.wait(10) == 0
    assert not os.path.exists(worker.socket_path)


def test_drain_with_zero_grace_ends_open_streams_unavailable(worker_process):
    worker = worker_process(*SYNTHETIC, "--set", "server.drain_timeout_s=0")
    worker.wait_ready()
    results = {}
    thread = stream_in_thread(worker.socket_path, 5_000, results)
    assert results["first"].wait(10)
    started = time.monotonic()
    worker.signal(signal.SIGTERM)
    thread.join(10)
    assert results["code"] == grpc.StatusCode.UNAVAILABLE
    assert worker.wait(10) == 0
    assert time.monotonic() - started < 4


def test_grace_runs_out_then_streams_end_unavailable(worker_process):
    worker = worker_process(*SYNTHETIC, "--set", "server.drain_timeout_s=0.5")
    worker.wait_ready()
    results = {}
    thread = stream_in_thread(worker.socket_path, 5_000, results)
    assert results["first"].wait(10)
    worker.signal(signal.SIGTERM)
    thread.join(10)
    assert results["code"] == grpc.StatusCode.UNAVAILABLE
    assert worker.wait(10) == 0


def test_second_instance_is_refused_and_the_first_keeps_serving(worker_process):
    first = worker_process(*SYNTHETIC)
    first.wait_ready()
    second = worker_process(*SYNTHETIC, socket_path=first.socket_path)
    assert second.wait(30) == 1
    assert "another cy-llm worker" in second.log() and str(first.socket_path) in second.log()
    assert health_status(first.socket_path, INFERENCE_SERVICE) == health_pb2.HealthCheckResponse.SERVING


def test_stale_socket_from_a_killed_run_is_replaced(worker_process):
    directory = short_tmpdir()
    path = f"{directory}/w.sock"
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(path)
    stale.close()  # the file stays, nobody listens: what a kill -9 leaves behind
    worker = worker_process(*SYNTHETIC, socket_path=path)
    worker.wait_ready()
    killed = worker_process(*SYNTHETIC, socket_path=f"{directory}/k.sock")
    killed.wait_ready()
    killed.signal(signal.SIGKILL)
    killed.wait(10)
    assert os.path.exists(killed.socket_path)
    restarted = worker_process(*SYNTHETIC, socket_path=killed.socket_path)
    restarted.wait_ready()


def test_socket_and_directory_permissions(worker_process):
    # The worker sets the mode of a directory it creates; it leaves an existing one as it is.
    worker = worker_process(*SYNTHETIC, socket_path=f"{short_tmpdir()}/run/w.sock")
    worker.wait_ready()
    assert oct(os.stat(worker.socket_path).st_mode & 0o777) == oct(0o660)
    assert oct(os.stat(os.path.dirname(worker.socket_path)).st_mode & 0o777) == oct(0o750)


def test_socket_path_over_the_limit_is_a_clear_error():
    path = "/tmp/" + "d" * 110 + "/w.sock"
    result = subprocess.run([sys.executable, "-m", "worker", "serve", "--socket", path, "--engine", "synthetic"],
                            capture_output=True, text=True, cwd=REPO, timeout=60)
    assert result.returncode == 2
    assert "server.socket" in result.stderr and "107-byte limit" in result.stderr


def test_drain_rpc_stops_the_worker(worker_process):
    worker = worker_process(*SYNTHETIC)
    worker.wait_ready()
    with grpc.insecure_channel(f"unix:{worker.socket_path}") as channel:
        reply = pb_grpc.WorkerControlStub(channel).Drain(pb.DrainRequest(timeout_s=5), timeout=5)
    assert reply.in_flight == 0
    assert worker.wait(10) == 0


def test_generate_cli_prints_text_and_fails_with_the_status(worker_process):
    worker = worker_process(*SYNTHETIC)
    worker.wait_ready()
    ok = subprocess.run([sys.executable, "-m", "worker", "generate", "--socket", worker.socket_path,
                         "--max-tokens", "5", "--seed", "1", "hello"], capture_output=True, text=True, cwd=REPO)
    assert ok.returncode == 0 and len(ok.stdout.strip()) == 5
    assert "completion_tokens=5" in ok.stderr
    bad = subprocess.run([sys.executable, "-m", "worker", "generate", "--socket", worker.socket_path,
                          "--top-p", "2", "hello"], capture_output=True, text=True, cwd=REPO)
    assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr
    # The request's speculative field: asked of an engine that has none, refused; opted out of, served.
    asked = subprocess.run([sys.executable, "-m", "worker", "generate", "--socket", worker.socket_path,
                            "--speculative", "hello"], capture_output=True, text=True, cwd=REPO)
    assert asked.returncode == 1 and "INVALID_ARGUMENT" in asked.stderr and "speculative" in asked.stderr
    out = subprocess.run([sys.executable, "-m", "worker", "generate", "--socket", worker.socket_path,
                          "--no-speculative", "--max-tokens", "3", "hello"], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0 and "completion_tokens=3" in out.stderr


def test_an_engine_that_stops_making_progress_is_not_ready_but_alive(worker_process):
    worker = worker_process(*SYNTHETIC, "--set", "engine.args.stall_after_tokens=20", "--set", "server.drain_timeout_s=0",
                            "--set", "server.progress_timeout_s=1")
    worker.wait_ready()
    results = {}
    stream_in_thread(worker.socket_path, 1000, results)
    assert results["first"].wait(10)
    deadline = time.monotonic() + 10
    while health_status(worker.socket_path, INFERENCE_SERVICE) != health_pb2.HealthCheckResponse.NOT_SERVING:
        assert time.monotonic() < deadline, "a stalled engine must turn readiness off"
        time.sleep(0.1)
    assert health_status(worker.socket_path, "") == health_pb2.HealthCheckResponse.SERVING
    assert "engine made no progress" in worker.log()
    # The probes containers run: alive, not ready.
    assert health_cli("--socket", worker.socket_path).returncode == 0
    not_ready = health_cli("--socket", worker.socket_path, "--ready")
    assert not_ready.returncode == 1 and "NOT_SERVING" in not_ready.stdout


def health_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "worker", "health", *args], capture_output=True, text=True, cwd=REPO,
                          timeout=30)


def test_health_cli_on_a_ready_worker_and_on_no_worker(worker_process):
    worker = worker_process(*SYNTHETIC)
    worker.wait_ready()
    ready = health_cli("--socket", worker.socket_path, "--ready")
    assert ready.returncode == 0 and "SERVING" in ready.stdout
    missing = health_cli("--socket", f"{worker.socket_dir}/nobody.sock", "--timeout", "1")
    assert missing.returncode == 1 and "UNAVAILABLE" in missing.stdout


def test_a_dead_engine_fails_every_stream_and_exits_non_zero(worker_process):
    worker = worker_process(*SYNTHETIC, "--set", "engine.args.fail_after_tokens=30")
    worker.wait_ready()
    streams = [{} for _ in range(3)]
    threads = [stream_in_thread(worker.socket_path, 1000, results) for results in streams]
    for thread in threads:
        thread.join(20)
    assert [results["code"] for results in streams] == [grpc.StatusCode.UNAVAILABLE] * 3
    assert worker.wait(20) == 1
    assert "engine failed; the worker stops" in worker.log()


async def test_what_the_worker_loaded_is_frozen_out_of_the_collector_once_ready():
    """A full garbage collection walks every object the collector tracks; frozen once the model is
    loaded, what lives as long as the process is not walked again (unfrozen, one took ~200 ms of a
    batch-256 decode on an H100, every stream stalled)."""
    gc.unfreeze()
    async with running_worker() as (worker, _):
        assert worker.inference.ready and gc.get_freeze_count() > 0


async def test_a_worker_serves_a_chat_request_of_its_own_before_it_says_it_is_ready(monkeypatch):
    """A fresh worker's first request paid the chat template's compile and the first run of a
    prompt's paths (41 against ~20 ms to the first token on the 2-core CPU): the worker serves a
    chat request of its own first, through the engine as StreamPredict does, and counts it nowhere."""
    if os.environ.get("CYLLM_TEST_OWN_PROCESS"):
        pytest.skip("spies on the engine in this process")
    seen = []
    encode, stream_predict = SyntheticEngine.encode, SyntheticEngine.stream_predict
    monkeypatch.setattr(SyntheticEngine, "encode", lambda self, request: seen.append(
        ("encode", request.request_id, bool(request.messages))) or encode(self, request))
    monkeypatch.setattr(SyntheticEngine, "stream_predict", lambda self, request: seen.append(
        ("stream", request.request_id, len(request.prompt_token_ids))) or stream_predict(self, request))
    async with running_worker() as (worker, client):
        ours = [entry for entry in seen if entry[1] == "warmup-request"]
        assert ours[0] == ("encode", "warmup-request", True) and [kind for kind, *_ in ours] == ["encode", "stream", "stream"]
        assert ours[1][2] > 1  # the rendered chat's ids
        await client.collect(pb.PredictRequest(prompt="hello", sampling=pb.SamplingParams(max_tokens=3, ignore_eos=True)))
        assert worker.metrics.requests.labels("OK")._value.get() == 1
        assert worker.metrics.generation_tokens._value.get() == 3
        assert (await client.wait_idle()).running == 0


class SlowLoad(ThreadedEngine):
    """A test double: a ThreadedEngine whose load lasts until the test lets it end (a large model's)."""

    name = "slow-load"

    def __init__(self, config):
        super().__init__(config)
        self.loading = threading.Event()
        self.finish_load = threading.Event()

    def _load(self) -> None:
        self.loading.set()
        self.finish_load.wait(30)
        self.info = ModelInfo("slow", 64, 32, 0)

    def _serve(self) -> None:
        while self._take_inbox(block=True):
            pass

    def _open_streams(self):
        return []

    def _release(self) -> None:
        pass

    def _on_add(self, item) -> None:
        pass

    def _on_abort(self, stream) -> None:
        pass

    def encode(self, request):
        return []

    def stream_predict(self, request):
        stream = RequestStream(request.request_id)
        stream.fail(EngineDead("this test double serves no requests"))
        return stream

    def kv_budget_tokens(self) -> int:
        return 0

    def num_unfinished(self) -> int:
        return 0


async def test_stopping_while_the_model_loads_does_not_wait_for_the_load():
    """SIGTERM during a load drains and unloads (server.py): the worker exits without waiting for a
    load of minutes, and the engine thread, once loaded, stops."""
    import asyncio

    engine = SlowLoad(load_config(None, {"HOME": "/tmp"}))
    load = asyncio.create_task(engine.load_model())
    assert await asyncio.to_thread(engine.loading.wait, 5)
    thread = engine._thread
    await asyncio.wait_for(engine.unload_model(), 5)
    assert thread.is_alive() and engine.still_loading(), "the load was still running"
    load.cancel()
    engine.finish_load.set()
    thread.join(5)
    assert not thread.is_alive() and not engine.still_loading()


@pytest.mark.model
@pytest.mark.parametrize("own_process", ["false", "true"])
def test_stderr_holds_json_lines_to_the_exit(worker_process, embedded_model, own_process):
    """The native worker freezes what it loaded (gc.freeze), and so does the engine's own process,
    whose stderr is the worker's; left frozen at exit, Triton's objects were never freed and
    nanobind reported them as leaks on stderr, dozens of lines not JSON."""
    worker = worker_process("--engine", "native", "--model", "smollm2-135m-instruct",
                            "--set", f"engine.own_process={own_process}")
    worker.wait_ready(300)
    worker.signal(signal.SIGTERM)
    assert worker.wait(30) == 0
    lines = [line for line in worker.log().splitlines() if line.strip()]
    assert json.loads(lines[-1])["event"] == "stopped"
    assert [line for line in lines if not line.startswith("{")] == []
    for line in lines:
        json.loads(line)
