//! A whole fleet in this process: control plane (sled in a temp dir), data-plane replicas and
//! simulated engines, each on its own loopback port, so that the benchmark drives the real
//! servers over real HTTP and gRPC. With `FleetSpec::engines` the engines are not started here:
//! the variant points at engines that already run (`prefixctl bench --engines`).

use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use proto::control_plane_client::ControlPlaneClient;
use proto::{
    CreateEndpointConfigRequest, CreateEndpointRequest, DescribeEndpointRequest, KvEventsConfig,
    PrefixAwareRoutingConfig, ProductionVariant, RoutingConfig, RoutingStrategy,
    UpdateEndpointConfigRequest,
};
use tokio::sync::oneshot;
use tonic::transport::Channel;

use super::metrics::{self, CacheCounters, EngineMetrics, Histogram};
use super::precise::{self, RouterIndex, SimTokenizer};

/// The bench's endpoint, and its routers' default endpoint: they route every request to it,
/// whatever model it names.
pub const ENDPOINT: &str = "bench";
pub const VARIANT: &str = "v1";

/// What to start.
#[derive(Debug, Clone)]
pub struct FleetSpec {
    pub instances: usize,
    pub routers: usize,
    pub strategy: RoutingStrategy,
    pub prefix_length: u32,
    pub concurrency_threshold: u32,
    pub kv_capacity_tokens: u64,
    pub time_scale: f64,
    pub seed: u64,
    /// Engines that already run (base URLs); when not empty, no engine-sim is started and
    /// `instances` is ignored.
    pub engines: Vec<String>,
    /// The variant's model name (`GET /v1/models` of the routers lists it); `None`:
    /// [`SIM_MODEL`]. Requests are routed by endpoint, never by this name.
    pub model_name: Option<String>,
    /// engine-sims' `--max-num-seqs` (`None`: engine-sim's default).
    pub max_num_seqs: Option<u32>,
    /// Routers' `--flow-control` (`None`: the router's default, on).
    pub flow_control: Option<data_plane::flow::Switch>,
    /// engine-sims' `--tokenizer` and, for PREFIX_AWARE precise, their KV events named in the
    /// variant (`None`: a token is 4 bytes, no events).
    pub tokenizer: Option<SimTokenizer>,
}

/// The model engine-sim serves by default, the variant's model name when none is given.
pub const SIM_MODEL: &str = "llama-3.1-70b";

/// A server task and the way to stop it; an engine that runs outside this process has neither.
struct Server {
    url: String,
    stop: Option<oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<anyhow::Result<()>>>,
}

impl Server {
    fn external(url: String) -> Self {
        Server {
            url,
            stop: None,
            task: None,
        }
    }

    async fn stop(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(mut task) = self.task.take() {
            let _ = tokio::time::timeout(Duration::from_secs(10), &mut task).await;
            task.abort();
        }
    }
}

/// One scrape of one engine's `/metrics`.
#[derive(Debug, Clone)]
pub struct EngineReading {
    pub url: String,
    /// The engine's own prefix-cache counters; `None` when its `/metrics` has none this knows
    /// or it serves no `/metrics` (llama-server without `--metrics`).
    pub counters: Option<(EngineMetrics, CacheCounters)>,
}

impl From<&EngineReading> for EngineCounters {
    fn from(r: &EngineReading) -> Self {
        let c = r.counters.map(|c| c.1).unwrap_or_default();
        EngineCounters {
            queries: c.prompt_tokens,
            hits: c.cached_tokens,
            requests: c.requests.unwrap_or(0.0),
        }
    }
}

/// Counters read from one engine's `/metrics`.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EngineCounters {
    pub queries: f64,
    pub hits: f64,
    pub requests: f64,
}

impl std::ops::Sub for EngineCounters {
    type Output = EngineCounters;
    fn sub(self, o: Self) -> Self {
        EngineCounters {
            queries: self.queries - o.queries,
            hits: self.hits - o.hits,
            requests: self.requests - o.requests,
        }
    }
}

pub struct Fleet {
    pub spec: FleetSpec,
    control_plane: Server,
    routers: Vec<Server>,
    engines: Vec<Server>,
    /// Engines in the variant, in order (an index into `engines`).
    active: Vec<usize>,
    client: ControlPlaneClient<Channel>,
    http: metrics::HttpClient,
    _dir: tempfile::TempDir,
}

async fn bind() -> anyhow::Result<(tokio::net::TcpListener, String)> {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .context("binding a loopback port")?;
    let url = format!("http://{}", l.local_addr()?);
    Ok((l, url))
}

