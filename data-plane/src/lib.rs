//! prefix-router data plane: a stateless HTTP router for fleets of LLM inference servers.
//!
//! Map:
//! - [`config`]: flags / settings ([`Config`]).
//! - [`table`]: the validated routing table (`TryFrom<proto::RoutingTable>`), per-instance state
//!   reused across tables.
//! - `watch`: the `WatchRoutingTable` stream: validate, `ArcSwap::store`, ACK/NACK, reconnect
//!   with backoff, `--table-cache`.
//! - [`prompt`]: the affinity key and the whole prompt's blocks, hashed from the body bytes
//!   (canonical prompt text, chained blocks).
//! - [`placement`]: endpoint / variant / instance choice: RANDOM, LEAST_OUTSTANDING_REQUESTS,
//!   PREFIX_AWARE (one cost per instance over a [`prefix_index::PrefixIndex`] and its queue;
//!   the cost and its constants in [`placement`] and [`placement::Tuning`]).
//! - [`usage`]: the engines' own cache reports, read from response bodies as they pass, which
//!   teach the prefix index each instance's capacity.
//! - [`load`]: in-flight counters (an RAII guard held until the response body ends) and passive
//!   health (ejection after repeated failures).
//! - `proxy`: HTTP handling: dispatch and admission (`proxy`), the request read
//!   (`proxy::request`), forwarding with one retry over pooled keep-alive connections
//!   (`proxy::forward`, `upstream`); `response`: the streamed response body and JSON errors;
//!   `spans`: the `route` / `upstream` spans (W3C `traceparent` in and out).
//! - [`flow`]: flow control (a request waits in the router while every instance it may use is
//!   full), over [`queue`] (a variant's waiters) and [`priority`] (tenants, priorities, what an
//!   API key says).
//! - [`metrics`]: counters and [`histogram`]s in atomics, described at scrape time and encoded by
//!   the `prometheus` crate (`telemetry::exposition`); [`route_stats`]: each route's counters,
//!   by [`decision`] and status.
//! - [`models`]: `GET /v1/models` from the routing table (every other `/v1/*` path is proxied).
//!
//! Invariants:
//! - The data plane never writes state anywhere but memory, except the optional table cache file.
//! - A request keeps the table it started with (it holds an `Arc`); a swap never blocks requests.
//! - An invalid table is NACKed and the last good one keeps serving; with the control plane gone,
//!   routing goes on (static stability).
//! - Placement depends on the table, the prompt, in-flight counts, and this router's prefix
//!   index (what it sent where, and what the engines reported); a prompt no instance is known to
//!   hold goes to its key's rendezvous top while that one is not loaded, so replicas with the
//!   same table send a new prefix to the same instance.
//! - No lock is held across an `.await`; the request path takes no global lock (one mutex per
//!   PREFIX_AWARE variant guards its prefix index, held for microseconds).

use std::future::Future;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;

mod access;
pub mod config;
pub mod decision;
pub mod ext_proc;
pub mod flow;
pub mod histogram;
mod kv;
pub mod kv_index;
pub mod load;
pub mod metrics;
pub mod models;
pub mod placement;
pub mod prefix_index;
pub mod priority;
pub mod prompt;
mod proxy;
pub mod queue;
mod response;
pub mod route_stats;
mod spans;
pub mod table;
mod tls;
mod upstream;
pub mod usage;
mod watch;

pub use config::Config;
pub use proxy::{
    X_DECISION, X_ENDPOINT_NAME, X_INSTANCE, X_PREFIX_AWARE_ID, X_TABLE_VERSION, X_TARGET_VARIANT,
    X_VARIANT,
};

/// Aborts a background task when dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Completes once the shutdown stage reaches `level` (or the sender is gone).
async fn reached(stop: &mut tokio::sync::watch::Receiver<u8>, level: u8) {
    let _ = stop.wait_for(|&s| s >= level).await;
}

/// What `serve` reads from files before it serves: the API keys, the listener's TLS and the
/// control plane's TLS settings.
struct Prepared {
    access: access::Access,
    tls: Option<tokio_rustls::TlsAcceptor>,
    control_plane_tls: proto::client::TlsOptions,
    upstream_tls: tokio_rustls::TlsConnector,
}

fn prepare(config: &Config) -> anyhow::Result<Prepared> {
    let access = access::Access::load(config)?;
    let tls = match (&config.tls_cert, &config.tls_key) {
        (Some(cert), Some(key)) => Some(tls::acceptor(cert, key)?),
        _ => None,
    };
    let control_plane_tls = proto::client::TlsOptions::from_files(
        config.ca_cert.as_deref(),
        config
            .control_plane_tls_cert
            .as_deref()
            .zip(config.control_plane_tls_key.as_deref()),
    )?;
    if let Some(path) = &config.auth_token_file {
        credentials::read_first(path).map_err(|e| anyhow::anyhow!("--auth-token-file: {e}"))?;
    }
    let upstream_tls = upstream::tls_connector(config.upstream_ca_cert.as_deref())?;
    Ok(Prepared {
        access,
        tls,
        control_plane_tls,
        upstream_tls,
    })
}

