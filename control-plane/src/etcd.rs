//! The etcd store backend (`--etcd-endpoints`): several control-plane replicas share one etcd.
//!
//! Keys: `PREFIX TREE / KEY` for each of the store's trees, and `PREFIX changes`, a counter every
//! commit bumps. Each replica keeps a mirror of everything under the prefix (one Range, then a
//! Watch from the next revision), and reads only from it. A commit is one etcd transaction that
//! applies the change's puts and deletes and bumps the counter, if the counter still holds the
//! value this replica's mirror has: if another replica committed in between, nothing is written
//! and the store re-reads and retries ([`StoreError::Conflict`]). After a commit the replica waits
//! until its mirror has the commit's revision, so it reads its own writes. Changes made by other
//! replicas reach the mirror through the watch; the store then republishes the routing table
//! (see [`open_store`]).
//!
//! Leases of registered instances are stored fields (an expiry time), not etcd leases: every
//! replica's reaper removes expired instances, with the same compare-and-swap, so an instance
//! registered through a replica that died stays as long as it renews through another, and goes
//! on time when nobody renews it.

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use tokio::sync::watch;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;

use crate::store::{Backend, Op, Store, StoreError, TreeId};

/// etcd's v3 API, generated (client side) from the vendored .proto files.
#[allow(clippy::all, missing_docs)]
pub mod pb {
    pub mod mvccpb {
        tonic::include_proto!("mvccpb");
    }
    pub mod authpb {
        tonic::include_proto!("authpb");
    }
    pub mod etcdserverpb {
        tonic::include_proto!("etcdserverpb");
    }
}

use pb::etcdserverpb::compare::{CompareResult, CompareTarget, TargetUnion};
use pb::etcdserverpb::kv_client::KvClient;
use pb::etcdserverpb::request_op::Request as TxnOp;
use pb::etcdserverpb::watch_client::WatchClient;
use pb::etcdserverpb::watch_request::RequestUnion;
use pb::etcdserverpb::{
    Compare, DeleteRangeRequest, PutRequest, RangeRequest, RequestOp, TxnRequest,
    WatchCreateRequest, WatchRequest,
};
use pb::mvccpb::event::EventType;

/// How long one etcd call may take before the store calls etcd unavailable.
const CALL_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a commit waits for its own revision to come back through the watch before it
/// re-reads the whole prefix instead.
const SEE_OWN_WRITE: Duration = Duration::from_secs(2);

/// `--etcd-endpoints` and `--etcd-prefix`.
#[derive(Debug, Clone)]
pub struct EtcdSettings {
    pub endpoints: Vec<String>,
    pub prefix: String,
}

/// The mirror of everything under the prefix, at `revision`.
#[derive(Default)]
struct Mirror {
    entries: BTreeMap<Vec<u8>, Vec<u8>>,
    revision: i64,
}

pub(crate) struct EtcdBackend {
    prefix: Vec<u8>,
    kv: KvClient<Channel>,
    mirror: Arc<RwLock<Mirror>>,
    /// The mirror's revision, for waiting on it.
    applied: watch::Receiver<i64>,
    runtime: tokio::runtime::Handle,
    watcher: tokio::task::JoinHandle<()>,
}

impl Drop for EtcdBackend {
    fn drop(&mut self) {
        self.watcher.abort();
    }
}

fn unavailable(what: &str, e: impl std::fmt::Display) -> StoreError {
    StoreError::Unavailable(format!("etcd {what} failed: {e}"))
}

/// The first key after every key that starts with `prefix` (etcd's `range_end`).
fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

impl EtcdBackend {
    fn tree_key(&self, tree: TreeId, key: &[u8]) -> Vec<u8> {
        let mut k = Vec::with_capacity(self.prefix.len() + tree.name().len() + 1 + key.len());
        k.extend_from_slice(&self.prefix);
        k.extend_from_slice(tree.name().as_bytes());
        k.push(b'/');
        k.extend_from_slice(key);
        k
    }

