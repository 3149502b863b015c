//! The routing-table watch: one background task keeps a `WatchRoutingTable` stream open to the
//! control plane, validates each table, swaps it in, and ACKs (or NACKs and keeps the last good
//! one). Reconnects with exponential backoff and jitter; with the control plane gone the last good
//! table keeps serving. `--table-cache` keeps that table on disk across restarts. On the same
//! stream the router reports its status (requests waiting per endpoint and priority, for `prefixctl
//! endpoint describe`) when it changes, checked every [`STATUS_EVERY`]. A response with no nonce
//! and no table (only an older control plane sends one, relaying routers' cache evidence) is not
//! answered and is ignored: placement needs nothing from other routers.

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use prost::Message as _;
use proto::routing_discovery_client::RoutingDiscoveryClient;
use proto::{WatchRoutingTableRequest, WatchRoutingTableResponse};
use rand::Rng;
use tokio_stream::wrappers::ReceiverStream;

use crate::proxy::Router;
use crate::table::RoutingTable;

const BACKOFF_BASE: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(5);
const MAX_TABLE_BYTES: usize = 256 << 20;
/// How often the router looks whether its status changed since it last reported it.
pub(crate) const STATUS_EVERY: Duration = Duration::from_secs(1);

/// Exponential backoff with "equal jitter": a delay drawn from [d/2, d], d doubling up to the max.
#[derive(Debug)]
pub(crate) struct Backoff {
    base: Duration,
    max: Duration,
    next: Duration,
}

impl Backoff {
    pub(crate) fn new(base: Duration, max: Duration) -> Self {
        Backoff {
            base,
            max,
            next: base,
        }
    }

    pub(crate) fn next_delay(&mut self) -> Duration {
        let d = self.next;
        self.next = (self.next * 2).min(self.max);
        let half = d / 2;
        half + half.mul_f64(rand::rng().random::<f64>())
    }

    pub(crate) fn reset(&mut self) {
        self.next = self.base;
    }

    fn max_out(&mut self) {
        self.next = self.max;
    }
}

