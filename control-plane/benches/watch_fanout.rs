//! Time from `UpdateEndpointConfig` to 100 watching routers holding the new version.
//!
//! Run: `cargo bench -p control-plane --bench watch_fanout` (env `WATCHERS`, `ROUNDS` to change
//! the size). Each watcher has its own HTTP/2 connection and decodes every table it receives, as a
//! data plane does. Prints the median and p90/max over the rounds, measured two ways: from the
//! moment the update RPC was sent and from the moment it returned; then `WRITES` (200) updates
//! in a row, as writes per second.
//!
//! With `ETCD=http://127.0.0.1:2379[,...]` it runs again on the etcd store, with two control-plane
//! replicas and the watchers spread over both (updates go through the first), so sled and etcd
//! are measured in one run.

use std::time::{Duration, Instant};

use futures_util::StreamExt;
use prost::Message;
use proto::control_plane_client::ControlPlaneClient;
use proto::routing_discovery_client::RoutingDiscoveryClient;
use proto::*;
use test_support::InProcessServer;
use tokio::sync::mpsc;

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn variants(round: usize) -> Vec<ProductionVariant> {
    let instances = (0..7)
        .map(|i| format!("http://127.0.0.1:{}", 20_000 + round * 10 + i))
        .collect();
    vec![ProductionVariant {
        variant_name: "v1".into(),
        model_name: "llama".into(),
        initial_variant_weight: Some(1.0),
        routing_config: Some(RoutingConfig {
            routing_strategy: RoutingStrategy::PrefixAware as i32,
            prefix_aware_routing_config: Some(PrefixAwareRoutingConfig {
                prefix_length: 2048,
                concurrency_threshold: 64,
                ..Default::default()
            }),
            ..Default::default()
        }),
        instances,
    }]
}

fn pct(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    if std::env::args().any(|a| a == "--list") {
        return Ok(());
    }
    run(None).await?;
    if let Ok(etcd) = std::env::var("ETCD") {
        run(Some(etcd)).await?;
    }
    Ok(())
}

