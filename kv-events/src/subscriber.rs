//! One background task per instance: subscribe to its KV events, keep the stream exact, hand the
//! events to a [`Sink`].
//!
//! The objective is an index that holds exactly the blocks the engine holds, or knows it does
//! not: every batch is applied once and in order, and whenever that cannot be guaranteed the sink
//! is told to [`Sink::reset`] the instance (forget everything it holds for it) and the stream
//! goes on from there. The task tracks the publisher's sequence numbers to decide:
//!
//! - the first message sets the sequence; with [`SubscriberConfig::warm_start`], the task first
//!   replays the publisher's whole buffer as soon as it connects (and, if that replay failed,
//!   from 0 up to the first live message), so a router that starts after the engine learns the
//!   blocks stored before it without waiting for the engine's next event;
//! - a gap (a seq past the next expected one) is filled from the publisher's replay socket
//!   (below); what the replay cannot cover (its buffer no longer holds the missing batches, there
//!   is no replay endpoint, or it does not answer within [`SubscriberConfig::replay_timeout`])
//!   resets;
//! - a seq that goes backwards means the engine restarted (its seq starts at 0 again): reset, and
//!   replay the new engine's batches missed before this one;
//! - a dropped connection resets too and forgets the sequence: the engine may have restarted, and
//!   a restarted engine's seq could catch up past the old one before the reconnect;
//! - with [`SubscriberConfig::silence`] set, nothing received for that long after the instance
//!   had published resets as well;
//! - stopping the subscriber (the instance left the table) resets last.
//!
//! A malformed message is counted and skipped, and the stream goes on. One whose seq could be
//! read counts as received (its batch is lost, not replayed: the publisher would send the same
//! bytes again); one without a readable seq is ignored.
//!
//! The replay protocol is vLLM's `ZmqEventPublisher._service_replay`: the publisher's ROUTER
//! socket takes `[identity, "", start_seq]` (start_seq 8 bytes big-endian; a DEALER here sends
//! `["", start_seq]`), answers with every buffered batch whose seq is at least start_seq as
//! `[identity, "", seq, payload]` (vLLM up to v0.25) or `[identity, "", topic, seq, payload]`
//! (from v0.26), then the end marker, seq -1 (8 bytes, all ones) with an empty payload. Each
//! replay uses a fresh DEALER socket, so a late answer to an abandoned replay cannot be mistaken
//! for a new one.
//!
//! Decoding runs here, off the request path; the sink is called from this task, so it must not
//! block for long (a lock held only to update an index is fine). Reconnects are ZeroMQ's: the
//! SUB socket connects whenever the publisher is up, before or after the subscriber starts.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use zeromq::{Socket, SocketEvent, SocketOptions, SocketRecv, SocketSend};

use crate::decode::{decode_batch, decode_seq, Batch, DecodeError, DecodeLimits, Event};
use crate::template::{self, TemplateError};

/// Where decoded events go: typically an index of the blocks each instance holds.
pub trait Sink: Send + Sync + 'static {
    /// Applies one event of `instance` (the key the subscriber was spawned with), in order.
    fn apply(&self, instance: &str, event: &Event);
    /// Forgets everything known about `instance`: the stream can no longer vouch for it.
    fn reset(&self, instance: &str);
}

/// Per-instance counters for metrics: plain atomics, read with [`Counters::snapshot`].
#[derive(Debug, Default)]
pub struct Counters {
    stored: AtomicU64,
    removed: AtomicU64,
    cleared: AtomicU64,
    unknown_events: AtomicU64,
    batches: AtomicU64,
    decode_errors: AtomicU64,
    gaps: AtomicU64,
    replays_served: AtomicU64,
    replayed_batches: AtomicU64,
    resets: AtomicU64,
}

/// The counters at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CountersSnapshot {
    /// `BlockStored` events applied.
    pub stored: u64,
    /// `BlockRemoved` events applied.
    pub removed: u64,
    /// `AllBlocksCleared` events applied.
    pub cleared: u64,
    /// Events of an unknown type skipped.
    pub unknown_events: u64,
    /// Batches applied (live and replayed).
    pub batches: u64,
    /// Messages that could not be decoded (live or replayed).
    pub decode_errors: u64,
    /// Gaps in the sequence seen on the live stream.
    pub gaps: u64,
    /// Replays that filled a gap completely.
    pub replays_served: u64,
    /// Batches applied from replays.
    pub replayed_batches: u64,
    /// Times the sink was told to reset the instance.
    pub resets: u64,
}