#[derive(Debug, thiserror::Error)]
enum WatchError {
    #[error("bad control-plane URL: {}", crate::proxy::error_chain(.0))]
    Url(tonic::transport::Error),
    #[error("cannot connect: {}", crate::proxy::error_chain(.0))]
    Connect(tonic::transport::Error),
    #[error("stream failed: {0}")]
    Status(#[from] tonic::Status),
    #[error("{0}")]
    Credentials(String),
}

impl WatchError {
    /// Errors that retrying soon will not fix (still retried, at the slowest pace: a router must
    /// keep serving and keep trying).
    fn is_fatal(&self) -> bool {
        match self {
            WatchError::Url(_) | WatchError::Credentials(_) => true,
            WatchError::Connect(_) => false,
            WatchError::Status(s) => matches!(
                s.code(),
                tonic::Code::Unimplemented
                    | tonic::Code::Unauthenticated
                    | tonic::Code::PermissionDenied
                    | tonic::Code::InvalidArgument
                    | tonic::Code::FailedPrecondition
            ),
        }
    }
}

/// How the data plane proves itself to the control plane: `--auth-token-file` (read at each
/// connect, so a rotated token is picked up on the next reconnect) and TLS for `https://`.
#[derive(Debug, Clone, Default)]
pub(crate) struct ControlPlaneCredentials {
    pub(crate) token_file: Option<PathBuf>,
    pub(crate) tls: proto::client::TlsOptions,
}

impl ControlPlaneCredentials {
    /// The `authorization` value to send, if a token file is set.
    fn authorization(&self) -> Result<Option<tonic::metadata::AsciiMetadataValue>, WatchError> {
        let Some(path) = &self.token_file else {
            return Ok(None);
        };
        let token = credentials::read_first(path)
            .map_err(|e| WatchError::Credentials(format!("--auth-token-file: {e}")))?;
        format!("Bearer {token}").parse().map(Some).map_err(|_| {
            WatchError::Credentials(format!(
                "--auth-token-file {}: the token has characters a header cannot carry",
                path.display()
            ))
        })
    }
}

/// The control planes of `--control-plane` (comma-separated), in order.
pub(crate) fn control_planes(list: &str) -> Vec<String> {
    let urls: Vec<String> = list
        .split(',')
        .map(str::trim)
        .filter(|u| !u.is_empty())
        .map(str::to_string)
        .collect();
    if urls.is_empty() {
        vec![list.to_string()]
    } else {
        urls
    }
}

/// Runs until dropped (aborted with the server). With several control planes, a stream that
/// breaks or cannot be opened moves the watch to the next one (in order, wrapping around), after
/// the usual backoff; the first request there carries the version this router holds, so an
/// up-to-date replica sends nothing again.
pub(crate) async fn run(
    router: Arc<Router>,
    urls: String,
    node_id: String,
    cache: Option<PathBuf>,
    credentials: ControlPlaneCredentials,
) {
    let urls = control_planes(&urls);
    let mut current = 0;
    let mut backoff = Backoff::new(BACKOFF_BASE, BACKOFF_MAX);
    let mut failures = 0u32;
    loop {
        let url = &urls[current];
        let result = watch_once(
            &router,
            url,
            &node_id,
            cache.as_deref(),
            &credentials,
            &mut backoff,
            &mut failures,
        )
        .await;
        router.metrics.control_plane_connected.store(0, Relaxed);
        match result {
            Ok(()) => {
                tracing::info!(control_plane = %url, "routing-table stream closed by the control plane")
            }
            Err(e) if e.is_fatal() => {
                tracing::error!(control_plane = %url, "routing-table watch: {e}; retrying every {BACKOFF_MAX:?}");
                backoff.max_out();
            }
            Err(e) => {
                failures += 1;
                // One warning per outage, not one per retry.
                if failures == 1 {
                    tracing::warn!(control_plane = %url, "routing-table watch: {e}; serving the last good table and retrying");
                } else {
                    tracing::debug!(control_plane = %url, failures, "routing-table watch: {e}");
                }
            }
        }
        if urls.len() > 1 {
            current = (current + 1) % urls.len();
            tracing::info!(control_plane = %urls[current], "routing-table watch moves to the next control plane");
        }
        tokio::time::sleep(backoff.next_delay()).await;
    }
}

async fn watch_once(
    router: &Router,
    url: &str,
    node_id: &str,
    cache: Option<&Path>,
    credentials: &ControlPlaneCredentials,
    backoff: &mut Backoff,
    failures: &mut u32,
) -> Result<(), WatchError> {
    let mut endpoint =
        tonic::transport::Endpoint::from_shared(url.to_string()).map_err(WatchError::Url)?;
    if let Some(tls) = credentials
        .tls
        .for_url(url)
        .map_err(|e| WatchError::Credentials(e.to_string()))?
    {
        endpoint = endpoint.tls_config(tls).map_err(WatchError::Url)?;
    }
    let authorization = credentials.authorization()?;
    let endpoint = endpoint
        .connect_timeout(Duration::from_secs(2))
        .tcp_nodelay(true)
        .http2_keep_alive_interval(Duration::from_secs(10))
        .keep_alive_timeout(Duration::from_secs(5))
        .keep_alive_while_idle(true);
    let channel = endpoint.connect().await.map_err(WatchError::Connect)?;
    let mut client =
        RoutingDiscoveryClient::new(channel).max_decoding_message_size(MAX_TABLE_BYTES);
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    let held = router.table.load().as_ref().map_or(0, |t| t.version());
    let mut reported = status(router);
    // The channel has room: the first message is queued before the call starts.
    let _ = tx.try_send(WatchRoutingTableRequest {
        node_id: node_id.to_string(),
        applied_version: held,
        status: Some(reported.clone()),
        ..Default::default()
    });
    let mut request = tonic::Request::new(ReceiverStream::new(rx));
    if let Some(value) = authorization {
        request.metadata_mut().insert("authorization", value);
    }
    let mut inbound = client.watch_routing_table(request).await?.into_inner();
    router.metrics.control_plane_connected.store(1, Relaxed);
    if *failures > 0 {
        tracing::info!(control_plane = %url, "routing-table watch reconnected");
        *failures = 0;
    }
    backoff.reset();
    let mut check = tokio::time::interval(STATUS_EVERY);
    check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            response = inbound.message() => {
                let Some(response) = response? else { break };
                if response.nonce.is_empty() && response.routing_table.is_empty() {
                    continue;
                }
                let (answer, applied) = apply(router, node_id, response);
                if tx.send(answer).await.is_err() {
                    break;
                }
                if let (Some(path), Some(bytes)) = (cache, applied) {
                    let path = path.to_path_buf();
                    let written =
                        tokio::task::spawn_blocking(move || write_atomically(&path, &bytes)).await;
                    if let Ok(Err(e)) = written {
                        tracing::warn!("cannot write the table cache: {e}");
                    }
                }
            }
            _ = check.tick() => {
                let now = status(router);
                if now == reported {
                    continue;
                }
                let report = WatchRoutingTableRequest {
                    node_id: node_id.to_string(),
                    applied_version: router.table.load().as_ref().map_or(0, |t| t.version()),
                    status: Some(now.clone()),
                    ..Default::default()
                };
                if tx.send(report).await.is_err() {
                    break;
                }
                reported = now;
            }
        }
    }
    Ok(())
}

