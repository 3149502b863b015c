//! `GET /metrics`: Prometheus text exposition (format 0.0.4) with vLLM's metric names, each
//! labelled `model_name="..."` as vLLM does.
//!
//! TTFT is observed in wall-clock seconds as a client sees it, i.e. after `--time-scale`.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use crate::engine::Engine;

/// vLLM's buckets for `vllm:time_to_first_token_seconds`.
pub const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];

/// A lock-free histogram of durations.
pub(crate) struct Histogram {
    bounds: &'static [f64],
    /// Per-bucket (not cumulative) counts; the last one is +Inf.
    counts: Box<[AtomicU64]>,
    sum_nanos: AtomicU64,
}

impl Histogram {
    pub(crate) fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            counts: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum_nanos: AtomicU64::new(0),
        }
    }

    pub(crate) fn observe(&self, d: Duration) {
        let secs = d.as_secs_f64();
        let i = self.bounds.partition_point(|&b| b < secs);
        self.counts[i].fetch_add(1, Relaxed);
        let nanos = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        self.sum_nanos.fetch_add(nanos, Relaxed);
    }

    pub(crate) fn count(&self) -> u64 {
        self.counts.iter().map(|c| c.load(Relaxed)).sum()
    }

    pub(crate) fn sum_seconds(&self) -> f64 {
        self.sum_nanos.load(Relaxed) as f64 / 1e9
    }
}

/// Escapes a Prometheus label value.
fn escape_label(v: &str) -> String {
    let mut out = String::with_capacity(v.len());
    for c in v.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
}

/// The whole exposition of one engine.
pub(crate) fn render(engine: &Engine) -> String {
    let s = engine.stats();
    let model = escape_label(&engine.config().model_name);
    let labels = format!("model_name=\"{model}\"");
    let mut out = String::with_capacity(4096);
    let mut metric = |name: &str, kind: &str, help: &str, value: &dyn std::fmt::Display| {
        let _ = write!(
            out,
            "# HELP {name} {help}\n# TYPE {name} {kind}\n{name}{{{labels}}} {value}\n"
        );
    };
    metric(
        "vllm:num_requests_running",
        "gauge",
        "Number of requests in model execution batches.",
        &s.running,
    );
    metric(
        "vllm:num_requests_waiting",
        "gauge",
        "Number of requests waiting to be processed.",
        &s.waiting,
    );
    metric(
        "vllm:kv_cache_usage_perc",
        "gauge",
        "KV-cache usage. 1 means 100 percent usage.",
        &s.kv_cache_usage,
    );
    metric(
        "vllm:prefix_cache_queries_total",
        "counter",
        "Prefix cache queries, in terms of number of queried tokens.",
        &s.prefix_cache_queries,
    );
    metric(
        "vllm:prefix_cache_hits_total",
        "counter",
        "Prefix cache hits, in terms of number of cached tokens.",
        &s.prefix_cache_hits,
    );
    metric(
        "vllm:prompt_tokens_total",
        "counter",
        "Number of prefill tokens processed.",
        &s.prompt_tokens,
    );
    metric(
        "vllm:generation_tokens_total",
        "counter",
        "Number of generation tokens processed.",
        &s.generation_tokens,
    );
    metric(
        "vllm:request_success_total",
        "counter",
        "Count of successfully processed requests.",
        &s.requests_succeeded,
    );
    metric(
        "engine_sim_requests_total",
        "counter",
        "Completion requests received by this engine, any outcome.",
        &s.requests_total,
    );
    metric(
        "engine_sim_injected_failures_total",
        "counter",
        "Completion requests answered 500 by --fail-rate.",
        &s.failures_injected,
    );
    metric(
        "engine_sim_cached_blocks",
        "gauge",
        "KV-cache blocks holding a cached prefix, pinned or evictable.",
        &s.cached_blocks,
    );

    let h = &engine.ttft;
    let name = "vllm:time_to_first_token_seconds";
    let _ = write!(
        out,
        "# HELP {name} Histogram of time to first token in seconds.\n# TYPE {name} histogram\n"
    );
    let mut cumulative = 0;
    for (i, count) in h.counts.iter().enumerate() {
        cumulative += count.load(Relaxed);
        match h.bounds.get(i) {
            Some(le) => {
                let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{le:?}\"}} {cumulative}");
            }
            None => {
                let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {cumulative}");
            }
        }
    }
    let _ = writeln!(out, "{name}_sum{{{labels}}} {}", h.sum_seconds());
    let _ = writeln!(out, "{name}_count{{{labels}}} {cumulative}");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_upper_bounds_inclusive() {
        let h = Histogram::new(&[0.1, 1.0]);
        h.observe(Duration::from_millis(100));
        h.observe(Duration::from_millis(500));
        h.observe(Duration::from_secs(5));
        let counts: Vec<u64> = h.counts.iter().map(|c| c.load(Relaxed)).collect();
        assert_eq!(counts, vec![1, 1, 1]);
        assert_eq!(h.count(), 3);
        assert!((h.sum_seconds() - 5.6).abs() < 1e-9);
    }

    #[test]
    fn label_values_are_escaped() {
        assert_eq!(escape_label("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }
}
