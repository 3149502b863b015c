//! Control-plane replicas over a real 3-member etcd cluster on loopback (the `etcd` binary of
//! the distribution's `etcd-server` package; skipped with a message when it is missing, except
//! under `CI=true`): updates reach routers on every replica, a change computed before another
//! replica's commit reached it is retried (not written over it), 8 concurrent writers through 3
//! replicas lose nothing,
//! routers fail over when a replica dies, etcd member loss, instance leases across replicas, and
//! the control-plane contract suite run again on the etcd store.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use integration_tests::etcd::EtcdCluster;
use integration_tests::{variant, Backend};
use proto::client::Client;
use proto::RoutingStrategy;
use test_support::{require_tool, wait_for, ChildServer};
use tonic::Code;

/// One cluster at a time: these tests time failovers, and 2 cores run them.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn etcd_here(test: &str) -> bool {
    require_tool(test, integration_tests::etcd::available()).is_some()
}

fn replica(cluster: &EtcdCluster, prefix: &str, extra: &[&str]) -> ChildServer {
    let endpoints = cluster.endpoints();
    let mut args = vec![
        "--etcd-endpoints",
        &endpoints,
        "--etcd-prefix",
        prefix,
        "--lease-check-interval-ms",
        "200",
    ];
    args.extend_from_slice(extra);
    ChildServer::start("control-plane", &args).unwrap()
}

fn router(control_planes: &str, node: &str) -> ChildServer {
    ChildServer::start(
        "data-plane",
        &[
            "--control-plane",
            control_planes,
            "--node-id",
            node,
            "--default-endpoint",
            "ep",
        ],
    )
    .unwrap()
}

async fn sdk(url: &str) -> Client {
    Client::connect(url.to_string()).await.unwrap()
}

/// `GET path` on a server: status and body.
async fn get(server: &ChildServer, path: &str) -> (u16, String) {
    request(server, "GET", path, "").await
}

async fn request(server: &ChildServer, method: &str, path: &str, body: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let Ok(mut s) = tokio::net::TcpStream::connect(server.addr).await else {
        return (0, String::new());
    };
    let req = format!(
        "{method} {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    if s.write_all(req.as_bytes()).await.is_err() {
        return (0, String::new());
    }
    let mut reply = String::new();
    let _ = tokio::time::timeout(Duration::from_secs(20), s.read_to_string(&mut reply)).await;
    let status = reply
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = reply.split("\r\n\r\n").nth(1).unwrap_or("").to_string();
    (status, body)
}

async fn table_version(server: &ChildServer) -> Option<u64> {
    let (status, body) = get(server, "/readyz").await;
    let v: serde_json::Value = serde_json::from_str(&body).ok()?;
    (status == 200)
        .then(|| v["table_version"].as_u64())
        .flatten()
}

async fn chat(server: &ChildServer, n: u64) -> u16 {
    let body = serde_json::json!({
        "model": "m", "max_tokens": 2,
        "messages": [{"role": "user", "content": format!("question {n}")}],
    })
    .to_string();
    request(server, "POST", "/v1/chat/completions", &body)
        .await
        .0
}

/// The endpoint `ep` over one engine-sim, created through `c`.
async fn endpoint(c: &Client) -> ChildServer {
    let engine = ChildServer::start("engine-sim", &["--time-scale", "0.01"]).unwrap();
    let url = engine.url();
    c.create_endpoint_config(
        "cfg",
        vec![variant("v1", RoutingStrategy::PrefixAware, &[&url])],
    )
    .await
    .unwrap();
    c.create_endpoint("ep", "cfg").await.unwrap();
    engine
}

