"""InferenceService.StreamPredict: validate, adapt, encode, admit, stream; give back what the call
held however it ends, and map every failure to one status."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
import uuid
from pathlib import Path

import grpc

from worker.adapters.base import Adapter, build_adapters
from worker.config import Config
from worker.engines.base import BaseEngine, RequestStream, message_spacing
from worker.errors import (
    AdapterNotFound,
    ClientStalled,
    DeviceOutOfMemory,
    Draining,
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
from worker.request import ChatMessage, GenerationRequest, SamplingParams, TokenLogprob
from worker.scheduler import Grant, TaskScheduler
from worker.telemetry import Metrics, get_logger
from worker.traces import Tracer

log = get_logger(__name__)
FINISH_REASONS = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH,
                  "aborted": pb.FINISH_REASON_ABORTED}
# Tokenizing more text than this would stall every stream on the event loop; do it on a thread.
INLINE_ENCODE_CHARS = 16_384
# A call cancelled this close to its deadline ended by the deadline (a client that hangs up, or a
# sidecar whose own deadline passed, cancels a moment before grpc's timer here fires).
DEADLINE_SLACK_S = 0.05


class InferenceServicer(pb_grpc.InferenceServiceServicer):
    """StreamPredict: validate, encode, admit, stream; release the slot however the call ends."""

    def __init__(self, engine: BaseEngine, scheduler: TaskScheduler, metrics: Metrics, config: Config):
        self.engine = engine
        self.scheduler = scheduler
        self.metrics = metrics
        self.defaults = config.sampling
        self.max_messages_per_s = config.server.max_messages_per_s
        self.min_message_interval_s = config.server.min_message_interval_s
        self.stall_timeout_s = config.server.stall_timeout_s
        self.max_consecutive_engine_errors = config.server.max_consecutive_engine_errors
        self.consecutive_engine_errors = 0
        # Set by the Worker: called once faults in a row say the device is not coming back.
        self.on_repeated_faults = lambda: None
        self.adapters: dict[str, Adapter] = build_adapters(config.adapters.named, Path(config.adapters.kb_dir))
        self.tracer = Tracer(config.tracing, metrics.spans_exported, metrics.spans_dropped)
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
        span = self.tracer.start(context, request_id)
        status = grpc.StatusCode.OK
        grant = stream = timer = finish_reason = None
        finished = False
        first_token_at = None
        completion_tokens = 0
        remaining = context.time_remaining()
        deadline = time.monotonic() + remaining if remaining is not None else None
        self._in_flight += 1
        self.idle.clear()
        try:
            request = await self._prepare(message)
            span.prepared(request)
            prompt_tokens = len(request.prompt_token_ids)
            tenant = self.scheduler.fairness.tenant_of(request.metadata)
            grant = await self.scheduler.admit(prompt_tokens + max(1, request.sampling.max_tokens), request.priority,
                                               deadline, tenant, prompt_tokens)
            span.admitted(grant)
            self.last_progress = time.monotonic()
            self.metrics.queue_time.observe(grant.queued_s)
            self.metrics.tenant_queue_time.labels(self.scheduler.fairness.label(tenant)).observe(grant.queued_s)
            self.metrics.prompt_tokens.inc(prompt_tokens)
            stream = self.engine.stream_predict(request if request.sampling.max_tokens else dataclasses.replace(
                request, sampling=dataclasses.replace(request.sampling, max_tokens=1)))
            self._streams[id(stream)] = stream
            # The engine holds nothing of a request once it ends: its slot goes to the next one
            # now, not after the last message is written to a client that may read slowly.
            stream.on_finish = functools.partial(self.scheduler.release, grant)
            if deadline is not None:
                timer = asyncio.get_running_loop().call_later(
                    max(0.0, deadline - time.monotonic()), stream.fail,
                    RequestDeadlineExceeded("deadline passed while generating"))
            adapter = self.adapters.get(request.adapter)
            scoring_only = request.sampling.max_tokens == 0  # the engine makes one token, not sent
            async for output in stream:
                if scoring_only:
                    output.text, output.token_ids, output.logprobs = "", [], []
                    output.finish_reason = output.finish_reason and "length"
                if adapter is not None:
                    output = adapter.process_output(output)
                self.last_progress = time.monotonic()
                completion_tokens += len(output.token_ids)
                self.scheduler.served(grant, len(output.token_ids))
                if first_token_at is None and output.token_ids:
                    first_token_at = time.perf_counter()
                    span.first_token()
                response = pb.PredictResponse(request_id=request_id, text=output.text)
                if request.return_token_ids:
                    response.token_ids.extend(output.token_ids)
                if output.logprobs:
                    response.logprobs.extend(self._logprobs(output.logprobs))
                if output.prompt_logprobs is not None:
                    response.prompt_logprobs.extend(self._logprobs(output.prompt_logprobs))
                if output.finish_reason is not None:
                    finished, finish_reason = True, output.finish_reason
                    self.consecutive_engine_errors = 0
                    now = time.perf_counter()
                    response.finish_reason = FINISH_REASONS[output.finish_reason]
                    response.usage.prompt_tokens = prompt_tokens
                    response.usage.completion_tokens = completion_tokens
                    response.timing.queue_ms = grant.queued_s * 1000
                    response.timing.time_to_first_token_ms = ((first_token_at or now) - arrived) * 1000
                    response.timing.total_ms = (now - arrived) * 1000
                elif not output.text and not response.token_ids and not response.prompt_logprobs:
                    continue
                await self._send(context, response)
                if not finished and not self.engine.paces_messages:
                    spacing = message_spacing(len(self._streams), self.max_messages_per_s, self.min_message_interval_s)
                    if spacing > 0.0005:  # below this a timer costs more than the message it saves
                        await asyncio.sleep(spacing)
        except WorkerError as exc:
            status, detail = status_for(exc)
            if isinstance(exc, (DeviceOutOfMemory, EngineRequestError)):
                self._count_engine_error()
            # Given back before the status, which can queue behind data a client has not read.
            self._release(stream, grant, timer, finished)
            stream = grant = timer = None
            await _abort(context, status, detail)
        except asyncio.CancelledError:  # the client left, or grpc ended the call at its deadline
            # grpc's own clock: `deadline` above was read a little after the call's, so at the
            # deadline grpc cancels the call before time.monotonic() reaches it.
            remaining = context.time_remaining()
            past_deadline = remaining is not None and remaining <= DEADLINE_SLACK_S
            status = grpc.StatusCode.DEADLINE_EXCEEDED if past_deadline else grpc.StatusCode.CANCELLED
            raise
        except Exception as exc:  # noqa: BLE001 - a bug must cost one request, not the worker
            log.exception("request failed", request_id=request_id)
            status, detail = status_for(exc)
            self._release(stream, grant, timer, finished)
            stream = grant = timer = None
            await _abort(context, status, detail)
        finally:
            self._release(stream, grant, timer, finished)
            self._record(request_id, status, arrived, first_token_at, completion_tokens, span.trace_id)
            self._in_flight -= 1
            if self._in_flight == 0:
                self.idle.set()
            span.end(status.name, completion_tokens, finish_reason, getattr(self.engine.info, "served_name", ""))

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

    async def warm_up(self) -> None:
        """One short chat request served as StreamPredict serves one (encoded, checked, streamed),
        before the worker says it is ready and in no metric of its: otherwise the first request
        pays the chat template's compile, the tokenizer's first checks and the first run of the
        paths a real prompt takes. A fresh worker's first chat request (SmolLM2, native), ms to its
        first token: H200 10.4-11.7 without, 4.4-4.7 with (the next ones 3.4-4.5); 2-core CPU
        38-42 without, 25-26 with (the next ones 19-21)."""
        request = GenerationRequest(request_id="warmup-request", sampling=SamplingParams(max_tokens=2, ignore_eos=True),
                                    messages=(ChatMessage(role="user", content="Hello, who are you?"),))
        try:
            request.prompt_token_ids = self.engine.encode(request)
        except Exception:  # noqa: BLE001 - no chat template, or one that refuses a lone user message
            request = dataclasses.replace(request, messages=None, prompt="Hello, who are you?")
            request.prompt_token_ids = self.engine.encode(request)
        request.prompt_token_ids = request.prompt_token_ids[:max(1, self.engine.info.max_model_len - 2)]
        self.engine.prepare(request)
        for _ in range(2):  # the second after the first's prompt, cached where the engine caches prefixes
            async for _ in self.engine.stream_predict(request):
                pass

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
        if request.constraint is not None:
            await asyncio.to_thread(self.engine.prepare, request)  # compiling a new schema takes milliseconds
        else:
            self.engine.prepare(request)
        prompt_tokens = len(request.prompt_token_ids)
        if prompt_tokens + request.sampling.max_tokens > info.max_model_len:
            raise InvalidRequest(
                f"prompt ({prompt_tokens} tokens) + max_tokens ({request.sampling.max_tokens}) is over the "
                f"model's context of {info.max_model_len} tokens")
        return request

    def _logprobs(self, entries: list[TokenLogprob]) -> list[pb.TokenLogprob]:
        def one(token_id: int, logprob: float | None, top: list[tuple[int, float]]) -> pb.TokenLogprob:
            raw = self.engine.token_bytes(token_id)
            return pb.TokenLogprob(token_id=token_id, text=raw.decode("utf-8", errors="replace"), bytes=raw,
                                   logprob=logprob, top_logprobs=[one(i, v, []) for i, v in top])

        return [one(e.token_id, e.logprob, e.top) for e in entries]

    def _record(self, request_id: str, status: grpc.StatusCode, arrived: float,
                first_token_at: float | None, completion_tokens: int, trace_id: str | None) -> None:
        now = time.perf_counter()
        self.metrics.requests.labels(status=status.name).inc()
        self.metrics.generation_tokens.inc(completion_tokens)
        if first_token_at is not None:
            self.metrics.ttft.observe(first_token_at - arrived)
            if completion_tokens > 1:
                self.metrics.tpot.observe((now - first_token_at) / (completion_tokens - 1))
        trace = {"trace_id": trace_id} if trace_id else {}
        log.info("request ended", request_id=request_id, **trace, status=status.name,
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
