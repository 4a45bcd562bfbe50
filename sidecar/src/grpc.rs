//! InferenceService for the gateway: the same contract as the worker's, forwarded to a worker.

use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::Stream;
use tonic::metadata::MetadataMap;
use tonic::{Request, Response, Status};

use crate::auth::{ApiKeys, Caller, FAIRNESS_HEADER};
use crate::error::code_name;
use crate::gateway::{record_end, Gateway, Route};
use crate::proto::inference_service_server::InferenceService;
use crate::proto::{PredictRequest, PredictResponse};
use crate::ratelimit::RateLimits;
use crate::request_id;
use crate::trace;

pub struct InferenceProxy {
    pub gateway: Arc<Gateway>,
    pub limits: Arc<RateLimits>,
}

type ResponseStream = Pin<Box<dyn Stream<Item = Result<PredictResponse, Status>> + Send>>;

#[tonic::async_trait]
impl InferenceService for InferenceProxy {
    type StreamPredictStream = ResponseStream;

    async fn stream_predict(&self, request: Request<PredictRequest>) -> Result<Response<ResponseStream>, Status> {
        let timeout = grpc_timeout(request.metadata());
        let id = request_id::of_grpc(&request.get_ref().request_id, request.metadata()).map_err(Status::from)?;
        let span = trace::request_span(Route::Grpc, &id, trace::parent_of_grpc(request.metadata()));
        let fairness = request.metadata().get(FAIRNESS_HEADER).and_then(|v| v.to_str().ok()).map(str::to_owned);
        let caller = request.extensions().get::<Caller>().cloned().unwrap_or_default();
        let mut forwarded = request.into_inner();
        forwarded.request_id = id.clone();
        if let Some(tenant) = caller.tenant(fairness) {
            forwarded.metadata.entry(FAIRNESS_HEADER.to_owned()).or_insert(tenant);  // the body's own wins
        }
        trace::record_request(&span, &forwarded, 1);
        let mut admission = self.limits.admit(&caller.budget_key(&forwarded), &forwarded, 1).inspect_err(|error| {
            record_end(Route::Grpc, &id, "none", code_name(error.code()), Instant::now(), None, &span);
        })?;
        let mut upstream = self.gateway.open(forwarded, timeout, Route::Grpc, &span).await?;
        upstream.bill(admission.charges.remove(0));
        // Dropped when the client leaves: that drops `upstream`, which cancels the worker's call.
        let stream = async_stream::stream! {
            while let Some(item) = upstream.next().await {
                match item {
                    Ok(message) => yield Ok(message),
                    Err(error) => {
                        yield Err(Status::from(error));
                        break;
                    }
                }
            }
        };
        let mut response = Response::new(Box::pin(stream) as ResponseStream);
        if let Ok(value) = id.parse() {  // a client's own request_id field may not be a valid header value
            response.metadata_mut().insert(request_id::HEADER, value);
        }
        for (name, value) in admission.headers {
            if let Ok(value) = value.parse() {
                response.metadata_mut().insert(name, value);
            }
        }
        Ok(response)
    }
}

/// The caller's deadline from the grpc-timeout header ("100m", "5S", ...), to pass on to the worker.
pub fn grpc_timeout(metadata: &MetadataMap) -> Option<Duration> {
    let value = metadata.get("grpc-timeout")?.to_str().ok()?;
    let (digits, unit) = value.split_at(value.len().checked_sub(1)?);
    let amount: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(amount * 3600),
        "M" => Duration::from_secs(amount * 60),
        "S" => Duration::from_secs(amount),
        "m" => Duration::from_millis(amount),
        "u" => Duration::from_micros(amount),
        "n" => Duration::from_nanos(amount),
        _ => return None,
    })
}

/// Statuses tonic itself produces that the contract names differently: its decoder refuses a
/// message over the size limit with OUT_OF_RANGE (grpc-core, which the workers use, and the
/// contract say RESOURCE_EXHAUSTED), and a caller's grpc-timeout that runs out before the first
/// message ends the call CANCELLED "Timeout expired" (the gRPC spec says DEADLINE_EXCEEDED).
pub fn contract_status<B>(mut response: http::Response<B>) -> http::Response<B> {
    let headers = response.headers_mut();
    let message = headers.get("grpc-message").and_then(|m| m.to_str().ok()).unwrap_or("").to_owned();
    let rewrite = match headers.get("grpc-status").and_then(|s| s.to_str().ok()) {
        Some("11") if message.contains("message") && message.contains("too") && message.contains("large") => Some("8"),
        Some("1") if message.starts_with("Timeout%20expired") || message.starts_with("Timeout expired") => Some("4"),
        _ => None,
    };
    if let Some(code) = rewrite {
        headers.insert("grpc-status", http::HeaderValue::from_static(code));
    }
    response
}

/// Rejects calls without a valid key (authorization: Bearer KEY, or x-api-key: KEY).
/// The caller (a named key's name) goes on in the request's extensions.
pub fn auth_interceptor(keys: ApiKeys) -> impl FnMut(Request<()>) -> Result<Request<()>, Status> + Clone {
    move |mut request: Request<()>| {
        let metadata = request.metadata();
        let authorization = metadata.get("authorization").map(|v| v.as_bytes());
        let api_key = metadata.get("x-api-key").map(|v| v.as_bytes());
        match keys.check_header(authorization, api_key) {
            Some(caller) => {
                request.extensions_mut().insert(caller);
                Ok(request)
            }
            None => Err(Status::unauthenticated("missing or invalid API key")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_grpc_timeouts() {
        let mut metadata = MetadataMap::new();
        assert_eq!(grpc_timeout(&metadata), None);
        for (value, expected) in [("250m", Duration::from_millis(250)), ("3S", Duration::from_secs(3)), ("1M", Duration::from_secs(60))] {
            metadata.insert("grpc-timeout", value.parse().unwrap());
            assert_eq!(grpc_timeout(&metadata), Some(expected));
        }
        metadata.insert("grpc-timeout", "12x".parse().unwrap());
        assert_eq!(grpc_timeout(&metadata), None);
    }

    #[test]
    fn tonic_statuses_become_the_contract_s() {
        let response = |status: &'static str, message: &'static str| {
            let mut response = http::Response::new(());
            response.headers_mut().insert("grpc-status", http::HeaderValue::from_static(status));
            response.headers_mut().insert("grpc-message", http::HeaderValue::from_static(message));
            contract_status(response)
        };
        let large = response("11", "Error,%20decoded%20message%20length%20too%20large");
        assert_eq!(large.headers()["grpc-status"], "8");
        assert_eq!(response("11", "other").headers()["grpc-status"], "11");
        assert_eq!(response("3", "message too large").headers()["grpc-status"], "3");
        assert_eq!(response("1", "Timeout%20expired").headers()["grpc-status"], "4");
        assert_eq!(response("1", "client went away").headers()["grpc-status"], "1");
    }

    #[test]
    fn interceptor_requires_a_key_when_keys_are_set() {
        let mut check = auth_interceptor(ApiKeys::plain(&["sk-1"]));
        assert_eq!(check(Request::new(())).unwrap_err().code(), tonic::Code::Unauthenticated);
        let mut request = Request::new(());
        request.metadata_mut().insert("authorization", "Bearer sk-1".parse().unwrap());
        assert!(check(request).is_ok());
        let mut open = auth_interceptor(ApiKeys::default());
        assert!(open(Request::new(())).is_ok());
    }
}
