//! Flow control: when every instance a request may use is at its in-flight limit, the request
//! waits in the router instead of piling onto an engine's own queue.
//!
//! - **Limit.** An instance takes a request while it has fewer in flight from this router than
//!   its variant's limit: PREFIX_AWARE's `concurrency_threshold`, else `--instance-max-in-flight`;
//!   a sheddable request only while it has fewer than three quarters of that (the rest is kept
//!   for standard and critical requests: a critical one arriving in a sheddable flood finds a
//!   place at once instead of waiting for one to free), and only while the variant's requests in
//!   flight are fewer than three quarters of all its places (so that engines that run one
//!   request each, whose own quarter rounds to none, still keep one in four for the others).
//!   The placement's choice goes first; when it is full the request takes the first free instance
//!   (PREFIX_AWARE: of the key's ranking; else the least loaded), and only when none is free does
//!   it queue.
//! - **Order.** Strict priority between classes (`critical`, then `standard`, then
//!   `sheddable`); within a class, round robin between tenants, each tenant first in, first out.
//!   Fair by requests, not by prompt tokens: a request's cost to the engine is not known before
//!   the engine reports it (most of a long prompt may be cached), and one request per turn keeps a
//!   tenant of short chats from waiting behind another's long documents any more than behind its
//!   own. A newcomer queues behind those already waiting.
//! - **Wake.** Every request that leaves an instance ([`crate::load::InFlight`]'s drop) hands its
//!   place to the next waiter of the variant that takes it. The waiter takes its placement's
//!   instance if that one is free, else the first free one; if another request took the place
//!   first it queues again, at the front. A PREFIX_AWARE waiter holds out for its own instance
//!   (whose cache has its prefix; when all are full, placement names it) for the first
//!   [`PATIENCE_SHARE`] of its wait: a place freed elsewhere goes first to the next waiter whose
//!   own instance it is, or who holds out no longer, and only then to it (no place stays idle
//!   while anyone waits: an idle place cost more served requests than the misses it saved, on
//!   the overload soak). A new table wakes as many of a variant's waiters as it has free
//!   places (an instance joined), and every waiter of a variant it no longer has; a waiter woken
//!   under a table that is no longer served routes again by the new one (still at the front, its
//!   deadline unchanged).
//! - **Bounds.** Each waiter has a deadline (`--queue-timeout-ms`, or less from the client's
//!   `x-prefix-router-queue-timeout-ms`): past it, 429 with Retry-After. At most `--max-queued`
//!   wait in the router: past it a request takes the place of the youngest waiter of the least
//!   urgent class below its own in the variant (which gets 503); failing that, one whose tenant
//!   has fewer waiting in its class takes the place of the youngest waiter of the tenant with the
//!   most (a flood does not shut a quieter tenant out); else it is refused with 503.
//!   A client that goes away leaves the queue at once (its ticket is dropped with the request).
//!   When the router starts shutting down, every waiter is answered 503 (`shutting_down`) at
//!   once and nothing starts waiting; requests already forwarded finish within the grace.
//!
//! Nothing here runs while no one waits: the request path reads one atomic and the chosen
//! instance's in-flight count.

use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use http::header::{HeaderMap, HeaderName, HeaderValue};
use tokio::sync::oneshot;

mod metrics;
mod rates;
pub use metrics::{FlowMetrics, TenantSeries, OTHER_TENANT, TENANT_SERIES};
pub use rates::{RateLimits, RateReport, RateState};

use crate::load::{now_ms, VariantLoad};
use crate::priority::{Priority, Who};
use crate::queue::{Grant, Home};
use crate::table::{RoutingTable, Strategy, Variant};

pub const X_QUEUE_TIMEOUT_MS: HeaderName =
    HeaderName::from_static("x-prefix-router-queue-timeout-ms");
/// On a response that waited: how long, in milliseconds.
pub const X_QUEUED_MS: HeaderName = HeaderName::from_static("x-prefix-router-queued-ms");

