//! `prefixctl bench --workload mixed-priority`: what flow control does when the fleet is full.
//!
//! Engine-sims with [`SLOTS`] running slots each (`--max-num-seqs`) behind PREFIX_AWARE routers
//! whose `concurrency_threshold` is the same, so a router's in-flight limit is what an engine
//! runs at once. With `--engines` (real servers that already run) the variant's
//! `concurrency_threshold` is `--concurrency-threshold`, which should be each engine's running
//! slots (llama-server's `--parallel`), and durations are wall-clock (no `--time-scale`). Requests are open-loop (sent at a fixed rate whatever the answers), streaming,
//! each with a unique prompt (no cache luck):
//! - `batch`: tenant `batch`, `sheddable`, long prompts and long answers (summaries);
//! - `chat`: tenant `chat`, `critical`, short prompts and short answers;
//! - `a` and `b`: two `standard` tenants of the batch shape.
//!
//! Phases, each on a fresh fleet (fresh routers over the same `--engines`; every phase's prompts
//! differ from the others', so a real engine's cache gives no phase a head start): `capacity` (closed loop, one batch client per slot: the
//! fleet's batch requests per second), `idle` (chat alone at 20% of that), then with flow control
//! on and off: `flood` (batch at 3x capacity while chat sends at 20%) and `fair` (a at 3.2x and
//! b at 0.8x capacity: 4:1 demand). Reported per phase and tenant: requests, served, refusals by
//! status and code, TTFT p50/p99 of the served; per `fair` phase Jain's index of a's and b's
//! served rates.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use proto::RoutingStrategy;

use super::fleet::{Fleet, FleetSpec};
use super::load::SseText;
use super::metrics::{http_client, HttpClient};
use super::report::{percentile, BenchReport};
use super::BenchArgs;
use data_plane::flow::Switch;

/// Running slots per engine, and the variant's concurrency_threshold.
pub const SLOTS: u32 = 4;

/// One kind of request a phase sends.
#[derive(Debug, Clone, Copy)]
struct Stream {
    tenant: &'static str,
    priority: &'static str,
    /// Requests per second (wall clock); 0 with `clients`: closed loop.
    rate: f64,
    clients: usize,
    prompt_tokens: usize,
    max_tokens: u32,
}

const BATCH_PROMPT: usize = 2_000;
const BATCH_ANSWER: u32 = 64;
const CHAT_PROMPT: usize = 100;
const CHAT_ANSWER: u32 = 8;

fn batch(tenant: &'static str, priority: &'static str, rate: f64) -> Stream {
    Stream {
        tenant,
        priority,
        rate,
        clients: 0,
        prompt_tokens: BATCH_PROMPT,
        max_tokens: BATCH_ANSWER,
    }
}

fn chat(rate: f64) -> Stream {
    Stream {
        tenant: "chat",
        priority: "critical",
        rate,
        clients: 0,
        prompt_tokens: CHAT_PROMPT,
        max_tokens: CHAT_ANSWER,
    }
}

/// One request's outcome.
#[derive(Debug, Clone)]
struct Outcome {
    tenant: &'static str,
    /// `200`, or the refusal's status and code (`429 queue_timeout`), or the failure.
    result: String,
    ttft: Option<Duration>,
    done: Instant,
}

/// A phase's figures for one tenant.
#[derive(Debug, Clone, serde::Serialize)]
pub struct TenantResult {
    pub phase: String,
    pub flow_control: String,
    pub tenant: String,
    pub priority: String,
    pub offered_rps: f64,
    pub requests: usize,
    pub served: usize,
    /// Served requests that ended within the phase's time, per second of it.
    pub served_rps: f64,
    /// Refusals and failures by `status code`.
    pub refused: BTreeMap<String, usize>,
    pub ttft_p50_ms: f64,
    pub ttft_p99_ms: f64,
}

/// Jain's fairness index of `xs`: 1 when all are equal, 1/n when one gets everything.
pub fn jain(xs: &[f64]) -> f64 {
    let sum: f64 = xs.iter().sum();
    let squares: f64 = xs.iter().map(|x| x * x).sum();
    if squares == 0.0 {
        return 1.0;
    }
    sum * sum / (xs.len() as f64 * squares)
}

