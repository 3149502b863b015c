//! The etcd store backend (`--etcd-endpoints`): several control-plane replicas share one etcd.
//!
//! Keys: `PREFIX TREE / KEY` for each of the store's trees, and `PREFIX changes`, a counter every
//! commit bumps. Each replica keeps a mirror of everything under the prefix (one Range, then a
//! Watch from the next revision), and reads only from it. A commit is one etcd transaction that
//! applies the change's puts and deletes and bumps the counter, if the counter still holds the
//! value the mirror had when the change began its reads ([`Backend::begin`]; not the value at
//! commit time: the watch may have brought another replica's commit in between, and the change
//! was computed without it). If another replica committed since, nothing is written and the
//! store re-reads and retries ([`StoreError::Conflict`]). After a commit the replica waits
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

use crate::store::{Backend, Op, ReadMark, Store, StoreError, TreeId};

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
use pb::etcdserverpb::lease_client::LeaseClient;
use pb::etcdserverpb::request_op::Request as TxnOp;
use pb::etcdserverpb::watch_client::WatchClient;
use pb::etcdserverpb::watch_request::RequestUnion;
use pb::etcdserverpb::{
    Compare, DeleteRangeRequest, LeaseGrantRequest, PutRequest, RangeRequest, RequestOp,
    TxnRequest, WatchCreateRequest, WatchRequest,
};
use pb::mvccpb::event::EventType;

/// How long one etcd call may take before the store calls etcd unavailable.
const CALL_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a commit waits for its own revision to come back through the watch before it
/// re-reads the whole prefix instead.
const SEE_OWN_WRITE: Duration = Duration::from_secs(2);

/// `--etcd-endpoints`, `--etcd-prefix` and how to authenticate to etcd.
#[derive(Debug, Clone)]
pub struct EtcdSettings {
    pub endpoints: Vec<String>,
    pub prefix: String,
    /// For `https://` endpoints: the CA to trust and, for client-certificate auth, ours.
    pub tls: proto::client::TlsOptions,
    /// An etcd user (etcd with `auth enable`), `--etcd-user` and `--etcd-password-file`.
    pub user: Option<EtcdUser>,
}

/// An etcd user name and password.
#[derive(Clone)]
pub struct EtcdUser {
    pub name: String,
    pub password: String,
}

impl std::fmt::Debug for EtcdUser {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdUser")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

/// Adds etcd's auth `token` (from `Authenticate`) to every call, once there is one.
#[derive(Clone, Default)]
struct Token(Arc<RwLock<Option<tonic::metadata::AsciiMetadataValue>>>);

impl tonic::service::Interceptor for Token {
    fn call(
        &mut self,
        mut request: tonic::Request<()>,
    ) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(t) = self.0.read().unwrap_or_else(|e| e.into_inner()).as_ref() {
            request.metadata_mut().insert("token", t.clone());
        }
        Ok(request)
    }
}

/// A connection to one member, carrying the auth token.
type EtcdChannel = tonic::service::interceptor::InterceptedService<Channel, Token>;

/// The etcd members, one connection each (made lazily), used one at a time: a call that cannot
/// reach the current member moves to the next. With a user, calls carry the token `Authenticate`
/// gave, renewed when etcd calls it invalid (etcd's tokens expire).
struct Members {
    channels: Vec<Channel>,
    current: std::sync::atomic::AtomicUsize,
    user: Option<EtcdUser>,
    token: Token,
}

impl Members {
    fn current(&self) -> (usize, EtcdChannel) {
        let i = self.current.load(std::sync::atomic::Ordering::Relaxed) % self.channels.len();
        (
            i,
            EtcdChannel::new(self.channels[i].clone(), self.token.clone()),
        )
    }

    /// Gets a fresh token from member `i` (nothing to do without a user).
    async fn authenticate(&self, i: usize) -> Result<(), tonic::Status> {
        let Some(user) = &self.user else {
            return Ok(());
        };
        let answer = pb::etcdserverpb::auth_client::AuthClient::new(self.channels[i].clone())
            .authenticate(pb::etcdserverpb::AuthenticateRequest {
                name: user.name.clone(),
                password: user.password.clone(),
            })
            .await?
            .into_inner();
        let token = answer.token.parse().map_err(|_| {
            tonic::Status::unauthenticated("etcd gave a token that cannot travel in metadata")
        })?;
        *self.token.0.write().unwrap_or_else(|e| e.into_inner()) = Some(token);
        Ok(())
    }

