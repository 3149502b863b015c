//! Against real inference servers: llama.cpp's `llama-server` on CPU, serving a tiny random-weight
//! Llama model written at test time (`scripts/llama-server/tiny_model.py`, Python `gguf`).
//!
//! The binary comes from `scripts/llama-server/build.sh` (built once per machine into its cache
//! directory) or from `$LLAMA_SERVER`. When the binary or Python's `gguf` is missing, each test
//! says it skipped and passes; with `CI=true` it fails instead (`.ci/run` installs both).
//!
//! Placement is checked by the engines' own counters (`llamacpp:prompt_tokens_cached_total`), not
//! by the router's headers alone: PREFIX_AWARE sends every request of a long shared prefix to one
//! engine, whose cache then serves all but the first; RANDOM spreads them, and every engine that
//! sees the prefix computes it once.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use integration_tests::{variant, InProcessControlPlane};
use proto::RoutingStrategy;
use test_support::{at_timeout, bind_loopback, wait_for, InProcessServer};

/// The tests share two cores: one fleet of llama-servers at a time.
static ONE_FLEET: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace root")
        .to_path_buf()
}

/// Where build.sh caches its binaries (mirrors the script).
fn cache_dir() -> PathBuf {
    if let Ok(d) = std::env::var("PREFIX_ROUTER_CACHE") {
        return PathBuf::from(d);
    }
    let base = std::env::var("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|_| {
            PathBuf::from(std::env::var("HOME").unwrap_or_default()).join(".cache")
        });
    base.join("prefix-router")
}

fn llama_server_binary() -> Result<PathBuf, String> {
    if let Ok(p) = std::env::var("LLAMA_SERVER") {
        let p = PathBuf::from(p);
        return if p.is_file() {
            Ok(p)
        } else {
            Err(format!("LLAMA_SERVER={} is not a file", p.display()))
        };
    }
    let dir = cache_dir().join("llama-server");
    let mut found: Vec<PathBuf> = std::fs::read_dir(&dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path().join("llama-server"))
        .filter(|p| p.is_file())
        .collect();
    found.sort();
    found.pop().ok_or_else(|| {
        format!(
            "no llama-server under {} and LLAMA_SERVER is not set (build it with scripts/llama-server/build.sh)",
            dir.display()
        )
    })
}

fn tiny_model(dir: &Path) -> Result<PathBuf, String> {
    let out = dir.join("tiny-llama.gguf");
    let script = workspace().join("scripts/llama-server/tiny_model.py");
    let result = Command::new("python3")
        .arg(&script)
        .arg(&out)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run python3: {e}"))?;
    if !result.status.success() {
        return Err(format!(
            "{} failed ({}): {}",
            script.display(),
            result.status,
            String::from_utf8_lossy(&result.stderr).trim()
        ));
    }
    Ok(out)
}

/// The binary and a fresh model, or `None` when this machine lacks them (the test is skipped, and
/// fails instead under `CI=true`).
fn prerequisites(test: &str, dir: &Path) -> Option<(PathBuf, PathBuf)> {
    let found = llama_server_binary().and_then(|bin| tiny_model(dir).map(|m| (bin, m)));
    test_support::require_tool(test, found)
}

/// One llama-server child process; killed on drop.
struct LlamaServer {
    child: Child,
    url: String,
    log: PathBuf,
}

