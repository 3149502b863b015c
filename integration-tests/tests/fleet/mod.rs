//! A fleet of real binaries for the fault drills and the soak: a control plane, engine-sims each
//! behind a [`FaultProxy`], data planes watching the control plane through another proxy; and a
//! load client that records every request's outcome (status, instance, how a stream ended,
//! latency), so nothing can be lost without a trace.

#![allow(dead_code)]

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use integration_tests::fault::FaultProxy;
use integration_tests::variant;
use proto::RoutingStrategy;
use test_support::{wait_for, ChildServer};

pub const ENDPOINT: &str = "chat";
/// How long the client waits for a whole answer before it calls the request hung.
pub const CLIENT_DEADLINE: Duration = Duration::from_secs(30);

pub type Http = Client<HttpConnector, Full<Bytes>>;

pub fn http() -> Http {
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(5))
        .build_http()
}

/// One engine-sim process behind its proxy; the table names the proxy.
pub struct Engine {
    pub server: ChildServer,
    pub proxy: FaultProxy,
    args: Vec<String>,
}

impl Engine {
    pub async fn start(args: &[&str]) -> Self {
        let server = ChildServer::start("engine-sim", args).expect("engine-sim starts");
        let proxy = FaultProxy::start(server.addr).await;
        Engine {
            server,
            proxy,
            args: args.iter().map(|s| s.to_string()).collect(),
        }
    }

    /// The address routers know it by (its proxy).
    pub fn url(&self) -> String {
        self.proxy.url()
    }

    pub fn kill(&mut self) {
        self.server.kill9();
    }

    /// A new process (on a new port) behind the same proxy address.
    pub fn restart(&mut self) {
        let args: Vec<&str> = self.args.iter().map(String::as_str).collect();
        let server = ChildServer::start("engine-sim", &args).expect("engine-sim restarts");
        self.proxy.retarget(server.addr);
        self.server = server;
    }
}

/// What to start.
pub struct Spec {
    pub engines: usize,
    pub routers: usize,
    pub strategy: RoutingStrategy,
    pub engine_args: Vec<&'static str>,
    pub router_args: Vec<String>,
}

/// Owned flags.
pub fn args(a: &[&str]) -> Vec<String> {
    a.iter().map(|s| s.to_string()).collect()
}

impl Default for Spec {
    fn default() -> Self {
        Spec {
            engines: 4,
            routers: 1,
            strategy: RoutingStrategy::PrefixAware,
            // ttft 12 ms, 5 ms per token
            engine_args: vec!["--time-scale", "0.2"],
            router_args: args(&["--workers", "1"]),
        }
    }
}

pub struct Fleet {
    pub dir: tempfile::TempDir,
    pub cp: ChildServer,
    /// Routers reach the control plane through this proxy.
    pub cp_proxy: FaultProxy,
    pub engines: Vec<Engine>,
    pub routers: Vec<ChildServer>,
    pub router_args: Vec<String>,
    pub sdk: proto::client::Client,
    pub http: Http,
}

impl Fleet {
    pub async fn start(spec: Spec) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("cp");
        let cp = ChildServer::start("control-plane", &["--data-dir", data.to_str().unwrap()])
            .expect("control plane starts");
        let cp_proxy = FaultProxy::start(cp.addr).await;
        let mut engines = Vec::new();
        for _ in 0..spec.engines {
            engines.push(Engine::start(&spec.engine_args).await);
        }
        let sdk = proto::client::Client::connect(cp.url()).await.unwrap();
        let urls: Vec<String> = engines.iter().map(Engine::url).collect();
        let urls: Vec<&str> = urls.iter().map(String::as_str).collect();
        sdk.create_endpoint_config(ENDPOINT, vec![variant("v1", spec.strategy, &urls)])
            .await
            .unwrap();
        sdk.create_endpoint(ENDPOINT, ENDPOINT).await.unwrap();
        let mut fleet = Fleet {
            dir,
            cp,
            cp_proxy,
            engines,
            routers: Vec::new(),
            router_args: spec.router_args,
            sdk,
            http: http(),
        };
        for i in 0..spec.routers {
            let router = fleet.start_router(i, "127.0.0.1:0");
            fleet.routers.push(router);
        }
        for i in 0..spec.routers {
            fleet.wait_ready(i).await;
        }
        fleet
    }

    /// Starts data plane `i` on `listen` (does not wait for its table).
    pub fn start_router(&self, i: usize, listen: &str) -> ChildServer {
        let cp = self.cp_proxy.url();
        let node = format!("dp-{i}");
        let mut args = vec![
            "--control-plane",
            &cp,
            "--node-id",
            &node,
            "--default-endpoint",
            ENDPOINT,
        ];
        args.extend(self.router_args.iter().map(String::as_str));
        ChildServer::start_listening("data-plane", listen, &args, &[]).expect("data plane starts")
    }

    pub fn router_url(&self, i: usize) -> String {
        self.routers[i].url()
    }

    pub async fn wait_ready(&self, i: usize) {
        let url = format!("{}/readyz", self.router_url(i));
        let http = self.http.clone();
        wait_for(
            "a data plane to apply a table",
            Duration::from_secs(20),
            || {
                let (http, url) = (http.clone(), url.clone());
                async move { (get(&http, &url).await?.0 == 200).then_some(()) }
            },
        )
        .await;
    }

    pub async fn metrics(&self, i: usize) -> String {
        let url = format!("{}/metrics", self.router_url(i));
        get(&self.http, &url).await.expect("router /metrics").1
    }

    /// The table version data plane `i` serves (from its /metrics).
    pub async fn router_version(&self, i: usize) -> u64 {
        metric(&self.metrics(i).await, "prefix_router_table_version", &[]) as u64
    }

    pub async fn engine_metrics(&self, e: usize) -> Option<String> {
        let url = format!("{}/metrics", self.engines[e].server.url());
        get(&self.http, &url).await.map(|(_, body)| body)
    }

    pub async fn current_version(&self) -> u64 {
        self.sdk
            .describe_endpoint(ENDPOINT)
            .await
            .unwrap()
            .current_routing_table_version
    }
}

