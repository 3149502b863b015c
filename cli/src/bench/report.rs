//! Bench results: the contract's JSON, the summary table, the BENCHMARKS.md section and the plot.

use std::time::Duration;

use anyhow::Context;
use proto::RoutingStrategy;
use serde::Serialize;

use super::engines::share_deviation;
use super::fleet::EngineCounters;
use super::load::Sample;
use super::metrics::Histogram;
use super::table::aligned;
use super::timeline::Timeline;
use super::workload::Workload;
use super::BenchArgs;

#[derive(Debug, Clone, Serialize)]
pub struct PhaseHitRate {
    pub phase: String,
    pub kv_hit_rate: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct AutoscaleReport {
    pub added_instance: String,
    pub removed_instance: String,
    /// Fraction of documents whose main instance changed when the instance joined.
    pub keys_moved_on_join: f64,
    /// Of them, those whose new main instance is not the one that joined (hashing sends about
    /// 1/(n+1) of the documents to it, binomially: with 80 documents, 12.5% +- 3.7 points;
    /// a move between the instances that were there is the router's own).
    pub keys_moved_on_join_elsewhere: f64,
    /// The same when one left, not counting the documents that lived on it.
    pub keys_moved_on_leave: f64,
    /// Simulated seconds after the join until the hit rate was within 5 points of steady state.
    pub recovered_after_join_s: Option<f64>,
    pub phases: Vec<PhaseHitRate>,
    /// (seconds since measuring began, hit rate over the previous 5 s), simulated time.
    pub hit_rate_series: Vec<(f64, f64)>,
}

/// One strategy's figures, in the contract's field names. Times are simulated (wall / time scale).
#[derive(Debug, Clone, Serialize)]
pub struct StrategyResult {
    pub strategy: String,
    pub requests: usize,
    pub errors: usize,
    pub ttft_p50_ms: f64,
    pub ttft_p90_ms: f64,
    pub ttft_p99_ms: f64,
    pub throughput_rps: f64,
    pub output_tokens_per_s: f64,
    /// Token-level: the engines' prefix-cache hits / queries over the measured window.
    pub kv_hit_rate: f64,
    /// Each engine's share of the requests it served in the measured window.
    pub instance_share: Vec<f64>,
    /// max |share - 1/n| over the engines in the variant, as a fraction (0.01 = 1 point).
    pub max_share_deviation: f64,
    /// Busiest engine's requests over the mean.
    pub max_load_ratio: f64,
    pub route_decision_p50_us: f64,
    pub route_decision_p99_us: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub autoscale: Option<AutoscaleReport>,
    /// The whole run (warm-up included) window by window, and when its hit rate settled.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timeline: Option<Timeline>,
    /// PREFIX_AWARE_PRECISE: each router's exact index at the end of the run (KV events applied,
    /// blocks indexed), in router order.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_index: Option<Vec<super::precise::RouterIndex>>,
    #[serde(skip)]
    pub ttft_ms_sorted: Vec<f64>,
}

/// The `p` quantile (0..=1) of `sorted` by nearest rank; 0 when empty.
pub(super) fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = (p * (sorted.len() - 1) as f64).round() as usize;
    sorted[rank.min(sorted.len() - 1)]
}

/// The measured window of one strategy's run: the requests that finished in it, the engines'
/// counters at its start and its end, and its wall-clock length.
pub struct MeasuredWindow<'a> {
    pub samples: &'a [&'a Sample],
    pub begin: &'a [EngineCounters],
    pub end: &'a [EngineCounters],
    pub length: Duration,
}

