//! `prefixctl top --once` against canned data-plane `/metrics` served on loopback: two routers
//! summed into one JSON document, a router that does not answer named on stderr, and a failure
//! only when none answers.

use assert_cmd::Command;
use serde_json::Value;
use test_support::{unused_url, HttpStub, StubReply};

/// Serves `body` as `GET /metrics` (any request) on 127.0.0.1:0 until dropped.
fn serve_metrics(body: &'static str) -> HttpStub {
    HttpStub::start(move |_| {
        StubReply::new(200, "text/plain; version=0.0.4", body)
            .header("connection", "close")
            .then_close()
    })
}

const ROUTER_A: &str = r#"# HELP prefix_router_requests_total Requests by endpoint, variant, instance, routing decision and response status.
# TYPE prefix_router_requests_total counter
prefix_router_requests_total{endpoint="",variant="",instance="",decision="none",status="404"} 1
prefix_router_requests_total{endpoint="chat",variant="v1",instance="http://127.0.0.1:9001",decision="prefix_hash",status="200"} 10
prefix_router_requests_total{endpoint="chat",variant="v1",instance="http://127.0.0.1:9002",decision="overload_bypass",status="200"} 5
# TYPE prefix_router_prompt_tokens_total counter
prefix_router_prompt_tokens_total{endpoint="chat",variant="v1",instance="http://127.0.0.1:9001",decision="prefix_hash"} 1000
prefix_router_prompt_tokens_total{endpoint="chat",variant="v1",instance="http://127.0.0.1:9002",decision="overload_bypass"} 500
# TYPE prefix_router_cached_prompt_tokens_total counter
prefix_router_cached_prompt_tokens_total{endpoint="chat",variant="v1",instance="http://127.0.0.1:9001",decision="prefix_hash"} 800
prefix_router_cached_prompt_tokens_total{endpoint="chat",variant="v1",instance="http://127.0.0.1:9002",decision="overload_bypass"} 50
# TYPE prefix_router_prefix_index_blocks gauge
prefix_router_prefix_index_blocks{endpoint="chat",variant="v1",instance="http://127.0.0.1:9001"} 120
prefix_router_prefix_index_blocks{endpoint="chat",variant="v1",instance="http://127.0.0.1:9002"} 40
# TYPE prefix_router_prefix_index_capacity_blocks gauge
prefix_router_prefix_index_capacity_blocks{endpoint="chat",variant="v1",instance="http://127.0.0.1:9001"} 300
prefix_router_prefix_index_capacity_blocks{endpoint="chat",variant="v1",instance="http://127.0.0.1:9002"} 290
# TYPE prefix_router_instance_in_flight gauge
prefix_router_instance_in_flight{endpoint="chat",variant="v1",instance="http://127.0.0.1:9001"} 2
prefix_router_instance_in_flight{endpoint="chat",variant="v1",instance="http://127.0.0.1:9002"} 0
"#;

const ROUTER_B: &str = r#"prefix_router_requests_total{endpoint="chat",variant="v1",instance="http://127.0.0.1:9001",decision="prefix_hash",status="200"} 6
prefix_router_prompt_tokens_total{endpoint="chat",variant="v1",instance="http://127.0.0.1:9001",decision="prefix_hash"} 1000
prefix_router_cached_prompt_tokens_total{endpoint="chat",variant="v1",instance="http://127.0.0.1:9001",decision="prefix_hash"} 600
prefix_router_prefix_index_blocks{endpoint="chat",variant="v1",instance="http://127.0.0.1:9001"} 80
prefix_router_prefix_index_capacity_blocks{endpoint="chat",variant="v1",instance="http://127.0.0.1:9001"} 200
prefix_router_instance_in_flight{endpoint="chat",variant="v1",instance="http://127.0.0.1:9001"} 1
"#;

