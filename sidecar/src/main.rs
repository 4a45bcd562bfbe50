//! cy-llm-sidecar: faces the gateway (gRPC, OpenAI HTTP, /metrics) and routes to workers over Unix sockets.

mod auth;
mod breaker;
mod cache_index;
mod cache_routing;
mod config;
mod error;
mod gateway;
mod grpc;
mod http;
mod limits_file;
mod listener;
mod metrics;
mod openai;
mod pool;
mod probe;
mod proto;
mod ratelimit;
mod reply;
mod request_id;
mod response;
mod routing;
mod sampling;
mod tools;
mod trace;
mod watcher;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use tokio::sync::watch;
use tonic::service::interceptor::InterceptedService;
use tonic_health::ServingStatus;

use crate::auth::ApiKeys;
use crate::config::Args;
use crate::gateway::Gateway;
use crate::grpc::{auth_interceptor, InferenceProxy};
use crate::listener::{Limits, Listener};
use crate::pool::Pool;
use crate::watcher::Watch;
use crate::proto::inference_service_server::InferenceServiceServer;
use crate::ratelimit::RateLimits;

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if let Some(path) = &args.probe {
        std::process::exit(probe::run(args.http_addr, path));
    }
    let mut runtime = match args.threads {
        1 => tokio::runtime::Builder::new_current_thread(),
        0 => tokio::runtime::Builder::new_multi_thread(),
        n => {
            let mut builder = tokio::runtime::Builder::new_multi_thread();
            builder.worker_threads(n);
            builder
        }
    };
    runtime.enable_all().build()?.block_on(serve(args))
}

async fn serve(args: Args) -> anyhow::Result<()> {
    let traces = trace::provider(&args)?;
    init_logging(&args, traces.as_ref())?;
    args.check()?;
    let keys = ApiKeys::new(args.load_api_keys()?);
    let auth_enabled = keys.enabled();
    let rate_limits = RateLimits::load(args.rate_limits_file.clone())?;
    tokio::spawn(rate_limits.clone().watch());
    let handle = metrics::install()?;
    let watch = Watch::from_args(&args);
    let pool = Arc::new(Pool::new(&args, &watch)?);
    pool.spawn_watchers(&watch);
    let gateway = Arc::new(Gateway::new(pool.clone(), &args));
    let (stop_tx, stop_rx) = watch::channel(false);

    let (health, health_service) = tonic_health::server::health_reporter();
    tokio::spawn(report_health(health, gateway.clone(), stop_rx.clone()));
    // Only what this process serves: the proto's file also describes WorkerControl, which the
    // workers serve and the sidecar does not.
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .with_service_name(proto::INFERENCE_SERVICE)
        .with_service_name("grpc.health.v1.Health")
        .build_v1()?;
    let inference = InferenceServiceServer::new(InferenceProxy { gateway: gateway.clone(), limits: rate_limits.clone() })
        .max_decoding_message_size(args.max_request_bytes);
    let limits = Limits::from_args(&args);
    let grpc_listener = Arc::new(Listener::bind(args.grpc_addr, "grpc", limits).await?);
    let grpc = tonic::transport::Server::builder()
        .max_concurrent_streams(limits.http2_max_streams)
        .http2_max_header_list_size(u32::try_from(limits.max_header_bytes).unwrap_or(u32::MAX))
        // Finds clients that vanished without closing (their streams are then cancelled).
        .http2_keepalive_interval(Some(Duration::from_secs(30)))
        .http2_keepalive_timeout(Some(Duration::from_secs(20)))
        .layer(tower::util::MapResponseLayer::new(grpc::contract_status))
        .add_service(health_service)
        .add_service(reflection)
        .add_service(InterceptedService::new(inference, auth_interceptor(keys.clone())))
        .serve_with_incoming_shutdown(grpc_listener.incoming(), stopped(stop_rx.clone()));

    let http_state = Arc::new(http::HttpState {
        gateway: gateway.clone(),
        keys,
        limits: rate_limits,
        timeout: args.http_timeout(),
        body_timeout: config::limit(args.body_read_timeout_s),
        max_body_bytes: args.max_request_bytes,
    });
    let metrics_app = metrics::app(metrics::MetricsState { handle, gateway: gateway.clone() });
    let http_listener = Listener::bind(args.http_addr, "http", limits).await?;
    // /metrics on the API port too: the Inference Extension's endpoint picker scrapes the port it
    // routes to (as vLLM serves it), and keys do not guard it, as they do not guard the probes.
    let http_app = http::app(http_state).merge(metrics_app.clone());
    let http = listener::serve_http(http_listener, http_app, stop_rx.clone());
    let metrics_listener = Listener::bind(args.metrics_addr, "metrics", limits).await?;
    let metrics_server = listener::serve_http(metrics_listener, metrics_app, stop_rx.clone());
    tracing::info!(grpc = %args.grpc_addr, http = %args.http_addr, metrics = %args.metrics_addr,
                   workers = ?args.workers, auth = auth_enabled, "listening");

    let servers = async { tokio::try_join!(async { grpc.await.map_err(anyhow::Error::from) }, async { http.await.map_err(anyhow::Error::from) }, async { metrics_server.await.map_err(anyhow::Error::from) }) };
    tokio::pin!(servers);
    tokio::select! {
        result = &mut servers => { result?; return Ok(()); }
        _ = shutdown_signal() => {}
    }
    // Not ready at once; the listeners stop accepting; open streams get the grace period.
    gateway.shutting_down.store(true, Ordering::Release);
    let _ = stop_tx.send(true);
    let grace = Duration::from_secs_f64(args.shutdown_grace_s);
    tracing::info!(grace_s = args.shutdown_grace_s, "shutting down");
    let ended = match tokio::time::timeout(grace, servers).await {
        Ok(result) => result.map(|_| ()),
        Err(_) => {
            tracing::warn!("grace period over; closing open streams");
            Ok(())
        }
    };
    if let Some(traces) = traces {
        // Exports what is still batched; blocking, so off the runtime's threads.
        let _ = tokio::task::spawn_blocking(move || traces.shutdown()).await;
    }
    ended
}