fn spawn_server<F>(url: String, f: impl FnOnce(oneshot::Receiver<()>) -> F) -> Server
where
    F: std::future::Future<Output = anyhow::Result<()>> + Send + 'static,
{
    let (tx, rx) = oneshot::channel();
    Server {
        url,
        stop: Some(tx),
        task: Some(tokio::spawn(f(rx))),
    }
}

impl Fleet {
    pub async fn start(spec: FleetSpec) -> anyhow::Result<Self> {
        let dir = tempfile::tempdir().context("creating a temp dir for the control plane")?;
        let store = control_plane::open_store(&dir.path().join("control-plane"))?;
        let (l, cp_url) = bind().await?;
        let control_plane = spawn_server(cp_url.clone(), move |rx| {
            control_plane::serve_store(l, store, Duration::from_secs(1), async move {
                let _ = rx.await;
            })
        });
        let client = connect(&cp_url).await?;
        let mut fleet = Fleet {
            spec: spec.clone(),
            control_plane,
            routers: Vec::new(),
            engines: Vec::new(),
            active: Vec::new(),
            client,
            http: metrics::http_client(),
            _dir: dir,
        };
        if spec.engines.is_empty() {
            for _ in 0..spec.instances {
                let i = fleet.start_engine().await?;
                fleet.active.push(i);
            }
        } else {
            for url in &spec.engines {
                fleet.active.push(fleet.engines.len());
                fleet.engines.push(Server::external(url.clone()));
            }
        }
        fleet
            .client
            .create_endpoint_config(CreateEndpointConfigRequest {
                endpoint_config_name: ENDPOINT.into(),
                production_variants: fleet.variants(spec.strategy),
            })
            .await
            .context("creating the bench endpoint config")?;
        fleet
            .client
            .create_endpoint(CreateEndpointRequest {
                endpoint_name: ENDPOINT.into(),
                endpoint_config_name: ENDPOINT.into(),
            })
            .await
            .context("creating the bench endpoint")?;
        for r in 0..spec.routers {
            let (l, url) = bind().await?;
            // The bench endpoint is the default: a request whose model names no endpoint (the
            // engines' own model id, `--model`) is routed there.
            let mut config = data_plane::Config {
                control_plane: cp_url.clone(),
                node_id: Some(format!("bench-router-{r}")),
                default_endpoint: Some(ENDPOINT.into()),
                ..data_plane::Config::default()
            };
            if let Some(f) = spec.flow_control {
                config.flow_control = f;
            }
            fleet.routers.push(spawn_server(url, move |rx| {
                data_plane::serve(l, config, async move {
                    let _ = rx.await;
                })
            }));
        }
        fleet.wait_rollout().await?;
        Ok(fleet)
    }

    async fn start_engine(&mut self) -> anyhow::Result<usize> {
        anyhow::ensure!(
            self.spec.engines.is_empty(),
            "cannot start an engine-sim in a fleet of --engines {}",
            self.spec.engines.join(",")
        );
        let events = self.spec.tokenizer.as_ref().is_some_and(|t| t.kv_events);
        // With KV events the engine's event ports follow its HTTP port: when they are taken (or
        // taken between the check and the engine's bind), another HTTP port.
        let mut attempts = 0;
        loop {
            attempts += 1;
            let (l, url) = bind().await?;
            let port = l.local_addr()?.port();
            if events && !precise::event_ports_free(port) {
                anyhow::ensure!(
                    attempts < 50,
                    "no loopback port P with P+{0} and P+{1} free for an engine's KV events \
                     in 50 tries",
                    precise::EVENTS_PORT_OFFSET,
                    precise::EVENTS_PORT_OFFSET + 1
                );
                continue;
            }
            let config = engine_sim::Config::try_parse_from(self.engine_flags(port))?;
            let engine = spawn_server(url, move |rx| {
                engine_sim::serve(l, config, async move {
                    let _ = rx.await;
                })
            });
            if events {
                match self.wait_engine(engine).await {
                    Ok(engine) => self.engines.push(engine),
                    Err(e) if attempts < 50 => {
                        tracing::debug!(error = %e, "engine-sim did not start; another port");
                        continue;
                    }
                    Err(e) => return Err(e),
                }
            } else {
                self.engines.push(engine);
            }
            return Ok(self.engines.len() - 1);
        }
    }

