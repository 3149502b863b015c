//! PREFIX_AWARE on the engines' own KV events (issue 56), end to end on loopback: a control
//! plane, three engine-sims that tokenize with a model's tokenizer and publish vLLM's event format
//! from their caches, and two data planes that subscribe to them. A prompt one engine was sent
//! directly (so only its cache holds it) goes to that engine from both routers, although the
//! key's rendezvous ranking puts another first; after that engine restarts (its cache empty,
//! its event stream begun again) neither router sends the prompt there on the old belief.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use integration_tests::InProcessControlPlane;
use test_support::{bind_loopback, wait_for, InProcessServer};
use tokio::net::TcpListener;

mod kv_common;
use kv_common::rendezvous_first;

const ENDPOINT: &str = "chat";
/// The engines' event ports, from their HTTP ports.
const PUB_OFFSET: u16 = 1000;

fn tokenizer() -> String {
    concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../chat-tokens/tests/fixtures/tiny/tokenizer.json"
    )
    .to_string()
}

/// An engine-sim on `listener` publishing its cache's events at its port + 1000 (replay + 1001).
fn engine(listener: TcpListener) -> InProcessServer {
    let port = listener.local_addr().unwrap().port();
    let config = engine_sim::Config {
        time_scale: 0.01,
        block_size: 16,
        tokenizer: Some(tokenizer().into()),
        kv_events_endpoint: Some(format!("tcp://127.0.0.1:{}", port + PUB_OFFSET)),
        kv_events_replay_endpoint: Some(format!("tcp://127.0.0.1:{}", port + PUB_OFFSET + 1)),
        ..engine_sim::Config::default()
    };
    InProcessServer::start_on(listener, |l, stop| engine_sim::serve(l, config, stop))
}

/// A listener on a loopback port whose event ports are free too.
async fn engine_listener() -> TcpListener {
    loop {
        let l = bind_loopback().await;
        let port = l.local_addr().unwrap().port();
        if port < 60000
            && std::net::TcpListener::bind(("127.0.0.1", port + PUB_OFFSET)).is_ok()
            && std::net::TcpListener::bind(("127.0.0.1", port + PUB_OFFSET + 1)).is_ok()
        {
            return l;
        }
    }
}

fn chat(document: &str) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "model": ENDPOINT,
        "max_tokens": 4,
        "messages": [
            {"role": "system", "content": "You answer from the document."},
            {"role": "user", "content": document},
        ],
    }))
    .unwrap()
}

/// POSTs a chat to `base`; the instance the router chose (its response header), or "" direct.
async fn post(base: &str, body: &[u8]) -> String {
    let url = format!("{base}/v1/chat/completions");
    let (status, body, instance) = kv_common::send("POST", &url, body.to_vec()).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    instance
}

async fn get(url: &str) -> String {
    let http: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let resp = http.get(url.parse().unwrap()).await.unwrap();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    String::from_utf8_lossy(&body).into_owned()
}

/// The value of `name{instance=...}` in a router's `/metrics`.
async fn metric(router: &str, name: &str, instance: &str) -> Option<f64> {
    kv_common::metric_value(&get(&format!("{router}/metrics")).await, name, instance)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_routers_send_a_prompt_to_the_engine_that_reports_it_until_that_engine_restarts() {
    let dir = tempfile::tempdir().unwrap();
    let control_plane = InProcessControlPlane::start(dir.path()).await;
    let mut engines = Vec::new();
    for _ in 0..3 {
        engines.push(engine(engine_listener().await));
    }
    let urls: Vec<String> = engines.iter().map(|e| e.url()).collect();

    // a document whose key ranks some engine first, and another engine to hold it
    let document = |n: u32| format!("Document {n}: {}", "the quick brown fox jumps. ".repeat(60));
    let body = chat(&document(1));
    let first = rendezvous_first(&urls, &body);
    let holder = (first + 1) % 3;

    let client = proto::client::Client::connect(control_plane.url.clone())
        .await
        .unwrap();
    let v = kv_common::events_variant(&urls, PUB_OFFSET, 16, tokenizer());
    client
        .create_endpoint_config(ENDPOINT, vec![v])
        .await
        .unwrap();
    client.create_endpoint(ENDPOINT, ENDPOINT).await.unwrap();

    // only the holder's cache has the document (sent to it directly, before the routers start)
    post(&urls[holder], &body).await;

    let routers = kv_common::start_routers(&control_plane.url, ENDPOINT, &["dp-a", "dp-b"]).await;
    let router_urls: Vec<String> = routers.iter().map(|r| r.url()).collect();
    // each router learns the holder's blocks: replayed from its buffer, or from the events after
    let holder_url = urls[holder].clone();
    for r in &router_urls {
        wait_for(
            "the router's index of the holder to be exact and hold the document",
            Duration::from_secs(20),
            || async {
                metric(r, "prefix_router_kv_index_blocks", &holder_url)
                    .await
                    .filter(|&blocks| blocks > 0.0)
            },
        )
        .await;
    }
    for r in &router_urls {
        assert_eq!(
            post(r, &body).await,
            urls[holder],
            "router {r}: the engine that holds the document, not the ranking's first ({})",
            urls[first]
        );
    }

    // the holder restarts on the same ports with an empty cache
    let mut resets = Vec::new();
    for r in &router_urls {
        resets.push(
            metric(r, "prefix_router_kv_event_resets_total", &holder_url)
                .await
                .unwrap_or(0.0),
        );
    }
    let old = engines.remove(holder);
    let port = old.addr.port();
    old.stop().await.unwrap();
    let listener = loop {
        match TcpListener::bind(("127.0.0.1", port)).await {
            Ok(l) => break l,
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    };
    engines.push(engine(listener));
    // each router resets its index of it (the stream dropped and began again), and the document
    // goes where its key ranks first, not to the restarted engine on the old belief
    for (r, before) in router_urls.iter().zip(resets) {
        wait_for(
            "the router to reset its index of the restarted engine",
            Duration::from_secs(20),
            || async {
                metric(r, "prefix_router_kv_event_resets_total", &holder_url)
                    .await
                    .filter(|&n| n > before)
            },
        )
        .await;
        assert_eq!(post(r, &body).await, urls[first], "router {r}");
    }
    for r in routers {
        r.stop().await.unwrap();
    }
    for e in engines {
        e.stop().await.unwrap();
    }
}
