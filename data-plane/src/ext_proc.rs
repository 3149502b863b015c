//! The endpoint picker: Envoy's external-processing protocol (`envoy.service.ext_proc.v3`) as the
//! Gateway API Inference Extension uses it, served on `--ext-proc-listen`. Envoy asks, for each
//! request, which model server should take it; the answer comes from the same routing table and
//! the same [`crate::placement::Placement`] as the HTTP router's (every strategy, variant rule,
//! `x-prefix-aware-id`, `x-endpoint-name` or the `model` field).
//!
//! One gRPC stream is one HTTP request. The picker reads the request's headers and body in the
//! processing mode Envoy announces in its first message (`protocol_config`):
//! - `BUFFERED` (or `BUFFERED_PARTIAL`) request body: the headers are let through unchanged, the
//!   pick rides on the body's response (a header mutation in a body response takes effect in
//!   that mode only);
//! - `FULL_DUPLEX_STREAMED` (the extension's reference configuration): the headers' response waits
//!   until the body has ended, carries the pick, and the body follows whole, as one streamed
//!   chunk;
//! - no body (`NONE`, or a request without one): the pick is made on the headers.
//!
//! The pick is the `x-gateway-destination-endpoint` header (`ip:port`) and, in dynamic metadata
//! under `envoy.lb`, the same key holding the ordered list `primary,fallback`. A subset hint
//! (`envoy.lb.subset_hint` / `x-gateway-destination-endpoint-subset`) restricts the pick to the
//! instances it names (503 when none is eligible). The request counts as in flight on the chosen
//! instance from the pick until its response ends (end of body or trailers) or the stream
//! closes, so LEAST_OUTSTANDING_REQUESTS, bounded load and `concurrency_threshold` see it; the
//! response body, when Envoy sends it, is read for the engine's cache report as on the HTTP
//! path ([`crate::usage`]). Past `--max-in-flight`, or a body larger than `--max-body-bytes`, the
//! answer is an ImmediateResponse (429, 413) with an OpenAI-shaped error.
//!
//! Traced like the HTTP path: a `route` span per pick (`front_door = "ext_proc"`), parented by
//! the request's `traceparent`, its context sent on to the instance; it ends with the response.
//!
//! Authentication is the gateway's: `--api-key-file` guards the HTTP listener only.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Arc;

use envoy_types::pb::envoy::config::core::v3::{
    header_value_option::HeaderAppendAction, HeaderValue as EnvoyHeader, HeaderValueOption,
};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    self as ep,
    external_processor_server::{ExternalProcessor, ExternalProcessorServer},
    processing_request::Request as Msg,
    processing_response::Response as Reply,
    BodyMutation, BodyResponse, CommonResponse, HeaderMutation, HeadersResponse, HttpHeaders,
    ImmediateResponse, ProcessingRequest, ProcessingResponse, StreamedBodyResponse,
    TrailersResponse,
};
use envoy_types::pb::google::protobuf::{value::Kind, Struct, Value};
use futures_util::Stream;
use http::HeaderValue;
use tonic::{Status, Streaming};

use crate::access::Refusal;
use crate::decision::FrontDoor;
use crate::load::{now_ms, InFlight};
use crate::placement::{Route, RouteRequest};
use crate::prompt::BodyKind;
use crate::proxy::{Router, X_DECISION, X_INSTANCE, X_TABLE_VERSION, X_VARIANT};
use crate::proxy::{X_ENDPOINT_NAME, X_PREFIX_AWARE_ID, X_TARGET_VARIANT};
use crate::response::{error_body, Admission, Outcome};
use crate::usage::UsageScanner;

/// The header Envoy's `ORIGINAL_DST` cluster reads the chosen endpoint from.
pub const DESTINATION: &str = "x-gateway-destination-endpoint";
/// The dynamic-metadata namespace of the pick.
pub const LB_NAMESPACE: &str = "envoy.lb";
/// The filter-metadata namespace, and its key, of the gateway's subset hint.
pub const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
pub const SUBSET_KEY: &str = "x-gateway-destination-endpoint-subset";

