//! The router's responses: its own small JSON bodies, and an instance's body streamed frame by
//! frame ([`ResponseBody`]), read for the engine's cache report as it passes, holding the
//! instance's in-flight count until it ends, and ending a stream that breaks off with an SSE
//! error event where the client reads events.

use std::future::Future as _;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering, Ordering::Relaxed};
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderValue};
use http::{Response, StatusCode};
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use tokio::time::Sleep;

use crate::decision::Decision;
use crate::load::{now_ms, InFlight};
use crate::placement::Tuning;
use crate::prefix_index::{Prediction, Timing};
use crate::route_stats::RouteStats;
use crate::spans::{end_trace, BodyTrace};
use crate::upstream::Conn;
use crate::usage::UsageScanner;

pub(crate) fn json_response(status: u16, body: impl Into<Bytes>) -> Response<ResponseBody> {
    let mut r = Response::new(ResponseBody::full(body));
    *r.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

/// `{"error":{"message":...,"type":...}}`, OpenAI's error shape.
pub(crate) fn error_body(message: &str, kind: &str) -> Vec<u8> {
    let body = serde_json::json!({ "error": { "message": message, "type": kind } });
    serde_json::to_vec(&body).unwrap_or_default()
}

/// An OpenAI error response with a machine-readable `code` (refusals: `overloaded`,
/// `queue_timeout`, ...).
pub(crate) fn coded_error_response(
    status: u16,
    message: &str,
    kind: &str,
    code: &str,
) -> Response<ResponseBody> {
    let body = serde_json::json!({
        "error": { "message": message, "type": kind, "param": null, "code": code }
    });
    json_response(status, serde_json::to_vec(&body).unwrap_or_default())
}

/// A JSON response with an [`error_body`].
pub(crate) fn error_response(status: u16, message: &str, kind: &str) -> Response<ResponseBody> {
    json_response(status, error_body(message, kind))
}

/// `content-type: text/event-stream`
pub(crate) fn is_event_stream(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"))
}

/// Drives `conn` until `body`'s first frame (`None`: the body is empty) or its failure.
pub(crate) async fn first_frame(
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
pub(crate) struct UpstreamStream {
    /// The body's first frame, read before the head was answered, to send first.
    pub(crate) pending: Option<Frame<Bytes>>,
    pub(crate) in_flight: InFlight,
    /// The router's ejection counter: a body that fails counts against its instance's health.
    pub(crate) ejections: Arc<std::sync::atomic::AtomicU64>,
    /// `text/event-stream`: a failure ends the stream with an SSE error event (as OpenAI's API
    /// does), so a client never takes a cut stream for a whole one.
    pub(crate) sse: bool,
    /// The bytes sent so far end between events (`\n\n`), or none were sent.
    pub(crate) at_event_boundary: bool,
    /// A 5xx passed through (both attempts failed): already counted as a failure, so its body
    /// ending is no success.
    pub(crate) server_error: bool,
    /// A 2xx body: read for the engine's cache report as it passes.
    pub(crate) outcome: Option<Outcome>,
}

/// What one successful response teaches: the engine's cache report, counted for the route and
/// the decision that placed the request, and (PREFIX_AWARE) held against what the prefix index
/// predicted.
pub(crate) struct Outcome {
    pub(crate) scanner: UsageScanner,
    pub(crate) stats: Arc<RouteStats>,
    pub(crate) decision: Decision,
    /// [`crate::placement::Route::prediction`].
    pub(crate) prediction: Option<Prediction>,
    pub(crate) tuning: Tuning,
}

impl Outcome {
    /// The response ended whole: the engine's report (if it sent one) is learned from.
    pub(crate) fn learn(&self, in_flight: &InFlight) {
        let Some(report) = self.scanner.report() else {
            return;
        };
        self.stats.record_usage(self.decision, report);
        if let Some(p) = self.prediction {
            let cached = report.cached_tokens.min(report.prompt_tokens);
            let cached_bytes = (u64::from(p.prompt_bytes) * cached)
                .checked_div(report.prompt_tokens)
                .unwrap_or(0) as u32;
            let sample = Timing {
                seconds: in_flight.elapsed().as_secs_f64(),
                queued: in_flight.queued(),
            };
            in_flight
                .variant()
                .index()
                .learn(p, cached_bytes, Some(sample), &self.tuning);
        }
    }
}

impl UpstreamStream {
    /// The body ended: the exchange was a success for passive health (unless a 5xx), and the
    /// engine's report (if it sent one) is learned from.
    fn ended(&self) {
        if !self.server_error {
            self.in_flight.instance().record_success();
        }
        if let Some(o) = &self.outcome {
            o.learn(&self.in_flight);
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
        event.extend_from_slice(b"data: ");
        event.extend_from_slice(&error_body(&error.to_string(), kind));
        event.extend_from_slice(b"\n\n");
        Ok(Frame::data(Bytes::from(event)))
    }
}

/// A place among the router's requests in flight (`--max-in-flight`, taken by
/// [`crate::access::Access::admit`]); released on drop, so held by the response body until it
/// ends.
#[derive(Debug)]
pub(crate) struct Admission(pub(crate) Arc<AtomicUsize>);

impl Drop for Admission {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
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

    /// Holds the request's place under `--max-in-flight` until the body is done.
    pub(crate) fn hold(&mut self, admission: Admission) {
        self.admission = Some(admission);
    }

    pub(crate) fn upstream(
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

#[cfg(test)]
mod tests {
    use super::*;

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
