//! The HTTP side: OpenAI-compatible /v1 routes (streaming as SSE), /healthz and /readyz.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use serde::de::DeserializeOwned;
use serde_json::{json, Value};

use crate::auth::{ApiKeys, Caller, FAIRNESS_HEADER};
use crate::error::{code_name, SidecarError};
use crate::gateway::{record_end, Gateway, Route};
use crate::openai::{ChatRequest, CompletionRequest};
use crate::proto::PredictRequest;
use crate::ratelimit::RateLimits;
use crate::reply::Shape;
use crate::response::{respond, Options};
use crate::request_id;
use crate::trace;

pub struct HttpState {
    pub gateway: Arc<Gateway>,
    pub keys: ApiKeys,
    pub limits: Arc<RateLimits>,
    pub timeout: Option<Duration>,
    /// How long a request body may take to arrive whole.
    pub body_timeout: Option<Duration>,
    pub max_body_bytes: usize,
}

pub fn app(state: Arc<HttpState>) -> Router {
    // Layers run bottom-up: the key is checked before the body is read.
    let api = Router::new()
        .route("/v1/models", get(models))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route_layer(middleware::from_fn_with_state(state.clone(), read_body))
        .route_layer(middleware::from_fn_with_state(state.clone(), require_key))
        .route_layer(middleware::from_fn(request_id::layer));
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/health", get(|| async { "ok" })) // vLLM's name, which OpenAI-server tools probe
        .route("/readyz", get(readyz))
        .merge(api)
        .layer(DefaultBodyLimit::max(state.max_body_bytes))
        .with_state(state)
}

/// The route a request's path names, for metric labels.
fn route_of(path: &str) -> Route {
    match path {
        "/v1/chat/completions" => Route::ChatCompletions,
        _ => Route::Completions,
    }
}

/// An error answered by the sidecar itself, counted like any other request's end. Refusals
/// before the handler (key, body) have no request span: `Span::none()`.
pub fn refuse(route: Route, id: &str, error: SidecarError, span: &tracing::Span) -> Response {
    record_end(route, id, "none", code_name(error.code()), Instant::now(), None, span);
    error.into_response()
}

/// The caller (a named key's name) goes on in the request's extensions.
async fn require_key(State(state): State<Arc<HttpState>>, mut request: Request, next: Next) -> Response {
    let headers = request.headers();
    let authorization = headers.get(header::AUTHORIZATION).map(|v| v.as_bytes());
    let api_key = headers.get("x-api-key").map(|v| v.as_bytes());
    match state.keys.check_header(authorization, api_key) {
        Some(caller) => {
            request.extensions_mut().insert(caller);
            next.run(request).await
        }
        None => refuse(route_of(request.uri().path()), &request_id::of(headers), SidecarError::Unauthenticated,
                       &tracing::Span::none()),
    }
}

/// Reads the whole body within the body timeout and the size limit: a client that declares a
/// body and sends it slowly (or never) gets 408 and its connection closed, instead of holding it.
async fn read_body(State(state): State<Arc<HttpState>>, request: Request, next: Next) -> Response {
    let (route, id) = (route_of(request.uri().path()), request_id::of(request.headers()));
    let (parts, body) = request.into_parts();
    let read = Limited::new(body, state.max_body_bytes).collect();
    let collected = match state.body_timeout {
        Some(timeout) => match tokio::time::timeout(timeout, read).await {
            Ok(collected) => collected,
            Err(_) => {
                let mut response = refuse(route, &id, SidecarError::BodyTimeout(timeout.as_secs()), &tracing::Span::none());
                response.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close"));
                return response;
            }
        },
        None => read.await,
    };
    match collected {
        Ok(collected) => next.run(Request::from_parts(parts, axum::body::Body::from(collected.to_bytes()))).await,
        Err(error) if error.downcast_ref::<LengthLimitError>().is_some() => refuse(route, &id, SidecarError::TooLarge(state.max_body_bytes), &tracing::Span::none()),
        Err(error) => refuse(route, &id, SidecarError::InvalidRequest(format!("could not read the request body: {error}")),
                            &tracing::Span::none()),
    }
}

