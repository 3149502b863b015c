//! A lock-free histogram of durations, as the engine keeps its time to first token (rendered by
//! [`crate::metrics`]).

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

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

    /// The buckets' upper bounds, in seconds.
    pub(crate) fn bounds(&self) -> &'static [f64] {
        self.bounds
    }

    /// Per-bucket (not cumulative) counts, one more than the bounds (+Inf last).
    pub(crate) fn counts(&self) -> Vec<u64> {
        self.counts.iter().map(|c| c.load(Relaxed)).collect()
    }

    pub(crate) fn count(&self) -> u64 {
        self.counts.iter().map(|c| c.load(Relaxed)).sum()
    }

    pub(crate) fn sum_seconds(&self) -> f64 {
        self.sum_nanos.load(Relaxed) as f64 / 1e9
    }
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
        assert_eq!(h.counts(), vec![1, 1, 1]);
        assert_eq!(h.count(), 3);
        assert!((h.sum_seconds() - 5.6).abs() < 1e-9);
    }
}
