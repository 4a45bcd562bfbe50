//! Token budgets per caller: requests a second and tokens a minute, from a JSON file reloaded on
//! change. A request is admitted against an estimate of its tokens, which is held while it runs;
//! when its stream ends, the hold is given back and what it used (the worker's usage) is charged,
//! as Envoy AI Gateway bills after the response. Refusals are RESOURCE_EXHAUSTED / 429 with
//! Retry-After and OpenAI's x-ratelimit-* headers.
//!
//! The file: {"default": {"requests_per_s": 5, "tokens_per_min": 20000},
//!            "tenants": {"team-a": {"requests_per_s": 50, "tokens_per_min": 400000}}}
//! A caller named under "tenants" has its own limits; every other caller has "default"'s, each in a
//! bucket of its own. A limit left out is no limit.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use serde::Deserialize;

use crate::error::SidecarError;
use crate::proto::predict_request::Input;
use crate::proto::{PredictRequest, PredictResponse};

/// max_tokens the estimate assumes when a request sets none: the worker's sampling.max_tokens default.
const DEFAULT_MAX_TOKENS: u64 = 512;
/// Prompt text bytes per token for the estimate (the usual ~4 for English BPE vocabularies); the
/// charge itself is the worker's exact count.
const BYTES_PER_TOKEN: u64 = 4;
const RELOAD_CHECK: Duration = Duration::from_secs(1);