    /// engine-sim's flags for the next engine, listening on `port`.
    fn engine_flags(&self, port: u16) -> Vec<String> {
        let n = self.engines.len();
        let mut capacity = self.spec.kv_capacity_tokens;
        let mut flags = vec![
            "engine-sim".to_string(),
            "--listen".into(),
            "127.0.0.1:0".into(),
            "--time-scale".into(),
            self.spec.time_scale.to_string(),
            "--seed".into(),
            (self.spec.seed.wrapping_add(n as u64)).to_string(),
        ];
        if let Some(t) = &self.spec.tokenizer {
            // the same text in the cache and the same simulated prefill time as without it
            capacity = (capacity as f64 * t.ids_per_token).round() as u64;
            let prefill = engine_sim::Config::default().prefill_tokens_per_s * t.ids_per_token;
            flags.extend([
                "--tokenizer".to_string(),
                t.path.display().to_string(),
                "--prefill-tokens-per-s".into(),
                prefill.to_string(),
            ]);
            if t.kv_events {
                flags.extend(precise::engine_flags(port));
            }
        }
        flags.extend(["--kv-capacity-tokens".to_string(), capacity.to_string()]);
        if let Some(m) = self.spec.max_num_seqs {
            flags.extend(["--max-num-seqs".to_string(), m.to_string()]);
        }
        flags
    }

