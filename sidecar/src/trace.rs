//! OpenTelemetry traces, off unless an OTLP endpoint is configured. Each request is a server span
//! (a child of the caller's W3C `traceparent` when one came, else a new trace) with a client span
//! per upstream attempt, whose context goes to the worker in the call's metadata. Spans are
//! batched and exported off the request path; those that never reach the collector (queue full,
//! export failed) are counted in cyllm_sidecar_spans_dropped_total, never waited for.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::TraceContextExt;
use opentelemetry::Context;
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{
    BatchConfigBuilder, BatchSpanProcessor, Sampler, SdkTracerProvider, Span, SpanData, SpanExporter, SpanProcessor,
};
use opentelemetry_sdk::Resource;
use tonic::metadata::{KeyRef, MetadataKey, MetadataMap};
use tracing_opentelemetry::OpenTelemetrySpanExt;

use tracing::field::Empty;

use crate::config::{Args, TraceSampler};
use crate::gateway::Route;
use crate::proto::{FinishReason, PredictRequest, PredictResponse};

/// The target of the request spans: the exporter's layer takes these and nothing else.
pub const TARGET: &str = "cy_llm_sidecar::trace";
/// Spans waiting for export; past it new ones are dropped (and counted), not queued.
const QUEUE: usize = 4096;
const DROPPED: &str = "cyllm_sidecar_spans_dropped_total";

/// The tracer provider, when `--otlp-endpoint` (or OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT) is set.
/// Must be called inside the tokio runtime: the exporter's channel lives on it.
pub fn provider(args: &Args) -> anyhow::Result<Option<SdkTracerProvider>> {
    let Some(endpoint) = args.otlp_endpoint() else { return Ok(None) };
    anyhow::ensure!(endpoint.starts_with("http://"),
                    "--otlp-endpoint {endpoint:?}: OTLP over gRPC in plain text (http://HOST:4317) is what this build exports");
    anyhow::ensure!((0.0..=1.0).contains(&args.trace_sample_ratio), "--trace-sample-ratio must be within 0..1");
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .with_endpoint(endpoint)
        .with_timeout(Duration::from_secs_f64(args.otlp_timeout_s))
        .build()?;
    let pending = Arc::new(AtomicUsize::new(0));
    let batch = BatchSpanProcessor::builder(Counted { inner: exporter, pending: pending.clone() })
        .with_batch_config(BatchConfigBuilder::default().with_max_queue_size(QUEUE).build())
        .build();
    let ratio = Sampler::TraceIdRatioBased(args.trace_sample_ratio);
    let sampler = match args.trace_sampler {
        TraceSampler::ParentbasedTraceidratio => Sampler::ParentBased(Box::new(ratio)),
        TraceSampler::Traceidratio => ratio,
        TraceSampler::ParentbasedAlwaysOn => Sampler::ParentBased(Box::new(Sampler::AlwaysOn)),
        TraceSampler::AlwaysOn => Sampler::AlwaysOn,
        TraceSampler::ParentbasedAlwaysOff => Sampler::ParentBased(Box::new(Sampler::AlwaysOff)),
        TraceSampler::AlwaysOff => Sampler::AlwaysOff,
    };
    Ok(Some(
        SdkTracerProvider::builder()
            .with_span_processor(Gate { inner: batch, pending })
            .with_sampler(sampler)
            .with_resource(Resource::builder_empty().with_service_name(args.otel_service_name.clone()).build())
            .build(),
    ))
}

/// Counts a span as pending from its end until its batch is handed to the exporter, and drops it
/// (counted) when the batch processor's queue could not take it: the SDK's processor drops those
/// silently.
#[derive(Debug)]
struct Gate<P> {
    inner: P,
    pending: Arc<AtomicUsize>,
}

impl<P: SpanProcessor> SpanProcessor for Gate<P> {
    fn on_start(&self, span: &mut Span, cx: &Context) {
        self.inner.on_start(span, cx);
    }

    fn on_end(&self, span: SpanData) {
        if !span.span_context.is_sampled() {
            return;
        }
        if self.pending.fetch_add(1, Ordering::AcqRel) >= QUEUE {
            self.pending.fetch_sub(1, Ordering::AcqRel);
            metrics::counter!(DROPPED, "reason" => "queue_full").increment(1);
            return;
        }
        self.inner.on_end(span);
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.inner.set_resource(resource);
    }
}

/// The OTLP exporter, counting what it sent and what it could not.
#[derive(Debug)]
struct Counted<E> {
    inner: E,
    pending: Arc<AtomicUsize>,
}

impl<E: SpanExporter> SpanExporter for Counted<E> {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        let spans = batch.len();
        self.pending.fetch_sub(spans, Ordering::AcqRel);
        let result = self.inner.export(batch).await;
        match &result {
            Ok(()) => metrics::counter!("cyllm_sidecar_spans_exported_total").increment(spans as u64),
            Err(error) => {
                metrics::counter!(DROPPED, "reason" => "export_failed").increment(spans as u64);
                tracing::debug!(spans, %error, "span export failed");
            }
        }
        result
    }

    fn shutdown_with_timeout(&mut self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn force_flush(&mut self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.inner.set_resource(resource);
    }
}

/// The server span of one request, a child of `parent`. Never the prompt or the output.
pub fn request_span(route: Route, request_id: &str, parent: Context) -> tracing::Span {
    let span = tracing::info_span!(target: TARGET, "request",
        otel.name = route.span_name(), otel.kind = "server", otel.status_code = Empty, otel.status_message = Empty,
        cyllm.request_id = request_id, cyllm.route = route.as_str(), gen_ai.operation.name = route.operation(),
        gen_ai.request.model = Empty, gen_ai.request.max_tokens = Empty, gen_ai.request.temperature = Empty,
        gen_ai.request.top_p = Empty, gen_ai.request.choice.count = Empty);
    let _ = span.set_parent(parent);
    span
}

