//! `prefixctl`'s API commands, run as the real binary against an in-process control plane:
//! the happy paths, JSON output parsed back, and every error path with its exit code.

mod common;

use common::{prefixctl, ControlPlane, VARIANTS};
use predicates::prelude::*;
use serde_json::Value;

#[test]
fn endpoint_config_and_endpoint_lifecycle() {
    let cp = ControlPlane::start();

    // Create: the table names the config and its variant.
    cp.prefixctl(&[
        "endpoint-config",
        "create",
        "--endpoint-config-name",
        "chat",
        "--production-variants",
        VARIANTS,
    ])
    .assert()
    .success()
    .stdout(predicate::str::contains("chat").and(predicate::str::contains("RANDOM")));

    // Describe as JSON: SageMaker-shaped, revision 1.
    let d = cp.json(&[
        "endpoint-config",
        "describe",
        "--endpoint-config-name",
        "chat",
    ]);
    assert_eq!(d["EndpointConfigName"], "chat");
    assert_eq!(d["Revision"], 1);
    assert_eq!(d["LatestRevision"], 1);
    assert_eq!(d["ProductionVariants"][0]["VariantName"], "v1");
    assert_eq!(
        d["ProductionVariants"][0]["RoutingConfig"]["RoutingStrategy"],
        "RANDOM"
    );
    assert_eq!(
        d["ProductionVariants"][0]["Instances"]
            .as_array()
            .unwrap()
            .len(),
        2
    );

    // An endpoint on it.
    let e = cp.json(&[
        "endpoint",
        "create",
        "--endpoint-name",
        "ep",
        "--endpoint-config-name",
        "chat",
    ]);
    assert_eq!(e["EndpointName"], "ep");
    let created_version = e["RoutingTableVersion"].as_u64().unwrap();
    assert!(created_version > 0);

    // The strategy shortcut writes revision 2 and bumps the routing table.
    let u = cp.json(&[
        "endpoint-config",
        "update",
        "--endpoint-config-name",
        "chat",
        "--variant-name",
        "v1",
        "--routing-strategy",
        "PREFIX_AWARE",
        "--prefix-length",
        "512",
    ]);
    assert_eq!(u["Revision"], 2);
    assert_eq!(u["RoutingTableVersion"], created_version + 1);
    let rc = &u["ProductionVariants"][0]["RoutingConfig"];
    assert_eq!(rc["RoutingStrategy"], "PREFIX_AWARE");
    assert_eq!(rc["PrefixAwareRoutingConfig"]["PrefixLength"], 512);
    assert_eq!(
        rc["PrefixAwareRoutingConfig"]["ConcurrencyThreshold"], 64,
        "server default filled in"
    );
    assert_eq!(
        u["ProductionVariants"][0]["Instances"], d["ProductionVariants"][0]["Instances"],
        "the rest is kept"
    );

    // Old revisions stay readable.
    let old = cp.json(&[
        "endpoint-config",
        "describe",
        "--endpoint-config-name",
        "chat",
        "--revision",
        "1",
    ]);
    assert_eq!(old["Revision"], 1);
    assert_eq!(old["LatestRevision"], 2);
    assert_eq!(
        old["ProductionVariants"][0]["RoutingConfig"]["RoutingStrategy"],
        "RANDOM"
    );
    cp.prefixctl(&[
        "endpoint-config",
        "describe",
        "--endpoint-config-name",
        "chat",
        "--revision",
        "1",
    ])
    .assert()
    .success()
    .stdout(predicate::str::contains("1 (latest 2)"));

    // Endpoint describe shows the version and the (empty) rollout status.
    let ed = cp.json(&["endpoint", "describe", "--endpoint-name", "ep"]);
    assert_eq!(ed["EndpointConfigName"], "chat");
    assert_eq!(ed["EndpointConfigRevision"], 2);
    assert_eq!(ed["RoutingTableVersion"], created_version + 1);
    assert_eq!(ed["CurrentRoutingTableVersion"], created_version + 1);
    assert_eq!(ed["EndpointStatus"], "InService");
    assert_eq!(ed["DataPlanes"], Value::Array(vec![]));
    cp.prefixctl(&["endpoint", "describe", "--endpoint-name", "ep"])
        .assert()
        .success()
        .stdout(
            predicate::str::contains("Data planes:").and(predicate::str::contains("PREFIX_AWARE")),
        );

    // Lists.
    let configs = cp.json(&["endpoint-config", "list"]);
    assert_eq!(configs["EndpointConfigs"].as_array().unwrap().len(), 1);
    cp.prefixctl(&["endpoint-config", "list"])
        .assert()
        .success()
        .stdout(predicate::str::contains("v1=PREFIX_AWARE"));
    let endpoints = cp.json(&["endpoint", "list"]);
    assert_eq!(endpoints["Endpoints"][0]["EndpointName"], "ep");
    cp.prefixctl(&["endpoint", "list"])
        .assert()
        .success()
        .stdout(predicate::str::contains("ep"));

    // Re-point the endpoint, then delete everything.
    cp.prefixctl(&[
        "endpoint-config",
        "create",
        "--endpoint-config-name",
        "other",
        "--production-variants",
        VARIANTS,
    ])
    .assert()
    .success();
    let moved = cp.json(&[
        "endpoint",
        "update",
        "--endpoint-name",
        "ep",
        "--endpoint-config-name",
        "other",
    ]);
    assert_eq!(moved["EndpointConfigName"], "other");
    cp.prefixctl(&["endpoint", "delete", "--endpoint-name", "ep"])
        .assert()
        .success()
        .stdout(predicate::str::is_empty())
        .stderr(predicate::str::contains("deleted endpoint \"ep\""));
    assert_eq!(
        cp.json(&[
            "endpoint-config",
            "delete",
            "--endpoint-config-name",
            "chat"
        ]),
        serde_json::json!({})
    );
    cp.prefixctl(&[
        "endpoint-config",
        "delete",
        "--endpoint-config-name",
        "other",
    ])
    .assert()
    .success();
    assert_eq!(
        cp.json(&["endpoint-config", "list"])["EndpointConfigs"],
        Value::Array(vec![])
    );
    cp.prefixctl(&["endpoint", "describe", "--endpoint-name", "ep"])
        .assert()
        .code(1)
        .stderr(predicate::str::starts_with("error: NotFound: "));
}

