//! Shared helpers for the integration tests: start the real servers in-process on
//! `127.0.0.1:0` and build API requests. The helpers every test crate shares (waiting on a
//! condition, child processes on port 0, the skip policy) are in `test-support`.

pub mod contract;
pub mod envoy;
pub mod etcd;
pub mod fault;

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use proto::control_plane_client::ControlPlaneClient;
use proto::{PrefixAwareRoutingConfig, ProductionVariant, RoutingConfig, RoutingStrategy};
use test_support::{bind_loopback, InProcessServer};
use tonic::transport::Channel;

/// Where an [`InProcessControlPlane`] keeps its state.
#[derive(Debug, Clone)]
pub enum Backend {
    /// sled under the data dir.
    Sled,
    /// etcd at these client URLs (comma-separated), under a prefix named after the data dir (so
    /// a restart on the same dir finds its state, as with sled).
    Etcd(String),
}

/// A control plane running in this process on a loopback port; asked to stop when dropped.
pub struct InProcessControlPlane {
    pub addr: SocketAddr,
    pub url: String,
    /// Where `GET /metrics` is served, when started with metrics ([`Self::start_on`]).
    pub metrics_addr: Option<SocketAddr>,
    server: InProcessServer,
}

impl InProcessControlPlane {
    pub async fn start(data_dir: &Path) -> Self {
        Self::start_on(&Backend::Sled, data_dir, Duration::from_millis(1000), false).await
    }

    /// Also serves Prometheus metrics (`--metrics-listen`) on a loopback port.
    pub async fn start_with_metrics(data_dir: &Path) -> Self {
        Self::start_on(&Backend::Sled, data_dir, Duration::from_millis(1000), true).await
    }

    /// A control plane over `backend`, checking leases every `lease_check`, serving Prometheus
    /// metrics (`--metrics-listen`) on a loopback port of its own when `metrics`.
    pub async fn start_on(
        backend: &Backend,
        data_dir: &Path,
        lease_check: Duration,
        metrics: bool,
    ) -> Self {
        let listener = bind_loopback().await;
        let metrics_listener = if metrics {
            Some(bind_loopback().await)
        } else {
            None
        };
        let metrics_addr = metrics_listener.as_ref().map(|l| l.local_addr().unwrap());
        let store = match backend {
            Backend::Etcd(endpoints) => {
                let prefix = format!(
                    "/suite/{:016x}/",
                    xxhash_rust::xxh3::xxh3_64(data_dir.as_os_str().as_encoded_bytes())
                );
                control_plane::etcd::open_store(&control_plane::etcd::EtcdSettings {
                    endpoints: endpoints.split(',').map(str::to_string).collect(),
                    prefix,
                    tls: Default::default(),
                    user: None,
                })
                .await
                .expect("open the etcd store")
            }
            Backend::Sled => control_plane::open_store(data_dir).expect("open store"),
        };
        let options = control_plane::ServeOptions {
            lease_check_interval: lease_check,
            metrics_listener,
            ..control_plane::ServeOptions::default()
        };
        let server = InProcessServer::start_on(listener, |l, stop| {
            control_plane::serve_with(l, store, options, stop)
        });
        Self {
            addr: server.addr,
            url: server.url(),
            metrics_addr,
            server,
        }
    }

    /// `GET /metrics` as text (panics unless started with metrics).
    pub async fn metrics(&self) -> String {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let addr = self.metrics_addr.expect("started with metrics");
        let mut stream = tokio::net::TcpStream::connect(addr)
            .await
            .expect("connect to the metrics port");
        stream
            .write_all(b"GET /metrics HTTP/1.1\r\nHost: cp\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut raw = String::new();
        stream.read_to_string(&mut raw).await.unwrap();
        let (head, body) = raw.split_once("\r\n\r\n").expect("an HTTP response");
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
        body.to_string()
    }

    pub async fn client(&self) -> ControlPlaneClient<Channel> {
        ControlPlaneClient::connect(self.url.clone())
            .await
            .expect("connect to control plane")
    }

    /// Graceful stop; returns the server's result.
    pub async fn stop(self) -> anyhow::Result<()> {
        self.server.stop().await
    }
}

/// A production variant with the given strategy over `instances`.
pub fn variant(name: &str, strategy: RoutingStrategy, instances: &[&str]) -> ProductionVariant {
    ProductionVariant {
        variant_name: name.into(),
        model_name: "llama".into(),
        initial_variant_weight: Some(1.0),
        routing_config: Some(RoutingConfig {
            routing_strategy: strategy as i32,
            prefix_aware_routing_config: (strategy == RoutingStrategy::PrefixAware).then_some(
                PrefixAwareRoutingConfig {
                    prefix_length: 2048,
                    concurrency_threshold: 64,
                    ..Default::default()
                },
            ),
            ..Default::default()
        }),
        instances: instances.iter().map(|s| s.to_string()).collect(),
    }
}

/// Checks of deployment files (docker-compose.yml, deploy/kubernetes) against the binaries: the
/// flags their `--help` lists, the ports their listen flags name.
pub mod deploy {
    use std::path::PathBuf;
    use std::process::Command;

