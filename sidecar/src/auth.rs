//! Optional API keys, compared in constant time, on gRPC metadata and HTTP Bearer headers. A key
//! may have a name: the caller's tenant (for the worker's fair sharing, when no fairness header
//! names one) and what its rate limits are kept under.

use std::sync::Arc;

use subtle::{ConditionallySelectable, ConstantTimeEq};

use crate::proto::PredictRequest;

/// A key and its name, if it has one.
#[derive(Clone, Debug, PartialEq)]
pub struct Key {
    pub name: Option<String>,
    pub secret: String,
}

impl Key {
    /// A keys-file line: `KEY`, or `NAME KEY` (whitespace between; keys hold none).
    pub fn parse(line: &str) -> Self {
        match line.split_once(char::is_whitespace) {
            Some((name, secret)) => Self { name: Some(name.to_owned()), secret: secret.trim().to_owned() },
            None => Self { name: None, secret: line.to_owned() },
        }
    }
}

/// The Gateway API Inference Extension's fairness key: forwarded to the worker in
/// PredictRequest.metadata under the same name, where its TaskScheduler reads the tenant.
pub const FAIRNESS_HEADER: &str = "x-gateway-inference-fairness-id";

/// Who called, once the key checked out: request extensions carry it to the handlers.
#[derive(Clone, Debug, Default)]
pub struct Caller {
    pub key_name: Option<String>,
}

impl Caller {
    /// The tenant the worker shares its slots by: the fairness header's, else the key's name.
    pub fn tenant(&self, fairness: Option<String>) -> Option<String> {
        fairness.filter(|t| !t.is_empty()).or_else(|| self.key_name.clone())
    }

    /// Whose rate limits a request counts against: the key's name (which a client cannot choose),
    /// else the tenant the request names, else `default`.
    pub fn budget_key(&self, request: &PredictRequest) -> String {
        self.key_name.clone()
            .or_else(|| request.metadata.get(FAIRNESS_HEADER).filter(|t| !t.is_empty()).cloned())
            .unwrap_or_else(|| "default".to_owned())
    }
}

#[derive(Clone, Default)]
pub struct ApiKeys {
    keys: Arc<Vec<Key>>,
}

impl ApiKeys {
    pub fn new(keys: Vec<Key>) -> Self {
        Self { keys: Arc::new(keys) }
    }

    #[cfg(test)]
    pub fn plain(keys: &[&str]) -> Self {
        Self::new(keys.iter().map(|k| Key::parse(k)).collect())
    }

    pub fn enabled(&self) -> bool {
        !self.keys.is_empty()
    }

    /// The caller when auth is off or the presented value matches a key; None otherwise. Every key
    /// is compared, so the time taken does not depend on which key matched.
    pub fn check(&self, presented: Option<&[u8]>) -> Option<Caller> {
        if !self.enabled() {
            return Some(Caller::default());
        }
        let presented = presented?;
        let (mut found, mut index) = (subtle::Choice::from(0), 0u32);
        for (i, key) in self.keys.iter().enumerate() {
            let matched = key.secret.as_bytes().ct_eq(presented);
            index = u32::conditional_select(&index, &(i as u32), matched);
            found |= matched;
        }
        bool::from(found).then(|| Caller { key_name: self.keys[index as usize].name.clone() })
    }

    /// Checks an `authorization: Bearer KEY` value (or a bare `x-api-key` value).
    pub fn check_header(&self, authorization: Option<&[u8]>, api_key: Option<&[u8]>) -> Option<Caller> {
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
        assert!(ApiKeys::default().check_header(None, None).is_some());
    }

    #[test]
    fn bearer_and_api_key_headers() {
        let keys = ApiKeys::plain(&["k1", "secret-2"]);
        assert!(keys.check_header(Some(b"Bearer secret-2"), None).is_some());
        assert!(keys.check_header(None, Some(b"k1")).is_some());
        assert!(keys.check_header(Some(b"Bearer secret-3"), None).is_none());
        assert!(keys.check_header(Some(b"secret-2"), None).is_none(), "the Bearer scheme is required");
        assert!(keys.check_header(None, None).is_none());
        assert!(keys.check(Some(b"")).is_none());
    }

    #[test]
    fn a_named_key_names_its_caller() {
        let keys = ApiKeys::new(["team-a  sk-aaa", "sk-bare", "team-b\tsk-bbb"].into_iter().map(Key::parse).collect());
        let name = |k: &[u8]| keys.check(Some(k)).map(|c| c.key_name);
        assert_eq!(name(b"sk-aaa"), Some(Some("team-a".into())));
        assert_eq!(name(b"sk-bbb"), Some(Some("team-b".into())));
        assert_eq!(name(b"sk-bare"), Some(None));
        assert_eq!(name(b"team-a"), None, "a name is not a key");
    }
}