    /// `engine` once its `/health` answers; its error when it stopped first (e.g. its KV-event
    /// ports were taken when it bound them).
    async fn wait_engine(&self, mut engine: Server) -> anyhow::Result<Server> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        let health = format!("{}/health", engine.url);
        loop {
            if engine.task.as_ref().is_some_and(|t| t.is_finished()) {
                let task = engine.task.take().expect("checked above");
                return Err(match task.await {
                    Ok(Err(e)) => e,
                    Ok(Ok(())) => anyhow::anyhow!("engine-sim {} stopped at once", engine.url),
                    Err(e) => anyhow::anyhow!("engine-sim {} failed: {e}", engine.url),
                });
            }
            if metrics::get_text(&self.http, &health).await.is_ok() {
                return Ok(engine);
            }
            if tokio::time::Instant::now() >= deadline {
                let url = engine.url.clone();
                engine.stop().await;
                anyhow::bail!("engine-sim {url} did not answer /health within 10 s");
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    fn variants(&self, strategy: RoutingStrategy) -> Vec<ProductionVariant> {
        vec![ProductionVariant {
            variant_name: VARIANT.into(),
            model_name: self
                .spec
                .model_name
                .clone()
                .unwrap_or_else(|| SIM_MODEL.into()),
            initial_variant_weight: Some(1.0),
            routing_config: Some(RoutingConfig {
                routing_strategy: strategy as i32,
                prefix_aware_routing_config: Some(self.prefix_aware_config(strategy)),
                ..Default::default()
            }),
            instances: self
                .active
                .iter()
                .map(|&i| self.engines[i].url.clone())
                .collect(),
        }]
    }

    /// The variant's PREFIX_AWARE settings; for PREFIX_AWARE precise, the engines' KV events and
    /// their tokenizer.
    fn prefix_aware_config(&self, strategy: RoutingStrategy) -> PrefixAwareRoutingConfig {
        let mut c = PrefixAwareRoutingConfig {
            prefix_length: self.spec.prefix_length,
            concurrency_threshold: self.spec.concurrency_threshold,
            ..Default::default()
        };
        if let Some(t) = self
            .spec
            .tokenizer
            .as_ref()
            .filter(|t| t.kv_events && strategy == RoutingStrategy::PrefixAware)
        {
            c.kv_events = Some(KvEventsConfig {
                endpoint: precise::endpoint_template(),
                replay_endpoint: precise::replay_endpoint_template(),
                topic: precise::TOPIC.into(),
                block_size: engine_sim::Config::default().block_size,
            });
            c.tokenizer = t.path.display().to_string();
        }
        c
    }

    /// Writes the current variant (strategy, instances) and waits until every router applied it.
    async fn apply(&mut self, strategy: RoutingStrategy) -> anyhow::Result<()> {
        self.client
            .update_endpoint_config(UpdateEndpointConfigRequest {
                endpoint_config_name: ENDPOINT.into(),
                production_variants: self.variants(strategy),
                expected_revision: None,
            })
            .await
            .context("updating the bench endpoint config")?;
        self.spec.strategy = strategy;
        self.wait_rollout().await
    }

    /// Switches the routing strategy live (no restart of anything).
    pub async fn set_strategy(&mut self, strategy: RoutingStrategy) -> anyhow::Result<()> {
        self.apply(strategy).await
    }

    /// Starts one more engine and adds it to the variant through the control plane.
    pub async fn add_instance(&mut self) -> anyhow::Result<String> {
        let i = self.start_engine().await?;
        self.active.push(i);
        self.apply(self.spec.strategy).await?;
        Ok(self.engines[i].url.clone())
    }

    /// Removes the engine at position `pos` of the variant through the control plane (the
    /// engine keeps running, so in-flight requests finish).
    pub async fn remove_instance(&mut self, pos: usize) -> anyhow::Result<String> {
        let i = self.active.remove(pos);
        self.apply(self.spec.strategy).await?;
        Ok(self.engines[i].url.clone())
    }

    /// Waits until every router reports (through the control plane's rollout status) that it
    /// applied the endpoint's current routing-table version.
    async fn wait_rollout(&mut self) -> anyhow::Result<()> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            let d = self
                .client
                .describe_endpoint(DescribeEndpointRequest {
                    endpoint_name: ENDPOINT.into(),
                })
                .await?
                .into_inner();
            let ready = d
                .data_planes
                .iter()
                .filter(|n| n.connected && n.up_to_date)
                .count();
            if ready >= self.routers.len() {
                return Ok(());
            }
            anyhow::ensure!(
                tokio::time::Instant::now() < deadline,
                "routers did not apply the routing table within 30 s ({ready} of {} did)",
                self.routers.len()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub fn router_urls(&self) -> Vec<String> {
        self.routers.iter().map(|r| r.url.clone()).collect()
    }

    /// Engine URLs in the variant now.
    pub fn instance_urls(&self) -> Vec<String> {
        self.active
            .iter()
            .map(|&i| self.engines[i].url.clone())
            .collect()
    }

    /// Counters of every engine ever started, in start order (zero where an engine has none).
    pub async fn engine_counters(&self) -> anyhow::Result<Vec<EngineCounters>> {
        Ok(self
            .engine_readings()
            .await?
            .iter()
            .map(EngineCounters::from)
            .collect())
    }

    /// One scrape of every engine's `/metrics`, in start order. An engine that cannot be reached
    /// is an error; one that answers `/metrics` with an error status has no counters.
    pub async fn engine_readings(&self) -> anyhow::Result<Vec<EngineReading>> {
        let mut out = Vec::with_capacity(self.engines.len());
        for e in &self.engines {
            let counters = match metrics::get_text(&self.http, &format!("{}/metrics", e.url)).await
            {
                Ok(text) => metrics::cache_counters(&text),
                Err(err) if err.is::<metrics::HttpStatus>() => None,
                Err(err) => return Err(err),
            };
            out.push(EngineReading {
                url: e.url.clone(),
                counters,
            });
        }
        Ok(out)
    }

    /// The routers' routing-decision histograms, merged.
    pub async fn decision_histogram(&self) -> anyhow::Result<Histogram> {
        let mut h = Histogram::default();
        for r in &self.routers {
            let text = metrics::get_text(&self.http, &format!("{}/metrics", r.url)).await?;
            h.merge(&Histogram::parse(
                &text,
                "prefix_router_route_decision_seconds",
            ));
        }
        Ok(h)
    }

    /// What each router's exact index took in (KV events, blocks), in router order.
    pub async fn router_indexes(&self) -> anyhow::Result<Vec<RouterIndex>> {
        let mut out = Vec::with_capacity(self.routers.len());
        for r in &self.routers {
            let text = metrics::get_text(&self.http, &format!("{}/metrics", r.url)).await?;
            out.push(RouterIndex::from_metrics(&text));
        }
        Ok(out)
    }

    /// Each router's `/metrics`, to `dir/{label}-router{i}.prom`.
    pub async fn write_router_metrics(
        &self,
        dir: &std::path::Path,
        label: &str,
    ) -> anyhow::Result<()> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        for (i, r) in self.routers.iter().enumerate() {
            let text = metrics::get_text(&self.http, &format!("{}/metrics", r.url)).await?;
            let path = dir.join(format!("{label}-router{i}.prom"));
            std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
        }
        Ok(())
    }

    pub async fn stop(self) {
        for r in self.routers {
            r.stop().await;
        }
        for e in self.engines {
            e.stop().await;
        }
        self.control_plane.stop().await;
    }
}

async fn connect(url: &str) -> anyhow::Result<ControlPlaneClient<Channel>> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        match ControlPlaneClient::connect(url.to_string()).await {
            Ok(c) => return Ok(c),
            Err(e) if tokio::time::Instant::now() >= deadline => {
                return Err(anyhow::anyhow!(
                    "cannot reach the bench control plane at {url}: {e}"
                ))
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
}
