//! Durable state, and the routing table derived from it.
//!
//! The state lives in a [`Backend`]: sled under `--data-dir` (the default, [`SledBackend`]) or
//! etcd (`--etcd-endpoints`, [`crate::etcd::EtcdBackend`]), which several control-plane replicas
//! share. Every rule about what a change does lives here, once; a backend only reads and commits.
//!
//! Trees (all values are encoded protobuf messages, keys are UTF-8 names unless noted):
//! - `config_revisions`: `name \0 revision(u64 BE)` -> `EndpointConfig`; every revision stays.
//! - `config_heads`: `name` -> latest revision (u64 BE).
//! - `endpoints`: `name` -> `Endpoint`.
//! - `instances`: `instance_id` -> `RegisteredInstance` (leased).
//! - `meta`: `routing_table_version` -> u64 BE.
//!
//! Invariants:
//! - One writer at a time (`write` mutex): a change reads what it needs, then commits all its
//!   writes, including the routing-table version bump, in one atomic backend commit (a multi-tree
//!   sled transaction, or one etcd transaction), durable before it returns. A `kill -9` at any
//!   point leaves either all of a change or none.
//! - Across replicas (etcd), a commit succeeds only if no other commit happened since the change
//!   began its reads (compare-and-swap on the change counter as it was before the first read,
//!   [`Backend::begin`], never as it is at commit time); otherwise the change is re-read,
//!   re-validated and retried, so no write is lost and no version is given out twice.
//! - The routing-table version only grows; it is bumped exactly when what routers see changes.
//! - The published table is rebuilt and encoded once per version, under the same mutex, so
//!   watchers observe versions in order and share one buffer.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use prost::Message;
use sled::transaction::{TransactionError, TransactionalTree};
use sled::{Transactional, Tree};
use tokio::sync::watch;

use proto::{
    Endpoint, EndpointConfig, EndpointRoutes, Instance, ProductionVariant, RegisteredInstance,
    RoutingTable, VariantRoutes,
};

use crate::model::{self, InvalidField};

const VERSION_KEY: &[u8] = b"routing_table_version";

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error(transparent)]
    Invalid(#[from] InvalidField),
    #[error("{kind} {name:?} not found")]
    NotFound { kind: &'static str, name: String },
    #[error("{kind} {name:?} already exists")]
    AlreadyExists { kind: &'static str, name: String },
    #[error("variant {variant:?} not found in endpoint {endpoint:?} (config {config:?} revision {revision})")]
    VariantNotFound {
        variant: String,
        endpoint: String,
        config: String,
        revision: u64,
    },
    #[error("{0}")]
    FailedPrecondition(String),
    // The text carries the cause, so it is not also linked as `source`: a cause chain printed
    // with `{:#}` names it once.
    #[error("storage error: {0}")]
    Storage(sled::Error),
    /// The disk under `--data-dir` is full (or over quota): the change was not made, and reads
    /// and watches go on from what was stored. The next change tries again (the store is
    /// reopened once space is back, see [`SledBackend`]).
    #[error("the control plane's store is out of disk space ({0}): changes are refused until space is freed (no restart needed); reads and routing-table watches go on")]
    OutOfSpace(sled::Error),
    #[error("corrupt record in {tree}: {error}")]
    Corrupt {
        tree: &'static str,
        error: prost::DecodeError,
    },
    /// Another replica committed since this one read: the change is retried (internal).
    #[error("another control-plane replica changed the state at the same time")]
    Conflict,
    /// The shared store cannot take the change now (etcd unreachable or without quorum).
    #[error("the control plane's store is unavailable: {0}")]
    Unavailable(String),
    /// The change lost every retry to concurrent changes from other replicas.
    #[error("{0}")]
    Aborted(String),
}

impl From<sled::Error> for StoreError {
    fn from(e: sled::Error) -> Self {
        match &e {
            sled::Error::Io(io)
                if matches!(
                    io.kind(),
                    std::io::ErrorKind::StorageFull | std::io::ErrorKind::QuotaExceeded
                ) =>
            {
                StoreError::OutOfSpace(e)
            }
            _ => StoreError::Storage(e),
        }
    }
}

fn not_found(kind: &'static str, name: &str) -> StoreError {
    StoreError::NotFound {
        kind,
        name: name.to_string(),
    }
}

/// One routing-table version, encoded once and shared by every watcher.
#[derive(Debug, Clone)]
pub struct PublishedTable {
    pub version: u64,
    pub encoded: Bytes,
}

/// A key space of the store (a sled tree; a key prefix in etcd).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum TreeId {
    Configs,
    Heads,
    Endpoints,
    Instances,
    Meta,
}

impl TreeId {
    /// The sled tree name (also the etcd key segment).
    pub(crate) fn name(self) -> &'static str {
        match self {
            TreeId::Configs => "config_revisions",
            TreeId::Heads => "config_heads",
            TreeId::Endpoints => "endpoints",
            TreeId::Instances => "instances",
            TreeId::Meta => "meta",
        }
    }
}

