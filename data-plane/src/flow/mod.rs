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

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use http::header::{HeaderMap, HeaderName, HeaderValue};
use tokio::sync::oneshot;

mod metrics;
mod rates;
pub use metrics::{FlowMetrics, TenantSeries, OTHER_TENANT, TENANT_SERIES};
pub use rates::{RateLimits, RateReport, RateState};

use crate::config::Config;
use crate::load::{now_ms, VariantLoad};
use crate::table::{RoutingTable, Strategy, Variant};

pub const X_TENANT: HeaderName = HeaderName::from_static("x-prefix-router-tenant");
pub const X_PRIORITY: HeaderName = HeaderName::from_static("x-prefix-router-priority");
pub const X_QUEUE_TIMEOUT_MS: HeaderName =
    HeaderName::from_static("x-prefix-router-queue-timeout-ms");
/// On a response that waited: how long, in milliseconds.
pub const X_QUEUED_MS: HeaderName = HeaderName::from_static("x-prefix-router-queued-ms");

/// The longest tenant name a header or key file may give.
pub const MAX_TENANT_LEN: usize = 64;

/// How urgent a request is. Ordered: a higher one is served first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub enum Priority {
    Sheddable = 0,
    #[default]
    Standard = 1,
    Critical = 2,
}

impl Priority {
    pub const ALL: [Priority; 3] = [Priority::Critical, Priority::Standard, Priority::Sheddable];

    pub fn as_str(self) -> &'static str {
        match self {
            Priority::Sheddable => "sheddable",
            Priority::Standard => "standard",
            Priority::Critical => "critical",
        }
    }

    /// A request's priority: `x-prefix-router-priority` (default: `default`, its variant's
    /// `default_priority`) capped by its key's (`standard` for a key that names none; `None`: no
    /// keys, the header is trusted).
    pub fn of(
        headers: &HeaderMap,
        key: Option<&KeyPolicy>,
        default: Priority,
    ) -> Result<Priority, String> {
        let asked = match headers.get(X_PRIORITY) {
            None => default,
            Some(v) => v.to_str().ok().and_then(Priority::parse).ok_or_else(|| {
                format!(
                    "invalid {X_PRIORITY} {:?}: expected critical, standard or sheddable",
                    String::from_utf8_lossy(v.as_bytes())
                )
            })?,
        };
        Ok(match key {
            Some(k) => asked.min(k.priority.unwrap_or(Priority::Standard)),
            None => asked,
        })
    }

    pub fn parse(s: &str) -> Option<Priority> {
        match s {
            "sheddable" => Some(Priority::Sheddable),
            "standard" => Some(Priority::Standard),
            "critical" => Some(Priority::Critical),
            _ => None,
        }
    }
}

/// What an API key's line in `--api-key-file` says of its holder: `KEY [tenant=NAME]
/// [priority=P]`. A key without a priority may ask for `standard` at most.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KeyPolicy {
    pub tenant: Option<Arc<str>>,
    pub priority: Option<Priority>,
    /// `rpm=N tpm=N`: the tenant's rate limits (a line with them must name its tenant).
    pub rates: Rates,
}

/// A tenant's rate limits: requests and prompt tokens per minute.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Rates {
    pub requests_per_minute: Option<u32>,
    pub tokens_per_minute: Option<u32>,
}

impl Rates {
    pub fn is_limited(&self) -> bool {
        self.requests_per_minute.is_some() || self.tokens_per_minute.is_some()
    }
}

