//! KV events in vLLM's wire format: what the prefix cache stores and evicts, published on a ZeroMQ
//! PUB socket with a ROUTER socket for replays, as vLLM's `ZmqEventPublisher` (v0.34) does.
//!
//! - Each cache step (a request's blocks inserted after its prefill) is one batch, msgpack
//!   `[ts, [event, ...], dp_rank]` with events as maps (vLLM's encoding since v0.24):
//!   `{"type": "BlockStored", "block_hashes", "parent_block_hash", "token_ids", "block_size",
//!   "lora_id", "medium": "GPU", "lora_name", "extra_keys", "group_idx": 0, "kv_cache_spec_kind":
//!   "full_attention"}` and `{"type": "BlockRemoved", "block_hashes", "medium": "GPU",
//!   "group_idx": 0}`; hashes as unsigned 64-bit integers.
//! - A message is `[topic, seq, payload]`, seq 8 bytes big-endian counting from 0.
//! - Replay: the ROUTER takes `[identity, "", start_seq]` and answers each buffered batch with
//!   seq >= start_seq as `[identity, "", topic, seq, payload]`, then `[identity, "", "", -1, ""]`.
//!
//! The engine never waits on this: batches go through a bounded channel to the publisher task,
//! and a batch that does not fit is dropped and counted (`engine_sim_kv_events_dropped_total`); its
//! seq is skipped, so subscribers see a gap that no replay fills.
//! Seqs are assigned by the task, so a subscriber cannot see the loss (as with vLLM's own queue
//! overflow); the counter can.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use tokio::sync::mpsc;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

/// Batches waiting for the publisher task; beyond this the engine drops them.
const QUEUE: usize = 1024;

/// One event, before encoding.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum CacheEvent {
    Stored {
        hashes: Vec<u64>,
        parent: Option<u64>,
        token_ids: Vec<u32>,
    },
    Removed {
        hashes: Vec<u64>,
    },
}

/// Publishing counters, for `/metrics`.
#[derive(Debug, Default)]
pub(crate) struct KvEventCounters {
    pub(crate) published_batches: AtomicU64,
    pub(crate) dropped_batches: AtomicU64,
    /// Dropped batches whose seq the publisher has not skipped yet.
    unsequenced_drops: AtomicU64,
}

/// The engine's end: hands batches to the publisher task without waiting.
#[derive(Debug)]
pub(crate) struct Outbox {
    tx: mpsc::Sender<Vec<CacheEvent>>,
    rx: Mutex<Option<mpsc::Receiver<Vec<CacheEvent>>>>,
    pub(crate) counters: Arc<KvEventCounters>,
}

impl Outbox {
    pub(crate) fn new() -> Self {
        let (tx, rx) = mpsc::channel(QUEUE);
        Outbox {
            tx,
            rx: Mutex::new(Some(rx)),
            counters: Arc::default(),
        }
    }

    /// Queues one batch; drops and counts it when the queue is full.
    pub(crate) fn send(&self, batch: Vec<CacheEvent>) {
        if batch.is_empty() {
            return;
        }
        if self.tx.try_send(batch).is_err() {
            self.counters.dropped_batches.fetch_add(1, Relaxed);
            self.counters.unsequenced_drops.fetch_add(1, Relaxed);
        }
    }

    fn take_receiver(&self) -> Option<mpsc::Receiver<Vec<CacheEvent>>> {
        self.rx.lock().unwrap_or_else(|e| e.into_inner()).take()
    }
}

/// Where and how to publish.
#[derive(Debug, Clone)]
pub(crate) struct PublisherConfig {
    pub(crate) endpoint: String,
    pub(crate) replay_endpoint: Option<String>,
    pub(crate) topic: String,
    pub(crate) buffer_steps: usize,
    pub(crate) block_size: u32,
}

/// Binds the sockets and starts the publisher task; the task ends when the engine (the outbox's
/// sender) is dropped or the handle is aborted. `None` if the outbox's receiver was taken already
/// (the engine is served twice: the first serve publishes).
pub(crate) async fn start(
    outbox: &Outbox,
    config: PublisherConfig,
) -> anyhow::Result<Option<tokio::task::JoinHandle<()>>> {
    let Some(rx) = outbox.take_receiver() else {
        return Ok(None);
    };
    let mut publisher = zeromq::PubSocket::new();
    publisher.bind(&config.endpoint).await.map_err(|e| {
        anyhow::anyhow!("--kv-events-endpoint {}: cannot bind: {e}", config.endpoint)
    })?;
    let replay = match &config.replay_endpoint {
        Some(endpoint) => {
            let mut router = zeromq::RouterSocket::new();
            router.bind(endpoint).await.map_err(|e| {
                anyhow::anyhow!("--kv-events-replay-endpoint {endpoint}: cannot bind: {e}")
            })?;
            Some(router)
        }
        None => None,
    };
    let counters = Arc::clone(&outbox.counters);
    Ok(Some(tokio::spawn(run(
        publisher, replay, rx, config, counters,
    ))))
}