/// One write of a change; a change's writes commit together.
pub(crate) enum Op {
    Put(TreeId, Vec<u8>, Vec<u8>),
    Del(TreeId, Vec<u8>),
}

/// Keys and values of a scan, in key order.
pub(crate) type Entries = Vec<(Vec<u8>, Vec<u8>)>;

/// The state a change was computed from, as its backend tells it apart from later states (etcd:
/// the change counter before the change's first read; sled, with one writer: nothing).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct ReadMark(pub(crate) u64);

/// Where the state lives: reads, and atomic durable commits.
pub(crate) trait Backend: Send + Sync {
    fn get(&self, tree: TreeId, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError>;
    /// Every `(key, value)` of `tree` whose key starts with `prefix`, in key order.
    fn scan(&self, tree: TreeId, prefix: &[u8]) -> Result<Entries, StoreError>;
    /// Called before a change's first read: the mark its commit compares against.
    fn begin(&self) -> ReadMark {
        ReadMark::default()
    }
    /// Commits `ops` all or nothing, durably, if nothing was committed anywhere since `from`
    /// ([`StoreError::Conflict`] otherwise: the change is read again and retried).
    fn commit(&self, from: ReadMark, ops: &[Op]) -> Result<(), StoreError>;
    /// Brings reads up to date with every commit made so far, anywhere (after a conflict).
    fn sync(&self) -> Result<(), StoreError> {
        Ok(())
    }
    fn flush(&self) -> Result<(), StoreError>;
}

/// How many times a change is retried when other replicas keep committing first.
const COMMIT_ATTEMPTS: usize = 16;

/// Runs just before a change commits (a test's way to let another replica commit in between).
type CommitHook = Arc<dyn Fn() + Send + Sync>;

pub struct Store {
    backend: Box<dyn Backend>,
    write: Mutex<()>,
    /// The mark of the change being made (set by [`Store::mutate`] under `write`).
    change_from: Mutex<ReadMark>,
    before_commit: Mutex<Option<CommitHook>>,
    published: watch::Sender<Arc<PublishedTable>>,
}

/// The sled backend: one tree per [`TreeId`], multi-tree transactions, a flush per commit.
///
/// sled refuses every write after one failed (its global error), so a write that fails for want
/// of space marks the database for reopening: the next commit first checks that a write of
/// [`SPACE_PROBE`] bytes fits under the directory, then reopens it (still refused, with the same
/// error, while the disk is full). Writes work again as soon as space returns, with no restart.
pub(crate) struct SledBackend {
    dir: std::path::PathBuf,
    open: RwLock<Option<SledDb>>,
    out_of_space: AtomicBool,
}

struct SledDb {
    db: sled::Db,
    trees: [Tree; 5],
}

/// How much must fit on the disk before a store that ran out of space is reopened.
const SPACE_PROBE: usize = 1 << 20;

impl SledDb {
    fn open(dir: &std::path::Path) -> Result<Self, StoreError> {
        let db = sled::Config::new().path(dir).flush_every_ms(None).open()?;
        let tree = |id: TreeId| db.open_tree(id.name());
        let trees = [
            tree(TreeId::Configs)?,
            tree(TreeId::Heads)?,
            tree(TreeId::Endpoints)?,
            tree(TreeId::Instances)?,
            tree(TreeId::Meta)?,
        ];
        Ok(SledDb { db, trees })
    }

    fn tree(&self, id: TreeId) -> &Tree {
        &self.trees[id as usize]
    }
}

impl SledBackend {
    pub(crate) fn open(dir: &std::path::Path) -> Result<Self, StoreError> {
        Ok(SledBackend {
            dir: dir.to_path_buf(),
            open: RwLock::new(Some(SledDb::open(dir)?)),
            out_of_space: AtomicBool::new(false),
        })
    }

    /// Runs `f` on the open database.
    fn with_db<T>(
        &self,
        f: impl FnOnce(&SledDb) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        match self.open.read().unwrap_or_else(|p| p.into_inner()).as_ref() {
            Some(db) => f(db),
            None => Err(StoreError::Unavailable(format!(
                "the store under {} could not be reopened after running out of disk space; the next change tries again",
                self.dir.display()
            ))),
        }
    }

    /// Notes a failed write: one for want of space has sled refuse every later write.
    fn failed(&self, e: sled::Error) -> StoreError {
        let e = StoreError::from(e);
        if matches!(e, StoreError::OutOfSpace(_)) {
            self.out_of_space.store(true, Ordering::SeqCst);
        }
        e
    }