/// The router's flow-control settings and the count of requests waiting in it.
#[derive(Debug)]
pub struct FlowControl {
    enabled: bool,
    instance_max_in_flight: u64,
    queue_timeout: Duration,
    max_queued: usize,
    queued: AtomicUsize,
    /// Tenants' `rpm=`/`tpm=` buckets.
    pub rates: RateLimits,
    /// Set when the router starts shutting down: waiters are answered 503, none start waiting.
    draining: std::sync::atomic::AtomicBool,
    drained: tokio::sync::Notify,
}

/// What [`FlowControl`] is told at start (from `--flow-control`, `--instance-max-in-flight`,
/// `--queue-timeout-ms` and `--max-queued`).
#[derive(Debug, Clone, Copy)]
pub struct Settings {
    pub enabled: bool,
    pub instance_max_in_flight: u64,
    pub queue_timeout: Duration,
    pub max_queued: usize,
}

impl FlowControl {
    pub fn new(settings: Settings) -> Self {
        FlowControl {
            enabled: settings.enabled,
            instance_max_in_flight: settings.instance_max_in_flight,
            queue_timeout: settings.queue_timeout,
            max_queued: settings.max_queued,
            queued: AtomicUsize::new(0),
            rates: RateLimits::default(),
            draining: Default::default(),
            drained: tokio::sync::Notify::new(),
        }
    }

    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// The in-flight limit of an instance of a variant whose strategy gives `threshold`
    /// (PREFIX_AWARE's `concurrency_threshold`), else `--instance-max-in-flight`, for a request
    /// of `priority`: a sheddable one may fill three quarters of it (the last quarter, rounded
    /// down, is kept for standard and critical requests, so that a flood of sheddable work
    /// never makes them wait for a place).
    pub fn limit(&self, threshold: Option<u32>, priority: Priority) -> u64 {
        let limit = threshold.map_or(self.instance_max_in_flight, u64::from);
        match priority {
            Priority::Sheddable => limit - limit / 4,
            Priority::Standard | Priority::Critical => limit,
        }
    }

    /// [`FlowControl::limit`] for an instance of `v`.
    pub fn variant_limit(&self, v: &Variant, priority: Priority) -> u64 {
        let threshold = match v.strategy() {
            Strategy::PrefixAware(pa) => Some(pa.concurrency_threshold),
            _ => None,
        };
        self.limit(threshold, priority)
    }

    /// Whether `v` as a whole has room for a request of `priority`: a sheddable one only while
    /// its requests in flight from this router are fewer than three quarters of its places
    /// (instances times [`FlowControl::limit`], the last quarter rounded down). This keeps a place
    /// for standard and critical requests where the per-instance quarter rounds to none: four
    /// engines that run one request each keep one engine for them.
    pub fn variant_room(&self, v: &Variant, priority: Priority) -> bool {
        self.variant_cap(v, priority)
            .is_none_or(|cap| v.load().outstanding() < cap)
    }

    /// The most requests of `priority` `v` may have in flight from this router as a whole (see
    /// [`FlowControl::variant_room`]; `None`: no cap but the instances' own).
    pub fn variant_cap(&self, v: &Variant, priority: Priority) -> Option<u64> {
        (priority == Priority::Sheddable).then(|| {
            let places = v.instances().len() as u64 * self.variant_limit(v, Priority::Critical);
            places - places / 4
        })
    }

    /// `new` now serves in place of `old`: each of its variants' waiters may take a place it adds
    /// (an instance that joined a full fleet), and the waiters of a variant it no longer has must
    /// go by it rather than wait for a place no table serves. Woken, each routes again (see the
    /// module doc).
    pub fn table_changed(&self, old: Option<&RoutingTable>, new: &RoutingTable) {
        if self.queued() == 0 {
            return;
        }
        let now = now_ms();
        let kept = variants(new);
        for v in &kept {
            let queue = v.load().flow();
            if queue.is_empty() {
                continue;
            }
            let limit = self.variant_limit(v, Priority::Critical);
            let free: u64 = v
                .instances()
                .iter()
                .filter(|i| !i.state().is_ejected(now))
                .map(|i| limit.saturating_sub(i.state().outstanding()))
                .sum();
            for _ in 0..free.min(queue.len() as u64) {
                queue.release(0);
            }
        }
        for v in old.map(variants).unwrap_or_default() {
            if !kept.iter().any(|k| Arc::ptr_eq(k.load(), v.load())) {
                v.load().flow().release_all();
            }
        }
    }

