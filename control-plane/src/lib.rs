//! prefix-router control plane.
//!
//! Map:
//! - [`model`]: validation of API input into normalized stored shapes (errors name field and value).
//! - [`store`]: sled-backed state (configs with every revision, endpoints, leased instances, the
//!   routing-table version) and the routing table derived from it, published once per version.
//! - [`service`]: the `ControlPlane` gRPC API over the store.
//! - [`discovery`]: `RoutingDiscovery.WatchRoutingTable`, xDS-style push with nonces, ACK/NACK and
//!   per-node rollout status.
//! - [`rpc_layer`]: a tower layer around every gRPC call: per-method metrics, and the caller's W3C
//!   trace context made current, so the service methods' spans join the caller's trace.
//! - [`metrics`]: Prometheus text on `--metrics-listen` (RPCs by method and code, watch streams,
//!   routing-table version, per-node applied version and lag).
//!
//! Invariants: every change that affects routing bumps the one routing-table version in the same
//! sled transaction as the change and is flushed before the RPC returns; nothing is written before
//! validation passes; the control plane is the only writer of its data dir (sled's file lock).

pub mod auth;
pub mod discovery;
pub mod etcd;
pub mod metrics;
pub mod model;
pub mod rpc_layer;
pub mod service;
pub mod store;

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;

use discovery::{Discovery, NodeRegistry};
use service::ControlPlaneService;
use store::Store;

/// Control-plane settings (also its command line).
#[derive(Debug, Clone, clap::Parser)]
#[command(
    name = "control-plane",
    version,
    about = "prefix-router control plane: endpoint configs in sled, routing tables streamed to data planes over gRPC"
)]
pub struct Config {
    /// Address to serve gRPC on.
    #[arg(long, default_value = "127.0.0.1:7070")]
    pub listen: SocketAddr,
    /// Directory of the sled database (created if missing). Not used with --etcd-endpoints.
    #[arg(long, default_value = "./.prefix-router/control-plane")]
    pub data_dir: PathBuf,
    /// Keep the state in etcd instead of sled, so that several control-plane replicas share it:
    /// comma-separated client URLs of the etcd members (e.g. http://a:2379,http://b:2379, or
    /// unix:///PATH for a member on a unix socket, unixs:///PATH with TLS).
    #[arg(long, value_name = "URL,URL,...", value_delimiter = ',')]
    pub etcd_endpoints: Vec<String>,
    /// Key prefix of this control plane's state in etcd.
    #[arg(long, default_value = "/prefix-router/", value_name = "PREFIX")]
    pub etcd_prefix: String,
    /// PEM CA certificate of etcd's https:// client URLs (default: the system's roots).
    #[arg(long, value_name = "PEM")]
    pub etcd_ca_cert: Option<PathBuf>,
    /// PEM client certificate for an etcd that requires one (--client-cert-auth), with
    /// --etcd-key.
    #[arg(long, value_name = "PEM", requires = "etcd_key")]
    pub etcd_cert: Option<PathBuf>,
    /// PEM private key of --etcd-cert.
    #[arg(long, value_name = "PEM", requires = "etcd_cert")]
    pub etcd_key: Option<PathBuf>,
    /// etcd user, for an etcd with authentication enabled (with --etcd-password-file).
    #[arg(long, value_name = "NAME", requires = "etcd_password_file")]
    pub etcd_user: Option<String>,
    /// File whose first line is --etcd-user's password.
    #[arg(long, value_name = "PATH", requires = "etcd_user")]
    pub etcd_password_file: Option<PathBuf>,
    /// How often expired instance leases are looked for, in milliseconds.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(10..=60_000))]
    pub lease_check_interval_ms: u64,
    /// Address to serve Prometheus metrics on (`GET /metrics`), e.g. 127.0.0.1:7071. Default: off.
    #[arg(long, value_name = "HOST:PORT")]
    pub metrics_listen: Option<SocketAddr>,
    /// Bearer tokens, one per line as `TOKEN ROLE` (ROLE `admin`, the default, or `reader`:
    /// Describe, List and WatchRoutingTable only). Every RPC then needs `authorization: Bearer
    /// TOKEN`. Re-read when the file changes and on SIGHUP.
    #[arg(long, value_name = "PATH")]
    pub auth_token_file: Option<PathBuf>,
    /// PEM certificate chain: serve gRPC over TLS (with --tls-key).
    #[arg(long, value_name = "PEM", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of --tls-cert.
    #[arg(long, value_name = "PEM", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// PEM CA certificates: require a client certificate signed by one of them (mutual TLS).
    #[arg(long, value_name = "PEM", requires = "tls_cert")]
    pub tls_client_ca: Option<PathBuf>,
    /// Serve on a non-loopback address with neither --auth-token-file nor --tls-client-ca:
    /// anyone who reaches the port can then change routing.
    #[arg(long)]
    pub insecure: bool,
    /// Most WatchRoutingTable streams open at once (past it: RESOURCE_EXHAUSTED).
    #[arg(long, default_value_t = 4096, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_watch_streams: u32,
    /// Largest gRPC request message accepted, in bytes (past it: RESOURCE_EXHAUSTED).
    #[arg(long, default_value_t = 4 << 20, value_parser = clap::value_parser!(u64).range(1024..=(256 << 20)))]
    pub max_message_bytes: u64,
    /// Logs and traces (used by the binary; `serve` ignores them).
    #[command(flatten)]
    pub telemetry: telemetry::TelemetryArgs,
}