/// What the request asks for, as OpenTelemetry's GenAI conventions name it.
pub fn record_request(span: &tracing::Span, request: &PredictRequest, choices: u32) {
    if !request.model.is_empty() {
        span.record("gen_ai.request.model", request.model.as_str());
    }
    if let Some(sampling) = &request.sampling {
        span.record("gen_ai.request.max_tokens", sampling.max_tokens.map(i64::from));
        span.record("gen_ai.request.temperature", sampling.temperature);
        span.record("gen_ai.request.top_p", sampling.top_p);
    }
    if choices > 1 {
        span.record("gen_ai.request.choice.count", i64::from(choices));
    }
}

/// (Numbers go in as i64: tracing-opentelemetry writes unsigned ones as text.)
/// One call to a worker: which one, how it was chosen, and (set later) how it went.
pub fn attempt_span(request: &tracing::Span, worker: &str, attempt: u32, policy: &'static str, candidates: usize) -> tracing::Span {
    tracing::info_span!(target: TARGET, parent: request, "attempt",
        otel.name = "cyllm.inference.v1.InferenceService/StreamPredict", otel.kind = "client",
        otel.status_code = Empty, otel.status_message = Empty, rpc.system = "grpc",
        cyllm.worker = worker, cyllm.attempt = i64::from(attempt), cyllm.routing.policy = policy,
        cyllm.routing.candidates = candidates as i64,
        cyllm.status = Empty, cyllm.time_to_first_token_ms = Empty, gen_ai.usage.input_tokens = Empty,
        gen_ai.usage.output_tokens = Empty, gen_ai.response.finish_reasons = Empty)
}

/// A span's gRPC status; anything but OK marks it an error (OK leaves it unset, as the
/// conventions ask of servers).
pub fn record_status(span: &tracing::Span, status: &'static str) {
    span.record("cyllm.status", status);
    if status != "OK" {
        span.record("otel.status_code", "ERROR");
        span.record("otel.status_message", status);
    }
}

/// Token counts and the finish reason from the worker's last message.
pub fn record_usage(span: &tracing::Span, message: &PredictResponse) {
    if let Some(usage) = &message.usage {
        span.record("gen_ai.usage.input_tokens", i64::from(usage.prompt_tokens));
        span.record("gen_ai.usage.output_tokens", i64::from(usage.completion_tokens));
    }
    let reason = match FinishReason::try_from(message.finish_reason) {
        Ok(FinishReason::Stop) => "stop",
        Ok(FinishReason::Length) => "length",
        Ok(FinishReason::Aborted) => "aborted",
        _ => return,
    };
    span.record("gen_ai.response.finish_reasons", reason);
}

/// The first message from the worker, as an event on the attempt.
pub fn first_token(span: &tracing::Span, after: Duration) {
    span.record("cyllm.time_to_first_token_ms", after.as_secs_f64() * 1000.0);
    span.add_event("first token", Vec::new());
}

/// The caller's trace context from `traceparent` / `tracestate` in HTTP headers or gRPC metadata
/// (gRPC metadata are HTTP/2 headers): an empty context, so a new trace, when there is none.
pub fn parent(headers: &http::HeaderMap) -> Context {
    TraceContextPropagator::new().extract(&HeaderText(headers))
}

pub fn parent_of_grpc(metadata: &MetadataMap) -> Context {
    TraceContextPropagator::new().extract(&MetadataText(metadata))
}

/// `span`'s context into the metadata of the call to a worker. Nothing when tracing is off.
pub fn inject(span: &tracing::Span, metadata: &mut MetadataMap) {
    let context = span.context();
    if context.span().span_context().is_valid() {
        TraceContextPropagator::new().inject_context(&context, &mut MetadataWriter(metadata));
    }
}

/// The trace id of `span` (32 hex digits) when it is being recorded, for log lines.
pub fn trace_id(span: &tracing::Span) -> Option<String> {
    let context = span.context();
    let span_context = context.span().span_context().clone();
    span_context.is_sampled().then(|| span_context.trace_id().to_string())
}

struct HeaderText<'a>(&'a http::HeaderMap);

impl Extractor for HeaderText<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(|k| k.as_str()).collect()
    }
}

struct MetadataText<'a>(&'a MetadataMap);

impl Extractor for MetadataText<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().filter_map(|k| if let KeyRef::Ascii(k) = k { Some(k.as_str()) } else { None }).collect()
    }
}

struct MetadataWriter<'a>(&'a mut MetadataMap);

impl Injector for MetadataWriter<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(key), Ok(value)) = (MetadataKey::from_bytes(key.as_bytes()), value.parse()) {
            self.0.insert(key, value);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_traceparent_is_read_from_headers_and_metadata() {
        let traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let mut headers = http::HeaderMap::new();
        headers.insert("traceparent", traceparent.parse().unwrap());
        let context = parent(&headers);
        let span = context.span();
        assert_eq!(span.span_context().trace_id().to_string(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert!(span.span_context().is_sampled() && span.span_context().is_remote());
        let mut metadata = MetadataMap::new();
        metadata.insert("traceparent", traceparent.parse().unwrap());
        assert_eq!(parent_of_grpc(&metadata).span().span_context().span_id().to_string(), "00f067aa0ba902b7");
        assert!(!parent(&http::HeaderMap::new()).span().span_context().is_valid());
    }
}
