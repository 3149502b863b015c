//! A fixed-bucket latency histogram in atomics (no lock on the request path), described at scrape
//! time: the decision latency ([`crate::metrics`]) and flow control's waits.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;
use telemetry::exposition::{Exposition, Family};

/// Upper bounds of the decision-latency buckets, in nanoseconds.
const DECISION_BUCKETS_NS: [u64; 33] = [
    250, 500, 750, 1_000, 1_500, 2_000, 2_500, 3_000, 3_500, 4_000, 5_000, 6_000, 7_000, 8_000,
    10_000, 12_500, 15_000, 20_000, 25_000, 30_000, 40_000, 50_000, 75_000, 100_000, 150_000,
    200_000, 300_000, 500_000, 750_000, 1_000_000, 2_500_000, 5_000_000, 10_000_000,
];

/// A fixed-bucket latency histogram in atomics.
#[derive(Debug)]
pub struct Histogram {
    /// Upper bounds of the finite buckets, in nanoseconds.
    bounds: &'static [u64],
    /// One count per bound, then the overflow.
    buckets: Box<[AtomicU64]>,
    sum_ns: AtomicU64,
}

impl Default for Histogram {
    /// The decision-latency buckets (250 ns to 10 ms).
    fn default() -> Self {
        Histogram::with_bounds(&DECISION_BUCKETS_NS)
    }
}

impl Histogram {
    /// A histogram with these bucket bounds (nanoseconds, ascending).
    pub fn with_bounds(bounds: &'static [u64]) -> Self {
        Histogram {
            bounds,
            buckets: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum_ns: AtomicU64::new(0),
        }
    }

    pub fn observe(&self, d: Duration) {
        let ns = d.as_nanos().min(u64::MAX as u128) as u64;
        let i = self.bounds.partition_point(|&b| b < ns);
        self.buckets[i].fetch_add(1, Relaxed);
        self.sum_ns.fetch_add(ns, Relaxed);
    }

    pub fn count(&self) -> u64 {
        self.buckets.iter().map(|b| b.load(Relaxed)).sum()
    }

    /// Adds this histogram (no labels) to `out` as `name`.
    pub(crate) fn describe(&self, name: &str, help: &str, out: &mut Exposition) {
        self.sample(&mut out.histogram(name, help), &[]);
    }

    /// Adds this histogram to a histogram family, with `labels`.
    pub(crate) fn sample(&self, family: &mut Family<'_>, labels: &[(&str, &str)]) {
        let counts: Vec<u64> = self.buckets.iter().map(|b| b.load(Relaxed)).collect();
        let finite = self
            .bounds
            .iter()
            .zip(&counts)
            .map(|(&ns, &n)| (ns as f64 / 1e9, n));
        family.buckets(
            labels,
            finite,
            counts[self.bounds.len()],
            self.sum_ns.load(Relaxed) as f64 / 1e9,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_renders_cumulative_buckets() {
        let h = Histogram::default();
        h.observe(Duration::from_nanos(900));
        h.observe(Duration::from_micros(3));
        h.observe(Duration::from_secs(1));
        let mut e = Exposition::new();
        h.describe("x", "help", &mut e);
        let out = e.render();
        assert!(out.contains("x_bucket{le=\"0.000001\"} 1\n"), "{out}");
        assert!(out.contains("x_bucket{le=\"0.000003\"} 2\n"), "{out}");
        assert!(out.contains("x_bucket{le=\"+Inf\"} 3\n"), "{out}");
        assert!(out.contains("x_count 3\n"));
    }
}
