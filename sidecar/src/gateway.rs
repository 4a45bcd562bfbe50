//! Opening a stream to a worker for one request: choose, call, retry before the first message,
//! keep the breaker and metrics, and hold a stream slot until the stream is dropped.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tonic::Streaming;

use crate::cache_routing::CachePolicy;
use crate::config::{Args, RoutingMode};
use crate::error::{code_name, upstream_code, SidecarError};
use crate::pool::{OutstandingGuard, Pool, Worker};
use crate::proto::inference_service_client::InferenceServiceClient;
use crate::proto::predict_request::Input;
use crate::proto::{PredictRequest, PredictResponse};
use crate::ratelimit::Charge;
use crate::routing::{is_worker_failure, pick, prefix_key, retryable, RetryBudget};
use crate::trace;

/// Where a request came in, for metric labels.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Route {
    Grpc,
    Completions,
    ChatCompletions,
}

impl Route {
    pub fn as_str(self) -> &'static str {
        match self {
            Route::Grpc => "grpc",
            Route::Completions => "completions",
            Route::ChatCompletions => "chat_completions",
        }
    }

    /// The server span's name: the gRPC method, or HTTP's method and route.
    pub fn span_name(self) -> &'static str {
        match self {
            Route::Grpc => "cyllm.inference.v1.InferenceService/StreamPredict",
            Route::Completions => "POST /v1/completions",
            Route::ChatCompletions => "POST /v1/chat/completions",
        }
    }

    /// gen_ai.operation.name (a gRPC request may be either; it says "chat" for a chat input).
    pub fn operation(self) -> &'static str {
        match self {
            Route::ChatCompletions => "chat",
            _ => "text_completion",
        }
    }
}

pub struct Gateway {
    pub pool: Arc<Pool>,
    pub shutting_down: AtomicBool,
    budget: RetryBudget,
    streams: Arc<Semaphore>,
    max_retries: u32,
    routing: RoutingMode,
    cache_policy: CachePolicy,
    prefix_bytes: usize,
    max_decoding_bytes: usize,
    stall_timeout: Duration,
}

impl Gateway {
    pub fn new(pool: Arc<Pool>, args: &Args) -> Self {
        Self {
            pool,
            shutting_down: AtomicBool::new(false),
            budget: RetryBudget::new(args.retry_budget),
            streams: Arc::new(Semaphore::new(args.max_streams)),
            max_retries: args.max_retries,
            routing: args.routing,
            cache_policy: CachePolicy::from_args(args),
            prefix_bytes: args.prefix_bytes,
            max_decoding_bytes: args.max_request_bytes.max(16 * 1024 * 1024),
            stall_timeout: Duration::from_secs_f64(args.worker_stall_timeout_s),
        }
    }

    pub fn is_shutting_down(&self) -> bool {
        self.shutting_down.load(Ordering::Acquire)
    }

    /// A stream from a worker whose first message has arrived (so later failures are not retried).
    /// `span` is the request's server span: each attempt is a child span of it.
    pub async fn open(
        &self,
        request: PredictRequest,
        timeout: Option<Duration>,
        route: Route,
        span: &tracing::Span,
    ) -> Result<Upstream, SidecarError> {
        let started = Instant::now();
        let result = self.admit(&request);
        if let Err(error) = result {
            record_end(route, &request.request_id, "none", code_name(error.code()), started, None, span);
            return Err(error);
        }
        let permit = result?;
        self.budget.deposit();
        let deadline = timeout.map(|t| started + t);
        let affinity = (self.routing == RoutingMode::PrefixAffinity).then(|| affinity_key(&request, self.prefix_bytes));
        let mut preferred = match self.routing {
            RoutingMode::CacheAware => self.cache_policy.choose(&self.pool.candidates(&request.model, started), &request).await,
            _ => None,
        };
        let mut tried: Vec<Arc<Worker>> = Vec::new();
        let mut last_error = None;
        for attempt in 0..=self.max_retries {
            let now = Instant::now();
            let candidates: Vec<_> = self
                .pool
                .candidates(&request.model, now)
                .into_iter()
                .filter(|w| !tried.iter().any(|t| Arc::ptr_eq(t, w)))
                .collect();
            // The cache-aware choice is for the first attempt; a retry goes by load.
            let first_choice = preferred.take().filter(|p| candidates.iter().any(|c| Arc::ptr_eq(c, p)));
            let Some(worker) = first_choice.or_else(|| pick(&candidates, affinity, &mut rand::rng())) else { break };
            let attempt_span = trace::attempt_span(span, &worker.name, attempt + 1, self.policy(), candidates.len());
            tried.push(worker.clone());
            if !worker.breaker.allow(now) {
                trace::record_status(&attempt_span, "UNAVAILABLE");
                continue;
            }
            let remaining = match deadline {
                Some(deadline) if deadline <= now => {
                    trace::record_status(&attempt_span, "DEADLINE_EXCEEDED");
                    record_end(route, &request.request_id, &worker.name, "DEADLINE_EXCEEDED", started, None, span);
                    return Err(SidecarError::Upstream(tonic::Status::deadline_exceeded("deadline passed before a worker answered")))
                }
                Some(deadline) => Some(deadline - now),
                None => None,
            };
            let guard = worker.begin();
            match self.call(&worker, request.clone(), remaining, &attempt_span).await {
                Ok((first, rest)) => {
                    worker.breaker.record_success();
                    let first_at = first.as_ref().map(|_| Instant::now());
                    if let Some(first_at) = first_at {
                        trace::first_token(&attempt_span, first_at - started);
                    }
                    return Ok(Upstream {
                        worker,
                        route,
                        started,
                        deadline,
                        stall_timeout: self.stall_timeout,
                        last_message: Instant::now(),
                        first_at,
                        first,
                        rest,
                        status: "CANCELLED",
                        request_id: request.request_id.clone(),
                        span: span.clone(),
                        attempt_span,
                        charge: None,
                        _guard: guard,
                        _permit: permit,
                    });
                }
                Err(status) => {
                    let code = upstream_code(&status);
                    if is_worker_failure(code) {
                        worker.breaker.record_failure(Instant::now());
                    } else {
                        worker.breaker.record_success();
                    }
                    drop(guard);
                    let error = SidecarError::Upstream(status);
                    trace::record_status(&attempt_span, code_name(code));
                    if !retryable(code) || attempt == self.max_retries || !self.budget.try_spend() {
                        record_end(route, &request.request_id, &worker.name, code_name(error.code()), started, None, span);
                        return Err(error);
                    }
                    metrics::counter!("cyllm_sidecar_retries_total", "route" => route.as_str(), "code" => code_name(code)).increment(1);
                    tracing::info!(request_id = %request.request_id, worker = %worker.name, code = code_name(code), "retrying on another worker");
                    last_error = Some(error);
                }
            }
        }
        let error = last_error.unwrap_or_else(|| SidecarError::NoWorker(request.model.clone()));
        record_end(route, &request.request_id, "none", code_name(error.code()), started, None, span);
        Err(error)
    }