#[tokio::test]
async fn an_update_through_one_replica_reaches_the_routers_of_every_replica() {
    if !etcd_here("etcd replicas") {
        return;
    }
    let _serial = SERIAL.lock().await;
    let cluster = EtcdCluster::start(3).await;
    let a = replica(&cluster, "/t1/", &[]);
    let b = replica(&cluster, "/t1/", &[]);
    let (ca, cb) = (sdk(&a.url()).await, sdk(&b.url()).await);
    let _engine = endpoint(&ca).await;
    let dp1 = router(&a.url(), "dp-a");
    let dp2 = router(&b.url(), "dp-b");
    for dp in [&dp1, &dp2] {
        wait_for("a table", Duration::from_secs(10), || table_version(dp)).await;
    }

    let mut lags = Vec::new();
    for i in 0..5 {
        let strategy = if i % 2 == 0 {
            RoutingStrategy::Random
        } else {
            RoutingStrategy::PrefixAware
        };
        let sent = Instant::now();
        let version = ca
            .set_variant_routing_strategy("cfg", "v1", strategy, None)
            .await
            .unwrap()
            .routing_table_version;
        wait_for(
            "replica B's router to apply it",
            Duration::from_secs(10),
            || async { table_version(&dp2).await.filter(|&v| v >= version) },
        )
        .await;
        lags.push(sent.elapsed());
    }
    eprintln!("update via A -> router on B: {lags:?}");

    // Either replica reports both routers as up to date.
    for (name, c) in [("A", &ca), ("B", &cb)] {
        wait_for(
            "both routers in the rollout status",
            Duration::from_secs(5),
            || async {
                let d = c.describe_endpoint("ep").await.ok()?;
                let ids: Vec<_> = d
                    .data_planes
                    .iter()
                    .filter(|p| p.connected && p.up_to_date)
                    .map(|p| p.node_id.as_str())
                    .collect();
                (ids.contains(&"dp-a") && ids.contains(&"dp-b")).then_some(())
            },
        )
        .await;
        eprintln!("replica {name}: both routers ACKed");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_writers_through_three_replicas_lose_no_acknowledged_update() {
    if !etcd_here("etcd replicas") {
        return;
    }
    let _serial = SERIAL.lock().await;
    let cluster = EtcdCluster::start(3).await;
    let replicas = [0, 1, 2].map(|_| replica(&cluster, "/t2/", &[]));
    let ca = sdk(&replicas[0].url()).await;
    let _engine = endpoint(&ca).await;
    // 8 writers, 25 updates each, spread over the 3 replicas; each update's weight names it.
    const WRITERS: u32 = 8;
    const EACH: u32 = 25;
    let writers: Vec<_> = (0..WRITERS)
        .map(|w| {
            let url = replicas[w as usize % 3].url();
            tokio::spawn(async move {
                let c = sdk(&url).await;
                let mut out = Vec::new();
                for i in 0..EACH {
                    let weight = (1 + w * 1000 + i) as f32;
                    let mut v = variant("v1", RoutingStrategy::Random, &["http://127.0.0.1:9"]);
                    v.initial_variant_weight = Some(weight);
                    let r = c.update_endpoint_config("cfg", vec![v], None).await;
                    out.push((
                        weight,
                        r.map(|u| (u.endpoint_config.revision, u.routing_table_version)),
                    ));
                }
                out
            })
        })
        .collect();
    let mut acknowledged = Vec::new();
    let mut refused = Vec::new();
    for w in writers {
        for (weight, r) in w.await.unwrap() {
            match r {
                Ok((rev, ver)) => acknowledged.push((rev, ver, weight)),
                Err(e) => {
                    assert_eq!(e.code(), Some(Code::Aborted), "{e}");
                    refused.push(weight);
                }
            }
        }
    }
    let n = acknowledged.len();
    let mut revisions: Vec<u64> = acknowledged.iter().map(|a| a.0).collect();
    let mut versions: Vec<u64> = acknowledged.iter().map(|a| a.1).collect();
    revisions.sort_unstable();
    versions.sort_unstable();
    revisions.dedup();
    versions.dedup();
    assert_eq!(revisions.len(), n, "a config revision was given out twice");
    assert_eq!(
        versions.len(),
        n,
        "a routing-table version was given out twice"
    );
    // Replica 0 reads from its mirror, which the other replicas' last commits reach through its
    // watch: every acknowledged update becomes a revision there, and nothing beyond them.
    let latest = wait_for(
        "replica 0 to see every acknowledged update",
        Duration::from_secs(10),
        || async {
            let d = ca.describe_endpoint_config("cfg", None).await.unwrap();
            (d.latest_revision > n as u64).then_some(d)
        },
    )
    .await;
    assert_eq!(
        latest.latest_revision,
        1 + n as u64,
        "every acknowledged update is a revision"
    );
    // Each acknowledged update is stored at the revision it was told, and the final state is
    // the last acknowledged one.
    for &(rev, _, weight) in &acknowledged {
        let at = ca.describe_endpoint_config("cfg", Some(rev)).await.unwrap();
        assert_eq!(
            at.endpoint_config.production_variants[0].initial_variant_weight,
            Some(weight),
            "revision {rev} does not hold the update acknowledged for it"
        );
    }
    let last = acknowledged.iter().max_by_key(|a| a.0).unwrap();
    assert_eq!(
        latest.endpoint_config.production_variants[0].initial_variant_weight,
        Some(last.2)
    );
    for r in 2..=latest.latest_revision {
        let at = ca.describe_endpoint_config("cfg", Some(r)).await.unwrap();
        let w = at.endpoint_config.production_variants[0]
            .initial_variant_weight
            .unwrap();
        assert!(
            !refused.contains(&w),
            "an update answered ABORTED was written (revision {r})"
        );
    }
    eprintln!(
        "{n} of {} concurrent updates through 3 replicas applied (revisions 2..={}), {} aborted after retries",
        WRITERS * EACH,
        1 + n,
        refused.len()
    );
}

/// Two stores over the same etcd prefix, as two replicas would hold them (in this process, so a
/// test can step between one's reads and its commit).
async fn two_stores(
    cluster: &EtcdCluster,
    prefix: &str,
) -> (
    Arc<control_plane::store::Store>,
    Arc<control_plane::store::Store>,
) {
    let settings = control_plane::etcd::EtcdSettings {
        endpoints: cluster.endpoints().split(',').map(str::to_string).collect(),
        prefix: prefix.into(),
        tls: Default::default(),
        user: None,
    };
    let a = control_plane::etcd::open_store(&settings).await.unwrap();
    let b = control_plane::etcd::open_store(&settings).await.unwrap();
    (a, b)
}

/// Waits until `store`'s mirror (fed by its etcd watch) holds revision `revision` of config `name`.
async fn sees_revision(
    store: &Arc<control_plane::store::Store>,
    name: &'static str,
    revision: u64,
) {
    let store = store.clone();
    wait_for(
        &format!("the replica to see {name}@{revision}"),
        Duration::from_secs(10),
        || {
            let store = store.clone();
            async move {
                tokio::task::spawn_blocking(move || {
                    store.describe_config(name, Some(revision)).ok()
                })
                .await
                .ok()
                .flatten()
                .map(drop)
            }
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_computed_before_another_replicas_commit_reached_it_is_retried_not_written() {
    if !etcd_here("etcd replicas") {
        return;
    }
    let _serial = SERIAL.lock().await;
    let cluster = EtcdCluster::start(3).await;
    let (a, b) = two_stores(&cluster, "/lost-update/").await;
    let weights = |w: f32| {
        let mut v = variant("v1", RoutingStrategy::Random, &["http://127.0.0.1:9"]);
        v.initial_variant_weight = Some(w);
        vec![v]
    };
    let (a2, v1) = (a.clone(), weights(1.0));
    tokio::task::spawn_blocking(move || {
        a2.create_config("cfg", &v1).unwrap();
        a2.create_endpoint("ep", "cfg").unwrap();
    })
    .await
    .unwrap();
    // B's mirror has the config (through its watch) before the race is staged.
    sees_revision(&b, "cfg", 1).await;
    // A's first commit waits while B commits revision 2 and A's mirror receives it: A computed
    // its change (revision 2 too) from the state before.
    let once = Arc::new(AtomicBool::new(false));
    let (weak_a, b2, once2) = (Arc::downgrade(&a), b.clone(), once.clone());
    a.before_commit(move || {
        if once2.swap(true, Ordering::SeqCst) {
            return;
        }
        let Some(a) = weak_a.upgrade() else { return };
        let before = a.version().unwrap();
        let (config, _) = b2.update_config("cfg", &weights(2.0), None).unwrap();
        assert_eq!(config.revision, 2);
        test_support::wait_for_blocking(
            "A's mirror to see B's commit",
            Duration::from_secs(10),
            || a.version().unwrap() != before,
        );
    });
    let (a3, v3) = (a.clone(), weights(3.0));
    let (config, _) = tokio::task::spawn_blocking(move || a3.update_config("cfg", &v3, None))
        .await
        .unwrap()
        .unwrap();
    assert!(once.load(Ordering::SeqCst), "the hook ran");
    assert_eq!(
        config.revision, 3,
        "A's change was computed before B's revision 2 and must be retried on top of it"
    );
    // B reads from its mirror, which A's commit reaches through B's watch.
    sees_revision(&b, "cfg", 3).await;
    let b3 = b.clone();
    let history = tokio::task::spawn_blocking(move || {
        (1..=3)
            .map(|r| {
                b3.describe_config("cfg", Some(r))
                    .map(|(c, head, _)| (c, head))
            })
            .collect::<Result<Vec<_>, _>>()
    })
    .await
    .unwrap()
    .unwrap();
    let w: Vec<f32> = history
        .iter()
        .map(|(c, _)| c.production_variants[0].initial_variant_weight.unwrap())
        .collect();
    assert_eq!(
        w,
        [1.0, 2.0, 3.0],
        "every acknowledged change has its own revision"
    );
    assert_eq!(history[2].1, 3, "the latest revision is A's");
}

#[tokio::test]
async fn a_router_moves_to_the_next_replica_when_its_replica_dies() {
    if !etcd_here("etcd replicas") {
        return;
    }
    let _serial = SERIAL.lock().await;
    let cluster = EtcdCluster::start(3).await;
    let mut a = replica(&cluster, "/t3/", &[]);
    let b = replica(&cluster, "/t3/", &[]);
    let cb = sdk(&b.url()).await;
    let _engine = endpoint(&cb).await;
    let dp = Arc::new(router(&format!("{},{}", a.url(), b.url()), "dp-1"));
    let first = wait_for("a table", Duration::from_secs(10), || table_version(&dp)).await;

    // Load, and the router's table version sampled, all along.
    let stop = Arc::new(AtomicBool::new(false));
    let failed = Arc::new(AtomicU64::new(0));
    let sent = Arc::new(AtomicU64::new(0));
    let load = {
        let (dp, stop, failed, sent) = (dp.clone(), stop.clone(), failed.clone(), sent.clone());
        tokio::spawn(async move {
            let mut last = 0;
            let mut n = 0;
            while !stop.load(Ordering::Relaxed) {
                n += 1;
                if chat(&dp, n).await != 200 {
                    failed.fetch_add(1, Ordering::Relaxed);
                }
                sent.fetch_add(1, Ordering::Relaxed);
                if let Some(v) = table_version(&dp).await {
                    assert!(v >= last, "the table version went back from {last} to {v}");
                    last = v;
                }
            }
        })
    };
    wait_for("the load under way", Duration::from_secs(10), || async {
        sent.load(Ordering::Relaxed) >= 20
    })
    .await;
    a.kill9();
    let killed = Instant::now();
    wait_for(
        "the router on replica B",
        Duration::from_secs(10),
        || async {
            let d = cb.describe_endpoint("ep").await.ok()?;
            d.data_planes
                .iter()
                .any(|p| p.node_id == "dp-1" && p.connected)
                .then_some(())
        },
    )
    .await;
    let moved = killed.elapsed();
    let version = cb
        .set_variant_routing_strategy("cfg", "v1", RoutingStrategy::Random, None)
        .await
        .unwrap()
        .routing_table_version;
    wait_for("the update through B", Duration::from_secs(10), || async {
        table_version(&dp).await.filter(|&v| v >= version)
    })
    .await;
    stop.store(true, Ordering::Relaxed);
    load.await.unwrap();
    let (sent, failed) = (sent.load(Ordering::Relaxed), failed.load(Ordering::Relaxed));
    eprintln!("router moved to B {moved:?} after A's SIGKILL; {sent} requests, {failed} failed; version {first} -> {version}");
    assert_eq!(failed, 0, "requests failed during the failover");
}

#[tokio::test]
async fn writes_survive_one_etcd_member_and_stop_clearly_without_quorum() {
    if !etcd_here("etcd replicas") {
        return;
    }
    let _serial = SERIAL.lock().await;
    let mut cluster = EtcdCluster::start(3).await;
    let a = replica(&cluster, "/t4/", &[]);
    let ca = sdk(&a.url()).await;
    let _engine = endpoint(&ca).await;
    let dp = router(&a.url(), "dp-1");
    wait_for("a table", Duration::from_secs(10), || table_version(&dp)).await;

    // A follower dies: writes go on at once.
    let leader = cluster.leader().await.expect("a leader");
    let follower = (leader + 1) % 3;
    cluster.kill(follower);
    let one_down = ca
        .set_variant_routing_strategy("cfg", "v1", RoutingStrategy::Random, None)
        .await
        .expect("a write with one member down");
    // Then the leader: one member of three is no quorum.
    cluster.kill(leader);
    let e = ca
        .set_variant_routing_strategy("cfg", "v1", RoutingStrategy::PrefixAware, None)
        .await
        .expect_err("no quorum, no write");
    eprintln!("without quorum: {e}");
    assert_eq!(e.code(), Some(Code::Unavailable), "{e}");
    assert!(
        e.to_string().contains("etcd"),
        "the message names etcd: {e}"
    );
    assert_eq!(chat(&dp, 1).await, 200, "the router keeps serving");
    assert_eq!(
        ca.describe_endpoint_config("cfg", None)
            .await
            .unwrap()
            .latest_revision,
        one_down.endpoint_config.revision,
        "reads go on from the replica's mirror"
    );

    cluster.restart(follower).await;
    cluster.restart(leader).await;
    let after = wait_for("writes to resume", Duration::from_secs(20), || async {
        ca.set_variant_routing_strategy("cfg", "v1", RoutingStrategy::PrefixAware, None)
            .await
            .ok()
    })
    .await;
    assert!(after.endpoint_config.revision > one_down.endpoint_config.revision);
    let d = ca
        .describe_endpoint_config("cfg", Some(one_down.endpoint_config.revision))
        .await;
    assert!(
        d.is_ok(),
        "the write acknowledged with one member down is kept: {d:?}"
    );
}

#[tokio::test]
async fn instance_leases_outlive_their_replica_and_expire_when_nobody_renews() {
    if !etcd_here("etcd replicas") {
        return;
    }
    let _serial = SERIAL.lock().await;
    let cluster = EtcdCluster::start(3).await;
    let mut a = replica(&cluster, "/t5/", &[]);
    let b = replica(&cluster, "/t5/", &[]);
    let (ca, cb) = (sdk(&a.url()).await, sdk(&b.url()).await);
    let _engine = endpoint(&ca).await;
    let inst = ca
        .register_instance("ep", "v1", "http://127.0.0.1:19", 2)
        .await
        .unwrap();
    let registered = |c: &Client| {
        let c = c.clone();
        async move {
            c.describe_endpoint("ep")
                .await
                .map(|d| d.registered_instances.len())
                .unwrap_or(usize::MAX)
        }
    };
    // B's mirror has the registration (through its watch) before A dies.
    wait_for("B to see the instance", Duration::from_secs(10), || async {
        (registered(&cb).await == 1).then_some(())
    })
    .await;
    a.kill9();
    // Renewed through B for 4 s (twice the TTL): still there.
    for _ in 0..8 {
        cb.renew_instance_lease(&inst.instance_id).await.unwrap();
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_eq!(registered(&cb).await, 1, "a renewed lease expired");
    }
    // Nobody renews: gone within the TTL and a reaper tick or two.
    let last = Instant::now();
    wait_for("the lease to expire", Duration::from_secs(4), || async {
        (registered(&cb).await == 0).then_some(())
    })
    .await;
    eprintln!(
        "lease of 2 s expired {:?} after the last renewal",
        last.elapsed()
    );
    let e = cb
        .renew_instance_lease(&inst.instance_id)
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(Code::NotFound));
}

/// Runs a case of the control-plane contract suite on a fresh 3-member cluster.
async fn on_etcd<F: std::future::Future<Output = ()>>(case: impl FnOnce(Backend) -> F) {
    if !etcd_here("etcd contract suite") {
        return;
    }
    let _serial = SERIAL.lock().await;
    let cluster = EtcdCluster::start(3).await;
    case(Backend::Etcd(cluster.endpoints())).await
}

/// The control-plane contract suite ([`integration_tests::contract`]) on the etcd store.
mod contract_on_etcd {
    use super::on_etcd;
    integration_tests::contract_suite!(on_etcd);
}

/// One etcd member with `extra` flags, on unix sockets beside `data` (no port is picked): its
/// client URL is `unix:///PATH` (`unixs:///PATH` with `scheme` "https"); killed on drop.
struct OneEtcd {
    child: std::process::Child,
    url: String,
    socket: std::path::PathBuf,
}

impl OneEtcd {
    fn start(data: &std::path::Path, scheme: &str, extra: &[&str]) -> Self {
        let workdir = data.parent().unwrap().to_path_buf();
        let peer_url = "unix://one.peer:2380".to_string();
        let unix = if scheme == "https" { "unixs" } else { "unix" };
        // etcd takes a unix URL's host and port as the socket's name in its working directory
        let client = format!("{unix}://one.client:2379");
        let socket = workdir.join("one.client:2379");
        let url = format!("{unix}://{}", socket.display());
        let child = std::process::Command::new("etcd")
            .current_dir(&workdir)
            .args(["--name", "one", "--data-dir"])
            .arg(data)
            .args(["--listen-client-urls", &client])
            .args(["--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer_url])
            .args(["--initial-advertise-peer-urls", &peer_url])
            .args(["--initial-cluster", &format!("one={peer_url}")])
            .args(extra)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        OneEtcd { child, url, socket }
    }

    /// A plain gRPC channel to the member's client socket.
    async fn channel(&self) -> Option<tonic::transport::Channel> {
        tonic::transport::Endpoint::from_static("http://localhost")
            .connect_with_connector(control_plane::etcd::UnixConnector(self.socket.clone()))
            .await
            .ok()
    }
}

impl Drop for OneEtcd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A CA and a certificate for `names` it signed, as PEM files in `dir`: (ca, cert, key).
fn pki(
    dir: &std::path::Path,
    names: &[&str],
) -> (
    std::path::PathBuf,
    [(std::path::PathBuf, std::path::PathBuf); 2],
) {
    use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = CertifiedIssuer::self_signed(ca, KeyPair::generate().unwrap()).unwrap();
    let write = |name: &str, pem: String| {
        let p = dir.join(name);
        std::fs::write(&p, pem).unwrap();
        p
    };
    let leaf = |tag: &str, names: Vec<String>| {
        let key = KeyPair::generate().unwrap();
        let cert = CertificateParams::new(names)
            .unwrap()
            .signed_by(&key, &ca)
            .unwrap();
        (
            write(&format!("{tag}.pem"), cert.pem()),
            write(&format!("{tag}.key"), key.serialize_pem()),
        )
    };
    let server = leaf("server", names.iter().map(|n| n.to_string()).collect());
    let client = leaf("client", vec!["control-plane".to_string()]);
    (write("ca.pem", ca.pem()), [server, client])
}

#[tokio::test]
async fn the_control_plane_reaches_etcd_over_mutual_tls() {
    if !etcd_here("etcd over TLS") {
        return;
    }
    let _serial = SERIAL.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let (ca, [(cert, key), (client_cert, client_key)]) =
        pki(dir.path(), &["localhost", "127.0.0.1"]);
    let s = |p: &std::path::Path| p.to_str().unwrap().to_string();
    let etcd = OneEtcd::start(
        &dir.path().join("data"),
        "https",
        &[
            "--cert-file",
            &s(&cert),
            "--key-file",
            &s(&key),
            "--trusted-ca-file",
            &s(&ca),
            "--client-cert-auth",
        ],
    );
    let url = etcd.url.clone();
    let tls = [
        "--etcd-endpoints",
        &url,
        "--etcd-ca-cert",
        &s(&ca),
        "--etcd-cert",
        &s(&client_cert),
        "--etcd-key",
        &s(&client_key),
    ];
    let cp = wait_for(
        "the control plane on TLS etcd",
        Duration::from_secs(20),
        || async { ChildServer::start("control-plane", &tls).ok() },
    )
    .await;
    let c = sdk(&cp.url()).await;
    c.create_endpoint_config(
        "cfg",
        vec![variant(
            "v1",
            RoutingStrategy::Random,
            &["http://127.0.0.1:9"],
        )],
    )
    .await
    .expect("a write through mutual TLS");
    // Without our certificate etcd refuses us: the control plane does not start.
    let refused = ChildServer::start(
        "control-plane",
        &["--etcd-endpoints", &url, "--etcd-ca-cert", &s(&ca)],
    );
    let Err(e) = refused else {
        panic!("a control plane without a client certificate started")
    };
    eprintln!("without a client certificate: {e}");
    assert!(e.to_string().contains("etcd"), "{e}");
    drop(etcd);
}

#[tokio::test]
async fn the_control_plane_logs_in_to_an_etcd_with_authentication_and_writes_past_its_token_ttl() {
    use control_plane::etcd::pb::etcdserverpb::auth_client::AuthClient;
    use control_plane::etcd::pb::etcdserverpb::{
        AuthEnableRequest, AuthRoleAddRequest, AuthUserAddRequest, AuthUserGrantRoleRequest,
    };
    if !etcd_here("etcd with authentication") {
        return;
    }
    let _serial = SERIAL.lock().await;
    let dir = tempfile::tempdir().unwrap();
    // Tokens that expire within the test: the control plane must keep a valid one.
    let etcd = OneEtcd::start(
        &dir.path().join("data"),
        "http",
        &["--auth-token", "simple", "--auth-token-ttl", "2"],
    );
    let url = etcd.url.clone();
    let password = "s3cret-etcd-pw";
    let mut auth = wait_for("etcd to answer", Duration::from_secs(20), || async {
        etcd.channel().await.map(AuthClient::new)
    })
    .await;
    auth.role_add(AuthRoleAddRequest {
        name: "root".into(),
    })
    .await
    .unwrap();
    auth.user_add(AuthUserAddRequest {
        name: "root".into(),
        password: password.into(),
        options: None,
    })
    .await
    .unwrap();
    auth.user_grant_role(AuthUserGrantRoleRequest {
        user: "root".into(),
        role: "root".into(),
    })
    .await
    .unwrap();
    auth.auth_enable(AuthEnableRequest {}).await.unwrap();

    let s = |p: &std::path::Path| p.to_str().unwrap().to_string();
    let right = dir.path().join("pw");
    std::fs::write(&right, format!("{password}\n")).unwrap();
    let wrong = dir.path().join("wrong");
    std::fs::write(&wrong, "not-the-password\n").unwrap();
    let start_as_root = |password_file: &std::path::Path| {
        ChildServer::start(
            "control-plane",
            &[
                "--etcd-endpoints",
                &url,
                "--etcd-user",
                "root",
                "--etcd-password-file",
                &s(password_file),
            ],
        )
    };
    let refused = start_as_root(&wrong);
    let Err(e) = refused else {
        panic!("a wrong etcd password was accepted")
    };
    eprintln!("wrong etcd password: {e}");
    assert!(e.to_string().contains("refused user"), "{e}");
    assert!(!e.to_string().contains("not-the-password"), "{e}");
    let anonymous = ChildServer::start("control-plane", &["--etcd-endpoints", &url]);
    assert!(anonymous.is_err(), "no user, no start on an etcd with auth");

    let cp = start_as_root(&right).unwrap();
    let c = sdk(&cp.url()).await;
    let vs = || {
        vec![variant(
            "v1",
            RoutingStrategy::Random,
            &["http://127.0.0.1:9"],
        )]
    };
    c.create_endpoint_config("cfg", vs()).await.unwrap();
    // Past the token's 2 s: the next write renews it.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let updated = c.update_endpoint_config("cfg", vs(), None).await;
    assert!(
        updated.is_ok(),
        "a write after the token expired: {updated:?}"
    );
    assert!(!cp.logs().contains(password));
    drop(etcd);
}
