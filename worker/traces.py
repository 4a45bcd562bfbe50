"""OpenTelemetry traces of StreamPredict, off unless tracing.otlp_endpoint is set.

One server span per call, a child of the sidecar's attempt (the W3C `traceparent` in the call's
metadata) or a new trace: a `prepare` child (validation, adapter, encoding, grammar), a `queue`
child (the wait for a slot and budget), a `first token` event, and at the end the gRPC status and
token counts. Attributes follow OpenTelemetry's GenAI conventions; never the prompt or the output.
Spans are batched and exported on the SDK's thread; those that never reach the collector (queue
full, export failed) are counted in cyllm_spans_dropped_total, never waited for.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

from worker.config import TracingConfig

if TYPE_CHECKING:
    import grpc
    from prometheus_client import Counter

    from worker.request import GenerationRequest
    from worker.scheduler import Grant

# Spans waiting for export; past it new ones are dropped (and counted), not queued.
QUEUE = 4096
METHOD = "cyllm.inference.v1.InferenceService/StreamPredict"


class Tracer:
    """Starts each call's span; `start` returns NO_SPAN, whose methods do nothing, when tracing is off."""

    def __init__(self, config: TracingConfig, exported: Counter, dropped: Counter):
        self._tracer = None
        if not config.otlp_endpoint:
            return
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        exporter = OTLPSpanExporter(endpoint=config.otlp_endpoint, insecure=True, timeout=config.export_timeout_s)
        gate = _Gate(exported, dropped)
        self.provider = TracerProvider(sampler=_sampler(config), resource=Resource({"service.name": config.service_name}))
        self._exporter = _Counted(exporter, gate)
        gate.inner = BatchSpanProcessor(self._exporter, max_queue_size=QUEUE)
        self.provider.add_span_processor(gate)
        self._tracer = self.provider.get_tracer("cy-llm-worker")
        self._propagator = TraceContextTextMapPropagator()

    def start(self, context: grpc.aio.ServicerContext, request_id: str) -> RequestSpan:
        """The call's span, a child of the `traceparent` in its metadata (read only when tracing is on)."""
        if self._tracer is None:
            return NO_SPAN
        from opentelemetry.trace import SpanKind

        carrier = {key: value for key, value in context.invocation_metadata() or () if isinstance(value, str)}
        span = self._tracer.start_span(METHOD, context=self._propagator.extract(carrier), kind=SpanKind.SERVER,
                                       attributes={"rpc.system": "grpc", "rpc.service": METHOD.split("/")[0],
                                                   "rpc.method": "StreamPredict", "cyllm.request_id": request_id})
        return RequestSpan(self._tracer, span) if span.is_recording() else NO_SPAN

    def shutdown(self, timeout_s: float = 2.0) -> None:
        """Exports what is still batched, waiting at most about timeout_s: the exporter retries an
        unreachable collector until its own timeout, which must not hold up the worker's exit
        (what is left then is counted as dropped)."""
        if self._tracer is not None:
            # force_flush exports on the calling thread, retrying past its own timeout argument.
            flusher = threading.Thread(target=self.provider.force_flush, daemon=True)
            flusher.start()
            flusher.join(timeout_s)
            self._exporter.shutdown()  # ends an export still retrying
            self.provider.shutdown()


def _sampler(config: TracingConfig):
    from opentelemetry.sdk.trace import sampling

    ratio = sampling.TraceIdRatioBased(config.sample_ratio)
    return {
        "parentbased_traceidratio": sampling.ParentBased(ratio), "traceidratio": ratio,
        "parentbased_always_on": sampling.ParentBased(sampling.ALWAYS_ON), "always_on": sampling.ALWAYS_ON,
        "parentbased_always_off": sampling.ParentBased(sampling.ALWAYS_OFF), "always_off": sampling.ALWAYS_OFF,
    }[config.sampler]


