//! The spans of a proxied request: `route` (endpoint, variant, strategy, decision, instance,
//! table version, request bytes, time waited in flow control's queue, status) and one `upstream` child per attempt (instance, status,
//! time to first body byte, body bytes), both ending with the response body ([`BodyTrace`]).
//! Numbers are recorded as `i64`: `tracing-opentelemetry` exports other integer types as strings.

use http::StatusCode;
use tracing::field::Empty;
use tracing::Span;

use crate::placement::Route;
use crate::table::RoutingTable;

/// A request's `route` span, through `front_door` (`http`, or `ext_proc` for the endpoint
/// picker); [`record_route`] and [`record_status`] fill it in.
pub(crate) fn route_span(front_door: &'static str) -> Span {
    tracing::info_span!(
        "route",
        otel.kind = "server",
        front_door,
        endpoint = Empty,
        variant = Empty,
        strategy = Empty,
        decision = Empty,
        instance = Empty,
        prefix_blocks = Empty,
        table_version = Empty,
        request_bytes = Empty,
        queue_ms = Empty,
        status = Empty,
        otel.status_code = Empty,
    )
}

/// The decision's attributes on the `route` span (call only for an enabled span).
pub(crate) fn record_route(
    span: &Span,
    table: &RoutingTable,
    route: &Route<'_>,
    request_bytes: usize,
) {
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

/// How long the request waited in flow control's queue (since `since`), as `queue_ms` on its
/// `route` span: whether it was then forwarded or refused.
pub(crate) fn record_queue(span: &Span, since: std::time::Instant) {
    if !span.is_disabled() {
        span.record("queue_ms", since.elapsed().as_millis() as i64);
    }
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

pub(crate) fn record_status(span: &Span, status: StatusCode) {
    span.record("status", i64::from(status.as_u16()));
    if status.is_server_error() {
        span.record("otel.status_code", "error");
    }
}

/// Marks an `upstream` span failed with `error` (a status or an error message).
pub(crate) fn record_failure(span: &Span, error: &str) {
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
    pub(crate) fn start(
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

    pub(crate) fn on_data(&mut self, len: usize) {
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

/// Ends a traced body's spans now (rather than when the body is dropped), marking a failure.
pub(crate) fn end_trace(trace: &mut Option<Box<BodyTrace>>, error: Option<&str>) {
    if let Some(t) = trace.take() {
        if let Some(e) = error {
            record_failure(&t.upstream, e);
            t.route.record("otel.status_code", "error");
        }
    }
}
