//! `RoutingDiscovery.WatchRoutingTable`: xDS-style streaming of versioned routing tables.
//!
//! Per stream: the router's first message names it and the version it holds; if that is not the
//! current version the full table goes out at once, then every new version (intermediate
//! versions are skipped when a router is slow: each table is complete). Each response carries a
//! nonce; the router ACKs or NACKs it, and [`NodeRegistry`] records per node the applied version,
//! the last NACK and when it was last heard from. A message that answers no push (an empty nonce)
//! may carry the router's status (its queue depths, the cache bounds it learnt), kept while its
//! stream is open. Tables are encoded once per version ([`crate::store::PublishedTable`]) and the
//! same buffer goes to every watcher.
//!
//! Shared evidence: routers that each see part of the traffic learn how many of a variant's
//! reused prefixes an instance's cache holds each from its own revisits, and until all have,
//! they place differently, and with small caches every difference is an eviction (4 routers
//! before 4 llama-servers took 20-40 s where one router took 10-20). So each watcher gets the
//! least bound per variant that the other connected routers report
//! ([`NodeRegistry::fleet_bounds_for`]; its own would only echo back, and a bound it forgot
//! would come back as the fleet's) whenever that changes, in a response with no nonce and no
//! table, which routers do not answer. It is this replica's routers' evidence only (not shared
//! through etcd). The bound comes only once one router has enough revisits of its own to judge
//! a cache, and each of 4 routers sees a quarter of them: each watcher is also sent, at most once
//! per [`EVIDENCE_EVERY`], per instance the sum of the other connected routers' revisits of
//! reused prefixes and their misses ([`NodeRegistry::fleet_evidence_for`]), which each router
//! adds to its own, so that every router judges each cache on the whole fleet's revisits. A
//! router's totals count from when its stream opened (what it reported then is a base): one that
//! reconnects, to a restarted control plane or another replica, would otherwise bring its whole
//! history into the others' samples as if it had just happened.
//!
//! Each router also reports the reused prefixes its last placement pass found in its own traffic,
//! and each watcher is sent, with the evidence, per variant the union of the other connected
//! routers' ([`NodeRegistry::fleet_reused_for`]): a router's pass counts them with its own, and the
//! homes it assigns depend on that set, so routers whose samples put the bar between reused and
//! not at different prefixes would otherwise assign different homes.
//!
//! Each push is a `push_routing_table` span (node, version, nonce, bytes) that lasts until the
//! node answers it, recording `result` = `ack` | `nack` (with the error) | `superseded`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use proto::routing_discovery_server::RoutingDiscovery;
use proto::{WatchRoutingTableRequest, WatchRoutingTableResponse};

use crate::store::{now_unix_ms, PublishedTable, Store};

/// How often a watcher is sent the other routers' evidence, when it changed.
const EVIDENCE_EVERY: Duration = Duration::from_secs(1);
/// How long a new stream may take to send its first message.
const FIRST_MESSAGE_TIMEOUT: Duration = Duration::from_secs(30);

/// What the control plane knows of one data-plane node.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct NodeStatus {
    /// Last version the node ACKed (or reported holding when it connected).
    pub applied_version: u64,
    /// Open watch streams from this node.
    pub streams: u32,
    pub last_seen_unix_ms: i64,
    /// Error detail of the last NACK, cleared by the next ACK.
    pub last_nack: String,
    /// Requests waiting in the node per endpoint, as it last reported (cleared when its last
    /// stream closes: a router that is gone holds no queue this control plane can vouch for).
    pub queues: Vec<proto::EndpointQueue>,
    /// The cache bounds the node learnt, as it last reported (cleared with the queues).
    pub cache_bounds: Vec<proto::CacheBound>,
    /// Its own revisits and misses per instance, as it last reported (cleared with the queues).
    pub cache_evidence: Vec<proto::CacheEvidence>,
    /// What it reported when its stream opened: history that the other routers did not see
    /// grow (a router that reconnects, to this control plane restarted or to another replica,
    /// brings its totals since it started), left out of the fleet's sums.
    pub evidence_base: Vec<proto::CacheEvidence>,
    /// The reused prefixes its last placement pass found per variant, as it last reported
    /// (cleared with the queues).
    pub reused_keys: Vec<proto::ReusedKeys>,
}