/// What [`serve_with`] runs besides the gRPC API.
#[derive(Debug)]
pub struct ServeOptions {
    /// How often expired instance leases are looked for.
    pub lease_check_interval: Duration,
    /// Where to serve `GET /metrics`, if anywhere.
    pub metrics_listener: Option<TcpListener>,
    /// Tokens every call must carry (`--auth-token-file`); `None`: no authentication.
    pub auth: Option<Arc<credentials::SecretFile<auth::Role>>>,
    /// TLS (and mTLS) settings; `None`: plaintext.
    pub tls: Option<tonic::transport::ServerTlsConfig>,
    /// `--max-watch-streams`.
    pub max_watch_streams: usize,
    /// `--max-message-bytes`.
    pub max_message_bytes: usize,
    /// With the etcd store: the data planes of the other replicas, and where to share this one's.
    pub cluster: Option<Arc<etcd::ClusterNodes>>,
}

impl Default for ServeOptions {
    fn default() -> Self {
        ServeOptions {
            lease_check_interval: Duration::from_secs(1),
            metrics_listener: None,
            auth: None,
            tls: None,
            max_watch_streams: 4096,
            max_message_bytes: 4 << 20,
            cluster: None,
        }
    }
}

impl Config {
    /// Refuses to expose an unauthenticated API beyond loopback unless `--insecure`.
    pub fn check_exposure(&self) -> anyhow::Result<()> {
        let authenticated = self.auth_token_file.is_some() || self.tls_client_ca.is_some();
        if !authenticated && !self.listen.ip().is_loopback() && !self.insecure {
            anyhow::bail!(
                "refusing to serve on {} without --auth-token-file: anyone who reaches it could change routing (give --auth-token-file PATH or --tls-client-ca PEM, or --insecure to serve unauthenticated anyway)",
                self.listen
            );
        }
        Ok(())
    }

    /// The TLS settings of `--tls-cert`, `--tls-key` and `--tls-client-ca`.
    pub fn tls(&self) -> anyhow::Result<Option<tonic::transport::ServerTlsConfig>> {
        let (Some(cert), Some(key)) = (&self.tls_cert, &self.tls_key) else {
            return Ok(None);
        };
        let read = |path: &PathBuf, flag: &str| {
            std::fs::read(path).with_context(|| format!("cannot read {flag} {}", path.display()))
        };
        let identity = tonic::transport::Identity::from_pem(
            read(cert, "--tls-cert")?,
            read(key, "--tls-key")?,
        );
        let mut tls = tonic::transport::ServerTlsConfig::new().identity(identity);
        if let Some(ca) = &self.tls_client_ca {
            tls = tls.client_ca_root(tonic::transport::Certificate::from_pem(read(
                ca,
                "--tls-client-ca",
            )?));
        }
        Ok(Some(tls))
    }
}

