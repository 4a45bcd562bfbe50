//! Token budgets per caller: requests a second and tokens a minute, from a JSON file reloaded on
//! change. A request is admitted against an estimate of its tokens, which is held while it runs;
//! when its stream ends, the hold is given back and what it used (the worker's usage) is charged,
//! as Envoy AI Gateway bills after the response. Refusals are RESOURCE_EXHAUSTED / 429 with
//! Retry-After and OpenAI's x-ratelimit-* headers.
//! The limits themselves come from limits_file.rs.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use crate::error::SidecarError;
use crate::limits_file::{Limit, LimitsFile};
use crate::proto::predict_request::Input;
use crate::proto::{PredictRequest, PredictResponse};

/// max_tokens the estimate assumes when a request sets none: the worker's sampling.max_tokens default.
const DEFAULT_MAX_TOKENS: u64 = 512;
/// Prompt text bytes per token for the estimate (the usual ~4 for English BPE vocabularies); the
/// charge itself is the worker's exact count.
const BYTES_PER_TOKEN: u64 = 4;
const RELOAD_CHECK: Duration = Duration::from_secs(1);

/// A token bucket: `level` of `capacity`, refilled at `rate` a second. The tokens bucket may go
/// below zero when a request used more than its estimate; it then refuses until refilled.
#[derive(Debug)]
struct Bucket {
    level: f64,
    at: Instant,
}

impl Bucket {
    fn refill(&mut self, capacity: f64, rate: f64, now: Instant) -> f64 {
        self.level = (self.level + rate * (now - self.at).as_secs_f64()).min(capacity);
        self.at = now;
        self.level
    }
}

#[derive(Debug)]
struct Buckets {
    requests: Bucket,
    tokens: Bucket,
    /// Tokens held for requests still running.
    held: f64,
}

struct State {
    file: LimitsFile,
    modified: Option<SystemTime>,
    buckets: HashMap<String, Buckets>,
    /// The buckets' holds summed (the held-tokens gauge), kept as they change.
    held: f64,
}

/// One refusal's figures: what the headers and the message say.
#[derive(Clone, Debug, PartialEq)]
pub struct Refusal {
    pub limit: &'static str,
    pub retry_after: Duration,
    pub headers: Vec<(&'static str, String)>,
}

pub struct RateLimits {
    path: Option<PathBuf>,
    state: Mutex<State>,
}

impl RateLimits {
    /// Reads the file once (an unreadable or invalid file stops the start); None: no limits.
    pub fn load(path: Option<PathBuf>) -> anyhow::Result<Arc<Self>> {
        let (file, modified) = match &path {
            Some(path) => LimitsFile::read(path).map_err(|e| anyhow::anyhow!("--rate-limits-file {}: {e}", path.display()))?,
            None => (LimitsFile::default(), None),
        };
        Ok(Arc::new(Self { path, state: Mutex::new(State { file, modified, buckets: HashMap::new(), held: 0.0 }) }))
    }

    #[cfg(test)]
    pub fn from_file(file: LimitsFile) -> Arc<Self> {
        Arc::new(Self { path: None, state: Mutex::new(State { file, modified: None, buckets: HashMap::new(), held: 0.0 }) })
    }