class RequestSpan:
    """The phases of one call, recorded as they pass; the child spans are written at the end with
    the times taken here."""

    def __init__(self, tracer, span):
        self._tracer = tracer
        self._span = span
        self._marks: dict[str, int] = {"arrived": time.time_ns()}
        self._attributes: dict[str, dict] = {}

    @property
    def trace_id(self) -> str | None:
        return format(self._span.get_span_context().trace_id, "032x")

    def prepared(self, request: GenerationRequest) -> None:
        self._marks["prepared"] = time.time_ns()
        sampling = request.sampling
        self._span.set_attributes({
            "gen_ai.operation.name": "chat" if request.messages is not None else "text_completion",
            "gen_ai.request.max_tokens": sampling.max_tokens,
            "gen_ai.request.temperature": sampling.temperature, "gen_ai.request.top_p": sampling.top_p,
            "gen_ai.usage.input_tokens": len(request.prompt_token_ids or ())})
        if request.model:
            self._span.set_attribute("gen_ai.request.model", request.model)
        if request.adapter:
            self._attributes["prepare"] = {"cyllm.adapter": request.adapter}

    def admitted(self, grant: Grant) -> None:
        self._marks["admitted"] = time.time_ns()
        self._attributes["queue"] = {"cyllm.queue_ms": grant.queued_s * 1000, "cyllm.budget_tokens": grant.cost}

    def first_token(self) -> None:
        self._span.add_event("first token")

    def end(self, status_name: str, completion_tokens: int, finish_reason: str | None, served_model: str) -> None:
        from opentelemetry.trace import Status, StatusCode, set_span_in_context

        context = set_span_in_context(self._span)
        phases = (("prepare", "arrived", "prepared"), ("queue", "prepared", "admitted"))
        for name, start, stop in phases:
            if start in self._marks and stop in self._marks:
                child = self._tracer.start_span(name, context=context, start_time=self._marks[start],
                                                attributes=self._attributes.get(name))
                child.end(end_time=self._marks[stop])
        self._span.set_attribute("gen_ai.response.model", served_model)
        self._span.set_attribute("gen_ai.usage.output_tokens", completion_tokens)
        self._span.set_attribute("rpc.grpc.status_code", _CODES.get(status_name, 2))
        if finish_reason is not None:
            self._span.set_attribute("gen_ai.response.finish_reasons", (finish_reason,))
        if status_name != "OK":
            self._span.set_status(Status(StatusCode.ERROR, status_name))
        self._span.end()


class _NoSpan(RequestSpan):
    def __init__(self):
        pass

    trace_id = None

    def prepared(self, request: GenerationRequest) -> None:
        pass

    def admitted(self, grant: Grant) -> None:
        pass

    def first_token(self) -> None:
        pass

    def end(self, status_name: str, completion_tokens: int, finish_reason: str | None, served_model: str) -> None:
        pass


NO_SPAN = _NoSpan()
_CODES = {"OK": 0, "CANCELLED": 1, "UNKNOWN": 2, "INVALID_ARGUMENT": 3, "DEADLINE_EXCEEDED": 4, "NOT_FOUND": 5,
          "ALREADY_EXISTS": 6, "PERMISSION_DENIED": 7, "RESOURCE_EXHAUSTED": 8, "FAILED_PRECONDITION": 9,
          "ABORTED": 10, "OUT_OF_RANGE": 11, "UNIMPLEMENTED": 12, "INTERNAL": 13, "UNAVAILABLE": 14,
          "DATA_LOSS": 15, "UNAUTHENTICATED": 16}


class _Gate:
    """A span processor in front of the SDK's batch processor, which drops spans silently when its
    queue is full: counts a span pending from its end until its batch goes to the exporter, and
    drops (and counts) those past the queue's size."""

    def __init__(self, exported: Counter, dropped: Counter):
        self.inner = None
        self.exported, self.dropped = exported, dropped
        self.pending = 0
        self.lock = threading.Lock()

    def on_start(self, span, parent_context=None) -> None:
        self.inner.on_start(span, parent_context)

    def _on_ending(self, span) -> None:
        self.inner._on_ending(span)  # the SDK's processor hook (a no-op in its batch processor)

    def on_end(self, span) -> None:
        if not span.context.trace_flags.sampled:
            return
        with self.lock:
            full = self.pending >= QUEUE
            self.pending += not full
        if full:
            self.dropped.labels(reason="queue_full").inc()
        else:
            self.inner.on_end(span)

    def taken(self, spans: int) -> None:
        with self.lock:
            self.pending -= spans

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


class _Counted:
    """The OTLP exporter, counting what it sent and what it could not."""

    def __init__(self, inner, gate: _Gate):
        self.inner, self.gate = inner, gate
        self.stopped = False

    def export(self, spans):
        from opentelemetry.sdk.trace.export import SpanExportResult

        self.gate.taken(len(spans))
        try:
            result = self.inner.export(spans)
        except Exception:  # noqa: BLE001 - an exporter's failure costs spans, never a request
            result = SpanExportResult.FAILURE
        if result == SpanExportResult.SUCCESS:
            self.gate.exported.inc(len(spans))
        else:
            self.gate.dropped.labels(reason="export_failed").inc(len(spans))
        return result

    def shutdown(self) -> None:
        if not self.stopped:  # once: Tracer.shutdown and the batch processor's both call it
            self.stopped = True
            self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)