/// JSON log lines on stderr, filtered by --log; with tracing on, the request spans go to the
/// exporter whatever --log says.
fn init_logging(args: &Args, traces: Option<&opentelemetry_sdk::trace::SdkTracerProvider>) -> anyhow::Result<()> {
    use opentelemetry::trace::TracerProvider as _;
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    use tracing_subscriber::Layer;

    let logs = tracing_subscriber::fmt::layer()
        .json()
        .with_current_span(false)
        .with_span_list(false)
        .with_writer(std::io::stderr)
        .with_filter(tracing_subscriber::EnvFilter::try_new(&args.log)?);
    let spans = traces.map(|provider| {
        tracing_opentelemetry::layer()
            .with_tracer(provider.tracer("cy-llm-sidecar"))
            .with_location(false)
            .with_threads(false)
            .with_target(false)
            .with_tracked_inactivity(false)
            .with_filter(tracing_subscriber::filter::Targets::new().with_target(trace::TARGET, tracing::Level::INFO))
    });
    tracing_subscriber::registry().with(logs).with(spans).try_init()?;
    Ok(())
}

async fn stopped(mut stop: watch::Receiver<bool>) {
    let _ = stop.wait_for(|stopped| *stopped).await;
}

async fn shutdown_signal() {
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).expect("SIGTERM handler");
    tokio::select! {
        _ = terminate.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}

/// The sidecar's own grpc.health.v1: SERVING while every known model has a ready worker.
async fn report_health(health: tonic_health::server::HealthReporter, gateway: Arc<Gateway>, mut stop: watch::Receiver<bool>) {
    let mut ticker = tokio::time::interval(Duration::from_millis(250));
    let mut last = None;
    loop {
        tokio::select! {
            _ = ticker.tick() => {}
            _ = stop.changed() => {}
        }
        let ready = gateway.pool.is_ready() && !gateway.is_shutting_down();
        if last != Some(ready) {
            let status = if ready { ServingStatus::Serving } else { ServingStatus::NotServing };
            health.set_service_status(proto::INFERENCE_SERVICE, status).await;
            health.set_service_status("", status).await;
            last = Some(ready);
        }
    }
}