impl LlamaServer {
    /// One thread, one slot, flash attention off, `--cache-ram` MiB of prompt cache, metrics on,
    /// on a port of its own choosing (`--port 0`; [`LlamaServer::started`] reads it from the log).
    fn start(bin: &Path, model: &Path, dir: &Path, cache_ram_mib: u32) -> Self {
        static STARTED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = STARTED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let log = dir.join(format!("llama-server-{n}.log"));
        let child = Command::new(bin)
            .args(["-m", model.to_str().unwrap(), "--host", "127.0.0.1"])
            .args(["--port", "0"])
            .args([
                "-t", "1", "-tb", "1", "-np", "1", "-fa", "off", "-c", "4096",
            ])
            .args(["--cache-ram", &cache_ram_mib.to_string(), "--metrics"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("a log file"))
            .spawn()
            .expect("llama-server starts");
        LlamaServer {
            child,
            url: String::new(),
            log,
        }
    }

    /// Waits (up to `limit`) for the `listening on http://HOST:PORT` line and keeps its URL.
    async fn started(&mut self, limit: Duration) {
        let this = &*self;
        let url = wait_for(
            &at_timeout(|| {
                format!(
                    "llama-server to say where it listens; its log ends:\n{}",
                    this.log_tail()
                )
            }),
            limit,
            || async {
                let text = std::fs::read_to_string(&this.log).unwrap_or_default();
                text.lines()
                    .find_map(|l| l.split("listening on ").nth(1))
                    .map(|u| u.trim().trim_end_matches('/').to_string())
            },
        )
        .await;
        self.url = url;
    }

    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(15)..].join("\n")
    }
}

impl Drop for LlamaServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

type Http = Client<HttpConnector, Full<Bytes>>;

async fn get(http: &Http, url: &str) -> Option<(u16, String)> {
    let req = http::Request::get(url).body(Full::new(Bytes::new())).ok()?;
    let resp = tokio::time::timeout(Duration::from_secs(10), http.request(req))
        .await
        .ok()?
        .ok()?;
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await.ok()?.to_bytes();
    Some((status, String::from_utf8_lossy(&body).into_owned()))
}

/// Starts `n` servers with 16 MiB prompt caches and waits until each answers `/health` with 200.
async fn start_fleet(
    http: &Http,
    bin: &Path,
    model: &Path,
    dir: &Path,
    n: usize,
) -> Vec<LlamaServer> {
    start_fleet_with_cache(http, bin, model, dir, n, 16).await
}

/// Starts `n` servers with `cache_ram_mib` MiB prompt caches and waits until each is healthy.
async fn start_fleet_with_cache(
    http: &Http,
    bin: &Path,
    model: &Path,
    dir: &Path,
    n: usize,
    cache_ram_mib: u32,
) -> Vec<LlamaServer> {
    let mut servers: Vec<LlamaServer> = (0..n)
        .map(|_| LlamaServer::start(bin, model, dir, cache_ram_mib))
        .collect();
    for s in &mut servers {
        s.started(Duration::from_secs(60)).await;
    }
    for s in &servers {
        let health = format!("{}/health", s.url);
        wait_for(
            &at_timeout(|| {
                format!(
                    "llama-server {} to be healthy; its log ends:\n{}",
                    s.url,
                    s.log_tail()
                )
            }),
            Duration::from_secs(60),
            || async { matches!(get(http, &health).await, Some((200, _))) },
        )
        .await;
    }
    servers
}

/// An in-process control plane with endpoint `llama` (one PREFIX_AWARE variant over `urls`) and a
/// data plane `node_id` watching it, ready (a table applied); returns them and the router's URL.
async fn prefix_aware_router(
    http: &Http,
    dir: &Path,
    urls: &[&str],
    node_id: &str,
) -> (InProcessControlPlane, proto::client::Client, String) {
    prefix_aware_router_with_picker(http, dir, urls, node_id, None).await
}

/// [`prefix_aware_router`], its data plane also serving the endpoint picker on `ext_proc`.
async fn prefix_aware_router_with_picker(
    http: &Http,
    dir: &Path,
    urls: &[&str],
    node_id: &str,
    ext_proc: Option<tokio::net::TcpListener>,
) -> (InProcessControlPlane, proto::client::Client, String) {
    let control_plane = InProcessControlPlane::start(&dir.join("cp")).await;
    let client = proto::client::Client::connect(control_plane.url.clone())
        .await
        .unwrap();
    client
        .create_endpoint_config(
            "llama",
            vec![variant("v1", RoutingStrategy::PrefixAware, urls)],
        )
        .await
        .unwrap();
    client.create_endpoint("llama", "llama").await.unwrap();
    let config = data_plane::Config {
        control_plane: control_plane.url.clone(),
        node_id: Some(node_id.into()),
        default_endpoint: Some("llama".into()),
        ..data_plane::Config::default()
    };
    let router =
        InProcessServer::start(|l, stop| data_plane::serve_with_picker(l, ext_proc, config, stop))
            .await
            .detach();
    let router = format!("http://{router}");
    wait_for(
        "the data plane to apply a routing table",
        Duration::from_secs(15),
        || async {
            matches!(get(http, &format!("{router}/readyz")).await, Some((200, _))).then_some(())
        },
    )
    .await;
    (control_plane, client, router)
}

