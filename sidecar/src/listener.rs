//! The sidecar's TCP listeners: at most `max_connections` open on each (one more is closed at
//! once and counted), connections closed when a request head comes too slowly or nothing happens
//! for too long, and HTTP/2 limits. axum::serve has none of these: a client that sent six bytes
//! of a body, or nothing at all, held its connection for as long as it liked.
//!
//! HTTP (and /metrics) connections are served here with hyper; each knows how many of its
//! requests are open. gRPC connections go to tonic, which sets its own HTTP/2 limits; here they
//! only must start talking within the header timeout.

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::Router;
use futures::Stream;
use http_body::{Body as HttpBody, Frame, SizeHint};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, OwnedSemaphorePermit, Semaphore};
use tokio::time::{Instant, Sleep};
use tonic::transport::server::{Connected, TcpConnectInfo};
use tower::Service;

use crate::config::{limit, Args};

#[derive(Clone, Copy, Debug)]
pub struct Limits {
    pub max_connections: usize,
    pub header_read_timeout: Option<Duration>,
    pub idle_timeout: Option<Duration>,
    pub http2_max_streams: u32,
    pub max_header_bytes: usize,
}

impl Limits {
    pub fn from_args(args: &Args) -> Self {
        Self {
            max_connections: args.max_connections,
            header_read_timeout: limit(args.header_read_timeout_s),
            idle_timeout: limit(args.idle_timeout_s),
            http2_max_streams: args.http2_max_streams,
            max_header_bytes: args.max_header_bytes,
        }
    }
}

/// A bound listener whose accepted connections each hold one of `max_connections` slots.
pub struct Listener {
    tcp: TcpListener,
    name: &'static str,
    slots: Arc<Semaphore>,
    limits: Limits,
}

/// One connection's slot: given back, and the gauge lowered, when the connection is dropped.
pub struct Slot {
    name: &'static str,
    _permit: OwnedSemaphorePermit,
}

impl Drop for Slot {
    fn drop(&mut self) {
        metrics::gauge!("cyllm_sidecar_connections_open", "listener" => self.name).decrement(1.0);
    }
}

impl Listener {
    pub async fn bind(addr: SocketAddr, name: &'static str, limits: Limits) -> io::Result<Self> {
        Ok(Self { tcp: TcpListener::bind(addr).await?, name, slots: Arc::new(Semaphore::new(limits.max_connections)), limits })
    }

