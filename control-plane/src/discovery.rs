//! `RoutingDiscovery.WatchRoutingTable`: xDS-style streaming of versioned routing tables.
//!
//! Per stream: the router's first message names it and the version it holds; if that is not the
//! current version the full table goes out at once, then every new version (intermediate
//! versions are skipped when a router is slow: each table is complete). Each response carries a
//! nonce; the router ACKs or NACKs it, and [`NodeRegistry`] records per node the applied version,
//! the last NACK and when it was last heard from. A message that answers no push (an empty nonce)
//! may carry the router's status (its queue depths), kept while its stream is open. The control
//! plane sends a router nothing but tables: routers share nothing with each other through it.
//! Tables are encoded once per version ([`crate::store::PublishedTable`]) and the same buffer goes
//! to every watcher.
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
}

/// Per-node rollout state, in memory: after a control-plane restart routers reconnect and
/// report their versions again.
#[derive(Debug, Default)]
pub struct NodeRegistry {
    nodes: Mutex<HashMap<String, NodeStatus>>,
}

impl NodeRegistry {
    fn update(&self, node_id: &str, f: impl FnOnce(&mut NodeStatus)) {
        let mut nodes = self.nodes.lock().unwrap_or_else(|p| p.into_inner());
        let status = nodes.entry(node_id.to_string()).or_default();
        status.last_seen_unix_ms = now_unix_ms();
        f(status);
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
            })
            .collect()
    }

    /// Number of open watch streams.
    pub fn connected_streams(&self) -> u32 {
        let nodes = self.nodes.lock().unwrap_or_else(|p| p.into_inner());
        nodes.values().map(|s| s.streams).sum()
    }
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
        loop {
            let current = self.tables.borrow_and_update().clone();
            if current.version != held {
                if !self.send(&node_id, &current).await {
                    return;
                }
                held = current.version;
            }
            tokio::select! {
                changed = self.tables.changed() => if changed.is_err() { return },
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