/// Opens the store, with an error that names the data dir.
pub fn open_store(data_dir: &std::path::Path) -> anyhow::Result<Arc<Store>> {
    std::fs::create_dir_all(data_dir)
        .with_context(|| format!("cannot use data dir {}", data_dir.display()))?;
    match Store::open(data_dir) {
        Ok(store) => Ok(Arc::new(store)),
        // sled's text for this one repeats the OS error's debug form; say what it means.
        Err(store::StoreError::Storage(sled::Error::Io(e)))
            if e.to_string().contains("could not acquire lock") =>
        {
            anyhow::bail!(
                "cannot open data dir {}: it is locked by another process (another control-plane?)",
                data_dir.display()
            )
        }
        Err(e) => Err(e).with_context(|| format!("cannot open data dir {}", data_dir.display())),
    }
}

/// The part of start-up that can fail before the API socket is announced: the store opened and
/// the metrics socket bound. The binary calls it before it says it listens.
pub async fn prepare(config: &Config) -> anyhow::Result<(Arc<Store>, ServeOptions)> {
    config.check_exposure()?;
    let auth = match &config.auth_token_file {
        Some(path) => Some(auth::open_token_file(path).context("--auth-token-file")?),
        None => None,
    };
    let tls = config.tls()?;
    let (store, cluster) = if config.etcd_endpoints.is_empty() {
        (open_store(&config.data_dir)?, None)
    } else {
        let tls = proto::client::TlsOptions::from_files(
            config.etcd_ca_cert.as_deref(),
            config.etcd_cert.as_deref().zip(config.etcd_key.as_deref()),
        )
        .context("etcd TLS (--etcd-ca-cert, --etcd-cert, --etcd-key)")?;
        let user = match (&config.etcd_user, &config.etcd_password_file) {
            (Some(name), Some(file)) => Some(etcd::EtcdUser {
                name: name.clone(),
                password: credentials::read_first(file).context("--etcd-password-file")?,
            }),
            _ => None,
        };
        let etcd = etcd::open(&etcd::EtcdSettings {
            endpoints: config.etcd_endpoints.clone(),
            prefix: config.etcd_prefix.clone(),
            tls,
            user,
        })
        .await?;
        (etcd.store, Some(etcd.cluster))
    };
    let metrics_listener = match config.metrics_listen {
        Some(addr) => Some(
            TcpListener::bind(addr)
                .await
                .with_context(|| format!("cannot listen on {addr} (--metrics-listen)"))?,
        ),
        None => None,
    };
    let options = ServeOptions {
        lease_check_interval: Duration::from_millis(config.lease_check_interval_ms),
        metrics_listener,
        auth,
        tls,
        max_watch_streams: config.max_watch_streams as usize,
        max_message_bytes: config.max_message_bytes as usize,
        cluster,
    };
    Ok((store, options))
}

/// Serves the control plane on `listener` until `shutdown` resolves, then stops watch streams,
/// drains in-flight calls and flushes the store.
pub async fn serve(
    listener: TcpListener,
    config: Config,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let (store, options) = prepare(&config).await?;
    serve_with(listener, store, options, shutdown).await
}

/// Like [`serve`], with a store the caller opened (embedded use, e.g. `prefixctl up`).
pub async fn serve_store(
    listener: TcpListener,
    store: Arc<Store>,
    lease_check_interval: Duration,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    serve_with(
        listener,
        store,
        ServeOptions {
            lease_check_interval,
            ..ServeOptions::default()
        },
        shutdown,
    )
    .await
}