    /// Member `i` could not be reached: use the next one (unless another call already moved).
    fn failed(&self, i: usize) {
        let next = (i + 1) % self.channels.len();
        let _ = self.current.compare_exchange(
            i,
            next,
            std::sync::atomic::Ordering::Relaxed,
            std::sync::atomic::Ordering::Relaxed,
        );
    }

    fn len(&self) -> usize {
        self.channels.len()
    }
}

/// etcd refused the call's token (expired, or none yet): authenticate and try again.
fn token_refused(status: &tonic::Status) -> bool {
    status.code() == tonic::Code::Unauthenticated
        || status.message().contains("invalid auth token")
        || status.message().contains("user name is empty")
}

/// A status made on this side because the member could not be reached (not an answer of etcd's).
fn unreachable(status: &tonic::Status) -> bool {
    status.code() == tonic::Code::Unavailable && std::error::Error::source(status).is_some()
}

/// Dials an etcd member's unix socket (an `unix:///PATH` or `unixs:///PATH` endpoint).
#[derive(Clone)]
pub struct UnixConnector(pub std::path::PathBuf);

impl tower_service::Service<http::Uri> for UnixConnector {
    type Response = hyper_util::rt::TokioIo<tokio::net::UnixStream>;
    type Error = std::io::Error;
    type Future = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<Self::Response, Self::Error>> + Send>,
    >;

    fn poll_ready(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: http::Uri) -> Self::Future {
        let path = self.0.clone();
        Box::pin(async move {
            tokio::net::UnixStream::connect(path)
                .await
                .map(hyper_util::rt::TokioIo::new)
        })
    }
}

/// The mirror of everything under the prefix, at `revision`.
#[derive(Default)]
struct Mirror {
    entries: BTreeMap<Vec<u8>, Vec<u8>>,
    revision: i64,
}

pub(crate) struct EtcdBackend {
    prefix: Vec<u8>,
    members: Arc<Members>,
    mirror: Arc<RwLock<Mirror>>,
    /// The mirror's revision, for waiting on it.
    applied: watch::Sender<i64>,
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
    /// `spawn_blocking`), within [`CALL_TIMEOUT`], on the first member that can be reached.
    fn call<T, F, Fut>(&self, what: &str, make: F) -> Result<T, StoreError>
    where
        F: Fn(EtcdChannel) -> Fut,
        Fut: std::future::Future<Output = Result<T, tonic::Status>>,
    {
        let mut last = String::new();
        let mut renewed = false;
        for _ in 0..self.members.len() + 1 {
            let (i, channel) = self.members.current();
            let answer = self
                .runtime
                .block_on(async { tokio::time::timeout(CALL_TIMEOUT, make(channel)).await });
            match answer {
                Ok(Ok(v)) => return Ok(v),
                Ok(Err(status))
                    if !renewed && self.members.user.is_some() && token_refused(&status) =>
                {
                    renewed = true;
                    let fresh = self.runtime.block_on(async {
                        tokio::time::timeout(CALL_TIMEOUT, self.members.authenticate(i)).await
                    });
                    if let Ok(Err(e)) = fresh {
                        return Err(unavailable(
                            what,
                            format!("etcd refused the user: {}", e.message()),
                        ));
                    }
                }
                Ok(Err(status)) if unreachable(&status) => {
                    self.members.failed(i);
                    last = status.message().to_string();
                }
                Ok(Err(status)) => return Err(unavailable(what, status.message())),
                Err(_) => {
                    return Err(unavailable(
                        what,
                        format!(
                            "no answer within {}s (is a quorum of etcd members up?)",
                            CALL_TIMEOUT.as_secs()
                        ),
                    ))
                }
            }
        }
        Err(unavailable(
            what,
            format!("no etcd member could be reached ({last})"),
        ))
    }
}