    fn policy(&self) -> &'static str {
        match self.routing {
            RoutingMode::LeastOutstanding => "least-outstanding",
            RoutingMode::PrefixAffinity => "prefix-affinity",
            RoutingMode::CacheAware => "cache-aware",
        }
    }

    /// The checks made before any worker is chosen; the permit holds a stream slot.
    fn admit(&self, request: &PredictRequest) -> Result<OwnedSemaphorePermit, SidecarError> {
        if self.is_shutting_down() {
            return Err(SidecarError::ShuttingDown);
        }
        let permit = self
            .streams
            .clone()
            .try_acquire_owned()
            .map_err(|_| SidecarError::Overloaded("too many open streams on this sidecar".into()))?;
        if !self.pool.knows(&request.model) && !self.pool.models().is_empty() {
            return Err(SidecarError::ModelNotFound(request.model.clone()));
        }
        Ok(permit)
    }

    async fn call(
        &self,
        worker: &Worker,
        request: PredictRequest,
        timeout: Option<Duration>,
        span: &tracing::Span,
    ) -> Result<(Option<PredictResponse>, Streaming<PredictResponse>), tonic::Status> {
        let mut client = InferenceServiceClient::new(worker.channel.clone()).max_decoding_message_size(self.max_decoding_bytes);
        let mut request = tonic::Request::new(request);
        trace::inject(span, request.metadata_mut());
        if let Some(timeout) = timeout {
            request.set_timeout(timeout);
        }
        let opened = async {
            let mut stream = client.stream_predict(request).await?.into_inner();
            let first = stream.message().await?;
            Ok((first, stream))
        };
        // Sent to a worker just before it was found hung: UNAVAILABLE as soon as it is (nothing
        // reached the client yet), so it is tried elsewhere.
        unless_stalled(worker, Instant::now(), Duration::ZERO, opened).await.unwrap_or_else(|| {
            Err(tonic::Status::unavailable(format!("worker {} stopped answering before the first message", worker.name)))
        })
    }
}

/// How often a call waiting on a worker checks whether the worker still answers.
const STALL_CHECK: Duration = Duration::from_millis(500);

/// `future`'s output, or None once the worker is unresponsive (see pool::poll_load) and nothing
/// came from it for `stall` since `since`.
async fn unless_stalled<T>(worker: &Worker, since: Instant, stall: Duration, future: impl Future<Output = T>) -> Option<T> {
    tokio::pin!(future);
    // A message already waiting is taken without touching the timer.
    let mut ticker = tokio::time::interval_at(tokio::time::Instant::now() + STALL_CHECK, STALL_CHECK);
    loop {
        tokio::select! {
            biased;
            value = &mut future => return Some(value),
            _ = ticker.tick() => {
                if !worker.is_responsive() && since.elapsed() >= stall {
                    return None;
                }
            }
        }
    }
}

