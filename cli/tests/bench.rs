//! `prefixctl bench` end to end: a real in-process fleet per strategy, the contract's JSON, and
//! prefix-aware routing visibly raising the engines' own cache hit rate.

use assert_cmd::Command;
use test_support::InProcessServer;

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
            "--router-metrics",
            dir.path().join("routers").to_str().unwrap(),
        ])
        .assert()
        .success();
    let report: serde_json::Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    assert_eq!(report["workload"], "long-context");
    for strategy in ["RANDOM", "PREFIX_AWARE"] {
        let path = dir.path().join(format!("routers/{strategy}-router0.prom"));
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(
            text.contains("prefix_router_prompt_tokens_total{"),
            "{}: {text}",
            path.display()
        );
    }
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
    // The timeline: the whole run (10 s warm-up + 40 s) in windows of 10 s, their requests the
    // run's, and PREFIX_AWARE's hit above RANDOM's once it has settled.
    let timeline = |i: usize| {
        results[i]["timeline"]["windows"]
            .as_array()
            .unwrap()
            .clone()
    };
    for (i, r) in results.iter().enumerate() {
        let windows = timeline(i);
        assert!((4..=6).contains(&windows.len()), "{}", r["timeline"]);
        let served: u64 = windows
            .iter()
            .map(|w| w["requests"].as_u64().unwrap())
            .sum();
        assert!(served >= r["requests"].as_u64().unwrap(), "{r}");
    }
    let last_hit = |i: usize| timeline(i).last().unwrap()["kv_hit_rate"].as_f64().unwrap();
    assert!(
        last_hit(1) > last_hit(0) + 0.1,
        "{} vs {}",
        last_hit(1),
        last_hit(0)
    );
    let converged = results[1]["timeline"]["converged_s"].as_f64().unwrap();
    assert!(
        (0.0..=50.0).contains(&converged),
        "{}",
        results[1]["timeline"]
    );
    let text = std::fs::read_to_string(&md).unwrap();
    assert!(
        text.contains("<!-- bench:long-context -->") && text.contains("| PREFIX_AWARE |"),
        "{text}"
    );
    assert!(
        text.contains("PREFIX_AWARE from its first request: hit per 10 s "),
        "{text}"
    );
}

#[test]
fn tenants_with_a_precise_run_whose_routers_index_every_engines_kv_events() {
    // The smallest tenants run: approximate on one router, precise on two. Every engine-sim
    // tokenizes with the bench's tiny tokenizer; the precise routers subscribe to every engine.
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("tenants.json");
    let routers = dir.path().join("routers");
    let assert = Command::cargo_bin("prefixctl")
        .unwrap()
        .args([
            "bench",
            "--workload",
            "tenants",
            "--strategies",
            "PREFIX_AWARE,PREFIX_AWARE_PRECISE@2",
            "--instances",
            "3",
            "--token-scale",
            "0.25",
            "--duration",
            "20",
            "--warmup",
            "5",
            "--concurrency",
            "8",
            "--time-scale",
            "0.1",
            "--out",
            out.to_str().unwrap(),
            "--router-metrics",
            routers.to_str().unwrap(),
        ])
        .assert()
        .success();
    let stdout = String::from_utf8_lossy(&assert.get_output().stdout).into_owned();
    assert!(
        stdout.contains("workload tenants") && stdout.contains("PREFIX_AWARE_PRECISE@2 "),
        "{stdout}"
    );
    let report: serde_json::Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    assert_eq!(report["workload"], "tenants");
    let tokenizer = &report["config"]["tokenizer"];
    assert!(
        tokenizer["path"].as_str().unwrap().contains("tiny")
            && tokenizer["ids_per_workload_token"].as_f64().unwrap() > 1.0,
        "{tokenizer}"
    );
    let results = report["results"].as_array().unwrap();
    assert_eq!(results[0]["strategy"], "PREFIX_AWARE");
    assert_eq!(results[1]["strategy"], "PREFIX_AWARE_PRECISE@2");
    for r in results {
        assert_eq!(r["errors"], 0, "{r}");
        assert!(r["requests"].as_u64().unwrap() > 0, "{r}");
        assert!(r["kv_hit_rate"].as_f64().unwrap() > 0.0, "{r}");
    }
    assert!(results[0]["kv_index"].is_null(), "approximate: no events");
    // each precise router applied events and holds blocks: its index is exact
    let index = results[1]["kv_index"].as_array().unwrap();
    assert_eq!(index.len(), 2, "{}", results[1]);
    for r in index {
        assert!(r["kv_events"].as_f64().unwrap() > 0.0, "{r}");
        assert!(r["index_blocks"].as_f64().unwrap() > 0.0, "{r}");
    }
    // and says so per engine in its /metrics
    for i in 0..2 {
        let path = routers.join(format!("PREFIX_AWARE_PRECISE@2-router{i}.prom"));
        let text = std::fs::read_to_string(&path).unwrap();
        let engines = text
            .lines()
            .filter(|l| l.starts_with("prefix_router_kv_index_blocks{"))
            .filter(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap() > 0.0)
            .count();
        assert_eq!(engines, 3, "{}: {text}", path.display());
    }
    let approximate = std::fs::read_to_string(routers.join("PREFIX_AWARE-router0.prom")).unwrap();
    assert!(
        !approximate.contains("prefix_router_kv_index_blocks{"),
        "{approximate}"
    );
}