impl Counters {
    /// The current values (each read on its own: a snapshot taken while events flow may mix
    /// moments, as metrics do).
    pub fn snapshot(&self) -> CountersSnapshot {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        CountersSnapshot {
            stored: get(&self.stored),
            removed: get(&self.removed),
            cleared: get(&self.cleared),
            unknown_events: get(&self.unknown_events),
            batches: get(&self.batches),
            decode_errors: get(&self.decode_errors),
            gaps: get(&self.gaps),
            replays_served: get(&self.replays_served),
            replayed_batches: get(&self.replayed_batches),
            resets: get(&self.resets),
        }
    }
}

fn bump(counter: &AtomicU64, by: u64) {
    counter.fetch_add(by, Ordering::Relaxed);
}

/// How to subscribe to one instance.
#[derive(Debug, Clone, PartialEq)]
pub struct SubscriberConfig {
    /// The publisher's PUB endpoint, e.g. `tcp://10.0.0.5:5557`.
    pub endpoint: String,
    /// The publisher's replay (ROUTER) endpoint; without one every gap resets.
    pub replay_endpoint: Option<String>,
    /// The topic to subscribe to; empty subscribes to all.
    pub topic: String,
    /// Replay the publisher's buffer from seq 0 before the first message, so the index learns
    /// blocks stored before the subscriber started (as far as the buffer reaches back).
    pub warm_start: bool,
    /// Reset after this long without a message, once the instance had published. `None` (the
    /// default): never, because vLLM publishes only when its cache changes, so an idle engine is
    /// silent and still holds its blocks; a dead engine leaves the table (stop resets) and a
    /// restarted one shows itself by its seq and the dropped connection.
    pub silence: Option<Duration>,
    /// How long a replay may take, connect included, before the gap counts as not covered.
    pub replay_timeout: Duration,
    /// How long one attempt to connect to the publisher may take before it starts over.
    pub connect_timeout: Duration,
    /// Bounds on each message.
    pub limits: DecodeLimits,
}

impl SubscriberConfig {
    /// Defaults for `endpoint`: all topics, no replay, no warm start, no silence reset, replays
    /// time out after 2 s.
    pub fn new(endpoint: impl Into<String>) -> Self {
        SubscriberConfig {
            endpoint: endpoint.into(),
            replay_endpoint: None,
            topic: String::new(),
            warm_start: false,
            silence: None,
            replay_timeout: Duration::from_secs(2),
            connect_timeout: Duration::from_secs(2),
            limits: DecodeLimits::default(),
        }
    }

    /// The endpoints filled from templates (`tcp://{host}:5557`, see [`crate::template`]) for the
    /// instance at `instance_url`, other fields as in [`SubscriberConfig::new`].
    pub fn for_instance(
        instance_url: &str,
        endpoint_template: &str,
        replay_template: Option<&str>,
        topic: &str,
    ) -> Result<Self, TemplateError> {
        let mut config = SubscriberConfig::new(template::fill(endpoint_template, instance_url)?);
        config.replay_endpoint = replay_template
            .map(|t| template::fill(t, instance_url))
            .transpose()?;
        config.topic = topic.to_owned();
        Ok(config)
    }
}

/// Why a subscriber could not start.
#[derive(Debug, thiserror::Error)]
pub enum SpawnError {
    /// An endpoint is not a ZeroMQ endpoint.
    #[error("KV-events endpoint {endpoint:?} of instance {instance:?}: {reason}")]
    BadEndpoint {
        /// The instance.
        instance: String,
        /// The endpoint.
        endpoint: String,
        /// What is wrong with it.
        reason: String,
    },
    /// Not called from within a Tokio runtime.
    #[error("a KV-events subscriber must be spawned from within a Tokio runtime")]
    NoRuntime,
}

/// A running subscriber. Dropping it or calling [`Subscriber::stop`] ends its task, which resets
/// the instance in the sink on its way out.
#[derive(Debug)]
pub struct Subscriber {
    instance: Arc<str>,
    counters: Arc<Counters>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
}

