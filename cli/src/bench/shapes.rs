//! `prefixctl bench --workload shapes`: many prompt shapes drawn at random, so that no placement
//! rule can be fitted to a handful of fixed workloads.
//!
//! Shape `k` of `--seed S` is a function of `(S, k)` only (the same whatever `--shapes N`):
//! - documents or tenants: 4 to 64, log-uniform;
//! - their length: 0.3 to 4 times the variant's `prefix_length` (characters), log-uniform;
//! - role: `user` (document and question in one user message), `system` (the document as the
//!   system message, the question as a user message) or `multi-turn` (each tenant's system
//!   prompt shared by conversations of [`TURNS`] turns that resend their whole history);
//! - popularity: Zipf with an exponent uniform in [0, [`MAX_ZIPF_EXPONENT`]] (0 = uniform);
//! - question length (multi-turn: the median user message): 10 to 400 characters, log-uniform;
//! - each engine's cache: [`CACHE_SHARE`] (uniform) of the shape's *popular set*, the most
//!   popular documents (tenants' system prompts) that together draw [`POPULAR_SHARE`] of the
//!   requests, in prompt tokens; never less than one whole request. As engine-sim
//!   `--kv-capacity-tokens` and as llama-server `--cache-ram` MiB ([`LLAMA_CPP_MIB_PER_TOKEN`]).
//!
//! Each shape runs with every router of the list: the bench's own (`--strategies`, where
//! `STRATEGY@N` runs N routers) and peers started per run (`--peer-cmd`), each on a fresh fleet:
//! engine-sims in this process, or the engines `--fleet-script` starts with the shape's cache.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;

use super::metrics;
use super::report::StrategyResult;
use super::table::aligned;
use super::workload::{Workload, BYTES_PER_TOKEN};
use super::{BenchArgs, StrategyRun};

/// Documents or tenants per shape, drawn log-uniform in this range.
pub const PREFIXES: (usize, usize) = (4, 64);
/// Document (system prompt) length over the variant's `prefix_length`, log-uniform.
pub const PREFIX_FACTOR: (f64, f64) = (0.3, 4.0);
/// The largest Zipf exponent of popularity (the smallest is 0: uniform).
pub const MAX_ZIPF_EXPONENT: f64 = 1.3;
/// Question length in characters, log-uniform (rounded up to whole tokens of 4 characters).
pub const QUESTION_CHARS: (f64, f64) = (10.0, 400.0);
/// Each engine's cache over the popular set, uniform.
pub const CACHE_SHARE: (f64, f64) = (0.25, 1.5);
/// The popular set: the most popular prefixes that together draw this share of the requests.
pub const POPULAR_SHARE: f64 = 0.8;
/// Turns of a multi-turn conversation (min, max).
pub const TURNS: (u32, u32) = (2, 4);
/// Output tokens of an answer (and the median reply of a multi-turn turn).
pub const ANSWER_TOKENS: u32 = 24;
/// The variant's `prefix_length` at `--token-scale 1` when `--prefix-length` is not given
/// (characters; multiplied by `--token-scale` like every workload's).
pub const PREFIX_LENGTH: u32 = 4096;

/// llama-server's `--cache-ram` per prompt token of the bench (4 characters of its pseudo-words),
/// in MiB, with the tiny model of `scripts/llama-server/tiny_model.py` (2 layers, f16 KV).
/// Measured by `scripts/llama-server/cache_ram_per_token.py` on one `fleet.sh` server (llama.cpp
/// of llama-cpp-python 0.3.36, `-lv 4`, `CACHE_RAM_MIB=256`): chat prompts of 400 to 4,000 bench
/// tokens (626 to 6,146 of the tokenizer's, 1.53 per bench token), each saved to the prompt cache
/// when the next one took the slot, took 0.619 to 6.072 MiB by the server's `prompt_save` log
/// lines: 0.001518 (largest) to 0.001548 (smallest, the chat template's share larger) MiB per
/// bench token, 0.000988 MiB per tokenizer token. The server's one slot holds one more prompt
/// beside the cache.
pub const LLAMA_CPP_MIB_PER_TOKEN: f64 = 0.00153;

/// A shape's role: where its shared prefix sits in the prompt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ShapeRole {
    User,
    System,
    MultiTurn,
}

impl ShapeRole {
    pub fn name(self) -> &'static str {
        match self {
            ShapeRole::User => "user",
            ShapeRole::System => "system",
            ShapeRole::MultiTurn => "multi-turn",
        }
    }
}

/// What is drawn for shape `index` of `seed`, before it meets a `prefix_length`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ShapeDraw {
    pub seed: u64,
    pub index: u64,
    pub role: ShapeRole,
    pub prefixes: usize,
    pub prefix_factor: f64,
    pub zipf_exponent: f64,
    pub question_tokens: usize,
    pub cache_share: f64,
}

