//! `prefixctl up` as a process: it answers a chat completion through its data plane, applies a
//! strategy change made from "a second terminal" without a restart, stops on SIGINT within 5 s
//! with exit code 0, and on a second run over the same data dir updates what the first created.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use serde_json::Value;
use test_support::{at_timeout, wait_for_blocking};

/// A running `prefixctl up`, killed on drop if the test failed before stopping it.
struct Up {
    child: Child,
    stdout: mpsc::Receiver<String>,
    stderr: std::sync::Arc<std::sync::Mutex<String>>,
}

impl Up {
    fn start(data_dir: &std::path::Path, extra: &[&str]) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_prefixctl"))
            .args([
                "up",
                "--listen",
                "127.0.0.1:0",
                "--control-plane-listen",
                "127.0.0.1:0",
                "--engine-base-port",
                "0",
            ])
            .args(["--engines", "2", "--time-scale", "0.01", "--data-dir"])
            .arg(data_dir)
            .args(extra)
            .env_remove("PREFIX_ROUTER_CONTROL_PLANE")
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn prefixctl up");
        let (tx, stdout) = mpsc::channel();
        let out = child.stdout.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let stderr = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
        let mut err = child.stderr.take().unwrap();
        let sink = stderr.clone();
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = err.read(&mut buf) {
                if n == 0 {
                    break;
                }
                sink.lock()
                    .unwrap()
                    .push_str(&String::from_utf8_lossy(&buf[..n]));
            }
        });
        Self {
            child,
            stdout,
            stderr,
        }
    }

    /// The next stdout line, failing after 60 s (start-up on a loaded 2-core machine).
    fn line(&self) -> String {
        self.stdout
            .recv_timeout(Duration::from_secs(60))
            .unwrap_or_else(|_| {
                panic!(
                    "prefixctl up printed nothing more; stderr:\n{}",
                    self.stderr()
                )
            })
    }

    /// Reads stdout until a line containing `label`, returns the first URL on it.
    fn url_after(&self, label: &str) -> String {
        loop {
            let line = self.line();
            if let Some(rest) = line.split(label).nth(1) {
                return rest
                    .split_whitespace()
                    .next()
                    .expect("a URL after the label")
                    .to_string();
            }
        }
    }

    fn stderr(&self) -> String {
        self.stderr.lock().unwrap().clone()
    }

    /// Sends `signal` and waits for the exit, at most 5 s.
    fn stop_with(&mut self, signal: libc::c_int) -> std::process::ExitStatus {
        let pid = libc::pid_t::try_from(self.child.id()).unwrap();
        // SAFETY: kill(2) on our own child's pid has no memory-safety preconditions.
        assert_eq!(unsafe { libc::kill(pid, signal) }, 0, "kill failed");
        let stderr = self.stderr.clone();
        wait_for_blocking(
            &at_timeout(move || {
                format!(
                    "prefixctl up to exit after signal {signal}; stderr:\n{}",
                    stderr.lock().unwrap()
                )
            }),
            Duration::from_secs(5),
            || self.child.try_wait().unwrap(),
        )
    }
}

impl Drop for Up {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// POSTs a small chat completion; returns (status line, headers, body).
fn chat(data_plane_url: &str, content: &str) -> (String, String, String) {
    let addr = data_plane_url.trim_start_matches("http://");
    let body = serde_json::json!({
        "model": "default",
        "max_tokens": 8,
        "messages": [{"role": "user", "content": content}],
    })
    .to_string();
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut response = String::new();
    s.read_to_string(&mut response).unwrap();
    let (head, body) = response
        .split_once("\r\n\r\n")
        .expect("a full HTTP response");
    let (status, headers) = head.split_once("\r\n").unwrap_or((head, ""));
    (
        status.to_string(),
        headers.to_ascii_lowercase(),
        body.to_string(),
    )
}

fn header<'a>(headers: &'a str, name: &str) -> Option<&'a str> {
    headers.lines().find_map(|l| {
        l.strip_prefix(name)
            .and_then(|r| r.strip_prefix(':'))
            .map(str::trim)
    })
}

fn prefixctl(control_plane: &str, token: &std::path::Path, args: &[&str]) -> Value {
    let (ok, out) = prefixctl_with(control_plane, args, Some(token.to_path_buf()));
    assert!(ok, "prefixctl {args:?}: {out}");
    serde_json::from_str(&out).unwrap()
}

/// Runs prefixctl with `--bearer-token-file` when given: success, and stdout (stderr on failure).
fn prefixctl_with(
    control_plane: &str,
    args: &[&str],
    token_file: Option<std::path::PathBuf>,
) -> (bool, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_prefixctl"));
    cmd.args(args)
        .args(["--output", "json", "--control-plane", control_plane])
        .env_remove("PREFIX_ROUTER_TOKEN");
    if let Some(t) = token_file {
        cmd.arg("--bearer-token-file").arg(t);
    }
    let out = cmd.output().unwrap();
    let text = if out.status.success() {
        String::from_utf8_lossy(&out.stdout).to_string()
    } else {
        String::from_utf8_lossy(&out.stderr).to_string()
    };
    (out.status.success(), text)
}

