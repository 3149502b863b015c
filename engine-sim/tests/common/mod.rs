//! Shared helpers: an in-process engine on 127.0.0.1:0 and a real HTTP client.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use engine_sim::{Config, Engine};
use http::{HeaderMap, Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;
use test_support::InProcessServer;
use tokio::task::JoinHandle;

/// Everything 100x faster than real time: an 8,000-token miss takes ~2.8 ms.
pub fn fast_config() -> Config {
    Config {
        listen: "127.0.0.1:0".into(),
        time_scale: 0.01,
        ..Config::default()
    }
}

pub struct TestServer {
    pub addr: SocketAddr,
    pub engine: Arc<Engine>,
    pub client: Client<HttpConnector, Full<Bytes>>,
    server: InProcessServer,
    task: Option<JoinHandle<anyhow::Result<()>>>,
}

impl TestServer {
    pub async fn start(config: Config) -> Self {
        let engine = Engine::new(config);
        let serving = Arc::clone(&engine);
        let server =
            InProcessServer::start(|l, stop| engine_sim::serve_engine(l, serving, stop)).await;
        let client = Client::builder(TokioExecutor::new()).build_http();
        Self {
            addr: server.addr,
            engine,
            client,
            server,
            task: None,
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    /// Starts a request and returns the response head with its streaming body.
    pub async fn send(&self, method: Method, path: &str, body: &str) -> http::Response<Incoming> {
        let req = Request::builder()
            .method(method)
            .uri(self.url(path))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body.to_owned())))
            .unwrap();
        tokio::time::timeout(Duration::from_secs(10), self.client.request(req))
            .await
            .expect("response head within 10 s")
            .expect("request succeeds")
    }

    /// A whole request: status, headers and the full body.
    pub async fn request(
        &self,
        method: Method,
        path: &str,
        body: &str,
    ) -> (StatusCode, HeaderMap, Bytes) {
        let resp = self.send(method, path, body).await;
        let (parts, body) = resp.into_parts();
        let bytes = tokio::time::timeout(Duration::from_secs(10), body.collect())
            .await
            .expect("body within 10 s")
            .expect("body reads")
            .to_bytes();
        (parts.status, parts.headers, bytes)
    }

    pub async fn post_json(&self, path: &str, body: &Value) -> (StatusCode, Value) {
        let (status, _, bytes) = self.request(Method::POST, path, &body.to_string()).await;
        let v = serde_json::from_slice(&bytes).unwrap_or_else(|e| {
            panic!(
                "response is not JSON ({e}): {}",
                String::from_utf8_lossy(&bytes)
            )
        });
        (status, v)
    }

    pub async fn get_text(&self, path: &str) -> (StatusCode, String) {
        let (status, _, bytes) = self.request(Method::GET, path, "").await;
        (status, String::from_utf8(bytes.to_vec()).unwrap())
    }

    /// Signals shutdown and waits for the drain to finish.
    pub async fn stop(mut self) {
        self.trigger_shutdown();
        self.join().await;
    }

    pub fn trigger_shutdown(&mut self) {
        if self.task.is_none() {
            self.task = Some(self.server.begin_shutdown());
        }
    }

    /// Waits for the drain to finish (starting the shutdown if [`Self::trigger_shutdown`] has not).
    pub async fn join(&mut self) {
        self.trigger_shutdown();
        if let Some(task) = self.task.take() {
            tokio::time::timeout(Duration::from_secs(10), task)
                .await
                .expect("serve returns within 10 s of shutdown")
                .expect("serve task does not panic")
                .expect("serve returns Ok");
        }
    }
}

/// A chat body with a long shared system prompt and a user message.
pub fn chat(system: &str, user: &str, max_tokens: u64, stream: bool) -> Value {
    serde_json::json!({
        "model": "client-model",
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": user},
        ],
        "max_tokens": max_tokens,
        "stream": stream,
    })
}

/// Prometheus text -> (sample name with labels, value), checking every family has HELP and TYPE.
pub fn parse_metrics(text: &str) -> std::collections::HashMap<String, f64> {
    let mut helped = std::collections::HashSet::new();
    let mut typed = std::collections::HashSet::new();
    let mut samples = std::collections::HashMap::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            helped.insert(rest.split(' ').next().unwrap().to_owned());
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            typed.insert(rest.split(' ').next().unwrap().to_owned());
        } else if !line.is_empty() {
            let (name, value) = line.rsplit_once(' ').expect("sample line has a value");
            let family = name.split('{').next().unwrap();
            let family = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| family.strip_suffix(s).filter(|f| typed.contains(*f)))
                .unwrap_or(family);
            assert!(
                helped.contains(family) && typed.contains(family),
                "no HELP/TYPE before {line}"
            );
            samples.insert(
                name.to_owned(),
                value.parse::<f64>().expect("numeric value"),
            );
        }
    }
    samples
}
