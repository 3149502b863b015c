//! W3C trace context (`traceparent`, `tracestate`) in and out of HTTP headers, through the
//! globally installed propagator.
//!
//! Both functions do nothing for a disabled span; callers on the request path check
//! [`Span::is_disabled`] first anyway, so that with export off no header is even looked at.

use http::header::{HeaderMap, HeaderName, HeaderValue};
use opentelemetry::propagation::{Extractor, Injector};
use opentelemetry::trace::TraceContextExt as _;
use tracing::Span;
use tracing_opentelemetry::OpenTelemetrySpanExt as _;

/// Reads a header map as a propagation carrier.
pub struct HeaderExtractor<'a>(pub &'a HeaderMap);

impl Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(HeaderName::as_str).collect()
    }
}

/// Writes into a header map as a propagation carrier (replacing what was there).
pub struct HeaderInjector<'a>(pub &'a mut HeaderMap);

const TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");
const TRACESTATE: HeaderName = HeaderName::from_static("tracestate");

impl Injector for HeaderInjector<'_> {
    /// The W3C names are constants and the value's buffer is reused: nothing is copied for the
    /// `traceparent` of every traced upstream request.
    fn set(&mut self, key: &str, value: String) {
        let name = match key {
            "traceparent" => Ok(TRACEPARENT),
            "tracestate" => Ok(TRACESTATE),
            other => HeaderName::from_bytes(other.as_bytes()),
        };
        if let (Ok(name), Ok(value)) = (name, HeaderValue::try_from(value)) {
            self.0.insert(name, value);
        }
    }
}

/// The remote context carried by `headers`, if they carry a valid one.
pub fn extract(headers: &HeaderMap) -> Option<opentelemetry::Context> {
    let cx =
        opentelemetry::global::get_text_map_propagator(|p| p.extract(&HeaderExtractor(headers)));
    cx.span().span_context().is_valid().then_some(cx)
}

/// Makes the caller's span (from `traceparent` in `headers`) the parent of `span`, so this
/// service's spans join the caller's trace. Call before `span` is first entered; without a valid
/// `traceparent` the span stays a root.
pub fn set_parent_from_headers(span: &Span, headers: &HeaderMap) {
    if span.is_disabled() {
        return;
    }
    if let Some(cx) = extract(headers) {
        // Fails only when no OpenTelemetry layer is installed or the span already started:
        // the span then stays where it is, which is all there is to do.
        let _ = span.set_parent(cx);
    }
}

/// Writes `span`'s context into `headers` (`traceparent`, and `tracestate` when set), so the
/// next hop's spans become its children.
pub fn inject_headers(span: &Span, headers: &mut HeaderMap) {
    if span.is_disabled() {
        return;
    }
    let cx = span.context();
    opentelemetry::global::get_text_map_propagator(|p| {
        p.inject_context(&cx, &mut HeaderInjector(headers))
    });
}