    /// Admits one request of `n` choices for `caller`, or says why not. Each returned charge goes
    /// with one choice's stream and settles when it is dropped.
    pub fn admit(self: &Arc<Self>, caller: &str, request: &PredictRequest, n: u32) -> Result<Admission, SidecarError> {
        let now = Instant::now();
        let mut state = self.state.lock().unwrap();
        let limit = state.file.limit_of(caller);
        if limit == Limit::default() {
            return Ok(Admission { headers: Vec::new(), charges: (0..n).map(|_| Charge::free()).collect() });
        }
        let prompt = prompt_estimate(request);
        let completion = request.sampling.as_ref().and_then(|s| s.max_tokens).map_or(DEFAULT_MAX_TOKENS, u64::from);
        let (requests_cap, requests_rate) = limit.requests_bucket();
        let (tokens_cap, tokens_rate) = limit.tokens_bucket();
        // Capped at the bucket, so that a request larger than a whole minute's budget can still run
        // (on an otherwise full bucket).
        let estimate = (((prompt + completion) * u64::from(n)) as f64).min(tokens_cap);
        let buckets = state.buckets.entry(caller.to_owned()).or_insert_with(|| Buckets {
            requests: Bucket { level: requests_cap, at: now },
            tokens: Bucket { level: tokens_cap, at: now },
            held: 0.0,
        });
        let requests = buckets.requests.refill(requests_cap, requests_rate, now);
        let tokens = buckets.tokens.refill(tokens_cap, tokens_rate, now) - buckets.held;
        let refusal = if requests < 1.0 {
            Some(("requests", (1.0 - requests) / requests_rate))
        } else if tokens < estimate {
            Some(("tokens", (estimate - tokens) / tokens_rate))
        } else {
            None
        };
        if let Some((which, wait)) = refusal {
            let headers = limit.headers(requests, tokens);
            metrics::counter!("cyllm_sidecar_rate_limited_total", "tenant" => state.file.label(caller), "limit" => which)
                .increment(1);
            let retry_after = Duration::from_secs_f64(wait.clamp(0.0, 86_400.0));
            return Err(SidecarError::RateLimited(caller.to_owned(), Refusal { limit: which, retry_after, headers }));
        }
        buckets.requests.level -= 1.0;
        buckets.held += estimate;
        state.held += estimate;
        metrics::gauge!("cyllm_sidecar_rate_limit_held_tokens").set(state.held);
        let headers = limit.headers(requests - 1.0, tokens - estimate);
        let each = estimate / f64::from(n.max(1));
        let charges = (0..n)
            .map(|_| Charge { limits: Some(self.clone()), caller: caller.to_owned(), held: each, prompt, messages: 0, used: None })
            .collect();
        Ok(Admission { headers, charges })
    }

    /// Rereads the file when its modification time changes; a file that no longer parses keeps
    /// the limits in force (logged and counted). Buckets at rest (full, nothing held) are dropped.
    pub async fn watch(self: Arc<Self>) {
        let Some(path) = self.path.clone() else { return };
        let mut ticker = tokio::time::interval(RELOAD_CHECK);
        loop {
            ticker.tick().await;
            let modified = std::fs::metadata(&path).and_then(|m| m.modified()).ok();
            let mut state = self.state.lock().unwrap();
            if modified != state.modified {
                state.modified = modified;
                match LimitsFile::read(&path) {
                    Ok((file, _)) => {
                        tracing::info!(path = %path.display(), tenants = file.tenants.len(), "rate limits reloaded");
                        metrics::counter!("cyllm_sidecar_rate_limit_reloads_total", "result" => "ok").increment(1);
                        state.file = file;
                    }
                    Err(error) => {
                        tracing::warn!(path = %path.display(), %error, "rate limits file not reloaded; the previous limits stay");
                        metrics::counter!("cyllm_sidecar_rate_limit_reloads_total", "result" => "error").increment(1);
                    }
                }
            }
            let now = Instant::now();
            let State { file, buckets, .. } = &mut *state;
            buckets.retain(|caller, b| {
                let limit = file.limit_of(caller);
                let ((rc, rr), (tc, tr)) = (limit.requests_bucket(), limit.tokens_bucket());
                b.held > 0.0 || b.requests.refill(rc, rr, now) < rc || b.tokens.refill(tc, tr, now) < tc
            });
        }
    }