#[test]
fn json_output_pastes_back_in() {
    let cp = ControlPlane::start();
    let sagemaker = r#"[{"VariantName":"AllTraffic","ModelName":"llama","InstanceType":"ml.g5.12xlarge",
        "InitialInstanceCount":2,"VolumeSizeInGB":256,"InitialVariantWeight":1.0,
        "Instances":["http://127.0.0.1:9001"],
        "RoutingConfig":{"RoutingStrategy":"LEAST_OUTSTANDING_REQUESTS"}}]"#;
    cp.prefixctl(&[
        "endpoint-config",
        "create",
        "--endpoint-config-name",
        "sm",
        "--production-variants",
        sagemaker,
    ])
    .assert()
    .success();

    // A saved describe (the whole document) goes back in through file://.
    let described = cp
        .prefixctl(&[
            "endpoint-config",
            "describe",
            "--endpoint-config-name",
            "sm",
            "--output",
            "json",
        ])
        .output()
        .unwrap();
    assert!(described.status.success());
    let dir = tempfile::tempdir().unwrap();
    let whole = dir.path().join("described.json");
    std::fs::write(&whole, &described.stdout).unwrap();
    let u = cp.json(&[
        "endpoint-config",
        "update",
        "--endpoint-config-name",
        "sm",
        "--production-variants",
        &format!("file://{}", whole.display()),
        "--expected-revision",
        "1",
    ]);
    assert_eq!(u["Revision"], 2);
    let first: Value = serde_json::from_slice(&described.stdout).unwrap();
    assert_eq!(u["ProductionVariants"], first["ProductionVariants"]);

    // So does just the ProductionVariants list.
    let list = dir.path().join("variants.json");
    std::fs::write(
        &list,
        serde_json::to_vec_pretty(&first["ProductionVariants"]).unwrap(),
    )
    .unwrap();
    let u = cp.json(&[
        "endpoint-config",
        "update",
        "--endpoint-config-name",
        "sm",
        "--production-variants",
        &format!("file://{}", list.display()),
    ]);
    assert_eq!(u["Revision"], 3);
    assert_eq!(u["ProductionVariants"], first["ProductionVariants"]);

    // A stale expected revision is the server's FAILED_PRECONDITION, exit 1.
    cp.prefixctl(&[
        "endpoint-config",
        "update",
        "--endpoint-config-name",
        "sm",
        "--production-variants",
        &format!("file://{}", list.display()),
        "--expected-revision",
        "1",
    ])
    .assert()
    .code(1)
    .stdout(predicate::str::is_empty())
    .stderr(predicate::str::starts_with("error: FailedPrecondition: "));
}

