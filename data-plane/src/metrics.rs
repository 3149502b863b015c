//! Prometheus text metrics, kept in atomics (no lock on the request path).
//!
//! Per-route counters (`endpoint`, `variant`, `instance`, `decision`, `status`) are pre-created when
//! a table is built and reused by the next table for routes that are still there.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use crate::placement::Decision;
use crate::table::RoutingTable;

/// Status codes with their own counter; others are counted by class.
const STATUS_CODES: [u16; 11] = [200, 400, 404, 405, 408, 413, 429, 500, 502, 503, 504];
const STATUS_CLASSES: [&str; 5] = ["1xx", "2xx", "3xx", "4xx", "5xx"];
pub const STATUS_SLOTS: usize = STATUS_CODES.len() + STATUS_CLASSES.len();

fn status_slot(code: u16) -> usize {
    match STATUS_CODES.iter().position(|&c| c == code) {
        Some(i) => i,
        None => STATUS_CODES.len() + (code / 100).clamp(1, 5) as usize - 1,
    }
}

fn slot_label(slot: usize, out: &mut String) {
    if slot < STATUS_CODES.len() {
        let _ = write!(out, "{}", STATUS_CODES[slot]);
    } else {
        out.push_str(STATUS_CLASSES[slot - STATUS_CODES.len()]);
    }
}

/// Request counters of one (endpoint, variant, instance) route, by decision and status.
#[derive(Debug)]
pub struct RouteStats {
    counts: Box<[AtomicU64]>,
}

impl Default for RouteStats {
    fn default() -> Self {
        RouteStats {
            counts: (0..Decision::ALL.len() * STATUS_SLOTS)
                .map(|_| AtomicU64::new(0))
                .collect(),
        }
    }
}

impl RouteStats {
    pub fn record(&self, decision: Decision, status: u16) {
        self.counts[decision as usize * STATUS_SLOTS + status_slot(status)].fetch_add(1, Relaxed);
    }

    pub fn get(&self, decision: Decision, status: u16) -> u64 {
        self.counts[decision as usize * STATUS_SLOTS + status_slot(status)].load(Relaxed)
    }
}

/// Upper bounds of the decision-latency buckets, in nanoseconds.
const DECISION_BUCKETS_NS: [u64; 33] = [
    250, 500, 750, 1_000, 1_500, 2_000, 2_500, 3_000, 3_500, 4_000, 5_000, 6_000, 7_000, 8_000,
    10_000, 12_500, 15_000, 20_000, 25_000, 30_000, 40_000, 50_000, 75_000, 100_000, 150_000,
    200_000, 300_000, 500_000, 750_000, 1_000_000, 2_500_000, 5_000_000, 10_000_000,
];

/// A fixed-bucket latency histogram in atomics.
#[derive(Debug)]
pub struct Histogram {
    buckets: [AtomicU64; DECISION_BUCKETS_NS.len() + 1],
    sum_ns: AtomicU64,
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram {
            buckets: std::array::from_fn(|_| AtomicU64::new(0)),
            sum_ns: AtomicU64::new(0),
        }
    }
}

impl Histogram {
    pub fn observe(&self, d: Duration) {
        let ns = d.as_nanos().min(u64::MAX as u128) as u64;
        let i = DECISION_BUCKETS_NS.partition_point(|&b| b < ns);
        self.buckets[i].fetch_add(1, Relaxed);
        self.sum_ns.fetch_add(ns, Relaxed);
    }

    pub fn count(&self) -> u64 {
        self.buckets.iter().map(|b| b.load(Relaxed)).sum()
    }

    fn render(&self, name: &str, help: &str, out: &mut String) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cumulative = 0;
        for (i, bucket) in self.buckets.iter().enumerate() {
            cumulative += bucket.load(Relaxed);
            match DECISION_BUCKETS_NS.get(i) {
                Some(&ns) => {
                    let _ = writeln!(
                        out,
                        "{name}_bucket{{le=\"{}\"}} {cumulative}",
                        ns as f64 / 1e9
                    );
                }
                None => {
                    let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {cumulative}");
                }
            }
        }
        let _ = writeln!(out, "{name}_sum {}", self.sum_ns.load(Relaxed) as f64 / 1e9);
        let _ = writeln!(out, "{name}_count {cumulative}");
    }
}

/// Router-wide metrics.
#[derive(Debug, Default)]
pub struct Metrics {
    /// Routing-decision latency: body parse, key hash, endpoint/variant/instance choice.
    pub decision: Histogram,
    /// Requests answered without reaching an instance (no table, unknown endpoint, 413...).
    unrouted: [AtomicU64; STATUS_SLOTS],
    pub table_version: AtomicU64,
    pub tables_applied: AtomicU64,
    pub tables_rejected: AtomicU64,
    pub control_plane_connected: AtomicU64,
    pub retries: AtomicU64,
    pub ejections: Arc<AtomicU64>,
    /// Open client connections per worker thread (`serve` hands a new one to the lowest).
    pub worker_connections: Box<[AtomicU64]>,
}

impl Metrics {
    /// Metrics of a router with `workers` worker threads.
    pub fn with_workers(workers: usize) -> Self {
        Metrics {
            worker_connections: (0..workers).map(|_| AtomicU64::new(0)).collect(),
            ..Metrics::default()
        }
    }

    pub fn record_unrouted(&self, status: u16) {
        self.unrouted[status_slot(status)].fetch_add(1, Relaxed);
    }