/// One control plane on sled, or (with etcd URLs) two replicas on etcd.
async fn run(etcd: Option<String>) -> anyhow::Result<()> {
    let watchers = env_usize("WATCHERS", 100);
    let rounds = env_usize("ROUNDS", 30);
    let writes = env_usize("WRITES", 200);
    let dir = tempfile::tempdir()?;
    let mut urls = Vec::new();
    let mut servers = Vec::new();
    let prefix = format!("/bench-{}/", uuid_like());
    for _ in 0..if etcd.is_some() { 2 } else { 1 } {
        let (store, cluster) = match &etcd {
            None => (control_plane::open_store(dir.path())?, None),
            Some(endpoints) => {
                let s = control_plane::etcd::open(&control_plane::etcd::EtcdSettings {
                    endpoints: endpoints.split(',').map(str::to_string).collect(),
                    prefix: prefix.clone(),
                    tls: Default::default(),
                    user: None,
                })
                .await?;
                (s.store, Some(s.cluster))
            }
        };
        let options = control_plane::ServeOptions {
            cluster,
            ..control_plane::ServeOptions::default()
        };
        let server =
            InProcessServer::start(|l, stop| control_plane::serve_with(l, store, options, stop))
                .await;
        urls.push(server.url());
        servers.push(server);
    }
    let url = urls[0].clone();

    let mut c = ControlPlaneClient::connect(url.clone()).await?;
    c.create_endpoint_config(CreateEndpointConfigRequest {
        endpoint_config_name: "cfg".into(),
        production_variants: variants(0),
    })
    .await?;
    let ep = c
        .create_endpoint(CreateEndpointRequest {
            endpoint_name: "ep".into(),
            endpoint_config_name: "cfg".into(),
        })
        .await?
        .into_inner()
        .endpoint
        .unwrap();

    let (seen_tx, mut seen_rx) = mpsc::unbounded_channel::<(u64, Instant)>();
    for n in 0..watchers {
        let url = urls[n % urls.len()].clone();
        let seen = seen_tx.clone();
        tokio::spawn(async move {
            let mut client = RoutingDiscoveryClient::connect(url).await.expect("connect");
            let (tx, rx) = mpsc::channel(4);
            let node_id = format!("router-{n}");
            tx.send(WatchRoutingTableRequest {
                node_id: node_id.clone(),
                applied_version: 0,
                ..Default::default()
            })
            .await
            .unwrap();
            let mut stream = client
                .watch_routing_table(tokio_stream::wrappers::ReceiverStream::new(rx))
                .await
                .expect("watch")
                .into_inner();
            while let Some(Ok(resp)) = stream.next().await {
                let table = RoutingTable::decode(resp.routing_table.clone()).expect("decode");
                let _ = seen.send((table.version, Instant::now()));
                let _ = tx
                    .send(WatchRoutingTableRequest {
                        node_id: node_id.clone(),
                        applied_version: resp.version,
                        response_nonce: resp.nonce,
                        error_detail: String::new(),
                        status: None,
                    })
                    .await;
            }
        });
    }
    // Everyone holds the initial table first.
    let mut initial = 0;
    while initial < watchers {
        let (v, _) = seen_rx.recv().await.unwrap();
        if v == ep.routing_table_version {
            initial += 1;
        }
    }

    let mut from_send = Vec::new();
    let mut from_return = Vec::new();
    for round in 1..=rounds {
        let sent = Instant::now();
        let up = c
            .update_endpoint_config(UpdateEndpointConfigRequest {
                endpoint_config_name: "cfg".into(),
                production_variants: variants(round),
                expected_revision: None,
            })
            .await?
            .into_inner();
        let returned = Instant::now();
        let mut got = 0;
        let mut last = returned;
        while got < watchers {
            let (v, at) = seen_rx.recv().await.unwrap();
            if v == up.routing_table_version {
                got += 1;
                last = last.max(at);
            }
        }
        from_send.push(last - sent);
        from_return.push(last.saturating_duration_since(returned));
    }
    from_send.sort();
    from_return.sort();
    println!(
        "watch_fanout on {}: {watchers} watchers, {rounds} updates (7-instance PREFIX_AWARE variant)",
        match &etcd {
            None => "sled, 1 control plane".to_string(),
            Some(_) => format!("etcd, {} replicas (watchers spread over them)", urls.len()),
        }
    );
    for (name, v) in [
        ("from update sent", &from_send),
        ("from update returned", &from_return),
    ] {
        println!(
            "  {name:>22}: p50 {:>8.2} ms  p90 {:>8.2} ms  p99 {:>8.2} ms  max {:>8.2} ms",
            pct(v, 0.5).as_secs_f64() * 1e3,
            pct(v, 0.9).as_secs_f64() * 1e3,
            pct(v, 0.99).as_secs_f64() * 1e3,
            v.last().unwrap().as_secs_f64() * 1e3
        );
    }
    // Writes per second: updates in a row, each waited for.
    let started = Instant::now();
    for i in 0..writes {
        c.update_endpoint_config(UpdateEndpointConfigRequest {
            endpoint_config_name: "cfg".into(),
            production_variants: variants(rounds + 1 + i % 5),
            expected_revision: None,
        })
        .await?;
    }
    let per_s = writes as f64 / started.elapsed().as_secs_f64();
    println!("  UpdateEndpointConfig: {writes} in a row, {per_s:.0} writes/s");
    let stopping: Vec<_> = servers.iter_mut().map(|s| s.begin_shutdown()).collect();
    for server in stopping {
        let _ = server.await;
    }
    Ok(())
}

/// A prefix of its own for each run (etcd keeps state between runs).
fn uuid_like() -> String {
    format!(
        "{:x}",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0)
    )
}
