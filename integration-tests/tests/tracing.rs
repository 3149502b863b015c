//! Traces over OTLP, end to end: an in-process OTLP collector (a tonic `TraceService`) receives the
//! spans really exported by `telemetry::init` from an in-process control plane, data plane and
//! engine-sim. One chat completion sent with a W3C `traceparent` shows up as one trace:
//! client -> `route` -> `upstream` -> engine `completion` -> `queue` / `prefill` / `decode`, and the
//! SDK's calls join the control plane's spans to the caller's trace. A request that waited in
//! flow control's queue has `queue_ms` on its `route` span, forwarded or refused.
//!
//! Its own test binary, with one test: the global subscriber and tracer provider are per process.

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use common::otlp::start_collector;
use integration_tests::fault::{Fault, FaultProxy};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::trace::v1::Span;
use tokio::sync::{mpsc, Mutex};

/// The spans received so far, flushing the exporter first (spans end on other tasks, e.g. when a
/// response body is dropped, so callers poll this until what they expect is there).
struct Received {
    guard: Arc<telemetry::Guard>,
    rx: Mutex<mpsc::UnboundedReceiver<(String, Span)>>,
    spans: Mutex<Vec<(String, Span)>>,
}

impl Received {
    async fn collect(&self) -> Vec<(String, Span)> {
        let guard = self.guard.clone();
        // force_flush blocks until the export is done; the export itself runs on this runtime.
        tokio::task::spawn_blocking(move || guard.force_flush())
            .await
            .unwrap();
        let mut rx = self.rx.lock().await;
        let mut spans = self.spans.lock().await;
        while let Ok(s) = rx.try_recv() {
            spans.push(s);
        }
        spans.clone()
    }

    /// Waits until `pick` finds what it looks for in the spans received.
    async fn wait_for_spans<T>(
        &self,
        what: &str,
        pick: impl Fn(&[(String, Span)]) -> Option<T>,
    ) -> T {
        test_support::wait_for(what, Duration::from_secs(20), || async {
            pick(&self.collect().await)
        })
        .await
    }
}

fn attr<'a>(span: &'a Span, key: &str) -> Option<&'a Value> {
    span.attributes
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| kv.value.as_ref()?.value.as_ref())
}

fn str_attr<'a>(span: &'a Span, key: &str) -> &'a str {
    match attr(span, key) {
        Some(Value::StringValue(s)) => s,
        other => panic!(
            "span {} has no string attribute {key}: {other:?}",
            span.name
        ),
    }
}