#[test]
fn up_serves_swaps_strategy_live_and_stops_on_sigint() {
    let dir = tempfile::tempdir().unwrap();
    let mut up = Up::start(dir.path(), &[]);
    let control_plane = up.url_after("control plane:");
    // The control plane wants the token `up` made (owner-only) and printed the path of.
    let token = std::path::PathBuf::from(up.url_after("admin token:"));
    assert_eq!(token, dir.path().join("admin-token"));
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt as _;
        let mode = std::fs::metadata(&token).unwrap().permissions().mode();
        assert_eq!(
            mode & 0o077,
            0,
            "the token file is readable by its owner only"
        );
    }
    let data_plane = up.url_after("data plane:");
    let (ok, err) = prefixctl_with(&control_plane, &["endpoint-config", "list"], None);
    assert!(!ok && err.contains("Unauthenticated"), "{err}");
    assert!(
        up.stderr().contains("data-plane listening on "),
        "{}",
        up.stderr()
    );

    let (status, headers, body) = chat(&data_plane, "Hello from the up test!");
    assert!(
        status.starts_with("HTTP/1.1 200"),
        "{status}\n{headers}\n{body}"
    );
    assert_eq!(header(&headers, "x-prefix-router-decision"), Some("random"));
    assert_eq!(header(&headers, "x-prefix-router-variant"), Some("v1"));
    let reply: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(reply["object"], "chat.completion");

    // A second terminal swaps the strategy; the data plane applies it without a restart.
    let u = prefixctl(
        &control_plane,
        &token,
        &[
            "endpoint-config",
            "update",
            "--endpoint-config-name",
            "default",
            "--variant-name",
            "v1",
            "--routing-strategy",
            "PREFIX_AWARE",
        ],
    );
    let version = u["RoutingTableVersion"].as_u64().unwrap();
    wait_for_blocking(
        &format!("the data plane to apply version {version}"),
        Duration::from_secs(20),
        || {
            let d = prefixctl(
                &control_plane,
                &token,
                &["endpoint", "describe", "--endpoint-name", "default"],
            );
            d["DataPlanes"].as_array().unwrap().iter().any(|n| {
                n["NodeId"] == "prefixctl-up"
                    && n["AppliedVersion"].as_u64() >= Some(version)
                    && n["UpToDate"] == true
            })
        },
    );
    let (status, headers, _) = chat(&data_plane, "Hello again, now with prefix-aware routing.");
    assert!(status.starts_with("HTTP/1.1 200"), "{status}");
    let decision = header(&headers, "x-prefix-router-decision")
        .unwrap_or_default()
        .to_string();
    assert!(
        decision.starts_with("prefix_"),
        "decision after the swap: {decision}"
    );
    assert_eq!(
        header(&headers, "x-prefix-router-table-version"),
        Some(version.to_string().as_str())
    );

    let status = up.stop_with(libc::SIGINT);
    assert_eq!(status.code(), Some(0), "stderr:\n{}", up.stderr());
    assert!(
        up.stderr().contains("prefixctl up: stopped"),
        "{}",
        up.stderr()
    );

    // A second run over the same data dir updates the endpoint config of the first (a new
    // revision, back to the strategy asked for) and prints one JSON document with --output json.
    let mut again = Up::start(
        dir.path(),
        &[
            "--output",
            "json",
            "--routing-strategy",
            "LEAST_OUTSTANDING_REQUESTS",
        ],
    );
    let mut text = String::new();
    let doc: Value = loop {
        text.push_str(&again.line());
        text.push('\n');
        if let Ok(v) = serde_json::from_str(&text) {
            break v;
        }
    };
    assert_eq!(doc["EndpointConfigRevision"], 3, "{doc}");
    assert_eq!(doc["RoutingStrategy"], "LEAST_OUTSTANDING_REQUESTS");
    assert_eq!(doc["Ready"], true);
    assert_eq!(doc["EngineUrls"].as_array().unwrap().len(), 2);
    let (status, headers, _) = chat(doc["DataPlaneUrl"].as_str().unwrap(), "third");
    assert!(status.starts_with("HTTP/1.1 200"), "{status}");
    assert_eq!(
        header(&headers, "x-prefix-router-decision"),
        Some("least_outstanding")
    );
    let status = again.stop_with(libc::SIGTERM);
    assert_eq!(status.code(), Some(0), "stderr:\n{}", again.stderr());
}

#[test]
fn up_reports_a_taken_port_in_one_line() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let dir = tempfile::tempdir().unwrap();
    let out = common::prefixctl()
        .args([
            "up",
            "--control-plane-listen",
            "127.0.0.1:0",
            "--engine-base-port",
            "0",
            "--engines",
            "1",
            "--listen",
            &addr,
        ])
        .arg("--data-dir")
        .arg(dir.path())
        .env("RUST_LOG", "off")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8(out.stderr).unwrap();
    let error: Vec<&str> = stderr
        .lines()
        .filter(|l| l.starts_with("error: "))
        .collect();
    assert_eq!(error.len(), 1, "{stderr}");
    assert!(
        error[0].contains(&format!("data plane: cannot listen on {addr}")),
        "{stderr}"
    );

    common::prefixctl()
        .args(["up", "--routing-strategy", "PREFIX_AWAR"])
        .arg("--data-dir")
        .arg(dir.path())
        .assert()
        .code(2)
        .stderr(predicates::str::contains(
            "unknown routing strategy \"PREFIX_AWAR\" for variant \"v1\"",
        ));
}