/// A GET: status and body, `None` if the server did not answer.
pub async fn get(http: &Http, url: &str) -> Option<(u16, String)> {
    let req = http::Request::get(url)
        .body(Full::new(Bytes::new()))
        .unwrap();
    let resp = tokio::time::timeout(Duration::from_secs(5), http.request(req))
        .await
        .ok()?
        .ok()?;
    let status = resp.status().as_u16();
    let body = tokio::time::timeout(Duration::from_secs(5), resp.into_body().collect())
        .await
        .ok()?
        .ok()?
        .to_bytes();
    Some((status, String::from_utf8_lossy(&body).into_owned()))
}

/// The sum of a metric's samples whose labels include every `name="value"` of `labels`.
pub fn metric(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let rest = series.strip_prefix(name)?;
            if !(rest.is_empty() || rest.starts_with('{')) {
                return None;
            }
            labels
                .iter()
                .all(|(k, v)| rest.contains(&format!("{k}=\"{v}\"")))
                .then(|| value.parse::<f64>().ok())?
        })
        .sum()
}

/// How a request ended, as a client sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Kind {
    /// A whole answer: JSON with choices, or a stream that ended with `data: [DONE]`.
    Ok,
    /// A contract error before any byte of an answer: status and the error's `type`.
    Error(u16, String),
    /// A stream that ended with an SSE error event (its `type`).
    StreamError(String),
    /// The body broke off (connection aborted) without an error event: visible to an HTTP
    /// client as a failed read, but not the contract's shape.
    Aborted(String),
    /// A body that ended cleanly but is not a whole answer: a silent truncation.
    Truncated(String),
    /// The connection was refused: the request reached no router.
    Refused,
    /// No HTTP answer at all (the connection closed or reset before a head).
    Transport(String),
    /// Nothing within [`CLIENT_DEADLINE`].
    Hung,
}

impl Kind {
    /// A short name, for tallies.
    pub fn name(&self) -> String {
        match self {
            Kind::Ok => "ok".into(),
            Kind::Error(s, t) => format!("{s} {t}"),
            Kind::StreamError(t) => format!("sse error {t}"),
            Kind::Aborted(_) => "aborted".into(),
            Kind::Truncated(_) => "truncated".into(),
            Kind::Refused => "refused".into(),
            Kind::Transport(_) => "transport".into(),
            Kind::Hung => "hung".into(),
        }
    }

    /// An outcome that breaks the promise: neither an answer nor a contract-shaped error (a
    /// refused connection, which reached no router, is not counted here).
    pub fn is_broken(&self) -> bool {
        matches!(
            self,
            Kind::Aborted(_) | Kind::Truncated(_) | Kind::Transport(_) | Kind::Hung
        )
    }
}

/// One request.
#[derive(Debug, Clone)]
pub struct Req {
    pub key: u64,
    pub stream: bool,
    pub max_tokens: u32,
}

#[derive(Debug, Clone)]
pub struct Outcome {
    pub req: Req,
    pub router: usize,
    /// Since the load started.
    pub started: Duration,
    pub latency: Duration,
    pub kind: Kind,
    pub instance: Option<String>,
    /// Tries (more than one only for a client that retries refused connections).
    pub attempts: u32,
}

