"""The worker process: StreamPredict and WorkerControl on a Unix socket, health, reflection and drain."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from worker import __version__
from worker.adapters.base import Adapter, build_adapters
from worker.config import Config
from worker.engines.base import BaseEngine, RequestStream
from worker.errors import (
    AdapterNotFound,
    ClientStalled,
    DeviceOutOfMemory,
    Draining,
    EngineDead,
    EngineRequestError,
    InvalidRequest,
    ModelNotFound,
    NotReady,
    RequestDeadlineExceeded,
    WorkerError,
    status_for,
)
from worker.gen.cyllm.inference.v1 import inference_pb2 as pb
from worker.gen.cyllm.inference.v1 import inference_pb2_grpc as pb_grpc
from worker.listener import SocketOwnership
from worker.request import GenerationRequest
from worker.scheduler import Grant, TaskScheduler
from worker.telemetry import Metrics, get_logger

log = get_logger(__name__)
INFERENCE_SERVICE = pb.DESCRIPTOR.services_by_name["InferenceService"].full_name
CONTROL_SERVICE = pb.DESCRIPTOR.services_by_name["WorkerControl"].full_name
FINISH_REASONS = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH,
                  "aborted": pb.FINISH_REASON_ABORTED}
# Tokenizing more text than this would stall every stream on the event loop; do it on a thread.
INLINE_ENCODE_CHARS = 16_384


class InferenceServicer(pb_grpc.InferenceServiceServicer):
    """StreamPredict: validate, encode, admit, stream; release the slot however the call ends."""

    def __init__(self, engine: BaseEngine, scheduler: TaskScheduler, metrics: Metrics, config: Config):
        self.engine = engine
        self.scheduler = scheduler
        self.metrics = metrics
        self.defaults = config.sampling
        self.max_messages_per_s = config.server.max_messages_per_s
        self.stall_timeout_s = config.server.stall_timeout_s
        self.max_consecutive_engine_errors = config.server.max_consecutive_engine_errors
        self.consecutive_engine_errors = 0
        # Set by the Worker: called once faults in a row say the device is not coming back.
        self.on_repeated_faults = lambda: None
        self.adapters: dict[str, Adapter] = build_adapters(config.adapters.named, Path(config.adapters.kb_dir))
        self.ready = False
        self.load_error: str | None = None
        self.draining = False
        self.idle = asyncio.Event()
        self.idle.set()
        # Monotonic time of the last output or admission: the progress watchdog reads it.
        self.last_progress = time.monotonic()
        self._in_flight = 0
        self._streams: dict[int, RequestStream] = {}

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def fail_all(self, error: WorkerError) -> None:
        """Ends every running stream with `error` (drain past its grace, or a dead engine)."""
        for stream in list(self._streams.values()):
            stream.fail(error)

    async def StreamPredict(self, message: pb.PredictRequest, context: grpc.aio.ServicerContext):
        arrived = time.perf_counter()
        request_id = message.request_id or uuid.uuid4().hex
        message.request_id = request_id
        status = grpc.StatusCode.OK
        grant = stream = timer = None
        finished = False
        first_token_at = None
        completion_tokens = 0
        remaining = context.time_remaining()
        deadline = time.monotonic() + remaining if remaining is not None else None
        self._in_flight += 1
        self.idle.clear()
        try:
            request = await self._prepare(message)
            prompt_tokens = len(request.prompt_token_ids)
            grant = await self.scheduler.admit(
                prompt_tokens + request.sampling.max_tokens, request.priority, deadline)
            self.last_progress = time.monotonic()
            self.metrics.queue_time.observe(grant.queued_s)
            self.metrics.prompt_tokens.inc(prompt_tokens)
            stream = self.engine.stream_predict(request)
            self._streams[id(stream)] = stream
            if deadline is not None:
                timer = asyncio.get_running_loop().call_later(
                    max(0.0, deadline - time.monotonic()), stream.fail,
                    RequestDeadlineExceeded("deadline passed while generating"))
            adapter = self.adapters.get(request.adapter)
            async for output in stream:
                if adapter is not None:
                    output = adapter.process_output(output)
                self.last_progress = time.monotonic()
                completion_tokens += len(output.token_ids)
                if first_token_at is None and output.token_ids:
                    first_token_at = time.perf_counter()
                response = pb.PredictResponse(request_id=request_id, text=output.text)
                if request.return_token_ids:
                    response.token_ids.extend(output.token_ids)
                if output.finish_reason is not None:
                    finished = True
                    self.consecutive_engine_errors = 0
                    now = time.perf_counter()
                    response.finish_reason = FINISH_REASONS[output.finish_reason]
                    response.usage.prompt_tokens = prompt_tokens
                    response.usage.completion_tokens = completion_tokens
                    response.timing.queue_ms = grant.queued_s * 1000
                    response.timing.time_to_first_token_ms = ((first_token_at or now) - arrived) * 1000
                    response.timing.total_ms = (now - arrived) * 1000
                elif not output.text and not response.token_ids:
                    continue
                await self._send(context, response)
                if self.max_messages_per_s and not finished:
                    spacing = len(self._streams) / self.max_messages_per_s
                    if spacing > 0.0005:  # below this a timer costs more than the message it saves
                        await asyncio.sleep(spacing)
        except WorkerError as exc:
            status, detail = status_for(exc)
            if isinstance(exc, (DeviceOutOfMemory, EngineRequestError)):
                self._count_engine_error()
            if isinstance(exc, ClientStalled):
                # The status queues behind the data the client has not read: free the slot now.
                self._release(stream, grant, timer, finished)
                stream = grant = timer = None
            await _abort(context, status, detail)
        except asyncio.CancelledError:  # the client left, or grpc ended the call at its deadline
            past_deadline = deadline is not None and time.monotonic() >= deadline
            status = grpc.StatusCode.DEADLINE_EXCEEDED if past_deadline else grpc.StatusCode.CANCELLED
            raise
        except Exception as exc:  # noqa: BLE001 - a bug must cost one request, not the worker
            log.exception("request failed", request_id=request_id)
            status, detail = status_for(exc)
            await _abort(context, status, detail)
        finally:
            self._release(stream, grant, timer, finished)
            self._record(request_id, status, arrived, first_token_at, completion_tokens)
            self._in_flight -= 1
            if self._in_flight == 0:
                self.idle.set()

    def _release(self, stream: RequestStream | None, grant: Grant | None, timer: asyncio.TimerHandle | None,
                 finished: bool) -> None:
        """Gives back what a call holds: its deadline timer, the engine's request, the slot and budget."""
        if timer is not None:
            timer.cancel()
        if stream is not None:
            self._streams.pop(id(stream), None)
            if not finished:
                self.engine.abort(stream)
        if grant is not None:
            self.scheduler.release(grant)

    async def _send(self, context: grpc.aio.ServicerContext, response: pb.PredictResponse) -> None:
        """Writes one message; a write that flow control holds past the stall limit ends the call."""
        if not self.stall_timeout_s:
            await context.write(response)
            return
        try:
            async with asyncio.timeout(self.stall_timeout_s):
                await context.write(response)
        except TimeoutError:
            raise ClientStalled(f"the client read nothing for {self.stall_timeout_s:g} s; stream ended") from None

    def _count_engine_error(self) -> None:
        self.consecutive_engine_errors += 1
        if self.consecutive_engine_errors == self.max_consecutive_engine_errors:
            log.error("engine faults in a row; the worker stops", faults=self.consecutive_engine_errors)
            self.on_repeated_faults()

    async def _prepare(self, message: pb.PredictRequest) -> GenerationRequest:
        if self.draining:
            raise Draining("worker is draining; send to another worker")
        if not self.ready:
            raise NotReady(self.load_error or "model is loading")
        request = GenerationRequest.from_pb(message, self.defaults)
        info = self.engine.info
        if request.model and request.model != info.served_name:
            raise ModelNotFound(f"model {request.model!r} is not served here; this worker serves {info.served_name!r}")
        if request.adapter:
            adapter = self.adapters.get(request.adapter)
            if adapter is None:
                raise AdapterNotFound(f"adapter {request.adapter!r} is not configured on this worker")
            request = await asyncio.to_thread(adapter.prepare_prompt, request, self.engine.count_tokens)
            log.debug("adapter prepared the request", request_id=request.request_id, adapter=adapter.name,
                      prompt=request.prompt, messages=[(m.role, m.content) for m in request.messages or ()])
        if request.prompt_token_ids is not None:
            self.engine.check_token_ids(request.prompt_token_ids, "token_ids")
        self.engine.check_token_ids(request.sampling.stop_token_ids, "sampling.stop_token_ids")
        log.debug("request", request_id=request.request_id, prompt=request.prompt,
                  messages=[(m.role, m.content) for m in request.messages or ()], metadata=request.metadata)
        size = len(request.prompt or "") + sum(len(m.content) for m in request.messages or ())
        if size > INLINE_ENCODE_CHARS:
            request.prompt_token_ids = await asyncio.to_thread(self.engine.encode, request)
        else:
            request.prompt_token_ids = self.engine.encode(request)
        prompt_tokens = len(request.prompt_token_ids)
        if prompt_tokens + request.sampling.max_tokens > info.max_model_len:
            raise InvalidRequest(
                f"prompt ({prompt_tokens} tokens) + max_tokens ({request.sampling.max_tokens}) is over the "
                f"model's context of {info.max_model_len} tokens")
        return request

    def _record(self, request_id: str, status: grpc.StatusCode, arrived: float,
                first_token_at: float | None, completion_tokens: int) -> None:
        now = time.perf_counter()
        self.metrics.requests.labels(status=status.name).inc()
        self.metrics.generation_tokens.inc(completion_tokens)
        if first_token_at is not None:
            self.metrics.ttft.observe(first_token_at - arrived)
            if completion_tokens > 1:
                self.metrics.tpot.observe((now - first_token_at) / (completion_tokens - 1))
        log.info("request ended", request_id=request_id, status=status.name,
                 completion_tokens=completion_tokens, total_ms=round((now - arrived) * 1000, 2))


