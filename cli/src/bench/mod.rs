//! `prefixctl bench` and `prefixctl demo`: the fleet benchmark.
//!
//! For each strategy a fresh fleet starts in this process (control plane, `--routers` data
//! planes, `--instances` engine-sims with cold caches), a warm-up runs, then closed-loop load from
//! `--concurrency` clients spread over the routers. TTFT is measured at the client (first content
//! chunk), hit rate and shares from the engines' own counters, decision time from the routers'
//! histograms. Engines run `--time-scale` times real time; every duration reported (TTFT,
//! `--duration`, throughput) is in simulated time, i.e. wall time divided by the time scale.
//!
//! With `--engines URL,...` no engine is started: the data plane(s) route to engines that already
//! run, time is real time (time scale 1), and each strategy runs on texts of its own (the
//! workload's text salt is the strategy's position + 1), so no strategy finds the documents of
//! the one before it in the engines' caches. Hit rate and shares come from the engines' own
//! `/metrics` counters when they have them, else from the responses (see [`engines`]).
//!
//! `PREFIX_AWARE_PRECISE` runs PREFIX_AWARE on the engines' KV events: [`precise`] gives the
//! engine-sims their tokenizer and event ports and the variant its `kv_events` (see there).
//!
//! Module dependencies run one way: [`table`] and [`metrics`] are leaves; [`engines`] (per-engine
//! windows and shares) uses [`fleet`] and [`load`]; [`timeline`] uses [`engines`]; [`report`] uses
//! [`timeline`] and [`engines`]; this module wires them.

pub mod engines;
pub mod failures;
pub mod fleet;
pub mod load;
pub mod metrics;
pub mod mixed;
pub mod precise;
pub mod report;
pub mod shapes;
pub mod table;
pub mod timeline;
pub mod workload;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use proto::RoutingStrategy;
use tokio::sync::mpsc;

use engines::EngineShares;
use fleet::{EngineCounters, EngineReading, Fleet, FleetSpec};
use load::{Clients, Conversations, Finished, PromptUsage, Sample};
use report::{AutoscaleReport, BenchReport, MeasuredWindow, PhaseHitRate, StrategyResult};
use workload::{CacheRegime, DocumentRole, Workload, WorkloadKind};

/// `prefixctl bench` flags.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchArgs {
    /// Workload to run.
    #[arg(long, value_enum, default_value = "long-context")]
    pub workload: WorkloadKind,
    /// Strategies to compare, comma-separated (each gets a fresh fleet; default with --workload
    /// shapes: RANDOM,PREFIX_AWARE). `STRATEGY@N` runs that strategy on N routers (e.g.
    /// RANDOM,PREFIX_AWARE,PREFIX_AWARE@4: --routers, and four), labelled so in the report.
    /// PREFIX_AWARE_PRECISE is PREFIX_AWARE fed by the engines' KV events: its engine-sims
    /// publish them and its routers subscribe (see --tokenizer).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "RANDOM,LEAST_OUTSTANDING_REQUESTS,PREFIX_AWARE",
        default_value_if("workload", "shapes", "RANDOM,PREFIX_AWARE"),
        value_parser = parse_strategy_run
    )]
    pub strategies: Vec<StrategyRun>,
    /// --workload shapes: how many shapes to draw from --seed (shape k of a seed is the same
    /// whatever N). Each runs with every router of --strategies and --peer-cmd on a fresh fleet
    /// whose caches are the shape's.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u64).range(1..=1000))]
    pub shapes: u64,
    /// --workload shapes with --engines: the script that starts fresh engines before each run,
    /// `CACHE_RAM_MIB=<the shape's> PATH start N FIRST_PORT` (N and FIRST_PORT: the count and the
    /// first port of --engines; its last line of output: the engines' URLs, comma-separated),
    /// and stops them after it (`PATH stop`); e.g. scripts/llama-server/fleet.sh.
    #[arg(long, value_name = "PATH", requires = "engines")]
    pub fleet_script: Option<std::path::PathBuf>,
    /// --workload shapes: a peer router to run each shape with, `LABEL=COMMAND` (repeatable),
    /// started by the bench in front of each run's fresh engines and killed after it. COMMAND
    /// runs under `sh -c`; `{port}` is replaced by a free port the bench then sends to
    /// (127.0.0.1), `{urls}` by the engines' URLs space-separated (`{urls_csv}`:
    /// comma-separated); the run starts once its GET /health answers. E.g.
    /// 'smg=smg launch --policy cache_aware --host 127.0.0.1 --port {port} --worker-urls {urls}'.
    /// The table gives every other router's req/s over the best peer's.
    #[arg(long, value_name = "LABEL=COMMAND", value_parser = shapes::parse_peer_cmd)]
    pub peer_cmd: Vec<shapes::PeerCmd>,
    /// Model servers (engine-sim) in the fleet.
    #[arg(long, default_value_t = 7, value_parser = clap::value_parser!(u64).range(1..=64))]
    pub instances: u64,
    /// Engines that already run (base URLs, comma-separated: vLLM, SGLang, llama-server...): the
    /// data plane(s) route to them instead of engine-sims. Times are real; hit rate comes from
    /// their own /metrics counters, else from the responses' usage. Each strategy gets fresh
    /// texts (no strategy inherits another's warm cache).
    #[arg(long, value_delimiter = ',', conflicts_with_all = ["instances", "time_scale"])]
    pub engines: Vec<String>,
    /// Document workloads (long-context, long-context-calibrated, autoscale): `user` sends the
    /// document and the question as one user message; `system` sends the document as the
    /// system message and the question as a user message after it.
    #[arg(long, value_enum, default_value = "user")]
    pub document_role: DocumentRole,
    /// Document workloads: `ample` is the workload's own sizes; `small` is 8 documents and KV
    /// caches of 3 documents per engine (fewer than half each; four engines hold each document
    /// once). With --engines, size the engines' caches yourself (the bench says how).
    #[arg(long, value_enum, default_value = "ample")]
    pub cache_regime: CacheRegime,
    /// The `model` field the clients send (default: with --engines, the first engine's model id
    /// from its GET /v1/models; else `bench`, the bench endpoint's name). The bench's routers
    /// send any model to the bench endpoint; a --router-url router may require the engines' id.
    #[arg(long)]
    pub model: Option<String>,
    /// Multiplies the workload's token sizes (documents, system prompts, messages, replies), its
    /// suggested prefix_length and the engines' KV capacity; e.g. 0.1 for small CPU engines.
    #[arg(long, default_value_t = 1.0)]
    pub token_scale: f64,
    /// With --engines: send the load to this router, already running in front of the same
    /// engines (another router, to compare with), instead of to the bench's data plane; one run,
    /// labelled --router-label, on texts of its own.
    #[arg(long, requires = "engines")]
    pub router_url: Option<String>,
    /// The label of the --router-url run in the report.
    #[arg(long, default_value = "EXTERNAL")]
    pub router_label: String,
    /// With --engines: the texts' salt for every run of this invocation (default: each strategy
    /// its own, 1, 2, ..., and 100 for --router-url, so that none finds another's documents in
    /// caches that keep running). Runs on fresh engines compared with the same salt meet the same
    /// placement draw (which documents' hashes meet on one engine).
    #[arg(long, requires = "engines", value_parser = clap::value_parser!(u64).range(1..))]
    pub text_salt: Option<u64>,
    /// Writes each of the bench's routers' `/metrics` (placement rules, the engines' reports by
    /// instance and rule, the learnt cache bound) at the end of each strategy's run to
    /// `DIR/STRATEGY-routerI.prom`.
    #[arg(long, value_name = "DIR")]
    pub router_metrics: Option<std::path::PathBuf>,
    /// Data-plane replicas; clients are spread over them.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=16))]
    pub routers: u64,
    /// Concurrent closed-loop clients.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..=4096))]
    pub concurrency: u64,
    /// Measured time per strategy, in simulated seconds (real seconds with --engines; default 120 there).
    #[arg(
        long,
        default_value_t = 300.0,
        default_value_if("engines", clap::builder::ArgPredicate::IsPresent, "120")
    )]
    pub duration: f64,
    /// Warm-up before measuring, in simulated seconds (real seconds with --engines; default 30 there).
    #[arg(
        long,
        default_value_t = 60.0,
        default_value_if("engines", clap::builder::ArgPredicate::IsPresent, "30")
    )]
    pub warmup: f64,
    /// Engine speed: 0.1 runs the engines ten times faster than real time.
    #[arg(long, default_value_t = 0.1)]
    pub time_scale: f64,
    /// Seed of the workload.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// PREFIX_AWARE prefix_length in characters (default: the workload's suggestion).
    #[arg(long)]
    pub prefix_length: Option<u32>,
    /// PREFIX_AWARE concurrency_threshold.
    #[arg(long, default_value_t = 64)]
    pub concurrency_threshold: u32,
    /// Write the results as JSON here.
    #[arg(long)]
    pub out: Option<std::path::PathBuf>,
    /// Draw TTFT CDFs and per-instance shares (SVG).
    #[arg(long)]
    pub plot: Option<std::path::PathBuf>,
    /// Update this Markdown file's section for the workload (e.g. BENCHMARKS.md).
    #[arg(long)]
    pub markdown: Option<std::path::PathBuf>,
    /// The engine-sims' `tokenizer.json` (chat template beside it) when a run is
    /// PREFIX_AWARE_PRECISE (default: chat-tokens' tiny ByteLevel BPE, written to a temporary
    /// directory). Given, or with any precise run, every engine-sim of every run tokenizes with
    /// it, so precise and approximate differ only in the events; their KV capacity and prefill
    /// rate are scaled by its ids per workload token (4 bytes).
    #[arg(long, value_name = "PATH", conflicts_with = "engines")]
    pub tokenizer: Option<std::path::PathBuf>,
    /// The tokenizer as loaded by [`run`] (`--tokenizer`, or the tiny one for precise runs).
    #[arg(skip)]
    pub sim_tokenizer: Option<precise::BenchTokenizer>,
}

