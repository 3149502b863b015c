//! Per-instance load and health, shared by every table that lists the instance.
//!
//! These structs live behind `Arc`s keyed by instance id; a new routing table reuses the ones of
//! instances that are still there, so in-flight counts and ejections survive a table swap.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use crate::prefix_index::PrefixIndex;
use crate::queue::Queue;
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
    /// The instance's id, as flow control's waiters name their home and a freed place: the
    /// address of its state (the same `Arc` across tables that keep the instance; never 0).
    #[inline]
    pub fn id(&self) -> usize {
        std::ptr::from_ref(self) as usize
    }

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

    /// Whether the instance would take one more request now: fewer than `limit` in flight and
    /// not ejected (a read: [`InFlight::try_start`] is what takes the place).
    #[inline]
    pub fn takes(&self, limit: u64, now_ms: u64) -> bool {
        self.outstanding() < limit && !self.is_ejected(now_ms)
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

/// Load of one production variant: requests in flight, the flow-control queue and (PREFIX_AWARE)
/// the prefix index of its instances.
#[derive(Debug, Default)]
pub struct VariantLoad {
    outstanding: AtomicU64,
    index: OnceLock<PrefixIndex>,
    kv: OnceLock<Arc<crate::kv_index::KvIndex>>,
    /// Requests waiting for an instance below its in-flight limit ([`crate::flow`]).
    flow: Queue,
}

impl VariantLoad {
    pub fn outstanding(&self) -> u64 {
        self.outstanding.load(Relaxed)
    }

    /// The variant's flow-control queue.
    #[inline]
    pub fn flow(&self) -> &Queue {
        &self.flow
    }

    /// The prefix index of the variant's instances (made on first use: none for a variant that
    /// never was PREFIX_AWARE).
    pub fn index(&self) -> &PrefixIndex {
        self.index.get_or_init(PrefixIndex::default)
    }

    /// The exact prefix index fed by the engines' KV events (made on first use).
    pub fn kv(&self) -> &Arc<crate::kv_index::KvIndex> {
        self.kv.get_or_init(Default::default)
    }

    /// The exact index, if one was ever made.
    pub fn kv_if_any(&self) -> Option<&Arc<crate::kv_index::KvIndex>> {
        self.kv.get()
    }

    /// The prefix index, if one was ever made.
    pub fn index_if_any(&self) -> Option<&PrefixIndex> {
        self.index.get()
    }
}

/// One request in flight on an instance: counted from the routing decision until this guard drops
/// (the end of the response body, or the client going away).
#[derive(Debug)]
pub struct InFlight {
    instance: Arc<InstanceState>,
    variant: Arc<VariantLoad>,
    /// Requests in flight on the instance when this one started, and when that was.
    queued: u64,
    since: Instant,
}

impl InFlight {
    /// The instance the request is on.
    pub fn instance(&self) -> &Arc<InstanceState> {
        &self.instance
    }

    /// The variant the request is in.
    pub fn variant(&self) -> &Arc<VariantLoad> {
        &self.variant
    }

    pub fn start(instance: &Arc<InstanceState>, variant: &Arc<VariantLoad>) -> Self {
        let before = instance.outstanding.fetch_add(1, Relaxed);
        variant.outstanding.fetch_add(1, Relaxed);
        Self::started(instance, variant, before)
    }

    fn started(instance: &Arc<InstanceState>, variant: &Arc<VariantLoad>, before: u64) -> Self {
        InFlight {
            instance: instance.clone(),
            variant: variant.clone(),
            queued: before,
            since: Instant::now(),
        }
    }

    /// Requests in flight on the instance (this router's) when this one started.
    pub fn queued(&self) -> u64 {
        self.queued
    }

    /// How long the request has been in flight.
    pub fn elapsed(&self) -> Duration {
        self.since.elapsed()
    }

    /// [`InFlight::start`] if the instance has fewer than `limit` requests in flight and the
    /// variant fewer than `variant_cap` (if any), each count raised only from below its bound
    /// (compare and swap): two requests that checked the counts first and then took places both
    /// took the last one (on two worker threads, a sheddable request took the place kept for
    /// critical ones). No count ever passes its bound, and a failed try wakes no one (a wake per
    /// failed try would pass a full fleet's waiters back and forth). With a cap, the variant's
    /// count is taken first and given back if the instance is full: a sheddable waiter that
    /// reads it in between sees no room and waits for the next place to free, or its deadline.
    pub fn try_start(
        instance: &Arc<InstanceState>,
        variant: &Arc<VariantLoad>,
        limit: u64,
        variant_cap: Option<u64>,
    ) -> Option<Self> {
        let below = |bound: u64| move |c: u64| (c < bound).then_some(c + 1);
        let before = if let Some(cap) = variant_cap {
            variant
                .outstanding
                .fetch_update(Relaxed, Relaxed, below(cap))
                .ok()?;
            match instance
                .outstanding
                .fetch_update(Relaxed, Relaxed, below(limit))
            {
                Ok(before) => before,
                Err(_) => {
                    variant.outstanding.fetch_sub(1, Relaxed);
                    return None;
                }
            }
        } else {
            let before = instance
                .outstanding
                .fetch_update(Relaxed, Relaxed, below(limit))
                .ok()?;
            variant.outstanding.fetch_add(1, Relaxed);
            before
        };
        Some(Self::started(instance, variant, before))
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.instance.outstanding.fetch_sub(1, Relaxed);
        self.variant.outstanding.fetch_sub(1, Relaxed);
        // its place may go to a request waiting for one (the fence pairs with the waiter's
        // after it queues: one of the two sees the other)
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        self.variant.flow.release(self.instance.id());
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
    fn a_place_is_taken_as_it_is_counted_so_the_last_one_goes_to_one_request() {
        let (i, j) = (
            Arc::new(InstanceState::default()),
            Arc::new(InstanceState::default()),
        );
        let v = Arc::new(VariantLoad::default());
        // an instance that runs one request: the second asking for it gets none, and its try
        // leaves the counts as they were
        let a = InFlight::try_start(&i, &v, 1, None).expect("a free instance");
        assert!(InFlight::try_start(&i, &v, 1, None).is_none());
        assert_eq!((i.outstanding(), v.outstanding()), (1, 1));
        // the variant's cap holds across its instances
        assert!(InFlight::try_start(&j, &v, 1, Some(1)).is_none());
        let b = InFlight::try_start(&j, &v, 1, Some(2)).expect("under the cap");
        assert_eq!(v.outstanding(), 2);
        drop((a, b));
        // many threads after 3 places: exactly 3 get one
        let taken: Vec<bool> = std::thread::scope(|s| {
            let tries: Vec<_> = (0..8)
                .map(|_| {
                    s.spawn(|| {
                        let place = InFlight::try_start(&i, &v, 3, None);
                        let got = place.is_some();
                        std::mem::forget(place); // held until the count below
                        got
                    })
                })
                .collect();
            tries.into_iter().map(|t| t.join().unwrap()).collect()
        });
        assert_eq!(taken.iter().filter(|&&t| t).count(), 3);
        assert_eq!(i.outstanding(), 3);
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