/// Draws shape `index` of `seed`: a function of both only.
pub fn draw(seed: u64, index: u64) -> ShapeDraw {
    let mut rng = SmallRng::seed_from_u64(
        seed.wrapping_mul(0x9E37_79B9_7F4A_7C15)
            ^ index.wrapping_mul(0xC2B2_AE3D_27D4_EB4F)
            ^ 0x5A9E,
    );
    let log_uniform = |rng: &mut SmallRng, lo: f64, hi: f64| {
        (rng.random_range(lo.ln()..=hi.ln())).exp().clamp(lo, hi)
    };
    let role = match rng.random_range(0..3) {
        0 => ShapeRole::User,
        1 => ShapeRole::System,
        _ => ShapeRole::MultiTurn,
    };
    // log-uniform over the integers lo..=hi: a real in [lo, hi + 1), rounded down
    let prefixes = (log_uniform(&mut rng, PREFIXES.0 as f64, (PREFIXES.1 + 1) as f64) as usize)
        .clamp(PREFIXES.0, PREFIXES.1);
    let prefix_factor = log_uniform(&mut rng, PREFIX_FACTOR.0, PREFIX_FACTOR.1);
    let zipf_exponent = rng.random_range(0.0..=MAX_ZIPF_EXPONENT);
    let question_chars = log_uniform(&mut rng, QUESTION_CHARS.0, QUESTION_CHARS.1);
    let question_tokens = (question_chars / BYTES_PER_TOKEN as f64).ceil() as usize;
    let cache_share = rng.random_range(CACHE_SHARE.0..=CACHE_SHARE.1);
    ShapeDraw {
        seed,
        index,
        role,
        prefixes,
        prefix_factor,
        zipf_exponent,
        question_tokens,
        cache_share,
    }
}

/// The popular set of `n` prefixes of Zipf popularity `s`: the fewest most popular ones whose
/// requests make up [`POPULAR_SHARE`] of all.
pub fn popular_prefixes(n: usize, s: f64) -> usize {
    let weights: Vec<f64> = (1..=n).map(|k| (k as f64).powf(-s)).collect();
    let total: f64 = weights.iter().sum();
    let mut sum = 0.0;
    for (i, w) in weights.iter().enumerate() {
        sum += w;
        if sum >= POPULAR_SHARE * total - 1e-9 {
            return i + 1;
        }
    }
    n
}

/// One shape of the suite, with its sizes for a `prefix_length`: the parameters of the report.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Shape {
    pub seed: u64,
    pub index: u64,
    pub role: ShapeRole,
    /// Documents (roles `user`, `system`) or tenants (`multi-turn`).
    pub documents_or_tenants: usize,
    /// The variant's `prefix_length` (characters) the shape was sized against.
    pub prefix_length: u32,
    /// Document (system prompt) length over `prefix_length`.
    pub prefix_factor: f64,
    /// Document (system prompt) length in characters.
    pub prefix_chars: usize,
    /// Zipf exponent of the documents' (tenants') popularity; 0 is uniform.
    pub zipf_exponent: f64,
    /// Question length in characters (multi-turn: the median user message), before the label
    /// naming the client and the request that makes each question unique.
    pub question_chars: usize,
    /// The popular set: documents (tenants) drawing [`POPULAR_SHARE`] of the requests, and
    /// their tokens.
    pub popular_prefixes: usize,
    pub popular_set_tokens: u64,
    /// Each engine's cache over the popular set, as drawn.
    pub cache_share: f64,
    /// Each engine's cache: engine-sim `--kv-capacity-tokens`, llama-server `--cache-ram` MiB.
    pub kv_capacity_tokens: u64,
    pub cache_ram_mib: u64,
}

impl Shape {
    pub fn new(d: ShapeDraw, prefix_length: u32) -> Self {
        let prefix_tokens = ((d.prefix_factor * f64::from(prefix_length)) / BYTES_PER_TOKEN as f64)
            .round()
            .max(1.0) as usize;
        let popular = popular_prefixes(d.prefixes, d.zipf_exponent);
        let popular_set_tokens = (popular * prefix_tokens) as u64;
        let one_request = (prefix_tokens + d.question_tokens) as u64 + u64::from(ANSWER_TOKENS);
        let kv_capacity_tokens =
            ((d.cache_share * popular_set_tokens as f64).ceil() as u64).max(one_request);
        Shape {
            seed: d.seed,
            index: d.index,
            role: d.role,
            documents_or_tenants: d.prefixes,
            prefix_length,
            prefix_factor: d.prefix_factor,
            prefix_chars: prefix_tokens * BYTES_PER_TOKEN,
            zipf_exponent: d.zipf_exponent,
            question_chars: d.question_tokens * BYTES_PER_TOKEN,
            popular_prefixes: popular,
            popular_set_tokens,
            cache_share: d.cache_share,
            kv_capacity_tokens,
            cache_ram_mib: ((kv_capacity_tokens as f64 * LLAMA_CPP_MIB_PER_TOKEN).ceil() as u64)
                .max(1),
        }
    }

    pub fn prefix_tokens(&self) -> usize {
        self.prefix_chars / BYTES_PER_TOKEN
    }