    /// After running out of space: reopens the database once a probe write fits.
    fn recover(&self) -> Result<(), StoreError> {
        use std::io::Write as _;
        let probe = self.dir.join("space-probe");
        let written = std::fs::File::create(&probe).and_then(|mut f| {
            f.write_all(&[0u8; SPACE_PROBE])?;
            f.sync_data()
        });
        let _ = std::fs::remove_file(&probe);
        written.map_err(|e| StoreError::from(sled::Error::Io(e)))?;
        let mut open = self.open.write().unwrap_or_else(|p| p.into_inner());
        // sled holds a lock on its directory until the last handle is dropped.
        *open = None;
        let mut reopened = SledDb::open(&self.dir);
        for _ in 0..20 {
            if reopened.is_ok() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
            reopened = SledDb::open(&self.dir);
        }
        *open = Some(reopened?);
        self.out_of_space.store(false, Ordering::SeqCst);
        tracing::info!(dir = %self.dir.display(), "disk space is back: the store takes changes again");
        Ok(())
    }
}

impl Backend for SledBackend {
    fn get(&self, tree: TreeId, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
        self.with_db(|db| Ok(db.tree(tree).get(key)?.map(|v| v.to_vec())))
    }

    fn scan(&self, tree: TreeId, prefix: &[u8]) -> Result<Entries, StoreError> {
        self.with_db(|db| {
            db.tree(tree)
                .scan_prefix(prefix)
                .map(|kv| {
                    let (k, v) = kv?;
                    Ok((k.to_vec(), v.to_vec()))
                })
                .collect()
        })
    }

    fn commit(&self, _from: ReadMark, ops: &[Op]) -> Result<(), StoreError> {
        if self.out_of_space.load(Ordering::SeqCst) {
            self.recover()?;
        }
        self.with_db(|db| self.commit_to(db, ops))
    }

    fn flush(&self) -> Result<(), StoreError> {
        self.with_db(|db| db.db.flush().map(drop).map_err(|e| self.failed(e)))
    }
}

impl SledBackend {
    fn commit_to(&self, db: &SledDb, ops: &[Op]) -> Result<(), StoreError> {
        let [c, h, e, i, m] = &db.trees;
        let result: Result<(), TransactionError<()>> =
            (c, h, e, i, m).transaction(|(c, h, e, i, m)| {
                let pick = |id: TreeId| -> &TransactionalTree {
                    match id {
                        TreeId::Configs => c,
                        TreeId::Heads => h,
                        TreeId::Endpoints => e,
                        TreeId::Instances => i,
                        TreeId::Meta => m,
                    }
                };
                for op in ops {
                    match op {
                        Op::Put(t, k, v) => {
                            pick(*t).insert(k.as_slice(), v.as_slice())?;
                        }
                        Op::Del(t, k) => {
                            pick(*t).remove(k.as_slice())?;
                        }
                    }
                }
                Ok(())
            });
        match result {
            Ok(()) => {}
            Err(TransactionError::Storage(e)) => return Err(self.failed(e)),
            Err(TransactionError::Abort(())) => unreachable!("the transaction never aborts"),
        }
        db.db.flush().map_err(|e| self.failed(e))?;
        Ok(())
    }
}

/// Describes an endpoint as stored: its record, the config revision it routes with, and its
/// registered instances.
#[derive(Debug, Clone)]
pub struct EndpointView {
    pub endpoint: Endpoint,
    pub config: EndpointConfig,
    pub registered: Vec<RegisteredInstance>,
    pub current_version: u64,
}

pub fn now_unix_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

fn revision_key(name: &str, revision: u64) -> Vec<u8> {
    let mut k = Vec::with_capacity(name.len() + 9);
    k.extend_from_slice(name.as_bytes());
    k.push(0);
    k.extend_from_slice(&revision.to_be_bytes());
    k
}

fn read_u64(bytes: &[u8]) -> u64 {
    let mut b = [0u8; 8];
    let n = bytes.len().min(8);
    b[..n].copy_from_slice(&bytes[..n]);
    u64::from_be_bytes(b)
}

fn decode<M: Message + Default>(tree: &'static str, bytes: &[u8]) -> Result<M, StoreError> {
    M::decode(bytes).map_err(|error| StoreError::Corrupt { tree, error })
}

impl Store {
    /// Opens (or creates) the sled store under `dir`. A fresh store starts at routing-table
    /// version 1 (an empty table), so a router that holds nothing (version 0) is always behind.
    pub fn open(dir: &std::path::Path) -> Result<Self, StoreError> {
        Self::with_backend(Box::new(SledBackend::open(dir)?))
    }

    /// A store over `backend`, initialized (version 1) if empty, with its table published.
    pub(crate) fn with_backend(backend: Box<dyn Backend>) -> Result<Self, StoreError> {
        let (published, _) = watch::channel(Arc::new(PublishedTable {
            version: 0,
            encoded: Bytes::new(),
        }));
        let store = Self {
            backend,
            write: Mutex::new(()),
            change_from: Mutex::new(ReadMark::default()),
            before_commit: Mutex::new(None),
            published,
        };
        {
            let _guard = store.lock();
            store.mutate(|| {
                if store.backend.get(TreeId::Meta, VERSION_KEY)?.is_none() {
                    store.commit(vec![], Some(1))?;
                }
                Ok(())
            })?;
            store.publish()?;
        }
        Ok(store)
    }