impl StrategyResult {
    pub fn compute(
        strategy: RoutingStrategy,
        time_scale: f64,
        window: &MeasuredWindow<'_>,
        decisions: &Histogram,
        autoscale: Option<AutoscaleReport>,
    ) -> Self {
        let MeasuredWindow {
            samples: measured,
            begin,
            end,
            length: window,
        } = *window;
        let ok: Vec<&&Sample> = measured.iter().filter(|s| s.error.is_none()).collect();
        let errors = measured.len() - ok.len();
        let mut ttft: Vec<f64> = ok
            .iter()
            .map(|s| s.ttft.as_secs_f64() * 1e3 / time_scale)
            .collect();
        ttft.sort_by(|a, b| a.total_cmp(b));
        let simulated_window = window.as_secs_f64() / time_scale;
        let output_tokens: u64 = ok.iter().map(|s| u64::from(s.output_tokens)).sum();
        let deltas: Vec<EngineCounters> = end
            .iter()
            .enumerate()
            .map(|(i, e)| *e - begin.get(i).copied().unwrap_or_default())
            .collect();
        let queries: f64 = deltas.iter().map(|d| d.queries).sum();
        let hits: f64 = deltas.iter().map(|d| d.hits).sum();
        let requests: f64 = deltas.iter().map(|d| d.requests).sum();
        let instance_share: Vec<f64> = deltas
            .iter()
            .map(|d| {
                if requests > 0.0 {
                    d.requests / requests
                } else {
                    0.0
                }
            })
            .collect();
        // Engines that served nothing in the window (e.g. one that left) are not in the variant.
        let serving: Vec<f64> = instance_share
            .iter()
            .copied()
            .filter(|s| *s > 0.0)
            .collect();
        let n = serving.len().max(1) as f64;
        let max_share_deviation = share_deviation(&serving);
        let max_load_ratio = serving.iter().copied().fold(0.0, f64::max) * n;
        let us = |q| decisions.quantile(q).map(|s| s * 1e6).unwrap_or(0.0);
        StrategyResult {
            strategy: strategy.user_name().to_string(),
            requests: ok.len(),
            errors,
            ttft_p50_ms: percentile(&ttft, 0.5),
            ttft_p90_ms: percentile(&ttft, 0.9),
            ttft_p99_ms: percentile(&ttft, 0.99),
            throughput_rps: ok.len() as f64 / simulated_window,
            output_tokens_per_s: output_tokens as f64 / simulated_window,
            kv_hit_rate: if queries > 0.0 { hits / queries } else { 0.0 },
            instance_share,
            max_share_deviation,
            max_load_ratio,
            route_decision_p50_us: us(0.5),
            route_decision_p99_us: us(0.99),
            autoscale,
            timeline: None,
            kv_index: None,
            ttft_ms_sorted: ttft,
        }
    }
}

/// The whole bench output (`--out`).
#[derive(Debug, Clone, Serialize)]
pub struct BenchReport {
    pub workload: String,
    pub config: serde_json::Value,
    pub results: Vec<StrategyResult>,
}

impl BenchReport {
    pub fn new(args: &BenchArgs, workload: &Workload, results: Vec<StrategyResult>) -> Self {
        let config = serde_json::json!({
            "instances": args.instances,
            "routers": args.routers,
            "concurrency": args.concurrency,
            "duration_s": args.duration,
            "warmup_s": args.warmup,
            "time_scale": args.time_scale,
            "seed": args.seed,
            "prefix_length": args.prefix_length.unwrap_or(workload.prefix_length),
            "concurrency_threshold": args.concurrency_threshold,
            "document_role": workload.document_role,
            "cache_regime": workload.cache_regime,
            "model": args.model,
            "workload": workload,
            "date": today(),
        });
        BenchReport {
            workload: workload.kind.name().to_string(),
            config,
            results,
        }
    }

    fn baseline(&self) -> Option<&StrategyResult> {
        self.results.iter().find(|r| r.strategy == "RANDOM")
    }

