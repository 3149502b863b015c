//! A real etcd cluster for the tests: members started from the `etcd` binary (the distribution's
//! `etcd-server` package), each with its own data dir, stoppable and restartable. Members talk to
//! each other and to clients over unix sockets in the cluster's own directory (etcd 3.4 takes
//! `unix://` client and peer URLs; it cannot listen on port 0 and report the port), so no test
//! ever waits on a port another test took.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// Whether the `etcd` server binary runs here (for [`test_support::require_tool`]).
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

struct Member {
    name: String,
    dir: PathBuf,
    child: Option<Child>,
}

impl Member {
    /// Its client URL as etcd takes it: a socket named `NAME.client:2379` in etcd's working
    /// directory (etcd wants a port in every URL; for a unix socket it is part of the name).
    fn client_url(&self) -> String {
        format!("unix://{}.client:2379", self.name)
    }

    fn peer_url(&self) -> String {
        format!("unix://{}.peer:2380", self.name)
    }
}

/// An etcd cluster of `n` members; killed on drop.
pub struct EtcdCluster {
    members: Vec<Member>,
    initial_cluster: String,
    dir: tempfile::TempDir,
}

impl EtcdCluster {
    /// Starts `n` members and waits until every one reports itself healthy.
    pub async fn start(n: usize) -> Self {
        let dir = tempfile::tempdir().expect("a temp dir");
        let members: Vec<Member> = (0..n)
            .map(|i| Member {
                name: format!("m{i}"),
                dir: dir.path().join(format!("m{i}")),
                child: None,
            })
            .collect();
        let initial_cluster = members
            .iter()
            .map(|m| format!("{}={}", m.name, m.peer_url()))
            .collect::<Vec<_>>()
            .join(",");
        let mut cluster = EtcdCluster {
            members,
            initial_cluster,
            dir,
        };
        for i in 0..n {
            cluster.start_member(i);
        }
        cluster.wait_healthy().await;
        cluster
    }

    /// The unix socket of member `m`'s client URL.
    fn client_socket(&self, m: &Member) -> PathBuf {
        self.dir.path().join(format!("{}.client:2379", m.name))
    }

    async fn all_healthy(&self) -> bool {
        for m in self.members.iter().filter(|m| m.child.is_some()) {
            if !healthy(&self.client_socket(m)).await {
                return false;
            }
        }
        true
    }

    fn start_member(&mut self, i: usize) {
        let cluster = self.initial_cluster.clone();
        let workdir = self.dir.path().to_path_buf();
        let m = &mut self.members[i];
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log_path(&m.dir))
            .ok();
        let (client, peer) = (m.client_url(), m.peer_url());
        // A restarted member finds its socket files left behind by the one killed.
        let _ = std::fs::remove_file(workdir.join(client.trim_start_matches("unix://")));
        let _ = std::fs::remove_file(workdir.join(peer.trim_start_matches("unix://")));
        let child = Command::new("etcd")
            .current_dir(&workdir)
            .args(["--name", &m.name, "--data-dir"])
            .arg(&m.dir)
            .args([
                "--listen-client-urls",
                &client,
                "--advertise-client-urls",
                &client,
                "--listen-peer-urls",
                &peer,
                "--initial-advertise-peer-urls",
                &peer,
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

    /// The members' client URLs, comma-separated (for `--etcd-endpoints`): `unix:///PATH`.
    pub fn endpoints(&self) -> String {
        self.members
            .iter()
            .map(|m| format!("unix://{}", self.client_socket(m).display()))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// The member that leads now (from each member's own `etcd_server_is_leader` metric).
    pub async fn leader(&self) -> Option<usize> {
        for (i, m) in self.members.iter().enumerate() {
            if m.child.is_some()
                && get(&self.client_socket(m), "/metrics")
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
        test_support::wait_for("etcd to be healthy", Duration::from_secs(30), || async {
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

/// `GET path` on a member's client socket: the whole reply, or "" if it does not answer.
pub async fn get(socket: &Path, path: &str) -> String {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let Ok(Ok(mut s)) = tokio::time::timeout(
        Duration::from_secs(1),
        tokio::net::UnixStream::connect(socket),
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

/// `GET /health` on a member's client socket says `"health":"true"`.
pub async fn healthy(socket: &Path) -> bool {
    get(socket, "/health").await.contains(r#""health":"true""#)
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        for i in 0..self.members.len() {
            self.kill(i);
        }
    }
}