#[test]
fn documents_in_the_system_message_with_small_caches_and_a_model_naming_no_endpoint() {
    // The bench's routers route by endpoint, so a model named after an engine (not the
    // endpoint) still reaches the fleet; the flags are recorded in the config.
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("bench.json");
    Command::cargo_bin("prefixctl")
        .unwrap()
        .args([
            "bench",
            "--workload",
            "long-context",
            "--document-role",
            "system",
            "--cache-regime",
            "small",
            "--model",
            "an-engine-model-id",
            "--strategies",
            "PREFIX_AWARE",
            "--duration",
            "20",
            "--warmup",
            "5",
            "--concurrency",
            "8",
            "--out",
            out.to_str().unwrap(),
        ])
        .assert()
        .success();
    let report: serde_json::Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    let config = &report["config"];
    assert_eq!(config["document_role"], "system", "{config}");
    assert_eq!(config["cache_regime"], "small", "{config}");
    assert_eq!(config["model"], "an-engine-model-id", "{config}");
    assert_eq!(config["workload"]["documents"], 8, "{config}");
    assert_eq!(config["workload"]["kv_capacity_tokens"], 25_200, "{config}");
    let r = &report["results"][0];
    assert_eq!(r["errors"], 0, "{r}");
    assert!(r["requests"].as_u64().unwrap() > 0, "{r}");
    assert!(r["kv_hit_rate"].as_f64().unwrap() > 0.0, "{r}");
}

#[test]
fn prefix_aware_uses_every_instance_when_system_prompts_outgrow_the_key() {
    // system-prompt-long: four system prompts longer than prefix_length, so every user of one
    // prompt has the same shallow key. Keyed by that alone, the users of four prompts would fill
    // at most four of the seven instances; the queue term of the cost copies a hot prompt where
    // its holder's queue costs more than its prefill, and each conversation's history keeps its
    // later turns where they were.
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("bench.json");
    Command::cargo_bin("prefixctl")
        .unwrap()
        .args([
            "bench",
            "--workload",
            "system-prompt-long",
            "--strategies",
            "PREFIX_AWARE,RANDOM",
            "--duration",
            "60",
            "--warmup",
            "10",
            "--concurrency",
            "32",
            "--out",
            out.to_str().unwrap(),
        ])
        .assert()
        .success();
    let report: serde_json::Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    let (r, random) = (&report["results"][0], &report["results"][1]);
    assert_eq!(r["strategy"], "PREFIX_AWARE", "{report}");
    assert_eq!(r["errors"], 0, "{r}");
    let shares: Vec<f64> = r["instance_share"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_f64().unwrap())
        .collect();
    assert_eq!(shares.len(), 7);
    // no instance idles (an even share is 0.143; the cost model has no share target, and the
    // instance holding the hottest prompt takes more: 0.11-0.23 in one run)
    assert!(shares.iter().all(|&s| s > 0.04), "{shares:?}");
    // each conversation's turns stay together: spreading the hot system prompts request by
    // request balances as well but loses every conversation's history
    assert!(r["kv_hit_rate"].as_f64().unwrap() > 0.8, "{r}");
    assert!(
        r["kv_hit_rate"].as_f64().unwrap() > random["kv_hit_rate"].as_f64().unwrap() + 0.1,
        "PREFIX_AWARE {r} against RANDOM {random}"
    );
}