    /// The next connection within the cap. Over it, connections are closed as they come (the
    /// client sees a reset at once instead of waiting in the backlog) and counted.
    async fn accept(&self) -> (TcpStream, Slot) {
        loop {
            let stream = match self.tcp.accept().await {
                Ok((stream, _)) => stream,
                Err(error) => {
                    // Out of file descriptors, or a connection reset before it was taken: not fatal.
                    tracing::warn!(listener = self.name, %error, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            match self.slots.clone().try_acquire_owned() {
                Ok(permit) => {
                    let _ = stream.set_nodelay(true);
                    metrics::gauge!("cyllm_sidecar_connections_open", "listener" => self.name).increment(1.0);
                    return (stream, Slot { name: self.name, _permit: permit });
                }
                Err(_) => {
                    metrics::counter!("cyllm_sidecar_connections_refused_total", "listener" => self.name).increment(1);
                    drop(stream);
                }
            }
        }
    }

    /// Resolves once every accepted connection has closed.
    async fn all_closed(&self) {
        let _ = self.slots.acquire_many(self.limits.max_connections as u32).await;
    }

    /// Connections for tonic: each must send its first bytes within the header timeout.
    pub fn incoming(self: Arc<Self>) -> impl Stream<Item = io::Result<Conn>> {
        async_stream::stream! {
            loop {
                let (io, slot) = self.accept().await;
                let deadline = self.limits.header_read_timeout.map(|t| Box::pin(tokio::time::sleep(t)));
                yield Ok(Conn { io, watch: Watch::FirstBytes { deadline, listener: self.name }, _slot: slot });
            }
        }
    }
}

/// An accepted connection, holding its listener slot, whose reads are watched.
pub struct Conn {
    io: TcpStream,
    watch: Watch,
    _slot: Slot,
}

enum Watch {
    /// gRPC: its first bytes (an HTTP/2 preface) must come before the deadline.
    FirstBytes { deadline: Option<Pin<Box<Sleep>>>, listener: &'static str },
    /// HTTP: its Activity hears of every read.
    Requests(Arc<Activity>),
}

impl AsyncRead for Conn {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let result = Pin::new(&mut this.io).poll_read(cx, buf);
        let got_bytes = buf.filled().len() > before;
        match &mut this.watch {
            Watch::Requests(activity) if got_bytes => activity.read_some(),
            Watch::FirstBytes { deadline, .. } if got_bytes => *deadline = None,
            Watch::FirstBytes { deadline: Some(deadline), listener } if result.is_pending() => {
                if deadline.as_mut().poll(cx).is_ready() {
                    closed_for(listener, "header");
                    return Poll::Ready(Err(io::Error::new(io::ErrorKind::TimedOut, "nothing received")));
                }
            }
            _ => {}
        }
        result
    }
}

impl AsyncWrite for Conn {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

impl Connected for Conn {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}

fn closed_for(listener: &'static str, phase: &'static str) {
    metrics::counter!("cyllm_sidecar_connections_timed_out_total", "listener" => listener, "phase" => phase).increment(1);
}

/// What an HTTP connection is doing: requests open, and since when it has been waiting.
struct Activity {
    open: AtomicUsize,
    waiting: Mutex<Waiting>,
}

struct Waiting {
    /// Accepted, or its last request ended.
    since: Instant,
    /// The first byte read since then: a request head is coming in.
    first_byte: Option<Instant>,
}

impl Activity {
    fn new() -> Arc<Self> {
        Arc::new(Self { open: AtomicUsize::new(0), waiting: Mutex::new(Waiting { since: Instant::now(), first_byte: None }) })
    }

    fn begin(self: &Arc<Self>) -> RequestGuard {
        self.open.fetch_add(1, Ordering::AcqRel);
        self.waiting.lock().unwrap().first_byte = None;
        RequestGuard(self.clone())
    }

    fn read_some(&self) {
        if self.open.load(Ordering::Acquire) == 0 {
            self.waiting.lock().unwrap().first_byte.get_or_insert_with(Instant::now);
        }
    }

    /// When the connection is to be closed, and why; None while a request is open.
    fn deadline(&self, limits: &Limits) -> Option<(Instant, &'static str)> {
        if self.open.load(Ordering::Acquire) > 0 {
            return None;
        }
        let waiting = self.waiting.lock().unwrap();
        match waiting.first_byte {
            Some(first) => limits.header_read_timeout.map(|t| (first + t, "header")),
            None => limits.idle_timeout.map(|t| (waiting.since + t, "idle")),
        }
    }
}

/// Held from a request's head until its response body is sent or dropped.
struct RequestGuard(Arc<Activity>);

impl Drop for RequestGuard {
    fn drop(&mut self) {
        if self.0.open.fetch_sub(1, Ordering::AcqRel) == 1 {
            *self.0.waiting.lock().unwrap() = Waiting { since: Instant::now(), first_byte: None };
        }
    }
}

/// A response body that keeps its request open until it is done.
struct Guarded {
    inner: Body,
    _guard: RequestGuard,
}

impl HttpBody for Guarded {
    type Data = <Body as HttpBody>::Data;
    type Error = <Body as HttpBody>::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// Resolves when the connection has been waiting past its deadline, with the phase it was in.
async fn expired(activity: &Activity, limits: &Limits) -> &'static str {
    loop {
        let now = Instant::now();
        match activity.deadline(limits) {
            Some((at, phase)) if at <= now => return phase,
            // Re-checked at least every second: a request may open or end meanwhile.
            Some((at, _)) => tokio::time::sleep_until(at.min(now + Duration::from_secs(1))).await,
            None => tokio::time::sleep(Duration::from_secs(1)).await,
        }
    }
}

async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|stopped| *stopped).await;
}

/// Serves `app` over HTTP/1 and HTTP/2 until `stop`, then lets open requests finish.
pub async fn serve_http(listener: Listener, app: Router, mut stop: watch::Receiver<bool>) -> io::Result<()> {
    let listener = Arc::new(listener);
    let limits = listener.limits;
    let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    builder.http1().timer(TokioTimer::new()).header_read_timeout(None).max_buf_size(limits.max_header_bytes);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(limits.http2_max_streams)
        .max_header_list_size(u32::try_from(limits.max_header_bytes).unwrap_or(u32::MAX));
    let builder = Arc::new(builder);
    loop {
        let (stream, slot) = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = stopped(&mut stop) => break,
        };
        let (app, builder, mut stop, name) = (app.clone(), builder.clone(), stop.clone(), listener.name);
        tokio::spawn(async move {
            let activity = Activity::new();
            let requests = activity.clone();
            let service = hyper::service::service_fn(move |request: hyper::Request<Incoming>| {
                let guard = requests.begin();
                let mut app = app.clone();
                async move {
                    let response = app.call(request).await?;
                    Ok::<_, Infallible>(response.map(|inner| Body::new(Guarded { inner, _guard: guard })))
                }
            });
            let io = TokioIo::new(Conn { io: stream, watch: Watch::Requests(activity.clone()), _slot: slot });
            let connection = builder.serve_connection_with_upgrades(io, service);
            tokio::pin!(connection);
            tokio::select! {
                _ = connection.as_mut() => return,
                _ = stopped(&mut stop) => connection.as_mut().graceful_shutdown(),
                phase = expired(&activity, &limits) => {
                    closed_for(name, phase);
                    if phase == "idle" {
                        // HTTP/2 clients get a GOAWAY; an idle HTTP/1 connection closes at once.
                        connection.as_mut().graceful_shutdown();
                        let _ = tokio::time::timeout(Duration::from_secs(1), connection.as_mut()).await;
                    }
                    return; // a head still coming in would keep a graceful close waiting: cut off
                }
            }
            let _ = connection.await;
        });
    }
    listener.all_closed().await;
    Ok(())
}