    /// Rows of the summary, with changes against RANDOM.
    fn rows(&self) -> Vec<Vec<String>> {
        let base = self.baseline();
        let delta = |x: f64, b: Option<f64>| match b {
            Some(b) if b > 0.0 && (x - b).abs() > f64::EPSILON => {
                format!(" ({:+.0}%)", (x - b) / b * 100.0)
            }
            _ => String::new(),
        };
        self.results
            .iter()
            .map(|r| {
                vec![
                    r.strategy.clone(),
                    format!("{}", r.requests),
                    format!("{}", r.errors),
                    format!(
                        "{:.0}{}",
                        r.ttft_p50_ms,
                        delta(r.ttft_p50_ms, base.map(|b| b.ttft_p50_ms))
                    ),
                    format!(
                        "{:.0}{}",
                        r.ttft_p90_ms,
                        delta(r.ttft_p90_ms, base.map(|b| b.ttft_p90_ms))
                    ),
                    format!("{:.0}", r.ttft_p99_ms),
                    format!(
                        "{:.2}{}",
                        r.throughput_rps,
                        delta(r.throughput_rps, base.map(|b| b.throughput_rps))
                    ),
                    format!("{:.1}%", r.kv_hit_rate * 100.0),
                    format!("{:.2} pt", r.max_share_deviation * 100.0),
                    min_max_share(&r.instance_share),
                    format!("{:.2}", r.max_load_ratio),
                    format!(
                        "{:.1}/{:.1}",
                        r.route_decision_p50_us, r.route_decision_p99_us
                    ),
                ]
            })
            .collect()
    }

    const HEADER: [&'static str; 12] = [
        "strategy",
        "requests",
        "errors",
        "TTFT p50 ms",
        "TTFT p90 ms",
        "TTFT p99 ms",
        "req/s",
        "KV hit",
        "max share dev",
        "min/max share",
        "max/mean load",
        "decision p50/p99 us",
    ];

    pub fn print_table(&self) {
        println!("workload {}", self.workload);
        for line in aligned(&Self::HEADER, self.rows()) {
            println!("{line}");
        }
        for line in self.notes() {
            println!("{line}");
        }
    }

    /// Lines below the table, one per strategy and topic: autoscale's moves and recovery, and
    /// the run's hit rate window by window.
    fn notes(&self) -> Vec<String> {
        let mut out = Vec::new();
        for r in &self.results {
            if let Some(a) = &r.autoscale {
                out.push(format!(
                    "{}: keys moved on join {:.1}% ({:.1}% between the instances already there), on leave {:.1}%; hit rate {}; back within 5 points of steady state {}.",
                    r.strategy,
                    a.keys_moved_on_join * 100.0,
                    a.keys_moved_on_join_elsewhere * 100.0,
                    a.keys_moved_on_leave * 100.0,
                    a.phases.iter().map(|p| format!("{} {:.1}%", p.phase, p.kv_hit_rate * 100.0)).collect::<Vec<_>>().join(", "),
                    a.recovered_after_join_s.map(|s| format!("{s:.0} s after the join")).unwrap_or_else(|| "never".into()),
                ));
            }
        }
        for r in &self.results {
            if let Some(t) = r.timeline.as_ref().and_then(Timeline::summary) {
                out.push(format!("{} from its first request: {t}.", r.strategy));
            }
        }
        out
    }

    /// The workload, with the document role and the cache regime when they are not the
    /// defaults, the number of routers when there are several and the seed when it is not 1: one
    /// Markdown section each, so runs of several seeds stand side by side.
    pub fn section(&self) -> String {
        let mut parts = Vec::new();
        if self.config["document_role"] == "system" {
            parts.push("system role".to_string());
        }
        if self.config["cache_regime"] == "small" {
            parts.push("small caches".to_string());
        }
        if let Some(r) = self.config["routers"].as_u64().filter(|&r| r > 1) {
            parts.push(format!("{r} routers"));
        }
        if let Some(seed) = self.config["seed"].as_u64().filter(|&s| s != 1) {
            parts.push(format!("seed {seed}"));
        }
        match parts.is_empty() {
            true => self.workload.clone(),
            false => format!("{} ({})", self.workload, parts.join(", ")),
        }
    }

    /// The Markdown section for this workload.
    pub fn markdown(&self, command: &str) -> String {
        let mut s = format!(
            "### {}\n\n_{}_ · `{}`\n\n",
            self.section(),
            today(),
            command
        );
        s.push_str(&format!("| {} |\n", Self::HEADER.join(" | ")));
        s.push_str(&format!("|{}\n", "---|".repeat(Self::HEADER.len())));
        for r in self.rows() {
            s.push_str(&format!("| {} |\n", r.join(" | ")));
        }
        for line in self.notes() {
            s.push_str(&format!("\n{line}\n"));
        }
        s
    }

