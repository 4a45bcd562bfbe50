//! The workers behind the sidecar: one lazy channel per socket, models from GetInfo, readiness from
//! a grpc.health.v1 Watch stream, load from GetLoad, and outstanding requests counted here.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
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
use crate::proto::worker_control_client::WorkerControlClient;
use crate::proto::{GetInfoRequest, GetLoadRequest, INFERENCE_SERVICE};

pub struct Worker {
    /// Short label for metrics and logs: w0, w1, ...
    pub name: String,
    pub socket: PathBuf,
    pub channel: Channel,
    pub breaker: Breaker,
    models: RwLock<Vec<String>>,
    ready: AtomicBool,
    outstanding: AtomicUsize,
    remote_load: AtomicU64,
}

impl Worker {
    pub fn new(name: String, uri: &str, breaker: Breaker) -> anyhow::Result<Self> {
        let socket = socket_path(uri)?;
        let path = socket.clone();
        // The URI is a placeholder: the connector dials the Unix socket whatever it says.
        let channel = Endpoint::try_from("http://worker.local")?
            .connect_timeout(Duration::from_secs(2))
            .http2_keep_alive_interval(Duration::from_secs(10))
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
            ready: AtomicBool::new(false),
            outstanding: AtomicUsize::new(0),
            remote_load: AtomicU64::new(0),
        })
    }

    /// A worker with a fixed model list, for routing tests.
    #[cfg(test)]
    pub fn fake(name: &str, models: &[&str], ready: bool) -> Self {
        let worker = Self::new(name.into(), &format!("unix:///tmp/{name}.sock"), Breaker::new(3, Duration::from_secs(1)))
            .unwrap();
        *worker.models.write().unwrap() = models.iter().map(|m| m.to_string()).collect();
        worker.ready.store(ready, Ordering::SeqCst);
        worker
    }

    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Acquire)
    }

    pub fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Ordering::Release);
    }

    pub fn models(&self) -> Vec<String> {
        self.models.read().unwrap().clone()
    }

    /// Empty `model` means the worker's default, which any worker has.
    pub fn serves(&self, model: &str) -> bool {
        let models = self.models.read().unwrap();
        !models.is_empty() && (model.is_empty() || models.iter().any(|m| m == model))
    }

    /// What routing compares: our own outstanding requests, or the worker's running + queued
    /// when other clients keep it busier than we know.
    pub fn load(&self) -> u64 {
        (self.outstanding.load(Ordering::Relaxed) as u64).max(self.remote_load.load(Ordering::Relaxed))
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
    pub fn new(uris: &[String], breaker_failures: u32, breaker_cooldown: Duration) -> anyhow::Result<Self> {
        let workers = uris
            .iter()
            .enumerate()
            .map(|(i, uri)| Worker::new(format!("w{i}"), uri, Breaker::new(breaker_failures, breaker_cooldown)).map(Arc::new))
            .collect::<anyhow::Result<Vec<_>>>()?;
        Ok(Self { workers })
    }

    /// Every model any configured worker has reported.
    pub fn models(&self) -> BTreeSet<String> {
        self.workers.iter().flat_map(|w| w.models()).collect()
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

    /// Keeps each worker's models, readiness and load current until the process ends.
    pub fn spawn_watchers(&self, load_poll: Duration) {
        for worker in &self.workers {
            tokio::spawn(watch_health(worker.clone()));
            tokio::spawn(poll_load(worker.clone(), load_poll));
        }
    }
}

async fn watch_health(worker: Arc<Worker>) {
    let mut backoff = Duration::from_millis(100);
    loop {
        match watch_once(&worker).await {
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
async fn watch_once(worker: &Arc<Worker>) -> Result<(), tonic::Status> {
    let mut control = WorkerControlClient::new(worker.channel.clone());
    let mut health = HealthClient::new(worker.channel.clone());
    let mut updates =
        health.watch(HealthCheckRequest { service: INFERENCE_SERVICE.to_string() }).await?.into_inner();
    while let Some(update) = updates.message().await? {
        let ready = update.status == ServingStatus::Serving as i32;
        if ready {
            *worker.models.write().unwrap() = control.get_info(GetInfoRequest {}).await?.into_inner().models;
        }
        if ready != worker.is_ready() {
            tracing::info!(worker = %worker.name, ready, models = ?worker.models(), "worker readiness");
        }
        worker.set_ready(ready);
    }
    Ok(())
}

async fn poll_load(worker: Arc<Worker>, every: Duration) {
    let mut control = WorkerControlClient::new(worker.channel.clone());
    let mut ticker = tokio::time::interval(every);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        if !worker.is_ready() {
            continue;
        }
        let mut request = tonic::Request::new(GetLoadRequest {});
        request.set_timeout(Duration::from_secs(1));
        if let Ok(load) = control.get_load(request).await {
            let load = load.into_inner();
            worker.remote_load.store(u64::from(load.running + load.queued), Ordering::Relaxed);
        }
    }
}
