//! The control plane's contract over real gRPC, one suite for every store backend (like
//! object_store's conformance tests): configs and revisions, endpoints, leases, validation, the
//! routing-table watch, metrics, concurrency and reflection. `tests/control_plane.rs` runs it on
//! sled and `tests/etcd.rs` on a 3-member etcd cluster, each case its own `#[tokio::test]`
//! through [`contract_suite!`](crate::contract_suite).

use std::time::Duration;

use crate::{variant, Backend, InProcessControlPlane};
use futures_util::StreamExt;
use prost::Message;
use proto::control_plane_client::ControlPlaneClient;
use proto::routing_discovery_client::RoutingDiscoveryClient;
use proto::*;
use test_support::wait_for;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;
use tonic::Code;

pub const A: &str = "http://127.0.0.1:9001";
pub const B: &str = "http://127.0.0.1:9002";

pub async fn create_config(
    c: &mut ControlPlaneClient<Channel>,
    name: &str,
    variants: Vec<ProductionVariant>,
) -> EndpointConfig {
    c.create_endpoint_config(CreateEndpointConfigRequest {
        endpoint_config_name: name.into(),
        production_variants: variants,
    })
    .await
    .expect("create config")
    .into_inner()
    .endpoint_config
    .unwrap()
}

pub async fn update_config(
    c: &mut ControlPlaneClient<Channel>,
    name: &str,
    variants: Vec<ProductionVariant>,
    expected: Option<u64>,
) -> Result<UpdateEndpointConfigResponse, tonic::Status> {
    c.update_endpoint_config(UpdateEndpointConfigRequest {
        endpoint_config_name: name.into(),
        production_variants: variants,
        expected_revision: expected,
    })
    .await
    .map(|r| r.into_inner())
}

pub async fn create_endpoint(
    c: &mut ControlPlaneClient<Channel>,
    name: &str,
    config: &str,
) -> Endpoint {
    c.create_endpoint(CreateEndpointRequest {
        endpoint_name: name.into(),
        endpoint_config_name: config.into(),
    })
    .await
    .expect("create endpoint")
    .into_inner()
    .endpoint
    .unwrap()
}

pub async fn register(
    c: &mut ControlPlaneClient<Channel>,
    req: RegisterInstanceRequest,
) -> RegisteredInstance {
    c.register_instance(req)
        .await
        .expect("register instance")
        .into_inner()
        .instance
        .unwrap()
}

/// A control plane over `backend` in a directory of its own, checking leases every second with
/// no metrics listener, and a client of it: how most cases start. The directory goes when the
/// returned `TempDir` drops (bound first, it drops after the control plane).
async fn control_plane(
    backend: &Backend,
) -> (
    tempfile::TempDir,
    InProcessControlPlane,
    ControlPlaneClient<Channel>,
) {
    control_plane_with(backend, Duration::from_millis(1000), false).await
}

/// [`control_plane`], checking leases every `lease_check` and serving metrics when `metrics`.
async fn control_plane_with(
    backend: &Backend,
    lease_check: Duration,
    metrics: bool,
) -> (
    tempfile::TempDir,
    InProcessControlPlane,
    ControlPlaneClient<Channel>,
) {
    let dir = tempfile::tempdir().unwrap();
    let cp = InProcessControlPlane::start_on(backend, dir.path(), lease_check, metrics).await;
    let c = cp.client().await;
    (dir, cp, c)
}

/// Config "cfg" with one variant "v1" over instance A, and endpoint "ep" routing with it.
pub async fn endpoint_ep_over_a(
    c: &mut ControlPlaneClient<Channel>,
    strategy: RoutingStrategy,
) -> Endpoint {
    create_config(c, "cfg", vec![variant("v1", strategy, &[A])]).await;
    create_endpoint(c, "ep", "cfg").await
}

/// Waits (5 s at most) until endpoint `ep` shows node `node_id` in a state `ok` accepts; the
/// endpoint's description then.
async fn wait_for_node(
    c: &ControlPlaneClient<Channel>,
    what: &str,
    node_id: &str,
    ok: impl Fn(&DataPlaneStatus) -> bool,
) -> DescribeEndpointResponse {
    let ok = &ok;
    wait_for(what, Duration::from_secs(5), || {
        let mut c = c.clone();
        async move {
            let d = describe_endpoint(&mut c, "ep").await;
            d.data_planes
                .iter()
                .any(|n| n.node_id == node_id && ok(n))
                .then_some(d)
        }
    })
    .await
}