    fn settle(&self, caller: &str, held: f64, used: f64) {
        let mut state = self.state.lock().unwrap();
        let label = state.file.label(caller);
        let State { buckets, held: total, .. } = &mut *state;
        if let Some(buckets) = buckets.get_mut(caller) {
            // A hold split over n choices may not sum back exactly: what is left under a
            // thousandth of a token is none.
            let left = if buckets.held - held < 1e-3 { 0.0 } else { buckets.held - held };
            *total -= buckets.held - left;
            buckets.held = left;
            buckets.tokens.level -= used;
        }
        if *total < 1e-3 {
            *total = 0.0;
        }
        metrics::gauge!("cyllm_sidecar_rate_limit_held_tokens").set(*total);
        metrics::counter!("cyllm_sidecar_tenant_tokens_total", "tenant" => label).increment(used as u64);
    }

    #[cfg(test)]
    fn held(&self, caller: &str) -> f64 {
        self.state.lock().unwrap().buckets.get(caller).map_or(0.0, |b| b.held)
    }
}

pub struct Admission {
    /// OpenAI's x-ratelimit-* headers after this admission; none for a caller without limits.
    pub headers: Vec<(&'static str, String)>,
    pub charges: Vec<Charge>,
}

/// One stream's hold on its caller's tokens: dropped when the stream ends (any way it ends), it
/// gives the hold back and charges the worker's usage; a stream cut off before its usage came is
/// charged its prompt estimate and a token per message received, and one that never got a
/// message is charged nothing.
pub struct Charge {
    limits: Option<Arc<RateLimits>>,
    caller: String,
    held: f64,
    prompt: u64,
    messages: u64,
    used: Option<u64>,
}

impl Charge {
    pub fn free() -> Self {
        Self { limits: None, caller: String::new(), held: 0.0, prompt: 0, messages: 0, used: None }
    }

