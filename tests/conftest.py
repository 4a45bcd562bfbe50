"""Shared fixtures: in-process workers over a real Unix socket, worker processes, the embedded model."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, ClassVar

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from worker.config_loader import load_config
from worker.engines.factory import create_engine
from worker.gen.cyllm.inference.v1 import inference_pb2 as pb
from worker.gen.cyllm.inference.v1 import inference_pb2_grpc as pb_grpc
from worker.server import INFERENCE_SERVICE, Worker

REPO = Path(__file__).resolve().parent.parent
EMBEDDED = "smollm2-135m-instruct"


def short_tmpdir() -> str:
    # Unix socket paths are limited to 107 bytes; pytest's tmp_path can be longer.
    return tempfile.mkdtemp(prefix="cyllm-", dir="/tmp")


def cache_dir() -> str:
    return load_config(None, os.environ).models.cache_dir


class Client:
    """Async stubs over one channel to a worker's socket."""

    def __init__(self, socket_path: str):
        self.channel = grpc.aio.insecure_channel(f"unix:{socket_path}")
        self.inference = pb_grpc.InferenceServiceStub(self.channel)
        self.control = pb_grpc.WorkerControlStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    async def collect(self, request: pb.PredictRequest, timeout: float | None = None) -> list[pb.PredictResponse]:
        return [r async for r in self.inference.StreamPredict(request, timeout=timeout)]

    async def status_of(self, request: pb.PredictRequest, timeout: float | None = None) -> grpc.StatusCode:
        try:
            await self.collect(request, timeout)
        except grpc.aio.AioRpcError as exc:
            return exc.code()
        return grpc.StatusCode.OK

    async def load(self) -> pb.WorkerLoad:
        return await self.control.GetLoad(pb.GetLoadRequest())

    async def wait_idle(self, timeout: float = 5.0) -> pb.WorkerLoad:
        """Waits until nothing runs or queues; handlers release in their finally blocks."""
        deadline = time.monotonic() + timeout
        while True:
            load = await self.load()
            if (load.running, load.queued, load.budget_tokens_used) == (0, 0, 0) or time.monotonic() > deadline:
                return load
            await asyncio.sleep(0.01)

    async def close(self) -> None:
        await self.channel.close()


@contextlib.asynccontextmanager
async def running_worker(**overrides: Any):
    """A Worker in this event loop, serving a fresh socket; yields (worker, client)."""
    socket_dir = short_tmpdir()
    settings = {"server.socket": f"{socket_dir}/w.sock", "engine.name": "synthetic", **overrides}
    if os.environ.get("CYLLM_TEST_OWN_PROCESS"):
        settings["engine.own_process"] = "true"
    config = load_config(None, {"HOME": os.environ.get("HOME", "/tmp")}, settings)
    worker = Worker(config, create_engine)
    task = asyncio.create_task(worker.run())
    client = Client(config.server.socket)
    try:
        deadline = time.monotonic() + 60
        while not worker.inference.ready:
            if task.done():
                task.result()
                raise RuntimeError("worker stopped before it was ready")
            assert time.monotonic() < deadline, "worker not ready in 60 s"
            await asyncio.sleep(0.01)
        yield worker, client
    finally:
        await client.close()
        worker.request_shutdown(0.0)
        await asyncio.wait_for(task, 30)
        shutil.rmtree(socket_dir, ignore_errors=True)