/// The `ExternalProcessor` service over the router's table and placement.
pub(crate) struct Picker {
    router: Arc<Router>,
}

impl Picker {
    pub(crate) fn service(router: Arc<Router>) -> ExternalProcessorServer<Picker> {
        ExternalProcessorServer::new(Picker { router })
    }
}

type Replies = Pin<Box<dyn Stream<Item = Result<ProcessingResponse, Status>> + Send>>;

#[tonic::async_trait]
impl ExternalProcessor for Picker {
    type ProcessStream = Replies;

    async fn process(
        &self,
        request: tonic::Request<Streaming<ProcessingRequest>>,
    ) -> Result<tonic::Response<Replies>, Status> {
        // The replies are produced as tonic polls the response stream, on the stream's own task:
        // no task or channel of ours between Envoy's messages and the answers (on
        // router_overhead's ENVOY=1 run, wake-ups were most of the picker's cost). Envoy
        // closing or resetting the stream drops it, and with it the request's in-flight count.
        let state = Pending {
            exchange: Exchange::new(self.router.clone()),
            inbound: request.into_inner(),
            queue: std::collections::VecDeque::new(),
            done: false,
        };
        let replies = futures_util::stream::unfold(state, |mut p| async move {
            loop {
                if let Some(m) = p.queue.pop_front() {
                    // an ImmediateResponse ends the exchange
                    if matches!(m.response, Some(Reply::ImmediateResponse(_))) {
                        p.done = true;
                        p.queue.clear();
                    }
                    return Some((Ok(m), p));
                }
                if p.done {
                    return None;
                }
                match p.inbound.message().await {
                    Ok(Some(message)) => {
                        let replies = p.exchange.on_message(message);
                        p.queue.extend(replies);
                    }
                    // the request is over, or was reset
                    Ok(None) | Err(_) => return None,
                }
            }
        });
        Ok(tonic::Response::new(Box::pin(replies)))
    }
}

/// One stream's state between polls: the exchange, Envoy's messages, replies not yet taken.
struct Pending {
    exchange: Exchange,
    inbound: Streaming<ProcessingRequest>,
    queue: std::collections::VecDeque<ProcessingResponse>,
    done: bool,
}

/// What the request's headers say about its routing.
#[derive(Default)]
struct Head {
    path: String,
    endpoint: Option<String>,
    target_variant: Option<String>,
    prefix_aware_id: Option<Vec<u8>>,
    /// `traceparent` / `tracestate`, when the request carries them.
    trace: Option<http::HeaderMap>,
}

impl Head {
    fn read(headers: &HttpHeaders) -> Self {
        let mut head = Head::default();
        for h in headers.headers.iter().flat_map(|m| &m.headers) {
            let value = || header_text(h);
            match h.key.as_str() {
                ":path" => head.path = value(),
                k if k == X_ENDPOINT_NAME.as_str() => head.endpoint = Some(value()),
                k if k == X_TARGET_VARIANT.as_str() => head.target_variant = Some(value()),
                k if k == X_PREFIX_AWARE_ID.as_str() => {
                    head.prefix_aware_id = Some(value().into_bytes())
                }
                "traceparent" | "tracestate" => {
                    if let (Ok(name), Ok(v)) = (
                        http::HeaderName::from_bytes(h.key.as_bytes()),
                        HeaderValue::from_str(&value()),
                    ) {
                        head.trace
                            .get_or_insert_with(http::HeaderMap::new)
                            .insert(name, v);
                    }
                }
                _ => {}
            }
        }
        head
    }

    /// The body's kind and the endpoint the path names, as [`Router::handle`] dispatches.
    fn kind(&self) -> (BodyKind, Option<String>) {
        let path = self.path.split('?').next().unwrap_or_default();
        if path == "/v1/responses" {
            return (BodyKind::Responses, None);
        }
        match crate::proxy::invocation_endpoint(path) {
            Some(Ok(name)) => (BodyKind::Raw, Some(name)),
            _ => (BodyKind::OpenAi, None),
        }
    }
}