    fn counter_key(&self) -> Vec<u8> {
        let mut k = self.prefix.clone();
        k.extend_from_slice(b"changes");
        k
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Mirror> {
        self.mirror.read().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs an etcd call to completion from a blocking thread (the store's callers run it on
    /// `spawn_blocking`), within [`CALL_TIMEOUT`].
    fn call<T>(
        &self,
        what: &str,
        fut: impl std::future::Future<Output = Result<T, tonic::Status>>,
    ) -> Result<T, StoreError> {
        match self
            .runtime
            .block_on(async { tokio::time::timeout(CALL_TIMEOUT, fut).await })
        {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(status)) => Err(unavailable(what, status.message())),
            Err(_) => Err(unavailable(
                what,
                format!(
                    "no answer within {}s (is a quorum of etcd members up?)",
                    CALL_TIMEOUT.as_secs()
                ),
            )),
        }
    }
}

/// Loads everything under `prefix` into `mirror` if it is newer than what the mirror holds;
/// returns the revision read.
async fn load(
    kv: &mut KvClient<Channel>,
    prefix: &[u8],
    mirror: &RwLock<Mirror>,
    applied: &watch::Sender<i64>,
) -> Result<i64, tonic::Status> {
    let resp = kv
        .range(RangeRequest {
            key: prefix.to_vec(),
            range_end: prefix_end(prefix),
            ..Default::default()
        })
        .await?
        .into_inner();
    let revision = resp.header.map_or(0, |h| h.revision);
    let mut m = mirror.write().unwrap_or_else(|e| e.into_inner());
    if revision > m.revision {
        m.entries = resp.kvs.into_iter().map(|kv| (kv.key, kv.value)).collect();
        m.revision = revision;
        applied.send_replace(revision);
    }
    Ok(m.revision)
}

/// Keeps the mirror current: watches the prefix from the mirror's next revision, applies every
/// event, and starts over from a fresh load when the watch breaks (etcd restarted, compaction).
async fn watch_prefix(
    channel: Channel,
    prefix: Vec<u8>,
    mirror: Arc<RwLock<Mirror>>,
    applied: watch::Sender<i64>,
) {
    let mut kv = KvClient::new(channel.clone());
    let mut watch = WatchClient::new(channel);
    loop {
        let from = match load(&mut kv, &prefix, &mirror, &applied).await {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(
                    "etcd: cannot read the store's keys: {}; retrying",
                    e.message()
                );
                tokio::time::sleep(Duration::from_millis(500)).await;
                continue;
            }
        };
        let (tx, rx) = tokio::sync::mpsc::channel(1);
        let _ = tx
            .send(WatchRequest {
                request_union: Some(RequestUnion::CreateRequest(WatchCreateRequest {
                    key: prefix.clone(),
                    range_end: prefix_end(&prefix),
                    start_revision: from + 1,
                    progress_notify: true,
                    ..Default::default()
                })),
            })
            .await;
        let mut stream = match watch.watch(ReceiverStream::new(rx)).await {
            Ok(s) => s.into_inner(),
            Err(e) => {
                tracing::warn!(
                    "etcd: cannot watch the store's keys: {}; retrying",
                    e.message()
                );
                tokio::time::sleep(Duration::from_millis(500)).await;
                continue;
            }
        };
        loop {
            let resp = match stream.message().await {
                Ok(Some(r)) => r,
                Ok(None) => break,
                Err(e) => {
                    tracing::warn!("etcd: the watch broke: {}; reloading", e.message());
                    break;
                }
            };
            if resp.canceled || resp.compact_revision > 0 {
                break;
            }
            let mut m = mirror.write().unwrap_or_else(|e| e.into_inner());
            for event in resp.events {
                let Some(kv) = event.kv else { continue };
                if kv.mod_revision <= m.revision {
                    continue; // already in the mirror (loaded after this event)
                }
                if event.r#type == EventType::Delete as i32 {
                    m.entries.remove(&kv.key);
                } else {
                    m.entries.insert(kv.key, kv.value);
                }
            }
            let revision = resp.header.map_or(0, |h| h.revision);
            if revision > m.revision {
                m.revision = revision;
                drop(m);
                applied.send_replace(revision);
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // (the loop ends only when the task is aborted)
}

impl Backend for EtcdBackend {
    fn get(&self, tree: TreeId, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
        Ok(self.read().entries.get(&self.tree_key(tree, key)).cloned())
    }

    fn scan(&self, tree: TreeId, prefix: &[u8]) -> Result<Vec<(Vec<u8>, Vec<u8>)>, StoreError> {
        let start = self.tree_key(tree, prefix);
        let skip = self.tree_key(tree, b"").len();
        Ok(self
            .read()
            .entries
            .range(start.clone()..)
            .take_while(|(k, _)| k.starts_with(&start))
            .map(|(k, v)| (k[skip..].to_vec(), v.clone()))
            .collect())
    }

    fn commit(&self, ops: &[Op]) -> Result<(), StoreError> {
        let counter_key = self.counter_key();
        let counter = self.read().entries.get(&counter_key).cloned();
        let compare = match &counter {
            Some(value) => Compare {
                key: counter_key.clone(),
                target: CompareTarget::Value as i32,
                result: CompareResult::Equal as i32,
                target_union: Some(TargetUnion::Value(value.clone())),
                ..Default::default()
            },
            // No commit yet: the counter must still not exist.
            None => Compare {
                key: counter_key.clone(),
                target: CompareTarget::Version as i32,
                result: CompareResult::Equal as i32,
                target_union: Some(TargetUnion::Version(0)),
                ..Default::default()
            },
        };
        let next = counter
            .as_deref()
            .and_then(|v| std::str::from_utf8(v).ok()?.parse::<u64>().ok())
            .unwrap_or(0)
            + 1;
        let mut success: Vec<RequestOp> = ops
            .iter()
            .map(|op| RequestOp {
                request: Some(match op {
                    Op::Put(t, k, v) => TxnOp::RequestPut(PutRequest {
                        key: self.tree_key(*t, k),
                        value: v.clone(),
                        ..Default::default()
                    }),
                    Op::Del(t, k) => TxnOp::RequestDeleteRange(DeleteRangeRequest {
                        key: self.tree_key(*t, k),
                        ..Default::default()
                    }),
                }),
            })
            .collect();
        success.push(RequestOp {
            request: Some(TxnOp::RequestPut(PutRequest {
                key: counter_key,
                value: next.to_string().into_bytes(),
                ..Default::default()
            })),
        });
        let mut kv = self.kv.clone();
        let resp = self.call("transaction", async move {
            kv.txn(TxnRequest {
                compare: vec![compare],
                success,
                failure: vec![],
            })
            .await
            .map(|r| r.into_inner())
        })?;
        if !resp.succeeded {
            return Err(StoreError::Conflict);
        }
        // Read our own write before returning: wait for the watch to bring the commit's
        // revision, or load the prefix at once if it is slow.
        let revision = resp.header.map_or(0, |h| h.revision);
        let mut applied = self.applied.clone();
        let seen = self.runtime.block_on(async {
            tokio::time::timeout(SEE_OWN_WRITE, applied.wait_for(|&r| r >= revision))
                .await
                .is_ok_and(|r| r.is_ok())
        });
        if !seen {
            self.sync()?;
        }
        Ok(())
    }

    fn sync(&self) -> Result<(), StoreError> {
        let mut kv = self.kv.clone();
        let prefix = self.prefix.clone();
        let mirror = self.mirror.clone();
        let (tx, _) = watch::channel(0);
        let before = self.read().revision;
        let revision = self.call(
            "read",
            async move { load(&mut kv, &prefix, &mirror, &tx).await },
        )?;
        if revision > before {
            // Wake waiters as the watch would have.
            tracing::debug!(revision, "etcd: mirror reloaded");
        }
        Ok(())
    }

    fn flush(&self) -> Result<(), StoreError> {
        Ok(()) // every etcd commit is durable when it returns
    }
}

/// Connects to etcd, loads the mirror and starts the watch; returns the store over it and keeps
/// its routing table republished when other replicas change the state.
pub async fn open_store(settings: &EtcdSettings) -> anyhow::Result<Arc<Store>> {
    use anyhow::Context as _;
    if settings.endpoints.is_empty() {
        anyhow::bail!("--etcd-endpoints is empty");
    }
    let mut endpoints = Vec::with_capacity(settings.endpoints.len());
    for url in &settings.endpoints {
        let endpoint = tonic::transport::Endpoint::from_shared(url.clone())
            .with_context(|| format!("bad --etcd-endpoints URL {url:?}"))?
            .connect_timeout(Duration::from_secs(2))
            .keep_alive_while_idle(true)
            .http2_keep_alive_interval(Duration::from_secs(5))
            .keep_alive_timeout(Duration::from_secs(3));
        endpoints.push(endpoint);
    }
    let channel = Channel::balance_list(endpoints.into_iter());
    let prefix = settings.prefix.clone().into_bytes();
    let mirror = Arc::new(RwLock::new(Mirror::default()));
    let (applied_tx, applied) = watch::channel(0i64);
    let mut kv = KvClient::new(channel.clone());
    tokio::time::timeout(CALL_TIMEOUT, load(&mut kv, &prefix, &mirror, &applied_tx))
        .await
        .map_err(|_| {
            anyhow::anyhow!(
                "etcd at {} did not answer within {}s",
                settings.endpoints.join(","),
                CALL_TIMEOUT.as_secs()
            )
        })?
        .map_err(|s| {
            anyhow::anyhow!(
                "cannot read from etcd at {}: {}",
                settings.endpoints.join(","),
                s.message()
            )
        })?;
    let watcher = tokio::spawn(watch_prefix(
        channel,
        prefix.clone(),
        mirror.clone(),
        applied_tx,
    ));
    let mut changes = applied.clone();
    let backend = EtcdBackend {
        prefix,
        kv,
        mirror,
        applied,
        runtime: tokio::runtime::Handle::current(),
        watcher,
    };
    let store = tokio::task::spawn_blocking(move || Store::with_backend(Box::new(backend)))
        .await
        .context("opening the etcd store")?
        .context("initializing the etcd store")?;
    let store = Arc::new(store);
    // Another replica's change: republish (a no-op for this replica's own commits).
    let weak = Arc::downgrade(&store);
    tokio::spawn(async move {
        while changes.changed().await.is_ok() {
            let Some(store) = weak.upgrade() else { return };
            let done = tokio::task::spawn_blocking(move || store.republish_if_changed()).await;
            if let Ok(Err(e)) = done {
                tracing::error!("republishing the routing table failed: {e}");
            }
        }
    });
    Ok(store)
}