/// Per-node rollout state, in memory: after a control-plane restart routers reconnect and
/// report their versions again.
#[derive(Debug)]
pub struct NodeRegistry {
    nodes: Mutex<HashMap<String, NodeStatus>>,
    /// Bumped whenever a node's reported cache bounds change (or go with its last stream).
    bounds_changed: watch::Sender<u64>,
}

impl Default for NodeRegistry {
    fn default() -> Self {
        NodeRegistry {
            nodes: Mutex::default(),
            bounds_changed: watch::channel(0).0,
        }
    }
}

impl NodeRegistry {
    fn update(&self, node_id: &str, f: impl FnOnce(&mut NodeStatus)) {
        let mut nodes = self.nodes.lock().unwrap_or_else(|p| p.into_inner());
        let status = nodes.entry(node_id.to_string()).or_default();
        status.last_seen_unix_ms = now_unix_ms();
        let (bounds, streams) = (status.cache_bounds.len(), status.streams);
        let before = (bounds > 0).then(|| status.cache_bounds.clone());
        f(status);
        let changed = match before {
            Some(b) => b != status.cache_bounds || (streams > 0) != (status.streams > 0),
            None => !status.cache_bounds.is_empty(),
        };
        drop(nodes);
        if changed {
            self.bounds_changed.send_modify(|n| *n += 1);
        }
    }

    /// Per endpoint and variant, the least cache bound that a connected node other than
    /// `node_id` reports, sorted by endpoint and variant (see the module doc).
    pub fn fleet_bounds_for(&self, node_id: &str) -> Vec<proto::CacheBound> {
        let nodes = self.nodes.lock().unwrap_or_else(|p| p.into_inner());
        let others = nodes
            .iter()
            .filter(|(id, _)| id.as_str() != node_id)
            .map(|(_, s)| s);
        fleet_bounds(others)
    }

    /// Per endpoint, variant and instance, the sum of the revisits and misses that the connected
    /// nodes other than `node_id` report, sorted by those three (see the module doc).
    pub fn fleet_evidence_for(&self, node_id: &str) -> Vec<proto::CacheEvidence> {
        let nodes = self.nodes.lock().unwrap_or_else(|p| p.into_inner());
        fn at(x: &proto::CacheEvidence) -> (&str, &str, &str) {
            (&x.endpoint_name, &x.variant_name, &x.instance_id)
        }
        let mut sum: std::collections::BTreeMap<(&str, &str, &str), (u64, u64)> =
            Default::default();
        for (_, s) in nodes
            .iter()
            .filter(|(id, s)| id.as_str() != node_id && s.streams > 0)
        {
            for (k, x) in s.cache_evidence.iter().enumerate() {
                // a router reports in its table's order: the base's entry is at the same place
                // unless instances came or went
                let base = (s.evidence_base.get(k))
                    .filter(|b| at(b) == at(x))
                    .or_else(|| s.evidence_base.iter().find(|b| at(b) == at(x)));
                let (r0, m0) = base.map_or((0, 0), |b| (b.revisits, b.misses));
                let (revisits, misses) = sum.entry(at(x)).or_default();
                *revisits = revisits.saturating_add(x.revisits.saturating_sub(r0));
                *misses = misses.saturating_add(x.misses.saturating_sub(m0));
            }
        }
        sum.into_iter()
            .map(
                |((endpoint, variant, instance), (revisits, misses))| proto::CacheEvidence {
                    endpoint_name: endpoint.to_string(),
                    variant_name: variant.to_string(),
                    instance_id: instance.to_string(),
                    revisits,
                    misses,
                },
            )
            .collect()
    }