/// Envoy sends header values in `raw_value` (or, older, `value`).
fn header_text(h: &EnvoyHeader) -> String {
    if h.raw_value.is_empty() {
        h.value.clone()
    } else {
        String::from_utf8_lossy(&h.raw_value).into_owned()
    }
}

/// A request placed on an instance: held until its response ends.
struct Picked {
    in_flight: InFlight,
    _admission: Admission,
    outcome: Outcome,
    /// The response headers the HTTP router adds (instance, variant, table version, decision).
    route_headers: [(http::HeaderName, HeaderValue); 4],
    /// The response status, once its headers passed.
    status: u16,
    /// The pick's `route` span (disabled unless traces are exported): ends with the response.
    span: tracing::Span,
    decision: crate::decision::Decision,
}

/// One gRPC stream: one HTTP request through Envoy.
struct Exchange {
    router: Arc<Router>,
    first: bool,
    request_mode: BodySendMode,
    response_mode: BodySendMode,
    head: Option<Head>,
    subset: Option<Vec<String>>,
    body: Vec<u8>,
    picked: Option<Picked>,
}

impl Exchange {
    fn new(router: Arc<Router>) -> Self {
        Exchange {
            router,
            first: true,
            request_mode: BodySendMode::None,
            response_mode: BodySendMode::None,
            head: None,
            subset: None,
            body: Vec::new(),
            picked: None,
        }
    }

    /// The replies to one message from Envoy.
    fn on_message(&mut self, message: ProcessingRequest) -> Vec<ProcessingResponse> {
        if self.first {
            self.first = false;
            if let Some(c) = &message.protocol_config {
                self.request_mode =
                    BodySendMode::try_from(c.request_body_mode).unwrap_or(BodySendMode::None);
                self.response_mode =
                    BodySendMode::try_from(c.response_body_mode).unwrap_or(BodySendMode::None);
            }
        }
        if self.subset.is_none() {
            self.subset = subset_hint(&message);
        }
        let replies = match message.request {
            Some(request) => self.step(request),
            None => Vec::new(),
        };
        for r in &replies {
            match &r.response {
                Some(Reply::ImmediateResponse(i)) => {
                    let status = i.status.as_ref().map_or(500, |s| s.code);
                    self.router
                        .metrics
                        .record_ext_proc(u16::try_from(status).unwrap_or(500));
                }
                // the pick rides on the reply that carries the destination
                _ if r.dynamic_metadata.is_some() => self.router.metrics.record_ext_proc(200),
                _ => {}
            }
        }
        replies
    }