/// A prompt of about `tokens` tokens (4 bytes each), unique to `(tenant, n)`.
fn prompt(tenant: &str, n: u64, tokens: usize) -> String {
    let mut s = format!("{tenant} request {n}: ");
    let words = ["alpha ", "beta ", "gamma ", "delta ", "omega "];
    let mut i = n as usize;
    while s.len() < tokens * 4 {
        s.push_str(words[i % words.len()]);
        i = i.wrapping_mul(31).wrapping_add(7);
    }
    s
}

async fn send(http: &HttpClient, url: &http::Uri, s: Stream, n: u64) -> Outcome {
    let body = serde_json::json!({
        "model": super::fleet::ENDPOINT,
        "messages": [{"role": "user", "content": prompt(s.tenant, n, s.prompt_tokens)}],
        "max_tokens": s.max_tokens,
        "stream": true,
    });
    let started = Instant::now();
    let outcome = |result: String, ttft| Outcome {
        tenant: s.tenant,
        result,
        ttft,
        done: Instant::now(),
    };
    let req = match http::Request::post(url.clone())
        .header(http::header::CONTENT_TYPE, "application/json")
        .header("x-prefix-router-tenant", s.tenant)
        .header("x-prefix-router-priority", s.priority)
        .body(Full::new(Bytes::from(body.to_string())))
    {
        Ok(r) => r,
        Err(e) => return outcome(format!("request: {e}"), None),
    };
    let resp = match http.request(req).await {
        Ok(r) => r,
        Err(e) => return outcome(format!("connect: {e}"), None),
    };
    let status = resp.status().as_u16();
    let mut body = resp.into_body();
    if status != 200 {
        let bytes = body
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        let code = serde_json::from_slice::<serde_json::Value>(&bytes)
            .ok()
            .and_then(|v| v["error"]["code"].as_str().map(str::to_string))
            .unwrap_or_default();
        return outcome(format!("{status} {code}").trim().to_string(), None);
    }
    let mut ttft = None;
    let mut sse = SseText::default();
    while let Some(frame) = body.frame().await {
        match frame {
            Ok(f) => {
                if let Some(data) = f.data_ref() {
                    sse.feed(data);
                    if ttft.is_none() && !sse.text.is_empty() {
                        ttft = Some(started.elapsed());
                    }
                }
            }
            Err(e) => return outcome(format!("stream: {e}"), None),
        }
    }
    outcome("200".into(), ttft)
}

/// Sends `s` until `until`: open loop at its rate, or closed loop with its clients; request
/// numbers (hence prompts) start at `first`.
async fn drive(
    http: HttpClient,
    url: http::Uri,
    s: Stream,
    until: Instant,
    first: u64,
) -> Vec<Outcome> {
    let mut tasks = tokio::task::JoinSet::new();
    if s.clients > 0 {
        for c in 0..s.clients {
            let (http, url) = (http.clone(), url.clone());
            tasks.spawn(async move {
                let mut out = Vec::new();
                let mut n = first + ((c as u64) << 32);
                while Instant::now() < until {
                    out.push(send(&http, &url, s, n).await);
                    n += 1;
                }
                out
            });
        }
    } else {
        let interval = Duration::from_secs_f64(1.0 / s.rate);
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
        let mut n = first;
        while Instant::now() < until {
            tick.tick().await;
            let (http, url) = (http.clone(), url.clone());
            tasks.spawn(async move { vec![send(&http, &url, s, n).await] });
            n += 1;
        }
    }
    let mut out = Vec::new();
    while let Some(r) = tasks.join_next().await {
        out.extend(r.unwrap_or_default());
    }
    out
}

/// Running slots per engine: [`SLOTS`] on engine-sims, `--concurrency-threshold` on `--engines`.
fn slots(args: &BenchArgs) -> u32 {
    if args.engines.is_empty() {
        SLOTS
    } else {
        args.concurrency_threshold
    }
}

