//! Trace export pointed at a port where nothing listens never fails a request: spans queue in the
//! batch processor and are dropped or fail to export off the request path. Its own test binary:
//! the global subscriber and tracer provider are per process.

mod common;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_collector_never_fails_a_request() {
    let guard = telemetry::init(
        "prefix-router-test",
        telemetry::LogFormat::Json,
        Some(test_support::unused_url()),
    );
    assert!(guard.exporting());

    let fleet = common::Fleet::start().await;
    for i in 0..40 {
        let traceparent = format!(
            "00-{:032x}-{:016x}-01",
            0xabc0_0000u128 + i,
            0x1000 + i as u64
        );
        let headers: &[(&str, &str)] = if i % 2 == 0 {
            &[("traceparent", &traceparent)]
        } else {
            &[]
        };
        let answer = fleet.chat(&format!("question number {i}"), headers).await;
        assert_eq!(
            answer.status,
            200,
            "request {i}: {}",
            String::from_utf8_lossy(&answer.body)
        );
    }
    // The exporter's failures stay in its own thread; flushing and shutting down still return.
    tokio::task::spawn_blocking(move || {
        guard.force_flush();
        drop(guard);
    })
    .await
    .unwrap();
}