    /// Runs a change, again from its reads when another replica committed first (its reads
    /// brought up to date in between). A change refused for what its reads did not find (or
    /// found) is read again once from reads brought up to date: this replica's reads may not
    /// show yet a commit another replica acknowledged (a config created through one replica and
    /// updated at once through another). Call with the write lock held.
    fn mutate<T>(
        &self,
        mut change: impl FnMut() -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let mut synced = false;
        for _ in 0..COMMIT_ATTEMPTS {
            *self.change_from.lock().unwrap_or_else(|p| p.into_inner()) = self.backend.begin();
            match change() {
                Err(StoreError::Conflict) => self.backend.sync()?,
                Err(
                    StoreError::NotFound { .. }
                    | StoreError::AlreadyExists { .. }
                    | StoreError::VariantNotFound { .. },
                ) if !synced => {
                    synced = true;
                    self.backend.sync()?;
                }
                other => return other,
            }
        }
        Err(StoreError::Aborted(format!(
            "the change lost to concurrent changes from other control-plane replicas {COMMIT_ATTEMPTS} times; retry it"
        )))
    }

    /// Publishes the table again if the stored version moved without this replica (another
    /// replica committed). Called when the backend sees outside changes.
    pub(crate) fn republish_if_changed(&self) -> Result<(), StoreError> {
        let _guard = self.lock();
        if self.version()? != self.published().version {
            self.publish()?;
        }
        Ok(())
    }

    /// Runs `hook` just before every commit of this store, from the thread making the change
    /// (tests: another replica commits between this one's reads and its commit).
    #[doc(hidden)]
    pub fn before_commit(&self, hook: impl Fn() + Send + Sync + 'static) {
        *self.before_commit.lock().unwrap_or_else(|p| p.into_inner()) = Some(Arc::new(hook));
    }

    fn lock(&self) -> MutexGuard<'_, ()> {
        // A panic while holding the guard cannot leave sled half-written (transactions), so a
        // poisoned lock is safe to take over.
        self.write.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A receiver that always holds the latest published table.
    pub fn subscribe(&self) -> watch::Receiver<Arc<PublishedTable>> {
        self.published.subscribe()
    }

    pub fn published(&self) -> Arc<PublishedTable> {
        self.published.borrow().clone()
    }

    /// The current routing-table version.
    pub fn version(&self) -> Result<u64, StoreError> {
        Ok(self
            .backend
            .get(TreeId::Meta, VERSION_KEY)?
            .map(|v| read_u64(&v))
            .unwrap_or(1))
    }

    /// Commits `ops` atomically (with `new_version` written in the same commit when set),
    /// durably, and republishes the table if the version moved. Call with the write lock held.
    fn commit(&self, mut ops: Vec<Op>, new_version: Option<u64>) -> Result<(), StoreError> {
        if let Some(v) = new_version {
            ops.push(Op::Put(
                TreeId::Meta,
                VERSION_KEY.to_vec(),
                v.to_be_bytes().to_vec(),
            ));
        }
        let hook = self
            .before_commit
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        if let Some(hook) = hook {
            hook();
        }
        let from = *self.change_from.lock().unwrap_or_else(|p| p.into_inner());
        self.backend.commit(from, &ops)?;
        if new_version.is_some() {
            self.publish()?;
        }
        Ok(())
    }

    fn publish(&self) -> Result<(), StoreError> {
        let table = self.build_table()?;
        let version = table.version;
        let encoded = Bytes::from(table.encode_to_vec());
        self.published
            .send_replace(Arc::new(PublishedTable { version, encoded }));
        Ok(())
    }

    fn head(&self, name: &str) -> Result<Option<u64>, StoreError> {
        Ok(self
            .backend
            .get(TreeId::Heads, name.as_bytes())?
            .map(|v| read_u64(&v)))
    }

    fn config_at(&self, name: &str, revision: u64) -> Result<Option<EndpointConfig>, StoreError> {
        self.backend
            .get(TreeId::Configs, &revision_key(name, revision))?
            .map(|v| decode("config_revisions", &v))
            .transpose()
    }

    fn latest_config(&self, name: &str) -> Result<Option<EndpointConfig>, StoreError> {
        match self.head(name)? {
            Some(rev) => self.config_at(name, rev),
            None => Ok(None),
        }
    }

    fn endpoint(&self, name: &str) -> Result<Option<Endpoint>, StoreError> {
        self.backend
            .get(TreeId::Endpoints, name.as_bytes())?
            .map(|v| decode("endpoints", &v))
            .transpose()
    }

    fn all_endpoints(&self) -> Result<Vec<Endpoint>, StoreError> {
        self.backend
            .scan(TreeId::Endpoints, b"")?
            .iter()
            .map(|(_, v)| decode("endpoints", v))
            .collect()
    }

    fn all_instances(&self) -> Result<Vec<RegisteredInstance>, StoreError> {
        self.backend
            .scan(TreeId::Instances, b"")?
            .iter()
            .map(|(_, v)| decode("instances", v))
            .collect()
    }

