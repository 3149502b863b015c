//! `prefixctl top`: a live view of what the engines report about their prefix caches, read from
//! one or more data planes' `GET /metrics` and summed over them.
//!
//! Per endpoint and variant it shows, per instance, requests/s, requests in flight, prompt
//! tokens/s and the share of prompt tokens the engine served from its cache (over the last
//! interval and over the routers' lifetime); per placement rule (the `decision` label), prompt
//! tokens and cached share, so one sees which rule's placements hit; and, for PREFIX_AWARE, what
//! each router's prefix index holds of each instance against its learnt capacity (in blocks of
//! 256 prompt characters, the mean over the routers that report it), and whether that index is
//! exact (fed by the engine's KV events) or inferred from the responses.
//!
//! The metrics (names and labels as the data plane exports them, see `data-plane/src/metrics.rs`):
//! `prefix_router_requests_total`, `prefix_router_instance_in_flight`,
//! `prefix_router_prompt_tokens_total`, `prefix_router_cached_prompt_tokens_total`,
//! `prefix_router_prefix_index_blocks`, `prefix_router_prefix_index_capacity_blocks`,
//! `prefix_router_kv_index_blocks` (present where a router's index of an instance is exact).
//!
//! Each router's scrape is kept apart: interval rates come from each router's own deltas over
//! its own elapsed time (a router whose counters went down restarted: its delta counts from
//! zero), then are summed. Totals are the sum of the routers that answered this round; a router
//! that did not answer is named in one line and left out until it answers again.

use std::collections::BTreeMap;
use std::io::IsTerminal as _;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::args::{OutputFormat, TopArgs};
use crate::bench::metrics::{self, HttpClient};
use crate::output::{emit, emit_json_line, write_stdout, Report, Table};
use crate::InputError;

const REQUESTS: &str = "prefix_router_requests_total";
const IN_FLIGHT: &str = "prefix_router_instance_in_flight";
const PROMPT_TOKENS: &str = "prefix_router_prompt_tokens_total";
const CACHED_TOKENS: &str = "prefix_router_cached_prompt_tokens_total";
const INDEX_BLOCKS: &str = "prefix_router_prefix_index_blocks";
const INDEX_CAPACITY: &str = "prefix_router_prefix_index_capacity_blocks";
const KV_BLOCKS: &str = "prefix_router_kv_index_blocks";

/// Placement rules (the `decision` label of the token counters) in the data plane's order;
/// others follow, sorted by name.
const DECISION_ORDER: [&str; 5] = [
    "random",
    "least_outstanding",
    "prefix_match",
    "prefix_hash",
    "overload_bypass",
];

/// How long one scrape may take with `--once`.
const ONCE_TIMEOUT: Duration = Duration::from_secs(5);

/// What one series counts, and of what.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
enum Kind {
    /// Requests answered (any status) by `instance`.
    Requests { instance: String },
    /// Requests in flight to `instance` (a gauge).
    InFlight { instance: String },
    /// Prompt tokens `instance` reported for requests the `decision` rule placed.
    PromptTokens { instance: String, decision: String },
    /// Of those, the tokens served from its cache.
    CachedTokens { instance: String, decision: String },
    /// Blocks a router's prefix index lists on `instance` (a gauge).
    IndexBlocks { instance: String },
    /// The index's learnt capacity of `instance`, in blocks (a gauge).
    IndexCapacity { instance: String },
    /// Routers that report an index of `instance` (1 per router; summed, how many there are).
    IndexReported { instance: String },
    /// KV blocks the engine reported holding, on routers whose index of it is exact (a gauge).
    KvBlocks { instance: String },
    /// Routers whose index of `instance` is exact (fed by its KV events).
    KvReported { instance: String },
}

impl Kind {
    /// Whether the series only grows (so deltas and rates mean something).
    fn is_counter(&self) -> bool {
        matches!(
            self,
            Kind::Requests { .. } | Kind::PromptTokens { .. } | Kind::CachedTokens { .. }
        )
    }
}

/// One series: an endpoint's variant and what it counts.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
struct Series {
    endpoint: String,
    variant: String,
    kind: Kind,
}

/// The values `top` reads from one router's `/metrics`, or their sum over several routers, or
/// (after [`Counters::rates`]) their growth per second.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Counters {
    series: BTreeMap<Series, f64>,
}