async fn readyz(State(state): State<Arc<HttpState>>) -> Response {
    let pool = &state.gateway.pool;
    let workers: Vec<Value> = pool
        .workers
        .iter()
        .map(|w| {
            json!({"name": w.name, "socket": w.socket.display().to_string(), "ready": w.is_ready(), "models": w.models(),
                   "problem": w.problem()})
        })
        .collect();
    let ready = pool.is_ready() && !state.gateway.is_shutting_down();
    let status = if ready { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    (status, Json(json!({"ready": ready, "shutting_down": state.gateway.is_shutting_down(), "workers": workers}))).into_response()
}

async fn models(State(state): State<Arc<HttpState>>) -> Json<Value> {
    let data: Vec<Value> = state
        .gateway
        .pool
        .models()
        .into_iter()
        .map(|id| json!({"id": id, "object": "model", "created": 0, "owned_by": "cy-llm"}))
        .collect();
    Json(json!({"object": "list", "data": data}))
}

fn parse<T: DeserializeOwned>(body: Result<Bytes, BytesRejection>, limit: usize) -> Result<T, SidecarError> {
    let body = body.map_err(|rejection| {
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            SidecarError::TooLarge(limit)
        } else {
            SidecarError::InvalidRequest(rejection.body_text())
        }
    })?;
    serde_json::from_slice(&body).map_err(|e| SidecarError::InvalidRequest(format!("invalid JSON body: {e}")))
}

async fn completions(State(state): State<Arc<HttpState>>, Extension(caller): Extension<Caller>, headers: HeaderMap,
                     body: Result<Bytes, BytesRejection>) -> Response {
    let id = request_id::of(&headers);
    let span = trace::request_span(Route::Completions, &id, trace::parent(&headers));
    let request: CompletionRequest = match parse(body, state.max_body_bytes) {
        Ok(request) => request,
        Err(error) => return refuse(Route::Completions, &id, error, &span),
    };
    let (stream, include_usage, n) = (request.sampling.stream, request.sampling.include_usage(), request.sampling.choices());
    let logprobs = request.sampling.logprobs.as_ref().is_some_and(|v| v.is_number());
    match request.into_proto(&id).and_then(|(proto, echo)| Ok((with_headers(proto, &headers, &caller)?, echo))) {
        Ok((proto, echo)) => {
            let shape = Shape { route: Route::Completions, tools: None, logprobs, echo };
            respond(&state, proto, shape, id, Options { streaming: stream, include_usage, n, caller }, span).await
        }
        Err(error) => refuse(Route::Completions, &id, error, &span),
    }
}

async fn chat_completions(State(state): State<Arc<HttpState>>, Extension(caller): Extension<Caller>, headers: HeaderMap,
                          body: Result<Bytes, BytesRejection>) -> Response {
    let id = request_id::of(&headers);
    let span = trace::request_span(Route::ChatCompletions, &id, trace::parent(&headers));
    let request: ChatRequest = match parse(body, state.max_body_bytes) {
        Ok(request) => request,
        Err(error) => return refuse(Route::ChatCompletions, &id, error, &span),
    };
    let (stream, include_usage, n) = (request.sampling.stream, request.sampling.include_usage(), request.sampling.choices());
    match request.into_proto(&id).and_then(|(proto, plan)| Ok((with_headers(proto, &headers, &caller)?, plan))) {
        Ok((proto, plan)) => {
            let logprobs = proto.logprobs.is_some();
            let tools = (plan.mode != crate::tools::Mode::None).then_some(plan);
            let shape = Shape { route: Route::ChatCompletions, tools, logprobs, echo: None };
            respond(&state, proto, shape, id, Options { streaming: stream, include_usage, n, caller }, span).await
        }
        Err(error) => refuse(Route::ChatCompletions, &id, error, &span),
    }
}

