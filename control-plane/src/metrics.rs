//! Prometheus metrics of the control plane, served on `--metrics-listen` (`GET /metrics`):
//! gRPC calls by method and code (count and latency), open watch streams, the routing-table
//! version, and per data-plane node the version it applied and how far behind it is.
//!
//! Calls are recorded by [`crate::rpc_layer::RpcLayer`] around every gRPC request; the rest is read
//! when scraped. A call takes one short, uncontended lock (no `.await` under it).

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

use telemetry::exposition::Exposition;

use crate::discovery::NodeRegistry;
use crate::store::Store;

/// Upper bounds of the RPC latency buckets, in seconds.
const BUCKETS: [f64; 14] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// Calls and latencies of one (service, method, code).
#[derive(Debug, Default, Clone)]
struct CallStats {
    count: u64,
    sum_seconds: f64,
    /// Per bucket (not cumulative), plus one for +Inf.
    buckets: [u64; BUCKETS.len() + 1],
}

/// gRPC call statistics, keyed by (service, method, code name).
#[derive(Debug, Default)]
pub struct RpcStats {
    calls: Mutex<BTreeMap<(String, String, &'static str), CallStats>>,
}

impl RpcStats {
    /// Records one call of `path` (`/package.Service/Method`) that ended with gRPC `code` after
    /// `elapsed`. Paths the server does not serve (answered `Unimplemented`) are counted under
    /// `method="unknown"`, so clients cannot grow the label set.
    pub fn record(&self, path: &str, code: tonic::Code, elapsed: Duration) {
        let (service, method) = match path.strip_prefix('/').and_then(|p| p.split_once('/')) {
            Some((s, m))
                if code != tonic::Code::Unimplemented && !m.is_empty() && !m.contains('/') =>
            {
                (s, m)
            }
            _ => ("unknown", "unknown"),
        };
        let secs = elapsed.as_secs_f64();
        let bucket = BUCKETS.partition_point(|&b| b < secs);
        let mut calls = self.calls.lock().unwrap_or_else(|p| p.into_inner());
        let stats = calls
            .entry((service.to_string(), method.to_string(), code_label(code)))
            .or_default();
        stats.count += 1;
        stats.sum_seconds += secs;
        stats.buckets[bucket] += 1;
    }

    /// Calls recorded for `method` with `code`, for tests.
    pub fn count(&self, method: &str, code: tonic::Code) -> u64 {
        let calls = self.calls.lock().unwrap_or_else(|p| p.into_inner());
        calls
            .iter()
            .filter(|((_, m, c), _)| m == method && *c == code_label(code))
            .map(|(_, s)| s.count)
            .sum()
    }
}

/// `OK`, `InvalidArgument`, `NotFound`, ... (as gRPC's own Prometheus exporters name codes).
fn code_label(code: tonic::Code) -> &'static str {
    use tonic::Code::*;
    match code {
        Ok => "OK",
        Cancelled => "Canceled",
        Unknown => "Unknown",
        InvalidArgument => "InvalidArgument",
        DeadlineExceeded => "DeadlineExceeded",
        NotFound => "NotFound",
        AlreadyExists => "AlreadyExists",
        PermissionDenied => "PermissionDenied",
        ResourceExhausted => "ResourceExhausted",
        FailedPrecondition => "FailedPrecondition",
        Aborted => "Aborted",
        OutOfRange => "OutOfRange",
        Unimplemented => "Unimplemented",
        Internal => "Internal",
        Unavailable => "Unavailable",
        DataLoss => "DataLoss",
        Unauthenticated => "Unauthenticated",
    }
}

/// A per-node gauge's value from (current version, node status).
type NodeGauge = fn(u64, &crate::discovery::NodeStatus) -> u64;

/// What `/metrics` reads.
#[derive(Clone)]
pub struct MetricsSource {
    pub rpc: Arc<RpcStats>,
    pub nodes: Arc<NodeRegistry>,
    pub store: Arc<Store>,
    /// Failed authentications per peer ([`crate::auth`]).
    pub throttle: Arc<credentials::Throttle>,
}

impl MetricsSource {
    /// The Prometheus text exposition (encoded by the `prometheus` crate, see
    /// [`telemetry::exposition`]).
    pub fn render(&self) -> String {
        let mut out = Exposition::new();
        self.describe_rpc(&mut out);
        out.counter(
            "prefix_router_control_plane_auth_throttled_total",
            "Calls refused (UNAVAILABLE) because their peer address presented wrong tokens too often.",
        )
        .sample(&[], self.throttle.refused() as f64);
        let current = self.store.published().version;
        out.gauge(
            "prefix_router_control_plane_routing_table_version",
            "The current routing-table version.",
        )
        .sample(&[], current as f64);
        out.gauge(
            "prefix_router_control_plane_watch_streams",
            "Open WatchRoutingTable streams (data planes and other watchers).",
        )
        .sample(&[], f64::from(self.nodes.connected_streams()));
        let nodes = self.nodes.snapshot();
        let per_node: [(&str, &str, NodeGauge); 3] = [
            (
                "prefix_router_control_plane_node_applied_version",
                "Routing-table version each data-plane node last applied (ACKed).",
                |_, s| s.applied_version,
            ),
            (
                "prefix_router_control_plane_node_version_lag",
                "Current routing-table version minus the version each node applied (0: up to date).",
                |current, s| current.saturating_sub(s.applied_version),
            ),
            (
                "prefix_router_control_plane_node_connected",
                "1 while the node has a watch stream open.",
                |_, s| u64::from(s.streams > 0),
            ),
        ];
        for (name, help, value) in per_node {
            let mut family = out.gauge(name, help);
            for (node_id, status) in &nodes {
                family.sample(&[("node_id", node_id)], value(current, status) as f64);
            }
        }
        out.render()
    }

