//! The workers behind the sidecar: one lazy channel per socket, what watcher.rs learns of each (models
//! from GetInfo, readiness from a grpc.health.v1 Watch stream, load from GetLoad), and outstanding
//! requests counted here.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;
use tonic::transport::{Channel, Endpoint, Uri};
use tower::service_fn;

use crate::breaker::Breaker;
use crate::cache_index::{self, CacheView};
use crate::config::Args;
use crate::proto::predict_request::Input;
use crate::proto::structured_output::Kind;
use crate::proto::{Capabilities, PredictRequest, WorkerLoad};
use crate::watcher::{self, Watch};

pub struct Worker {
    /// Short label for metrics and logs: w0, w1, ...
    pub name: String,
    pub socket: PathBuf,
    pub channel: Channel,
    pub breaker: Breaker,
    pub(crate) models: RwLock<Vec<String>>,
    /// What its engine does beyond plain text (GetInfo).
    pub(crate) capabilities: RwLock<Capabilities>,
    /// The worker's own health: its inference service SERVING.
    pub(crate) ready: AtomicBool,
    /// It answered its last GetLoad within the probe timeout.
    pub(crate) responsive: AtomicBool,
    /// Set when the worker's settings and this sidecar's cannot work together.
    pub(crate) misconfigured: RwLock<Option<String>>,
    outstanding: AtomicUsize,
    /// Its last GetLoad answer.
    last_load: RwLock<WorkerLoad>,
    /// GetLoad answers so far, and our requests that ended since the last one but began before it
    /// (which that answer may still count as running).
    polls: AtomicU64,
    ended_since_poll: AtomicU64,
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
            polls: AtomicU64::new(0),
            ended_since_poll: AtomicU64::new(0),
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
    /// when other clients keep it busier than we know, less our requests that ended since it said
    /// so. Without that, a worker just left by our last request looked busy until the next poll,
    /// and the cache-aware choice priced its queue at a request it no longer had.
    pub fn load(&self) -> u64 {
        let last = self.last_load.read().unwrap();
        let polled = u64::from(last.running + last.queued).saturating_sub(self.ended_since_poll.load(Ordering::Relaxed));
        (self.outstanding.load(Ordering::Relaxed) as u64).max(polled)
    }

    /// A GetLoad answer.
    pub(crate) fn set_last_load(&self, load: WorkerLoad) {
        let mut last = self.last_load.write().unwrap();
        *last = load;
        self.ended_since_poll.store(0, Ordering::Relaxed);
        self.polls.fetch_add(1, Ordering::Relaxed);
    }

    pub fn outstanding(&self) -> usize {
        self.outstanding.load(Ordering::Relaxed)
    }

    /// Counts a request against this worker until the guard drops.
    pub fn begin(self: &Arc<Self>) -> OutstandingGuard {
        self.outstanding.fetch_add(1, Ordering::Relaxed);
        OutstandingGuard(self.clone(), self.polls.load(Ordering::Relaxed))
    }
}

/// The worker, and how many GetLoad answers it had when the request began.
pub struct OutstandingGuard(Arc<Worker>, u64);

impl Drop for OutstandingGuard {
    fn drop(&mut self) {
        let worker = &self.0;
        let _last = worker.last_load.read().unwrap(); // not between an answer and its reset
        worker.outstanding.fetch_sub(1, Ordering::Relaxed);
        if worker.polls.load(Ordering::Relaxed) > self.1 {
            worker.ended_since_poll.fetch_add(1, Ordering::Relaxed);
        }
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
            tokio::spawn(watcher::watch_health(worker.clone(), watch.clone()));
            tokio::spawn(watcher::poll_load(worker.clone(), watch.clone()));
            tokio::spawn(cache_index::follow(worker.clone(), watch.cache_event_max_bytes));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_request_that_ended_since_the_last_poll_no_longer_loads_its_worker() {
        let worker = Arc::new(Worker::fake("w0", &["m"], true));
        let before = worker.begin(); // began before the poll, which counts it
        worker.set_last_load(WorkerLoad { running: 2, queued: 1, ..Default::default() }); // and another client's two
        let after = worker.begin(); // began after it: the poll did not count it
        assert_eq!(worker.load(), 3);
        drop(after);
        assert_eq!(worker.load(), 3, "what the poll counted stays until the next");
        drop(before);
        assert_eq!(worker.load(), 2, "the poll counted this one, which has ended");
        worker.set_last_load(WorkerLoad { running: 2, ..Default::default() });
        assert_eq!(worker.load(), 2);
    }
}
