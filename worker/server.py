"""The worker process: the inference service (worker/inference.py) and WorkerControl on a Unix
socket, health, reflection, drain, and the watchdogs."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from worker import __version__
from worker.config import Config
from worker.engines.base import BaseEngine
from worker.engines.cache_events import prompt_hashes
from worker.errors import Draining, EngineDead, NoCacheEvents, NotReady, WorkerError, status_for
from worker.fairness import Fairness
from worker.gen.cyllm.inference.v1 import inference_pb2 as pb
from worker.gen.cyllm.inference.v1 import inference_pb2_grpc as pb_grpc
from worker.inference import InferenceServicer
from worker.listener import SocketOwnership
from worker.request import GenerationRequest
from worker.scheduler import TaskScheduler
from worker.telemetry import Metrics, get_logger

log = get_logger(__name__)
INFERENCE_SERVICE = pb.DESCRIPTOR.services_by_name["InferenceService"].full_name
CONTROL_SERVICE = pb.DESCRIPTOR.services_by_name["WorkerControl"].full_name


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
            min_ping_interval_ms=int(self.worker.config.server.keepalive_min_ping_interval_s * 1000),
            permit_pings_without_calls=self.worker.config.server.keepalive_permit_without_calls,
            capabilities=self._capabilities(),
        )

    def _capabilities(self) -> pb.Capabilities:
        able = self.worker.engine.capabilities()
        return pb.Capabilities(structured_output=able.structured_output, max_logprobs=able.max_logprobs,
                               prompt_logprobs=able.prompt_logprobs, tools=able.tools,
                               speculative_decoding=able.speculative_decoding,
                               cache_events=self.worker.engine.events is not None and not self.worker.engine.events.stopped)

    async def CacheEvents(self, request, context):
        events = self.worker.engine.events
        try:
            if events is None:
                raise NoCacheEvents(f"the {self.worker.engine.name} engine publishes no cache events")
            async for batch in events.subscribe():
                yield pb.CacheEventBatch(
                    sequence=batch.sequence, snapshot=batch.snapshot, block_size=events.block_size,
                    stored=[pb.CachedBlock(hash=h, parent_hash=p, token_ids=t) for h, p, t in batch.stored],
                    removed=batch.removed)
        except WorkerError as exc:
            await context.abort(*status_for(exc))

    async def PrefixHashes(self, message: pb.PredictRequest, context) -> pb.PrefixHashesReply:
        engine = self.worker.engine
        try:
            if engine.events is None:
                raise NoCacheEvents(f"the {engine.name} engine publishes no cache events")
            if not self.worker.inference.ready:
                raise NotReady("model is loading")
            request = GenerationRequest.from_pb(message, self.worker.config.sampling)
            if request.adapter:
                return pb.PrefixHashesReply(block_size=engine.events.block_size)
            ids = request.prompt_token_ids
            if ids is None:
                ids = await asyncio.to_thread(engine.encode, request)
        except WorkerError as exc:
            await context.abort(*status_for(exc))
        return pb.PrefixHashesReply(block_size=engine.events.block_size, prompt_tokens=len(ids),
                                    hashes=prompt_hashes(ids, engine.events.block_size))

    async def GetLoad(self, request, context) -> pb.WorkerLoad:
        load = self.worker.scheduler.load()
        prefix = self.worker.engine.prefix_cache_stats()
        return pb.WorkerLoad(
            running=load.running, queued=load.queued, max_concurrency=load.max_concurrency,
            max_queue=load.max_queue, budget_tokens_used=load.budget_used,
            budget_tokens_total=load.budget_total, ready=self.worker.inference.ready,
            draining=load.draining, prefix_queried_tokens=prefix[0] if prefix else None,
            prefix_hit_tokens=prefix[1] if prefix else None)

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
            queue_timeout_s=resources.queue_timeout_s, budget_tokens=0, fairness=Fairness.from_config(config.tenants))
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
        server = grpc.aio.server(options=self.config.server.grpc_options())
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
            await asyncio.to_thread(self.inference.tracer.shutdown)
            # Frozen objects are never collected, so at exit nanobind would report Triton's as
            # leaks: dozens of lines that are not JSON on stderr.
            gc.unfreeze()
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
            await self.inference.warm_up()  # first: the engine's warm-up then resets what it counted
            await self.engine.warmup()
            # What is loaded by now lives as long as the process: frozen, a full collection no
            # longer walks it. Unfrozen, one took ~200 ms of a batch-256 decode on an H100 (every
            # stream stalled); frozen, 0-22 ms.
            gc.collect()
            gc.freeze()
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
        """Readiness means progress: running work while the engine completes no step (a prefill
        chunk counts) and sends no output for timeout_s is a stuck engine. A long prompt is not."""
        stalled = False
        while True:
            await asyncio.sleep(min(1.0, timeout_s / 4))
            if not self.inference.ready or self._shutdown.is_set():
                continue
            idle_s = time.monotonic() - max(self.inference.last_progress, self.engine.last_step_at)
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