/// One entry of `--strategies`: a strategy, and with `@N` its own number of routers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StrategyRun {
    pub strategy: RoutingStrategy,
    /// `STRATEGY@N`: N routers for this run (`None`: `--routers`).
    pub routers: Option<u64>,
    /// PREFIX_AWARE_PRECISE: the engines publish KV events and the routers subscribe.
    pub precise: bool,
}

/// The label of PREFIX_AWARE fed by the engines' KV events.
pub const PRECISE: &str = "PREFIX_AWARE_PRECISE";

impl StrategyRun {
    /// The strategy's name in the report, without `@N`.
    pub fn name(&self) -> &'static str {
        if self.precise {
            PRECISE
        } else {
            self.strategy.user_name()
        }
    }
}

impl std::fmt::Display for StrategyRun {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.routers {
            Some(n) => write!(f, "{}@{n}", self.name()),
            None => f.write_str(self.name()),
        }
    }
}

impl From<RoutingStrategy> for StrategyRun {
    fn from(strategy: RoutingStrategy) -> Self {
        StrategyRun {
            strategy,
            routers: None,
            precise: false,
        }
    }
}

pub fn parse_strategy_run(s: &str) -> Result<StrategyRun, String> {
    let (name, routers) = match s.split_once('@') {
        Some((name, n)) => {
            let n: u64 = n
                .parse()
                .ok()
                .filter(|n| (1..=16).contains(n))
                .ok_or_else(|| {
                    format!("invalid routers in {s:?}: expected STRATEGY@N with N in 1..=16")
                })?;
            (name, Some(n))
        }
        None => (s, None),
    };
    if name.trim().eq_ignore_ascii_case(PRECISE) {
        return Ok(StrategyRun {
            strategy: RoutingStrategy::PrefixAware,
            routers,
            precise: true,
        });
    }
    Ok(StrategyRun {
        strategy: parse_strategy(name).map_err(|e| format!("{e}, or {PRECISE}"))?,
        routers,
        precise: false,
    })
}

pub fn parse_strategy(s: &str) -> Result<RoutingStrategy, String> {
    RoutingStrategy::from_user_name(s).ok_or_else(|| {
        format!(
            "unknown routing strategy {s:?} (expected {})",
            RoutingStrategy::USER_NAMES
        )
    })
}

impl BenchArgs {
    fn validate(&self) -> anyhow::Result<()> {
        anyhow::ensure!(
            self.time_scale > 0.0 && self.time_scale <= 10.0,
            "invalid --time-scale {}: must be in (0, 10]",
            self.time_scale
        );
        anyhow::ensure!(
            self.duration > 0.0,
            "invalid --duration {}: must be > 0",
            self.duration
        );
        anyhow::ensure!(
            self.warmup >= 0.0,
            "invalid --warmup {}: must be >= 0",
            self.warmup
        );
        anyhow::ensure!(
            !self.strategies.is_empty(),
            "invalid --strategies: none given"
        );
        anyhow::ensure!(
            self.token_scale > 0.0 && self.token_scale <= 10.0,
            "invalid --token-scale {}: must be in (0, 10]",
            self.token_scale
        );
        if !self.workload.has_documents() {
            anyhow::ensure!(
                self.document_role == DocumentRole::default(),
                "invalid --document-role {} for --workload {}: only the document workloads ({}) \
                 have a document",
                self.document_role.name(),
                self.workload.name(),
                WorkloadKind::DOCUMENT_WORKLOADS
            );
            anyhow::ensure!(
                self.cache_regime == CacheRegime::default(),
                "invalid --cache-regime {} for --workload {}: only the document workloads ({}) \
                 have documents to size the caches by",
                self.cache_regime.name(),
                self.workload.name(),
                WorkloadKind::DOCUMENT_WORKLOADS
            );
        }
        if self.workload == WorkloadKind::Shapes {
            self.validate_shapes()?;
        } else {
            self.validate_labels()?;
            anyhow::ensure!(
                self.router_url.is_none()
                    || !self
                        .strategies
                        .iter()
                        .any(|r| r.routers.is_some() || r.precise),
                "invalid --strategies {} with --router-url: that is one run through the other \
                 router",
                self.strategies_list()
            );
            let only_shapes = [
                (self.fleet_script.is_some(), "--fleet-script"),
                (!self.peer_cmd.is_empty(), "--peer-cmd"),
            ];
            for (given, what) in only_shapes {
                anyhow::ensure!(
                    !given,
                    "invalid {what} for --workload {}: only --workload shapes takes it (use \
                     --router-url for a router that already runs)",
                    self.workload.name()
                );
            }
        }
        if let Some(model) = &self.model {
            anyhow::ensure!(
                !model.trim().is_empty(),
                "invalid --model {model:?}: must not be empty"
            );
        }
        if !self.engines.is_empty() {
            anyhow::ensure!(
                !self.strategies.iter().any(|r| r.precise),
                "invalid {PRECISE} with --engines: the bench gives the KV-event ports to the \
                 engine-sims it starts; for running engines, set kv_events in the variant's \
                 routing config and bench them through --router-url"
            );
            anyhow::ensure!(
                self.workload != WorkloadKind::Autoscale,
                "invalid --workload autoscale with --engines: it starts and stops engines, \
                 which the bench cannot do to engines it did not start"
            );
            if let Some(url) = &self.router_url {
                let ok = url
                    .parse::<http::Uri>()
                    .is_ok_and(|u| u.scheme_str() == Some("http") && u.authority().is_some());
                anyhow::ensure!(
                    ok,
                    "invalid --router-url {url:?}: expected http://HOST:PORT"
                );
            }
            for (i, url) in self.engines.iter().enumerate() {
                let uri: http::Uri = url
                    .parse()
                    .map_err(|e| anyhow::anyhow!("invalid --engines URL {url:?}: {e}"))?;
                anyhow::ensure!(
                    uri.scheme_str() == Some("http")
                        && uri.authority().is_some()
                        && matches!(uri.path(), "" | "/")
                        && uri.query().is_none(),
                    "invalid --engines URL {url:?}: expected http://HOST:PORT"
                );
                anyhow::ensure!(
                    !self.engines[..i].contains(url),
                    "invalid --engines: {url:?} is given twice"
                );
            }
        }
        Ok(())
    }

    fn validate_shapes(&self) -> anyhow::Result<()> {
        let refused = [
            (self.router_url.is_some(), "--router-url", "a peer must be restarted in front of each shape's fresh engines: give its command with --peer-cmd"),
            (self.text_salt.is_some(), "--text-salt", "every router of a shape runs on fresh engines and the same texts"),
            (self.markdown.is_some(), "--markdown", "the suite writes its table and --out only"),
            (self.plot.is_some(), "--plot", "the suite writes its table and --out only"),
            (self.router_metrics.is_some(), "--router-metrics", "the suite writes its table and --out only"),
        ];
        for (given, flag, why) in refused {
            anyhow::ensure!(!given, "invalid {flag} with --workload shapes: {why}");
        }
        anyhow::ensure!(
            self.engines.is_empty() || self.fleet_script.is_some(),
            "invalid --engines without --fleet-script for --workload shapes: every run needs \
             fresh engines with the shape's cache (e.g. --fleet-script \
             scripts/llama-server/fleet.sh)"
        );
        self.validate_labels()
    }

