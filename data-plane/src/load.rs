//! Per-instance load and health, shared by every table that lists the instance.
//!
//! These structs live behind `Arc`s keyed by instance id; a new routing table reuses the ones of
//! instances that are still there, so in-flight counts and ejections survive a table swap.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use crate::upstream::Pool;

/// Consecutive failures (connect errors, 5xx) after which an instance is ejected.
pub const EJECT_AFTER_FAILURES: u32 = 3;
/// First ejection length; each further ejection without a success in between doubles it.
pub const EJECT_BASE: Duration = Duration::from_secs(5);
/// Longest ejection.
pub const EJECT_MAX: Duration = Duration::from_secs(60);

/// Milliseconds on a monotonic clock that starts at 1 (0 means "never").
pub fn now_ms() -> u64 {
    static START: OnceLock<Instant> = OnceLock::new();
    START.get_or_init(Instant::now).elapsed().as_millis() as u64 + 1
}

/// Load and passive-health state of one model-server instance.
#[derive(Debug, Default)]
pub struct InstanceState {
    outstanding: AtomicU64,
    failures: AtomicU32,
    ejections: AtomicU32,
    ejected_until_ms: AtomicU64,
    /// Idle keep-alive connections to the instance.
    pool: Pool,
}

impl InstanceState {
    pub(crate) fn pool(&self) -> &Pool {
        &self.pool
    }

    /// Requests sent to the instance whose response body has not ended yet.
    pub fn outstanding(&self) -> u64 {
        self.outstanding.load(Relaxed)
    }

    pub fn is_ejected(&self, now_ms: u64) -> bool {
        now_ms < self.ejected_until_ms.load(Relaxed)
    }

    pub fn record_success(&self) {
        // Read first: no write (and no cache-line bouncing) on the common path.
        if self.failures.load(Relaxed) != 0 {
            self.failures.store(0, Relaxed);
        }
        if self.ejections.load(Relaxed) != 0 {
            self.ejections.store(0, Relaxed);
        }
    }

    /// Counts a failure; returns the ejection length if this failure ejected the instance.
    /// Failures are not reset by an ejection: once it runs out, one more failure ejects again,
    /// for twice as long.
    pub fn record_failure(&self, now_ms: u64) -> Option<Duration> {
        let failures = self.failures.fetch_add(1, Relaxed) + 1;
        if failures < EJECT_AFTER_FAILURES || self.is_ejected(now_ms) {
            return None;
        }
        let k = self.ejections.fetch_add(1, Relaxed).min(16);
        let length = EJECT_BASE.saturating_mul(1 << k).min(EJECT_MAX);
        self.ejected_until_ms
            .store(now_ms + length.as_millis() as u64, Relaxed);
        Some(length)
    }
}

/// Requests in flight through one production variant (the `m` of the bounded-load cap).
#[derive(Debug, Default)]
pub struct VariantLoad {
    outstanding: AtomicU64,
}

impl VariantLoad {
    pub fn outstanding(&self) -> u64 {
        self.outstanding.load(Relaxed)
    }
}

/// One request in flight on an instance: counted from the routing decision until this guard drops
/// (the end of the response body, or the client going away).
#[derive(Debug)]
pub struct InFlight {
    instance: Arc<InstanceState>,
    variant: Arc<VariantLoad>,
}

impl InFlight {
    /// The instance the request is on.
    pub fn instance(&self) -> &Arc<InstanceState> {
        &self.instance
    }

    pub fn start(instance: &Arc<InstanceState>, variant: &Arc<VariantLoad>) -> Self {
        instance.outstanding.fetch_add(1, Relaxed);
        variant.outstanding.fetch_add(1, Relaxed);
        InFlight {
            instance: instance.clone(),
            variant: variant.clone(),
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.instance.outstanding.fetch_sub(1, Relaxed);
        self.variant.outstanding.fetch_sub(1, Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_flight_counts_until_dropped() {
        let i = Arc::new(InstanceState::default());
        let v = Arc::new(VariantLoad::default());
        let a = InFlight::start(&i, &v);
        let b = InFlight::start(&i, &v);
        assert_eq!((i.outstanding(), v.outstanding()), (2, 2));
        drop(a);
        drop(b);
        assert_eq!((i.outstanding(), v.outstanding()), (0, 0));
    }

    #[test]
    fn ejection_after_three_failures_doubles_and_resets_on_success() {
        let i = InstanceState::default();
        let t = 1000;
        assert_eq!(i.record_failure(t), None);
        assert_eq!(i.record_failure(t), None);
        assert_eq!(i.record_failure(t), Some(EJECT_BASE));
        assert!(i.is_ejected(t + 4999));
        assert!(!i.is_ejected(t + 5000));
        // once the ejection ran out, one more failure ejects for twice as long
        assert_eq!(i.record_failure(t + 5000), Some(EJECT_BASE * 2));
        i.record_success();
        let t2 = t + 20_000;
        assert_eq!(i.record_failure(t2), None);
        assert_eq!(i.record_failure(t2), None);
        assert_eq!(i.record_failure(t2), Some(EJECT_BASE));
    }
}