    /// The Prometheus text exposition.
    pub fn render(&self, table: Option<&RoutingTable>, prefix_index_entries: usize) -> String {
        let mut out = String::with_capacity(4096);
        out.push_str(
            "# HELP prefix_router_requests_total Requests by endpoint, variant, instance, routing decision and response status.\n\
             # TYPE prefix_router_requests_total counter\n",
        );
        let mut line = String::new();
        for (slot, count) in self.unrouted.iter().enumerate() {
            let n = count.load(Relaxed);
            if n > 0 {
                line.clear();
                slot_label(slot, &mut line);
                let _ = writeln!(
                    out,
                    "prefix_router_requests_total{{endpoint=\"\",variant=\"\",instance=\"\",decision=\"none\",status=\"{line}\"}} {n}"
                );
            }
        }
        let mut in_flight = String::new();
        let mut ejected = String::new();
        let now = crate::load::now_ms();
        if let Some(table) = table {
            for endpoint in table.endpoints() {
                for variant in endpoint.variants() {
                    for instance in variant.instances() {
                        let labels = format!(
                            "endpoint=\"{}\",variant=\"{}\",instance=\"{}\"",
                            escape(endpoint.name()),
                            escape(variant.name()),
                            escape(instance.address())
                        );
                        for decision in Decision::ALL {
                            for slot in 0..STATUS_SLOTS {
                                let n = instance.stats().counts
                                    [decision as usize * STATUS_SLOTS + slot]
                                    .load(Relaxed);
                                if n > 0 {
                                    line.clear();
                                    slot_label(slot, &mut line);
                                    let _ = writeln!(
                                        out,
                                        "prefix_router_requests_total{{{labels},decision=\"{}\",status=\"{line}\"}} {n}",
                                        decision.as_str()
                                    );
                                }
                            }
                        }
                        let _ = writeln!(
                            in_flight,
                            "prefix_router_instance_in_flight{{{labels}}} {}",
                            instance.state().outstanding()
                        );
                        let _ = writeln!(
                            ejected,
                            "prefix_router_instance_ejected{{{labels}}} {}",
                            u8::from(instance.state().is_ejected(now))
                        );
                    }
                }
            }
        }
        out.push_str(
            "# HELP prefix_router_instance_in_flight Requests in flight per instance (until the response body ends).\n\
             # TYPE prefix_router_instance_in_flight gauge\n",
        );
        out.push_str(&in_flight);
        out.push_str(
            "# HELP prefix_router_instance_ejected 1 while passive health keeps the instance out of placement.\n\
             # TYPE prefix_router_instance_ejected gauge\n",
        );
        out.push_str(&ejected);
        self.decision.render(
            "prefix_router_route_decision_seconds",
            "Routing decision latency: body parse, prefix hash and instance choice.",
            &mut out,
        );
        let gauges: [(&str, &str, &str, u64); 7] = [
            (
                "prefix_router_table_version",
                "gauge",
                "Version of the routing table being served (0 = none).",
                self.table_version.load(Relaxed),
            ),
            (
                "prefix_router_tables_applied_total",
                "counter",
                "Routing tables applied (ACKed or loaded from the cache).",
                self.tables_applied.load(Relaxed),
            ),
            (
                "prefix_router_tables_rejected_total",
                "counter",
                "Routing tables rejected (NACKed) as invalid.",
                self.tables_rejected.load(Relaxed),
            ),
            (
                "prefix_router_control_plane_connected",
                "gauge",
                "1 while the routing-table watch stream is up.",
                self.control_plane_connected.load(Relaxed),
            ),
            (
                "prefix_router_retries_total",
                "counter",
                "Requests retried on another instance after a connect error or 5xx.",
                self.retries.load(Relaxed),
            ),
            (
                "prefix_router_ejections_total",
                "counter",
                "Instances ejected after repeated failures.",
                self.ejections.load(Relaxed),
            ),
            (
                "prefix_router_prefix_index_entries",
                "gauge",
                "Entries in the local prefix index (spilled keys).",
                prefix_index_entries as u64,
            ),
        ];
        for (name, kind, help, value) in gauges {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}"
            );
        }
        out.push_str(
            "# HELP prefix_router_worker_connections Open client connections per worker thread.\n\
             # TYPE prefix_router_worker_connections gauge\n",
        );
        for (worker, open) in self.worker_connections.iter().enumerate() {
            let _ = writeln!(
                out,
                "prefix_router_worker_connections{{worker=\"{worker}\"}} {}",
                open.load(Relaxed)
            );
        }
        out
    }
}

fn escape(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_slots_cover_every_code() {
        assert_eq!(status_slot(200), 0);
        assert_eq!(status_slot(504), STATUS_CODES.len() - 1);
        for code in [0u16, 100, 201, 302, 418, 599, 999] {
            assert!(status_slot(code) < STATUS_SLOTS);
        }
        let mut s = String::new();
        slot_label(status_slot(201), &mut s);
        assert_eq!(s, "2xx");
    }

    #[test]
    fn histogram_renders_cumulative_buckets() {
        let h = Histogram::default();
        h.observe(Duration::from_nanos(900));
        h.observe(Duration::from_micros(3));
        h.observe(Duration::from_secs(1));
        let mut out = String::new();
        h.render("x", "help", &mut out);
        assert!(out.contains("x_bucket{le=\"0.000001\"} 1\n"), "{out}");
        assert!(out.contains("x_bucket{le=\"0.000003\"} 2\n"), "{out}");
        assert!(out.contains("x_bucket{le=\"+Inf\"} 3\n"), "{out}");
        assert!(out.contains("x_count 3\n"));
    }
}