    /// Every run's label (`--strategies`, `--peer-cmd`) names a row or column of the report: none
    /// twice.
    fn validate_labels(&self) -> anyhow::Result<()> {
        let mut labels: Vec<String> = self.strategies.iter().map(|r| r.to_string()).collect();
        labels.extend(self.peer_cmd.iter().map(|p| p.label.clone()));
        for (i, l) in labels.iter().enumerate() {
            anyhow::ensure!(
                !labels[..i].contains(l),
                "invalid router list: {l:?} is given twice (--strategies and --peer-cmd labels \
                 name the table's columns)"
            );
        }
        Ok(())
    }

    fn strategies_list(&self) -> String {
        let labels: Vec<String> = self.strategies.iter().map(|r| r.to_string()).collect();
        labels.join(",")
    }

    /// The workload as run: its document role and cache regime, `salt` mixed into its texts,
    /// and its sizes scaled (the cache regime's too).
    /// The texts' salt of the run at `position` against running engines: `--text-salt`, else the
    /// position's own (1, 2, ...; 100 through `--router-url`).
    fn salt(&self, position: usize) -> u64 {
        match (self.text_salt, &self.router_url) {
            (Some(salt), _) => salt,
            (None, Some(_)) => 100,
            (None, None) => position as u64 + 1,
        }
    }

    fn workload(&self, salt: u64) -> Workload {
        let mut w = Workload::new(self.workload, self.seed)
            .with_document_role(self.document_role)
            .with_cache_regime(self.cache_regime);
        if salt != 0 {
            w = w.with_text_salt(salt);
        }
        let f = self.token_scale;
        if f != 1.0 {
            // Sizes the workload does not use (0) stay 0.
            let scale = |n: usize| ((n as f64 * f).round() as usize).max(n.min(1));
            w.document_tokens = scale(w.document_tokens);
            w.system_prompt_tokens = scale(w.system_prompt_tokens);
            w.user_tokens_median *= f;
            w.reply_tokens_median *= f;
            w.kv_capacity_tokens = scale(w.kv_capacity_tokens as usize) as u64;
            w.prefix_length = ((w.prefix_length as f64 * f).round() as u32).clamp(64, 65536);
        }
        w
    }

    fn wall(&self, simulated_secs: f64) -> Duration {
        Duration::from_secs_f64(simulated_secs * self.time_scale)
    }
}

/// Runs the benchmark and writes its outputs.
pub async fn run(mut args: BenchArgs) -> anyhow::Result<()> {
    args.validate()?;
    if args.workload == WorkloadKind::MixedPriority {
        return mixed::run(&args).await.map(|_| ());
    }
    for url in &mut args.engines {
        // The router names an instance by its address as registered: keep one spelling.
        *url = url.trim_end_matches('/').to_string();
    }
    let external = !args.engines.is_empty();
    if external {
        args.time_scale = 1.0;
        args.instances = args.engines.len() as u64;
    }
    args.sim_tokenizer = match &args.tokenizer {
        Some(path) => Some(precise::BenchTokenizer::at(path)?),
        None if args.strategies.iter().any(|r| r.precise) => Some(precise::BenchTokenizer::tiny()?),
        None => None,
    };
    if args.workload == WorkloadKind::Shapes {
        return shapes::run_and_report(&args).await;
    }
    if args.model.is_none() {
        args.model = Some(match args.engines.first() {
            Some(engine) => engines_model(&metrics::http_client(), engine).await?,
            None => fleet::ENDPOINT.to_string(),
        });
    }
    let workload = Arc::new(args.workload(0));
    if external && args.cache_regime == CacheRegime::Small {
        eprintln!("{}", engine_cache_advice(&workload));
    }
    let documents = Arc::new(workload.documents());
    let mut results = Vec::new();
    let mut shares = Vec::new();
    if args.router_url.is_some() {
        // One run through the other router; its texts are its own (salt past any strategy's).
        args.strategies.truncate(1);
    }
    if let Some(t) = &args.sim_tokenizer {
        eprintln!(
            "engine-sims tokenize with {} ({:.2} ids per workload token; KV capacity and prefill \
             rate scaled by it)",
            t.describe(),
            t.for_workload(&workload)?.ids_per_token
        );
    }
    let runs = args.strategies.clone();
    for (i, run) in runs.into_iter().enumerate() {
        let mut run_args = args.clone();
        run_args.routers = run.routers.unwrap_or(args.routers);
        let (r, s) = if args.router_url.is_some() {
            let w = Arc::new(args.workload(args.salt(0)));
            let d = Arc::new(w.documents());
            let (mut r, mut s) = run_strategy(&run_args, &w, &d, run, None).await?;
            r.strategy = args.router_label.clone();
            if let Some(s) = s.as_mut() {
                s.strategy = args.router_label.clone();
            }
            (r, s)
        } else if external {
            // The engines keep running between strategies: fresh texts for each.
            let w = Arc::new(args.workload(args.salt(i)));
            let d = Arc::new(w.documents());
            run_strategy(&run_args, &w, &d, run, None).await?
        } else {
            run_strategy(&run_args, &workload, &documents, run, None).await?
        };
        results.push(r);
        shares.extend(s);
    }
    let mut report = BenchReport::new(&args, &workload, results);
    if let Some(t) = &args.sim_tokenizer {
        report.config["tokenizer"] = serde_json::json!({
            "path": t.describe(),
            "ids_per_workload_token": t.for_workload(&workload)?.ids_per_token,
            "note": "every engine-sim of every run tokenized with it (prompts as token ids, cache \
                     blocks of 16 ids, KV capacity and prefill rate scaled by the ids per \
                     workload token); PREFIX_AWARE_PRECISE runs add the engines' KV events and \
                     the routers' subscriptions, nothing else",
        });
    }
    let mut json = serde_json::to_value(&report)?;
    report.print_table();
    if external {
        engines::print_table(&shares);
        json["config"]["engines"] = serde_json::json!(args.engines);
        json["config"]["token_scale"] = serde_json::json!(args.token_scale);
        json["config"]["text_salt"] = match args.text_salt {
            Some(salt) => serde_json::json!(format!("{salt} for every run (--text-salt)")),
            None => serde_json::json!(
                "strategy position + 1 (100 through --router-url): every strategy runs on texts \
                 of its own, so none finds another's documents in the engines' caches"
            ),
        };
        for (r, s) in json["results"]
            .as_array_mut()
            .into_iter()
            .flatten()
            .zip(&shares)
        {
            r["text_salt"] = serde_json::json!(s.text_salt);
            r["engines"] = serde_json::to_value(&s.engines)?;
        }
    } else if args.token_scale != 1.0 {
        json["config"]["token_scale"] = serde_json::json!(args.token_scale);
    }
    if let Some(path) = &args.out {
        std::fs::write(path, serde_json::to_vec_pretty(&json)?)
            .with_context(|| format!("writing {}", path.display()))?;
        eprintln!("wrote {}", path.display());
    }
    if let Some(path) = &args.markdown {
        if external {
            engines_markdown(&report, &shares, &args, path)?;
        } else {
            report.update_markdown(path, &command_line())?;
        }
        eprintln!("updated {}", path.display());
    }
    if let Some(path) = &args.plot {
        report::plot(&report, path)?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}

/// The model id an engine serves: `data[0].id` of its `GET /v1/models`.
async fn engines_model(http: &metrics::HttpClient, engine: &str) -> anyhow::Result<String> {
    let url = format!("{engine}/v1/models");
    let text = metrics::get_text(http, &url)
        .await
        .with_context(|| format!("reading the engines' model id from {url} (or give --model)"))?;
    model_id(&url, &text)
}

/// `data[0].id` of a `GET /v1/models` answer from `url`.
fn model_id(url: &str, text: &str) -> anyhow::Result<String> {
    let v: serde_json::Value = serde_json::from_str(text)
        .with_context(|| format!("reading the engines' model id from {url} (or give --model)"))?;
    match v.pointer("/data/0/id").and_then(|id| id.as_str()) {
        Some(id) if !id.trim().is_empty() => Ok(id.to_string()),
        _ => anyhow::bail!(
            "no model id in {url}: expected a non-empty data[0].id in its answer (or give --model)"
        ),
    }
}

/// llama.cpp's prompt cache per token of a workload document, in MiB: at `--token-scale 0.1`
/// a prompt of an 800-token document (~1,330 tokens of the tiny model's tokenizer) takes about
/// 1.3 MiB of `--cache-ram` (BENCHMARKS.md: 32 MiB hold ~24 of them).
const LLAMA_CPP_MIB_PER_DOCUMENT_TOKEN: f64 = 1.33 / 800.0;

/// `--cache-regime small` with `--engines`: how to give the engines, which the bench did not
/// start, caches of the regime's size.
fn engine_cache_advice(w: &Workload) -> String {
    let mib = (w.kv_capacity_tokens as f64 * LLAMA_CPP_MIB_PER_DOCUMENT_TOKEN).ceil();
    format!(
        "--cache-regime small: the bench cannot size the caches of --engines; start them with \
         room for {} documents of {} tokens ({} tokens) each, e.g. llama-server: \
         CACHE_RAM_MIB={mib} scripts/llama-server/fleet.sh start (about {:.1} MiB per document \
         with the tiny model)",
        workload::SMALL_CACHE_DOCUMENTS_PER_ENGINE,
        w.document_tokens,
        w.kv_capacity_tokens,
        w.document_tokens as f64 * LLAMA_CPP_MIB_PER_DOCUMENT_TOKEN,
    )
}

/// The `--engines` run's Markdown section: named apart from engine-sim's section of the same
/// workload (it does not replace it), with the per-engine table at its end.
fn engines_markdown(
    report: &BenchReport,
    shares: &[EngineShares],
    args: &BenchArgs,
    path: &std::path::Path,
) -> anyhow::Result<()> {
    let mut named = report.clone();
    named.workload = format!("{} on {} engines", report.workload, args.engines.len());
    named.update_markdown(path, &command_line())?;
    let end = format!("<!-- /bench:{} -->", named.section());
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let table = engines::markdown(shares);
    let text = match text.find(&end) {
        Some(at) => format!("{}{table}{}", &text[..at], &text[at..]),
        None => format!("{text}{table}"),
    };
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}

fn command_line() -> String {
    let args: Vec<String> = std::env::args().skip(1).collect();
    format!("prefixctl {}", args.join(" "))
}

fn spec(args: &BenchArgs, workload: &Workload, run: StrategyRun) -> anyhow::Result<FleetSpec> {
    let tokenizer = match &args.sim_tokenizer {
        Some(t) => Some(precise::SimTokenizer {
            kv_events: run.precise,
            ..t.for_workload(workload)?
        }),
        None => None,
    };
    Ok(FleetSpec {
        instances: args.instances as usize,
        routers: run.routers.unwrap_or(args.routers) as usize,
        strategy: run.strategy,
        prefix_length: args.prefix_length.unwrap_or(workload.prefix_length),
        concurrency_threshold: args.concurrency_threshold,
        kv_capacity_tokens: workload.kv_capacity_tokens,
        time_scale: args.time_scale,
        seed: args.seed,
        engines: args.engines.clone(),
        // With --engines the variant serves the engines' model (by its id, as the clients send
        // it); engine-sims serve their own default.
        model_name: (!args.engines.is_empty())
            .then(|| args.model.clone())
            .flatten(),
        max_num_seqs: None,
        flow_control: None,
        tokenizer,
    })
}

/// The `model` the clients send (resolved by [`run`]).
fn model(args: &BenchArgs) -> Arc<str> {
    Arc::from(args.model.as_deref().unwrap_or(fleet::ENDPOINT))
}

fn progress(total: Duration, label: String) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::new(total.as_millis() as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{prefix:>28} [{bar:30}] {msg}")
            .expect("a valid template")
            .progress_chars("=> "),
    );
    bar.set_prefix(label);
    bar
}

