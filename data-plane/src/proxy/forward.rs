//! Forwarding: an attempt at the chosen instance, once more at the next instance on a connect
//! error or a 5xx before the client saw any byte, and the answer handed to
//! [`crate::response::ResponseBody`] to stream.

use std::pin::Pin;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::uri::PathAndQuery;
use http::Response;
use http_body::Frame;
use hyper::body::Incoming;
use tokio::time::Sleep;
use tracing::field::Empty;
use tracing::Span;

use super::request::{strip_hop_by_hop, upstream_request};
use super::{error_chain, set_route_headers, Router};
use crate::decision::FrontDoor;
use crate::load::{now_ms, InFlight};
use crate::placement::Route;
use crate::response::{first_frame, is_event_stream, Outcome, ResponseBody, UpstreamStream};
use crate::spans::{record_failure, record_route, BodyTrace};
use crate::table::RoutingTable;
use crate::upstream::{self, Conn, UpstreamError};
use crate::usage::UsageScanner;

/// One request on its way to an instance: what every attempt sends, and the spans it reports to.
pub(super) struct Exchange<'a> {
    pub(super) table: &'a RoutingTable,
    pub(super) parts: &'a http::request::Parts,
    pub(super) body: Bytes,
    pub(super) upstream_path: &'a PathAndQuery,
    /// The request's `route` span.
    pub(super) span: &'a Span,
}

/// An instance's response head, the connection its body comes over, and the body's first
/// frame when it was read before answering.
struct Answer {
    response: Response<Incoming>,
    conn: Box<Conn>,
    first: Option<Frame<Bytes>>,
    /// When the request went out (traced requests only).
    sent: Option<Instant>,
}

/// How one attempt at an instance ended. (An `Answer` is large, and returned once per attempt:
/// boxing it would allocate per request.)
#[allow(clippy::large_enum_variant)]
enum Attempt {
    /// A response to pass on (not a 5xx).
    Answered(Answer),
    /// Worth another instance: nothing has reached the client yet.
    Failed(Failure),
    /// The router's own final answer (the deadline passed, or no request could be built).
    Final(Response<ResponseBody>),
}

/// An attempt that may be retried elsewhere.
#[allow(clippy::large_enum_variant)]
enum Failure {
    /// A 5xx: passed on if the retry is not possible.
    ServerError(Answer),
    /// No usable response (connect, TLS, protocol, or a body that failed before its first
    /// frame): 502 if the retry is not possible.
    Upstream(UpstreamError),
}

impl Router {
    /// Sends the request; on a connect error or a 5xx before any response byte, once more to the
    /// next instance.
    pub(super) async fn forward(
        &self,
        x: &Exchange<'_>,
        mut route: Route<'_>,
        mut in_flight: InFlight,
        mut deadline: Pin<Box<Sleep>>,
    ) -> Response<ResponseBody> {
        let variant = route.variant;
        let mut retried = false;
        let authorization = self
            .access
            .upstream_authorization(x.parts.headers.get(header::AUTHORIZATION));
        loop {
            let instance = &variant.instances()[route.instance];
            let upstream = tracing::info_span!(
                parent: x.span,
                "upstream",
                otel.kind = "client",
                instance = instance.address(),
                status = Empty,
                ttfb_ms = Empty,
                bytes = Empty,
                error = Empty,
                otel.status_code = Empty,
            );
            let failure = match self
                .attempt(x, &route, authorization.as_ref(), &upstream, &mut deadline)
                .await
            {
                Attempt::Answered(answer) => {
                    let trace =
                        BodyTrace::start(x.span, upstream, answer.sent, answer.response.status());
                    return self.respond(x.table, &route, answer, trace, in_flight, deadline);
                }
                Attempt::Final(response) => return response,
                Attempt::Failed(failure) => failure,
            };
            self.count_failure(instance);
            if !retried {
                if let Some((next, decision)) =
                    self.placement
                        .choose(variant, route.key, Some(route.instance), now_ms())
                {
                    retried = true;
                    self.metrics.retries.fetch_add(1, Relaxed);
                    in_flight = InFlight::start(variant.instances()[next].state(), variant.load());
                    // a retry's outcome says nothing of the key's placement
                    route.moved(next, decision);
                    if !x.span.is_disabled() {
                        match &failure {
                            Failure::ServerError(a) => {
                                record_failure(&upstream, a.response.status().as_str())
                            }
                            Failure::Upstream(e) => record_failure(&upstream, &error_chain(e)),
                        }
                        record_route(x.span, x.table, &route, x.body.len());
                    }
                    continue;
                }
            }
            return match failure {
                Failure::ServerError(answer) => {
                    let status = answer.response.status();
                    let trace = BodyTrace::start(x.span, upstream, answer.sent, status);
                    self.respond(x.table, &route, answer, trace, in_flight, deadline)
                }
                Failure::Upstream(e) => {
                    let msg = format!(
                        "upstream {} failed: {}",
                        instance.address(),
                        error_chain(&e)
                    );
                    if !upstream.is_disabled() {
                        record_failure(&upstream, &msg);
                    }
                    self.routed_error(x.table, &route, 502, &msg, "upstream_error")
                }
            };
        }
    }

