//! Flow control's metrics: requests waiting by priority and by tenant, how long they waited, and
//! refusals by reason; rendered into the router's `/metrics` by [`FlowMetrics::describe`].
//!
//! Tenants are named by clients (`x-prefix-router-tenant`) as well as by API-key files, so the
//! per-tenant gauge is bounded: the first [`TENANT_SERIES`] tenants this router sees waiting get
//! series of their own, later ones share `tenant="other"`. A waiting request resolves its tenant's
//! [`TenantSeries`] once; taking and leaving its place are then one atomic add each.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, RwLock};

use telemetry::exposition::Exposition;

use super::Refused;
use crate::histogram::Histogram;
use crate::priority::Priority;

/// Tenants with series of their own in `prefix_router_tenant_queue_depth`.
pub const TENANT_SERIES: usize = 64;

/// The `tenant` label of every tenant past the first [`TENANT_SERIES`] (and of one named so).
pub const OTHER_TENANT: &str = "other";

/// Upper bounds of the queue-wait buckets, in nanoseconds (1 ms to 60 s).
const WAIT_BUCKETS_NS: &[u64] = &[
    1_000_000,
    2_500_000,
    5_000_000,
    10_000_000,
    25_000_000,
    50_000_000,
    100_000_000,
    250_000_000,
    500_000_000,
    1_000_000_000,
    2_500_000_000,
    5_000_000_000,
    10_000_000_000,
    30_000_000_000,
    60_000_000_000,
];

/// Flow-control metrics.
#[derive(Debug)]
pub struct FlowMetrics {
    /// Requests waiting now, by priority (index: `Priority as usize`).
    pub depth: [AtomicU64; 3],
    /// Requests waiting now by [`TenantSeries`] (the last one is `other`), then priority.
    tenant_depth: Box<[[AtomicU64; 3]]>,
    /// The tenants with series of their own, in the order they were first seen (the index is
    /// their [`TenantSeries`]).
    tenants: RwLock<Vec<Arc<str>>>,
    /// Refusals by [`Refused`] (index: position in `Refused::ALL`).
    pub refusals: [AtomicU64; 6],
    /// How long requests that waited waited (served or not).
    pub wait: Histogram,
}

/// A tenant's series in `prefix_router_tenant_queue_depth`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TenantSeries(usize);

impl TenantSeries {
    /// The series every tenant past the first [`TENANT_SERIES`] shares.
    pub const OTHER: TenantSeries = TenantSeries(TENANT_SERIES);
}

impl Default for FlowMetrics {
    fn default() -> Self {
        FlowMetrics {
            depth: Default::default(),
            tenant_depth: (0..=TENANT_SERIES).map(|_| Default::default()).collect(),
            tenants: RwLock::new(Vec::with_capacity(TENANT_SERIES)),
            refusals: Default::default(),
            wait: Histogram::with_bounds(WAIT_BUCKETS_NS),
        }
    }
}

impl FlowMetrics {
    pub fn refused(&self, why: Refused) {
        let i = Refused::ALL.iter().position(|&r| r == why).unwrap_or(0);
        self.refusals[i].fetch_add(1, Relaxed);
    }

    /// `tenant`'s series: its own once seen (while fewer than [`TENANT_SERIES`] have one), else
    /// [`TenantSeries::OTHER`]. Allocates only for a tenant's first request.
    pub fn tenant_series(&self, tenant: &str) -> TenantSeries {
        if tenant == OTHER_TENANT {
            return TenantSeries::OTHER;
        }
        let find = |tenants: &[Arc<str>]| tenants.iter().position(|t| **t == *tenant);
        let known = self.tenants.read().unwrap_or_else(|e| e.into_inner());
        if let Some(i) = find(&known) {
            return TenantSeries(i);
        }
        if known.len() >= TENANT_SERIES {
            return TenantSeries::OTHER;
        }
        drop(known);
        let mut known = self.tenants.write().unwrap_or_else(|e| e.into_inner());
        // another request may have added it (or filled the last series) meanwhile
        if let Some(i) = find(&known) {
            return TenantSeries(i);
        }
        if known.len() >= TENANT_SERIES {
            return TenantSeries::OTHER;
        }
        known.push(tenant.into());
        TenantSeries(known.len() - 1)
    }

