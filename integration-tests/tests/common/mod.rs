//! An in-process fleet for the telemetry tests: a control plane, one engine-sim and one data plane
//! (HTTP and its ext_proc endpoint picker) on loopback ports, with the endpoint `chat` (PREFIX_AWARE over the engine) created through the
//! SDK, and a plain HTTP client.

#![allow(dead_code)]

pub mod otlp;

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use integration_tests::{variant, InProcessControlPlane};
use proto::RoutingStrategy;
use test_support::{bind_loopback, wait_for, InProcessServer};

pub const ENDPOINT: &str = "chat";
pub const NODE_ID: &str = "dp-telemetry";

pub struct Fleet {
    pub control_plane: InProcessControlPlane,
    pub engine_url: String,
    pub router: String,
    /// The data plane's endpoint picker (ext_proc), `ip:port`.
    pub picker: String,
    pub http: Client<HttpConnector, Full<Bytes>>,
    _dir: tempfile::TempDir,
}

/// A response: status, headers and body.
pub struct Answer {
    pub status: u16,
    pub headers: http::HeaderMap,
    pub body: Bytes,
}

impl Fleet {
    /// Starts everything and waits until the data plane is ready. The SDK calls run inside a
    /// `prefixctl` span, as the CLI's do.
    pub async fn start() -> Self {
        Self::start_with(false).await
    }

    /// [`Self::start`] with the control plane's `GET /metrics` served too.
    pub async fn start_with_control_plane_metrics() -> Self {
        Self::start_with(true).await
    }

    async fn start_with(control_plane_metrics: bool) -> Self {
        use tracing::Instrument as _;
        let dir = tempfile::tempdir().unwrap();
        let control_plane = if control_plane_metrics {
            InProcessControlPlane::start_with_metrics(dir.path()).await
        } else {
            InProcessControlPlane::start(dir.path()).await
        };

        let engine_url = integration_tests::spawn_engine_sim(0.01).await;

        let client = proto::client::Client::connect(control_plane.url.clone())
            .await
            .unwrap();
        async {
            let variants = vec![variant("v1", RoutingStrategy::PrefixAware, &[&engine_url])];
            client
                .create_endpoint_config(ENDPOINT, variants)
                .await
                .unwrap();
            client.create_endpoint(ENDPOINT, ENDPOINT).await.unwrap();
        }
        .instrument(tracing::info_span!(
            "prefixctl",
            otel.name = "setup",
            otel.kind = "client"
        ))
        .await;

        let ext_proc = bind_loopback().await;
        let picker = ext_proc.local_addr().unwrap().to_string();
        let config = data_plane::Config {
            control_plane: control_plane.url.clone(),
            node_id: Some(NODE_ID.into()),
            default_endpoint: Some(ENDPOINT.into()),
            ..data_plane::Config::default()
        };
        let router = InProcessServer::start(|l, stop| {
            data_plane::serve_with_picker(l, Some(ext_proc), config, stop)
        })
        .await
        .detach();
        let router = format!("http://{router}");

        let http = Client::builder(TokioExecutor::new()).build_http();
        let fleet = Fleet {
            control_plane,
            engine_url,
            router,
            picker,
            http,
            _dir: dir,
        };
        wait_for(
            "the data plane to apply a routing table",
            Duration::from_secs(15),
            || async {
                let ready = fleet.get("/readyz").await;
                (ready.status == 200).then_some(())
            },
        )
        .await;
        fleet
    }

    pub async fn get(&self, path: &str) -> Answer {
        let req = http::Request::get(format!("{}{path}", self.router))
            .body(Full::new(Bytes::new()))
            .unwrap();
        self.send(req).await
    }

    /// One non-streaming chat completion through the data plane, with `headers` added.
    pub async fn chat(&self, content: &str, headers: &[(&str, &str)]) -> Answer {
        let body = serde_json::json!({
            "model": ENDPOINT,
            "max_tokens": 4,
            "messages": [{ "role": "user", "content": content }],
        });
        let mut req = http::Request::post(format!("{}/v1/chat/completions", self.router))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(serde_json::to_vec(&body).unwrap())))
            .unwrap();
        for (name, value) in headers {
            req.headers_mut().insert(
                http::HeaderName::from_bytes(name.as_bytes()).unwrap(),
                value.parse().unwrap(),
            );
        }
        self.send(req).await
    }

    /// A POST of a JSON body through the data plane.
    pub async fn post_json(&self, path: &str, body: &serde_json::Value) -> Answer {
        let req = http::Request::post(format!("{}{path}", self.router))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(serde_json::to_vec(body).unwrap())))
            .unwrap();
        self.send(req).await
    }

    async fn send(&self, req: http::Request<Full<Bytes>>) -> Answer {
        let resp = tokio::time::timeout(Duration::from_secs(30), self.http.request(req))
            .await
            .expect("an answer within 30 s")
            .expect("the data plane answers");
        let (parts, body) = resp.into_parts();
        let body = body.collect().await.expect("a whole body").to_bytes();
        Answer {
            status: parts.status.as_u16(),
            headers: parts.headers,
            body,
        }
    }
}