/// The prompt text (or the chat's text, or the token ids) that prefix affinity hashes.
fn affinity_key(request: &PredictRequest, bytes: usize) -> u64 {
    match &request.input {
        Some(Input::Prompt(prompt)) => prefix_key(prompt, bytes),
        Some(Input::Chat(chat)) => {
            let text: String = chat.messages.iter().map(|m| format!("{}\n{}\n", m.role, m.content)).collect();
            prefix_key(&text, bytes)
        }
        Some(Input::TokenIds(ids)) => {
            let text: String = ids.ids.iter().map(|i| format!("{i},")).collect();
            prefix_key(&text, bytes)
        }
        None => 0,
    }
}

/// An open upstream stream. Dropping it cancels the worker's call (the client left) and gives back
/// the stream slot and the worker's outstanding count.
pub struct Upstream {
    pub worker: Arc<Worker>,
    route: Route,
    started: Instant,
    deadline: Option<Instant>,
    stall_timeout: Duration,
    last_message: Instant,
    first_at: Option<Instant>,
    first: Option<PredictResponse>,
    rest: Streaming<PredictResponse>,
    status: &'static str,
    request_id: String,
    /// The request's server span and this call's: held so they end when the stream does.
    span: tracing::Span,
    attempt_span: tracing::Span,
    /// The caller's token budget, settled when the stream ends (see ratelimit::Charge).
    charge: Option<Charge>,
    _guard: OutstandingGuard,
    _permit: OwnedSemaphorePermit,
}

impl Upstream {
    pub fn bill(&mut self, charge: Charge) {
        self.charge = Some(charge);
    }

    /// The next message; None once the worker ended the stream with OK. A stream whose worker
    /// stopped answering (see pool::poll_load) and that got nothing for the stall timeout ends
    /// UNAVAILABLE; dropping it resets the worker's call, which the worker sees when it is back.
    pub async fn next(&mut self) -> Option<Result<PredictResponse, SidecarError>> {
        if let Some(first) = self.first.take() {
            if let Some(charge) = &mut self.charge {
                charge.observe(&first);
            }
            return Some(Ok(first));
        }
        let Some(received) = unless_stalled(&self.worker, self.last_message, self.stall_timeout, self.rest.message()).await
        else {
            let error = SidecarError::WorkerStalled(self.worker.name.clone(), self.last_message.elapsed().as_secs());
            tracing::warn!(request_id = %self.request_id, worker = %self.worker.name, "stream ended: its worker stopped answering");
            self.status = code_name(error.code());
            return Some(Err(error));
        };
        self.last_message = Instant::now();
        match received {
            Ok(Some(message)) => {
                if self.first_at.is_none() {
                    self.first_at = Some(Instant::now());
                    trace::first_token(&self.attempt_span, self.started.elapsed());
                }
                if message.usage.is_some() {
                    trace::record_usage(&self.attempt_span, &message);
                }
                if let Some(charge) = &mut self.charge {
                    charge.observe(&message);
                }
                Some(Ok(message))
            }
            Ok(None) => {
                self.status = "OK";
                None
            }
            Err(status) => {
                let error = SidecarError::Upstream(status);
                self.status = code_name(error.code());
                Some(Err(error))
            }
        }
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        // A client whose deadline passed mid-stream resets the call: that is its deadline, not a cancel.
        let past_deadline = self.deadline.is_some_and(|d| Instant::now() + DEADLINE_SLACK >= d);
        let status = if self.status == "CANCELLED" && past_deadline { "DEADLINE_EXCEEDED" } else { self.status };
        trace::record_status(&self.attempt_span, status);
        record_end(self.route, &self.request_id, &self.worker.name, status, self.started, self.first_at, &self.span);
    }
}

/// A stream dropped this close to its deadline ended by it (the client's clock runs a little ahead).
const DEADLINE_SLACK: Duration = Duration::from_millis(50);

/// A request's end: counted, timed, and logged with its id and trace id (the worker logs the same
/// ids); a status other than OK marks `span` an error.
pub fn record_end(route: Route, request_id: &str, worker: &str, status: &'static str, started: Instant,
                  first_at: Option<Instant>, span: &tracing::Span) {
    let route = route.as_str();
    if status != "OK" {
        trace::record_status(span, status);
    }
    match trace::trace_id(span) {
        Some(trace_id) => tracing::info!(request_id, trace_id, route, worker, status,
                                         seconds = started.elapsed().as_secs_f64(), "request ended"),
        None => tracing::info!(request_id, route, worker, status, seconds = started.elapsed().as_secs_f64(), "request ended"),
    }
    metrics::counter!("cyllm_sidecar_requests_total", "route" => route, "status" => status, "worker" => worker.to_string())
        .increment(1);
    metrics::histogram!("cyllm_sidecar_upstream_latency_seconds", "route" => route).record(started.elapsed().as_secs_f64());
    if let Some(first_at) = first_at {
        metrics::histogram!("cyllm_sidecar_time_to_first_token_seconds", "route" => route)
            .record((first_at - started).as_secs_f64());
    }
}