    /// Per endpoint and variant, the union of the reused keys that the connected nodes other
    /// than `node_id` report, sorted by endpoint and variant, each set sorted (see the module
    /// doc).
    pub fn fleet_reused_for(&self, node_id: &str) -> Vec<proto::ReusedKeys> {
        let nodes = self.nodes.lock().unwrap_or_else(|p| p.into_inner());
        let mut union: std::collections::BTreeMap<(&str, &str), Vec<u64>> = Default::default();
        for (_, s) in nodes
            .iter()
            .filter(|(id, s)| id.as_str() != node_id && s.streams > 0)
        {
            for r in &s.reused_keys {
                let keys = union
                    .entry((r.endpoint_name.as_str(), r.variant_name.as_str()))
                    .or_default();
                keys.extend_from_slice(&r.keys);
            }
        }
        union
            .into_iter()
            .map(|((endpoint, variant), mut keys)| {
                keys.sort_unstable();
                keys.dedup();
                proto::ReusedKeys {
                    endpoint_name: endpoint.to_string(),
                    variant_name: variant.to_string(),
                    keys,
                }
            })
            .collect()
    }

    fn subscribe_bounds(&self) -> watch::Receiver<u64> {
        self.bounds_changed.subscribe()
    }

    /// Every node seen since start, sorted by id.
    pub fn snapshot(&self) -> Vec<(String, NodeStatus)> {
        let nodes = self.nodes.lock().unwrap_or_else(|p| p.into_inner());
        let mut all: Vec<_> = nodes.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        all.sort_by(|a, b| a.0.cmp(&b.0));
        all
    }

    /// Every node as a `DataPlaneStatus` (`up_to_date` left for the caller, who knows the
    /// endpoint's version).
    pub fn statuses(&self) -> Vec<proto::DataPlaneStatus> {
        self.snapshot()
            .into_iter()
            .map(|(node_id, s)| proto::DataPlaneStatus {
                node_id,
                applied_version: s.applied_version,
                up_to_date: false,
                connected: s.streams > 0,
                last_seen_unix_ms: s.last_seen_unix_ms,
                last_nack: s.last_nack,
                queues: s.queues,
                cache_bounds: s.cache_bounds,
            })
            .collect()
    }

    /// Number of open watch streams.
    pub fn connected_streams(&self) -> u32 {
        let nodes = self.nodes.lock().unwrap_or_else(|p| p.into_inner());
        nodes.values().map(|s| s.streams).sum()
    }
}

/// The least bound per endpoint and variant over the nodes with an open stream.
fn fleet_bounds<'a>(nodes: impl Iterator<Item = &'a NodeStatus>) -> Vec<proto::CacheBound> {
    let mut least: std::collections::BTreeMap<(&str, &str), u32> = Default::default();
    for b in nodes
        .filter(|s| s.streams > 0)
        .flat_map(|s| &s.cache_bounds)
    {
        if b.keys == 0 {
            continue;
        }
        least
            .entry((b.endpoint_name.as_str(), b.variant_name.as_str()))
            .and_modify(|k| *k = (*k).min(b.keys))
            .or_insert(b.keys);
    }
    least
        .into_iter()
        .map(|((endpoint, variant), keys)| proto::CacheBound {
            endpoint_name: endpoint.to_string(),
            variant_name: variant.to_string(),
            keys,
        })
        .collect()
}

/// Decrements the node's stream count when a stream ends, however it ends.
struct StreamGuard {
    nodes: Arc<NodeRegistry>,
    node_id: String,
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        self.nodes.update(&self.node_id, |s| {
            s.streams = s.streams.saturating_sub(1);
            if s.streams == 0 {
                s.queues.clear();
                s.cache_bounds.clear();
                s.cache_evidence.clear();
                s.evidence_base.clear();
                s.reused_keys.clear();
            }
        });
    }
}

pub struct Discovery {
    store: Arc<Store>,
    nodes: Arc<NodeRegistry>,
    shutdown: watch::Receiver<bool>,
    /// One permit per open watch stream (`--max-watch-streams`).
    streams: Arc<tokio::sync::Semaphore>,
}

impl Discovery {
    /// `shutdown` flips to true when the server stops: open streams then end, so graceful
    /// shutdown does not wait on them forever.
    pub fn new(
        store: Arc<Store>,
        nodes: Arc<NodeRegistry>,
        shutdown: watch::Receiver<bool>,
    ) -> Self {
        Self {
            store,
            nodes,
            shutdown,
            streams: Arc::new(tokio::sync::Semaphore::new(4096)),
        }
    }

