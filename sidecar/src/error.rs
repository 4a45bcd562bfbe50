//! The sidecar's errors and their one mapping to gRPC statuses and to OpenAI-shaped HTTP errors.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;
use tonic::Code;

use crate::ratelimit::Refusal;

#[derive(Debug, thiserror::Error)]
pub enum SidecarError {
    #[error("{0}")]
    InvalidRequest(String),
    #[error("missing or invalid API key")]
    Unauthenticated,
    #[error("model {0:?} is not served by any worker")]
    ModelNotFound(String),
    #[error("{0}")]
    Overloaded(String),
    #[error("no ready worker serves model {0:?}")]
    NoWorker(String),
    #[error("sidecar is shutting down")]
    ShuttingDown,
    #[error("request body is over the {0}-byte limit")]
    TooLarge(usize),
    #[error("request body not received within {0} s")]
    BodyTimeout(u64),
    #[error("rate limit reached for {0:?}: {limit} (retry after {after} s)", limit = .1.limit,
            after = .1.retry_after.as_secs_f64().ceil())]
    RateLimited(String, Refusal),
    #[error("worker {0} stopped answering; no message for {1} s")]
    WorkerStalled(String, u64),
    /// A status the worker returned (or the transport to it), passed on as it is.
    #[error("{}", .0.message())]
    Upstream(tonic::Status),
}

impl SidecarError {
    /// INVALID_ARGUMENT (HTTP 400) with what is wrong with the request.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::InvalidRequest(message.into())
    }

    pub fn code(&self) -> Code {
        match self {
            Self::InvalidRequest(_) => Code::InvalidArgument,
            Self::Unauthenticated => Code::Unauthenticated,
            Self::ModelNotFound(_) => Code::NotFound,
            Self::Overloaded(_) | Self::TooLarge(_) | Self::RateLimited(..) => Code::ResourceExhausted,
            Self::NoWorker(_) | Self::ShuttingDown | Self::WorkerStalled(..) => Code::Unavailable,
            Self::BodyTimeout(_) => Code::DeadlineExceeded,
            Self::Upstream(status) => upstream_code(status),
        }
    }

    pub fn http_status(&self) -> StatusCode {
        match self {
            Self::TooLarge(_) => return StatusCode::PAYLOAD_TOO_LARGE,
            Self::BodyTimeout(_) => return StatusCode::REQUEST_TIMEOUT,
            _ => {}
        }
        http_status_for(self.code())
    }
}

/// Transport failures reach tonic as UNKNOWN or INTERNAL "transport error"s: a worker that went
/// away mid-stream is UNAVAILABLE to the client, so it may retry elsewhere.
pub fn upstream_code(status: &tonic::Status) -> Code {
    let message = status.message();
    let transport = message.contains("transport error")
        || message.contains("h2 protocol error")
        || message.contains("connection")
        || message.contains("broken pipe");
    match status.code() {
        Code::Unknown | Code::Internal if transport => Code::Unavailable,
        code => code,
    }
}