/// Snapshots taken at a moment of the run.
struct Snapshot {
    at: Instant,
    engines: Vec<EngineCounters>,
    readings: Vec<EngineReading>,
}

async fn snapshot(fleet: &Fleet) -> anyhow::Result<Snapshot> {
    let readings = fleet.engine_readings().await?;
    Ok(Snapshot {
        at: Instant::now(),
        engines: readings.iter().map(EngineCounters::from).collect(),
        readings,
    })
}

fn hit_rate(from: &[EngineCounters], to: &[EngineCounters]) -> f64 {
    let (mut q, mut h) = (0.0, 0.0);
    for (i, t) in to.iter().enumerate() {
        let f = from.get(i).copied().unwrap_or_default();
        q += t.queries - f.queries;
        h += t.hits - f.hits;
    }
    if q > 0.0 {
        h / q
    } else {
        0.0
    }
}

/// One strategy's run on a fresh fleet. With `peer` (a command, its log, how long it may take
/// to answer `/health`), the load goes to that router, started in front of the fleet's engines
/// and stopped after the run, instead of to the bench's routers.
async fn run_strategy(
    args: &BenchArgs,
    workload: &Arc<Workload>,
    documents: &Arc<Vec<Arc<str>>>,
    run: StrategyRun,
    peer: Option<(&shapes::PeerCmd, std::path::PathBuf, Duration)>,
) -> anyhow::Result<(StrategyResult, Option<EngineShares>)> {
    let strategy = run.strategy;
    let label = run.to_string();
    let mut fleet = Fleet::start(spec(args, workload, run)?).await?;
    let peer = match peer {
        Some((cmd, log, within)) => match cmd.start(&fleet.instance_urls(), &log, within).await {
            Ok(p) => Some(p),
            Err(e) => {
                fleet.stop().await;
                return Err(e);
            }
        },
        None => None,
    };
    if !args.engines.is_empty()
        && args.workload != WorkloadKind::Shapes
        && args.strategies.first() == Some(&run)
    {
        for r in fleet.engine_readings().await? {
            match r.counters {
                Some((m, _)) => {
                    eprintln!("engine {}: {} cache counters in /metrics", r.url, m.name())
                }
                None => eprintln!(
                    "engine {}: no cache counters in /metrics (llama-server needs --metrics); \
                     hit rate from the responses' usage",
                    r.url
                ),
            }
        }
    }
    let warmup = args.wall(args.warmup);
    let measure = args.wall(args.duration);
    let start = Instant::now();
    let measure_from = start + warmup;
    let stop_at = measure_from + measure;

    let (tx, mut rx) = mpsc::unbounded_channel();
    let targets = match (&peer, &args.router_url) {
        (Some(p), _) => vec![p.url.clone()],
        (None, Some(url)) => vec![url.trim_end_matches('/').to_string()],
        (None, None) => fleet.router_urls(),
    };
    let clients = tokio::spawn(load::run_clients(
        Conversations {
            workload: workload.clone(),
            documents: documents.clone(),
            model: model(args),
        },
        Clients {
            routers: targets,
            concurrency: args.concurrency as usize,
            stop_at,
        },
        metrics::http_client(),
        tx,
    ));
    let bar = progress(
        warmup + measure,
        format!(
            "{} {}",
            workload.kind.name(),
            peer.as_ref().map_or(label.as_str(), |p| p.label.as_str())
        ),
    );
    let mut samples: Vec<Sample> = Vec::new();
    let mut usages: Vec<PromptUsage> = Vec::new();
    let mut first: Option<(Snapshot, metrics::Histogram)> = None;
    let mut autoscale = (args.workload == WorkloadKind::Autoscale)
        .then(|| AutoscaleRun::new(args, measure_from, measure));
    let mut timeline = timeline::TimelineRun::new(start, args.time_scale);
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    let mut failures = failures::Failures::default();
    loop {
        tokio::select! {
            s = rx.recv() => match s {
                Some(Finished { sample: s, usage }) => {
                    failures.count(s.error.as_deref());
                    if s.error.is_some() && failures.errors() <= 3 {
                        bar.println(format!("request error: {}", s.error.as_deref().unwrap_or_default()));
                    }
                    samples.push(s);
                    usages.push(usage);
                    if failures.most_failed(failures::STOP_AFTER) {
                        clients.abort();
                        bar.finish_and_clear();
                        fleet.stop().await;
                        anyhow::bail!("stopped early: {}", failures.explain(&label, args.token_scale));
                    }
                }
                None => break,
            },
            _ = tick.tick() => {
                let now = Instant::now();
                bar.set_position(now.saturating_duration_since(start).as_millis() as u64);
                bar.set_message(format!("{} requests, {} errors", samples.len(), failures.errors()));
                if first.is_none() && now >= measure_from {
                    first = Some((snapshot(&fleet).await?, fleet.decision_histogram().await?));
                }
                if timeline.due(now) {
                    timeline.record(Instant::now(), fleet.engine_readings().await?);
                }
                if let Some(a) = autoscale.as_mut() {
                    a.step(&mut fleet, now).await?;
                }
            }
        }
    }
    clients.await.context("load clients failed")?;
    bar.finish_and_clear();
    if failures.most_failed(1) {
        fleet.stop().await;
        anyhow::bail!("{}", failures.explain(&label, args.token_scale));
    }
    if let Some(dir) = &args.router_metrics {
        fleet.write_router_metrics(dir, &label).await?;
    }
    if let Some(p) = peer {
        p.stop().await;
    }
    let end = snapshot(&fleet).await?;
    timeline.record_end(end.at, end.readings.clone());
    let end_hist = fleet.decision_histogram().await?;
    let (begin, begin_hist) = match first {
        Some(f) => f,
        None => (
            Snapshot {
                at: start,
                engines: Vec::new(),
                readings: Vec::new(),
            },
            metrics::Histogram::default(),
        ),
    };
    let measured: Vec<&Sample> = samples
        .iter()
        .filter(|s| s.done >= measure_from && s.done <= stop_at)
        .collect();
    let window = end
        .at
        .min(stop_at)
        .saturating_duration_since(begin.at)
        .max(Duration::from_millis(1));
    let autoscale_report = match autoscale {
        Some(a) => Some(a.finish(&samples)?),
        None => None,
    };
    let in_window = |s: &Sample| s.done >= measure_from && s.done <= stop_at;
    let shares = (!args.engines.is_empty()).then(|| {
        let with_usage: Vec<(&Sample, PromptUsage)> = samples
            .iter()
            .zip(usages.iter().copied())
            .filter(|(s, _)| in_window(s))
            .collect();
        EngineShares {
            strategy: label.clone(),
            text_salt: workload.text_salt,
            engines: engines::windows(&begin.readings, &end.readings, &with_usage),
        }
    });
    let (begin_counters, end_counters) = match &shares {
        Some(s) => engines::counters(&s.engines),
        None => (begin.engines, end.engines),
    };
    let result = StrategyResult::compute(
        strategy,
        args.time_scale,
        &MeasuredWindow {
            samples: &measured,
            begin: &begin_counters,
            end: &end_counters,
            length: window,
        },
        &end_hist.since(&begin_hist),
        autoscale_report,
    );
    // A precise run's routers say what their exact indexes took in: none means no events.
    let kv_index = match run.precise {
        true => Some(fleet.router_indexes().await?),
        false => None,
    };
    for (i, r) in kv_index.iter().flatten().enumerate() {
        if r.kv_events == 0.0 {
            eprintln!("{label}: router {i} applied no KV events (its index is not exact)");
        }
    }
    let result = StrategyResult {
        strategy: label,
        timeline: Some(timeline.finish(&samples, &usages)),
        kv_index,
        ..result
    };
    fleet.stop().await;
    Ok((result, shares))
}

