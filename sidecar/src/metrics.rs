//! /metrics on its own port: the sidecar's cyllm_sidecar_ metrics, then every worker's metrics
//! (fetched through WorkerControl.Metrics) with a worker label, merged by family.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

use crate::gateway::Gateway;
use crate::pool::Worker;
use crate::proto::worker_control_client::WorkerControlClient;
use crate::proto::{MetricsRequest, WorkerLoad};

const LATENCY_BUCKETS: &[f64] = &[0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0];

pub fn install() -> anyhow::Result<PrometheusHandle> {
    let handle = PrometheusBuilder::new().set_buckets(LATENCY_BUCKETS)?.install_recorder()?;
    metrics::describe_counter!("cyllm_sidecar_requests_total", "Requests ended, by route, gRPC status and worker");
    metrics::describe_histogram!("cyllm_sidecar_upstream_latency_seconds", "Request duration through the sidecar");
    metrics::describe_histogram!("cyllm_sidecar_time_to_first_token_seconds", "Time to the first response message");
    metrics::describe_counter!("cyllm_sidecar_retries_total", "Requests retried on another worker before any message");
    metrics::describe_gauge!("cyllm_sidecar_breaker_state", "Circuit breaker per worker: 0 closed, 1 open, 2 half-open");
    metrics::describe_gauge!("cyllm_sidecar_active_streams", "Streams open through the sidecar");
    metrics::describe_gauge!("cyllm_sidecar_worker_ready", "1 when the worker's inference service is SERVING");
    metrics::describe_gauge!("cyllm_sidecar_worker_outstanding", "Requests this sidecar has open on the worker");
    metrics::describe_gauge!("cyllm_pod_requests_waiting", "Requests queued in the pod's ready workers' schedulers");
    metrics::describe_gauge!("cyllm_pod_requests_running", "Requests running in the pod's ready workers");
    metrics::describe_gauge!("cyllm_pod_kv_cache_usage_ratio", "KV budget in use in the pod's fullest ready worker, 0-1");
    metrics::describe_gauge!("cyllm_sidecar_prefix_index_blocks", "Blocks the sidecar knows the worker's prefix cache holds (CacheEvents)");
    metrics::describe_gauge!("cyllm_sidecar_cache_events_live", "1 while the worker's CacheEvents stream is followed");
    metrics::describe_counter!("cyllm_sidecar_cache_event_resyncs_total", "CacheEvents streams started over, by reason");
    metrics::describe_counter!("cyllm_sidecar_spans_dropped_total", "Trace spans that never reached the collector, by reason");
    metrics::describe_counter!("cyllm_sidecar_spans_exported_total", "Trace spans sent to the OTLP collector");
    metrics::describe_gauge!("cyllm_pod_prefix_cache_hit_ratio", "Prompt tokens found in the prefix caches over those looked up, since the workers started");
    metrics::describe_counter!("cyllm_sidecar_rate_limited_total", "Requests refused by a caller's rate limit, by tenant and limit (requests, tokens)");
    metrics::describe_counter!("cyllm_sidecar_tenant_tokens_total", "Tokens charged to callers' budgets (prompt + generated), by tenant");
    metrics::describe_gauge!("cyllm_sidecar_rate_limit_held_tokens", "Token estimates held for requests still running");
    metrics::describe_counter!("cyllm_sidecar_rate_limit_reloads_total", "Rereads of the rate limits file, by result (ok, error)");
    let upkeep = handle.clone();
    tokio::spawn(async move {
        let mut ticker = tokio::time::interval(Duration::from_secs(5));
        loop {
            ticker.tick().await;
            upkeep.run_upkeep();
        }
    });
    Ok(handle)
}

#[derive(Clone)]
pub struct MetricsState {
    pub handle: PrometheusHandle,
    pub gateway: Arc<Gateway>,
}

pub fn app(state: MetricsState) -> Router {
    Router::new().route("/metrics", get(scrape)).with_state(state)
}

async fn scrape(State(state): State<MetricsState>) -> impl IntoResponse {
    let pool = &state.gateway.pool;
    let mut active = 0;
    for worker in &pool.workers {
        let name = worker.name.clone();
        active += worker.outstanding();
        metrics::gauge!("cyllm_sidecar_breaker_state", "worker" => name.clone()).set(worker.breaker.state_code());
        metrics::gauge!("cyllm_sidecar_worker_ready", "worker" => name.clone()).set(f64::from(u8::from(worker.is_ready())));
        metrics::gauge!("cyllm_sidecar_worker_outstanding", "worker" => name).set(worker.outstanding() as f64);
    }
    metrics::gauge!("cyllm_sidecar_active_streams").set(active as f64);
    set_pod_signals(&pool.workers);
    let fetches = pool.workers.iter().map(|worker| {
        let worker = worker.clone();
        async move {
            let mut request = tonic::Request::new(MetricsRequest {});
            request.set_timeout(Duration::from_secs(2));
            let text = WorkerControlClient::new(worker.channel.clone()).metrics(request).await.ok()?.into_inner().text;
            Some((worker.name.clone(), text))
        }
    });
    let exports: Vec<_> = futures::future::join_all(fetches).await.into_iter().flatten().collect();
    let mut body = state.handle.render();
    body.push_str(&merge_worker_metrics(&exports));
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], body)
}

/// The pod's figures for gateways and autoscalers (the Gateway API Inference Extension's endpoint
/// picker, KEDA, an HPA), to whom a pod is one endpoint however many workers it holds, from the
/// ready workers' last GetLoad: queued and running requests summed, the fullest worker's KV budget
/// in use (0-1), and the prefix caches' hit ratio over all their lookups (None: no prefix cache).
#[derive(Debug, PartialEq)]
struct PodSignals {
    waiting: u64,
    running: u64,
    kv_usage: f64,
    prefix_hit_ratio: Option<f64>,
}