pub async fn describe_endpoint(
    c: &mut ControlPlaneClient<Channel>,
    name: &str,
) -> DescribeEndpointResponse {
    c.describe_endpoint(DescribeEndpointRequest {
        endpoint_name: name.into(),
    })
    .await
    .expect("describe endpoint")
    .into_inner()
}

/// A router-side watch stream: send requests down `tx`, read tables from `rx`.
struct Watcher {
    tx: mpsc::Sender<WatchRoutingTableRequest>,
    rx: tonic::Streaming<WatchRoutingTableResponse>,
    node_id: String,
}

impl Watcher {
    async fn connect(url: &str, node_id: &str, applied_version: u64) -> Self {
        let mut client = RoutingDiscoveryClient::connect(url.to_string())
            .await
            .unwrap();
        let (tx, rx) = mpsc::channel(8);
        tx.send(WatchRoutingTableRequest {
            node_id: node_id.into(),
            applied_version,
            ..Default::default()
        })
        .await
        .unwrap();
        let rx = client
            .watch_routing_table(ReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner();
        Self {
            tx,
            rx,
            node_id: node_id.into(),
        }
    }

    async fn next(&mut self) -> (WatchRoutingTableResponse, RoutingTable) {
        let resp = tokio::time::timeout(Duration::from_secs(10), self.rx.next())
            .await
            .expect("a table within 10 s")
            .expect("stream open")
            .expect("no stream error");
        // the control plane sends nothing but tables, each with the nonce its answer names
        assert!(!resp.nonce.is_empty(), "not a table: {resp:?}");
        let table = RoutingTable::decode(resp.routing_table.clone()).expect("decodable table");
        assert_eq!(table.version, resp.version);
        (resp, table)
    }

    /// A status report: waiting requests per endpoint `(name, critical, standard, sheddable)`.
    async fn report(&self, queues: &[(&str, u32, u32, u32)]) {
        let queues = queues
            .iter()
            .map(
                |&(name, critical, standard, sheddable)| proto::EndpointQueue {
                    endpoint_name: name.into(),
                    critical,
                    standard,
                    sheddable,
                },
            )
            .collect();
        self.tx
            .send(WatchRoutingTableRequest {
                node_id: self.node_id.clone(),
                status: Some(proto::RouterStatus { queues }),
                ..Default::default()
            })
            .await
            .unwrap();
    }

    async fn reply(&self, resp: &WatchRoutingTableResponse, error: &str) {
        self.tx
            .send(WatchRoutingTableRequest {
                node_id: self.node_id.clone(),
                applied_version: resp.version,
                response_nonce: resp.nonce.clone(),
                error_detail: error.into(),
                status: None,
            })
            .await
            .unwrap();
    }
}

pub async fn configs_are_revisioned_and_endpoints_follow_them(backend: Backend) {
    let (_dir, cp, mut c) = control_plane(&backend).await;

    let created = create_config(
        &mut c,
        "cfg",
        vec![variant(
            "v1",
            RoutingStrategy::Random,
            &[A, "http://127.0.0.1:9002/"],
        )],
    )
    .await;
    assert_eq!(created.revision, 1);
    assert_eq!(
        created.production_variants[0].instances,
        vec![A.to_string(), B.to_string()],
        "URLs normalized"
    );

    let e = create_endpoint(&mut c, "ep", "cfg").await;
    let v_created = e.routing_table_version;

    let up = update_config(
        &mut c,
        "cfg",
        vec![variant("v1", RoutingStrategy::PrefixAware, &[A])],
        Some(1),
    )
    .await
    .unwrap();
    assert_eq!(up.endpoint_config.as_ref().unwrap().revision, 2);
    assert_eq!(
        up.routing_table_version,
        v_created + 1,
        "an update of a used config bumps the table version once"
    );

    // Old revisions stay readable, so a user can roll back.
    let old = c
        .describe_endpoint_config(DescribeEndpointConfigRequest {
            endpoint_config_name: "cfg".into(),
            revision: Some(1),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(old.latest_revision, 2);
    assert_eq!(
        old.endpoint_config.unwrap().production_variants[0]
            .instances
            .len(),
        2
    );
    assert_eq!(old.endpoint_names, vec!["ep".to_string()]);
    let latest = c
        .describe_endpoint_config(DescribeEndpointConfigRequest {
            endpoint_config_name: "cfg".into(),
            revision: None,
        })
        .await
        .unwrap()
        .into_inner()
        .endpoint_config
        .unwrap();
    let rc = latest.production_variants[0]
        .routing_config
        .clone()
        .unwrap();
    assert_eq!(rc.routing_strategy, RoutingStrategy::PrefixAware as i32);
    assert_eq!(rc.prefix_aware_routing_config.unwrap().prefix_length, 2048);
    let missing = c
        .describe_endpoint_config(DescribeEndpointConfigRequest {
            endpoint_config_name: "cfg".into(),
            revision: Some(9),
        })
        .await
        .unwrap_err();
    assert_eq!(missing.code(), Code::NotFound);

    // Optimistic concurrency.
    let stale = update_config(
        &mut c,
        "cfg",
        vec![variant("v1", RoutingStrategy::Random, &[A])],
        Some(1),
    )
    .await
    .unwrap_err();
    assert_eq!(stale.code(), Code::FailedPrecondition);
    assert!(
        stale.message().contains("revision 2"),
        "{}",
        stale.message()
    );

    // A config in use cannot be deleted; re-pointing the endpoint frees it.
    let refused = c
        .delete_endpoint_config(DeleteEndpointConfigRequest {
            endpoint_config_name: "cfg".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::FailedPrecondition);
    assert!(
        refused.message().contains("\"ep\""),
        "{}",
        refused.message()
    );
    create_config(
        &mut c,
        "cfg2",
        vec![variant(
            "v9",
            RoutingStrategy::LeastOutstandingRequests,
            &[B],
        )],
    )
    .await;
    let moved = c
        .update_endpoint(UpdateEndpointRequest {
            endpoint_name: "ep".into(),
            endpoint_config_name: "cfg2".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .endpoint
        .unwrap();
    assert_eq!(moved.endpoint_config_name, "cfg2");
    let d = describe_endpoint(&mut c, "ep").await;
    assert_eq!(
        d.endpoint_config.unwrap().production_variants[0].variant_name,
        "v9"
    );
    assert_eq!(d.current_routing_table_version, moved.routing_table_version);
    c.delete_endpoint_config(DeleteEndpointConfigRequest {
        endpoint_config_name: "cfg".into(),
    })
    .await
    .unwrap();

    let configs = c
        .list_endpoint_configs(ListEndpointConfigsRequest {})
        .await
        .unwrap()
        .into_inner()
        .endpoint_configs;
    assert_eq!(
        configs
            .iter()
            .map(|c| c.endpoint_config_name.as_str())
            .collect::<Vec<_>>(),
        vec!["cfg2"]
    );
    let endpoints = c
        .list_endpoints(ListEndpointsRequest {})
        .await
        .unwrap()
        .into_inner()
        .endpoints;
    assert_eq!(endpoints.len(), 1);

    c.delete_endpoint(DeleteEndpointRequest {
        endpoint_name: "ep".into(),
    })
    .await
    .unwrap();
    let gone = c
        .describe_endpoint(DescribeEndpointRequest {
            endpoint_name: "ep".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(gone.code(), Code::NotFound);
    let dup = c
        .create_endpoint_config(CreateEndpointConfigRequest {
            endpoint_config_name: "cfg2".into(),
            production_variants: vec![variant("v1", RoutingStrategy::Random, &[A])],
        })
        .await
        .unwrap_err();
    assert_eq!(dup.code(), Code::AlreadyExists);
    cp.stop().await.unwrap();
}

pub async fn invalid_input_is_rejected_and_nothing_is_written(backend: Backend) {
    let (_dir, _cp, mut c) = control_plane(&backend).await;
    endpoint_ep_over_a(&mut c, RoutingStrategy::Random).await;
    let before_configs = c
        .list_endpoint_configs(ListEndpointConfigsRequest {})
        .await
        .unwrap()
        .into_inner();
    let before_version = describe_endpoint(&mut c, "ep")
        .await
        .current_routing_table_version;

    let prefix = |len: u32, thr: u32| {
        let mut v = variant("v1", RoutingStrategy::PrefixAware, &[A]);
        v.routing_config
            .as_mut()
            .unwrap()
            .prefix_aware_routing_config = Some(PrefixAwareRoutingConfig {
            prefix_length: len,
            concurrency_threshold: thr,
            ..Default::default()
        });
        v
    };
    let mut weight0 = variant("v1", RoutingStrategy::Random, &[A]);
    weight0.initial_variant_weight = Some(0.0);
    let mut bad_strategy = variant("v1", RoutingStrategy::Random, &[A]);
    bad_strategy
        .routing_config
        .as_mut()
        .unwrap()
        .routing_strategy = 17;
    let cases: Vec<(&str, Vec<ProductionVariant>, &str)> = vec![
        (
            "",
            vec![variant("v1", RoutingStrategy::Random, &[A])],
            "endpoint_config_name",
        ),
        ("cfg", vec![], "production_variants"),
        (
            "cfg",
            vec![variant("", RoutingStrategy::Random, &[A])],
            "production_variants[0].variant_name",
        ),
        (
            "cfg",
            vec![
                variant("v1", RoutingStrategy::Random, &[A]),
                variant("v1", RoutingStrategy::Random, &[B]),
            ],
            "duplicate variant name \"v1\"",
        ),
        ("cfg", vec![bad_strategy], "unknown routing strategy 17"),
        (
            "cfg",
            vec![weight0],
            "production_variants[0].initial_variant_weight",
        ),
        (
            "cfg",
            vec![prefix(63, 1)],
            "prefix_length: 63 is outside 64..=65536",
        ),
        (
            "cfg",
            vec![prefix(65537, 1)],
            "prefix_length: 65537 is outside",
        ),
        (
            "cfg",
            vec![prefix(64, 4097)],
            "concurrency_threshold: 4097 is outside 1..=4096",
        ),
        (
            "cfg",
            vec![variant("v1", RoutingStrategy::Random, &["not a url"])],
            "production_variants[0].instances[0]",
        ),
        (
            "cfg",
            vec![variant("v1", RoutingStrategy::Random, &["http://h:1/v1"])],
            "\"http://h:1/v1\"",
        ),
        (
            "cfg",
            vec![variant("v1", RoutingStrategy::Random, &[A, A])],
            "duplicate instance",
        ),
    ];
    for (name, variants, needle) in cases {
        let err = update_config(&mut c, name, variants.clone(), None)
            .await
            .unwrap_err();
        assert_eq!(
            err.code(),
            Code::InvalidArgument,
            "{needle}: {}",
            err.message()
        );
        assert!(
            err.message().contains(needle),
            "expected {needle:?} in {:?}",
            err.message()
        );
        let err = c
            .create_endpoint_config(CreateEndpointConfigRequest {
                endpoint_config_name: if name.is_empty() {
                    String::new()
                } else {
                    format!("{name}x")
                },
                production_variants: variants,
            })
            .await
            .unwrap_err();
        assert_eq!(
            err.code(),
            Code::InvalidArgument,
            "{needle}: {}",
            err.message()
        );
    }
    let bad_endpoint = c
        .create_endpoint(CreateEndpointRequest {
            endpoint_name: "no spaces".into(),
            endpoint_config_name: "cfg".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(bad_endpoint.code(), Code::InvalidArgument);
    let bad_register = c
        .register_instance(RegisterInstanceRequest {
            endpoint_name: "ep".into(),
            variant_name: "v1".into(),
            address: "tcp://x".into(),
            lease_ttl_seconds: 0,
        })
        .await
        .unwrap_err();
    assert_eq!(bad_register.code(), Code::InvalidArgument);
    assert!(
        bad_register.message().contains("address"),
        "{}",
        bad_register.message()
    );
    let bad_ttl = c
        .register_instance(RegisterInstanceRequest {
            endpoint_name: "ep".into(),
            variant_name: "v1".into(),
            address: B.into(),
            lease_ttl_seconds: 7200,
        })
        .await
        .unwrap_err();
    assert!(
        bad_ttl.message().contains("lease_ttl_seconds: 7200"),
        "{}",
        bad_ttl.message()
    );
    let unknown_variant = c
        .register_instance(RegisterInstanceRequest {
            endpoint_name: "ep".into(),
            variant_name: "nope".into(),
            address: B.into(),
            lease_ttl_seconds: 0,
        })
        .await
        .unwrap_err();
    assert_eq!(unknown_variant.code(), Code::NotFound);

    let after_configs = c
        .list_endpoint_configs(ListEndpointConfigsRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        before_configs, after_configs,
        "a rejected request writes nothing"
    );
    let d = describe_endpoint(&mut c, "ep").await;
    assert_eq!(
        d.current_routing_table_version, before_version,
        "a rejected request bumps no version"
    );
    assert!(d.registered_instances.is_empty());
}

pub async fn watcher_gets_current_table_then_each_version_and_reports_rollout(backend: Backend) {
    let (_dir, cp, mut c) = control_plane(&backend).await;
    let ep = endpoint_ep_over_a(&mut c, RoutingStrategy::Random).await;

    let mut w = Watcher::connect(&cp.url, "router-1", 0).await;
    let (resp, table) = w.next().await;
    assert_eq!(
        resp.version, ep.routing_table_version,
        "the current table at once"
    );
    assert_eq!(table.endpoints[0].variants[0].instances[0].address, A);
    w.reply(&resp, "").await;
    wait_for_node(&c, "ACK recorded", "router-1", |n| {
        n.up_to_date && n.connected
    })
    .await;

    // Each new version arrives, in order.
    let mut last = resp.version;
    for (i, strategy) in [
        RoutingStrategy::PrefixAware,
        RoutingStrategy::LeastOutstandingRequests,
        RoutingStrategy::Random,
    ]
    .into_iter()
    .enumerate()
    {
        let up = update_config(
            &mut c,
            "cfg",
            vec![variant("v1", strategy, &[A, B])],
            Some(i as u64 + 1),
        )
        .await
        .unwrap();
        let (resp, table) = w.next().await;
        assert_eq!(resp.version, up.routing_table_version);
        assert!(resp.version > last);
        last = resp.version;
        let v = &table.endpoints[0].variants[0];
        assert_eq!(
            v.routing_config.as_ref().unwrap().routing_strategy,
            strategy as i32
        );
        assert_eq!(v.instances.len(), 2);
        assert_eq!(table.endpoints[0].endpoint_config_revision, i as u64 + 2);
        if i == 2 {
            w.reply(&resp, "instance URL unreachable in this test")
                .await;
        } else {
            w.reply(&resp, "").await;
            // Recorded before the next version is pushed: a reply to a push that is no longer
            // the latest is stale (xDS), ignored, and the node would stay a version behind.
            let version = resp.version;
            wait_for_node(&c, "ACK recorded", "router-1", |n| {
                n.applied_version == version
            })
            .await;
        }
    }
    // A NACK is recorded and leaves the node behind.
    let d = wait_for_node(&c, "NACK recorded", "router-1", |n| !n.last_nack.is_empty()).await;
    let node = d
        .data_planes
        .iter()
        .find(|n| n.node_id == "router-1")
        .unwrap();
    assert!(!node.up_to_date);
    assert_eq!(node.applied_version, last - 1);
    assert_eq!(d.endpoint.unwrap().routing_table_version, last);
    cp.stop().await.unwrap();
}

pub async fn metrics_report_rpcs_watchers_and_each_nodes_lag(backend: Backend) {
    let (_dir, cp, mut c) = control_plane_with(&backend, Duration::from_millis(1000), true).await;
    let ep = endpoint_ep_over_a(&mut c, RoutingStrategy::Random).await;
    let again = c
        .create_endpoint(CreateEndpointRequest {
            endpoint_name: "ep".into(),
            endpoint_config_name: "cfg".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(again.code(), Code::AlreadyExists);

    // A node that has the table but has not answered yet is a whole version behind.
    let mut w = Watcher::connect(&cp.url, "router-1", 0).await;
    let (resp, _) = w.next().await;
    let current = ep.routing_table_version;
    let text = cp.metrics().await;
    let rpc = |method: &str, code: &str| {
        format!(
            "prefix_router_control_plane_rpc_requests_total{{service=\"prefixrouter.v1.ControlPlane\",method=\"{method}\",code=\"{code}\"}} 1\n"
        )
    };
    for (method, code) in [
        ("CreateEndpointConfig", "OK"),
        ("CreateEndpoint", "OK"),
        ("CreateEndpoint", "AlreadyExists"),
    ] {
        assert!(
            text.contains(&rpc(method, code)),
            "no {method} {code} in:\n{text}"
        );
    }
    assert!(text.contains("prefix_router_control_plane_rpc_duration_seconds_count{service=\"prefixrouter.v1.ControlPlane\",method=\"CreateEndpoint\",code=\"OK\"} 1\n"), "{text}");
    assert!(
        text.contains(&format!(
            "prefix_router_control_plane_routing_table_version {current}\n"
        )),
        "{text}"
    );
    assert!(
        text.contains("prefix_router_control_plane_watch_streams 1\n"),
        "{text}"
    );
    assert!(
        text.contains(&format!(
            "prefix_router_control_plane_node_version_lag{{node_id=\"router-1\"}} {current}\n"
        )),
        "{text}"
    );
    assert!(
        text.contains("prefix_router_control_plane_node_connected{node_id=\"router-1\"} 1\n"),
        "{text}"
    );

    // After its ACK it is up to date; after a new version, one behind again.
    w.reply(&resp, "").await;
    wait_for("the ACK in the metrics", Duration::from_secs(5), || async {
        let text = cp.metrics().await;
        text.contains("prefix_router_control_plane_node_version_lag{node_id=\"router-1\"} 0\n")
            .then_some(())
    })
    .await;
    let text = cp.metrics().await;
    assert!(
        text.contains(&format!(
            "prefix_router_control_plane_node_applied_version{{node_id=\"router-1\"}} {current}\n"
        )),
        "{text}"
    );
    update_config(
        &mut c,
        "cfg",
        vec![variant("v1", RoutingStrategy::PrefixAware, &[A])],
        None,
    )
    .await
    .unwrap();
    let text = cp.metrics().await;
    assert!(
        text.contains("prefix_router_control_plane_node_version_lag{node_id=\"router-1\"} 1\n"),
        "{text}"
    );

    // A dropped watcher is no longer connected.
    drop(w);
    wait_for(
        "the watcher gone from the metrics",
        Duration::from_secs(5),
        || async {
            cp.metrics()
                .await
                .contains("prefix_router_control_plane_watch_streams 0\n")
                .then_some(())
        },
    )
    .await;
    cp.stop().await.unwrap();
}

/// A router's status report (its queues) answers no push, shows in `DescribeEndpoint` for the
/// endpoint described only, and goes with the router's stream.
pub async fn status_reports_show_per_endpoint_until_the_stream_ends(backend: Backend) {
    let (_dir, cp, mut c) = control_plane(&backend).await;
    endpoint_ep_over_a(&mut c, RoutingStrategy::PrefixAware).await;
    let mut w = Watcher::connect(&cp.url, "router-1", 0).await;
    let (resp, _) = w.next().await;
    w.report(&[("ep", 1, 2, 3), ("other", 9, 9, 9)]).await;
    let d = wait_for_node(&c, "the report recorded", "router-1", |n| {
        !n.queues.is_empty()
    })
    .await;
    let node = d.data_planes.iter().find(|n| n.node_id == "router-1");
    let node = node.unwrap();
    assert_eq!(
        node.queues,
        vec![proto::EndpointQueue {
            endpoint_name: "ep".into(),
            critical: 1,
            standard: 2,
            sheddable: 3,
        }],
        "only the described endpoint's queue"
    );
    assert!(
        !node.up_to_date && node.applied_version == 0,
        "a status report is no ACK: {node:?}"
    );
    w.reply(&resp, "").await;
    wait_for_node(&c, "the ACK after a report", "router-1", |n| n.up_to_date).await;
    // A report that nothing waits any more.
    w.report(&[]).await;
    wait_for_node(&c, "the emptied queue", "router-1", |n| n.queues.is_empty()).await;
    w.report(&[("ep", 0, 4, 0)]).await;
    wait_for_node(&c, "the new report", "router-1", |n| !n.queues.is_empty()).await;
    // Reports bring no response: the next thing the router hears is the next table.
    let wider = vec![variant("v1", RoutingStrategy::PrefixAware, &[A, B])];
    update_config(&mut c, "cfg", wider, None).await.unwrap();
    let (next, _) = w.next().await;
    assert!(next.version > resp.version, "{next:?}");
    drop(w);
    let d = wait_for_node(&c, "the stream gone", "router-1", |n| !n.connected).await;
    let node = d.data_planes.iter().find(|n| n.node_id == "router-1");
    assert!(
        node.unwrap().queues.is_empty(),
        "a gone router holds no queue"
    );
    cp.stop().await.unwrap();
}

pub async fn reconnect_with_current_version_gets_no_resend(backend: Backend) {
    let (_dir, cp, mut c) = control_plane(&backend).await;
    let ep = endpoint_ep_over_a(&mut c, RoutingStrategy::Random).await;

    let mut w = Watcher::connect(&cp.url, "router-1", ep.routing_table_version).await;
    // Nothing is resent for the version it holds: the first thing it receives is the next one.
    let up = update_config(
        &mut c,
        "cfg",
        vec![variant("v1", RoutingStrategy::PrefixAware, &[A])],
        None,
    )
    .await
    .unwrap();
    let (resp, _) = w.next().await;
    assert_eq!(resp.version, up.routing_table_version);
    assert_eq!(resp.version, ep.routing_table_version + 1);
}

pub async fn concurrent_updates_lose_no_write_and_reuse_no_version(backend: Backend) {
    let (_dir, _cp, mut c) = control_plane(&backend).await;
    let ep = endpoint_ep_over_a(&mut c, RoutingStrategy::Random).await;

    let mut tasks = Vec::new();
    for t in 0..8 {
        let mut c = c.clone();
        tasks.push(tokio::spawn(async move {
            let mut versions = Vec::new();
            for i in 0..6 {
                let addr = format!("http://127.0.0.1:{}", 10_000 + t * 100 + i);
                let up = update_config(
                    &mut c,
                    "cfg",
                    vec![variant("v1", RoutingStrategy::Random, &[&addr])],
                    None,
                )
                .await
                .unwrap();
                versions.push((
                    up.routing_table_version,
                    up.endpoint_config.unwrap().revision,
                ));
            }
            versions
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap());
    }
    let mut versions: Vec<u64> = all.iter().map(|v| v.0).collect();
    let mut revisions: Vec<u64> = all.iter().map(|v| v.1).collect();
    versions.sort();
    revisions.sort();
    versions.dedup();
    revisions.dedup();
    assert_eq!(versions.len(), 48, "every update got its own version");
    assert_eq!(
        revisions,
        (2..=49).collect::<Vec<_>>(),
        "every update got its own revision"
    );
    let d = describe_endpoint(&mut c, "ep").await;
    assert_eq!(
        d.current_routing_table_version,
        ep.routing_table_version + 48
    );
    assert_eq!(d.endpoint_config.unwrap().revision, 49);
}

pub async fn registered_instances_join_the_table_and_leave_when_their_lease_expires(
    backend: Backend,
) {
    let (_dir, cp, mut c) = control_plane_with(&backend, Duration::from_millis(50), false).await;
    endpoint_ep_over_a(&mut c, RoutingStrategy::PrefixAware).await;
    let mut w = Watcher::connect(&cp.url, "router-1", 0).await;
    w.next().await;

    let reg = |addr: &str, ttl: u32| RegisterInstanceRequest {
        endpoint_name: "ep".into(),
        variant_name: "v1".into(),
        address: addr.into(),
        lease_ttl_seconds: ttl,
    };
    let short = register(&mut c, reg(B, 1)).await;
    let long = register(&mut c, reg("http://127.0.0.1:9003", 600)).await;
    let again = register(&mut c, reg("http://127.0.0.1:9003", 600)).await;
    assert_eq!(
        long.instance_id, again.instance_id,
        "re-registering an address renews it"
    );
    uuid_like(&short.instance_id);

    let (_, t1) = w.next().await;
    let ids = |t: &RoutingTable| {
        t.endpoints[0].variants[0]
            .instances
            .iter()
            .map(|i| i.instance_id.clone())
            .collect::<Vec<_>>()
    };
    assert!(ids(&t1).contains(&short.instance_id));
    let (_, t2) = w.next().await;
    assert_eq!(
        ids(&t2),
        vec![
            A.to_string(),
            short.instance_id.clone(),
            long.instance_id.clone()
        ]
    );

    // The short lease is not renewed: the instance leaves the table by itself.
    let (_, t3) = w.next().await;
    assert_eq!(ids(&t3), vec![A.to_string(), long.instance_id.clone()]);

    c.renew_instance_lease(RenewInstanceLeaseRequest {
        instance_id: long.instance_id.clone(),
    })
    .await
    .unwrap();
    c.deregister_instance(DeregisterInstanceRequest {
        instance_id: long.instance_id.clone(),
    })
    .await
    .unwrap();
    let (_, t4) = w.next().await;
    assert_eq!(ids(&t4), vec![A.to_string()]);
    let err = c
        .deregister_instance(DeregisterInstanceRequest {
            instance_id: long.instance_id,
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound);
}

pub fn uuid_like(s: &str) {
    assert_eq!(s.len(), 36, "{s}");
    assert_eq!(s.matches('-').count(), 4, "{s}");
}

pub async fn reflection_lists_the_services(backend: Backend) {
    let (_dir, cp, _) = control_plane(&backend).await;
    // Both protocols: v1, and v1alpha, the only one grpcio-reflection and older tools speak.
    let listings = [
        ("v1", reflection_v1::list_services(&cp.url).await),
        ("v1alpha", reflection_v1alpha::list_services(&cp.url).await),
    ];
    for (protocol, services) in listings {
        for s in [
            "prefixrouter.v1.ControlPlane",
            "prefixrouter.v1.RoutingDiscovery",
        ] {
            assert!(
                services.iter().any(|x| x == s),
                "{s} missing from the {protocol} listing {services:?}"
            );
        }
    }
}

/// A minimal reflection client (list services) on tonic-reflection's generated types of one
/// protocol version; the two versions' messages are the same shape in different packages.
macro_rules! reflection_client {
    ($name:ident, $pb:path) => {
        mod $name {
            use pb::server_reflection_client::ServerReflectionClient;
            use pb::server_reflection_request::MessageRequest;
            use pb::server_reflection_response::MessageResponse;
            use pb::ServerReflectionRequest;
            use $pb as pb;

            pub async fn list_services(url: &str) -> Vec<String> {
                let channel = tonic::transport::Endpoint::from_shared(url.to_string())
                    .unwrap()
                    .connect()
                    .await
                    .unwrap();
                let mut client = ServerReflectionClient::new(channel);
                let req = ServerReflectionRequest {
                    host: String::new(),
                    message_request: Some(MessageRequest::ListServices(String::new())),
                };
                let mut stream = client
                    .server_reflection_info(tokio_stream::iter(vec![req]))
                    .await
                    .unwrap()
                    .into_inner();
                let resp = stream.message().await.unwrap().unwrap();
                match resp.message_response {
                    Some(MessageResponse::ListServicesResponse(l)) => {
                        l.service.into_iter().map(|s| s.name).collect()
                    }
                    other => panic!("unexpected reflection answer {other:?}"),
                }
            }
        }
    };
}
reflection_client!(reflection_v1, tonic_reflection::pb::v1);
reflection_client!(reflection_v1alpha, tonic_reflection::pb::v1alpha);

/// One `#[tokio::test]` per case of the suite, each run as `RUN(case).await`, where `RUN` is
/// an async fn taking the case (`FnOnce(Backend) -> impl Future`) that sets up the backend.
#[macro_export]
macro_rules! contract_suite {
    ($run:path) => {
        $crate::contract_suite!(@cases $run; configs_are_revisioned_and_endpoints_follow_them, invalid_input_is_rejected_and_nothing_is_written, watcher_gets_current_table_then_each_version_and_reports_rollout, status_reports_show_per_endpoint_until_the_stream_ends, metrics_report_rpcs_watchers_and_each_nodes_lag, reconnect_with_current_version_gets_no_resend, concurrent_updates_lose_no_write_and_reuse_no_version, registered_instances_join_the_table_and_leave_when_their_lease_expires, reflection_lists_the_services);
    };
    (@cases $run:path; $($name:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                $run($crate::contract::$name).await
            }
        )*
    };
}