    pub fn question_tokens(&self) -> usize {
        self.question_chars / BYTES_PER_TOKEN
    }

    /// The seed of the shape's texts and clients.
    pub fn text_seed(&self) -> u64 {
        self.seed ^ (self.index + 1).wrapping_mul(0xD6E8_FEB8_6659_FD93)
    }

    /// Each engine's cache over the popular set, as sized (at least one request).
    pub fn cache_percent(&self) -> f64 {
        self.kv_capacity_tokens as f64 / self.popular_set_tokens.max(1) as f64 * 100.0
    }

    /// One line naming the shape's parameters.
    pub fn describe(&self) -> String {
        format!(
            "shape {}: {} {} of {} chars ({:.2}x prefix_length {}), Zipf {:.2}, questions of \
             {} chars, caches of {} tokens ({:.0}% of the popular set of {}; llama-server \
             CACHE_RAM_MIB={})",
            self.index,
            self.documents_or_tenants,
            match self.role {
                ShapeRole::MultiTurn => "tenants",
                _ => "documents",
            },
            self.prefix_chars,
            self.prefix_factor,
            self.prefix_length,
            self.zipf_exponent,
            self.question_chars,
            self.kv_capacity_tokens,
            self.cache_percent(),
            self.popular_prefixes,
            self.cache_ram_mib,
        )
    }
}

/// A peer router the bench starts in front of each run's fresh engines (`--peer-cmd
/// LABEL=COMMAND`): COMMAND runs under `sh -c` in a process group of its own, with `{port}`
/// replaced by a free loopback port (the bench sends its load to `http://127.0.0.1:{port}`) and
/// `{urls}` by the engines' URLs, space-separated (`{urls_csv}`: comma-separated). The run starts
/// once `GET /health` answers 2xx; the group is killed after it.
#[derive(Debug, Clone, PartialEq)]
pub struct PeerCmd {
    pub label: String,
    pub template: String,
}

pub fn parse_peer_cmd(s: &str) -> Result<PeerCmd, String> {
    let (label, template) = s
        .split_once('=')
        .ok_or_else(|| format!("invalid --peer-cmd {s:?}: expected LABEL=COMMAND"))?;
    let (label, template) = (label.trim(), template.trim());
    if label.is_empty() || label.contains(char::is_whitespace) {
        return Err(format!(
            "invalid --peer-cmd {s:?}: the label before '=' must be one word"
        ));
    }
    if !template.contains("{port}") || !template.contains("{urls") {
        return Err(format!(
            "invalid --peer-cmd {s:?}: the command must contain {{port}} (where it listens) and \
             {{urls}} or {{urls_csv}} (the engines)"
        ));
    }
    Ok(PeerCmd {
        label: label.to_string(),
        template: template.to_string(),
    })
}

impl PeerCmd {
    /// The command line for a peer on `port` in front of `engines`.
    pub fn command(&self, port: u16, engines: &[String]) -> String {
        self.template
            .replace("{port}", &port.to_string())
            .replace("{urls_csv}", &engines.join(","))
            .replace("{urls}", &engines.join(" "))
    }

    /// Starts the peer in front of `engines` and waits (up to `ready_within`) until its
    /// `/health` answers. Its output goes to `log`.
    pub async fn start(
        &self,
        engines: &[String],
        log: &Path,
        ready_within: Duration,
    ) -> anyhow::Result<RunningPeer> {
        // The port is free when it is picked, but another process may take it before the
        // peer binds it: a peer that exits on "address in use" is started again on a new port.
        const ATTEMPTS: usize = 3;
        for attempt in 1..=ATTEMPTS {
            match self.start_once(engines, log, ready_within).await? {
                Started::Ready(peer) => return Ok(peer),
                Started::Exited(e) if attempt < ATTEMPTS && port_was_taken(log) => {
                    tracing::warn!(peer = %self.label, "{e:#}; starting it on another port");
                }
                Started::Exited(e) => return Err(e),
            }
        }
        unreachable!("the last attempt returns")
    }