impl Subscriber {
    /// Starts subscribing to `config.endpoint` for `instance` (the key handed to the sink).
    pub fn spawn(
        instance: impl Into<Arc<str>>,
        config: SubscriberConfig,
        sink: Arc<dyn Sink>,
    ) -> Result<Subscriber, SpawnError> {
        let instance = instance.into();
        for endpoint in std::iter::once(&config.endpoint).chain(&config.replay_endpoint) {
            if let Err(e) = endpoint.parse::<zeromq::Endpoint>() {
                return Err(SpawnError::BadEndpoint {
                    instance: instance.to_string(),
                    endpoint: endpoint.clone(),
                    reason: e.to_string(),
                });
            }
        }
        let runtime = tokio::runtime::Handle::try_current().map_err(|_| SpawnError::NoRuntime)?;
        let counters = Arc::new(Counters::default());
        let (stop, stopped) = oneshot::channel();
        let task = runtime.spawn(run(
            Arc::clone(&instance),
            config,
            sink,
            Arc::clone(&counters),
            stopped,
        ));
        Ok(Subscriber {
            instance,
            counters,
            stop: Some(stop),
            task: Some(task),
        })
    }

    /// The instance key.
    pub fn instance(&self) -> &str {
        &self.instance
    }

    /// This subscriber's counters.
    pub fn counters(&self) -> &Arc<Counters> {
        &self.counters
    }

    /// Ends the task and waits for it: once this returns, the sink has seen the last event and
    /// the final reset of this instance.
    pub async fn stop(mut self) {
        self.stop.take();
        if let Some(task) = self.task.take() {
            // A task that panicked (a panicking sink) has nothing left to do.
            let _ = task.await;
        }
    }
}

impl Drop for Subscriber {
    fn drop(&mut self) {
        // Dropping the sender is the signal; the task resets and ends by itself.
        self.stop.take();
    }
}

/// A pause after a failed connect attempt or receive, so a persistent failure does not spin.
const RETRY_PAUSE: Duration = Duration::from_millis(200);

async fn run(
    instance: Arc<str>,
    config: SubscriberConfig,
    sink: Arc<dyn Sink>,
    counters: Arc<Counters>,
    stopped: oneshot::Receiver<()>,
) {
    let mut stream = Stream {
        instance: &instance,
        config: &config,
        sink: &*sink,
        counters: &counters,
        expected: None,
        published: false,
        replayed_below: None,
    };
    tokio::select! {
        // Resolves on a send or on the sender's drop: either means stop.
        _ = stopped => {}
        () = stream.run() => {}
    }
    stream.reset("the subscriber stopped");
}

/// The sequence state of one instance's stream.
struct Stream<'a> {
    instance: &'a str,
    config: &'a SubscriberConfig,
    sink: &'a dyn Sink,
    counters: &'a Counters,
    /// The seq the next batch should have; `None` before the first.
    expected: Option<u64>,
    /// Whether a message arrived since the last reset (arms the silence reset).
    published: bool,
    /// After a warm start's replay: live messages below this seq were replayed already (the
    /// live stream delivers what was published during the replay too).
    replayed_below: Option<u64>,
}

/// Progress of one replay, kept outside the replay's future so that a timeout still sees it.
struct Fill {
    /// The next seq needed.
    next: u64,
    /// Whether the sink was reset during this fill.
    reset: bool,
}

