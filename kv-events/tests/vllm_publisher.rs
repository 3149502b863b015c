//! The subscriber against vLLM's own publisher: `ZmqEventPublisher` from
//! `vllm/distributed/kv_events.py` (verbatim copies of v0.23.0 and v0.34.0 in tests/fixtures),
//! run by tests/fixtures/run_vllm_publisher.py on pyzmq (libzmq) and msgspec. It loses some
//! batches on its live socket on purpose; the subscriber must fill them from vLLM's replay ROUTER
//! and hand the sink the exact stream, whenever it happens to join.
//!
//! It needs python3 with `msgspec` and `pyzmq` (the test command installs them: see
//! scripts/install-test-deps.sh); without them it skips, and fails under `CI=true`.

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kv_events::{Event, Sink, Subscriber, SubscriberConfig};

#[derive(Default)]
struct RecordingSink(Mutex<Vec<Option<Event>>>);

impl RecordingSink {
    fn seen(&self) -> Vec<Option<Event>> {
        self.0.lock().expect("sink lock").clone()
    }
}

impl Sink for RecordingSink {
    fn apply(&self, _instance: &str, event: &Event) {
        self.0.lock().expect("sink lock").push(Some(event.clone()));
    }
    fn reset(&self, _instance: &str) {
        self.0.lock().expect("sink lock").push(None);
    }
}

fn stored(hash: u64, group_idx: Option<u32>) -> Option<Event> {
    Some(Event::Stored {
        hashes: vec![hash],
        parent: None,
        token_ids: vec![1, 2, 3, 4],
        block_size: 4,
        lora_name: None,
        medium: Some("GPU".into()),
        group_idx,
    })
}

async fn against_vllm(release: &str) {
    let test = &format!("vllm_publisher::{release}");
    let modules = test_support::python_modules(&["msgspec", "zmq"])
        .map_err(|e| format!("{e} (pip install msgspec pyzmq)"));
    if test_support::require_tool(test, modules).is_none() {
        return;
    }
    let fixtures = format!("{}/tests/fixtures", env!("CARGO_MANIFEST_DIR"));
    let (port, replay_port) = (
        test_support::child::unused_port(),
        test_support::child::unused_port(),
    );
    let mut python = Command::new("python3")
        .arg(format!("{fixtures}/run_vllm_publisher.py"))
        .arg(release)
        .arg(port.to_string())
        .arg(replay_port.to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("start python3");
    let mut stdout = BufReader::new(python.stdout.take().expect("stdout"));
    let mut line = String::new();
    stdout.read_line(&mut line).expect("read the publisher");
    assert_eq!(line.trim(), "ready", "the publisher's first line");

    let mut config = SubscriberConfig::new(format!("tcp://127.0.0.1:{port}"));
    config.replay_endpoint = Some(format!("tcp://127.0.0.1:{replay_port}"));
    config.topic = "kv".into();
    config.warm_start = true;
    let sink = Arc::new(RecordingSink::default());
    let subscriber = Subscriber::spawn("vllm", config, sink.clone()).expect("spawn");

    // One more batch per line until the sink has 6 + 5 events: the first batches it sees live
    // may be any, the warm start and the replays must fill in the rest.
    let mut stdin = python.stdin.take().expect("stdin");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while sink.seen().len() < 11 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out; the sink saw {:?}",
            sink.seen()
        );
        writeln!(stdin, "batch").expect("ask for a batch");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    drop(stdin);
    let seen = sink.seen();
    // v0.23.0 and v0.34.0 both send group_idx as nil (omitted) when unset.
    let mut expected = vec![
        stored(100, None),
        stored(101, None),
        stored(102, None),
        stored(103, None),
        Some(Event::Removed {
            hashes: vec![100],
            medium: Some("GPU".into()),
            group_idx: None,
        }),
        Some(Event::Cleared),
    ];
    expected.extend(
        (200..)
            .take(seen.len() - expected.len())
            .map(|h| stored(h, None)),
    );
    assert_eq!(seen, expected, "{release}");
    let c = subscriber.counters().snapshot();
    assert_eq!((c.resets, c.decode_errors), (0, 0), "{release}: {c:?}");
    assert!(c.replayed_batches >= 3, "{release}: {c:?}");
    subscriber.stop().await;
    let _ = python.wait();
}

#[tokio::test]
async fn vllm_v0_23_0_publisher() {
    against_vllm("v0_23_0").await;
}

#[tokio::test]
async fn vllm_v0_34_0_publisher() {
    against_vllm("v0_34_0").await;
}
