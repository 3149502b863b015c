//! A response that fails after its head: an event stream ends with an SSE error event (never a
//! cut that looks whole), a JSON body is cut (the client's read fails), and either counts
//! against the instance's passive health.

mod support;

use std::time::Duration;

use bytes::Bytes;
use data_plane::Config;
use support::*;
use test_support::{HttpStub, StubReply};

/// A model server that answers each request with a head and `first` (one chunk of a chunked
/// body; none when empty), then either closes the connection mid-body or holds it open forever.
fn breaking_server(content_type: &'static str, first: &'static str, close: bool) -> HttpStub {
    HttpStub::start(move |_| {
        let chunks: &[&str] = if first.is_empty() { &[] } else { &[first] };
        let reply = StubReply::cut_chunked(content_type, chunks);
        match close {
            true => reply.then_close(),
            false => reply.then_hold(), // held until the router gives up
        }
    })
}

async fn router_over(url: &str, timeout_ms: u64) -> (MockControlPlane, RouterHandle) {
    let cp = MockControlPlane::start().await;
    cp.push(simple_table(1, prefix_aware(256, 64), &[url]));
    let router = RouterHandle::start(Config {
        control_plane: cp.url.clone(),
        node_id: Some("r".into()),
        request_timeout_ms: timeout_ms,
        ..Config::default()
    })
    .await;
    router.wait_version(1).await;
    (cp, router)
}

/// The body as far as it came, and whether it ended cleanly.
async fn read_all(url: &str, body: &str) -> (u16, String, bool) {
    use http_body_util::BodyExt as _;
    let resp = tokio::time::timeout(
        WAIT,
        client().request(post_request(url, &[], body.to_string())),
    )
    .await
    .expect("a head in time")
    .expect("a head");
    let status = resp.status().as_u16();
    let mut body = resp.into_body();
    let mut bytes = Vec::new();
    loop {
        match tokio::time::timeout(WAIT, body.frame())
            .await
            .expect("the body ends in time")
        {
            None => return (status, String::from_utf8_lossy(&bytes).into_owned(), true),
            Some(Ok(f)) => bytes.extend_from_slice(f.data_ref().unwrap_or(&Bytes::new())),
            Some(Err(_)) => return (status, String::from_utf8_lossy(&bytes).into_owned(), false),
        }
    }
}

const STREAM: &str = r#"{"model":"e","stream":true,"messages":[{"role":"user","content":"hi"}]}"#;

#[tokio::test]
async fn an_event_stream_cut_by_the_instance_ends_with_an_error_event_and_counts_against_it() {
    let stub = breaking_server("text/event-stream", "data: {\"n\":0}\n\n", true);
    let url = stub.url.clone();
    let (_cp, router) = router_over(&url, 30_000).await;
    let chat = router.url("/v1/chat/completions");
    for _ in 0..3 {
        let (status, text, clean) = read_all(&chat, STREAM).await;
        assert_eq!(status, 200);
        assert!(clean, "the stream ends with its error event: {text}");
        let (first, error) = text.split_once("\n\n").unwrap();
        assert_eq!(first, "data: {\"n\":0}");
        let event: serde_json::Value =
            serde_json::from_str(error.trim().strip_prefix("data: ").unwrap()).unwrap();
        assert_eq!(event["error"]["type"], "upstream_error", "{text}");
        assert!(!text.contains("[DONE]"));
    }
    // three broken bodies in a row: ejected, and it shows
    let m = router.metrics().await;
    assert!(m.contains("prefix_router_ejections_total 1\n"), "{m}");
    assert!(
        m.contains(&format!("prefix_router_instance_ejected{{endpoint=\"e\",variant=\"v1\",instance=\"{url}\"}} 1\n")),
        "{m}"
    );
}

#[tokio::test]
async fn a_stream_cut_inside_an_event_closes_it_before_the_error_event() {
    let stub = breaking_server("text/event-stream", "data: {\"n\":0}\n\ndata: {\"n\"", true);
    let url = stub.url.clone();
    let (_cp, router) = router_over(&url, 30_000).await;
    let (_, text, clean) = read_all(&router.url("/v1/chat/completions"), STREAM).await;
    assert!(clean);
    let events: Vec<&str> = text
        .split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .collect();
    assert_eq!(events.len(), 3, "{text:?}");
    assert!(events[2].trim().starts_with("data: {\"error\""), "{text:?}");
}