impl Counters {
    /// Reads the series `top` shows out of a data plane's Prometheus text. Requests not routed
    /// to any endpoint (empty `endpoint` label) are left out; samples over several statuses or
    /// lines of one series are summed.
    pub fn from_text(text: &str) -> Self {
        let mut counters = Counters::default();
        for sample in metrics::parse(text) {
            let label = |name: &str| sample.label(name).unwrap_or("").to_string();
            let instance = || label("instance");
            let (kind, value) = match sample.name {
                REQUESTS => (
                    Kind::Requests {
                        instance: instance(),
                    },
                    sample.value,
                ),
                IN_FLIGHT => (
                    Kind::InFlight {
                        instance: instance(),
                    },
                    sample.value,
                ),
                PROMPT_TOKENS => (
                    Kind::PromptTokens {
                        instance: instance(),
                        decision: label("decision"),
                    },
                    sample.value,
                ),
                CACHED_TOKENS => (
                    Kind::CachedTokens {
                        instance: instance(),
                        decision: label("decision"),
                    },
                    sample.value,
                ),
                INDEX_BLOCKS => (
                    Kind::IndexBlocks {
                        instance: instance(),
                    },
                    sample.value,
                ),
                INDEX_CAPACITY => (
                    Kind::IndexCapacity {
                        instance: instance(),
                    },
                    sample.value,
                ),
                KV_BLOCKS => (
                    Kind::KvBlocks {
                        instance: instance(),
                    },
                    sample.value,
                ),
                _ => continue,
            };
            let endpoint = label("endpoint");
            if endpoint.is_empty() || !value.is_finite() {
                continue;
            }
            let reported = match &kind {
                Kind::IndexBlocks { instance } => Some(Kind::IndexReported {
                    instance: instance.clone(),
                }),
                Kind::KvBlocks { instance } => Some(Kind::KvReported {
                    instance: instance.clone(),
                }),
                _ => None,
            };
            if let Some(kind) = reported {
                counters.add_value(
                    Series {
                        endpoint: endpoint.clone(),
                        variant: label("variant"),
                        kind,
                    },
                    1.0,
                );
            }
            counters.add_value(
                Series {
                    endpoint,
                    variant: label("variant"),
                    kind,
                },
                value,
            );
        }
        counters
    }

    fn add_value(&mut self, series: Series, value: f64) {
        *self.series.entry(series).or_insert(0.0) += value;
    }

    /// Adds every series of `other` (another router's scrape).
    pub fn add(&mut self, other: &Counters) {
        for (series, value) in &other.series {
            self.add_value(series.clone(), *value);
        }
    }

    /// The counters' growth per second from `earlier` to `self`, `elapsed` apart; gauges are
    /// left out. A counter below its earlier value was reset (the router restarted): it grew by
    /// its whole value.
    pub fn rates(&self, earlier: &Counters, elapsed: Duration) -> Counters {
        let secs = elapsed.as_secs_f64();
        let mut rates = Counters::default();
        if secs <= 0.0 {
            return rates;
        }
        for (series, &now) in self.series.iter().filter(|(s, _)| s.kind.is_counter()) {
            let before = earlier.series.get(series).copied().unwrap_or(0.0);
            let grew = if now >= before { now - before } else { now };
            rates.series.insert(series.clone(), grew / secs);
        }
        rates
    }

    fn get(&self, series: &Series) -> f64 {
        self.series.get(series).copied().unwrap_or(0.0)
    }
}

/// One router and how its last scrape went.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "PascalCase")]
pub struct RouterStatus {
    /// The URL as given.
    pub url: String,
    /// Whether its `/metrics` answered this round.
    pub answered: bool,
    /// Why not, when it did not.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl RouterStatus {
    /// The one line naming a router that did not answer.
    fn unreachable_line(&self) -> Option<String> {
        self.error
            .as_ref()
            .map(|e| format!("router {} did not answer: {e}", self.url))
    }
}

/// Tokens the engines reported, and the share they served from their caches.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
#[serde(rename_all = "PascalCase")]
pub struct Tokens {
    pub prompt_tokens: u64,
    pub cached_prompt_tokens: u64,
    /// cached / prompt; `null` without prompt tokens.
    pub cached_share: Option<f64>,
}

impl Tokens {
    fn new(prompt: f64, cached: f64) -> Self {
        Tokens {
            prompt_tokens: count(prompt),
            cached_prompt_tokens: count(cached),
            cached_share: share(cached, prompt),
        }
    }
}

/// One instance over the last interval.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(rename_all = "PascalCase")]
pub struct InstanceRates {
    pub requests_per_second: f64,
    pub prompt_tokens_per_second: f64,
    /// Cached prompt tokens / prompt tokens over the interval; `null` without prompt tokens.
    pub cached_share: Option<f64>,
}

/// One instance of a variant: the routers' cumulative counters, summed.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "PascalCase")]
pub struct InstanceView {
    pub instance: String,
    pub requests: u64,
    pub in_flight: u64,
    #[serde(flatten)]
    pub tokens: Tokens,
    /// The last interval (absent with `--once` and on the first refresh).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub interval: Option<InstanceRates>,
    /// What the routers' PREFIX_AWARE prefix indexes hold of it (absent for other strategies).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub index: Option<IndexView>,
}

/// One instance in the routers' prefix indexes: the mean over the routers that report it (each
/// router keeps its own index of what it sent).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(rename_all = "PascalCase")]
pub struct IndexView {
    /// Blocks (of 256 prompt characters) the index lists on the instance.
    pub blocks: f64,
    /// The capacity the index learnt from the engine's reports, in blocks.
    pub capacity_blocks: f64,
    /// Routers reporting an index of the instance.
    pub routers: u64,
    /// Of them, the routers whose index of it is exact (fed by the engine's KV events).
    pub exact_routers: u64,
    /// KV blocks the engine reported holding (the mean over the exact routers), when any is.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_blocks: Option<f64>,
}