    pub fn observe(&mut self, message: &PredictResponse) {
        self.messages += 1;
        if let Some(usage) = &message.usage {
            self.used = Some(u64::from(usage.prompt_tokens) + u64::from(usage.completion_tokens));
        }
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        if let Some(limits) = self.limits.take() {
            let used = self.used.unwrap_or(if self.messages > 0 { self.prompt + self.messages } else { 0 });
            limits.settle(&self.caller, self.held, used as f64);
        }
    }
}

fn prompt_estimate(request: &PredictRequest) -> u64 {
    let bytes = match &request.input {
        Some(Input::Prompt(prompt)) => prompt.len(),
        Some(Input::Chat(chat)) => chat.messages.iter().map(|m| m.content.len() + m.role.len()).sum(),
        Some(Input::TokenIds(ids)) => return ids.ids.len() as u64,
        None => 0,
    } as u64;
    bytes.div_ceil(BYTES_PER_TOKEN)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::{SamplingParams, Usage};

    fn request(prompt_bytes: usize, max_tokens: u32) -> PredictRequest {
        PredictRequest {
            input: Some(Input::Prompt("x".repeat(prompt_bytes))),
            sampling: Some(SamplingParams { max_tokens: Some(max_tokens), ..Default::default() }),
            ..Default::default()
        }
    }

    fn limits(default: Limit, tenants: &[(&str, Limit)]) -> Arc<RateLimits> {
        RateLimits::from_file(LimitsFile { default, tenants: tenants.iter().map(|(n, l)| (n.to_string(), *l)).collect() })
    }

    fn finished(prompt: u32, completion: u32) -> PredictResponse {
        PredictResponse { usage: Some(Usage { prompt_tokens: prompt, completion_tokens: completion }), ..Default::default() }
    }

    #[test]
    fn requests_per_second_refuse_with_retry_after_then_refill() {
        let limits = limits(Limit { requests_per_s: Some(2.0), tokens_per_min: None }, &[]);
        let first = limits.admit("a", &request(8, 4), 1).unwrap();
        assert!(first.headers.contains(&("x-ratelimit-remaining-requests", "1".into())), "{:?}", first.headers);
        limits.admit("a", &request(8, 4), 1).unwrap();
        let SidecarError::RateLimited(caller, refusal) = limits.admit("a", &request(8, 4), 1).err().unwrap() else { panic!() };
        assert_eq!((caller.as_str(), refusal.limit), ("a", "requests"));
        assert!(refusal.retry_after > Duration::from_millis(400) && refusal.retry_after <= Duration::from_millis(500));
        limits.admit("b", &request(8, 4), 1).expect("each caller has a bucket of its own");
        // Refilled at 2 a second: one more request after half a second.
        let at = Instant::now();
        let mut bucket = Bucket { level: 0.0, at };
        assert!(bucket.refill(2.0, 2.0, at + Duration::from_millis(520)) >= 1.0, "refilled at 2 a second");
        assert_eq!(bucket.refill(2.0, 2.0, at + Duration::from_secs(5)), 2.0, "up to one second's requests");
    }

    #[test]
    fn tokens_are_held_while_running_and_the_usage_is_charged_after() {
        let limits = limits(Limit::default(), &[("team", Limit { requests_per_s: None, tokens_per_min: Some(1000.0) })]);
        // 400 bytes ~ 100 prompt tokens + 300 max_tokens: 400 held.
        let mut running = limits.admit("team", &request(400, 300), 1).unwrap();
        assert_eq!(limits.held("team"), 400.0);
        assert!(running.headers.contains(&("x-ratelimit-remaining-tokens", "600".into())), "{:?}", running.headers);
        let SidecarError::RateLimited(_, refusal) = limits.admit("team", &request(400, 300), 2).err().unwrap() else { panic!() };
        assert_eq!(refusal.limit, "tokens");
        assert!(refusal.retry_after.as_secs_f64() > 10.0, "200 tokens at 1000/min: {:?}", refusal.retry_after);
        let mut charge = running.charges.pop().unwrap();
        charge.observe(&finished(90, 10));
        drop(charge);
        assert_eq!(limits.held("team"), 0.0, "the hold is given back");
        let after = limits.admit("team", &request(4, 1), 1).unwrap();
        let remaining: f64 = after.headers.iter().find(|(k, _)| *k == "x-ratelimit-remaining-tokens").unwrap().1.parse().unwrap();
        assert!((898.0..=900.0).contains(&remaining), "charged the usage (100), not the estimate: {remaining}");
        assert_eq!(limits.admit("nobody", &request(4, 1), 1).unwrap().headers, vec![], "no limits for others");
    }

    #[test]
    fn a_stream_cut_short_is_charged_what_it_got_and_one_never_answered_nothing() {
        let limits = limits(Limit { requests_per_s: None, tokens_per_min: Some(6000.0) }, &[]);
        let mut cut = limits.admit("c", &request(40, 100), 2).unwrap();
        assert_eq!(cut.charges.len(), 2);
        let mut first = cut.charges.pop().unwrap();
        for _ in 0..3 {
            first.observe(&PredictResponse::default());
        }
        drop(first);
        drop(cut);
        assert_eq!(limits.held("c"), 0.0);
        let remaining = |a: &Admission| -> f64 {
            a.headers.iter().find(|(k, _)| *k == "x-ratelimit-remaining-tokens").unwrap().1.parse().unwrap()
        };
        let probe = limits.admit("c", &request(0, 0), 1).unwrap();
        // 6000 - (10 prompt + 3 messages); refill over the test's milliseconds is well under one token.
        assert!((5986.0..=5988.0).contains(&remaining(&probe)), "{}", remaining(&probe));
    }

    #[test]
    fn an_estimate_above_a_minute_s_budget_still_runs_on_a_full_bucket() {
        let limits = limits(Limit { requests_per_s: None, tokens_per_min: Some(100.0) }, &[]);
        let big = limits.admit("d", &request(4000, 4000), 1).expect("capped at the bucket");
        assert!(limits.admit("d", &request(4, 1), 1).is_err(), "the whole budget is held");
        drop(big);
    }
}
