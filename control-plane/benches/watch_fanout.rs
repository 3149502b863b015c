//! Time from `UpdateEndpointConfig` to 100 watching routers holding the new version.
//!
//! Run: `cargo bench -p control-plane --bench watch_fanout` (env `WATCHERS`, `ROUNDS` to change
//! the size). Each watcher has its own HTTP/2 connection and decodes every table it receives, as a
//! data plane does. Prints the median and p90/max over the rounds, measured two ways: from the
//! moment the update RPC was sent and from the moment it returned.

use std::time::{Duration, Instant};

use futures_util::StreamExt;
use prost::Message;
use proto::control_plane_client::ControlPlaneClient;
use proto::routing_discovery_client::RoutingDiscoveryClient;
use proto::*;
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
            }),
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
    let watchers = env_usize("WATCHERS", 100);
    let rounds = env_usize("ROUNDS", 30);
    let dir = tempfile::tempdir()?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    let store = control_plane::open_store(dir.path())?;
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(control_plane::serve_store(
        listener,
        store,
        Duration::from_secs(1),
        async move {
            let _ = stop_rx.await;
        },
    ));

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
        let url = url.clone();
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
        "watch_fanout: {watchers} watchers, {rounds} updates (7-instance PREFIX_AWARE variant)"
    );
    for (name, v) in [
        ("from update sent", &from_send),
        ("from update returned", &from_return),
    ] {
        println!(
            "  {name:>22}: p50 {:>8.2} ms  p90 {:>8.2} ms  max {:>8.2} ms",
            pct(v, 0.5).as_secs_f64() * 1e3,
            pct(v, 0.9).as_secs_f64() * 1e3,
            v.last().unwrap().as_secs_f64() * 1e3
        );
    }
    let _ = stop_tx.send(());
    let _ = server.await;
    Ok(())
}