async def _abort(context: grpc.aio.ServicerContext, status: grpc.StatusCode, detail: str) -> None:
    """Ends the call with `status`, unless it ended already (its deadline passed in grpc's core
    while we were deciding): then there is nothing left to send it on."""
    try:
        await context.abort(status, detail)
    except grpc.aio.AbortError:
        raise
    except Exception:  # noqa: BLE001 - grpc's core refuses the status of a finished call
        log.debug("call ended before its status could be sent", status=status.name)


class ControlServicer(pb_grpc.WorkerControlServicer):
    def __init__(self, worker: Worker):
        self.worker = worker

    async def GetInfo(self, request, context) -> pb.WorkerInfo:
        info = self.worker.engine.info
        return pb.WorkerInfo(
            worker_version=__version__,
            engine=self.worker.engine.name,
            models=[info.served_name] if info else [],
            max_model_len=info.max_model_len if info else 0,
            adapters=sorted(self.worker.inference.adapters),
            pid=os.getpid(),
        )

    async def GetLoad(self, request, context) -> pb.WorkerLoad:
        load = self.worker.scheduler.load()
        return pb.WorkerLoad(
            running=load.running, queued=load.queued, max_concurrency=load.max_concurrency,
            max_queue=load.max_queue, budget_tokens_used=load.budget_used,
            budget_tokens_total=load.budget_total, ready=self.worker.inference.ready,
            draining=load.draining)

    async def Metrics(self, request, context) -> pb.MetricsText:
        return pb.MetricsText(text=self.worker.metrics.render())

    async def Drain(self, request, context) -> pb.DrainResponse:
        self.worker.request_shutdown(request.timeout_s or None)
        return pb.DrainResponse(in_flight=self.worker.inference.in_flight)