    /// How long a request may wait: `--queue-timeout-ms`, or less if the client asks.
    pub fn timeout(&self, headers: &HeaderMap) -> Result<Duration, String> {
        match headers.get(X_QUEUE_TIMEOUT_MS) {
            None => Ok(self.queue_timeout),
            Some(v) => {
                let ms: u64 = v
                    .to_str()
                    .ok()
                    .and_then(|s| s.parse().ok())
                    .ok_or_else(|| {
                        format!(
                            "invalid {X_QUEUE_TIMEOUT_MS} {:?}: expected milliseconds",
                            String::from_utf8_lossy(v.as_bytes())
                        )
                    })?;
                Ok(self.queue_timeout.min(Duration::from_millis(ms)))
            }
        }
    }

    /// Requests waiting in this router now.
    pub fn queued(&self) -> usize {
        self.queued.load(Relaxed)
    }

    /// The router is shutting down: every waiter is answered (503 `shutting_down`) at once, and
    /// no request starts waiting (those already forwarded finish).
    pub fn drain(&self) {
        self.draining.store(true, Relaxed);
        self.drained.notify_waiters();
    }

    fn is_draining(&self) -> bool {
        self.draining.load(Relaxed)
    }
}

/// `--flow-control`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Switch {
    On,
    Off,
}

/// Why a request that waited, or would have, is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// `--max-queued` reached (503).
    Full,
    /// Its place was given to a more urgent request (503).
    Shed,
    /// Its deadline passed while it waited (429).
    Timeout,
    /// Its tenant is over its requests per minute (429).
    Requests,
    /// Its tenant is over its prompt tokens per minute (429).
    Tokens,
    /// The router is shutting down: it takes no more waiting work (503).
    Draining,
}

impl Refused {
    pub const ALL: [Refused; 6] = [
        Refused::Full,
        Refused::Shed,
        Refused::Timeout,
        Refused::Requests,
        Refused::Tokens,
        Refused::Draining,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Refused::Full => "queue_full",
            Refused::Shed => "shed",
            Refused::Timeout => "queue_timeout",
            Refused::Requests => "requests_per_minute",
            Refused::Tokens => "tokens_per_minute",
            Refused::Draining => "shutting_down",
        }
    }

    pub fn status(self) -> u16 {
        match self {
            Refused::Timeout | Refused::Requests | Refused::Tokens => 429,
            Refused::Full | Refused::Shed | Refused::Draining => 503,
        }
    }

    pub fn message(self, waited: Duration) -> String {
        match self {
            Refused::Full => {
                "every instance is at its in-flight limit and the router's queue is full \
                 (--max-queued); retry shortly"
                    .to_string()
            }
            Refused::Shed => "every instance is at its in-flight limit and this request's \
                 place in the full queue went to a more urgent request, or to a tenant with fewer \
                 waiting; retry shortly"
                .to_string(),
            Refused::Timeout => format!(
                "every instance stayed at its in-flight limit for the {} ms this request may \
                 wait (--queue-timeout-ms or x-prefix-router-queue-timeout-ms); retry shortly",
                waited.as_millis()
            ),
            Refused::Draining => "the router is shutting down and takes no more waiting \
                 requests; retry on another replica"
                .to_string(),
            Refused::Requests | Refused::Tokens => format!(
                "rate limit reached on {} per minute for this API key's tenant; retry in {} ms",
                match self {
                    Refused::Requests => "requests",
                    _ => "prompt tokens",
                },
                waited.as_millis()
            ),
        }
    }
}

/// The share of its wait during which a PREFIX_AWARE request lets other waiters take places freed
/// away from its own instance (whose cache has its prefix) first.
pub const PATIENCE_SHARE: f64 = 0.25;

