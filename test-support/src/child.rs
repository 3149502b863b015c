//! Workspace binaries as child processes on port 0: [`ChildServer`] passes `--listen`, reads the
//! bound address back from the `NAME listening on ADDR` line every server prints on stderr, and
//! kills the process on drop.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};

/// Path of a workspace binary built next to the test executable (`target/debug/NAME`; cargo
/// builds a package's own binaries for its tests, the others need `cargo build --workspace --bins`).
pub fn bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    let dir = exe.parent().and_then(|d| d.parent()).expect("target dir");
    let path = dir.join(name);
    assert!(
        path.exists(),
        "{} is not built: run `cargo build --workspace --bins` before the tests",
        path.display()
    );
    path
}

/// A loopback port nothing listens on (bound, then released).
pub fn unused_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("bind loopback")
        .port()
}

/// `http://127.0.0.1:PORT` on a port nothing listens on: a server that is down.
pub fn unused_url() -> String {
    format!("http://127.0.0.1:{}", unused_port())
}

/// A server binary running as a child process; killed on drop.
pub struct ChildServer {
    pub child: Child,
    pub addr: SocketAddr,
    /// Everything the child wrote to stderr so far.
    pub logs: Arc<Mutex<String>>,
}

impl ChildServer {
    /// Starts workspace binary `name` with `args` plus `--listen 127.0.0.1:0` and waits for its
    /// `NAME listening on ADDR` line on stderr.
    pub fn start(name: &str, args: &[&str]) -> anyhow::Result<Self> {
        Self::start_with_env(name, args, &[])
    }

    /// [`Self::start`] with extra environment variables (e.g. `RUST_LOG`).
    pub fn start_with_env(name: &str, args: &[&str], env: &[(&str, &str)]) -> anyhow::Result<Self> {
        Self::start_listening(name, "127.0.0.1:0", args, env)
    }

    /// [`Self::start_with_env`] on a given `--listen` address (e.g. the port of a server that
    /// just stopped, to restart it where its clients look for it).
    pub fn start_listening(
        name: &str,
        listen: &str,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> anyhow::Result<Self> {
        use std::io::{BufRead, BufReader};
        let mut child = Command::new(bin(name))
            .args(args)
            .args(["--listen", listen])
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()?;
        let stderr = child.stderr.take().expect("piped stderr");
        let mut lines = BufReader::new(stderr).lines();
        let needle = format!("{name} listening on ");
        let logs = Arc::new(Mutex::new(String::new()));
        let keep = |logs: &Mutex<String>, line: &str| {
            let mut l = logs.lock().unwrap_or_else(|e| e.into_inner());
            l.push_str(line);
            l.push('\n');
        };
        for line in lines.by_ref() {
            let line = line?;
            keep(&logs, &line);
            if let Some(rest) = line.split(&needle).nth(1) {
                let addr: SocketAddr = rest.trim().parse()?;
                // Keep draining stderr so the child never blocks on a full pipe.
                let kept = logs.clone();
                std::thread::spawn(move || {
                    for line in lines.map_while(Result::ok) {
                        keep(&kept, &line);
                    }
                });
                return Ok(Self { child, addr, logs });
            }
        }
        let status = child.wait()?;
        let logs = logs.lock().unwrap_or_else(|e| e.into_inner()).clone();
        anyhow::bail!("{name} exited ({status}) before it listened: {logs}")
    }

    /// `http://ADDR`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// What the child wrote to stderr so far.
    pub fn logs(&self) -> String {
        self.logs.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// SIGKILL: no chance to flush or clean up.
    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for ChildServer {
    fn drop(&mut self) {
        self.kill9();
    }
}