    async fn start_once(
        &self,
        engines: &[String],
        log: &Path,
        ready_within: Duration,
    ) -> anyhow::Result<Started> {
        use std::os::unix::process::CommandExt;
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .context("finding a free port for a peer router")?
            .port();
        let line = self.command(port, engines);
        let out = std::fs::File::create(log)
            .with_context(|| format!("creating the peer's log {}", log.display()))?;
        let child = std::process::Command::new("sh")
            .arg("-c")
            .arg(&line)
            .stdin(std::process::Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .process_group(0)
            .spawn()
            .with_context(|| format!("starting peer {}: sh -c {line:?}", self.label))?;
        let mut peer = RunningPeer {
            label: self.label.clone(),
            url: format!("http://127.0.0.1:{port}"),
            child,
        };
        let http = metrics::http_client();
        let deadline = Instant::now() + ready_within;
        let health = format!("{}/health", peer.url);
        loop {
            if let Some(status) = peer.child.try_wait()? {
                return Ok(Started::Exited(anyhow::anyhow!(
                    "peer {} exited ({status}) before its /health answered: sh -c {line:?}; its \
                     output: {}",
                    self.label,
                    tail(log)
                )));
            }
            if metrics::get_text(&http, &health).await.is_ok() {
                return Ok(Started::Ready(peer));
            }
            if Instant::now() >= deadline {
                peer.kill();
                anyhow::bail!(
                    "peer {}: {health} did not answer within {} s: sh -c {line:?}; its output: {}",
                    self.label,
                    ready_within.as_secs(),
                    tail(log)
                );
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

/// How one attempt to start a peer ended.
enum Started {
    Ready(RunningPeer),
    Exited(anyhow::Error),
}

/// Whether a peer's log says its port was taken (Python's and Rust's wordings).
fn port_was_taken(log: &Path) -> bool {
    let text = std::fs::read_to_string(log)
        .unwrap_or_default()
        .to_ascii_lowercase();
    text.contains("address already in use") || text.contains("addrinuse")
}

/// The last lines of a log, for an error message.
fn tail(log: &Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    let from = lines.len().saturating_sub(5);
    match lines[from..].join(" | ") {
        s if s.is_empty() => format!("(nothing in {})", log.display()),
        s => s,
    }
}

/// A peer router the bench started; its process group is killed when it is stopped or dropped.
pub struct RunningPeer {
    pub label: String,
    pub url: String,
    child: std::process::Child,
}

impl RunningPeer {
    /// SIGTERM to the group, up to 5 s to exit, then SIGKILL.
    pub async fn stop(mut self) {
        signal_group(self.child.id(), libc::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        self.kill();
    }

    fn kill(&mut self) {
        signal_group(self.child.id(), libc::SIGKILL);
        let _ = self.child.wait();
    }
}

impl Drop for RunningPeer {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            self.kill();
        } else {
            // the shell is gone; what it started may not be
            signal_group(self.child.id(), libc::SIGKILL);
        }
    }
}

/// Sends `signal` to the process group the bench started as `pid` (the group's leader).
fn signal_group(pid: u32, signal: libc::c_int) {
    if let Ok(pid) = libc::pid_t::try_from(pid) {
        // SAFETY: kill(2) with a negative pid signals that process group; it touches no memory.
        unsafe {
            libc::kill(-pid, signal);
        }
    }
}

/// `--fleet-script PATH`: the script that starts `n` fresh engines from `first_port` with
/// `CACHE_RAM_MIB` MiB of prompt cache each (`PATH start N FIRST_PORT`, printing their URLs,
/// comma-separated, on its last line of output) and stops them (`PATH stop`).
#[derive(Debug, Clone)]
pub struct FleetScript {
    pub path: PathBuf,
    pub engines: usize,
    pub first_port: u16,
}

impl FleetScript {
    /// Stops whatever the script left running, then starts fresh engines; returns their URLs.
    pub async fn start(&self, cache_ram_mib: u64) -> anyhow::Result<Vec<String>> {
        self.stop().await?;
        let out = self
            .call(
                vec![
                    "start".into(),
                    self.engines.to_string(),
                    self.first_port.to_string(),
                ],
                Some(cache_ram_mib),
            )
            .await?;
        let line = out
            .lines()
            .rev()
            .find(|l| !l.trim().is_empty())
            .unwrap_or("");
        let urls: Vec<String> = line
            .split(',')
            .map(|u| u.trim().trim_end_matches('/').to_string())
            .collect();
        anyhow::ensure!(
            urls.len() == self.engines && urls.iter().all(|u| u.starts_with("http://")),
            "{} start {} {} printed {line:?}: expected {} engine URLs, comma-separated",
            self.path.display(),
            self.engines,
            self.first_port,
            self.engines
        );
        Ok(urls)
    }

    pub async fn stop(&self) -> anyhow::Result<()> {
        self.call(vec!["stop".into()], None).await.map(|_| ())
    }

    async fn call(&self, args: Vec<String>, cache_ram_mib: Option<u64>) -> anyhow::Result<String> {
        let path = self.path.clone();
        let shown = format!("{} {}", path.display(), args.join(" "));
        let out = tokio::task::spawn_blocking(move || {
            let mut cmd = std::process::Command::new(&path);
            cmd.args(&args)
                .stdin(std::process::Stdio::null())
                .stderr(std::process::Stdio::inherit());
            if let Some(mib) = cache_ram_mib {
                cmd.env("CACHE_RAM_MIB", mib.to_string());
            }
            cmd.output()
        })
        .await?
        .with_context(|| format!("running {shown}"))?;
        anyhow::ensure!(
            out.status.success(),
            "{shown} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stdout).trim()
        );
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }
}

/// One router of a shape's runs: a strategy of the bench's routers or a peer.
#[derive(Debug, Clone)]
pub enum Router {
    Bench(StrategyRun),
    Peer(PeerCmd),
}

impl Router {
    pub fn label(&self) -> String {
        match self {
            Router::Bench(r) => r.to_string(),
            Router::Peer(p) => p.label.clone(),
        }
    }
}

/// One shape and every router's result on it (the contract's JSON).
#[derive(Debug, Clone, Serialize)]
pub struct ShapeResult {
    pub shape: Shape,
    pub results: Vec<StrategyResult>,
}

/// The suite's JSON: `{"workload":"shapes","shapes":[{"shape":{...},"results":[...]}]}`.
#[derive(Debug, Clone, Serialize)]
pub struct ShapesReport {
    pub workload: &'static str,
    pub shapes: Vec<ShapeResult>,
}

/// The `prefix_length` shapes are sized against: `--prefix-length`, else [`PREFIX_LENGTH`]
/// times `--token-scale`.
pub fn prefix_length(args: &BenchArgs) -> u32 {
    args.prefix_length.unwrap_or_else(|| {
        ((f64::from(PREFIX_LENGTH) * args.token_scale).round() as u32).clamp(64, 65536)
    })
}

/// The routers each shape runs with: the strategies, then the peers.
pub fn routers(args: &BenchArgs) -> Vec<Router> {
    args.strategies
        .iter()
        .cloned()
        .map(Router::Bench)
        .chain(args.peer_cmd.iter().cloned().map(Router::Peer))
        .collect()
}

/// How long a peer may take to answer `/health`.
const PEER_READY_WITHIN: Duration = Duration::from_secs(120);

/// `--fleet-script` with the count and first port of `--engines`.
fn fleet_script(args: &BenchArgs) -> Option<FleetScript> {
    args.fleet_script.as_ref().map(|path| FleetScript {
        path: path.clone(),
        engines: args.engines.len(),
        first_port: args
            .engines
            .first()
            .and_then(|u| u.parse::<http::Uri>().ok())
            .and_then(|u| u.port_u16())
            .unwrap_or(8001),
    })
}

/// Runs the suite (`args` validated and normalised by [`super::run`]).
pub async fn run(args: &BenchArgs) -> anyhow::Result<ShapesReport> {
    let routers = routers(args);
    let fleet_script = fleet_script(args);
    let logs = tempfile::Builder::new()
        .prefix("prefixctl-shapes-")
        .tempdir()
        .context("creating a directory for the peers' logs")?
        .keep();
    let mut report = ShapesReport {
        workload: "shapes",
        shapes: Vec::new(),
    };
    for k in 0..args.shapes {
        let shape = Shape::new(draw(args.seed, k), prefix_length(args));
        eprintln!("{}", shape.describe());
        let workload = Arc::new(Workload::from_shape(&shape));
        let documents = Arc::new(workload.documents());
        let mut results = Vec::new();
        for router in &routers {
            let mut run_args = args.clone();
            run_args.prefix_length = Some(shape.prefix_length);
            let (strategy, peer) = match router {
                Router::Bench(r) => {
                    run_args.routers = r.routers.unwrap_or(args.routers);
                    (*r, None)
                }
                // the bench's own routers stand idle beside a peer: one is enough
                Router::Peer(p) => {
                    run_args.routers = 1;
                    (proto::RoutingStrategy::Random.into(), Some(p))
                }
            };
            if let Some(script) = &fleet_script {
                run_args.engines = script.start(shape.cache_ram_mib).await?;
            }
            if run_args.model.is_none() {
                run_args.model = Some(match run_args.engines.first() {
                    Some(engine) => super::engines_model(&metrics::http_client(), engine).await?,
                    None => super::fleet::ENDPOINT.to_string(),
                });
            }
            let peer = peer.map(|p| {
                let file = p
                    .label
                    .chars()
                    .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
                    .collect::<String>();
                (
                    p,
                    logs.join(format!("shape{k}-{file}.log")),
                    PEER_READY_WITHIN,
                )
            });
            let outcome =
                super::run_strategy(&run_args, &workload, &documents, strategy, peer).await;
            if let Some(script) = &fleet_script {
                script.stop().await?;
            }
            let (mut result, _) =
                outcome.with_context(|| format!("shape {k} with {}", router.label()))?;
            result.strategy = router.label();
            eprintln!(
                "shape {k} {}: {:.2} req/s, hit {:.1}%, TTFT p50 {:.0} ms",
                result.strategy,
                result.throughput_rps,
                result.kv_hit_rate * 100.0,
                result.ttft_p50_ms
            );
            results.push(result);
        }
        report.shapes.push(ShapeResult { shape, results });
    }
    let _ = std::fs::remove_dir_all(&logs);
    Ok(report)
}

/// Labels of the peers among the routers.
fn peer_labels(args: &BenchArgs) -> Vec<String> {
    args.peer_cmd.iter().map(|p| p.label.clone()).collect()
}

impl ShapesReport {
    /// One row per shape: its parameters, each router's req/s, hit and TTFT p50/p90, and when
    /// peers ran, each other router's req/s over the best peer's.
    pub fn table(&self, peers: &[String]) -> Vec<String> {
        let labels: Vec<String> = self
            .shapes
            .first()
            .map(|s| s.results.iter().map(|r| r.strategy.clone()).collect())
            .unwrap_or_default();
        let ours: Vec<&String> = labels.iter().filter(|l| !peers.contains(l)).collect();
        let mut header: Vec<String> = [
            "shape",
            "role",
            "docs",
            "doc chars (x key)",
            "zipf",
            "q chars",
            "cache/popular",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        for l in &labels {
            header.push(format!("{l} req/s hit p50/p90 ms"));
        }
        if !peers.is_empty() {
            for l in &ours {
                header.push(format!("{l}/peer"));
            }
        }
        let rows = self
            .shapes
            .iter()
            .map(|s| {
                let sh = &s.shape;
                let mut row = vec![
                    sh.index.to_string(),
                    sh.role.name().to_string(),
                    sh.documents_or_tenants.to_string(),
                    format!("{} ({:.2})", sh.prefix_chars, sh.prefix_factor),
                    format!("{:.2}", sh.zipf_exponent),
                    sh.question_chars.to_string(),
                    format!("{:.0}% of {}", sh.cache_percent(), sh.popular_prefixes),
                ];
                let find = |l: &str| s.results.iter().find(|r| r.strategy == l);
                for l in &labels {
                    row.push(match find(l) {
                        Some(r) => format!(
                            "{:.2} {:.1}% {:.0}/{:.0}",
                            r.throughput_rps,
                            r.kv_hit_rate * 100.0,
                            r.ttft_p50_ms,
                            r.ttft_p90_ms
                        ),
                        None => "-".into(),
                    });
                }
                if !peers.is_empty() {
                    let best = s
                        .results
                        .iter()
                        .filter(|r| peers.contains(&r.strategy))
                        .map(|r| r.throughput_rps)
                        .fold(0.0, f64::max);
                    for l in &ours {
                        row.push(match find(l) {
                            Some(r) if best > 0.0 => format!("{:.2}", r.throughput_rps / best),
                            _ => "-".into(),
                        });
                    }
                }
                row
            })
            .collect();
        let header: Vec<&str> = header.iter().map(String::as_str).collect();
        aligned(&header, rows)
    }
}

/// Runs the suite, prints its table and writes `--out`. On Ctrl-C (SIGINT) it leaves nothing
/// running: the run in progress is dropped, which kills its peer's process group (the peers run
/// in groups of their own, which the terminal's SIGINT does not reach), and the fleet script
/// stops its engines.
pub async fn run_and_report(args: &BenchArgs) -> anyhow::Result<()> {
    let report = tokio::select! {
        report = run(args) => report?,
        _ = tokio::signal::ctrl_c() => {
            if let Some(script) = fleet_script(args) {
                script.stop().await?;
            }
            anyhow::bail!("interrupted: the peer and the engines of the run in progress were stopped");
        }
    };
    println!(
        "workload shapes, seed {}, {} shapes (req/s; hit from the engines' counters; TTFT p50/p90 ms{})",
        args.seed,
        report.shapes.len(),
        if args.engines.is_empty() {
            ", simulated time"
        } else {
            ""
        }
    );
    for line in report.table(&peer_labels(args)) {
        println!("{line}");
    }
    if let Some(path) = &args.out {
        std::fs::write(path, serde_json::to_vec_pretty(&report)?)
            .with_context(|| format!("writing {}", path.display()))?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_are_drawn_within_their_ranges_and_from_the_seed_and_index_only() {
        let mut roles = std::collections::HashSet::new();
        let (mut small, mut large, mut flat, mut steep) = (false, false, false, false);
        for seed in [1, 2, 3, 42, u64::MAX] {
            for k in 0..200 {
                let d = draw(seed, k);
                assert_eq!(d, draw(seed, k), "the same draw again");
                assert!((4..=64).contains(&d.prefixes), "{d:?}");
                assert!((0.3..=4.0).contains(&d.prefix_factor), "{d:?}");
                assert!((0.0..=1.3).contains(&d.zipf_exponent), "{d:?}");
                assert!((3..=100).contains(&d.question_tokens), "{d:?}");
                assert!((0.25..=1.5).contains(&d.cache_share), "{d:?}");
                roles.insert(d.role);
                small |= d.prefixes < 8;
                large |= d.prefixes > 40;
                flat |= d.zipf_exponent < 0.1;
                steep |= d.zipf_exponent > 1.2;
                let s = Shape::new(d, 1024);
                let chars = s.prefix_chars as f64;
                assert!(
                    (0.3 * 1024.0 - 4.0..=4.0 * 1024.0 + 4.0).contains(&chars),
                    "{s:?}"
                );
                assert!((12..=400).contains(&s.question_chars), "{s:?}");
                assert!(s.popular_prefixes >= 1 && s.popular_prefixes <= s.documents_or_tenants);
                assert_eq!(
                    s.popular_set_tokens,
                    (s.popular_prefixes * s.prefix_tokens()) as u64
                );
                // the drawn share of the popular set, or one whole request when that is more
                let one = (s.prefix_tokens() + s.question_tokens()) as u64 + 24;
                let drawn = (d.cache_share * s.popular_set_tokens as f64).ceil() as u64;
                assert_eq!(s.kv_capacity_tokens, drawn.max(one), "{s:?}");
                assert_eq!(
                    s.cache_ram_mib,
                    ((s.kv_capacity_tokens as f64 * LLAMA_CPP_MIB_PER_TOKEN).ceil() as u64).max(1)
                );
            }
        }
        assert_eq!(roles.len(), 3, "every role is drawn");
        assert!(small && large && flat && steep, "the ranges are covered");
        // shape k is the same whatever comes before or after it, and seeds differ
        assert_eq!(draw(7, 5), draw(7, 5));
        assert_ne!(draw(7, 5), draw(8, 5));
        let a: Vec<_> = (0..4).map(|k| draw(9, k)).collect();
        assert!(a.windows(2).all(|w| w[0] != w[1]));
    }

    #[test]
    fn the_popular_set_draws_80_percent_of_the_requests() {
        assert_eq!(popular_prefixes(10, 0.0), 8, "uniform: 80% of them");
        assert_eq!(popular_prefixes(5, 0.0), 4);
        // Zipf 1 over 4: weights 1, 1/2, 1/3, 1/4 (sum 2.083; 80% = 1.667): 1 + 1/2 + 1/3 = 1.833
        assert_eq!(popular_prefixes(4, 1.0), 3);
        // steep popularity over many: few make the popular set
        assert!(popular_prefixes(64, 1.3) < 20);
    }

    #[test]
    fn a_shape_becomes_a_workload_of_its_role_and_sizes() {
        use super::super::workload::DocumentRole;
        let find = |role: ShapeRole| {
            (0..100)
                .map(|k| Shape::new(draw(3, k), 2048))
                .find(|s| s.role == role)
                .unwrap()
        };
        for role in [ShapeRole::User, ShapeRole::System] {
            let s = find(role);
            let w = Workload::from_shape(&s);
            assert!(w.has_documents());
            assert_eq!(
                (w.documents, w.document_tokens, w.question_tokens),
                (
                    s.documents_or_tenants,
                    s.prefix_tokens(),
                    s.question_tokens()
                )
            );
            assert_eq!(
                w.document_role,
                if role == ShapeRole::System {
                    DocumentRole::System
                } else {
                    DocumentRole::User
                }
            );
            assert_eq!(w.kv_capacity_tokens, s.kv_capacity_tokens);
            assert_eq!(w.prefix_length, 2048);
            let docs = w.documents();
            let mut c = w.client(0);
            let r = c.next(&w, &docs, None);
            let doc = &*docs[r.affinity as usize];
            assert_eq!(doc.len(), s.prefix_chars);
            match role {
                ShapeRole::System => {
                    assert_eq!(r.messages[0].content, doc);
                    let q = &r.messages[1].content;
                    let asked = q.rsplit_once(": ").unwrap().1;
                    assert_eq!(asked.len(), s.question_chars + 1, "{q}"); // and '?'
                }
                _ => assert!(r.messages[0].content.starts_with(doc)),
            }
        }
        let s = find(ShapeRole::MultiTurn);
        let w = Workload::from_shape(&s);
        assert!(!w.has_documents());
        assert_eq!(
            (w.system_prompts, w.system_prompt_tokens),
            (s.documents_or_tenants, s.prefix_tokens())
        );
        assert_eq!((w.min_turns, w.max_turns), TURNS);
        let mut c = w.client(1);
        let first = c.next(&w, &[], None);
        assert_eq!(first.messages[0].role, "system");
        let second = c.next(&w, &[], Some("reply".into()));
        assert_eq!(
            second.messages[..2],
            first.messages[..],
            "the history resent"
        );
        assert_eq!(second.affinity, first.affinity);
    }

    #[test]
    fn multi_turn_tenants_follow_the_shapes_popularity() {
        let s = (0..200)
            .map(|k| Shape::new(draw(5, k), 512))
            .find(|s| s.role == ShapeRole::MultiTurn && s.zipf_exponent > 1.0)
            .unwrap();
        let w = Workload::from_shape(&s);
        let mut counts = vec![0u32; w.system_prompts];
        for client in 0..400 {
            let r = w.client(client).next(&w, &[], None);
            let system = &r.messages[0].content;
            let i = (0..w.system_prompts)
                .find(|&i| w.system_prompt(i) == *system)
                .unwrap();
            counts[i] += 1;
        }
        let last = counts[w.system_prompts - 1].max(1);
        assert!(counts[0] > 4 * last, "{counts:?}");
    }

    #[test]
    fn peer_commands_name_a_label_a_port_and_the_engines() {
        let p = parse_peer_cmd(
            "smg=smg launch --policy cache_aware --host 127.0.0.1 --port {port} --worker-urls {urls}",
        )
        .unwrap();
        assert_eq!(p.label, "smg");
        let engines = [
            "http://127.0.0.1:8001".to_string(),
            "http://127.0.0.1:8002".into(),
        ];
        assert_eq!(
            p.command(30000, &engines),
            "smg launch --policy cache_aware --host 127.0.0.1 --port 30000 --worker-urls \
             http://127.0.0.1:8001 http://127.0.0.1:8002"
        );
        let csv = parse_peer_cmd("x=r --port {port} --workers {urls_csv}").unwrap();
        assert_eq!(
            csv.command(1, &engines),
            "r --port 1 --workers http://127.0.0.1:8001,http://127.0.0.1:8002"
        );
        for bad in [
            "smg launch",
            "=cmd {port} {urls}",
            "a b=c {port} {urls}",
            "x=no port {urls}",
            "x=c {port}",
        ] {
            let e = parse_peer_cmd(bad).unwrap_err();
            assert!(e.contains(&format!("{bad:?}")), "{e}");
        }
    }

    #[tokio::test]
    async fn a_peer_runs_until_its_health_answers_and_its_group_dies_when_stopped() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("peer.log");
        // The "router": python's http.server serves a /health file from a directory of its own.
        let root = dir.path().join("root");
        std::fs::create_dir(&root).unwrap();
        std::fs::write(root.join("health"), "ok").unwrap();
        let pids = dir.path().join("pids");
        let p = parse_peer_cmd(&format!(
            "echo=cd {} && echo $$ > {} && echo {{urls}} && exec python3 -m http.server --bind 127.0.0.1 {{port}}",
            root.display(),
            pids.display()
        ))
        .unwrap();
        let test = "a_peer_runs_until_its_health_answers_and_its_group_dies_when_stopped";
        if test_support::require_tool(test, test_support::python_modules(&["http.server"]))
            .is_none()
        {
            return;
        }
        let engines = ["http://e:1".to_string()];
        let peer = p
            .start(&engines, &log, Duration::from_secs(30))
            .await
            .unwrap();
        let body = metrics::get_text(&metrics::http_client(), &format!("{}/health", peer.url))
            .await
            .unwrap();
        assert_eq!(body, "ok");
        let pid: i32 = std::fs::read_to_string(&pids)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        peer.stop().await;
        // SAFETY: signal 0 only checks whether the process exists.
        assert_ne!(unsafe { libc::kill(pid, 0) }, 0, "the peer still runs");
        assert!(std::fs::read_to_string(&log)
            .unwrap()
            .contains("http://e:1"));
        // a command that exits before answering: the error says so with its output
        let gone = parse_peer_cmd("gone=echo no router here {port} {urls}; exit 3").unwrap();
        let e = format!(
            "{:#}",
            gone.start(&engines, &log, Duration::from_secs(30))
                .await
                .err()
                .unwrap()
        );
        assert!(
            e.contains("peer gone exited") && e.contains("no router here"),
            "{e}"
        );
        // a peer that loses its port to another process (the first time) is started again
        let marker = dir.path().join("tried");
        let racy = parse_peer_cmd(&format!(
            "racy=cd {} && if [ ! -e {m} ]; then touch {m}; echo 'OSError: [Errno 98] Address \
             already in use' >&2; exit 1; fi; exec python3 -m http.server --bind 127.0.0.1 \
             {{port}} # {{urls}}",
            root.display(),
            m = marker.display()
        ))
        .unwrap();
        let peer = racy
            .start(&engines, &log, Duration::from_secs(30))
            .await
            .unwrap();
        assert!(marker.exists());
        peer.stop().await;
    }

    #[tokio::test]
    async fn the_fleet_script_is_called_with_the_cache_size_and_stopped() {
        let dir = tempfile::tempdir().unwrap();
        let script = dir.path().join("fleet.sh");
        let calls = dir.path().join("calls");
        std::fs::write(
            &script,
            format!(
                "#!/bin/sh\necho \"$* CACHE_RAM_MIB=$CACHE_RAM_MIB\" >> {}\n\
                 [ \"$1\" = start ] && echo building >&2 && echo noise && \
                 echo http://127.0.0.1:$3,http://127.0.0.1:$(($3 + 1))\nexit 0\n",
                calls.display()
            ),
        )
        .unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
        let f = FleetScript {
            path: script,
            engines: 2,
            first_port: 8001,
        };
        let urls = f.start(17).await.unwrap();
        assert_eq!(urls, ["http://127.0.0.1:8001", "http://127.0.0.1:8002"]);
        f.stop().await.unwrap();
        let text = std::fs::read_to_string(&calls).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines,
            [
                "stop CACHE_RAM_MIB=",
                "start 2 8001 CACHE_RAM_MIB=17",
                "stop CACHE_RAM_MIB="
            ]
        );
        let three = FleetScript { engines: 3, ..f };
        let e = three.start(1).await.unwrap_err().to_string();
        assert!(e.contains("expected 3 engine URLs"), "{e}");
    }
}