/// Loads everything under `prefix` into `mirror` if it is newer than what the mirror holds;
/// returns the revision read.
async fn load(
    kv: &mut KvClient<EtcdChannel>,
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
    members: Arc<Members>,
    prefix: Vec<u8>,
    mirror: Arc<RwLock<Mirror>>,
    applied: watch::Sender<i64>,
) {
    loop {
        let (member, channel) = members.current();
        let mut kv = KvClient::new(channel.clone());
        let mut watch = WatchClient::new(channel);
        let from = match load(&mut kv, &prefix, &mirror, &applied).await {
            Ok(r) => r,
            Err(e) if token_refused(&e) && members.user.is_some() => {
                if let Err(e) = members.authenticate(member).await {
                    tracing::warn!("etcd: cannot authenticate: {}; retrying", e.message());
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                continue;
            }
            Err(e) => {
                members.failed(member);
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
                members.failed(member);
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
                    members.failed(member);
                    tracing::warn!("etcd: the watch broke: {}; reloading", e.message());
                    break;
                }
            };
            if resp.canceled || resp.compact_revision > 0 {
                break;
            }
            // The mirror's revision moves with the events applied, not with the response header:
            // a header can be ahead of events still to come (the store's revision when the
            // response was sent), and those events must not be taken for already applied.
            let mut m = mirror.write().unwrap_or_else(|e| e.into_inner());
            let mut newest = m.revision;
            for event in resp.events {
                let Some(kv) = event.kv else { continue };
                if kv.mod_revision <= m.revision {
                    continue; // already in the mirror (loaded after this event)
                }
                newest = newest.max(kv.mod_revision);
                if event.r#type == EventType::Delete as i32 {
                    m.entries.remove(&kv.key);
                } else {
                    m.entries.insert(kv.key, kv.value);
                }
            }
            if newest > m.revision {
                m.revision = newest;
                drop(m);
                applied.send_replace(newest);
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

    fn scan(&self, tree: TreeId, prefix: &[u8]) -> Result<crate::store::Entries, StoreError> {
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

    fn begin(&self) -> ReadMark {
        ReadMark(
            self.read()
                .entries
                .get(&self.counter_key())
                .and_then(|v| std::str::from_utf8(v).ok()?.parse::<u64>().ok())
                .unwrap_or(0),
        )
    }

    fn commit(&self, from: ReadMark, ops: &[Op]) -> Result<(), StoreError> {
        let counter_key = self.counter_key();
        let compare = match from.0 {
            // No commit yet: the counter must still not exist.
            0 => Compare {
                key: counter_key.clone(),
                target: CompareTarget::Version as i32,
                result: CompareResult::Equal as i32,
                target_union: Some(TargetUnion::Version(0)),
                ..Default::default()
            },
            seen => Compare {
                key: counter_key.clone(),
                target: CompareTarget::Value as i32,
                result: CompareResult::Equal as i32,
                target_union: Some(TargetUnion::Value(seen.to_string().into_bytes())),
                ..Default::default()
            },
        };
        let next = from.0 + 1;
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
        let txn = TxnRequest {
            compare: vec![compare],
            success,
            failure: vec![],
        };
        let resp = self.call("transaction", |channel| {
            let txn = txn.clone();
            async move {
                KvClient::new(channel)
                    .txn(txn)
                    .await
                    .map(|r| r.into_inner())
            }
        })?;
        if !resp.succeeded {
            return Err(StoreError::Conflict);
        }
        // Read our own write before returning: wait for the watch to bring the commit's
        // revision, or load the prefix at once if it is slow.
        let revision = resp.header.map_or(0, |h| h.revision);
        let mut applied = self.applied.subscribe();
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
        self.call("read", |channel| {
            let (prefix, mirror) = (self.prefix.clone(), self.mirror.clone());
            let applied = self.applied.clone();
            async move { load(&mut KvClient::new(channel), &prefix, &mirror, &applied).await }
        })
        .map(drop)
    }

    fn flush(&self) -> Result<(), StoreError> {
        Ok(()) // every etcd commit is durable when it returns
    }
}

/// How often a replica shares the rollout status of its data planes, and how long that entry
/// outlives a replica that stopped sharing it (an etcd lease).
const NODES_EVERY: Duration = Duration::from_secs(1);
const NODES_TTL_SECONDS: i64 = 5;

/// One replica's data planes, as shared in etcd (`PREFIX nodes/REPLICA`, under a short lease).
#[derive(Clone, PartialEq, prost::Message)]
struct ReplicaNodes {
    #[prost(message, repeated, tag = "1")]
    nodes: Vec<proto::DataPlaneStatus>,
}

/// The data planes of the other replicas: each replica writes its watchers' state under a short
/// etcd lease, so `DescribeEndpoint` on any replica reports every data plane, and a dead
/// replica's entry goes away within [`NODES_TTL_SECONDS`].
pub struct ClusterNodes {
    members: Arc<Members>,
    prefix: Vec<u8>,
    replica: String,
    mirror: Arc<RwLock<Mirror>>,
}

impl std::fmt::Debug for ClusterNodes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterNodes")
            .field("replica", &self.replica)
            .finish_non_exhaustive()
    }
}

impl ClusterNodes {
    fn key(&self, replica: &str) -> Vec<u8> {
        let mut k = self.nodes_prefix();
        k.extend_from_slice(replica.as_bytes());
        k
    }

    fn nodes_prefix(&self) -> Vec<u8> {
        let mut k = self.prefix.clone();
        k.extend_from_slice(b"nodes/");
        k
    }

    /// Every data plane the other replicas serve: `(node id, applied version, connected, last
    /// seen, last NACK)` as `DataPlaneStatus` (`up_to_date` unset).
    pub fn others(&self) -> Vec<proto::DataPlaneStatus> {
        use prost::Message as _;
        let own = self.key(&self.replica);
        let start = self.nodes_prefix();
        let mirror = self.mirror.read().unwrap_or_else(|e| e.into_inner());
        mirror
            .entries
            .range(start.clone()..)
            .take_while(|(k, _)| k.starts_with(&start))
            .filter(|(k, _)| **k != own)
            .filter_map(|(_, v)| ReplicaNodes::decode(v.as_slice()).ok())
            .flat_map(|r| r.nodes)
            .collect()
    }

    /// Shares `nodes` every [`NODES_EVERY`] until `stop` flips.
    pub async fn share(
        self: Arc<Self>,
        nodes: Arc<crate::discovery::NodeRegistry>,
        mut stop: watch::Receiver<bool>,
    ) {
        use prost::Message as _;
        let mut tick = tokio::time::interval(NODES_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = stop.changed() => return,
            }
            let shared = ReplicaNodes {
                nodes: nodes.statuses(),
            };
            // A fresh short lease each time: the entry lives NODES_TTL_SECONDS past the last
            // write, whatever happened to earlier leases.
            let (member, channel) = self.members.current();
            let mut kv = KvClient::new(channel.clone());
            let mut leases = LeaseClient::new(channel);
            let put = async {
                let lease = leases
                    .lease_grant(LeaseGrantRequest {
                        ttl: NODES_TTL_SECONDS,
                        id: 0,
                    })
                    .await?
                    .into_inner();
                kv.put(PutRequest {
                    key: self.key(&self.replica),
                    value: shared.encode_to_vec(),
                    lease: lease.id,
                    ..Default::default()
                })
                .await
            };
            if let Ok(Err(e)) = tokio::time::timeout(CALL_TIMEOUT, put).await {
                if unreachable(&e) {
                    self.members.failed(member);
                } else if token_refused(&e) {
                    let _ = self.members.authenticate(member).await;
                }
                tracing::debug!(
                    "etcd: cannot share the data planes' status: {}",
                    e.message()
                );
            }
        }
    }
}