#[test]
fn instances_register_renew_and_deregister() {
    let cp = ControlPlane::start();
    cp.create_config_c_and_endpoint_e();
    let i = cp.json(&[
        "instance",
        "register",
        "--endpoint-name",
        "e",
        "--variant-name",
        "v1",
        "--address",
        "http://127.0.0.1:9100",
        "--lease-ttl-seconds",
        "120",
    ]);
    let id = i["InstanceId"].as_str().unwrap().to_string();
    assert_eq!(i["Address"], "http://127.0.0.1:9100");
    assert_eq!(i["LeaseTtlSeconds"], 120);
    let described = cp.json(&["endpoint", "describe", "--endpoint-name", "e"]);
    assert_eq!(
        described["RegisteredInstances"][0]["InstanceId"],
        id.as_str()
    );

    let renewed = cp.json(&["instance", "renew", "--instance-id", &id]);
    assert_eq!(renewed["InstanceId"], id.as_str());
    assert!(
        renewed["LeaseExpiresTime"].as_str().unwrap() >= i["LeaseExpiresTime"].as_str().unwrap()
    );

    cp.prefixctl(&["instance", "deregister", "--instance-id", &id])
        .assert()
        .success();
    cp.prefixctl(&["instance", "renew", "--instance-id", &id])
        .assert()
        .code(1)
        .stderr(predicate::str::starts_with("error: NotFound: "));
    cp.prefixctl(&[
        "instance",
        "register",
        "--endpoint-name",
        "e",
        "--variant-name",
        "v9",
        "--address",
        "http://127.0.0.1:9100",
    ])
    .assert()
    .code(1)
    .stderr(predicate::str::contains("v9"));
}