impl KeyPolicy {
    /// Parses the text after a key (`credentials::LabelParser`); errors name the field.
    pub fn parse(label: Option<&str>) -> Result<KeyPolicy, String> {
        let mut policy = KeyPolicy::default();
        for field in label.unwrap_or("").split_whitespace() {
            match field.split_once('=') {
                Some(("tenant", name)) => {
                    check_tenant(name).map_err(|e| format!("tenant={name:?}: {e}"))?;
                    policy.tenant = Some(name.into());
                }
                Some(("priority", p)) => {
                    policy.priority = Some(Priority::parse(p).ok_or_else(|| {
                        format!("priority={p:?}: expected critical, standard or sheddable")
                    })?);
                }
                Some((name @ ("rpm" | "tpm"), n)) => {
                    let n: u32 = n.parse().ok().filter(|&n| n > 0).ok_or_else(|| {
                        format!("{name}={n:?}: expected a whole number of at least 1 per minute")
                    })?;
                    match name {
                        "rpm" => policy.rates.requests_per_minute = Some(n),
                        _ => policy.rates.tokens_per_minute = Some(n),
                    }
                }
                _ => {
                    return Err(format!(
                        "unexpected {:?} after the key: expected tenant=NAME, priority=P, rpm=N \
                         or tpm=N",
                        field.chars().take(24).collect::<String>()
                    ))
                }
            }
        }
        if policy.rates.is_limited() && policy.tenant.is_none() {
            return Err("rpm= and tpm= limit a tenant: add tenant=NAME".to_string());
        }
        Ok(policy)
    }
}

fn check_tenant(name: &str) -> Result<(), &'static str> {
    if name.is_empty() || name.len() > MAX_TENANT_LEN {
        return Err("a tenant name is 1 to 64 characters");
    }
    if !name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b"-_.:@".contains(&b))
    {
        return Err("a tenant name is letters, digits and - _ . : @");
    }
    Ok(())
}

/// The tenant `x-prefix-router-tenant` names, checked (`None`: the key names its tenant, or the
/// header is absent). Called on every request that flow control sees, so that a bad header is
/// refused whether the request would wait or not; nothing is kept.
pub fn tenant_header<'h>(
    headers: &'h HeaderMap,
    key: Option<&KeyPolicy>,
) -> Result<Option<&'h str>, String> {
    if key.is_some_and(|k| k.tenant.is_some()) {
        return Ok(None);
    }
    let Some(v) = headers.get(X_TENANT) else {
        return Ok(None);
    };
    let name = v.to_str().map_err(|_| {
        format!("invalid {X_TENANT}: a tenant name is letters, digits and - _ . : @")
    })?;
    check_tenant(name).map_err(|e| format!("invalid {X_TENANT} {name:?}: {e}"))?;
    Ok(Some(name))
}

/// Who sent a request and how urgent it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Who {
    pub tenant: Arc<str>,
    pub priority: Priority,
}

impl Who {
    /// From the key's policy (`None`: no keys configured, the headers are trusted) and the
    /// headers: the key's tenant, else `x-prefix-router-tenant`, else `default`; the priority
    /// header (else the variant's `default_priority`) capped by the key's priority (`standard`
    /// for a key that names none). Errors name the header and its value.
    pub fn of(
        headers: &HeaderMap,
        key: Option<&KeyPolicy>,
        default_priority: Priority,
    ) -> Result<Who, String> {
        let priority = Priority::of(headers, key, default_priority)?;
        let tenant = match (
            key.and_then(|k| k.tenant.clone()),
            tenant_header(headers, key)?,
        ) {
            (Some(t), _) => t,
            (None, Some(name)) => name.into(),
            (None, None) => Arc::from("default"),
        };
        Ok(Who { tenant, priority })
    }
}

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

