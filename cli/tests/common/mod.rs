//! Test helpers: a control plane running in this process on a loopback port, and `prefixctl`
//! commands pointed at it.

#![allow(dead_code)]

use std::time::Duration;

use assert_cmd::Command;
use test_support::InProcessServer;

/// A control plane served by a tokio runtime owned by the test, so the test body stays
/// synchronous and runs the real `prefixctl` binary.
pub struct ControlPlane {
    pub url: String,
    runtime: tokio::runtime::Runtime,
    server: Option<InProcessServer>,
    _dir: tempfile::TempDir,
}

impl ControlPlane {
    /// Endpoint config "c" (VARIANTS) and endpoint "e" routing with it, through prefixctl.
    pub fn create_config_c_and_endpoint_e(&self) {
        self.prefixctl(&[
            "endpoint-config",
            "create",
            "--endpoint-config-name",
            "c",
            "--production-variants",
            VARIANTS,
        ])
        .assert()
        .success();
        self.prefixctl(&[
            "endpoint",
            "create",
            "--endpoint-name",
            "e",
            "--endpoint-config-name",
            "c",
        ])
        .assert()
        .success();
    }

    pub fn start() -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let store = control_plane::open_store(dir.path()).expect("open store");
        let server = runtime.block_on(InProcessServer::start(|l, stop| {
            control_plane::serve_store(l, store, Duration::from_secs(1), stop)
        }));
        Self {
            url: server.url(),
            runtime,
            server: Some(server),
            _dir: dir,
        }
    }

    /// `prefixctl --control-plane URL ARGS...`.
    pub fn prefixctl(&self, args: &[&str]) -> Command {
        let mut cmd = prefixctl();
        cmd.env("PREFIX_ROUTER_CONTROL_PLANE", &self.url).args(args);
        cmd
    }

    /// The same as a `std::process::Command`, to run several at once.
    pub fn std_prefixctl(&self, args: &[&str]) -> std::process::Command {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_prefixctl"));
        cmd.env("PREFIX_ROUTER_CONTROL_PLANE", &self.url)
            .env_remove("PREFIX_ROUTER_TOKEN")
            .args(args);
        cmd
    }

    /// Runs `prefixctl --output json ARGS...`, expects success, and parses stdout as one JSON document.
    pub fn json(&self, args: &[&str]) -> serde_json::Value {
        let out = self
            .prefixctl(args)
            .arg("--output")
            .arg("json")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "prefixctl {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
            panic!(
                "stdout of {args:?} is not one JSON document ({e}): {}",
                String::from_utf8_lossy(&out.stdout)
            )
        })
    }

    /// Runs the SDK against this control plane.
    pub fn block_on<F: std::future::Future>(&self, f: F) -> F::Output {
        self.runtime.block_on(f)
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        if let Some(mut server) = self.server.take() {
            let _ = self.runtime.block_on(server.begin_shutdown());
        }
    }
}

/// `prefixctl` with no control plane in its environment.
pub fn prefixctl() -> Command {
    let mut cmd = Command::cargo_bin("prefixctl").expect("prefixctl is built");
    cmd.env_remove("PREFIX_ROUTER_CONTROL_PLANE")
        .env_remove("PREFIX_ROUTER_TOKEN")
        .timeout(Duration::from_secs(60));
    cmd
}

pub const VARIANTS: &str = r#"[{"VariantName":"v1","ModelName":"llama","InitialVariantWeight":1,
  "Instances":["http://127.0.0.1:9001","http://127.0.0.1:9002"],
  "RoutingConfig":{"RoutingStrategy":"RANDOM"}}]"#;
