//! A tower layer around every gRPC call: records its method, code and latency in
//! [`RpcStats`], and runs it inside the caller's trace context (W3C `traceparent` from the
//! request headers, as the SDK's client sends it), so the `#[instrument]` spans of the service
//! methods join the caller's trace.
//!
//! The code is read from the response head: tonic answers a failed call with its status in the
//! headers (trailers-only); a call whose head carries no `grpc-status` succeeded as far as the
//! head goes (its status follows in the trailers).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use opentelemetry::context::FutureExt as _;
use tonic::Code;

use crate::metrics::RpcStats;

/// See the module docs.
#[derive(Clone)]
pub struct RpcLayer {
    stats: Arc<RpcStats>,
}

impl RpcLayer {
    pub fn new(stats: Arc<RpcStats>) -> Self {
        Self { stats }
    }
}

impl<S> tower_layer::Layer<S> for RpcLayer {
    type Service = RpcService<S>;

    fn layer(&self, inner: S) -> RpcService<S> {
        RpcService {
            inner,
            stats: self.stats.clone(),
        }
    }
}

/// The service [`RpcLayer`] wraps around the gRPC routes.
#[derive(Clone)]
pub struct RpcService<S> {
    inner: S,
    stats: Arc<RpcStats>,
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<S, B, R> tower_service::Service<http::Request<B>> for RpcService<S>
where
    S: tower_service::Service<http::Request<B>, Response = http::Response<R>>,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    R: 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = BoxFuture<Result<S::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let started = Instant::now();
        let path = request.uri().path().to_owned();
        let parent = telemetry::propagation::extract(request.headers());
        let call = match &parent {
            Some(cx) => {
                let _active = cx.clone().attach();
                self.inner.call(request)
            }
            None => self.inner.call(request),
        };
        let stats = self.stats.clone();
        let observed = async move {
            let result = call.await;
            let code = match &result {
                Ok(response) => grpc_status(response.headers()),
                Err(_) => Code::Unknown,
            };
            stats.record(&path, code, started.elapsed());
            result
        };
        match parent {
            Some(cx) => Box::pin(observed.with_context(cx)),
            None => Box::pin(observed),
        }
    }
}

/// The `grpc-status` of a response head; none means OK so far.
fn grpc_status(headers: &http::HeaderMap) -> Code {
    headers
        .get("grpc-status")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<i32>().ok())
        .map(Code::from_i32)
        .unwrap_or(Code::Ok)
}