async fn run(
    mut publisher: zeromq::PubSocket,
    mut replay: Option<zeromq::RouterSocket>,
    mut rx: mpsc::Receiver<Vec<CacheEvent>>,
    config: PublisherConfig,
    counters: Arc<KvEventCounters>,
) {
    let topic = Bytes::from(config.topic.clone().into_bytes());
    let mut buffer: VecDeque<(u64, Bytes)> = VecDeque::new();
    let mut seq: u64 = 0;
    loop {
        tokio::select! {
            batch = rx.recv() => {
                let Some(batch) = batch else { return };
                // a dropped batch keeps its seq, so subscribers see the gap (and, as the replay
                // buffer never held it, reset)
                seq += counters.unsequenced_drops.swap(0, Relaxed);
                let payload = Bytes::from(encode_batch(&batch, config.block_size, unix_now()));
                let frames = vec![
                    topic.clone(),
                    Bytes::copy_from_slice(&seq.to_be_bytes()),
                    payload.clone(),
                ];
                if let Ok(message) = ZmqMessage::try_from(frames) {
                    if let Err(e) = publisher.send(message).await {
                        tracing::debug!(error = %e, "KV events: publish failed");
                    }
                }
                counters.published_batches.fetch_add(1, Relaxed);
                buffer.push_back((seq, payload));
                if buffer.len() > config.buffer_steps {
                    buffer.pop_front();
                }
                seq += 1;
            }
            request = recv_replay(&mut replay) => {
                let (Some(router), Ok(request)) = (&mut replay, request) else { continue };
                serve_replay(router, request.into_vec(), &buffer, &topic).await;
            }
        }
    }
}

async fn recv_replay(
    replay: &mut Option<zeromq::RouterSocket>,
) -> Result<ZmqMessage, zeromq::ZmqError> {
    match replay {
        Some(router) => router.recv().await,
        None => std::future::pending().await,
    }
}

async fn serve_replay(
    router: &mut zeromq::RouterSocket,
    frames: Vec<Bytes>,
    buffer: &VecDeque<(u64, Bytes)>,
    topic: &Bytes,
) {
    let [client, _empty, start] = frames.as_slice() else {
        tracing::debug!(frames = frames.len(), "KV events: invalid replay request");
        return;
    };
    let Ok(start) = <[u8; 8]>::try_from(start.as_ref()).map(u64::from_be_bytes) else {
        tracing::debug!("KV events: replay request without an 8-byte start seq");
        return;
    };
    let replies = buffer
        .iter()
        .filter(|(seq, _)| *seq >= start)
        .map(|(seq, payload)| {
            vec![
                client.clone(),
                Bytes::new(),
                topic.clone(),
                Bytes::copy_from_slice(&seq.to_be_bytes()),
                payload.clone(),
            ]
        })
        .chain(std::iter::once(vec![
            client.clone(),
            Bytes::new(),
            Bytes::new(),
            Bytes::copy_from_slice(&u64::MAX.to_be_bytes()),
            Bytes::new(),
        ]));
    for frames in replies {
        let Ok(message) = ZmqMessage::try_from(frames) else {
            continue;
        };
        if let Err(e) = router.send(message).await {
            tracing::debug!(error = %e, "KV events: replay send failed");
            return;
        }
    }
}

fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// One batch as vLLM's msgspec encodes it (see the module docs).
pub(crate) fn encode_batch(events: &[CacheEvent], block_size: u32, ts: f64) -> Vec<u8> {
    use rmp::encode as w;
    // Writes to a Vec cannot fail.
    let mut out = Vec::with_capacity(64 + events.len() * 256);
    let _ = w::write_array_len(&mut out, 3);
    let _ = w::write_f64(&mut out, ts);
    let _ = w::write_array_len(&mut out, events.len() as u32);
    let str_ = |out: &mut Vec<u8>, s: &str| {
        let _ = w::write_str(out, s);
    };
    let hashes = |out: &mut Vec<u8>, hashes: &[u64]| {
        let _ = w::write_array_len(out, hashes.len() as u32);
        for &h in hashes {
            let _ = w::write_uint(out, h);
        }
    };
    for event in events {
        match event {
            CacheEvent::Stored {
                hashes: block_hashes,
                parent,
                token_ids,
            } => {
                let _ = w::write_map_len(&mut out, 11);
                str_(&mut out, "type");
                str_(&mut out, "BlockStored");
                str_(&mut out, "block_hashes");
                hashes(&mut out, block_hashes);
                str_(&mut out, "parent_block_hash");
                match parent {
                    Some(p) => {
                        let _ = w::write_uint(&mut out, *p);
                    }
                    None => {
                        let _ = w::write_nil(&mut out);
                    }
                }
                str_(&mut out, "token_ids");
                let _ = w::write_array_len(&mut out, token_ids.len() as u32);
                for &id in token_ids {
                    let _ = w::write_uint(&mut out, u64::from(id));
                }
                str_(&mut out, "block_size");
                let _ = w::write_uint(&mut out, u64::from(block_size));
                str_(&mut out, "lora_id");
                let _ = w::write_nil(&mut out);
                str_(&mut out, "medium");
                str_(&mut out, "GPU");
                str_(&mut out, "lora_name");
                let _ = w::write_nil(&mut out);
                str_(&mut out, "extra_keys");
                let _ = w::write_array_len(&mut out, block_hashes.len() as u32);
                for _ in block_hashes {
                    let _ = w::write_nil(&mut out);
                }
                str_(&mut out, "group_idx");
                let _ = w::write_uint(&mut out, 0);
                str_(&mut out, "kv_cache_spec_kind");
                str_(&mut out, "full_attention");
            }
            CacheEvent::Removed {
                hashes: block_hashes,
            } => {
                let _ = w::write_map_len(&mut out, 4);
                str_(&mut out, "type");
                str_(&mut out, "BlockRemoved");
                str_(&mut out, "block_hashes");
                hashes(&mut out, block_hashes);
                str_(&mut out, "medium");
                str_(&mut out, "GPU");
                str_(&mut out, "group_idx");
                let _ = w::write_uint(&mut out, 0);
            }
        }
    }
    let _ = w::write_uint(&mut out, 0);
    out
}