    /// The replies to one message from Envoy (none while a full-duplex request body is read).
    fn step(&mut self, request: Msg) -> Vec<ProcessingResponse> {
        match request {
            Msg::RequestHeaders(headers) => {
                self.head = Some(Head::read(&headers));
                if headers.end_of_stream || self.request_mode == BodySendMode::None {
                    return self.pick(On::Headers);
                }
                match self.request_mode {
                    BodySendMode::FullDuplexStreamed => Vec::new(),
                    BodySendMode::Streamed => vec![immediate(
                        500,
                        "the endpoint picker cannot carry its pick on a STREAMED request body: \
                         configure request_body_mode BUFFERED or FULL_DUPLEX_STREAMED",
                        "server_error",
                        None,
                    )],
                    _ => vec![reply(Reply::RequestHeaders(HeadersResponse::default()))],
                }
            }
            Msg::RequestBody(body) => {
                if self.body.len() + body.body.len() > self.router.max_body_bytes() {
                    self.router.metrics.record_unrouted(FrontDoor::ExtProc, 413);
                    let msg = format!(
                        "request body is larger than the limit of {} bytes",
                        self.router.max_body_bytes()
                    );
                    return vec![immediate(413, &msg, "request_too_large", None)];
                }
                self.body.extend_from_slice(&body.body);
                if !body.end_of_stream {
                    return Vec::new();
                }
                if self.request_mode == BodySendMode::FullDuplexStreamed {
                    self.pick(On::HeadersThenBody)
                } else {
                    self.pick(On::Body)
                }
            }
            Msg::RequestTrailers(_) => {
                vec![reply(Reply::RequestTrailers(TrailersResponse::default()))]
            }
            Msg::ResponseHeaders(headers) => {
                let mut common = CommonResponse::default();
                if let Some(p) = self.picked.as_mut() {
                    p.status = headers
                        .headers
                        .iter()
                        .flat_map(|m| &m.headers)
                        .find(|h| h.key == ":status")
                        .and_then(|h| header_text(h).parse().ok())
                        .unwrap_or(0);
                    // the route's request counter, by the status Envoy got from the instance
                    p.outcome
                        .stats
                        .record(FrontDoor::ExtProc, p.decision, p.status);
                    if !p.span.is_disabled() {
                        if let Ok(status) = http::StatusCode::from_u16(p.status) {
                            crate::spans::record_status(&p.span, status);
                        }
                    }
                    common.header_mutation = Some(HeaderMutation {
                        set_headers: p
                            .route_headers
                            .iter()
                            .map(|(k, v)| set_header(k.as_str(), v.as_bytes()))
                            .collect(),
                        remove_headers: Vec::new(),
                    });
                }
                if headers.end_of_stream {
                    self.ended();
                }
                vec![reply(Reply::ResponseHeaders(HeadersResponse {
                    response: Some(common),
                }))]
            }
            Msg::ResponseBody(body) => {
                if let Some(p) = self.picked.as_mut() {
                    p.outcome.scanner.feed(&body.body);
                }
                let end = body.end_of_stream;
                let body_reply = if self.response_mode == BodySendMode::FullDuplexStreamed {
                    Reply::ResponseBody(BodyResponse {
                        response: Some(CommonResponse {
                            body_mutation: Some(streamed(body.body, end)),
                            ..Default::default()
                        }),
                    })
                } else {
                    Reply::ResponseBody(BodyResponse::default())
                };
                if end {
                    self.ended();
                }
                vec![reply(body_reply)]
            }
            Msg::ResponseTrailers(_) => {
                self.ended();
                vec![reply(Reply::ResponseTrailers(TrailersResponse::default()))]
            }
        }
    }

    /// The response ended whole: a success for passive health unless a 5xx, the engine's
    /// report learned from a 2xx, and the request no longer in flight.
    fn ended(&mut self) {
        let Some(p) = self.picked.take() else { return };
        if p.status < 500 {
            p.in_flight.instance().record_success();
        }
        if (200..300).contains(&p.status) {
            p.outcome.learn(&p.in_flight);
        }
    }