#[test]
fn once_sums_two_routers_into_one_json_document_and_names_the_one_that_is_down() {
    let (a, b) = (serve_metrics(ROUTER_A), serve_metrics(ROUTER_B));
    let down = unused_url();
    let out = Command::cargo_bin("prefixctl")
        .unwrap()
        .args([
            "top",
            "--router-url",
            &format!("{},{}/", a.url, b.url),
            "--router-url",
            &down,
            "--once",
            "--output",
            "json",
        ])
        .timeout(std::time::Duration::from_secs(30))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let lines: Vec<_> = stderr.lines().collect();
    assert_eq!(
        lines.len(),
        1,
        "one line for the router that is down: {stderr}"
    );
    assert!(
        lines[0].starts_with(&format!("router {down} did not answer: ")),
        "{stderr}"
    );

    let doc: Value = serde_json::from_slice(&out.stdout).expect("stdout is one JSON document");
    let routers = doc["Routers"].as_array().unwrap();
    assert_eq!(routers.len(), 3);
    assert_eq!(routers[0]["Answered"], true);
    assert_eq!(routers[2]["Url"], down.as_str());
    assert_eq!(routers[2]["Answered"], false);
    assert!(routers[2]["Error"].as_str().unwrap().contains(&down));

    let variants = doc["Variants"].as_array().unwrap();
    assert_eq!(variants.len(), 1, "unrouted requests are left out: {doc}");
    let v = &variants[0];
    assert_eq!(
        (&v["Endpoint"], &v["Variant"]),
        (&"chat".into(), &"v1".into())
    );
    let i1 = &v["Instances"][0];
    assert_eq!(i1["Instance"], "http://127.0.0.1:9001");
    assert_eq!(i1["Requests"], 16);
    assert_eq!(i1["InFlight"], 3);
    assert_eq!(i1["PromptTokens"], 2000);
    assert_eq!(i1["CachedPromptTokens"], 1400);
    assert_eq!(i1["CachedShare"], 0.7);
    assert!(i1.get("Interval").is_none(), "--once has no rates");
    assert_eq!(v["Instances"][1]["CachedShare"], 0.1);

    let decisions: Vec<(&str, f64)> = v["Decisions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| {
            (
                d["Decision"].as_str().unwrap(),
                d["CachedShare"].as_f64().unwrap(),
            )
        })
        .collect();
    assert_eq!(decisions, [("prefix_hash", 0.7), ("overload_bypass", 0.1)]);

    // each router keeps its own index: the mean over the routers that report the instance
    let index = |i: usize| {
        let x = &v["Instances"][i]["Index"];
        (
            x["Blocks"].as_f64().unwrap(),
            x["CapacityBlocks"].as_f64().unwrap(),
            x["Routers"].as_u64().unwrap(),
        )
    };
    assert_eq!(index(0), (100.0, 250.0, 2));
    assert_eq!(index(1), (40.0, 290.0, 1));
}

#[test]
fn once_prints_a_table_and_fails_only_when_no_router_answers() {
    let a = serve_metrics(ROUTER_A);
    let out = Command::cargo_bin("prefixctl")
        .unwrap()
        .args(["top", "--router-url", &a.url, "--once"])
        .timeout(std::time::Duration::from_secs(30))
        .output()
        .unwrap();
    assert!(out.status.success());
    let table = String::from_utf8_lossy(&out.stdout);
    for line in [
        "endpoint chat  variant v1",
        "INDEX BLOCKS/CAPACITY",
        "120/300",
        "40/290",
        "prefix_hash      1000           80.0%",
    ] {
        assert!(table.contains(line), "{line:?} missing in\n{table}");
    }

    let (x, y) = (unused_url(), unused_url());
    let out = Command::cargo_bin("prefixctl")
        .unwrap()
        .args(["top", "--router-url", &format!("{x},{y}"), "--once"])
        .timeout(std::time::Duration::from_secs(30))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(out.stdout.is_empty());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&format!("router {x} did not answer")),
        "{stderr}"
    );
    assert!(
        stderr.contains(&format!("router {y} did not answer")),
        "{stderr}"
    );
    assert!(
        stderr
            .lines()
            .last()
            .unwrap()
            .starts_with("error: no router answered"),
        "{stderr}"
    );

    Command::cargo_bin("prefixctl")
        .unwrap()
        .args(["top", "--router-url", "https://a:1", "--once"])
        .assert()
        .code(2);
}