impl FlowControl {
    pub fn new(config: &Config) -> Self {
        FlowControl {
            enabled: config.flow_control == Switch::On,
            instance_max_in_flight: config.instance_max_in_flight,
            queue_timeout: Duration::from_millis(config.queue_timeout_ms),
            max_queued: usize::try_from(config.max_queued).unwrap_or(usize::MAX),
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
        if priority != Priority::Sheddable {
            return true;
        }
        let places = v.instances().len() as u64 * self.variant_limit(v, Priority::Critical);
        v.load().outstanding() < places - places / 4
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

/// What a waiter is told.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Grant {
    /// A place freed (on the instance of this [`instance_id`]; 0: any): try again.
    Go(usize),
    /// Leave: a more urgent request took the place.
    Shed,
}

struct Waiter {
    id: u64,
    wake: oneshot::Sender<Grant>,
    /// The [`instance_id`] of the instance its placement chose.
    home: usize,
    /// Until then a place on its home goes to it before one elsewhere (PREFIX_AWARE affinity);
    /// `None`: any place, in turn.
    patient_until: Option<Instant>,
}

impl Waiter {
    /// Whether it takes a place freed on `freed` (0: any instance) at `now`.
    fn takes(&self, freed: usize, now: Instant) -> bool {
        freed == 0 || self.home == freed || self.patient_until.is_none_or(|t| now >= t)
    }
}

/// Which instance a place freed on, as waiters name their home: the address of its state (the
/// same `Arc` across tables that keep the instance; never 0).
pub fn instance_id(state: &Arc<crate::load::InstanceState>) -> usize {
    Arc::as_ptr(state) as usize
}

/// The share of its wait during which a PREFIX_AWARE request lets other waiters take places freed
/// away from its own instance (whose cache has its prefix) first.
pub const PATIENCE_SHARE: f64 = 0.25;

struct TenantQueue {
    tenant: Arc<str>,
    waiters: VecDeque<Waiter>,
}

#[derive(Default)]
struct Waiting {
    /// Per priority (index: `Priority as usize`), the tenants with waiters in round-robin order.
    classes: [VecDeque<TenantQueue>; 3],
    next_id: u64,
}

impl Waiting {
    fn push(&mut self, who: &Who, waiter: Waiter, front: bool) {
        let class = &mut self.classes[who.priority as usize];
        match class.iter().position(|t| t.tenant == who.tenant) {
            Some(i) if front => {
                let mut t = class.remove(i).expect("a tenant at its position");
                t.waiters.push_front(waiter);
                class.push_front(t);
            }
            Some(i) => class[i].waiters.push_back(waiter),
            None => {
                let t = TenantQueue {
                    tenant: who.tenant.clone(),
                    waiters: VecDeque::from([waiter]),
                };
                if front {
                    class.push_front(t)
                } else {
                    class.push_back(t)
                }
            }
        }
    }

    /// The next waiter: the most urgent class, its next tenant in turn.
    fn pop(&mut self) -> Option<Waiter> {
        for p in Priority::ALL {
            let class = &mut self.classes[p as usize];
            while let Some(mut t) = class.pop_front() {
                if let Some(w) = t.waiters.pop_front() {
                    if !t.waiters.is_empty() {
                        class.push_back(t);
                    }
                    return Some(w);
                }
            }
        }
        None
    }

    /// The next waiter, in [`Waiting::pop`]'s order, that takes a place freed on `freed` at
    /// `now`: waiters holding out for other instances keep their turn.
    fn pop_for(&mut self, freed: usize, now: Instant) -> Option<Waiter> {
        for p in Priority::ALL {
            let class = &mut self.classes[p as usize];
            let found = class.iter().enumerate().find_map(|(i, t)| {
                let j = t.waiters.iter().position(|w| w.takes(freed, now))?;
                Some((i, j))
            });
            if let Some((i, j)) = found {
                let mut t = class.remove(i).expect("a tenant at its position");
                let w = t.waiters.remove(j).expect("a waiter at its position");
                if !t.waiters.is_empty() {
                    class.push_back(t);
                }
                return Some(w);
            }
        }
        None
    }

    /// The youngest waiter of the least urgent class below `above` that has any.
    fn pop_less_urgent(&mut self, above: Priority) -> Option<Waiter> {
        let p = (Priority::Sheddable as usize..above as usize)
            .find(|&p| !self.classes[p].is_empty())?;
        let class = &mut self.classes[p];
        let (i, _) = class
            .iter()
            .enumerate()
            .filter_map(|(i, t)| t.waiters.back().map(|w| (i, w.id)))
            .max_by_key(|&(_, id)| id)?;
        take_youngest(class, i)
    }

    /// When the queue is full for `who` and no less urgent request waits: the youngest waiter
    /// of the tenant with the most waiting in `who`'s class, if that tenant has at least two
    /// more waiting than `who`'s own (a flood does not keep a quieter tenant out of a full queue).
    fn pop_from_busiest(&mut self, who: &Who) -> Option<Waiter> {
        let p = who.priority as usize;
        let own = self.classes[p]
            .iter()
            .find(|t| t.tenant == who.tenant)
            .map_or(0, |t| t.waiters.len());
        let (i, len) = self.classes[p]
            .iter()
            .enumerate()
            .map(|(i, t)| (i, t.waiters.len()))
            .max_by_key(|&(_, len)| len)?;
        let class = &mut self.classes[p];
        if class[i].tenant == who.tenant || len < own + 2 {
            return None;
        }
        take_youngest(class, i)
    }

    fn remove(&mut self, who: &Who, id: u64) -> bool {
        let class = &mut self.classes[who.priority as usize];
        let Some(i) = class.iter().position(|t| t.tenant == who.tenant) else {
            return false;
        };
        let Some(j) = class[i].waiters.iter().position(|w| w.id == id) else {
            return false;
        };
        class[i].waiters.remove(j);
        if class[i].waiters.is_empty() {
            class.remove(i);
        }
        true
    }
}

/// The youngest waiter of the `i`th tenant of `class`; a tenant left with none leaves the ring.
fn take_youngest(class: &mut VecDeque<TenantQueue>, i: usize) -> Option<Waiter> {
    let w = class[i].waiters.pop_back();
    if class[i].waiters.is_empty() {
        class.remove(i);
    }
    w
}

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

/// A variant's waiting requests (kept in its [`VariantLoad`], so that it outlives table
/// changes that keep the variant).
#[derive(Default)]
pub struct Queue {
    /// Waiters in `waiting` (read without the lock on every request).
    len: AtomicUsize,
    waiting: Mutex<Waiting>,
}

impl std::fmt::Debug for Queue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Queue")
            .field("len", &self.len.load(Relaxed))
            .finish()
    }
}