impl IndexView {
    /// `exact`, `inferred`, or `exact on K of N routers`.
    fn source(&self) -> String {
        match self.exact_routers {
            0 => "inferred".into(),
            k if k >= self.routers => "exact".into(),
            k => format!("exact on {k} of {}", self.routers),
        }
    }
}

/// One placement rule over the last interval.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(rename_all = "PascalCase")]
pub struct DecisionRates {
    pub prompt_tokens_per_second: f64,
    pub cached_share: Option<f64>,
}

/// One placement rule (the `decision` label), over all instances of the variant.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "PascalCase")]
pub struct DecisionView {
    pub decision: String,
    #[serde(flatten)]
    pub tokens: Tokens,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub interval: Option<DecisionRates>,
}

/// One endpoint's variant.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "PascalCase")]
pub struct VariantView {
    pub endpoint: String,
    pub variant: String,
    pub instances: Vec<InstanceView>,
    pub decisions: Vec<DecisionView>,
}

/// One refresh of `top` (with `--output json`, its document).
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "PascalCase")]
pub struct TopReport {
    pub routers: Vec<RouterStatus>,
    /// Seconds the interval rates cover (absent without rates).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub interval_seconds: Option<f64>,
    pub variants: Vec<VariantView>,
    /// Rendered with the live columns (rates shown as `-` until they are known).
    #[serde(skip)]
    pub live: bool,
}

impl TopReport {
    /// The view of `total` (the answering routers' counters, summed) and, when known, `rates`
    /// (their growth per second over the last interval, summed).
    pub fn build(
        routers: Vec<RouterStatus>,
        total: &Counters,
        rates: Option<(&Counters, Duration)>,
    ) -> Self {
        // (endpoint, variant) -> instance names, decision names.
        type Names = (Vec<String>, Vec<String>);
        let mut variants: BTreeMap<(&str, &str), Names> = BTreeMap::new();
        for series in total.series.keys() {
            let names = variants
                .entry((&series.endpoint, &series.variant))
                .or_default();
            let (list, name) = match &series.kind {
                Kind::Requests { instance }
                | Kind::InFlight { instance }
                | Kind::IndexBlocks { instance }
                | Kind::IndexCapacity { instance }
                | Kind::IndexReported { instance }
                | Kind::KvBlocks { instance }
                | Kind::KvReported { instance } => (&mut names.0, instance),
                Kind::PromptTokens { instance, decision }
                | Kind::CachedTokens { instance, decision } => {
                    if !names.0.contains(instance) {
                        names.0.push(instance.clone());
                    }
                    (&mut names.1, decision)
                }
            };
            if !list.contains(name) {
                list.push(name.clone());
            }
        }
        let views = variants
            .into_iter()
            .map(|((endpoint, variant), (mut instances, mut decisions))| {
                instances.sort();
                sort_by_order(&mut decisions, &DECISION_ORDER);
                let at = |kind: Kind| Series {
                    endpoint: endpoint.to_string(),
                    variant: variant.to_string(),
                    kind,
                };
                let sum_of = |counters: &Counters, pick: &dyn Fn(&Kind) -> bool| -> f64 {
                    counters
                        .series
                        .iter()
                        .filter(|(s, _)| {
                            s.endpoint == endpoint && s.variant == variant && pick(&s.kind)
                        })
                        .map(|(_, v)| v)
                        .sum()
                };
                let instances = instances
                    .into_iter()
                    .map(|instance| {
                        let prompt = |c: &Counters| {
                            sum_of(c, &|k| matches!(k, Kind::PromptTokens { instance: i, .. } if *i == instance))
                        };
                        let cached = |c: &Counters| {
                            sum_of(c, &|k| matches!(k, Kind::CachedTokens { instance: i, .. } if *i == instance))
                        };
                        let requests = at(Kind::Requests {
                            instance: instance.clone(),
                        });
                        let routers = count(total.get(&at(Kind::IndexReported {
                            instance: instance.clone(),
                        })));
                        let mean = |kind: Kind| total.get(&at(kind)) / routers as f64;
                        let exact_routers = count(total.get(&at(Kind::KvReported {
                            instance: instance.clone(),
                        })));
                        let kv_blocks = (exact_routers > 0).then(|| {
                            total.get(&at(Kind::KvBlocks {
                                instance: instance.clone(),
                            })) / exact_routers as f64
                        });
                        let index = (routers > 0).then(|| IndexView {
                            exact_routers,
                            kv_blocks,
                            blocks: mean(Kind::IndexBlocks {
                                instance: instance.clone(),
                            }),
                            capacity_blocks: mean(Kind::IndexCapacity {
                                instance: instance.clone(),
                            }),
                            routers,
                        });
                        InstanceView {
                            requests: count(total.get(&requests)),
                            in_flight: count(total.get(&at(Kind::InFlight {
                                instance: instance.clone(),
                            }))),
                            tokens: Tokens::new(prompt(total), cached(total)),
                            interval: rates.map(|(r, _)| InstanceRates {
                                requests_per_second: r.get(&requests),
                                prompt_tokens_per_second: prompt(r),
                                cached_share: share(cached(r), prompt(r)),
                            }),
                            index,
                            instance,
                        }
                    })
                    .collect();
                let decisions = decisions
                    .into_iter()
                    .map(|decision| {
                        let prompt = |c: &Counters| {
                            sum_of(c, &|k| matches!(k, Kind::PromptTokens { decision: d, .. } if *d == decision))
                        };
                        let cached = |c: &Counters| {
                            sum_of(c, &|k| matches!(k, Kind::CachedTokens { decision: d, .. } if *d == decision))
                        };
                        DecisionView {
                            tokens: Tokens::new(prompt(total), cached(total)),
                            interval: rates.map(|(r, _)| DecisionRates {
                                prompt_tokens_per_second: prompt(r),
                                cached_share: share(cached(r), prompt(r)),
                            }),
                            decision,
                        }
                    })
                    .collect();
                VariantView {
                    endpoint: endpoint.to_string(),
                    variant: variant.to_string(),
                    instances,
                    decisions,
                }
            })
            .collect();
        TopReport {
            routers,
            interval_seconds: rates.map(|(_, d)| d.as_secs_f64()),
            variants: views,
            live: rates.is_some(),
        }
    }
}

