//! Command-line flags, each also read from the environment (clap `env`).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, ValueEnum};

use crate::auth::Key;

#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum RoutingMode {
    /// Power of two random choices, the one with fewer outstanding requests wins.
    LeastOutstanding,
    /// Requests whose first `--prefix-bytes` bytes match go to the same worker (its prefix cache).
    PrefixAffinity,
    /// The worker whose prefix cache holds the longest prefix of the request (from the workers'
    /// CacheEvents), unless it is much busier than the others; else least outstanding.
    CacheAware,
}

/// OTEL_TRACES_SAMPLER's values (OpenTelemetry's SDK configuration names).
#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
#[value(rename_all = "snake_case")]
pub enum TraceSampler {
    /// The caller's decision when a `traceparent` came, else the ratio.
    ParentbasedTraceidratio,
    Traceidratio,
    ParentbasedAlwaysOn,
    AlwaysOn,
    ParentbasedAlwaysOff,
    AlwaysOff,
}

#[derive(Parser, Debug, Clone)]
#[command(name = "cy-llm-sidecar", version, about = "Gateway-facing sidecar for cy-llm workers")]
pub struct Args {
    /// Worker socket, e.g. unix:///run/cy-llm/w0.sock (repeat the flag, or comma-separate in env).
    #[arg(long = "worker", env = "CYLLM_SIDECAR_WORKERS", value_delimiter = ',', required_unless_present = "probe")]
    pub workers: Vec<String>,
    /// Probe a running sidecar instead of serving: GET this path (e.g. /readyz) on --http-addr,
    /// exit 0 on 200. For container HEALTHCHECKs, which have no curl.
    #[arg(long, value_name = "PATH")]
    pub probe: Option<String>,
    /// gRPC listener (InferenceService, health, reflection).
    #[arg(long, env = "CYLLM_SIDECAR_GRPC_ADDR", default_value = "0.0.0.0:50051")]
    pub grpc_addr: SocketAddr,
    /// OpenAI-compatible HTTP listener, with /healthz and /readyz.
    #[arg(long, env = "CYLLM_SIDECAR_HTTP_ADDR", default_value = "0.0.0.0:8080")]
    pub http_addr: SocketAddr,
    /// Prometheus /metrics listener: the sidecar's metrics and every worker's, labelled by worker.
    #[arg(long, env = "CYLLM_SIDECAR_METRICS_ADDR", default_value = "0.0.0.0:9090")]
    pub metrics_addr: SocketAddr,
    /// API keys (comma-separated). With none here or in --api-keys-file, auth is off.
    #[arg(long, env = "CYLLM_SIDECAR_API_KEYS", value_delimiter = ',', hide_env_values = true)]
    pub api_keys: Vec<String>,
    /// File with one API key per line, `KEY` or `NAME KEY` (# comments allowed). A named key's
    /// name is its caller's tenant and rate-limit bucket.
    #[arg(long, env = "CYLLM_SIDECAR_API_KEYS_FILE")]
    pub api_keys_file: Option<PathBuf>,
    /// Requests a second and tokens a minute per caller (JSON; see README); reread when it changes.
    #[arg(long, env = "CYLLM_SIDECAR_RATE_LIMITS_FILE")]
    pub rate_limits_file: Option<PathBuf>,
    #[arg(long, env = "CYLLM_SIDECAR_ROUTING", value_enum, default_value = "least-outstanding")]
    pub routing: RoutingMode,
    /// cache-aware: the share of a request's cacheable blocks a worker must hold to be chosen for them.
    #[arg(long, env = "CYLLM_SIDECAR_CACHE_MIN_MATCH", default_value_t = 0.5)]
    pub cache_min_match: f64,
    /// cache-aware: a worker with this many more requests than the least busy one (and
    /// --cache-balance-ratio times as many) is not chosen for its cache.
    #[arg(long, env = "CYLLM_SIDECAR_CACHE_BALANCE_ABS", default_value_t = 8)]
    pub cache_balance_abs: u64,
    #[arg(long, env = "CYLLM_SIDECAR_CACHE_BALANCE_RATIO", default_value_t = 1.5)]
    pub cache_balance_ratio: f64,
    /// cache-aware: prompt tokens to prefill that one more outstanding request is worth. A worker
    /// holding more of the request is chosen while what it saves exceeds this times its extra load.
    #[arg(long, env = "CYLLM_SIDECAR_CACHE_LOAD_TOKENS", default_value_t = 256)]
    pub cache_load_tokens: u64,
    /// Largest CacheEvents message taken from a worker (a snapshot names every cached block, about
    /// 120 bytes each); a worker whose messages are larger is routed by load.
    #[arg(long, env = "CYLLM_SIDECAR_CACHE_EVENT_MAX_BYTES", default_value_t = 256 * 1024 * 1024)]
    pub cache_event_max_bytes: usize,
    /// Prompt bytes hashed for prefix affinity.
    #[arg(long, env = "CYLLM_SIDECAR_PREFIX_BYTES", default_value_t = 256)]
    pub prefix_bytes: usize,
    /// Attempts on other workers after UNAVAILABLE or RESOURCE_EXHAUSTED, before the first message.
    #[arg(long, env = "CYLLM_SIDECAR_MAX_RETRIES", default_value_t = 2)]
    pub max_retries: u32,
    /// Retries allowed per request on average (a token bucket refilled by each request).
    #[arg(long, env = "CYLLM_SIDECAR_RETRY_BUDGET", default_value_t = 0.2)]
    pub retry_budget: f64,
    /// Consecutive failures that open a worker's circuit breaker.
    #[arg(long, env = "CYLLM_SIDECAR_BREAKER_FAILURES", default_value_t = 5)]
    pub breaker_failures: u32,
    /// Seconds an open breaker waits before letting one probe through.
    #[arg(long, env = "CYLLM_SIDECAR_BREAKER_COOLDOWN_S", default_value_t = 5.0)]
    pub breaker_cooldown_s: f64,
    /// Largest request body or message accepted, in bytes (HTTP 413 / RESOURCE_EXHAUSTED beyond).
    #[arg(long, env = "CYLLM_SIDECAR_MAX_REQUEST_BYTES", default_value_t = 4 * 1024 * 1024)]
    pub max_request_bytes: usize,
    /// Streams open at once over gRPC and HTTP together; beyond it RESOURCE_EXHAUSTED / 429.
    #[arg(long, env = "CYLLM_SIDECAR_MAX_STREAMS", default_value_t = 1024)]
    pub max_streams: usize,
    /// Deadline for HTTP requests (gRPC callers send their own grpc-timeout); 0 for none.
    #[arg(long, env = "CYLLM_SIDECAR_HTTP_TIMEOUT_S", default_value_t = 600.0)]
    pub http_timeout_s: f64,
    /// On SIGTERM, how long open streams may run on before the sidecar exits.
    #[arg(long, env = "CYLLM_SIDECAR_SHUTDOWN_GRACE_S", default_value_t = 30.0)]
    pub shutdown_grace_s: f64,
    /// How often each worker's GetLoad is read (it is also the check that the worker answers).
    #[arg(long, env = "CYLLM_SIDECAR_LOAD_POLL_S", default_value_t = 1.0)]
    pub load_poll_s: f64,
    /// A worker whose GetLoad takes longer than this is unresponsive (stopped, deadlocked, a
    /// wedged driver call): out of routing and /readyz until it answers again.
    #[arg(long, env = "CYLLM_SIDECAR_WORKER_PROBE_TIMEOUT_S", default_value_t = 2.0)]
    pub worker_probe_timeout_s: f64,
    /// A stream on an unresponsive worker that got no message for this long ends UNAVAILABLE
    /// (so its client can retry elsewhere); the worker sees it cancelled when it comes back.
    #[arg(long, env = "CYLLM_SIDECAR_WORKER_STALL_TIMEOUT_S", default_value_t = 10.0)]
    pub worker_stall_timeout_s: f64,
    /// HTTP/2 keepalive pings on each worker connection, idle ones too. Must not be shorter than
    /// the worker's server.keepalive_min_ping_interval_s (read from GetInfo and checked).
    #[arg(long, env = "CYLLM_SIDECAR_WORKER_KEEPALIVE_INTERVAL_S", default_value_t = 10.0)]
    pub worker_keepalive_interval_s: f64,
    /// A ping unanswered this long closes the worker connection and every stream on it.
    #[arg(long, env = "CYLLM_SIDECAR_WORKER_KEEPALIVE_TIMEOUT_S", default_value_t = 20.0)]
    pub worker_keepalive_timeout_s: f64,
    /// HTTP/1 request heads must arrive within this long of their first byte (else the
    /// connection is closed); 0 for no limit.
    #[arg(long, env = "CYLLM_SIDECAR_HEADER_READ_TIMEOUT_S", default_value_t = 10.0)]
    pub header_read_timeout_s: f64,
    /// A request body must arrive whole within this long of its head (else 408); 0 for no limit.
    #[arg(long, env = "CYLLM_SIDECAR_BODY_READ_TIMEOUT_S", default_value_t = 30.0)]
    pub body_read_timeout_s: f64,
    /// A connection with no request open that sends nothing for this long is closed (HTTP/1
    /// keep-alive and HTTP/2 alike); 0 for no limit.
    #[arg(long, env = "CYLLM_SIDECAR_IDLE_TIMEOUT_S", default_value_t = 60.0)]
    pub idle_timeout_s: f64,
    /// Open connections per listener (gRPC, HTTP, metrics); one more is closed at once and counted.
    #[arg(long, env = "CYLLM_SIDECAR_MAX_CONNECTIONS", default_value_t = 4096)]
    pub max_connections: usize,
    /// HTTP/2 streams one connection may have open at once (gRPC and HTTP listeners).
    #[arg(long, env = "CYLLM_SIDECAR_HTTP2_MAX_STREAMS", default_value_t = 256)]
    pub http2_max_streams: u32,
    /// Largest request head: HTTP/1 header bytes, HTTP/2 header list size (431 / refused beyond).
    #[arg(long, env = "CYLLM_SIDECAR_MAX_HEADER_BYTES", default_value_t = 64 * 1024)]
    pub max_header_bytes: usize,
    /// Runtime worker threads; 0 for one per available core, 1 for a single-threaded runtime.
    #[arg(long, env = "CYLLM_SIDECAR_THREADS", default_value_t = 0)]
    pub threads: usize,
    /// OTLP/gRPC collector for traces, e.g. http://otel-collector:4317; traces are off without one.
    #[arg(long, env = "OTEL_EXPORTER_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,
    /// The traces-only endpoint, which wins over --otlp-endpoint (OpenTelemetry's precedence).
    #[arg(long, env = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", hide = true)]
    pub otlp_traces_endpoint: Option<String>,
    /// How long one export to the collector may take before its spans are dropped (and counted).
    #[arg(long, env = "CYLLM_SIDECAR_OTLP_TIMEOUT_S", default_value_t = 10.0)]
    pub otlp_timeout_s: f64,
    #[arg(long, env = "OTEL_TRACES_SAMPLER", value_enum, default_value = "parentbased_traceidratio")]
    pub trace_sampler: TraceSampler,
    /// Fraction of new traces recorded (0..1), for the ratio samplers.
    #[arg(long, env = "OTEL_TRACES_SAMPLER_ARG", default_value_t = 1.0)]
    pub trace_sample_ratio: f64,
    /// service.name on the sidecar's spans.
    #[arg(long, env = "OTEL_SERVICE_NAME", default_value = "cy-llm-sidecar")]
    pub otel_service_name: String,
    /// tracing filter, e.g. info or cy_llm_sidecar=debug.
    #[arg(long, env = "CYLLM_SIDECAR_LOG", default_value = "info")]
    pub log: String,
}