    /// At most `n` watch streams at once; more are refused with `RESOURCE_EXHAUSTED`.
    pub fn with_max_streams(mut self, n: usize) -> Self {
        self.streams = Arc::new(tokio::sync::Semaphore::new(n));
        self
    }
}

type ResponseTx = mpsc::Sender<Result<WatchRoutingTableResponse, Status>>;

#[tonic::async_trait]
impl RoutingDiscovery for Discovery {
    type WatchRoutingTableStream = ReceiverStream<Result<WatchRoutingTableResponse, Status>>;

    async fn watch_routing_table(
        &self,
        request: Request<Streaming<WatchRoutingTableRequest>>,
    ) -> Result<Response<Self::WatchRoutingTableStream>, Status> {
        let permit = self.streams.clone().try_acquire_owned().map_err(|_| {
            Status::resource_exhausted(
                "too many routing-table watch streams are open on this control plane (--max-watch-streams); retry later or on another replica",
            )
        })?;
        let inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(4);
        let session = Session {
            _permit: permit,
            tables: self.store.subscribe(),
            bounds: self.nodes.subscribe_bounds(),
            nodes: self.nodes.clone(),
            shutdown: self.shutdown.clone(),
            tx,
            nonce: 0,
            pending: None,
        };
        tokio::spawn(session.run(inbound));
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

struct Session {
    /// Held for the stream's life.
    _permit: tokio::sync::OwnedSemaphorePermit,
    tables: watch::Receiver<Arc<PublishedTable>>,
    bounds: watch::Receiver<u64>,
    nodes: Arc<NodeRegistry>,
    shutdown: watch::Receiver<bool>,
    tx: ResponseTx,
    nonce: u64,
    /// The last response sent, awaiting ACK/NACK.
    pending: Option<Pending>,
}

/// A pushed table awaiting its answer.
struct Pending {
    nonce: String,
    version: u64,
    /// `push_routing_table`, ended by the answer (or by the next push).
    span: tracing::Span,
}

impl Session {
    async fn run(mut self, mut inbound: Streaming<WatchRoutingTableRequest>) {
        let first = match tokio::time::timeout(FIRST_MESSAGE_TIMEOUT, inbound.message()).await {
            Ok(Ok(Some(m))) => m,
            Ok(Ok(None)) | Ok(Err(_)) => return,
            Err(_) => {
                let _ = self
                    .tx
                    .send(Err(Status::deadline_exceeded(
                        "no first WatchRoutingTableRequest within 30 s",
                    )))
                    .await;
                return;
            }
        };
        if first.node_id.is_empty() {
            let _ = self
                .tx
                .send(Err(Status::invalid_argument(
                    "invalid node_id: must not be empty",
                )))
                .await;
            return;
        }
        let node_id = first.node_id;
        self.nodes.update(&node_id, |s| {
            s.streams += 1;
            if first.applied_version > 0 {
                s.applied_version = first.applied_version;
            }
            if let Some(status) = first.status {
                s.queues = status.queues;
                s.cache_bounds = status.cache_bounds;
                if s.streams == 1 {
                    s.evidence_base = status.cache_evidence.clone();
                }
                s.cache_evidence = status.cache_evidence;
                s.reused_keys = status.reused_keys;
            }
        });
        let _guard = StreamGuard {
            nodes: self.nodes.clone(),
            node_id: node_id.clone(),
        };
        tracing::debug!(
            node_id,
            applied_version = first.applied_version,
            "watcher connected"
        );

        let mut held = first.applied_version;
        // the fleet's bounds and evidence this router was last sent (none yet: nothing to send)
        let mut sent: Vec<proto::CacheBound> = Vec::new();
        let mut sent_evidence: Vec<proto::CacheEvidence> = Vec::new();
        let mut sent_reused: Vec<proto::ReusedKeys> = Vec::new();
        // the evidence grows with every request: it goes at most once per tick
        let mut tick = tokio::time::interval(EVIDENCE_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut evidence_due = false;
        loop {
            let current = self.tables.borrow_and_update().clone();
            if current.version != held {
                if !self.send(&node_id, &current).await {
                    return;
                }
                held = current.version;
                // a new table may hold new variants: the fleet's bounds and evidence follow it
                // again (the evidence as it stands: a router takes an instance missing from it
                // as one with none)
                sent.clear();
                sent_evidence.clear();
                sent_reused.clear();
                evidence_due = true;
            }
            self.bounds.borrow_and_update();
            let fleet = self.nodes.fleet_bounds_for(&node_id);
            let due = std::mem::take(&mut evidence_due);
            let evidence = due
                .then(|| self.nodes.fleet_evidence_for(&node_id))
                .filter(|e| *e != sent_evidence);
            let reused = due
                .then(|| self.nodes.fleet_reused_for(&node_id))
                .filter(|r| *r != sent_reused);
            // every such message carries the evidence and the reused keys too (the last sent,
            // if none is due)
            if fleet != sent || evidence.is_some() || reused.is_some() {
                if let Some(e) = evidence {
                    sent_evidence = e;
                }
                if let Some(r) = reused {
                    sent_reused = r;
                }
                let response = WatchRoutingTableResponse {
                    fleet_cache_bounds: fleet.clone(),
                    fleet_cache_evidence: sent_evidence.clone(),
                    fleet_reused_keys: sent_reused.clone(),
                    ..Default::default()
                };
                if self.tx.send(Ok(response)).await.is_err() {
                    return;
                }
                sent = fleet;
            }
            tokio::select! {
                _ = tick.tick() => evidence_due = true,
                changed = self.tables.changed() => if changed.is_err() { return },
                changed = self.bounds.changed() => if changed.is_err() { return },
                _ = self.shutdown.changed() => return,
                _ = self.tx.closed() => return,
                msg = inbound.message() => match msg {
                    Ok(Some(m)) => self.on_reply(&node_id, m),
                    Ok(None) | Err(_) => return,
                },
            }
        }
    }

    async fn send(&mut self, node_id: &str, table: &PublishedTable) -> bool {
        self.nonce += 1;
        let nonce = self.nonce.to_string();
        let span = tracing::info_span!(
            "push_routing_table",
            otel.kind = "producer",
            node_id,
            version = table.version as i64,
            nonce = nonce.as_str(),
            bytes = table.encoded.len() as i64,
            result = tracing::field::Empty,
            error = tracing::field::Empty,
            otel.status_code = tracing::field::Empty,
        );
        if let Some(superseded) = self.pending.replace(Pending {
            nonce: nonce.clone(),
            version: table.version,
            span,
        }) {
            superseded.span.record("result", "superseded");
        }
        let response = WatchRoutingTableResponse {
            version: table.version,
            nonce,
            routing_table: table.encoded.clone(),
            fleet_cache_bounds: Vec::new(),
            fleet_cache_evidence: Vec::new(),
            fleet_reused_keys: Vec::new(),
        };
        self.tx.send(Ok(response)).await.is_ok()
    }

    /// An ACK or NACK of the pending push (its nonce), or a status report (no nonce), or an
    /// answer to a push already superseded (nothing to record but that the node is alive).
    fn on_reply(&mut self, node_id: &str, reply: WatchRoutingTableRequest) {
        let answered = self
            .pending
            .as_ref()
            .filter(|p| !reply.response_nonce.is_empty() && p.nonce == reply.response_nonce)
            .map(|p| p.version);
        self.nodes.update(node_id, |s| {
            match answered {
                Some(version) if reply.error_detail.is_empty() => {
                    s.applied_version = version;
                    s.last_nack.clear();
                }
                Some(version) => {
                    tracing::warn!(node_id, version, error = %reply.error_detail, "data plane rejected routing table");
                    s.last_nack = reply.error_detail.clone();
                }
                None => {}
            }
            if let Some(status) = reply.status {
                s.queues = status.queues;
                s.cache_bounds = status.cache_bounds;
                s.cache_evidence = status.cache_evidence;
                s.reused_keys = status.reused_keys;
            }
        });
        if answered.is_some() {
            if let Some(pending) = self.pending.take() {
                if reply.error_detail.is_empty() {
                    pending.span.record("result", "ack");
                } else {
                    pending.span.record("result", "nack");
                    pending.span.record("otel.status_code", "error");
                    pending.span.record("error", reply.error_detail.as_str());
                }
            }
        }
    }
}
