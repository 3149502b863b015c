//! `prefixctl up`: the all-in-one local fleet in one process.
//!
//! Starts the control plane (embedded: sled under `--data-dir`/control-plane, the same layout as
//! a standalone `control-plane --data-dir`), `--engines` engine-sim instances, and one data plane;
//! creates, or on a later run updates, the endpoint config and endpoint `default` (variant `v1`
//! over the engines); prints the URLs and a curl line; and runs until SIGINT or SIGTERM.
//!
//! The control plane requires a token: `up` makes one (256 random bits) in `--data-dir`/admin-token
//! (mode 0600) on its first run, keeps it for later runs, gives it to its data plane, and prints
//! its path for `prefixctl --bearer-token-file`.
//!
//! Shutdown runs front to back so nothing in flight is cut: the data plane drains first, then the
//! engines stop, then the control plane ends its watch streams and flushes sled. Each server
//! also prints `NAME listening on ADDR` on stderr, like the standalone binaries.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use anyhow::Context;
use proto::client::{Client, Error as ApiError};
use proto::{ProductionVariant, RoutingConfig, RoutingStrategy};
use serde::Serialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tonic::Code;

use crate::args::{OutputFormat, UpArgs, DEFAULT_CONTROL_PLANE};
use crate::output::{emit, key_values, Report};
use crate::variants::parse_strategy;

/// Name of the endpoint config and the endpoint `up` manages.
pub const ENDPOINT: &str = "default";
/// Name of the one production variant.
pub const VARIANT: &str = "v1";
/// The data plane's node id in rollout status.
pub const NODE_ID: &str = "prefixctl-up";

/// How long in-flight requests may take to finish when the fleet stops.
const DRAIN_GRACE: Duration = Duration::from_secs(10);
/// How long the data plane may take to apply its first routing table.
const READY_WITHIN: Duration = Duration::from_secs(20);

/// What `up` started, as printed (and as `--output json` prints it).
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "PascalCase")]
pub struct FleetDoc {
    pub control_plane_url: String,
    pub data_plane_url: String,
    pub engine_urls: Vec<String>,
    pub data_dir: String,
    /// The control plane's admin token (`prefixctl --bearer-token-file`).
    pub token_file: String,
    pub endpoint_name: String,
    pub endpoint_config_name: String,
    pub endpoint_config_revision: u64,
    pub variant_name: String,
    pub routing_strategy: String,
    pub ready: bool,
}

impl Report for FleetDoc {
    fn table(&self) -> String {
        let engines = match (self.engine_urls.first(), self.engine_urls.last()) {
            (Some(first), Some(last))
                if self.engine_urls.len() > 2 && consecutive(&self.engine_urls) =>
            {
                format!("{} engine-sim at {first} .. {last}", self.engine_urls.len())
            }
            _ => format!(
                "{} engine-sim at {}",
                self.engine_urls.len(),
                self.engine_urls.join(", ")
            ),
        };
        let ctl = if self.control_plane_url == DEFAULT_CONTROL_PLANE {
            format!("prefixctl --bearer-token-file {}", self.token_file)
        } else {
            format!(
                "prefixctl --control-plane {} --bearer-token-file {}",
                self.control_plane_url, self.token_file
            )
        };
        let mut out = format!(
            "prefix-router is up{} (Ctrl-C stops it)\n",
            if self.ready {
                ""
            } else {
                ", data plane NOT ready yet"
            }
        );
        out.push_str(&indent(&key_values(&[
            (
                "control plane:",
                format!("{}  (data in {})", self.control_plane_url, self.data_dir),
            ),
            (
                "admin token:",
                format!("{} (keep it secret)", self.token_file),
            ),
            ("data plane:", self.data_plane_url.clone()),
            ("engines:", engines),
            (
                "endpoint:",
                format!(
                    "{} (endpoint config {} revision {}, variant {}, {})",
                    self.endpoint_name,
                    self.endpoint_config_name,
                    self.endpoint_config_revision,
                    self.variant_name,
                    self.routing_strategy
                ),
            ),
        ])));
        out.push_str(&format!(
            "\nTry it:\n  curl -s {}/v1/chat/completions -H 'content-type: application/json' \
             -d '{{\"model\":\"{}\",\"messages\":[{{\"role\":\"user\",\"content\":\"Hello!\"}}],\"max_tokens\":16}}'\n",
            self.data_plane_url, self.endpoint_name
        ));
        out.push_str(&format!(
            "\nSwap the routing strategy live, from another terminal:\n  {ctl} endpoint-config update --endpoint-config-name {} \
             --variant-name {} --routing-strategy PREFIX_AWARE\n  {ctl} endpoint describe --endpoint-name {}\n",
            self.endpoint_config_name, self.variant_name, self.endpoint_name
        ));
        out
    }
}

