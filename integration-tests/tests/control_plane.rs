//! The control-plane contract suite ([`integration_tests::contract`]) on the sled store, and
//! what only sled has: durability across a SIGKILL and one process per data dir.

use integration_tests::contract::{describe_endpoint, endpoint_ep_over_a, update_config, A, B};
use integration_tests::{variant, Backend};
use proto::control_plane_client::ControlPlaneClient;
use proto::*;
use test_support::ChildServer;

async fn on_sled<F: std::future::Future<Output = ()>>(case: impl FnOnce(Backend) -> F) {
    case(Backend::Sled).await
}

integration_tests::contract_suite!(on_sled);

#[tokio::test]
async fn sigkill_and_restart_keep_everything_and_the_version_counter() {
    let dir = tempfile::tempdir().unwrap();
    let data_dir = dir.path().join("cp");
    let data = data_dir.to_str().unwrap();
    let mut server = ChildServer::start("control-plane", &["--data-dir", data]).unwrap();
    let mut c = ControlPlaneClient::connect(server.url()).await.unwrap();
    endpoint_ep_over_a(&mut c, RoutingStrategy::Random).await;
    let up = update_config(
        &mut c,
        "cfg",
        vec![variant("v1", RoutingStrategy::PrefixAware, &[A, B])],
        Some(1),
    )
    .await
    .unwrap();
    let inst = c
        .register_instance(RegisterInstanceRequest {
            endpoint_name: "ep".into(),
            variant_name: "v1".into(),
            address: "http://127.0.0.1:9003".into(),
            lease_ttl_seconds: 600,
        })
        .await
        .unwrap()
        .into_inner()
        .instance
        .unwrap();
    let before = describe_endpoint(&mut c, "ep").await;
    assert_eq!(
        before.current_routing_table_version,
        up.routing_table_version + 1
    );

    // A second control plane on the same data dir is refused with one clear line: it never says
    // it listens (the store opens first), and the cause is named once.
    let out = std::process::Command::new(test_support::bin("control-plane"))
        .args(["--data-dir", data, "--listen", "127.0.0.1:0"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("cannot open data dir"), "{stderr}");
    assert!(!stderr.contains("listening"), "{stderr}");
    assert_eq!(stderr.matches("lock").count(), 1, "{stderr}");
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");

    server.kill9();
    drop(c);
    let server = ChildServer::start("control-plane", &["--data-dir", data]).unwrap();
    let mut c = ControlPlaneClient::connect(server.url()).await.unwrap();
    let after = describe_endpoint(&mut c, "ep").await;
    assert_eq!(
        after.current_routing_table_version,
        before.current_routing_table_version
    );
    assert_eq!(after.endpoint, before.endpoint);
    assert_eq!(after.endpoint_config, before.endpoint_config);
    assert_eq!(after.registered_instances, vec![inst]);
    let r1 = c
        .describe_endpoint_config(DescribeEndpointConfigRequest {
            endpoint_config_name: "cfg".into(),
            revision: Some(1),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r1.latest_revision, 2);
    // The counter goes on from where it was.
    let up2 = update_config(
        &mut c,
        "cfg",
        vec![variant("v1", RoutingStrategy::Random, &[A])],
        Some(2),
    )
    .await
    .unwrap();
    assert_eq!(
        up2.routing_table_version,
        before.current_routing_table_version + 1
    );

    // The port taken: one clear line, non-zero exit.
    let out = std::process::Command::new(test_support::bin("control-plane"))
        .args([
            "--data-dir",
            dir.path().join("other").to_str().unwrap(),
            "--listen",
            &server.addr.to_string(),
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("cannot listen on"), "{stderr}");
}
