//! A real etcd cluster on loopback for the tests: members started from the `etcd` binary (the
//! distribution's `etcd-server` package), each with its own data dir, stoppable and restartable.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// Whether the `etcd` server binary runs here (for [`crate::require_tool`]).
pub fn available() -> Result<(), String> {
    match Command::new("etcd").arg("--version").output() {
        Ok(out) if out.status.success() => Ok(()),
        Ok(out) => Err(format!(
            "`etcd --version` failed: {}",
            String::from_utf8_lossy(&out.stderr)
        )),
        Err(e) => Err(format!(
            "the etcd server binary is not installed ({e}); apt-get install etcd-server"
        )),
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

struct Member {
    name: String,
    client: u16,
    peer: u16,
    dir: PathBuf,
    child: Option<Child>,
}

/// An etcd cluster of `n` members on loopback; killed on drop.
pub struct EtcdCluster {
    members: Vec<Member>,
    initial_cluster: String,
    _dir: tempfile::TempDir,
}

impl EtcdCluster {
    /// Starts `n` members and waits until the cluster answers. A cluster that does not (a port
    /// chosen free was taken by a parallel test before its member bound it, and that member
    /// exited) is stopped and started again on new ports, up to three times.
    pub async fn start(n: usize) -> Self {
        for attempt in 1..=3 {
            let cluster = Self::launch(n);
            if cluster.healthy_within(Duration::from_secs(30)).await {
                return cluster;
            }
            eprintln!("etcd cluster, attempt {attempt}: not healthy within 30 s; starting again on new ports");
        }
        panic!("timed out waiting for etcd to be healthy (3 attempts)");
    }

    fn launch(n: usize) -> Self {
        let dir = tempfile::tempdir().expect("a temp dir");
        let members: Vec<Member> = (0..n)
            .map(|i| Member {
                name: format!("m{i}"),
                client: free_port(),
                peer: free_port(),
                dir: dir.path().join(format!("m{i}")),
                child: None,
            })
            .collect();
        let initial_cluster = members
            .iter()
            .map(|m| format!("{}=http://127.0.0.1:{}", m.name, m.peer))
            .collect::<Vec<_>>()
            .join(",");
        let mut cluster = EtcdCluster {
            members,
            initial_cluster,
            _dir: dir,
        };
        for i in 0..n {
            cluster.start_member(i);
        }
        cluster
    }

    /// Whether every running member reports itself healthy within `limit`.
    async fn healthy_within(&self, limit: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + limit;
        while tokio::time::Instant::now() < deadline {
            if self.all_healthy().await {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        false
    }

    async fn all_healthy(&self) -> bool {
        for m in self.members.iter().filter(|m| m.child.is_some()) {
            if !healthy(m.client).await {
                return false;
            }
        }
        true
    }

    fn start_member(&mut self, i: usize) {
        let cluster = self.initial_cluster.clone();
        let m = &mut self.members[i];
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log_path(&m.dir))
            .ok();
        let child = Command::new("etcd")
            .args(["--name", &m.name, "--data-dir"])
            .arg(&m.dir)
            .args([
                "--listen-client-urls",
                &format!("http://127.0.0.1:{}", m.client),
                "--advertise-client-urls",
                &format!("http://127.0.0.1:{}", m.client),
                "--listen-peer-urls",
                &format!("http://127.0.0.1:{}", m.peer),
                "--initial-advertise-peer-urls",
                &format!("http://127.0.0.1:{}", m.peer),
                "--initial-cluster",
                &cluster,
                "--initial-cluster-state",
                "new",
                "--initial-cluster-token",
                "prefix-router-test",
                "--heartbeat-interval",
                "50",
                "--election-timeout",
                "500",
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log.map_or_else(Stdio::null, Stdio::from))
            .spawn()
            .expect("start etcd");
        m.child = Some(child);
    }

    /// The members' client URLs, comma-separated (for `--etcd-endpoints`).
    pub fn endpoints(&self) -> String {
        self.members
            .iter()
            .map(|m| format!("http://127.0.0.1:{}", m.client))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// The member that leads now (from each member's own `etcd_server_is_leader` metric).
    pub async fn leader(&self) -> Option<usize> {
        for (i, m) in self.members.iter().enumerate() {
            if m.child.is_some()
                && get(m.client, "/metrics")
                    .await
                    .contains("\netcd_server_is_leader 1")
            {
                return Some(i);
            }
        }
        None
    }

    /// SIGKILLs member `i`.
    pub fn kill(&mut self, i: usize) {
        if let Some(mut c) = self.members[i].child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts member `i` again on its data dir.
    pub async fn restart(&mut self, i: usize) {
        self.start_member(i);
        self.wait_healthy().await;
    }

    /// Waits until every running member reports itself healthy (it has a leader).
    pub async fn wait_healthy(&self) {
        crate::wait_for("etcd to be healthy", Duration::from_secs(30), || async {
            self.all_healthy().await.then_some(())
        })
        .await;
    }
}

fn log_path(dir: &Path) -> PathBuf {
    let mut p = dir.as_os_str().to_owned();
    p.push(".log");
    PathBuf::from(p)
}

/// `GET path` on a member's client port: the whole reply, or "" if it does not answer.
async fn get(port: u16, path: &str) -> String {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let Ok(Ok(mut s)) = tokio::time::timeout(
        Duration::from_secs(1),
        tokio::net::TcpStream::connect(("127.0.0.1", port)),
    )
    .await
    else {
        return String::new();
    };
    let req = format!("GET {path} HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n\r\n");
    if s.write_all(req.as_bytes()).await.is_err() {
        return String::new();
    }
    let mut reply = String::new();
    let _ = tokio::time::timeout(Duration::from_secs(2), s.read_to_string(&mut reply)).await;
    reply
}

/// `GET /health` on a member's client port says `"health":"true"`.
async fn healthy(port: u16) -> bool {
    get(port, "/health").await.contains(r#""health":"true""#)
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        for i in 0..self.members.len() {
            self.kill(i);
        }
    }
}