#[test]
fn routing_table_watch_prints_each_version() {
    let cp = ControlPlane::start();
    cp.create_config_c_and_endpoint_e();

    let out = cp
        .prefixctl(&[
            "routing-table",
            "watch",
            "--count",
            "1",
            "--output",
            "json",
            "--node-id",
            "t1",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<&str> = std::str::from_utf8(&out.stdout).unwrap().lines().collect();
    assert_eq!(lines.len(), 1, "one JSON object per line per version");
    let table: Value = serde_json::from_str(lines[0]).unwrap();
    assert!(table["Version"].as_u64().unwrap() > 0);
    let variant = &table["Endpoints"][0]["Variants"][0];
    assert_eq!(variant["RoutingConfig"]["RoutingStrategy"], "RANDOM");
    assert_eq!(variant["InstanceCount"], 2);

    cp.prefixctl(&["routing-table", "watch", "--count", "1"])
        .assert()
        .success()
        .stdout(
            predicate::str::contains(format!("routing table version {}", table["Version"]))
                .and(predicate::str::contains("RANDOM")),
        );

    // The watcher ACKed: it shows up as up to date.
    let d = cp.json(&["endpoint", "describe", "--endpoint-name", "e"]);
    let t1 = d["DataPlanes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["NodeId"] == "t1")
        .expect("watcher listed");
    assert_eq!(t1["AppliedVersion"], table["Version"]);
}

#[test]
fn strategy_shortcut_changes_one_variant_and_survives_concurrent_writers() {
    let cp = ControlPlane::start();
    let variants: Vec<Value> = (1..=4)
        .map(|i| serde_json::json!({"VariantName": format!("v{i}"), "ModelName": "llama", "Instances": [format!("http://127.0.0.1:{}", 9000 + i)]}))
        .collect();
    let variants = serde_json::to_string(&variants).unwrap();
    cp.prefixctl(&[
        "endpoint-config",
        "create",
        "--endpoint-config-name",
        "c",
        "--production-variants",
        &variants,
    ])
    .assert()
    .success();

    // Four writers at once, each on its own variant: describe, change, write with
    // expected_revision, retry on conflict. Every change lands, one revision each.
    let writers: Vec<_> = (1..=4)
        .map(|i| {
            let mut cmd = cp.std_prefixctl(&[
                "endpoint-config",
                "update",
                "--endpoint-config-name",
                "c",
                "--variant-name",
                &format!("v{i}"),
                "--routing-strategy",
                "PREFIX_AWARE",
            ]);
            cmd.stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    for w in writers {
        let out = w.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let d = cp.json(&["endpoint-config", "describe", "--endpoint-config-name", "c"]);
    assert_eq!(d["Revision"], 5);
    for v in d["ProductionVariants"].as_array().unwrap() {
        assert_eq!(v["RoutingConfig"]["RoutingStrategy"], "PREFIX_AWARE", "{v}");
    }

    // The proto spelling and lower case are accepted; the other variants are untouched.
    cp.json(&[
        "endpoint-config",
        "update",
        "--endpoint-config-name",
        "c",
        "--variant-name",
        "v2",
        "--routing-strategy",
        "ROUTING_STRATEGY_RANDOM",
    ]);
    let u = cp.json(&[
        "endpoint-config",
        "update",
        "--endpoint-config-name",
        "c",
        "--variant-name",
        "v3",
        "--routing-strategy",
        "least_outstanding_requests",
    ]);
    let strategies: Vec<&str> = u["ProductionVariants"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["RoutingConfig"]["RoutingStrategy"].as_str().unwrap())
        .collect();
    assert_eq!(
        strategies,
        [
            "PREFIX_AWARE",
            "RANDOM",
            "LEAST_OUTSTANDING_REQUESTS",
            "PREFIX_AWARE"
        ]
    );

    cp.prefixctl(&[
        "endpoint-config",
        "update",
        "--endpoint-config-name",
        "c",
        "--variant-name",
        "v7",
        "--routing-strategy",
        "RANDOM",
    ])
    .assert()
    .code(1)
    .stderr(predicate::str::starts_with(
        "error: NotFound: no variant \"v7\" in endpoint config \"c\" (it has: v1, v2, v3, v4)",
    ));
}

#[test]
fn bad_input_is_a_usage_error_that_names_the_value() {
    let cp = ControlPlane::start();
    let create = |variants: &str| {
        cp.prefixctl(&[
            "endpoint-config",
            "create",
            "--endpoint-config-name",
            "c",
            "--production-variants",
            variants,
        ])
        .assert()
    };

    // Invalid JSON: where, by line and column.
    create("[{\"VariantName\": \"v1\",\n  \"ModelName\": }]")
        .code(2)
        .stdout(predicate::str::is_empty())
        .stderr(predicate::str::starts_with(
            "error: invalid --production-variants (inline JSON): ",
        ))
        .stderr(predicate::str::contains("at line 2 column"));

    // Unknown strategy, in the document and in the shortcut.
    const WANT: &str =
        "error: unknown routing strategy \"PREFIX_AWAR\" for variant \"v1\" (expected RANDOM, LEAST_OUTSTANDING_REQUESTS, PREFIX_AWARE)\n";
    create(r#"[{"VariantName":"v1","RoutingConfig":{"RoutingStrategy":"PREFIX_AWAR"}}]"#)
        .code(2)
        .stderr(WANT);
    cp.prefixctl(&[
        "endpoint-config",
        "update",
        "--endpoint-config-name",
        "c",
        "--variant-name",
        "v1",
        "--routing-strategy",
        "PREFIX_AWAR",
    ])
    .assert()
    .code(2)
    .stderr(WANT);

    // A missing file:// path.
    create("file:///no/such/variants.json")
        .code(2)
        .stderr(predicate::str::starts_with(
            "error: cannot read --production-variants file \"/no/such/variants.json\": ",
        ));

    // Server-side validation: INVALID_ARGUMENT with the field, exit 1.
    create(r#"[{"VariantName":"v1","RoutingConfig":{"RoutingStrategy":"PREFIX_AWARE","PrefixAwareRoutingConfig":{"PrefixLength":10}}}]"#)
        .code(1)
        .stderr(predicate::str::starts_with("error: InvalidArgument: invalid production_variants[0]"))
        .stderr(predicate::str::contains("prefix_length"));

    // Nothing was written by any of the above.
    assert_eq!(
        cp.json(&["endpoint-config", "list"])["EndpointConfigs"],
        Value::Array(vec![])
    );

    // clap's usage errors.
    cp.prefixctl(&["endpoint-config", "update", "--endpoint-config-name", "c"])
        .assert()
        .code(2);
    cp.prefixctl(&["endpoint-config", "create", "--endpoint-config-name", "c"])
        .assert()
        .code(2);
    cp.prefixctl(&["endpoint", "frobnicate"]).assert().code(2);
    cp.prefixctl(&["endpoint", "list", "--output", "yaml"])
        .assert()
        .code(2);
}

#[test]
fn a_control_plane_that_is_down_is_one_line() {
    let url = test_support::unused_url();
    let out = prefixctl()
        .args(["endpoint", "list", "--control-plane", &url])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(out.stdout.is_empty());
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(
        stderr.starts_with(&format!("error: cannot reach control plane at {url}: ")),
        "{stderr}"
    );
    assert_eq!(
        stderr.lines().count(),
        1,
        "one line, no stack trace: {stderr}"
    );

    // The env var is honoured too.
    prefixctl()
        .env("PREFIX_ROUTER_CONTROL_PLANE", &url)
        .args([
            "endpoint-config",
            "describe",
            "--endpoint-config-name",
            "x",
            "--output",
            "json",
        ])
        .assert()
        .code(1)
        .stdout(predicate::str::is_empty())
        .stderr(predicate::str::starts_with(format!(
            "error: cannot reach control plane at {url}: "
        )));
}

#[test]
fn help_version_and_completions() {
    prefixctl()
        .arg("--help")
        .assert()
        .success()
        .stdout(predicate::str::contains("endpoint-config"));
    prefixctl().arg("--version").assert().success();
    for shell in ["bash", "zsh", "fish"] {
        prefixctl()
            .args(["completions", shell])
            .assert()
            .success()
            .stdout(
                predicate::str::contains("prefixctl")
                    .and(predicate::str::contains("endpoint-config")),
            );
    }
    prefixctl().args(["completions", "tcsh"]).assert().code(2);
}