impl Report for TopReport {
    fn table(&self) -> String {
        let mut out = String::new();
        let answered = self.routers.iter().filter(|r| r.answered).count();
        out.push_str(&format!(
            "{answered} of {} router{} answered",
            self.routers.len(),
            if self.routers.len() == 1 { "" } else { "s" }
        ));
        match self.interval_seconds {
            Some(secs) => out.push_str(&format!(
                "; rates over the last {secs:.1} s, HIT = cached share of prompt tokens (NOW: interval, TOTAL: since the routers started)\n"
            )),
            None if self.live => out.push_str(
                "; rates from the next refresh on, HIT = cached share of prompt tokens (TOTAL: since the routers started)\n",
            ),
            None => out.push_str(
                "; counters since the routers started, HIT = cached share of prompt tokens\n",
            ),
        }
        for line in self
            .routers
            .iter()
            .filter_map(RouterStatus::unreachable_line)
        {
            out.push_str(&line);
            out.push('\n');
        }
        if self.variants.is_empty() && answered > 0 {
            out.push_str("\nno routed requests yet\n");
        }
        let live = self.live || self.interval_seconds.is_some();
        for v in &self.variants {
            out.push_str(&format!(
                "\nendpoint {}  variant {}\n",
                v.endpoint, v.variant
            ));
            let mut head = if live {
                vec![
                    "INSTANCE",
                    "REQ/S",
                    "IN FLIGHT",
                    "PROMPT TOK/S",
                    "HIT NOW",
                    "HIT TOTAL",
                ]
            } else {
                vec!["INSTANCE", "REQUESTS", "IN FLIGHT", "PROMPT TOKENS", "HIT"]
            };
            let indexed = v.instances.iter().any(|i| i.index.is_some());
            if indexed {
                head.push("INDEX BLOCKS/CAPACITY");
                head.push("INDEX");
            }
            let mut t = Table::new(&head).indent(2);
            for i in &v.instances {
                let mut row = vec![i.instance.clone()];
                match &i.interval {
                    Some(r) if live => row.extend([
                        format!("{:.1}", r.requests_per_second),
                        i.in_flight.to_string(),
                        format!("{:.0}", r.prompt_tokens_per_second),
                        percent(r.cached_share),
                        percent(i.tokens.cached_share),
                    ]),
                    _ if live => row.extend([
                        "-".into(),
                        i.in_flight.to_string(),
                        "-".into(),
                        "-".into(),
                        percent(i.tokens.cached_share),
                    ]),
                    _ => row.extend([
                        i.requests.to_string(),
                        i.in_flight.to_string(),
                        i.tokens.prompt_tokens.to_string(),
                        percent(i.tokens.cached_share),
                    ]),
                }
                if indexed {
                    row.push(i.index.map_or_else(
                        || "-".into(),
                        |x| format!("{:.0}/{:.0}", x.blocks, x.capacity_blocks),
                    ));
                    row.push(i.index.map_or_else(|| "-".into(), |x| x.source()));
                }
                t.row(row);
            }
            out.push_str(&t.render());
            if !v.decisions.is_empty() {
                let mut t = if live {
                    Table::new(&[
                        "RULE",
                        "PROMPT TOK/S",
                        "HIT NOW",
                        "PROMPT TOKENS",
                        "HIT TOTAL",
                    ])
                } else {
                    Table::new(&["RULE", "PROMPT TOKENS", "HIT"])
                }
                .indent(2);
                for d in &v.decisions {
                    let mut row = vec![d.decision.clone()];
                    if live {
                        match &d.interval {
                            Some(r) => row.extend([
                                format!("{:.0}", r.prompt_tokens_per_second),
                                percent(r.cached_share),
                            ]),
                            None => row.extend(["-".into(), "-".into()]),
                        }
                    }
                    row.extend([
                        d.tokens.prompt_tokens.to_string(),
                        percent(d.tokens.cached_share),
                    ]);
                    t.row(row);
                }
                out.push('\n');
                out.push_str(&t.render());
            }
        }
        out
    }
}

