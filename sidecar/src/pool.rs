//! The workers behind the sidecar: one lazy channel per socket, models from GetInfo, readiness from
//! a grpc.health.v1 Watch stream, load from GetLoad, and outstanding requests counted here.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;
use tonic::transport::{Channel, Endpoint, Uri};
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::HealthCheckRequest;
use tower::service_fn;

use crate::breaker::Breaker;
use crate::cache_index::{self, CacheView};
use crate::config::Args;
use crate::proto::worker_control_client::WorkerControlClient;
use crate::proto::predict_request::Input;
use crate::proto::structured_output::Kind;
use crate::proto::{Capabilities, GetInfoRequest, GetLoadRequest, PredictRequest, WorkerInfo, WorkerLoad, INFERENCE_SERVICE};

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

pub struct Worker {
    /// Short label for metrics and logs: w0, w1, ...
    pub name: String,
    pub socket: PathBuf,
    pub channel: Channel,
    pub breaker: Breaker,
    models: RwLock<Vec<String>>,
    /// What its engine does beyond plain text (GetInfo).
    capabilities: RwLock<Capabilities>,
    /// The worker's own health: its inference service SERVING.
    ready: AtomicBool,
    /// It answered its last GetLoad within the probe timeout.
    responsive: AtomicBool,
    /// Set when the worker's settings and this sidecar's cannot work together.
    misconfigured: RwLock<Option<String>>,
    outstanding: AtomicUsize,
    /// Its last GetLoad answer.
    last_load: RwLock<WorkerLoad>,
    /// What its prefix cache holds (cache_index::follow).
    pub cache: CacheView,
}

impl Worker {
    pub fn new(name: String, uri: &str, breaker: Breaker, watch: &Watch) -> anyhow::Result<Self> {
        let socket = socket_path(uri)?;
        let path = socket.clone();
        // The URI is a placeholder: the connector dials the Unix socket whatever it says.
        let channel = Endpoint::try_from("http://worker.local")?
            .connect_timeout(Duration::from_secs(2))
            .http2_keep_alive_interval(watch.keepalive_interval)
            .keep_alive_timeout(watch.keepalive_timeout)
            .keep_alive_while_idle(true)
            .connect_with_connector_lazy(service_fn(move |_: Uri| {
                let path = path.clone();
                async move { Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(path).await?)) }
            }));
        Ok(Self {
            name,
            socket,
            channel,
            breaker,
            models: RwLock::new(Vec::new()),
            capabilities: RwLock::new(Capabilities::default()),
            ready: AtomicBool::new(false),
            responsive: AtomicBool::new(true),
            misconfigured: RwLock::new(None),
            outstanding: AtomicUsize::new(0),
            last_load: RwLock::new(WorkerLoad::default()),
            cache: CacheView::default(),
        })
    }

    /// A worker with a fixed model list, for routing tests.
    #[cfg(test)]
    pub fn fake(name: &str, models: &[&str], ready: bool) -> Self {
        let args = <Args as clap::Parser>::parse_from(["cy-llm-sidecar", "--worker", "unix:///tmp/w.sock"]);
        let worker = Self::new(name.into(), &format!("unix:///tmp/{name}.sock"), Breaker::new(3, Duration::from_secs(1)),
                               &Watch::from_args(&args))
            .unwrap();
        *worker.models.write().unwrap() = models.iter().map(|m| m.to_string()).collect();
        worker.ready.store(ready, Ordering::SeqCst);
        worker
    }

    /// Routable: SERVING, answering, and configured to work with this sidecar.
    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Acquire) && self.is_responsive() && self.misconfigured.read().unwrap().is_none()
    }

    pub fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Ordering::Release);
    }

    pub fn is_responsive(&self) -> bool {
        self.responsive.load(Ordering::Acquire)
    }

    #[cfg(test)]
    pub fn set_responsive(&self, responsive: bool) {
        self.responsive.store(responsive, Ordering::Release);
    }

    /// Why a worker that may be up is not routed to: unresponsive or misconfigured.
    pub fn problem(&self) -> Option<String> {
        if !self.is_responsive() {
            return Some("unresponsive: GetLoad not answered within the probe timeout".into());
        }
        self.misconfigured.read().unwrap().clone()
    }

    pub fn models(&self) -> Vec<String> {
        self.models.read().unwrap().clone()
    }

    /// Empty `model` means the worker's default, which any worker has.
    pub fn serves(&self, model: &str) -> bool {
        let models = self.models.read().unwrap();
        !models.is_empty() && (model.is_empty() || models.iter().any(|m| m == model))
    }

    /// Its last GetLoad answer (all zero before the first).
    pub fn last_load(&self) -> WorkerLoad {
        self.last_load.read().unwrap().clone()
    }

    /// What routing compares: our own outstanding requests, or the worker's running + queued
    /// when other clients keep it busier than we know.
    pub fn load(&self) -> u64 {
        let last = self.last_load.read().unwrap();
        (self.outstanding.load(Ordering::Relaxed) as u64).max(u64::from(last.running + last.queued))
    }

    pub fn outstanding(&self) -> usize {
        self.outstanding.load(Ordering::Relaxed)
    }

    /// Counts a request against this worker until the guard drops.
    pub fn begin(self: &Arc<Self>) -> OutstandingGuard {
        self.outstanding.fetch_add(1, Ordering::Relaxed);
        OutstandingGuard(self.clone())
    }
}