/// `llamacpp:prompt_tokens_cached_total` and `llamacpp:prompt_tokens_total` of one server.
async fn cache_counters(http: &Http, url: &str) -> (f64, f64) {
    let (status, text) = get(http, &format!("{url}/metrics"))
        .await
        .unwrap_or_else(|| panic!("GET {url}/metrics"));
    assert_eq!(status, 200, "GET {url}/metrics: {text}");
    let value = |name: &str| {
        text.lines()
            .find_map(|l| {
                l.strip_prefix(name)?
                    .strip_prefix(' ')?
                    .trim()
                    .parse::<f64>()
                    .ok()
            })
            .unwrap_or_else(|| panic!("{name} missing in {url}/metrics:\n{text}"))
    };
    (
        value("llamacpp:prompt_tokens_cached_total"),
        value("llamacpp:prompt_tokens_total"),
    )
}

/// What one routed request got back.
#[derive(Debug)]
struct Routed {
    instance: String,
    decision: String,
    text: String,
    prompt_tokens: u64,
    cached_tokens: u64,
}

/// Sends one chat or completions request through the router, streaming or not, and checks the
/// answer is whole: text, usage, and for a stream the closing `[DONE]`.
async fn send(http: &Http, router: &str, chat: bool, stream: bool, prompt: &str) -> Routed {
    let (path, mut body) = if chat {
        (
            "/v1/chat/completions",
            serde_json::json!({"model": "llama", "messages": [{"role": "user", "content": prompt}]}),
        )
    } else {
        (
            "/v1/completions",
            serde_json::json!({"model": "llama", "prompt": prompt}),
        )
    };
    body["max_tokens"] = 8.into();
    if stream {
        body["stream"] = true.into();
        body["stream_options"] = serde_json::json!({"include_usage": true});
    }
    let req = http::Request::post(format!("{router}{path}"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(serde_json::to_vec(&body).unwrap())))
        .unwrap();
    let resp = tokio::time::timeout(Duration::from_secs(60), http.request(req))
        .await
        .expect("an answer within 60 s")
        .expect("the data plane answers");
    let status = resp.status();
    let header = |name: &str| {
        resp.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_string()
    };
    let (instance, decision) = (
        header("x-prefix-router-instance"),
        header("x-prefix-router-decision"),
    );
    let bytes = resp
        .into_body()
        .collect()
        .await
        .expect("a whole body")
        .to_bytes();
    let raw = String::from_utf8_lossy(&bytes).into_owned();
    assert!(
        status.is_success(),
        "{path} (stream {stream}): HTTP {status}: {raw}"
    );
    let events: Vec<serde_json::Value> = if stream {
        assert!(
            raw.trim_end().ends_with("data: [DONE]"),
            "{path}: the stream ends with [DONE]: {raw}"
        );
        raw.split("\n\n")
            .filter_map(|e| e.trim().strip_prefix("data: "))
            .filter(|d| *d != "[DONE]")
            .map(|d| serde_json::from_str(d).unwrap_or_else(|e| panic!("{path}: event {d}: {e}")))
            .collect()
    } else {
        vec![serde_json::from_str(&raw).unwrap_or_else(|e| panic!("{path}: {raw}: {e}"))]
    };
    let text_at = match (chat, stream) {
        (true, true) => "/choices/0/delta/content",
        (true, false) => "/choices/0/message/content",
        (false, _) => "/choices/0/text",
    };
    let text: String = events
        .iter()
        .filter_map(|e| e.pointer(text_at).and_then(|t| t.as_str()))
        .collect();
    let usage = events
        .iter()
        .find_map(|e| e.get("usage").filter(|u| u.is_object()))
        .unwrap_or_else(|| panic!("{path} (stream {stream}): no usage in {raw}"));
    let n = |p: &str| {
        usage
            .pointer(p)
            .and_then(|v| v.as_u64())
            .unwrap_or_else(|| panic!("{p} in {usage}"))
    };
    Routed {
        instance,
        decision,
        text,
        prompt_tokens: n("/prompt_tokens"),
        cached_tokens: n("/prompt_tokens_details/cached_tokens"),
    }
}