    /// Puts an endpoint record re-stamped with the version at which its routes changed.
    fn touch_endpoint(mut e: Endpoint, version: u64, now: i64) -> Op {
        e.routing_table_version = version;
        e.last_modified_time_unix_ms = now;
        Op::Put(
            TreeId::Endpoints,
            e.endpoint_name.clone().into_bytes(),
            e.encode_to_vec(),
        )
    }

    // ---- endpoint configs ----

    pub fn create_config(
        &self,
        name: &str,
        variants: &[ProductionVariant],
    ) -> Result<EndpointConfig, StoreError> {
        model::validate_name("endpoint_config_name", name)?;
        let variants = model::validate_variants(variants)?;
        let _guard = self.lock();
        self.mutate(|| {
            if self.head(name)?.is_some() {
                return Err(StoreError::AlreadyExists {
                    kind: "endpoint config",
                    name: name.into(),
                });
            }
            let config = EndpointConfig {
                endpoint_config_name: name.into(),
                production_variants: variants.clone(),
                revision: 1,
                creation_time_unix_ms: now_unix_ms(),
            };
            self.commit(
                vec![
                    Op::Put(
                        TreeId::Configs,
                        revision_key(name, 1),
                        config.encode_to_vec(),
                    ),
                    Op::Put(
                        TreeId::Heads,
                        name.as_bytes().to_vec(),
                        1u64.to_be_bytes().to_vec(),
                    ),
                ],
                None,
            )?;
            Ok(config)
        })
    }

    /// Writes a new revision. Returns it and the routing-table version it produced (0 when no
    /// endpoint routes with this config, so routers see nothing new).
    pub fn update_config(
        &self,
        name: &str,
        variants: &[ProductionVariant],
        expected_revision: Option<u64>,
    ) -> Result<(EndpointConfig, u64), StoreError> {
        model::validate_name("endpoint_config_name", name)?;
        let variants = model::validate_variants(variants)?;
        let _guard = self.lock();
        self.mutate(|| {
            let head = self
                .head(name)?
                .ok_or_else(|| not_found("endpoint config", name))?;
            if let Some(expected) = expected_revision {
                if expected != head {
                    return Err(StoreError::FailedPrecondition(format!(
                        "endpoint config {name:?} is at revision {head}, not the expected_revision {expected}"
                    )));
                }
            }
            let now = now_unix_ms();
            let revision = head + 1;
            let config = EndpointConfig {
                endpoint_config_name: name.into(),
                production_variants: variants.clone(),
                revision,
                creation_time_unix_ms: now,
            };
            let mut ops = vec![
                Op::Put(
                    TreeId::Configs,
                    revision_key(name, revision),
                    config.encode_to_vec(),
                ),
                Op::Put(
                    TreeId::Heads,
                    name.as_bytes().to_vec(),
                    revision.to_be_bytes().to_vec(),
                ),
            ];
            let users: Vec<Endpoint> = self
                .all_endpoints()?
                .into_iter()
                .filter(|e| e.endpoint_config_name == name)
                .collect();
            let new_version = if users.is_empty() {
                None
            } else {
                Some(self.version()? + 1)
            };
            if let Some(v) = new_version {
                ops.extend(users.into_iter().map(|e| Self::touch_endpoint(e, v, now)));
            }
            self.commit(ops, new_version)?;
            Ok((config, new_version.unwrap_or(0)))
        })
    }

    /// The config at `revision` (latest when `None`), its latest revision, and the endpoints
    /// that route with it.
    pub fn describe_config(
        &self,
        name: &str,
        revision: Option<u64>,
    ) -> Result<(EndpointConfig, u64, Vec<String>), StoreError> {
        let _guard = self.lock();
        let head = self
            .head(name)?
            .ok_or_else(|| not_found("endpoint config", name))?;
        let rev = revision.unwrap_or(head);
        let config = self
            .config_at(name, rev)?
            .ok_or_else(|| not_found("endpoint config revision", &format!("{name}@{rev}")))?;
        let users = self
            .all_endpoints()?
            .into_iter()
            .filter(|e| e.endpoint_config_name == name)
            .map(|e| e.endpoint_name)
            .collect();
        Ok((config, head, users))
    }

    pub fn list_configs(&self) -> Result<Vec<EndpointConfig>, StoreError> {
        let _guard = self.lock();
        let mut out = Vec::new();
        for (k, v) in self.backend.scan(TreeId::Heads, b"")? {
            let name = String::from_utf8_lossy(&k).into_owned();
            if let Some(c) = self.config_at(&name, read_u64(&v))? {
                out.push(c);
            }
        }
        Ok(out)
    }

