//! Test fixtures: a channel-backed mock control plane, tiny hyper model servers, a router started
//! in-process on 127.0.0.1:0, and an HTTP client.

#![allow(dead_code)]

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use data_plane::Config;
use http::{Request, Response, StatusCode};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use prost::Message as _;
use proto::routing_discovery_server::{RoutingDiscovery, RoutingDiscoveryServer};
use proto::{
    EndpointRoutes, PrefixAwareRoutingConfig, RoutingConfig, RoutingStrategy, VariantRoutes,
    WatchRoutingTableRequest, WatchRoutingTableResponse,
};
use test_support::{bind_loopback, InProcessServer};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tokio_stream::StreamExt as _;

/// How long a test waits for anything.
pub const WAIT: Duration = Duration::from_secs(15);

// ---------------------------------------------------------------- mock control plane

/// A `RoutingDiscovery` server fed by the test: `push` a table down a watch sender; every router
/// message (hello, ACK, NACK) comes back on `requests`.
pub struct MockControlPlane {
    pub addr: SocketAddr,
    pub url: String,
    tables: watch::Sender<Option<proto::RoutingTable>>,
    requests: tokio::sync::Mutex<mpsc::UnboundedReceiver<WatchRoutingTableRequest>>,
    kill: watch::Sender<bool>,
    server: tokio::task::JoinHandle<()>,
}

struct MockService {
    tables: watch::Receiver<Option<proto::RoutingTable>>,
    requests: mpsc::UnboundedSender<WatchRoutingTableRequest>,
    kill: watch::Receiver<bool>,
    nonce: Arc<AtomicU64>,
}

type ResponseStream = Pin<
    Box<dyn tokio_stream::Stream<Item = Result<WatchRoutingTableResponse, tonic::Status>> + Send>,
>;

#[tonic::async_trait]
impl RoutingDiscovery for MockService {
    type WatchRoutingTableStream = ResponseStream;