    use test_support::bin;

    /// Our binaries, as the image ships them (the Dockerfile copies each into /usr/local/bin).
    pub const BINARIES: [&str; 4] = ["control-plane", "data-plane", "engine-sim", "prefixctl"];

    /// Read by the OpenTelemetry SDK itself (see `telemetry`), so not in any `--help`.
    pub const SDK_ENV: [&str; 4] = [
        "OTEL_SERVICE_NAME",
        "OTEL_RESOURCE_ATTRIBUTES",
        "OTEL_TRACES_SAMPLER",
        "OTEL_TRACES_SAMPLER_ARG",
    ];

    /// A file of the repository, by its path from the top.
    pub fn repo_file(name: &str) -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("..")
            .join(name)
    }

    /// `bin [subcommand...] --help` of a built binary (target/debug).
    pub fn help(binary: &str, subcommand: &[&str]) -> String {
        let out = Command::new(bin(binary))
            .args(subcommand)
            .arg("--help")
            .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{binary} {subcommand:?} --help failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    }

    /// Whether a `--help` text lists `flag` (as `--flag <VALUE>`, `--flag` alone on its line, ...).
    pub fn help_has_flag(help: &str, flag: &str) -> bool {
        flag.starts_with('-')
            && help.lines().any(|line| {
                let line = line.trim_start();
                line.strip_prefix(flag)
                    .or_else(|| {
                        line.split_once(", ")
                            .and_then(|(_, l)| l.strip_prefix(flag))
                    })
                    .is_some_and(|rest| rest.is_empty() || rest.starts_with([' ', '=']))
            })
    }

    /// Whether a `--help` text says the binary reads environment variable `var` (clap's
    /// `[env: VAR=]`).
    pub fn help_has_env(help: &str, var: &str) -> bool {
        help.contains(&format!("[env: {var}=")) || help.contains(&format!("[env: {var}]"))
    }

    /// Every `--flag` in `args` (a `--flag=value` counts as `--flag`).
    pub fn flags(args: &[String]) -> Vec<&str> {
        args.iter()
            .filter(|a| a.starts_with("--"))
            .map(|a| a.split('=').next().unwrap())
            .collect()
    }

    /// The value of `flag` in `args`: the word after it, or what follows `--flag=`.
    pub fn flag_value<'a>(args: &'a [String], flag: &str) -> Option<&'a str> {
        args.iter().enumerate().find_map(|(i, a)| {
            if a == flag {
                args.get(i + 1).map(String::as_str)
            } else {
                a.strip_prefix(flag).and_then(|rest| rest.strip_prefix('='))
            }
        })
    }

    /// The port of `HOST:PORT` or `scheme://HOST:PORT[/path]`.
    pub fn port_of(addr: &str) -> u16 {
        addr.rsplit(':')
            .next()
            .and_then(|p| p.trim_end_matches('/').parse().ok())
            .unwrap_or_else(|| panic!("no port in {addr:?}"))
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn help_flags_and_values() {
            let help = "Options:\n      --listen <LISTEN>\n          Address\n  -h, --help\n      --insecure\n  --name 'default'\n";
            for flag in ["--listen", "--help", "--insecure", "--name"] {
                assert!(help_has_flag(help, flag), "{flag}");
            }
            for flag in ["--list", "--listen-x", "--insec", "Address"] {
                assert!(!help_has_flag(help, flag), "{flag}");
            }
            let args: Vec<String> = ["--a", "1", "--b=2", "x", "--c"].map(String::from).to_vec();
            assert_eq!(flags(&args), ["--a", "--b", "--c"]);
            assert_eq!(flag_value(&args, "--a"), Some("1"));
            assert_eq!(flag_value(&args, "--b"), Some("2"));
            assert_eq!(flag_value(&args, "--c"), None);
            assert_eq!(flag_value(&args, "--d"), None);
            assert_eq!(port_of("0.0.0.0:7070"), 7070);
            assert_eq!(port_of("http://etcd-0.etcd:2379"), 2379);
        }
    }
}

/// An engine-sim served in this process on a loopback port, at `time_scale` (0.01: a hundred
/// times faster than the modelled GPU), until the runtime ends; returns its URL.
pub async fn spawn_engine_sim(time_scale: f64) -> String {
    let engine = engine_sim::Config {
        time_scale,
        ..engine_sim::Config::default()
    };
    let addr = InProcessServer::start(|l, stop| engine_sim::serve(l, engine, stop))
        .await
        .detach();
    format!("http://{addr}")
}
