//! `GET /metrics`: Prometheus text exposition (format 0.0.4) with vLLM's metric names, each
//! labelled `model_name="..."` as vLLM does.
//!
//! TTFT is observed in wall-clock seconds as a client sees it, i.e. after `--time-scale`.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use telemetry::exposition::Exposition;

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

/// The whole exposition of one engine (encoded by the `prometheus` crate, see
/// [`telemetry::exposition`]).
pub(crate) fn render(engine: &Engine) -> String {
    let s = engine.stats();
    let model = engine.config().model_name.as_str();
    let labels = [("model_name", model)];
    let mut out = Exposition::new();
    let gauges: [(&str, &str, f64); 4] = [
        (
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            s.running as f64,
        ),
        (
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            s.waiting as f64,
        ),
        (
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            s.kv_cache_usage,
        ),
        (
            "engine_sim_cached_blocks",
            "KV-cache blocks holding a cached prefix, pinned or evictable.",
            s.cached_blocks as f64,
        ),
    ];
    for (name, help, value) in gauges {
        out.gauge(name, help).sample(&labels, value);
    }
    let counters: [(&str, &str, u64); 7] = [
        (
            "vllm:prefix_cache_queries_total",
            "Prefix cache queries, in terms of number of queried tokens.",
            s.prefix_cache_queries,
        ),
        (
            "vllm:prefix_cache_hits_total",
            "Prefix cache hits, in terms of number of cached tokens.",
            s.prefix_cache_hits,
        ),
        (
            "vllm:prompt_tokens_total",
            "Number of prefill tokens processed.",
            s.prompt_tokens,
        ),
        (
            "vllm:generation_tokens_total",
            "Number of generation tokens processed.",
            s.generation_tokens,
        ),
        (
            "vllm:request_success_total",
            "Count of successfully processed requests.",
            s.requests_succeeded,
        ),
        (
            "engine_sim_requests_total",
            "Completion requests received by this engine, any outcome.",
            s.requests_total,
        ),
        (
            "engine_sim_injected_failures_total",
            "Completion requests answered 500 by --fail-rate.",
            s.failures_injected,
        ),
    ];
    for (name, help, value) in counters {
        out.counter(name, help).sample(&labels, value as f64);
    }
    let h = &engine.ttft;
    let counts: Vec<u64> = h.counts.iter().map(|c| c.load(Relaxed)).collect();
    out.histogram(
        "vllm:time_to_first_token_seconds",
        "Histogram of time to first token in seconds.",
    )
    .buckets(
        &labels,
        h.bounds.iter().copied().zip(counts.iter().copied()),
        counts[h.bounds.len()],
        h.sum_seconds(),
    );
    out.render()
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
}