    /// One exchange with the route's instance, up to the response head (and, unless it is an
    /// event stream, the body's first frame: a body that fails before it can still be retried or
    /// answered 502, since the client has seen nothing yet).
    async fn attempt(
        &self,
        x: &Exchange<'_>,
        route: &Route<'_>,
        authorization: Option<&HeaderValue>,
        upstream: &Span,
        deadline: &mut Pin<Box<Sleep>>,
    ) -> Attempt {
        let instance = &route.variant.instances()[route.instance];
        let target = match instance.target(x.upstream_path) {
            Ok(t) => t,
            Err(e) => {
                let msg = format!(
                    "cannot build the upstream request for {}: {e}",
                    instance.address()
                );
                return Attempt::Final(self.routed_error(
                    x.table,
                    route,
                    502,
                    &msg,
                    "upstream_error",
                ));
            }
        };
        let traced = !upstream.is_disabled();
        let make = || {
            let mut request =
                upstream_request(x.parts, &target, instance.host(), authorization, &x.body);
            if traced {
                telemetry::propagation::inject_headers(upstream, request.headers_mut());
            }
            request
        };
        let sent = traced.then(Instant::now);
        let exchange = upstream::send(
            instance.state().pool(),
            instance.authority(),
            instance.tls().then_some(&self.upstream_tls),
            now_ms(),
            make,
        );
        let exchanged = tokio::select! {
            biased;
            exchanged = exchange => exchanged,
            () = deadline.as_mut() => {
                return Attempt::Final(self.timed_out(x.table, route, upstream, "response"));
            }
        };
        let (response, mut conn) = match exchanged {
            Ok((response, conn)) if response.status().is_server_error() => {
                return Attempt::Failed(Failure::ServerError(Answer {
                    response,
                    conn,
                    first: None,
                    sent,
                }))
            }
            Ok(exchanged) => exchanged,
            Err(e) => return Attempt::Failed(Failure::Upstream(e)),
        };
        // A success for passive health once the body has ended, too (a body that breaks off is
        // a failure).
        let (head, mut incoming) = response.into_parts();
        let first = if is_event_stream(&head.headers) {
            Ok(None)
        } else {
            tokio::select! {
                biased;
                first = first_frame(&mut conn, &mut incoming) => first,
                () = deadline.as_mut() => {
                    return Attempt::Final(self.timed_out(x.table, route, upstream, "response body"));
                }
            }
        };
        match first {
            Ok(first) => Attempt::Answered(Answer {
                response: Response::from_parts(head, incoming),
                conn,
                first,
                sent,
            }),
            Err(e) => Attempt::Failed(Failure::Upstream(UpstreamError::Http(e))),
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

    /// The instance's answer to the client: its head (hop-by-hop headers gone, the route's
    /// headers added) and its body, streamed ([`ResponseBody`]).
    fn respond(
        &self,
        table: &RoutingTable,
        route: &Route<'_>,
        answer: Answer,
        trace: Option<Box<BodyTrace>>,
        in_flight: InFlight,
        deadline: Pin<Box<Sleep>>,
    ) -> Response<ResponseBody> {
        let (mut parts, body) = answer.response.into_parts();
        strip_hop_by_hop(&mut parts.headers);
        let instance = &route.variant.instances()[route.instance];
        instance
            .stats()
            .record(FrontDoor::Http, route.decision, parts.status.as_u16());
        set_route_headers(&mut parts.headers, table, route);
        let sse = is_event_stream(&parts.headers);
        let outcome = parts.status.is_success().then(|| Outcome {
            scanner: UsageScanner::default(),
            stats: Arc::clone(instance.stats()),
            decision: route.decision,
            prediction: route.prediction,
            tuning: *self.placement.tuning(),
        });
        let stream = UpstreamStream {
            pending: answer.first,
            in_flight,
            ejections: Arc::clone(&self.metrics.ejections),
            server_error: parts.status.is_server_error(),
            sse,
            at_event_boundary: true,
            outcome,
        };
        Response::from_parts(
            parts,
            ResponseBody::upstream(body, answer.conn, stream, deadline, trace),
        )
    }
}