/// Phase `index` (its prompts' numbers start at `index << 40`).
async fn phase(
    args: &BenchArgs,
    (index, name): (u64, &str),
    flow: Switch,
    streams: &[Stream],
    seconds: f64,
) -> anyhow::Result<Vec<TenantResult>> {
    let fleet = Fleet::start(FleetSpec {
        instances: args.instances as usize,
        routers: 1,
        strategy: RoutingStrategy::PrefixAware,
        prefix_length: 256,
        concurrency_threshold: slots(args),
        kv_capacity_tokens: 200_000,
        time_scale: args.time_scale,
        seed: args.seed,
        engines: args.engines.clone(),
        model_name: args.model.clone(),
        max_num_seqs: args.engines.is_empty().then_some(SLOTS),
        flow_control: Some(flow),
        tokenizer: None,
    })
    .await
    .with_context(|| format!("starting the fleet of phase {name}"))?;
    let url: http::Uri = format!("{}/v1/chat/completions", fleet.router_urls()[0]).parse()?;
    let http = http_client();
    let started = Instant::now();
    let until = started + Duration::from_secs_f64(seconds);
    let mut runs = tokio::task::JoinSet::new();
    for &s in streams {
        runs.spawn(drive(http.clone(), url.clone(), s, until, index << 40));
    }
    let mut outcomes = Vec::new();
    while let Some(r) = runs.join_next().await {
        outcomes.extend(r?);
    }
    fleet.stop().await;
    let mut results = Vec::new();
    for s in streams {
        let mine: Vec<&Outcome> = outcomes.iter().filter(|o| o.tenant == s.tenant).collect();
        let mut ttfts: Vec<f64> = mine
            .iter()
            .filter_map(|o| o.ttft)
            .map(|d| d.as_secs_f64() * 1e3)
            .collect();
        ttfts.sort_by(f64::total_cmp);
        let served = mine.iter().filter(|o| o.result == "200").count();
        // the rate the fleet served at while the phase sent (not what drained after)
        let served_in_time = mine
            .iter()
            .filter(|o| o.result == "200" && o.done <= until)
            .count();
        let mut refused = BTreeMap::new();
        for o in mine.iter().filter(|o| o.result != "200") {
            *refused.entry(o.result.clone()).or_insert(0) += 1;
        }
        results.push(TenantResult {
            phase: name.to_string(),
            flow_control: match flow {
                Switch::On => "on".into(),
                Switch::Off => "off".into(),
            },
            tenant: s.tenant.to_string(),
            priority: s.priority.to_string(),
            offered_rps: if s.clients > 0 { 0.0 } else { s.rate },
            requests: mine.len(),
            served,
            served_rps: served_in_time as f64 / seconds,
            refused,
            ttft_p50_ms: percentile(&ttfts, 0.5),
            ttft_p99_ms: percentile(&ttfts, 0.99),
        });
    }
    Ok(results)
}