/// Sorts `names` by their place in `order`, names not in it last, by name.
fn sort_by_order(names: &mut [String], order: &[&str]) {
    names.sort_by_key(|n| {
        (
            order.iter().position(|o| o == n).unwrap_or(order.len()),
            n.clone(),
        )
    });
}

fn count(value: f64) -> u64 {
    if value.is_finite() && value > 0.0 {
        value.round() as u64
    } else {
        0
    }
}

fn share(cached: f64, prompt: f64) -> Option<f64> {
    (prompt > 0.0).then(|| (cached / prompt).clamp(0.0, 1.0))
}

fn percent(share: Option<f64>) -> String {
    share.map_or_else(|| "-".into(), |s| format!("{:.1}%", s * 100.0))
}

/// A router as given on the command line and the URL of its `/metrics`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Router {
    pub url: String,
    pub metrics_url: String,
}

impl Router {
    /// `http://HOST:PORT` (a path of `/metrics` or `/` may follow; `HOST:PORT` alone means
    /// http). The data plane's HTTPS listener is not supported: the CLI's HTTP client speaks
    /// plain HTTP.
    pub fn parse(url: &str) -> Result<Self, InputError> {
        let given = url.trim();
        let bad = |why: &str| InputError(format!("--router-url {given:?}: {why}"));
        if given.is_empty() {
            return Err(bad("empty URL"));
        }
        let with_scheme = if given.contains("://") {
            given.to_string()
        } else {
            format!("http://{given}")
        };
        let uri: http::Uri = with_scheme
            .parse()
            .map_err(|e| bad(&format!("not a URL ({e})")))?;
        match uri.scheme_str() {
            Some("http") => {}
            Some(other) => {
                return Err(bad(&format!(
                    "scheme {other}:// is not supported (expected http://HOST:PORT)"
                )))
            }
            None => return Err(bad("expected http://HOST:PORT")),
        }
        let Some(authority) = uri.authority() else {
            return Err(bad("no host (expected http://HOST:PORT)"));
        };
        let path = uri.path().trim_end_matches('/');
        let path = path.strip_suffix("/metrics").unwrap_or(path);
        Ok(Router {
            url: given.to_string(),
            metrics_url: format!("http://{authority}{path}/metrics"),
        })
    }
}

/// The routers of `--router-url` (comma-separated, possibly repeated).
pub fn routers(urls: &[String]) -> Result<Vec<Router>, InputError> {
    let routers = urls
        .iter()
        .flat_map(|u| u.split(','))
        .filter(|u| !u.trim().is_empty())
        .map(Router::parse)
        .collect::<Result<Vec<_>, _>>()?;
    if routers.is_empty() {
        return Err(InputError("--router-url: no URL given".into()));
    }
    Ok(routers)
}

/// The refresh interval of `--interval SECS`.
pub fn interval(secs: f64) -> Result<Duration, InputError> {
    if secs.is_finite() && (0.1..=3600.0).contains(&secs) {
        Ok(Duration::from_secs_f64(secs))
    } else {
        Err(InputError(format!(
            "--interval {secs}: expected seconds from 0.1 to 3600"
        )))
    }
}

/// One router's `/metrics`, within `timeout`.
async fn scrape(http: &HttpClient, router: &Router, timeout: Duration) -> anyhow::Result<Counters> {
    let text = tokio::time::timeout(timeout, metrics::get_text(http, &router.metrics_url))
        .await
        .map_err(|_| {
            anyhow::anyhow!(
                "GET {}: no answer within {:.1} s",
                router.metrics_url,
                timeout.as_secs_f64()
            )
        })??;
    Ok(Counters::from_text(&text))
}

/// Every router's scrape, concurrently, in the order given.
async fn scrape_all(
    http: &HttpClient,
    routers: &[Router],
    timeout: Duration,
) -> Vec<anyhow::Result<Counters>> {
    futures_util::future::join_all(routers.iter().map(|r| scrape(http, r, timeout))).await
}

fn status(router: &Router, result: &anyhow::Result<Counters>) -> RouterStatus {
    RouterStatus {
        url: router.url.clone(),
        answered: result.is_ok(),
        error: result.as_ref().err().map(crate::one_line),
    }
}

/// `prefixctl top`.
pub async fn run(args: &TopArgs, output: OutputFormat) -> anyhow::Result<()> {
    let routers = routers(&args.router_url)?;
    let every = interval(args.interval)?;
    let http = metrics::http_client();
    if args.once {
        return once(&http, &routers, output).await;
    }
    live(&http, &routers, every, output).await
}