#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Limit {
    pub requests_per_s: Option<f64>,
    pub tokens_per_min: Option<f64>,
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
}

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
            Some(path) => read(path).map_err(|e| anyhow::anyhow!("--rate-limits-file {}: {e}", path.display()))?,
            None => (LimitsFile::default(), None),
        };
        Ok(Arc::new(Self { path, state: Mutex::new(State { file, modified, buckets: HashMap::new() }) }))
    }

    #[cfg(test)]
    pub fn from_file(file: LimitsFile) -> Arc<Self> {
        Arc::new(Self { path: None, state: Mutex::new(State { file, modified: None, buckets: HashMap::new() }) })
    }

    /// Admits one request of `n` choices for `caller`, or says why not. Each returned charge goes
    /// with one choice's stream and settles when it is dropped.
    pub fn admit(self: &Arc<Self>, caller: &str, request: &PredictRequest, n: u32) -> Result<Admission, SidecarError> {
        let now = Instant::now();
        let mut state = self.state.lock().unwrap();
        let limit = limit_of(&state.file, caller);
        if limit == Limit::default() {
            return Ok(Admission { headers: Vec::new(), charges: (0..n).map(|_| Charge::free()).collect() });
        }
        let prompt = prompt_estimate(request);
        let completion = request.sampling.as_ref().and_then(|s| s.max_tokens).map_or(DEFAULT_MAX_TOKENS, u64::from);
        let (requests_cap, requests_rate) = requests_bucket(&limit);
        let (tokens_cap, tokens_rate) = tokens_bucket(&limit);
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
            let headers = headers(&limit, requests, tokens);
            metrics::counter!("cyllm_sidecar_rate_limited_total", "tenant" => label(&state.file, caller), "limit" => which)
                .increment(1);
            let retry_after = Duration::from_secs_f64(wait.clamp(0.0, 86_400.0));
            return Err(SidecarError::RateLimited(caller.to_owned(), Refusal { limit: which, retry_after, headers }));
        }
        buckets.requests.level -= 1.0;
        buckets.held += estimate;
        report_held(&state.buckets);
        let headers = headers(&limit, requests - 1.0, tokens - estimate);
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
                match read(&path) {
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
                let limit = limit_of(file, caller);
                let (rc, rr) = requests_bucket(&limit);
                let (tc, tr) = tokens_bucket(&limit);
                b.held > 0.0 || b.requests.refill(rc, rr, now) < rc || b.tokens.refill(tc, tr, now) < tc
            });
        }
    }

    fn settle(&self, caller: &str, held: f64, used: f64) {
        let mut state = self.state.lock().unwrap();
        let label = label(&state.file, caller);
        if let Some(buckets) = state.buckets.get_mut(caller) {
            // A hold split over n choices may not sum back exactly: what is left under a token is none.
            buckets.held = if buckets.held - held < 1e-3 { 0.0 } else { buckets.held - held };
            buckets.tokens.level -= used;
        }
        report_held(&state.buckets);
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

fn report_held(buckets: &HashMap<String, Buckets>) {
    metrics::gauge!("cyllm_sidecar_rate_limit_held_tokens").set(buckets.values().map(|b| b.held).sum::<f64>());
}

fn read(path: &std::path::Path) -> anyhow::Result<(LimitsFile, Option<SystemTime>)> {
    let modified = std::fs::metadata(path).and_then(|m| m.modified()).ok();
    Ok((LimitsFile::parse(&std::fs::read_to_string(path)?)?, modified))
}

fn limit_of(file: &LimitsFile, caller: &str) -> Limit {
    file.tenants.get(caller).copied().unwrap_or(file.default)
}

/// A burst of one second's requests (at least one); unlimited is an always-full bucket.
fn requests_bucket(limit: &Limit) -> (f64, f64) {
    limit.requests_per_s.map_or((f64::INFINITY, f64::INFINITY), |r| (r.max(1.0), r))
}

/// A burst of one minute's tokens.
fn tokens_bucket(limit: &Limit) -> (f64, f64) {
    limit.tokens_per_min.map_or((f64::INFINITY, f64::INFINITY), |t| (t, t / 60.0))
}

/// Callers named in the file by name; everyone else (unbounded names from headers) as `other`.
fn label(file: &LimitsFile, caller: &str) -> String {
    if file.tenants.contains_key(caller) { caller.to_owned() } else { "other".to_owned() }
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

/// OpenAI's headers: limit, remaining, and time until the bucket is full again, per limit set.
fn headers(limit: &Limit, requests: f64, tokens: f64) -> Vec<(&'static str, String)> {
    let per_limit = [
        (limit.requests_per_s, requests_bucket(limit), requests,
         ["x-ratelimit-limit-requests", "x-ratelimit-remaining-requests", "x-ratelimit-reset-requests"]),
        (limit.tokens_per_min, tokens_bucket(limit), tokens,
         ["x-ratelimit-limit-tokens", "x-ratelimit-remaining-tokens", "x-ratelimit-reset-tokens"]),
    ];
    let set = per_limit.into_iter().filter(|(value, ..)| value.is_some());
    set.flat_map(|(_, (cap, rate), left, [limit, remaining, reset])| {
        [(limit, format!("{}", cap.floor())), (remaining, format!("{}", left.max(0.0).floor())),
         (reset, duration_text((cap - left).max(0.0) / rate))]
    })
    .collect()
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
        std::thread::sleep(Duration::from_millis(520));
        limits.admit("a", &request(8, 4), 1).expect("refilled at 2 a second");
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

    #[test]
    fn the_file_is_checked() {
        assert!(LimitsFile::parse(r#"{"default": {"requests_per_s": 0}}"#).is_err());
        assert!(LimitsFile::parse(r#"{"default": {"request_per_s": 3}}"#).is_err(), "unknown keys are refused");
        let file = LimitsFile::parse(r#"{"tenants": {"a": {"tokens_per_min": 10}}}"#).unwrap();
        assert_eq!(file.tenants["a"].tokens_per_min, Some(10.0));
        assert_eq!(file.default, Limit::default());
    }

    #[test]
    fn durations_read_like_openai_s() {
        assert_eq!(duration_text(0.02), "20ms");
        assert_eq!(duration_text(1.5), "1.5s");
        assert_eq!(duration_text(360.0), "6m0s");
    }
}