/// Runs the phases, prints the table, writes `--out`.
pub async fn run(args: &BenchArgs) -> anyhow::Result<BenchReport> {
    let (engines, seconds) = if args.engines.is_empty() {
        (args.instances as usize, args.duration * args.time_scale)
    } else {
        (args.engines.len(), args.duration)
    };
    let slots = engines * slots(args) as usize;
    // standard: a sheddable request may fill only three quarters of an instance
    let mut closed = batch("batch", "standard", 0.0);
    closed.clients = slots;
    let cap = phase(args, (0, "capacity"), Switch::On, &[closed], seconds / 2.0).await?;
    let capacity = cap[0].served_rps;
    anyhow::ensure!(
        capacity > 0.0,
        "the capacity phase served nothing: {:?}",
        cap[0].refused
    );
    eprintln!("capacity: {capacity:.1} batch requests/s over {slots} slots");
    let mut results = cap;
    results.extend(
        phase(
            args,
            (1, "idle"),
            Switch::On,
            &[chat(0.2 * capacity)],
            seconds,
        )
        .await?,
    );
    for (i, flow) in [(2, Switch::On), (4, Switch::Off)] {
        let flood = [
            batch("batch", "sheddable", 3.0 * capacity),
            chat(0.2 * capacity),
        ];
        results.extend(phase(args, (i, "flood"), flow, &flood, seconds).await?);
        let fair = [
            batch("a", "standard", 3.2 * capacity),
            batch("b", "standard", 0.8 * capacity),
        ];
        results.extend(phase(args, (i + 1, "fair"), flow, &fair, seconds).await?);
    }
    print_table(&results);
    let fairness: Vec<serde_json::Value> = ["on", "off"]
        .iter()
        .map(|f| {
            let rates: Vec<f64> = results
                .iter()
                .filter(|r| r.phase == "fair" && r.flow_control == *f)
                .map(|r| r.served_rps)
                .collect();
            serde_json::json!({"flow_control": f, "jain_index": jain(&rates)})
        })
        .collect();
    for f in &fairness {
        println!(
            "fair, flow control {}: Jain's index of a's and b's served rates {:.3}",
            f["flow_control"].as_str().unwrap_or(""),
            f["jain_index"].as_f64().unwrap_or(0.0)
        );
    }
    let ttft = |phase: &str, flow: &str, p99: bool| {
        results
            .iter()
            .find(|r| r.phase == phase && r.flow_control == flow && r.tenant == "chat")
            .map_or(0.0, |r| if p99 { r.ttft_p99_ms } else { r.ttft_p50_ms })
    };
    let idle = ttft("idle", "on", true);
    for flow in ["on", "off"] {
        println!(
            "chat TTFT p99 under the flood, flow control {flow}: {:.0} ms, {:.2}x its idle {idle:.0} ms",
            ttft("flood", flow, true),
            ttft("flood", flow, true) / idle.max(1e-9)
        );
    }
    let config = serde_json::json!({
        "instances": engines,
        "engines": args.engines,
        "slots_per_instance": slots / engines,
        "time_scale": args.time_scale,
        "duration_s": args.duration,
        "seed": args.seed,
        "capacity_rps": capacity,
        "batch": {"prompt_tokens": BATCH_PROMPT, "max_tokens": BATCH_ANSWER},
        "chat": {"prompt_tokens": CHAT_PROMPT, "max_tokens": CHAT_ANSWER},
    });
    let json = serde_json::json!({
        "workload": "mixed-priority",
        "config": config,
        "tenants": results,
        "fairness": fairness,
    });
    if let Some(path) = &args.out {
        std::fs::write(path, serde_json::to_vec_pretty(&json)?)
            .with_context(|| format!("writing {}", path.display()))?;
        eprintln!("wrote {}", path.display());
    }
    Ok(BenchReport {
        workload: "mixed-priority".into(),
        config,
        results: Vec::new(),
    })
}

fn print_table(results: &[TenantResult]) {
    println!(
        "{:<9} {:<5} {:<6} {:<10} {:>8} {:>8} {:>7} {:>9} {:>9} {:>9}  refused",
        "phase",
        "flow",
        "tenant",
        "priority",
        "offered",
        "served",
        "req/s",
        "requests",
        "TTFT p50",
        "TTFT p99"
    );
    for r in results {
        let refused: Vec<String> = r.refused.iter().map(|(k, v)| format!("{k}: {v}")).collect();
        println!(
            "{:<9} {:<5} {:<6} {:<10} {:>8.1} {:>8} {:>7.1} {:>9} {:>9.0} {:>9.0}  {}",
            r.phase,
            r.flow_control,
            r.tenant,
            r.priority,
            r.offered_rps,
            r.served,
            r.served_rps,
            r.requests,
            r.ttft_p50_ms,
            r.ttft_p99_ms,
            refused.join(", ")
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jains_index_is_one_for_equal_shares_and_falls_with_skew() {
        assert!((jain(&[5.0, 5.0]) - 1.0).abs() < 1e-12);
        assert!((jain(&[8.0, 2.0]) - 0.735).abs() < 1e-3);
        assert!((jain(&[1.0, 0.0]) - 0.5).abs() < 1e-12);
    }

    #[test]
    fn prompts_are_unique_and_about_their_size() {
        let a = prompt("a", 1, 100);
        assert!(a.len() >= 400 && a.len() < 420, "{}", a.len());
        assert_ne!(a, prompt("a", 2, 100));
        assert_ne!(a, prompt("b", 1, 100));
    }
}