    pub fn delete_config(&self, name: &str) -> Result<(), StoreError> {
        let _guard = self.lock();
        self.mutate(|| {
            self.head(name)?
                .ok_or_else(|| not_found("endpoint config", name))?;
            let users: Vec<String> = self
                .all_endpoints()?
                .into_iter()
                .filter(|e| e.endpoint_config_name == name)
                .map(|e| e.endpoint_name)
                .collect();
            if !users.is_empty() {
                return Err(StoreError::FailedPrecondition(format!(
                    "endpoint config {name:?} is used by endpoint(s) {users:?}; point them elsewhere or delete them first"
                )));
            }
            let mut prefix = name.as_bytes().to_vec();
            prefix.push(0);
            let mut ops = vec![Op::Del(TreeId::Heads, name.as_bytes().to_vec())];
            for (k, _) in self.backend.scan(TreeId::Configs, &prefix)? {
                ops.push(Op::Del(TreeId::Configs, k));
            }
            self.commit(ops, None)
        })
    }

    // ---- endpoints ----

    pub fn create_endpoint(&self, name: &str, config_name: &str) -> Result<Endpoint, StoreError> {
        model::validate_name("endpoint_name", name)?;
        model::validate_name("endpoint_config_name", config_name)?;
        let _guard = self.lock();
        self.mutate(|| {
            if self.endpoint(name)?.is_some() {
                return Err(StoreError::AlreadyExists {
                    kind: "endpoint",
                    name: name.into(),
                });
            }
            self.head(config_name)?
                .ok_or_else(|| not_found("endpoint config", config_name))?;
            let now = now_unix_ms();
            let version = self.version()? + 1;
            let endpoint = Endpoint {
                endpoint_name: name.into(),
                endpoint_config_name: config_name.into(),
                creation_time_unix_ms: now,
                last_modified_time_unix_ms: now,
                routing_table_version: version,
            };
            self.commit(
                vec![Self::touch_endpoint(endpoint.clone(), version, now)],
                Some(version),
            )?;
            Ok(endpoint)
        })
    }

    pub fn update_endpoint(&self, name: &str, config_name: &str) -> Result<Endpoint, StoreError> {
        model::validate_name("endpoint_config_name", config_name)?;
        let _guard = self.lock();
        self.mutate(|| {
            let mut endpoint = self
                .endpoint(name)?
                .ok_or_else(|| not_found("endpoint", name))?;
            self.head(config_name)?
                .ok_or_else(|| not_found("endpoint config", config_name))?;
            let now = now_unix_ms();
            let version = self.version()? + 1;
            endpoint.endpoint_config_name = config_name.into();
            endpoint.routing_table_version = version;
            endpoint.last_modified_time_unix_ms = now;
            self.commit(
                vec![Self::touch_endpoint(endpoint.clone(), version, now)],
                Some(version),
            )?;
            Ok(endpoint)
        })
    }

    pub fn describe_endpoint(&self, name: &str) -> Result<EndpointView, StoreError> {
        let _guard = self.lock();
        let endpoint = self
            .endpoint(name)?
            .ok_or_else(|| not_found("endpoint", name))?;
        let config = self
            .latest_config(&endpoint.endpoint_config_name)?
            .ok_or_else(|| not_found("endpoint config", &endpoint.endpoint_config_name))?;
        let registered = self
            .all_instances()?
            .into_iter()
            .filter(|i| i.endpoint_name == name)
            .collect();
        Ok(EndpointView {
            endpoint,
            config,
            registered,
            current_version: self.version()?,
        })
    }

    pub fn list_endpoints(&self) -> Result<Vec<Endpoint>, StoreError> {
        let _guard = self.lock();
        self.all_endpoints()
    }

    /// Deletes the endpoint and its registered instances.
    pub fn delete_endpoint(&self, name: &str) -> Result<(), StoreError> {
        let _guard = self.lock();
        self.mutate(|| {
            self.endpoint(name)?
                .ok_or_else(|| not_found("endpoint", name))?;
            let mut ops = vec![Op::Del(TreeId::Endpoints, name.as_bytes().to_vec())];
            for inst in self
                .all_instances()?
                .into_iter()
                .filter(|i| i.endpoint_name == name)
            {
                ops.push(Op::Del(TreeId::Instances, inst.instance_id.into_bytes()));
            }
            let version = self.version()? + 1;
            self.commit(ops, Some(version))
        })
    }

    // ---- registered instances ----

