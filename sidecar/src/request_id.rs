//! The request id: a gateway's `x-request-id` (HTTP header or gRPC metadata) is the request's id
//! everywhere — the worker's and the sidecar's logs, the OpenAI response's `id`, the response's own
//! `x-request-id` — and one is made when a request comes without.

use axum::extract::Request;
use axum::http::{HeaderMap, HeaderValue};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use tonic::metadata::MetadataMap;

use crate::error::SidecarError;

pub const HEADER: &str = "x-request-id";

/// The worker takes 1-128 of these characters; n > 1 appends "-INDEX" to each choice's id, so a
/// given id may be at most 120 long.
const MAX_LEN: usize = 120;

/// The given id when it is well formed; a new one, `prefix` and a UUID, when none is given.
pub fn take(given: Option<&[u8]>, prefix: &str) -> Result<String, SidecarError> {
    let Some(given) = given else {
        return Ok(format!("{prefix}{}", uuid::Uuid::new_v4().simple()));
    };
    let good = |b: &u8| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b':' | b'-');
    if given.is_empty() || given.len() > MAX_LEN || !given.iter().all(good) {
        return Err(SidecarError::InvalidRequest(format!("{HEADER}: 1-{MAX_LEN} characters of letters, digits and ._:-")));
    }
    Ok(String::from_utf8_lossy(given).into_owned())
}

/// HTTP: the id into the request's headers (for the handler) and onto the response, errors too.
pub async fn layer(mut request: Request, next: Next) -> Response {
    let prefix = if request.uri().path() == "/v1/chat/completions" { "chatcmpl-" } else { "cmpl-" };
    let id = match take(request.headers().get(HEADER).map(HeaderValue::as_bytes), prefix) {
        Ok(id) => id,
        Err(error) => return error.into_response(),
    };
    let value = HeaderValue::from_str(&id).expect("checked characters");
    request.headers_mut().insert(HEADER, value.clone());
    let mut response = next.run(request).await;
    response.headers_mut().insert(HEADER, value);
    response
}

/// The id `layer` put in an HTTP request's headers.
pub fn of(headers: &HeaderMap) -> String {
    headers.get(HEADER).and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned()
}

/// gRPC: the request's own `request_id` first, then the metadata's, else a new one.
pub fn of_grpc(field: &str, metadata: &MetadataMap) -> Result<String, SidecarError> {
    if !field.is_empty() {
        return Ok(field.to_owned());
    }
    take(metadata.get(HEADER).map(|v| v.as_bytes()), "")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_given_id_is_kept_a_missing_one_made_a_bad_one_refused() {
        assert_eq!(take(Some(b"gw-123.a:b_c"), "cmpl-").unwrap(), "gw-123.a:b_c");
        let made = take(None, "cmpl-").unwrap();
        assert!(made.starts_with("cmpl-") && made.len() == 37, "{made}");
        for bad in [&b""[..], b"has space", b"\xff", &[b'a'; 121]] {
            assert!(take(Some(bad), "").is_err(), "{bad:?}");
        }
        let mut metadata = MetadataMap::new();
        metadata.insert(HEADER, "from-metadata".parse().unwrap());
        assert_eq!(of_grpc("", &metadata).unwrap(), "from-metadata");
        assert_eq!(of_grpc("in-the-request", &metadata).unwrap(), "in-the-request");
        assert_eq!(of_grpc("", &MetadataMap::new()).unwrap().len(), 32);
    }
}