/// Requests waiting per endpoint of `table`, by priority: endpoints where none waits are left out.
pub fn endpoint_queues(table: &RoutingTable) -> Vec<proto::EndpointQueue> {
    table
        .endpoints()
        .filter_map(|e| {
            let mut depths = [0u32; 3];
            for v in e.variants() {
                for (total, d) in depths.iter_mut().zip(v.load().flow().depths()) {
                    *total = total.saturating_add(d);
                }
            }
            (depths != [0; 3]).then(|| proto::EndpointQueue {
                endpoint_name: e.name().to_string(),
                critical: depths[Priority::Critical as usize],
                standard: depths[Priority::Standard as usize],
                sheddable: depths[Priority::Sheddable as usize],
            })
        })
        .collect()
}

/// A request's place in a variant's queue; leaving (drop) takes it out.
pub struct Ticket<'a> {
    flow: &'a FlowControl,
    metrics: &'a FlowMetrics,
    load: Arc<VariantLoad>,
    who: Who,
    series: TenantSeries,
    id: u64,
    wake: oneshot::Receiver<Grant>,
    /// Still in the variant's queue (not yet granted or shed).
    queued: bool,
}

impl<'a> Ticket<'a> {
    /// Queues `who` (counted in its tenant's `series`) on `load`'s variant (`front`: a waiter
    /// whose granted place was taken comes back first), first in line for places on its
    /// [`Home`]. Refused when `--max-queued` wait already, unless a sheddable waiter of the
    /// variant can give its place to a more urgent request.
    pub fn take(
        flow: &'a FlowControl,
        metrics: &'a FlowMetrics,
        load: &Arc<VariantLoad>,
        who: &Who,
        series: TenantSeries,
        front: bool,
        home: Home,
    ) -> Result<Self, Refused> {
        if flow.is_draining() {
            return Err(Refused::Draining);
        }
        let mut line = load.flow().line();
        if flow.queued.fetch_add(1, Relaxed) >= flow.max_queued && !line.shed_for(who) {
            flow.queued.fetch_sub(1, Relaxed);
            return Err(Refused::Full);
        }
        let (id, wake) = line.join(who, home, front);
        metrics.queued(who.priority, series);
        Ok(Ticket {
            flow,
            metrics,
            load: load.clone(),
            who: who.clone(),
            series,
            id,
            wake,
            queued: true,
        })
    }

    /// Waits until a place frees (`Ok`), the request's place goes to a more urgent one, or
    /// `until` passes.
    pub async fn wait(&mut self, until: tokio::time::Instant) -> Result<(), Refused> {
        let drained = self.flow.drained.notified();
        tokio::pin!(drained);
        drained.as_mut().enable(); // registered before the check: a drain in between wakes it
        if self.flow.is_draining() {
            return Err(Refused::Draining);
        }
        let grant = tokio::select! {
            // a grant that came in time wins over a deadline that passed meanwhile
            biased;
            g = &mut self.wake => g.unwrap_or(Grant::Go(0)),
            () = tokio::time::sleep_until(until) => return Err(Refused::Timeout),
            () = drained => return Err(Refused::Draining),
        };
        self.queued = false;
        match grant {
            Grant::Go(_) => Ok(()),
            Grant::Shed => Err(Refused::Shed),
        }
    }
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        self.flow.queued.fetch_sub(1, Relaxed);
        self.metrics.left(self.who.priority, self.series);
        if !self.queued {
            return;
        }
        let queue = self.load.flow();
        let removed = queue.leave(&self.who, self.id);
        // Granted as it left (a place freed for it that it will not take): pass it on.
        if !removed {
            if let Ok(Grant::Go(freed)) = self.wake.try_recv() {
                queue.release(freed);
            }
        }
    }
}

/// Prompt tokens of a request before any engine has seen it: about 4 bytes a token.
pub fn estimated_tokens(body: &[u8]) -> u64 {
    (body.len() as u64).div_ceil(4)
}

/// How long since `start`, for the `x-prefix-router-queued-ms` header.
pub fn queued_header(start: Instant) -> HeaderValue {
    HeaderValue::from(start.elapsed().as_millis() as u64)
}

fn variants(t: &RoutingTable) -> Vec<&Variant> {
    t.endpoints().flat_map(|e| e.variants().iter()).collect()
}