fn indent(text: &str) -> String {
    text.lines().map(|l| format!("  {l}\n")).collect()
}

fn consecutive(urls: &[String]) -> bool {
    let ports: Vec<Option<u16>> = urls
        .iter()
        .map(|u| u.rsplit(':').next().and_then(|p| p.parse().ok()))
        .collect();
    ports
        .windows(2)
        .all(|w| matches!((w[0], w[1]), (Some(a), Some(b)) if a.checked_add(1) == Some(b)))
}

/// Runs the fleet until SIGINT/SIGTERM (or until one of its servers fails).
pub async fn run(args: &UpArgs, output: OutputFormat) -> anyhow::Result<()> {
    let strategy = parse_strategy(&args.routing_strategy, VARIANT)?;
    if !(args.time_scale.is_finite() && args.time_scale > 0.0) {
        anyhow::bail!(crate::InputError(format!(
            "--time-scale {} must be a number greater than 0",
            args.time_scale
        )));
    }
    // Logs (and traces) were set up by `crate::main` (`telemetry::init`, events only, so the
    // in-process data plane's request spans stay disabled unless traces are exported).
    // Registered before anything starts, so a Ctrl-C during start-up still stops cleanly.
    let mut signals = Signals::install()?;

    let mut fleet = Fleet::new();
    let started = start(args, strategy, &mut fleet).await;
    let result = match started {
        Ok(doc) => {
            emit(output, &doc)?;
            tokio::select! {
                _ = signals.recv() => {
                    eprintln!("prefixctl up: stopping (draining the data plane, then engines, then the control plane)");
                    Ok(())
                }
                name = fleet.exited.recv() => Err(anyhow::anyhow!("{} stopped unexpectedly", name.unwrap_or_default())),
            }
        }
        Err(e) => Err(e),
    };
    let stopped = fleet.stop().await;
    if result.is_ok() && stopped.is_ok() {
        eprintln!("prefixctl up: stopped");
    }
    result.and(stopped)
}

async fn start(
    args: &UpArgs,
    strategy: RoutingStrategy,
    fleet: &mut Fleet,
) -> anyhow::Result<FleetDoc> {
    // Control plane.
    let cp_listener = bind(&args.control_plane_listen, "control plane").await?;
    let cp_addr = cp_listener.local_addr()?;
    let data_dir = args.data_dir.join("control-plane");
    let store = {
        let dir = data_dir.clone();
        tokio::task::spawn_blocking(move || control_plane::open_store(&dir)).await??
    };
    let token_file = admin_token(&args.data_dir)?;
    let options = control_plane::ServeOptions {
        auth: Some(control_plane::auth::open_token_file(&token_file)?),
        ..control_plane::ServeOptions::default()
    };
    fleet.control_plane = Some(fleet.spawn("control-plane", move |stop| {
        control_plane::serve_with(cp_listener, store, options, stop)
    }));
    eprintln!("control-plane listening on {cp_addr}");
    let cp_url = format!("http://{cp_addr}");

    // Engines.
    let mut engine_urls = Vec::with_capacity(usize::from(args.engines));
    for i in 0..args.engines {
        let addr = match args.engine_base_port {
            0 => "127.0.0.1:0".to_string(),
            base => {
                let port = base.checked_add(i).with_context(|| {
                    format!(
                        "--engine-base-port {base} leaves no room for {} engines below port 65536",
                        args.engines
                    )
                })?;
                format!("127.0.0.1:{port}")
            }
        };
        let listener = bind(&addr, "engine-sim").await.map_err(|e| match args.engine_base_port {
            0 => e,
            base => anyhow::anyhow!(
                "{e:#} (engines use consecutive ports from --engine-base-port {base}; --engine-base-port 0 picks free ones)"
            ),
        })?;
        let local = listener.local_addr()?;
        let config = engine_sim::Config {
            listen: local.to_string(),
            seed: u64::from(i),
            time_scale: args.time_scale,
            ..engine_sim::Config::default()
        };
        fleet
            .engines
            .push(fleet.spawn(&format!("engine-sim {local}"), move |stop| {
                engine_sim::serve(listener, config, stop)
            }));
        eprintln!("engine-sim listening on {local}");
        engine_urls.push(format!("http://{local}"));
    }

    // The endpoint config and endpoint `default`.
    let client = Client::connect_with(
        cp_url.clone(),
        proto::client::ClientOptions {
            bearer_token: Some(credentials::read_first(&token_file)?),
            ..Default::default()
        },
    )
    .await?;
    let revision = apply_endpoint(&client, strategy, &engine_urls).await?;

    // Data plane.
    let dp_listener = bind(&args.listen, "data plane").await?;
    let dp_addr = dp_listener.local_addr()?;
    let dp_config = data_plane::Config {
        listen: dp_addr.to_string(),
        control_plane: cp_url.clone(),
        node_id: Some(NODE_ID.into()),
        default_endpoint: Some(ENDPOINT.into()),
        auth_token_file: Some(token_file.clone()),
        shutdown_grace_ms: DRAIN_GRACE.as_millis() as u64,
        ..data_plane::Config::default()
    };
    fleet.data_plane = Some(fleet.spawn("data-plane", move |stop| {
        data_plane::serve(dp_listener, dp_config, stop)
    }));
    eprintln!("data-plane listening on {dp_addr}");
    let ready = wait_ready(dp_addr).await;
    if !ready {
        eprintln!("prefixctl up: the data plane has not applied a routing table within {READY_WITHIN:?}; it keeps trying");
    }

    Ok(FleetDoc {
        control_plane_url: cp_url,
        data_plane_url: format!("http://{dp_addr}"),
        engine_urls,
        data_dir: display_dir(&args.data_dir),
        token_file: display_dir(&token_file),
        endpoint_name: ENDPOINT.into(),
        endpoint_config_name: ENDPOINT.into(),
        endpoint_config_revision: revision,
        variant_name: VARIANT.into(),
        routing_strategy: strategy.user_name().into(),
        ready,
    })
}

