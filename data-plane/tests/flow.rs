//! Flow control through the router: when every instance is at its in-flight limit, requests
//! wait in the router, most urgent first and tenants in turn, with deadlines, a bound, and
//! nothing left behind by clients that go away.

mod support;

use std::time::{Duration, Instant};

use data_plane::flow::Switch;
use data_plane::Config;
use proto::RoutingStrategy;
use support::*;
use test_support::wait_for;
use tokio::task::JoinHandle;

/// A router over one held backend that takes one request at a time.
async fn one_at_a_time(
    extra: impl FnOnce(&mut Config),
) -> (MockControlPlane, Backend, RouterHandle) {
    let cp = MockControlPlane::start().await;
    let b = Backend::start_with("held", Behavior::Hold).await;
    cp.push(simple_table(
        1,
        strategy(RoutingStrategy::Random),
        &[b.url.as_str()],
    ));
    let mut config = Config {
        control_plane: cp.url.clone(),
        instance_max_in_flight: 1,
        ..Config::default()
    };
    extra(&mut config);
    let router = RouterHandle::start(config).await;
    router.wait_version(1).await;
    (cp, b, router)
}

fn body(name: &str) -> String {
    serde_json::json!({"model": "e", "prompt": name}).to_string()
}

/// The sum of a metric family's samples whose line contains `filter`.
async fn metric(router: &RouterHandle, name: &str, filter: &str) -> f64 {
    router
        .metrics()
        .await
        .lines()
        .filter(|l| l.starts_with(name) && l.contains(filter))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

async fn wait_queued(router: &RouterHandle, n: f64) {
    wait_for(
        &format!("{n} requests wait in the router"),
        WAIT,
        || async { metric(router, "prefix_router_queue_depth{", "").await == n },
    )
    .await;
}

/// Which request the held backend has now (its prompt), once it holds one.
async fn at_backend(b: &Backend) -> String {
    wait_for("the backend holds a request", WAIT, || async {
        b.active() == 1
    })
    .await;
    let last = b.last_request.lock().unwrap().clone().expect("a request");
    serde_json::from_slice::<serde_json::Value>(&last.2).unwrap()["prompt"]
        .as_str()
        .unwrap()
        .to_string()
}

/// `first` held at `b`, then `n` requests waiting behind it.
async fn queue_behind_one(
    url: &str,
    b: &Backend,
    router: &RouterHandle,
    n: usize,
) -> (JoinHandle<Reply>, Vec<JoinHandle<Reply>>) {
    let first = spawn_post(url, &[], body("first"));
    at_backend(b).await;
    let waiting: Vec<_> = (0..n)
        .map(|i| spawn_post(url, &[], body(&format!("w{i}"))))
        .collect();
    wait_queued(router, n as f64).await;
    (first, waiting)
}

/// Releases the held request and returns the prompt of the next one the backend gets.
async fn next_served(b: &Backend, served_so_far: u64) -> String {
    b.release();
    wait_for("the next request reaches the backend", WAIT, || async {
        b.hits() > served_so_far && b.active() == 1
    })
    .await;
    at_backend(b).await
}

#[tokio::test]
async fn a_full_fleet_serves_the_most_urgent_first_and_tenants_in_turn() {
    let (_cp, b, router) = one_at_a_time(|_| {}).await;
    let url = router.url("/v1/completions");
    let first = spawn_post(&url, &[], body("first"));
    assert_eq!(at_backend(&b).await, "first");
    let mut waiting = Vec::new();
    let queue = |prompt: &str, tenant: &str, priority: &str| {
        spawn_post(
            &url,
            &[
                ("x-prefix-router-tenant", tenant),
                ("x-prefix-router-priority", priority),
            ],
            body(prompt),
        )
    };
    // a batch tenant floods first, then chat arrives
    for (i, (prompt, tenant, priority)) in [
        ("batch-1", "batch", "sheddable"),
        ("big-1", "big", "standard"),
        ("big-2", "big", "standard"),
        ("big-3", "big", "standard"),
        ("small-1", "small", "standard"),
        ("chat-1", "chat", "critical"),
    ]
    .into_iter()
    .enumerate()
    {
        waiting.push(queue(prompt, tenant, priority));
        // in this order (each is in the queue before the next is sent)
        wait_queued(&router, (i + 1) as f64).await;
    }
    assert_eq!(b.hits(), 1, "nothing went on while the instance was full");
    assert_eq!(
        metric(&router, "prefix_router_queue_depth{", "critical").await,
        1.0
    );
    let mut order = Vec::new();
    for served in 1..=6 {
        order.push(next_served(&b, served).await);
    }
    assert_eq!(
        order,
        ["chat-1", "big-1", "small-1", "big-2", "big-3", "batch-1"],
        "critical first, then standard with its tenants in turn, sheddable last"
    );
    b.release();
    assert_eq!(first.await.unwrap().status, 200);
    for w in waiting {
        let r = w.await.unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        assert!(
            r.header("x-prefix-router-queued-ms").parse::<u64>().is_ok(),
            "a request that waited says how long"
        );
    }
    wait_queued(&router, 0.0).await;
    assert_eq!(
        metric(&router, "prefix_router_queue_wait_seconds_count", "").await,
        6.0
    );
}

#[tokio::test]
async fn a_request_past_its_deadline_gets_429_and_a_client_that_leaves_frees_its_place() {
    let (_cp, b, router) = one_at_a_time(|c| c.queue_timeout_ms = 60_000).await;
    let url = router.url("/v1/completions");
    let first = spawn_post(&url, &[], body("first"));
    at_backend(&b).await;

    // the client's own deadline, shorter than --queue-timeout-ms
    let start = Instant::now();
    let late = post(
        &url,
        &[("x-prefix-router-queue-timeout-ms", "300")],
        body("late"),
    )
    .await;
    let waited = start.elapsed();
    late.assert_error(429, "rate_limit_exceeded");
    assert_eq!(late.json()["error"]["code"], "queue_timeout");
    assert_eq!(late.header("retry-after"), "1");
    assert!(waited >= Duration::from_millis(300), "{waited:?}");
    // no time to wait at all: refused at once, nothing queued
    let now = post(
        &url,
        &[("x-prefix-router-queue-timeout-ms", "0")],
        body("now"),
    )
    .await;
    assert_eq!(now.json()["error"]["code"], "queue_timeout");
    assert_eq!(
        metric(
            &router,
            "prefix_router_queue_refusals_total",
            "queue_timeout"
        )
        .await,
        2.0
    );
    let bad = post(
        &url,
        &[("x-prefix-router-queue-timeout-ms", "soon")],
        body("x"),
    )
    .await;
    bad.assert_error(400, "invalid_request_error");
    assert!(
        bad.text().contains("x-prefix-router-queue-timeout-ms"),
        "{}",
        bad.text()
    );

    // a client that goes away leaves the queue at once; the next one gets the place
    let gone = spawn_post(&url, &[], body("gone"));
    wait_queued(&router, 1.0).await;
    gone.abort();
    wait_queued(&router, 0.0).await;
    let next = spawn_post(&url, &[], body("next"));
    wait_queued(&router, 1.0).await;
    assert_eq!(next_served(&b, 1).await, "next");
    b.release();
    assert_eq!(first.await.unwrap().status, 200);
    assert_eq!(next.await.unwrap().status, 200);
    assert_eq!(
        b.hits(),
        2,
        "the request that left never reached the instance"
    );
}

#[tokio::test]
async fn a_full_queue_refuses_sheddable_requests_first() {
    let (_cp, b, router) = one_at_a_time(|c| c.max_queued = 1).await;
    let url = router.url("/v1/completions");
    let first = spawn_post(&url, &[], body("first"));
    at_backend(&b).await;
    let shed = [("x-prefix-router-priority", "sheddable")];
    let batch = spawn_post(&url, &shed, body("batch"));
    wait_queued(&router, 1.0).await;
    // a standard request takes the sheddable one's place
    let chat = spawn_post(&url, &[], body("chat"));
    let batch = batch.await.unwrap();
    batch.assert_error(503, "service_unavailable");
    assert_eq!(batch.json()["error"]["code"], "shed");
    assert_eq!(batch.header("retry-after"), "1");
    wait_queued(&router, 1.0).await;
    // full of standard requests: a sheddable one is refused, and so is another standard one
    let refused = post(&url, &shed, body("more batch")).await;
    assert_eq!(refused.json()["error"]["code"], "queue_full");
    let refused = post(&url, &[], body("more chat")).await;
    refused.assert_error(503, "service_unavailable");
    assert_eq!(refused.json()["error"]["code"], "queue_full");
    assert_eq!(next_served(&b, 1).await, "chat");
    b.release();
    assert_eq!(first.await.unwrap().status, 200);
    assert_eq!(chat.await.unwrap().status, 200);
    assert_eq!(
        metric(&router, "prefix_router_queue_refusals_total", "queue_full").await,
        2.0
    );
    assert_eq!(
        metric(&router, "prefix_router_queue_refusals_total", "shed").await,
        1.0
    );
}

#[tokio::test]
async fn api_keys_name_the_tenant_and_cap_the_priority() {
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys");
    std::fs::write(
        &keys,
        "sk-batch tenant=batch priority=sheddable\nsk-chat tenant=chat priority=critical\nsk-plain\n",
    )
    .unwrap();
    let keys_path = keys.clone();
    let (_cp, b, router) = one_at_a_time(move |c| c.api_key_file = Some(keys_path)).await;
    let url = router.url("/v1/completions");
    let first = spawn_post(&url, &[("authorization", "Bearer sk-plain")], body("first"));
    at_backend(&b).await;
    // batch asks for critical and arrives first; its key holds it to sheddable
    let batch = spawn_post(
        &url,
        &[
            ("authorization", "Bearer sk-batch"),
            ("x-prefix-router-priority", "critical"),
        ],
        body("batch"),
    );
    wait_queued(&router, 1.0).await;
    // a key without a priority may not ask for critical either: standard
    let plain = spawn_post(
        &url,
        &[
            ("authorization", "Bearer sk-plain"),
            ("x-prefix-router-priority", "critical"),
        ],
        body("plain"),
    );
    wait_queued(&router, 2.0).await;
    let chat = spawn_post(
        &url,
        &[
            ("authorization", "Bearer sk-chat"),
            ("x-prefix-router-priority", "critical"),
        ],
        body("chat"),
    );
    wait_queued(&router, 3.0).await;
    assert_eq!(
        metric(&router, "prefix_router_queue_depth{", "sheddable").await,
        1.0
    );
    let order = [
        next_served(&b, 1).await,
        next_served(&b, 2).await,
        next_served(&b, 3).await,
    ];
    assert_eq!(order, ["chat", "plain", "batch"]);
    b.release();
    for r in [first, batch, plain, chat] {
        assert_eq!(r.await.unwrap().status, 200);
    }
    // a bad line names the field
    std::fs::write(&keys, "sk-x priority=urgent\n").unwrap();
    let e = data_plane::serve(
        test_support::bind_loopback().await,
        Config {
            api_key_file: Some(keys),
            ..Config::default()
        },
        async {},
    )
    .await
    .unwrap_err();
    assert!(format!("{e:#}").contains("priority=\"urgent\""), "{e:#}");
}

#[tokio::test]
async fn prefix_aware_requests_wait_only_once_every_instance_is_at_its_threshold() {
    let cp = MockControlPlane::start().await;
    let b = vec![
        Backend::start_with("h0", Behavior::Hold).await,
        Backend::start_with("h1", Behavior::Hold).await,
    ];
    cp.push(simple_table(1, prefix_aware(256, 1), &urls(&b)));
    let router = RouterHandle::watching(&cp, "r").await;
    router.wait_version(1).await;
    let url = router.url("/v1/chat/completions");
    let doc = chat(&[("user", "the same long document")]);
    let held: Vec<_> = (0..2).map(|_| spawn_post(&url, &[], doc.clone())).collect();
    wait_for("both instances hold one request", WAIT, || async {
        b[0].active() == 1 && b[1].active() == 1
    })
    .await;
    let third = spawn_post(&url, &[], doc.clone());
    wait_queued(&router, 1.0).await;
    assert_eq!(b[0].hits() + b[1].hits(), 2);
    for x in &b {
        x.set(Behavior::Echo);
        x.release();
    }
    let third = third.await.unwrap();
    assert_eq!(third.status, 200);
    assert!(!third.header("x-prefix-router-queued-ms").is_empty());
    for h in held {
        let r = h.await.unwrap();
        assert_eq!(r.status, 200);
        assert!(
            r.header("x-prefix-router-queued-ms").is_empty(),
            "did not wait"
        );
    }
}

#[tokio::test]
async fn a_strategy_swap_while_requests_wait_loses_none_and_flow_control_can_be_off() {
    let (cp, b, router) = one_at_a_time(|_| {}).await;
    let url = router.url("/v1/completions");
    let (first, waiting) = queue_behind_one(&url, &b, &router, 3).await;
    cp.push(simple_table(
        2,
        strategy(RoutingStrategy::LeastOutstandingRequests),
        &[b.url.as_str()],
    ));
    router.wait_version(2).await;
    b.set(Behavior::Echo);
    b.release();
    assert_eq!(first.await.unwrap().status, 200);
    for w in waiting {
        assert_eq!(w.await.unwrap().status, 200);
    }
    wait_queued(&router, 0.0).await;
    router.shutdown().await;

    // off: everything goes on to the instance, as before flow control
    let (_cp, b, router) = one_at_a_time(|c| c.flow_control = Switch::Off).await;
    let url = router.url("/v1/completions");
    let both: Vec<_> = (0..2)
        .map(|i| spawn_post(&url, &[], body(&format!("r{i}"))))
        .collect();
    wait_for("the instance holds both", WAIT, || async {
        b.active() == 2
    })
    .await;
    b.release();
    for r in both {
        assert_eq!(r.await.unwrap().status, 200);
    }
}

#[tokio::test]
async fn a_tenant_over_its_rate_gets_429_with_openai_rate_limit_headers() {
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys");
    std::fs::write(&keys, "sk-r tenant=r rpm=2 tpm=100000\nsk-free\n").unwrap();
    let cp = MockControlPlane::start().await;
    let b = Backend::start("b").await;
    cp.push(simple_table(
        1,
        strategy(RoutingStrategy::Random),
        &[b.url.as_str()],
    ));
    let router = RouterHandle::start(Config {
        control_plane: cp.url.clone(),
        api_key_file: Some(keys),
        ..Config::default()
    })
    .await;
    router.wait_version(1).await;
    let url = router.url("/v1/completions");
    let key = [("authorization", "Bearer sk-r")];
    for remaining in ["1", "0"] {
        let r = post(&url, &key, body("q")).await;
        assert_eq!(r.status, 200);
        assert_eq!(r.header("x-ratelimit-limit-requests"), "2");
        assert_eq!(r.header("x-ratelimit-remaining-requests"), remaining);
        assert_eq!(r.header("x-ratelimit-limit-tokens"), "100000");
        assert!(!r.header("x-ratelimit-reset-requests").is_empty());
    }
    let refused = post(&url, &key, body("q")).await;
    refused.assert_error(429, "rate_limit_exceeded");
    assert_eq!(refused.json()["error"]["code"], "requests_per_minute");
    let retry: u64 = refused.header("retry-after").parse().unwrap();
    assert!((1..=30).contains(&retry), "{retry}");
    assert_eq!(refused.header("x-ratelimit-remaining-requests"), "0");
    assert_eq!(b.hits(), 2, "the refused request reached no instance");
    // a bad flow header is refused even when nothing would wait
    let bad = post(
        &url,
        &[
            ("authorization", "Bearer sk-free"),
            ("x-prefix-router-tenant", "a/b"),
        ],
        body("q"),
    )
    .await;
    bad.assert_error(400, "invalid_request_error");
    assert!(
        bad.text().contains("x-prefix-router-tenant"),
        "{}",
        bad.text()
    );
    // another tenant is not slowed, and carries no rate headers
    let free = post(&url, &[("authorization", "Bearer sk-free")], body("q")).await;
    assert_eq!(free.status, 200);
    assert!(free.header("x-ratelimit-limit-requests").is_empty());
    assert_eq!(
        metric(
            &router,
            "prefix_router_queue_refusals_total",
            "requests_per_minute"
        )
        .await,
        1.0
    );
}

#[tokio::test]
async fn sheddable_requests_leave_a_quarter_of_each_instance_to_the_others() {
    let (_cp, b, router) = one_at_a_time(|c| c.instance_max_in_flight = 4).await;
    let url = router.url("/v1/completions");
    let shed = [("x-prefix-router-priority", "sheddable")];
    let batch: Vec<_> = (0..4)
        .map(|i| spawn_post(&url, &shed, body(&format!("batch-{i}"))))
        .collect();
    // three of the four places; the fourth batch request waits
    wait_queued(&router, 1.0).await;
    wait_for("the instance holds three", WAIT, || async {
        b.active() == 3
    })
    .await;
    // a critical request goes straight to the place kept free
    let chat = spawn_post(
        &url,
        &[("x-prefix-router-priority", "critical")],
        body("chat"),
    );
    wait_for("the instance holds four", WAIT, || async {
        b.active() == 4
    })
    .await;
    assert_eq!(metric(&router, "prefix_router_queue_depth{", "").await, 1.0);
    b.set(Behavior::Echo);
    b.release();
    // (it reached the instance before anything ended: it passed the sheddable waiter at once)
    assert_eq!(chat.await.unwrap().status, 200);
    for r in batch {
        assert_eq!(r.await.unwrap().status, 200);
    }
}

#[tokio::test]
async fn a_variant_names_the_priority_of_requests_that_name_none() {
    // a batch variant whose requests are sheddable unless they say otherwise
    let cp = MockControlPlane::start().await;
    let b = Backend::start_with("held", Behavior::Hold).await;
    let batch = proto::RoutingConfig {
        default_priority: proto::RequestPriority::Sheddable as i32,
        ..strategy(RoutingStrategy::Random)
    };
    cp.push(simple_table(1, batch, &[b.url.as_str()]));
    let router = RouterHandle::start(Config {
        control_plane: cp.url.clone(),
        instance_max_in_flight: 4,
        ..Config::default()
    })
    .await;
    router.wait_version(1).await;
    let url = router.url("/v1/completions");
    let unnamed: Vec<_> = (0..4)
        .map(|i| spawn_post(&url, &[], body(&format!("batch-{i}"))))
        .collect();
    // sheddable: three of the four places, and the fourth waits as sheddable
    wait_queued(&router, 1.0).await;
    assert_eq!(
        metric(&router, "prefix_router_queue_depth{", "sheddable").await,
        1.0
    );
    wait_for("the instance holds three", WAIT, || async {
        b.active() == 3
    })
    .await;
    // a request that names its priority has it
    let named = spawn_post(
        &url,
        &[("x-prefix-router-priority", "standard")],
        body("named"),
    );
    wait_for("the instance holds four", WAIT, || async {
        b.active() == 4
    })
    .await;
    b.set(Behavior::Echo);
    b.release();
    assert_eq!(named.await.unwrap().status, 200);
    for r in unnamed {
        assert_eq!(r.await.unwrap().status, 200);
    }
}

#[tokio::test]
async fn a_router_that_shuts_down_answers_its_waiting_requests_503_and_finishes_the_rest() {
    let (_cp, b, mut router) = one_at_a_time(|_| {}).await;
    let url = router.url("/v1/completions");
    let (first, waiting) = queue_behind_one(&url, &b, &router, 2).await;
    let serve = router.begin_shutdown();
    for w in waiting {
        let r = w.await.unwrap();
        r.assert_error(503, "service_unavailable");
        assert_eq!(r.json()["error"]["code"], "shutting_down");
        assert_eq!(r.header("retry-after"), "1");
    }
    // the request already on the instance finishes within the grace
    b.release();
    assert_eq!(first.await.unwrap().status, 200);
    tokio::time::timeout(WAIT, serve)
        .await
        .expect("serve returned")
        .unwrap()
        .unwrap();
    assert_eq!(b.hits(), 1, "nothing that waited was sent on");
}

/// A fleet that grows while requests wait: the table that adds an instance sends them there at
/// once (before, they waited for a place on the old instance, here held forever, until their
/// deadline), and one whose variant is gone answers them by the new table at once.
#[tokio::test]
async fn requests_waiting_when_a_table_adds_an_instance_go_to_it_at_once() {
    let (cp, b, router) = one_at_a_time(|_| {}).await;
    let url = router.url("/v1/completions");
    let (first, waiting) = queue_behind_one(&url, &b, &router, 2).await;
    let c = Backend::start("new").await;
    let started = Instant::now();
    cp.push(simple_table(
        2,
        strategy(RoutingStrategy::Random),
        &[b.url.as_str(), c.url.as_str()],
    ));
    router.wait_version(2).await;
    // one place on the new instance: the first waiter takes it, the second takes the next
    for w in waiting {
        let r = tokio::time::timeout(WAIT, w)
            .await
            .expect("the waiter is served by the new instance")
            .unwrap();
        assert_eq!(r.status, 200);
    }
    assert_eq!(
        c.hits(),
        2,
        "both waiters went to the instance the table added"
    );
    assert!(started.elapsed() < WAIT);
    assert_eq!(b.active(), 1, "the held request stays where it was");
    wait_queued(&router, 0.0).await;

    // a table without the waiter's variant: the waiter goes by the new table at once, not left
    // in a queue no table serves
    c.set(Behavior::Hold);
    let on_c = spawn_post(&url, &[], body("on-c"));
    wait_for("the new instance holds a request", WAIT, || async {
        c.active() == 1
    })
    .await;
    let stranded = spawn_post(&url, &[], body("stranded"));
    wait_queued(&router, 1.0).await;
    let d = Backend::start("other").await;
    let mut moved = simple_table(3, strategy(RoutingStrategy::Random), &[d.url.as_str()]);
    moved.endpoints[0].variants[0].variant_name = "other".to_string();
    cp.push(moved);
    router.wait_version(3).await;
    let r = tokio::time::timeout(WAIT, stranded)
        .await
        .expect("the stranded waiter is answered by the new table")
        .unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(d.hits(), 1, "it went to the new variant's instance");
    wait_queued(&router, 0.0).await;
    b.release();
    c.release();
    let _ = first.await;
    let _ = on_c.await;
    router.shutdown().await;
}

/// A prompt the router places on `backend` (which answers), out of 64 tried.
async fn document_on(url: &str, backend: &Backend) -> String {
    let host = backend.url.trim_start_matches("http://");
    for i in 0..64 {
        let prompt = format!("document {i}: the whole report, then a question");
        let r = post(url, &[], body(&prompt)).await;
        assert_eq!(r.status, 200, "{}", r.text());
        if r.instance().contains(host) {
            return prompt;
        }
    }
    panic!("no document of 64 placed on {host}");
}

/// PREFIX_AWARE while waiting: a place freed on an instance goes first to a waiter whose own
/// instance it is (whose cache has its prefix), even one queued later, while the others hold out
/// for theirs; but no place stays idle while anyone waits.
#[tokio::test]
async fn a_freed_place_goes_to_a_waiter_whose_own_instance_it_is_first() {
    let cp = MockControlPlane::start().await;
    let a = Backend::start("a").await;
    let b = Backend::start("b").await;
    cp.push(simple_table(
        1,
        prefix_aware(2048, 1),
        &[a.url.as_str(), b.url.as_str()],
    ));
    let router = RouterHandle::start(Config {
        control_plane: cp.url.clone(),
        // holds out for 30 s (a quarter), longer than any wait below
        queue_timeout_ms: 120_000,
        ..Config::default()
    })
    .await;
    router.wait_version(1).await;
    let url = router.url("/v1/completions");
    // A document whose instance is `a`, and one whose instance is `b`.
    let (doc_a, doc_b) = (document_on(&url, &a).await, document_on(&url, &b).await);
    a.set(Behavior::Hold);
    b.set(Behavior::Hold);
    let hits = (a.hits(), b.hits());
    let hold_a = spawn_post(&url, &[], body(&doc_a));
    wait_for("a holds its document", WAIT, || async { a.active() == 1 }).await;
    let hold_b = spawn_post(&url, &[], body(&doc_b));
    wait_for("b holds its document", WAIT, || async { b.active() == 1 }).await;
    let w_a = spawn_post(&url, &[], body(&doc_a));
    wait_queued(&router, 1.0).await;
    let w_b = spawn_post(&url, &[], body(&doc_b));
    wait_queued(&router, 2.0).await;

    // b frees: its place goes to the request for b, queued after the one for a
    b.release();
    assert_eq!(hold_b.await.unwrap().status, 200);
    wait_for("b takes the request for b", WAIT, || async {
        b.hits() == hits.1 + 2 && b.active() == 1
    })
    .await;
    assert!(!w_a.is_finished(), "the request for a still waits for a");
    assert_eq!(metric(&router, "prefix_router_queue_depth{", "").await, 1.0);
    b.release();
    let r = w_b.await.unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(r.instance().contains(b.url.trim_start_matches("http://")));
    // b frees again and no one else waits: the request for a takes it at once, well within
    // the share of its wait it would hold out for a
    wait_for("the request for a goes to b", WAIT, || async {
        b.active() == 1
    })
    .await;
    b.release();
    let r = w_a.await.unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(r.instance().contains(b.url.trim_start_matches("http://")));
    assert_eq!(a.hits(), hits.0 + 1, "a still has only its own request");
    a.release();
    assert_eq!(hold_a.await.unwrap().status, 200);
    wait_queued(&router, 0.0).await;
}

#[tokio::test]
async fn sheddable_requests_leave_one_of_four_single_request_engines_to_the_others() {
    // four engines that run one request each: no instance has a quarter to keep, the variant does
    let cp = MockControlPlane::start().await;
    let mut held = Vec::new();
    for i in 0..4 {
        held.push(Backend::start_with(&format!("e{i}"), Behavior::Hold).await);
    }
    let urls: Vec<&str> = held.iter().map(|b| b.url.as_str()).collect();
    cp.push(simple_table(1, strategy(RoutingStrategy::Random), &urls));
    let router = RouterHandle::start(Config {
        control_plane: cp.url.clone(),
        instance_max_in_flight: 1,
        ..Config::default()
    })
    .await;
    router.wait_version(1).await;
    let url = router.url("/v1/completions");
    let active = || held.iter().map(|b| b.active()).sum::<u64>();
    let shed = [("x-prefix-router-priority", "sheddable")];
    let batch: Vec<_> = (0..4)
        .map(|i| spawn_post(&url, &shed, body(&format!("batch-{i}"))))
        .collect();
    // three engines take batch work; the fourth batch request waits
    wait_queued(&router, 1.0).await;
    wait_for("three engines hold batch work", WAIT, || async {
        active() == 3
    })
    .await;
    // a critical request goes straight to the engine kept free
    let chat = spawn_post(
        &url,
        &[("x-prefix-router-priority", "critical")],
        body("chat"),
    );
    wait_for("all four engines hold a request", WAIT, || async {
        active() == 4
    })
    .await;
    assert_eq!(metric(&router, "prefix_router_queue_depth{", "").await, 1.0);
    for b in &held {
        b.set(Behavior::Echo);
        b.release();
    }
    assert_eq!(chat.await.unwrap().status, 200);
    for r in batch {
        assert_eq!(r.await.unwrap().status, 200);
    }
}

#[tokio::test]
async fn requests_waiting_are_counted_per_tenant_and_priority() {
    let (_cp, b, router) = one_at_a_time(|_| {}).await;
    let url = router.url("/v1/completions");
    let first = spawn_post(&url, &[], body("first"));
    at_backend(&b).await;
    let send = |tenant: &str, priority: &str| {
        spawn_post(
            &url,
            &[
                ("x-prefix-router-tenant", tenant),
                ("x-prefix-router-priority", priority),
            ],
            body(tenant),
        )
    };
    let waiting = [
        send("alpha", "standard"),
        send("alpha", "standard"),
        send("beta", "critical"),
    ];
    wait_queued(&router, 3.0).await;
    let depth = |tenant: &'static str, priority: &'static str| {
        let labels = format!("priority=\"{priority}\",tenant=\"{tenant}\"");
        let router = &router;
        async move { metric(router, "prefix_router_tenant_queue_depth{", &labels).await }
    };
    assert_eq!(depth("alpha", "standard").await, 2.0);
    assert_eq!(depth("beta", "critical").await, 1.0);
    assert_eq!(depth("other", "standard").await, 0.0);
    assert_eq!(
        metric(&router, "prefix_router_tenant_queue_depth{", "").await,
        3.0,
        "every waiter in one tenant's series"
    );
    b.set(Behavior::Echo);
    b.release();
    assert_eq!(first.await.unwrap().status, 200);
    for w in waiting {
        assert_eq!(w.await.unwrap().status, 200);
    }
    wait_for("the tenants' depths are back to 0", WAIT, || async {
        metric(&router, "prefix_router_tenant_queue_depth{", "").await == 0.0
    })
    .await;
    assert_eq!(depth("alpha", "standard").await, 0.0);
}

/// What a streaming client has seen of its answer.
#[derive(Debug)]
enum Seen {
    Head(u16, http::HeaderMap),
    Data(bytes::Bytes),
    End,
}

async fn next_seen(rx: &mut tokio::sync::mpsc::UnboundedReceiver<Seen>) -> Seen {
    tokio::time::timeout(WAIT, rx.recv())
        .await
        .expect("the client sees the stream go on")
        .expect("the client task reports")
}

#[tokio::test]
async fn a_streaming_request_that_waits_sees_nothing_until_forwarded_then_the_whole_stream() {
    use http_body_util::BodyExt as _;
    let (_cp, b, router) = one_at_a_time(|_| {}).await;
    let url = router.url("/v1/chat/completions");
    let first = spawn_post(&url, &[], body("first"));
    at_backend(&b).await;
    b.set(Behavior::Stream);
    let streaming = serde_json::json!({
        "model": "e",
        "stream": true,
        "messages": [{"role": "user", "content": "tell me a story"}],
    });
    let req = post_request(&url, &[], streaming.to_string());
    let (seen, mut client_saw) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        let resp = client().request(req).await.expect("an answer");
        let _ = seen.send(Seen::Head(resp.status().as_u16(), resp.headers().clone()));
        let mut body = resp.into_body();
        while let Some(frame) = body.frame().await {
            if let Some(data) = frame.expect("a whole body").data_ref() {
                let _ = seen.send(Seen::Data(data.clone()));
            }
        }
        let _ = seen.send(Seen::End);
    });
    wait_queued(&router, 1.0).await;
    // the router has answered /metrics while the request waits: still nothing for the client
    wait_queued(&router, 1.0).await;
    assert!(
        client_saw.try_recv().is_err(),
        "a waiting streaming request gets no response bytes"
    );
    assert_eq!(b.hits(), 1, "and is not forwarded");

    b.release();
    assert_eq!(first.await.unwrap().status, 200);
    let chunks = b.next_stream().await;
    let Seen::Head(status, headers) = next_seen(&mut client_saw).await else {
        panic!("the head comes first");
    };
    assert_eq!(status, 200);
    assert_eq!(headers["content-type"], "text/event-stream");
    assert!(headers.contains_key("x-prefix-router-queued-ms"));
    let events = [
        "data: {\"choices\":[{\"delta\":{\"content\":\"once\"}}]}\n\n",
        "data: {\"choices\":[{\"delta\":{\"content\":\" upon\"}}]}\n\n",
        "data: [DONE]\n\n",
    ];
    for event in events {
        chunks.send(bytes::Bytes::from(event)).await.unwrap();
        // each event reaches the client as the engine sends it, not at the end
        let mut got = Vec::new();
        while got.len() < event.len() {
            match next_seen(&mut client_saw).await {
                Seen::Data(d) => got.extend_from_slice(&d),
                other => panic!("expected the event {event:?}, got {other:?}"),
            }
        }
        assert_eq!(String::from_utf8(got).unwrap(), event);
    }
    drop(chunks);
    assert!(
        matches!(next_seen(&mut client_saw).await, Seen::End),
        "the stream ends whole"
    );
    wait_queued(&router, 0.0).await;
}