    async fn watch_routing_table(
        &self,
        request: tonic::Request<tonic::Streaming<WatchRoutingTableRequest>>,
    ) -> Result<tonic::Response<ResponseStream>, tonic::Status> {
        let mut inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(16);
        let mut tables = self.tables.clone();
        let mut kill = self.kill.clone();
        let requests = self.requests.clone();
        let nonce = self.nonce.clone();
        tokio::spawn(async move {
            let Ok(Some(hello)) = inbound.message().await else {
                return;
            };
            let mut router_version = hello.applied_version;
            let _ = requests.send(hello);
            loop {
                let current = tables.borrow_and_update().clone();
                if let Some(table) = current {
                    if table.version != router_version {
                        router_version = table.version;
                        let response = WatchRoutingTableResponse {
                            version: table.version,
                            nonce: format!("n{}", nonce.fetch_add(1, SeqCst)),
                            routing_table: table.encode_to_vec().into(),
                        };
                        if tx.send(Ok(response)).await.is_err() {
                            return;
                        }
                    }
                }
                tokio::select! {
                    changed = tables.changed() => if changed.is_err() { return },
                    msg = inbound.message() => match msg {
                        Ok(Some(m)) => { let _ = requests.send(m); }
                        _ => return,
                    },
                    _ = kill.wait_for(|&k| k) => return,
                }
            }
        });
        Ok(tonic::Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

impl MockControlPlane {
    pub async fn start() -> Self {
        Self::start_on(bind_loopback().await).await
    }

    pub async fn start_on(listener: TcpListener) -> Self {
        let addr = listener.local_addr().unwrap();
        let (tables, tables_rx) = watch::channel(None);
        let (req_tx, req_rx) = mpsc::unbounded_channel();
        let (kill, kill_rx) = watch::channel(false);
        let service = MockService {
            tables: tables_rx,
            requests: req_tx,
            kill: kill_rx.clone(),
            nonce: Arc::default(),
        };
        let mut kill_server = kill_rx;
        let server = tokio::spawn(async move {
            let _ = tonic::transport::Server::builder()
                .add_service(RoutingDiscoveryServer::new(service))
                .serve_with_incoming_shutdown(TcpListenerStream::new(listener), async move {
                    let _ = kill_server.wait_for(|&k| k).await;
                })
                .await;
        });
        MockControlPlane {
            addr,
            url: format!("http://{addr}"),
            tables,
            requests: tokio::sync::Mutex::new(req_rx),
            kill,
            server,
        }
    }

    pub fn push(&self, table: proto::RoutingTable) {
        self.tables.send_replace(Some(table));
    }

    /// The next message any router sent.
    pub async fn next_request(&self) -> WatchRoutingTableRequest {
        let mut rx = self.requests.lock().await;
        tokio::time::timeout(WAIT, rx.recv())
            .await
            .expect("no message from the router")
            .expect("closed")
    }

    /// Waits for an ACK of `version` (skipping other messages).
    pub async fn ack(&self, version: u64) -> WatchRoutingTableRequest {
        loop {
            let m = self.next_request().await;
            if !m.response_nonce.is_empty()
                && m.error_detail.is_empty()
                && m.applied_version == version
            {
                return m;
            }
        }
    }

    /// Waits for a NACK (skipping other messages).
    pub async fn nack(&self) -> WatchRoutingTableRequest {
        loop {
            let m = self.next_request().await;
            if !m.error_detail.is_empty() {
                return m;
            }
        }
    }

    /// Ends every stream and stops the server; returns the address for a restart.
    pub async fn stop(self) -> SocketAddr {
        self.kill.send_replace(true);
        let _ = tokio::time::timeout(WAIT, self.server).await;
        self.addr
    }
}

// ---------------------------------------------------------------- routing tables

pub fn prefix_aware(prefix_length: u32, concurrency_threshold: u32) -> RoutingConfig {
    RoutingConfig {
        routing_strategy: RoutingStrategy::PrefixAware as i32,
        prefix_aware_routing_config: Some(PrefixAwareRoutingConfig {
            prefix_length,
            concurrency_threshold,
            ..Default::default()
        }),
        ..Default::default()
    }
}

pub fn strategy(s: RoutingStrategy) -> RoutingConfig {
    RoutingConfig {
        routing_strategy: s as i32,
        prefix_aware_routing_config: None,
        ..Default::default()
    }
}

pub fn variant<S: AsRef<str>>(name: &str, config: RoutingConfig, addresses: &[S]) -> VariantRoutes {
    VariantRoutes {
        variant_name: name.into(),
        model_name: "sim".into(),
        weight: 1.0,
        routing_config: Some(config),
        instances: addresses
            .iter()
            .map(|a| proto::Instance {
                instance_id: a.as_ref().into(),
                address: a.as_ref().into(),
            })
            .collect(),
    }
}

pub fn endpoint(name: &str, variants: Vec<VariantRoutes>) -> EndpointRoutes {
    EndpointRoutes {
        endpoint_name: name.into(),
        endpoint_config_name: format!("{name}-config"),
        endpoint_config_revision: 1,
        variants,
    }
}

pub fn table(version: u64, endpoints: Vec<EndpointRoutes>) -> proto::RoutingTable {
    proto::RoutingTable { version, endpoints }
}

/// One endpoint "e" with one variant "v1".
pub fn simple_table<S: AsRef<str>>(
    version: u64,
    config: RoutingConfig,
    addresses: &[S],
) -> proto::RoutingTable {
    table(
        version,
        vec![endpoint("e", vec![variant("v1", config, addresses)])],
    )
}

// ---------------------------------------------------------------- model servers

/// What a backend does with a request.
#[derive(Clone)]
pub enum Behavior {
    /// 200 JSON naming the backend, the path and the body length.
    Echo,
    /// This status with a JSON error body.
    Status(u16),
    /// Waits until `release` is called, then echoes.
    Hold,
    /// A `text/event-stream` body whose chunks the test sends through `stream_chunks`.
    Stream,
}

/// Path and query, headers and body of the last request a backend got.
pub type LastRequest = Arc<Mutex<Option<(String, HashMap<String, String>, Bytes)>>>;

pub struct Backend {
    pub addr: SocketAddr,
    pub url: String,
    pub hits: Arc<AtomicU64>,
    /// Requests currently inside the handler (held or streaming).
    pub active: Arc<AtomicU64>,
    behavior: Arc<Mutex<Behavior>>,
    release: watch::Sender<u64>,
    streams: Arc<Mutex<mpsc::UnboundedSender<mpsc::Sender<Bytes>>>>,
    stream_rx: tokio::sync::Mutex<mpsc::UnboundedReceiver<mpsc::Sender<Bytes>>>,
    pub last_request: LastRequest,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Backend {
    fn drop(&mut self) {
        self.task.abort();
    }
}

struct BackendState {
    name: String,
    hits: Arc<AtomicU64>,
    active: Arc<AtomicU64>,
    behavior: Arc<Mutex<Behavior>>,
    release: watch::Receiver<u64>,
    streams: Arc<Mutex<mpsc::UnboundedSender<mpsc::Sender<Bytes>>>>,
    last_request: LastRequest,
}

type BackendBody = BoxBody<Bytes, Infallible>;

async fn backend_handle(
    state: Arc<BackendState>,
    req: Request<Incoming>,
) -> Result<Response<BackendBody>, Infallible> {
    state.hits.fetch_add(1, SeqCst);
    let path = req
        .uri()
        .path_and_query()
        .map(|p| p.to_string())
        .unwrap_or_default();
    let headers: HashMap<String, String> = req
        .headers()
        .iter()
        .map(|(k, v)| {
            (
                k.to_string(),
                String::from_utf8_lossy(v.as_bytes()).into_owned(),
            )
        })
        .collect();
    let body = req
        .into_body()
        .collect()
        .await
        .map(|c| c.to_bytes())
        .unwrap_or_default();
    *state.last_request.lock().unwrap() = Some((path.clone(), headers, body.clone()));
    let behavior = state.behavior.lock().unwrap().clone();
    let echo = |state: &BackendState| {
        let json = serde_json::json!({"backend": state.name, "path": path, "body_len": body.len()});
        Response::builder()
            .header("content-type", "application/json")
            .header("x-backend", state.name.as_str())
            .body(Full::new(Bytes::from(json.to_string())).boxed())
            .unwrap()
    };
    Ok(match behavior {
        Behavior::Echo => echo(&state),
        Behavior::Status(code) => Response::builder()
            .status(code)
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(format!(r#"{{"error":"backend {code}"}}"#))).boxed())
            .unwrap(),
        Behavior::Hold => {
            // the release count before the request shows as active: a release the test sends
            // once it sees the request active always lets it go
            let mut release = state.release.clone();
            let start = *release.borrow();
            state.active.fetch_add(1, SeqCst);
            let _ = release.wait_for(|&r| r > start).await;
            state.active.fetch_sub(1, SeqCst);
            echo(&state)
        }
        Behavior::Stream => {
            let (tx, rx) = mpsc::channel::<Bytes>(16);
            let _ = state.streams.lock().unwrap().send(tx);
            let active = state.active.clone();
            active.fetch_add(1, SeqCst);
            let guard = ActiveGuard(active);
            let stream = ReceiverStream::new(rx).map(move |b| {
                let _ = &guard;
                Ok::<_, Infallible>(Frame::data(b))
            });
            Response::builder()
                .header("content-type", "text/event-stream")
                .header("cache-control", "no-cache")
                .body(BodyExt::boxed(StreamBody::new(stream)))
                .unwrap()
        }
    })
}

struct ActiveGuard(Arc<AtomicU64>);
impl Drop for ActiveGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, SeqCst);
    }
}

impl Backend {
    pub async fn start(name: &str) -> Self {
        Self::start_with(name, Behavior::Echo).await
    }

    pub async fn start_with(name: &str, behavior: Behavior) -> Self {
        let listener = bind_loopback().await;
        let addr = listener.local_addr().unwrap();
        let (release, release_rx) = watch::channel(0u64);
        let (stream_tx, stream_rx) = mpsc::unbounded_channel();
        let behavior = Arc::new(Mutex::new(behavior));
        let streams = Arc::new(Mutex::new(stream_tx));
        let state = Arc::new(BackendState {
            name: name.to_string(),
            hits: Arc::default(),
            active: Arc::default(),
            behavior: behavior.clone(),
            release: release_rx,
            streams: streams.clone(),
            last_request: Arc::default(),
        });
        let (hits, active, last_request) = (
            state.hits.clone(),
            state.active.clone(),
            state.last_request.clone(),
        );
        let task = tokio::spawn(async move {
            let mut connections = tokio::task::JoinSet::new();
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let state = state.clone();
                connections.spawn(async move {
                    let service =
                        hyper::service::service_fn(move |req| backend_handle(state.clone(), req));
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
                while connections.try_join_next().is_some() {}
            }
        });
        Backend {
            addr,
            url: format!("http://{addr}"),
            hits,
            active,
            behavior,
            release,
            streams,
            stream_rx: tokio::sync::Mutex::new(stream_rx),
            last_request,
            task,
        }
    }

    pub fn set(&self, behavior: Behavior) {
        *self.behavior.lock().unwrap() = behavior;
    }

    /// Lets every held request go.
    pub fn release(&self) {
        self.release.send_modify(|r| *r += 1);
    }

    pub fn hits(&self) -> u64 {
        self.hits.load(SeqCst)
    }

    pub fn active(&self) -> u64 {
        self.active.load(SeqCst)
    }

    /// The chunk sender of the next streaming request this backend receives.
    pub async fn next_stream(&self) -> mpsc::Sender<Bytes> {
        let mut rx = self.stream_rx.lock().await;
        tokio::time::timeout(WAIT, rx.recv())
            .await
            .expect("no streaming request")
            .expect("closed")
    }
}

pub async fn backends(n: usize) -> Vec<Backend> {
    let mut v = Vec::new();
    for i in 0..n {
        v.push(Backend::start(&format!("b{i}")).await);
    }
    v
}

pub fn urls(backends: &[Backend]) -> Vec<String> {
    backends.iter().map(|b| b.url.clone()).collect()
}

// ---------------------------------------------------------------- router and client

/// A router served in this process on a loopback port; asked to stop when dropped.
pub struct RouterHandle {
    pub addr: SocketAddr,
    server: InProcessServer,
}

impl RouterHandle {
    pub async fn start(config: Config) -> Self {
        let server = InProcessServer::start(|l, stop| data_plane::serve(l, config, stop)).await;
        RouterHandle {
            addr: server.addr,
            server,
        }
    }

    /// A router watching `cp`, with a node id.
    pub async fn watching(cp: &MockControlPlane, node_id: &str) -> Self {
        Self::watching_on_workers(cp, node_id, 0).await
    }

    /// A router watching `cp`, serving on `workers` threads (0: one per CPU).
    pub async fn watching_on_workers(cp: &MockControlPlane, node_id: &str, workers: usize) -> Self {
        Self::start(Config {
            control_plane: cp.url.clone(),
            node_id: Some(node_id.into()),
            workers,
            ..Config::default()
        })
        .await
    }

    /// Starts the graceful shutdown and returns the serve task's handle.
    pub fn begin_shutdown(&mut self) -> tokio::task::JoinHandle<anyhow::Result<()>> {
        self.server.begin_shutdown()
    }

    pub async fn shutdown(self) {
        self.server.stop_within(WAIT).await.unwrap();
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    /// Waits until /readyz reports `version`.
    pub async fn wait_version(&self, version: u64) {
        let url = self.url("/readyz");
        test_support::wait_for(
            &format!("the router serves table version {version}"),
            WAIT,
            || {
                let url = url.clone();
                async move {
                    let r = get(&url).await;
                    r.status == 200 && r.json()["table_version"] == version
                }
            },
        )
        .await;
    }

    pub async fn metrics(&self) -> String {
        get(&self.url("/metrics")).await.text()
    }
}

pub type ClientBody = BoxBody<Bytes, Infallible>;

pub fn client() -> Client<HttpConnector, ClientBody> {
    Client::builder(TokioExecutor::new()).build(HttpConnector::new())
}

/// The router's open client connections (`prefix_router_worker_connections`), read from its
/// /metrics over one kept-alive connection: the reading itself counts as exactly one of them.
pub struct ConnectionGauge {
    client: Client<HttpConnector, ClientBody>,
    url: String,
}

impl ConnectionGauge {
    pub fn new(router: &RouterHandle) -> Self {
        ConnectionGauge {
            client: client(),
            url: router.url("/metrics"),
        }
    }

    /// The open connections of each worker thread, in worker order.
    pub async fn per_worker(&self) -> Vec<u64> {
        let req = Request::get(&self.url)
            .body(Full::new(Bytes::new()).boxed())
            .unwrap();
        let r = self.client.request(req).await.unwrap();
        let m = r.into_body().collect().await.unwrap().to_bytes();
        String::from_utf8_lossy(&m)
            .lines()
            .filter_map(|l| l.strip_prefix("prefix_router_worker_connections{worker=\""))
            .map(|l| l.split_once("} ").unwrap().1.parse().unwrap())
            .collect()
    }

    /// The open connections over all workers.
    pub async fn total(&self) -> u64 {
        self.per_worker().await.iter().sum()
    }
}

#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub headers: http::HeaderMap,
    pub body: Bytes,
}

impl Reply {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or(serde_json::Value::Null)
    }
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
    pub fn header(&self, name: &str) -> &str {
        self.headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
    }
    pub fn instance(&self) -> &str {
        self.header("x-prefix-router-instance")
    }
    pub fn decision(&self) -> &str {
        self.header("x-prefix-router-decision")
    }
    /// Asserts the JSON error shape and status.
    pub fn assert_error(&self, status: u16, kind: &str) {
        assert_eq!(self.status, status, "{}", self.text());
        let v = self.json();
        assert!(
            v["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty()),
            "{}",
            self.text()
        );
        assert_eq!(v["error"]["type"], kind, "{}", self.text());
        assert_eq!(self.header("content-type"), "application/json");
    }
}

pub async fn send(req: Request<ClientBody>) -> Reply {
    let resp = tokio::time::timeout(WAIT, client().request(req))
        .await
        .expect("request timed out")
        .expect("request failed");
    let (parts, body) = resp.into_parts();
    let body = body.collect().await.expect("body").to_bytes();
    Reply {
        status: parts.status.as_u16(),
        headers: parts.headers,
        body,
    }
}

pub async fn get(url: &str) -> Reply {
    send(
        Request::get(url)
            .body(Full::new(Bytes::new()).boxed())
            .unwrap(),
    )
    .await
}

pub async fn post(url: &str, headers: &[(&str, &str)], body: impl Into<Bytes>) -> Reply {
    send(post_request(url, headers, body)).await
}

/// `post` in a task, for requests that must be in flight together.
pub fn spawn_post(
    url: &str,
    headers: &[(&str, &str)],
    body: impl Into<Bytes>,
) -> tokio::task::JoinHandle<Reply> {
    let req = post_request(url, headers, body);
    tokio::spawn(send(req))
}

pub fn post_request(
    url: &str,
    headers: &[(&str, &str)],
    body: impl Into<Bytes>,
) -> Request<ClientBody> {
    let mut b = Request::post(url).header("content-type", "application/json");
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    b.body(Full::new(body.into()).boxed()).unwrap()
}

/// A chat body.
pub fn chat(messages: &[(&str, &str)]) -> String {
    let msgs: Vec<serde_json::Value> = messages
        .iter()
        .map(|(r, c)| serde_json::json!({"role": r, "content": c}))
        .collect();
    serde_json::json!({"model": "e", "messages": msgs}).to_string()
}

pub fn status_ok(s: StatusCode) -> bool {
    s.is_success()
}
