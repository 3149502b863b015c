//! The HTTP side: request handling, forwarding with one retry, streamed responses, JSON errors.
//!
//! Tracing: each proxied request has a `route` span (endpoint, variant, strategy, decision,
//! instance, table version, request bytes, status) and one `upstream` child span per attempt
//! (instance, status, time to first body byte, body bytes), both ending with the response body.
//! The caller's W3C `traceparent` parents `route`; `upstream`'s context goes to the instance in
//! `traceparent`. With trace export off these spans are disabled: no header is read or written
//! and nothing is allocated for them. Numbers are recorded as `i64`: `tracing-opentelemetry`
//! exports other integer types as strings.

use std::convert::Infallible;
use std::future::Future as _;
use std::pin::Pin;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use arc_swap::ArcSwapOption;
use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::uri::PathAndQuery;
use http::{Method, Request, Response, StatusCode};
use http_body::{Body, Frame, SizeHint};
use http_body_util::{BodyExt, Full, LengthLimitError, Limited};
use hyper::body::Incoming;
use tokio::time::Sleep;
use tracing::field::Empty;
use tracing::Span;

use crate::access::{self, Access, Admission};
use crate::config::Config;
use crate::feedback::{FeedbackTuning, Rule, Visit};
use crate::load::{now_ms, InFlight};
use crate::metrics::{Metrics, RouteStats};
use crate::placement::{Placement, Route, RouteRequest};
use crate::prompt::BodyKind;
use crate::table::RoutingTable;
use crate::upstream::{self, Conn, UpstreamBody};
use crate::usage::UsageScanner;

pub const X_ENDPOINT_NAME: HeaderName = HeaderName::from_static("x-endpoint-name");
pub const X_TARGET_VARIANT: HeaderName = HeaderName::from_static("x-target-variant");
pub const X_PREFIX_AWARE_ID: HeaderName = HeaderName::from_static("x-prefix-aware-id");
pub const X_INSTANCE: HeaderName = HeaderName::from_static("x-prefix-router-instance");
pub const X_VARIANT: HeaderName = HeaderName::from_static("x-prefix-router-variant");
pub const X_TABLE_VERSION: HeaderName = HeaderName::from_static("x-prefix-router-table-version");
pub const X_DECISION: HeaderName = HeaderName::from_static("x-prefix-router-decision");

/// How long a request that arrives before the router's first table waits for it.
pub(crate) const FIRST_TABLE_WAIT: Duration = Duration::from_secs(3);

/// Shared router state: the current table, placement policy, metrics. (Upstream connections are
/// kept per instance, in its state: see [`upstream`].)
pub(crate) struct Router {
    pub(crate) table: ArcSwapOption<RoutingTable>,
    /// Notified whenever a table is stored (requests that came before the first one wait).
    pub(crate) table_applied: tokio::sync::Notify,
    pub(crate) placement: Placement,
    pub(crate) metrics: Metrics,
    pub(crate) access: Access,
    /// TLS towards `https://` instances.
    upstream_tls: tokio_rustls::TlsConnector,
    max_body_bytes: usize,
    request_timeout: Duration,
    body_read_timeout: Duration,
}

impl Router {
    pub(crate) fn new(
        config: &Config,
        access: Access,
        upstream_tls: tokio_rustls::TlsConnector,
    ) -> Self {
        Router {
            table: ArcSwapOption::empty(),
            table_applied: tokio::sync::Notify::new(),
            placement: Placement::new(
                config.prefix_index_capacity,
                config.hash_balance_factor,
                config.default_endpoint.clone(),
            )
            .with_hot_key_spread(config.hot_key_spread),
            metrics: Metrics::with_workers(config.resolved_workers()),
            access,
            upstream_tls,
            max_body_bytes: config.max_body_bytes,
            request_timeout: config.request_timeout(),
            body_read_timeout: Duration::from_millis(config.body_read_timeout_ms),
        }
    }