fn int_attr(span: &Span, key: &str) -> i64 {
    match attr(span, key) {
        Some(Value::IntValue(i)) => *i,
        other => panic!(
            "span {} has no integer attribute {key}: {other:?}",
            span.name
        ),
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_trace_links_client_router_and_engine() {
    let (collector, rx) = start_collector().await;
    let guard = telemetry::init(
        "prefix-router-test",
        telemetry::LogFormat::Text,
        Some(collector),
    );
    assert!(guard.exporting());
    let received = Received {
        guard: Arc::new(guard),
        rx: Mutex::new(rx),
        spans: Mutex::new(Vec::new()),
    };

    let fleet = common::Fleet::start().await;

    // A client's trace: the chat completion arrives with its traceparent.
    let trace_id = "5d3a9f1e2b7c4d8e9f0a1b2c3d4e5f60";
    let client_span = "a1b2c3d4e5f60718";
    let traceparent = format!("00-{trace_id}-{client_span}-01");
    let content = "Summarize the history of the printing press in three sentences.";
    let answer = fleet.chat(content, &[("traceparent", &traceparent)]).await;
    assert_eq!(
        answer.status,
        200,
        "{}",
        String::from_utf8_lossy(&answer.body)
    );
    let decision = answer.headers["x-prefix-router-decision"]
        .to_str()
        .unwrap()
        .to_string();
    let version: i64 = answer.headers["x-prefix-router-table-version"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();

    let names = [
        "route",
        "upstream",
        "completion",
        "queue",
        "prefill",
        "decode",
    ];
    let trace: HashMap<String, Span> = received
        .wait_for_spans("the request's spans", |spans| {
            let mine: HashMap<String, Span> = spans
                .iter()
                .filter(|(_, s)| hex(&s.trace_id) == trace_id)
                .map(|(_, s)| (s.name.clone(), s.clone()))
                .collect();
            names.iter().all(|n| mine.contains_key(*n)).then_some(mine)
        })
        .await;
    let all = received.collect().await;
    assert_eq!(
        all.iter()
            .filter(|(_, s)| hex(&s.trace_id) == trace_id && s.name == "route")
            .count(),
        1,
        "one route span per request"
    );
    assert!(
        all.iter()
            .all(|(service, _)| service == "prefix-router-test"),
        "service.name is the init default"
    );

    // The chain of parents: client -> route -> upstream -> completion -> queue / prefill / decode.
    let route = &trace["route"];
    let upstream = &trace["upstream"];
    let completion = &trace["completion"];
    assert_eq!(
        hex(&route.parent_span_id),
        client_span,
        "route is a child of the caller's span"
    );
    assert_eq!(
        upstream.parent_span_id, route.span_id,
        "upstream is a child of route"
    );
    assert_eq!(
        completion.parent_span_id, upstream.span_id,
        "the engine continues the upstream span's trace"
    );
    for child in ["queue", "prefill", "decode"] {
        assert_eq!(
            trace[child].parent_span_id, completion.span_id,
            "{child} is a child of completion"
        );
    }

    // The routing decision, recorded on route.
    assert_eq!(str_attr(route, "endpoint"), common::ENDPOINT);
    assert_eq!(str_attr(route, "variant"), "v1");
    assert_eq!(str_attr(route, "strategy"), "PREFIX_AWARE");
    assert_eq!(str_attr(route, "decision"), decision);
    assert_eq!(str_attr(route, "instance"), fleet.engine_url);
    assert_eq!(int_attr(route, "table_version"), version);
    let request_bytes = int_attr(route, "request_bytes");
    assert!(
        request_bytes > content.len() as i64,
        "request_bytes {request_bytes}"
    );
    assert_eq!(int_attr(route, "status"), 200);
    // The key region is the canonical text of the first user message ("user\n{content}\n",
    // under the prefix length), cut into 64-byte blocks.
    let canonical = format!("user\n{content}\n");
    assert_eq!(
        int_attr(route, "prefix_blocks"),
        canonical.len().div_ceil(64) as i64
    );

    // The upstream call and the engine's work.
    assert_eq!(str_attr(upstream, "instance"), fleet.engine_url);
    assert_eq!(int_attr(upstream, "status"), 200);
    assert_eq!(int_attr(upstream, "bytes"), answer.body.len() as i64);
    assert!(matches!(attr(upstream, "ttfb_ms"), Some(Value::DoubleValue(ms)) if *ms >= 0.0));
    let prefill = &trace["prefill"];
    let prompt_tokens = int_attr(prefill, "prompt_tokens");
    assert!(prompt_tokens > 0);
    assert_eq!(
        int_attr(prefill, "cached_tokens") + int_attr(prefill, "uncached_tokens"),
        prompt_tokens
    );
    assert_eq!(int_attr(completion, "prompt_tokens"), prompt_tokens);
    assert_eq!(int_attr(&trace["decode"], "tokens"), 4);

    // The SDK's calls carried the caller's context: the control plane's method spans are children
    // of the client's `setup` span, in its trace.
    let spans = received.collect().await;
    let setup = spans
        .iter()
        .map(|(_, s)| s)
        .find(|s| s.name == "setup")
        .expect("the client's setup span");
    for method in ["CreateEndpointConfig", "CreateEndpoint"] {
        let name = format!("prefixrouter.v1.ControlPlane/{method}");
        let rpc = spans
            .iter()
            .map(|(_, s)| s)
            .find(|s| s.name == name)
            .unwrap_or_else(|| panic!("no {name} span"));
        assert_eq!(
            rpc.trace_id, setup.trace_id,
            "{name} joins the caller's trace"
        );
        assert_eq!(
            rpc.parent_span_id, setup.span_id,
            "{name} is a child of the caller's span"
        );
        assert_eq!(str_attr(rpc, "endpoint_config"), common::ENDPOINT);
    }
    let create = spans
        .iter()
        .map(|(_, s)| s)
        .find(|s| s.name == "prefixrouter.v1.ControlPlane/CreateEndpoint")
        .unwrap();
    assert!(int_attr(create, "routing_table_version") >= 2);

    // Each table push to the data plane is a span that ends with the node's ACK.
    let push = received
        .wait_for_spans("an acknowledged table push", |spans| {
            spans
                .iter()
                .map(|(_, s)| s)
                .find(|s| {
                    s.name == "push_routing_table"
                        && matches!(attr(s, "node_id"), Some(Value::StringValue(n)) if n == common::NODE_ID)
                        && matches!(attr(s, "result"), Some(Value::StringValue(r)) if r == "ack")
                })
                .cloned()
        })
        .await;
    assert_eq!(int_attr(&push, "version"), version);

    // Through the endpoint picker (as Envoy asks it): the caller's traceparent parents the
    // pick's `route` span (front_door ext_proc), and the pick sends its own context on to the
    // instance; the span ends with the stream.
    let picked_trace = "0af7651916cd43dd8448eb211c80319c";
    let gateway_span = "b7ad6b7169203331";
    let mut exchange = integration_tests::envoy::client::Exchange::open(&fleet.picker).await;
    let body = serde_json::to_vec(&serde_json::json!({
        "model": common::ENDPOINT,
        "messages": [{ "role": "user", "content": content }],
    }))
    .unwrap();
    let reply = exchange
        .request_with(
            &body,
            None,
            &[(
                "traceparent",
                &format!("00-{picked_trace}-{gateway_span}-01"),
            )],
        )
        .await;
    let (destination, _) = integration_tests::envoy::client::pick(&reply);
    assert_eq!(format!("http://{destination}"), fleet.engine_url);
    let sent_on = integration_tests::envoy::client::set_header(&reply, "traceparent")
        .expect("the pick sets traceparent for the instance");
    assert!(
        sent_on.starts_with(&format!("00-{picked_trace}-")),
        "{sent_on}"
    );
    drop(exchange);
    let picked = received
        .wait_for_spans("the pick's route span", |spans| {
            spans
                .iter()
                .map(|(_, s)| s)
                .find(|s| s.name == "route" && hex(&s.trace_id) == picked_trace)
                .cloned()
        })
        .await;
    assert_eq!(hex(&picked.parent_span_id), gateway_span);
    assert_eq!(str_attr(&picked, "front_door"), "ext_proc");
    assert_eq!(str_attr(&picked, "instance"), fleet.engine_url);
    assert!(str_attr(&picked, "decision").starts_with("prefix_"));
    assert_eq!(
        sent_on,
        format!("00-{picked_trace}-{}-01", hex(&picked.span_id)),
        "the instance's parent is the pick's span"
    );
    assert_eq!(str_attr(route, "front_door"), "http");

    // A request without traceparent starts its own trace, rooted at route.
    let answer = fleet
        .chat("A different question with no trace context.", &[])
        .await;
    assert_eq!(answer.status, 200);
    let root = received
        .wait_for_spans("the untraced request's route span", |spans| {
            spans
                .iter()
                .map(|(_, s)| s)
                .find(|s| {
                    s.name == "route"
                        && hex(&s.trace_id) != trace_id
                        && hex(&s.trace_id) != picked_trace
                })
                .cloned()
        })
        .await;
    assert!(root.parent_span_id.is_empty(), "a root span");

    // Flow control: a request that waited shows how long on its route span (`queue_ms`), whether
    // it was then forwarded or refused. Endpoint `queued` has one instance that takes one request
    // at a time, behind a proxy that holds the first request until the test lets it through.
    let held = FaultProxy::start(
        fleet
            .engine_url
            .trim_start_matches("http://")
            .parse()
            .unwrap(),
    )
    .await;
    held.set(Fault::BlackHole);
    let mut one_at_a_time =
        integration_tests::variant("v1", proto::RoutingStrategy::PrefixAware, &[&held.url()]);
    if let Some(pa) = one_at_a_time
        .routing_config
        .as_mut()
        .and_then(|c| c.prefix_aware_routing_config.as_mut())
    {
        pa.concurrency_threshold = 1;
    }
    let sdk = proto::client::Client::connect(fleet.control_plane.url.clone())
        .await
        .unwrap();
    sdk.create_endpoint_config("queued", vec![one_at_a_time])
        .await
        .unwrap();
    sdk.create_endpoint("queued", "queued").await.unwrap();
    test_support::wait_for(
        "the data plane to serve endpoint queued",
        Duration::from_secs(20),
        || async {
            String::from_utf8_lossy(&fleet.get("/v1/models").await.body).contains("queued")
        },
    )
    .await;
    let (refused_trace, served_trace) = (
        "7e1f0000000000000000000000000429",
        "7e1f0000000000000000000000000200",
    );
    let traced = |trace: &str| format!("00-{trace}-{client_span}-01");
    let (refused_parent, served_parent) = (traced(refused_trace), traced(served_trace));
    let to_queued = ("x-endpoint-name", "queued");
    let only_queued = [to_queued];
    let first = fleet.chat("held until the test lets it through", &only_queued);
    let waiters = async {
        test_support::wait_for(
            "the first request to reach the held instance",
            Duration::from_secs(20),
            || async { held.accepted() >= 1 },
        )
        .await;
        let refused = fleet
            .chat(
                "no place within its deadline",
                &[
                    to_queued,
                    ("x-prefix-router-queue-timeout-ms", "300"),
                    ("traceparent", &refused_parent),
                ],
            )
            .await;
        let served_headers = [to_queued, ("traceparent", served_parent.as_str())];
        let served = fleet.chat("waits, then goes on", &served_headers);
        let release = async {
            test_support::wait_for(
                "a request waiting in the router",
                Duration::from_secs(20),
                || async {
                    let metrics = fleet.get("/metrics").await;
                    String::from_utf8_lossy(&metrics.body)
                        .contains("prefix_router_queue_depth{priority=\"standard\"} 1")
                },
            )
            .await;
            held.set(Fault::Pass);
        };
        let (served, ()) = tokio::join!(served, release);
        (refused, served)
    };
    let (first, (refused, served)) = tokio::join!(first, waiters);
    assert_eq!(first.status, 200);
    assert_eq!(
        refused.status,
        429,
        "{}",
        String::from_utf8_lossy(&refused.body)
    );
    assert_eq!(
        served.status,
        200,
        "{}",
        String::from_utf8_lossy(&served.body)
    );
    for (trace, status, at_least) in [(refused_trace, 429, 300), (served_trace, 200, 0)] {
        let route = received
            .wait_for_spans("a waiter's route span", |spans| {
                spans
                    .iter()
                    .map(|(_, s)| s)
                    .find(|s| s.name == "route" && hex(&s.trace_id) == trace)
                    .cloned()
            })
            .await;
        assert_eq!(int_attr(&route, "status"), status);
        let queue_ms = int_attr(&route, "queue_ms");
        assert!(
            (at_least..20_000).contains(&queue_ms),
            "{status}: waited {queue_ms} ms"
        );
    }
}