#[tokio::test]
async fn a_stream_that_stalls_ends_at_the_deadline_with_a_timeout_event() {
    let stub = breaking_server("text/event-stream", "data: {\"n\":0}\n\n", false);
    let url = stub.url.clone();
    let (_cp, router) = router_over(&url, 500).await;
    let started = std::time::Instant::now();
    let (status, text, clean) = read_all(&router.url("/v1/chat/completions"), STREAM).await;
    assert_eq!(status, 200);
    assert!(clean, "{text}");
    assert!(text.contains(r#""type":"timeout_error""#), "{text}");
    assert!(started.elapsed() >= Duration::from_millis(450));
    // the request's own deadline is not the instance's failure
    let m = router.metrics().await;
    assert!(m.contains("prefix_router_ejections_total 0\n"), "{m}");
}

#[tokio::test]
async fn an_instance_that_never_answers_is_ejected_after_repeated_timeouts() {
    let cp = MockControlPlane::start().await;
    let stalled = Backend::start_with("stalled", Behavior::Hold).await;
    let good = Backend::start("good").await;
    cp.push(simple_table(
        1,
        prefix_aware(256, 64),
        &[stalled.url.as_str(), good.url.as_str()],
    ));
    let router = RouterHandle::start(Config {
        control_plane: cp.url.clone(),
        node_id: Some("r".into()),
        request_timeout_ms: 200,
        ..Config::default()
    })
    .await;
    router.wait_version(1).await;
    let url = router.url("/v1/completions");
    // prompts whose first choice is the stalled instance: 504 at the deadline, three times
    let mut timed_out = 0;
    for i in 0..200 {
        let r = post(&url, &[], format!(r#"{{"model":"e","prompt":"p{i}"}}"#)).await;
        if r.instance() == stalled.url {
            r.assert_error(504, "timeout_error");
            timed_out += 1;
            if timed_out == 3 {
                break;
            }
        }
    }
    assert_eq!(timed_out, 3);
    let m = router.metrics().await;
    assert!(m.contains("prefix_router_ejections_total 1\n"), "{m}");
    // ejected: its keys go to the other instance at once
    for i in 0..40 {
        let r = post(&url, &[], format!(r#"{{"model":"e","prompt":"p{i}"}}"#)).await;
        assert_eq!(
            (r.status, r.instance()),
            (200, good.url.as_str()),
            "{}",
            r.text()
        );
    }
    stalled.release();
}

#[tokio::test]
async fn a_5xx_passed_through_is_no_success_when_its_body_ends() {
    // One instance, always 500: nowhere to retry, so each 500 goes to the client whole; its body
    // ending must not reset the failures its status counted.
    let cp = MockControlPlane::start().await;
    let bad = Backend::start_with("bad", Behavior::Status(500)).await;
    cp.push(simple_table(
        1,
        strategy(proto::RoutingStrategy::Random),
        &[bad.url.as_str()],
    ));
    let router = RouterHandle::watching(&cp, "r").await;
    router.wait_version(1).await;
    for i in 0..3 {
        let r = post(
            &router.url("/v1/completions"),
            &[],
            format!(r#"{{"model":"e","prompt":"{i}"}}"#),
        )
        .await;
        assert_eq!(r.status, 500);
    }
    let m = router.metrics().await;
    assert!(m.contains("prefix_router_ejections_total 1\n"), "{m}");
}

#[tokio::test]
async fn a_json_body_that_fails_before_its_first_byte_is_retried_or_answered_502() {
    let stub = breaking_server("application/json", "", true);
    let url = stub.url.clone();
    let body = r#"{"model":"e","messages":[{"role":"user","content":"hi"}]}"#;
    // alone: nothing reached the client yet, so a contract error
    let (_cp, router) = router_over(&url, 30_000).await;
    post(&router.url("/v1/chat/completions"), &[], body)
        .await
        .assert_error(502, "upstream_error");
    // beside a healthy instance: retried there
    let good = Backend::start("good").await;
    let cp = MockControlPlane::start().await;
    cp.push(simple_table(
        1,
        strategy(proto::RoutingStrategy::Random),
        &[url.as_str(), good.url.as_str()],
    ));
    let router = RouterHandle::watching(&cp, "r2").await;
    router.wait_version(1).await;
    for i in 0..20 {
        let r = post(
            &router.url("/v1/completions"),
            &[],
            format!(r#"{{"model":"e","prompt":"{i}"}}"#),
        )
        .await;
        assert_eq!(
            (r.status, r.instance()),
            (200, good.url.as_str()),
            "{}",
            r.text()
        );
    }
}

#[tokio::test]
async fn a_json_body_cut_after_its_head_fails_the_clients_read() {
    let stub = breaking_server("application/json", "{\"id\":\"x\",\"choi", true);
    let url = stub.url.clone();
    let (_cp, router) = router_over(&url, 30_000).await;
    let body = r#"{"model":"e","messages":[{"role":"user","content":"hi"}]}"#;
    let req = post_request(&router.url("/v1/chat/completions"), &[], body);
    // Cut after the head: no JSON error can follow, so the client's read fails (before or
    // after it has the head), never a body that ends as if whole.
    let result = tokio::time::timeout(WAIT, async {
        use http_body_util::BodyExt as _;
        let resp = client().request(req).await.map_err(|e| e.to_string())?;
        resp.into_body()
            .collect()
            .await
            .map(|_| ())
            .map_err(|e| e.to_string())
    })
    .await
    .expect("an answer in time");
    assert!(result.is_err(), "a cut JSON body must not end cleanly");
}
