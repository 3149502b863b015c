//! `prefixctl bench` end to end: a real in-process fleet per strategy, the contract's JSON, and
//! prefix-aware routing visibly raising the engines' own cache hit rate.

use assert_cmd::Command;

#[test]
fn bench_writes_the_contract_json_and_prefix_aware_beats_random_on_hits() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("bench.json");
    let md = dir.path().join("BENCHMARKS.md");
    Command::cargo_bin("prefixctl")
        .unwrap()
        .args([
            "bench",
            "--workload",
            "long-context",
            "--strategies",
            "RANDOM,PREFIX_AWARE",
            "--duration",
            "40",
            "--warmup",
            "10",
            "--concurrency",
            "16",
            "--time-scale",
            "0.1",
            "--out",
            out.to_str().unwrap(),
            "--markdown",
            md.to_str().unwrap(),
        ])
        .assert()
        .success();
    let report: serde_json::Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    assert_eq!(report["workload"], "long-context");
    let results = report["results"].as_array().unwrap();
    assert_eq!(results.len(), 2);
    for r in results {
        for field in [
            "requests",
            "errors",
            "ttft_p50_ms",
            "ttft_p90_ms",
            "ttft_p99_ms",
            "throughput_rps",
            "output_tokens_per_s",
            "kv_hit_rate",
            "instance_share",
            "max_share_deviation",
            "route_decision_p50_us",
            "route_decision_p99_us",
        ] {
            assert!(!r[field].is_null(), "{field} missing in {r}");
        }
        assert_eq!(r["errors"], 0, "{r}");
        assert!(r["requests"].as_u64().unwrap() > 0, "{r}");
        assert_eq!(r["instance_share"].as_array().unwrap().len(), 7);
    }
    let hit = |i: usize| results[i]["kv_hit_rate"].as_f64().unwrap();
    assert_eq!(results[0]["strategy"], "RANDOM");
    assert_eq!(results[1]["strategy"], "PREFIX_AWARE");
    assert!(
        hit(1) > hit(0) + 0.1,
        "PREFIX_AWARE {} vs RANDOM {}",
        hit(1),
        hit(0)
    );
    let text = std::fs::read_to_string(&md).unwrap();
    assert!(
        text.contains("<!-- bench:long-context -->") && text.contains("| PREFIX_AWARE |"),
        "{text}"
    );
}