/// The autoscale schedule: an instance joins at 1/3 of the measured time, one leaves at 2/3;
/// hit rate is sampled every 5 simulated seconds.
struct AutoscaleRun {
    add_at: Instant,
    remove_at: Instant,
    every: Duration,
    next_sample: Instant,
    added: Option<(Instant, String)>,
    removed: Option<(Instant, String)>,
    last: Option<Snapshot>,
    series: Vec<(Instant, f64)>,
}

impl AutoscaleRun {
    fn new(args: &BenchArgs, from: Instant, measure: Duration) -> Self {
        AutoscaleRun {
            add_at: from + measure / 3,
            remove_at: from + measure * 2 / 3,
            every: args.wall(5.0),
            next_sample: from,
            added: None,
            removed: None,
            last: None,
            series: Vec::new(),
        }
    }

    async fn step(&mut self, fleet: &mut Fleet, now: Instant) -> anyhow::Result<()> {
        if now >= self.next_sample {
            let snap = snapshot(fleet).await?;
            if let Some(prev) = &self.last {
                self.series
                    .push((snap.at, hit_rate(&prev.engines, &snap.engines)));
            }
            self.last = Some(snap);
            self.next_sample = now + self.every;
        }
        if self.added.is_none() && now >= self.add_at {
            let url = fleet.add_instance().await?;
            self.added = Some((Instant::now(), url));
        }
        if self.removed.is_none() && now >= self.remove_at {
            // The first instance leaves: a different one from the one that joined.
            let url = fleet.remove_instance(0).await?;
            self.removed = Some((Instant::now(), url));
        }
        Ok(())
    }

    fn finish(self, samples: &[Sample]) -> anyhow::Result<AutoscaleReport> {
        let (added_at, added_url) = self
            .added
            .clone()
            .context("the run ended before an instance was added")?;
        let (removed_at, removed_url) = self
            .removed
            .clone()
            .context("the run ended before an instance was removed")?;
        let mean = |from: Instant, to: Instant| {
            let v: Vec<f64> = self
                .series
                .iter()
                .filter(|(t, _)| *t > from && *t <= to)
                .map(|x| x.1)
                .collect();
            if v.is_empty() {
                0.0
            } else {
                v.iter().sum::<f64>() / v.len() as f64
            }
        };
        let first = self.series.first().map(|x| x.0).unwrap_or(added_at);
        let steady = mean(first, added_at);
        // Time until the hit rate is back within 5 points of steady state after the join.
        let recovered = self
            .series
            .iter()
            .find(|(t, h)| *t > added_at && *t <= removed_at && *h >= steady - 0.05)
            .map(|(t, _)| t.duration_since(added_at));
        let last_sample = self.series.last().map(|x| x.0).unwrap_or(removed_at);
        let phases = vec![
            PhaseHitRate {
                phase: "before (7 instances)".into(),
                kv_hit_rate: steady,
            },
            PhaseHitRate {
                phase: "after join (8)".into(),
                kv_hit_rate: mean(added_at, removed_at),
            },
            PhaseHitRate {
                phase: "after leave (7)".into(),
                kv_hit_rate: mean(removed_at, last_sample),
            },
        ];
        let window = self.every * 6;
        let join = moved_keys(samples, added_at, window, None);
        Ok(AutoscaleReport {
            added_instance: added_url.clone(),
            removed_instance: removed_url.clone(),
            keys_moved_on_join: join.all(),
            keys_moved_on_join_elsewhere: join.not_to(&added_url),
            keys_moved_on_leave: moved_keys(samples, removed_at, window, Some(&removed_url)).all(),
            recovered_after_join_s: recovered.map(|d| d.as_secs_f64()),
            phases,
            hit_rate_series: self
                .series
                .iter()
                .map(|(t, h)| (t.duration_since(first).as_secs_f64(), *h))
                .collect(),
        })
    }
}

/// Fraction of keys (documents) that moved: most of whose requests in the window after `at` went
/// to instances that served none of them in the window before it (cold ones). A hot key spread
/// over several instances whose busiest one changes among them has not moved (every one of them
/// holds it); nor has one that gains the new instance as one more copy while most of its requests
/// still go where it was (the least loaded, the new one is often its busiest: counted as a move,
/// that added the 2-3 hottest of 80 documents to every join, 14.8% over 12 autoscale seeds
/// where this count gives 12.5%). On a leave, keys that lived on the removed instance must move
/// and are left out: the question is how many others moved.
fn moved_keys<'a>(
    samples: &'a [Sample],
    at: Instant,
    window: Duration,
    removed: Option<&str>,
) -> Moved<'a> {
    let served = |from: Instant, to: Instant| {
        let mut counts: HashMap<u64, HashMap<&str, u32>> = HashMap::new();
        for s in samples
            .iter()
            .filter(|s| s.error.is_none() && s.done >= from && s.done < to)
        {
            *counts
                .entry(s.affinity)
                .or_default()
                .entry(s.instance.as_str())
                .or_default() += 1;
        }
        counts
    };
    fn main<'a>(served: &HashMap<&'a str, u32>) -> Option<&'a str> {
        served.iter().max_by_key(|x| (*x.1, *x.0)).map(|x| *x.0)
    }
    // The busiest of the instances that served the key after the change and not before, when
    // they took most of its requests.
    fn cold_main<'a>(
        before: &HashMap<&str, u32>,
        after: &HashMap<&'a str, u32>,
    ) -> Option<&'a str> {
        let cold = || after.iter().filter(|x| !before.contains_key(x.0));
        let total: u32 = after.values().sum();
        (cold().map(|x| *x.1).sum::<u32>() * 2 > total)
            .then(|| cold().max_by_key(|x| (*x.1, *x.0)).map(|x| *x.0))
            .flatten()
    }
    let before = served(at.checked_sub(window).unwrap_or(at), at);
    // Skip the moment of the change itself: requests already in flight finish where they were.
    let settle = window / 6;
    let after = served(at + settle, at + settle + window);
    let mut total = 0;
    let mut to = Vec::new();
    for (k, b) in &before {
        if main(b).is_some_and(|i| removed == Some(i)) {
            continue;
        }
        if let Some(a) = after.get(k) {
            total += 1;
            if let Some(to_cold) = cold_main(b, a) {
                to.push(to_cold);
            }
        }
    }
    Moved { total, to }
}

