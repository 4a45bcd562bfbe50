//! The rate limits file (--rate-limits-file), as JSON:
//!
//!     {"default": {"requests_per_s": 5, "tokens_per_min": 20000},
//!      "tenants": {"team-a": {"requests_per_s": 50, "tokens_per_min": 400000}}}
//!
//! A caller named under "tenants" has its own limits; every other caller has "default"'s, each in a
//! bucket of its own (ratelimit.rs). A limit left out is no limit.

use std::collections::HashMap;
use std::path::Path;
use std::time::SystemTime;

use serde::Deserialize;

#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Limit {
    pub requests_per_s: Option<f64>,
    pub tokens_per_min: Option<f64>,
}

impl Limit {
    /// (capacity, refill a second): a burst of one second's requests (at least one); unlimited is
    /// an always-full bucket.
    pub fn requests_bucket(&self) -> (f64, f64) {
        self.requests_per_s.map_or((f64::INFINITY, f64::INFINITY), |r| (r.max(1.0), r))
    }

    /// (capacity, refill a second): a burst of one minute's tokens.
    pub fn tokens_bucket(&self) -> (f64, f64) {
        self.tokens_per_min.map_or((f64::INFINITY, f64::INFINITY), |t| (t, t / 60.0))
    }

    /// OpenAI's headers for the buckets at `requests` and `tokens`: limit, remaining, and time
    /// until the bucket is full again, for each limit set.
    pub fn headers(&self, requests: f64, tokens: f64) -> Vec<(&'static str, String)> {
        let per_limit = [
            (self.requests_per_s, self.requests_bucket(), requests,
             ["x-ratelimit-limit-requests", "x-ratelimit-remaining-requests", "x-ratelimit-reset-requests"]),
            (self.tokens_per_min, self.tokens_bucket(), tokens,
             ["x-ratelimit-limit-tokens", "x-ratelimit-remaining-tokens", "x-ratelimit-reset-tokens"]),
        ];
        let set = per_limit.into_iter().filter(|(value, ..)| value.is_some());
        set.flat_map(|(_, (cap, rate), left, [limit, remaining, reset])| {
            [(limit, format!("{}", cap.floor())), (remaining, format!("{}", left.max(0.0).floor())),
             (reset, duration_text((cap - left).max(0.0) / rate))]
        })
        .collect()
    }
}

#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct LimitsFile {
    #[serde(default)]
    pub default: Limit,
    #[serde(default)]
    pub tenants: HashMap<String, Limit>,
}

impl LimitsFile {
    pub fn parse(text: &str) -> anyhow::Result<Self> {
        let file: Self = serde_json::from_str(text)?;
        for (name, limit) in std::iter::once(("default", &file.default)).chain(file.tenants.iter().map(|(n, l)| (n.as_str(), l))) {
            for value in [limit.requests_per_s, limit.tokens_per_min].into_iter().flatten() {
                anyhow::ensure!(value.is_finite() && value > 0.0, "{name}: limits must be positive numbers");
            }
        }
        Ok(file)
    }

    /// The file and its modification time, to notice the next change by.
    pub fn read(path: &Path) -> anyhow::Result<(Self, Option<SystemTime>)> {
        let modified = std::fs::metadata(path).and_then(|m| m.modified()).ok();
        Ok((Self::parse(&std::fs::read_to_string(path)?)?, modified))
    }

    pub fn limit_of(&self, caller: &str) -> Limit {
        self.tenants.get(caller).copied().unwrap_or(self.default)
    }

    /// Callers named in the file by name; everyone else (unbounded names from headers) as `other`.
    pub fn label(&self, caller: &str) -> String {
        if self.tenants.contains_key(caller) { caller.to_owned() } else { "other".to_owned() }
    }
}

/// OpenAI's duration form: "20ms", "1.5s", "6m0s".
pub fn duration_text(seconds: f64) -> String {
    if seconds < 1.0 {
        return format!("{}ms", (seconds * 1000.0).ceil() as u64);
    }
    let minutes = (seconds / 60.0).floor();
    let rest = ((seconds - minutes * 60.0) * 10.0).ceil() / 10.0;
    if minutes >= 1.0 { format!("{minutes}m{rest}s") } else { format!("{rest}s") }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_file_is_checked() {
        assert!(LimitsFile::parse(r#"{"default": {"requests_per_s": 0}}"#).is_err());
        assert!(LimitsFile::parse(r#"{"default": {"request_per_s": 3}}"#).is_err(), "unknown keys are refused");
        let file = LimitsFile::parse(r#"{"tenants": {"a": {"tokens_per_min": 10}}}"#).unwrap();
        assert_eq!(file.tenants["a"].tokens_per_min, Some(10.0));
        assert_eq!(file.default, Limit::default());
    }

    #[test]
    fn the_shipped_file_parses() {
        // What docker-compose.yml mounts and deploy/k8s/base makes its ConfigMap from.
        let file = LimitsFile::parse(include_str!("../../deploy/k8s/base/limits/rate-limits.json")).unwrap();
        assert!(file.default.requests_per_s.is_some() && file.default.tokens_per_min.is_some());
    }

    #[test]
    fn durations_read_like_openai_s() {
        assert_eq!(duration_text(0.02), "20ms");
        assert_eq!(duration_text(1.5), "1.5s");
        assert_eq!(duration_text(360.0), "6m0s");
    }
}