    /// Places the request and answers with the pick: on the headers' response, the body's, or
    /// the headers' followed by the body (full duplex).
    fn pick(&mut self, on: On) -> Vec<ProcessingResponse> {
        let admission = match self.router.access.admit() {
            Ok(a) => a,
            Err(refusal) => {
                self.router.metrics.record_unrouted(FrontDoor::ExtProc, 429);
                let msg = match refusal {
                    Refusal::Overloaded(n) => format!("{n} requests in flight: try again shortly"),
                    other => format!("refused ({})", other.status()),
                };
                return vec![immediate(429, &msg, "rate_limit_exceeded", Some("1"))];
            }
        };
        let Some(table) = self.router.table.load_full() else {
            self.router.metrics.record_unrouted(FrontDoor::ExtProc, 503);
            let msg = "no routing table applied yet";
            return vec![immediate(503, msg, "service_unavailable", Some("1"))];
        };
        let head = self.head.take().unwrap_or_default();
        let (kind, path_endpoint) = head.kind();
        let started = std::time::Instant::now();
        let request = RouteRequest {
            kind,
            body: &self.body,
            endpoint: path_endpoint.as_deref().or(head.endpoint.as_deref()),
            target_variant: head.target_variant.as_deref(),
            prefix_aware_id: head.prefix_aware_id.as_deref(),
        };
        let route = match self.router.placement.route(&table, &request) {
            Ok(route) => route,
            Err(e) => {
                self.router
                    .metrics
                    .record_unrouted(FrontDoor::ExtProc, e.status());
                let kind = if e.status() == 404 {
                    "not_found_error"
                } else {
                    "service_unavailable"
                };
                return vec![immediate(e.status(), &e.to_string(), kind, None)];
            }
        };
        let Some((route, order)) = self.within_subset(route) else {
            self.router.metrics.record_unrouted(FrontDoor::ExtProc, 503);
            let msg = "no instance of the endpoint's variant is in the gateway's subset hint";
            return vec![immediate(503, msg, "service_unavailable", Some("1"))];
        };
        let variant = route.variant;
        let instance = &variant.instances()[route.instance];
        let in_flight = InFlight::start(instance.state(), variant.load());
        self.router
            .metrics
            .decision(FrontDoor::ExtProc)
            .observe(started.elapsed());
        // Traced: the caller's context parents the pick's `route` span, whose own context goes
        // to the instance in `traceparent` (as the HTTP router's `upstream` span's does).
        let span = crate::spans::route_span(FrontDoor::ExtProc.as_str());
        let mut set_headers = Vec::new();
        if !span.is_disabled() {
            if let Some(trace) = &head.trace {
                telemetry::propagation::set_parent_from_headers(&span, trace);
            }
            crate::spans::record_route(&span, &table, &route, self.body.len());
            let mut out = http::HeaderMap::new();
            telemetry::propagation::inject_headers(&span, &mut out);
            for (k, v) in &out {
                set_headers.push(set_header(k.as_str(), v.as_bytes()));
            }
        }
        self.picked = Some(Picked {
            in_flight,
            _admission: admission,
            outcome: Outcome {
                scanner: UsageScanner::default(),
                stats: Arc::clone(instance.stats()),
                decision: route.decision,
                prediction: route.prediction,
                tuning: *self.router.placement.tuning(),
            },
            route_headers: [
                (X_INSTANCE, instance.header().clone()),
                (X_VARIANT, variant.header().clone()),
                (X_TABLE_VERSION, table.version_header().clone()),
                (X_DECISION, route.decision.header()),
            ],
            status: 0,
            decision: route.decision,
            span,
        });
        let destination = instance.authority().as_str().to_string();
        set_headers.push(set_header(DESTINATION, destination.as_bytes()));
        let common = CommonResponse {
            header_mutation: Some(HeaderMutation {
                set_headers,
                remove_headers: Vec::new(),
            }),
            ..Default::default()
        };
        let first = match on {
            On::Headers | On::HeadersThenBody => Reply::RequestHeaders(HeadersResponse {
                response: Some(common),
            }),
            On::Body => Reply::RequestBody(BodyResponse {
                response: Some(common),
            }),
        };
        let mut replies = vec![ProcessingResponse {
            response: Some(first),
            dynamic_metadata: Some(lb_metadata(&order.join(","))),
            ..Default::default()
        }];
        if matches!(on, On::HeadersThenBody) {
            let body = std::mem::take(&mut self.body);
            replies.push(reply(Reply::RequestBody(BodyResponse {
                response: Some(CommonResponse {
                    body_mutation: Some(streamed(body, true)),
                    ..Default::default()
                }),
            })));
        }
        replies
    }

    /// The route, moved into the gateway's subset hint when it names one and the route's
    /// instance is not in it (to the least loaded instance of the subset), and the ordered
    /// destinations: the pick, then the placement's next choice when there is one.
    fn within_subset<'t>(&self, mut route: Route<'t>) -> Option<(Route<'t>, Vec<String>)> {
        let instances = route.variant.instances();
        let allowed = |i: usize| match &self.subset {
            None => true,
            Some(s) => s.iter().any(|a| a == instances[i].authority().as_str()),
        };
        if !allowed(route.instance) {
            let to = (0..instances.len())
                .filter(|&i| allowed(i) && !instances[i].state().is_ejected(now_ms()))
                .min_by_key(|&i| instances[i].state().outstanding())?;
            // As for a retry: this instance was not the placement's, so its outcome says nothing
            // of what the prefix index predicted.
            route.moved(to, route.decision);
        }
        let mut order = vec![instances[route.instance].authority().as_str().to_string()];
        if let Some((next, _)) =
            self.router
                .placement
                .choose(route.variant, route.key, Some(route.instance), now_ms())
        {
            if allowed(next) {
                order.push(instances[next].authority().as_str().to_string());
            }
        }
        Some((route, order))
    }
}

