//! The subscriber against real ZeroMQ sockets on loopback: a test publisher (XPUB, so the test
//! knows when the subscription has arrived) sends vLLM's own payloads (tests/fixtures) under seq
//! numbers the test chooses, and a test replay ROUTER answers the way vLLM's
//! `ZmqEventPublisher._service_replay` does. The framing is the test's; the payload bytes are
//! vLLM's.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use kv_events::{
    decode_batch, CountersSnapshot, DecodeLimits, Event, Sink, Subscriber, SubscriberConfig,
};
use test_support::wait::wait_for;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

const WAIT: Duration = Duration::from_secs(10);
const INSTANCE: &str = "instance-a";
const TOPIC: &str = "kv";

/// What the sink saw, in order.
#[derive(Debug, Clone, PartialEq)]
enum Seen {
    Apply(Event),
    Reset,
}

#[derive(Default)]
struct RecordingSink(Mutex<Vec<Seen>>);

impl RecordingSink {
    fn seen(&self) -> Vec<Seen> {
        self.0.lock().expect("sink lock").clone()
    }
}

impl Sink for RecordingSink {
    fn apply(&self, instance: &str, event: &Event) {
        assert_eq!(instance, INSTANCE);
        self.0
            .lock()
            .expect("sink lock")
            .push(Seen::Apply(event.clone()));
    }
    fn reset(&self, instance: &str) {
        assert_eq!(instance, INSTANCE);
        self.0.lock().expect("sink lock").push(Seen::Reset);
    }
}

fn payload(name: &str) -> Bytes {
    let path = format!("{}/tests/fixtures/{name}.bin", env!("CARGO_MANIFEST_DIR"));
    Bytes::from(std::fs::read(&path).unwrap_or_else(|e| panic!("read {path}: {e}")))
}

/// What the sink should see for a fixture: its events, applied.
fn applied(name: &str) -> Vec<Seen> {
    decode_batch(&payload(name), &DecodeLimits::default())
        .expect("fixture decodes")
        .events
        .into_iter()
        .map(Seen::Apply)
        .collect()
}

/// Three batches from vLLM v0.34.0 and their events: one Stored, one Removed, one Cleared.
const STORED: &str = "v0_34_0_stored_unsigned";
const REMOVED: &str = "v0_34_0_removed";
const CLEARED: &str = "v0_34_0_cleared";
const SIGNED: &str = "v0_23_0_stored_signed";
const BYTES: &str = "v0_23_0_stored_bytes";

fn message(frames: Vec<Bytes>) -> ZmqMessage {
    ZmqMessage::try_from(frames).expect("non-empty message")
}

/// A publisher the way vLLM's PUB socket frames messages: `[topic, seq, payload]`.
struct Publisher {
    socket: zeromq::XPubSocket,
    endpoint: String,
}

impl Publisher {
    async fn bind(endpoint: &str) -> Publisher {
        let mut socket = zeromq::XPubSocket::new();
        let bound = socket.bind(endpoint).await.expect("bind the publisher");
        Publisher {
            socket,
            endpoint: bound.to_string(),
        }
    }

    /// Waits until the subscriber's subscription has arrived, so nothing sent after is dropped.
    async fn subscribed(&mut self) {
        let subscription = tokio::time::timeout(WAIT, self.socket.recv())
            .await
            .expect("a subscription within the wait")
            .expect("a subscription message");
        let first = subscription.get(0).expect("a frame");
        assert_eq!(first.as_ref(), [&[1u8][..], TOPIC.as_bytes()].concat());
    }

    async fn send(&mut self, seq: u64, name: &str) {
        self.send_frames(vec![
            Bytes::from_static(TOPIC.as_bytes()),
            Bytes::copy_from_slice(&seq.to_be_bytes()),
            payload(name),
        ])
        .await;
    }

    async fn send_frames(&mut self, frames: Vec<Bytes>) {
        self.socket.send(message(frames)).await.expect("publish");
    }
}

/// The two reply layouts vLLM's replay ROUTER has used.
#[derive(Clone, Copy)]
enum ReplayFrames {
    /// `[identity, "", seq, payload]` (vLLM up to v0.25).
    SeqPayload,
    /// `[identity, "", topic, seq, payload]` (vLLM from v0.26).
    TopicSeqPayload,
}