    /// Registers a model server for a variant of an endpoint, with a lease. Registering an
    /// address that is already registered there renews its lease and returns the same id.
    pub fn register_instance(
        &self,
        endpoint_name: &str,
        variant_name: &str,
        address: &str,
        lease_ttl_seconds: u32,
    ) -> Result<RegisteredInstance, StoreError> {
        let address = model::normalize_instance_url("address", address)?;
        let ttl = model::validate_lease_ttl("lease_ttl_seconds", lease_ttl_seconds)?;
        let _guard = self.lock();
        self.mutate(|| {
            let endpoint = self
                .endpoint(endpoint_name)?
                .ok_or_else(|| not_found("endpoint", endpoint_name))?;
            let config = self
                .latest_config(&endpoint.endpoint_config_name)?
                .ok_or_else(|| not_found("endpoint config", &endpoint.endpoint_config_name))?;
            if !config
                .production_variants
                .iter()
                .any(|v| v.variant_name == variant_name)
            {
                return Err(StoreError::VariantNotFound {
                    variant: variant_name.into(),
                    endpoint: endpoint_name.into(),
                    config: config.endpoint_config_name,
                    revision: config.revision,
                });
            }
            let now = now_unix_ms();
            let expires = now + i64::from(ttl) * 1000;
            let existing = self.all_instances()?.into_iter().find(|i| {
                i.endpoint_name == endpoint_name
                    && i.variant_name == variant_name
                    && i.address == address
            });
            if let Some(mut inst) = existing {
                inst.lease_ttl_seconds = ttl;
                inst.lease_expires_unix_ms = expires;
                self.commit(
                    vec![Op::Put(
                        TreeId::Instances,
                        inst.instance_id.clone().into_bytes(),
                        inst.encode_to_vec(),
                    )],
                    None,
                )?;
                return Ok(inst);
            }
            let inst = RegisteredInstance {
                instance_id: uuid::Uuid::new_v4().to_string(),
                endpoint_name: endpoint_name.into(),
                variant_name: variant_name.into(),
                address: address.clone(),
                lease_ttl_seconds: ttl,
                lease_expires_unix_ms: expires,
            };
            let version = self.version()? + 1;
            self.commit(
                vec![
                    Op::Put(
                        TreeId::Instances,
                        inst.instance_id.clone().into_bytes(),
                        inst.encode_to_vec(),
                    ),
                    Self::touch_endpoint(endpoint, version, now),
                ],
                Some(version),
            )?;
            Ok(inst)
        })
    }

    /// A registered instance (called inside [`Store::mutate`], which reads again after bringing
    /// the reads up to date when this replica's mirror does not show it yet).
    fn registered(&self, instance_id: &str) -> Result<RegisteredInstance, StoreError> {
        self.backend
            .get(TreeId::Instances, instance_id.as_bytes())?
            .map(|v| decode("instances", &v))
            .transpose()?
            .ok_or_else(|| not_found("instance", instance_id))
    }

    pub fn renew_lease(&self, instance_id: &str) -> Result<RegisteredInstance, StoreError> {
        let _guard = self.lock();
        self.mutate(|| {
            let mut inst = self.registered(instance_id)?;
            inst.lease_expires_unix_ms = now_unix_ms() + i64::from(inst.lease_ttl_seconds) * 1000;
            self.commit(
                vec![Op::Put(
                    TreeId::Instances,
                    instance_id.as_bytes().to_vec(),
                    inst.encode_to_vec(),
                )],
                None,
            )?;
            Ok(inst)
        })
    }

    pub fn deregister_instance(&self, instance_id: &str) -> Result<(), StoreError> {
        let _guard = self.lock();
        self.mutate(|| {
            let inst = self.registered(instance_id)?;
            self.remove_instances(vec![inst])
        })
    }

    /// Removes every instance whose lease ran out before `now_ms`; returns how many.
    pub fn expire_leases(&self, now_ms: i64) -> Result<usize, StoreError> {
        let _guard = self.lock();
        self.mutate(|| {
            let expired: Vec<_> = self
                .all_instances()?
                .into_iter()
                .filter(|i| i.lease_expires_unix_ms < now_ms)
                .collect();
            let n = expired.len();
            if n > 0 {
                self.remove_instances(expired)?;
            }
            Ok(n)
        })
    }

    /// With the write lock held: deletes instances and re-stamps their endpoints, one version.
    fn remove_instances(&self, gone: Vec<RegisteredInstance>) -> Result<(), StoreError> {
        let now = now_unix_ms();
        let version = self.version()? + 1;
        let mut ops = Vec::new();
        let mut touched = std::collections::BTreeSet::new();
        for inst in gone {
            touched.insert(inst.endpoint_name.clone());
            ops.push(Op::Del(TreeId::Instances, inst.instance_id.into_bytes()));
        }
        for name in touched {
            if let Some(e) = self.endpoint(&name)? {
                ops.push(Self::touch_endpoint(e, version, now));
            }
        }
        self.commit(ops, Some(version))
    }

    // ---- the routing table ----

    /// Builds the full table from what is stored. Call with the write lock held so that the
    /// state and the version belong together.
    fn build_table(&self) -> Result<RoutingTable, StoreError> {
        let version = self.version()?;
        let mut instances = self.all_instances()?;
        // Registered instances join after the static ones, in address order.
        instances.sort_by(|a, b| a.address.cmp(&b.address));
        let mut endpoints = Vec::new();
        for endpoint in self.all_endpoints()? {
            let Some(config) = self.latest_config(&endpoint.endpoint_config_name)? else {
                continue;
            };
            let variants = config
                .production_variants
                .into_iter()
                .map(|v| {
                    let mut list: Vec<Instance> = v
                        .instances
                        .iter()
                        .map(|a| Instance {
                            instance_id: a.clone(),
                            address: a.clone(),
                        })
                        .collect();
                    for r in instances.iter().filter(|r| {
                        r.endpoint_name == endpoint.endpoint_name
                            && r.variant_name == v.variant_name
                    }) {
                        if !list.iter().any(|i| i.address == r.address) {
                            list.push(Instance {
                                instance_id: r.instance_id.clone(),
                                address: r.address.clone(),
                            });
                        }
                    }
                    VariantRoutes {
                        variant_name: v.variant_name,
                        model_name: v.model_name,
                        weight: v.initial_variant_weight.unwrap_or(1.0),
                        routing_config: v.routing_config,
                        instances: list,
                    }
                })
                .collect();
            endpoints.push(EndpointRoutes {
                endpoint_name: endpoint.endpoint_name,
                endpoint_config_name: config.endpoint_config_name,
                endpoint_config_revision: config.revision,
                variants,
            });
        }
        Ok(RoutingTable { version, endpoints })
    }