/// Where a pick is answered: on the request headers' response, the body's, or (full duplex)
/// the headers' followed by the body, which the picker held.
#[derive(Clone, Copy)]
enum On {
    Headers,
    Body,
    HeadersThenBody,
}

fn reply(r: Reply) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(r),
        ..Default::default()
    }
}

/// A body passed on as one streamed chunk (full-duplex mode: the processor sends the body).
fn streamed(body: Vec<u8>, end_of_stream: bool) -> BodyMutation {
    BodyMutation {
        mutation: Some(ep::body_mutation::Mutation::StreamedResponse(
            StreamedBodyResponse {
                body,
                end_of_stream,
                ..Default::default()
            },
        )),
    }
}

fn set_header(key: &str, value: &[u8]) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(EnvoyHeader {
            key: key.to_string(),
            raw_value: value.to_vec(),
            ..Default::default()
        }),
        append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
        ..Default::default()
    }
}

/// `envoy.lb: { x-gateway-destination-endpoint: "ip:port[,ip:port]" }`
fn lb_metadata(destinations: &str) -> Struct {
    let text = |s: String| Value {
        kind: Some(Kind::StringValue(s)),
    };
    let inner = Struct {
        fields: HashMap::from([(DESTINATION.to_string(), text(destinations.to_string()))]),
    };
    Struct {
        fields: HashMap::from([(
            LB_NAMESPACE.to_string(),
            Value {
                kind: Some(Kind::StructValue(inner)),
            },
        )]),
    }
}

/// The gateway's subset hint: the endpoints (`ip:port`) the pick must come from, as a list or
/// one comma-separated string, in the request's metadata context.
fn subset_hint(message: &ProcessingRequest) -> Option<Vec<String>> {
    let value = message
        .metadata_context
        .as_ref()?
        .filter_metadata
        .get(SUBSET_NAMESPACE)?
        .fields
        .get(SUBSET_KEY)?;
    let mut out = Vec::new();
    let mut push = |s: &str| {
        out.extend(
            s.split(',')
                .map(str::trim)
                .filter(|a| !a.is_empty())
                .map(str::to_string),
        )
    };
    match value.kind.as_ref()? {
        Kind::StringValue(s) => push(s),
        Kind::ListValue(list) => {
            for v in &list.values {
                if let Some(Kind::StringValue(s)) = &v.kind {
                    push(s);
                }
            }
        }
        _ => return None,
    }
    Some(out)
}

/// An ImmediateResponse: the status, an OpenAI-shaped JSON error, `Retry-After` when given.
fn immediate(
    status: u16,
    message: &str,
    kind: &str,
    retry_after: Option<&str>,
) -> ProcessingResponse {
    let mut headers = vec![set_header("content-type", b"application/json")];
    if let Some(r) = retry_after {
        headers.push(set_header("retry-after", r.as_bytes()));
    }
    reply(Reply::ImmediateResponse(ImmediateResponse {
        status: Some(HttpStatus {
            code: i32::from(status),
        }),
        headers: Some(HeaderMutation {
            set_headers: headers,
            remove_headers: Vec::new(),
        }),
        body: error_body(message, kind),
        details: message.to_string(),
        ..Default::default()
    }))
}

/// Serves the picker on `listener` until `shutdown` completes (then lets open streams end).
pub(crate) async fn serve(
    router: Arc<Router>,
    listener: tokio::net::TcpListener,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), tonic::transport::Error> {
    // Without TCP_NODELAY each reply waits out Nagle against Envoy's delayed ACK (about 40 ms
    // per request at one connection, on router_overhead's ENVOY=1 run).
    let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
    tonic::transport::Server::builder()
        .add_service(Picker::service(router))
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await
}