fn display_dir(dir: &Path) -> String {
    dir.display().to_string()
}

/// Creates the endpoint config and endpoint, or brings those of an earlier run up to date.
/// Returns the config's revision.
/// The control plane's admin token file in `data_dir`: kept if it holds a token, else made
/// (256 random bits, hex; readable by its owner only).
fn admin_token(data_dir: &Path) -> anyhow::Result<std::path::PathBuf> {
    let path = data_dir.join("admin-token");
    if credentials::read_first(&path).is_ok() {
        return Ok(path);
    }
    std::fs::create_dir_all(data_dir)
        .with_context(|| format!("cannot use data dir {}", data_dir.display()))?;
    let token: String = (0..32)
        .map(|_| format!("{:02x}", rand::random::<u8>()))
        .collect();
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
    let mut file = options
        .open(&path)
        .with_context(|| format!("cannot write the admin token to {}", path.display()))?;
    std::io::Write::write_all(&mut file, format!("{token} admin\n").as_bytes())
        .with_context(|| format!("cannot write the admin token to {}", path.display()))?;
    Ok(path)
}

async fn apply_endpoint(
    client: &Client,
    strategy: RoutingStrategy,
    engines: &[String],
) -> anyhow::Result<u64> {
    let variants = vec![ProductionVariant {
        variant_name: VARIANT.into(),
        model_name: "llama".into(),
        initial_variant_weight: Some(1.0),
        routing_config: Some(RoutingConfig {
            routing_strategy: strategy as i32,
            prefix_aware_routing_config: None,
            ..Default::default()
        }),
        instances: engines.to_vec(),
    }];
    let config = match client.describe_endpoint_config(ENDPOINT, None).await {
        Ok(_) => {
            client
                .update_endpoint_config(ENDPOINT, variants, None)
                .await?
                .endpoint_config
        }
        Err(ApiError::Api {
            code: Code::NotFound,
            ..
        }) => client.create_endpoint_config(ENDPOINT, variants).await?,
        Err(e) => return Err(e.into()),
    };
    match client.describe_endpoint(ENDPOINT).await {
        Ok(d) if d.endpoint.endpoint_config_name == ENDPOINT => {}
        Ok(_) => {
            client.update_endpoint(ENDPOINT, ENDPOINT).await?;
        }
        Err(ApiError::Api {
            code: Code::NotFound,
            ..
        }) => {
            client.create_endpoint(ENDPOINT, ENDPOINT).await?;
        }
        Err(e) => return Err(e.into()),
    }
    Ok(config.revision)
}

async fn bind(addr: &str, what: &str) -> anyhow::Result<TcpListener> {
    TcpListener::bind(addr)
        .await
        .with_context(|| format!("{what}: cannot listen on {addr}"))
}