/// Checks every file the flags name (keys, tokens, certificates) as `serve` will read them, so
/// the binary can fail before it says it listens.
pub fn check_files(config: &Config) -> anyhow::Result<()> {
    prepare(config).map(drop)
}

/// Serves the router on `listener` until `shutdown` completes, then drains: stops accepting,
/// lets in-flight requests finish (up to `--shutdown-grace-ms`) and returns.
///
/// Connections are accepted on the caller's runtime and handed to `--workers` threads (to the one
/// serving the fewest connections), each running a single-threaded runtime that keeps the
/// connection, and the upstream connections its requests use, on that thread: no task moves
/// between threads and no idle thread is woken to look for work (on the router_overhead
/// benchmark, tokio's work-stealing runtime cost about 20 µs of CPU more per request). The table
/// watch runs on the caller's runtime too.
///
/// Loads `--table-cache` first (if any), and watches the control plane in the background for as
/// long as it serves.
pub async fn serve(
    listener: TcpListener,
    config: Config,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    serve_with_picker(listener, None, config, shutdown).await
}

/// [`serve`], and with `ext_proc` the endpoint picker ([`ext_proc`]) on that listener too, from
/// the same table and placement; it stops with the HTTP listener and its streams get the same
/// grace period.
pub async fn serve_with_picker(
    listener: TcpListener,
    ext_proc: Option<TcpListener>,
    config: Config,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let Prepared {
        access,
        tls,
        control_plane_tls,
        upstream_tls,
    } = prepare(&config)?;
    let router = Arc::new(proxy::Router::new(&config, access, upstream_tls));
    let _key_reload = router
        .access
        .api_keys()
        .map(|keys| AbortOnDrop(keys.spawn_reload("API key file")));
    let _upstream_key_reload = router
        .access
        .upstream_key()
        .map(|key| AbortOnDrop(key.spawn_reload("upstream API key file")));
    if let Some(path) = &config.table_cache {
        match watch::load_cache(&router, path) {
            Ok(Some(version)) => {
                tracing::info!(version, cache = %path.display(), "routing table loaded from cache")
            }
            Ok(None) => {}
            Err(e) => tracing::warn!("{e}; waiting for the control plane"),
        }
    }
    let node_id = config.resolved_node_id();
    let _watch = AbortOnDrop(tokio::spawn(watch::run(
        router.clone(),
        config.control_plane.clone(),
        node_id.clone(),
        config.table_cache.clone(),
        watch::ControlPlaneCredentials {
            token_file: config.auth_token_file.clone(),
            tls: control_plane_tls,
        },
    )));
    let _kv_events = AbortOnDrop(tokio::spawn(kv::run(router.clone())));
    let workers = router.metrics.worker_connections.len();
    if let Ok(addr) = listener.local_addr() {
        tracing::info!(%addr, node_id, workers, control_plane = %config.control_plane, "data plane serving");
    }

    // 0: serving, 1: draining (finish in-flight requests), 2: grace over (close now).
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(0u8);
    let picker = match ext_proc {
        Some(l) => Some(spawn_picker(router.clone(), l, stop_rx.clone())?),
        None => None,
    };
    // Every worker thread and connection task holds a clone; `recv` returns None once all are
    // gone.
    let (drain_tx, mut drain_rx) = tokio::sync::mpsc::channel::<()>(1);
    let mut handoff = Vec::with_capacity(workers);
    for worker in 0..workers {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        handoff.push(tx);
        let (router, stop, drain) = (router.clone(), stop_rx.clone(), drain_tx.clone());
        let settings = ConnectionSettings::new(&config, tls.clone());
        std::thread::Builder::new()
            .name(format!("data-plane-{worker}"))
            .spawn(move || {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build();
                let runtime = match runtime {
                    Ok(r) => r,
                    Err(e) => {
                        tracing::error!("worker {worker}: cannot start a runtime: {e}");
                        return;
                    }
                };
                upstream::set_worker(worker);
                runtime.block_on(worker_loop(worker, rx, router, stop, drain, settings));
            })?;
    }
    let mut shutdown = std::pin::pin!(shutdown);
    let mut next = 0;
    loop {
        let stream = tokio::select! {
            _ = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of file descriptors and the like: wait a little rather than spin.
                    tracing::warn!("accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                }
            },
        };
        hand_off(
            stream,
            &handoff,
            &router.metrics.worker_connections,
            &mut next,
        );
    }
    // Connections the kernel completed before the shutdown but nobody accepted yet: closing
    // the listener would reset them, requests already sent included. They are served (one
    // request each) like the connections that were accepted in time.
    while let Poll::Ready(Ok((stream, _))) =
        std::future::poll_fn(|cx| Poll::Ready(listener.poll_accept(cx))).await
    {
        hand_off(
            stream,
            &handoff,
            &router.metrics.worker_connections,
            &mut next,
        );
    }
    drop(listener);
    drop(handoff);
    let _ = stop_tx.send(1);
    // requests waiting for an instance are answered now (503), not cut at the end of the grace
    router.flow.drain();
    drop(drain_tx);
    let grace = Duration::from_millis(config.shutdown_grace_ms);
    if tokio::time::timeout(grace, drain_rx.recv()).await.is_err() {
        tracing::warn!(
            ?grace,
            "shutdown grace period over; closing the remaining connections"
        );
        let _ = stop_tx.send(2);
        let _ = drain_rx.recv().await;
    }
    if let Some(picker) = picker {
        // Envoy keeps its gRPC connection open: streams still open after the grace are cut.
        match tokio::time::timeout(grace, picker).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(e))) => tracing::warn!("endpoint picker: {e}"),
            Ok(Err(_)) => tracing::warn!("endpoint picker thread ended without its result"),
            Err(_) => tracing::warn!("endpoint picker streams still open after the grace period"),
        }
    }
    Ok(())
}