    /// Replaces (or appends) this workload's section of `path`, between markers.
    pub fn update_markdown(&self, path: &std::path::Path, command: &str) -> anyhow::Result<()> {
        let begin = format!("<!-- bench:{} -->", self.section());
        let end = format!("<!-- /bench:{} -->", self.section());
        let old = match std::fs::read_to_string(path) {
            Ok(s) => s,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::from(
                "# Benchmarks\n\nWritten by `prefixctl bench --markdown BENCHMARKS.md`; times are simulated \
                 (engine-sim at `--time-scale`), hit rates come from the engines' own counters.\n",
            ),
            Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
        };
        let section = format!("{begin}\n{}{end}", self.markdown(command));
        let new = match (old.find(&begin), old.find(&end)) {
            (Some(b), Some(e)) if e > b => {
                format!("{}{}{}", &old[..b], section, &old[e + end.len()..])
            }
            _ => format!("{}\n{}\n", old.trim_end(), section),
        };
        let tmp = path.with_extension("md.tmp");
        std::fs::write(&tmp, new).with_context(|| format!("writing {}", tmp.display()))?;
        std::fs::rename(&tmp, path).with_context(|| format!("writing {}", path.display()))?;
        Ok(())
    }
}

fn today() -> String {
    // Days since the epoch to a civil date (Howard Hinnant's algorithm), to avoid a date crate.
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let z = (secs / 86_400) as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}")
}

/// The smallest and largest share of the requests an engine got, in percent (`-` without engines).
fn min_max_share(shares: &[f64]) -> String {
    if shares.is_empty() {
        return "-".into();
    }
    let min = shares.iter().copied().fold(f64::INFINITY, f64::min);
    let max = shares.iter().copied().fold(0.0, f64::max);
    format!("{:.1}/{:.1}%", min * 100.0, max * 100.0)
}

/// Shares in percent, one per engine.
fn shares_line(shares: &[f64]) -> String {
    shares
        .iter()
        .map(|s| format!("{:.1}", s * 100.0))
        .collect::<Vec<_>>()
        .join(" ")
}

/// The demo's side-by-side comparison.
pub fn print_demo(random: &StrategyResult, prefix: &StrategyResult) {
    let pct = |a: f64, b: f64| {
        if a > 0.0 {
            format!("{:+.0}%", (b - a) / a * 100.0)
        } else {
            "-".into()
        }
    };
    println!(
        "{:<22} {:>12} {:>14} {:>8}",
        "", "RANDOM", "PREFIX_AWARE", "change"
    );
    let rows = [
        ("TTFT p50 (ms)", random.ttft_p50_ms, prefix.ttft_p50_ms),
        ("TTFT p90 (ms)", random.ttft_p90_ms, prefix.ttft_p90_ms),
        (
            "throughput (req/s)",
            random.throughput_rps,
            prefix.throughput_rps,
        ),
        (
            "KV cache hit rate (%)",
            random.kv_hit_rate * 100.0,
            prefix.kv_hit_rate * 100.0,
        ),
    ];
    for (name, a, b) in rows {
        println!("{name:<22} {a:>12.1} {b:>14.1} {:>8}", pct(a, b));
    }
    println!(
        "{:<22} {:>12} {:>14}",
        "errors", random.errors, prefix.errors
    );
    println!(
        "{:<22} {:>12.2} {:>14.2}",
        "max share dev (pt)",
        random.max_share_deviation * 100.0,
        prefix.max_share_deviation * 100.0
    );
    let fair = 100.0 / random.instance_share.len().max(1) as f64;
    println!("requests per instance (%, fair share {fair:.1}):");
    println!("  {:<13} {}", "RANDOM", shares_line(&random.instance_share));
    println!(
        "  {:<13} {}",
        "PREFIX_AWARE",
        shares_line(&prefix.instance_share)
    );
    println!("(times are simulated: engine-sim runs faster than real time; hit rates from the engines' counters)");
}