    /// A request of `priority` and tenant `series` started waiting.
    pub fn queued(&self, priority: Priority, series: TenantSeries) {
        self.depth[priority as usize].fetch_add(1, Relaxed);
        self.tenant_depth[series.0][priority as usize].fetch_add(1, Relaxed);
    }

    /// A request counted by [`FlowMetrics::queued`] stopped waiting.
    pub fn left(&self, priority: Priority, series: TenantSeries) {
        self.depth[priority as usize].fetch_sub(1, Relaxed);
        self.tenant_depth[series.0][priority as usize].fetch_sub(1, Relaxed);
    }

    /// Adds the flow-control families to `out`.
    pub fn describe(&self, out: &mut Exposition) {
        let mut depth = out.gauge(
            "prefix_router_queue_depth",
            "Requests waiting in this router for an instance below its in-flight limit, by priority.",
        );
        for p in Priority::ALL {
            let n = self.depth[p as usize].load(Relaxed);
            depth.sample(&[("priority", p.as_str())], n as f64);
        }
        let mut by_tenant = out.gauge(
            "prefix_router_tenant_queue_depth",
            "Requests waiting in this router for an instance below its in-flight limit, by \
             priority and tenant. Only the first 64 tenants this router saw waiting (named by API \
             keys or x-prefix-router-tenant) have series of their own; later ones, and a tenant \
             named other, are summed in tenant=\"other\".",
        );
        let tenants = self.tenants.read().unwrap_or_else(|e| e.into_inner());
        let names = tenants.iter().map(|t| &**t).chain([OTHER_TENANT]);
        for (series, tenant) in self.tenant_depth.iter().zip(names) {
            for p in Priority::ALL {
                let n = series[p as usize].load(Relaxed);
                by_tenant.sample(&[("priority", p.as_str()), ("tenant", tenant)], n as f64);
            }
        }
        drop(tenants);
        let mut refused = out.counter(
            "prefix_router_queue_refusals_total",
            "Requests refused by flow control: queue_full (503), shed (503: its place went to a \
             more urgent request or a quieter tenant), queue_timeout (429), requests_per_minute \
             and tokens_per_minute (429: the tenant's rate limits), shutting_down (503).",
        );
        for (i, why) in Refused::ALL.iter().enumerate() {
            let n = self.refusals[i].load(Relaxed);
            refused.sample(&[("reason", why.as_str())], n as f64);
        }
        self.wait.describe(
            "prefix_router_queue_wait_seconds",
            "How long requests that waited for an instance waited, served or refused.",
            out,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_64_tenants_get_series_of_their_own_and_the_rest_share_other() {
        let m = FlowMetrics::default();
        let first: Vec<TenantSeries> = (0..TENANT_SERIES)
            .map(|i| m.tenant_series(&format!("t{i}")))
            .collect();
        assert_eq!(first[0], TenantSeries(0));
        assert_eq!(m.tenant_series("t0"), first[0], "resolved alike every time");
        assert_eq!(m.tenant_series("late"), TenantSeries::OTHER);
        assert_eq!(m.tenant_series(OTHER_TENANT), TenantSeries::OTHER);
        m.queued(Priority::Critical, first[3]);
        m.queued(Priority::Standard, m.tenant_series("late"));
        m.queued(Priority::Standard, m.tenant_series("later"));
        let mut out = Exposition::new();
        m.describe(&mut out);
        let text = out.render();
        let series = |labels: &str| {
            text.lines()
                .find_map(|l| {
                    l.strip_prefix(&format!("prefix_router_tenant_queue_depth{{{labels}}} "))
                })
                .unwrap_or_else(|| panic!("no series {labels}: {text}"))
                .to_string()
        };
        assert_eq!(series(r#"priority="critical",tenant="t3""#), "1");
        assert_eq!(series(r#"priority="standard",tenant="other""#), "2");
        assert!(!text.contains("tenant=\"late"), "{text}");
        let count = text
            .lines()
            .filter(|l| l.starts_with("prefix_router_tenant_queue_depth{"))
            .count();
        assert_eq!(count, (TENANT_SERIES + 1) * 3);
        m.left(Priority::Critical, first[3]);
        assert_eq!(m.depth[Priority::Critical as usize].load(Relaxed), 0);
    }
}