/// Like [`serve_store`], with every option (e.g. a metrics listener).
pub async fn serve_with(
    listener: TcpListener,
    store: Arc<Store>,
    options: ServeOptions,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let nodes = Arc::new(NodeRegistry::default());
    let rpc_stats = Arc::new(metrics::RpcStats::default());
    let throttle = Arc::new(credentials::Throttle::default());
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);

    let reaper = tokio::spawn(reap_leases(
        store.clone(),
        options.lease_check_interval,
        stop_rx.clone(),
    ));
    let metrics_server = options.metrics_listener.map(|l| {
        if let Ok(addr) = l.local_addr() {
            tracing::info!(%addr, "serving Prometheus metrics on /metrics");
        }
        let source = metrics::MetricsSource {
            rpc: rpc_stats.clone(),
            nodes: nodes.clone(),
            store: store.clone(),
            throttle: throttle.clone(),
        };
        let mut stop = stop_rx.clone();
        tokio::spawn(metrics::serve(l, source, async move {
            let _ = stop.wait_for(|&s| s).await;
        }))
    });

    // Both reflection protocols: v1, and v1alpha for the clients that know only it
    // (grpcio-reflection, older grpcurl and Postman builds).
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(proto::v1::FILE_DESCRIPTOR_SET)
        .build_v1()
        .context("building gRPC reflection service (v1)")?;
    let reflection_v1alpha = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(proto::v1::FILE_DESCRIPTOR_SET)
        .build_v1alpha()
        .context("building gRPC reflection service (v1alpha)")?;

    let local = listener.local_addr().ok();
    tracing::info!(
        listen = ?local,
        auth = options.auth.is_some(),
        tls = options.tls.is_some(),
        "control plane serving"
    );
    let token_reload = options
        .auth
        .as_ref()
        .map(|tokens| tokens.spawn_reload("auth token file"));
    let sharing = options.cluster.clone().map(|cluster| {
        let stop = stop_rx.clone();
        tokio::spawn(cluster.share(nodes.clone(), stop))
    });
    let mut builder = tonic::transport::Server::builder();
    if let Some(tls) = options.tls {
        builder = builder
            .tls_config(tls)
            .context("configuring TLS (--tls-cert, --tls-key, --tls-client-ca)")?;
    }
    let max_message = options.max_message_bytes;
    let result = builder
        .layer(rpc_layer::RpcLayer::new(rpc_stats))
        .layer(auth::AuthLayer::new(options.auth, throttle))
        .add_service(
            proto::control_plane_server::ControlPlaneServer::new(
                ControlPlaneService::new(store.clone(), nodes.clone())
                    .with_cluster(options.cluster),
            )
            .max_decoding_message_size(max_message),
        )
        .add_service(
            proto::routing_discovery_server::RoutingDiscoveryServer::new(
                Discovery::new(store.clone(), nodes, stop_rx)
                    .with_max_streams(options.max_watch_streams),
            )
            .max_decoding_message_size(max_message),
        )
        .add_service(reflection)
        .add_service(reflection_v1alpha)
        .serve_with_incoming_shutdown(TcpListenerStream::new(listener), async move {
            shutdown.await;
            // End the watch streams so the graceful drain does not wait on them.
            let _ = stop_tx.send(true);
        })
        .await;
    if let Some(t) = token_reload {
        t.abort();
    }
    if let Some(t) = sharing {
        t.abort();
    }
    reaper.abort();
    if let Some(m) = metrics_server {
        m.abort();
    }
    let flushed = store.flush();
    result.context("gRPC server failed")?;
    flushed.context("flushing the store")?;
    tracing::info!("control plane stopped");
    Ok(())
}

async fn reap_leases(
    store: Arc<Store>,
    every: Duration,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.changed() => return,
        }
        let s = store.clone();
        match tokio::task::spawn_blocking(move || s.expire_leases(store::now_unix_ms())).await {
            Ok(Ok(0)) => {}
            Ok(Ok(n)) => tracing::info!(expired = n, "removed instances whose lease ran out"),
            Ok(Err(e)) => tracing::error!(error = %e, "lease expiry failed"),
            Err(e) => tracing::error!(error = %e, "lease expiry task failed"),
        }
    }
}

/// Resolves on SIGINT or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! { _ = ctrl_c => {}, _ = term => {} }
}

#[cfg(test)]
mod tests {
    use clap::Parser as _;

    #[test]
    fn exposure_needs_credentials_or_insecure() {
        let check = |args: &[&str]| {
            let mut all = vec!["control-plane"];
            all.extend_from_slice(args);
            super::Config::parse_from(all).check_exposure()
        };
        assert!(check(&[]).is_ok(), "loopback by default");
        assert!(check(&["--listen", "[::1]:7070"]).is_ok());
        let e = check(&["--listen", "0.0.0.0:7070"])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("0.0.0.0:7070") && e.contains("--insecure"),
            "{e}"
        );
        assert!(check(&["--listen", "0.0.0.0:7070", "--insecure"]).is_ok());
        assert!(check(&["--listen", "0.0.0.0:7070", "--auth-token-file", "t"]).is_ok());
        assert!(check(&[
            "--listen",
            "0.0.0.0:7070",
            "--tls-cert",
            "c",
            "--tls-key",
            "k",
            "--tls-client-ca",
            "ca"
        ])
        .is_ok());
    }
}