    pub(crate) async fn handle(
        self: Arc<Self>,
        req: Request<Incoming>,
        peer: std::net::IpAddr,
    ) -> Result<Response<ResponseBody>, Infallible> {
        let path = req.uri().path();
        if !access::is_open_path(path) {
            if let Err(refusal) = self.access.authenticate(req.headers(), peer) {
                if matches!(refusal, access::Refusal::Throttled(_)) {
                    self.metrics.auth_throttled.fetch_add(1, Relaxed);
                }
                self.metrics.record_unrouted(refusal.status());
                return Ok(access::refusal_response(&refusal));
            }
        }
        let response = match path {
            "/v1/chat/completions" | "/v1/completions" if req.method() != Method::POST => {
                self.unrouted(None, 405, "use POST", "method_not_allowed")
            }
            _ if path.starts_with("/v1/models") && req.method() == Method::GET => self.models(path),
            // Chat, completions and the rest of the OpenAI surface (embeddings, responses,
            // tokenize, audio, ...): to an instance of the endpoint chosen by header, `model`
            // or default.
            _ if path.starts_with("/v1/") => {
                let kind = if path == "/v1/responses" {
                    BodyKind::Responses
                } else {
                    BodyKind::OpenAi
                };
                let upstream = req
                    .uri()
                    .path_and_query()
                    .cloned()
                    .unwrap_or_else(|| PathAndQuery::from_static("/"));
                self.proxy(req, kind, None, upstream).await
            }
            "/healthz" => json_response(200, r#"{"status":"ok"}"#),
            "/readyz" => match self.table.load().as_ref() {
                Some(t) => json_response(
                    200,
                    format!(r#"{{"status":"ready","table_version":{}}}"#, t.version()),
                ),
                None => self.unrouted(
                    None,
                    503,
                    "no routing table applied yet",
                    "service_unavailable",
                ),
            },
            "/metrics" => {
                let table = self.table.load_full();
                let text = self
                    .metrics
                    .render(table.as_deref(), self.placement.index().len());
                let mut r = Response::new(ResponseBody::full(text));
                r.headers_mut().insert(
                    header::CONTENT_TYPE,
                    HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
                );
                r
            }
            _ => match invocation_endpoint(path) {
                Some(Ok(name)) if req.method() == Method::POST => {
                    self.proxy(
                        req,
                        BodyKind::Raw,
                        Some(name),
                        PathAndQuery::from_static("/invocations"),
                    )
                    .await
                }
                Some(Ok(_)) => self.unrouted(None, 405, "use POST", "method_not_allowed"),
                Some(Err(msg)) => self.unrouted(None, 400, &msg, "invalid_request_error"),
                None => self.unrouted(
                    None,
                    404,
                    &format!("no route for {path:?}"),
                    "not_found_error",
                ),
            },
        };
        Ok(response)
    }

    /// `GET /v1/models` and `GET /v1/models/{id}` from the table (see [`crate::models`]).
    fn models(&self, path: &str) -> Response<ResponseBody> {
        let table = self.table.load();
        let Some(table) = table.as_deref() else {
            let msg = "no routing table applied yet";
            return self.unrouted(None, 503, msg, "service_unavailable");
        };
        let body = match path.strip_prefix("/v1/models") {
            Some("" | "/") => Some(crate::models::list(table)),
            Some(rest) => rest
                .strip_prefix('/')
                .and_then(|id| crate::models::retrieve(table, id)),
            None => None,
        };
        match body {
            Some(body) => json_response(200, body),
            None => {
                let msg = format!("no model {path:?} here: GET /v1/models lists them");
                self.unrouted(Some(table), 404, &msg, "not_found_error")
            }
        }
    }

    /// Admits the request under `--max-in-flight` (503 past it), then routes and forwards it.
    async fn proxy(
        &self,
        req: Request<Incoming>,
        kind: BodyKind,
        path_endpoint: Option<String>,
        upstream_path: PathAndQuery,
    ) -> Response<ResponseBody> {
        let admission = match self.access.admit() {
            Ok(a) => a,
            Err(refusal) => {
                self.metrics.record_unrouted(503);
                return access::refusal_response(&refusal);
            }
        };
        let mut response = self
            .traced_route_and_forward(req, kind, path_endpoint, upstream_path)
            .await;
        response.body_mut().admission = Some(admission);
        response
    }

    /// [`Self::route_and_forward`] inside the request's `route` span.
    async fn traced_route_and_forward(
        &self,
        req: Request<Incoming>,
        kind: BodyKind,
        path_endpoint: Option<String>,
        upstream_path: PathAndQuery,
    ) -> Response<ResponseBody> {
        let span = tracing::info_span!(
            "route",
            otel.kind = "server",
            endpoint = Empty,
            variant = Empty,
            strategy = Empty,
            decision = Empty,
            instance = Empty,
            prefix_blocks = Empty,
            table_version = Empty,
            request_bytes = Empty,
            status = Empty,
            otel.status_code = Empty,
        );
        if span.is_disabled() {
            return self
                .route_and_forward(req, kind, path_endpoint, upstream_path, &span)
                .await;
        }
        telemetry::propagation::set_parent_from_headers(&span, req.headers());
        let response = self
            .route_and_forward(req, kind, path_endpoint, upstream_path, &span)
            .await;
        record_status(&span, response.status());
        response
    }

    /// A router that has just started (with no `--table-cache`) holds a request until its first
    /// table arrives, which the control plane sends within milliseconds of the watch opening,
    /// rather than failing every request of that moment: up to [`FIRST_TABLE_WAIT`] or the
    /// request's deadline. `None`: still no table.
    async fn first_table(&self, deadline: Pin<&mut Sleep>) -> Option<Arc<RoutingTable>> {
        let applied = self.table_applied.notified();
        tokio::pin!(applied);
        applied.as_mut().enable(); // registered before the check: a store in between wakes it
        if let Some(table) = self.table.load_full() {
            return Some(table);
        }
        tokio::select! {
            () = applied => {}
            () = deadline => {}
            () = tokio::time::sleep(FIRST_TABLE_WAIT) => {}
        }
        self.table.load_full()
    }

    async fn route_and_forward(
        &self,
        req: Request<Incoming>,
        kind: BodyKind,
        path_endpoint: Option<String>,
        upstream_path: PathAndQuery,
        span: &Span,
    ) -> Response<ResponseBody> {
        // One timer for the whole request (body read, upstream call, response stream): one
        // registration with the runtime's timer wheel instead of one per phase.
        let mut deadline = Box::pin(tokio::time::sleep(self.request_timeout));
        let table = match self.table.load_full() {
            Some(table) => Some(table),
            None => self.first_table(deadline.as_mut()).await,
        };
        let Some(table) = table else {
            return self.unrouted(
                None,
                503,
                "no routing table applied yet",
                "service_unavailable",
            );
        };
        let (parts, body) = req.into_parts();
        let header = |name: &HeaderName| -> Result<Option<&str>, String> {
            match parts.headers.get(name) {
                None => Ok(None),
                Some(v) => v
                    .to_str()
                    .map(Some)
                    .map_err(|_| format!("header {name} is not valid UTF-8 text")),
            }
        };
        let (endpoint_header, target_variant) =
            match (header(&X_ENDPOINT_NAME), header(&X_TARGET_VARIANT)) {
                (Ok(e), Ok(v)) => (e, v),
                (Err(msg), _) | (_, Err(msg)) => {
                    return self.unrouted(Some(&table), 400, &msg, "invalid_request_error");
                }
            };
        let declared = parts
            .headers
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
        if declared.is_some_and(|len| len > self.max_body_bytes as u64) {
            return self.too_large(&table);
        }
        let read = tokio::select! {
            biased;
            read = Limited::new(body, self.max_body_bytes).collect() => Ok(read),
            () = deadline.as_mut() => Err(504),
            () = tokio::time::sleep(self.body_read_timeout) => Err(408),
        };
        let body = match read {
            Err(status) => {
                return self.unrouted(
                    Some(&table),
                    status,
                    "timed out reading the request body",
                    "timeout_error",
                )
            }
            Ok(Err(e)) if e.downcast_ref::<LengthLimitError>().is_some() => {
                return self.too_large(&table)
            }
            Ok(Err(e)) => {
                let msg = format!("could not read the request body: {e}");
                return self.unrouted(Some(&table), 400, &msg, "invalid_request_error");
            }
            Ok(Ok(collected)) => collected.to_bytes(),
        };

        let started = std::time::Instant::now();
        let request = RouteRequest {
            kind,
            body: &body,
            endpoint: path_endpoint.as_deref().or(endpoint_header),
            target_variant,
            prefix_aware_id: parts.headers.get(X_PREFIX_AWARE_ID).map(|v| v.as_bytes()),
        };
        let route = match self.placement.route(&table, &request) {
            Ok(route) => route,
            Err(e) => {
                let kind = if e.status() == 404 {
                    "not_found_error"
                } else {
                    "service_unavailable"
                };
                return self.unrouted(Some(&table), e.status(), &e.to_string(), kind);
            }
        };
        let in_flight = InFlight::start(
            route.variant.instances()[route.instance].state(),
            route.variant.load(),
        );
        self.metrics.decision.observe(started.elapsed());
        if !span.is_disabled() {
            record_route(span, &table, &route, body.len());
        }
        self.forward(
            &table,
            route,
            &parts,
            body,
            in_flight,
            &upstream_path,
            deadline,
            span,
        )
        .await
    }

    /// Sends the request; on a connect error or a 5xx before any response byte, once more to the
    /// next instance.
    #[allow(clippy::too_many_arguments)]
    async fn forward(
        &self,
        table: &RoutingTable,
        mut route: Route<'_>,
        parts: &http::request::Parts,
        body: Bytes,
        mut in_flight: InFlight,
        upstream_path: &PathAndQuery,
        mut deadline: Pin<Box<Sleep>>,
        span: &Span,
    ) -> Response<ResponseBody> {
        let variant = route.variant;
        let mut retried = false;
        let authorization = self
            .access
            .upstream_authorization(parts.headers.get(header::AUTHORIZATION));
        loop {
            let instance = &variant.instances()[route.instance];
            let target = match instance.target(upstream_path) {
                Ok(t) => t,
                Err(e) => {
                    let msg = format!(
                        "cannot build the upstream request for {}: {e}",
                        instance.address()
                    );
                    return self.routed_error(table, &route, 502, &msg, "upstream_error");
                }
            };
            let upstream = tracing::info_span!(
                parent: span,
                "upstream",
                otel.kind = "client",
                instance = instance.address(),
                status = Empty,
                ttfb_ms = Empty,
                bytes = Empty,
                error = Empty,
                otel.status_code = Empty,
            );
            let traced = !upstream.is_disabled();
            let make = || {
                let mut request = upstream_request(
                    parts,
                    &target,
                    instance.host(),
                    authorization.as_ref(),
                    &body,
                );
                if traced {
                    telemetry::propagation::inject_headers(&upstream, request.headers_mut());
                }
                request
            };
            let sent = traced.then(std::time::Instant::now);
            let exchange = upstream::send(
                instance.state().pool(),
                instance.authority(),
                instance.tls().then_some(&self.upstream_tls),
                now_ms(),
                make,
            );
            let failure = match tokio::select! {
                biased;
                sent = exchange => Ok(sent),
                () = deadline.as_mut() => Err(()),
            } {
                Err(_) => {
                    return self.timed_out(table, &route, &upstream, "response");
                }
                Ok(Ok((response, mut conn))) if !response.status().is_server_error() => {
                    // A success for passive health once the body has ended, too (a body
                    // that breaks off is a failure). A body that is not an event stream is
                    // read up to its first frame first: one that fails before it can still be
                    // retried or answered 502, since the client has seen nothing yet.
                    let (head, mut incoming) = response.into_parts();
                    let first = if is_event_stream(&head.headers) {
                        Ok(None)
                    } else {
                        tokio::select! {
                            biased;
                            first = first_frame(&mut conn, &mut incoming) => first,
                            () = deadline.as_mut() => {
                                return self.timed_out(table, &route, &upstream, "response body");
                            }
                        }
                    };
                    match first {
                        Ok(first) => {
                            let trace = BodyTrace::start(span, upstream, sent, head.status);
                            let response = Response::from_parts(head, incoming);
                            return self.respond(
                                table, &route, response, conn, in_flight, deadline, trace, first,
                            );
                        }
                        Err(e) => Ok(upstream::UpstreamError::Http(e)),
                    }
                }
                Ok(Ok(exchange)) => Err(exchange),
                Ok(Err(e)) => Ok(e),
            };
            self.count_failure(instance);
            if !retried {
                if let Some((next, decision, rule)) =
                    self.placement
                        .choose(variant, route.key, Some(route.instance), now_ms())
                {
                    retried = true;
                    self.metrics.retries.fetch_add(1, Relaxed);
                    in_flight = InFlight::start(variant.instances()[next].state(), variant.load());
                    route.instance = next;
                    route.decision = decision;
                    route.rule = rule;
                    // a retry's outcome says nothing of the key's placement
                    route.visit = Visit::First;
                    route.placed = 0;
                    if !span.is_disabled() {
                        match &failure {
                            Err((response, _)) => {
                                record_failure(&upstream, response.status().as_str())
                            }
                            Ok(e) => record_failure(&upstream, &error_chain(e)),
                        }
                        record_route(span, table, &route, body.len());
                    }
                    continue;
                }
            }
            return match failure {
                Err((response, conn)) => {
                    let trace = BodyTrace::start(span, upstream, sent, response.status());
                    self.respond(
                        table, &route, response, conn, in_flight, deadline, trace, None,
                    )
                }
                Ok(e) => {
                    let msg = format!(
                        "upstream {} failed: {}",
                        instance.address(),
                        error_chain(&e)
                    );
                    if !upstream.is_disabled() {
                        record_failure(&upstream, &msg);
                    }
                    self.routed_error(table, &route, 502, &msg, "upstream_error")
                }
            };
        }
    }

    /// 504: no `what` from the instance within the request's deadline. A stalled instance, as far
    /// as passive health can tell (not retried: the deadline is spent).
    fn timed_out(
        &self,
        table: &RoutingTable,
        route: &Route<'_>,
        upstream: &Span,
        what: &str,
    ) -> Response<ResponseBody> {
        let instance = &route.variant.instances()[route.instance];
        let msg = format!(
            "no {what} from {} within the request timeout",
            instance.address()
        );
        record_failure(upstream, "timeout");
        self.count_failure(instance);
        self.routed_error(table, route, 504, &msg, "timeout_error")
    }

    /// A failed exchange, for passive health: ejects the instance after repeated failures.
    fn count_failure(&self, instance: &crate::table::Instance) {
        if let Some(length) = instance.state().record_failure(now_ms()) {
            self.metrics.ejections.fetch_add(1, Relaxed);
            tracing::warn!(
                instance = instance.address(),
                ?length,
                "instance ejected after repeated failures"
            );
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn respond(
        &self,
        table: &RoutingTable,
        route: &Route<'_>,
        response: Response<Incoming>,
        conn: Box<Conn>,
        in_flight: InFlight,
        deadline: Pin<Box<Sleep>>,
        trace: Option<Box<BodyTrace>>,
        first: Option<Frame<Bytes>>,
    ) -> Response<ResponseBody> {
        let (mut parts, body) = response.into_parts();
        strip_hop_by_hop(&mut parts.headers);
        let instance = &route.variant.instances()[route.instance];
        instance
            .stats()
            .record(route.decision, parts.status.as_u16());
        set_route_headers(&mut parts.headers, table, route);
        let sse = is_event_stream(&parts.headers);
        let outcome = parts.status.is_success().then(|| Outcome {
            scanner: UsageScanner::default(),
            stats: Arc::clone(instance.stats()),
            rule: route.rule,
            visit: route.visit,
            placed: route.placed,
            feedback: self.placement.tuning().feedback,
        });
        let stream = UpstreamStream {
            pending: first,
            in_flight,
            ejections: Arc::clone(&self.metrics.ejections),
            server_error: parts.status.is_server_error(),
            sse,
            at_event_boundary: true,
            outcome,
        };
        Response::from_parts(
            parts,
            ResponseBody::upstream(body, conn, stream, deadline, trace),
        )
    }

    fn routed_error(
        &self,
        table: &RoutingTable,
        route: &Route<'_>,
        status: u16,
        message: &str,
        kind: &str,
    ) -> Response<ResponseBody> {
        route.variant.instances()[route.instance]
            .stats()
            .record(route.decision, status);
        let mut r = error_response(status, message, kind);
        set_route_headers(r.headers_mut(), table, route);
        r
    }

    fn too_large(&self, table: &RoutingTable) -> Response<ResponseBody> {
        let msg = format!(
            "request body is larger than the limit of {} bytes",
            self.max_body_bytes
        );
        self.unrouted(Some(table), 413, &msg, "request_too_large")
    }

    /// An error answered before any instance was chosen.
    fn unrouted(
        &self,
        table: Option<&RoutingTable>,
        status: u16,
        message: &str,
        kind: &str,
    ) -> Response<ResponseBody> {
        self.metrics.record_unrouted(status);
        let mut r = error_response(status, message, kind);
        let version = match table {
            Some(t) => t.version_header().clone(),
            None => match self.table.load().as_ref() {
                Some(t) => t.version_header().clone(),
                None => HeaderValue::from_static("0"),
            },
        };
        r.headers_mut().insert(X_TABLE_VERSION, version);
        r
    }
}

/// The decision's attributes on the `route` span (call only for an enabled span).
fn record_route(span: &Span, table: &RoutingTable, route: &Route<'_>, request_bytes: usize) {
    let instance = route.variant.instances()[route.instance].address();
    record_fields(
        span,
        [
            (
                "endpoint",
                Some(&route.endpoint.name() as &dyn tracing::Value),
            ),
            ("variant", Some(&route.variant.name())),
            ("strategy", Some(&route.variant.strategy().user_name())),
            ("decision", Some(&route.decision.as_str())),
            ("instance", Some(&instance)),
            ("prefix_blocks", Some(&i64::from(route.key_blocks))),
            ("table_version", Some(&(table.version() as i64))),
            ("request_bytes", Some(&(request_bytes as i64))),
        ],
    );
}

/// Records `values` (field name, value; `None` leaves a field empty) on `span` in ONE trip through
/// the subscriber: each `Span::record` call is a span lookup and an extensions lock in the trace
/// layer, so a span's fields are recorded together. Every name must be one the span declares
/// (else nothing is recorded: a programming error, caught by the tracing tests).
fn record_fields<const N: usize>(span: &Span, values: [(&str, Option<&dyn tracing::Value>); N]) {
    let Some(meta) = span.metadata() else {
        return;
    };
    let fields = meta.fields();
    let found: [Option<tracing::field::Field>; N] = values.map(|(name, _)| fields.field(name));
    if found.iter().any(Option::is_none) {
        debug_assert!(false, "a field name not declared by span {}", meta.name());
        return;
    }
    let pairs: [(&tracing::field::Field, Option<&dyn tracing::Value>); N] =
        std::array::from_fn(|i| (found[i].as_ref().expect("checked above"), values[i].1));
    span.record_all(&fields.value_set(&pairs));
}

fn record_status(span: &Span, status: StatusCode) {
    span.record("status", i64::from(status.as_u16()));
    if status.is_server_error() {
        span.record("otel.status_code", "error");
    }
}

/// Marks an `upstream` span failed with `error` (a status or an error message).
fn record_failure(span: &Span, error: &str) {
    span.record("error", error);
    span.record("otel.status_code", "error");
}

/// The spans of a traced request, held by its response body until the body ends: the `upstream`
/// span gets the time to the first body byte and the body's size, then both spans end.
/// Only built when the request is traced (`None` otherwise: nothing to carry).
pub(crate) struct BodyTrace {
    // Field order is drop order: `upstream` ends before `route`.
    upstream: Span,
    route: Span,
    sent: std::time::Instant,
    status: u16,
    ttfb_ms: Option<f64>,
    bytes: u64,
}

impl BodyTrace {
    /// `sent` is when the upstream request went out; `None` (span disabled) gives `None`.
    fn start(
        route: &Span,
        upstream: Span,
        sent: Option<std::time::Instant>,
        status: StatusCode,
    ) -> Option<Box<Self>> {
        let sent = sent?;
        if status.is_server_error() {
            upstream.record("otel.status_code", "error");
        }
        Some(Box::new(BodyTrace {
            upstream,
            route: route.clone(),
            sent,
            status: status.as_u16(),
            ttfb_ms: None,
            bytes: 0,
        }))
    }

    fn on_data(&mut self, len: usize) {
        if self.ttfb_ms.is_none() {
            self.ttfb_ms = Some(self.sent.elapsed().as_secs_f64() * 1e3);
        }
        self.bytes += len as u64;
    }
}

impl Drop for BodyTrace {
    /// The `upstream` span's status, time to first byte and size, recorded together as it ends.
    fn drop(&mut self) {
        let ttfb_ms = self.ttfb_ms;
        record_fields(
            &self.upstream,
            [
                (
                    "status",
                    Some(&i64::from(self.status) as &dyn tracing::Value),
                ),
                (
                    "ttfb_ms",
                    ttfb_ms.as_ref().map(|t| t as &dyn tracing::Value),
                ),
                ("bytes", Some(&(self.bytes as i64))),
            ],
        );
    }
}

fn set_route_headers(headers: &mut HeaderMap, table: &RoutingTable, route: &Route<'_>) {
    headers.insert(
        X_INSTANCE,
        route.variant.instances()[route.instance].header().clone(),
    );
    headers.insert(X_VARIANT, route.variant.header().clone());
    headers.insert(X_TABLE_VERSION, table.version_header().clone());
    headers.insert(X_DECISION, route.decision.header());
}

/// `/endpoints/{name}/invocations` -> the percent-decoded name (`Err` for a name that is not UTF-8).
fn invocation_endpoint(path: &str) -> Option<Result<String, String>> {
    let raw = path
        .strip_prefix("/endpoints/")?
        .strip_suffix("/invocations")?;
    if raw.is_empty() || raw.contains('/') {
        return None;
    }
    let bytes = raw.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = bytes
                .get(i + 1..i + 3)
                .and_then(|h| std::str::from_utf8(h).ok());
            match hex.and_then(|h| u8::from_str_radix(h, 16).ok()) {
                Some(b) => out.push(b),
                None => {
                    return Some(Err(format!(
                        "bad percent-encoding in endpoint name {raw:?}"
                    )))
                }
            }
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    Some(String::from_utf8(out).map_err(|_| format!("endpoint name {raw:?} is not valid UTF-8")))
}

const HOP_BY_HOP: [HeaderName; 8] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::PROXY_AUTHENTICATE,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

fn strip_hop_by_hop(headers: &mut HeaderMap) {
    for name in &HOP_BY_HOP {
        headers.remove(name);
    }
}

/// The request to an instance: the client's method and end-to-end headers, `target` (origin
/// form), the instance's `Host`, the `authorization` chosen by [`Access`] (the client's own is
/// never copied), and the body.
fn upstream_request(
    parts: &http::request::Parts,
    target: &http::Uri,
    host: &HeaderValue,
    authorization: Option<&HeaderValue>,
    body: &Bytes,
) -> Request<UpstreamBody> {
    let mut req = Request::new(Full::new(body.clone()));
    *req.method_mut() = parts.method.clone();
    *req.uri_mut() = target.clone();
    let headers = req.headers_mut();
    headers.reserve(parts.headers.len() + 1);
    headers.insert(header::HOST, host.clone());
    for (name, value) in &parts.headers {
        if HOP_BY_HOP.contains(name)
            || name == header::HOST
            || name == header::CONTENT_LENGTH
            || name == header::EXPECT
            || name == header::PROXY_AUTHORIZATION
            || name == header::AUTHORIZATION
        {
            continue;
        }
        headers.append(name.clone(), value.clone());
    }
    if let Some(a) = authorization {
        headers.insert(header::AUTHORIZATION, a.clone());
    }
    req
}

/// An error and its sources, `: `-separated.
pub(crate) fn error_chain(e: &dyn std::error::Error) -> String {
    let mut msg = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        msg.push_str(": ");
        msg.push_str(&s.to_string());
        source = s.source();
    }
    msg
}

pub(crate) fn json_response(status: u16, body: impl Into<Bytes>) -> Response<ResponseBody> {
    let mut r = Response::new(ResponseBody::full(body));
    *r.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

/// `{"error":{"message":...,"type":...}}`
pub(crate) fn error_response(status: u16, message: &str, kind: &str) -> Response<ResponseBody> {
    let body = serde_json::json!({ "error": { "message": message, "type": kind } });
    json_response(status, serde_json::to_vec(&body).unwrap_or_default())
}

/// `content-type: text/event-stream`
fn is_event_stream(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"))
}

/// Drives `conn` until `body`'s first frame (`None`: the body is empty) or its failure.
async fn first_frame(
    conn: &mut Conn,
    body: &mut Incoming,
) -> Result<Option<Frame<Bytes>>, hyper::Error> {
    std::future::poll_fn(|cx| {
        conn.poll_drive(cx);
        match Pin::new(&mut *body).poll_frame(cx) {
            Poll::Ready(frame) => Poll::Ready(frame.transpose()),
            Poll::Pending => Poll::Pending,
        }
    })
    .await
}

/// An upstream response body being streamed: what its failure needs to know.
struct UpstreamStream {
    /// The body's first frame, read before the head was answered, to send first.
    pending: Option<Frame<Bytes>>,
    in_flight: InFlight,
    /// The router's ejection counter: a body that fails counts against its instance's health.
    ejections: Arc<std::sync::atomic::AtomicU64>,
    /// `text/event-stream`: a failure ends the stream with an SSE error event (as OpenAI's API
    /// does), so a client never takes a cut stream for a whole one.
    sse: bool,
    /// The bytes sent so far end between events (`\n\n`), or none were sent.
    at_event_boundary: bool,
    /// A 5xx passed through (both attempts failed): already counted as a failure, so its body
    /// ending is no success.
    server_error: bool,
    /// A 2xx body: read for the engine's cache report as it passes.
    outcome: Option<Outcome>,
}

/// What one successful response teaches: the engine's cache report, counted for the route and
/// the rule that placed the request, and held against the rule ([`crate::feedback`]).
struct Outcome {
    scanner: UsageScanner,
    stats: Arc<RouteStats>,
    rule: Rule,
    visit: Visit,
    /// [`crate::placement::Route::placed`].
    placed: u64,
    feedback: FeedbackTuning,
}

impl UpstreamStream {
    /// The body ended: the exchange was a success for passive health (unless a 5xx), and the
    /// engine's report (if it sent one) is learned from.
    fn ended(&self) {
        if !self.server_error {
            self.in_flight.instance().record_success();
        }
        if let Some(o) = &self.outcome {
            if o.placed != 0 {
                self.in_flight.variant().served().insert(o.placed);
            }
            if let Some(report) = o.scanner.report() {
                o.stats.record_usage(o.rule, report);
                self.in_flight.variant().feedback().learn(
                    o.rule,
                    o.visit,
                    report,
                    now_ms(),
                    &o.feedback,
                    self.in_flight.instance().cache(),
                );
            }
        }
    }

    /// The stream failed after the head: a failure of the instance (unless it is the request's
    /// own deadline), and for SSE an error event that ends the body; otherwise an error, which
    /// aborts the client's connection.
    fn fail(self, error: BodyError) -> Result<Frame<Bytes>, BodyError> {
        let kind = match &error {
            BodyError::Timeout => "timeout_error",
            BodyError::Upstream(_) => {
                let instance = self.in_flight.instance();
                if let Some(length) = instance.record_failure(now_ms()) {
                    self.ejections.fetch_add(1, Relaxed);
                    tracing::warn!(?length, "instance ejected after repeated failures");
                }
                "upstream_error"
            }
        };
        if !self.sse {
            return Err(error);
        }
        let mut event = Vec::with_capacity(128);
        if !self.at_event_boundary {
            event.extend_from_slice(b"\n\n"); // end the event the instance left unfinished
        }
        let body = serde_json::json!({ "error": { "message": error.to_string(), "type": kind } });
        event.extend_from_slice(b"data: ");
        event.extend_from_slice(&serde_json::to_vec(&body).unwrap_or_default());
        event.extend_from_slice(b"\n\n");
        Ok(Frame::data(Bytes::from(event)))
    }
}

/// Why a streamed response body stopped early.
#[derive(Debug, thiserror::Error)]
pub enum BodyError {
    #[error("request timeout reached while streaming the response")]
    Timeout,
    #[error("upstream response body failed: {0}")]
    Upstream(#[from] hyper::Error),
}

/// The router's response body: a small full body, or an upstream body streamed frame by frame,
/// holding the instance's in-flight count until it ends or is dropped (client gone).
pub struct ResponseBody {
    kind: Inner,
    /// The request's place under `--max-in-flight`, given back when the body is done.
    admission: Option<Admission>,
}

// The upstream variant is the common one: boxing it would allocate per request.
#[allow(clippy::large_enum_variant)]
enum Inner {
    Full(Option<Bytes>),
    Upstream {
        body: Incoming,
        /// The connection the body comes over: polled here, given back to the instance's pool
        /// when the body has ended (dropped, which closes it, otherwise).
        conn: Option<Box<Conn>>,
        /// `None` once the body has ended.
        stream: Option<UpstreamStream>,
        deadline: Pin<Box<Sleep>>,
        trace: Option<Box<BodyTrace>>,
    },
}

impl ResponseBody {
    pub fn full(bytes: impl Into<Bytes>) -> Self {
        ResponseBody {
            kind: Inner::Full(Some(bytes.into())),
            admission: None,
        }
    }

    fn upstream(
        body: Incoming,
        conn: Box<Conn>,
        stream: UpstreamStream,
        deadline: Pin<Box<Sleep>>,
        trace: Option<Box<BodyTrace>>,
    ) -> Self {
        ResponseBody {
            kind: Inner::Upstream {
                body,
                conn: Some(conn),
                stream: Some(stream),
                deadline,
                trace,
            },
            admission: None,
        }
    }
}

impl Body for ResponseBody {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        match &mut self.get_mut().kind {
            Inner::Full(bytes) => Poll::Ready(bytes.take().map(|b| Ok(Frame::data(b)))),
            Inner::Upstream {
                body,
                conn,
                stream,
                deadline,
                trace,
            } => {
                let Some(s) = stream.as_mut() else {
                    return Poll::Ready(None);
                };
                // The connection reads the body (into `body`'s channel).
                if let Some(c) = conn.as_mut() {
                    c.poll_drive(cx);
                }
                if deadline.is_elapsed() {
                    end_trace(trace, Some("timeout while streaming the response"));
                    let s = stream.take().expect("checked above");
                    return Poll::Ready(Some(s.fail(BodyError::Timeout)));
                }
                let polled = match s.pending.take() {
                    Some(frame) => Poll::Ready(Some(Ok(frame))),
                    None => Pin::new(body).poll_frame(cx),
                };
                match polled {
                    Poll::Ready(Some(Ok(frame))) => {
                        if let Some(data) = frame.data_ref() {
                            if !data.is_empty() {
                                s.at_event_boundary = data.ends_with(b"\n\n");
                            }
                            if let Some(o) = s.outcome.as_mut() {
                                o.scanner.feed(data);
                            }
                            if let Some(t) = trace.as_mut() {
                                t.on_data(data.len());
                            }
                        }
                        Poll::Ready(Some(Ok(frame)))
                    }
                    Poll::Ready(Some(Err(e))) => {
                        if trace.is_some() {
                            end_trace(trace, Some(&format!("upstream response body failed: {e}")));
                        }
                        let s = stream.take().expect("checked above");
                        Poll::Ready(Some(s.fail(e.into())))
                    }
                    Poll::Ready(None) => {
                        s.ended();
                        release(conn, stream);
                        stream.take();
                        end_trace(trace, None);
                        Poll::Ready(None)
                    }
                    Poll::Pending => {
                        if deadline.as_mut().poll(cx).is_ready() {
                            end_trace(trace, Some("timeout while streaming the response"));
                            let s = stream.take().expect("checked above");
                            return Poll::Ready(Some(s.fail(BodyError::Timeout)));
                        }
                        Poll::Pending
                    }
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Inner::Full(b) => b.is_none(),
            Inner::Upstream { body, stream, .. } => match stream {
                None => true,
                Some(s) => s.pending.is_none() && body.is_end_stream(),
            },
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Inner::Full(Some(b)) => SizeHint::with_exact(b.len() as u64),
            Inner::Full(None) => SizeHint::with_exact(0),
            Inner::Upstream { body, stream, .. } => {
                let mut hint = body.size_hint();
                let pending = stream
                    .as_ref()
                    .and_then(|s| s.pending.as_ref()?.data_ref().map(|d| d.len() as u64))
                    .unwrap_or(0);
                if pending > 0 {
                    // upper first: a lower bound may never exceed the upper one
                    if let Some(upper) = hint.upper() {
                        hint.set_upper(upper + pending);
                    }
                    hint.set_lower(hint.lower() + pending);
                }
                hint
            }
        }
    }
}

impl Drop for ResponseBody {
    /// An upstream body that ended without being polled to its end (an empty body: the server
    /// does not poll it) still gives its connection back.
    fn drop(&mut self) {
        if let Inner::Upstream {
            body, conn, stream, ..
        } = &mut self.kind
        {
            if conn.is_some() && body.is_end_stream() {
                if let Some(s) = stream {
                    s.ended();
                }
                release(conn, stream);
            }
        }
    }
}

/// Gives an upstream connection whose response body has ended back to its instance's pool.
fn release(conn: &mut Option<Box<Conn>>, stream: &Option<UpstreamStream>) {
    if let (Some(c), Some(s)) = (conn.take(), stream) {
        s.in_flight.instance().pool().put(c, now_ms());
    }
}

/// Ends a traced body's spans now (rather than when the body is dropped), marking a failure.
fn end_trace(trace: &mut Option<Box<BodyTrace>>, error: Option<&str>) {
    if let Some(t) = trace.take() {
        if let Some(e) = error {
            record_failure(&t.upstream, e);
            t.route.record("otel.status_code", "error");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn invocation_paths() {
        assert_eq!(
            invocation_endpoint("/endpoints/e1/invocations"),
            Some(Ok("e1".into()))
        );
        assert_eq!(
            invocation_endpoint("/endpoints/my%20ep/invocations"),
            Some(Ok("my ep".into()))
        );
        assert!(matches!(
            invocation_endpoint("/endpoints/%ff/invocations"),
            Some(Err(_))
        ));
        assert!(matches!(
            invocation_endpoint("/endpoints/%zz/invocations"),
            Some(Err(_))
        ));
        assert_eq!(invocation_endpoint("/endpoints//invocations"), None);
        assert_eq!(invocation_endpoint("/endpoints/a/b/invocations"), None);
        assert_eq!(invocation_endpoint("/other"), None);
    }

    #[test]
    fn error_body_shape() {
        let r = error_response(404, "unknown endpoint \"x\"", "not_found_error");
        assert_eq!(r.status(), 404);
        let Inner::Full(Some(b)) = &r.body().kind else {
            panic!()
        };
        let v: serde_json::Value = serde_json::from_slice(b).unwrap();
        assert_eq!(v["error"]["message"], "unknown endpoint \"x\"");
        assert_eq!(v["error"]["type"], "not_found_error");
    }
}