/// What [`moved_keys`] found: how many keys it judged, and the new main instance of each that
/// moved.
struct Moved<'a> {
    total: usize,
    to: Vec<&'a str>,
}

impl Moved<'_> {
    /// The share of the keys that moved.
    fn all(&self) -> f64 {
        self.share(self.to.len())
    }

    /// The share of the keys that moved to an instance other than `instance` (on a join, the
    /// new one: hashing sends about 1/(n+1) of the keys there, and every other move is the
    /// router's own).
    fn not_to(&self, instance: &str) -> f64 {
        self.share(self.to.iter().filter(|&&a| a != instance).count())
    }

    fn share(&self, n: usize) -> f64 {
        if self.total == 0 {
            0.0
        } else {
            n as f64 / self.total as f64
        }
    }
}

/// `prefixctl demo` flags.
#[derive(Debug, Clone, clap::Args)]
pub struct DemoArgs {
    /// Wall-clock length of the whole demo, in seconds (at most 60).
    #[arg(long, default_value_t = 40, value_parser = clap::value_parser!(u64).range(10..=60))]
    pub seconds: u64,
    /// Concurrent clients.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..=4096))]
    pub concurrency: u64,
    /// Engine speed (0.1 = ten times real time).
    #[arg(long, default_value_t = 0.1)]
    pub time_scale: f64,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

/// `prefixctl demo`: one fleet on long-context, RANDOM for the first half, then the variant is
/// switched to PREFIX_AWARE live with UpdateEndpointConfig, and both halves are printed side by side.
pub async fn demo(args: DemoArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.time_scale > 0.0 && args.time_scale <= 10.0,
        "invalid --time-scale {}",
        args.time_scale
    );
    let workload = Arc::new(Workload::new(WorkloadKind::LongContext, args.seed));
    let documents = Arc::new(workload.documents());
    let bench = BenchArgs {
        workload: WorkloadKind::LongContext,
        strategies: vec![RoutingStrategy::Random.into()],
        shapes: 1,
        fleet_script: None,
        peer_cmd: Vec::new(),
        instances: 7,
        engines: Vec::new(),
        router_url: None,
        router_label: String::new(),
        text_salt: None,
        router_metrics: None,
        document_role: DocumentRole::User,
        cache_regime: CacheRegime::Ample,
        model: None,
        token_scale: 1.0,
        routers: 1,
        concurrency: args.concurrency,
        duration: 0.0,
        warmup: 0.0,
        time_scale: args.time_scale,
        seed: args.seed,
        prefix_length: None,
        concurrency_threshold: 64,
        out: None,
        plot: None,
        markdown: None,
        tokenizer: None,
        sim_tokenizer: None,
    };
    eprintln!("starting a fleet: control plane, 1 data plane, 7 engine-sims (long-context, time scale {})", args.time_scale);
    let mut fleet = Fleet::start(spec(&bench, &workload, RoutingStrategy::Random.into())?).await?;
    let total = Duration::from_secs(args.seconds);
    let half = total / 2;
    // Each half: the first 30% warms the caches, the rest is measured.
    let settle = half.mul_f64(0.3);
    let start = Instant::now();
    let stop_at = start + total;
    let (tx, mut rx) = mpsc::unbounded_channel();
    let clients = tokio::spawn(load::run_clients(
        Conversations {
            workload: workload.clone(),
            documents,
            model: model(&bench),
        },
        Clients {
            routers: fleet.router_urls(),
            concurrency: args.concurrency as usize,
            stop_at,
        },
        metrics::http_client(),
        tx,
    ));
    let bar = progress(total, "demo".into());
    let mut samples = Vec::new();
    let mut snaps: Vec<Snapshot> = Vec::new();
    let marks = [start + settle, start + half, start + half + settle, stop_at];
    let mut switched = false;
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    loop {
        tokio::select! {
            s = rx.recv() => match s { Some(f) => samples.push(f.sample), None => break },
            _ = tick.tick() => {
                let now = Instant::now();
                bar.set_position(now.saturating_duration_since(start).as_millis() as u64);
                if snaps.len() < marks.len() && now >= marks[snaps.len()] {
                    snaps.push(snapshot(&fleet).await?);
                }
                if !switched && now >= start + half {
                    fleet.set_strategy(RoutingStrategy::PrefixAware).await?;
                    bar.println("switched the variant to PREFIX_AWARE with UpdateEndpointConfig (no restart)");
                    switched = true;
                }
                bar.set_message(if switched { "PREFIX_AWARE" } else { "RANDOM" });
            }
        }
    }
    clients.await?;
    bar.finish_and_clear();
    while snaps.len() < marks.len() {
        snaps.push(snapshot(&fleet).await?);
    }
    let half_result = |strategy, from: &Snapshot, to: &Snapshot| {
        let measured: Vec<&Sample> = samples
            .iter()
            .filter(|s| s.done >= from.at && s.done <= to.at)
            .collect();
        StrategyResult::compute(
            strategy,
            args.time_scale,
            &MeasuredWindow {
                samples: &measured,
                begin: &from.engines,
                end: &to.engines,
                length: to.at - from.at,
            },
            &metrics::Histogram::default(),
            None,
        )
    };
    let random = half_result(RoutingStrategy::Random, &snaps[0], &snaps[1]);
    let prefix = half_result(RoutingStrategy::PrefixAware, &snaps[2], &snaps[3]);
    fleet.stop().await;
    report::print_demo(&random, &prefix);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        bench: BenchArgs,
    }

    fn parse(args: &[&str]) -> Result<BenchArgs, clap::Error> {
        Cli::try_parse_from(std::iter::once("bench").chain(args.iter().copied())).map(|c| c.bench)
    }

    #[test]
    fn a_key_moves_when_most_of_its_requests_go_to_instances_that_did_not_serve_it() {
        let at = Instant::now() + Duration::from_secs(100);
        let sample = |key: u64, instance: &str, secs: f64| Sample {
            client: 0,
            done: at - Duration::from_secs(10) + Duration::from_secs_f64(secs + 10.0),
            ttft: Duration::ZERO,
            latency: Duration::ZERO,
            output_tokens: 1,
            instance: instance.into(),
            affinity: key,
            error: None,
        };
        let mut samples = Vec::new();
        for t in [-5.0, -4.0, -3.0] {
            samples.push(sample(1, "a", t)); // cold key, moves to the new instance
            samples.push(sample(2, "a", t)); // hot key on a and b: a busiest before
            samples.push(sample(3, "c", t)); // stays
            samples.push(sample(4, "d", t)); // on the instance that leaves
        }
        samples.push(sample(2, "b", -2.0));
        for t in [-5.0, -4.0, -3.0] {
            samples.push(sample(5, "b", t)); // hot key on b and c
            samples.push(sample(5, "c", t));
            samples.push(sample(6, "c", t)); // on c alone
        }
        for t in [2.0, 3.0, 4.0] {
            samples.push(sample(1, "new", t));
            samples.push(sample(2, "b", t)); // now b is busiest: no cold start anywhere
            samples.push(sample(3, "c", t));
            samples.push(sample(4, "a", t));
            // a copy on the new instance, its busiest, but most requests still go to b and c
            samples.push(sample(5, "new", t));
            samples.push(sample(5, "new", t + 0.5));
            samples.push(sample(5, "b", t));
            samples.push(sample(5, "c", t));
            samples.push(sample(5, "c", t + 0.5));
            // two of three to the new instance: moved, though c still serves it
            samples.push(sample(6, "new", t));
            samples.push(sample(6, "new", t + 0.5));
            samples.push(sample(6, "c", t));
        }
        let window = Duration::from_secs(6);
        // of keys 1-6, 1 and 6 moved to the new instance (and 4, whose instance is not gone
        // here, to a); 5 gained a copy and 2 changed its busiest among its holders
        let join = moved_keys(&samples, at, window, None);
        assert_eq!(join.all(), 0.5);
        // of them, key 4 went to an instance that was there before: not the join's doing
        assert_eq!(join.not_to("new"), 1.0 / 6.0);
        // when d leaves, its key must move and is left out
        assert_eq!(moved_keys(&samples, at, window, Some("d")).all(), 2.0 / 5.0);
    }

    #[test]
    fn engines_flags() {
        let sims = parse(&[]).unwrap();
        assert!(sims.engines.is_empty());
        assert_eq!((sims.duration, sims.warmup), (300.0, 60.0));
        // Real engines run in real time: shorter defaults.
        let real = parse(&["--engines", "http://127.0.0.1:8001,http://127.0.0.1:8002/"]).unwrap();
        assert_eq!(
            real.engines,
            ["http://127.0.0.1:8001", "http://127.0.0.1:8002/"]
        );
        assert_eq!((real.duration, real.warmup), (120.0, 30.0));
        real.validate().unwrap();
        let given = parse(&["--engines", "http://h:1", "--duration", "9"]).unwrap();
        assert_eq!(given.duration, 9.0);
        // No time scale and no instance count for engines that already run.
        for other in [["--time-scale", "0.5"], ["--instances", "3"]] {
            let e = parse(&["--engines", "http://h:1", other[0], other[1]])
                .err()
                .unwrap();
            assert_eq!(e.kind(), clap::error::ErrorKind::ArgumentConflict, "{e}");
        }
        let invalid = |args: &[&str]| parse(args).unwrap().validate().unwrap_err().to_string();
        let e = invalid(&["--engines", "http://h:1", "--workload", "autoscale"]);
        assert!(e.contains("--workload autoscale"), "{e}");
        for url in ["h:1", "https://h:1", "http://h:1/v1", "http://"] {
            let e = invalid(&["--engines", url]);
            assert!(e.contains(&format!("{url:?}")), "{e}");
        }
        let e = invalid(&["--engines", "http://h:1,http://h:1"]);
        assert!(e.contains("given twice"), "{e}");
        let e = invalid(&["--token-scale", "0"]);
        assert!(e.contains("--token-scale 0"), "{e}");
        // another router in front of the same engines, to compare with
        let other = parse(&[
            "--engines",
            "http://h:1",
            "--router-url",
            "http://r:30000",
            "--router-label",
            "sglang cache_aware",
        ])
        .unwrap();
        other.validate().unwrap();
        assert_eq!(other.router_label, "sglang cache_aware");
        let e = parse(&["--router-url", "http://r:1"]).err().unwrap();
        assert_eq!(
            e.kind(),
            clap::error::ErrorKind::MissingRequiredArgument,
            "{e}"
        );
        let e = invalid(&["--engines", "http://h:1", "--router-url", "r:1"]);
        assert!(e.contains("--router-url \"r:1\""), "{e}");
    }

    #[test]
    fn shapes_flags() {
        let s = parse(&["--workload", "shapes"]).unwrap();
        s.validate().unwrap();
        assert_eq!(
            s.strategies,
            [
                RoutingStrategy::Random.into(),
                RoutingStrategy::PrefixAware.into()
            ],
            "the shapes' default routers"
        );
        assert_eq!(
            parse(&[]).unwrap().strategies.len(),
            3,
            "the others' default"
        );
        let four = parse(&[
            "--workload",
            "shapes",
            "--strategies",
            "RANDOM,PREFIX_AWARE,PREFIX_AWARE@4",
            "--peer-cmd",
            "smg=smg launch --port {port} --worker-urls {urls}",
            "--peer-cmd",
            "sglang=python3 -m sglang_router.launch_router --port {port} --worker-urls {urls}",
        ])
        .unwrap();
        four.validate().unwrap();
        let labels: Vec<String> = shapes::routers(&four).iter().map(|r| r.label()).collect();
        assert_eq!(
            labels,
            ["RANDOM", "PREFIX_AWARE", "PREFIX_AWARE@4", "smg", "sglang"]
        );
        assert_eq!(four.strategies[2].routers, Some(4));
        for bad in [
            "PREFIX_AWARE@0",
            "PREFIX_AWARE@x",
            "PREFIX_AWARE@17",
            "RANDO@2",
        ] {
            let e = parse(&["--workload", "shapes", "--strategies", bad])
                .err()
                .unwrap();
            assert_eq!(e.kind(), clap::error::ErrorKind::ValueValidation, "{e}");
        }
        let invalid = |args: &[&str]| parse(args).unwrap().validate().unwrap_err().to_string();
        // the other workloads take none of the suite's flags; STRATEGY@N they do
        parse(&["--strategies", "PREFIX_AWARE,PREFIX_AWARE@4"])
            .unwrap()
            .validate()
            .unwrap();
        let e = invalid(&[
            "--engines",
            "http://h:1",
            "--router-url",
            "http://r:1",
            "--strategies",
            "PREFIX_AWARE@4",
        ]);
        assert!(
            e.contains("--strategies PREFIX_AWARE@4 with --router-url"),
            "{e}"
        );
        let e = invalid(&["--peer-cmd", "a=x {port} {urls}"]);
        assert!(e.contains("invalid --peer-cmd"), "{e}");
        let e = invalid(&["--engines", "http://h:1", "--fleet-script", "f.sh"]);
        assert!(e.contains("invalid --fleet-script"), "{e}");
        // real engines must be fresh per run: a fleet script, and peers by command
        let e = invalid(&["--workload", "shapes", "--engines", "http://h:1"]);
        assert!(e.contains("without --fleet-script"), "{e}");
        let e = invalid(&[
            "--workload",
            "shapes",
            "--engines",
            "http://h:1",
            "--fleet-script",
            "f.sh",
            "--router-url",
            "http://r:1",
        ]);
        assert!(
            e.contains("--router-url with --workload shapes") && e.contains("--peer-cmd"),
            "{e}"
        );
        let e = invalid(&["--workload", "shapes", "--markdown", "B.md"]);
        assert!(e.contains("--markdown with --workload shapes"), "{e}");
        let e = invalid(&[
            "--workload",
            "shapes",
            "--strategies",
            "RANDOM,RANDOM@1,RANDOM",
        ]);
        assert!(e.contains("\"RANDOM\" is given twice"), "{e}");
        let e = invalid(&["--workload", "shapes", "--document-role", "system"]);
        assert!(e.contains("--document-role system"), "{e}");
        parse(&[
            "--workload",
            "shapes",
            "--engines",
            "http://127.0.0.1:8001,http://127.0.0.1:8002",
            "--fleet-script",
            "scripts/llama-server/fleet.sh",
        ])
        .unwrap()
        .validate()
        .unwrap();
        // the shapes' key: --prefix-length, else 4096 characters times --token-scale
        let scaled = parse(&["--workload", "shapes", "--token-scale", "0.1"]).unwrap();
        assert_eq!(shapes::prefix_length(&scaled), 410);
        let given = parse(&["--workload", "shapes", "--prefix-length", "1000"]).unwrap();
        assert_eq!(shapes::prefix_length(&given), 1000);
    }

    #[test]
    fn precise_is_prefix_aware_fed_by_the_engines_events() {
        let args = parse(&[
            "--workload",
            "tenants",
            "--strategies",
            "RANDOM,PREFIX_AWARE,PREFIX_AWARE_PRECISE,prefix_aware_precise@4",
        ])
        .unwrap();
        args.validate().unwrap();
        let labels: Vec<String> = args.strategies.iter().map(|r| r.to_string()).collect();
        assert_eq!(
            labels,
            [
                "RANDOM",
                "PREFIX_AWARE",
                "PREFIX_AWARE_PRECISE",
                "PREFIX_AWARE_PRECISE@4"
            ]
        );
        let precise = args.strategies[3];
        assert_eq!(
            (precise.strategy, precise.routers, precise.precise),
            (RoutingStrategy::PrefixAware, Some(4), true)
        );
        assert!(!args.strategies[1].precise);
        let e = parse(&["--strategies", "PREFIX_AWARE_EXACT"])
            .err()
            .unwrap();
        assert!(e.to_string().contains("or PREFIX_AWARE_PRECISE"), "{e}");
        let invalid = |args: &[&str]| parse(args).unwrap().validate().unwrap_err().to_string();
        let e = invalid(&[
            "--engines",
            "http://h:1",
            "--strategies",
            "PREFIX_AWARE_PRECISE",
        ]);
        assert!(
            e.contains("invalid PREFIX_AWARE_PRECISE with --engines"),
            "{e}"
        );
        let e = invalid(&["--strategies", "PREFIX_AWARE_PRECISE,PREFIX_AWARE_PRECISE"]);
        assert!(e.contains("given twice"), "{e}");
        let e = parse(&["--engines", "http://h:1", "--tokenizer", "t.json"])
            .err()
            .unwrap();
        assert_eq!(e.kind(), clap::error::ErrorKind::ArgumentConflict, "{e}");
    }

    #[tokio::test]
    async fn a_precise_fleet_names_its_engines_events_and_tokenizer_in_the_variant() {
        let args = parse(&[
            "--workload",
            "tenants",
            "--instances",
            "2",
            "--strategies",
            "PREFIX_AWARE_PRECISE@2",
        ])
        .unwrap();
        let tokenizer = precise::BenchTokenizer::tiny().unwrap();
        let args = BenchArgs {
            sim_tokenizer: Some(tokenizer.clone()),
            ..args
        };
        let w = args.workload(0);
        let spec = spec(&args, &w, args.strategies[0]).unwrap();
        assert_eq!(spec.routers, 2);
        let t = spec.tokenizer.clone().unwrap();
        assert!(t.kv_events && t.path == tokenizer.path);
        let fleet = Fleet::start(spec).await.unwrap();
        // every engine publishes, and each router takes every engine's events in
        let http = metrics::http_client();
        let deadline = Instant::now() + Duration::from_secs(20);
        let body = Workload::new(WorkloadKind::Tenants, 1)
            .client(0)
            .next(&w, &[], None)
            .body("bench");
        for router in fleet.router_urls() {
            let req = http::Request::post(format!("{router}/v1/chat/completions"))
                .header("content-type", "application/json")
                .body(http_body_util::Full::new(bytes::Bytes::from(body.clone())))
                .unwrap();
            let resp = http.request(req).await.unwrap();
            assert!(resp.status().is_success(), "{}", resp.status());
            http_body_util::BodyExt::collect(resp.into_body())
                .await
                .unwrap();
        }
        loop {
            let indexes = fleet.router_indexes().await.unwrap();
            if indexes
                .iter()
                .all(|r| r.kv_events > 0.0 && r.index_blocks > 0.0)
            {
                break;
            }
            assert!(Instant::now() < deadline, "{indexes:?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        fleet.stop().await;
    }

    #[test]
    fn document_flags_are_refused_for_the_chats() {
        let invalid = |args: &[&str]| parse(args).unwrap().validate().unwrap_err().to_string();
        for w in ["sharegpt", "system-prompt-chat", "system-prompt-long"] {
            let e = invalid(&["--workload", w, "--document-role", "system"]);
            assert!(
                e.contains(&format!(
                    "invalid --document-role system for --workload {w}"
                )) && e.contains("long-context, long-context-calibrated, autoscale"),
                "{e}"
            );
            let e = invalid(&["--workload", w, "--cache-regime", "small"]);
            assert!(
                e.contains(&format!("invalid --cache-regime small for --workload {w}")),
                "{e}"
            );
            // the defaults, given or not, are fine
            parse(&[
                "--workload",
                w,
                "--document-role",
                "user",
                "--cache-regime",
                "ample",
            ])
            .unwrap()
            .validate()
            .unwrap();
        }
        for w in ["long-context", "long-context-calibrated", "autoscale"] {
            let args = parse(&[
                "--workload",
                w,
                "--document-role",
                "system",
                "--cache-regime",
                "small",
            ])
            .unwrap();
            args.validate().unwrap();
            let workload = args.workload(0);
            assert_eq!(workload.document_role, DocumentRole::System);
            assert_eq!(workload.cache_regime, CacheRegime::Small);
        }
        let e = parse(&["--document-role", "assistant"]).err().unwrap();
        assert_eq!(e.kind(), clap::error::ErrorKind::InvalidValue, "{e}");
        let e = invalid(&["--model", " "]);
        assert!(e.contains("invalid --model \" \""), "{e}");
        let defaults = parse(&[]).unwrap();
        assert_eq!(
            (
                defaults.document_role,
                defaults.cache_regime,
                defaults.model
            ),
            (DocumentRole::User, CacheRegime::Ample, None)
        );
    }

    #[test]
    fn the_small_regime_composes_with_the_token_scale() {
        let args = parse(&["--cache-regime", "small", "--token-scale", "0.1"]).unwrap();
        let w = args.workload(0);
        assert_eq!((w.documents, w.document_tokens), (8, 800));
        let (cap, doc) = (w.kv_capacity_tokens, w.document_tokens as u64);
        assert!(cap >= 3 * doc && cap < 4 * doc, "{cap}");
        assert!(4 * cap >= 8 * doc && 4 * cap < 16 * doc, "{cap}");
        // what --engines is told: llama-server caches of ~1.3 MiB per document, 3 documents
        let advice = engine_cache_advice(&w);
        assert!(
            advice.contains("CACHE_RAM_MIB=5 scripts/llama-server/fleet.sh")
                && advice.contains("3 documents of 800 tokens")
                && !advice.contains('\n'),
            "{advice}"
        );
    }

    #[test]
    fn the_engines_model_is_data_0_id_of_their_model_list() {
        let url = "http://h:1/v1/models";
        let list = r#"{"object":"list","data":[{"id":"tiny.gguf","object":"model"},{"id":"b"}]}"#;
        assert_eq!(model_id(url, list).unwrap(), "tiny.gguf");
        for bad in [
            "{}",
            r#"{"data":[]}"#,
            r#"{"data":[{"id":""}]}"#,
            "not json",
        ] {
            let e = format!("{:#}", model_id(url, bad).unwrap_err());
            assert!(e.contains(url) && e.contains("--model"), "{bad}: {e}");
        }
    }

    #[tokio::test]
    async fn the_engines_model_is_read_from_the_first_engine() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", l.local_addr().unwrap());
        let config = engine_sim::Config::try_parse_from(["engine-sim"]).unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(engine_sim::serve(l, config, async move {
            let _ = stopped.await;
        }));
        let http = metrics::http_client();
        assert_eq!(engines_model(&http, &url).await.unwrap(), fleet::SIM_MODEL);
        let _ = stop.send(());
        server.await.unwrap().unwrap();
        // nothing listens there any more: the error names the URL
        let e = format!("{:#}", engines_model(&http, &url).await.unwrap_err());
        assert!(e.contains(&format!("{url}/v1/models")), "{e}");
    }

    #[test]
    fn token_scale_shrinks_the_workload_and_its_key() {
        let args = parse(&["--workload", "long-context", "--token-scale", "0.1"]).unwrap();
        let w = args.workload(0);
        let full = Workload::new(WorkloadKind::LongContext, 1);
        assert_eq!(w.document_tokens, full.document_tokens / 10);
        assert_eq!(w.kv_capacity_tokens, full.kv_capacity_tokens / 10);
        assert_eq!(
            w.prefix_length,
            (full.prefix_length as f64 / 10.0).round() as u32
        );
        assert_eq!(w.system_prompt_tokens, 0, "unused sizes stay unused");
        assert_eq!(w.documents, full.documents, "as many documents");
        let chat = parse(&["--workload", "system-prompt-long", "--token-scale", "0.1"]).unwrap();
        let c = chat.workload(2);
        let full = Workload::new(WorkloadKind::SystemPromptLong, 1);
        assert_eq!(
            c.system_prompt_tokens,
            (full.system_prompt_tokens as f64 / 10.0).round() as usize
        );
        assert_eq!(c.user_tokens_median, full.user_tokens_median * 0.1);
        assert_eq!(c.text_salt, 2);
        // Against running engines: each strategy its own texts, unless --text-salt names them.
        let own = parse(&[
            "--engines",
            "http://a:1",
            "--strategies",
            "RANDOM,PREFIX_AWARE",
        ])
        .unwrap();
        assert_eq!((own.salt(0), own.salt(1)), (1, 2));
        let peer = parse(&["--engines", "http://a:1", "--router-url", "http://r:2"]).unwrap();
        assert_eq!(peer.salt(0), 100);
        let fixed = parse(&[
            "--engines",
            "http://a:1",
            "--router-url",
            "http://r:2",
            "--text-salt",
            "7",
        ])
        .unwrap();
        assert_eq!(fixed.salt(0), 7);
        assert_eq!(fixed.workload(fixed.salt(0)).text_salt, 7);
        assert!(
            parse(&["--text-salt", "7"]).is_err(),
            "--text-salt needs --engines"
        );
        assert!(
            c.system_prompt(0).chars().count() > c.prefix_length as usize,
            "still longer than the key"
        );
        assert_ne!(
            c.system_prompt(0),
            chat.workload(3).system_prompt(0),
            "salted apart"
        );
    }
}