#[test]
fn demo_prints_each_instance_share_for_both_halves() {
    let out = Command::cargo_bin("prefixctl")
        .unwrap()
        .args(["demo", "--seconds", "10", "--concurrency", "16"])
        .assert()
        .success()
        .get_output()
        .stdout
        .clone();
    let text = String::from_utf8(out).unwrap();
    let shares_at = text
        .find("requests per instance")
        .unwrap_or_else(|| panic!("no shares: {text}"));
    for strategy in ["RANDOM", "PREFIX_AWARE"] {
        let line = text[shares_at..]
            .lines()
            .find(|l| l.trim_start().starts_with(strategy))
            .unwrap_or_else(|| panic!("no share line for {strategy}: {text}"));
        let shares: Vec<f64> = line
            .split_whitespace()
            .skip(1)
            .map(|x| x.parse().unwrap())
            .collect();
        assert_eq!(shares.len(), 7, "{line}");
        let sum: f64 = shares.iter().sum();
        assert!((sum - 100.0).abs() < 1.0, "{line}");
    }
}

#[test]
fn a_run_whose_requests_mostly_fail_stops_early_and_says_why() {
    // An engine whose context is shorter than the workload's prompts: every request is refused
    // (HTTP 400, vLLM's message). The run is asked for 10 minutes; it must stop on its own.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let engine = engine_sim(&runtime, &["--max-model-len", "512"]);
    let url = engine.url();
    let out = Command::cargo_bin("prefixctl")
        .unwrap()
        .args([
            "bench",
            "--engines",
            &url,
            "--workload",
            "long-context",
            "--strategies",
            "PREFIX_AWARE",
            "--warmup",
            "0",
            "--duration",
            "600",
            "--concurrency",
            "4",
        ])
        .timeout(std::time::Duration::from_secs(120))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("stopped early: PREFIX_AWARE:"), "{stderr}");
    assert!(stderr.contains("requests failed (HTTP 400: "), "{stderr}");
    assert!(
        stderr.contains("maximum context length is 512 tokens"),
        "the engine's own words: {stderr}"
    );
    assert!(
        stderr.contains("--token-scale (now 1; try 0.5)"),
        "{stderr}"
    );
}

