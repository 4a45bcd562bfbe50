//! How the sidecar watches its workers: the settings it talks to them with, each worker's health
//! (a grpc.health.v1 Watch stream, GetInfo whenever it turns ready) and its load (GetLoad, which
//! also tells a worker that has gone quiet).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::HealthCheckRequest;

use crate::config::Args;
use crate::pool::Worker;
use crate::proto::worker_control_client::WorkerControlClient;
use crate::proto::{GetInfoRequest, GetLoadRequest, WorkerInfo, INFERENCE_SERVICE};

/// How the sidecar talks to and watches its workers (from the flags).
#[derive(Clone, Debug)]
pub struct Watch {
    pub keepalive_interval: Duration,
    pub keepalive_timeout: Duration,
    pub load_poll: Duration,
    pub probe_timeout: Duration,
    pub cache_event_max_bytes: usize,
}

impl Watch {
    pub fn from_args(args: &Args) -> Self {
        Self {
            keepalive_interval: Duration::from_secs_f64(args.worker_keepalive_interval_s),
            keepalive_timeout: Duration::from_secs_f64(args.worker_keepalive_timeout_s),
            load_poll: Duration::from_secs_f64(args.load_poll_s),
            probe_timeout: Duration::from_secs_f64(args.worker_probe_timeout_s),
            cache_event_max_bytes: args.cache_event_max_bytes,
        }
    }

    /// Why this sidecar's pings would get the worker's connection closed, if they would.
    pub fn keepalive_conflict(&self, info: &WorkerInfo) -> Option<String> {
        let interval_ms = self.keepalive_interval.as_millis();
        if u128::from(info.min_ping_interval_ms) > interval_ms {
            return Some(format!(
                "the worker accepts a ping every {} ms at most and this sidecar pings every {interval_ms} ms: it \
                 would close the connection, and every stream on it, after a silence; raise \
                 --worker-keepalive-interval-s or lower the worker's server.keepalive_min_ping_interval_s",
                info.min_ping_interval_ms
            ));
        }
        if info.min_ping_interval_ms > 0 && !info.permit_pings_without_calls {
            return Some("the worker refuses pings on idle connections (server.keepalive_permit_without_calls: \
                         false), which this sidecar sends to notice a hung worker"
                .into());
        }
        None
    }
}

/// Keeps the worker's readiness current: its health watch, begun again (with backoff) when it breaks.
pub async fn watch_health(worker: Arc<Worker>, watch: Watch) {
    let mut backoff = Duration::from_millis(100);
    loop {
        match watch_once(&worker, &watch).await {
            Ok(()) => backoff = Duration::from_millis(100),
            Err(error) => tracing::debug!(worker = %worker.name, %error, "health watch ended"),
        }
        if worker.is_ready() {
            tracing::warn!(worker = %worker.name, socket = %worker.socket.display(), "worker not ready");
        }
        worker.set_ready(false);
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}

/// Follows the inference service's health until the stream breaks, reading the worker's models
/// (GetInfo) each time it turns ready: a worker still loading has none to report yet.
async fn watch_once(worker: &Arc<Worker>, watch: &Watch) -> Result<(), tonic::Status> {
    let mut control = WorkerControlClient::new(worker.channel.clone());
    let mut health = HealthClient::new(worker.channel.clone());
    let mut updates =
        health.watch(HealthCheckRequest { service: INFERENCE_SERVICE.to_string() }).await?.into_inner();
    while let Some(update) = updates.message().await? {
        let ready = update.status == ServingStatus::Serving as i32;
        if ready {
            let info = control.get_info(GetInfoRequest {}).await?.into_inner();
            let conflict = watch.keepalive_conflict(&info);
            if let Some(conflict) = &conflict {
                tracing::error!(worker = %worker.name, %conflict, "worker not routed to: keepalive settings conflict");
            } else if info.min_ping_interval_ms == 0 {
                tracing::warn!(worker = %worker.name, "worker reports no keepalive policy (an older worker?); \
                               it may close long silent streams");
            }
            *worker.misconfigured.write().unwrap() = conflict;
            *worker.models.write().unwrap() = info.models;
            *worker.capabilities.write().unwrap() = info.capabilities.unwrap_or_default();
        }
        if ready != worker.is_ready() {
            tracing::info!(worker = %worker.name, ready, models = ?worker.models(), "worker readiness");
        }
        worker.set_ready(ready);
    }
    Ok(())
}

/// Reads the worker's load, and so finds out whether it answers at all: a stopped or wedged
/// worker keeps its socket and its health Watch stream open and simply goes quiet.
pub async fn poll_load(worker: Arc<Worker>, watch: Watch) {
    let mut control = WorkerControlClient::new(worker.channel.clone());
    let mut ticker = tokio::time::interval(watch.load_poll);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        if !worker.ready.load(Ordering::Acquire) {
            continue; // not serving (loading, or gone): the health watch says so already
        }
        let mut request = tonic::Request::new(GetLoadRequest {});
        request.set_timeout(watch.probe_timeout);
        let answered = match tokio::time::timeout(watch.probe_timeout, control.get_load(request)).await {
            Ok(Ok(load)) => {
                worker.set_last_load(load.into_inner());
                true
            }
            // An error is an answer (the health watch handles a worker that went away); silence is not.
            Ok(Err(status)) => !matches!(status.code(), tonic::Code::DeadlineExceeded | tonic::Code::Cancelled),
            Err(_) => false,
        };
        if answered != worker.is_responsive() {
            worker.responsive.store(answered, Ordering::Release);
            if answered {
                tracing::info!(worker = %worker.name, "worker answers again; routed to");
            } else {
                metrics::counter!("cyllm_sidecar_worker_unresponsive_total", "worker" => worker.name.clone()).increment(1);
                tracing::warn!(worker = %worker.name, socket = %worker.socket.display(),
                               probe_timeout_s = watch.probe_timeout.as_secs_f64(), "worker unresponsive; not routed to");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn keepalive_settings_are_checked_against_the_worker_s() {
        let args = <Args as clap::Parser>::parse_from(["cy-llm-sidecar", "--worker", "unix:///tmp/w.sock"]);
        let watch = Watch::from_args(&args);
        let info = |ms, idle| WorkerInfo { min_ping_interval_ms: ms, permit_pings_without_calls: idle, ..Default::default() };
        assert_eq!(watch.keepalive_conflict(&info(5_000, true)), None);
        assert_eq!(watch.keepalive_conflict(&info(10_000, true)), None, "equal to the interval is accepted");
        let strict = watch.keepalive_conflict(&info(300_000, true)).unwrap();
        assert!(strict.contains("300000 ms") && strict.contains("--worker-keepalive-interval-s"), "{strict}");
        assert!(watch.keepalive_conflict(&info(5_000, false)).unwrap().contains("idle connections"));
        assert_eq!(watch.keepalive_conflict(&info(0, false)), None, "a worker that reports nothing is not refused");

        let worker = Worker::fake("w0", &["m"], true);
        assert!(worker.is_ready() && worker.problem().is_none());
        worker.set_responsive(false);
        assert!(!worker.is_ready());
        assert!(worker.problem().unwrap().contains("unresponsive"));
        worker.set_responsive(true);
        *worker.misconfigured.write().unwrap() = Some(strict);
        assert!(!worker.is_ready());
    }
}