/// The endpoint picker on a thread and single-threaded runtime of its own, as each HTTP worker:
/// Envoy's messages, the h2 connection task and each stream's replies then never wake another
/// thread (on router_overhead's ENVOY=1 run such wake-ups were most of the picker's cost). Its
/// result arrives on the receiver when it stops (stage 1 of `stop`).
fn spawn_picker(
    router: Arc<proxy::Router>,
    listener: TcpListener,
    mut stop: tokio::sync::watch::Receiver<u8>,
) -> anyhow::Result<tokio::sync::oneshot::Receiver<Result<(), tonic::transport::Error>>> {
    if let Ok(addr) = listener.local_addr() {
        tracing::info!(%addr, "endpoint picker (ext_proc) serving");
    }
    let listener = listener.into_std()?;
    let (done_tx, done_rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("data-plane-picker".into())
        .spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build();
            let result =
                runtime.map_err(anyhow::Error::from).and_then(|rt| {
                    rt.block_on(async move {
                        let listener = TcpListener::from_std(listener)?;
                        let served = ext_proc::serve(router, listener, async move {
                            reached(&mut stop, 1).await
                        })
                        .await;
                        let _ = done_tx.send(served);
                        Ok(())
                    })
                });
            if let Err(e) = result {
                tracing::error!("endpoint picker: cannot start: {e}");
            }
        })?;
    Ok(done_rx)
}

/// Hands an accepted connection to the worker with the fewest open connections (ties taken in
/// turn, from `next`).
fn hand_off(
    stream: tokio::net::TcpStream,
    handoff: &[tokio::sync::mpsc::UnboundedSender<std::net::TcpStream>],
    open: &[std::sync::atomic::AtomicU64],
    next: &mut usize,
) {
    let _ = stream.set_nodelay(true);
    let Ok(stream) = stream.into_std() else {
        return;
    };
    let n = handoff.len();
    let worker = (0..n)
        .map(|i| (*next + i) % n)
        .min_by_key(|&w| open[w].load(Relaxed))
        .unwrap_or(0);
    *next = (worker + 1) % n;
    open[worker].fetch_add(1, Relaxed);
    let _ = handoff[worker].send(stream);
}

/// One worker: serves the connections handed to it on this thread's runtime until the hand-off
/// channel closes (the drain stage), then waits for its connections to finish (each holds a
/// `drain` clone). Its open connections are counted in the router's metrics.
async fn worker_loop(
    worker: usize,
    mut connections_in: tokio::sync::mpsc::UnboundedReceiver<std::net::TcpStream>,
    router: Arc<proxy::Router>,
    stop: tokio::sync::watch::Receiver<u8>,
    drain: tokio::sync::mpsc::Sender<()>,
    settings: ConnectionSettings,
) {
    // Connections of this worker: they must finish before its runtime (returning) drops them.
    let mut connections = tokio::task::JoinSet::new();
    while let Some(stream) = connections_in.recv().await {
        // Finished connections' results, so the set does not grow with the connections served.
        while connections.try_join_next().is_some() {}
        let stream = match tokio::net::TcpStream::from_std(stream) {
            Ok(s) => s,
            Err(e) => {
                router.metrics.worker_connections[worker].fetch_sub(1, Relaxed);
                tracing::warn!("cannot serve an accepted connection: {e}");
                continue;
            }
        };
        let router = router.clone();
        let mut stop = stop.clone();
        let drain = drain.clone();
        let settings = settings.clone();
        // The client's address, for throttling failed authentication per peer.
        let peer = stream
            .peer_addr()
            .map(|a| a.ip())
            .unwrap_or(std::net::Ipv4Addr::UNSPECIFIED.into());
        connections.spawn(async move {
            match &settings.tls {
                None => {
                    serve_connection(TokioIo::new(stream), peer, &router, &mut stop, &settings)
                        .await
                }
                Some(acceptor) => {
                    if let Some(tls) = accept_tls(stream, acceptor, &settings).await {
                        serve_connection(TokioIo::new(tls), peer, &router, &mut stop, &settings)
                            .await;
                    }
                }
            }
            router.metrics.worker_connections[worker].fetch_sub(1, Relaxed);
            drop(drain);
        });
    }
    while connections.join_next().await.is_some() {}
}

