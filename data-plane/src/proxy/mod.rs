//! The HTTP side: dispatch by path ([`Router::handle`]), admission under `--max-in-flight`,
//! the request read ([`request`]), routed and forwarded with one retry ([`forward`]), the
//! response streamed back ([`crate::response`]), and JSON errors.
//!
//! Tracing ([`crate::spans`]): each proxied request has a `route` span and one `upstream` child
//! span per attempt, both ending with the response body. The caller's W3C `traceparent` parents
//! `route`; `upstream`'s context goes to the instance in `traceparent`. With trace export off
//! these spans are disabled: no header is read or written and nothing is allocated for them.

mod forward;
mod request;

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwapOption;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::uri::PathAndQuery;
use http::{Method, Request, Response};
use hyper::body::Incoming;
use tokio::time::Sleep;
use tracing::Span;

use self::forward::Exchange;
pub(crate) use self::request::invocation_endpoint;
use self::request::routing_headers;
use crate::access::{self, Access};
use crate::config::Config;
use crate::decision::FrontDoor;
use crate::flow::{self, FlowControl, Refused, Switch, Ticket, X_QUEUED_MS};
use crate::load::{now_ms, InFlight};
use crate::metrics::Metrics;
use crate::placement::{Placement, Route, RouteRequest};
use crate::priority::{KeyPolicy, Priority, Who};
use crate::prompt::BodyKind;
use crate::queue::Home;
use crate::response::{coded_error_response, error_response, json_response, ResponseBody};
use crate::spans::{record_queue, record_route, record_status, route_span};
use crate::table::RoutingTable;

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
/// kept per instance, in its state: see [`crate::upstream`].)
pub(crate) struct Router {
    pub(crate) table: ArcSwapOption<RoutingTable>,
    /// Notified whenever a table is stored (requests that came before the first one wait).
    pub(crate) table_applied: tokio::sync::Notify,
    pub(crate) placement: Placement,
    pub(crate) metrics: Metrics,
    pub(crate) access: Access,
    /// Requests waiting for an instance below its in-flight limit.
    pub(crate) flow: FlowControl,
    /// TLS towards `https://` instances.
    upstream_tls: tokio_rustls::TlsConnector,
    max_body_bytes: usize,
    request_timeout: Duration,
    body_read_timeout: Duration,
}

/// How flow control let a request through.
enum Waited {
    /// To the route's instance (which may have moved to a free one), whose place it holds:
    /// `Some(when it began to wait)` if it waited.
    Placed(Option<std::time::Instant>, InFlight),
    /// Woken under a table no longer served: route again by this one (waiting since then).
    NewTable(Arc<RoutingTable>, std::time::Instant),
}

/// A request flow control did not let through: its answer (400 for a bad flow header, else a
/// refusal), and when it began to wait if it did (its route span shows how long).
struct NotPlaced {
    response: Response<ResponseBody>,
    waited_since: Option<std::time::Instant>,
}

impl From<Response<ResponseBody>> for NotPlaced {
    fn from(response: Response<ResponseBody>) -> Self {
        NotPlaced {
            response,
            waited_since: None,
        }
    }
}

/// A request to proxy, as dispatch found it: the body's kind, the endpoint named by the path
/// (`/endpoints/{name}/invocations`), and the path the instance receives.
struct Call {
    req: Request<Incoming>,
    /// What the client's API key says of it (`None`: no keys configured).
    key: Option<KeyPolicy>,
    kind: BodyKind,
    path_endpoint: Option<String>,
    upstream_path: PathAndQuery,
}

impl Router {
    pub(crate) fn new(
        config: &Config,
        access: Access,
        upstream_tls: tokio_rustls::TlsConnector,
    ) -> Self {
        // each instance's upstream pool keeps a slot per worker thread
        crate::upstream::set_workers(config.resolved_workers());
        Router {
            table: ArcSwapOption::empty(),
            table_applied: tokio::sync::Notify::new(),
            placement: Placement::new(config.default_endpoint.clone()),
            metrics: Metrics::with_workers(config.resolved_workers()),
            access,
            flow: FlowControl::new(flow::Settings {
                enabled: config.flow_control == Switch::On,
                instance_max_in_flight: config.instance_max_in_flight,
                queue_timeout: Duration::from_millis(config.queue_timeout_ms),
                max_queued: usize::try_from(config.max_queued).unwrap_or(usize::MAX),
            }),
            upstream_tls,
            max_body_bytes: config.max_body_bytes,
            request_timeout: config.request_timeout(),
            body_read_timeout: Duration::from_millis(config.body_read_timeout_ms),
        }
    }

    pub(crate) fn max_body_bytes(&self) -> usize {
        self.max_body_bytes
    }

