//! Optional API keys, compared in constant time, on gRPC metadata and HTTP Bearer headers.

use std::sync::Arc;

use subtle::ConstantTimeEq;

#[derive(Clone, Default)]
pub struct ApiKeys {
    keys: Arc<Vec<Vec<u8>>>,
}

impl ApiKeys {
    pub fn new(keys: Vec<String>) -> Self {
        Self { keys: Arc::new(keys.into_iter().map(String::into_bytes).collect()) }
    }

    pub fn enabled(&self) -> bool {
        !self.keys.is_empty()
    }

    /// True when auth is off, or the presented value matches a key. Every key is compared, so
    /// the time taken does not depend on which key matched.
    pub fn check(&self, presented: Option<&[u8]>) -> bool {
        if !self.enabled() {
            return true;
        }
        let Some(presented) = presented else { return false };
        self.keys.iter().fold(subtle::Choice::from(0), |found, key| found | key.as_slice().ct_eq(presented)).into()
    }

    /// Checks an `authorization: Bearer KEY` value (or a bare `x-api-key` value).
    pub fn check_header(&self, authorization: Option<&[u8]>, api_key: Option<&[u8]>) -> bool {
        let bearer = authorization.and_then(|value| {
            value.strip_prefix(b"Bearer ").or_else(|| value.strip_prefix(b"bearer "))
        });
        self.check(bearer.or(api_key))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn off_without_keys() {
        assert!(ApiKeys::new(vec![]).check_header(None, None));
    }

    #[test]
    fn bearer_and_api_key_headers() {
        let keys = ApiKeys::new(vec!["k1".into(), "secret-2".into()]);
        assert!(keys.check_header(Some(b"Bearer secret-2"), None));
        assert!(keys.check_header(None, Some(b"k1")));
        assert!(!keys.check_header(Some(b"Bearer secret-3"), None));
        assert!(!keys.check_header(Some(b"secret-2"), None), "the Bearer scheme is required");
        assert!(!keys.check_header(None, None));
        assert!(!keys.check(Some(b"")));
    }
}