    fn describe_rpc(&self, out: &mut Exposition) {
        let calls = self
            .rpc
            .calls
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let mut requests = out.counter(
            "prefix_router_control_plane_rpc_requests_total",
            "gRPC calls handled, by service, method and code.",
        );
        for ((service, method, code), s) in &calls {
            requests.sample(
                &[("service", service), ("method", method), ("code", code)],
                s.count as f64,
            );
        }
        let mut durations = out.histogram(
            "prefix_router_control_plane_rpc_duration_seconds",
            "gRPC call latency to the response head (for streams: until the stream opened), by service, method and code.",
        );
        for ((service, method, code), s) in &calls {
            durations.buckets(
                &[("service", service), ("method", method), ("code", code)],
                BUCKETS.iter().copied().zip(s.buckets.iter().copied()),
                s.buckets[BUCKETS.len()],
                s.sum_seconds,
            );
        }
    }
}

/// Serves `GET /metrics` on `listener` until `shutdown` completes.
pub async fn serve(
    listener: TcpListener,
    source: MetricsSource,
    shutdown: impl Future<Output = ()>,
) {
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            () = &mut shutdown => return,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    tracing::warn!(error = %e, "metrics listener: accept failed");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                }
            },
        };
        let source = source.clone();
        tokio::spawn(async move {
            let service = service_fn(move |req: http::Request<hyper::body::Incoming>| {
                let response = match (req.method(), req.uri().path()) {
                    (&http::Method::GET, "/metrics") => http::Response::builder()
                        .header(
                            http::header::CONTENT_TYPE,
                            "text/plain; version=0.0.4; charset=utf-8",
                        )
                        .body(Full::new(Bytes::from(source.render()))),
                    _ => http::Response::builder()
                        .status(http::StatusCode::NOT_FOUND)
                        .body(Full::new(Bytes::from_static(
                            b"not found: this port serves GET /metrics\n",
                        ))),
                };
                std::future::ready(Ok::<_, Infallible>(response.unwrap_or_default()))
            });
            let _ = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calls_are_labelled_by_method_and_code() {
        let rpc = RpcStats::default();
        rpc.record(
            "/prefixrouter.v1.ControlPlane/CreateEndpoint",
            tonic::Code::Ok,
            Duration::from_millis(3),
        );
        rpc.record(
            "/prefixrouter.v1.ControlPlane/CreateEndpoint",
            tonic::Code::AlreadyExists,
            Duration::from_millis(1),
        );
        rpc.record(
            "/prefixrouter.v1.ControlPlane/NoSuchMethod",
            tonic::Code::Unimplemented,
            Duration::ZERO,
        );
        rpc.record("garbage", tonic::Code::Unimplemented, Duration::ZERO);
        assert_eq!(rpc.count("CreateEndpoint", tonic::Code::Ok), 1);
        assert_eq!(rpc.count("CreateEndpoint", tonic::Code::AlreadyExists), 1);
        assert_eq!(rpc.count("unknown", tonic::Code::Unimplemented), 2);

        let dir = tempfile::tempdir().unwrap();
        let source = MetricsSource {
            rpc: Arc::new(rpc),
            nodes: Arc::new(NodeRegistry::default()),
            store: Arc::new(Store::open(dir.path()).unwrap()),
            throttle: Default::default(),
        };
        let text = source.render();
        assert!(text.contains(
            "prefix_router_control_plane_rpc_requests_total{service=\"prefixrouter.v1.ControlPlane\",method=\"CreateEndpoint\",code=\"OK\"} 1"
        ), "{text}");
        assert!(text.contains("prefix_router_control_plane_rpc_duration_seconds_bucket{service=\"prefixrouter.v1.ControlPlane\",method=\"CreateEndpoint\",code=\"OK\",le=\"0.005\"} 1"), "{text}");
        assert!(text.contains("prefix_router_control_plane_rpc_duration_seconds_bucket{service=\"prefixrouter.v1.ControlPlane\",method=\"CreateEndpoint\",code=\"OK\",le=\"0.0025\"} 0"), "{text}");
        assert!(
            text.contains("prefix_router_control_plane_routing_table_version 1\n"),
            "{text}"
        );
        assert!(
            text.contains("prefix_router_control_plane_watch_streams 0\n"),
            "{text}"
        );
    }
}