/// A replay ROUTER serving `buffer` as `ZmqEventPublisher._service_replay` does: every buffered
/// batch whose seq is at least the requested start, then the end marker (seq -1, empty payload).
async fn replay_server(buffer: Vec<(u64, &'static str)>, layout: ReplayFrames) -> String {
    let mut router = zeromq::RouterSocket::new();
    let endpoint = router
        .bind("tcp://127.0.0.1:0")
        .await
        .expect("bind the replay socket")
        .to_string();
    tokio::spawn(async move {
        while let Ok(request) = router.recv().await {
            let frames = request.into_vec();
            let [client, _empty, start] = frames.as_slice() else {
                panic!("a replay request has 3 frames at the ROUTER, got {frames:?}");
            };
            let start = u64::from_be_bytes(start.as_ref().try_into().expect("8-byte start"));
            let reply = |seq: Bytes, body: Bytes, topic: Bytes| match layout {
                ReplayFrames::SeqPayload => vec![client.clone(), Bytes::new(), seq, body],
                ReplayFrames::TopicSeqPayload => {
                    vec![client.clone(), Bytes::new(), topic, seq, body]
                }
            };
            for &(seq, name) in &buffer {
                if seq >= start {
                    let frames = reply(
                        Bytes::copy_from_slice(&seq.to_be_bytes()),
                        payload(name),
                        Bytes::from_static(TOPIC.as_bytes()),
                    );
                    router.send(message(frames)).await.expect("replay a batch");
                }
            }
            let end = reply(
                Bytes::copy_from_slice(&(-1i64).to_be_bytes()),
                Bytes::new(),
                Bytes::new(),
            );
            router.send(message(end)).await.expect("end the replay");
        }
    });
    endpoint
}

struct Harness {
    publisher: Publisher,
    sink: Arc<RecordingSink>,
    subscriber: Subscriber,
}

impl Harness {
    /// A subscriber connected and subscribed to a fresh publisher.
    async fn start(configure: impl FnOnce(&mut SubscriberConfig)) -> Harness {
        let publisher = Publisher::bind("tcp://127.0.0.1:0").await;
        let mut config = SubscriberConfig::new(publisher.endpoint.clone());
        config.topic = TOPIC.to_owned();
        configure(&mut config);
        Harness::subscribe(publisher, config).await
    }

    async fn subscribe(mut publisher: Publisher, config: SubscriberConfig) -> Harness {
        let sink = Arc::new(RecordingSink::default());
        let subscriber = Subscriber::spawn(INSTANCE, config, sink.clone()).expect("spawn");
        publisher.subscribed().await;
        Harness {
            publisher,
            sink,
            subscriber,
        }
    }

    /// Waits until the sink has seen `n` things, then returns them.
    async fn seen(&self, n: usize) -> Vec<Seen> {
        let sink = &self.sink;
        let what =
            test_support::wait::at_timeout(|| format!("{n} sink calls; saw {:?}", sink.seen()));
        wait_for(&what, WAIT, || async { sink.seen().len() >= n }).await;
        sink.seen()
    }

    fn counters(&self) -> CountersSnapshot {
        self.subscriber.counters().snapshot()
    }
}

fn concat(parts: &[Vec<Seen>]) -> Vec<Seen> {
    parts.concat()
}

#[tokio::test]
async fn in_order_batches_reach_the_sink_even_when_the_publisher_binds_later() {
    let port = test_support::child::unused_port();
    let endpoint = format!("tcp://127.0.0.1:{port}");
    let sink = Arc::new(RecordingSink::default());
    let mut config = SubscriberConfig::new(endpoint.clone());
    config.topic = TOPIC.to_owned();
    let subscriber = Subscriber::spawn(INSTANCE, config, sink.clone()).expect("spawn");
    // The subscriber is trying to connect; the publisher comes up only now.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut publisher = Publisher::bind(&endpoint).await;
    publisher.subscribed().await;
    let mut h = Harness {
        publisher,
        sink,
        subscriber,
    };
    h.publisher.send(0, STORED).await;
    h.publisher.send(1, REMOVED).await;
    h.publisher.send(2, CLEARED).await;
    let expected = concat(&[applied(STORED), applied(REMOVED), applied(CLEARED)]);
    assert_eq!(h.seen(expected.len()).await, expected);
    assert!(expected.contains(&Seen::Apply(Event::Cleared)));
    let c = h.counters();
    assert_eq!(
        (c.stored, c.removed, c.cleared, c.batches, c.resets, c.gaps),
        (1, 1, 1, 3, 0, 0)
    );
}

async fn gap_filled_by_replay(layout: ReplayFrames) {
    let replay = replay_server(
        vec![(0, STORED), (1, SIGNED), (2, BYTES), (3, REMOVED)],
        layout,
    )
    .await;
    let mut h = Harness::start(|c| c.replay_endpoint = Some(replay)).await;
    h.publisher.send(0, STORED).await;
    // 1 and 2 are lost on the way; 3 arrives.
    h.publisher.send(3, REMOVED).await;
    let expected = concat(&[
        applied(STORED),
        applied(SIGNED),
        applied(BYTES),
        applied(REMOVED),
    ]);
    assert_eq!(h.seen(expected.len()).await, expected);
    let c = h.counters();
    assert_eq!(
        (
            c.gaps,
            c.replays_served,
            c.replayed_batches,
            c.resets,
            c.batches
        ),
        (1, 1, 2, 0, 4)
    );
}

#[tokio::test]
async fn a_gap_is_filled_from_the_replay_socket_old_reply_layout() {
    gap_filled_by_replay(ReplayFrames::SeqPayload).await;
}

#[tokio::test]
async fn a_gap_is_filled_from_the_replay_socket_new_reply_layout() {
    gap_filled_by_replay(ReplayFrames::TopicSeqPayload).await;
}

#[tokio::test]
async fn a_gap_the_replay_buffer_no_longer_covers_resets_then_goes_on() {
    // The buffer has rolled past seq 1: it starts at 2.
    let replay = replay_server(
        vec![(2, BYTES), (3, REMOVED)],
        ReplayFrames::TopicSeqPayload,
    )
    .await;
    let mut h = Harness::start(|c| c.replay_endpoint = Some(replay)).await;
    h.publisher.send(0, STORED).await;
    h.publisher.send(3, REMOVED).await;
    let expected = concat(&[
        applied(STORED),
        vec![Seen::Reset],
        applied(BYTES),
        applied(REMOVED),
    ]);
    assert_eq!(h.seen(expected.len()).await, expected);
    let c = h.counters();
    assert_eq!((c.gaps, c.replays_served, c.resets), (1, 0, 1));
}

#[tokio::test]
async fn a_gap_without_replay_endpoint_or_answer_resets() {
    // No replay endpoint.
    let mut h = Harness::start(|_| {}).await;
    h.publisher.send(0, STORED).await;
    h.publisher.send(2, REMOVED).await;
    let expected = concat(&[applied(STORED), vec![Seen::Reset], applied(REMOVED)]);
    assert_eq!(h.seen(expected.len()).await, expected);
    assert_eq!((h.counters().gaps, h.counters().resets), (1, 1));

    // A replay endpoint nobody answers on: the replay times out.
    let silent = format!("tcp://127.0.0.1:{}", test_support::child::unused_port());
    let mut h = Harness::start(|c| {
        c.replay_endpoint = Some(silent);
        c.replay_timeout = Duration::from_millis(300);
    })
    .await;
    h.publisher.send(0, STORED).await;
    h.publisher.send(2, REMOVED).await;
    assert_eq!(h.seen(expected.len()).await, expected);
    assert_eq!((h.counters().gaps, h.counters().resets), (1, 1));
}

#[tokio::test]
async fn warm_start_replays_the_buffer_on_connect_before_any_live_message() {
    let replay = replay_server(
        vec![(0, STORED), (1, SIGNED), (2, REMOVED)],
        ReplayFrames::TopicSeqPayload,
    )
    .await;
    let mut h = Harness::start(|c| {
        c.replay_endpoint = Some(replay);
        c.warm_start = true;
    })
    .await;
    // an idle engine publishes nothing: the buffer alone tells what it stored
    let replayed = concat(&[applied(STORED), applied(SIGNED), applied(REMOVED)]);
    assert_eq!(h.seen(replayed.len()).await, replayed);
    // seq 2 was published while the replay ran: not applied twice; seq 3 follows
    h.publisher.send(2, REMOVED).await;
    h.publisher.send(3, STORED).await;
    let expected = concat(&[replayed, applied(STORED)]);
    assert_eq!(h.seen(expected.len()).await, expected);
    let c = h.counters();
    assert_eq!(
        (c.gaps, c.replayed_batches, c.batches, c.resets),
        (0, 3, 4, 0)
    );
}

#[tokio::test]
async fn malformed_messages_are_counted_and_the_stream_goes_on() {
    let mut h = Harness::start(|_| {}).await;
    h.publisher.send(0, STORED).await;
    // Two frames.
    h.publisher
        .send_frames(vec![Bytes::from_static(TOPIC.as_bytes()), payload(REMOVED)])
        .await;
    // A seq of 3 bytes.
    h.publisher
        .send_frames(vec![
            Bytes::from_static(TOPIC.as_bytes()),
            Bytes::from_static(&[0, 0, 1]),
            payload(REMOVED),
        ])
        .await;
    // Seq 1 with a garbage payload: counted, and seq 1 is taken.
    h.publisher
        .send_frames(vec![
            Bytes::from_static(TOPIC.as_bytes()),
            Bytes::copy_from_slice(&1u64.to_be_bytes()),
            Bytes::from_static(b"\xc1 not msgpack"),
        ])
        .await;
    // A vLLM payload cut short.
    let cut = payload(REMOVED).slice(..10);
    h.publisher
        .send_frames(vec![
            Bytes::from_static(TOPIC.as_bytes()),
            Bytes::copy_from_slice(&2u64.to_be_bytes()),
            cut,
        ])
        .await;
    h.publisher.send(3, CLEARED).await;
    let expected = concat(&[applied(STORED), applied(CLEARED)]);
    assert_eq!(h.seen(expected.len()).await, expected);
    let c = h.counters();
    assert_eq!((c.decode_errors, c.resets, c.gaps, c.batches), (4, 0, 0, 2));
}

#[tokio::test]
async fn a_seq_that_goes_backwards_resets() {
    let mut h = Harness::start(|_| {}).await;
    h.publisher.send(5, STORED).await;
    h.publisher.send(6, REMOVED).await;
    // The engine restarted: its seq starts at 0 again.
    h.publisher.send(0, CLEARED).await;
    let expected = concat(&[
        applied(STORED),
        applied(REMOVED),
        vec![Seen::Reset],
        applied(CLEARED),
    ]);
    assert_eq!(h.seen(expected.len()).await, expected);
    assert_eq!(h.counters().resets, 1);
}

#[tokio::test]
async fn stop_and_drop_reset_the_instance() {
    let mut h = Harness::start(|_| {}).await;
    h.publisher.send(0, STORED).await;
    h.seen(1).await;
    let counters = Arc::clone(h.subscriber.counters());
    h.subscriber.stop().await;
    assert_eq!(h.sink.seen(), concat(&[applied(STORED), vec![Seen::Reset]]));
    assert_eq!(counters.snapshot().resets, 1);

    let h = Harness::start(|_| {}).await;
    let sink = Arc::clone(&h.sink);
    drop(h.subscriber);
    wait_for("the reset after a drop", WAIT, || async {
        sink.seen() == vec![Seen::Reset]
    })
    .await;
}

#[tokio::test]
async fn silence_after_publishing_resets() {
    let mut h = Harness::start(|c| c.silence = Some(Duration::from_millis(200))).await;
    h.publisher.send(0, STORED).await;
    let expected = concat(&[applied(STORED), vec![Seen::Reset]]);
    assert_eq!(h.seen(expected.len()).await, expected);
    // Reset once: silence arms again only when the instance publishes again.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(h.counters().resets, 1);
}

#[tokio::test]
async fn a_dropped_connection_resets_and_forgets_the_seq() {
    let mut h = Harness::start(|_| {}).await;
    h.publisher.send(7, STORED).await;
    h.seen(1).await;
    let endpoint = h.publisher.endpoint.clone();
    drop(h.publisher);
    let sink = Arc::clone(&h.sink);
    wait_for("the reset after the disconnect", WAIT, || async {
        sink.seen().last() == Some(&Seen::Reset)
    })
    .await;
    // The engine comes back on the same port; its seq starts over and is taken as is.
    h.publisher = Publisher::bind(&endpoint).await;
    h.publisher.subscribed().await;
    h.publisher.send(0, CLEARED).await;
    let expected = concat(&[applied(STORED), vec![Seen::Reset], applied(CLEARED)]);
    assert_eq!(h.seen(expected.len()).await, expected);
    assert_eq!(h.counters().resets, 1);
}