/// The prompt of key `k`: distinct per key from its first characters.
pub fn prompt(key: u64) -> String {
    format!("conversation {key:06}: please summarise the attached report in three bullet points")
}

/// What a client got back: how the request ended, the instance that served it and the
/// `Retry-After` of a refusal.
#[derive(Debug, Clone)]
pub struct Answer {
    pub kind: Kind,
    pub instance: Option<String>,
    pub retry_after: Option<String>,
}

/// Sends one chat completion to `router` and classifies the outcome.
pub async fn chat(http: &Http, router: &str, req: &Req) -> (Kind, Option<String>) {
    let answer = chat_answer(http, router, req).await;
    (answer.kind, answer.instance)
}

/// [`chat`], with the refusal's `Retry-After`.
pub async fn chat_answer(http: &Http, router: &str, req: &Req) -> Answer {
    let body = serde_json::json!({
        "model": ENDPOINT,
        "max_tokens": req.max_tokens,
        "stream": req.stream,
        "messages": [{ "role": "user", "content": prompt(req.key) }],
    });
    let request = http::Request::post(format!("{router}/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(serde_json::to_vec(&body).unwrap())))
        .unwrap();
    match tokio::time::timeout(CLIENT_DEADLINE, exchange(http, request, req.stream)).await {
        Ok(r) => r,
        Err(_) => Answer {
            kind: Kind::Hung,
            instance: None,
            retry_after: None,
        },
    }
}

async fn exchange(http: &Http, request: http::Request<Full<Bytes>>, stream: bool) -> Answer {
    let resp = match http.request(request).await {
        Ok(r) => r,
        Err(e) => {
            let kind = if refused(&e) {
                Kind::Refused
            } else {
                Kind::Transport(format!("{e:?}"))
            };
            return Answer {
                kind,
                instance: None,
                retry_after: None,
            };
        }
    };
    let retry_after = resp
        .headers()
        .get(http::header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .map(String::from);
    let (kind, instance) = classify(resp, stream).await;
    Answer {
        kind,
        instance,
        retry_after,
    }
}

/// How a response ended, and the instance that served it.
async fn classify(
    resp: http::Response<hyper::body::Incoming>,
    stream: bool,
) -> (Kind, Option<String>) {
    let status = resp.status().as_u16();
    let instance = resp
        .headers()
        .get(data_plane::X_INSTANCE)
        .and_then(|v| v.to_str().ok())
        .map(String::from);
    let mut body = resp.into_body();
    let mut bytes = Vec::new();
    let mut failed = None;
    while let Some(frame) = body.frame().await {
        match frame {
            Ok(f) => {
                if let Some(d) = f.data_ref() {
                    bytes.extend_from_slice(d);
                }
            }
            Err(e) => {
                failed = Some(format!("{e:?}"));
                break;
            }
        }
    }
    let text = String::from_utf8_lossy(&bytes);
    if status != 200 {
        let v: Option<serde_json::Value> = serde_json::from_slice(&bytes).ok();
        let kind = v.as_ref().and_then(|v| v["error"]["type"].as_str());
        return match (kind, failed) {
            (Some(kind), None) => (Kind::Error(status, kind.to_string()), instance),
            (_, Some(e)) => (Kind::Aborted(format!("{status}: {e}")), instance),
            (None, None) => (Kind::Truncated(format!("{status}: {text}")), instance),
        };
    }
    if stream {
        let error_event = text
            .split("\n\n")
            .filter_map(|event| event.trim().strip_prefix("data: "))
            .filter_map(|data| serde_json::from_str::<serde_json::Value>(data).ok())
            .find_map(|v| v["error"]["type"].as_str().map(String::from));
        return match (error_event, failed) {
            (Some(t), _) => (Kind::StreamError(t), instance),
            (None, Some(e)) => (Kind::Aborted(e), instance),
            (None, None) if text.trim_end().ends_with("data: [DONE]") => (Kind::Ok, instance),
            (None, None) => (Kind::Truncated(text.chars().take(200).collect()), instance),
        };
    }
    if let Some(e) = failed {
        return (Kind::Aborted(e), instance);
    }
    match serde_json::from_slice::<serde_json::Value>(&bytes) {
        Ok(v) if v["choices"].is_array() => (Kind::Ok, instance),
        _ => (Kind::Truncated(text.chars().take(200).collect()), instance),
    }
}

/// Whether a client error is a refused connection (somewhere in its chain of causes).
fn refused(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cause = Some(e);
    while let Some(c) = cause {
        if let Some(io) = c.downcast_ref::<std::io::Error>() {
            if io.kind() == std::io::ErrorKind::ConnectionRefused {
                return true;
            }
        }
        cause = c.source();
    }
    false
}

/// Requests from `workers` concurrent clients until stopped, every outcome recorded.
pub struct Load {
    pub records: Arc<Mutex<Vec<Outcome>>>,
    pub started: Instant,
    stop: tokio::sync::watch::Sender<bool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    pub sent: Arc<AtomicU64>,
}

/// Which request number `n` is.
pub type Plan = Arc<dyn Fn(u64) -> Req + Send + Sync>;

impl Load {
    /// `routers` are tried in turn per request; with `retry_refused`, a request whose
    /// connection is refused is sent again (to the next router) until `CLIENT_DEADLINE`.
    pub fn start(
        http: Http,
        routers: Vec<String>,
        workers: usize,
        limit: Option<u64>,
        retry_refused: bool,
        plan: Plan,
    ) -> Load {
        let records = Arc::new(Mutex::new(Vec::new()));
        let started = Instant::now();
        let (stop, rx) = tokio::sync::watch::channel(false);
        let sent = Arc::new(AtomicU64::new(0));
        let routers = Arc::new(routers);
        let tasks = (0..workers)
            .map(|_| {
                let (http, routers, plan, records, sent, rx) = (
                    http.clone(),
                    Arc::clone(&routers),
                    Arc::clone(&plan),
                    Arc::clone(&records),
                    Arc::clone(&sent),
                    rx.clone(),
                );
                tokio::spawn(async move {
                    while !*rx.borrow() {
                        let n = sent.fetch_add(1, Relaxed);
                        if limit.is_some_and(|l| n >= l) {
                            break;
                        }
                        let req = plan(n);
                        let t0 = Instant::now();
                        let mut attempts = 0;
                        let (router, kind, instance) = loop {
                            let router = (n as usize + attempts as usize) % routers.len();
                            attempts += 1;
                            let (kind, instance) = chat(&http, &routers[router], &req).await;
                            if retry_refused
                                && kind == Kind::Refused
                                && t0.elapsed() < CLIENT_DEADLINE
                            {
                                tokio::time::sleep(Duration::from_millis(20)).await;
                                continue;
                            }
                            break (router, kind, instance);
                        };
                        let outcome = Outcome {
                            req,
                            router,
                            started: t0 - started,
                            latency: t0.elapsed(),
                            kind,
                            instance,
                            attempts,
                        };
                        records.lock().unwrap().push(outcome);
                    }
                })
            })
            .collect();
        Load {
            records,
            started,
            stop,
            tasks,
            sent,
        }
    }

    /// Waits (bounded) for a load started with a `limit` to send and finish all of it.
    pub async fn stop_after_limit(self) -> Vec<Outcome> {
        for t in self.tasks {
            tokio::time::timeout(Duration::from_secs(120), t)
                .await
                .expect("the load finishes")
                .expect("load worker does not panic");
        }
        std::mem::take(&mut *self.records.lock().unwrap())
    }

    pub fn completed(&self) -> usize {
        self.records.lock().unwrap().len()
    }

    /// Stops sending, waits (bounded) for the requests in flight, and returns every outcome.
    pub async fn stop(self) -> Vec<Outcome> {
        self.stop.send_replace(true);
        for t in self.tasks {
            tokio::time::timeout(CLIENT_DEADLINE + Duration::from_secs(5), t)
                .await
                .expect("load workers finish")
                .expect("load worker does not panic");
        }
        std::mem::take(&mut *self.records.lock().unwrap())
    }
}

/// Outcome counts by kind, sorted: `ok=120 sse error upstream_error=3 ...`.
pub fn tally(outcomes: &[Outcome]) -> String {
    let mut counts = std::collections::BTreeMap::new();
    for o in outcomes {
        *counts.entry(o.kind.name()).or_insert(0u64) += 1;
    }
    let mut line = counts
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(" ");
    // The first few failures in full, so a failed assertion says what went wrong.
    for o in outcomes.iter().filter(|o| o.kind != Kind::Ok).take(3) {
        line.push_str(&format!(
            "\n  {:?} at {:.2?} after {:.2?} (router {}, attempt {})",
            o.kind, o.started, o.latency, o.router, o.attempts
        ));
    }
    line
}

/// The `q` quantile of the latencies of `outcomes` (0 when empty).
pub fn quantile(outcomes: &[&Outcome], q: f64) -> Duration {
    let mut l: Vec<Duration> = outcomes.iter().map(|o| o.latency).collect();
    if l.is_empty() {
        return Duration::ZERO;
    }
    l.sort();
    l[((l.len() - 1) as f64 * q).round() as usize]
}