/// Seconds to a Duration; 0 (or less) for none.
pub fn limit(seconds: f64) -> Option<Duration> {
    (seconds > 0.0).then(|| Duration::from_secs_f64(seconds))
}

impl Args {
    pub fn otlp_endpoint(&self) -> Option<&str> {
        self.otlp_traces_endpoint.as_deref().or(self.otlp_endpoint.as_deref()).filter(|e| !e.is_empty())
    }

    pub fn http_timeout(&self) -> Option<Duration> {
        limit(self.http_timeout_s)
    }

    /// Flag values that cannot work together, found before anything starts.
    pub fn check(&self) -> anyhow::Result<()> {
        anyhow::ensure!(self.worker_keepalive_interval_s >= 1.0, "--worker-keepalive-interval-s must be at least 1");
        anyhow::ensure!(self.worker_keepalive_timeout_s > 0.0, "--worker-keepalive-timeout-s must be positive");
        anyhow::ensure!(self.worker_probe_timeout_s > 0.0 && self.load_poll_s > 0.0,
                        "--worker-probe-timeout-s and --load-poll-s must be positive");
        anyhow::ensure!((0.0..=1.0).contains(&self.cache_min_match), "--cache-min-match must be within 0..1");
        anyhow::ensure!(self.cache_balance_ratio >= 1.0, "--cache-balance-ratio must be at least 1");
        anyhow::ensure!(self.max_header_bytes >= 8192, "--max-header-bytes must be at least 8192");
        anyhow::ensure!(self.max_connections >= 1 && self.http2_max_streams >= 1,
                        "--max-connections and --http2-max-streams must be at least 1");
        Ok(())
    }

    /// Keys from the flag/env (unnamed) and the file, blank lines and comments dropped.
    pub fn load_api_keys(&self) -> anyhow::Result<Vec<Key>> {
        let mut keys: Vec<Key> =
            self.api_keys.iter().filter(|k| !k.is_empty()).map(|k| Key { name: None, secret: k.clone() }).collect();
        if let Some(path) = &self.api_keys_file {
            let text = std::fs::read_to_string(path)
                .map_err(|e| anyhow::anyhow!("cannot read --api-keys-file {}: {e}", path.display()))?;
            keys.extend(
                text.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')).map(Key::parse),
            );
        }
        Ok(keys)
    }
}