/// One snapshot of the cumulative counters; fails only when no router answers.
async fn once(http: &HttpClient, routers: &[Router], output: OutputFormat) -> anyhow::Result<()> {
    let results = scrape_all(http, routers, ONCE_TIMEOUT).await;
    let mut total = Counters::default();
    let mut statuses = Vec::new();
    for (router, result) in routers.iter().zip(&results) {
        let s = status(router, result);
        if let Some(line) = s.unreachable_line() {
            eprintln!("{line}");
        }
        statuses.push(s);
        if let Ok(c) = result {
            total.add(c);
        }
    }
    if results.iter().all(Result::is_err) {
        anyhow::bail!(
            "no router answered ({})",
            routers
                .iter()
                .map(|r| r.url.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    let mut report = TopReport::build(statuses, &total, None);
    if output == OutputFormat::Table {
        // The unreachable routers were named on stderr already.
        report.routers.iter_mut().for_each(|r| r.error = None);
    }
    emit(output, &report)
}

/// A refresh every `every` until Ctrl-C: the screen is cleared between refreshes when stdout is
/// a terminal; otherwise blocks follow each other (with `--output json`, one JSON object per
/// line).
async fn live(
    http: &HttpClient,
    routers: &[Router],
    every: Duration,
    output: OutputFormat,
) -> anyhow::Result<()> {
    let terminal = std::io::stdout().is_terminal();
    let timeout = every.clamp(Duration::from_secs(1), Duration::from_secs(10));
    // Each router's last good scrape and when it was taken.
    let mut last: Vec<Option<(Counters, Instant)>> = vec![None; routers.len()];
    let mut ticks = tokio::time::interval(every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let interrupted = control_plane::shutdown_signal();
    tokio::pin!(interrupted);
    let mut first = true;
    loop {
        tokio::select! {
            _ = &mut interrupted => return Ok(()),
            _ = ticks.tick() => {}
        }
        let results = tokio::select! {
            _ = &mut interrupted => return Ok(()),
            r = scrape_all(http, routers, timeout) => r,
        };
        let now = Instant::now();
        let mut total = Counters::default();
        let mut rates = Counters::default();
        let mut rated: Option<Duration> = None;
        let mut statuses = Vec::new();
        for ((router, result), last) in routers.iter().zip(results).zip(&mut last) {
            statuses.push(status(router, &result));
            // A router that did not answer keeps its last scrape: its next answer is rated
            // against that one, over the longer time.
            if let Ok(counters) = result {
                total.add(&counters);
                if let Some((before, at)) = last.as_ref() {
                    let elapsed = now.duration_since(*at);
                    rates.add(&counters.rates(before, elapsed));
                    rated = Some(rated.map_or(elapsed, |r| r.max(elapsed)));
                }
                *last = Some((counters, now));
            }
        }
        let mut report = TopReport::build(statuses, &total, rated.map(|d| (&rates, d)));
        report.live = true;
        match output {
            OutputFormat::Json => emit_json_line(&report)?,
            OutputFormat::Table => {
                let mut text = String::new();
                if terminal {
                    // Cursor home, clear the screen.
                    text.push_str("\x1b[H\x1b[2J");
                } else if !first {
                    text.push('\n');
                }
                text.push_str(&format!(
                    "prefixctl top: every {:.1} s (Ctrl-C stops)\n",
                    every.as_secs_f64()
                ));
                text.push_str(&report.table());
                write_stdout(&text)?;
            }
        }
        first = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A data plane's scrape: two instances of e/v1, both in its prefix index.
    const ROUTER_A: &str = "\
# HELP prefix_router_requests_total Requests by endpoint, variant, instance, routing decision and response status.
# TYPE prefix_router_requests_total counter
prefix_router_requests_total{endpoint=\"\",variant=\"\",instance=\"\",decision=\"none\",status=\"404\"} 7
prefix_router_requests_total{endpoint=\"e\",variant=\"v1\",instance=\"http://i1\",decision=\"prefix_hash\",status=\"200\"} 10
prefix_router_requests_total{endpoint=\"e\",variant=\"v1\",instance=\"http://i1\",decision=\"prefix_hash\",status=\"502\"} 2
prefix_router_requests_total{endpoint=\"e\",variant=\"v1\",instance=\"http://i2\",decision=\"overload_bypass\",status=\"200\"} 4
# TYPE prefix_router_prompt_tokens_total counter
prefix_router_prompt_tokens_total{endpoint=\"e\",variant=\"v1\",instance=\"http://i1\",decision=\"prefix_hash\"} 1000
prefix_router_prompt_tokens_total{endpoint=\"e\",variant=\"v1\",instance=\"http://i2\",decision=\"overload_bypass\"} 400
# TYPE prefix_router_cached_prompt_tokens_total counter
prefix_router_cached_prompt_tokens_total{endpoint=\"e\",variant=\"v1\",instance=\"http://i1\",decision=\"prefix_hash\"} 900
prefix_router_cached_prompt_tokens_total{endpoint=\"e\",variant=\"v1\",instance=\"http://i2\",decision=\"overload_bypass\"} 40
# TYPE prefix_router_prefix_index_blocks gauge
prefix_router_prefix_index_blocks{endpoint=\"e\",variant=\"v1\",instance=\"http://i1\"} 64
prefix_router_prefix_index_blocks{endpoint=\"e\",variant=\"v1\",instance=\"http://i2\"} 16
# TYPE prefix_router_prefix_index_capacity_blocks gauge
prefix_router_prefix_index_capacity_blocks{endpoint=\"e\",variant=\"v1\",instance=\"http://i1\"} 128
prefix_router_prefix_index_capacity_blocks{endpoint=\"e\",variant=\"v1\",instance=\"http://i2\"} 100
# TYPE prefix_router_kv_index_blocks gauge
prefix_router_kv_index_blocks{endpoint=\"e\",variant=\"v1\",instance=\"http://i1\"} 40
# TYPE prefix_router_instance_in_flight gauge
prefix_router_instance_in_flight{endpoint=\"e\",variant=\"v1\",instance=\"http://i1\"} 3
prefix_router_instance_in_flight{endpoint=\"e\",variant=\"v1\",instance=\"http://i2\"} 0
";

    /// A second router: more of i1 (some matched), in its index too.
    const ROUTER_B: &str = "\
prefix_router_requests_total{endpoint=\"e\",variant=\"v1\",instance=\"http://i1\",decision=\"prefix_hash\",status=\"200\"} 8
prefix_router_prompt_tokens_total{endpoint=\"e\",variant=\"v1\",instance=\"http://i1\",decision=\"prefix_hash\"} 1000
prefix_router_prompt_tokens_total{endpoint=\"e\",variant=\"v1\",instance=\"http://i1\",decision=\"prefix_match\"} 600
prefix_router_cached_prompt_tokens_total{endpoint=\"e\",variant=\"v1\",instance=\"http://i1\",decision=\"prefix_hash\"} 700
prefix_router_cached_prompt_tokens_total{endpoint=\"e\",variant=\"v1\",instance=\"http://i1\",decision=\"prefix_match\"} 0
prefix_router_prefix_index_blocks{endpoint=\"e\",variant=\"v1\",instance=\"http://i1\"} 32
prefix_router_prefix_index_capacity_blocks{endpoint=\"e\",variant=\"v1\",instance=\"http://i1\"} 96
prefix_router_instance_in_flight{endpoint=\"e\",variant=\"v1\",instance=\"http://i1\"} 2
";

    fn up(url: &str) -> RouterStatus {
        RouterStatus {
            url: url.into(),
            answered: true,
            error: None,
        }
    }

    fn summed(texts: &[&str]) -> Counters {
        let mut total = Counters::default();
        for t in texts {
            total.add(&Counters::from_text(t));
        }
        total
    }

    #[test]
    fn one_router_instances_rules_and_its_index() {
        let report = TopReport::build(vec![up("a")], &Counters::from_text(ROUTER_A), None);
        assert_eq!(report.variants.len(), 1, "unrouted requests are left out");
        let v = &report.variants[0];
        assert_eq!((v.endpoint.as_str(), v.variant.as_str()), ("e", "v1"));
        let i1 = &v.instances[0];
        assert_eq!(i1.instance, "http://i1");
        assert_eq!(i1.requests, 12, "every status counts");
        assert_eq!(i1.in_flight, 3);
        assert_eq!(i1.tokens.prompt_tokens, 1000);
        assert_eq!(i1.tokens.cached_share, Some(0.9));
        assert_eq!(v.instances[1].tokens.cached_share, Some(0.1));
        let decisions: Vec<_> = v.decisions.iter().map(|d| d.decision.as_str()).collect();
        assert_eq!(
            decisions,
            ["prefix_hash", "overload_bypass"],
            "the data plane's order"
        );
        assert_eq!(
            i1.index,
            Some(IndexView {
                blocks: 64.0,
                capacity_blocks: 128.0,
                routers: 1,
                exact_routers: 1,
                kv_blocks: Some(40.0),
            })
        );
        assert_eq!(v.instances[1].index.unwrap().source(), "inferred");
        let table = report.table();
        assert!(table.contains("INDEX BLOCKS/CAPACITY  INDEX"), "{table}");
        // The first live refresh has no rates yet, and the live columns.
        let first = TopReport {
            live: true,
            ..report.clone()
        }
        .table();
        assert!(first.contains("REQ/S"), "{first}");
        assert!(
            first.contains("http://i1  -      3          -             -        90.0%      64/128"),
            "{first}"
        );
        assert!(
            table.contains("http://i1  12        3          1000           90.0%  64/128"),
            "{table}"
        );
    }

    #[test]
    fn two_routers_are_summed() {
        let total = summed(&[ROUTER_A, ROUTER_B]);
        let report = TopReport::build(vec![up("a"), up("b")], &total, None);
        let v = &report.variants[0];
        let i1 = &v.instances[0];
        assert_eq!(i1.requests, 20);
        assert_eq!(i1.in_flight, 5);
        assert_eq!(
            i1.tokens,
            Tokens {
                prompt_tokens: 2600,
                cached_prompt_tokens: 1600,
                cached_share: Some(1600.0 / 2600.0)
            }
        );
        let rule = |name: &str| v.decisions.iter().find(|d| d.decision == name).unwrap();
        assert_eq!(rule("prefix_hash").tokens.prompt_tokens, 2000);
        assert_eq!(rule("prefix_hash").tokens.cached_share, Some(0.8));
        assert_eq!(rule("prefix_match").tokens.cached_share, Some(0.0));
        assert_eq!(rule("overload_bypass").tokens.cached_share, Some(0.1));
        // each router indexes what it sent: the mean over the routers that report an instance
        let index = |i: usize| v.instances[i].index.unwrap();
        assert_eq!(
            (index(0).blocks, index(0).capacity_blocks, index(0).routers),
            (48.0, 112.0, 2)
        );
        assert_eq!(index(1).routers, 1);
        // only router A's index of i1 is fed by the engine's KV events
        assert_eq!(index(0).source(), "exact on 1 of 2");
        assert_eq!(index(0).kv_blocks, Some(40.0));
        let json = serde_json::to_value(&report).unwrap();
        assert_eq!(
            json["Variants"][0]["Instances"][0]["CachedPromptTokens"],
            1600
        );
        assert_eq!(json["Variants"][0]["Instances"][0]["Index"]["Blocks"], 48.0);
        assert!(json.get("IntervalSeconds").is_none());
        assert!(json["Variants"][0]["Instances"][0]
            .get("Interval")
            .is_none());
    }

    #[test]
    fn interval_rates_and_cached_share_come_from_deltas() {
        let before = Counters::from_text(ROUTER_A);
        let after = Counters::from_text(
            &ROUTER_A
                .replace("status=\"200\"} 10", "status=\"200\"} 30")
                .replace(
                    "instance=\"http://i1\",decision=\"prefix_hash\"} 1000",
                    "instance=\"http://i1\",decision=\"prefix_hash\"} 3000",
                )
                .replace(
                    "instance=\"http://i1\",decision=\"prefix_hash\"} 900",
                    "instance=\"http://i1\",decision=\"prefix_hash\"} 1400",
                ),
        );
        let rates = after.rates(&before, Duration::from_secs(2));
        let report = TopReport::build(
            vec![up("a")],
            &after,
            Some((&rates, Duration::from_secs(2))),
        );
        let i1 = &report.variants[0].instances[0];
        let r = i1.interval.unwrap();
        assert_eq!(r.requests_per_second, 10.0);
        assert_eq!(r.prompt_tokens_per_second, 1000.0);
        assert_eq!(r.cached_share, Some(0.25), "500 of 2000 over the interval");
        assert_eq!(
            i1.tokens.cached_share,
            Some(1400.0 / 3000.0),
            "since the start"
        );
        let i2 = &report.variants[0].instances[1];
        assert_eq!(i2.interval.unwrap().cached_share, None, "no prompt tokens");
        assert_eq!(report.interval_seconds, Some(2.0));
        let table = report.table();
        assert!(table.contains("25.0%"), "{table}");
        assert!(table.contains("HIT NOW"), "{table}");
    }

    #[test]
    fn a_restarted_router_counts_from_zero() {
        let before = Counters::from_text(ROUTER_A);
        let after = Counters::from_text(
            "prefix_router_requests_total{endpoint=\"e\",variant=\"v1\",instance=\"http://i1\",decision=\"prefix_hash\",status=\"200\"} 4\n",
        );
        let rates = after.rates(&before, Duration::from_secs(1));
        let report = TopReport::build(
            vec![up("a")],
            &after,
            Some((&rates, Duration::from_secs(1))),
        );
        assert_eq!(
            report.variants[0].instances[0]
                .interval
                .unwrap()
                .requests_per_second,
            4.0
        );
    }

    #[test]
    fn router_urls() {
        let parsed = routers(&[
            "http://a:8080, b:9/,http://c:1/metrics".into(),
            "http://d/x/".into(),
        ])
        .unwrap();
        let urls: Vec<_> = parsed.iter().map(|r| r.metrics_url.as_str()).collect();
        assert_eq!(
            urls,
            [
                "http://a:8080/metrics",
                "http://b:9/metrics",
                "http://c:1/metrics",
                "http://d/x/metrics"
            ]
        );
        assert!(routers(&["https://a:1".into()])
            .unwrap_err()
            .0
            .contains("https"));
        assert!(routers(&[",".into()]).is_err());
        assert!(routers(&["http://".into()]).is_err());
        assert!(interval(0.0).is_err());
        assert!(interval(f64::NAN).is_err());
        assert_eq!(interval(2.0).unwrap(), Duration::from_secs(2));
    }

    #[test]
    fn an_unreachable_router_is_one_line() {
        let down = RouterStatus {
            url: "http://127.0.0.1:1".into(),
            answered: false,
            error: Some("GET http://127.0.0.1:1/metrics: connection refused".into()),
        };
        let report = TopReport::build(vec![up("a"), down], &Counters::from_text(ROUTER_A), None);
        let table = report.table();
        assert!(table.starts_with("1 of 2 routers answered"), "{table}");
        assert_eq!(
            table
                .lines()
                .filter(|l| l.contains("http://127.0.0.1:1"))
                .collect::<Vec<_>>(),
            ["router http://127.0.0.1:1 did not answer: GET http://127.0.0.1:1/metrics: connection refused"]
        );
    }
}