/// The etcd store and the data-plane status shared between replicas.
pub struct EtcdStore {
    pub store: Arc<Store>,
    pub cluster: Arc<ClusterNodes>,
}

/// Connects to etcd, loads the mirror and starts the watch; returns the store over it and keeps
/// its routing table republished when other replicas change the state.
pub async fn open_store(settings: &EtcdSettings) -> anyhow::Result<Arc<Store>> {
    open(settings).await.map(|s| s.store)
}

/// [`open_store`], with the shared data-plane status.
pub async fn open(settings: &EtcdSettings) -> anyhow::Result<EtcdStore> {
    use anyhow::Context as _;
    if settings.endpoints.is_empty() {
        anyhow::bail!("--etcd-endpoints is empty");
    }
    let mut channels = Vec::with_capacity(settings.endpoints.len());
    for url in &settings.endpoints {
        let unix = match url.strip_prefix("unixs://") {
            Some(path) => Some((path, true)),
            None => url.strip_prefix("unix://").map(|path| (path, false)),
        };
        if let Some((path, secure)) = unix {
            // A member listening on a unix socket (`--listen-client-urls unix://...`, or
            // `unixs://...` with TLS): the connector dials the socket; the URI only fills the
            // requests' :authority and, with TLS, names the server the certificate must name
            // (localhost).
            anyhow::ensure!(
                path.starts_with('/'),
                "bad --etcd-endpoints URL {url:?}: a unix socket needs an absolute path (unix:///PATH or unixs:///PATH)"
            );
            let mut endpoint = tonic::transport::Endpoint::from_static(if secure {
                "https://localhost"
            } else {
                "http://localhost"
            });
            if secure {
                let tls = settings
                    .tls
                    .for_url("https://localhost")
                    .with_context(|| format!("etcd endpoint {url}"))?
                    .with_context(|| format!("no TLS settings for etcd endpoint {url}"))?;
                endpoint = endpoint
                    .tls_config(tls)
                    .with_context(|| format!("TLS settings for etcd endpoint {url}"))?;
            }
            let endpoint = endpoint
                .connect_timeout(Duration::from_secs(2))
                .keep_alive_while_idle(true)
                .http2_keep_alive_interval(Duration::from_secs(5))
                .keep_alive_timeout(Duration::from_secs(3));
            channels.push(endpoint.connect_with_connector_lazy(UnixConnector(path.into())));
            continue;
        }
        let mut endpoint = tonic::transport::Endpoint::from_shared(url.clone())
            .with_context(|| format!("bad --etcd-endpoints URL {url:?}"))?;
        if let Some(tls) = settings
            .tls
            .for_url(url)
            .with_context(|| format!("etcd endpoint {url}"))?
        {
            endpoint = endpoint
                .tls_config(tls)
                .with_context(|| format!("TLS settings for etcd endpoint {url}"))?;
        }
        let endpoint = endpoint
            .connect_timeout(Duration::from_secs(2))
            .keep_alive_while_idle(true)
            .http2_keep_alive_interval(Duration::from_secs(5))
            .keep_alive_timeout(Duration::from_secs(3));
        channels.push(endpoint.connect_lazy());
    }
    let members = Arc::new(Members {
        channels,
        current: Default::default(),
        user: settings.user.clone(),
        token: Token::default(),
    });
    let prefix = settings.prefix.clone().into_bytes();
    let mirror = Arc::new(RwLock::new(Mirror::default()));
    let (applied, _) = watch::channel(0i64);
    // The first member that answers (and, with a user, accepts it).
    let mut loaded = Err(anyhow::anyhow!("no etcd member given"));
    for _ in 0..members.len() {
        let (member, channel) = members.current();
        match tokio::time::timeout(CALL_TIMEOUT, members.authenticate(member)).await {
            Ok(Err(s)) if unreachable(&s) => {
                members.failed(member);
                continue;
            }
            Ok(Err(s)) => anyhow::bail!(
                "etcd at {} refused user {:?}: {}",
                settings.endpoints.join(","),
                settings
                    .user
                    .as_ref()
                    .map(|u| u.name.as_str())
                    .unwrap_or(""),
                s.message()
            ),
            _ => {}
        }
        let mut kv = KvClient::new(channel);
        let r = tokio::time::timeout(CALL_TIMEOUT, load(&mut kv, &prefix, &mirror, &applied)).await;
        let unreached = matches!(&r, Ok(Err(s)) if unreachable(s));
        loaded = Ok(r);
        if !unreached {
            break;
        }
        members.failed(member);
    }
    loaded?
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
        members.clone(),
        prefix.clone(),
        mirror.clone(),
        applied.clone(),
    ));
    let cluster = Arc::new(ClusterNodes {
        members: members.clone(),
        prefix: prefix.clone(),
        replica: uuid::Uuid::new_v4().to_string(),
        mirror: mirror.clone(),
    });
    let mut changes = applied.subscribe();
    let backend = EtcdBackend {
        prefix,
        members,
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
    Ok(EtcdStore { store, cluster })
}