impl Stream<'_> {
    async fn run(&mut self) {
        let mut options = SocketOptions::default();
        options.connect_timeout(self.config.connect_timeout);
        let mut sub = zeromq::SubSocket::with_options(options);
        let mut monitor = sub.monitor();
        if let Err(e) = sub.subscribe(&self.config.topic).await {
            tracing::warn!(instance = self.instance, error = %e, "KV events: subscribe failed");
        }
        // Connect retries inside until the publisher is up; a timed-out attempt starts over.
        while let Err(e) = sub.connect(&self.config.endpoint).await {
            tracing::debug!(instance = self.instance, endpoint = %self.config.endpoint, error = %e,
                "KV events: publisher not reachable yet");
            tokio::time::sleep(RETRY_PAUSE).await;
        }
        tracing::debug!(instance = self.instance, endpoint = %self.config.endpoint, "KV events: connected");
        if self.config.warm_start {
            self.warm().await;
        }
        let mut last_rx = Instant::now();
        loop {
            let silence_deadline = match self.config.silence {
                Some(silence) if self.published => Some(last_rx + silence),
                _ => None,
            };
            tokio::select! {
                received = sub.recv() => match received {
                    Ok(message) => {
                        last_rx = Instant::now();
                        self.on_live(message.into_vec()).await;
                    }
                    Err(e) => {
                        tracing::debug!(instance = self.instance, error = %e, "KV events: receive failed");
                        tokio::time::sleep(RETRY_PAUSE).await;
                    }
                },
                Some(event) = monitor.next() => {
                    if let SocketEvent::Disconnected(_) = event {
                        self.reset("the connection to the publisher dropped");
                        self.expected = None;
                    }
                }
                () = sleep_until_some(silence_deadline) => {
                    self.reset("the publisher fell silent");
                }
            }
        }
    }

    /// A warm start: replays the publisher's whole buffer at once, so the blocks an engine
    /// stored before this subscriber started are known before its next event (an idle engine
    /// publishes none). What the buffer no longer holds stays unknown; a replay that fails
    /// leaves it to the first live message (see [`Stream::on_live`]).
    async fn warm(&mut self) {
        let Some(endpoint) = self.config.replay_endpoint.clone() else {
            return;
        };
        // `reset: true`: a buffer that no longer reaches back to 0 is no reason to reset
        let mut fill = Fill {
            next: 0,
            reset: true,
        };
        let outcome = tokio::time::timeout(
            self.config.replay_timeout,
            self.replay(&endpoint, &mut fill, u64::MAX),
        )
        .await;
        if !matches!(outcome, Ok(Ok(()))) {
            tracing::debug!(
                instance = self.instance,
                "KV events: the warm start's replay did not complete"
            );
        }
        if self.expected.is_some() {
            self.published = true;
            self.replayed_below = self.expected;
        }
    }

    fn reset(&mut self, why: &str) {
        tracing::info!(
            instance = self.instance,
            why,
            "KV events: resetting the instance's blocks"
        );
        self.sink.reset(self.instance);
        bump(&self.counters.resets, 1);
        self.published = false;
    }

    fn apply(&self, batch: &Batch) {
        let (mut stored, mut removed, mut cleared) = (0, 0, 0);
        for event in &batch.events {
            self.sink.apply(self.instance, event);
            match event {
                Event::Stored { .. } => stored += 1,
                Event::Removed { .. } => removed += 1,
                Event::Cleared => cleared += 1,
            }
        }
        bump(&self.counters.stored, stored);
        bump(&self.counters.removed, removed);
        bump(&self.counters.cleared, cleared);
        bump(
            &self.counters.unknown_events,
            u64::from(batch.unknown_events),
        );
        bump(&self.counters.batches, 1);
    }

    fn decode_error(&self, what: &str, error: &DecodeError) {
        bump(&self.counters.decode_errors, 1);
        tracing::debug!(instance = self.instance, what, %error, "KV events: undecodable message");
    }

    /// Applies one decoded (or undecodable) batch whose seq is the next expected one.
    fn take(&mut self, seq: u64, batch: Result<Batch, DecodeError>, what: &str) {
        match batch {
            Ok(batch) => self.apply(&batch),
            Err(e) => self.decode_error(what, &e),
        }
        self.expected = seq.checked_add(1);
    }

    async fn on_live(&mut self, frames: Vec<Bytes>) {
        let [_topic, seq, payload] = frames.as_slice() else {
            return self.decode_error(
                "live message",
                &DecodeError::FrameCount { got: frames.len() },
            );
        };
        let seq = match decode_seq(seq) {
            Ok(seq) => seq,
            Err(e) => return self.decode_error("live message", &e),
        };
        if let Some(below) = self.replayed_below {
            if seq < below && self.expected == Some(below) {
                return; // replayed by the warm start already
            }
            self.replayed_below = None;
        }
        let batch = decode_batch(payload, &self.config.limits);
        match self.expected {
            None if self.config.warm_start && seq > 0 => {
                self.fill(
                    Fill {
                        next: 0,
                        reset: false,
                    },
                    seq,
                )
                .await;
            }
            None => {}
            Some(next) if seq == next => {}
            Some(next) if seq > next => {
                bump(&self.counters.gaps, 1);
                tracing::debug!(
                    instance = self.instance,
                    expected = next,
                    got = seq,
                    "KV events: gap"
                );
                self.fill(Fill { next, reset: false }, seq).await;
            }
            Some(next) => {
                tracing::debug!(
                    instance = self.instance,
                    expected = next,
                    got = seq,
                    "KV events: seq went backwards (engine restart)"
                );
                self.reset("the seq went backwards: the engine restarted");
                if seq > 0 {
                    bump(&self.counters.gaps, 1);
                    self.fill(
                        Fill {
                            next: 0,
                            reset: true,
                        },
                        seq,
                    )
                    .await;
                }
            }
        }
        self.published = true;
        self.take(seq, batch, "live message");
    }

    /// Fills the batches from `fill.next` up to (not including) `until` from the replay socket,
    /// resetting where it cannot.
    async fn fill(&mut self, mut fill: Fill, until: u64) {
        let Some(endpoint) = self.config.replay_endpoint.clone() else {
            if !fill.reset {
                self.reset("a gap, and no replay endpoint");
            }
            return;
        };
        let outcome = tokio::time::timeout(
            self.config.replay_timeout,
            self.replay(&endpoint, &mut fill, until),
        )
        .await;
        let why = match outcome {
            Ok(Ok(())) if fill.next >= until => None,
            Ok(Ok(())) => Some("the replay ended before the gap was filled"),
            Ok(Err(e)) => {
                tracing::debug!(instance = self.instance, error = %e, "KV events: replay failed");
                Some("the replay failed")
            }
            Err(_) => Some("the replay timed out"),
        };
        match why {
            None if !fill.reset => bump(&self.counters.replays_served, 1),
            None => {}
            Some(why) if !fill.reset => self.reset(why),
            Some(_) => {}
        }
        // Whatever was missed, the live message comes next.
        self.expected = Some(until);
    }

    async fn replay(
        &mut self,
        endpoint: &str,
        fill: &mut Fill,
        until: u64,
    ) -> Result<(), zeromq::ZmqError> {
        let mut options = SocketOptions::default();
        options.connect_timeout(self.config.replay_timeout);
        let mut dealer = zeromq::DealerSocket::with_options(options);
        dealer.connect(endpoint).await?;
        let request = vec![
            Bytes::new(),
            Bytes::copy_from_slice(&fill.next.to_be_bytes()),
        ];
        let request = zeromq::ZmqMessage::try_from(request)
            .map_err(|_| zeromq::ZmqError::Other("empty replay request"))?;
        dealer.send(request).await?;
        while fill.next < until {
            let frames = dealer.recv().await?.into_vec();
            let (seq, payload) = match frames.as_slice() {
                [empty, seq, payload] | [empty, _, seq, payload] if empty.is_empty() => {
                    (seq, payload)
                }
                _ => {
                    self.decode_error(
                        "replayed message",
                        &DecodeError::FrameCount { got: frames.len() },
                    );
                    return Ok(());
                }
            };
            let seq = match decode_seq(seq) {
                Ok(seq) => seq,
                Err(e) => {
                    self.decode_error("replayed message", &e);
                    return Ok(());
                }
            };
            if seq == END_OF_REPLAY {
                return Ok(());
            }
            if seq < fill.next {
                continue; // already applied
            }
            if seq >= until {
                return Ok(()); // the live stream carries these
            }
            if seq > fill.next && !fill.reset {
                // The buffer no longer reaches back far enough: what is missing is lost, but
                // the rest of the replay is still good after a reset.
                self.reset("the replay buffer does not reach back to the gap");
                fill.reset = true;
            }
            let batch = decode_batch(payload, &self.config.limits);
            if batch.is_ok() {
                bump(&self.counters.replayed_batches, 1);
            }
            self.take(seq, batch, "replayed message");
            fill.next = seq + 1;
        }
        Ok(())
    }
}

/// vLLM's end-of-replay marker: seq -1 as 8 big-endian bytes.
const END_OF_REPLAY: u64 = u64::MAX;

async fn sleep_until_some(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}