/// How connections are served: HTTP/1 limits and TLS.
#[derive(Clone)]
struct ConnectionSettings {
    max_headers: usize,
    max_header_bytes: usize,
    header_read_timeout: Duration,
    tls: Option<tokio_rustls::TlsAcceptor>,
}

impl ConnectionSettings {
    fn new(config: &Config, tls: Option<tokio_rustls::TlsAcceptor>) -> Self {
        ConnectionSettings {
            max_headers: usize::try_from(config.max_headers).unwrap_or(100),
            max_header_bytes: usize::try_from(config.max_header_bytes).unwrap_or(64 * 1024),
            header_read_timeout: Duration::from_millis(config.header_read_timeout_ms),
            tls,
        }
    }
}

/// The TLS handshake, within the header read timeout. A client that speaks plain HTTP gets a
/// 400 that says to use https:// (rather than a reset it cannot explain).
async fn accept_tls(
    stream: tokio::net::TcpStream,
    acceptor: &tokio_rustls::TlsAcceptor,
    settings: &ConnectionSettings,
) -> Option<tokio_rustls::server::TlsStream<tokio::net::TcpStream>> {
    use tokio::io::AsyncWriteExt as _;
    let handshake = async {
        let mut first = [0u8; 1];
        let mut stream = stream;
        if matches!(stream.peek(&mut first).await, Ok(1) if first[0] != tls::HANDSHAKE) {
            let _ = stream.write_all(&tls::plaintext_refusal()).await;
            let _ = stream.shutdown().await;
            return None;
        }
        match acceptor.accept(stream).await {
            Ok(tls) => Some(tls),
            Err(e) => {
                tracing::debug!("TLS handshake failed: {e}");
                None
            }
        }
    };
    tokio::time::timeout(settings.header_read_timeout, handshake)
        .await
        .ok()
        .flatten()
}

/// Whether a connection has begun its first request (set by the service, waited for by a
/// drain that finds the connection still fresh).
#[derive(Default)]
struct FirstRequest {
    started: std::sync::atomic::AtomicBool,
    notify: tokio::sync::Notify,
}

/// Serves one connection until it closes, or drains it once the shutdown stage is reached.
async fn serve_connection<I>(
    io: TokioIo<I>,
    peer: std::net::IpAddr,
    router: &Arc<proxy::Router>,
    stop: &mut tokio::sync::watch::Receiver<u8>,
    settings: &ConnectionSettings,
) where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let handler = router.clone();
    let first = Arc::new(FirstRequest::default());
    let seen = first.clone();
    let service = service_fn(move |req| {
        if !seen.started.swap(true, Relaxed) {
            seen.notify.notify_one();
        }
        handler.clone().handle(req, peer)
    });
    let conn = http1::Builder::new()
        .timer(TokioTimer::new())
        .keep_alive(true)
        .max_headers(settings.max_headers)
        .max_header_size(settings.max_header_bytes)
        .header_read_timeout(settings.header_read_timeout)
        .serve_connection(io, service);
    let mut conn = std::pin::pin!(conn);
    tokio::select! {
        _ = conn.as_mut() => {}
        _ = reached(stop, 1) => {
            // A connection accepted just before the shutdown whose request has not been read
            // yet: closing it now would reset a request the client has already sent, and the
            // client cannot know whether to send it again. Its first request is read (within
            // the header read timeout) and answered, then it closes.
            if !first.started.load(Relaxed) {
                tokio::select! {
                    _ = conn.as_mut() => return,
                    _ = first.notify.notified() => {}
                    _ = tokio::time::sleep(settings.header_read_timeout) => {}
                    _ = reached(stop, 2) => return,
                }
            }
            conn.as_mut().graceful_shutdown();
            tokio::select! {
                _ = conn.as_mut() => {}
                _ = reached(stop, 2) => {}
            }
        }
    }
}