/// TTFT CDFs per strategy (left) and per-instance shares (right), as SVG.
pub fn plot(report: &BenchReport, path: &std::path::Path) -> anyhow::Result<()> {
    use plotters::prelude::*;
    let root = SVGBackend::new(path, (1100, 450)).into_drawing_area();
    root.fill(&WHITE)?;
    let (left, right) = root.split_horizontally(650);
    let max_ttft = report
        .results
        .iter()
        .filter_map(|r| r.ttft_ms_sorted.last().copied())
        .fold(1.0, f64::max);
    let mut chart = ChartBuilder::on(&left)
        .caption(format!("{}: TTFT CDF", report.workload), ("sans-serif", 18))
        .margin(10)
        .x_label_area_size(35)
        .y_label_area_size(45)
        .build_cartesian_2d(0f64..max_ttft, 0f64..1f64)?;
    chart
        .configure_mesh()
        .x_desc("TTFT (ms, simulated)")
        .y_desc("fraction of requests")
        .draw()?;
    let colors = [RED, BLUE, GREEN, MAGENTA, CYAN];
    for (i, r) in report.results.iter().enumerate() {
        let n = r.ttft_ms_sorted.len().max(1) as f64;
        let color = colors[i % colors.len()];
        chart
            .draw_series(LineSeries::new(
                r.ttft_ms_sorted
                    .iter()
                    .enumerate()
                    .map(|(k, t)| (*t, (k + 1) as f64 / n)),
                color.stroke_width(2),
            ))?
            .label(r.strategy.clone())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()?;

    let instances = report
        .results
        .iter()
        .map(|r| r.instance_share.len())
        .max()
        .unwrap_or(1);
    let max_share = report
        .results
        .iter()
        .flat_map(|r| r.instance_share.iter().copied())
        .fold(0.0, f64::max)
        .max(0.01);
    let groups = report.results.len().max(1);
    let mut bars = ChartBuilder::on(&right)
        .caption("share of requests per instance", ("sans-serif", 18))
        .margin(10)
        .x_label_area_size(35)
        .y_label_area_size(45)
        .build_cartesian_2d(0f64..instances as f64, 0f64..max_share * 1.15)?;
    bars.configure_mesh()
        .x_desc("instance")
        .y_desc("share")
        .draw()?;
    let width = 0.8 / groups as f64;
    for (g, r) in report.results.iter().enumerate() {
        let color = colors[g % colors.len()];
        bars.draw_series(r.instance_share.iter().enumerate().map(|(i, s)| {
            let x0 = i as f64 + 0.1 + g as f64 * width;
            Rectangle::new([(x0, 0.0), (x0 + width, *s)], color.filled())
        }))?;
    }
    root.present()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    fn sample(ttft_ms: u64) -> Sample {
        Sample {
            client: 0,
            done: Instant::now(),
            ttft: Duration::from_millis(ttft_ms),
            latency: Duration::from_millis(ttft_ms * 2),
            output_tokens: 10,
            instance: "a".into(),
            affinity: 0,
            error: None,
        }
    }

    #[test]
    fn figures_come_from_samples_and_engine_counters() {
        let samples: Vec<Sample> = (1..=100).map(sample).collect();
        let refs: Vec<&Sample> = samples.iter().collect();
        let begin = vec![
            EngineCounters {
                queries: 100.0,
                hits: 0.0,
                requests: 10.0
            };
            2
        ];
        let end = vec![
            EngineCounters {
                queries: 1100.0,
                hits: 900.0,
                requests: 70.0,
            },
            EngineCounters {
                queries: 1100.0,
                hits: 700.0,
                requests: 50.0,
            },
        ];
        let r = StrategyResult::compute(
            RoutingStrategy::PrefixAware,
            0.1,
            &MeasuredWindow {
                samples: &refs,
                begin: &begin,
                end: &end,
                length: Duration::from_secs(1),
            },
            &Histogram::default(),
            None,
        );
        assert_eq!(r.requests, 100);
        assert_eq!(r.ttft_p50_ms, 510.0, "wall ms / time scale");
        assert!((r.kv_hit_rate - 0.8).abs() < 1e-9);
        assert_eq!(r.instance_share, vec![0.6, 0.4]);
        assert!((r.max_share_deviation - 0.1).abs() < 1e-9);
        assert!(
            (r.throughput_rps - 10.0).abs() < 1e-9,
            "100 requests in 10 simulated seconds"
        );
        assert!((r.max_load_ratio - 1.2).abs() < 1e-9);
    }

    fn report(workload: &str, routers: u64, p50: f64) -> BenchReport {
        let samples: Vec<Sample> = (1..=10).map(|_| sample(p50 as u64)).collect();
        let refs: Vec<&Sample> = samples.iter().collect();
        let r = StrategyResult::compute(
            RoutingStrategy::Random,
            1.0,
            &MeasuredWindow {
                samples: &refs,
                begin: &[],
                end: &[],
                length: Duration::from_secs(1),
            },
            &Histogram::default(),
            None,
        );
        BenchReport {
            workload: workload.into(),
            config: serde_json::json!({ "routers": routers }),
            results: vec![r],
        }
    }

    #[test]
    fn seeds_and_router_counts_get_sections_of_their_own() {
        let mut r = report("long-context", 4, 100.0);
        assert_eq!(r.section(), "long-context (4 routers)");
        r.config["seed"] = serde_json::json!(2);
        assert_eq!(r.section(), "long-context (4 routers, seed 2)");
        r.config["routers"] = serde_json::json!(1);
        assert_eq!(r.section(), "long-context (seed 2)");
        r.config["seed"] = serde_json::json!(1);
        r.config["document_role"] = serde_json::json!("system");
        r.config["cache_regime"] = serde_json::json!("small");
        assert_eq!(r.section(), "long-context (system role, small caches)");
        r.config["document_role"] = serde_json::json!("user");
        r.config["cache_regime"] = serde_json::json!("ample");
        assert_eq!(r.section(), "long-context");
    }

    #[test]
    fn tables_show_the_least_and_most_loaded_engine() {
        let mut r = report("long-context", 1, 100.0);
        r.results[0].instance_share = vec![0.125, 0.2, 0.15];
        let md = r.markdown("prefixctl bench");
        assert!(md.contains("| min/max share |"), "{md}");
        assert!(md.contains("| 12.5/20.0% |"), "{md}");
        r.results[0].instance_share.clear();
        assert!(r.markdown("x").contains("| - |"));
    }

    #[test]
    fn markdown_sections_are_replaced_in_place() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("BENCHMARKS.md");
        report("long-context", 1, 100.0)
            .update_markdown(&path, "prefixctl bench a")
            .unwrap();
        report("sharegpt", 1, 200.0)
            .update_markdown(&path, "prefixctl bench b")
            .unwrap();
        report("long-context", 4, 300.0)
            .update_markdown(&path, "prefixctl bench c")
            .unwrap();
        report("long-context", 1, 400.0)
            .update_markdown(&path, "prefixctl bench d")
            .unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(text.matches("<!-- bench:long-context -->").count(), 1);
        assert_eq!(
            text.matches("<!-- bench:long-context (4 routers) -->")
                .count(),
            1
        );
        assert!(
            text.contains("prefixctl bench d") && !text.contains("prefixctl bench a"),
            "{text}"
        );
        assert!(text.contains("| RANDOM | 10 | 0 | 400 |"), "{text}");
        let order: Vec<usize> = [
            "bench:long-context -->",
            "bench:sharegpt",
            "bench:long-context (4",
        ]
        .iter()
        .map(|m| text.find(m).unwrap())
        .collect();
        assert!(
            order[0] < order[1] && order[1] < order[2],
            "sections keep their places"
        );
    }

    #[test]
    fn date_is_civil() {
        let d = today();
        assert_eq!(d.len(), 10);
        assert!(d.starts_with("20"));
    }
}