    /// The table at the current version, decoded (for tests and tools).
    pub fn routing_table(&self) -> Result<RoutingTable, StoreError> {
        let _guard = self.lock();
        self.build_table()
    }
}

impl Store {
    /// Flushes to disk (each change already does; this is for shutdown).
    pub fn flush(&self) -> Result<(), StoreError> {
        self.backend.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    type Keys = BTreeMap<(TreeId, Vec<u8>), Vec<u8>>;

    /// A replica's view of a shared store that lags behind the other replicas' commits until it
    /// syncs (as an etcd mirror fed by a watch does): commits compare against the shared commit
    /// count, as etcd's compare-and-swap does.
    struct Lagging {
        shared: Arc<Mutex<(u64, Keys)>>,
        view: Mutex<(u64, Keys)>,
    }

    impl Lagging {
        fn replicas(n: usize) -> Vec<Lagging> {
            let shared = Arc::new(Mutex::new((0, Keys::new())));
            (0..n)
                .map(|_| Lagging {
                    shared: shared.clone(),
                    view: Mutex::new((0, Keys::new())),
                })
                .collect()
        }
    }

    impl Backend for Lagging {
        fn get(&self, tree: TreeId, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
            Ok(self
                .view
                .lock()
                .unwrap()
                .1
                .get(&(tree, key.to_vec()))
                .cloned())
        }
        fn scan(&self, tree: TreeId, prefix: &[u8]) -> Result<Entries, StoreError> {
            let view = self.view.lock().unwrap();
            Ok(view
                .1
                .range((tree, prefix.to_vec())..)
                .take_while(|((t, k), _)| *t == tree && k.starts_with(prefix))
                .map(|((_, k), v)| (k.clone(), v.clone()))
                .collect())
        }
        fn begin(&self) -> ReadMark {
            ReadMark(self.view.lock().unwrap().0)
        }
        fn commit(&self, from: ReadMark, ops: &[Op]) -> Result<(), StoreError> {
            let mut shared = self.shared.lock().unwrap();
            if shared.0 != from.0 {
                return Err(StoreError::Conflict);
            }
            for op in ops {
                match op {
                    Op::Put(t, k, v) => shared.1.insert((*t, k.clone()), v.clone()),
                    Op::Del(t, k) => shared.1.remove(&(*t, k.clone())),
                };
            }
            shared.0 += 1;
            // a replica reads its own writes
            *self.view.lock().unwrap() = shared.clone();
            Ok(())
        }
        fn sync(&self) -> Result<(), StoreError> {
            *self.view.lock().unwrap() = self.shared.lock().unwrap().clone();
            Ok(())
        }
        fn flush(&self) -> Result<(), StoreError> {
            Ok(())
        }
    }

    fn variants(weight: f32) -> Vec<ProductionVariant> {
        vec![ProductionVariant {
            variant_name: "v1".into(),
            model_name: "m".into(),
            initial_variant_weight: Some(weight),
            instances: vec!["http://127.0.0.1:9".into()],
            ..Default::default()
        }]
    }

    #[test]
    fn a_config_created_through_one_replica_updates_at_once_through_another() {
        let mut backends = Lagging::replicas(2).into_iter();
        let a = Store::with_backend(Box::new(backends.next().unwrap())).unwrap();
        let b = Store::with_backend(Box::new(backends.next().unwrap())).unwrap();
        a.create_config("cfg", &variants(1.0)).unwrap();
        // b's reads do not show the create yet: the update must not answer NOT_FOUND
        let (updated, _) = b.update_config("cfg", &variants(2.0), None).unwrap();
        assert_eq!(updated.revision, 2);
        // and the other way round: a create of a name another replica holds is refused
        let Err(StoreError::AlreadyExists { .. }) = b.create_config("cfg", &variants(3.0)) else {
            panic!("a second create of cfg was not refused")
        };
        // an instance registered through a replica renews at once through the other
        a.create_endpoint("e", "cfg").unwrap();
        let inst = a
            .register_instance("e", "v1", "http://127.0.0.1:10", 30)
            .unwrap();
        b.renew_lease(&inst.instance_id).unwrap();
        // a name nobody created is still not found
        let Err(StoreError::NotFound { .. }) = b.update_config("nope", &variants(1.0), None) else {
            panic!("an update of a config nobody created did not answer NOT_FOUND")
        };
    }
}