#[test]
fn mixed_priority_on_one_request_engines_keeps_chat_fast_under_a_batch_flood() {
    // Four engines that each run one request at a time (llama-server --parallel 1 is the real
    // case): with flow control on, the flood's sheddable batch leaves one engine to chat, so chat
    // is never refused and its TTFT p99 under the flood is far below the same flood without it.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let mut urls = Vec::new();
    let mut stops = Vec::new();
    for seed in 0..4 {
        let seed = seed.to_string();
        let engine = engine_sim(
            &runtime,
            &[
                "--max-num-seqs",
                "1",
                "--time-scale",
                "0.25",
                "--seed",
                &seed,
            ],
        );
        urls.push(engine.url());
        stops.push(engine);
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("mixed.json");
    let out = Command::cargo_bin("prefixctl")
        .unwrap()
        .args([
            "bench",
            "--workload",
            "mixed-priority",
            "--engines",
            &urls.join(","),
            "--concurrency-threshold",
            "1",
            "--duration",
            "4",
            "--out",
        ])
        .arg(&path)
        .timeout(std::time::Duration::from_secs(180))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    assert_eq!(json["workload"], "mixed-priority");
    assert_eq!(json["config"]["instances"], 4, "{}", json["config"]);
    assert_eq!(
        json["config"]["slots_per_instance"], 1,
        "{}",
        json["config"]
    );
    assert_eq!(json["config"]["engines"].as_array().unwrap().len(), 4);
    let tenants = json["tenants"].as_array().unwrap();
    let row = |phase: &str, flow: &str, tenant: &str| {
        tenants
            .iter()
            .find(|t| t["phase"] == phase && t["flow_control"] == flow && t["tenant"] == tenant)
            .unwrap_or_else(|| panic!("no {phase}/{flow}/{tenant} row in {tenants:?}"))
            .clone()
    };
    assert!(row("capacity", "on", "batch")["served"].as_u64().unwrap() > 0);
    let chat_on = row("flood", "on", "chat");
    let chat_off = row("flood", "off", "chat");
    assert!(chat_on["requests"].as_u64().unwrap() > 0, "{chat_on}");
    assert_eq!(
        chat_on["served"], chat_on["requests"],
        "chat refused: {chat_on}"
    );
    let (p99_on, p99_off) = (
        chat_on["ttft_p99_ms"].as_f64().unwrap(),
        chat_off["ttft_p99_ms"].as_f64().unwrap(),
    );
    assert!(
        p99_on * 3.0 < p99_off,
        "chat p99 under the flood: {p99_on} ms with flow control, {p99_off} ms without"
    );
    let batch_on = row("flood", "on", "batch");
    assert!(
        !batch_on["refused"].as_object().unwrap().is_empty(),
        "a 3x flood of sheddable batch is partly refused with flow control: {batch_on}"
    );
    for f in ["on", "off"] {
        row("fair", f, "a");
        row("fair", f, "b");
    }
    drop(stops);
}

/// An engine-sim started with `args`, served by `runtime` on a loopback port; it stops when
/// dropped.
fn engine_sim(runtime: &tokio::runtime::Runtime, args: &[&str]) -> InProcessServer {
    let config = <engine_sim::Config as clap::Parser>::try_parse_from(
        std::iter::once("engine-sim").chain(args.iter().copied()),
    )
    .unwrap();
    runtime.block_on(InProcessServer::start(|l, stop| {
        engine_sim::serve(l, config, stop)
    }))
}

#[test]
fn the_shape_suite_runs_each_drawn_shape_with_every_router_and_writes_one_table() {
    // The suite's smallest form on engine-sim: 2 shapes drawn from seed 11, each with RANDOM on
    // one router and PREFIX_AWARE on two, each run on a fresh fleet with the shape's caches.
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("shapes.json");
    let assert = Command::cargo_bin("prefixctl")
        .unwrap()
        .args([
            "bench",
            "--workload",
            "shapes",
            "--shapes",
            "2",
            "--seed",
            "11",
            "--strategies",
            "RANDOM,PREFIX_AWARE@2",
            "--instances",
            "4",
            "--warmup",
            "5",
            "--duration",
            "20",
            "--concurrency",
            "8",
            "--time-scale",
            "0.1",
            "--out",
            out.to_str().unwrap(),
        ])
        .assert()
        .success();
    let report: serde_json::Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    let top: Vec<&String> = report.as_object().unwrap().keys().collect();
    assert_eq!(top, ["shapes", "workload"], "{report}");
    assert_eq!(report["workload"], "shapes");
    let shapes = report["shapes"].as_array().unwrap();
    assert_eq!(shapes.len(), 2);
    for (k, s) in shapes.iter().enumerate() {
        let shape = &s["shape"];
        assert_eq!(
            (shape["seed"].as_u64(), shape["index"].as_u64()),
            (Some(11), Some(k as u64))
        );
        let n = shape["documents_or_tenants"].as_u64().unwrap();
        assert!((4..=64).contains(&n), "{shape}");
        assert!(["user", "system", "multi-turn"].contains(&shape["role"].as_str().unwrap()));
        for field in [
            "prefix_chars",
            "zipf_exponent",
            "question_chars",
            "kv_capacity_tokens",
            "cache_ram_mib",
        ] {
            assert!(!shape[field].is_null(), "{field} missing in {shape}");
        }
        let results = s["results"].as_array().unwrap();
        let labels: Vec<&str> = results
            .iter()
            .map(|r| r["strategy"].as_str().unwrap())
            .collect();
        assert_eq!(labels, ["RANDOM", "PREFIX_AWARE@2"]);
        for r in results {
            assert_eq!(r["errors"], 0, "{r}");
            assert!(r["requests"].as_u64().unwrap() > 0, "{r}");
            let hit = r["kv_hit_rate"].as_f64().unwrap();
            assert!((0.0..=1.0).contains(&hit), "{r}");
            assert_eq!(r["instance_share"].as_array().unwrap().len(), 4, "{r}");
        }
    }
    // one table: a header and one row per shape, every router's column in it
    let stdout = String::from_utf8(assert.get_output().stdout.clone()).unwrap();
    let header = stdout
        .lines()
        .find(|l| l.starts_with("shape"))
        .unwrap_or_else(|| panic!("no table: {stdout}"));
    assert!(
        header.contains("RANDOM req/s hit p50/p90 ms") && header.contains("PREFIX_AWARE@2 req/s"),
        "{header}"
    );
    let rows = stdout
        .lines()
        .skip_while(|l| !l.starts_with("shape"))
        .skip(1)
        .filter(|l| !l.trim().is_empty())
        .count();
    assert_eq!(rows, 2, "{stdout}");
}

#[test]
fn the_shape_suite_restarts_real_engines_through_the_fleet_script_and_stops_them_on_ctrl_c() {
    // The fleet script stands for scripts/llama-server/fleet.sh: it records its calls and "starts"
    // two engine-sims the test runs, printing their URLs. --engines gives the count and first port.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let engines = [engine_sim(&runtime, &[]), engine_sim(&runtime, &[])];
    let urls = format!("{},{}", engines[0].url(), engines[1].url());
    let dir = tempfile::tempdir().unwrap();
    let calls = dir.path().join("calls");
    let script = dir.path().join("fleet.sh");
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\ncase \"$1\" in\n  start) echo \"start $2 $3 $CACHE_RAM_MIB\" >> {calls}; echo {urls} ;;\n  \
             stop) echo stop >> {calls} ;;\nesac\n",
            calls = calls.display()
        ),
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    let out = dir.path().join("shapes.json");
    let bench = |duration: &str| {
        let mut cmd = std::process::Command::new(assert_cmd::cargo::cargo_bin("prefixctl"));
        cmd.args([
            "bench",
            "--workload",
            "shapes",
            "--shapes",
            "1",
            "--seed",
            "2",
            "--engines",
            "http://127.0.0.1:8101,http://127.0.0.1:8102",
            "--fleet-script",
            script.to_str().unwrap(),
            "--strategies",
            "RANDOM",
            "--token-scale",
            "0.1",
            "--concurrency",
            "4",
            "--warmup",
            "1",
            "--duration",
            duration,
            "--out",
            out.to_str().unwrap(),
        ]);
        cmd
    };
    let run = bench("2").output().unwrap();
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    let mib = report["shapes"][0]["shape"]["cache_ram_mib"]
        .as_u64()
        .unwrap();
    let r = &report["shapes"][0]["results"][0];
    assert!(r["requests"].as_u64().unwrap() > 0, "{r}");
    assert_eq!(r["instance_share"].as_array().unwrap().len(), 2, "{r}");
    // stopped first (nothing left over), started with the shape's cache, stopped after the run
    let log = std::fs::read_to_string(&calls).unwrap();
    assert_eq!(log, format!("stop\nstart 2 8101 {mib}\nstop\n"));
    // Ctrl-C in the middle of a long run: the bench stops the engines and says so
    std::fs::remove_file(&calls).unwrap();
    let long = bench("600")
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let started = std::time::Instant::now();
    while !std::fs::read_to_string(&calls).is_ok_and(|l| l.contains("start")) {
        assert!(
            started.elapsed() < std::time::Duration::from_secs(30),
            "never started"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    std::thread::sleep(std::time::Duration::from_secs(2));
    // SAFETY: a signal to the child this test started.
    unsafe { libc::kill(long.id() as i32, libc::SIGINT) };
    let out = long.wait_with_output().unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("interrupted"), "{stderr}");
    let log = std::fs::read_to_string(&calls).unwrap();
    assert!(
        log.ends_with("stop\n") && log.matches("stop").count() == 2,
        "{log}"
    );
}