/// What the OpenAI body has no field for, from headers (the openai SDK's `extra_headers`): the
/// worker's prompt adapter (`x-cyllm-adapter`) and the tenant the worker shares its slots by (the
/// Gateway API Inference Extension's fairness header, else the key's name, into the metadata
/// under the header's name).
fn with_headers(mut proto: PredictRequest, headers: &HeaderMap, caller: &Caller) -> Result<PredictRequest, SidecarError> {
    let text = |name: &str| -> Result<Option<String>, SidecarError> {
        headers.get(name).map(|v| v.to_str().map(|t| t.trim().to_owned()))
            .transpose().map_err(|_| SidecarError::InvalidRequest(format!("{name}: not ASCII")))
    };
    if let Some(name) = text("x-cyllm-adapter")? {
        proto.adapter = name;
    }
    if let Some(tenant) = caller.tenant(text(FAIRNESS_HEADER)?) {
        proto.metadata.insert(FAIRNESS_HEADER.to_owned(), tenant);
    }
    Ok(proto)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Args;
    use crate::pool::{Pool, Worker};
    use axum::body::Body;
    use clap::Parser;
    use tower::ServiceExt;

    fn state(keys: Vec<String>, ready: bool) -> Arc<HttpState> {
        let args = Args::parse_from(["cy-llm-sidecar", "--worker", "unix:///tmp/w0.sock", "--max-request-bytes", "1024"]);
        let pool = Arc::new(Pool { workers: vec![Arc::new(Worker::fake("w0", &["smol"], ready))] });
        Arc::new(HttpState {
            gateway: Arc::new(Gateway::new(pool, &args)),
            keys: ApiKeys::plain(&keys.iter().map(String::as_str).collect::<Vec<_>>()),
            limits: RateLimits::load(None).unwrap(),
            timeout: None,
            body_timeout: Some(Duration::from_millis(200)),
            max_body_bytes: 1024,
        })
    }

    async fn call(app: Router, method: &str, uri: &str, body: &str, key: Option<&str>) -> (StatusCode, Value) {
        let mut request = axum::http::Request::builder().method(method).uri(uri).header("content-type", "application/json");
        if let Some(key) = key {
            request = request.header("authorization", format!("Bearer {key}"));
        }
        let response = app.oneshot(request.body(Body::from(body.to_string())).unwrap()).await.unwrap();
        let status = response.status();
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        (status, serde_json::from_slice(&bytes).unwrap_or(Value::String(String::from_utf8_lossy(&bytes).into())))
    }

    #[tokio::test]
    async fn probes_and_models() {
        let (status, body) = call(app(state(vec![], false)), "GET", "/healthz", "", None).await;
        assert_eq!((status, body), (StatusCode::OK, Value::String("ok".into())));
        let (status, body) = call(app(state(vec![], false)), "GET", "/readyz", "", None).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(body["workers"][0]["name"], "w0");
        assert_eq!(call(app(state(vec![], true)), "GET", "/readyz", "", None).await.0, StatusCode::OK);
        let (status, body) = call(app(state(vec![], true)), "GET", "/v1/models", "", None).await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(body["data"][0]["id"], "smol");
    }

    #[tokio::test]
    async fn errors_in_openai_shape() {
        let cases = [
            ("/v1/completions", "{not json", StatusCode::BAD_REQUEST),
            ("/v1/completions", r#"{"prompt": "x", "n": 30}"#, StatusCode::BAD_REQUEST),
            ("/v1/chat/completions", r#"{"messages": [], "frobnicate": 1}"#, StatusCode::BAD_REQUEST),
            ("/v1/chat/completions", r#"{"model": "llama-9000", "messages": [{"role": "user", "content": "hi"}]}"#, StatusCode::NOT_FOUND),
            ("/v1/chat/completions", r#"{"model": "smol", "messages": [{"role": "user", "content": "hi"}]}"#, StatusCode::SERVICE_UNAVAILABLE),
        ];
        for (uri, body, expected) in cases {
            let (status, json) = call(app(state(vec![], false)), "POST", uri, body, None).await;
            assert_eq!(status, expected, "{uri} {body}");
            assert!(json["error"]["message"].is_string(), "{json}");
            assert_eq!(json["error"]["code"], expected.as_u16());
        }
        let big = format!(r#"{{"prompt": "{}"}}"#, "x".repeat(4096));
        let (status, json) = call(app(state(vec![], true)), "POST", "/v1/completions", &big, None).await;
        assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
        assert_eq!(json["error"]["type"], "invalid_request_error");
    }

    #[tokio::test]
    async fn a_body_that_does_not_arrive_in_time_is_refused_408() {
        // Declares 100 bytes, sends 10, then nothing.
        let (mut sender, body) = futures::channel::mpsc::channel::<Result<Bytes, std::io::Error>>(1);
        sender.try_send(Ok(Bytes::from_static(b"{\"prompt\":"))).unwrap();
        let request = axum::http::Request::post("/v1/completions")
            .header("content-type", "application/json")
            .header("content-length", "100")
            .body(Body::from_stream(body))
            .unwrap();
        let started = std::time::Instant::now();
        let response = app(state(vec![], true)).oneshot(request).await.unwrap();
        assert_eq!(response.status(), StatusCode::REQUEST_TIMEOUT);
        assert_eq!(response.headers()["connection"], "close");
        assert!(started.elapsed() < Duration::from_secs(2));
        drop(sender);
        assert_eq!(call(app(state(vec![], false)), "GET", "/health", "", None).await.0, StatusCode::OK);
    }

    #[tokio::test]
    async fn keys_guard_v1_but_not_the_probes() {
        let keys = vec!["sk-good".to_string()];
        let (status, json) = call(app(state(keys.clone(), true)), "GET", "/v1/models", "", Some("sk-bad")).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED);
        assert_eq!(json["error"]["type"], "authentication_error");
        assert_eq!(call(app(state(keys.clone(), true)), "GET", "/v1/models", "", None).await.0, StatusCode::UNAUTHORIZED);
        assert_eq!(call(app(state(keys.clone(), true)), "GET", "/v1/models", "", Some("sk-good")).await.0, StatusCode::OK);
        assert_eq!(call(app(state(keys.clone(), true)), "GET", "/healthz", "", None).await.0, StatusCode::OK);
        assert_eq!(call(app(state(keys, true)), "GET", "/readyz", "", None).await.0, StatusCode::OK);
    }
}