pub fn http_status_for(code: Code) -> StatusCode {
    match code {
        Code::Ok => StatusCode::OK,
        Code::InvalidArgument | Code::OutOfRange | Code::FailedPrecondition => StatusCode::BAD_REQUEST,
        Code::Unauthenticated => StatusCode::UNAUTHORIZED,
        Code::PermissionDenied => StatusCode::FORBIDDEN,
        Code::NotFound => StatusCode::NOT_FOUND,
        Code::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
        Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
        Code::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
        Code::Cancelled => StatusCode::from_u16(499).unwrap_or(StatusCode::BAD_REQUEST),
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

fn openai_type(status: StatusCode) -> &'static str {
    match status.as_u16() {
        400 | 408 | 413 => "invalid_request_error",
        401 => "authentication_error",
        404 => "not_found_error",
        429 => "rate_limit_error",
        503 | 504 => "service_unavailable",
        _ => "server_error",
    }
}

/// OpenAI's error body: {"error": {"message", "type", "param", "code"}}.
pub fn openai_error_body(status: StatusCode, message: &str) -> serde_json::Value {
    json!({"error": {"message": message, "type": openai_type(status), "param": null, "code": status.as_u16()}})
}

impl From<SidecarError> for tonic::Status {
    fn from(error: SidecarError) -> Self {
        match error {
            SidecarError::Upstream(status) => tonic::Status::new(upstream_code(&status), status.message()),
            SidecarError::RateLimited(_, ref refusal) => {
                let mut metadata = tonic::metadata::MetadataMap::new();
                for (name, value) in rate_limit_headers(refusal) {
                    if let Ok(value) = value.parse() {
                        metadata.insert(name, value);
                    }
                }
                tonic::Status::with_metadata(error.code(), error.to_string(), metadata)
            }
            other => tonic::Status::new(other.code(), other.to_string()),
        }
    }
}

/// Retry-After in whole seconds (at least one), then OpenAI's x-ratelimit-* headers.
fn rate_limit_headers(refusal: &Refusal) -> impl Iterator<Item = (&'static str, String)> + '_ {
    let after = (refusal.retry_after.as_secs_f64().ceil() as u64).max(1);
    std::iter::once(("retry-after", after.to_string())).chain(refusal.headers.iter().cloned())
}

/// The gRPC status's name, as metric labels and logs spell it.
pub fn code_name(code: tonic::Code) -> &'static str {
    use tonic::Code::*;
    match code {
        Ok => "OK",
        Cancelled => "CANCELLED",
        Unknown => "UNKNOWN",
        InvalidArgument => "INVALID_ARGUMENT",
        DeadlineExceeded => "DEADLINE_EXCEEDED",
        NotFound => "NOT_FOUND",
        AlreadyExists => "ALREADY_EXISTS",
        PermissionDenied => "PERMISSION_DENIED",
        ResourceExhausted => "RESOURCE_EXHAUSTED",
        FailedPrecondition => "FAILED_PRECONDITION",
        Aborted => "ABORTED",
        OutOfRange => "OUT_OF_RANGE",
        Unimplemented => "UNIMPLEMENTED",
        Internal => "INTERNAL",
        Unavailable => "UNAVAILABLE",
        DataLoss => "DATA_LOSS",
        Unauthenticated => "UNAUTHENTICATED",
    }
}

impl IntoResponse for SidecarError {
    fn into_response(self) -> Response {
        let status = self.http_status();
        let mut response = (status, Json(openai_error_body(status, &self.to_string()))).into_response();
        if let Self::RateLimited(_, refusal) = &self {
            for (name, value) in rate_limit_headers(refusal) {
                if let Ok(value) = value.parse() {
                    response.headers_mut().insert(name, value);
                }
            }
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_design_status_has_its_http_code() {
        for (code, http) in [
            (Code::InvalidArgument, 400),
            (Code::Unauthenticated, 401),
            (Code::NotFound, 404),
            (Code::ResourceExhausted, 429),
            (Code::Unavailable, 503),
            (Code::DeadlineExceeded, 504),
            (Code::Internal, 500),
        ] {
            assert_eq!(http_status_for(code).as_u16(), http, "{code:?}");
        }
        assert_eq!(SidecarError::TooLarge(10).http_status(), StatusCode::PAYLOAD_TOO_LARGE);
    }

    #[test]
    fn a_worker_that_vanished_is_unavailable_and_worker_statuses_pass_through() {
        let vanished = tonic::Status::unknown("transport error: connection reset");
        assert_eq!(tonic::Status::from(SidecarError::Upstream(vanished)).code(), Code::Unavailable);
        let invalid = tonic::Status::invalid_argument("sampling.top_p must be in (0, 1]");
        let passed = tonic::Status::from(SidecarError::Upstream(invalid));
        assert_eq!(passed.code(), Code::InvalidArgument);
        assert_eq!(passed.message(), "sampling.top_p must be in (0, 1]");
        assert_eq!(tonic::Status::from(SidecarError::ModelNotFound("x".into())).code(), Code::NotFound);
    }

    #[test]
    fn openai_error_shape() {
        let body = openai_error_body(StatusCode::TOO_MANY_REQUESTS, "busy");
        assert_eq!(body["error"]["message"], "busy");
        assert_eq!(body["error"]["type"], "rate_limit_error");
        assert_eq!(body["error"]["code"], 429);
    }
}