/// What the router reports of itself: the requests waiting per endpoint of its table.
fn status(router: &Router) -> proto::RouterStatus {
    let table = router.table.load();
    let Some(table) = table.as_deref() else {
        return proto::RouterStatus::default();
    };
    proto::RouterStatus {
        queues: crate::flow::endpoint_queues(table),
    }
}

/// Applies one response; returns the ACK/NACK and, for a newly applied table, its encoding.
fn apply(
    router: &Router,
    node_id: &str,
    response: WatchRoutingTableResponse,
) -> (WatchRoutingTableRequest, Option<Bytes>) {
    let current = router.table.load_full();
    let held = current.as_ref().map_or(0, |t| t.version());
    let encoded = response.routing_table.clone();
    let result = decode(&response).and_then(|wire| {
        if current.is_some() && wire.version == held {
            return Ok(None); // already serving it (e.g. a resend after reconnect)
        }
        RoutingTable::build(wire, current.as_deref())
            .map(Some)
            .map_err(|e| e.to_string())
    });
    let answer = |applied_version, error_detail| WatchRoutingTableRequest {
        node_id: node_id.to_string(),
        applied_version,
        response_nonce: response.nonce.clone(),
        error_detail,
        status: None,
    };
    match result {
        Ok(Some(table)) => {
            let version = table.version();
            store(router, table);
            tracing::info!(version, "routing table applied");
            (answer(version, String::new()), Some(encoded))
        }
        Ok(None) => (answer(held, String::new()), None),
        Err(detail) => {
            router.metrics.tables_rejected.fetch_add(1, Relaxed);
            tracing::warn!(
                version = response.version,
                held,
                "routing table rejected: {detail}"
            );
            (answer(held, detail), None)
        }
    }
}

fn decode(response: &WatchRoutingTableResponse) -> Result<proto::RoutingTable, String> {
    let mut wire = proto::RoutingTable::decode(response.routing_table.clone()).map_err(|e| {
        format!(
            "cannot decode routing_table of version {}: {e}",
            response.version
        )
    })?;
    if wire.version == 0 {
        wire.version = response.version;
    } else if response.version != 0 && wire.version != response.version {
        return Err(format!(
            "routing_table.version {} differs from the response version {}",
            wire.version, response.version
        ));
    }
    if wire.version == 0 {
        return Err("routing table version 0 is reserved for \"no table\"".to_string());
    }
    Ok(wire)
}