impl Queue {
    /// Whether anyone waits.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len.load(Relaxed) == 0
    }

    /// Waiters now.
    pub fn len(&self) -> usize {
        self.len.load(Relaxed)
    }

    /// Waiters now by priority (index: `Priority as usize`).
    pub fn depths(&self) -> [u32; 3] {
        if self.is_empty() {
            return [0; 3];
        }
        let waiting = self.lock();
        waiting.classes.each_ref().map(|class| {
            let n: usize = class.iter().map(|t| t.waiters.len()).sum();
            u32::try_from(n).unwrap_or(u32::MAX)
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Waiting> {
        self.waiting.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A place freed on the instance of [`instance_id`] `freed` (0: some instance): the next
    /// waiter that takes it (see [`Waiter::takes`]), else the next waiter, may.
    pub fn release(&self, freed: usize) {
        if self.is_empty() {
            return;
        }
        let now = Instant::now();
        let mut waiting = self.lock();
        // the next waiter that takes it, else the next one: no place stays idle while any wait
        while let Some(w) = waiting.pop_for(freed, now).or_else(|| waiting.pop()) {
            self.len.fetch_sub(1, Relaxed);
            if w.wake.send(Grant::Go(freed)).is_ok() {
                return;
            }
        }
    }

    /// Wakes every waiter (its variant is gone from the table: see
    /// [`FlowControl::table_changed`]).
    fn release_all(&self) {
        let woken: Vec<Waiter> = {
            let mut waiting = self.lock();
            std::iter::from_fn(|| waiting.pop()).collect()
        };
        self.len.fetch_sub(woken.len(), Relaxed);
        for w in woken {
            let _ = w.wake.send(Grant::Go(0));
        }
    }
}

/// Where a waiter would rather go: a place freed on `instance` ([`instance_id`]) goes to it before
/// the waiters ahead of it until `patient_until` (PREFIX_AWARE affinity; `None`: none).
#[derive(Debug, Clone, Copy)]
pub struct Home {
    pub instance: usize,
    pub patient_until: Option<Instant>,
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
        let queue = load.flow();
        let mut waiting = queue.lock();
        if flow.queued.fetch_add(1, Relaxed) >= flow.max_queued {
            let shed = waiting
                .pop_less_urgent(who.priority)
                .or_else(|| waiting.pop_from_busiest(who));
            match shed {
                Some(w) => {
                    // its ticket counts itself out when it reads the grant
                    queue.len.fetch_sub(1, Relaxed);
                    let _ = w.wake.send(Grant::Shed);
                }
                None => {
                    flow.queued.fetch_sub(1, Relaxed);
                    return Err(Refused::Full);
                }
            }
        }
        let (tx, rx) = oneshot::channel();
        let id = waiting.next_id;
        waiting.next_id += 1;
        let waiter = Waiter {
            id,
            wake: tx,
            home: home.instance,
            patient_until: home.patient_until,
        };
        waiting.push(who, waiter, front);
        queue.len.fetch_add(1, Relaxed);
        drop(waiting);
        metrics.queued(who.priority, series);
        Ok(Ticket {
            flow,
            metrics,
            load: load.clone(),
            who: who.clone(),
            series,
            id,
            wake: rx,
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
        let removed = {
            let mut waiting = queue.lock();
            let removed = waiting.remove(&self.who, self.id);
            if removed {
                queue.len.fetch_sub(1, Relaxed);
            }
            removed
        };
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

#[cfg(test)]
mod tests {
    use super::*;

    impl Waiter {
        /// A waiter that takes any place.
        fn any(id: u64, wake: oneshot::Sender<Grant>) -> Self {
            Waiter {
                id,
                wake,
                home: 0,
                patient_until: None,
            }
        }
    }

    #[test]
    fn a_place_goes_first_to_a_waiter_whose_home_it_is_or_who_holds_out_no_longer() {
        let mut w = Waiting::default();
        let now = Instant::now();
        let later = Some(now + Duration::from_secs(60));
        let chat = who("chat", Priority::Standard);
        // ids 0-2 hold out for homes 10, 20 and 10; id 3 held out until just now
        for (id, home, until) in [
            (0, 10, later),
            (1, 20, later),
            (2, 10, later),
            (3, 30, Some(now)),
        ] {
            let (tx, _rx) = oneshot::channel();
            let waiter = Waiter {
                id,
                wake: tx,
                home,
                patient_until: until,
            };
            w.push(&chat, waiter, false);
        }
        let id = |w: Option<Waiter>| w.map(|w| w.id);
        assert_eq!(
            id(w.pop_for(20, now)),
            Some(1),
            "the one whose home it is, queued second"
        );
        assert_eq!(
            id(w.pop_for(40, now)),
            Some(3),
            "the one that holds out no longer"
        );
        assert_eq!(id(w.pop_for(40, now)), None, "the others hold out");
        assert_eq!(
            id(w.pop_for(0, now)),
            Some(0),
            "a place on any instance: in turn"
        );
        assert_eq!(id(w.pop()), Some(2));
    }

    fn who(tenant: &str, p: Priority) -> Who {
        Who {
            tenant: tenant.into(),
            priority: p,
        }
    }

    #[test]
    fn the_most_urgent_class_goes_first_and_tenants_take_turns() {
        let mut w = Waiting::default();
        let mut rx = Vec::new();
        let mut push = |w: &mut Waiting, who: &Who, id: u64| {
            let (tx, r) = oneshot::channel();
            w.push(who, Waiter::any(id, tx), false);
            rx.push(r);
        };
        let (a, b) = (who("a", Priority::Standard), who("b", Priority::Standard));
        for id in 0..4 {
            push(&mut w, &a, id); // a floods first
        }
        push(&mut w, &b, 10);
        push(&mut w, &b, 11);
        push(&mut w, &who("batch", Priority::Sheddable), 20);
        push(&mut w, &who("chat", Priority::Critical), 30);
        let order: Vec<u64> = std::iter::from_fn(|| w.pop().map(|x| x.id)).collect();
        assert_eq!(order, [30, 0, 10, 1, 11, 2, 3, 20]);
    }

    #[test]
    fn a_shed_takes_the_youngest_sheddable_and_removal_finds_its_waiter() {
        let mut w = Waiting::default();
        let s1 = who("s1", Priority::Sheddable);
        let s2 = who("s2", Priority::Sheddable);
        for (who, id) in [(&s1, 1), (&s2, 2), (&s1, 3)] {
            let (tx, _) = oneshot::channel();
            w.push(who, Waiter::any(id, tx), false);
        }
        assert_eq!(w.pop_less_urgent(Priority::Standard).map(|x| x.id), Some(3));
        assert!(
            w.pop_less_urgent(Priority::Sheddable).is_none(),
            "nothing below sheddable"
        );
        assert!(w.remove(&s2, 2));
        assert!(!w.remove(&s2, 2));
        assert_eq!(w.pop().map(|x| x.id), Some(1));
        assert!(w.pop().is_none());
    }

    #[test]
    fn a_full_queue_gives_a_quiet_tenant_the_place_of_the_floods_youngest() {
        let mut w = Waiting::default();
        let flood = who("flood", Priority::Standard);
        for id in 0..3 {
            let (tx, _) = oneshot::channel();
            w.push(&flood, Waiter::any(id, tx), false);
        }
        let quiet = who("quiet", Priority::Standard);
        assert_eq!(w.pop_from_busiest(&quiet).map(|x| x.id), Some(2));
        // the flood's own requests do not displace each other
        assert!(w.pop_from_busiest(&flood).is_none());
        let (tx, _) = oneshot::channel();
        w.push(&quiet, Waiter::any(5, tx), false);
        assert!(
            w.pop_from_busiest(&quiet).is_none(),
            "2 against 1: close enough"
        );
        // a more urgent class is never displaced by a less urgent one
        for id in 10..14 {
            let (tx, _) = oneshot::channel();
            w.push(&who("vip", Priority::Critical), Waiter::any(id, tx), false);
        }
        assert!(w
            .pop_from_busiest(&who("other", Priority::Sheddable))
            .is_none());
        assert_eq!(
            w.pop_from_busiest(&who("boss", Priority::Critical))
                .map(|x| x.id),
            Some(13)
        );
    }

    #[test]
    fn key_lines_name_tenant_and_priority_and_bad_fields_are_named() {
        assert_eq!(KeyPolicy::parse(None).unwrap(), KeyPolicy::default());
        let p = KeyPolicy::parse(Some("tenant=chat priority=critical")).unwrap();
        assert_eq!(p.tenant.as_deref(), Some("chat"));
        assert_eq!(p.priority, Some(Priority::Critical));
        let e = KeyPolicy::parse(Some("priority=urgent")).unwrap_err();
        assert!(e.contains("priority=\"urgent\""), "{e}");
        let e = KeyPolicy::parse(Some("tenant=a/b")).unwrap_err();
        assert!(e.contains("tenant=\"a/b\""), "{e}");
        let e = KeyPolicy::parse(Some("burst")).unwrap_err();
        assert!(e.contains("\"burst\""), "{e}");
    }

    #[test]
    fn a_key_caps_the_priority_its_holder_asks_for() {
        let mut h = HeaderMap::new();
        h.insert(X_PRIORITY, HeaderValue::from_static("critical"));
        h.insert(X_TENANT, HeaderValue::from_static("spoofed"));
        // no keys: the headers are trusted
        assert_eq!(
            Who::of(&h, None, Priority::Standard).unwrap(),
            who("spoofed", Priority::Critical)
        );
        // a key without a priority may ask for standard at most; its tenant wins
        let key = KeyPolicy::parse(Some("tenant=batch")).unwrap();
        assert_eq!(
            Who::of(&h, Some(&key), Priority::Standard).unwrap(),
            who("batch", Priority::Standard)
        );
        let key = KeyPolicy::parse(Some("priority=critical")).unwrap();
        assert_eq!(
            Who::of(&h, Some(&key), Priority::Standard).unwrap(),
            who("spoofed", Priority::Critical)
        );
        h.insert(X_PRIORITY, HeaderValue::from_static("sheddable"));
        assert_eq!(
            Who::of(&h, Some(&key), Priority::Standard)
                .unwrap()
                .priority,
            Priority::Sheddable
        );
        h.insert(X_PRIORITY, HeaderValue::from_static("high"));
        let e = Who::of(&h, None, Priority::Standard).unwrap_err();
        assert!(e.contains("x-prefix-router-priority \"high\""), "{e}");
        assert_eq!(
            Who::of(&HeaderMap::new(), None, Priority::Standard).unwrap(),
            who("default", Priority::Standard)
        );
        // a request that names no priority has its variant's default, capped by its key's
        let none = HeaderMap::new();
        assert_eq!(
            Who::of(&none, None, Priority::Sheddable).unwrap().priority,
            Priority::Sheddable
        );
        let plain = KeyPolicy::parse(Some("tenant=chat")).unwrap();
        assert_eq!(
            Who::of(&none, Some(&plain), Priority::Critical)
                .unwrap()
                .priority,
            Priority::Standard
        );
        assert_eq!(
            Who::of(&none, Some(&key), Priority::Critical)
                .unwrap()
                .priority,
            Priority::Critical
        );
    }
}