fn pod_signals(loads: &[WorkerLoad]) -> PodSignals {
    let (mut queried, mut hits) = (None, 0u64);
    for load in loads {
        if let Some(looked_up) = load.prefix_queried_tokens {
            queried = Some(queried.unwrap_or(0u64) + looked_up);
            hits += load.prefix_hit_tokens.unwrap_or(0);
        }
    }
    PodSignals {
        waiting: loads.iter().map(|l| u64::from(l.queued)).sum(),
        running: loads.iter().map(|l| u64::from(l.running)).sum(),
        kv_usage: loads.iter().filter(|l| l.budget_tokens_total > 0)
            .map(|l| l.budget_tokens_used as f64 / l.budget_tokens_total as f64).fold(0.0, f64::max),
        prefix_hit_ratio: queried.filter(|q| *q > 0).map(|q| hits as f64 / q as f64),
    }
}

fn set_pod_signals(workers: &[Arc<Worker>]) {
    let loads: Vec<WorkerLoad> = workers.iter().filter(|w| w.is_ready()).map(|w| w.last_load()).collect();
    let signals = pod_signals(&loads);
    metrics::gauge!("cyllm_pod_requests_waiting").set(signals.waiting as f64);
    metrics::gauge!("cyllm_pod_requests_running").set(signals.running as f64);
    metrics::gauge!("cyllm_pod_kv_cache_usage_ratio").set(signals.kv_usage);
    if let Some(ratio) = signals.prefix_hit_ratio {
        metrics::gauge!("cyllm_pod_prefix_cache_hit_ratio").set(ratio);
    }
}

/// Prometheus text from several workers as one exposition: one HELP/TYPE per family, every
/// sample labelled worker="NAME".
pub fn merge_worker_metrics(exports: &[(String, String)]) -> String {
    let mut order: Vec<String> = Vec::new();
    let mut families: HashMap<String, (Vec<String>, Vec<String>)> = HashMap::new();
    for (worker, text) in exports {
        let mut family = String::new();
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            if let Some(rest) = line.strip_prefix("# HELP ").or_else(|| line.strip_prefix("# TYPE ")) {
                family = rest.split_whitespace().next().unwrap_or_default().to_string();
                let entry = families.entry(family.clone()).or_insert_with(|| {
                    order.push(family.clone());
                    (Vec::new(), Vec::new())
                });
                if entry.0.len() < 2 && !entry.0.iter().any(|l| l == line) {
                    entry.0.push(line.to_string());
                }
            } else if !line.starts_with('#') {
                let entry = families.entry(family.clone()).or_insert_with(|| {
                    order.push(family.clone());
                    (Vec::new(), Vec::new())
                });
                entry.1.push(with_worker_label(line, worker));
            }
        }
    }
    let mut out = String::new();
    for family in order {
        let (header, samples) = &families[&family];
        for line in header.iter().chain(samples) {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

fn with_worker_label(sample: &str, worker: &str) -> String {
    let label = format!("worker=\"{worker}\"");
    match (sample.find('{'), sample.find(' ')) {
        (Some(brace), Some(space)) if brace < space => {
            let closing = sample[brace..].starts_with("{}");
            if closing {
                format!("{}{{{}}}{}", &sample[..brace], label, &sample[brace + 2..])
            } else {
                format!("{}{{{},{}", &sample[..brace], label, &sample[brace + 1..])
            }
        }
        (_, Some(space)) => format!("{}{{{}}}{}", &sample[..space], label, &sample[space..]),
        _ => sample.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pod_signals_sum_queues_and_take_the_fullest_worker() {
        let load = |queued, running, used, total, prefix: Option<(u64, u64)>| WorkerLoad {
            queued, running, budget_tokens_used: used, budget_tokens_total: total,
            prefix_queried_tokens: prefix.map(|p| p.0), prefix_hit_tokens: prefix.map(|p| p.1), ..Default::default()
        };
        let signals = pod_signals(&[load(3, 4, 500, 1000, Some((100, 30))), load(1, 2, 900, 1000, None),
                                    load(0, 1, 10, 0, Some((100, 50)))]);
        assert_eq!(signals, PodSignals { waiting: 4, running: 7, kv_usage: 0.9, prefix_hit_ratio: Some(0.4) });
        assert_eq!(pod_signals(&[]), PodSignals { waiting: 0, running: 0, kv_usage: 0.0, prefix_hit_ratio: None });
    }

    #[test]
    fn merges_families_and_labels_samples() {
        let a = "# HELP cyllm_running_requests Running\n# TYPE cyllm_running_requests gauge\ncyllm_running_requests 2.0\n\
                 # HELP cyllm_requests_total Ended\n# TYPE cyllm_requests_total counter\ncyllm_requests_total{status=\"OK\"} 5.0\n";
        let b = "# HELP cyllm_running_requests Running\n# TYPE cyllm_running_requests gauge\ncyllm_running_requests 0.0\n";
        let merged = merge_worker_metrics(&[("w0".into(), a.into()), ("w1".into(), b.into())]);
        assert_eq!(merged.matches("# TYPE cyllm_running_requests gauge").count(), 1);
        assert!(merged.contains("cyllm_running_requests{worker=\"w0\"} 2.0\n"));
        assert!(merged.contains("cyllm_running_requests{worker=\"w1\"} 0.0\n"));
        assert!(merged.contains("cyllm_requests_total{worker=\"w0\",status=\"OK\"} 5.0\n"));
        let running = merged.find("cyllm_running_requests{worker=\"w1\"}").unwrap();
        assert!(running < merged.find("# HELP cyllm_requests_total").unwrap(), "samples stay under their family");
    }
}