fn store(router: &Router, table: RoutingTable) {
    router.metrics.table_version.store(table.version(), Relaxed);
    router.metrics.tables_applied.fetch_add(1, Relaxed);
    let table = Arc::new(table);
    let old = router.table.swap(Some(table.clone()));
    router.table_applied.notify_waiters();
    router.flow.table_changed(old.as_deref(), &table);
}

/// Loads `--table-cache` at start, so the router serves before the control plane answers.
pub(crate) fn load_cache(router: &Router, path: &Path) -> Result<Option<u64>, String> {
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(format!("cannot read table cache {}: {e}", path.display())),
    };
    let wire = proto::RoutingTable::decode(bytes.as_slice())
        .map_err(|e| format!("cannot decode table cache {}: {e}", path.display()))?;
    let table = RoutingTable::build(wire, None)
        .map_err(|e| format!("invalid table cache {}: {e}", path.display()))?;
    let version = table.version();
    store(router, table);
    Ok(Some(version))
}

/// Temp file in the same directory, fsync, rename: readers see the old or the new file, never half.
fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write as _;
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(format!(".tmp-{}", std::process::id()));
    let tmp = PathBuf::from(tmp);
    let result = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_plane_lists() {
        assert_eq!(control_planes("http://a:1"), ["http://a:1"]);
        assert_eq!(
            control_planes("http://a:1, http://b:2,,http://c:3"),
            ["http://a:1", "http://b:2", "http://c:3"]
        );
    }

    #[test]
    fn backoff_doubles_with_jitter_and_resets() {
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
        let mut ceilings = Vec::new();
        for _ in 0..10 {
            let d = b.next_delay();
            ceilings.push(d);
        }
        assert!(
            ceilings[0] >= Duration::from_millis(50) && ceilings[0] <= Duration::from_millis(100)
        );
        assert!(
            ceilings[1] >= Duration::from_millis(100) && ceilings[1] <= Duration::from_millis(200)
        );
        assert!(
            ceilings[9] >= Duration::from_millis(2500) && ceilings[9] <= Duration::from_secs(5)
        );
        b.reset();
        assert!(b.next_delay() <= Duration::from_millis(100));
    }

    proptest::proptest! {
        #![proptest_config(proptest::test_runner::Config {
            rng_seed: proptest::test_runner::RngSeed::Fixed(0x15),
            failure_persistence: None,
            ..proptest::test_runner::Config::default()
        })]

        /// Whatever bytes arrive as a table: a NACK naming the problem and the last good table
        /// kept, or a valid table applied and ACKed. Never a panic.
        #[test]
        fn arbitrary_table_bytes_are_nacked_or_applied(
            version in 0u64..4,
            bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..256),
        ) {
            let config = crate::Config::default();
            let router = Router::new(
                &config,
                crate::access::Access::load(&config).unwrap(),
                crate::upstream::tls_connector(None).unwrap(),
            );
            let response = WatchRoutingTableResponse {
                version,
                nonce: "n1".into(),
                routing_table: bytes.into(),
            };
            let (answer, applied) = apply(&router, "node", response);
            proptest::prop_assert_eq!(answer.response_nonce, "n1");
            match router.table.load().as_ref() {
                Some(t) => {
                    proptest::prop_assert!(answer.error_detail.is_empty());
                    proptest::prop_assert_eq!(answer.applied_version, t.version());
                    proptest::prop_assert!(applied.is_some());
                }
                None => {
                    proptest::prop_assert!(!answer.error_detail.is_empty());
                    proptest::prop_assert_eq!(answer.applied_version, 0);
                    proptest::prop_assert_eq!(router.metrics.tables_rejected.load(Relaxed), 1);
                }
            }
        }
    }

    #[test]
    fn atomic_write_replaces_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("table.bin");
        write_atomically(&p, b"one").unwrap();
        write_atomically(&p, b"two").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"two");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }
}