pub struct OutstandingGuard(Arc<Worker>);

impl Drop for OutstandingGuard {
    fn drop(&mut self) {
        self.0.outstanding.fetch_sub(1, Ordering::Relaxed);
    }
}

/// `unix:///run/x.sock`, `unix:/run/x.sock` or a plain path.
pub fn socket_path(uri: &str) -> anyhow::Result<PathBuf> {
    let path = uri.strip_prefix("unix://").or_else(|| uri.strip_prefix("unix:")).unwrap_or(uri);
    anyhow::ensure!(path.starts_with('/'), "worker {uri:?} must be unix:///absolute/path.sock");
    Ok(PathBuf::from(path))
}

pub struct Pool {
    pub workers: Vec<Arc<Worker>>,
}

impl Pool {
    pub fn new(args: &Args, watch: &Watch) -> anyhow::Result<Self> {
        let cooldown = Duration::from_secs_f64(args.breaker_cooldown_s);
        let workers = args
            .workers
            .iter()
            .enumerate()
            .map(|(i, uri)| Worker::new(format!("w{i}"), uri, Breaker::new(args.breaker_failures, cooldown), watch).map(Arc::new))
            .collect::<anyhow::Result<Vec<_>>>()?;
        Ok(Self { workers })
    }

    /// Every model any configured worker has reported.
    pub fn models(&self) -> BTreeSet<String> {
        self.workers.iter().flat_map(|w| w.models()).collect()
    }

    /// What a request asks that no ready worker serving its model can do, named; None when one can
    /// (or when none is ready: routing then says so).
    pub fn lacks(&self, model: &str, request: &PredictRequest) -> Option<String> {
        let able: Vec<Capabilities> = self
            .workers
            .iter()
            .filter(|w| w.is_ready() && w.serves(model))
            .map(|w| w.capabilities.read().unwrap().clone())
            .collect();
        let mut needs: Vec<(String, Box<dyn Fn(&Capabilities) -> bool>)> = Vec::new();
        if let Some(kind) = request.structured_output.as_ref().and_then(|s| s.kind.as_ref()) {
            let name = match kind {
                Kind::JsonSchema(_) => "json_schema",
                Kind::JsonObject(_) => "json_object",
                Kind::Regex(_) => "regex",
                Kind::Grammar(_) => "grammar",
                Kind::Choice(_) => "choice",
            };
            needs.push((format!("structured output ({name})"), Box::new(move |c| c.structured_output.iter().any(|k| k == name))));
        }
        for (field, count) in [("logprobs", request.logprobs), ("prompt logprobs (echo)", request.prompt_logprobs)] {
            if let Some(count) = count {
                needs.push((field.to_string(), Box::new(move |c| c.max_logprobs >= count.max(1))));
            }
        }
        if matches!(&request.input, Some(Input::Chat(chat)) if !chat.tools_json.is_empty()) {
            needs.push(("tools".to_string(), Box::new(|c| c.tools)));
        }
        if request.speculative == Some(true) {
            needs.push(("speculative decoding".to_string(), Box::new(|c| c.speculative_decoding)));
        }
        if able.is_empty() {
            return None;
        }
        needs
            .into_iter()
            .find(|(_, can)| !able.iter().any(|c| can(c)))
            .map(|(what, _)| format!("{what} is not supported by the engine serving this model"))
    }

    pub fn knows(&self, model: &str) -> bool {
        model.is_empty() || self.workers.iter().any(|w| w.models().iter().any(|m| m == model))
    }

    /// Ready workers serving `model` whose breaker would let a request through.
    pub fn candidates(&self, model: &str, now: Instant) -> Vec<Arc<Worker>> {
        self.workers
            .iter()
            .filter(|w| w.is_ready() && w.serves(model) && w.breaker.is_available(now))
            .cloned()
            .collect()
    }

    /// Every known model has a ready worker (and at least one model is known).
    pub fn is_ready(&self) -> bool {
        let models = self.models();
        !models.is_empty()
            && models.iter().all(|m| self.workers.iter().any(|w| w.is_ready() && w.serves(m)))
    }

    /// Keeps each worker's models, readiness, responsiveness and load current until the process ends.
    pub fn spawn_watchers(&self, watch: &Watch) {
        for worker in &self.workers {
            tokio::spawn(watch_health(worker.clone(), watch.clone()));
            tokio::spawn(poll_load(worker.clone(), watch.clone()));
            tokio::spawn(cache_index::follow(worker.clone(), watch.cache_event_max_bytes));
        }
    }
}

async fn watch_health(worker: Arc<Worker>, watch: Watch) {
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
async fn poll_load(worker: Arc<Worker>, watch: Watch) {
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
                *worker.last_load.write().unwrap() = load.into_inner();
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