/// About `chars` characters of lowercase pseudo-words, different for each `seed`.
fn document(seed: u64, chars: usize) -> String {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut s = String::with_capacity(chars + 10);
    while s.len() < chars {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let len = 2 + (x % 8) as usize;
        for i in 0..len {
            s.push((b'a' + ((x >> (8 + 5 * i)) % 26) as u8) as char);
        }
        s.push(' ');
    }
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefix_aware_places_a_shared_prefix_on_one_llama_server_and_its_cache_serves_it() {
    let _one = ONE_FLEET.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let Some((bin, model)) = prerequisites("real_engines::prefix_aware", dir.path()) else {
        return;
    };
    let http: Http = Client::builder(TokioExecutor::new()).build_http();
    let servers = start_fleet(&http, &bin, &model, dir.path(), 3).await;
    let urls: Vec<&str> = servers.iter().map(|s| s.url.as_str()).collect();

    let (control_plane, client, router) =
        prefix_aware_router(&http, dir.path(), &urls, "dp-real-engines").await;

    let counters = || async {
        let mut v = Vec::new();
        for u in &urls {
            v.push(cache_counters(&http, u).await);
        }
        v
    };

    // PREFIX_AWARE: four requests on one 3,000-character document (longer than the variant's
    // 2,048-character prefix_length), streaming and not; first as chats, then as completions.
    for (round, chat) in [(1u64, true), (2, false)] {
        let doc = document(round, 3000);
        let before = counters().await;
        let mut answers = Vec::new();
        for (i, stream) in [false, true, false, true].into_iter().enumerate() {
            let r = send(
                &http,
                &router,
                chat,
                stream,
                &format!("{doc}\nQuestion {i}: why?"),
            )
            .await;
            assert!(
                !r.text.is_empty(),
                "chat {chat}, stream {stream}: no text in {r:?}"
            );
            assert!(
                r.decision.starts_with("prefix_"),
                "a prefix placement, not a bypass: {r:?}"
            );
            answers.push(r);
        }
        let home = answers[0].instance.clone();
        assert!(
            answers.iter().all(|r| r.instance == home),
            "chat {chat}: one prefix, one engine: {answers:#?}"
        );
        let after = counters().await;
        let at = urls
            .iter()
            .position(|u| *u == home)
            .expect("a known instance");
        let cached = after[at].0 - before[at].0;
        // The first request computes the document, the next three find it in the engine's cache.
        let doc_tokens = answers[0].prompt_tokens as f64;
        assert!(
            cached >= 3.0 * 0.9 * doc_tokens,
            "chat {chat}: {home} cached {cached} tokens over 3 repeats of a {doc_tokens}-token prompt"
        );
        assert!(
            answers[0].cached_tokens < answers[0].prompt_tokens / 2,
            "{:?}",
            answers[0]
        );
        for r in &answers[1..] {
            assert!(r.cached_tokens as f64 >= 0.9 * doc_tokens, "a hit: {r:?}");
        }
        for (i, (b, a)) in before.iter().zip(&after).enumerate() {
            if i != at {
                assert_eq!(
                    a, b,
                    "{} served nothing, so its counters stand still",
                    urls[i]
                );
            }
        }
    }

    // RANDOM: twelve chats on a new document spread over the engines, and every engine that
    // gets it computes it once. Between the two, the router's idle keep-alive connections to the
    // engines outlive llama-server's keep-alive timeout (5 s), which closes them without notice:
    // the requests after it must not fail.
    client
        .update_endpoint_config(
            "llama",
            vec![variant("v1", RoutingStrategy::Random, &urls)],
            None,
        )
        .await
        .unwrap();
    wait_for(
        "the RANDOM table to roll out",
        Duration::from_secs(15),
        || async {
            let d = client.describe_endpoint("llama").await.ok()?;
            (!d.data_planes.is_empty() && d.rolled_out()).then_some(())
        },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(6)).await;
    let doc = document(3, 3000);
    let before = counters().await;
    let mut answers = Vec::new();
    for i in 0..12 {
        let r = send(
            &http,
            &router,
            true,
            i % 2 == 1,
            &format!("{doc}\nQuestion {i}: how?"),
        )
        .await;
        assert_eq!(r.decision, "random", "{r:?}");
        answers.push(r);
    }
    let after = counters().await;
    let mut engines: Vec<&str> = answers.iter().map(|r| r.instance.as_str()).collect();
    engines.sort();
    engines.dedup();
    assert!(
        engines.len() >= 2,
        "RANDOM spreads twelve requests: {engines:?}"
    );
    let misses = answers
        .iter()
        .filter(|r| r.cached_tokens < r.prompt_tokens / 2)
        .count();
    assert_eq!(
        misses,
        engines.len(),
        "each engine computes the document once, then its cache serves it: {answers:#?}"
    );
    let computed: f64 = after.iter().zip(&before).map(|(a, b)| a.1 - b.1).sum();
    let doc_tokens = answers[0].prompt_tokens as f64;
    assert!(
        computed >= engines.len() as f64 * 0.9 * doc_tokens,
        "the engines' own counters show {} cold prefills: {computed} tokens computed",
        engines.len()
    );
    control_plane.stop().await.unwrap();
}

/// Through a real Envoy (`deploy/envoy/envoy.yaml`, full-duplex bodies) with the data plane as its
/// endpoint picker: a document's chats and completions, streaming and not, all go to one
/// llama-server, whose own counters show its cache serving the repeats and the others untouched;
/// the picker learns the engine's cache reports from the response bodies Envoy sends it, and
/// nothing stays in flight after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn through_envoy_a_shared_prefix_stays_on_one_llama_server() {
    let _one = ONE_FLEET.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let test = "real_engines::through_envoy";
    let Some((bin, model)) = prerequisites(test, dir.path()) else {
        return;
    };
    let Some(envoy_bin) = test_support::require_tool(test, integration_tests::envoy::binary())
    else {
        return;
    };
    let http: Http = Client::builder(TokioExecutor::new()).build_http();
    let servers = start_fleet(&http, &bin, &model, dir.path(), 3).await;
    let urls: Vec<&str> = servers.iter().map(|s| s.url.as_str()).collect();
    let ext = bind_loopback().await;
    let picker = ext.local_addr().unwrap().to_string();
    let (control_plane, _client, router) =
        prefix_aware_router_with_picker(&http, dir.path(), &urls, "dp-envoy", Some(ext)).await;
    let config = integration_tests::envoy::picker_config(&picker, "FULL_DUPLEX_STREAMED");
    let envoy =
        integration_tests::envoy::Envoy::start(&envoy_bin, dir.path(), "envoy", &config).await;
    let counters = || async {
        let mut v = Vec::new();
        for u in &urls {
            v.push(cache_counters(&http, u).await);
        }
        v
    };
    let router_metric = |name: &'static str| {
        let (http, url) = (http.clone(), format!("{router}/metrics"));
        async move {
            let (_, text) = get(&http, &url).await.expect("the router's /metrics");
            text.lines()
                .filter(|l| l.starts_with(name) && !l.starts_with('#'))
                .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
                .sum::<f64>()
        }
    };
    let learned_before = router_metric("prefix_router_cached_prompt_tokens_total").await;
    for (round, chat) in [(11u64, true), (12, false)] {
        let doc = document(round, 3000);
        let before = counters().await;
        let mut answers = Vec::new();
        for (i, stream) in [false, true, false, true].into_iter().enumerate() {
            let prompt = format!("{doc}\nQuestion {i}: why?");
            let r = send(&http, &envoy.url, chat, stream, &prompt).await;
            assert!(!r.text.is_empty(), "chat {chat}, stream {stream}: {r:?}");
            assert!(
                r.decision.starts_with("prefix_"),
                "the picker's prefix placement (its headers through Envoy): {r:?}"
            );
            answers.push(r);
        }
        let home = answers[0].instance.clone();
        assert!(
            answers.iter().all(|r| r.instance == home),
            "chat {chat}: one prefix, one engine through Envoy: {answers:#?}"
        );
        let after = counters().await;
        let at = urls
            .iter()
            .position(|u| *u == home)
            .expect("a known instance");
        let doc_tokens = answers[0].prompt_tokens as f64;
        let cached = after[at].0 - before[at].0;
        assert!(
            cached >= 3.0 * 0.9 * doc_tokens,
            "chat {chat}: {home} cached {cached} tokens over 3 repeats of a {doc_tokens}-token prompt"
        );
        for (i, (b, a)) in before.iter().zip(&after).enumerate() {
            if i != at {
                assert_eq!(a, b, "{} served nothing through Envoy", urls[i]);
            }
        }
    }
    let learned = router_metric("prefix_router_cached_prompt_tokens_total").await - learned_before;
    assert!(
        learned > 0.0,
        "the picker read the engines' cache reports from the responses Envoy sent it"
    );
    wait_for("nothing in flight", Duration::from_secs(10), || async {
        (router_metric("prefix_router_instance_in_flight").await == 0.0).then_some(())
    })
    .await;
    drop(envoy);
    control_plane.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bench_engines_reads_llama_server_counters_and_prefix_aware_raises_the_hit_rate() {
    let _one = ONE_FLEET.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let Some((bin, model)) = prerequisites("real_engines::bench_engines", dir.path()) else {
        return;
    };
    let http: Http = Client::builder(TokioExecutor::new()).build_http();
    let servers = start_fleet(&http, &bin, &model, dir.path(), 3).await;
    let engines = servers
        .iter()
        .map(|s| s.url.clone())
        .collect::<Vec<_>>()
        .join(",");
    let out = dir.path().join("bench.json");
    let md = dir.path().join("BENCHMARKS.md");
    let run = tokio::task::spawn_blocking({
        let (out, md) = (out.clone(), md.clone());
        move || {
            Command::new(test_support::bin("prefixctl"))
                .args(["bench", "--engines", &engines, "--workload", "long-context"])
                .args([
                    "--strategies",
                    "RANDOM,PREFIX_AWARE",
                    "--token-scale",
                    "0.05",
                ])
                .args(["--duration", "10", "--warmup", "4", "--concurrency", "4"])
                .args([
                    "--out",
                    out.to_str().unwrap(),
                    "--markdown",
                    md.to_str().unwrap(),
                ])
                .stdin(Stdio::null())
                .output()
                .expect("prefixctl runs")
        }
    })
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success(),
        "prefixctl bench --engines failed ({}):\n{stdout}\n{}",
        run.status,
        String::from_utf8_lossy(&run.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    assert_eq!(report["workload"], "long-context");
    assert_eq!(
        report["config"]["time_scale"], 1.0,
        "real time with --engines"
    );
    assert_eq!(report["config"]["instances"], 3);
    let results = report["results"].as_array().unwrap();
    assert_eq!(results.len(), 2);
    for (i, r) in results.iter().enumerate() {
        assert_eq!(r["errors"], 0, "{r}");
        assert!(r["requests"].as_u64().unwrap() > 20, "{r}");
        assert_eq!(
            r["text_salt"],
            i as u64 + 1,
            "fresh texts per strategy: {r}"
        );
        let per_engine = r["engines"].as_array().unwrap();
        assert_eq!(per_engine.len(), 3, "{r}");
        for e in per_engine {
            assert_eq!(
                e["tokens_from"], "llama.cpp",
                "the engine's own counters: {e}"
            );
            assert_eq!(e["requests_from"], "router-header", "{e}");
        }
        let shares: f64 = r["instance_share"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s.as_f64().unwrap())
            .sum();
        assert!((shares - 1.0).abs() < 1e-9, "{r}");
    }
    let hit = |i: usize| results[i]["kv_hit_rate"].as_f64().unwrap();
    assert_eq!(results[1]["strategy"], "PREFIX_AWARE");
    assert!(
        hit(1) > hit(0) + 0.1,
        "PREFIX_AWARE {:.3} vs RANDOM {:.3} on llama-server's own counters:\n{stdout}",
        hit(1),
        hit(0)
    );
    assert!(stdout.contains("per engine"), "{stdout}");
    let md = std::fs::read_to_string(&md).unwrap();
    assert!(md.contains("### long-context on 3 engines"), "{md}");
    assert!(md.contains("Per engine"), "{md}");
}

/// One non-streamed chat through the router: `system` as the system message, `question` as the
/// user's; returns the instance that served it and the engine's usage.
async fn ask(http: &Http, router: &str, system: &str, question: &str) -> Routed {
    let body = serde_json::json!({
        "model": "llama",
        "max_tokens": 4,
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": question},
        ],
    });
    let req = http::Request::post(format!("{router}/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(serde_json::to_vec(&body).unwrap())))
        .unwrap();
    let resp = tokio::time::timeout(Duration::from_secs(60), http.request(req))
        .await
        .expect("an answer within 60 s")
        .expect("the data plane answers");
    let header = |name: &str| {
        resp.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_string()
    };
    let (instance, decision) = (
        header("x-prefix-router-instance"),
        header("x-prefix-router-decision"),
    );
    let status = resp.status();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    let json: serde_json::Value = serde_json::from_slice(&bytes)
        .unwrap_or_else(|e| panic!("HTTP {status}: {e}: {}", String::from_utf8_lossy(&bytes)));
    assert!(status.is_success(), "HTTP {status}: {json}");
    let n = |p: &str| json.pointer(p).and_then(|v| v.as_u64()).unwrap_or(0);
    Routed {
        instance,
        decision,
        text: String::new(),
        prompt_tokens: n("/usage/prompt_tokens"),
        cached_tokens: n("/usage/prompt_tokens_details/cached_tokens"),
    }
}

/// A skewed request order over `docs` documents (each index about half as often as the one
/// before, the last ones equally rare), the same for every run.
fn skewed(docs: usize, len: usize, seed: u64) -> Vec<usize> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            // a Zipf(1)-like draw: P(d) proportional to 1 / (d + 1)
            let weights: f64 = (1..=docs).map(|d| 1.0 / d as f64).sum();
            let mut u = (x >> 11) as f64 / (1u64 << 53) as f64 * weights;
            (0..docs)
                .find(|&d| {
                    u -= 1.0 / (d + 1) as f64;
                    u < 0.0
                })
                .unwrap_or(docs - 1)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn documents_as_system_messages_stay_on_few_llama_servers_whose_caches_are_small() {
    // Six 3,000-character documents sent as system messages (longer than prefix_length: every
    // request on one shares a head-only key), each with a unique question, over three
    // llama-servers whose prompt caches (3 MiB) hold about two documents each besides the one in
    // the slot: the fleet holds every document once, not everywhere. Spreading popular documents
    // or deepening their head makes every engine cycle through all six and evict; the engines'
    // own reports must stop that. Judged by the engines' own counters, against RANDOM.
    let _one = ONE_FLEET.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let Some((bin, model)) = prerequisites("real_engines::small_caches", dir.path()) else {
        return;
    };
    let http: Http = Client::builder(TokioExecutor::new()).build_http();
    let servers = start_fleet_with_cache(&http, &bin, &model, dir.path(), 3, 3).await;
    let urls: Vec<&str> = servers.iter().map(|s| s.url.as_str()).collect();
    let (control_plane, client, router) =
        prefix_aware_router(&http, dir.path(), &urls, "dp-small-caches").await;
    let counters = || async {
        let mut v = Vec::new();
        for u in &urls {
            v.push(cache_counters(&http, u).await);
        }
        v
    };
    // llama.cpp counts cached prompt tokens and evaluated ones apart
    let hit_since = |before: &[(f64, f64)], after: &[(f64, f64)]| {
        let cached: f64 = after.iter().zip(before).map(|(a, b)| a.0 - b.0).sum();
        let evaluated: f64 = after.iter().zip(before).map(|(a, b)| a.1 - b.1).sum();
        cached / (cached + evaluated)
    };

    // Two clients; the last 150 requests of each run are measured. PREFIX_AWARE learns from
    // the first 300 (its probe for room, then the bound, take their passes: after 150, CI once
    // saw hit 0.922 with a document still on all three engines; the placement test
    // `three_instances_whose_caches_hold_two_of_six_documents_settle_within_300_requests` is
    // the same shape), RANDOM from nothing (150 before, to fill the caches alike).
    const MEASURED: usize = 150;
    let run = |salt: u64, len: usize| {
        let (http, router) = (http.clone(), router.clone());
        async move {
            let order = skewed(6, len, salt);
            let docs: Vec<String> = (0..6).map(|d| document(salt * 100 + d, 3000)).collect();
            let mut placed: Vec<(usize, usize, Routed)> = Vec::new();
            for (i, pair) in order.chunks(2).enumerate() {
                let (qa, qb) = (
                    format!("Question {i}a: why?"),
                    format!("Question {i}b: how?"),
                );
                let (a, b) = tokio::join!(
                    ask(&http, &router, &docs[pair[0]], &qa),
                    ask(&http, &router, &docs[pair[1]], &qb),
                );
                placed.push((2 * i, pair[0], a));
                placed.push((2 * i + 1, pair[1], b));
            }
            placed
        }
    };
    let measured = |placed: &[(usize, usize, Routed)], i: usize| i + MEASURED >= placed.len();
    let measure = |placed: &[(usize, usize, Routed)]| {
        let mut engines = vec![std::collections::BTreeSet::new(); 6];
        for (i, d, r) in placed {
            if measured(placed, *i) {
                engines[*d].insert(r.instance.clone());
            }
        }
        engines
    };

    let start = counters().await;
    let prefix_aware = run(1, 3 * MEASURED).await;
    let mid = counters().await;
    let engines = measure(&prefix_aware);
    // the learning part ends here: measure the last 150 by the router's answers and the
    // engines' counters over the whole run (the counters cannot be split by request)
    let measured_hits = |placed: &[(usize, usize, Routed)]| {
        let (mut cached, mut total) = (0u64, 0u64);
        for (i, _, r) in placed {
            if measured(placed, *i) {
                cached += r.cached_tokens;
                total += r.prompt_tokens;
            }
        }
        cached as f64 / total as f64
    };
    let pa_hit = measured_hits(&prefix_aware);

    client
        .update_endpoint_config(
            "llama",
            vec![variant("v1", RoutingStrategy::Random, &urls)],
            None,
        )
        .await
        .unwrap();
    wait_for("the RANDOM table", Duration::from_secs(15), || async {
        let d = client.describe_endpoint("llama").await.ok()?;
        (!d.data_planes.is_empty() && d.rolled_out()).then_some(())
    })
    .await;
    let random = run(2, 2 * MEASURED).await;
    let end = counters().await;
    let random_hit = measured_hits(&random);
    eprintln!(
        "SMALL-CACHES PREFIX_AWARE hit {pa_hit:.3} (engines' counters, whole run {:.3}), RANDOM {random_hit:.3} ({:.3}); documents' engines {engines:?}",
        hit_since(&start, &mid),
        hit_since(&mid, &end),
    );
    for (d, e) in engines.iter().enumerate() {
        assert!(e.len() <= 2, "document {d} on {e:?}");
    }
    assert!(
        hit_since(&start, &mid) > hit_since(&mid, &end) + 0.1,
        "the engines' own counters: PREFIX_AWARE {:.3} vs RANDOM {:.3}",
        hit_since(&start, &mid),
        hit_since(&mid, &end)
    );
    assert!(pa_hit > random_hit + 0.1, "{pa_hit:.3} vs {random_hit:.3}");
    control_plane.stop().await.unwrap();
}