class Worker:
    """Owns the socket, the server, the engine and the scheduler from start to a drained exit."""

    def __init__(self, config: Config, engine_factory):
        self.config = config
        self.metrics = Metrics()
        self.engine: BaseEngine = engine_factory(config, self._on_engine_fatal)
        resources = config.resources
        self.scheduler = TaskScheduler(
            max_concurrency=resources.max_concurrency, max_queue=resources.max_queue,
            queue_timeout_s=resources.queue_timeout_s, budget_tokens=0)
        self.metrics.watch(self.scheduler, self.engine)
        self.inference = InferenceServicer(self.engine, self.scheduler, self.metrics, config)
        self.inference.on_repeated_faults = lambda: self.request_shutdown(0.0, exit_code=1)
        self.health = health.aio.HealthServicer()
        self.ownership = SocketOwnership(config.server.socket)
        self.exit_code = 0
        self._shutdown = asyncio.Event()
        self._grace_s = config.server.drain_timeout_s

    def request_shutdown(self, grace_s: float | None = None, exit_code: int = 0) -> None:
        """Starts a drain; a later request can only shorten the grace."""
        grace = self.config.server.drain_timeout_s if grace_s is None else grace_s
        self._grace_s = min(self._grace_s, grace) if self._shutdown.is_set() else grace
        self.exit_code = self.exit_code or exit_code
        self._shutdown.set()

    def _on_engine_fatal(self, error: BaseException) -> None:
        log.error("engine failed; the worker stops", error=repr(error))
        self.inference.fail_all(EngineDead("engine failed"))
        self.request_shutdown(0.0, exit_code=1)

    async def run(self) -> int:
        self.ownership.acquire()
        max_bytes = self.config.server.max_receive_message_bytes
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", max_bytes)])
        pb_grpc.add_InferenceServiceServicer_to_server(self.inference, server)
        pb_grpc.add_WorkerControlServicer_to_server(ControlServicer(self), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            [INFERENCE_SERVICE, CONTROL_SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME], server)
        self.ownership.bind(server)
        await server.start()
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        await self.health.set(INFERENCE_SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal)
        log.info("listening", socket=str(self.ownership.socket_path), pid=os.getpid(), engine=self.engine.name)
        watchers = [asyncio.create_task(self._load())]
        if self.config.server.progress_timeout_s:
            watchers.append(asyncio.create_task(self._watch_progress(self.config.server.progress_timeout_s)))
        if self.config.server.exit_with_parent:
            watchers.append(asyncio.create_task(self._watch_parent(os.getppid())))
        try:
            await self._shutdown.wait()
            await self._drain(server)
        finally:
            for task in watchers:
                task.cancel()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
            self.ownership.release()
        log.info("stopped", exit_code=self.exit_code)
        return self.exit_code

    def _on_signal(self) -> None:
        # A second signal skips what is left of the grace.
        self.request_shutdown(0.0 if self._shutdown.is_set() else None)

    async def _load(self) -> None:
        try:
            started = time.perf_counter()
            info = await self.engine.load_model()
            self.scheduler.set_budget(self.config.resources.budget_tokens or self.engine.kv_budget_tokens())
            await self.engine.warmup()
        except Exception as exc:  # noqa: BLE001 - reported, then the worker exits non-zero
            log.error("model failed to load", error=str(exc), error_type=type(exc).__name__,
                      model=self.config.engine.model, engine=self.config.engine.name)
            self.inference.load_error = f"model failed to load: {type(exc).__name__}: {exc}"
            if self.config.server.exit_on_load_failure:
                self.request_shutdown(0.0, exit_code=3)
            return
        self.inference.ready = True
        await self.health.set(INFERENCE_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        log.info("ready", model=info.served_name, max_model_len=info.max_model_len,
                 budget_tokens=self.scheduler.budget_total, load_s=round(time.perf_counter() - started, 2))

    async def _watch_progress(self, timeout_s: float) -> None:
        """Readiness means progress: running work with no output for timeout_s is a stuck engine."""
        stalled = False
        while True:
            await asyncio.sleep(min(1.0, timeout_s / 4))
            if not self.inference.ready or self._shutdown.is_set():
                continue
            idle_s = time.monotonic() - self.inference.last_progress
            now_stalled = self.scheduler.load().running > 0 and idle_s > timeout_s
            if now_stalled != stalled:
                stalled = now_stalled
                status = health_pb2.HealthCheckResponse.NOT_SERVING if stalled else health_pb2.HealthCheckResponse.SERVING
                await self.health.set(INFERENCE_SERVICE, status)
                if stalled:
                    log.error("engine made no progress; not ready", idle_s=round(idle_s, 1),
                              running=self.scheduler.load().running)
                else:
                    log.info("engine progressing again; ready")

    async def _watch_parent(self, parent: int) -> None:
        while os.getppid() == parent:
            await asyncio.sleep(0.5)  # no event tells a child that its parent died; poll cheaply
        log.warning("parent process exited; stopping", parent=parent)
        self.request_shutdown()

    async def _drain(self, server: grpc.aio.Server) -> None:
        await self.health.enter_graceful_shutdown()
        self.inference.draining = True
        self.scheduler.drain()
        log.info("draining", in_flight=self.inference.in_flight, grace_s=self._grace_s)
        loop = asyncio.get_running_loop()
        started = loop.time()
        # Sliced waits, so a second signal (grace 0) cuts a long grace short.
        while not self.inference.idle.is_set() and loop.time() - started < self._grace_s:
            try:
                await asyncio.wait_for(self.inference.idle.wait(), min(0.25, self._grace_s))
            except TimeoutError:
                pass
        if not self.inference.idle.is_set():
            log.warning("grace ended; stopping open streams", in_flight=self.inference.in_flight)
            self.inference.fail_all(Draining("worker shut down before the request finished"))
            try:
                await asyncio.wait_for(self.inference.idle.wait(), 2.0)
            except TimeoutError:
                pass
        await server.stop(grace=1.0)
        await self.engine.unload_model()
