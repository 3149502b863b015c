//! A router that has just started holds requests until its first routing table arrives (bounded),
//! instead of failing everything sent in that moment with 503.

mod support;

use std::time::{Duration, Instant};

use data_plane::Config;
use proto::RoutingStrategy;
use support::*;

#[tokio::test]
async fn requests_before_the_first_table_wait_for_it() {
    let cp = MockControlPlane::start().await;
    let b = Backend::start("b").await;
    let router = RouterHandle::watching(&cp, "r").await;
    // in flight before any table exists
    let early = spawn_post(
        &router.url("/v1/completions"),
        &[],
        r#"{"model":"e","prompt":"x"}"#,
    );
    // /readyz does not wait: not ready yet
    get(&router.url("/readyz"))
        .await
        .assert_error(503, "service_unavailable");
    assert!(
        !early.is_finished(),
        "the early request waits for the table"
    );
    cp.push(simple_table(
        1,
        strategy(RoutingStrategy::Random),
        &[b.url.as_str()],
    ));
    let r = early.await.unwrap();
    assert_eq!(
        (r.status, r.header("x-prefix-router-table-version")),
        (200, "1"),
        "{}",
        r.text()
    );
}

#[tokio::test]
async fn without_a_table_the_wait_is_bounded_by_the_request_deadline() {
    // no control plane at all
    let router = RouterHandle::start(Config {
        control_plane: test_support::unused_url(),
        request_timeout_ms: 300,
        ..Config::default()
    })
    .await;
    let started = Instant::now();
    post(
        &router.url("/v1/completions"),
        &[],
        r#"{"model":"e","prompt":"x"}"#,
    )
    .await
    .assert_error(503, "service_unavailable");
    let waited = started.elapsed();
    assert!(waited >= Duration::from_millis(250), "{waited:?}");
    assert!(waited < Duration::from_secs(10), "{waited:?}");
}
