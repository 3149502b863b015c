//! Real Prometheus tooling on the servers' `/metrics`: `promtool check metrics` flags nothing on
//! the data plane's and the control plane's, and nothing on engine-sim's but vLLM's own `vllm:`
//! colon names; every metric the Grafana dashboard (`deploy/grafana/prefix-router.json`) queries
//! is one the binaries export (checked without promtool), and its queries are valid PromQL
//! (`promtool check rules`). The promtool checks are skipped (with the reason) when it is
//! missing, except under CI=true (Debian's `prometheus` package ships it; `.ci/run` installs it).

mod common;

use std::collections::BTreeSet;
use std::io::Write as _;
use std::process::{Command, Stdio};

use common::{Fleet, ENDPOINT};
use serde_json::{json, Value};
use test_support::require_tool;

fn promtool_available() -> Result<(), String> {
    match Command::new("promtool").arg("--version").output() {
        Ok(out) if out.status.success() => Ok(()),
        Ok(out) => Err(format!("promtool --version failed: {}", out.status)),
        Err(e) => Err(format!(
            "promtool is not installed ({e}); apt-get install prometheus"
        )),
    }
}

/// `promtool ARGS` with `input` on stdin: (success, stdout and stderr).
fn promtool(args: &[&str], input: &str) -> (bool, String) {
    let mut child = Command::new("promtool")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool runs");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// The three servers' `/metrics` after some traffic: (data plane, control plane, engine-sim).
async fn scrape_after_traffic(fleet: &Fleet) -> (String, String, String) {
    let ask = json!({"model": ENDPOINT, "max_tokens": 3, "messages": [
        {"role": "system", "content": "You answer briefly. ".repeat(20)},
        {"role": "user", "content": "hello"}]});
    for _ in 0..3 {
        assert_eq!(
            fleet.post_json("/v1/chat/completions", &ask).await.status,
            200
        );
    }
    let mut stream = ask.clone();
    stream["stream"] = json!(true);
    assert_eq!(
        fleet
            .post_json("/v1/chat/completions", &stream)
            .await
            .status,
        200
    );
    let e = json!({"model": ENDPOINT, "input": "x"});
    assert_eq!(fleet.post_json("/v1/embeddings", &e).await.status, 200);
    assert_eq!(fleet.get("/nope").await.status, 404);

    let router = fleet.get("/metrics").await;
    assert_eq!(router.status, 200);
    let engine = http_get(&format!("{}/metrics", fleet.engine_url)).await;
    let control_plane = fleet.control_plane.metrics().await;
    (
        String::from_utf8(router.body.to_vec()).unwrap(),
        control_plane,
        engine,
    )
}

async fn http_get(url: &str) -> String {
    use http_body_util::BodyExt as _;
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<http_body_util::Empty<bytes::Bytes>>();
    let resp = client.get(url.parse().unwrap()).await.unwrap();
    assert_eq!(resp.status(), 200, "{url}");
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    String::from_utf8(body.to_vec()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn promtool_accepts_every_servers_metrics_and_the_dashboard_queries() {
    let test = "promtool_accepts_every_servers_metrics_and_the_dashboard_queries";
    if require_tool(test, promtool_available()).is_none() {
        return;
    }
    let fleet = Fleet::start_with_control_plane_metrics().await;
    let (router, control_plane, engine) = scrape_after_traffic(&fleet).await;

    for (server, text) in [("data plane", &router), ("control plane", &control_plane)] {
        let (ok, out) = promtool(&["check", "metrics"], text);
        println!("promtool check metrics, {server}: {}", out.trim());
        assert!(ok && out.trim().is_empty(), "{server}: {out}\n{text}");
    }
    let (_, out) = promtool(&["check", "metrics"], &engine);
    println!("promtool check metrics, engine-sim:\n{}", out.trim());
    for line in out.lines().filter(|l| !l.trim().is_empty()) {
        assert!(
            line.starts_with("vllm:") && line.ends_with("metric names should not contain ':'"),
            "engine-sim: promtool flags more than vLLM's colon names: {line}"
        );
    }

    // The dashboard: every query parses (that each names exported metrics is
    // `the_dashboard_queries_only_metrics_the_binaries_export`, which needs no promtool).
    let queries = dashboard_queries();
    let mut rules = String::from("groups:\n  - name: dashboard\n    rules:\n");
    for (i, (_, expr)) in queries.iter().enumerate() {
        let promql = expr.replace("$__rate_interval", "1m");
        rules.push_str(&format!(
            "      - record: dashboard:query_{i}\n        expr: {}\n",
            serde_json::to_string(&promql).unwrap()
        ));
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("dashboard-rules.yml");
    std::fs::write(&path, &rules).unwrap();
    let (ok, out) = promtool(&["check", "rules", path.to_str().unwrap()], "");
    assert!(
        ok,
        "the dashboard's queries are not valid PromQL:\n{out}\n{rules}"
    );
}

/// Every metric the dashboard's queries name is one a binary exports after some traffic, and the
/// flow-control panels (waiting by priority and by tenant, wait time, refusals) are there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_queries_only_metrics_the_binaries_export() {
    let fleet = Fleet::start_with_control_plane_metrics().await;
    let (router, control_plane, engine) = scrape_after_traffic(&fleet).await;
    let exported: BTreeSet<String> = [&router, &control_plane, &engine]
        .iter()
        .flat_map(|text| sample_names(text))
        .collect();
    let queries = dashboard_queries();
    assert!(queries.len() >= 10, "{queries:?}");
    let mut queried = BTreeSet::new();
    for (panel, expr) in &queries {
        let names = metric_names(expr);
        assert!(!names.is_empty(), "panel {panel:?}: no metric in {expr}");
        for name in names {
            assert!(
                exported.contains(&name),
                "panel {panel:?} queries {name}, which no binary exports ({expr})"
            );
            queried.insert(name);
        }
    }
    for flow in [
        "prefix_router_queue_depth",
        "prefix_router_tenant_queue_depth",
        "prefix_router_queue_wait_seconds_bucket",
        "prefix_router_queue_refusals_total",
    ] {
        assert!(queried.contains(flow), "no dashboard panel shows {flow}");
    }
}

/// (panel title, query) for every target of every panel.
fn dashboard_queries() -> Vec<(String, String)> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../deploy/grafana/prefix-router.json");
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap())
        .expect("the dashboard is JSON");
    let mut out = Vec::new();
    for panel in doc["panels"].as_array().expect("panels") {
        let title = panel["title"].as_str().expect("a title").to_string();
        for target in panel["targets"].as_array().expect("targets") {
            let expr = target["expr"].as_str().expect("an expr");
            out.push((title.clone(), expr.to_string()));
        }
    }
    out
}

/// Names of the samples in Prometheus text (`name{...} value` / `name value`).
fn sample_names(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(|l| l.split(['{', ' ']).next())
        .map(str::to_string)
        .collect()
}

/// The metric names a PromQL expression selects: identifiers outside label matchers, ranges and
/// grouping lists that are not functions, keywords or numbers.
fn metric_names(expr: &str) -> BTreeSet<String> {
    // Operators, and the aggregations (which may put `by (...)` before their parentheses).
    const KEYWORDS: [&str; 17] = [
        "and",
        "or",
        "unless",
        "bool",
        "offset",
        "sum",
        "min",
        "max",
        "avg",
        "group",
        "stddev",
        "stdvar",
        "count",
        "count_values",
        "bottomk",
        "topk",
        "quantile",
    ];
    const GROUPING: [&str; 6] = [
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
    ];
    let chars: Vec<char> = expr.chars().collect();
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':';
    let mut names = BTreeSet::new();
    let mut i = 0;
    let mut skip_group = false;
    while i < chars.len() {
        let c = chars[i];
        if c == '{' || c == '[' {
            let close = if c == '{' { '}' } else { ']' };
            while i < chars.len() && chars[i] != close {
                i += 1;
            }
            i += 1;
            continue;
        }
        if c == '(' && skip_group {
            while i < chars.len() && chars[i] != ')' {
                i += 1;
            }
            skip_group = false;
            i += 1;
            continue;
        }
        if !ident(c) || c.is_ascii_digit() {
            // Skip a number whole (`0.99`, `1e3`).
            if c.is_ascii_digit() {
                while i < chars.len() && (ident(chars[i]) || chars[i] == '.') {
                    i += 1;
                }
            } else {
                i += 1;
            }
            continue;
        }
        let start = i;
        while i < chars.len() && ident(chars[i]) {
            i += 1;
        }
        let word: String = chars[start..i].iter().collect();
        let next = chars[i..].iter().find(|c| !c.is_whitespace());
        if GROUPING.contains(&word.as_str()) {
            skip_group = true;
        } else if next == Some(&'(') || KEYWORDS.contains(&word.as_str()) {
            // A function or an operator keyword.
        } else {
            names.insert(word);
        }
    }
    names
}

#[test]
fn metric_names_are_read_out_of_promql() {
    let names = |e: &str| metric_names(e).into_iter().collect::<Vec<_>>();
    assert_eq!(
        names("histogram_quantile(0.99, sum by (le) (rate(vllm:time_to_first_token_seconds_bucket[$__rate_interval])))"),
        ["vllm:time_to_first_token_seconds_bucket"]
    );
    assert_eq!(
        names(
            r#"sum(rate(a_total{x="y"}[1m])) / sum without (instance) (b) and on (z) c > bool 1e3"#
        ),
        ["a_total", "b", "c"]
    );
}
