//! The data plane at its boundaries: a mock control plane (gRPC), tiny model servers (HTTP), the
//! router in-process on 127.0.0.1:0.

mod support;

use std::collections::{HashMap, HashSet};
use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::Arc;

use bytes::Bytes;
use data_plane::Config;
use http::Request;
use http_body_util::{BodyExt, StreamBody};
use hyper::body::Frame;
use proto::RoutingStrategy;
use support::*;
use test_support::{wait_for, HttpStub, StubReply};

#[tokio::test]
async fn proxies_with_contract_headers_and_acks_each_table() {
    let cp = MockControlPlane::start().await;
    let b = backends(2).await;
    let router = RouterHandle::watching(&cp, "node-a").await;
    let hello = cp.next_request().await;
    assert_eq!(
        (hello.node_id.as_str(), hello.applied_version),
        ("node-a", 0)
    );
    assert_eq!(get(&router.url("/readyz")).await.status, 503);
    assert_eq!(get(&router.url("/healthz")).await.status, 200);

    cp.push(simple_table(
        1,
        strategy(RoutingStrategy::Random),
        &urls(&b),
    ));
    let ack = cp.ack(1).await;
    assert_eq!(ack.node_id, "node-a");
    assert!(!ack.response_nonce.is_empty());
    router.wait_version(1).await;

    let body = chat(&[("user", "hello")]);
    let r = post(
        &router.url("/v1/chat/completions?trace=1"),
        &[("x-endpoint-name", "e")],
        body.clone(),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(
        urls(&b).iter().any(|u| u == r.instance()),
        "{}",
        r.instance()
    );
    assert_eq!(r.header("x-prefix-router-variant"), "v1");
    assert_eq!(r.header("x-prefix-router-table-version"), "1");
    assert_eq!(r.decision(), "random");
    assert_eq!(r.json()["path"], "/v1/chat/completions?trace=1");
    assert_eq!(r.json()["body_len"], body.len());
    let served_by = b.iter().find(|x| x.url == r.instance()).unwrap();
    let (_, headers, forwarded) = served_by.last_request.lock().unwrap().clone().unwrap();
    assert_eq!(forwarded, Bytes::from(body));
    assert_eq!(
        headers.get("host").map(String::as_str),
        Some(served_by.addr.to_string().as_str())
    );

    // a new table swaps strategies without a restart
    cp.push(simple_table(
        2,
        strategy(RoutingStrategy::LeastOutstandingRequests),
        &urls(&b),
    ));
    cp.ack(2).await;
    router.wait_version(2).await;
    let r = post(
        &router.url("/v1/completions"),
        &[],
        r#"{"model":"e","prompt":"hi"}"#,
    )
    .await;
    assert_eq!((r.status, r.decision()), (200, "least_outstanding"));
    assert_eq!(r.header("x-prefix-router-table-version"), "2");
    router.shutdown().await;
}

#[tokio::test]
async fn endpoint_choice_by_header_model_default_path_and_variant() {
    let cp = MockControlPlane::start().await;
    let (a, bb, c) = (
        Backend::start("a").await,
        Backend::start("b").await,
        Backend::start("c").await,
    );
    let random = || strategy(RoutingStrategy::Random);
    cp.push(table(
        1,
        vec![
            endpoint("e1", vec![variant("v1", random(), &[a.url.as_str()])]),
            endpoint(
                "e2",
                vec![
                    variant("blue", random(), &[bb.url.as_str()]),
                    variant("green", random(), &[c.url.as_str()]),
                ],
            ),
        ],
    ));
    let router = RouterHandle::start(Config {
        control_plane: cp.url.clone(),
        default_endpoint: Some("e1".into()),
        ..Config::default()
    })
    .await;
    let strict = RouterHandle::watching(&cp, "strict").await;
    router.wait_version(1).await;
    strict.wait_version(1).await;

    let chat_url = router.url("/v1/chat/completions");
    let body = |model: &str| {
        format!(r#"{{"model":"{model}","messages":[{{"role":"user","content":"x"}}]}}"#)
    };
    // header wins over model
    let r = post(&chat_url, &[("x-endpoint-name", "e1")], body("e2")).await;
    assert_eq!(r.instance(), a.url);
    // model names an endpoint (after the messages, as the OpenAI client sends it)
    let r = post(
        &chat_url,
        &[],
        r#"{"messages":[{"role":"user","content":"x"}],"model":"e1"}"#,
    )
    .await;
    assert_eq!(r.instance(), a.url);
    // model names no endpoint: --default-endpoint
    let r = post(&chat_url, &[], body("llama-3")).await;
    assert_eq!(r.instance(), a.url);
    // ... and without a default: 404
    post(&strict.url("/v1/chat/completions"), &[], body("llama-3"))
        .await
        .assert_error(404, "not_found_error");
    post(&chat_url, &[("x-endpoint-name", "nope")], body("e1"))
        .await
        .assert_error(404, "not_found_error");
    // variants: pinned, unknown, weighted
    let r = post(&chat_url, &[("x-target-variant", "green")], body("e2")).await;
    assert_eq!(
        (r.instance(), r.header("x-prefix-router-variant")),
        (c.url.as_str(), "green")
    );
    post(&chat_url, &[("x-target-variant", "red")], body("e2"))
        .await
        .assert_error(404, "not_found_error");
    let mut seen = HashSet::new();
    for _ in 0..60 {
        seen.insert(
            post(&chat_url, &[], body("e2"))
                .await
                .header("x-prefix-router-variant")
                .to_string(),
        );
    }
    assert_eq!(
        seen,
        ["blue".to_string(), "green".to_string()]
            .into_iter()
            .collect()
    );
    // SageMaker-style invocations: raw bytes to /invocations
    let raw: Vec<u8> = (0..=255u8).collect();
    let r = post(
        &router.url("/endpoints/e1/invocations"),
        &[("content-type", "application/octet-stream")],
        raw.clone(),
    )
    .await;
    assert_eq!(
        (r.status, r.json()["path"].as_str()),
        (200, Some("/invocations"))
    );
    let (_, _, forwarded) = a.last_request.lock().unwrap().clone().unwrap();
    assert_eq!(forwarded, Bytes::from(raw));
    post(&router.url("/endpoints/zz/invocations"), &[], "x")
        .await
        .assert_error(404, "not_found_error");
}

#[tokio::test]
async fn same_prompt_goes_to_the_same_instance_from_two_routers() {
    let cp = MockControlPlane::start().await;
    let b = backends(5).await;
    cp.push(simple_table(1, prefix_aware(256, 64), &urls(&b)));
    let (r1, r2) = (
        RouterHandle::watching(&cp, "r1").await,
        RouterHandle::watching(&cp, "r2").await,
    );
    r1.wait_version(1).await;
    r2.wait_version(1).await;
    let mut used = HashSet::new();
    for i in 0..30 {
        let body = chat(&[
            ("system", "You are terse."),
            ("user", &format!("question number {i}")),
        ]);
        let x = post(&r1.url("/v1/chat/completions"), &[], body.clone()).await;
        let y = post(&r2.url("/v1/chat/completions"), &[], body).await;
        assert_eq!(x.instance(), y.instance());
        assert_eq!((x.decision(), y.decision()), ("prefix_hash", "prefix_hash"));
        used.insert(x.instance().to_string());
    }
    assert!(used.len() >= 4, "{used:?}");
}

#[tokio::test]
async fn conversations_stay_and_users_of_one_system_prompt_spread() {
    let cp = MockControlPlane::start().await;
    let b = backends(7).await;
    cp.push(simple_table(1, prefix_aware(4096, 64), &urls(&b)));
    let router = RouterHandle::watching(&cp, "r").await;
    router.wait_version(1).await;
    let url = router.url("/v1/chat/completions");
    let system = "You are the support assistant of a large company. Follow the policy. ".repeat(30);
    let mut used = HashSet::new();
    for u in 0..40 {
        let first = format!("Hi, I am customer {u} and my order is late");
        let t1 = post(&url, &[], chat(&[("system", &system), ("user", &first)])).await;
        let t2 = post(
            &url,
            &[],
            chat(&[
                ("system", &system),
                ("user", &first),
                ("assistant", "Sorry to hear."),
                ("user", "Where is it?"),
            ]),
        )
        .await;
        let t3 = post(
            &url,
            &[],
            chat(&[
                ("system", &system),
                ("user", &first),
                ("assistant", "Sorry to hear."),
                ("user", "Where is it?"),
                ("assistant", "In transit."),
                ("user", "Thanks"),
            ]),
        )
        .await;
        assert_eq!(t1.instance(), t2.instance(), "turn 2 of user {u}");
        assert_eq!(t1.instance(), t3.instance(), "turn 3 of user {u}");
        used.insert(t1.instance().to_string());
    }
    assert!(
        used.len() >= 6,
        "40 users over 7 instances used only {used:?}"
    );

    // x-prefix-aware-id: a key made only of a shared prefix spreads by id, and one id stays put
    cp.push(simple_table(2, prefix_aware(64, 64), &urls(&b)));
    router.wait_version(2).await;
    let body = chat(&[("system", &system), ("user", "anything")]);
    let plain: HashSet<String> = futures_collect(4, || post(&url, &[], body.clone()))
        .await
        .iter()
        .map(|r| r.instance().to_string())
        .collect();
    assert_eq!(plain.len(), 1);
    let mut by_id = HashSet::new();
    for id in 0..20 {
        let id = format!("conversation-{id}");
        let a = post(&url, &[("x-prefix-aware-id", &id)], body.clone()).await;
        let again = post(&url, &[("x-prefix-aware-id", &id)], body.clone()).await;
        assert_eq!(a.instance(), again.instance());
        by_id.insert(a.instance().to_string());
    }
    assert!(by_id.len() >= 4, "{by_id:?}");
}

async fn futures_collect<F, Fut>(n: usize, mut f: F) -> Vec<Reply>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Reply>,
{
    let mut out = Vec::new();
    for _ in 0..n {
        out.push(f().await);
    }
    out
}

#[tokio::test]
async fn least_outstanding_counts_until_the_body_ends() {
    let cp = MockControlPlane::start().await;
    let b = vec![
        Backend::start_with("a", Behavior::Hold).await,
        Backend::start_with("b", Behavior::Hold).await,
    ];
    cp.push(simple_table(
        1,
        strategy(RoutingStrategy::LeastOutstandingRequests),
        &urls(&b),
    ));
    let router = RouterHandle::watching(&cp, "r").await;
    router.wait_version(1).await;
    let url = router.url("/v1/completions");
    let body = r#"{"model":"e","prompt":"p"}"#;
    let first = spawn_post(&url, &[], body);
    wait_for("one backend holds a request", WAIT, || async {
        b[0].active() + b[1].active() == 1
    })
    .await;
    let busy = if b[0].active() == 1 { 0 } else { 1 };
    let second = spawn_post(&url, &[], body);
    wait_for("the idle backend gets the second request", WAIT, || async {
        b[1 - busy].active() == 1
    })
    .await;
    b[0].release();
    b[1].release();
    let (x, y) = (first.await.unwrap(), second.await.unwrap());
    assert_eq!(
        (x.decision(), y.decision()),
        ("least_outstanding", "least_outstanding")
    );
    assert_ne!(x.instance(), y.instance());

    // a streamed body keeps its instance busy until the client goes away
    for x in &b {
        x.set(Behavior::Stream);
    }
    let resp = client()
        .request(post_request(&url, &[], body))
        .await
        .unwrap();
    let instance = resp.headers()["x-prefix-router-instance"]
        .to_str()
        .unwrap()
        .to_string();
    let m = router.metrics().await;
    assert!(m.contains(&format!("instance=\"{instance}\"}} 1\n")), "{m}");
    drop(resp); // client gone mid-stream
    wait_for(
        "in-flight back to 0 after the client left",
        WAIT,
        || async {
            let m = router.metrics().await;
            m.contains(&format!("instance=\"{instance}\"}} 0\n"))
        },
    )
    .await;
}

#[tokio::test]
async fn overload_bypass_at_the_concurrency_threshold() {
    let cp = MockControlPlane::start().await;
    let mut b = Vec::new();
    for i in 0..3 {
        b.push(Backend::start_with(&format!("h{i}"), Behavior::Hold).await);
    }
    cp.push(simple_table(1, prefix_aware(256, 1), &urls(&b)));
    let router = RouterHandle::watching(&cp, "r").await;
    router.wait_version(1).await;
    let url = router.url("/v1/chat/completions");
    let body = chat(&[("user", "the same long document")]);
    let first = spawn_post(&url, &[], body.clone());
    wait_for("the first request is held", WAIT, || async {
        b.iter().map(|x| x.active()).sum::<u64>() == 1
    })
    .await;
    let holder = b.iter().position(|x| x.active() == 1).unwrap();
    let second = spawn_post(&url, &[], body.clone());
    wait_for("the second request is held", WAIT, || async {
        b.iter().map(|x| x.active()).sum::<u64>() == 2
    })
    .await;
    for x in &b {
        x.set(Behavior::Echo);
        x.release();
    }
    let (x, y) = (first.await.unwrap(), second.await.unwrap());
    assert_eq!(
        (x.instance(), x.decision()),
        (b[holder].url.as_str(), "prefix_hash")
    );
    assert_eq!(y.decision(), "overload_bypass");
    assert_ne!(y.instance(), x.instance());
    // with room again, the key goes home
    let z = post(&url, &[], body).await;
    assert_eq!(
        (z.instance(), z.decision()),
        (b[holder].url.as_str(), "prefix_hash")
    );
}

#[tokio::test]
async fn table_swap_under_load_loses_no_request() {
    let cp = MockControlPlane::start().await;
    let b = backends(4).await;
    let all = urls(&b);
    cp.push(simple_table(1, prefix_aware(256, 64), &all));
    let router = RouterHandle::watching(&cp, "r").await;
    router.wait_version(1).await;
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let mut workers = Vec::new();
    for w in 0..6 {
        let (url, stop, done) = (
            router.url("/v1/chat/completions"),
            stop.clone(),
            done.clone(),
        );
        workers.push(tokio::spawn(async move {
            let mut failures = Vec::new();
            let mut i = 0;
            while !stop.load(SeqCst) {
                let r = post(
                    &url,
                    &[],
                    chat(&[("user", &format!("worker {w} request {i}"))]),
                )
                .await;
                if r.status != 200 {
                    failures.push(r.text());
                }
                done.fetch_add(1, SeqCst);
                i += 1;
            }
            failures
        }));
    }
    let configs = [
        strategy(RoutingStrategy::Random),
        strategy(RoutingStrategy::LeastOutstandingRequests),
        prefix_aware(64, 2),
        prefix_aware(1024, 64),
    ];
    for v in 2..=25u64 {
        let members: Vec<String> = all
            .iter()
            .enumerate()
            .filter(|(i, _)| (v as usize + i) & 3 != 0)
            .map(|(_, u)| u.clone())
            .collect();
        cp.push(simple_table(v, configs[v as usize % 4].clone(), &members));
        cp.ack(v).await;
        let before = done.load(SeqCst);
        wait_for("requests flow on the new table", WAIT, || {
            let done = done.clone();
            async move { done.load(SeqCst) >= before + 5 }
        })
        .await;
    }
    stop.store(true, SeqCst);
    let mut total_failures = Vec::new();
    for w in workers {
        total_failures.extend(w.await.unwrap());
    }
    assert!(total_failures.is_empty(), "{total_failures:?}");
    assert!(done.load(SeqCst) >= 24 * 5);
    let r = post(
        &router.url("/v1/chat/completions"),
        &[],
        chat(&[("user", "last")]),
    )
    .await;
    assert_eq!(r.header("x-prefix-router-table-version"), "25");
}

#[tokio::test]
async fn invalid_table_is_nacked_and_the_last_good_one_keeps_serving() {
    let cp = MockControlPlane::start().await;
    let b = backends(2).await;
    cp.push(simple_table(
        1,
        strategy(RoutingStrategy::Random),
        &urls(&b),
    ));
    let router = RouterHandle::watching(&cp, "r").await;
    cp.ack(1).await;
    let mut bad = simple_table(2, strategy(RoutingStrategy::Random), &urls(&b));
    bad.endpoints[0].variants[0].instances[1].address = "ftp://nowhere".into();
    cp.push(bad);
    let nack = cp.nack().await;
    assert_eq!(nack.applied_version, 1);
    assert!(!nack.response_nonce.is_empty());
    assert!(
        nack.error_detail
            .contains("bad instance URL \"ftp://nowhere\""),
        "{}",
        nack.error_detail
    );
    let r = post(
        &router.url("/v1/completions"),
        &[],
        r#"{"model":"e","prompt":"x"}"#,
    )
    .await;
    assert_eq!(
        (r.status, r.header("x-prefix-router-table-version")),
        (200, "1")
    );
    let mut unknown = simple_table(3, strategy(RoutingStrategy::Random), &urls(&b));
    unknown.endpoints[0].variants[0]
        .routing_config
        .as_mut()
        .unwrap()
        .routing_strategy = 42;
    cp.push(unknown);
    assert!(cp
        .nack()
        .await
        .error_detail
        .contains("unknown routing strategy 42"));
    let m = router.metrics().await;
    assert!(m.contains("prefix_router_tables_rejected_total 2\n"), "{m}");
    assert!(m.contains("prefix_router_table_version 1\n"), "{m}");
    cp.push(simple_table(
        4,
        strategy(RoutingStrategy::Random),
        &urls(&b),
    ));
    cp.ack(4).await;
    router.wait_version(4).await;
}

#[tokio::test]
async fn routing_continues_without_the_control_plane_and_resumes_when_it_returns() {
    let cp = MockControlPlane::start().await;
    let b = backends(2).await;
    cp.push(simple_table(1, prefix_aware(256, 64), &urls(&b)));
    let router = RouterHandle::watching(&cp, "r").await;
    cp.ack(1).await;
    let addr = cp.stop().await;
    wait_for(
        "the router notices the control plane is gone",
        WAIT,
        || async {
            router
                .metrics()
                .await
                .contains("prefix_router_control_plane_connected 0\n")
        },
    )
    .await;
    for i in 0..20 {
        let r = post(
            &router.url("/v1/chat/completions"),
            &[],
            chat(&[("user", &format!("q{i}"))]),
        )
        .await;
        assert_eq!(
            (r.status, r.header("x-prefix-router-table-version")),
            (200, "1")
        );
    }
    // back on the same address: the router reconnects and says what it holds
    let cp = MockControlPlane::start_on(tokio::net::TcpListener::bind(addr).await.unwrap()).await;
    let hello = cp.next_request().await;
    assert_eq!((hello.node_id.as_str(), hello.applied_version), ("r", 1));
    cp.push(simple_table(2, prefix_aware(256, 64), &urls(&b)));
    cp.ack(2).await;
    router.wait_version(2).await;
}

#[tokio::test]
async fn table_cache_lets_a_restarted_router_serve_before_the_control_plane_is_back() {
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("table.pb");
    let b = backends(2).await;
    let cp = MockControlPlane::start().await;
    cp.push(simple_table(
        7,
        strategy(RoutingStrategy::Random),
        &urls(&b),
    ));
    let config = Config {
        control_plane: cp.url.clone(),
        table_cache: Some(cache.clone()),
        ..Config::default()
    };
    let router = RouterHandle::start(config.clone()).await;
    cp.ack(7).await;
    wait_for("the cache file is written", WAIT, || async {
        cache.exists()
    })
    .await;
    router.shutdown().await;
    cp.stop().await;

    let offline = Config {
        control_plane: test_support::unused_url(),
        ..config
    };
    let router = RouterHandle::start(offline.clone()).await;
    let ready = get(&router.url("/readyz")).await;
    assert_eq!(
        (ready.status, ready.json()["table_version"].as_u64()),
        (200, Some(7))
    );
    let r = post(
        &router.url("/v1/completions"),
        &[],
        r#"{"model":"e","prompt":"x"}"#,
    )
    .await;
    assert_eq!(
        (r.status, r.header("x-prefix-router-table-version")),
        (200, "7")
    );
    router.shutdown().await;

    // a corrupt cache is ignored (not ready, no crash)
    std::fs::write(&cache, b"\xff\xff\xff garbage").unwrap();
    let router = RouterHandle::start(offline).await;
    get(&router.url("/readyz"))
        .await
        .assert_error(503, "service_unavailable");
    router.shutdown().await;
}

#[tokio::test]
async fn streaming_responses_pass_through_chunk_by_chunk() {
    let cp = MockControlPlane::start().await;
    let b = Backend::start_with("s", Behavior::Stream).await;
    cp.push(simple_table(1, prefix_aware(256, 64), &[b.url.as_str()]));
    let router = RouterHandle::watching(&cp, "r").await;
    router.wait_version(1).await;
    let body = r#"{"model":"e","stream":true,"messages":[{"role":"user","content":"count"}]}"#;
    let resp = client().request(post_request(&router.url("/v1/chat/completions"), &[], body));
    let chunks = b.next_stream();
    let (resp, chunks) = tokio::join!(resp, chunks);
    let resp = resp.unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    assert_eq!(resp.headers()["x-prefix-router-decision"], "prefix_hash");
    let mut body = resp.into_body();
    let mut received = Vec::new();
    for i in 0..3 {
        let chunk = Bytes::from(format!("data: {{\"n\":{i}}}\n\n"));
        chunks.send(chunk.clone()).await.unwrap();
        // each chunk arrives while the upstream is still open
        let mut got = Vec::new();
        while got.len() < chunk.len() {
            let frame = tokio::time::timeout(WAIT, body.frame())
                .await
                .expect("chunk not flushed")
                .unwrap()
                .unwrap();
            got.extend_from_slice(&frame.into_data().unwrap());
        }
        assert_eq!(got, chunk.to_vec());
        received.extend(got);
    }
    chunks
        .send(Bytes::from_static(b"data: [DONE]\n\n"))
        .await
        .unwrap();
    drop(chunks);
    let rest = body.collect().await.unwrap().to_bytes();
    received.extend_from_slice(&rest);
    assert!(received.ends_with(b"data: [DONE]\n\n"));
}

#[tokio::test]
async fn engines_cache_reports_are_counted_as_they_pass_unchanged() {
    let cp = MockControlPlane::start().await;
    let b = Backend::start_with("s", Behavior::Stream).await;
    cp.push(simple_table(1, prefix_aware(256, 64), &[b.url.as_str()]));
    let router = RouterHandle::watching(&cp, "r").await;
    router.wait_version(1).await;
    let body = r#"{"model":"e","stream":true,"messages":[{"role":"user","content":"count"}]}"#;
    // llama.cpp's timings in the last event, split across frames mid-key and mid-number
    let pieces = [
        "data: {\"choices\":[{\"delta\":{\"content\":\"say \\\"cache_n\\\":9\"}}]}\n\n",
        "data: {\"choices\":[],\"timings\":{\"cac",
        "he_n\":12",
        "52,\"prompt_n\":78}}\n\ndata: [DONE]\n\n",
    ];
    for _ in 0..2 {
        let resp = client().request(post_request(&router.url("/v1/chat/completions"), &[], body));
        let chunks = b.next_stream();
        let (resp, chunks) = tokio::join!(resp, chunks);
        let resp = resp.unwrap();
        assert_eq!(resp.status(), 200);
        for p in pieces {
            chunks.send(Bytes::from(p)).await.unwrap();
        }
        drop(chunks);
        let got = resp.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(
            got,
            pieces.concat().as_bytes(),
            "the client's bytes are unchanged"
        );
    }
    let instance = format!("instance=\"{}\"", b.url);
    let sample = |metrics: &str, name: &str| -> Option<f64> {
        metrics
            .lines()
            .find(|l| {
                l.starts_with(name)
                    && l.contains(&instance)
                    && l.contains("decision=\"prefix_hash\"")
            })
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
    };
    // the report is learned when the body ends, which the client sees at the same moment
    let metrics = wait_for(
        "the request's prompt tokens in the metrics",
        WAIT,
        || async {
            let metrics = router.metrics().await;
            (sample(&metrics, "prefix_router_prompt_tokens_total") == Some(2660.0))
                .then_some(metrics)
        },
    )
    .await;
    assert_eq!(
        sample(&metrics, "prefix_router_cached_prompt_tokens_total"),
        Some(2504.0),
        "{metrics}"
    );
    // the prefix index keeps a capacity estimate for the instance that reported
    assert!(
        metrics.contains(&format!(
            "prefix_router_prefix_index_capacity_blocks{{endpoint=\"e\",variant=\"v1\",{instance}}}"
        )),
        "{metrics}"
    );
}

#[tokio::test]
async fn error_paths_answer_json_with_their_status() {
    // no table yet: 503
    let router = RouterHandle::start(Config {
        control_plane: test_support::unused_url(),
        max_body_bytes: 1024,
        request_timeout_ms: 500,
        ..Config::default()
    })
    .await;
    let chat_url = router.url("/v1/chat/completions");
    post(&chat_url, &[], chat(&[("user", "x")]))
        .await
        .assert_error(503, "service_unavailable");
    router.shutdown().await;

    let cp = MockControlPlane::start().await;
    let ok = Backend::start("ok").await;
    let held = Backend::start_with("held", Behavior::Hold).await;
    let dead = test_support::unused_url();
    let random = || strategy(RoutingStrategy::Random);
    cp.push(table(
        1,
        vec![
            endpoint("e", vec![variant("v1", random(), &[ok.url.as_str()])]),
            endpoint("empty", vec![variant::<&str>("v1", random(), &[])]),
            endpoint("novariant", vec![]),
            endpoint("dead", vec![variant("v1", random(), &[dead.as_str()])]),
            endpoint("slow", vec![variant("v1", random(), &[held.url.as_str()])]),
        ],
    ));
    let router = RouterHandle::start(Config {
        control_plane: cp.url.clone(),
        max_body_bytes: 1024,
        request_timeout_ms: 500,
        ..Config::default()
    })
    .await;
    router.wait_version(1).await;
    let chat_url = router.url("/v1/chat/completions");
    let body = chat(&[("user", "x")]);

    // 400: header that is not text
    let mut req = post_request(&chat_url, &[], body.clone());
    req.headers_mut().insert(
        "x-endpoint-name",
        http::HeaderValue::from_bytes(b"\xffe").unwrap(),
    );
    let r = send(req).await;
    r.assert_error(400, "invalid_request_error");
    assert_eq!(r.header("x-prefix-router-table-version"), "1");
    post(&router.url("/endpoints/%ff%fe/invocations"), &[], "x")
        .await
        .assert_error(400, "invalid_request_error");
    // 404: endpoint, variant, path
    post(&chat_url, &[("x-endpoint-name", "nope")], body.clone())
        .await
        .assert_error(404, "not_found_error");
    post(
        &chat_url,
        &[("x-endpoint-name", "e"), ("x-target-variant", "v9")],
        body.clone(),
    )
    .await
    .assert_error(404, "not_found_error");
    post(&router.url("/v2/whatever"), &[], body.clone())
        .await
        .assert_error(404, "not_found_error");
    get(&chat_url).await.assert_error(405, "method_not_allowed");
    // 413: declared length, and a chunked body with no length
    let big = "x".repeat(2048);
    post(&chat_url, &[("x-endpoint-name", "e")], big.clone())
        .await
        .assert_error(413, "request_too_large");
    let chunks: Vec<Result<Frame<Bytes>, Infallible>> = (0..8)
        .map(|_| Ok(Frame::data(Bytes::from(vec![b'y'; 256]))))
        .collect();
    let stream = StreamBody::new(tokio_stream::iter(chunks));
    let req = Request::post(&chat_url)
        .header("x-endpoint-name", "e")
        .body(BodyExt::boxed(stream))
        .unwrap();
    send(req).await.assert_error(413, "request_too_large");
    // a body just under the limit is fine
    assert_eq!(
        post(&chat_url, &[("x-endpoint-name", "e")], "x".repeat(1000))
            .await
            .status,
        200
    );
    // 503: no instance, no variant
    post(&chat_url, &[("x-endpoint-name", "empty")], body.clone())
        .await
        .assert_error(503, "service_unavailable");
    post(&chat_url, &[("x-endpoint-name", "novariant")], body.clone())
        .await
        .assert_error(503, "service_unavailable");
    // 502: the only instance refuses connections (retry has nowhere to go)
    let r = post(&chat_url, &[("x-endpoint-name", "dead")], body.clone()).await;
    r.assert_error(502, "upstream_error");
    assert_eq!(r.instance(), dead);
    assert_eq!(r.decision(), "random");
    // 504: no response within --request-timeout-ms
    let r = post(&chat_url, &[("x-endpoint-name", "slow")], body.clone()).await;
    r.assert_error(504, "timeout_error");
    assert_eq!(r.instance(), held.url);
    held.release();
    // garbage bodies never fail routing
    for garbage in [
        "",
        "{",
        "[]",
        "null",
        "{\"messages\":[{\"role\":1}]}",
        "\u{0}\u{1}",
    ] {
        let r = post(&chat_url, &[("x-endpoint-name", "e")], garbage).await;
        assert_eq!(r.status, 200, "{garbage:?}");
    }
    let m = router.metrics().await;
    assert!(
        m.contains("decision=\"none\",status=\"404\",front_door=\"http\"} 3\n"),
        "{m}"
    );
    assert!(
        m.contains("decision=\"none\",status=\"413\",front_door=\"http\"} 2\n"),
        "{m}"
    );
    assert!(
        m.contains(&format!(
            "instance=\"{dead}\",decision=\"random\",status=\"502\",front_door=\"http\"}} 1\n"
        )),
        "{m}"
    );
}

#[tokio::test]
async fn failed_instances_are_retried_once_then_ejected() {
    let cp = MockControlPlane::start().await;
    let good = Backend::start("good").await;
    let bad = Backend::start_with("bad", Behavior::Status(500)).await;
    let dead = test_support::unused_url();
    cp.push(simple_table(
        1,
        strategy(RoutingStrategy::Random),
        &[good.url.as_str(), bad.url.as_str(), dead.as_str()],
    ));
    let router = RouterHandle::watching(&cp, "r").await;
    router.wait_version(1).await;
    let url = router.url("/v1/completions");
    for i in 0..40 {
        let r = post(&url, &[], format!(r#"{{"model":"e","prompt":"{i}"}}"#)).await;
        // a 500 or a refused connection is retried once on another instance; the retry may hit the
        // other failing one, whose 500 is then passed through
        assert!(
            r.status == 200 || r.status == 500 || r.status == 502,
            "{}",
            r.text()
        );
    }
    let m = router.metrics().await;
    assert!(!m.contains("prefix_router_retries_total 0\n"), "{m}");
    assert!(
        m.contains("prefix_router_ejections_total 2\n"),
        "both failing instances ejected: {m}"
    );
    // ejected: everything goes to the good one, the bad one sees nothing more
    let bad_hits = bad.hits();
    for i in 0..20 {
        let r = post(
            &url,
            &[],
            format!(r#"{{"model":"e","prompt":"again {i}"}}"#),
        )
        .await;
        assert_eq!((r.status, r.instance()), (200, good.url.as_str()));
    }
    assert_eq!(bad.hits(), bad_hits);

    // PREFIX_AWARE: a 5xx from the top choice is retried on the next instance of the ranking
    let b = backends(3).await;
    cp.push(simple_table(2, prefix_aware(256, 64), &urls(&b)));
    router.wait_version(2).await;
    let body = chat(&[("user", "retry me")]);
    let home = post(&router.url("/v1/chat/completions"), &[], body.clone())
        .await
        .instance()
        .to_string();
    let home_backend = b.iter().find(|x| x.url == home).unwrap();
    home_backend.set(Behavior::Status(503));
    let r = post(&router.url("/v1/chat/completions"), &[], body).await;
    assert_eq!(r.status, 200);
    assert_ne!(r.instance(), home);
}

#[tokio::test]
async fn metrics_report_requests_decisions_latency_and_version() {
    let cp = MockControlPlane::start().await;
    let b = backends(2).await;
    cp.push(simple_table(3, prefix_aware(256, 64), &urls(&b)));
    let router = RouterHandle::watching(&cp, "r").await;
    router.wait_version(3).await;
    let mut per_instance: HashMap<String, u64> = HashMap::new();
    for i in 0..10 {
        let r = post(
            &router.url("/v1/chat/completions"),
            &[],
            chat(&[("user", &format!("m{i}"))]),
        )
        .await;
        *per_instance.entry(r.instance().to_string()).or_default() += 1;
    }
    let m = router.metrics().await;
    for (instance, n) in per_instance {
        let line = format!(
            "prefix_router_requests_total{{endpoint=\"e\",variant=\"v1\",instance=\"{instance}\",decision=\"prefix_hash\",status=\"200\",front_door=\"http\"}} {n}\n"
        );
        assert!(m.contains(&line), "missing {line} in {m}");
    }
    assert!(
        m.contains("prefix_router_route_decision_seconds_count{front_door=\"http\"} 10\n"),
        "{m}"
    );
    assert!(
        m.contains(
            "prefix_router_route_decision_seconds_bucket{front_door=\"http\",le=\"0.000001\"}"
        ),
        "{m}"
    );
    assert!(m.contains("prefix_router_table_version 3\n"), "{m}");
    assert!(
        m.contains("prefix_router_control_plane_connected 1\n"),
        "{m}"
    );
}

#[tokio::test]
async fn shutdown_drains_in_flight_requests() {
    let cp = MockControlPlane::start().await;
    let b = Backend::start_with("h", Behavior::Hold).await;
    cp.push(simple_table(
        1,
        strategy(RoutingStrategy::Random),
        &[b.url.as_str()],
    ));
    let mut router = RouterHandle::watching(&cp, "r").await;
    router.wait_version(1).await;
    let in_flight = spawn_post(
        &router.url("/v1/completions"),
        &[],
        r#"{"model":"e","prompt":"x"}"#,
    );
    wait_for("the request is held", WAIT, || async { b.active() == 1 }).await;
    let serve = router.begin_shutdown();
    // no new connections once draining
    let addr = router.addr;
    wait_for("the listener is closed", WAIT, || async {
        tokio::net::TcpStream::connect(addr).await.is_err()
    })
    .await;
    assert!(!serve.is_finished());
    b.release();
    let r = in_flight.await.unwrap();
    assert_eq!(r.status, 200);
    tokio::time::timeout(WAIT, serve)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
}

/// A client that connected just before the shutdown and sends its request just after it (the
/// request was on its way) gets an answer, not a reset: closing such a connection would lose a
/// request the client cannot know whether to send again.
#[tokio::test]
async fn shutdown_answers_the_first_request_of_a_connection_opened_before_it() {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let cp = MockControlPlane::start().await;
    let b = Backend::start("h").await;
    cp.push(simple_table(
        1,
        strategy(RoutingStrategy::Random),
        &[b.url.as_str()],
    ));
    let mut router = RouterHandle::watching(&cp, "r").await;
    router.wait_version(1).await;
    // The connection is accepted (handed to a worker) before the shutdown and its first request
    // not read yet: the case a graceful close of idle connections would reset.
    let gauge = ConnectionGauge::new(&router);
    wait_for("only the gauge's connection is open", WAIT, || async {
        gauge.total().await == 1
    })
    .await;
    let mut early = tokio::net::TcpStream::connect(router.addr).await.unwrap();
    wait_for("the router accepted the early connection", WAIT, || async {
        gauge.total().await == 2
    })
    .await;
    drop(gauge);
    let serve = router.begin_shutdown();
    let addr = router.addr;
    wait_for("the listener is closed", WAIT, || async {
        tokio::net::TcpStream::connect(addr).await.is_err()
    })
    .await;
    let body = r#"{"model":"e","prompt":"x"}"#;
    let request = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: r\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    early.write_all(request.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(WAIT, early.read_to_end(&mut answer))
        .await
        .expect("the answer comes and the connection closes")
        .expect("an answer, not a reset");
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(
        answer.to_ascii_lowercase().contains("connection: close"),
        "{answer}"
    );
    tokio::time::timeout(WAIT, serve)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
}

/// A raw HTTP/1.1 model server answering each request with a keep-alive 200 and then, if
/// `close_after_reply`, closing the connection without saying so (as a server whose keep-alive
/// timeout ran out does).
fn raw_backend(close_after_reply: bool) -> HttpStub {
    HttpStub::start(move |_| {
        let reply = StubReply::json(r#"{"ok":true}"#);
        if close_after_reply {
            reply.then_close()
        } else {
            reply
        }
    })
}

#[tokio::test]
async fn upstream_connections_are_reused_and_replaced_once_the_server_closes_them() {
    let cp = MockControlPlane::start().await;
    let keep = raw_backend(false);
    let close = raw_backend(true);
    let (keep_url, close_url) = (keep.url.clone(), close.url.clone());
    cp.push(table(
        1,
        vec![
            endpoint(
                "keep",
                vec![variant(
                    "v1",
                    strategy(RoutingStrategy::Random),
                    &[&keep_url],
                )],
            ),
            endpoint(
                "close",
                vec![variant(
                    "v1",
                    strategy(RoutingStrategy::Random),
                    &[&close_url],
                )],
            ),
        ],
    ));
    // One worker thread: idle connections are kept per worker.
    let router = RouterHandle::watching_on_workers(&cp, "r", 1).await;
    router.wait_version(1).await;
    let url = router.url("/v1/completions");

    // keep-alive: one connection carries every request
    for i in 0..10 {
        let r = post(
            &url,
            &[("x-endpoint-name", "keep")],
            format!(r#"{{"prompt":"{i}"}}"#),
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.text());
    }
    assert_eq!(keep.accepted(), 1);

    // closed after each reply: each request gets a new connection, and the closed one is neither
    // an error for the client nor a failure of the instance
    for i in 0..10 {
        let r = post(
            &url,
            &[("x-endpoint-name", "close")],
            format!(r#"{{"prompt":"{i}"}}"#),
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.text());
        if i % 3 == 0 {
            // and when the close was sent well before the next request
            wait_for("the backend to close the connection", WAIT, || async {
                close.closed() == i + 1
            })
            .await;
        }
    }
    assert_eq!(close.accepted(), 10);
    let m = router.metrics().await;
    assert!(m.contains("prefix_router_retries_total 0\n"), "{m}");
    assert!(m.contains("prefix_router_ejections_total 0\n"), "{m}");
}

#[tokio::test]
async fn connections_are_spread_evenly_over_the_worker_threads() {
    let cp = MockControlPlane::start().await;
    let b = backends(1).await;
    cp.push(simple_table(
        1,
        strategy(RoutingStrategy::Random),
        &urls(&b),
    ));
    let router = RouterHandle::watching_on_workers(&cp, "r", 3).await;
    router.wait_version(1).await;
    // One connection reads the metrics throughout; the others (readiness polls) are gone first.
    let gauge = ConnectionGauge::new(&router);
    wait_for("only the metrics connection is open", WAIT, || async {
        gauge.total().await == 1
    })
    .await;
    // 8 more client connections held open (keep-alive), one request each: 9 over 3 workers
    let url = router.url("/v1/completions");
    let mut held = Vec::new();
    for i in 0..8 {
        let c = client();
        let r = c
            .request(post_request(
                &url,
                &[],
                format!(r#"{{"model":"e","prompt":"{i}"}}"#),
            ))
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        r.into_body().collect().await.unwrap();
        held.push(c);
    }
    assert_eq!(gauge.per_worker().await, vec![3, 3, 3]);
    drop(held);
}