    pub(crate) async fn handle(
        self: Arc<Self>,
        req: Request<Incoming>,
        peer: std::net::IpAddr,
    ) -> Result<Response<ResponseBody>, Infallible> {
        let path = req.uri().path();
        let mut key = None;
        if !access::is_open_path(path) {
            match self.access.authenticate(req.headers(), peer) {
                Ok(policy) => key = policy,
                Err(refusal) => {
                    if matches!(refusal, access::Refusal::Throttled(_)) {
                        self.metrics.auth_throttled.fetch_add(1, Relaxed);
                    }
                    self.metrics
                        .record_unrouted(FrontDoor::Http, refusal.status());
                    return Ok(access::refusal_response(&refusal));
                }
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
                self.proxy(Call {
                    req,
                    key,
                    kind,
                    path_endpoint: None,
                    upstream_path: upstream,
                })
                .await
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
                let text = self.metrics.render(table.as_deref());
                let mut r = Response::new(ResponseBody::full(text));
                r.headers_mut().insert(
                    header::CONTENT_TYPE,
                    HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
                );
                r
            }
            _ => match invocation_endpoint(path) {
                Some(Ok(name)) if req.method() == Method::POST => {
                    self.proxy(Call {
                        req,
                        key,
                        kind: BodyKind::Raw,
                        path_endpoint: Some(name),
                        upstream_path: PathAndQuery::from_static("/invocations"),
                    })
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
    async fn proxy(&self, call: Call) -> Response<ResponseBody> {
        let admission = match self.access.admit() {
            Ok(a) => a,
            Err(refusal) => {
                self.metrics.record_unrouted(FrontDoor::Http, 503);
                return access::refusal_response(&refusal);
            }
        };
        let mut response = self.traced_route_and_forward(call).await;
        response.body_mut().hold(admission);
        response
    }

    /// [`Self::route_and_forward`] inside the request's `route` span.
    async fn traced_route_and_forward(&self, call: Call) -> Response<ResponseBody> {
        let span = route_span(FrontDoor::Http.as_str());
        if span.is_disabled() {
            return self.route_and_forward(call, &span).await;
        }
        telemetry::propagation::set_parent_from_headers(&span, call.req.headers());
        let response = self.route_and_forward(call, &span).await;
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

    async fn route_and_forward(&self, call: Call, span: &Span) -> Response<ResponseBody> {
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
        let (parts, body) = call.req.into_parts();
        let (endpoint_header, target_variant) = match routing_headers(&parts.headers) {
            Ok(names) => names,
            Err(msg) => return self.unrouted(Some(&table), 400, &msg, "invalid_request_error"),
        };
        let body = match self
            .read_body(&table, &parts.headers, body, deadline.as_mut())
            .await
        {
            Ok(body) => body,
            Err(response) => return response,
        };

        // a tenant over its rate limits is refused before anything is placed
        let mut rates = None;
        if let Some((k, tenant)) = call
            .key
            .as_ref()
            .filter(|k| k.rates.is_limited())
            .and_then(|k| Some((k, k.tenant.as_ref()?)))
        {
            let tokens = crate::flow::estimated_tokens(&body);
            match self
                .flow
                .rates
                .charge(tenant, k.rates, tokens, std::time::Instant::now())
            {
                Ok(report) => rates = Some(report),
                Err((why, wait, report)) => {
                    let mut r = self.flow_refusal(&table, why, wait, wait);
                    report.write(r.headers_mut());
                    return r;
                }
            }
        }

        let started = std::time::Instant::now();
        let request = RouteRequest {
            kind: call.kind,
            body: &body,
            endpoint: call.path_endpoint.as_deref().or(endpoint_header),
            target_variant,
            prefix_aware_id: parts.headers.get(X_PREFIX_AWARE_ID).map(|v| v.as_bytes()),
        };
        // A waiter woken under a table that is no longer served routes again by the new one.
        let mut table = table;
        let mut requeued = None;
        let mut route;
        let (queued, in_flight) = loop {
            route = match self.placement.route(&table, &request) {
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
            if requeued.is_none() {
                self.metrics
                    .decision(FrontDoor::Http)
                    .observe(started.elapsed());
            }
            if !self.flow.enabled() {
                let state = route.variant.instances()[route.instance].state();
                break (None, InFlight::start(state, route.variant.load()));
            }
            match self
                .wait_for_instance(
                    &table,
                    &mut route,
                    &parts.headers,
                    call.key.as_ref(),
                    &deadline,
                    requeued,
                )
                .await
            {
                Ok(Waited::Placed(queued, place)) => break (queued, place),
                Ok(Waited::NewTable(next, since)) => {
                    requeued = Some(since);
                    table = next;
                }
                Err(not) => {
                    if let Some(since) = not.waited_since {
                        record_queue(span, since);
                    }
                    return not.response;
                }
            }
        };
        if !span.is_disabled() {
            record_route(span, &table, &route, body.len());
        }
        if let Some(start) = queued {
            record_queue(span, start);
        }
        let exchange = Exchange {
            table: &table,
            parts: &parts,
            body,
            upstream_path: &call.upstream_path,
            span,
        };
        let mut response = self.forward(&exchange, route, in_flight, deadline).await;
        if let Some(start) = queued {
            response
                .headers_mut()
                .insert(X_QUEUED_MS, crate::flow::queued_header(start));
        }
        if let Some(report) = rates {
            report.write(response.headers_mut());
        }
        response
    }

    /// The answer to a request flow control refuses: OpenAI-shaped, `Retry-After` in whole
    /// seconds (at least 1), counted by reason.
    fn flow_refusal(
        &self,
        table: &RoutingTable,
        why: Refused,
        waited: std::time::Duration,
        retry: std::time::Duration,
    ) -> Response<ResponseBody> {
        self.metrics.flow.refused(why);
        self.metrics.record_unrouted(FrontDoor::Http, why.status());
        let kind = match why {
            Refused::Full | Refused::Shed | Refused::Draining => "service_unavailable",
            Refused::Timeout | Refused::Requests | Refused::Tokens => "rate_limit_exceeded",
        };
        let mut r = coded_error_response(why.status(), &why.message(waited), kind, why.as_str());
        let secs = retry.as_millis().div_ceil(1000).max(1) as u64;
        r.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        r.headers_mut()
            .insert(X_TABLE_VERSION, table.version_header().clone());
        r
    }

    /// Flow control ([`crate::flow`]): `Ok(Placed(None))` at once when the route's instance is
    /// below its in-flight limit and no one waits, or when another instance is (the route moves
    /// there); else the request waits its turn in the variant's queue (`Ok(Placed(Some(when it
    /// began)))`, or `Ok(NewTable)` when woken under a table no longer served) or is refused
    /// ([`NotPlaced`]). `requeued`: when the request began waiting under a table no longer served (it
    /// waits again at the front, to the same deadline).
    async fn wait_for_instance(
        &self,
        table: &RoutingTable,
        route: &mut Route<'_>,
        headers: &HeaderMap,
        key: Option<&KeyPolicy>,
        deadline: &Pin<Box<Sleep>>,
        requeued: Option<std::time::Instant>,
    ) -> Result<Waited, NotPlaced> {
        let v = route.variant;
        let bad = |msg: String| {
            NotPlaced::from(self.unrouted(Some(table), 400, &msg, "invalid_request_error"))
        };
        let priority = Priority::of(headers, key, v.default_priority()).map_err(bad)?;
        // the other flow headers too, so that a bad one is refused whether or not it would wait
        crate::priority::tenant_header(headers, key).map_err(bad)?;
        let timeout = self.flow.timeout(headers).map_err(bad)?;
        let limit = self.flow.variant_limit(v, priority);
        let queue = v.load().flow();
        // the variant's own share (sheddable: a quarter of all its places kept for the others)
        let room = || self.flow.variant_room(v, priority);
        let cap = self.flow.variant_cap(v, priority);
        // what take_place would take (a free but ejected instance is no reason to wake anyone)
        let usable = |i: usize| room() && v.instances()[i].state().takes(limit, now_ms());
        if queue.is_empty() {
            if let Some(place) = self.take_place(route, limit, cap) {
                if let Some(start) = requeued {
                    self.metrics.flow.wait.observe(start.elapsed());
                }
                return Ok(Waited::Placed(requeued, place));
            }
        }
        let who = Who::of(headers, key, v.default_priority()).map_err(bad)?;
        let start = requeued.unwrap_or_else(std::time::Instant::now);
        let until = (tokio::time::Instant::from_std(start) + timeout).min(deadline.deadline());
        if until <= tokio::time::Instant::now() {
            // no time to wait: refused without taking (or shedding) a place
            self.metrics.flow.wait.observe(start.elapsed());
            let second = std::time::Duration::from_secs(1);
            return Err(NotPlaced {
                response: self.flow_refusal(table, Refused::Timeout, timeout, second),
                waited_since: Some(start),
            });
        }
        // its tenant's series in the depth gauge, resolved once however often it queues
        let series = self.metrics.flow.tenant_series(&who.tenant);
        let mut front = requeued.is_some();
        let own = v.instances()[route.instance].state().id();
        // PREFIX_AWARE: the first share of the wait goes to the instance whose cache has the prefix
        let patient_until = route.key.map(|_| {
            let wait = until.into_std().saturating_duration_since(start);
            start + wait.mul_f64(crate::flow::PATIENCE_SHARE)
        });
        let refused = loop {
            let home = Home {
                instance: own,
                patient_until: patient_until.filter(|&t| std::time::Instant::now() < t),
            };
            let mut ticket = match Ticket::take(
                &self.flow,
                &self.metrics.flow,
                v.load(),
                &who,
                series,
                front,
                home,
            ) {
                Ok(t) => t,
                Err(r) => break r,
            };
            // a place that freed before the ticket was in the queue went to no one (the fence
            // pairs with `InFlight`'s drop: it sees this waiter, or this sees its place)
            std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
            for i in (0..v.instances().len()).filter(|&i| usable(i)) {
                queue.release(v.instances()[i].state().id());
            }
            if let Err(r) = ticket.wait(until).await {
                break r;
            }
            drop(ticket);
            if let Some(next) = self
                .table
                .load_full()
                .filter(|t| t.version() != table.version())
            {
                return Ok(Waited::NewTable(next, start));
            }
            if let Some(place) = self.take_place(route, limit, cap) {
                self.metrics.flow.wait.observe(start.elapsed());
                return Ok(Waited::Placed(Some(start), place));
            }
            // another request took the place first: back to the front
            front = true;
        };
        self.metrics.flow.wait.observe(start.elapsed());
        let second = std::time::Duration::from_secs(1);
        Err(NotPlaced {
            response: self.flow_refusal(table, refused, timeout, second),
            waited_since: Some(start),
        })
    }

    /// A place for `route`: on its instance if that has fewer than `limit` requests in flight,
    /// else on the first instance below `limit` (PREFIX_AWARE: in the key's ranking; else the
    /// least loaded), which the route moves to; and with the variant under `cap` if any. Each
    /// place is taken as it is counted ([`InFlight::try_start`]). `None`: no place. A route that
    /// moves says nothing of the key's placement (as for a retry).
    fn take_place(&self, route: &mut Route<'_>, limit: u64, cap: Option<u64>) -> Option<InFlight> {
        let v = route.variant;
        let instances = v.instances();
        let take = |i: usize| InFlight::try_start(instances[i].state(), v.load(), limit, cap);
        if let Some(place) = take(route.instance) {
            return Some(place);
        }
        let now = now_ms();
        let usable = |i: &usize| instances[*i].state().takes(limit, now);
        // a variant at its cap has no place on any instance
        let capped = || cap.is_some_and(|cap| v.load().outstanding() >= cap);
        if capped() {
            return None;
        }
        let (i, place) = match route.key {
            Some(key) => crate::placement::ranking(v.id_hashes(), key)
                .take_while(|_| !capped())
                .filter(usable)
                .find_map(|i| Some((i, take(i)?)))?,
            None => {
                // the least loaded; one that another request took meanwhile is full the next
                // time, and a try that failed on the variant's cap ends the search
                let mut found = None;
                for _ in 0..instances.len() {
                    if capped() {
                        break;
                    }
                    let Some(i) = (0..instances.len())
                        .filter(usable)
                        .min_by_key(|&i| instances[i].state().outstanding())
                    else {
                        break;
                    };
                    if let Some(place) = take(i) {
                        found = Some((i, place));
                        break;
                    }
                }
                found?
            }
        };
        if i != route.instance {
            route.moved(i, crate::decision::Decision::OverloadBypass);
        }
        Some(place)
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

    fn routed_error(
        &self,
        table: &RoutingTable,
        route: &Route<'_>,
        status: u16,
        message: &str,
        kind: &str,
    ) -> Response<ResponseBody> {
        route.variant.instances()[route.instance].stats().record(
            FrontDoor::Http,
            route.decision,
            status,
        );
        let mut r = error_response(status, message, kind);
        set_route_headers(r.headers_mut(), table, route);
        r
    }

    /// An error answered before any instance was chosen.
    fn unrouted(
        &self,
        table: Option<&RoutingTable>,
        status: u16,
        message: &str,
        kind: &str,
    ) -> Response<ResponseBody> {
        self.metrics.record_unrouted(FrontDoor::Http, status);
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

fn set_route_headers(headers: &mut HeaderMap, table: &RoutingTable, route: &Route<'_>) {
    headers.insert(
        X_INSTANCE,
        route.variant.instances()[route.instance].header().clone(),
    );
    headers.insert(X_VARIANT, route.variant.header().clone());
    headers.insert(X_TABLE_VERSION, table.version_header().clone());
    headers.insert(X_DECISION, route.decision.header());
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