def child_pids(pid: int) -> list[int]:
    """The processes whose parent is `pid`, whichever of its threads started them (/proc/PID/task/
    PID/children lists only the main thread's: vLLM's engine core starts from a loading thread)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
        except (OSError, IndexError, ValueError):  # gone meanwhile
            pass
    return found


def synthetic_request(max_tokens: int = 8, **fields: Any) -> pb.PredictRequest:
    sampling = pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for key, value in fields.pop("sampling", {}).items():
        if key in ("stop", "stop_token_ids"):
            getattr(sampling, key).extend(value)
        else:
            setattr(sampling, key, value)
    fields.setdefault("prompt", "tell me a story")
    return pb.PredictRequest(sampling=sampling, **fields)


class LoggedProcess:
    """A child process writing to a log file of its own; stopped with SIGTERM, killed if it lingers.
    While it runs, a failing test's report carries the end of its log (pytest_runtest_makereport)."""

    stop_timeout_s = 10.0
    running: ClassVar[list[LoggedProcess]] = []
    report_chars = 20_000

    def __init__(self, command: list[str], env: dict[str, str] | None = None):
        self.log_path = Path(tempfile.mkstemp(prefix="cyllm-log-", dir="/tmp")[1])
        self._log = open(self.log_path, "w")
        self.command = command
        self.proc = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})}, cwd=REPO)
        LoggedProcess.running.append(self)

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self in LoggedProcess.running:
            LoggedProcess.running.remove(self)
        self._log.close()
        self.log_path.unlink(missing_ok=True)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test's report ends with the logs of the processes running then (workers, sidecars,
    module-scoped ones included): their files are deleted when the processes stop."""
    report = (yield).get_result()
    if report.failed and report.when in ("setup", "call"):
        for process in LoggedProcess.running:
            text = process.log()
            cut = f"[first {len(text) - process.report_chars} chars cut]\n" if len(text) > process.report_chars else ""
            report.sections.append((f"log of pid {process.proc.pid}: {' '.join(process.command[:6])}",
                                    cut + text[-process.report_chars:]))


class WorkerProcess(LoggedProcess):
    """`cy-llm serve` as a child process, for signals, locks and exit codes."""

    def __init__(self, *args: str, socket_path: str | None = None, env: dict[str, str] | None = None):
        self.socket_dir = None
        if socket_path is None:
            self.socket_dir = short_tmpdir()
            socket_path = f"{self.socket_dir}/w.sock"
        self.socket_path = socket_path
        own = ["--set", "engine.own_process=true"] if os.environ.get("CYLLM_TEST_OWN_PROCESS") else []
        super().__init__([sys.executable, "-m", "worker", "serve", "--socket", socket_path, *own, *args], env)

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        with grpc.insecure_channel(f"unix:{self.socket_path}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"worker exited {self.proc.returncode}:\n{self.log()}")
                try:
                    reply = stub.Check(health_pb2.HealthCheckRequest(service=INFERENCE_SERVICE), timeout=1)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.05)
        raise TimeoutError(f"worker not ready in {timeout} s:\n{self.log()}")

    def signal(self, sig: int = signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float = 30.0) -> int:
        return self.proc.wait(timeout)

    def stop(self) -> None:
        super().stop()
        if self.socket_dir:
            shutil.rmtree(self.socket_dir, ignore_errors=True)


@contextlib.contextmanager
def _started(factory):
    """A start function for a fixture; every process it started is stopped afterwards."""
    started = []

    def start(*args: Any, **kwargs: Any):
        process = factory(*args, **kwargs)
        started.append(process)
        return process

    try:
        yield start
    finally:
        for process in started:
            process.stop()


@pytest.fixture
def worker_process():
    with _started(WorkerProcess) as start:
        yield start


@pytest.fixture(scope="session")
def embedded_model() -> Path:
    """The embedded model, prepared once into the cache directory (kept across runs)."""
    from worker.models import prepare_model

    return prepare_model(EMBEDDED, cache_dir())


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """tiny_model(family, **config): a random 2-layer "llama" or "qwen2" saved as an HF folder (no
    tokenizer), of hidden size 256 unless config says otherwise."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    def make(family: str, **config: Any) -> Path:
        config_class, model_class = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[family]
        folder = tmp_path_factory.mktemp(f"tiny-{family}")
        torch.manual_seed(5)
        shape = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
                 "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 1024}
        model_class(config_class(**{**shape, **config})).save_pretrained(folder)
        return folder

    return make


@pytest.fixture(scope="session")
def tiny_llama(tiny_model):
    """A random 2-layer Llama saved as an HF folder, with a word-level tokenizer (t0 .. t511)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    folder = tiny_model("llama", bos_token_id=0, eos_token_id=1)
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(512)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=words, eos_token="t1", unk_token="t0").save_pretrained(folder)
    return folder


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def sidecar_binary() -> Path:
    """cargo build --release of sidecar/, into a target directory outside the clone (kept across runs)."""
    target = Path(os.environ.get("CARGO_TARGET_DIR", Path.home() / ".cache" / "cy-llm" / "cargo-target"))
    subprocess.run(["cargo", "build", "--release", "--quiet"], cwd=REPO / "sidecar", check=True,
                   env={**os.environ, "CARGO_TARGET_DIR": str(target)}, timeout=1800)
    return target / "release" / "cy-llm-sidecar"


class SidecarProcess(LoggedProcess):
    """cy-llm-sidecar on loopback ports in front of the given worker sockets."""

    stop_timeout_s = 15.0

    def __init__(self, binary: Path, sockets: list[str], *args: str, env: dict[str, str] | None = None):
        self.grpc_port, self.http_port, self.metrics_port = free_port(), free_port(), free_port()
        super().__init__([str(binary), "--grpc-addr", f"127.0.0.1:{self.grpc_port}",
                          "--http-addr", f"127.0.0.1:{self.http_port}", "--metrics-addr", f"127.0.0.1:{self.metrics_port}",
                          *(f"--worker=unix://{s}" for s in sockets), *args], env)

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def wait_ready(self, timeout: float = 60.0) -> None:
        self.wait_readyz({200}, timeout)

    def wait_readyz(self, statuses: set[int], timeout: float = 60.0) -> int:
        """Polls /readyz until it answers one of `statuses` (200: ready; 503: listening, not ready)."""
        import urllib.error
        import urllib.request

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sidecar exited {self.proc.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(f"{self.http}/readyz", timeout=1) as reply:
                    status = reply.status
            except urllib.error.HTTPError as error:
                status = error.code
            except (urllib.error.URLError, ConnectionError):
                status = None
            if status in statuses:
                return status
            time.sleep(0.05)
        raise TimeoutError(f"sidecar's /readyz gave none of {sorted(statuses)} in {timeout} s:\n{self.log()}")


@pytest.fixture
def sidecar(sidecar_binary):
    with _started(lambda sockets, *args, **kwargs: SidecarProcess(sidecar_binary, sockets, *args, **kwargs)) as start:
        yield start


def record_check_runs(monkeypatch) -> list[tuple[bool, bool, bool]]:
    """Spies on the native engine's reading of checks: for each run of a check launched ahead
    (ahead.checks), (it stood, it checked proposals, its sequence had other runs), appended as read."""
    import collections

    from worker.engines.native.engine import NativeEngine

    runs, verified = [], NativeEngine._verified

    def spy(self, step):
        if not step.launched_at and any(step.drafts):
            counts = collections.Counter(map(id, step.verifying))
            runs.extend(zip(step.standing(), map(bool, step.drafts), (counts[id(seq)] > 1 for seq in step.verifying)))
        return verified(self, step)

    monkeypatch.setattr(NativeEngine, "_verified", spy)
    return runs