/// Polls `GET /readyz` until it answers 200 (a routing table is applied).
async fn wait_ready(addr: SocketAddr) -> bool {
    let deadline = tokio::time::Instant::now() + READY_WITHIN;
    while tokio::time::Instant::now() < deadline {
        if http_status(addr, "/readyz").await == Some(200) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

/// The status code of `GET path` (HTTP/1.1, one connection, no client library needed).
async fn http_status(addr: SocketAddr, path: &str) -> Option<u16> {
    let exchange = async {
        let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
        let req = format!("GET {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n\r\n");
        s.write_all(req.as_bytes()).await.ok()?;
        let mut head = [0u8; 32];
        let mut n = 0;
        while n < 12 {
            let read = s.read(&mut head[n..]).await.ok()?;
            if read == 0 {
                break;
            }
            n += read;
        }
        std::str::from_utf8(&head[..n])
            .ok()?
            .split(' ')
            .nth(1)?
            .parse()
            .ok()
    };
    tokio::time::timeout(Duration::from_secs(2), exchange)
        .await
        .ok()
        .flatten()
}

/// SIGINT or SIGTERM, registered when installed.
struct Signals {
    #[cfg(unix)]
    int: tokio::signal::unix::Signal,
    #[cfg(unix)]
    term: tokio::signal::unix::Signal,
}

impl Signals {
    fn install() -> anyhow::Result<Self> {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{signal, SignalKind};
            Ok(Self {
                int: signal(SignalKind::interrupt()).context("installing the SIGINT handler")?,
                term: signal(SignalKind::terminate()).context("installing the SIGTERM handler")?,
            })
        }
        #[cfg(not(unix))]
        Ok(Self {})
    }

    async fn recv(&mut self) {
        #[cfg(unix)]
        tokio::select! {
            _ = self.int.recv() => {}
            _ = self.term.recv() => {}
        }
        #[cfg(not(unix))]
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// One server task and the switch that stops it.
struct Component {
    name: String,
    stop: watch::Sender<bool>,
    handle: JoinHandle<anyhow::Result<()>>,
}

/// The running servers, stopped front to back.
struct Fleet {
    data_plane: Option<Component>,
    engines: Vec<Component>,
    control_plane: Option<Component>,
    exited_tx: mpsc::UnboundedSender<String>,
    /// Names of servers whose task ended (before `stop`: unexpectedly).
    exited: mpsc::UnboundedReceiver<String>,
}

impl Fleet {
    fn new() -> Self {
        let (exited_tx, exited) = mpsc::unbounded_channel();
        Self {
            data_plane: None,
            engines: Vec::new(),
            control_plane: None,
            exited_tx,
            exited,
        }
    }

    /// Spawns `serve(shutdown)`; the shutdown future completes when the component is stopped.
    fn spawn<F, Fut>(&self, name: &str, serve: F) -> Component
    where
        F: FnOnce(std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>) -> Fut,
        Fut: std::future::Future<Output = anyhow::Result<()>> + Send + 'static,
    {
        let (stop, mut stopped) = watch::channel(false);
        let shutdown = Box::pin(async move {
            let _ = stopped.wait_for(|s| *s).await;
        });
        let serving = serve(shutdown);
        let exited = self.exited_tx.clone();
        let task_name = name.to_string();
        let handle = tokio::spawn(async move {
            let result = serving.await;
            let _ = exited.send(task_name);
            result
        });
        Component {
            name: name.into(),
            stop,
            handle,
        }
    }

    /// Data plane (drains in-flight requests), then engines, then the control plane (flushes).
    async fn stop(mut self) -> anyhow::Result<()> {
        let mut first_error = None;
        let stages: [(Vec<Component>, Duration); 3] = [
            (
                self.data_plane.take().into_iter().collect(),
                DRAIN_GRACE + Duration::from_secs(2),
            ),
            (std::mem::take(&mut self.engines), Duration::from_secs(5)),
            (
                self.control_plane.take().into_iter().collect(),
                Duration::from_secs(10),
            ),
        ];
        for (components, limit) in stages {
            for c in &components {
                let _ = c.stop.send(true);
            }
            for c in components {
                let abort = c.handle.abort_handle();
                match tokio::time::timeout(limit, c.handle).await {
                    Ok(Ok(Ok(()))) => {}
                    Ok(Ok(Err(e))) => {
                        let e = e.context(format!("{} failed", c.name));
                        first_error.get_or_insert(e);
                    }
                    Ok(Err(join)) => {
                        first_error.get_or_insert(anyhow::anyhow!("{} panicked: {join}", c.name));
                    }
                    Err(_) => {
                        abort.abort();
                        eprintln!(
                            "prefixctl up: {} did not stop within {limit:?}; stopped it",
                            c.name
                        );
                    }
                }
            }
        }
        first_error.map_or(Ok(()), Err)
    }
}
